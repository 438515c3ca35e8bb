//! Black-box tests of agent threads, registrations, the drain and the idle check
//! (issue 13, G0–G5) against the real binary.

mod common;

use std::time::Duration;

use common::Daemon;
use serde_json::{json, Value};

fn claim(run: &str, gen: &str, fence: u64, budget_ms: Option<u64>) -> String {
    let mut b = json!({"run_id": run, "owner_gen": gen, "owner_fence": fence});
    if let Some(ms) = budget_ms {
        b["run_budget_ms"] = ms.into();
    }
    b.to_string()
}

fn attach(d: &Daemon, key: &str, run: &str, gen: &str, fence: u64) -> common::Resp {
    d.post(
        &format!("/v1/threads/{key}/attach"),
        &claim(run, gen, fence, Some(60_000)),
    )
}

/// G2 across a kill -9: a newer owner takes the thread; a delayed message from the
/// older one, before and after a restart, is refused naming the newer owner, and the
/// thread's workspace is the same directory throughout.
#[test]
fn the_owner_fence_survives_release_and_a_kill_9() {
    let mut d = Daemon::start(&[]);
    let r = attach(&d, "t1", "run-a", "gen-1", 1);
    assert_eq!(r.status, 200, "{:?}", r.body);
    let ws = r.body["workspace"]
        .as_str()
        .expect("a workspace")
        .to_string();
    assert!(std::path::Path::new(&ws).is_dir(), "{ws}");
    let r = attach(&d, "t1", "run-b", "gen-2", 2);
    assert_eq!(r.status, 200, "{:?}", r.body);
    let r = d.post("/v1/threads/t1/detach", &claim("run-b", "gen-2", 2, None));
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert!(r.body["registration"].is_null(), "{:?}", r.body);
    let refused = |d: &Daemon| {
        let r = attach(d, "t1", "run-a", "gen-1", 1);
        assert_eq!(r.status, 409, "{:?}", r.body);
        assert_eq!(r.code(), "registration_mismatch");
        assert_eq!(r.body["error"]["details"]["current"]["owner_gen"], "gen-2");
        assert_eq!(r.body["error"]["details"]["current"]["owner_fence"], 2);
    };
    refused(&d);
    d.kill9_and_restart();
    refused(&d);
    // Same fence, another generation: also refused.
    let r = attach(&d, "t1", "run-b", "gen-x", 2);
    assert_eq!(r.code(), "registration_mismatch", "{:?}", r.body);
    let r = attach(&d, "t1", "run-b", "gen-2", 2);
    assert_eq!(r.status, 200, "the owner itself re-attaches: {:?}", r.body);
    assert_eq!(r.body["workspace"], ws.as_str(), "the same workspace");
    assert!(std::path::Path::new(&ws).is_dir());
    let out = d.cli().arg("threads").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("thread"), "a header first: {text}");
    let row = text
        .lines()
        .find(|l| l.starts_with("t1 "))
        .expect("t1's row");
    assert!(
        row.contains("gen-2 fence 2 (run run-b)") && row.contains("until "),
        "{text}"
    );
}

/// G0/G1: a registered thread's workspace outlives `thread_idle_after` while its
/// agent "thinks"; once the registration lapses (deadline + grace) the sweep evicts
/// it with reason `idle`, and the journal says so.
#[test]
fn a_registered_thread_survives_the_idle_sweep_and_is_evicted_once_it_lapses() {
    let d = Daemon::start(&["--thread-idle-after", "1s", "--thread-grace", "200ms"]);
    let r = d.post(
        "/v1/threads/think/attach",
        &claim("run-1", "g", 1, Some(2_500)),
    );
    assert_eq!(r.status, 200, "{:?}", r.body);
    let ws = r.body["workspace"].as_str().unwrap().to_string();
    // Thinking for twice the idle time: the registration protects the workspace.
    std::thread::sleep(Duration::from_millis(2_000));
    let t = d.get("/v1/threads/think").body;
    assert_eq!(t["registration"]["live"], true, "{t:?}");
    assert!(t["evictions"].as_array().unwrap().is_empty(), "{t:?}");
    assert!(std::path::Path::new(&ws).is_dir());
    d.wait_until("the lapsed thread is evicted", |d| {
        d.get("/v1/threads/think").body["evictions"]
            .as_array()
            .is_some_and(|e| !e.is_empty())
    });
    let t = d.get("/v1/threads/think").body;
    assert_eq!(t["evictions"][0]["reason"], "idle", "{t:?}");
    assert!(t["workspace"].is_null(), "{t:?}");
    assert_eq!(t["owner"]["owner_gen"], "g", "the owner is kept (G2)");
    d.wait_until("the workspace directory is gone", |_| {
        !std::path::Path::new(&ws).exists()
    });
    let kinds: Vec<String> = d
        .journal()
        .iter()
        .map(|e| e["kind"].as_str().unwrap_or("").to_string())
        .collect();
    for k in [
        "thread_attached",
        "thread_workspace_created",
        "thread_evicted",
    ] {
        assert!(kinds.iter().any(|x| x == k), "{k} in {kinds:?}");
    }
}

