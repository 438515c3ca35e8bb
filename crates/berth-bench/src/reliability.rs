//! `berth-bench reliability`: the figures an operator asks for, from real runs.
//!
//! - **Daemon kill -9s.** A real daemon under load from clients that acquire, register
//!   processes, write logs and release. It is killed with SIGKILL at a random moment,
//!   or made to abort at each of its failpoints in turn (a `failpoints` build: see
//!   `scripts/reliability.sh`), then restarted on the same state dir. After every
//!   restart each acknowledged operation is checked against the ledger it left: an
//!   acknowledged grant must still hold its fence, an acknowledged release must have
//!   ended its run (else *lost*); no fence may be acknowledged twice, nor one below a
//!   fence acknowledged before the crash (else *repeated*). At the end everything is
//!   released and the daemon must hold no capacity (else *leaked*), and no process of an
//!   ended run may be alive.
//! - **Client kill -9s.** Real `berth run` processes are killed with SIGKILL once their
//!   command runs, or abort at the client's own failpoint (`spawn-before-register`):
//!   their runs must end when their lease lapses, their commands must be gone and their
//!   capacity back.
//! - **Strangers under forced pid reuse** (root): a run's process exits, and a stranger
//!   is started with the same pid and process group (`/proc/sys/kernel/ns_last_pid`);
//!   releasing the run must not signal it.
//!
//! The malformed-input and linearizability figures come from the fuzz and
//! linearizability test binaries, run by `scripts/reliability.sh` in their long form.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// The daemon's failpoints (crates/berth-server/src/failpoint.rs), crashed at in turn.
const DAEMON_POINTS: [&str; 5] = [
    "grant-committed",
    "mid-stop",
    "mid-archive",
    "archive-marked",
    "mid-workspace-removal",
];
/// How long an armed failpoint may take to be reached before the daemon is killed
/// with SIGKILL instead (counted as a plain kill).
const FAILPOINT_WAIT: Duration = Duration::from_secs(5);
/// Clients loading the daemon between two kills.
const LOAD_CLIENTS: usize = 4;
/// The lease `berth run` clients ask for: short, so a killed client's run lapses soon.
const CLIENT_TTL_S: u64 = 2;
/// Longer than two clock ticks of /proc's start times (see `strangers`).
const SAME_TICK_GAP: Duration = Duration::from_millis(30);
/// How long anything the checks wait for may take before it counts as a failure.
const SETTLE: Duration = Duration::from_secs(30);

/// A real `berth serve` on a state dir that outlives its restarts.
struct Daemon {
    bin: PathBuf,
    state: PathBuf,
    port: u16,
    token: String,
    /// Behind a lock: the crash is dealt while the load clients use the daemon.
    child: Mutex<Option<Child>>,
    agent: ureq::Agent,
}

