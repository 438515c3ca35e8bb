//! Black-box tests of what a fleet shares rather than decides (issue 38 Build 3): a
//! token made on one host is honoured on every host and revoked from all by any, and
//! survives a restart while the database is away; a fleet drain started on one host
//! refuses new runs on every host (one that joins during it too) and ends everywhere.
//! Real daemons on one real PostgreSQL database (pg_virtualenv, as `scripts/test.sh`
//! runs it).

mod common;

use std::time::{Duration, Instant};

use common::fleet::{acquire, database, granted, host};
use common::Daemon;
use serde_json::{json, Value};

/// How long another host may take to honour a change: a notification normally makes
/// it milliseconds; a lost one waits for the next heartbeat (100 ms in these tests).
const SPREAD: Duration = Duration::from_secs(5);

/// Waits until `f` holds on `d`; how long that took.
fn within(d: &Daemon, what: &str, mut f: impl FnMut(&Daemon) -> bool) -> Duration {
    let start = Instant::now();
    while start.elapsed() < SPREAD {
        if f(d) {
            return start.elapsed();
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("{what}: not within {SPREAD:?}");
}

fn status_with(d: &Daemon, token: &str) -> u16 {
    d.call_as(Some(token), "GET", "/v1/status", None).status
}

fn make_token(d: &Daemon, body: Value) -> (String, String) {
    let r = d.post("/v1/tokens", &body.to_string());
    assert_eq!(r.status, 201, "{:?}", r.body);
    let token = r.body["token"].as_str().unwrap().to_string();
    (token, r.body["id"].as_str().unwrap().to_string())
}

/// Issue 38 Build 3: before, a token made on one host was `401` on every other (each
/// host kept its own tokens), so an operator needed one token per host.
#[test]
fn regression_a_token_made_on_one_host_is_honoured_on_every_host_and_revoked_on_any() {
    let db = database();
    let a = host(&db, "ta", "60s", "5s");
    let mut b = host(&db, "tb", "60s", "5s");
    let (op, op_id) = make_token(&a, json!({"scope": "operator"}));
    // On its own host at once: mirrored before the answer.
    assert_eq!(status_with(&a, &op), 200);
    let took = within(&b, "the token honoured on the other host", |b| {
        status_with(b, &op) == 200
    });
    eprintln!("a new token was honoured on the other host after {took:?}");
    let listed = b.get("/v1/tokens").body;
    let row = (listed["tokens"].as_array().unwrap().iter())
        .find(|t| t["id"] == op_id.as_str())
        .unwrap_or_else(|| panic!("{listed}"))
        .clone();
    assert_eq!(
        (row["scope"].clone(), row["fleet"].clone()),
        (json!("operator"), json!(true))
    );
    // It acts on the other host as on its own: an operator may acquire there.
    let body = json!({"run_id": "by-fleet-token", "project": "p", "detach": true,
                      "resources": {"slots": 1, "memory": 0, "cpu_millis": 0, "disk": 0}});
    let r = b.call_as(Some(&op), "POST", "/v1/runs", Some(&body.to_string()));
    assert_eq!(r.status, 201, "{:?}", r.body);
    // A second token, kept across b's restart below.
    let (kept, _) = make_token(&a, json!({"scope": "read"}));
    within(&b, "the second token on the other host", |b| {
        status_with(b, &kept) == 200
    });
    // Revoked on the host that did not make it: refused there at once, and on the
    // host that made it once it reads the change.
    let r = b.call("DELETE", &format!("/v1/tokens/{op_id}"), None);
    assert_eq!(
        (r.status, r.body["fleet"].clone()),
        (200, json!(true)),
        "{:?}",
        r.body
    );
    assert_eq!(status_with(&b, &op), 401);
    let took = within(&a, "the revoked token refused on the other host", |a| {
        status_with(a, &op) == 401
    });
    eprintln!("a revoked token was refused on the other host after {took:?}");
    let r = a.call("DELETE", &format!("/v1/tokens/{op_id}"), None);
    assert_eq!((r.status, r.code()), (404, "not_found"), "{:?}", r.body);
    // A host's own admin token stays its own.
    assert_eq!(status_with(&b, &a.token.clone()), 401);
    // b restarts with the database away: the fleet's tokens are in its ledger, so
    // the runs on it can still renew with them.
    b.kill9();
    let at = b.args.iter().position(|x| x == "--store").unwrap() + 1;
    b.args[at] = "postgres://berth@127.0.0.1:1/none?sslmode=disable".into();
    b.spawn();
    assert_eq!(status_with(&b, &kept), 200);
    assert_eq!(status_with(&b, &op), 401);
}

fn new_run(d: &Daemon, run: &str) -> common::Resp {
    acquire(d, run, json!({"wait_s": 0}))
}

fn refused_by_the_fleet_drain(r: &common::Resp, started_on: &str) -> bool {
    r.status == 503
        && r.code() == "draining"
        && r.body["error"]["details"]["drain"]["fleet"] == true
        && r.body["error"]["details"]["drain"]["host"] == started_on
}

/// Issue 38 Build 3 (G4 fleet-wide): before, a drain was one host's; new runs went on
/// being admitted on every other host.
#[test]
fn regression_a_fleet_drain_started_on_one_host_refuses_new_runs_on_every_host() {
    let db = database();
    let a = host(&db, "da", "60s", "5s");
    let b = host(&db, "db", "60s", "5s");
    let r = new_run(&b, "before");
    assert_eq!(r.status, 201, "{:?}", r.body);
    let fence = granted(&b, "before");
    let out = (a
        .cli()
        .args(["drain", "--fleet", "--start", "--reason", "upgrade"]))
    .output()
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("the fleet is draining") && text.contains("upgrade"),
        "{text}"
    );
    // Refused on the host that started it at once, and on the other soon.
    let r = new_run(&a, "on-a");
    assert!(refused_by_the_fleet_drain(&r, "da"), "{:?}", r.body);
    let mut n = 0;
    let took = within(&b, "the fleet drain honoured on the other host", |b| {
        n += 1;
        refused_by_the_fleet_drain(&new_run(b, &format!("on-b-{n}")), "da")
    });
    eprintln!("the fleet drain was honoured on the other host after {took:?}");
    // A host joining during the drain admits nothing new, from its first request.
    let c = host(&db, "dc", "60s", "5s");
    let r = new_run(&c, "on-c");
    assert!(refused_by_the_fleet_drain(&r, "da"), "{:?}", r.body);
    // Runs already in flight go on, and the drain shows what it waits for.
    let r = b.post(
        "/v1/runs/before/renew",
        &json!({"fence": fence}).to_string(),
    );
    assert_eq!(r.status, 200, "{:?}", r.body);
    let d = b.get("/v1/drain").body;
    assert_eq!(
        (d["draining"].clone(), d["drain"].clone()),
        (json!(true), Value::Null),
        "{d}"
    );
    assert_eq!(d["fleet_drain"]["reason"], "upgrade", "{d}");
    assert_eq!(d["waiting_for"][0]["id"], "before", "{d}");
    // Ended on another host than the one that started it: admitted everywhere again.
    let r = b.call("DELETE", "/v1/fleet/drain", None);
    assert_eq!(
        (r.status, r.body["draining"].clone()),
        (200, json!(false)),
        "{:?}",
        r.body
    );
    let mut n = 0;
    within(&a, "the fleet drain ended on the other host", |a| {
        n += 1;
        new_run(a, &format!("after-{n}")).status == 201
    });
    // A host's own drain is not the fleet's: ending the fleet's leaves it.
    let r = c.post("/v1/drain", &json!({"reason": "host"}).to_string());
    assert_eq!(r.status, 200, "{:?}", r.body);
    let r = new_run(&c, "c-host-drained");
    assert_eq!((r.status, r.code()), (503, "draining"), "{:?}", r.body);
    assert_eq!(
        r.body["error"]["details"]["drain"]["fleet"], false,
        "{:?}",
        r.body
    );
    // Without fleet mode there is no fleet drain.
    let plain = Daemon::start(&[]);
    let r = plain.post("/v1/fleet/drain", "{}");
    assert_eq!((r.status, r.code()), (404, "fleet_mode_off"));
}

fn budget_run(d: &Daemon, run: &str) -> common::Resp {
    let b = json!({"scope": "exp", "harness": "claude", "per_harness": {"claude": 8}});
    acquire(d, run, json!({"budget": b, "wait_s": 60}))
}

fn control(d: &Daemon, id: &str, mode: &str) -> common::Resp {
    let body = json!({"request_id": id, "mode": mode});
    d.post("/v1/scopes/exp/control", &body.to_string())
}

/// Issue 38 Build 3 (B4/B5 fleet-wide): before, a scope paused on one host went on
/// granting tokens on every other; a control request is now decided once for the
/// fleet (a retry on another host gets the same receipt, another mode is a conflict)
/// and every host holds its waiters with `scope.paused`, then admits again, or
/// refuses for good once the scope stops.
#[test]
fn regression_a_scope_paused_on_one_host_admits_no_new_token_on_another() {
    let db = database();
    let a = host(&db, "sa", "60s", "5s");
    let b = host(&db, "sb", "60s", "5s");
    for (d, run) in [(&a, "a-holder"), (&b, "b-holder")] {
        let r = budget_run(d, run);
        assert_eq!(r.status, 201, "{:?}", r.body);
    }
    let r = control(&a, "p1", "pause");
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(
        (r.body["control"].clone(), r.body["generation"].clone()),
        (json!("paused"), json!(1))
    );
    // On the other host a new run of the scope waits, saying why.
    let mut n = 0;
    let took = within(&b, "the pause honoured on the other host", |b| {
        n += 1;
        let r = budget_run(b, &format!("b-new-{n}"));
        assert!(r.status == 201 || r.status == 202, "{:?}", r.body);
        r.body["reason"]["code"] == "scope.paused"
    });
    eprintln!("a pause was honoured on the other host after {took:?}");
    let waiter = format!("b-new-{n}");
    let s = b.get("/v1/scopes/exp").body;
    assert_eq!(
        (s["control"].clone(), s["generation"].clone()),
        (json!("paused"), json!(1)),
        "{s}"
    );
    // A retry on the other host: the same receipt; another mode: a conflict.
    let r = control(&b, "p1", "pause");
    assert_eq!(
        (r.status, r.body["generation"].clone()),
        (200, json!(1)),
        "{:?}",
        r.body
    );
    let r = control(&b, "p1", "stop");
    assert_eq!(
        (r.status, r.code()),
        (409, "control_conflict"),
        "{:?}",
        r.body
    );
    // Resumed on the other host: its waiter is granted, and the first host is open.
    let r = control(&b, "r1", "resume");
    assert_eq!(r.body["generation"], 2, "{:?}", r.body);
    granted(&b, &waiter);
    within(&a, "the resume honoured on the first host", |a| {
        a.get("/v1/scopes/exp").body["generation"] == 2
    });
    // Stopped: for good, on every host.
    let r = control(&a, "s1", "stop");
    assert_eq!(r.body["control"], "stopped", "{:?}", r.body);
    // Each try a new run (a retry of one already admitted answers as that run does).
    let mut n = 0;
    within(&b, "the stop honoured on the other host", |b| {
        n += 1;
        budget_run(b, &format!("b-late-{n}")).code() == "scope_stopped"
    });
    let r = control(&b, "p2", "pause");
    assert_eq!((r.status, r.code()), (409, "scope_stopped"), "{:?}", r.body);
    // A host that starts using the scope after the stop refuses it from the first run.
    let c = host(&db, "sc", "60s", "5s");
    assert_eq!(budget_run(&c, "c-first").code(), "scope_stopped");
}

/// An operator token bound to `uid`, made on `a` and honoured on `b` too.
fn user_token(a: &Daemon, b: &Daemon, uid: u32) -> String {
    let (token, _) = make_token(a, json!({"scope": "operator", "uid": uid}));
    within(b, "the token honoured on the other host", |b| {
        status_with(b, &token) == 200
    });
    token
}

/// S9 fleet-wide: before, a uid-bound user whose own run had made another user's scope
/// on a host of its own (a scope is named by its runs) stopped that scope on every
/// host, the other user's too: the host it asked knew the scope as its user's. Now no
/// uid-bound token controls a scope fleet-wide, its user's run or not; a token without
/// a uid still does.
#[test]
fn regression_a_uid_bound_token_cannot_stop_another_users_scope_through_its_own_host() {
    let db = database();
    let a = host(&db, "ua", "60s", "5s");
    let b = host(&db, "ub", "60s", "5s");
    // Two users any Debian has (nobody and daemon).
    let alice = user_token(&a, &b, 65_534);
    let mallory = user_token(&a, &b, 1);
    let budget = json!({"scope": "exp", "harness": "claude", "per_harness": {"claude": 8}});
    let run_as = |d: &Daemon, token: &str, run: &str| {
        let body = json!({"run_id": run, "project": format!("p-{run}"), "budget": budget,
            "workspace": false, "wait_s": 60,
            "resources": {"slots": 1, "memory": 0, "cpu_millis": 0, "disk": 0}});
        d.call_as(Some(token), "POST", "/v1/runs", Some(&body.to_string()))
    };
    let r = run_as(&a, &alice, "alice-run");
    assert_eq!(r.status, 201, "{:?}", r.body);
    let r = run_as(&b, &mallory, "mallory-run");
    assert_eq!(r.status, 201, "{:?}", r.body);
    let control_as = |d: &Daemon, token: &str, id: &str, mode: &str| {
        let body = json!({"request_id": id, "mode": mode}).to_string();
        d.call_as(Some(token), "POST", "/v1/scopes/exp/control", Some(&body))
    };
    // Asked on the host where her own run made the scope: refused, nothing changed.
    let r = control_as(&b, &mallory, "m1", "stop");
    assert_eq!((r.status, r.code()), (403, "not_owner"), "{:?}", r.body);
    assert_eq!(r.body["error"]["details"]["fleet"], true, "{:?}", r.body);
    // Nor on her own host does the other user control it fleet-wide.
    let r = control_as(&a, &alice, "a1", "pause");
    assert_eq!((r.status, r.code()), (403, "not_owner"), "{:?}", r.body);
    for d in [&a, &b] {
        let s = d.get("/v1/scopes/exp").body;
        assert_eq!(
            s["generation"], 0,
            "a refused control changed the scope: {s}"
        );
        assert_ne!(s["control"], "stopped", "{s}");
    }
    let r = run_as(&a, &alice, "alice-next");
    assert_eq!(r.status, 201, "{:?}", r.body);
    // A token without a uid controls it.
    let r = control(&b, "p1", "pause");
    assert_eq!(
        (r.status, r.body["control"].clone()),
        (200, json!("paused")),
        "{:?}",
        r.body
    );
}

/// S9: before, any user's uid-bound operator token drained the whole fleet for every
/// user, or ended the fleet drain an operator had started. Only a token without a uid
/// (or the admin token) starts or ends one now.
#[test]
fn regression_a_uid_bound_token_cannot_drain_the_fleet_for_every_user() {
    let db = database();
    let a = host(&db, "da", "60s", "5s");
    let b = host(&db, "db", "60s", "5s");
    let nobody = user_token(&a, &b, 65_534);
    let body = json!({"reason": "mine"}).to_string();
    let r = b.call_as(Some(&nobody), "POST", "/v1/fleet/drain", Some(&body));
    assert_eq!((r.status, r.code()), (403, "not_owner"), "{:?}", r.body);
    let r = acquire(&a, "after-refusal", json!({}));
    assert_eq!(r.status, 201, "{:?}", r.body);
    let r = a.post(
        "/v1/fleet/drain",
        &json!({"reason": "maintenance"}).to_string(),
    );
    assert_eq!(r.status, 200, "{:?}", r.body);
    let r = b.call_as(Some(&nobody), "DELETE", "/v1/fleet/drain", None);
    assert_eq!((r.status, r.code()), (403, "not_owner"), "{:?}", r.body);
    // The operator's drain holds on the other host all the same.
    let mut n = 0;
    within(&b, "the fleet drain honoured on the other host", |b| {
        n += 1;
        refused_by_the_fleet_drain(&new_run(b, &format!("during-{n}")), "da")
    });
}

const COMMIT_A: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";

/// A parallel project whose one port is a real HTTP server on `$PORT`.
const WEB: &str = r#"concurrency = "parallel"
[[port]]
name = "web"
launch = { command = "sh", args = ["-c", "exec python3 -m http.server --bind 127.0.0.1 $PORT"] }
ready = { http = "/", expect_status = 200, timeout_s = 30, interval_ms = 100 }
"#;

fn shop_run(d: &Daemon, id: &str, wt: &std::path::Path) -> common::Resp {
    let body = json!({"run_id": id, "project": "shop", "worktree": wt, "wait_s": 60,
                      "ttl_s": 60, "detach": true,
                      "resources": {"cpu_millis": 1000, "memory": 256 << 20, "disk": 0}});
    d.post("/v1/runs", &body.to_string())
}

fn shop(d: &Daemon) -> Value {
    let s = d.get("/v1/status").body;
    (s["projects"].as_array().unwrap().iter())
        .find(|p| p["project"] == "shop")
        .cloned()
        .unwrap_or(Value::Null)
}

fn fleet_host_with_ports(db: &str, id: &str, offset: u16) -> Daemon {
    let (lo, hi) = common::run_ports(offset, 10);
    let mut args: Vec<String> = ["--slots-max", "8", "--port-range"]
        .map(String::from)
        .to_vec();
    args.push(format!("{lo}-{hi}"));
    let id_flag = ["--store", db, "--host-id", id, "--fleet-beat", "100ms"];
    args.extend(id_flag.map(String::from));
    args.extend(
        [
            "--ttl-max",
            "60s",
            "--fleet-margin",
            "5s",
            "--stop-grace",
            "1s",
        ]
        .map(String::from),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Daemon::start(&args)
}

/// Issue 38 Build 3 (C3/C4 fleet-wide): before, a project proven parallel on one host
/// stayed serial on every other until a run proved it there too. Now the proof spreads:
/// on another host the holder with the same contract shares its hold and the queued
/// run is granted beside it; a changed contract there drops the evidence fleet-wide.
#[test]
fn regression_promotion_evidence_proven_on_one_host_promotes_the_project_on_another() {
    let db = database();
    let a = fleet_host_with_ports(&db, "ea", 0);
    let b = fleet_host_with_ports(&db, "eb", 10);
    let wt = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(wt.path().join(".git")).unwrap();
    std::fs::write(wt.path().join(".git/HEAD"), format!("{COMMIT_A}\n")).unwrap();
    std::fs::write(wt.path().join(".berth.toml"), WEB).unwrap();
    // On b: one run holds the project's runtime key, the next waits for it.
    let r = shop_run(&b, "b1", wt.path());
    assert_eq!(r.status, 201, "{:?}", r.body);
    let r = shop_run(&b, "b2", wt.path());
    assert_eq!(r.status, 202, "{:?}", r.body);
    assert!(
        r.body["reason"]["code"]
            .as_str()
            .unwrap()
            .starts_with("key."),
        "{:?}",
        r.body
    );
    // On a: a run proves the project parallel.
    let r = shop_run(&a, "a1", wt.path());
    let f = r.body["fence"].as_u64().expect("a1 granted");
    let started = a.post("/v1/runs/a1/runtime", &json!({ "fence": f }).to_string());
    assert_eq!(started.body["promoted"], true, "{:?}", started.body);
    // On b the proof is taken: b2 is granted beside b1.
    let took = within(&b, "b2 granted on the evidence a1 proved", |b| {
        b.get("/v1/runs/b2").body["state"] == "granted"
    });
    eprintln!("evidence proven on one host promoted the project on another after {took:?}");
    let p = shop(&b);
    assert_eq!(
        (p["concurrency"].clone(), p["evidence"]["commit"].clone()),
        (json!("parallel_safe"), json!(COMMIT_A)),
        "{p}"
    );
    assert_eq!(b.get("/v1/runs/b1").body["state"], "granted");
    // C4 on b: a new commit's run refutes the evidence, on every host.
    std::fs::write(wt.path().join(".git/HEAD"), format!("{}\n", "b".repeat(40))).unwrap();
    shop_run(&b, "b3", wt.path());
    assert_eq!(shop(&b)["evidence"], Value::Null, "{}", shop(&b));
    within(&a, "the refuted evidence dropped on the other host", |a| {
        shop(a)["evidence"] == Value::Null
    });
}

/// Issue 38 Build 3: a fleet drain is strict. While another host starts a fleet drain,
/// three clients keep sending new runs to this host; none sent after the drain's start
/// has answered is admitted (the store refuses its claim). The window this closes (a
/// host that has not read the drain yet) is pinned by the simulator's
/// `regression_a_host_that_has_not_read_the_fleet_drain_admits_no_new_run`; here real
/// hosts answer before their notification comes too rarely to show it (with the
/// store's check taken out this passed 5 of 5 times), so this checks the rule end to
/// end under load rather than pinning the bug.
#[test]
fn no_new_run_sent_after_a_fleet_drain_answered_is_admitted() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::OnceLock;
    let db = database();
    let a = host(&db, "sa", "60s", "5s");
    let b = host(&db, "sb", "60s", "5s");
    let (stop, drained) = (AtomicBool::new(false), OnceLock::<Instant>::new());
    let hammer = |c: usize| {
        let (mut after, mut admitted) = (0, Vec::new());
        for n in 0.. {
            if stop.load(Ordering::Relaxed) {
                break;
            }
            let (run, sent) = (format!("h{c}-{n}"), Instant::now());
            let r = new_run(&b, &run);
            if r.status == 201 {
                let fence = json!({"fence": r.body["fence"]}).to_string();
                b.post(&format!("/v1/runs/{run}/release"), &fence);
            }
            if drained.get().is_some_and(|t| sent > *t) {
                after += 1;
                if r.status == 201 {
                    admitted.push(run);
                }
            }
        }
        (after, admitted)
    };
    let (after, admitted) = std::thread::scope(|sc| {
        let clients: Vec<_> = (0..3).map(|c| sc.spawn(move || hammer(c))).collect();
        std::thread::sleep(Duration::from_millis(500));
        let r = a.post("/v1/fleet/drain", &json!({"reason": "strict"}).to_string());
        drained.set(Instant::now()).unwrap();
        assert!(r.status < 300, "{:?}", r.body);
        std::thread::sleep(Duration::from_millis(500));
        stop.store(true, Ordering::Relaxed);
        clients
            .into_iter()
            .fold((0, Vec::new()), |(n, mut all), c| {
                let (after, admitted) = c.join().unwrap();
                all.extend(admitted);
                (n + after, all)
            })
    });
    assert!(after > 0, "no new run was sent after the drain answered");
    assert!(
        admitted.is_empty(),
        "admitted after the fleet drain had answered: {admitted:?}"
    );
}
