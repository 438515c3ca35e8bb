//! P1, P2, P5, P6 against the real daemon: registered trees are stopped exactly, a
//! dead `berth run` client's child is stopped by the broker, and identities recorded in
//! the ledger survive a `kill -9` of the daemon.

mod common;

use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{alive, killed_within, wait_pids, Daemon};
use serde_json::json;

fn acquire(d: &Daemon, id: &str, ttl: u64) -> u64 {
    let r = d.post(
        "/v1/runs",
        &json!({"run_id": id, "project": id, "resources": {"cpu_millis": 100}, "ttl_s": ttl})
            .to_string(),
    );
    assert_eq!(r.status, 201, "{:?}", r.body);
    r.body["fence"].as_u64().unwrap()
}

#[test]
fn release_stops_exactly_the_registered_tree() {
    let d = Daemon::start(&["--slots-max", "2", "--stop-grace", "1s"]);
    let fence = acquire(&d, "t", 60);
    let dir = tempfile::tempdir().unwrap();
    let pids = dir.path().join("pids");
    let p = pids.display();
    // Three generations, TERM ignored, and a grandchild that calls setsid.
    let script = format!(
        "trap '' TERM; echo $$ >> {p}; (trap '' TERM; sleep 3600 & echo $! >> {p}; (sleep 3600 & echo $! >> {p}; wait) & wait) & \
         setsid sh -c 'echo $$ >> {p}; exec sleep 3600' & wait"
    );
    // Output not inherited: a survivor must not hold the test runner's pipes.
    let mut root = Command::new("sh")
        .arg("-c")
        .arg(&script)
        .process_group(0)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let tree = wait_pids(&pids, 4);
    assert_eq!(tree.len(), 4);
    // A stranger that must survive.
    let mut stranger = Command::new("sleep").arg("3600").spawn().unwrap();
    let reg = d.post(
        "/v1/runs/t/processes",
        &json!({"fence": fence, "pid": root.id()}).to_string(),
    );
    assert_eq!(reg.status, 201, "{:?}", reg.body);
    // Bad registrations change nothing.
    assert_eq!(
        d.post(
            "/v1/runs/t/processes",
            &json!({"fence": fence + 1, "pid": root.id()}).to_string()
        )
        .status,
        409
    );
    assert_eq!(
        d.post(
            "/v1/runs/t/processes",
            &json!({"fence": fence, "pid": 4_000_000}).to_string()
        )
        .status,
        400
    );
    // S3: init is never a run's process (issue 8's registration rule).
    let init = d.post(
        "/v1/runs/t/processes",
        &json!({"fence": fence, "pid": 1}).to_string(),
    );
    assert_eq!((init.status, init.code()), (403, "pid_forbidden"));
    assert_eq!(
        d.post("/v1/runs/t/processes", &json!({"fence": fence}).to_string())
            .status,
        400
    );
    let t = Instant::now();
    let r = d.post("/v1/runs/t/release", &json!({"fence": fence}).to_string());
    assert_eq!(r.status, 200);
    d.wait_until("the run is released", |d| {
        d.get("/v1/runs/t").body["state"] == "released"
    });
    // The tree would live an hour: gone now means berth killed it.
    for pid in &tree {
        assert!(!alive(*pid), "{pid} of the tree survived");
    }
    assert!(
        killed_within(&mut root, Duration::from_secs(5)),
        "the root survived"
    );
    // TERM was ignored, so it took the grace period and then KILL.
    assert!(
        t.elapsed() >= Duration::from_millis(900),
        "{:?}",
        t.elapsed()
    );
    assert!(alive(stranger.id() as i32), "a stranger was signalled");
    stranger.kill().unwrap();
    // Capacity is free again.
    assert_eq!(d.get("/v1/status").body["granted"], 0);
    let _ = stranger.wait();
}

