//! C7, C3, C4 against the real daemon with real servers (`python3 -m http.server`):
//! a run starts its project's runtime through berth, which launches, records and
//! probes each port; the first proof promotes a parallel project, so a second run
//! queued behind the first is granted beside it; a changed contract makes runs serial
//! again; a port that never gets ready fails with its log and promotes nothing.

mod common;

use std::time::Duration;

use common::Daemon;
use serde_json::{json, Value};

const COMMIT_A: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";

/// A git-like worktree at `COMMIT_A` whose contract is `contract`.
fn worktree(contract: &str) -> tempfile::TempDir {
    let wt = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(wt.path().join(".git")).unwrap();
    std::fs::write(wt.path().join(".git/HEAD"), format!("{COMMIT_A}\n")).unwrap();
    std::fs::write(wt.path().join(".berth.toml"), contract).unwrap();
    wt
}

/// A parallel project whose one port is a real HTTP server on `$PORT`.
const WEB: &str = r#"concurrency = "parallel"
[[port]]
name = "web"
launch = { command = "sh", args = ["-c", "echo serving on $PORT; exec python3 -m http.server --bind 127.0.0.1 $PORT"] }
ready = { http = "/", expect_status = 200, timeout_s = 30, interval_ms = 100 }
"#;

/// `n` ports at `offset` in this test binary's block (the tests here never share one).
fn range(offset: u16, n: u16) -> String {
    let (lo, hi) = common::run_ports(offset, n);
    format!("{lo}-{hi}")
}

fn acquire(id: &str, wt: &std::path::Path, wait_s: u64) -> String {
    json!({"run_id": id, "project": "shop", "worktree": wt, "wait_s": wait_s, "ttl_s": 300,
           "resources": {"cpu_millis": 1000, "memory": 256 << 20, "disk": 0}})
    .to_string()
}

fn start_runtime(d: &Daemon, id: &str, fence: u64) -> common::Resp {
    d.post(
        &format!("/v1/runs/{id}/runtime"),
        &json!({ "fence": fence }).to_string(),
    )
}

/// `GET /` on the port answers 200 (the server berth launched is really there).
fn serves(port: u64) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port as u16)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = s.write_all(b"GET / HTTP/1.0\r\n\r\n");
    let mut head = [0u8; 12];
    s.read_exact(&mut head).is_ok() && head.starts_with(b"HTTP/1.0 200")
}

fn project(d: &Daemon) -> Value {
    let s = d.get("/v1/status").body;
    s["projects"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["project"] == "shop")
        .cloned()
        .unwrap_or(Value::Null)
}

