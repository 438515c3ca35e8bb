//! Regression tests for issue 8: what a hostile run, file, token holder or neighbour
//! did to the daemon. Each test is named after the finding it pins.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

/// Finding 2: a worktree's `.berth.toml` swapped between a regular file and a FIFO
/// froze an async worker in `open()` (and with it the whole API). Now the contract is
/// opened `O_NONBLOCK | O_NOFOLLOW` on a blocking thread and its type checked on the
/// descriptor: every acquire is answered, and the API keeps answering while it runs.
#[test]
fn finding_2_a_fifo_swapped_in_for_the_contract_never_freezes_the_api() {
    let d = Daemon::start(&[]);
    let wt = tempfile::tempdir().unwrap();
    let (file, fifo) = (wt.path().join("file"), wt.path().join("fifo"));
    let contract = wt.path().join(".berth.toml");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let swapper = {
        let (file, fifo, contract, stop) = (file.clone(), fifo.clone(), contract.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                // A fresh file or FIFO renamed over the contract: each rename swaps it
                // atomically, so a check-then-open path race sees both.
                if n % 2 == 0 {
                    std::fs::write(&file, "concurrency = \"serial\"\n").unwrap();
                    std::fs::rename(&file, &contract).unwrap();
                } else {
                    rustix::fs::mknodat(
                        rustix::fs::CWD,
                        &fifo,
                        rustix::fs::FileType::Fifo,
                        rustix::fs::Mode::from_raw_mode(0o600),
                        0,
                    )
                    .unwrap();
                    std::fs::rename(&fifo, &contract).unwrap();
                }
                n += 1;
            }
            n
        })
    };
    let mut slowest = Duration::ZERO;
    let mut latencies = Vec::new();
    let (mut granted, mut refused) = (0, 0);
    for i in 0..60 {
        let body = json!({"run_id": format!("fifo-{i}"), "project": format!("p{i}"),
            "resources": {"memory": 1u64 << 20, "cpu_millis": 10, "disk": 0},
            "worktree": wt.path(), "wait_s": 0});
        let r = d.post("/v1/runs", &body.to_string());
        match r.status {
            201 => {
                granted += 1;
                let fence = r.body["fence"].as_u64().unwrap();
                let rel = d.post(&format!("/v1/runs/fifo-{i}/release"), &json!({"fence": fence}).to_string());
                assert_eq!(rel.status, 200, "{:?}", rel.body);
            }
            400 => {
                refused += 1;
                let m = r.body["error"]["message"].as_str().unwrap_or("");
                assert!(m.starts_with("worktree"), "{m}");
            }
            s => panic!("acquire {i}: {s} {:?}", r.body),
        }
        let t = Instant::now();
        let s = d.get("/v1/status");
        let took = t.elapsed();
        assert_eq!(s.status, 200);
        slowest = slowest.max(took);
        latencies.push(took);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let swaps = swapper.join().unwrap();
    latencies.sort();
    let median = latencies[latencies.len() / 2];
    eprintln!("{swaps} swaps; {granted} granted, {refused} refused; status median {median:?}, slowest {slowest:?}");
    assert!(swaps > 10, "the swapper must have raced the acquires");
    assert!(granted + refused == 60);
    // Not a benchmark: the old daemon never answered at all once a worker was stuck.
    assert!(median < Duration::from_millis(100), "status median {median:?}");
    assert!(slowest < Duration::from_secs(2), "status slowest {slowest:?}");
}


/// Acquires `id` (tiny claim, its own project) and returns its fence.
fn grant(d: &Daemon, id: &str, ttl_s: u64) -> u64 {
    let body = json!({"run_id": id, "project": id, "ttl_s": ttl_s, "wait_s": 0,
        "resources": {"memory": 1u64 << 20, "cpu_millis": 10, "disk": 0}});
    let r = d.post("/v1/runs", &body.to_string());
    assert_eq!(r.status, 201, "{:?}", r.body);
    r.body["fence"].as_u64().unwrap()
}

/// A process that outlives any test by far, in its own process group.
fn sleeper() -> std::process::Child {
    use std::os::unix::process::CommandExt;
    std::process::Command::new("sleep")
        .arg("3600")
        .process_group(0)
        .spawn()
        .unwrap()
}

