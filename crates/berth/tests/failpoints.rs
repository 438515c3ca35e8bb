//! Crash tests (cargo feature `failpoints`): the daemon aborts at a named point; after
//! a restart no acknowledged lease is lost, no fence repeats, no capacity leaks, live
//! children keep running and the runs being stopped are stopped.
//!
//!     cargo test -p berth --features failpoints --test failpoints
//!     BERTH_CRASH_LOOP_ITERATIONS=200 cargo test -p berth --features failpoints --test failpoints crash_loop
#![cfg(feature = "failpoints")]

mod common;

use std::io::Write;
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command};
use std::time::Duration;

use common::{alive, killed_within, long_poll, Daemon};
use serde_json::json;

struct Held {
    fence: u64,
    child: Child,
}

fn hold(d: &Daemon, id: &str, ignore_term: bool) -> Held {
    let r = d.post(
        "/v1/runs",
        &json!({"run_id": id, "project": id, "resources": {"cpu_millis": 100}, "ttl_s": 120})
            .to_string(),
    );
    assert_eq!(r.status, 201, "{:?}", r.body);
    let fence = r.body["fence"].as_u64().unwrap();
    let script = if ignore_term {
        "trap '' TERM; sleep 3600; sleep 3600"
    } else {
        "sleep 3600"
    };
    // Output not inherited: a tree that outlives the test must not hold its pipes.
    let child = Command::new("sh")
        .args(["-c", script])
        .process_group(0)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let reg = d.post(
        &format!("/v1/runs/{id}/processes"),
        &json!({"fence": fence, "pid": child.id()}).to_string(),
    );
    assert_eq!(reg.status, 201, "{:?}", reg.body);
    Held { fence, child }
}

/// Runs one crash at `failpoint` and checks everything that must hold after a restart.
fn crash_at(failpoint: &str, variant: u64) {
    let dir = tempfile::tempdir().unwrap();
    let mut d = Daemon::start_in(
        dir.path(),
        common::free_port(),
        &[
            "--slots-max",
            "4",
            "--stop-grace",
            "2s",
            "--memory-total",
            "64GiB",
        ],
    );
    let arm = dir.path().join("armed");
    d.env = vec![
        ("BERTH_FAILPOINT".into(), failpoint.into()),
        ("BERTH_FAILPOINT_ARM".into(), arm.display().to_string()),
    ];
    d.kill9_and_restart();
    let mut keep = hold(&d, "keep", false);
    let mut stop = hold(&d, "stop", failpoint == "mid-stop");
    // A run with diagnostics and a dirty workspace, released without processes.
    let dirty = d.post(
        "/v1/runs",
        &json!({"run_id": "dirty", "project": "dirty", "resources": {"cpu_millis": 100}})
            .to_string(),
    );
    let dirty_fence = dirty.body["fence"].as_u64().unwrap();
    let ws = std::path::PathBuf::from(dirty.body["workspace"].as_str().unwrap());
    std::fs::write(ws.join("logs/run.log"), vec![b'l'; 4096 + variant as usize]).unwrap();
    std::fs::write(ws.join("out/result"), b"r").unwrap();
    // A run whose lease runs out around the crash: it must be reaped afterwards.
    let exp = d.post(
        "/v1/runs",
        &json!({"run_id": "exp", "project": "exp", "resources": {"cpu_millis": 100}, "ttl_s": 2})
            .to_string(),
    );
    let exp_fence = exp.body["fence"].as_u64().unwrap();
    let mut exp_child = Command::new("sleep")
        .arg("3600")
        .process_group(0)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let reg = d.post(
        "/v1/runs/exp/processes",
        &json!({"fence": exp_fence, "pid": exp_child.id()}).to_string(),
    );
    assert_eq!(reg.status, 201);
    let _waiter = long_poll(
        &d,
        &json!({"run_id": "waiter", "project": "waiter", "resources": {"cpu_millis": 100}}),
    );
    d.wait_until("the waiter queues", |d| {
        d.get("/v1/runs/waiter").body["state"] == "queued"
    });
    let fences_before: Vec<u64> = d.get("/v1/runs").body["runs"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["fence"].as_u64())
        .collect();

    // Arm the crash, then trigger it.
    std::fs::write(&arm, b"").unwrap();
    // (Raw: the daemon may die before it answers this very call.)
    let (path, fence) = match failpoint {
        "mid-stop" => ("/v1/runs/stop/release", stop.fence),
        // Releasing `dirty` grants the waiter (grant-committed), archives its logs
        // (mid-archive) and deletes its dirty workspace (mid-workspace-removal).
        _ => ("/v1/runs/dirty/release", dirty_fence),
    };
    let mut s = TcpStream::connect(("127.0.0.1", d.port)).unwrap();
    let body = json!({ "fence": fence }).to_string();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        d.token,
        body.len()
    )
    .unwrap();
    let st = d.wait_exit(Duration::from_secs(20)).unwrap_or_else(|| {
        // Still up: say what it answered and what it thinks of the runs.
        use std::io::Read;
        let mut answer = vec![0u8; 4096];
        s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
        let n = s.read(&mut answer).unwrap_or(0);
        panic!(
            "{failpoint}: the daemon did not crash; it answered {:?}; runs: {}; status: {}",
            String::from_utf8_lossy(&answer[..n]),
            d.get("/v1/runs").body,
            d.get("/v1/status").body
        )
    });
    assert!(
        !st.success(),
        "{failpoint}: the daemon exited cleanly instead of crashing"
    );

    d.env.clear();
    d.spawn();
    // No acknowledged lease is lost: `keep` renews with its fence, its child runs on.
    let r = d.post(
        "/v1/runs/keep/renew",
        &json!({"fence": keep.fence}).to_string(),
    );
    assert_eq!(r.status, 200, "{failpoint}: keep: {:?}", r.body);
    assert!(
        alive(keep.child.id() as i32),
        "{failpoint}: a live child was killed"
    );
    // The run that was being stopped is stopped after the restart.
    if failpoint == "mid-stop" {
        d.wait_until("stop is released", |d| {
            d.get("/v1/runs/stop").body["state"] == "released"
        });
        assert!(
            killed_within(&mut stop.child, Duration::from_secs(10)),
            "{failpoint}: the run stopped mid-stop was released but its tree lives on"
        );
    } else {
        let r = d.post(
            "/v1/runs/stop/renew",
            &json!({"fence": stop.fence}).to_string(),
        );
        assert_eq!(r.status, 200, "{failpoint}: stop: {:?}", r.body);
        // The release of `dirty` was never answered: the crash may have come before it
        // was durable (then `dirty` is still granted) or after. A client retries; the
        // retry is idempotent either way (L5).
        let r = d.post(
            "/v1/runs/dirty/release",
            &json!({ "fence": dirty_fence }).to_string(),
        );
        assert_eq!(r.status, 200, "{failpoint}: dirty: {:?}", r.body);
        d.wait_until("dirty is released", |d| {
            d.get("/v1/runs/dirty").body["state"] == "released"
        });
    }
    // The expired run is reaped: its process stopped, its claim freed.
    d.wait_until("exp is expired", |d| {
        d.get("/v1/runs/exp").body["state"] == "expired"
    });
    assert!(
        killed_within(&mut exp_child, Duration::from_secs(10)),
        "{failpoint}: the expired run's process lives on"
    );
    // No fence repeats: everything issued from here on is above every fence seen.
    let runs = d.get("/v1/runs").body["runs"].as_array().unwrap().clone();
    let max_seen = runs
        .iter()
        .filter_map(|r| r["fence"].as_u64())
        .chain(fences_before)
        .max()
        .unwrap();
    let n = d.post("/v1/runs", &json!({"run_id": "after", "project": "after", "resources": {"cpu_millis": 100}, "wait_s": 0}).to_string());
    if n.status == 201 {
        assert!(
            n.body["fence"].as_u64().unwrap() > max_seen,
            "{failpoint}: a fence repeated"
        );
    }
    // No capacity leaks: committed slots equal the live runs that hold claims.
    let s = d.get("/v1/status").body;
    let holding = d.get("/v1/runs").body["runs"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| {
            matches!(
                r["state"].as_str(),
                Some("granted" | "releasing" | "degraded")
            )
        })
        .count() as u64;
    assert_eq!(
        s["resources"][0]["committed"].as_u64(),
        Some(holding),
        "{failpoint}: capacity leak: {s}"
    );
    // Whole groups: `sh -c` keeps its `sleep` as a child, which would outlive it.
    for c in [&mut keep.child, &mut stop.child] {
        if let Some(pg) = rustix::process::Pid::from_raw(c.id() as i32) {
            let _ = rustix::process::kill_process_group(pg, rustix::process::Signal::KILL);
        }
        let _ = c.wait();
    }
}

