//! Black-box tests of the HTTP API against the real daemon.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::Daemon;
use serde_json::{json, Value};

fn acquire(d: &Daemon, body: Value) -> common::Resp {
    d.post("/v1/runs", &body.to_string())
}

#[test]
fn stale_fence_idempotent_release_gone_after_release_and_impossible_at_once() {
    let d = Daemon::start(&["--slots-max", "2"]);
    let a = acquire(
        &d,
        json!({"run_id": "a", "project": "p", "resources": {"memory": 1 << 30, "cpu_millis": 500}}),
    );
    assert_eq!(a.status, 201, "{:?}", a.body);
    assert_eq!(a.body["state"], "granted");
    let fence = a.body["fence"].as_u64().unwrap();
    assert!(fence >= 1);
    // L7: the same body re-attaches to the same lease and fence; another body conflicts.
    let again = acquire(
        &d,
        json!({"run_id": "a", "project": "p", "resources": {"memory": 1 << 30, "cpu_millis": 500}}),
    );
    assert_eq!(
        (again.status, again.body["fence"].as_u64()),
        (201, Some(fence))
    );
    let other = acquire(&d, json!({"run_id": "a", "project": "p"}));
    assert_eq!((other.status, other.code()), (409, "conflict"));
    // L2: a wrong fence is 409 stale_fence.
    let stale = d.post("/v1/runs/a/renew", &json!({"fence": fence + 1}).to_string());
    assert_eq!(
        (stale.status, stale.code()),
        (409, "stale_fence"),
        "{:?}",
        stale.body
    );
    let stale = d.post(
        "/v1/runs/a/release",
        &json!({"fence": fence + 7}).to_string(),
    );
    assert_eq!((stale.status, stale.code()), (409, "stale_fence"));
    let ok = d.post(
        "/v1/runs/a/renew",
        &json!({"fence": fence, "ttl_s": 120}).to_string(),
    );
    assert_eq!(ok.status, 200);
    // L5: release is idempotent for the same fence.
    let r1 = d.post("/v1/runs/a/release", &json!({"fence": fence}).to_string());
    let r2 = d.post("/v1/runs/a/release", &json!({"fence": fence}).to_string());
    assert_eq!(
        (r1.status, r2.status),
        (200, 200),
        "{:?} {:?}",
        r1.body,
        r2.body
    );
    assert_eq!(r2.body["state"], "released");
    // L4: renew after release is 410 gone.
    let gone = d.post("/v1/runs/a/renew", &json!({"fence": fence}).to_string());
    assert_eq!((gone.status, gone.code()), (410, "gone"));
    assert_eq!(gone.body["error"]["details"]["state"], "released");
    // A3: refused at once, naming the resource, request and maximum.
    let t = Instant::now();
    let imp = acquire(
        &d,
        json!({"project": "p", "resources": {"memory": 64u64 << 30}, "wait_s": 600}),
    );
    assert_eq!((imp.status, imp.code()), (422, "capacity_impossible"));
    assert!(t.elapsed() < Duration::from_secs(5));
    assert_eq!(imp.body["error"]["details"]["resource"], "memory");
    assert_eq!(imp.body["error"]["details"]["max"], 7u64 << 30);
    // L8: fence check.
    let fc = d.get(&format!("/v1/fences/check?run_id=a&fence={fence}"));
    assert_eq!(fc.body["current"], false);
    assert_eq!(fc.body["state"], "released");
    let b = acquire(
        &d,
        json!({"run_id": "b", "project": "p", "resources": {"cpu_millis": 100}}),
    );
    let bf = b.body["fence"].as_u64().unwrap();
    assert!(bf > fence);
    let fc = d.get(&format!("/v1/fences/check?run_id=b&fence={bf}"));
    assert_eq!(fc.body["current"], true);
}

