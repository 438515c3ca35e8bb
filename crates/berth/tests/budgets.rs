//! Black-box tests of experiment budgets (issue 14, B1–B6) against the real binary:
//! the harness token inside the atomic claim under 300 concurrent acquires, idempotent
//! turn reservations, lapses that never free (across kill -9), the control state
//! machine across restarts, the frozen policy and manifest, and malformed requests.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::Daemon;
use serde_json::{json, Value};

/// Enough room that the budget, not the host, is what runs wait for.
const ROOMY: &[&str] = &["--slots-max", "64", "--cpu-total", "64"];

fn policy() -> Value {
    json!({"claude": 2, "codex": 5, "gemini": 10})
}

/// A detached acquire (answered at once) of a run in a project of its own.
fn acquire(d: &Daemon, run: &str, budget: Value) -> common::Resp {
    let body = json!({"run_id": run, "project": format!("p-{run}"), "detach": true,
                      "resources": {"slots": 1, "memory": 0, "cpu_millis": 0, "disk": 0},
                      "budget": budget});
    d.post("/v1/runs", &body.to_string())
}

fn release(d: &Daemon, run: &str, fence: u64) -> common::Resp {
    d.post(
        &format!("/v1/runs/{run}/release"),
        &json!({ "fence": fence }).to_string(),
    )
}

fn scope(d: &Daemon, id: &str) -> Value {
    let r = d.get(&format!("/v1/scopes/{id}"));
    assert_eq!(r.status, 200, "{:?}", r.body);
    r.body
}

/// Holders per harness replayed from the journal, entry by entry: the largest each
/// ever reached (a sample at every grant and every release, in commit order).
fn max_holders(journal: &[Value], scope: &str) -> BTreeMap<String, (i64, i64)> {
    let mut now: BTreeMap<String, (i64, i64)> = BTreeMap::new();
    for e in journal {
        let d = &e["data"];
        if d["scope"] != scope {
            continue;
        }
        let h = d["harness"].as_str().unwrap_or_default().to_string();
        let step = match e["kind"].as_str() {
            Some("budget_token_taken") => 1,
            Some("budget_token_freed") => -1,
            _ => continue,
        };
        let c = now.entry(h).or_insert((0, 0));
        c.0 += step;
        assert!(c.0 >= 0, "a token freed twice: {e}");
        c.1 = c.1.max(c.0);
    }
    now
}