#[test]
fn a_proven_runtime_promotes_the_project_and_a_queued_run_joins_it_until_the_contract_changes() {
    let r = range(0, 10);
    let mut d = Daemon::start(&["--slots-max", "4", "--port-range", &r]);
    let wt = worktree(WEB);
    let a1 = d.post("/v1/runs", &acquire("a1", wt.path(), 0));
    assert_eq!(a1.status, 201, "{}", a1.body);
    let f1 = a1.body["fence"].as_u64().unwrap();
    // The second run of the project waits: the project is serial until proven.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let berth = berth_client::Client::new(&d.url, Some(d.token.clone())).unwrap();
    let body: berth_client::wire::AcquireRequest =
        serde_json::from_str(&acquire("a2", wt.path(), 60)).unwrap();
    let a2 = rt.spawn(async move { berth.acquire(&body).await });
    d.wait_until("a2 waits for the runtime key", |d| {
        d.get("/v1/runs/a2").body["reason"]["code"]
            .as_str()
            .is_some_and(|c| c.starts_with("key."))
    });
    assert_eq!(project(&d)["concurrency"], "parallel_candidate");

    let started = start_runtime(&d, "a1", f1);
    assert_eq!(started.status, 200, "{}", started.body);
    assert_eq!(started.body["promoted"], true, "{}", started.body);
    let p1 = started.body["ports"]["web"].as_u64().unwrap();
    assert_eq!(Some(p1), a1.body["ports"]["web"].as_u64());
    let kinds: Vec<&str> = started.body["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["event"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["launched", "ready", "done"]);
    assert!(serves(p1), "nothing serves on {p1}");
    // The output went to the run's logs/.
    let ws = a1.body["workspace"].as_str().unwrap();
    let log = std::fs::read_to_string(format!("{ws}/logs/web.log")).unwrap();
    assert!(log.contains(&format!("serving on {p1}")), "{log}");

    // Promoted: a2, already queued, is granted beside a1, on its own port.
    let a2 = rt
        .block_on(a2)
        .unwrap()
        .expect("a2 granted after the promotion");
    assert_eq!(d.get("/v1/runs/a1").body["state"], "granted");
    let p2 = a2.ports["web"] as u64;
    assert_ne!(p1, p2);
    let s2 = start_runtime(&d, "a2", a2.fence.unwrap());
    assert_eq!(s2.status, 200, "{}", s2.body);
    assert!(serves(p1) && serves(p2), "both serve, on {p1} and {p2}");
    let p = project(&d);
    assert_eq!(p["concurrency"], "parallel_safe", "{p}");
    assert_eq!(p["evidence"]["commit"], COMMIT_A, "{p}");
    assert_eq!(p["evidence"]["ports"], json!(["web"]), "{p}");

    // The evidence and the port allocations survive a kill -9.
    d.kill9_and_restart();
    let p = project(&d);
    assert_eq!(p["evidence"]["commit"], COMMIT_A, "after restart: {p}");
    assert_eq!(d.get("/v1/runs/a1").body["ports"]["web"].as_u64(), Some(p1));

    // Released, a run's server is stopped with it (P1: berth launched it).
    let rel = d.post("/v1/runs/a1/release", &json!({ "fence": f1 }).to_string());
    assert_eq!(rel.status, 200, "{}", rel.body);
    d.wait_until("a1's server is gone", |_| !serves(p1));

    // C4: the contract changes (a new commit): the next run is serial again and the
    // evidence is gone.
    std::fs::write(wt.path().join(".git/HEAD"), format!("{}\n", "b".repeat(40))).unwrap();
    let a3 = d.post("/v1/runs", &acquire("a3", wt.path(), 0));
    assert_eq!(
        a3.status, 410,
        "a3 may not join a2's shared hold: {}",
        a3.body
    );
    assert_eq!(project(&d)["evidence"], Value::Null, "{}", project(&d));
    // a2, started on the old commit, is told its contract changed.
    let again = start_runtime(&d, "a2", a2.fence.unwrap());
    assert_eq!(again.status, 409, "{}", again.body);
    assert_eq!(again.body["error"]["code"], "contract_changed");
}

#[test]
fn a_port_that_never_gets_ready_fails_with_its_log_tail_and_promotes_nothing() {
    let r = range(50, 10);
    let d = Daemon::start(&["--slots-max", "4", "--port-range", &r]);
    let wt = worktree(
        r#"concurrency = "parallel"
[[port]]
name = "web"
launch = { command = "sh", args = ["-c", "test -f config && exec python3 -m http.server --bind 127.0.0.1 $PORT; echo warming up; echo 'no config found' >&2; exec sleep 60"] }
ready = { tcp = true, timeout_s = 1, interval_ms = 100 }
"#,
    );
    let a = d.post("/v1/runs", &acquire("slow", wt.path(), 0));
    assert_eq!(a.status, 201, "{}", a.body);
    let f = a.body["fence"].as_u64().unwrap();
    let t = std::time::Instant::now();
    // One start per run at a time: a second one while the first runs is refused.
    let s = std::thread::scope(|sc| {
        let first = sc.spawn(|| start_runtime(&d, "slow", f));
        std::thread::sleep(Duration::from_millis(300));
        let second = start_runtime(&d, "slow", f);
        assert_eq!(second.status, 409, "{}", second.body);
        assert_eq!(second.body["error"]["code"], "runtime_starting");
        first.join().unwrap()
    });
    assert_eq!(s.status, 422, "{}", s.body);
    assert_eq!(s.body["error"]["code"], "runtime_failed");
    let tail = s.body["error"]["details"]["log_tail"].to_string();
    assert!(
        tail.contains("no config found") && tail.contains("warming up"),
        "{}",
        s.body
    );
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    // Nothing was promoted, the run stays granted, and what it launched is gone.
    assert_eq!(project(&d)["evidence"], Value::Null);
    assert_eq!(d.get("/v1/runs/slow").body["state"], "granted");
    let pid = s.body["error"]["details"]["events"][0]["pid"]
        .as_i64()
        .unwrap();
    d.wait_until("the failed attempt's process is gone", |_| {
        !std::path::Path::new(&format!("/proc/{pid}")).exists()
    });
    // The agent fixes its worktree (not the contract, not the commit) and tries again,
    // under the same lease and on the same port: this time it is ready, and proves the
    // project.
    std::fs::write(wt.path().join("config"), "ok").unwrap();
    let retry = start_runtime(&d, "slow", f);
    assert_eq!(retry.status, 200, "{}", retry.body);
    assert_eq!(retry.body["ports"], a.body["ports"]);
    assert_eq!(retry.body["promoted"], true);

    // A command that exits at once fails with its status, at once.
    std::fs::write(
        wt.path().join(".berth.toml"),
        "[[port]]\nname = \"web\"\nlaunch = { command = \"sh\", args = [\"-c\", \"echo bad flag >&2; exit 3\"] }\n",
    )
    .unwrap();
    // Another project: "slow" still holds shop's runtime key.
    let body = acquire("quick", wt.path(), 0).replace("\"shop\"", "\"shop2\"");
    let b = d.post("/v1/runs", &body);
    assert_eq!(b.status, 201, "{}", b.body);
    let s = start_runtime(&d, "quick", b.body["fence"].as_u64().unwrap());
    assert_eq!(s.status, 422, "{}", s.body);
    let msg = s.body["error"]["message"].as_str().unwrap();
    assert!(msg.contains("exit 3"), "{msg}");
    assert!(s.body["error"]["details"]["log_tail"]
        .to_string()
        .contains("bad flag"));

    // An analysis run may not start a runtime (C6), and a stale fence is refused.
    let an = d.post(
        "/v1/runs",
        &json!({"run_id": "an", "project": "shop", "class": "analysis", "worktree": wt.path(),
                "resources": {"cpu_millis": 1000, "memory": 256 << 20, "disk": 0}})
        .to_string(),
    );
    assert_eq!(an.status, 201, "{}", an.body);
    let s = start_runtime(&d, "an", an.body["fence"].as_u64().unwrap());
    assert_eq!(s.status, 409, "{}", s.body);
    let s = start_runtime(&d, "quick", 1);
    assert_eq!(s.body["error"]["code"], "stale_fence", "{}", s.body);
    // Malformed bodies are refused by name, changing nothing.
    for (body, field) in [
        (r#"{"fence":"one"}"#, "fence"),
        (r#"{"fence":1,"ports":["web"]}"#, "ports"),
        (r#"{}"#, "body"),
        (r#"{"fence":0}"#, "fence"),
    ] {
        let s = d.post("/v1/runs/quick/runtime", body);
        assert_eq!(s.status, 400, "{body}: {}", s.body);
        let named = s.body["error"]["details"]["field"]
            .as_str()
            .unwrap_or_default();
        assert!(named.starts_with(field), "{body}: {}", s.body);
    }
    assert_eq!(d.get("/v1/runs/quick").body["state"], "granted");
    // A token that acts for another user may not get berth to run commands (as
    // berth's own user) from a worktree: refused before anything is read or launched.
    let t = d.post("/v1/tokens", r#"{"scope":"operator","uid":65534}"#);
    assert_eq!(t.status, 201, "{}", t.body);
    let other = t.body["token"].as_str().unwrap().to_string();
    let fence = b.body["fence"].as_u64().unwrap();
    let s = d.call_as(
        Some(&other),
        "POST",
        "/v1/runs/quick/runtime",
        Some(&json!({ "fence": fence }).to_string()),
    );
    assert_eq!(s.status, 403, "{}", s.body);
    assert_eq!(s.body["error"]["code"], "runtime_forbidden");
}

/// `berth run --runtime` starts the servers before CMD, which finds them at
/// `BERTH_URL_<NAME>`; a port command that double-forks its server out of its
/// session is still stopped with the run (the cgroup it joined before it ran).
/// A bad `--port-range` stops `berth serve` at start with the flag's rule.
#[test]
fn a_bad_port_range_is_refused_at_start() {
    let d = Daemon::unstarted(&[]);
    for bad in ["5-3", "30000"] {
        let (status, said) = d.start_fails(&["--port-range", bad]);
        assert!(!status.success());
        assert!(said.contains("is not a port range like"), "{bad}: {said}");
    }
}

#[test]
fn berth_run_runtime_serves_cmd_and_a_double_forked_server_is_stopped_with_the_run() {
    let cgroups = berth_proc::testing::cgroups(
        "berth_run_runtime_serves_cmd_and_a_double_forked_server_is_stopped_with_the_run",
    );
    let r = range(20, 10);
    let d = Daemon::start(&["--slots-max", "4", "--port-range", &r]);
    let wt = worktree(
        r#"[[port]]
name = "web"
launch = { command = "sh", args = ["-c", "(setsid python3 -m http.server --bind 127.0.0.1 $PORT >/dev/null 2>&1 &); exec sleep 120"] }
ready = { http = "/", timeout_s = 30, interval_ms = 100 }
"#,
    );
    let fetch = "import os,urllib.request\nu=os.environ['BERTH_URL_WEB']\nprint(u.rsplit(':',1)[1]); print(urllib.request.urlopen(u).status)";
    let out = d
        .cli()
        .args([
            "run",
            "--runtime",
            "--project",
            "dbl",
            "--run-id",
            "dbl",
            "--cpus",
            "0.1",
        ])
        .arg("--worktree")
        .arg(wt.path())
        .args(["--", "python3", "-c", fetch])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "berth run said: {said}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let mut lines = stdout.lines();
    let port: u64 = lines.next().unwrap().parse().unwrap();
    assert_eq!(lines.next(), Some("200"), "{stdout}");
    d.wait_until("dbl is released", |d| {
        d.get("/v1/runs/dbl").body["state"] == "released"
    });
    if cgroups {
        d.wait_until("the double-forked server is stopped with the run", |_| {
            !serves(port)
        });
    }
    // A runtime that fails keeps CMD from starting, with the port's last lines.
    std::fs::write(
        wt.path().join(".berth.toml"),
        "[[port]]\nname = \"web\"\nlaunch = { command = \"sh\", args = [\"-c\", \"echo missing module >&2; exit 2\"] }\n",
    )
    .unwrap();
    let marker = wt.path().join("cmd-ran");
    let out = d
        .cli()
        .args(["run", "--runtime", "--project", "dbl2", "--cpus", "0.1"])
        .arg("--worktree")
        .arg(wt.path())
        .arg("--")
        .args(["touch"])
        .arg(&marker)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(69), "{said}");
    assert!(
        said.contains("exit 2") && said.contains("missing module"),
        "{said}"
    );
    assert!(!marker.exists(), "CMD ran although its runtime failed");
}

/// Issue 32 finding 4 (S11): a1's runtime promoted the project, a2 was granted the
/// runtime key shared, then the contract changed and a2's runtime start answered
/// `409 contract_changed`. a2 was then written to the ledger as an exclusive holder
/// beside a1's shared hold, and every restart failed with "run a2 conflicts on key
/// project:shop:runtime". Now its pending upgrade is recorded: the daemon restarts
/// with both runs as they were, and a2 gets the key once a1 is gone.
#[test]
fn finding_4_a_demotion_never_leaves_a_ledger_that_refuses_to_restore() {
    let r = range(70, 10);
    let mut d = Daemon::start(&["--slots-max", "4", "--port-range", &r]);
    let wt = worktree(WEB);
    let a1 = d.post("/v1/runs", &acquire("a1", wt.path(), 0));
    assert_eq!(a1.status, 201, "{}", a1.body);
    let f1 = a1.body["fence"].as_u64().unwrap();
    let a2 = d.post(
        "/v1/runs",
        &json!({"run_id": "a2", "project": "shop", "worktree": wt.path(), "wait_s": 60,
            "ttl_s": 300, "detach": true,
            "resources": {"cpu_millis": 1000, "memory": 256 << 20, "disk": 0}})
        .to_string(),
    );
    assert_eq!(a2.status, 202, "a2 waits for the runtime key: {}", a2.body);
    let started = start_runtime(&d, "a1", f1);
    assert_eq!(started.body["promoted"], true, "{}", started.body);
    d.wait_until("a2 is granted beside a1", |d| {
        d.get("/v1/runs/a2").body["state"] == "granted"
    });
    let f2 = d.get("/v1/runs/a2").body["fence"].as_u64().unwrap();
    std::fs::write(wt.path().join(".git/HEAD"), format!("{}\n", "b".repeat(40))).unwrap();
    let again = start_runtime(&d, "a2", f2);
    assert_eq!(again.status, 409, "{}", again.body);
    assert_eq!(again.body["error"]["code"], "contract_changed");
    let key_mode = |d: &Daemon, id: &str| {
        d.get(&format!("/v1/runs/{id}")).body["claim"]["keys"]
            .as_array()
            .unwrap()
            .iter()
            .find(|k| k["key"] == "project:shop:runtime")
            .map(|k| k["mode"].clone())
            .unwrap()
    };
    let before = (key_mode(&d, "a1"), key_mode(&d, "a2"));
    // kill -9, then a clean stop: the ledger loads both times, the same runs in it.
    d.kill9_and_restart();
    assert_eq!(d.get("/v1/runs/a1").body["state"], "granted");
    assert_eq!(d.get("/v1/runs/a2").body["state"], "granted");
    assert_eq!((key_mode(&d, "a1"), key_mode(&d, "a2")), before);
    let pid = d.child.as_ref().unwrap().id() as i32;
    let pid = rustix::process::Pid::from_raw(pid).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    assert!(
        d.wait_exit(Duration::from_secs(30)).is_some(),
        "SIGTERM stops it"
    );
    d.spawn();
    assert_eq!(d.get("/v1/runs/a2").body["state"], "granted");
    // a1 goes: a2's upgrade is granted, and a third run may not slip in beside it.
    let rel = d.post("/v1/runs/a1/release", &json!({ "fence": f1 }).to_string());
    assert_eq!(rel.status, 200, "{}", rel.body);
    d.wait_until("a2 holds the key alone", |d| {
        d.get("/v1/runs/a1").body["state"] == "released"
            && d.get("/v1/runs/a2").body["reason"].is_null()
    });
    let a3 = d.post("/v1/runs", &acquire("a3", wt.path(), 0));
    assert_eq!(a3.status, 410, "a3 may not join a2: {}", a3.body);
}

/// Issue 32 finding 5: another process bound run a's allocated port (which any read
/// token can see); a's server died with `Address already in use`, yet the start
/// answered `{"promoted":true}` and the project became `parallel_safe`. Now the
/// listener that answered must be the run's own: the start fails with `port_taken`
/// naming the port and the stranger's pid, and nothing is promoted.
#[test]
fn finding_5_a_squatted_port_fails_the_start_and_promotes_nothing() {
    let r = range(80, 1);
    let d = Daemon::start(&["--slots-max", "4", "--port-range", &r]);
    let wt = worktree(WEB);
    let a = d.post("/v1/runs", &acquire("a", wt.path(), 0));
    assert_eq!(a.status, 201, "{}", a.body);
    let port = a.body["ports"]["web"].as_u64().unwrap();
    let mut squatter = std::process::Command::new("python3")
        .args([
            "-m",
            "http.server",
            "--bind",
            "127.0.0.1",
            &port.to_string(),
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    d.wait_until("the squatter serves", |_| serves(port));
    let started = start_runtime(&d, "a", a.body["fence"].as_u64().unwrap());
    let _ = squatter.kill();
    let _ = squatter.wait();
    assert_eq!(started.status, 422, "{}", started.body);
    assert_eq!(
        started.body["error"]["code"], "port_taken",
        "{}",
        started.body
    );
    let details = &started.body["error"]["details"];
    assert_eq!(details["port"], "web", "{}", started.body);
    assert_eq!(details["number"], port, "{}", started.body);
    assert_eq!(details["pid"], squatter.id(), "{}", started.body);
    let p = project(&d);
    assert_ne!(p["concurrency"], "parallel_safe", "{p}");
    assert_eq!(p["evidence"], Value::Null, "{p}");
}

/// Issue 34: the README's runtime example runs as written (it needed a `make api`
/// target and a `./bin/api` no one has): its `.berth.toml` block and its command, taken
/// from README.md itself, start both ports and CMD reaches both.
#[test]
fn the_readme_runtime_example_runs_as_written() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md")).unwrap();
    let section = &readme[readme.find("## Parallel projects").expect("the section")..];
    let toml = section
        .split("```toml\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("the .berth.toml block");
    let cmd = section
        .lines()
        .find_map(|l| l.strip_prefix("    berth run --runtime"))
        .map(|rest| format!("berth run --runtime{rest}"))
        .expect("the command");
    let r = range(40, 10);
    let d = Daemon::start(&["--slots-max", "4", "--port-range", &r]);
    let wt = worktree(toml);
    let bin_dir = std::path::Path::new(common::BERTH).parent().unwrap();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = std::process::Command::new("sh")
        .args(["-c", &cmd])
        .current_dir(wt.path())
        .env("PATH", path)
        .env("BERTH_URL", &d.url)
        .env("BERTH_TOKEN", &d.token)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{cmd}\n{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(said.contains("ok") && said.contains("both up"), "{said}");
}