#[test]
fn a_killed_berth_run_has_its_child_stopped_within_ttl_plus_grace() {
    let d = Daemon::start(&["--slots-max", "2", "--stop-grace", "1s"]);
    let dir = tempfile::tempdir().unwrap();
    let pidfile = dir.path().join("pid");
    let mut client = d
        .cli()
        .args([
            "run",
            "--project",
            "p",
            "--run-id",
            "orphan",
            "--cpus",
            "0.1",
            "--ttl",
            "2s",
            "--",
            "sh",
            "-c",
        ])
        .arg(format!(
            "echo $$ > {}; trap '' TERM; sleep 100; sleep 100",
            pidfile.display()
        ))
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let child = wait_pids(&pidfile, 1)[0];
    d.wait_until("orphan is granted", |d| {
        d.get("/v1/runs/orphan").body["state"] == "granted"
    });
    std::thread::sleep(Duration::from_millis(300)); // let the registration land
    client.kill().unwrap(); // SIGKILL: no release, no renewals
    client.wait().unwrap();
    let killed_at = Instant::now();
    let end = killed_at + Duration::from_secs(2 + 1 + 2);
    while alive(child) && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!alive(child), "the child outlived ttl + grace + 2 s");
    d.wait_until("the run is expired", |d| {
        d.get("/v1/runs/orphan").body["state"] == "expired"
    });
}

#[test]
fn recorded_processes_survive_a_daemon_kill_9_and_are_stopped_afterwards() {
    let mut d = Daemon::start(&["--slots-max", "2", "--stop-grace", "1s"]);
    let fence = acquire(&d, "keep", 60);
    let mut worker = Command::new("sleep")
        .arg("3600")
        .process_group(0)
        .spawn()
        .unwrap();
    let pid = worker.id() as i32;
    assert_eq!(
        d.post(
            "/v1/runs/keep/processes",
            &json!({"fence": fence, "pid": pid}).to_string()
        )
        .status,
        201
    );
    d.kill9_and_restart();
    // The process kept running through the crash; the lease and fence are intact.
    assert!(alive(pid));
    assert_eq!(
        d.post("/v1/runs/keep/renew", &json!({"fence": fence}).to_string())
            .status,
        200
    );
    assert_eq!(
        d.post(
            "/v1/runs/keep/release",
            &json!({"fence": fence}).to_string()
        )
        .status,
        200
    );
    d.wait_until("keep is released", |d| {
        d.get("/v1/runs/keep").body["state"] == "released"
    });
    assert!(
        killed_within(&mut worker, Duration::from_secs(5)),
        "the re-adopted process was not stopped"
    );
}

#[test]
fn a_swapped_workspace_is_never_removed_and_the_run_degrades() {
    let mut d = Daemon::start(&["--slots-max", "2"]);
    let fence = acquire(&d, "swap", 60);
    let ws = std::path::PathBuf::from(d.get("/v1/runs/swap").body["workspace"].as_str().unwrap());
    // Replace the workspace with a symlink to a directory that must survive.
    let precious = tempfile::tempdir().unwrap();
    std::fs::write(precious.path().join("keep"), b"keep").unwrap();
    std::fs::rename(&ws, ws.with_extension("moved")).unwrap();
    std::os::unix::fs::symlink(precious.path(), &ws).unwrap();
    assert_eq!(
        d.post(
            "/v1/runs/swap/release",
            &json!({"fence": fence}).to_string()
        )
        .status,
        200
    );
    d.wait_until("swap is degraded", |d| {
        d.get("/v1/runs/swap").body["state"] == "degraded"
    });
    assert!(precious.path().join("keep").exists());
    let s = d.get("/v1/status").body;
    assert_eq!(s["degraded"], 1);
    assert_eq!(
        s["resources"][0]["committed"], 1,
        "a degraded run keeps its capacity counted"
    );
    // A reaper pass retries and reports it, still degraded, still untouched.
    let out = d.cli().args(["reap", "--json"]).output().unwrap();
    assert!(out.status.success());
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (report["examined"].as_u64(), report["degraded"].as_u64()),
        (Some(1), Some(1)),
        "{report}"
    );
    // Issue 36: by id, too.
    assert_eq!(report["degraded_runs"], json!(["swap"]), "{report}");
    assert_eq!(report["reaped_runs"], json!([]), "{report}");
    // A restart names the runs it recovers, by id.
    d.kill9_and_restart();
    d.wait_until("the restart names the run it recovers", |d| {
        common::log_tail(&d.log).contains("recovering 1 runs still to be stopped: swap")
    });
    for key in [
        "reaped",
        "processes_terminated",
        "reused_pids_protected",
        "diagnostics_bytes",
        "diagnostics_dropped",
    ] {
        assert!(report[key].is_u64(), "{key} missing in {report}");
    }
    assert!(precious.path().join("keep").exists());
}