fn wait_gone(pid: i32, within: Duration) -> bool {
    let end = Instant::now() + within;
    while Instant::now() < end {
        if !alive(pid) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

fn daemon_pid(d: &Daemon) -> i32 {
    d.child.as_ref().unwrap().id() as i32
}

fn stat_field(pid: i32, n: usize) -> i32 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    s.rsplit(')').next().unwrap().split_whitespace().nth(n - 3).unwrap().parse().unwrap()
}

/// Finding 3: ~1,000 idle connections (no token needed) took every descriptor; then
/// "could not look" was read as "gone" and an expired run's process kept running,
/// untracked. Now connections are capped below the descriptor limit (the oldest one
/// without a token makes room at the cap), and a failed look keeps the run stopping.
#[test]
fn finding_3_idle_connections_never_exhaust_the_descriptors_supervision_needs() {
    // The test holds 1,000 sockets itself.
    let lim = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    let want = 4096u64.min(lim.maximum.unwrap_or(4096));
    assert!(want >= 1200, "the test needs 1,200 descriptors; the hard limit is {want}");
    rustix::process::setrlimit(
        rustix::process::Resource::Nofile,
        rustix::process::Rlimit { current: Some(want), maximum: lim.maximum },
    )
    .unwrap();
    let mut d = Daemon::unstarted(&["--stop-grace", "1s"]);
    d.nofile = Some(256);
    d.spawn();
    let fence = grant(&d, "fd", 2);
    let mut child = sleeper();
    let pid = child.id() as i32;
    let r = d.post("/v1/runs/fd/processes", &json!({"fence": fence, "pid": pid}).to_string());
    assert_eq!(r.status, 201, "{:?}", r.body);
    let mut idle = Vec::new();
    for _ in 0..1000 {
        match std::net::TcpStream::connect(("127.0.0.1", d.port)) {
            Ok(s) => idle.push(s),
            Err(e) => panic!("connect: {e}"),
        }
    }
    // The lease runs out while the 1,000 idle connections are held.
    let stopped = wait_gone(pid, Duration::from_secs(30));
    if !stopped {
        let _ = child.kill();
    }
    let _ = child.wait();
    let state = d.get("/v1/runs/fd").body["state"].clone();
    assert!(stopped, "the expired run's process was left running (run is {state})");
    d.wait_until("the run is released", |d| d.get("/v1/runs/fd").body["state"] == "released");
    drop(idle);
    assert_eq!(d.get("/v1/status").status, 200);
}

/// Finding 4: registration accepted almost any pid. Every forbidden registration is
/// refused with 403 and a code that says why, and nothing was signalled: every target
/// is still alive after the probing run is released.
#[test]
fn finding_4_forbidden_registrations_are_refused_and_nothing_is_signalled() {
    let d = Daemon::start(&["--stop-grace", "1s"]);
    let dpid = daemon_pid(&d);
    let owner_fence = grant(&d, "owner", 60);
    let mut owned = sleeper();
    let owned_pid = owned.id() as i32;
    let r = d.post("/v1/runs/owner/processes", &json!({"fence": owner_fence, "pid": owned_pid}).to_string());
    assert_eq!(r.status, 201, "{:?}", r.body);
    let fence = grant(&d, "probe", 60);
    let register = |pid: i32, token: Option<&str>| {
        let body = json!({"fence": fence, "pid": pid}).to_string();
        d.call_as(Some(token.unwrap_or(&d.token)), "POST", "/v1/runs/probe/processes", Some(&body))
    };
    let thread = std::fs::read_dir(format!("/proc/{dpid}/task"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .find(|&t| t != dpid)
        .expect("the daemon has threads");
    let me = std::process::id() as i32;
    let mut cases = vec![
        ("init", 1, "pid_forbidden"),
        ("kthreadd", 2, "pid_forbidden"),
        ("the daemon", dpid, "pid_forbidden"),
        ("a daemon thread", thread, "pid_forbidden"),
        ("the daemon's parent (this test)", me, "pid_forbidden"),
        ("another run's process", owned_pid, "pid_owned_by_run"),
    ];
    let (pgrp, session) = (stat_field(dpid, 5), stat_field(dpid, 6));
    for (what, p) in [("the daemon's group leader", pgrp), ("the daemon's session leader", session)] {
        if p > 1 && p != dpid && alive(p) {
            cases.push((what, p, "pid_forbidden"));
        }
    }
    // A kernel thread other than kthreadd.
    if let Some(k) = std::fs::read_dir("/proc").unwrap().filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok()).find(|&p| p > 2 && std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|s| s.rsplit(')').next().unwrap().split_whitespace().nth(1) == Some("2"))) {
        cases.push(("a kernel thread", k, "pid_forbidden"));
    }
    for (what, pid, code) in &cases {
        let r = register(*pid, None);
        assert_eq!((r.status, r.code()), (403, *code), "{what} (pid {pid}): {:?}", r.body);
    }
    // Another user's process: a token that acts for another uid.
    let other_uid = if rustix::process::geteuid().is_root() { 4242 } else { rustix::process::geteuid().as_raw() + 1 };
    let t = d.post("/v1/tokens", &json!({"scope": "operator", "uid": other_uid}).to_string());
    assert_eq!(t.status, 201, "{:?}", t.body);
    let other = t.body["token"].as_str().unwrap().to_string();
    let mut mine = sleeper();
    let r = register(mine.id() as i32, Some(&other));
    assert_eq!((r.status, r.code()), (403, "pid_not_owned"), "{:?}", r.body);
    // Nothing was recorded, so releasing the probe signals nothing.
    let rel = d.post("/v1/runs/probe/release", &json!({"fence": fence}).to_string());
    assert_eq!(rel.status, 200, "{:?}", rel.body);
    d.wait_until("the probe is released", |d| d.get("/v1/runs/probe").body["state"] == "released");
    std::thread::sleep(Duration::from_millis(1500)); // longer than the stop grace
    assert!(alive(owned_pid), "another run's process was signalled");
    assert!(alive(mine.id() as i32), "another user's process was signalled");
    assert!(alive(dpid) && alive(thread), "the daemon was signalled");
    assert_eq!(d.get("/v1/runs/owner").body["state"], "granted");
    assert_eq!(d.get("/v1/status").status, 200);
    // The rule is not a blanket refusal: the process's owner may register it.
    let f2 = grant(&d, "ok", 60);
    let r = d.post("/v1/runs/ok/processes", &json!({"fence": f2, "pid": mine.id()}).to_string());
    assert_eq!(r.status, 201, "{:?}", r.body);
    let rel = d.post("/v1/runs/ok/release", &json!({"fence": f2}).to_string());
    assert_eq!(rel.status, 200);
    assert!(wait_gone(mine.id() as i32, Duration::from_secs(10)), "a registered process is stopped");
    let _ = mine.wait();
    let _ = owned.kill();
    let _ = owned.wait();
}

/// Finding 5: when registering CMD failed, `berth run` warned and opened the gate
/// anyway. Now CMD never starts, the lease is released, and the exit code says why.
#[test]
fn finding_5_cmd_never_runs_unregistered() {
    let d = Daemon::start(&[]);
    let other_uid = if rustix::process::geteuid().is_root() { 4242 } else { rustix::process::geteuid().as_raw() + 1 };
    let t = d.post("/v1/tokens", &json!({"scope": "operator", "uid": other_uid}).to_string());
    let token = t.body["token"].as_str().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("ran");
    let out = d
        .cli()
        .env("BERTH_TOKEN", &token)
        .args(["run", "--run-id", "gate", "--project", "gate", "--memory", "1MiB", "--cpus", "0.01", "--disk", "0", "--"])
        .args(["touch", marker.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(69), "{err}");
    assert!(err.contains("CMD was not started") && err.contains("pid_not_owned"), "{err}");
    std::thread::sleep(Duration::from_millis(300));
    assert!(!marker.exists(), "CMD ran although it was never registered");
    assert_eq!(d.get("/v1/runs/gate").body["state"], "released");
}