impl Daemon {
    fn new(bin: &Path, state: &Path) -> Daemon {
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(10)))
            .build()
            .into();
        Daemon {
            bin: bin.to_path_buf(),
            state: state.to_path_buf(),
            port: crate::peers::free_port(),
            token: String::new(),
            child: Mutex::new(None),
            agent,
        }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Starts it with `env` added; waits until it serves.
    fn spawn(&mut self, env: &[(&str, String)]) {
        let mut child = Command::new(&self.bin)
            .arg("serve")
            .arg("--state-dir")
            .arg(&self.state)
            .args(["--listen", &format!("127.0.0.1:{}", self.port)])
            .args([
                "--slots-max",
                "64",
                "--memory-total",
                "64GiB",
                "--memory-reserve",
                "0",
            ])
            .args([
                "--cpu-total",
                "64",
                "--cpu-reserve",
                "0",
                "--disk-total",
                "1TiB",
            ])
            .args([
                "--disk-reserve",
                "0",
                "--no-memory-sampling",
                "--stop-grace",
                "1s",
            ])
            // Every run stays answerable: a missing acknowledged run is a loss, not pruning.
            .args(["--retain-ended", "1000000", "--thread-disk-free-min", "0"])
            .envs(env.iter().map(|(k, v)| (k, v)))
            .env("BERTH_LOG", "error")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start berth serve");
        let mut line = String::new();
        let out = child.stdout.take().unwrap();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(out), &mut line).unwrap();
        assert!(
            line.starts_with("listening on"),
            "berth serve said {line:?}"
        );
        self.token = std::fs::read_to_string(self.state.join("admin.token"))
            .unwrap()
            .trim()
            .to_string();
        *self.child.lock().unwrap() = Some(child);
    }

    fn kill9(&self) {
        if let Some(mut c) = self.child.lock().unwrap().take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Waits up to `within` for the daemon to exit by itself (a failpoint's abort).
    fn exited_within(&self, within: Duration) -> bool {
        let end = Instant::now() + within;
        while Instant::now() < end {
            let mut child = self.child.lock().unwrap();
            if let Some(Ok(Some(_))) = child.as_mut().map(|c| c.try_wait()) {
                *child = None;
                return true;
            }
            drop(child);
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    /// One request; (status, body), or None when the daemon did not answer.
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> Option<(u16, Value)> {
        let url = format!("{}{path}", self.url());
        let auth = format!("Bearer {}", self.token);
        let resp = match body {
            None if method == "GET" => self.agent.get(&url).header("Authorization", &auth).call(),
            None => self
                .agent
                .delete(&url)
                .header("Authorization", &auth)
                .call(),
            Some(b) => self
                .agent
                .post(&url)
                .header("Authorization", &auth)
                .header("Content-Type", "application/json")
                .send(b.to_string().as_bytes()),
        }
        .ok()?;
        let status = resp.status().as_u16();
        let text = resp.into_body().read_to_string().ok()?;
        Some((status, serde_json::from_str(&text).unwrap_or(Value::Null)))
    }

    fn get(&self, path: &str) -> Value {
        self.call("GET", path, None)
            .map(|r| r.1)
            .unwrap_or(Value::Null)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A process a client started for its run; `registered` once the daemon acknowledged
/// it (only then is it berth's to stop).
struct Registered {
    child: Child,
    registered: bool,
}

/// What the clients were told, by run id.
#[derive(Default)]
struct Book {
    /// Acknowledged grants: run id -> fence.
    granted: BTreeMap<String, u64>,
    /// Acknowledged releases.
    released: BTreeSet<String>,
    /// Every fence acknowledged, and the count of those acknowledged twice.
    fences: BTreeSet<u64>,
    repeated: u64,
    /// The highest fence acknowledged before the last crash: every later one is above.
    high_before_crash: u64,
    /// Processes the clients started for their runs (reaped at the end).
    children: Vec<Registered>,
    acknowledged_ops: u64,
}

impl Book {
    fn grant(&mut self, run: String, fence: u64) {
        self.acknowledged_ops += 1;
        if !self.fences.insert(fence) || fence <= self.high_before_crash {
            self.repeated += 1;
        }
        self.granted.insert(run, fence);
    }
}

/// One load client: lifecycles on project `p{c}` until `stop`.
fn load_client(d: &Daemon, cycle: usize, c: usize, stop: &AtomicBool, book: &Mutex<Book>) {
    let mut j = 0u64;
    while !stop.load(Ordering::Relaxed) {
        j += 1;
        let run = format!("k{cycle}-c{c}-{j}");
        // Analysis runs: no project key, so a run still being stopped does not hold
        // back its client's next one.
        let body = json!({"run_id": run, "project": format!("p{c}"), "class": "analysis",
            "ttl_s": 600, "wait_s": 0,
            "resources": {"cpu_millis": 1, "memory": 1 << 20, "disk": 0}});
        let r = match d.call("POST", "/v1/runs", Some(body)) {
            Some((201, r)) => r,
            // No room this moment (runs being stopped hold theirs): try again.
            Some(_) => {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            None => return, // the daemon is gone: this cycle's load is over
        };
        let fence = r["fence"].as_u64().unwrap_or(0);
        book.lock().unwrap().grant(run.clone(), fence);
        // Every other run has a process tree (one in four ignores SIGTERM, so a stop
        // reaches `mid-stop`), and logs to archive.
        if j.is_multiple_of(2) {
            if let Some(child) = register_child(d, &run, fence, j.is_multiple_of(4)) {
                book.lock().unwrap().children.push(child);
            }
        }
        if let Some(ws) = r["workspace"].as_str() {
            let _ = std::fs::write(Path::new(ws).join("logs/out.log"), vec![b'x'; 3000]);
        }
        let path = format!("/v1/runs/{run}/release");
        match d.call("POST", &path, Some(json!({"fence": fence}))) {
            Some((200, _)) => {
                let mut b = book.lock().unwrap();
                b.released.insert(run);
                b.acknowledged_ops += 1;
            }
            _ => return,
        }
    }
}

fn register_child(d: &Daemon, run: &str, fence: u64, ignore_term: bool) -> Option<Registered> {
    use std::os::unix::process::CommandExt;
    let script = if ignore_term {
        "trap '' TERM; sleep 600"
    } else {
        "exec sleep 600"
    };
    let child = Command::new("sh")
        .args(["-c", script])
        .process_group(0)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let body = json!({"fence": fence, "pid": child.id()});
    let reg = d.call("POST", &format!("/v1/runs/{run}/processes"), Some(body));
    Some(Registered {
        child,
        registered: matches!(reg, Some((201, _))),
    })
}

/// After a restart: every acknowledged operation against what the daemon says now.
/// Returns how many were lost.
fn check_acknowledged(d: &Daemon, book: &Book) -> u64 {
    let runs = d.get("/v1/runs?all=true");
    let now: BTreeMap<&str, (&str, Option<u64>)> = runs["runs"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|r| {
                    let id = r["run_id"].as_str().unwrap_or("");
                    (id, (r["state"].as_str().unwrap_or(""), r["fence"].as_u64()))
                })
                .collect()
        })
        .unwrap_or_default();
    let mut lost = 0;
    for (run, fence) in &book.granted {
        let ok = match now.get(run.as_str()) {
            None => false,
            Some((_, f)) if *f != Some(*fence) => false,
            // A release that was acknowledged has ended the run (or is stopping it).
            Some((state, _)) if book.released.contains(run) => {
                matches!(*state, "released" | "releasing" | "stopping")
            }
            Some((state, _)) => *state != "queued",
        };
        if !ok {
            eprintln!(
                "lost: {run} (fence {fence}): now {:?}",
                now.get(run.as_str())
            );
            lost += 1;
        }
    }
    lost
}

/// The failpoint (if any) crash `i` arms: every other crash is a plain SIGKILL.
fn crash_plan(i: usize) -> Option<&'static str> {
    (i % 2 == 1).then(|| DAEMON_POINTS[(i / 2) % DAEMON_POINTS.len()])
}

#[derive(Default)]
struct KillFigures {
    kills: u64,
    at_failpoint: BTreeMap<&'static str, u64>,
    lost: u64,
    leaked_runs: u64,
    leaked_resources: u64,
    leaked_processes: u64,
    acknowledged_ops: u64,
    repeated: u64,
}

/// `n` crashes of a daemon under load, each followed by a restart and the checks.
fn daemon_kills(bin: &Path, n: usize) -> KillFigures {
    let dir = tempfile::tempdir().unwrap();
    let arm = dir.path().join("armed");
    let mut d = Daemon::new(bin, &dir.path().join("state"));
    let book = Mutex::new(Book::default());
    let mut fig = KillFigures::default();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for i in 0..n {
        let _ = std::fs::remove_file(&arm);
        let point = crash_plan(i);
        let env: Vec<(&str, String)> = match point {
            Some(p) => vec![
                ("BERTH_FAILPOINT", p.to_string()),
                ("BERTH_FAILPOINT_ARM", arm.display().to_string()),
            ],
            None => vec![],
        };
        d.spawn(&env);
        fig.lost += check_acknowledged(&d, &book.lock().unwrap());
        release_live(&d, &book);
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let load_ms = 30 + (x >> 33) % 200;
        let stop = AtomicBool::new(false);
        let crashed_at = std::thread::scope(|s| {
            for c in 0..LOAD_CLIENTS {
                let (d, stop, book) = (&d, &stop, &book);
                s.spawn(move || load_client(d, i, c, stop, book));
            }
            std::thread::sleep(Duration::from_millis(load_ms));
            let at = crash(&d, point, &arm);
            stop.store(true, Ordering::Relaxed);
            at
        });
        if let Some(p) = crashed_at {
            *fig.at_failpoint.entry(p).or_default() += 1;
        }
        fig.kills += 1;
        let mut b = book.lock().unwrap();
        b.high_before_crash = b.fences.last().copied().unwrap_or(0);
    }
    d.spawn(&[]);
    fig.lost += check_acknowledged(&d, &book.lock().unwrap());
    release_live(&d, &book);
    let mut b = book.into_inner().unwrap();
    (fig.leaked_runs, fig.leaked_resources) = settle_and_measure(&d);
    fig.leaked_processes = reap(&mut b.children);
    fig.acknowledged_ops = b.acknowledged_ops;
    fig.repeated = b.repeated;
    fig
}

/// Crashes the loaded daemon: arms `point` and waits for its abort, else SIGKILL.
/// Returns the failpoint it crashed at, if any.
fn crash(d: &Daemon, point: Option<&'static str>, arm: &Path) -> Option<&'static str> {
    let at = point.and_then(|p| {
        std::fs::write(arm, b"").unwrap();
        let reached = d.exited_within(FAILPOINT_WAIT);
        if !reached {
            eprintln!("failpoint {p} was not reached within {FAILPOINT_WAIT:?}: SIGKILL instead");
        }
        reached.then_some(p)
    });
    d.kill9();
    at
}

/// Releases every live run (acknowledged or not: a grant the crash left unanswered
/// holds capacity too), so the next cycle's load has room.
fn release_live(d: &Daemon, book: &Mutex<Book>) {
    let runs = d.get("/v1/runs");
    for r in runs["runs"].as_array().into_iter().flatten() {
        let (Some(id), Some(fence)) = (r["run_id"].as_str(), r["fence"].as_u64()) else {
            continue;
        };
        if r["state"] != "granted" {
            continue;
        }
        let path = format!("/v1/runs/{id}/release");
        if let Some((200, _)) = d.call("POST", &path, Some(json!({"fence": fence}))) {
            let mut b = book.lock().unwrap();
            if b.granted.contains_key(id) {
                b.released.insert(id.to_string());
            }
        }
    }
}

/// Waits until nothing is granted, releasing or degraded; then (runs still holding
/// capacity, resources still committed).
fn settle_and_measure(d: &Daemon) -> (u64, u64) {
    let end = Instant::now() + SETTLE;
    loop {
        let s = d.get("/v1/status");
        let holding = ["granted", "releasing", "degraded"]
            .iter()
            .map(|k| s[k].as_u64().unwrap_or(0))
            .sum::<u64>();
        let committed = s["resources"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|r| r["committed"].as_u64().unwrap_or(0) > 0)
            .count() as u64;
        if (holding == 0 && committed == 0) || Instant::now() > end {
            return (holding, committed);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Processes of ended runs still alive (each is killed and reaped here).
fn reap(children: &mut Vec<Registered>) -> u64 {
    let mut alive = 0;
    for r in children.iter_mut() {
        if let Ok(None) = r.child.try_wait() {
            if r.registered {
                eprintln!("leaked: pid {} outlived its run", r.child.id());
                alive += 1;
            }
            let _ = r.child.kill();
            let _ = r.child.wait();
        }
    }
    children.clear();
    alive
}

/// `n` real `berth run` clients killed: half with SIGKILL once their command runs, half
/// aborting at their own failpoint (between spawning the command and registering it).
/// Returns (kills, runs still live or holding capacity, commands still alive).
fn client_kills(bin: &Path, n: usize) -> (u64, u64, u64) {
    let dir = tempfile::tempdir().unwrap();
    let mut d = Daemon::new(bin, &dir.path().join("state"));
    d.spawn(&[]);
    let mut clients = Vec::new();
    for i in 0..n {
        let pidfile = dir.path().join(format!("cmd-{i}.pid"));
        let mut cmd = Command::new(&d.bin);
        cmd.args(["run", "--url", &d.url(), "--token", &d.token])
            .args([
                "--project",
                &format!("client-{i}"),
                "--cpus",
                "0.001",
                "--memory",
                "1MiB",
            ])
            .args([
                "--disk",
                "0",
                "--ttl",
                &format!("{CLIENT_TTL_S}s"),
                "--wait",
                "0",
            ])
            .args([
                "--",
                "sh",
                "-c",
                &format!("echo $$ > {}; exec sleep 600", pidfile.display()),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if i % 2 == 1 {
            cmd.env("BERTH_FAILPOINT", "spawn-before-register");
        }
        clients.push((cmd.spawn().expect("berth run"), pidfile, i % 2 == 1));
    }
    for (child, pidfile, at_failpoint) in &mut clients {
        let end = Instant::now() + SETTLE;
        // SIGKILL once the command runs (its pid file is written); a client at its
        // failpoint aborts by itself.
        while !*at_failpoint && !pidfile.exists() && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    let (live, _) = settle_and_measure(&d);
    let mut alive = 0;
    for (_, pidfile, _) in &clients {
        let pid = std::fs::read_to_string(pidfile)
            .ok()
            .and_then(|p| p.trim().parse().ok());
        if let Some(pid) = pid {
            if running(pid) {
                eprintln!("leaked: the command {pid} of a killed client is alive");
                alive += 1;
                let _ = rustix::process::kill_process(
                    rustix::process::Pid::from_raw(pid).unwrap(),
                    rustix::process::Signal::KILL,
                );
            }
        }
    }
    (n as u64, live, alive)
}

/// Alive and not a zombie.
fn running(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            let state = s.rsplit(')').next().unwrap_or("").trim_start();
            !state.starts_with('Z') && !state.starts_with('X')
        })
        .unwrap_or(false)
}

/// Starts `sleep 600` in a process group of its own with exactly `pid`, by setting the
/// kernel's last pid (root only); None if the pid was taken meanwhile.
fn stranger_at(pid: i32) -> Option<Child> {
    use std::os::unix::process::CommandExt;
    std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string()).ok()?;
    let mut child = Command::new("sleep")
        .arg("600")
        .process_group(0)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    if child.id() as i32 == pid {
        return Some(child);
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

/// `n` trials: a run's registered process exits and a stranger takes its pid and
/// process group; the run is released. Returns (trials, strangers signalled), or None
/// when pids cannot be forced here (not root).
fn strangers(bin: &Path, n: usize) -> Option<(u64, u64)> {
    if !Path::new("/proc/sys/kernel/ns_last_pid").exists() || !rustix::process::getuid().is_root() {
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut d = Daemon::new(bin, &dir.path().join("state"));
    d.spawn(&[]);
    let (mut trials, mut signalled) = (0u64, 0u64);
    for i in 0..n {
        let run = format!("reuse-{i}");
        let body = json!({"run_id": run, "project": "reuse", "ttl_s": 600,
            "resources": {"cpu_millis": 1, "memory": 1 << 20, "disk": 0}});
        let Some((201, r)) = d.call("POST", "/v1/runs", Some(body)) else {
            continue;
        };
        let fence = r["fence"].as_u64().unwrap_or(0);
        let Some(mut own) = register_child(&d, &run, fence, false) else {
            continue;
        };
        let pid = own.child.id() as i32;
        // A process's identity is its pid and its start time in clock ticks (10 ms):
        // a stranger started in the same tick as the process it replaces is the same
        // process to /proc. A real pid cycle takes far longer; here it is forced, so
        // the stranger is started a few ticks later, as any reuse would be.
        std::thread::sleep(SAME_TICK_GAP);
        let _ = own.child.kill();
        let _ = own.child.wait();
        let Some(mut stranger) = (0..5).find_map(|_| stranger_at(pid)) else {
            continue;
        };
        let path = format!("/v1/runs/{run}/release");
        let _ = d.call("POST", &path, Some(json!({"fence": fence})));
        settle_and_measure(&d);
        trials += 1;
        if !matches!(stranger.try_wait(), Ok(None)) {
            eprintln!("stranger {pid} was signalled by the release of {run}");
            signalled += 1;
        }
        let _ = stranger.kill();
        let _ = stranger.wait();
    }
    Some((trials, signalled))
}

/// The lines the fuzz and linearizability tests print (`fuzz-http: cases=N refused=M`,
/// `lincheck: histories=N operations=M …`), from a run of them in their long form.
const FIGURE_LINES: [&str; 4] = ["fuzz-http:", "fuzz-toml:", "fuzz-ledger:", "lincheck:"];

/// Runs the fuzz and linearizability test binaries (release, `--nocapture`) with `env`
/// and returns their figure lines as `"name":{"key":n,…}` JSON members. A failing test
/// fails this benchmark: its figures would not be worth printing.
fn test_figures(env: &[(String, String)]) -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .current_dir(&root)
        .args(["test", "--release", "--locked", "-p", "berth"])
        .args([
            "--test",
            "fuzz_http",
            "--test",
            "fuzz_config",
            "--test",
            "fuzz_ledger",
        ])
        .args(["--test", "linearizability", "--", "--nocapture"])
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .output()
        .expect("cargo test");
    let text =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the fuzz or linearizability tests failed:\n{text}"
    );
    // Lines of one name (`fuzz-toml` prints one per file) are summed.
    let mut sums: BTreeMap<&str, BTreeMap<String, u64>> = BTreeMap::new();
    for l in text.lines() {
        let Some(name) = FIGURE_LINES.iter().find(|p| l.starts_with(*p)) else {
            continue;
        };
        let sum = sums.entry(name.trim_end_matches(':')).or_default();
        for (k, v) in l[name.len()..]
            .split_whitespace()
            .filter_map(|kv| kv.split_once('='))
        {
            if let Ok(v) = v.parse::<u64>() {
                *sum.entry(k.to_string()).or_default() += v;
            }
        }
    }
    sums.iter()
        .map(|(name, kv)| {
            let pairs: Vec<String> = kv.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
            format!("\"{name}\":{{{}}}", pairs.join(","))
        })
        .collect()
}

pub fn main(
    bin: &Path,
    kills: usize,
    client_kills_n: usize,
    stranger_trials: usize,
    tests: Option<&[(String, String)]>,
) {
    let started = Instant::now();
    let figures = tests.map(test_figures).unwrap_or_default();
    let k = daemon_kills(bin, kills);
    let (c_kills, c_live, c_alive) = client_kills(bin, client_kills_n);
    let s = strangers(bin, stranger_trials);
    let at: Vec<String> = k
        .at_failpoint
        .iter()
        .map(|(p, n)| format!("\"{p}\":{n}"))
        .collect();
    let (s_trials, s_signalled) = match s {
        Some((t, n)) => (t.to_string(), n.to_string()),
        None => ("null".into(), "null".into()),
    };
    println!(
        "{{\"daemon_kill9s\":{},\"daemon_crashes_at_failpoints\":{{{}}},\"client_kill9s\":{c_kills},\"acknowledged_ops\":{},\"acknowledged_ops_lost\":{},\"fences_repeated\":{},\"capacity_leaked_runs\":{},\"capacity_leaked_resources\":{},\"processes_leaked\":{},\"killed_clients_runs_left_live\":{c_live},\"killed_clients_commands_left_alive\":{c_alive},\"stranger_trials\":{s_trials},\"strangers_signalled\":{s_signalled},{}\"seconds\":{:.0}}}",
        k.kills,
        at.join(","),
        k.acknowledged_ops,
        k.lost,
        k.repeated,
        k.leaked_runs,
        k.leaked_resources,
        k.leaked_processes,
        figures.iter().map(|f| format!("{f},")).collect::<String>(),
        started.elapsed().as_secs_f64()
    );
}
