//! `berth run` against a daemon that misbehaves (issue 33 items 3 and 9): frozen,
//! answering 503, letting a wait run out. Each ends in a documented exit code and
//! one line that says why, and CMD never outlives a lease berth run cannot confirm.

mod common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::Daemon;
use serde_json::json;

/// Item 9: with the daemon frozen (SIGSTOP), a renew's connection is accepted and
/// never answered. Every request of berth run has a total deadline inside the lease:
/// when the lease cannot be confirmed before its expiry minus the stop grace, berth
/// run stops CMD's process group itself and exits 75 with one line. (Before: the
/// renew sat in `recvfrom` for 20 s of a 6 s ttl while CMD kept running.)
#[test]
fn issue_33_a_frozen_daemon_cannot_keep_cmd_running_past_its_lease() {
    let d = Daemon::start(&["--slots-max", "2"]);
    let dir = tempfile::tempdir().unwrap();
    let pidfile = dir.path().join("pid");
    let mut child = d
        .cli()
        .args([
            "run",
            "--project",
            "p",
            "--run-id",
            "frozen",
            "--cpus",
            "0.1",
            "--ttl",
            "6s",
            "--",
            "sh",
            "-c",
        ])
        .arg(format!("echo $$ > {}; exec sleep 60", pidfile.display()))
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let cmd_pid = common::wait_pids(&pidfile, 1)[0];
    let daemon_pid = d.child.as_ref().unwrap().id() as i32;
    let frozen_at = Instant::now();
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(daemon_pid).unwrap(),
        rustix::process::Signal::STOP,
    )
    .unwrap();
    // 6 s of lease at most, then berth run's own grace: well inside 10 s.
    let ended = common::killed_within(&mut child, Duration::from_secs(10));
    let took = frozen_at.elapsed();
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(daemon_pid).unwrap(),
        rustix::process::Signal::CONT,
    )
    .unwrap();
    assert!(
        ended,
        "berth run was still running {took:?} after the daemon froze"
    );
    let out = child.wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(75), "berth run said: {said}");
    assert!(!common::alive(cmd_pid), "CMD outlived the lease");
    let lines: Vec<&str> = said.lines().filter(|l| l.contains("lease")).collect();
    assert_eq!(lines.len(), 1, "one line says why: {said}");
    assert!(lines[0].contains("could not confirm"), "{said}");
}

/// Item 9: a 503 is "not now" (here: the host drains), waited out within --wait
/// with the reason on the waiting line; the run is admitted when it ends. (Before:
/// exit 69 at once.)
#[test]
fn issue_33_a_503_is_waited_out_within_wait_not_a_refusal() {
    let d = Daemon::start(&["--slots-max", "2"]);
    let r = d.post("/v1/drain", &json!({"reason": "maintenance"}).to_string());
    assert!(r.status < 300, "{}", r.body);
    let child = d
        .cli()
        .args([
            "run",
            "--project",
            "p",
            "--run-id",
            "patient",
            "--cpus",
            "0.1",
            "--wait",
            "60s",
            "--",
            "sh",
            "-c",
            "exit 3",
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(2));
    let r = d.call("DELETE", "/v1/drain", None);
    assert!(r.status < 300, "{}", r.body);
    let out = child.wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(3),
        "admitted once the drain ended: {said}"
    );
    assert!(
        said.contains("draining"),
        "the waiting line said why: {said}"
    );

    // A 503 that lasts past --wait is a timeout (75) that names it.
    let r = d.post("/v1/drain", &json!({"reason": "maintenance"}).to_string());
    assert!(r.status < 300, "{}", r.body);
    let out = d
        .cli()
        .args(["run", "--project", "p", "--wait", "1s", "--", "true"])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(75), "{said}");
    assert!(said.contains("draining"), "{said}");
}

