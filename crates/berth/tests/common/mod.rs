//! Black-box harness: starts the real `berth` binary on a free loopback port with a
//! temporary state dir and small fixed totals, and talks to it over HTTP.
#![allow(dead_code)]

pub mod fleet;

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

pub const BERTH: &str = env!("CARGO_BIN_EXE_berth");

/// A `--port-range` of `n` ports for runs, at `offset` in this test binary's block of
/// 300 in 26000-31999: below the kernel's ephemeral range (an outgoing connection
/// never takes one of them), apart from test daemons' own ports, and apart from the
/// ranges of the binary's other tests (by `offset`).
#[allow(dead_code)] // Not every test binary gives runs ports.
pub fn run_ports(offset: u16, n: u16) -> (u16, u16) {
    assert!(offset + n <= 300, "a test binary's block is 300 ports");
    let lo = 26_000 + (std::process::id() % 20) as u16 * 300 + offset;
    (lo, lo + n - 1)
}

/// A port for a test daemon, free now and below the kernel's ephemeral range
/// (`ip_local_port_range`, 32768 and up by default). A port from `bind(:0)` came from
/// that range, and while its daemon was starting or down for a restart, an outgoing
/// connection of another test could take it ("Address already in use"). Each test
/// binary (one runs at a time) counts through its own block of 100 ports, in
/// 20000-25999; 26000-32767 is for the port ranges runs get (`run_ports`).
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU16, Ordering};
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let base = 20_000 + (std::process::id() % 60) as u16 * 100;
    for _ in 0..100 {
        let port = base + NEXT.fetch_add(1, Ordering::Relaxed) % 100;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {base}..{}", base + 100)
}

pub struct Daemon {
    pub child: Option<Child>,
    pub state: PathBuf,
    pub port: u16,
    pub url: String,
    pub token: String,
    pub args: Vec<String>,
    /// Extra environment for the next spawn (e.g. `BERTH_FAILPOINT`).
    pub env: Vec<(String, String)>,
    /// The binary started, and the user (uid = gid) it runs as if not ours.
    pub bin: PathBuf,
    pub uid: Option<u32>,
    /// The daemon's descriptor limit (soft and hard), if not the test's own.
    pub nofile: Option<u64>,
    /// What the daemon wrote on stderr, every start appended: shown when a test times
    /// out or a wait fails.
    pub log: PathBuf,
    /// The test's watchdog (see `Watchdog`).
    watchdog: Watchdog,
    _log_dir: tempfile::TempDir,
    _dir: Option<tempfile::TempDir>,
}

/// Every end-to-end test has a deadline: a daemon that hangs (or a test waiting on one)
/// fails the test binary with the test's name and the daemon's log instead of hanging
/// the suite. `BERTH_TEST_TIMEOUT_S` sets it (default `TEST_TIMEOUT_S_DEFAULT`).
pub const TEST_TIMEOUT_S_DEFAULT: u64 = 240;

struct Watchdog {
    done: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Watchdog {
    /// Started when the daemon is prepared, in the test's own thread (named after it).
    fn start(log: PathBuf) -> Watchdog {
        use std::sync::atomic::Ordering;
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let test = std::thread::current()
            .name()
            .unwrap_or("a test")
            .to_string();
        let timeout_s = std::env::var("BERTH_TEST_TIMEOUT_S")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(TEST_TIMEOUT_S_DEFAULT);
        let flag = done.clone();
        std::thread::spawn(move || {
            let end = Instant::now() + Duration::from_secs(timeout_s);
            while Instant::now() < end {
                if flag.load(Ordering::Relaxed) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            // Straight to the descriptor (the harness captures `eprintln!`), then out:
            // the whole binary fails, and every daemon it started dies with it
            // (`PR_SET_PDEATHSIG`).
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "\n{test}: timed out after {timeout_s} s (BERTH_TEST_TIMEOUT_S); the daemon logged:\n{}",
                log_tail(&log)
            );
            std::process::exit(101);
        });
        Watchdog { done }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.done.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The last 8 KiB of a daemon log.
pub fn log_tail(log: &Path) -> String {
    let bytes = std::fs::read(log).unwrap_or_default();
    let from = bytes.len().saturating_sub(8 << 10);
    String::from_utf8_lossy(&bytes[from..]).into_owned()
}

pub struct Resp {
    pub status: u16,
    pub body: Value,
}

impl Resp {
    pub fn code(&self) -> &str {
        self.body["error"]["code"].as_str().unwrap_or("")
    }
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(60)))
        .build()
        .into()
}

impl Daemon {
    /// Small fixed totals: slots, 8 GiB memory (1 GiB reserve), 4 cpus (1 reserved),
    /// 100 GiB disk, no memory sampling (see `start_sampling_memory`).
    pub fn start(extra: &[&str]) -> Daemon {
        let mut d = Daemon::unstarted(extra);
        d.spawn();
        d
    }