/// B2/A1: 300 concurrent acquires across three harnesses with limits 2, 5 and 10.
/// Sampled at every grant and release (the journal, in commit order) the holders never
/// exceed a limit, and each harness reaches its limit (the test has contention to
/// fail on). While they wait, the waiters' reasons name their harness. Every run is
/// granted once and released, and every token comes back.
#[test]
fn three_hundred_concurrent_acquires_never_exceed_a_harness_limit() {
    let d = Arc::new(Daemon::start(ROOMY));
    let harness = |i: usize| ["claude", "codex", "gemini"][i % 3];
    // The first freezes the policy; the rest may leave it out or repeat it.
    let r = acquire(
        &d,
        "r-0",
        json!({"scope": "exp", "harness": "claude", "per_harness": policy()}),
    );
    assert!(r.status == 201 || r.status == 202, "{:?}", r.body);
    // Releasers: whatever is granted is released, by four threads, from `go` until
    // told to stop (they start once every acquire queued and the waiters were seen).
    let (go, done) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let releasers: Vec<_> = (0..4)
        .map(|k| {
            let (d, go, done) = (d.clone(), go.clone(), done.clone());
            std::thread::spawn(move || {
                let mut released = BTreeSet::new();
                while !done.load(Ordering::Relaxed) {
                    if !go.load(Ordering::Relaxed) {
                        std::thread::sleep(Duration::from_millis(10));
                        continue;
                    }
                    let runs = d.get("/v1/runs").body["runs"].clone();
                    for r in runs.as_array().into_iter().flatten() {
                        let id = r["run_id"].as_str().unwrap_or_default().to_string();
                        let mine = id.bytes().map(usize::from).sum::<usize>() % 4 == k;
                        if mine && r["state"] == "granted" && !released.contains(&id) {
                            let fence = r["fence"].as_u64().unwrap();
                            let got = release(&d, &id, fence);
                            assert_eq!(got.status, 200, "{id}: {:?}", got.body);
                            released.insert(id);
                        }
                    }
                    std::thread::sleep(Duration::from_millis(30));
                }
                released.len()
            })
        })
        .collect();
    // 299 more acquires from 12 threads at once.
    let submitters: Vec<_> = (0..12)
        .map(|t| {
            let d = d.clone();
            std::thread::spawn(move || {
                for i in (1..300).filter(|i| i % 12 == t) {
                    let mut b = json!({"scope": "exp", "harness": harness(i)});
                    if i % 2 == 0 {
                        b["per_harness"] = policy();
                    }
                    let r = acquire(&d, &format!("r-{i}"), b);
                    assert!(r.status == 201 || r.status == 202, "r-{i}: {:?}", r.body);
                }
            })
        })
        .collect();
    submitters.into_iter().for_each(|s| s.join().unwrap());
    // While the queue is deep, the waiters say which harness they wait for.
    let s = scope(&d, "exp");
    assert_eq!(s["waiting"], 300 - 17, "all but the limits' sum wait: {s}");
    let waiters = s["waiters"].as_array().cloned().unwrap_or_default();
    let full: Vec<&Value> = waiters
        .iter()
        .filter(|w| w["reason"]["code"] == "budget.full")
        .collect();
    if let Some(w) = full.first() {
        let h = w["harness"].as_str().unwrap();
        let msg = w["reason"]["message"].as_str().unwrap();
        assert!(msg.contains(h), "the reason names the harness: {msg}");
    }
    go.store(true, Ordering::Relaxed);
    d.wait_until("every run ended", |d| {
        let s = scope(d, "exp");
        s["waiting"] == 0 && s["tokens"].as_array().is_some_and(|t| t.is_empty())
    });
    done.store(true, Ordering::Relaxed);
    let released: usize = releasers.into_iter().map(|r| r.join().unwrap()).sum();
    assert_eq!(released, 300, "each run granted and released once");
    let journal = d.journal();
    let grants = journal.iter().filter(|e| e["kind"] == "granted").count();
    assert_eq!(grants, 300);
    let max = max_holders(&journal, "exp");
    let limits = [("claude", 2), ("codex", 5), ("gemini", 10)];
    for (h, limit) in limits {
        let (left, most) = max[h];
        eprintln!("harness {h}: at most {most} holders, limit {limit}");
        assert!(most <= limit, "{h}: {most} holders over its limit {limit}");
        assert_eq!(most, limit, "{h}: the limit was reached under contention");
        assert_eq!(left, 0, "{h}: every token came back");
    }
    assert!(
        !full.is_empty(),
        "with 300 waiters some wait for a harness: {waiters:?}"
    );
    // The export of the scope's entries is content-addressed: the same prefix twice
    // gives the same bytes and digest, and holds only this scope's entries.
    let export = |d: &Daemon| {
        let out = std::process::Command::new("curl")
            .args(["-sS", "-D", "-", "-H"])
            .arg(format!("Authorization: Bearer {}", d.token))
            .arg(format!("{}/v1/journal/export?scope=exp&through=200", d.url))
            .output()
            .unwrap();
        String::from_utf8(out.stdout).unwrap()
    };
    // (The digest header and the body; the `date` header may differ by a second.)
    let digest_and_body = |text: &str| {
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or_default();
        let digest = head
            .lines()
            .find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("x-berth-journal-sha256: ")
                    .map(str::to_string)
            })
            .unwrap_or_else(|| panic!("no digest header in {head}"));
        (digest, body.to_string())
    };
    let (a, b) = (digest_and_body(&export(&d)), digest_and_body(&export(&d)));
    assert_eq!(a, b, "the same prefix gives the same bytes and digest");
    let (digest, body) = a;
    use sha2::Digest;
    let hex: String = sha2::Sha256::digest(body.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(digest, hex, "the digest is the body's SHA-256");
    assert!(!body.is_empty());
    for l in body.lines() {
        let v: Value = serde_json::from_str(l).unwrap();
        assert_eq!(v["data"]["scope"], "exp", "{l}");
        assert!(v["seq"].as_u64().unwrap() <= 200);
    }
}