fn acquire(d: &Daemon, id: &str) -> common::Resp {
    d.post(
        "/v1/runs",
        &json!({"run_id": id, "project": id, "wait_s": 0,
                "resources": {"cpu_millis": 10, "disk": 1024}})
        .to_string(),
    )
}

/// G4: a drain refuses new runs and new registrations with its record, lets the
/// owner of a live registration re-attach, keeps granted runs renewing, shows what it
/// waits for, survives a restart and ends on DELETE.
#[test]
fn a_drain_refuses_newcomers_and_lets_owners_back() {
    let mut d = Daemon::start(&[]);
    let lease = acquire(&d, "busy");
    assert_eq!(lease.status, 201, "{:?}", lease.body);
    let fence = lease.body["fence"].as_u64().unwrap();
    assert_eq!(attach(&d, "t", "run-1", "g", 3).status, 200);
    let r = d.post("/v1/drain", &json!({"reason": "deploy 42"}).to_string());
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(r.body["drain"]["reason"], "deploy 42");
    d.kill9_and_restart();
    let r = acquire(&d, "late");
    assert_eq!((r.status, r.code()), (503, "draining"), "{:?}", r.body);
    assert_eq!(r.body["error"]["details"]["drain"]["reason"], "deploy 42");
    let r = attach(&d, "other", "run-2", "g", 1);
    assert_eq!((r.status, r.code()), (503, "draining"), "{:?}", r.body);
    // A lower fence is a mismatch before it is a drain refusal (G2 before G4).
    let r = attach(&d, "t", "run-0", "g", 2);
    assert_eq!(r.code(), "registration_mismatch", "{:?}", r.body);
    assert_eq!(
        attach(&d, "t", "run-1", "g", 3).status,
        200,
        "the owner re-attaches"
    );
    let renew = d.post(
        "/v1/runs/busy/renew",
        &json!({ "fence": fence }).to_string(),
    );
    assert_eq!(renew.status, 200, "{:?}", renew.body);
    let w = d.get("/v1/drain").body;
    let ids: Vec<&str> = w["waiting_for"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["busy", "t"], "{w:?}");
    let r = d.call("DELETE", "/v1/drain", None);
    assert_eq!((r.status, &r.body["draining"]), (200, &json!(false)));
    assert_eq!(acquire(&d, "late").status, 201);
}

/// `/v1/idle` flips exactly when the last run and the last registration end.
#[test]
fn idle_flips_when_the_last_run_and_registration_end() {
    let d = Daemon::start(&[]);
    let idle = |d: &Daemon| d.get("/v1/idle").body;
    assert_eq!(idle(&d)["idle"], true);
    let lease = acquire(&d, "r");
    let fence = lease.body["fence"].as_u64().unwrap();
    assert_eq!(attach(&d, "t", "run-1", "g", 1).status, 200);
    let i = idle(&d);
    assert_eq!(i["idle"], false);
    assert_eq!(i["busy"].as_array().unwrap().len(), 2, "{i:?}");
    let r = d.post("/v1/runs/r/release", &json!({ "fence": fence }).to_string());
    assert_eq!(r.status, 200, "{:?}", r.body);
    d.wait_until("the run has ended", |d| {
        d.get("/v1/runs/r").body["state"] == "released"
    });
    let i = idle(&d);
    assert_eq!(i["idle"], false, "a registration still lives: {i:?}");
    assert_eq!(i["busy"][0]["kind"], "registration");
    let r = d.post("/v1/threads/t/detach", &claim("run-1", "g", 1, None));
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(idle(&d)["idle"], true);
}