    /// Like `start`, but sampling the host's real MemAvailable (A2).
    pub fn start_sampling_memory(extra: &[&str]) -> Daemon {
        let mut d = Daemon::unstarted(extra);
        d.args.retain(|a| a != "--no-memory-sampling");
        d.spawn();
        d
    }

    /// Like `start_in`, but sampling the host (MemAvailable, pressure, free disk).
    pub fn start_sampling_in(state: &Path, extra: &[&str]) -> Daemon {
        let mut d = Daemon::prepare(state, free_port(), extra);
        d.args.retain(|a| a != "--no-memory-sampling");
        d.spawn();
        d
    }

    /// Prepared on a temporary state dir, not started yet (set `env`, `nofile`, …).
    pub fn unstarted(extra: &[&str]) -> Daemon {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().to_path_buf();
        let mut d = Daemon::prepare(&state, free_port(), extra);
        d._dir = Some(dir);
        d
    }

    /// Starts `berth serve` with this daemon's arguments plus `more`, expecting it to
    /// refuse to start: returns its exit status and what it printed.
    pub fn start_fails(&self, more: &[&str]) -> (std::process::ExitStatus, String) {
        // Output to a file, and a deadline: a daemon that starts after all (the bug)
        // fails the test instead of hanging it.
        let log = tempfile::NamedTempFile::new().unwrap();
        let mut child = Command::new(&self.bin)
            .args(&self.args)
            .args(more)
            .env("BERTH_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(log.reopen().unwrap())
            .stderr(log.reopen().unwrap())
            .spawn()
            .expect("run berth serve");
        let end = Instant::now() + Duration::from_secs(15);
        let status = loop {
            if let Some(st) = child.try_wait().unwrap() {
                break st;
            }
            if Instant::now() > end {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "berth serve {more:?} was expected to refuse to start but is serving: {}",
                    std::fs::read_to_string(log.path()).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        (
            status,
            std::fs::read_to_string(log.path()).unwrap_or_default(),
        )
    }

    /// S5: a second `berth serve` on this daemon's state dir (on another port) refuses
    /// to start, naming this one's pid; this one goes on serving.
    pub fn assert_a_second_daemon_is_refused(&mut self) {
        let first = self.args.clone();
        let i = self.args.iter().position(|a| a == "--listen").unwrap();
        self.args[i + 1] = format!("127.0.0.1:{}", free_port());
        let (status, text) = self.start_fails(&[]);
        self.args = first;
        assert!(!status.success(), "{text}");
        let pid = self.child.as_ref().unwrap().id();
        assert!(
            text.contains(&format!("in use by another berth serve (pid {pid})")),
            "{text}"
        );
        assert_eq!(self.get("/v1/status").status, 200);
    }

    /// The daemon as user `uid` (needs root): a copy of the binary any user may run,
    /// and a state dir that user owns.
    pub fn start_as(uid: u32, extra: &[&str]) -> Daemon {
        use std::os::unix::fs::{chown, PermissionsExt};
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let bin = dir.path().join("berth");
        std::fs::copy(BERTH, &bin).unwrap();
        let state = dir.path().join("state");
        std::fs::create_dir(&state).unwrap();
        chown(&state, Some(uid), Some(uid)).unwrap();
        let mut d = Daemon::prepare(&state, free_port(), extra);
        d.bin = bin;
        d.uid = Some(uid);
        d._dir = Some(dir);
        d.spawn();
        d
    }

    pub fn start_in(state: &Path, port: u16, extra: &[&str]) -> Daemon {
        let mut d = Daemon::prepare(state, port, extra);
        d.spawn();
        d
    }

    fn prepare(state: &Path, port: u16, extra: &[&str]) -> Daemon {
        let defaults = [
            ("--memory-total", "8GiB"),
            ("--memory-reserve", "1GiB"),
            ("--cpu-total", "4"),
            ("--disk-total", "100GiB"),
            ("--disk-reserve", "0"),
            // Threads' disk-pressure sweep off: no test may depend on how full the
            // machine's disk is (the one that tests it sets its own).
            ("--thread-disk-free-min", "0"),
        ];
        let mut args: Vec<String> = vec![
            "serve".into(),
            "--state-dir".into(),
            state.display().to_string(),
            "--listen".into(),
            format!("127.0.0.1:{port}"),
            "--no-memory-sampling".into(),
        ];
        for (flag, value) in defaults {
            if !extra.contains(&flag) {
                args.push(flag.into());
                args.push(value.into());
            }
        }
        // Each daemon its own: the default (/var/lib/berth-users) is one per host.
        if !extra.contains(&"--user-workspaces") {
            args.push("--user-workspaces".into());
            args.push(state.join("users").display().to_string());
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        let log_dir = tempfile::tempdir().unwrap();
        let log = log_dir.path().join("daemon.log");
        Daemon {
            watchdog: Watchdog::start(log.clone()),
            log,
            _log_dir: log_dir,
            child: None,
            state: state.to_path_buf(),
            port,
            url: format!("http://127.0.0.1:{port}"),
            token: String::new(),
            args,
            env: Vec::new(),
            bin: PathBuf::from(BERTH),
            uid: None,
            nofile: None,
            _dir: None,
        }
    }

    pub fn spawn(&mut self) {
        let mut cmd = Command::new(&self.bin);
        {
            use std::os::unix::process::CommandExt;
            // SAFETY: prctl is async-signal-safe; nothing else runs in the child. The
            // daemon dies with the test's thread: a test binary that exits (a timeout)
            // or is killed leaves no daemon serving.
            unsafe {
                cmd.pre_exec(|| {
                    rustix::process::set_parent_process_death_signal(Some(
                        rustix::process::Signal::KILL,
                    ))
                    .map_err(std::io::Error::from)
                });
            }
        }
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("open the daemon log");
        if let Some(uid) = self.uid {
            use std::os::unix::process::CommandExt;
            cmd.uid(uid).gid(uid);
        }
        if let Some(n) = self.nofile {
            use std::os::unix::process::CommandExt;
            // SAFETY: setrlimit is async-signal-safe; nothing else runs in the child.
            unsafe {
                cmd.pre_exec(move || {
                    let lim = rustix::process::Rlimit {
                        current: Some(n),
                        maximum: Some(n),
                    };
                    rustix::process::setrlimit(rustix::process::Resource::Nofile, lim)
                        .map_err(std::io::Error::from)
                });
            }
        }
        let mut child = cmd
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .env("BERTH_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("start berth serve");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(
            line.starts_with("listening on"),
            "berth serve said {line:?}; it logged:\n{}",
            log_tail(&self.log)
        );
        self.token = std::fs::read_to_string(self.state.join("admin.token"))
            .map(|t| t.trim().to_string())
            .unwrap_or_default();
        self.child = Some(child);
    }

    /// kill -9, then start again on the same state dir and port.
    pub fn kill9_and_restart(&mut self) {
        self.kill9();
        self.spawn();
    }

    /// Waits for the daemon to exit by itself (a failpoint), up to `within`.
    pub fn wait_exit(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let end = Instant::now() + within;
        while Instant::now() < end {
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(st)) = c.try_wait() {
                    self.child = None;
                    return Some(st);
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill().unwrap();
            c.wait().unwrap();
        }
    }

    pub fn call_as(
        &self,
        token: Option<&str>,
        method: &str,
        path: &str,
        body: Option<&str>,
    ) -> Resp {
        let url = format!("{}{}", self.url, path);
        let a = agent();
        let auth = token.map(|t| format!("Bearer {t}"));
        let resp = match method {
            "GET" => {
                let mut r = a.get(&url);
                if let Some(h) = &auth {
                    r = r.header("Authorization", h);
                }
                r.call()
            }
            "DELETE" => {
                let mut r = a.delete(&url);
                if let Some(h) = &auth {
                    r = r.header("Authorization", h);
                }
                r.call()
            }
            m => {
                let mut r = match m {
                    "PUT" => a.put(&url),
                    "PATCH" => a.patch(&url),
                    _ => a.post(&url),
                }
                .header("Content-Type", "application/json");
                if let Some(h) = &auth {
                    r = r.header("Authorization", h);
                }
                r.send(body.unwrap_or("").as_bytes())
            }
        }
        .unwrap_or_else(|e| {
            panic!(
                "{method} {path}: the daemon did not answer ({e}); it logged:\n{}",
                log_tail(&self.log)
            )
        });
        let status = resp.status().as_u16();
        let text = resp.into_body().read_to_string().unwrap_or_default();
        Resp {
            status,
            body: serde_json::from_str(&text).unwrap_or(Value::String(text)),
        }
    }

    pub fn call(&self, method: &str, path: &str, body: Option<&str>) -> Resp {
        self.call_as(Some(&self.token.clone()), method, path, body)
    }

    pub fn get(&self, path: &str) -> Resp {
        self.call("GET", path, None)
    }

    pub fn post(&self, path: &str, body: &str) -> Resp {
        self.call("POST", path, Some(body))
    }

    /// The whole journal (`GET /v1/journal`, ndjson), page by page.
    pub fn journal(&self) -> Vec<Value> {
        let mut all: Vec<Value> = Vec::new();
        loop {
            let after = all.last().map_or(0, |e| e["seq"].as_u64().unwrap());
            let r = self.get(&format!("/v1/journal?after={after}"));
            assert_eq!(r.status, 200, "journal: {:?}", r.body);
            // A page of one line parses as that line; several stay text (see call_as).
            let page: Vec<Value> = match r.body {
                Value::String(text) => text
                    .lines()
                    .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
                    .collect(),
                one => vec![one],
            };
            if page.is_empty() {
                return all;
            }
            all.extend(page);
        }
    }

    /// `berth` CLI command pointed at this daemon.
    pub fn cli(&self) -> Command {
        let mut c = Command::new(BERTH);
        c.env("BERTH_URL", &self.url)
            .env("BERTH_TOKEN", &self.token);
        c
    }

    pub fn wait_until(&self, what: &str, mut f: impl FnMut(&Daemon) -> bool) {
        let end = Instant::now() + Duration::from_secs(20);
        while Instant::now() < end {
            if f(self) {
                // Met only after the deadline (one call blocked past it) is late too.
                assert!(
                    Instant::now() <= end,
                    "{what}: only after the 20 s deadline; the daemon logged:\n{}",
                    log_tail(&self.log)
                );
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!(
            "timed out waiting until {what}; the daemon logged:\n{}",
            log_tail(&self.log)
        );
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill9();
        self.kill_its_runs_processes();
    }
}

impl Daemon {
    /// Kills what this daemon's runs left running (the daemon was killed, so nothing
    /// stopped them): every process whose environment names this daemon's URL. A
    /// runtime's server left behind held its port into later tests and later runs.
    fn kill_its_runs_processes(&self) {
        let mark = format!("BERTH_URL={}", self.url);
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return;
        };
        for e in dir.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
                continue;
            };
            let env = std::fs::read(e.path().join("environ")).unwrap_or_default();
            if env.split(|&b| b == 0).any(|v| v == mark.as_bytes()) {
                if let Some(pid) = rustix::process::Pid::from_raw(pid) {
                    // One that is gone by now is no matter.
                    let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
                }
            }
        }
    }
}

/// Is `pid` a live (non-zombie) process?
pub fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            s.rsplit(')')
                .next()
                .and_then(|r| r.split_whitespace().next())
                != Some("Z")
        })
        .unwrap_or(false)
}

/// Runs `script` in bash as a reader of the README would: in `dir` (also HOME), with
/// this build's berth first on PATH, a daemon of the test's own at `port`
/// (BERTH_LISTEN, BERTH_URL) and its state in `state_dir` (else HOME's default). The
/// script's process group (the daemon it starts included) is ended afterwards.
/// Whether it finished within `within`, and what it printed.
pub fn run_as_reader(
    script: &str,
    dir: &Path,
    port: u16,
    state_dir: Option<&Path>,
    within: Duration,
) -> (bool, std::process::Output) {
    use std::os::unix::process::CommandExt;
    let bin_dir = Path::new(BERTH).parent().unwrap();
    let mut cmd = Command::new("bash");
    cmd.arg("-c")
        .arg(script)
        .current_dir(dir)
        .env("PATH", format!("{}:/usr/bin:/bin", bin_dir.display()))
        .env("HOME", dir)
        .env_remove("XDG_STATE_HOME")
        .env_remove("BERTH_STATE_DIR")
        .env_remove("BERTH_TOKEN")
        .env("BERTH_LISTEN", format!("127.0.0.1:{port}"))
        .env("BERTH_URL", format!("http://127.0.0.1:{port}"))
        // The README's runs take the default claims (10 GiB of disk among them); whether
        // they fit must not hang on how full the test host's disk or memory is at the
        // moment (a CI clone building beside it left 18 GiB free, under claim + reserve,
        // and the tour's first run waited out the test).
        .env("BERTH_NO_MEMORY_SAMPLING", "true")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    if let Some(state) = state_dir {
        cmd.env("BERTH_STATE_DIR", state);
    }
    let mut child = cmd.spawn().unwrap();
    let pgid = child.id() as i32;
    let ended = killed_within(&mut child, within);
    let _ = rustix::process::kill_process_group(
        rustix::process::Pid::from_raw(pgid).unwrap(),
        rustix::process::Signal::TERM,
    );
    (ended, child.wait_with_output().unwrap())
}

/// Did berth end `child` within `within`? Polled, never `wait()`ed: a tree that
/// outlives the test by far (`sleep 3600`) must be proven killed, not waited out.
/// The child is reaped either way (killed first if it still runs).
pub fn killed_within(child: &mut Child, within: Duration) -> bool {
    let end = Instant::now() + within;
    let gone = loop {
        if let Ok(Some(_)) = child.try_wait() {
            break true;
        }
        if Instant::now() > end {
            break false;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    if !gone {
        let _ = child.kill();
        let _ = child.wait();
    }
    gone
}

/// Waits (up to 10 s) until `path` lists at least `n` pids, one per line.
pub fn wait_pids(path: &Path, n: usize) -> Vec<i32> {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let v: Vec<i32> = std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect();
        if v.len() >= n || Instant::now() > end {
            return v;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts a long-poll acquire on a raw socket and returns the socket (kept open).
pub fn long_poll(d: &Daemon, body: &Value) -> std::net::TcpStream {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect(("127.0.0.1", d.port)).unwrap();
    let body = body.to_string();
    write!(
        s,
        "POST /v1/runs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        d.token,
        body.len()
    )
    .unwrap();
    s
}
