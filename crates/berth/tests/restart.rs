//! P5: `kill -9` of the daemon while runs hold leases and others wait, then a restart
//! on the same ledger: leases renew with the same fences, waiters keep their order,
//! new fences are higher than any before, and `berth run` clients ride it out.

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::{long_poll, Daemon};
use serde_json::{json, Value};

/// Starts a long-poll acquire on a raw socket and returns the socket (kept open).
fn waiter(id: &str) -> Value {
    json!({"run_id": id, "project": format!("w-{id}"), "resources": {"cpu_millis": 100}, "ttl_s": 60})
}

#[test]
fn kill_9_keeps_leases_fences_and_queue_order() {
    let mut d = Daemon::start(&["--slots-max", "2", "--reconnect-window", "3s"]);
    let mut fences = Vec::new();
    for id in ["h1", "h2"] {
        let r = d.post(
            "/v1/runs",
            &json!({"run_id": id, "project": id, "resources": {"cpu_millis": 100}, "ttl_s": 60})
                .to_string(),
        );
        assert_eq!(r.status, 201);
        fences.push(r.body["fence"].as_u64().unwrap());
    }
    let ws = d.get("/v1/runs/h1").body["workspace"]
        .as_str()
        .unwrap()
        .to_string();
    let mut sockets = Vec::new();
    for id in ["w1", "w2", "w3"] {
        sockets.push(long_poll(&d, &waiter(id)));
        d.wait_until("the waiter is queued", |d| {
            d.get(&format!("/v1/runs/{id}")).body["state"] == "queued"
        });
    }
    let order = |d: &Daemon| -> Vec<(String, u64)> {
        d.get("/v1/runs").body["runs"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["state"] == "queued")
            .map(|r| {
                (
                    r["run_id"].as_str().unwrap().to_string(),
                    r["position"].as_u64().unwrap(),
                )
            })
            .collect()
    };
    let before = order(&d);
    assert_eq!(
        before,
        vec![("w1".into(), 1), ("w2".into(), 2), ("w3".into(), 3)]
    );
    let max_before = *fences.iter().max().unwrap();

    d.kill9_and_restart();

    // Leases renew with the same fences; the workspace is still there.
    for (id, f) in ["h1", "h2"].iter().zip(&fences) {
        let r = d.post(
            &format!("/v1/runs/{id}/renew"),
            &json!({"fence": f}).to_string(),
        );
        assert_eq!(r.status, 200, "{id}: {:?}", r.body);
        assert_eq!(r.body["fence"].as_u64(), Some(*f));
    }
    assert!(std::path::Path::new(&ws).is_dir());
    // Waiters keep their order and positions.
    assert_eq!(order(&d), before);
    // w1's client reconnects by posting the same run again (L7).
    let mut w1 = long_poll(&d, &waiter("w1"));
    d.wait_until("w1 is claimed again", |d| {
        d.get("/v1/runs/w1").body["state"] == "queued"
    });
    std::thread::sleep(Duration::from_millis(300));
    // Capacity frees: w1 gets the next fence, above every fence issued before.
    let r = d.post(
        "/v1/runs/h1/release",
        &json!({"fence": fences[0]}).to_string(),
    );
    assert_eq!(r.status, 200);
    d.wait_until("w1 is granted", |d| {
        d.get("/v1/runs/w1").body["state"] == "granted"
    });
    let f = d.get("/v1/runs/w1").body["fence"].as_u64().unwrap();
    assert!(f > max_before, "fence {f} not above {max_before}");
    // The reconnected client is answered with that grant, on its own connection.
    let (status, body) = read_answer(&mut w1);
    assert_eq!(status, 201, "w1's reconnect was answered {status} {body}");
    assert_eq!(body["run_id"], "w1", "{body}");
    assert_eq!(body["fence"].as_u64(), Some(f), "{body}");
    // Nobody reclaimed w2 and w3 within the reconnect window: they are cancelled.
    d.wait_until("w2 and w3 are cancelled", |d| {
        d.get("/v1/runs/w2").body["state"] == "cancelled"
            && d.get("/v1/runs/w3").body["state"] == "cancelled"
    });
    // A second crash right away loses nothing acknowledged either.
    d.kill9_and_restart();
    assert_eq!(d.get("/v1/runs/w1").body["fence"].as_u64(), Some(f));
    assert_eq!(d.get("/v1/runs/h1").body["state"], "released");
    let n = d.post(
        "/v1/runs",
        &json!({"run_id": "n", "project": "n", "resources": {"cpu_millis": 100}, "wait_s": 0})
            .to_string(),
    );
    // h2 and w1 still hold both slots after the second restart: no room for `n`.
    assert_eq!((n.status, n.code()), (410, "expired"), "n: {:?}", n.body);
    assert_eq!(
        n.body["error"]["details"]["reason"]["code"], "capacity.slots",
        "n: {:?}",
        n.body
    );
    let nf = d.post(
        "/v1/runs/h2/release",
        &json!({"fence": fences[1]}).to_string(),
    );
    assert_eq!(nf.status, 200);
    let n2 = d.post(
        "/v1/runs",
        &json!({"run_id": "n2", "project": "n2", "resources": {"cpu_millis": 100}}).to_string(),
    );
    assert_eq!(n2.status, 201, "{:?} {:?}", n.body, n2.body);
    assert!(n2.body["fence"].as_u64().unwrap() > f);
}

/// Reads one HTTP response (status and JSON body) from a raw connection, within 10 s.
fn read_answer(s: &mut std::net::TcpStream) -> (u16, Value) {
    use std::io::Read;
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&buf).into_owned();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let len = head
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse::<usize>().ok())?
                })
                .expect("a content-length");
            if body.len() >= len {
                let status = head.split(' ').nth(1).unwrap().parse().unwrap();
                return (status, serde_json::from_str(&body[..len]).unwrap());
            }
        }
        let n = s.read(&mut chunk).expect("an answer within 10 s");
        assert!(n > 0, "connection closed after {:?}", text);
        buf.extend_from_slice(&chunk[..n]);
    }
}

#[test]
fn berth_run_keeps_renewing_across_a_daemon_restart() {
    let mut d = Daemon::start(&["--slots-max", "2"]);
    let child = d
        .cli()
        .args([
            "run",
            "--project",
            "p",
            "--run-id",
            "survivor",
            "--cpus",
            "0.1",
            // A 6 s ttl against a 1.5 s outage: the renewer retries every 250 ms
            // while the daemon is down, so this has seconds of slack, not tenths.
            "--ttl",
            "6s",
            "--",
            "sh",
            "-c",
            "sleep 9; exit 5",
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    d.wait_until("survivor is granted", |d| {
        d.get("/v1/runs/survivor").body["state"] == "granted"
    });
    let fence = d.get("/v1/runs/survivor").body["fence"].as_u64();
    d.kill9();
    std::thread::sleep(Duration::from_millis(1500));
    d.kill9_and_restart();
    let out = child.wait_with_output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(5),
        "the child should finish normally; berth run said: {}; the daemon logged: {}",
        String::from_utf8_lossy(&out.stderr),
        common::log_tail(&d.log)
    );
    d.wait_until("survivor is released", |d| {
        d.get("/v1/runs/survivor").body["state"] == "released"
    });
    let r = d.get("/v1/runs/survivor").body;
    assert_eq!(r["fence"].as_u64(), fence);
}