#[test]
fn tokens_missing_wrong_and_under_scoped() {
    let d = Daemon::start(&[]);
    let none = d.call_as(None, "GET", "/v1/status", None);
    assert_eq!((none.status, none.code()), (401, "unauthorized"));
    let wrong = d.call_as(Some("berth_not_a_token"), "GET", "/v1/status", None);
    assert_eq!((wrong.status, wrong.code()), (401, "unauthorized"));
    let read = d.post("/v1/tokens", r#"{"scope":"read"}"#);
    assert_eq!(read.status, 201, "{:?}", read.body);
    let read_token = read.body["token"].as_str().unwrap().to_string();
    let op = d.post("/v1/tokens", r#"{"scope":"operator"}"#);
    let op_token = op.body["token"].as_str().unwrap().to_string();
    // read: GET only.
    assert_eq!(
        d.call_as(Some(&read_token), "GET", "/v1/status", None)
            .status,
        200
    );
    let denied = d.call_as(
        Some(&read_token),
        "POST",
        "/v1/runs",
        Some(r#"{"project":"p"}"#),
    );
    assert_eq!((denied.status, denied.code()), (403, "forbidden"));
    // operator: runs, but not tokens.
    let ok = d.call_as(
        Some(&op_token),
        "POST",
        "/v1/runs",
        Some(r#"{"project":"p","resources":{"cpu_millis":10}}"#),
    );
    assert_eq!(ok.status, 201, "{:?}", ok.body);
    let denied = d.call_as(
        Some(&op_token),
        "POST",
        "/v1/tokens",
        Some(r#"{"scope":"admin"}"#),
    );
    assert_eq!(denied.status, 403);
    // Tokens are stored hashed: the ledger file does not contain them.
    let ledger = std::fs::read(d.state.join("ledger.db")).unwrap();
    let wal = std::fs::read(d.state.join("ledger.db-wal")).unwrap_or_default();
    for t in [&read_token, &op_token, &d.token] {
        let needle = t.as_bytes();
        assert!(
            !ledger.windows(needle.len()).any(|w| w == needle)
                && !wal.windows(needle.len()).any(|w| w == needle)
        );
    }
    // The admin token file is 0600.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(d.state.join("admin.token"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
}

#[test]
fn insecure_no_auth_is_refused_off_loopback() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(common::BERTH)
        .args([
            "serve",
            "--state-dir",
            dir.path().to_str().unwrap(),
            "--listen",
            "0.0.0.0:0",
            "--insecure-no-auth",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("loopback"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Raw HTTP, for bodies no well-behaved client would send.
fn raw(d: &Daemon, method: &str, path: &str, headers: &str, body: &[u8]) -> (u16, Value) {
    let mut s = TcpStream::connect(("127.0.0.1", d.port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Length: {}\r\nConnection: close\r\n{headers}\r\n",
        d.token,
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    let _ = s.write_all(body);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).to_string();
    let status: u16 = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text.split("\r\n\r\n").nth(1).unwrap_or("");
    (
        status,
        serde_json::from_str(body).unwrap_or(Value::String(body.to_string())),
    )
}

/// Acquire bodies the API must refuse: not JSON, not an object, every field broken,
/// ids and labels over their rules, a body over its size.
fn bad_acquire_bodies() -> Vec<String> {
    let big = format!(
        r#"{{"project":"p","labels":{{"x":"{}"}}}}"#,
        "y".repeat(70 * 1024)
    );
    let long_id = "r".repeat(129);
    let many_labels: serde_json::Map<String, Value> =
        (0..33).map(|i| (format!("k{i}"), json!("v"))).collect();
    let bodies: Vec<String> = vec![
        "".into(),
        "{".into(),
        "[]".into(),
        "null".into(),
        "42".into(),
        r#"{}"#.into(),
        r#"{"project":""}"#.into(),
        r#"{"project":"-x"}"#.into(),
        r#"{"project":"a b"}"#.into(),
        r#"{"project":7}"#.into(),
        r#"{"project":"p","unknown":1}"#.into(),
        r#"{"project":"p","class":"wizard"}"#.into(),
        r#"{"project":"p","priority":"urgent"}"#.into(),
        r#"{"project":"p","ttl_s":0}"#.into(),
        r#"{"project":"p","ttl_s":86401}"#.into(),
        r#"{"project":"p","ttl_s":-5}"#.into(),
        r#"{"project":"p","ttl_s":1.5}"#.into(),
        r#"{"project":"p","ttl_s":"10"}"#.into(),
        r#"{"project":"p","wait_s":86401}"#.into(),
        r#"{"project":"p","wait_s":99999999999999999999999}"#.into(),
        r#"{"project":"p","resources":{"memory":-1}}"#.into(),
        r#"{"project":"p","resources":{"memory":"2GiB"}}"#.into(),
        r#"{"project":"p","resources":{"slots":0}}"#.into(),
        r#"{"project":"p","resources":{"fpga":1}}"#.into(),
        r#"{"project":"p","resources":[]}"#.into(),
        r#"{"project":"p","singletons":["a/b"]}"#.into(),
        r#"{"project":"p","singletons":"db"}"#.into(),
        r#"{"project":"p","worktree":"relative/path"}"#.into(),
        r#"{"project":"p","worktree":"/definitely/not/here"}"#.into(),
        format!(r#"{{"project":"p","run_id":"{long_id}"}}"#),
        r#"{"project":"p","run_id":"bad/id"}"#.into(),
        r#"{"project":"p","labels":{"k":5}}"#.into(),
        json!({"project": "p", "labels": many_labels}).to_string(),
        r#"{"project":"p","budget":{"scope":"s","harness":"h"}}"#.into(),
        r#"{"project":"p","project":"q"}"#.into(),
        big,
    ];
    bodies
}

/// Requests the API must refuse with a 4xx naming the rule, changing nothing: bodies
/// that are not JSON or not the request, every field broken, stale or foreign fences,
/// bad query strings (`fence` is the live run `held`'s).
fn malformed_cases(fence: u64) -> Vec<(&'static str, String, String)> {
    let acquires = bad_acquire_bodies().into_iter();
    let mut cases: Vec<_> = acquires
        .map(|b| ("POST", "/v1/runs".to_string(), b))
        .collect();
    cases.extend(vec![
        (
            "POST",
            "/v1/runs/held/renew".into(),
            r#"{"fence":0}"#.into(),
        ),
        (
            "POST",
            "/v1/runs/held/renew".into(),
            r#"{"fence":9007199254740992}"#.into(),
        ),
        (
            "POST",
            "/v1/runs/held/renew".into(),
            r#"{"fence":"1"}"#.into(),
        ),
        (
            "POST",
            "/v1/runs/held/renew".into(),
            format!(r#"{{"fence":{fence},"ttl_s":0}}"#),
        ),
        (
            "POST",
            "/v1/runs/held/renew".into(),
            format!(r#"{{"fence":{fence},"extra":true}}"#),
        ),
        ("POST", "/v1/runs/held/release".into(), r#"{}"#.into()),
        (
            "POST",
            "/v1/runs/held/release".into(),
            r#"{"fence":-1}"#.into(),
        ),
        (
            "POST",
            "/v1/runs/held/release".into(),
            format!(r#"{{"fence":{}}}"#, fence + 1),
        ),
        (
            "POST",
            "/v1/runs/nobody/release".into(),
            r#"{"fence":1}"#.into(),
        ),
        ("DELETE", "/v1/runs/held".into(), "".into()),
        ("DELETE", "/v1/runs/held?fence=abc".into(), "".into()),
        ("DELETE", "/v1/runs/held?fence=1&x=2".into(), "".into()),
        ("GET", "/v1/runs/bad%2Fid".into(), "".into()),
        ("GET", "/v1/runs/bad%ff%fe".into(), "".into()),
        ("GET", "/v1/runs?limit=%zz".into(), "".into()),
        ("GET", "/v1/runs?limit=0".into(), "".into()),
        ("GET", "/v1/fences/check?run_id=held".into(), "".into()),
        (
            "GET",
            "/v1/fences/check?run_id=held&fence=x".into(),
            "".into(),
        ),
        ("GET", "/v1/nope".into(), "".into()),
        ("PUT", "/v1/runs".into(), "{}".into()),
        ("POST", "/v1/tokens".into(), r#"{"scope":"god"}"#.into()),
    ]);
    cases
}

#[test]
fn malformed_requests_get_4xx_with_a_code_and_change_nothing() {
    let d = Daemon::start(&["--slots-max", "2"]);
    let held = acquire(
        &d,
        json!({"run_id": "held", "project": "p", "resources": {"cpu_millis": 100}}),
    );
    let fence = held.body["fence"].as_u64().unwrap();
    let before_status = d.get("/v1/status").body;
    let before_runs = d.get("/v1/runs").body;
    let cases = malformed_cases(fence);
    assert!(cases.len() >= 40);
    for (method, path, body) in &cases {
        let r = d.call(method, path, Some(body));
        assert!(
            (400..500).contains(&r.status),
            "{method} {path} {body:.80} -> {} {:?}",
            r.status,
            r.body
        );
        assert!(
            !r.code().is_empty(),
            "{method} {path} {body:.80}: no error code in {:?}",
            r.body
        );
        if r.status == 400 {
            let msg = r.body["error"]["message"].as_str().unwrap_or("");
            assert!(
                msg.contains(':'),
                "{method} {path}: message should name the field: {msg}"
            );
        }
    }
    // Invalid UTF-8 and a lying Content-Type.
    let (status, body) = raw(
        &d,
        "POST",
        "/v1/runs",
        "Content-Type: application/json\r\n",
        b"{\"project\":\"\xff\xfe\"}",
    );
    assert_eq!(status, 400, "{body:?}");
    assert_eq!(body["error"]["details"]["field"], "body");
    // Still serving, nothing changed (no new run, no fence issued, the holder intact).
    assert_eq!(d.get("/v1/status").body, before_status);
    assert_eq!(d.get("/v1/runs").body, before_runs);
    assert_eq!(
        d.post("/v1/runs/held/renew", &json!({"fence": fence}).to_string())
            .status,
        200
    );
}

#[test]
fn a_dropped_long_poll_leaves_the_queue_at_once() {
    let d = Daemon::start(&["--slots-max", "1"]);
    let h = acquire(
        &d,
        json!({"run_id": "holder", "project": "a", "resources": {"cpu_millis": 100}}),
    );
    assert_eq!(h.status, 201);
    // A raw long-poll that we then drop.
    let mut s = TcpStream::connect(("127.0.0.1", d.port)).unwrap();
    let body =
        json!({"run_id": "waiter", "project": "b", "resources": {"cpu_millis": 100}}).to_string();
    write!(
        s,
        "POST /v1/runs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        d.token,
        body.len()
    )
    .unwrap();
    d.wait_until("the waiter is queued", |d| {
        d.get("/v1/runs/waiter").body["state"] == "queued"
    });
    drop(s);
    d.wait_until("the waiter is cancelled", |d| {
        d.get("/v1/runs/waiter").body["state"] == "cancelled"
    });
}

#[test]
fn ndjson_stream_reports_position_and_reason_then_the_grant() {
    let d = Daemon::start(&["--slots-max", "1"]);
    let h = acquire(
        &d,
        json!({"run_id": "holder", "project": "acme/web", "resources": {"cpu_millis": 100}}),
    );
    let fence = h.body["fence"].as_u64().unwrap();
    let url = d.url.clone();
    let token = d.token.clone();
    let reader = std::thread::spawn(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .into();
        let resp = agent
            .post(format!("{url}/v1/runs"))
            .header("Authorization", &format!("Bearer {token}"))
            .header("Accept", "application/x-ndjson")
            .send(
                json!({"run_id": "w", "project": "acme/web", "resources": {"cpu_millis": 100}})
                    .to_string(),
            )
            .unwrap();
        let text = resp.into_body().read_to_string().unwrap();
        text.lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .collect::<Vec<_>>()
    });
    d.wait_until("w is queued", |d| {
        d.get("/v1/runs/w").body["state"] == "queued"
    });
    let q = d.get("/v1/runs/w").body;
    assert_eq!(q["position"], 1);
    assert_eq!(q["reason"]["code"], "key.exclusive");
    assert!(q["reason"]["message"].as_str().unwrap().contains("holder"));
    d.post(
        "/v1/runs/holder/release",
        &json!({"fence": fence}).to_string(),
    );
    let lines = reader.join().unwrap();
    assert_eq!(lines.first().unwrap()["event"], "queued", "{lines:?}");
    assert_eq!(lines.first().unwrap()["reason"]["code"], "key.exclusive");
    let last = lines.last().unwrap();
    assert_eq!(last["event"], "granted");
    assert!(last["lease"]["fence"].as_u64().unwrap() > fence);
    assert!(last["lease"]["env"]["BERTH_WORKSPACE"].is_string());
}

#[test]
fn a_run_that_waits_past_its_deadline_expires() {
    let d = Daemon::start(&["--slots-max", "1"]);
    acquire(
        &d,
        json!({"run_id": "holder", "project": "a", "resources": {"cpu_millis": 100}}),
    );
    let t = Instant::now();
    let r = acquire(
        &d,
        json!({"run_id": "late", "project": "b", "wait_s": 1, "resources": {"cpu_millis": 100}}),
    );
    assert_eq!((r.status, r.code()), (410, "expired"), "{:?}", r.body);
    assert!(t.elapsed() >= Duration::from_millis(900));
    let now0 = acquire(
        &d,
        json!({"run_id": "now", "project": "c", "wait_s": 0, "resources": {"cpu_millis": 100}}),
    );
    assert_eq!((now0.status, now0.code()), (410, "expired"));
    assert_eq!(
        now0.body["error"]["details"]["reason"]["code"],
        "capacity.slots"
    );
}

#[test]
fn the_worktree_contract_shapes_the_claim() {
    let d = Daemon::start(&["--slots-max", "4"]);
    let wt = tempfile::tempdir().unwrap();
    let path = wt.path().to_str().unwrap().to_string();
    // No contract: serial, no singletons.
    let r = acquire(
        &d,
        json!({"run_id": "c0", "project": "web", "worktree": path, "resources": {"cpu_millis": 10}}),
    );
    assert_eq!(r.status, 201);
    assert_eq!(r.body["env"]["BERTH_WORKTREE"], path.as_str());
    d.post(
        "/v1/runs/c0/release",
        &json!({"fence": r.body["fence"]}).to_string(),
    );
    // Singletons from the contract become exclusive keys (C2).
    std::fs::write(
        wt.path().join(".berth.toml"),
        "concurrency = \"parallel\"\nsingletons = [\"postgres\"]\n",
    )
    .unwrap();
    let r = acquire(
        &d,
        json!({"run_id": "c1", "project": "web", "worktree": path, "resources": {"cpu_millis": 10}}),
    );
    assert_eq!(r.status, 201, "{:?}", r.body);
    let keys: Vec<String> = r.body["claim"]["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| {
            format!(
                "{}={}",
                k["key"].as_str().unwrap(),
                k["mode"].as_str().unwrap()
            )
        })
        .collect();
    assert_eq!(
        keys,
        vec![
            "project:web:runtime=exclusive",
            "singleton:postgres=exclusive"
        ]
    );
    // Another project's run wanting the same singleton waits for it.
    let w = acquire(
        &d,
        json!({"run_id": "c2", "project": "api", "singletons": ["postgres"], "wait_s": 0, "resources": {"cpu_millis": 10}}),
    );
    assert_eq!(w.status, 410);
    assert_eq!(
        w.body["error"]["details"]["reason"]["code"],
        "key.exclusive"
    );
    // disabled: 422; invalid: 400 naming the file and the key.
    std::fs::write(
        wt.path().join(".berth.toml"),
        "concurrency = \"disabled\"\n",
    )
    .unwrap();
    let r = acquire(&d, json!({"project": "web", "worktree": path}));
    assert_eq!((r.status, r.code()), (422, "contract_disabled"));
    std::fs::write(wt.path().join(".berth.toml"), "concurrency = \"maybe\"\n").unwrap();
    let r = acquire(&d, json!({"project": "web", "worktree": path}));
    assert_eq!(r.status, 400);
    assert!(
        r.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains(".berth.toml"),
        "{:?}",
        r.body
    );
}

#[test]
fn the_config_file_sets_totals_and_bad_files_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("berth.toml"),
        "slots_max = 3\nmemory_total = \"6GiB\"\nmemory_reserve = \"1GiB\"\ncpu_total = 8\n[resources]\ngpu = 2\n",
    )
    .unwrap();
    let d = Daemon::start_in(dir.path(), common::free_port(), &[]);
    let s = d.get("/v1/status").body;
    assert_eq!(s["slots_max"], 3);
    let res = s["resources"].as_array().unwrap();
    let find = |n: &str| res.iter().find(|r| r["name"] == n).unwrap().clone();
    assert_eq!(find("gpu")["total"], 2);
    // The harness passes --memory-total 8GiB: flags win over the file.
    assert_eq!(find("memory")["total"], 8u64 << 30);
    drop(d);
    std::fs::write(dir.path().join("berth.toml"), "slots_maxx = 3\n").unwrap();
    let out = std::process::Command::new(common::BERTH)
        .args([
            "serve",
            "--state-dir",
            dir.path().to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("berth.toml") && err.contains("slots_maxx"),
        "{err}"
    );
}

#[test]
fn a_corrupt_ledger_stops_the_daemon_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("ledger.db"), vec![0x42u8; 8192]).unwrap();
    let out = std::process::Command::new(common::BERTH)
        .args([
            "serve",
            "--state-dir",
            dir.path().to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--no-memory-sampling",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("ledger"), "{err}");
}

/// A2 with real sampling: the daemon reads the host's MemAvailable, and a grant the
/// configured totals allow but the host's memory does not is held back for it.
#[test]
fn real_memory_sampling_holds_back_what_the_host_does_not_have() {
    let meminfo = |key: &str| -> u64 {
        std::fs::read_to_string("/proc/meminfo")
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap()
            * 1024
    };
    let host_total = meminfo("MemTotal:");
    // Configured far above the machine: only the sampled figure can stop a grant.
    let d = Daemon::start_sampling_memory(&["--slots-max", "4", "--memory-total", "4TiB"]);
    d.wait_until("the daemon has sampled MemAvailable", |d| {
        d.get("/v1/status").body["memory_available"].is_u64()
    });
    let sampled = d.get("/v1/status").body["memory_available"]
        .as_u64()
        .unwrap();
    assert!(
        sampled > 0 && sampled <= host_total,
        "sampled {sampled} of a {host_total}-byte host"
    );
    // All of the host's memory: more than it can have available, less than configured.
    let big = acquire(
        &d,
        json!({"run_id": "big", "project": "big", "wait_s": 0,
               "resources": {"memory": host_total, "cpu_millis": 10}}),
    );
    assert_eq!((big.status, big.code()), (410, "expired"), "{:?}", big.body);
    let reason = &big.body["error"]["details"]["reason"];
    assert_eq!(reason["code"], "capacity.memory", "{reason}");
    assert!(
        reason["message"]
            .as_str()
            .unwrap()
            .contains("free under the"),
        "not the sampled figure that held it back: {reason}"
    );
    // A small claim fits the host: granted.
    let small = acquire(
        &d,
        json!({"run_id": "small", "project": "small", "wait_s": 0,
               "resources": {"memory": 16u64 << 20, "cpu_millis": 10}}),
    );
    assert_eq!(small.status, 201, "{:?}", small.body);
}

/// Issue 10, retention: ended runs past `--retain-ended` leave the ledger in the
/// background (counted in the status), live runs stay whatever their age, a pruned run
/// is gone after a restart (its id free again), and a bad setting is refused by name.
#[test]
fn retention_prunes_ended_runs_in_the_background_and_never_live_ones() {
    let mut d = Daemon::start(&["--slots-max", "4", "--retain-ended", "2"]);
    let live = acquire(&d, json!({"run_id": "live", "project": "l"}));
    assert_eq!(live.status, 201, "{:?}", live.body);
    for i in 0..5 {
        let id = format!("old-{i}");
        let r = acquire(&d, json!({"run_id": id, "project": "p"}));
        assert_eq!(r.status, 201, "{:?}", r.body);
        let fence = r.body["fence"].as_u64().unwrap();
        let rel = d.post(
            &format!("/v1/runs/{id}/release"),
            &json!({ "fence": fence }).to_string(),
        );
        assert_eq!(rel.status, 200, "{:?}", rel.body);
    }
    d.wait_until("three ended runs are pruned", |d| {
        d.get("/v1/status").body["ledger"]["ended_runs_pruned"] == 3
    });
    d.kill9_and_restart();
    for (id, status) in [
        ("old-0", 404),
        ("old-2", 404),
        ("old-3", 200),
        ("old-4", 200),
    ] {
        assert_eq!(
            d.get(&format!("/v1/runs/{id}")).status,
            status,
            "{id} after the restart"
        );
    }
    assert_eq!(d.get("/v1/runs/live").body["state"], "granted");
    // The id of a pruned run is free: a new run, with a new fence.
    let again = acquire(&d, json!({"run_id": "old-0", "project": "other"}));
    assert_eq!(again.status, 201, "{:?}", again.body);
    for value in ["0", "1000001", "many"] {
        let (st, out) = d.start_fails(&[&format!("--retain-ended={value}")]);
        assert!(!st.success());
        assert!(out.contains("retain"), "--retain-ended {value}: {out}");
    }
    let (st, out) = d.start_fails(&["--retain-ended-for=soon"]);
    assert!(!st.success());
    assert!(out.contains("--retain-ended-for"), "{out}");
}

/// Issue 10, item 5: every route has the scope of the router it is declared in. For
/// each route, a token one scope short is refused with 403 naming the scope needed
/// (before anything is read or changed), and a token of that scope gets past auth.
/// An unknown path is 404 and a known path with another method 405, for any token.
#[test]
fn every_route_has_the_scope_of_its_router() {
    let d = Daemon::start(&["--slots-max", "2"]);
    let token = |scope: &str| {
        let r = d.post("/v1/tokens", &json!({ "scope": scope }).to_string());
        assert_eq!(r.status, 201, "{:?}", r.body);
        r.body["token"].as_str().unwrap().to_string()
    };
    let (read, operator) = (token("read"), token("operator"));
    let routes = [
        ("GET", "/v1/runs", "read"),
        ("GET", "/v1/runs/x", "read"),
        ("GET", "/v1/status", "read"),
        ("GET", "/v1/fences/check?run_id=x&fence=1", "read"),
        ("POST", "/v1/runs", "operator"),
        ("DELETE", "/v1/runs/x", "operator"),
        ("POST", "/v1/runs/x/renew", "operator"),
        ("POST", "/v1/runs/x/release", "operator"),
        ("POST", "/v1/runs/x/processes", "operator"),
        ("POST", "/v1/tokens", "admin"),
        ("POST", "/v1/reap", "admin"),
    ];
    for (method, path, need) in routes {
        let short = match need {
            "read" => None,
            "operator" => Some(read.as_str()),
            _ => Some(operator.as_str()),
        };
        let body = (method == "POST").then_some("{}");
        if let Some(t) = short {
            let r = d.call_as(Some(t), method, path, body);
            assert_eq!(
                (r.status, r.code()),
                (403, "forbidden"),
                "{method} {path}: {:?}",
                r.body
            );
            let message = r.body["error"]["message"].as_str().unwrap_or("");
            assert!(
                message.contains(&format!("needs the {need} scope")),
                "{method} {path}: {message}"
            );
        }
        let enough = match need {
            "read" => read.as_str(),
            "operator" => operator.as_str(),
            _ => d.token.as_str(),
        };
        let r = d.call_as(Some(enough), method, path, body);
        assert!(
            r.status != 401 && r.status != 403,
            "{method} {path} with a {need} token: {} {:?}",
            r.status,
            r.body
        );
    }
    assert_eq!(
        d.call_as(Some(&read), "GET", "/v1/nothing", None).status,
        404
    );
    assert_eq!(
        d.call_as(Some(&operator), "DELETE", "/v1/status", None)
            .status,
        405
    );
}

/// The runs' workspaces in the state dir (`runs/`, without the pool and the trash).
fn workspace_dirs(d: &Daemon) -> usize {
    std::fs::read_dir(d.state.join("runs")).map_or(0, |rd| {
        rd.filter(|e| {
            e.as_ref()
                .is_ok_and(|e| !e.file_name().to_string_lossy().starts_with('.'))
        })
        .count()
    })
}

/// Issue 16: `"workspace": false` is a lease only. It is granted with a fence and no
/// workspace (none is made, none is removed), a restart keeps a queued one as it asked,
/// a retry that differs in it is another request, and it cannot go with `thread`.
#[test]
fn a_lease_only_acquire_gets_a_fence_and_no_workspace_even_across_a_restart() {
    let mut d = Daemon::start(&["--slots-max", "1"]);
    let body = |id: &str| json!({"run_id": id, "project": id, "workspace": false, "wait_s": 600, "detach": true});
    let a = acquire(&d, body("a"));
    assert_eq!(
        (a.status, a.body["state"].as_str()),
        (201, Some("granted")),
        "{:?}",
        a.body
    );
    assert!(a.body["fence"].as_u64().is_some());
    assert!(a.body["workspace"].is_null(), "{:?}", a.body);
    assert!(
        a.body["env"].get("BERTH_WORKSPACE").is_none(),
        "{:?}",
        a.body
    );
    assert_eq!(workspace_dirs(&d), 0, "a lease only made a workspace");
    let with_ws = acquire(
        &d,
        json!({"run_id": "w", "project": "w", "wait_s": 600, "detach": true}),
    );
    assert_eq!(with_ws.status, 202, "{:?}", with_ws.body);
    let b = acquire(&d, body("b"));
    assert_eq!(b.status, 202, "{:?}", b.body);
    // The same id without the option is another request (L7).
    let differs = acquire(
        &d,
        json!({"run_id": "b", "project": "b", "wait_s": 600, "detach": true}),
    );
    assert_eq!(
        (differs.status, differs.code()),
        (409, "conflict"),
        "{:?}",
        differs.body
    );
    // Restored after kill -9, the queued lease-only run is granted without a workspace
    // and the one that asked for a workspace gets one.
    d.kill9_and_restart();
    let fence = a.body["fence"].as_u64().unwrap();
    let r = d.post("/v1/runs/a/release", &json!({"fence": fence}).to_string());
    assert_eq!(r.status, 200, "{:?}", r.body);
    d.wait_until("w is granted", |d| {
        d.get("/v1/runs/w").body["state"] == "granted"
    });
    let w = d.get("/v1/runs/w");
    assert!(w.body["workspace"].as_str().is_some(), "{:?}", w.body);
    let wf = w.body["fence"].as_u64().unwrap();
    let r = d.post("/v1/runs/w/release", &json!({"fence": wf}).to_string());
    assert_eq!(r.status, 200, "{:?}", r.body);
    d.wait_until("b is granted", |d| {
        d.get("/v1/runs/b").body["state"] == "granted"
    });
    let b = d.get("/v1/runs/b");
    assert!(b.body["workspace"].is_null(), "{:?}", b.body);
    d.wait_until("w's workspace is gone", |d| workspace_dirs(d) == 0);
    let refused = acquire(
        &d,
        json!({"project": "t", "workspace": false, "thread": "t1"}),
    );
    assert_eq!(
        (refused.status, refused.code()),
        (400, "invalid"),
        "{:?}",
        refused.body
    );
    assert_eq!(
        refused.body["error"]["details"]["field"], "workspace",
        "{:?}",
        refused.body
    );
}
