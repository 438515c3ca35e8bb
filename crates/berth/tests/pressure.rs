//! Issue 36: admission follows the host's memory pressure (PSI `some avg10`), here from
//! a synthetic source: a file in `/proc/pressure/memory`'s format that the test writes
//! (`--pressure-source`). Above 5% background waiters are held back, above 10%
//! foreground ones too, each with reason `host.memory_pressure` and the figures; once
//! the pressure falls they are admitted, without a request to wake them.

mod common;

use std::time::Duration;

use common::Daemon;
use serde_json::json;

/// The daemon reads its source once a second.
const SAMPLE_MS: u64 = 1_000;

fn psi(path: &std::path::Path, avg10: &str) {
    let text = format!(
        "some avg10={avg10} avg60=0.00 avg300=0.00 total=1\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
    );
    std::fs::write(path, text).unwrap();
}

fn waiter(d: &Daemon, id: &str, priority: &str) {
    let body = json!({"run_id": id, "project": id, "priority": priority, "detach": true,
                      "wait_s": 60, "resources": {"cpu_millis": 100}});
    let r = d.post("/v1/runs", &body.to_string());
    assert!(r.status < 300, "{id}: {:?}", r.body);
}

fn state_and_reason(d: &Daemon, id: &str) -> (String, String, String) {
    let v = d.get(&format!("/v1/runs/{id}")).body;
    let s = |x: &serde_json::Value| x.as_str().unwrap_or_default().to_string();
    (
        s(&v["state"]),
        s(&v["reason"]["code"]),
        s(&v["reason"]["message"]),
    )
}

#[test]
fn waiters_are_held_back_under_memory_pressure_and_admitted_when_it_falls() {
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("memory");
    psi(&source, "25.00");
    let d = Daemon::start(&["--pressure-source", source.to_str().unwrap()]);
    std::thread::sleep(Duration::from_millis(2 * SAMPLE_MS));
    waiter(&d, "fg", "foreground");
    waiter(&d, "bg", "background");
    for id in ["fg", "bg"] {
        let (state, code, message) = state_and_reason(&d, id);
        assert_eq!(
            (state.as_str(), code.as_str()),
            ("queued", "host.memory_pressure"),
            "{id}"
        );
        assert!(message.contains("25.00%"), "{id}: {message}");
    }
    // Between the two figures: foreground runs go in, background ones still wait.
    psi(&source, "7.50");
    d.wait_until("fg is granted", |d| {
        state_and_reason(d, "fg").0 == "granted"
    });
    let (state, code, message) = state_and_reason(&d, "bg");
    assert_eq!(
        (state.as_str(), code.as_str()),
        ("queued", "host.memory_pressure")
    );
    assert!(
        message.contains("7.50%") && message.contains("5.00%"),
        "{message}"
    );
    psi(&source, "0.00");
    d.wait_until("bg is granted", |d| {
        state_and_reason(d, "bg").0 == "granted"
    });
}