#[test]
fn a_recorded_pid_that_now_belongs_to_a_stranger_is_left_alone() {
    let mut d = Daemon::start(&["--slots-max", "2", "--stop-grace", "1s"]);
    let fence = acquire(&d, "reuse", 60);
    d.kill9();
    // An unrelated process leading its own group; the ledger says the run owns its pid,
    // with an older start time: the run's process is gone and the pid was reused.
    let mut stranger = Command::new("sleep")
        .arg("60")
        .process_group(0)
        .spawn()
        .unwrap();
    let pid = stranger.id() as i32;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let start: u64 = stat
        .rsplit(')')
        .next()
        .unwrap()
        .split_whitespace()
        .nth(19)
        .unwrap()
        .parse()
        .unwrap();
    {
        use berth_store::{Batch, ProcessRecord, SqliteStore, Store};
        let mut store = SqliteStore::open(&d.state.join("ledger.db")).unwrap();
        let ledger = store.load(100).unwrap();
        let mut rec = ledger
            .runs
            .iter()
            .find(|r| r.request.run_id == "reuse")
            .unwrap()
            .clone();
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .unwrap()
            .trim()
            .to_string();
        rec.processes = vec![ProcessRecord {
            pid,
            start_ticks: start.saturating_sub(50),
            boot_id: boot,
        }];
        store
            .write(&[&Batch::runs(ledger.last_fence, vec![rec])])
            .unwrap();
    }
    d.kill9_and_restart();
    assert_eq!(
        d.post(
            "/v1/runs/reuse/release",
            &json!({"fence": fence}).to_string()
        )
        .status,
        200
    );
    d.wait_until("reuse is released", |d| {
        d.get("/v1/runs/reuse").body["state"] == "released"
    });
    assert!(alive(pid), "the stranger was signalled");
    assert_eq!(
        d.get("/v1/status").body["reaper"]["reused_pids_protected"],
        1
    );
    stranger.kill().unwrap();
    let _ = stranger.wait();
}

#[test]
fn a_run_may_ask_for_its_own_stop_grace() {
    // The host's grace is 30 s; this run asks for 1 s.
    let d = Daemon::start(&["--slots-max", "2", "--stop-grace", "30s"]);
    let r = d.post("/v1/runs", &json!({"run_id": "quick", "project": "q", "resources": {"cpu_millis": 100}, "stop_grace_s": 1}).to_string());
    assert_eq!(r.status, 201, "{:?}", r.body);
    let fence = r.body["fence"].as_u64().unwrap();
    let mut child = Command::new("sh")
        .args(["-c", "trap '' TERM; sleep 100; sleep 100"])
        .process_group(0)
        .spawn()
        .unwrap();
    assert_eq!(
        d.post(
            "/v1/runs/quick/processes",
            &json!({"fence": fence, "pid": child.id()}).to_string()
        )
        .status,
        201
    );
    std::thread::sleep(Duration::from_millis(200));
    let t = Instant::now();
    d.post(
        "/v1/runs/quick/release",
        &json!({"fence": fence}).to_string(),
    );
    d.wait_until("quick is released", |d| {
        d.get("/v1/runs/quick").body["state"] == "released"
    });
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(10),
        "{took:?}"
    );
    assert!(
        killed_within(&mut child, Duration::from_secs(5)),
        "quick is released but its tree lives on"
    );
    let bad = d.post(
        "/v1/runs",
        &json!({"project": "q", "stop_grace_s": 3601}).to_string(),
    );
    assert_eq!(bad.status, 400);
    assert_eq!(bad.body["error"]["details"]["field"], "stop_grace_s");
}