/// G5: malformed requests across the new endpoints are refused with the field and
/// the rule, and none of them changes anything (threads, drain, journal).
/// Thread and drain requests the API must refuse, each with its status and code:
/// bodies and fields broken, ids over the rule, fences past a safe integer, owners
/// that are not the thread's (thread `t` has owner `g` at fence 5, run `run-1`).
fn malformed_thread_cases() -> Vec<(&'static str, String, String, u16, &'static str)> {
    let long = "x".repeat(129);
    let attach = bad_attach_bodies().into_iter();
    let mut cases: Vec<_> = attach
        .map(|(body, status, code)| {
            (
                "POST",
                "/v1/threads/t/attach".to_string(),
                body,
                status,
                code,
            )
        })
        .collect();
    cases.extend(vec![
        (
            "POST",
            "/v1/threads/t/attach".into(),
            r#"{"run_id":"r","owner_gen":"g","owner_fence":9,"run_budget_ms":10,"evict":true}"#
                .into(),
            400,
            "invalid",
        ),
        (
            "POST",
            format!("/v1/threads/{long}/attach"),
            claim("r", "g", 9, Some(10)),
            400,
            "invalid",
        ),
        (
            "POST",
            "/v1/threads/bad%20key/attach".into(),
            claim("r", "g", 9, Some(10)),
            400,
            "invalid",
        ),
        (
            "POST",
            "/v1/threads/t/deadline".into(),
            claim("run-1", "g", 5, None),
            400,
            "invalid",
        ),
        (
            "POST",
            "/v1/threads/t/deadline".into(),
            claim("run-1", "g", 5, Some(86_400_001)),
            400,
            "invalid",
        ),
        (
            "POST",
            "/v1/threads/t/deadline".into(),
            claim("run-1", "h", 5, Some(10)),
            409,
            "registration_mismatch",
        ),
        (
            "POST",
            "/v1/threads/t/detach".into(),
            claim("run-1", "g", 5, Some(10)),
            400,
            "invalid",
        ),
        (
            "POST",
            "/v1/threads/t/detach".into(),
            claim("run-1", "g", 4, None),
            409,
            "registration_mismatch",
        ),
        (
            "POST",
            "/v1/threads/nope/detach".into(),
            claim("run-1", "g", 5, None),
            404,
            "not_found",
        ),
        (
            "DELETE",
            "/v1/threads/t".into(),
            String::new(),
            409,
            "thread_protected",
        ),
        (
            "GET",
            "/v1/threads/nope".into(),
            String::new(),
            404,
            "not_found",
        ),
        (
            "POST",
            "/v1/drain".into(),
            r#"{"reason":"a\nb"}"#.into(),
            400,
            "invalid",
        ),
        (
            "POST",
            "/v1/drain".into(),
            r#"{"why":"x"}"#.into(),
            400,
            "invalid",
        ),
        (
            "POST",
            "/v1/drain".into(),
            format!(r#"{{"reason":"{}"}}"#, "y".repeat(1025)),
            400,
            "invalid",
        ),
    ]);
    cases
}

/// Attach bodies the API must refuse, with the status and code of each.
fn bad_attach_bodies() -> Vec<(String, u16, &'static str)> {
    let big = (1u64 << 53).to_string();
    let long = "x".repeat(129);
    vec![
        ("{}".into(), 400, "invalid"),
        ("not json".into(), 400, "invalid"),
        (
            r#"{"run_id":"r","owner_gen":"g","owner_fence":1}"#.into(),
            400,
            "invalid",
        ),
        (
            r#"{"owner_gen":"g","owner_fence":9,"run_budget_ms":10}"#.into(),
            400,
            "invalid",
        ),
        (
            r#"{"run_id":"r","owner_fence":9,"run_budget_ms":10}"#.into(),
            400,
            "invalid",
        ),
        (
            r#"{"run_id":"r","owner_gen":"g","run_budget_ms":10}"#.into(),
            400,
            "invalid",
        ),
        (
            r#"{"run_id":"r","owner_gen":"g","owner_fence":0,"run_budget_ms":10}"#.into(),
            400,
            "invalid",
        ),
        (
            format!(r#"{{"run_id":"r","owner_gen":"g","owner_fence":{big},"run_budget_ms":10}}"#),
            400,
            "invalid",
        ),
        (
            r#"{"run_id":"r","owner_gen":"g","owner_fence":-1,"run_budget_ms":10}"#.into(),
            400,
            "invalid",
        ),
        (
            r#"{"run_id":"r","owner_gen":"g","owner_fence":1.5,"run_budget_ms":10}"#.into(),
            400,
            "invalid",
        ),
        (
            r#"{"run_id":"r","owner_gen":"g","owner_fence":"9","run_budget_ms":10}"#.into(),
            400,
            "invalid",
        ),
        (
            r#"{"run_id":"r","owner_gen":"g","owner_fence":9,"run_budget_ms":0}"#.into(),
            400,
            "invalid",
        ),
        (
            r#"{"run_id":"r","owner_gen":"g","owner_fence":9,"run_budget_ms":86400001}"#.into(),
            400,
            "invalid",
        ),
        (
            r#"{"run_id":"","owner_gen":"g","owner_fence":9,"run_budget_ms":10}"#.into(),
            400,
            "invalid",
        ),
        (
            format!(r#"{{"run_id":"{long}","owner_gen":"g","owner_fence":9,"run_budget_ms":10}}"#),
            400,
            "invalid",
        ),
        (
            format!(r#"{{"run_id":"r","owner_gen":"{long}","owner_fence":9,"run_budget_ms":10}}"#),
            400,
            "invalid",
        ),
        (
            r#"{"run_id":"r r","owner_gen":"g","owner_fence":9,"run_budget_ms":10}"#.into(),
            400,
            "invalid",
        ),
        (
            r#"{"run_id":"r","owner_gen":"g","owner_fence":9,"run_budget_ms":10,"extra":1}"#.into(),
            400,
            "invalid",
        ),
        (
            claim("run-1", "g", 4, Some(10)),
            409,
            "registration_mismatch",
        ),
        (
            claim("run-2", "g", 5, Some(10)),
            409,
            "registration_mismatch",
        ),
    ]
}

#[test]
fn malformed_thread_and_drain_requests_change_nothing() {
    let d = Daemon::start(&[]);
    assert_eq!(attach(&d, "t", "run-1", "g", 5).status, 200);
    let cases = malformed_thread_cases();
    assert!(cases.len() >= 25);
    let state = |d: &Daemon| {
        let t = d.get("/v1/threads").body;
        let dr = d.get("/v1/drain").body;
        let kinds: Vec<Value> = d
            .journal()
            .into_iter()
            .map(|e| e["kind"].clone())
            .filter(|k| k != "thread_evict_refused")
            .collect();
        (t, dr, kinds)
    };
    let before = state(&d);
    for (method, path, body, status, code) in &cases {
        let r = d.call(method, path, (!body.is_empty()).then_some(body.as_str()));
        assert_eq!(
            (r.status, r.code()),
            (*status, *code),
            "{method} {path} {body}: {:?}",
            r.body
        );
        if r.status == 400 {
            assert!(
                r.body["error"]["details"]["field"].is_string(),
                "names its field: {:?}",
                r.body
            );
        }
    }
    assert_eq!(state(&d), before, "a refusal changed something");
}

/// G0: runs that name a thread work in its persistent workspace (`BERTH_WORKSPACE`),
/// each with its own `tmp` and `out`; what one run leaves there the next one finds;
/// the thread is not evicted while a run works in it, even past its idle time.
#[test]
fn runs_of_a_thread_share_its_workspace_and_keep_their_own_tmp() {
    let d = Daemon::start(&["--thread-idle-after", "1s"]);
    let run = |id: &str| {
        let r = d.post(
            "/v1/runs",
            &json!({"run_id": id, "project": "p", "thread": "conv-1", "wait_s": 0,
                    "resources": {"cpu_millis": 10, "disk": 1024}})
            .to_string(),
        );
        assert_eq!(r.status, 201, "{:?}", r.body);
        r.body
    };
    let a = run("turn-1");
    let ws = a["env"]["BERTH_WORKSPACE"].as_str().unwrap().to_string();
    assert_eq!(a["env"]["BERTH_THREAD"], "conv-1");
    assert_ne!(
        Some(ws.as_str()),
        a["workspace"].as_str(),
        "the thread's, not the run's"
    );
    assert!(
        !a["env"]["TMPDIR"].as_str().unwrap().starts_with(&ws),
        "tmp stays the run's"
    );
    std::fs::write(format!("{ws}/notes.md"), "remember this").unwrap();
    // Working past the idle time: the live run protects the thread.
    std::thread::sleep(Duration::from_millis(2_500));
    let t = d.get("/v1/threads/conv-1").body;
    assert!(t["evictions"].as_array().unwrap().is_empty(), "{t:?}");
    // An operator may not take the workspace from under the live run.
    let r = d.call("DELETE", "/v1/threads/conv-1", None);
    assert_eq!(
        (r.status, r.code()),
        (409, "thread_protected"),
        "{:?}",
        r.body
    );
    let fence = a["fence"].as_u64().unwrap();
    let r = d.post(
        "/v1/runs/turn-1/release",
        &json!({ "fence": fence }).to_string(),
    );
    assert_eq!(r.status, 200, "{:?}", r.body);
    let b = run("turn-2");
    assert_eq!(b["env"]["BERTH_WORKSPACE"], ws.as_str());
    assert_ne!(a["env"]["TMPDIR"], b["env"]["TMPDIR"]);
    let notes = std::fs::read_to_string(format!("{ws}/notes.md")).unwrap();
    assert_eq!(notes, "remember this");
    // L7: a retry of turn-2 that names another thread is another request.
    let r = d.post(
        "/v1/runs",
        &json!({"run_id": "turn-2", "project": "p", "thread": "conv-2", "wait_s": 0,
                "resources": {"cpu_millis": 10, "disk": 1024}})
        .to_string(),
    );
    assert_eq!((r.status, r.code()), (409, "conflict"), "{:?}", r.body);
    let r = d.post(
        "/v1/runs",
        &json!({"project": "p", "thread": "bad key"}).to_string(),
    );
    assert_eq!(
        (r.status, r.body["error"]["details"]["field"].as_str()),
        (400, Some("thread"))
    );
}

/// G4: `berth drain --wait` returns once the last run in flight has released, and
/// `berth status` names what the drain waits for meanwhile.
#[test]
fn berth_drain_wait_returns_once_the_last_run_releases() {
    let d = Daemon::start(&[]);
    let lease = acquire(&d, "last");
    let fence = lease.body["fence"].as_u64().unwrap();
    let mut wait = d
        .cli()
        .args(["drain", "--start", "--reason", "recycle", "--wait"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    d.wait_until("the drain is in force", |d| {
        d.get("/v1/drain").body["draining"] == true
    });
    let status = d.cli().arg("status").output().unwrap();
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(
        text.contains("draining since") && text.contains("last"),
        "{text}"
    );
    std::thread::sleep(Duration::from_millis(1_200));
    assert!(
        wait.try_wait().unwrap().is_none(),
        "--wait returned while a run lives"
    );
    let r = d.post(
        "/v1/runs/last/release",
        &json!({ "fence": fence }).to_string(),
    );
    assert_eq!(r.status, 200, "{:?}", r.body);
    let end = std::time::Instant::now() + Duration::from_secs(20);
    let code = loop {
        if let Some(c) = wait.try_wait().unwrap() {
            break c;
        }
        assert!(std::time::Instant::now() < end, "--wait did not return");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(code.success(), "{code:?}");
    let out = wait.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("waiting for 1") && text.contains("nothing in flight"),
        "{text}"
    );
}

/// G4: a waiter queued before the drain stays queued with reason `host.draining`, is
/// not granted when capacity frees during the drain, and is granted once it ends.
#[test]
fn a_queued_waiter_is_held_by_a_drain_and_granted_after_it() {
    let d = Daemon::start(&[]);
    let body = |id: &str, detach: bool| {
        json!({"run_id": id, "project": id, "singletons": ["db"], "wait_s": 600,
               "detach": detach, "resources": {"cpu_millis": 10, "disk": 1024}})
        .to_string()
    };
    let a = d.post("/v1/runs", &body("holder", false));
    assert_eq!(a.status, 201, "{:?}", a.body);
    let b = d.post("/v1/runs", &body("waiter", true));
    assert_eq!(b.status, 202, "{:?}", b.body);
    assert_eq!(d.post("/v1/drain", "{}").status, 200);
    let w = d.get("/v1/runs/waiter").body;
    assert_eq!(
        (w["state"].as_str(), w["reason"]["code"].as_str()),
        (Some("queued"), Some("host.draining")),
        "{w:?}"
    );
    let fence = a.body["fence"].as_u64().unwrap();
    let r = d.post(
        "/v1/runs/holder/release",
        &json!({ "fence": fence }).to_string(),
    );
    assert_eq!(r.status, 200);
    d.wait_until("the holder has ended", |d| {
        d.get("/v1/runs/holder").body["state"] == "released"
    });
    assert_eq!(
        d.get("/v1/runs/waiter").body["state"],
        "queued",
        "granted during a drain"
    );
    assert_eq!(d.call("DELETE", "/v1/drain", None).status, 200);
    d.wait_until("the waiter is granted", |d| {
        d.get("/v1/runs/waiter").body["state"] == "granted"
    });
}

/// Disk pressure: with less free space than `--thread-disk-free-min`, the sweep evicts
/// an unregistered idle thread's workspace (reason `disk_pressure`) and refuses, once
/// and journaled, to destroy a registered one's.
#[test]
fn disk_pressure_evicts_idle_threads_and_spares_registered_ones() {
    let d = Daemon::start(&["--thread-disk-free-min", "1000000TiB"]);
    assert_eq!(attach(&d, "kept", "run-1", "g", 1).status, 200);
    let r = d.post(
        "/v1/runs",
        &json!({"run_id": "r1", "project": "p", "thread": "spare", "wait_s": 0,
                "resources": {"cpu_millis": 10, "disk": 1024}})
        .to_string(),
    );
    assert_eq!(r.status, 201, "{:?}", r.body);
    let fence = r.body["fence"].as_u64().unwrap();
    std::thread::sleep(Duration::from_millis(1_500));
    let t = d.get("/v1/threads/spare").body;
    assert!(
        t["evictions"].as_array().unwrap().is_empty(),
        "a live run protects it: {t:?}"
    );
    let r = d.post(
        "/v1/runs/r1/release",
        &json!({ "fence": fence }).to_string(),
    );
    assert_eq!(r.status, 200);
    d.wait_until("the idle thread goes under disk pressure", |d| {
        d.get("/v1/threads/spare").body["evictions"][0]["reason"] == "disk_pressure"
    });
    std::thread::sleep(Duration::from_millis(1_500));
    let kept = d.get("/v1/threads/kept").body;
    assert!(kept["workspace"].is_string(), "{kept:?}");
    let refused: Vec<Value> = d
        .journal()
        .into_iter()
        .filter(|e| e["kind"] == "thread_evict_refused")
        .collect();
    assert_eq!(
        refused.len(),
        1,
        "journaled once, not every second: {refused:?}"
    );
    assert_eq!(refused[0]["data"]["key"], "kept");
    assert_eq!(refused[0]["data"]["reason"], "disk_pressure");
}

/// Issue 33 item 5: a bare `berth drain` shows the drain and changes nothing;
/// starting one takes `--start --reason`, `--off` ends it. (Before: a bare `berth
/// drain` drained the host.)
#[test]
fn issue_33_a_bare_berth_drain_only_shows_the_drain() {
    let d = Daemon::start(&[]);
    let out = d.cli().arg("drain").output().unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("not draining"));
    assert_eq!(d.get("/v1/drain").body["draining"], false);
    // --start without a reason, or a reason without --start: a usage error, nothing
    // changed.
    for args in [&["drain", "--start"][..], &["drain", "--reason", "x"][..]] {
        let out = d.cli().args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        assert_eq!(d.get("/v1/drain").body["draining"], false, "{args:?}");
    }
    let out = d
        .cli()
        .args(["drain", "--start", "--reason", "deploy 7"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(d.get("/v1/drain").body["draining"], true);
    let out = d.cli().arg("drain").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("draining since") && text.contains("deploy 7"),
        "{text}"
    );
    let out = d.cli().args(["drain", "--off"]).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(d.get("/v1/drain").body["draining"], false);
}