#[test]
fn crash_after_a_grant_is_committed_but_not_answered() {
    crash_at("grant-committed", 0);
}

#[test]
fn crash_in_the_middle_of_a_stop() {
    crash_at("mid-stop", 0);
}

#[test]
fn crash_in_the_middle_of_archiving() {
    crash_at("mid-archive", 0);
}

#[test]
fn crash_in_the_middle_of_removing_a_workspace() {
    crash_at("mid-workspace-removal", 0);
}

#[test]
fn a_berth_run_that_dies_between_spawn_and_registration_never_starts_cmd() {
    let d = Daemon::start(&["--slots-max", "2", "--stop-grace", "1s"]);
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("ran");
    let out = d
        .cli()
        .env("BERTH_FAILPOINT", "spawn-before-register")
        .args([
            "run",
            "--project",
            "p",
            "--run-id",
            "gated",
            "--cpus",
            "0.1",
            "--ttl",
            "2s",
            "--",
            "sh",
            "-c",
        ])
        .arg(format!("touch {}; sleep 100", marker.display()))
        .output()
        .unwrap();
    assert!(!out.status.success(), "berth run should have crashed");
    // CMD waited behind the gate; the gate closed with its parent; CMD never ran.
    std::thread::sleep(Duration::from_millis(500));
    assert!(!marker.exists(), "CMD ran although it was never registered");
    // The lease runs out and the run is reaped like any other.
    d.wait_until("gated is expired", |d| {
        d.get("/v1/runs/gated").body["state"] == "expired"
    });
    assert_eq!(d.get("/v1/status").body["granted"], 0);
}

/// The seeded crash loop: a random failpoint per iteration. Two iterations in the
/// default run; `BERTH_CRASH_LOOP_ITERATIONS=200` for the heavy run.
#[test]
fn crash_loop() {
    let n: u64 = std::env::var("BERTH_CRASH_LOOP_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let seed: u64 = std::env::var("BERTH_CRASH_LOOP_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(42);
    let points = [
        "grant-committed",
        "mid-stop",
        "mid-archive",
        "mid-workspace-removal",
    ];
    let mut x = seed;
    let mut count = [0u64; 4];
    for i in 0..n {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let k = (x >> 33) as usize % points.len();
        count[k] += 1;
        eprintln!("crash loop {i}: {}", points[k]);
        crash_at(points[k], x % 997);
    }
    eprintln!("crash loop: {n} iterations, per failpoint {count:?}, all invariants held");
}
