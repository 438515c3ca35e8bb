//! Black-box tests of waiting in a deep queue (issue 18): detached waiters (`detach:
//! true`, `GET /v1/runs/{id}?wait_s=`, `berth acquire --detach`, `berth wait`) and
//! what idle waiters of each kind cost the daemon.

mod common;

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::{long_poll, Daemon};
use serde_json::{json, Value};

fn body(id: &str, extra: Value) -> Value {
    let mut b = json!({"run_id": id, "project": id, "wait_s": 600,
                       "resources": {"cpu_millis": 10, "disk": 1024}});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

/// A lease held at once (the host has one slot).
fn hold(d: &Daemon, id: &str) -> u64 {
    let r = d.post("/v1/runs", &body(id, json!({"wait_s": 0})).to_string());
    assert_eq!(r.status, 201, "{id}: {:?}", r.body);
    r.body["fence"].as_u64().unwrap()
}

fn detach(d: &Daemon, id: &str) -> Value {
    let r = d.post("/v1/runs", &body(id, json!({"detach": true})).to_string());
    assert_eq!(r.status, 202, "{id}: {:?}", r.body);
    r.body
}

fn release(d: &Daemon, id: &str, fence: u64) {
    let r = d.post(
        &format!("/v1/runs/{id}/release"),
        &json!({ "fence": fence }).to_string(),
    );
    assert_eq!(r.status, 200, "{id}: {:?}", r.body);
}

fn state(d: &Daemon, id: &str) -> Value {
    d.get(&format!("/v1/runs/{id}")).body
}

fn wait_state(d: &Daemon, id: &str, want: &str) -> Value {
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        let s = state(d, id);
        if s["state"] == want {
            return s;
        }
        assert!(Instant::now() < end, "{id} never {want}: {s:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A detached acquire answers 202 at once with its place, its reason and its deadline,
/// and then waits in order among attached waiters: FIFO, whoever holds a connection.
#[test]
fn a_detached_waiter_is_granted_in_order_among_attached_ones() {
    let d = Daemon::start(&["--slots-max", "1"]);
    let f0 = hold(&d, "h");
    let _a1 = long_poll(&d, &body("a1", json!({})));
    d.wait_until("a1 queued", |d| state(d, "a1")["state"] == "queued");
    let q = detach(&d, "d2");
    assert_eq!(
        (
            q["state"].as_str(),
            q["position"].as_u64(),
            q["detached"].as_bool()
        ),
        (Some("queued"), Some(2), Some(true)),
        "{q:?}"
    );
    assert!(q["reason"]["code"].is_string(), "{q:?}");
    assert!(q["deadline"].is_string(), "{q:?}");
    let _a3 = long_poll(&d, &body("a3", json!({})));
    d.wait_until("a3 queued", |d| state(d, "a3")["position"] == 3);

    release(&d, "h", f0);
    let a1 = wait_state(&d, "a1", "granted");
    assert_eq!(state(&d, "d2")["position"], 1);
    release(&d, "a1", a1["fence"].as_u64().unwrap());
    let d2 = wait_state(&d, "d2", "granted");
    assert_eq!(state(&d, "a3")["state"], "queued", "a3 passed d2");
    release(&d, "d2", d2["fence"].as_u64().unwrap());
    wait_state(&d, "a3", "granted");
}

/// `GET /v1/runs/{id}?wait_s=N` answers as soon as the run changes, and with the
/// unchanged run after N s when nothing happens; bad values are refused by name.
#[test]
fn get_with_wait_s_answers_on_a_change_and_after_wait_s_without_one() {
    let d = Daemon::start(&["--slots-max", "1"]);
    let f0 = hold(&d, "h");
    detach(&d, "w");
    let t = Instant::now();
    let r = d.get("/v1/runs/w?wait_s=1");
    let took = t.elapsed();
    assert_eq!((r.status, r.body["state"].as_str()), (200, Some("queued")));
    assert!(
        took >= Duration::from_millis(900),
        "answered after {took:?}, not after wait_s"
    );

    let (url, token) = (d.url.clone(), d.token.clone());
    let waiting = std::thread::spawn(move || {
        let t = Instant::now();
        let r = ureq::get(format!("{url}/v1/runs/w?wait_s=120"))
            .header("Authorization", format!("Bearer {token}"))
            .call()
            .unwrap();
        let v: Value = serde_json::from_str(&r.into_body().read_to_string().unwrap()).unwrap();
        (t.elapsed(), v)
    });
    std::thread::sleep(Duration::from_millis(300));
    release(&d, "h", f0);
    let (took, v) = waiting.join().unwrap();
    assert_eq!(v["state"], "granted", "{v:?}");
    assert!(
        took < Duration::from_secs(30),
        "the change was answered after {took:?} (wait_s was 120)"
    );

    for bad in ["-1", "x", "301"] {
        let r = d.get(&format!("/v1/runs/w?wait_s={bad}"));
        assert_eq!((r.status, r.code()), (400, "invalid"), "{bad}");
        assert!(r.body.to_string().contains("wait_s"), "{:?}", r.body);
    }
    let r = d.get("/v1/runs/w?wait=1");
    assert_eq!(r.status, 400, "{:?}", r.body);
    // An ended run answers at once: nothing about it will change.
    release(&d, "w", v["fence"].as_u64().unwrap());
    wait_state(&d, "w", "released");
    let t = Instant::now();
    let r = d.get("/v1/runs/w?wait_s=60");
    assert_eq!(r.body["state"], "released");
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    assert_eq!(d.get("/v1/runs/nope?wait_s=5").status, 404);
}

/// A detached waiter survives kill -9 with its place: it has no connection to come
/// back on, so the reconnect window (1 s here) that cancels unclaimed attached waiters
/// does not apply to it.
#[test]
fn a_detached_waiter_survives_a_kill_9_restart_with_its_place() {
    let mut d = Daemon::start(&["--slots-max", "1", "--reconnect-window", "1s"]);
    let f0 = hold(&d, "h");
    detach(&d, "d1");
    let _attached = long_poll(&d, &body("a2", json!({})));
    d.wait_until("a2 queued", |d| state(d, "a2")["state"] == "queued");
    detach(&d, "d3");
    d.kill9_and_restart();
    // Past the window: the attached waiter nobody re-attached to is cancelled, the
    // detached ones keep their order.
    std::thread::sleep(Duration::from_millis(2_500));
    assert_eq!(state(&d, "a2")["state"], "cancelled");
    let (d1, d3) = (state(&d, "d1"), state(&d, "d3"));
    assert_eq!(
        (d1["position"].as_u64(), d3["position"].as_u64()),
        (Some(1), Some(2)),
        "{d1:?} {d3:?}"
    );
    assert_eq!(d1["detached"], true);
    release(&d, "h", f0);
    let g = wait_state(&d, "d1", "granted");
    assert_eq!(state(&d, "d3")["position"], 1);
    release(&d, "d1", g["fence"].as_u64().unwrap());
    wait_state(&d, "d3", "granted");
}

/// DELETE cancels a detached waiter; a client that attaches to it and goes away
/// (A9) does not: its place was never held by a connection.
#[test]
fn delete_cancels_a_detached_waiter_and_a_dropped_attach_does_not() {
    let d = Daemon::start(&["--slots-max", "1"]);
    let _f0 = hold(&d, "h");
    detach(&d, "d1");
    detach(&d, "d2");
    {
        // The same run id again, attached (L7), then the connection drops.
        let s = long_poll(&d, &body("d1", json!({})));
        std::thread::sleep(Duration::from_millis(300));
        drop(s);
    }
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        state(&d, "d1")["state"],
        "queued",
        "A9 cancelled a detached waiter"
    );
    let r = d.call("DELETE", "/v1/runs/d1", None);
    assert_eq!(
        (r.status, r.body["state"].as_str()),
        (200, Some("cancelled")),
        "{:?}",
        r.body
    );
    assert_eq!(state(&d, "d2")["position"], 1);
}

/// An attached waiter lets go: the same run id again with `detach: true` makes it a
/// detached waiter, so its connection dropping no longer cancels it.
#[test]
fn an_attached_waiter_can_be_detached_by_a_retry() {
    let d = Daemon::start(&["--slots-max", "1"]);
    let _f0 = hold(&d, "h");
    let s = long_poll(&d, &body("w", json!({})));
    d.wait_until("w queued", |d| state(d, "w")["state"] == "queued");
    let q = detach(&d, "w");
    assert_eq!(q["detached"], true);
    drop(s);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(state(&d, "w")["state"], "queued");
}

/// `berth acquire --detach` prints the queued run and exits 0 at once; `berth wait`
/// follows it to its grant (exit 0), or gives up at --timeout with 75 while the run
/// keeps its place.
#[test]
fn berth_acquire_detach_and_berth_wait() {
    let d = Daemon::start(&["--slots-max", "1"]);
    let f0 = hold(&d, "h");
    let out = d
        .cli()
        .args(["acquire", "--detach", "--run-id", "c1", "--project", "c1"])
        .args(["--cpus", "0.01", "--disk", "1024", "--wait", "10m"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("queued") && text.contains("position 1"),
        "{text}"
    );

    let out = d
        .cli()
        .args(["wait", "c1", "--timeout", "1s"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(75), "{out:?}");
    assert_eq!(state(&d, "c1")["state"], "queued");

    let waiter = d
        .cli()
        .args(["wait", "c1"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    release(&d, "h", f0);
    let out = waiter.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("granted"));
}

/// Starts a streamed acquire (ndjson) on a raw socket and returns the socket.
fn stream(d: &Daemon, body: &Value) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", d.port)).unwrap();
    let body = body.to_string();
    write!(
        s,
        "POST /v1/runs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nAccept: application/x-ndjson\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        d.token,
        body.len()
    )
    .unwrap();
    s
}

/// The sample `name` (labels included, as /metrics writes them), if there is one.
fn sample(d: &Daemon, name: &str) -> Option<f64> {
    let text = d.get("/metrics").body;
    let text = text.as_str().expect("metrics text");
    text.lines()
        .find(|l| l.split(' ').next() == Some(name))
        .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
}

fn metric(d: &Daemon, name: &str) -> f64 {
    sample(d, name).unwrap_or_else(|| panic!("{name} not in /metrics"))
}

/// Regression (issue 18, the herd): idle waiters cost the daemon nothing. Each waiter
/// re-read its run every second (`WAIT_POLL`), so 900 waiters with nothing changing
/// made the state task handle 900 messages a second. Now 2,000 idle waiters (1,200
/// long polls, 400 streams, 400 detached) cost it no message over 2 s: counted, not
/// timed (the counter may grow by the scrapes themselves, never per waiter).
#[test]
fn idle_waiters_cost_the_state_task_no_messages() {
    const POLLS: usize = 1_200;
    const STREAMS: usize = 400;
    const DETACHED: usize = 400;
    let nofile = rustix::process::Rlimit {
        current: Some(8_192),
        maximum: Some(8_192),
    };
    rustix::process::setrlimit(rustix::process::Resource::Nofile, nofile).unwrap();
    // One token holds all 1,600 waits here: past the default cap (S10), so raised.
    let mut d = Daemon::unstarted(&["--slots-max", "1", "--token-waits-max", "4096"]);
    d.nofile = Some(8_192);
    d.spawn();
    let fence = hold(&d, "holder");
    let mut conns: Vec<TcpStream> = Vec::new();
    for i in 0..POLLS + STREAMS + DETACHED {
        let id = format!("w{i}");
        match i {
            i if i < POLLS => conns.push(long_poll(&d, &body(&id, json!({})))),
            i if i < POLLS + STREAMS => conns.push(stream(&d, &body(&id, json!({})))),
            _ => {
                detach(&d, &id);
            }
        }
    }
    let all = (POLLS + STREAMS + DETACHED) as u64;
    let queued = || {
        d.get("/v1/status").body["queued"]["foreground"]
            .as_u64()
            .unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while queued() < all {
        assert!(Instant::now() < deadline, "{} of {all} queued", queued());
        std::thread::sleep(Duration::from_millis(50));
    }
    // The arrivals moved the queue: the streams hear of it once (within a second).
    std::thread::sleep(Duration::from_millis(1_500));
    let (messages, polls) = (
        metric(&d, "berth_state_messages_total"),
        metric(&d, "berth_waiter_polls_total"),
    );
    std::thread::sleep(Duration::from_secs(2));
    let (messages_after, polls_after) = (
        metric(&d, "berth_state_messages_total"),
        metric(&d, "berth_waiter_polls_total"),
    );
    assert_eq!(
        polls_after, polls,
        "waiters re-read their runs with nothing moving"
    );
    assert!(
        messages_after - messages < 10.0,
        "{} messages in 2 s with {all} idle waiters",
        messages_after - messages
    );
    // They still wait for real: a release grants the first at once, and the queue
    // moving is told to the streams (each re-reads its position once).
    release(&d, "holder", fence);
    let deadline = Instant::now() + Duration::from_secs(30);
    while d.get("/v1/status").body["granted"] != 1 || queued() != all - 1 {
        assert!(Instant::now() < deadline, "{:?}", d.get("/v1/status").body);
        std::thread::sleep(Duration::from_millis(20));
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(&d, "berth_waiter_polls_total") < polls_after + STREAMS as f64 {
        assert!(
            Instant::now() < deadline,
            "the streams never heard the queue move"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(conns);
}

/// Malformed `detach` is a `400` naming the field, and nothing is queued.
#[test]
fn a_malformed_detach_is_refused_naming_the_field_and_queues_nothing() {
    let d = Daemon::start(&["--slots-max", "1"]);
    let _f0 = hold(&d, "h");
    for bad in [json!("yes"), json!(1), json!({})] {
        let r = d.post("/v1/runs", &body("x", json!({ "detach": bad })).to_string());
        assert_eq!(
            (r.status, r.code()),
            (400, "invalid"),
            "{bad}: {:?}",
            r.body
        );
        assert!(r.body.to_string().contains("detach"), "{:?}", r.body);
    }
    assert_eq!(
        d.get("/v1/runs/x").status,
        404,
        "a refused acquire left a run"
    );
    assert_eq!(d.get("/v1/status").body["queued"]["foreground"], 0);
}

/// `name` or 0 when no such sample exists.
fn metric_or_zero(d: &Daemon, name: &str) -> f64 {
    sample(d, name).unwrap_or(0.0)
}

/// A queued long poll leaves hyper for its wait (park.rs). Granted, it gets one
/// HTTP/1.1 response with the lease and `connection: close` (reading to the end
/// returns: the daemon closed it), counted once in `berth_http_requests_total` under
/// its real status; the placeholder hyper was handed is neither sent nor counted. A
/// client that leaves while parked is cancelled (A9).
#[test]
fn a_parked_long_poll_is_answered_once_and_its_client_leaving_cancels_it() {
    use std::io::Read;
    let created = r#"berth_http_requests_total{route="/v1/runs",method="POST",status="201"}"#;
    let placeholder = r#"berth_http_requests_total{route="/v1/runs",method="POST",status="200"}"#;
    let d = Daemon::start(&["--slots-max", "1"]);
    let f0 = hold(&d, "h");
    let mut a1 = long_poll(&d, &body("a1", json!({})));
    d.wait_until("a1 queued", |d| state(d, "a1")["state"] == "queued");
    let a2 = long_poll(&d, &body("a2", json!({})));
    d.wait_until("a2 queued", |d| state(d, "a2")["state"] == "queued");
    let before = metric_or_zero(&d, created);
    drop(a2);
    wait_state(&d, "a2", "cancelled");
    release(&d, "h", f0);
    a1.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut text = String::new();
    a1.read_to_string(&mut text).unwrap();
    let (head, json) = text.split_once("\r\n\r\n").expect("one response");
    assert!(head.starts_with("HTTP/1.1 201 Created\r\n"), "{head}");
    assert!(head.contains("connection: close"), "{head}");
    assert!(head.contains("content-type: application/json"), "{head}");
    let lease: Value = serde_json::from_str(json).expect("the body is the lease alone");
    assert_eq!(lease["run_id"], "a1", "{lease:?}");
    assert_eq!(lease["state"], "granted", "{lease:?}");
    assert!(lease["fence"].as_u64().unwrap() > f0, "{lease:?}");
    assert_eq!(metric_or_zero(&d, created), before + 1.0);
    assert_eq!(
        metric_or_zero(&d, placeholder),
        0.0,
        "the placeholder was counted"
    );
}

/// A hostile parked client: it keeps sending after its request (a parked socket serves
/// nothing more). Past 4 KiB it counts as gone, so its waiter is cancelled (A9), and
/// the daemon goes on serving everyone else.
#[test]
fn a_parked_client_that_floods_its_socket_is_cut_off_and_its_waiter_cancelled() {
    let d = Daemon::start(&["--slots-max", "1"]);
    let f0 = hold(&d, "h");
    let mut flood = long_poll(&d, &body("f1", json!({})));
    d.wait_until("f1 queued", |d| state(d, "f1")["state"] == "queued");
    let quiet = long_poll(&d, &body("q2", json!({})));
    d.wait_until("q2 queued", |d| state(d, "q2")["state"] == "queued");
    // Under the limit: still waiting.
    flood.write_all(&[b'x'; 1024]).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(state(&d, "f1")["state"], "queued");
    // Over it: cut off. (The write may fail once the daemon has closed the socket.)
    let _ = flood.write_all(&[b'x'; 8 * 1024]);
    wait_state(&d, "f1", "cancelled");
    assert_eq!(state(&d, "q2")["position"], 1, "the quiet waiter moved up");
    release(&d, "h", f0);
    wait_state(&d, "q2", "granted");
    drop(quiet);
}

/// Regression (found by `berth-bench fleet`'s wake-up, one trial of 5,004 ms): a waiter
/// granted between its caller's last look and the caller's long poll has no change left
/// to come, so the poll answered only after `wait_s` (`berth wait` waited a whole 60 s
/// round for it). Told the state the caller last saw (`state`), it answers at once.
#[test]
fn regression_a_long_poll_told_the_state_last_seen_answers_a_grant_made_before_it_at_once() {
    let d = Daemon::start(&["--slots-max", "1"]);
    let f0 = hold(&d, "h");
    assert_eq!(detach(&d, "w")["state"], "queued");
    // Granted before the caller polls.
    release(&d, "h", f0);
    wait_state(&d, "w", "granted");
    let t = Instant::now();
    let r = d.get("/v1/runs/w?wait_s=30&state=queued");
    assert_eq!((r.status, r.body["state"].as_str()), (200, Some("granted")));
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "answered after {:?}",
        t.elapsed()
    );
    // Still in the state seen: it waits for a change, as without `state`.
    let t = Instant::now();
    let r = d.get("/v1/runs/w?wait_s=1&state=granted");
    assert_eq!((r.status, r.body["state"].as_str()), (200, Some("granted")));
    assert!(
        t.elapsed() >= Duration::from_millis(900),
        "{:?}",
        t.elapsed()
    );
    let r = d.get("/v1/runs/w?wait_s=1&state=waiting");
    assert_eq!((r.status, r.code()), (400, "invalid"), "{:?}", r.body);
    assert!(r.body.to_string().contains("state"), "{:?}", r.body);
}