/// B2: a retry of the same (owner, operation_id), as after a dropped connection, gets
/// the same reservation and takes no second token; the same key with another harness
/// is a conflict; a full harness refuses at once; the owner's release frees it.
#[test]
fn a_retried_reservation_gets_the_same_token() {
    let d = Daemon::start(ROOMY);
    let r = acquire(
        &d,
        "a",
        json!({"scope": "s", "harness": "codex", "per_harness": {"claude": 1, "codex": 1}}),
    );
    assert!(r.status == 201 || r.status == 202, "{:?}", r.body);
    let reserve = |owner: &str, op: &str, h: &str| {
        let b = json!({"owner": owner, "operation_id": op, "harness": h});
        d.post("/v1/scopes/s/reservations", &b.to_string())
    };
    let first = reserve("worker-1", "turn-7", "claude");
    assert_eq!(first.status, 201, "{:?}", first.body);
    assert_eq!(first.body["new"], true);
    // The answer was lost; the client sends the same request again.
    let again = reserve("worker-1", "turn-7", "claude");
    assert_eq!(again.status, 200, "{:?}", again.body);
    assert_eq!(again.body["new"], false);
    assert_eq!(again.body["token"], first.body["token"], "the same token");
    let s = scope(&d, "s");
    assert_eq!(
        s["harnesses"]["claude"],
        json!({"limit": 1, "held": 1, "lapsed": 0})
    );
    assert_eq!(s["tokens_held"], 2, "the run's and the turn's");
    let other = reserve("worker-1", "turn-7", "codex");
    assert_eq!(other.status, 409, "{:?}", other.body);
    assert_eq!(other.code(), "reservation_conflict");
    let full = reserve("worker-2", "turn-1", "claude");
    assert_eq!(full.status, 409, "{:?}", full.body);
    assert_eq!(full.code(), "budget_full");
    assert_eq!(full.body["error"]["details"]["holders"], 1);
    // The run's own token is part of its claim: not released on its own.
    let r = d.call("DELETE", "/v1/scopes/s/reservations/a/run", None);
    assert_eq!(r.code(), "token_in_use", "{:?}", r.body);
    let r = d.call("DELETE", "/v1/scopes/s/reservations/worker-1/turn-7", None);
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(reserve("worker-2", "turn-1", "claude").status, 201);
    let r = d.call("DELETE", "/v1/scopes/s/reservations/worker-1/turn-7", None);
    assert_eq!(r.status, 404, "freed once: {:?}", r.body);
    // A connection dropped right after sending the reservation (the answer never
    // read): whether or not it was taken, the retries that follow hold one token.
    let body = json!({"owner": "worker-9", "operation_id": "turn-1", "harness": "codex"});
    let r = d.call("DELETE", "/v1/runs/a", None);
    assert_eq!(r.code(), "fence_required", "a is granted: {:?}", r.body);
    let fence = d.get("/v1/runs/a").body["fence"].as_u64().unwrap();
    assert_eq!(release(&d, "a", fence).status, 200, "codex is free again");
    d.wait_until("a's codex token is back", |d| {
        scope(d, "s")["harnesses"]["codex"]["held"] == 0
    });
    {
        use std::io::Write;
        let mut sock = std::net::TcpStream::connect(("127.0.0.1", d.port)).unwrap();
        let text = body.to_string();
        write!(
            sock,
            "POST /v1/scopes/s/reservations HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{text}",
            d.token,
            text.len()
        )
        .unwrap();
        // Dropped here, unread.
    }
    let first = d.post("/v1/scopes/s/reservations", &body.to_string());
    assert!(
        first.status == 200 || first.status == 201,
        "{:?}",
        first.body
    );
    let again = d.post("/v1/scopes/s/reservations", &body.to_string());
    assert_eq!(again.status, 200, "{:?}", again.body);
    assert_eq!(again.body["new"], false);
    assert_eq!(again.body["token"], first.body["token"], "the same token");
    let s = scope(&d, "s");
    assert_eq!(s["harnesses"]["codex"]["held"], 1, "one token: {s}");
}

