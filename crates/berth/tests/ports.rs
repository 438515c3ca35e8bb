//! W3 against the real daemon: a worktree contract's `[[port]]` entries are numbered at
//! grant from the configured range, never twice, waited for like any resource, shown
//! in the lease and the environment, kept across a kill -9, and given back.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::Daemon;
use serde_json::{json, Value};

/// A worktree whose contract declares `ports`.
fn worktree(ports: &[&str]) -> tempfile::TempDir {
    let wt = tempfile::tempdir().unwrap();
    let mut text = String::from("concurrency = \"serial\"\n");
    for p in ports {
        text.push_str(&format!(
            "[[port]]\nname = \"{p}\"\nlaunch = {{ command = \"true\" }}\n"
        ));
    }
    std::fs::write(wt.path().join(".berth.toml"), text).unwrap();
    wt
}

fn acquire(id: &str, wt: &std::path::Path, wait_s: u64) -> String {
    json!({"run_id": id, "project": id, "worktree": wt, "wait_s": wait_s, "ttl_s": 300,
           "resources": {"cpu_millis": 1, "memory": 1 << 20, "disk": 0}})
    .to_string()
}

fn ports_of(run: &Value) -> Vec<u16> {
    run["ports"]
        .as_object()
        .map(|m| m.values().map(|v| v.as_u64().unwrap() as u16).collect())
        .unwrap_or_default()
}

/// Every granted run's ports, asserting that no port is held twice.
fn granted_ports(d: &Daemon) -> (usize, BTreeSet<u16>) {
    let runs = d.get("/v1/runs").body;
    let mut seen = BTreeSet::new();
    let mut granted = 0;
    for r in runs["runs"].as_array().unwrap() {
        if r["state"] == "granted" {
            granted += 1;
            for p in ports_of(r) {
                assert!(seen.insert(p), "port {p} is held twice: {runs}");
            }
        }
    }
    (granted, seen)
}

#[test]
fn two_hundred_acquires_in_a_150_port_range_never_share_a_port_and_wait_for_ports() {
    let (lo, hi) = common::run_ports(0, 150);
    let range = format!("{lo}-{hi}");
    let d = Daemon::start(&["--slots-max", "400", "--port-range", &range]);
    let wt = worktree(&["web"]);
    // 200 acquires at once, each waiting up to two minutes, without a thread each.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let berth = berth_client::Client::new(&d.url, Some(d.token.clone())).unwrap();
    let mut waiters = Vec::new();
    for i in 0..200 {
        let body: berth_client::wire::AcquireRequest =
            serde_json::from_str(&acquire(&format!("p{i}"), wt.path(), 120)).unwrap();
        let berth = berth.clone();
        waiters.push(rt.spawn(async move { berth.acquire(&body).await }));
    }
    {
        d.wait_until("150 runs granted and 50 waiting for ports", |d| {
            let runs = d.get("/v1/runs").body;
            let list = runs["runs"].as_array().unwrap();
            let waiting = list
                .iter()
                .filter(|r| r["state"] == "queued" && r["reason"]["code"] == "capacity.ports")
                .count();
            granted_ports(d).0 == 150 && waiting == 50
        });
        let (_, held) = granted_ports(&d);
        assert_eq!(held.len(), 150);
        assert!(held.iter().all(|p| (lo..=hi).contains(p)), "{held:?}");
        // Release everything granted, again and again, until all 200 have run.
        let mut released = BTreeSet::new();
        while released.len() < 200 {
            let runs = d.get("/v1/runs").body;
            granted_ports(&d);
            for r in runs["runs"].as_array().unwrap() {
                let id = r["run_id"].as_str().unwrap().to_string();
                if r["state"] == "granted" && !released.contains(&id) {
                    let f = r["fence"].as_u64().unwrap();
                    let rel = d.post(
                        &format!("/v1/runs/{id}/release"),
                        &json!({"fence": f}).to_string(),
                    );
                    assert_eq!(rel.status, 200, "{}", rel.body);
                    released.insert(id);
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    for w in waiters {
        let run = rt
            .block_on(w)
            .unwrap()
            .expect("every acquire was granted in the end");
        assert_eq!(run.ports.len(), 1, "{run:?}");
    }
    // Every port is back: the ports resource holds nothing.
    d.wait_until("every port back", |d| {
        let s = d.get("/v1/status").body;
        s["resources"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["name"] == "ports" && r["committed"] == 0 && r["total"] == 150)
    });
}

#[test]
fn a_lease_carries_its_ports_in_json_and_environment_and_keeps_them_across_kill_9() {
    let (lo, hi) = common::run_ports(200, 4);
    let range = format!("{lo}-{hi}");
    let mut d = Daemon::start(&["--slots-max", "8", "--port-range", &range]);
    // Something outside berth listens on the first port of the range: it is skipped.
    let outsider = std::net::TcpListener::bind(("127.0.0.1", lo)).unwrap();
    let wt = worktree(&["web", "api"]);
    let r = d.post("/v1/runs", &acquire("two", wt.path(), 0));
    assert_eq!(r.status, 201, "{}", r.body);
    let (web, api) = (
        r.body["ports"]["web"].as_u64().unwrap(),
        r.body["ports"]["api"].as_u64().unwrap(),
    );
    assert_ne!(web, api);
    for p in [web, api] {
        assert!(
            (lo as u64 + 1..=hi as u64).contains(&p),
            "{p} not in {lo}+1..={hi}"
        );
    }
    let env = &r.body["env"];
    assert_eq!(env["BERTH_PORT_WEB"], web.to_string());
    assert_eq!(env["BERTH_PORT_API"], api.to_string());
    assert_eq!(env["BERTH_URL_API"], format!("http://127.0.0.1:{api}"));
    assert_eq!(r.body["claim"]["resources"]["ports"], 2);
    // A user may not claim ports by hand: the contract counts them.
    let by_hand = d.post("/v1/runs", r#"{"project":"x","resources":{"ports":1}}"#);
    assert_eq!(by_hand.status, 400, "{}", by_hand.body);
    assert_eq!(by_hand.body["error"]["details"]["field"], "resources.ports");

    d.kill9_and_restart();
    let after = d.get("/v1/runs/two").body;
    assert_eq!(after["ports"], r.body["ports"], "{after}");
    assert_eq!(after["env"]["BERTH_PORT_WEB"], web.to_string());
    // One port is left (the outsider holds the other): a one-port run gets it, a
    // two-port run waits for ports.
    let one = worktree(&["db"]);
    let r1 = d.post("/v1/runs", &acquire("one", one.path(), 0));
    assert_eq!(r1.status, 201, "{}", r1.body);
    let db = r1.body["ports"]["db"].as_u64().unwrap();
    assert!(![web, api, lo as u64].contains(&db), "{db}");
    let r2 = d.post("/v1/runs", &acquire("three", wt.path(), 0));
    assert_eq!(r2.status, 410, "{}", r2.body);
    assert_eq!(
        r2.body["error"]["details"]["reason"]["code"], "capacity.ports",
        "{}",
        r2.body
    );
    // Released, its ports come back.
    let f = r.body["fence"].as_u64().unwrap();
    let rel = d.post("/v1/runs/two/release", &json!({"fence": f}).to_string());
    assert_eq!(rel.status, 200, "{}", rel.body);
    let again = d.post("/v1/runs", &acquire("four", wt.path(), 0));
    assert_eq!(again.status, 201, "{}", again.body);
    let mut got = ports_of(&again.body);
    got.sort();
    let mut want = vec![web as u16, api as u16];
    want.sort();
    assert_eq!(got, want);
    drop(outsider);
}
