//! C6 against the real daemon: an analysis run whose command opens a listener is
//! stopped with `analysis_listener_violation` naming the pid, the port and the command
//! line; one that only connects out is left alone.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::Daemon;

const LISTENS: &str = "import socket,time
s=socket.socket(); s.bind(('127.0.0.1',0)); s.listen()
print(s.getsockname()[1], flush=True)
time.sleep(30)";

trait AnalysisRun {
    /// `berth run` of an analysis run (`--cpus 0.1`) whose command is a python script.
    fn analysis_run(&self, project: &str, id: &str, more: &[&str], script: &str) -> Command;
}

impl AnalysisRun for Daemon {
    fn analysis_run(&self, project: &str, id: &str, more: &[&str], script: &str) -> Command {
        let mut c = self.cli();
        c.args([
            "run",
            "--project",
            project,
            "--run-id",
            id,
            "--class",
            "analysis",
        ])
        .args(["--cpus", "0.1"])
        .args(more)
        .args(["--", "python3", "-c", script]);
        c
    }
}

#[test]
fn an_analysis_run_that_listens_is_stopped_and_one_that_connects_out_is_not() {
    let d = Daemon::start(&["--slots-max", "4"]);
    let mut child = d
        .analysis_run("a", "lis", &[], LISTENS)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The command prints its port once it listens: from then on the clock runs.
    let mut first = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut first,
    )
    .unwrap();
    let listening = Instant::now();
    let port: u16 = first.trim().parse().expect("the port it listened on");
    let out = child.wait_with_output().unwrap();
    let took = listening.elapsed();
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(75), "berth run said: {said}");
    assert!(said.contains("analysis_listener_violation"), "{said}");
    // C6: stopped within a second of listening (a 200 ms watch round, the stop, and
    // berth run's release), with room for a loaded machine.
    eprintln!("analysis run stopped {took:?} after it listened");
    assert!(took < Duration::from_millis(1500), "{took:?}");
    let run = d.get("/v1/runs/lis").body;
    let failure = run["failure"].as_str().unwrap_or_default().to_string();
    assert!(
        failure.starts_with("analysis_listener_violation")
            && failure.contains(&format!("port {port}"))
            && failure.contains("python3"),
        "{run}"
    );
    assert!(
        ["released", "releasing"].contains(&run["state"].as_str().unwrap()),
        "{run}"
    );

    // Outbound connections are fine: it runs to its end.
    let connects = format!(
        "import socket,time\ns=socket.create_connection(('127.0.0.1',{}))\ntime.sleep(1.5)",
        d.port
    );
    let out = d
        .analysis_run("b", "out", &[], &connects)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        d.get("/v1/runs/out").body["failure"],
        serde_json::Value::Null
    );
}

/// An analysis run that lived through a restart of the daemon is still watched: it
/// listens only after the restart, and is stopped all the same.
#[test]
fn an_analysis_run_is_watched_again_after_a_daemon_restart() {
    let mut d = Daemon::start(&["--slots-max", "4"]);
    let late = "import socket,time
time.sleep(3)
s=socket.socket(); s.bind(('127.0.0.1',0)); s.listen()
print(s.getsockname()[1], flush=True)
time.sleep(30)";
    let child = d
        .analysis_run("a", "late", &["--ttl", "20s"], late)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    d.wait_until("late's command is registered", |d| {
        d.get("/v1/runs/late").body["state"] == "granted"
    });
    // Registered: berth run records CMD right after the grant.
    std::thread::sleep(Duration::from_millis(500));
    d.kill9_and_restart();
    let out = child.wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(75), "berth run said: {said}");
    assert!(said.contains("analysis_listener_violation"), "{said}");
}