/// B3: a run's lease expires: berth stops the run, but its token stays held, marked
/// `owner_lapsed`, and a waiter for that harness keeps waiting; a kill -9 of the
/// daemon frees nothing either. Only the operator's reconciliation (journaled with its
/// reason) frees it, and then the waiter is granted.
#[test]
fn a_lapsed_token_stays_held_until_reconciled_even_across_kill_9() {
    let mut d = Daemon::start(ROOMY);
    let b = json!({"scope": "s", "harness": "claude", "per_harness": {"claude": 1}});
    let body = json!({"run_id": "lapses", "project": "a", "ttl_s": 1, "budget": b,
                      "resources": {"slots": 1, "memory": 0, "cpu_millis": 0, "disk": 0}});
    let r = d.post("/v1/runs", &body.to_string());
    assert_eq!(r.status, 201, "{:?}", r.body);
    let r = acquire(&d, "waits", json!({"scope": "s", "harness": "claude"}));
    assert_eq!(r.status, 202, "{:?}", r.body);
    d.wait_until("the lease expired", |d| {
        d.get("/v1/runs/lapses").body["state"] == "expired"
    });
    let lapsed = |d: &Daemon| {
        let s = scope(d, "s");
        assert_eq!(s["tokens"].as_array().unwrap().len(), 1, "{s}");
        assert_eq!(s["tokens"][0]["owner"], "lapses");
        assert_eq!(s["tokens"][0]["owner_lapsed"], true, "{s}");
        assert_eq!(s["lapsed_owners"], json!(["lapses"]));
        assert_eq!(s["waiters"][0]["run_id"], "waits");
        assert_eq!(s["waiters"][0]["reason"]["code"], "budget.full");
    };
    lapsed(&d);
    std::thread::sleep(Duration::from_millis(500));
    lapsed(&d);
    d.kill9_and_restart();
    lapsed(&d);
    // Metrics count the tokens per scope and harness, lapsed ones too.
    let m = d.get("/metrics").body;
    let m = m.as_str().unwrap_or_default();
    for line in [
        r#"berth_budget_tokens_held{scope="s",harness="claude"} 1"#,
        r#"berth_budget_tokens_limit{scope="s",harness="claude"} 1"#,
        r#"berth_budget_tokens_owner_lapsed{scope="s",harness="claude"} 1"#,
    ] {
        assert!(m.lines().any(|l| l == line), "{line} in:\n{m}");
    }
    // A read token may not reconcile; an admin may.
    let read = d.post("/v1/tokens", r#"{"scope":"read"}"#).body["token"]
        .as_str()
        .unwrap()
        .to_string();
    let rec = json!({"owner": "lapses", "reason": "worker crashed; provider session closed"});
    let r = d.call_as(
        Some(&read),
        "POST",
        "/v1/scopes/s/reconcile",
        Some(&rec.to_string()),
    );
    assert_eq!(r.status, 403, "{:?}", r.body);
    let r = d.post("/v1/scopes/s/reconcile", &rec.to_string());
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(r.body["freed"][0]["owner_lapsed"], true);
    d.wait_until("the waiter is granted", |d| {
        d.get("/v1/runs/waits").body["state"] == "granted"
    });
    let j = d.journal();
    let e = j
        .iter()
        .find(|e| e["kind"] == "scope_reconciled")
        .expect("journaled");
    assert_eq!(
        e["data"]["reason"],
        "worker crashed; provider session closed"
    );
    assert!(j.iter().any(|e| e["kind"] == "budget_token_lapsed"));
}

/// B4/B5 as a table, each row checked, and the whole table again after a kill -9:
/// pause→resume, pause→stop, stop→pause refused, stop→resume refused, the same request
/// id twice (the same receipt), the same id with another mode (409), and generations
/// that move by exactly one per accepted request. A paused scope holds its waiters with
/// `scope.paused`; a stop refuses them at once and every later acquire.
#[test]
fn the_control_state_machine_holds_across_restarts() {
    let mut d = Daemon::start(ROOMY);
    let b = |h: &str| json!({"scope": "c", "harness": h, "per_harness": {"claude": 1, "codex": 2}});
    let r = acquire(&d, "holder", b("claude"));
    assert!(r.status == 201 || r.status == 202, "{:?}", r.body);
    let control = |d: &Daemon, id: &str, mode: &str| {
        let body = json!({"request_id": id, "mode": mode});
        d.post("/v1/scopes/c/control", &body.to_string())
    };
    // (request id, mode, the answer: Ok((control, generation)) or Err(code)).
    type Row = (
        &'static str,
        &'static str,
        Result<(&'static str, u64), &'static str>,
    );
    let rows: &[Row] = &[
        ("p1", "pause", Ok(("paused", 1))),
        ("r1", "resume", Ok(("open", 2))),
        ("p1", "pause", Ok(("paused", 1))), // the same id again: the same receipt
        ("p1", "stop", Err("control_conflict")),
        ("p2", "pause", Ok(("paused", 3))),
        ("s1", "stop", Ok(("stopped", 4))), // pause -> stop
        ("p3", "pause", Err("scope_stopped")),
        ("r2", "resume", Err("scope_stopped")),
        ("s1", "stop", Ok(("stopped", 4))),
    ];
    let check = |d: &Daemon, row: usize| {
        let (id, mode, want) = rows[row];
        let r = control(d, id, mode);
        match want {
            Ok((state, gen)) => {
                assert_eq!(r.status, 200, "row {row}: {:?}", r.body);
                assert_eq!(r.body["control"], state, "row {row}");
                assert_eq!(r.body["generation"], gen, "row {row}");
            }
            Err(code) => {
                assert_eq!(r.status, 409, "row {row}: {:?}", r.body);
                assert_eq!(r.code(), code, "row {row}");
            }
        }
    };
    for row in 0..rows.len() {
        if row == 1 {
            // Paused: a new waiter is held with scope.paused (the holder keeps its token).
            let r = acquire(&d, "w-paused", b("codex"));
            assert_eq!(r.status, 202, "{:?}", r.body);
            assert_eq!(r.body["reason"]["code"], "scope.paused", "{:?}", r.body);
        }
        let mut held = None;
        if row == 5 {
            let r = acquire(&d, "w-stopped", b("codex"));
            assert_eq!(r.body["reason"]["code"], "scope.paused", "{:?}", r.body);
            // And one whose client holds its connection open while it waits.
            let body = json!({"run_id": "w-attached", "project": "p-att", "budget": b("codex"),
                              "resources": {"slots": 1, "memory": 0, "cpu_millis": 0, "disk": 0}});
            held = Some(common::long_poll(&d, &body));
            d.wait_until("the attached waiter queued", |d| {
                d.get("/v1/runs/w-attached").body["state"] == "queued"
            });
        }
        check(&d, row);
        if let Some(mut sock) = held {
            // The long poll is answered at once: refused, naming the stopped scope.
            use std::io::Read;
            sock.set_read_timeout(Some(Duration::from_secs(10)))
                .unwrap();
            let mut text = String::new();
            let _ = sock.read_to_string(&mut text);
            assert!(text.starts_with("HTTP/1.1 409"), "{text}");
            assert!(
                text.contains("scope_stopped") && text.contains("scope c was stopped"),
                "{text}"
            );
        }
        if row == 5 {
            // Stopped: its waiter was refused at once, and says why.
            let w = d.get("/v1/runs/w-stopped").body;
            assert_eq!(w["state"], "rejected", "{w}");
            let r = acquire(&d, "late", b("codex"));
            assert_eq!(r.code(), "scope_stopped", "{:?}", r.body);
        }
    }
    let s = scope(&d, "c");
    assert_eq!(
        (s["control"].clone(), s["generation"].clone()),
        (json!("stopped"), json!(4))
    );
    assert_eq!(s["receipts"].as_array().unwrap().len(), 4);
    assert_eq!(
        s["harnesses"]["claude"]["held"], 1,
        "the holder keeps its token"
    );
    // After a kill -9, every row answers as before: receipts, refusals, generation.
    d.kill9_and_restart();
    for (row, (id, _, want)) in rows.iter().enumerate() {
        if want.is_err() || ["p1", "s1"].contains(id) {
            check(&d, row);
        }
    }
    let r = control(&d, "r1", "resume");
    assert_eq!(
        (r.status, r.body["generation"].clone()),
        (200, json!(2)),
        "{:?}",
        r.body
    );
    assert_eq!(scope(&d, "c")["generation"], 4, "retries moved nothing");
    let gens: Vec<u64> = d
        .journal()
        .iter()
        .filter(|e| e["kind"] == "scope_control")
        .map(|e| e["data"]["generation"].as_u64().unwrap())
        .collect();
    assert_eq!(gens, vec![1, 2, 3, 4], "gap-free, one per accepted request");
}

/// B1: the first admission freezes the policy (and manifest): another policy is
/// `409 budget_conflict` naming both, another manifest `409 scope_manifest_changed`,
/// both still after a restart; a refused acquire leaves nothing behind.
#[test]
fn the_frozen_policy_and_manifest_refuse_changes() {
    let mut d = Daemon::start(ROOMY);
    let manifest = |sha: &str| {
        json!({"path": "exp/m.json", "sha256": sha.repeat(32),
                                     "execution_ids": ["e1", "e2"]})
    };
    let first = json!({"scope": "f", "harness": "claude", "per_harness": {"claude": 3},
                       "manifest": manifest("ab")});
    let granted = acquire(&d, "one", first.clone());
    assert_eq!(granted.status, 201);
    // L7: the same body again re-attaches to the same lease (the policy and manifest
    // it repeats are checked against the scope's, not kept per run).
    let again = acquire(&d, "one", first);
    assert_eq!(again.status, 201, "{:?}", again.body);
    assert_eq!(again.body["fence"], granted.body["fence"]);
    for _ in 0..2 {
        let r = acquire(
            &d,
            "two",
            json!({"scope": "f", "harness": "claude",
                                          "per_harness": {"claude": 4}}),
        );
        assert_eq!(r.status, 409, "{:?}", r.body);
        assert_eq!(r.code(), "budget_conflict");
        assert_eq!(r.body["error"]["details"]["frozen"], json!({"claude": 3}));
        assert_eq!(r.body["error"]["details"]["given"], json!({"claude": 4}));
        let r = acquire(
            &d,
            "three",
            json!({"scope": "f", "harness": "claude",
                                            "manifest": manifest("cd")}),
        );
        assert_eq!(r.code(), "scope_manifest_changed", "{:?}", r.body);
        assert_eq!(d.get("/v1/runs/two").status, 404, "nothing left behind");
        let s = scope(&d, "f");
        assert_eq!(s["manifest"]["sha256"], "ab".repeat(32));
        d.kill9_and_restart();
    }
    let r = acquire(&d, "four", json!({"scope": "f", "harness": "claude"}));
    assert_eq!(
        r.status, 201,
        "the policy may be left out later: {:?}",
        r.body
    );
    let r = d.get("/v1/scopes");
    assert_eq!(r.body["scopes"][0]["scope"], "f", "{:?}", r.body);
    assert_eq!(r.body["scopes"][0]["harnesses"]["claude"]["held"], 2);
}

/// Bad input gets a 400 (or 404) naming the field and the rule, and changes nothing:
/// no scope, token, receipt or journal entry appears (but the `refused` entry D5 writes
/// for an acquire the engine refused).
#[test]
fn malformed_budget_requests_change_nothing() {
    let d = Daemon::start(ROOMY);
    let ok = json!({"scope": "m", "harness": "claude", "per_harness": {"claude": 1}});
    assert_eq!(acquire(&d, "base", ok).status, 201);
    // The engine's refusals of an acquire are journaled as `refused` (D5); nothing else.
    let changes = |d: &Daemon| {
        let j = d.journal();
        j.into_iter().filter(|e| e["kind"] != "refused").count()
    };
    let read = d.post("/v1/tokens", r#"{"scope":"read"}"#).body["token"]
        .as_str()
        .unwrap()
        .to_string();
    let before = (scope(&d, "m"), changes(&d));
    let run = |b: Value| json!({"project": "x", "budget": b, "detach": true}).to_string();
    let cases: Vec<(&str, &str, String, u16, &str)> = vec![
        ("POST", "/v1/runs", run(json!({"scope": "m"})), 400, "budget"),
        ("POST", "/v1/runs", run(json!({"scope": "m", "harness": "Claude"})), 400, "budget.harness"),
        ("POST", "/v1/runs", run(json!({"scope": "bad scope", "harness": "claude"})), 400, "budget.scope"),
        ("POST", "/v1/runs", run(json!({"scope": "n", "harness": "claude", "per_harness": {"claude": 0}})), 400, "budget.per_harness"),
        ("POST", "/v1/runs", run(json!({"scope": "n", "harness": "claude", "per_harness": {"claude": 1025}})), 400, "budget.per_harness"),
        ("POST", "/v1/runs", run(json!({"scope": "n", "harness": "claude", "per_harness": {}})), 400, "budget.per_harness"),
        ("POST", "/v1/runs", r#"{"project":"x","budget":{"scope":"n","harness":"claude","per_harness":{"claude":1,"claude":2}}}"#.into(), 400, "budget.per_harness"),
        ("POST", "/v1/runs", run(json!({"scope": "n", "harness": "claude"})), 400, "per_harness"),
        ("POST", "/v1/runs", run(json!({"scope": "m", "harness": "gemini"})), 400, "harness"),
        ("POST", "/v1/runs", run(json!({"scope": "m", "harness": "claude", "operation_id": ""})), 400, "budget.operation_id"),
        ("POST", "/v1/runs", run(json!({"scope": "m", "harness": "claude", "extra": 1})), 400, "budget.extra"),
        ("POST", "/v1/runs", run(json!({"scope": "n", "harness": "claude", "per_harness": {"claude": 1}, "manifest": {"path": "m", "sha256": "xyz"}})), 400, "budget.manifest.sha256"),
        ("POST", "/v1/scopes/m/reservations", json!({"owner": "w", "operation_id": "o"}).to_string(), 400, "body"),
        ("POST", "/v1/scopes/m/reservations", json!({"owner": "w w", "operation_id": "o", "harness": "claude"}).to_string(), 400, "owner"),
        ("POST", "/v1/scopes/m/reservations", json!({"owner": "w", "operation_id": "o", "harness": "-x"}).to_string(), 400, "harness"),
        ("POST", "/v1/scopes/nope/reservations", json!({"owner": "w", "operation_id": "o", "harness": "claude"}).to_string(), 404, ""),
        ("POST", "/v1/scopes/m/control", json!({"request_id": "", "mode": "pause"}).to_string(), 400, "request_id"),
        ("POST", "/v1/scopes/m/control", json!({"request_id": "x".repeat(257), "mode": "pause"}).to_string(), 400, "request_id"),
        ("POST", "/v1/scopes/m/control", json!({"request_id": "a", "mode": "halt"}).to_string(), 400, "mode"),
        ("POST", "/v1/scopes/nope/control", json!({"request_id": "a", "mode": "pause"}).to_string(), 404, ""),
        ("POST", "/v1/scopes/m/reconcile", json!({"owner": "w", "reason": "a\nb"}).to_string(), 400, "reason"),
        ("POST", "/v1/scopes/m/reconcile", json!({"owner": "w", "reason": ""}).to_string(), 400, "reason"),
        ("POST", "/v1/scopes/m/reconcile", json!({"owner": "", "reason": "r"}).to_string(), 400, "owner"),
        ("GET", "/v1/scopes/bad%20id", String::new(), 400, "scope"),
        ("GET", "/v1/scopes/nope", String::new(), 404, ""),
        ("DELETE", "/v1/scopes/m/reservations/w/o", String::new(), 404, ""),
        ("GET", "/v1/journal/export?scope=a%20b", String::new(), 400, "scope"),
    ];
    for (method, path, body, status, field) in &cases {
        let r = d.call(
            method,
            path,
            (method != &"GET" && method != &"DELETE").then_some(body.as_str()),
        );
        assert_eq!(r.status, *status, "{method} {path} {body}: {:?}", r.body);
        if !field.is_empty() {
            assert_eq!(
                r.body["error"]["details"]["field"], *field,
                "{path} {body}: {:?}",
                r.body
            );
        }
    }
    // A read token may look but not reserve, release, control or reconcile.
    let turn = json!({"owner": "w", "operation_id": "o", "harness": "claude"}).to_string();
    let ctl = json!({"request_id": "r", "mode": "stop"}).to_string();
    let rec = json!({"owner": "base", "reason": "r"}).to_string();
    for (method, path, body) in [
        ("POST", "/v1/scopes/m/reservations", Some(turn.as_str())),
        ("DELETE", "/v1/scopes/m/reservations/base/run", None),
        ("POST", "/v1/scopes/m/control", Some(ctl.as_str())),
        ("POST", "/v1/scopes/m/reconcile", Some(rec.as_str())),
    ] {
        let r = d.call_as(Some(&read), method, path, body);
        assert_eq!(r.status, 403, "{method} {path}: {:?}", r.body);
    }
    assert_eq!(
        d.call_as(Some(&read), "GET", "/v1/scopes/m", None).status,
        200
    );
    assert_eq!(
        d.get("/v1/scopes").body["scopes"].as_array().unwrap().len(),
        1
    );
    assert_eq!((scope(&d, "m"), changes(&d)), before, "nothing changed");
    eprintln!("{} malformed budget requests refused", cases.len());
}

/// The CLI: `berth acquire --budget --budget-policy`, `berth budget`, and `berth scope
/// show|pause|stop|resume` (a retried request id gives the same receipt; a refusal exits
/// non-zero naming its code).
#[test]
fn the_cli_acquires_shows_and_controls_a_scope() {
    let d = Daemon::start(ROOMY);
    let run = |args: &[&str]| {
        let out = d.cli().args(args).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        (out.status.success(), text)
    };
    let (ok, text) = run(&[
        "acquire",
        "--project",
        "cli-a",
        "--run-id",
        "c1",
        "--budget",
        "exp:claude",
        "--budget-policy",
        "claude=1,codex=2",
    ]);
    assert!(ok, "{text}");
    let (ok, text) = run(&[
        "acquire",
        "--project",
        "cli-b",
        "--run-id",
        "c2",
        "--budget",
        "exp:claude",
        "--detach",
    ]);
    assert!(ok, "{text}");
    let (ok, text) = run(&["budget"]);
    assert!(ok, "{text}");
    // A table with a header (issue 33 item 7: tab-separated lines before).
    assert!(text.starts_with("scope"), "{text}");
    let row = text
        .lines()
        .find(|l| l.starts_with("exp "))
        .expect("exp's row");
    let cells: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(&cells[..4], ["exp", "open", "0", "0"], "{text}");
    assert!(row.ends_with("claude 1/1, codex 0/2"), "{text}");
    let (ok, text) = run(&["scope", "pause", "exp", "--request-id", "p1"]);
    assert!(
        ok && text.contains("scope exp: paused (generation 1)"),
        "{text}"
    );
    let (ok, text) = run(&["scope", "pause", "exp", "--request-id", "p1"]);
    assert!(
        ok && text.contains("(generation 1)"),
        "the same receipt: {text}"
    );
    let (ok, text) = run(&["scope", "show", "exp"]);
    assert!(ok, "{text}");
    assert!(text.contains("claude c1/run run c1 since"), "{text}");
    assert!(text.contains("1 c2 (claude)"), "{text}");
    assert!(
        text.contains("receipt p1 pause -> paused generation 1"),
        "{text}"
    );
    let (ok, text) = run(&["scope", "stop", "exp"]);
    assert!(ok && text.contains("stopped (generation 2)"), "{text}");
    let (ok, text) = run(&["scope", "resume", "exp"]);
    assert!(!ok && text.contains("scope_stopped"), "{text}");
    let (ok, text) = run(&[
        "acquire",
        "--project",
        "cli-c",
        "--budget",
        "exp:claude",
        "--budget-policy",
        "claude=9",
    ]);
    assert!(!ok && text.contains("budget_conflict"), "{text}");
}
