//! What the fleet tests share: a fresh database on the test server, a fleet host on
//! it, and a run's acquire, grant and release.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::Daemon;

pub const ROOMY: &[&str] = &["--slots-max", "64", "--cpu-total", "64"];

pub fn database() -> String {
    berth_store::fleet::testing::pg_fresh_database("fleet").unwrap_or_else(|e| panic!("{e}"))
}

/// A fleet host: fast heartbeats, a lapse of `ttl_max + margin`, and a stop grace
/// short enough for that lapse (the self-fence leaves it before the lapse).
pub fn host(store: &str, id: &str, ttl_max: &str, margin: &str) -> Daemon {
    let mut args: Vec<&str> = ROOMY.to_vec();
    args.extend([
        "--stop-grace",
        "1s",
        "--store",
        store,
        "--host-id",
        id,
        "--fleet-beat",
        "100ms",
        "--ttl-max",
        ttl_max,
        "--fleet-margin",
        margin,
    ]);
    Daemon::start(&args)
}

pub fn acquire(d: &Daemon, run: &str, extra: Value) -> super::Resp {
    let mut body = json!({"run_id": run, "project": format!("p-{run}"), "detach": true,
                          "resources": {"slots": 1, "memory": 0, "cpu_millis": 0, "disk": 0}});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    d.post("/v1/runs", &body.to_string())
}

/// Waits until the run is granted; its fence. (A long poll waits for a change: it is
/// asked only while the run is queued, and briefly, since the grant may come between
/// the look and the poll.)
pub fn granted(d: &Daemon, run: &str) -> u64 {
    let end = Instant::now() + Duration::from_secs(60);
    let mut path = format!("/v1/runs/{run}");
    while Instant::now() < end {
        let r = d.get(&path);
        path = format!("/v1/runs/{run}?wait_s=1");
        assert_eq!(r.status, 200, "{run}: {:?}", r.body);
        match r.body["state"].as_str() {
            Some("granted") => return r.body["fence"].as_u64().unwrap(),
            Some("queued") => continue,
            other => panic!("{run} ended {other:?}: {}", r.body),
        }
    }
    panic!("{run} was not granted within 60 s");
}

pub fn release(d: &Daemon, run: &str, fence: u64) {
    let r = d.post(
        &format!("/v1/runs/{run}/release"),
        &json!({ "fence": fence }).to_string(),
    );
    assert_eq!(r.status, 200, "release {run}: {:?}", r.body);
}