/// The limits are flags (and `berth.toml` keys): a background figure above the
/// foreground one, or a figure that is not a percentage, is refused at start naming
/// the flag.
#[test]
fn memory_pressure_limits_are_checked_at_start() {
    let out = |args: &[&str]| {
        let dir = tempfile::tempdir().unwrap();
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_berth"))
            .arg("serve")
            .arg("--state-dir")
            .arg(dir.path())
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .output()
            .unwrap();
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let (ok, err) = out(&["--memory-pressure-max", "lots"]);
    assert!(
        !ok && err.contains("--memory-pressure-max") && err.contains("10%"),
        "{err}"
    );
    let (ok, err) = out(&[
        "--memory-pressure-max",
        "5%",
        "--memory-pressure-background-max",
        "20%",
    ]);
    assert!(!ok && err.contains("memory pressure limits"), "{err}");
}

/// Issue 36: cpu and io pressure hold waiters back too, once a limit is set (off by
/// default): from synthetic sources, each with its own reason code and figure.
#[test]
fn cpu_and_io_pressure_hold_waiters_back_once_a_limit_is_set() {
    let dir = tempfile::tempdir().unwrap();
    let (cpu, io) = (dir.path().join("cpu"), dir.path().join("io"));
    psi(&cpu, "50.00");
    psi(&io, "0.00");
    let d = Daemon::start(&[
        "--cpu-pressure-max",
        "40%",
        "--io-pressure-max",
        "20%",
        "--cpu-pressure-source",
        cpu.to_str().unwrap(),
        "--io-pressure-source",
        io.to_str().unwrap(),
    ]);
    std::thread::sleep(Duration::from_millis(2 * SAMPLE_MS));
    waiter(&d, "fg", "foreground");
    let (state, code, message) = state_and_reason(&d, "fg");
    assert_eq!(
        (state.as_str(), code.as_str()),
        ("queued", "host.cpu_pressure")
    );
    assert!(
        message.contains("50.00%") && message.contains("40.00%"),
        "{message}"
    );
    // io first: a sample between the two writes still holds the waiter back.
    psi(&io, "30.00");
    psi(&cpu, "0.00");
    d.wait_until("io holds it back now", |d| {
        state_and_reason(d, "fg").1 == "host.io_pressure"
    });
    psi(&io, "0.00");
    d.wait_until("fg is granted", |d| {
        state_and_reason(d, "fg").0 == "granted"
    });
    // Without a limit nothing is read: the kernel's figures never hold anyone back.
    let plain = Daemon::start(&[]);
    let text = String::from_utf8(
        plain
            .cli()
            .args(["serve", "--print-config", "--state-dir"])
            .arg(dir.path())
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    assert!(
        text.contains("cpu_pressure_max = \"100.00%\"") && !text.contains("cpu_pressure_source"),
        "{text}"
    );
}

/// A daemon with `--freeze-background` on a synthetic pressure source (at 0%), and a
/// background `berth run` (`bg`) whose shell writes the time to `beat` every 50 ms.
struct Paused {
    dir: tempfile::TempDir,
    source: std::path::PathBuf,
    d: Daemon,
    beat: std::path::PathBuf,
    child: std::process::Child,
}

impl Paused {
    fn start() -> Paused {
        let dir = tempfile::tempdir().unwrap();
        let source = dir.path().join("memory");
        psi(&source, "0.00");
        let d = Daemon::start(&[
            "--freeze-background",
            "--pressure-source",
            source.to_str().unwrap(),
        ]);
        let beat = dir.path().join("beat");
        let script = format!(
            "while :; do date +%s%N > {}; sleep 0.05; done",
            beat.display()
        );
        let child = d
            .cli()
            .args([
                "run",
                "--run-id",
                "bg",
                "--project",
                "bg",
                "--priority",
                "background",
                "--",
            ])
            .args(["sh", "-c", &script])
            .spawn()
            .unwrap();
        Paused {
            dir,
            source,
            d,
            beat,
            child,
        }
    }
}

/// Whether a run is paused, once its status tells its use.
fn frozen(d: &Daemon, id: &str) -> Option<bool> {
    d.get(&format!("/v1/runs/{id}")).body["usage"]["frozen"].as_bool()
}

/// Issue 36 (optional, `--freeze-background`): under memory pressure the newest
/// background run is paused by `cgroup.freeze` (its processes stop making progress,
/// its status says `frozen`), and resumed when the pressure falls.
#[test]
fn under_pressure_the_newest_background_run_is_paused_and_resumed_when_it_falls() {
    const TEST: &str =
        "under_pressure_the_newest_background_run_is_paused_and_resumed_when_it_falls";
    if !berth_proc::testing::cgroups(TEST) {
        return;
    }
    let Paused {
        dir: _dir,
        source,
        d,
        beat,
        mut child,
    } = Paused::start();
    d.wait_until("the run beats", |_| beat.exists());
    d.wait_until("the run is grouped", |d| frozen(d, "bg") == Some(false));
    psi(&source, "25.00");
    d.wait_until("the run is paused", |d| frozen(d, "bg") == Some(true));
    let at = std::fs::read_to_string(&beat).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        std::fs::read_to_string(&beat).unwrap(),
        at,
        "a paused run made progress"
    );
    psi(&source, "0.00");
    d.wait_until("the run is resumed", |d| frozen(d, "bg") == Some(false));
    d.wait_until("the run beats again", |_| {
        std::fs::read_to_string(&beat).unwrap() != at
    });
    let _ = child.kill();
    let _ = child.wait();
}

/// A pause is not remembered across a restart: a run paused when the daemon was
/// killed is resumed at the next start (the pressure has fallen meanwhile), instead of
/// staying frozen with nobody to thaw it.
#[test]
fn a_run_paused_when_the_daemon_died_is_resumed_at_its_next_start() {
    const TEST: &str = "a_run_paused_when_the_daemon_died_is_resumed_at_its_next_start";
    if !berth_proc::testing::cgroups(TEST) {
        return;
    }
    let Paused {
        dir: _dir,
        source,
        mut d,
        beat,
        mut child,
    } = Paused::start();
    d.wait_until("the run is grouped", |d| frozen(d, "bg") == Some(false));
    psi(&source, "25.00");
    d.wait_until("the run is paused", |d| frozen(d, "bg") == Some(true));
    psi(&source, "0.00");
    d.kill9_and_restart();
    let at = std::fs::read_to_string(&beat).unwrap();
    d.wait_until("the run beats again after the restart", |_| {
        std::fs::read_to_string(&beat).unwrap() != at
    });
    assert_eq!(frozen(&d, "bg"), Some(false));
    let _ = child.kill();
    let _ = child.wait();
}