#[test]
fn a_double_forked_daemon_is_stopped_by_the_cgroup_and_missed_by_the_fallback() {
    // Without a writable cgroup2 tree only the fallback half runs (said, or a failure
    // under BERTH_REQUIRE_CGROUPS=1).
    let cgroups = berth_proc::testing::cgroups(
        "a_double_forked_daemon_is_stopped_by_the_cgroup_and_missed_by_the_fallback",
    );
    for use_cgroups in [true, false] {
        let mut args = vec!["--slots-max", "2", "--stop-grace", "1s"];
        if !use_cgroups {
            args.push("--no-cgroups");
        }
        let d = Daemon::start(&args);
        let dir = tempfile::tempdir().unwrap();
        let pidfile = dir.path().join("daemon");
        // CMD double-forks a daemon (setsid, reparented to init) and exits at once.
        let st = d
            .cli()
            .args([
                "run",
                "--project",
                "p",
                "--run-id",
                "df",
                "--cpus",
                "0.1",
                "--",
                "sh",
                "-c",
            ])
            .arg(format!(
                "setsid sh -c 'echo $$ > {}; exec sleep 100' & sleep 0.3; exit 0",
                pidfile.display()
            ))
            .stderr(Stdio::null())
            .status()
            .unwrap();
        assert!(st.success());
        let pid = wait_pids(&pidfile, 1)[0];
        d.wait_until("df is released", |d| {
            d.get("/v1/runs/df").body["state"] == "released"
        });
        std::thread::sleep(Duration::from_millis(300));
        // Where this test can make groups, so can the daemon (same user, same tree).
        let expect_cgroup = use_cgroups && cgroups;
        if expect_cgroup {
            assert!(
                !alive(pid),
                "the cgroup should have caught the double-forked daemon"
            );
        } else if !use_cgroups {
            // The documented limit of the process-group fallback (docs/design.md).
            assert!(
                alive(pid),
                "the fallback is documented not to see a double-forked daemon"
            );
        }
        if alive(pid) {
            let _ = rustix::process::kill_process(
                rustix::process::Pid::from_raw(pid).unwrap(),
                rustix::process::Signal::KILL,
            );
        }
    }
}

/// P2: a tree berth cannot stop is never reported gone. Here the daemon runs as
/// `nobody` and the registered process is root's, so every signal is refused, as it
/// would be for a process stuck in the kernel: the run degrades, names the survivor and
/// keeps its capacity counted; once the survivor is gone, the retry ends the run.
#[test]
fn a_tree_that_outlives_sigkill_degrades_the_run_and_names_the_survivors() {
    // Starting the daemon as another user needs root.
    if !berth_proc::testing::root(
        "a_tree_that_outlives_sigkill_degrades_the_run_and_names_the_survivors",
    ) {
        return;
    }
    const NOBODY: u32 = 65534;
    let d = Daemon::start_as(NOBODY, &["--slots-max", "2", "--no-cgroups"]);
    // The registration rule lets a token register only what its uid could signal;
    // an admin may make a token that acts for root, whose processes this daemon (as
    // `nobody`) cannot signal: exactly the stuck tree this test needs. The run is that
    // token's own (S9: a uid-bound token registers only into its own user's runs).
    let t = d.post(
        "/v1/tokens",
        &json!({"scope": "operator", "uid": 0}).to_string(),
    );
    assert_eq!(t.status, 201, "{:?}", t.body);
    let root_token = t.body["token"].as_str().unwrap().to_string();
    let body = json!({"run_id": "stubborn", "project": "stubborn",
        "resources": {"cpu_millis": 100}, "ttl_s": 60, "stop_grace_s": 1});
    let r = d.call_as(
        Some(&root_token),
        "POST",
        "/v1/runs",
        Some(&body.to_string()),
    );
    assert_eq!(r.status, 201, "{:?}", r.body);
    let fence = r.body["fence"].as_u64().unwrap();
    let mut survivor = Command::new("sleep").arg("60").spawn().unwrap();
    let pid = survivor.id() as i32;
    let body = json!({"fence": fence, "pid": pid}).to_string();
    let reg = d.call_as(
        Some(&root_token),
        "POST",
        "/v1/runs/stubborn/processes",
        Some(&body),
    );
    assert_eq!(reg.status, 201, "{:?}", reg.body);
    let rel = d.post(
        "/v1/runs/stubborn/release",
        &json!({"fence": fence}).to_string(),
    );
    assert_eq!(rel.status, 200, "{:?}", rel.body);
    // TERM, 1 s of grace, KILL, then the kill wait: all refused.
    d.wait_until("the run degrades", |d| {
        d.get("/v1/runs/stubborn").body["state"] == "degraded"
    });
    let run = d.get("/v1/runs/stubborn").body;
    assert_eq!(run["survivors"], json!([pid]), "{run}");
    assert!(alive(pid), "berth reported a survivor that is gone");
    let status = d.get("/v1/status").body;
    assert_eq!(status["degraded"], 1, "{status}");
    let cpu = status["resources"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "cpu_millis")
        .unwrap()
        .clone();
    assert_eq!(
        cpu["committed"], 100,
        "capacity of a degraded run stays counted: {status}"
    );
    // The survivor goes away; the next retry (after its backoff) finds the tree gone.
    survivor.kill().unwrap();
    survivor.wait().unwrap();
    d.wait_until("the retry releases the run", |d| {
        d.get("/v1/runs/stubborn").body["state"] == "released"
    });
    let run = d.get("/v1/runs/stubborn").body;
    assert_eq!(run["survivors"], json!([]), "{run}");
    assert_eq!(d.get("/v1/status").body["degraded"], 0);
}

