//! `berth run` in a terminal, driven through a real pseudo-terminal as a person at a
//! keyboard would: an interactive command reads what is typed, Ctrl-C ends it, Ctrl-Z
//! and `fg` in a job-control shell suspend and resume it with the lease kept, a lease
//! lost while suspended ends in exit 75 with its line, and the terminal's modes come
//! back however CMD ends.

mod common;

use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::Daemon;

/// A child on the slave side of a new pseudo-terminal, as its session leader with the
/// terminal as its controlling one; the test holds the master (the keyboard and screen).
struct Pty {
    master: std::fs::File,
    screen: Arc<Mutex<Vec<u8>>>,
    child: Child,
}

impl Pty {
    fn spawn(mut cmd: Command) -> Pty {
        use rustix::pty::{grantpt, openpt, ptsname, unlockpt, OpenptFlags};
        let master: OwnedFd =
            openpt(OpenptFlags::RDWR | OpenptFlags::NOCTTY | OpenptFlags::CLOEXEC).unwrap();
        grantpt(&master).unwrap();
        unlockpt(&master).unwrap();
        rustix::termios::tcsetwinsize(
            &master,
            rustix::termios::Winsize {
                ws_row: 24,
                ws_col: 80,
                ws_xpixel: 0,
                ws_ypixel: 0,
            },
        )
        .unwrap();
        let name = ptsname(&master, Vec::new()).unwrap();
        let slave = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(name.to_str().unwrap())
            .unwrap();
        {
            use std::os::unix::process::CommandExt;
            // SAFETY: setsid and TIOCSCTTY are async-signal-safe.
            unsafe {
                cmd.pre_exec(|| {
                    rustix::process::setsid().map_err(std::io::Error::from)?;
                    rustix::process::ioctl_tiocsctty(std::io::stdin().as_fd())
                        .map_err(std::io::Error::from)
                });
            }
        }
        let child = cmd
            .stdin(Stdio::from(slave.try_clone().unwrap()))
            .stdout(Stdio::from(slave.try_clone().unwrap()))
            .stderr(Stdio::from(slave))
            .spawn()
            .unwrap();
        let master = std::fs::File::from(master);
        let screen = Arc::new(Mutex::new(Vec::new()));
        let (mut r, s) = (master.try_clone().unwrap(), screen.clone());
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            // EIO once the last slave descriptor closes.
            while let Ok(n) = r.read(&mut buf) {
                if n == 0 {
                    break;
                }
                s.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        });
        Pty {
            master,
            screen,
            child,
        }
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.screen.lock().unwrap()).into_owned()
    }

    /// Waits (10 s at most) until the screen shows `what` after byte `from`; returns
    /// where it ends.
    fn expect_after(&self, from: usize, what: &str) -> usize {
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            let t = self.text();
            if let Some(i) = t.get(from..).and_then(|rest| rest.find(what)) {
                return from + i + what.len();
            }
            assert!(
                Instant::now() < end,
                "the terminal never showed {what:?}; it shows:\n{t}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn expect(&self, what: &str) -> usize {
        self.expect_after(0, what)
    }

    fn type_(&mut self, keys: &str) {
        self.master.write_all(keys.as_bytes()).unwrap();
    }

    /// Waits for the child (10 s at most); its exit code.
    fn exit_code(&mut self) -> i32 {
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st.code().unwrap_or(-1);
            }
            if Instant::now() > end {
                let _ = self.child.kill();
                panic!("still running; the terminal shows:\n{}", self.text());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Pty {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn berth_run(d: &Daemon, run_id: &str, extra: &[&str], script: &str) -> Command {
    let mut c = d.cli();
    c.args([
        "run",
        "--project",
        run_id,
        "--run-id",
        run_id,
        "--cpus",
        "0.1",
    ])
    .args(extra)
    .args(["--", "sh", "-c", script]);
    c
}

/// A job-control shell on a terminal, with berth's environment.
fn shell(d: &Daemon) -> Pty {
    let mut c = Command::new("bash");
    c.args(["--norc", "--noprofile", "-i"])
        .env("PS1", "$ ")
        .env("BERTH_URL", &d.url)
        .env("BERTH_TOKEN", &d.token)
        .env("TERM", "dumb");
    let p = Pty::spawn(c);
    p.expect("$ ");
    p
}

fn state(d: &Daemon, id: &str) -> (String, Option<u64>) {
    let r = d.get(&format!("/v1/runs/{id}")).body;
    (
        r["state"].as_str().unwrap_or("").to_string(),
        r["fence"].as_u64(),
    )
}

#[test]
fn an_interactive_command_reads_the_terminal_and_sees_its_size() {
    let d = Daemon::start(&["--slots-max", "2"]);
    let mut p = Pty::spawn(berth_run(
        &d,
        "tty",
        &[],
        "printf 'name? '; read x; echo got:$x; stty size",
    ));
    p.expect("name? ");
    // A new window size reaches CMD: the driver itself tells its foreground group.
    rustix::termios::tcsetwinsize(
        &p.master,
        rustix::termios::Winsize {
            ws_row: 40,
            ws_col: 100,
            ws_xpixel: 0,
            ws_ypixel: 0,
        },
    )
    .unwrap();
    p.type_("ada\n");
    p.expect("got:ada");
    p.expect("40 100");
    assert_eq!(p.exit_code(), 0, "{}", p.text());
    // (Released once the broker has seen the run's processes gone.)
    d.wait_until("tty is released", |d| state(d, "tty").0 == "released");
    eprintln!("--- transcript ---\n{}\n---", p.text());
}

#[test]
fn ctrl_c_ends_cmd_and_the_run_is_released() {
    let d = Daemon::start(&["--slots-max", "2"]);
    let mut p = Pty::spawn(berth_run(&d, "cc", &[], "echo ready; sleep 3600"));
    p.expect("ready");
    p.type_("\x03");
    assert_eq!(p.exit_code(), 130, "{}", p.text());
    d.wait_until("cc is released", |d| state(d, "cc").0 == "released");
}

#[test]
fn the_terminal_modes_come_back_however_cmd_ends() {
    use rustix::termios::LocalModes;
    let d = Daemon::start(&["--slots-max", "2"]);
    // CMD puts the terminal in raw mode without echo, then dies by SIGKILL.
    let mut p = Pty::spawn(berth_run(
        &d,
        "raw",
        &[],
        "stty raw -echo; echo raw; kill -9 $$",
    ));
    p.expect("raw");
    assert_eq!(p.exit_code(), 137, "{}", p.text());
    let modes = rustix::termios::tcgetattr(&p.master).unwrap();
    assert!(
        modes
            .local_modes
            .contains(LocalModes::ECHO | LocalModes::ICANON),
        "echo and line editing were not restored: {:?}",
        modes.local_modes
    );
}

#[test]
fn ctrl_z_then_fg_suspends_and_resumes_cmd_with_the_lease_kept() {
    let d = Daemon::start(&["--slots-max", "2"]);
    let mut sh = shell(&d);
    sh.type_(&format!(
        "{} run --project z --run-id z --cpus 0.1 -- sh -c 'i=0; while :; do echo tick$i; i=$((i+1)); sleep 0.2; done'\n",
        common::BERTH
    ));
    sh.expect("tick2");
    let (st, fence) = state(&d, "z");
    assert_eq!(st, "granted");
    sh.type_("\x1a");
    let at = sh.expect("Stopped");
    // Suspended: no tick for a while, the lease still held.
    std::thread::sleep(Duration::from_millis(1500));
    let quiet = sh.text()[at..].to_string();
    // (Lines CMD prints start with `tick`; the shell's job line only mentions it.)
    assert!(
        !quiet.contains("\ntick"),
        "CMD ran on while suspended: {quiet:?}"
    );
    assert_eq!(state(&d, "z"), ("granted".to_string(), fence));
    let n = sh.text().len();
    sh.type_("fg\n");
    sh.expect_after(n, "\ntick");
    assert_eq!(state(&d, "z"), ("granted".to_string(), fence));
    sh.type_("\x03");
    let n = sh.text().len();
    sh.type_("echo rc=$?\n");
    sh.expect_after(n, "rc=130");
    d.wait_until("z is released", |d| state(d, "z").0 == "released");
    sh.type_("exit\n");
    eprintln!("--- transcript ---\n{}\n---", sh.text());
}

#[test]
fn a_lease_lost_while_suspended_exits_75_with_its_line() {
    let d = Daemon::start(&["--slots-max", "2", "--stop-grace", "1s"]);
    let mut sh = shell(&d);
    sh.type_(&format!(
        "{} run --project l --run-id lost --cpus 0.1 --ttl 2s -- sh -c 'while :; do echo tick; sleep 0.2; done'\n",
        common::BERTH
    ));
    // (`\ntick`: CMD's output, not the echo of the typed command.)
    sh.expect("\ntick");
    sh.type_("\x1a");
    sh.expect("Stopped");
    // Suspended past the ttl: the broker expires the lease and stops CMD.
    d.wait_until("the lease expires", |d| state(d, "lost").0 == "expired");
    let n = sh.text().len();
    sh.type_("fg\n");
    sh.expect_after(n, "was lost");
    let n = sh.text().len();
    sh.type_("echo rc=$?\n");
    sh.expect_after(n, "rc=75");
    sh.type_("exit\n");
    eprintln!("--- transcript ---\n{}\n---", sh.text());
}

/// Issue 33 item 3: `fg` while the broker is still in its stop grace after the lease
/// expired. CMD ends by the broker's TERM at once, and the release is answered
/// `releasing`: that is a lost lease (75, one line), not CMD's bare 143.
#[test]
fn issue_33_fg_during_the_brokers_stop_grace_is_a_lost_lease_not_a_bare_143() {
    let d = Daemon::start(&["--slots-max", "2", "--stop-grace", "30s"]);
    let mut sh = shell(&d);
    sh.type_(&format!(
        "{} run --project l --run-id graced --cpus 0.1 --ttl 2s -- sh -c 'while :; do echo tick; sleep 0.2; done'\n",
        common::BERTH
    ));
    sh.expect("\ntick");
    sh.type_("\x1a");
    sh.expect("Stopped");
    d.wait_until("the lease expires and its stop begins", |d| {
        state(d, "graced").0 == "releasing"
    });
    let n = sh.text().len();
    sh.type_("fg\n");
    sh.expect_after(n, "was lost");
    let n = sh.text().len();
    sh.type_("echo rc=$?\n");
    sh.expect_after(n, "rc=75");
    sh.type_("exit\n");
    assert!(
        sh.text().contains("ran out") || sh.text().contains("expired"),
        "the line says why: {}",
        sh.text()
    );
}

/// On a terminal the waiting line is redrawn every second: its elapsed time ticks
/// between the daemon's events.
#[test]
fn the_waiting_line_ticks_on_a_terminal() {
    let d = Daemon::start(&["--slots-max", "1"]);
    let h = d.post(
        "/v1/runs",
        &serde_json::json!({"run_id": "h", "project": "busy", "resources": {"cpu_millis": 10}})
            .to_string(),
    );
    assert_eq!(h.status, 201);
    let mut p = Pty::spawn(berth_run(&d, "w", &[], "echo admitted"));
    let at = p.expect("berth: waiting: position 1");
    let at = p.expect_after(at, ", 1s");
    p.expect_after(at, ", 2s");
    let r = d.post(
        "/v1/runs/h/release",
        &serde_json::json!({"fence": h.body["fence"]}).to_string(),
    );
    assert_eq!(r.status, 200);
    p.expect("admitted");
    assert_eq!(p.exit_code(), 0, "{}", p.text());
}
