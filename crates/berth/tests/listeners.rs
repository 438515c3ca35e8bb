//! C6 against the real daemon: an analysis run whose command opens a listener is
//! stopped with `analysis_listener_violation` naming the pid, the port and the command
//! line; one that only connects out is left alone.

mod common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::Daemon;

const LISTENS: &str = "import socket,time
s=socket.socket(); s.bind(('127.0.0.1',0)); s.listen()
print(s.getsockname()[1], flush=True)
time.sleep(30)";

#[test]
fn an_analysis_run_that_listens_is_stopped_and_one_that_connects_out_is_not() {
    let d = Daemon::start(&["--slots-max", "4"]);
    let t = Instant::now();
    let out = d
        .cli()
        .args([
            "run",
            "--project",
            "a",
            "--run-id",
            "lis",
            "--class",
            "analysis",
            "--cpus",
            "0.1",
        ])
        .args(["--", "python3", "-c", LISTENS])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let took = t.elapsed();
    let said = String::from_utf8_lossy(&out.stderr);
    let port: u16 = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("the port it listened on");
    assert_eq!(out.status.code(), Some(75), "berth run said: {said}");
    // Stopped within about a second of listening (the python start is in it too).
    assert!(took < Duration::from_secs(10), "{took:?}");
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
        .cli()
        .args([
            "run",
            "--project",
            "b",
            "--run-id",
            "out",
            "--class",
            "analysis",
            "--cpus",
            "0.1",
        ])
        .args(["--", "python3", "-c", &connects])
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