/// Regression: every daemon on a host put run `r`'s processes in the same cgroup
/// (`.../berth/<digest of r>`), so one daemon stopping its run `r` killed another
/// daemon's run `r` (seen as a rare crash-loop failure while tests ran side by side).
#[test]
fn two_daemons_with_the_same_run_id_never_stop_each_others_processes() {
    let a = Daemon::start(&["--slots-max", "2", "--stop-grace", "1s"]);
    let b = Daemon::start(&["--slots-max", "2", "--stop-grace", "1s"]);
    let mut children = Vec::new();
    for d in [&a, &b] {
        let fence = acquire(d, "same", 60);
        let child = Command::new("sleep")
            .arg("3600")
            .process_group(0)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let reg = d.post(
            "/v1/runs/same/processes",
            &json!({"fence": fence, "pid": child.id()}).to_string(),
        );
        assert_eq!(reg.status, 201, "{:?}", reg.body);
        children.push((fence, child));
    }
    let rel = a.post(
        "/v1/runs/same/release",
        &json!({"fence": children[0].0}).to_string(),
    );
    assert_eq!(rel.status, 200, "{:?}", rel.body);
    a.wait_until("a's run is released", |d| {
        d.get("/v1/runs/same").body["state"] == "released"
    });
    assert!(
        killed_within(&mut children[0].1, Duration::from_secs(5)),
        "a released its run but did not stop its process"
    );
    // Past a's grace and kill: b's process is untouched and b's run still granted.
    std::thread::sleep(Duration::from_millis(1500));
    assert!(alive(children[1].1.id() as i32), "a stopped b's process");
    assert_eq!(b.get("/v1/runs/same").body["state"], "granted");
    let _ = children[1].1.kill();
    let _ = children[1].1.wait();
}

/// P2 with cgroups: a tree that keeps moving to new pids (each process ignores TERM,
/// starts its successor and exits at once) is stopped and the run ends cleanly. (Here
/// the per-pid KILL rounds also catch it; that `cgroup.kill` alone ends a group that
/// per-pid signals miss is pinned in berth-proc's
/// `the_cgroup_kill_ends_a_group_that_per_pid_signals_miss`.)
#[test]
fn a_pid_hopping_tree_is_stopped() {
    const TEST: &str = "a_pid_hopping_tree_is_stopped";
    if !berth_proc::testing::cgroups(TEST) {
        return;
    }
    let d = Daemon::start(&["--slots-max", "2", "--stop-grace", "1s"]);
    let dir = tempfile::tempdir().unwrap();
    let hop = dir.path().join("hop.sh");
    // At most 30,000 hops (tens of seconds): an escaped hopper ends by itself.
    std::fs::write(
        &hop,
        "trap '' TERM\n[ \"$1\" -gt 0 ] || exit 0\nsh \"$0\" $(($1 - 1)) \"$2\" &\nexit 0\n",
    )
    .unwrap();
    let token = format!("hop-{}", std::process::id());
    let hoppers = || -> Vec<i32> {
        std::fs::read_dir("/proc")
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&token))
                    && alive(*pid)
            })
            .collect()
    };
    let st = d
        .cli()
        .args([
            "run",
            "--project",
            "p",
            "--run-id",
            "hop",
            "--cpus",
            "0.1",
            "--",
            "sh",
        ])
        .arg(&hop)
        .args(["30000", &token])
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(st.success());
    d.wait_until("hop has ended", |d| {
        matches!(
            d.get("/v1/runs/hop").body["state"].as_str(),
            Some("released" | "degraded")
        )
    });
    let run = d.get("/v1/runs/hop").body;
    // Whatever happened, no hopper outlives the test.
    let end = Instant::now() + Duration::from_secs(3);
    let mut left = hoppers();
    while !left.is_empty() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(50));
        left = hoppers();
    }
    let escaped = left.clone();
    let until = Instant::now() + Duration::from_secs(60);
    while !left.is_empty() && Instant::now() < until {
        for pid in &left {
            if let Some(p) = rustix::process::Pid::from_raw(*pid) {
                let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
            }
        }
        left = hoppers();
    }
    assert_eq!(run["state"], "released", "{run}");
    assert!(
        escaped.is_empty(),
        "hoppers alive after the release: {escaped:?}"
    );
}