/// Item 3: a run whose wait runs out is told what it was last waiting on, in the
/// 410 `expired` answer (`details.reason`) and in berth run's last line. (Before:
/// `reason: null`.)
#[test]
fn issue_33_an_expired_wait_says_what_it_was_waiting_on() {
    let d = Daemon::start(&["--slots-max", "2"]);
    let h = d.post(
        "/v1/runs",
        &json!({"run_id": "holder", "project": "p", "singletons": ["db"],
                "resources": {"cpu_millis": 10}})
        .to_string(),
    );
    assert_eq!(h.status, 201, "{}", h.body);
    let out = d
        .cli()
        .args([
            "run",
            "--project",
            "q",
            "--run-id",
            "late",
            "--singleton",
            "db",
            "--cpus",
            "0.1",
            "--wait",
            "1s",
            "--",
            "true",
        ])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(75), "{said}");
    let last = said.trim_end().lines().last().unwrap_or("");
    assert!(last.contains("db"), "the last line names the key: {said}");
    // The run remembers it.
    let r = d.get("/v1/runs/late");
    assert_eq!(r.body["state"], "expired", "{}", r.body);
    assert!(
        r.body["reason"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("db"),
        "{}",
        r.body
    );
    // An acquire's own 410 carries it in `details.reason`.
    let out = d
        .cli()
        .args([
            "acquire",
            "--json",
            "--project",
            "q",
            "--singleton",
            "db",
            "--cpus",
            "0.1",
            "--wait",
            "1s",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(75));
    let body: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let reason = &body["error"]["details"]["reason"];
    assert!(reason["code"].is_string(), "{body}");
    assert!(
        reason["message"].as_str().unwrap_or("").contains("db"),
        "{body}"
    );
}

/// Item 7: `BERTH_LEASE_EXPIRES_AT` keeps its first value; `$BERTH_LEASE_FILE` is
/// rewritten on each renew (lines a shell can source), and removed at the end.
#[test]
fn issue_33_the_lease_file_follows_every_renew() {
    let d = Daemon::start(&["--slots-max", "2"]);
    let out = d
        .cli()
        .args([
            "run",
            "--project",
            "p",
            "--run-id",
            "filed",
            "--cpus",
            "0.1",
            "--ttl",
            "3s",
            "--",
            "sh",
            "-c",
            ". \"$BERTH_LEASE_FILE\"; echo \"first=$BERTH_LEASE_EXPIRES_AT\"; sleep 2.5; \
             . \"$BERTH_LEASE_FILE\"; echo \"then=$BERTH_LEASE_EXPIRES_AT run=$BERTH_RUN_ID\"; \
             echo \"file=$BERTH_LEASE_FILE\"",
        ])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{said} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let value = |key: &str| -> String {
        said.lines()
            .find_map(|l| l.strip_prefix(key))
            .unwrap_or_else(|| panic!("no {key} in {said}"))
            .split(' ')
            .next()
            .unwrap()
            .to_string()
    };
    let (first, then) = (value("first="), value("then="));
    assert!(first.ends_with('Z') && then.ends_with('Z'), "{said}");
    assert!(then > first, "the file follows the renewals: {said}");
    assert!(said.contains("run=filed"), "{said}");
    let file = value("file=");
    assert!(
        !std::path::Path::new(&file).exists(),
        "{file} is removed at the end"
    );
}

/// Item 7: `berth run --thread KEY` works in the thread (its workspace is the
/// thread's), and CPUs are one unit everywhere: `--cpus 500m` is half a CPU, as
/// `--cpu-total 4` is four.
#[test]
fn issue_33_berth_run_takes_a_thread_and_cpus_in_one_unit() {
    let d = Daemon::start(&[
        "--slots-max",
        "2",
        "--cpu-total",
        "3000m",
        "--cpu-reserve",
        "0.5",
    ]);
    let status = d.get("/v1/status").body;
    let cpu = status["resources"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "cpu_millis")
        .unwrap()
        .clone();
    assert_eq!(
        (cpu["total"].as_u64(), cpu["reserve"].as_u64()),
        (Some(3000), Some(500)),
        "{status}"
    );
    let out = d
        .cli()
        .args([
            "run",
            "--project",
            "p",
            "--run-id",
            "threaded",
            "--thread",
            "conv-1",
            "--cpus",
            "500m",
            "--",
            "sh",
            "-c",
            "echo \"thread=$BERTH_THREAD ws=$BERTH_WORKSPACE\"",
        ])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(said.contains("thread=conv-1"), "{said}");
    let t = d.get("/v1/threads/conv-1").body;
    let ws = t["workspace"].as_str().unwrap_or("none");
    assert!(
        said.contains(&format!("ws={ws}")),
        "the thread's workspace: {said} {t}"
    );
    let r = d.get("/v1/runs/threaded").body;
    assert_eq!(r["claim"]["resources"]["cpu_millis"], 500, "{r}");
    // A size's unit is what it says: 4GB is decimal, a bare 4G is refused.
    let out = d
        .cli()
        .args(["run", "--memory", "4G", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("4GiB") && said.contains("4GB"), "{said}");
}
