//! Seeing what berth does (D5): the journal, its export, the live event stream,
//! `/metrics` and `berth events`, against the real binary.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{long_poll, Daemon};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into()
}

/// A GET's status, headers and body text.
fn get_raw(d: &Daemon, path: &str) -> (u16, ureq::http::HeaderMap, String) {
    let r = agent()
        .get(format!("{}{path}", d.url))
        .header("Authorization", format!("Bearer {}", d.token))
        .call()
        .unwrap();
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    (status, headers, r.into_body().read_to_string().unwrap())
}

fn kinds_of(entries: &[Value], run: &str) -> Vec<String> {
    entries
        .iter()
        .filter(|e| e["run_id"] == run)
        .map(|e| e["kind"].as_str().unwrap().to_string())
        .collect()
}

fn acquire(d: &Daemon, id: &str) -> u64 {
    let r = d.post(
        "/v1/runs",
        &json!({"run_id": id, "project": id, "resources": {"cpu_millis": 10, "disk": 1024}})
            .to_string(),
    );
    assert_eq!(r.status, 201, "{id}: {:?}", r.body);
    r.body["fence"].as_u64().unwrap()
}

fn release(d: &Daemon, id: &str, fence: u64) {
    let r = d.post(
        &format!("/v1/runs/{id}/release"),
        &json!({ "fence": fence }).to_string(),
    );
    assert_eq!(r.status, 200, "{id}: {:?}", r.body);
}

/// Every change is an entry, numbered 1, 2, 3, ... in order; a restart (kill -9)
/// continues the numbering without a gap or a repeat; an export of the same prefix is
/// the same bytes with the SHA-256 of exactly those bytes.
#[test]
fn the_journal_holds_every_change_in_order_and_exports_the_same_bytes() {
    let mut d = Daemon::start(&["--slots-max", "1"]);
    let fa = acquire(&d, "a");
    let _waiter = long_poll(&d, &json!({"run_id": "b", "project": "b"}));
    d.wait_until("b queues", |d| {
        d.get("/v1/runs/b").body["state"] == "queued"
    });
    release(&d, "a", fa);
    d.wait_until("b is granted", |d| {
        d.get("/v1/runs/b").body["state"] == "granted"
    });
    let fb = d.get("/v1/runs/b").body["fence"].as_u64().unwrap();
    let t = d.post("/v1/tokens", &json!({"scope": "read"}).to_string());
    assert_eq!(t.status, 201);
    let refused = d.post(
        "/v1/runs",
        &json!({"run_id": "huge", "project": "huge", "resources": {"memory": 1u64 << 50}})
            .to_string(),
    );
    assert!(refused.status >= 400, "{:?}", refused.body);

    let all = d.journal();
    let seqs: Vec<u64> = all.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
    assert_eq!(seqs, (1..=all.len() as u64).collect::<Vec<_>>(), "{all:#?}");
    assert_eq!(
        kinds_of(&all, "a"),
        ["queued", "granted", "released", "ended"]
    );
    assert_eq!(kinds_of(&all, "b"), ["queued", "granted"]);
    let granted_a = all
        .iter()
        .find(|e| e["run_id"] == "a" && e["kind"] == "granted");
    assert_eq!(granted_a.unwrap()["data"]["fence"], fa);
    let queued_b = all.iter().find(|e| e["run_id"] == "b").unwrap();
    assert_eq!(queued_b["data"]["position"], 1);
    assert!(queued_b["data"]["reason"]["code"].is_string(), "{queued_b}");
    assert_eq!(queued_b["project"], "b");
    assert!(all
        .iter()
        .any(|e| e["kind"] == "token_created" && e["data"]["scope"] == "read"));
    let refusal = all
        .iter()
        .find(|e| e["kind"] == "refused")
        .expect("the refusal");
    assert_eq!(refusal["run_id"], "huge");
    assert_eq!(refusal["data"]["code"], refused.code());
    assert!(!all
        .iter()
        .any(|e| e.to_string().contains(&t.body["token"].to_string()[1..20])));

    // The export: the digest of exactly the bytes sent, the same twice, and a shorter
    // prefix is a prefix of the bytes.
    let export = |d: &Daemon, q: &str| {
        let (status, h, body) = get_raw(d, &format!("/v1/journal/export{q}"));
        assert_eq!(status, 200, "{body}");
        let digest = h["x-berth-journal-sha256"].to_str().unwrap().to_string();
        (
            body,
            digest,
            h["x-berth-journal-through"].to_str().unwrap().to_string(),
        )
    };
    let (whole, digest, through) = export(&d, "");
    assert_eq!(through, seqs.len().to_string());
    let hex: String = Sha256::digest(whole.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(digest, hex, "the header is the digest of the body");
    assert_eq!(
        export(&d, ""),
        (whole.clone(), digest.clone(), through.clone())
    );
    let (three, d3, _) = export(&d, "?through=3");
    assert_eq!(three.lines().count(), 3);
    assert!(whole.starts_with(&three));
    assert_ne!(d3, digest);
    let past = d.get(&format!("/v1/journal/export?through={}", seqs.len() + 1));
    assert_eq!((past.status, past.code()), (400, "invalid"));
    assert!(past.body["error"]["message"]
        .as_str()
        .unwrap()
        .starts_with("through:"));
    for (q, field) in [
        ("limit=0", "limit"),
        ("limit=1001", "limit"),
        ("after=x", "after"),
    ] {
        let r = d.get(&format!("/v1/journal?{q}"));
        assert_eq!(r.status, 400, "{q}");
        assert_eq!(r.body["error"]["details"]["field"], field, "{q}");
    }

    // After kill -9 the numbering goes on from the last entry.
    let last = *seqs.last().unwrap();
    d.kill9_and_restart();
    release(&d, "b", fb);
    let after = d.journal();
    assert_eq!(
        &after[..all.len()],
        &all[..],
        "the journal survived the crash as it was"
    );
    let new: Vec<u64> = after[all.len()..]
        .iter()
        .map(|e| e["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(new.first(), Some(&(last + 1)), "{:#?}", &after[all.len()..]);
    assert_eq!(
        new,
        (last + 1..=last + new.len() as u64).collect::<Vec<_>>()
    );
    let (whole_again, digest_again, _) = export(&d, &format!("?through={last}"));
    assert_eq!((whole_again, digest_again), (whole, digest));
}

/// An event of an SSE stream: (id, event, data).
type Sse = (Option<u64>, String, Value);

/// Reads a stream's events on a thread; each arrives on the channel.
fn stream(d: &Daemon, query: &str, last_id: Option<u64>) -> mpsc::Receiver<Sse> {
    let mut r = agent()
        .get(format!("{}/v1/events{query}", d.url))
        .header("Authorization", format!("Bearer {}", d.token));
    if let Some(id) = last_id {
        r = r.header("Last-Event-ID", id.to_string());
    }
    let resp = r.call().unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let (tx, rx) = mpsc::channel();
    let body = BufReader::new(resp.into_body().into_reader());
    std::thread::spawn(move || parse_sse(body, |ev| tx.send(ev).is_ok()));
    rx
}

fn parse_sse(body: impl BufRead, mut each: impl FnMut(Sse) -> bool) {
    let (mut id, mut kind, mut data) = (None, String::new(), String::new());
    for l in body.lines() {
        let Ok(l) = l else { return };
        if let Some(v) = l.strip_prefix("id: ") {
            id = v.parse().ok();
        } else if let Some(v) = l.strip_prefix("event: ") {
            kind = v.to_string();
        } else if let Some(v) = l.strip_prefix("data: ") {
            data = v.to_string();
        } else if l.is_empty() && !data.is_empty() {
            let ev = (
                id.take(),
                std::mem::take(&mut kind),
                serde_json::from_str(&data).unwrap(),
            );
            data.clear();
            if !each(ev) {
                return;
            }
        }
    }
}

fn next(rx: &mpsc::Receiver<Sse>, what: &str) -> Sse {
    rx.recv_timeout(Duration::from_secs(10))
        .unwrap_or_else(|_| panic!("no event: {what}"))
}

/// `/v1/events` replays from `after`, goes on live, resumes after `Last-Event-ID`
/// without a gap or a duplicate, and filters by run and kind.
#[test]
fn the_event_stream_resumes_without_gaps_or_duplicates_and_filters() {
    let d = Daemon::start(&["--slots-max", "2"]);
    let f1 = acquire(&d, "one");
    release(&d, "one", f1);
    let rx = stream(&d, "?after=0", None);
    let replay: Vec<Sse> = (0..4).map(|_| next(&rx, "replay")).collect();
    assert_eq!(
        replay
            .iter()
            .map(|e| (e.0, e.1.as_str()))
            .collect::<Vec<_>>(),
        [
            (Some(1), "queued"),
            (Some(2), "granted"),
            (Some(3), "released"),
            (Some(4), "ended")
        ]
    );
    assert_eq!(
        replay[1].2["data"]["fence"], f1,
        "the data is the journal entry"
    );
    // Live: a new run's events arrive as they happen, numbered on.
    let f2 = acquire(&d, "two");
    let live = next(&rx, "live grant of two");
    assert_eq!((live.0, live.1.as_str()), (Some(5), "queued"));
    assert_eq!(next(&rx, "granted").0, Some(6));
    drop(rx);
    release(&d, "two", f2);
    // Resume after 5: exactly 6, 7, 8 (granted, released, ended), then nothing more.
    let rx = stream(&d, "", Some(5));
    let resumed: Vec<Option<u64>> = (0..3).map(|_| next(&rx, "resumed").0).collect();
    assert_eq!(resumed, [Some(6), Some(7), Some(8)]);
    assert!(
        rx.recv_timeout(Duration::from_millis(300)).is_err(),
        "a duplicate or a stray"
    );
    // Filters: one run, some kinds.
    let rx = stream(&d, "?after=0&run=two&kind=granted,ended", None);
    let got: Vec<(Option<u64>, String)> = (0..2)
        .map(|_| next(&rx, "filtered"))
        .map(|e| (e.0, e.1))
        .collect();
    assert_eq!(
        got,
        [
            (Some(6), "granted".to_string()),
            (Some(8), "ended".to_string())
        ]
    );
    for (q, field) in [("?run=%20x", "run"), ("?after=x", "after")] {
        let r = d.get(&format!("/v1/events{q}"));
        assert_eq!(
            (r.status, r.body["error"]["details"]["field"].as_str()),
            (400, Some(field)),
            "{q}"
        );
    }
    let ahead = d.get("/v1/events?after=999");
    assert_eq!(ahead.status, 400, "{:?}", ahead.body);
}

/// A socket with a small receive buffer, so a reader that does not read falls behind
/// after a few entries rather than after megabytes of kernel buffers.
fn small_socket(port: u16) -> TcpStream {
    use std::os::fd::FromRawFd;
    // SAFETY: plain socket calls on a descriptor this function owns until it hands it
    // to TcpStream.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
        assert!(fd >= 0);
        let size: libc::c_int = 4096;
        let p = &size as *const libc::c_int as *const libc::c_void;
        libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_RCVBUF, p, 4);
        let addr = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: port.to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from_be_bytes([127, 0, 0, 1]).to_be(),
            },
            sin_zero: [0; 8],
        };
        let a = &addr as *const libc::sockaddr_in as *const libc::sockaddr;
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        assert_eq!(libc::connect(fd, a, len), 0);
        TcpStream::from_raw_fd(fd)
    }
}

/// A reader that stops reading never slows admission: berth goes on granting, and
/// once the reader is too far behind its stream ends with a `cutoff` event naming the
/// last entry it was sent; it resumes from there without a gap.
#[test]
fn a_reader_that_falls_behind_is_cut_off_and_resumes_by_id() {
    let d = Daemon::start(&["--slots-max", "8"]);
    let mut slow = small_socket(d.port);
    write!(
        slow,
        "GET /v1/events?after=0 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\n\r\n",
        d.token
    )
    .unwrap();
    // ~4 entries a lifecycle, in rounds, until berth has cut the stalled reader off
    // (its stream is no longer counted): past the 4,096 entries a reader may lag plus
    // what the kernel's socket buffers and the stream's own buffer held for it.
    d.wait_until("the stalled stream is open", |d| subscribers(d) == 1.0);
    let started = Instant::now();
    let mut lifecycles = 0;
    while subscribers(&d) > 0.0 {
        assert!(lifecycles < 20_000, "the stalled reader was never cut off");
        std::thread::scope(|s| {
            for t in 0..4 {
                let d = &d;
                s.spawn(move || {
                    for i in 0..100 {
                        let id = format!("r{lifecycles}-{t}-{i}");
                        let f = acquire(d, &id);
                        release(d, &id, f);
                    }
                });
            }
        });
        lifecycles += 400;
    }
    let took = started.elapsed();
    let mut text = String::new();
    slow.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut buf = [0u8; 65536];
    while !text.contains("event: cutoff") {
        let n = slow
            .read(&mut buf)
            .expect("the stream ends with a cutoff event");
        assert!(n > 0, "the stream closed without a cutoff event");
        text.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    // The rest of the cutoff event.
    while !text[text.find("event: cutoff").unwrap()..].contains("\n\n") {
        let n = slow.read(&mut buf).unwrap();
        text.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    let ids: Vec<u64> = text
        .lines()
        .filter_map(|l| l.strip_prefix("id: ")?.parse().ok())
        .collect();
    let cut = &text[text.find("event: cutoff").unwrap()..];
    let data = cut.lines().find_map(|l| l.strip_prefix("data: ")).unwrap();
    let cut: Value = serde_json::from_str(data).unwrap();
    assert!(
        ids.len() > 10,
        "the reader got some events first: {}",
        ids.len()
    );
    assert_eq!(
        ids,
        (1..=ids.len() as u64).collect::<Vec<_>>(),
        "no gap before the cut"
    );
    assert_eq!(cut["last_seq"].as_u64(), ids.last().copied(), "{cut}");
    assert!(
        cut["reason"].as_str().unwrap().contains("Last-Event-ID"),
        "{cut}"
    );
    eprintln!(
        "{lifecycles} lifecycles in {took:?} with a stalled reader; it was cut off after {} events",
        ids.len()
    );
    let rx = stream(&d, "", Some(*ids.last().unwrap()));
    assert_eq!(
        next(&rx, "resumed after the cut").0,
        Some(ids.last().unwrap() + 1)
    );
}

fn subscribers(d: &Daemon) -> f64 {
    let (_, _, text) = get_raw(d, "/metrics");
    let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).unwrap();
    sample(&scrape, "berth_sse_subscribers", None)
}

fn sample(s: &prometheus_parse::Scrape, name: &str, label: Option<(&str, &str)>) -> f64 {
    let found = s
        .samples
        .iter()
        .find(|x| x.metric == name && label.is_none_or(|(k, v)| x.labels.get(k) == Some(v)));
    match found.map(|x| &x.value) {
        Some(prometheus_parse::Value::Counter(v))
        | Some(prometheus_parse::Value::Gauge(v))
        | Some(prometheus_parse::Value::Untyped(v)) => *v,
        other => panic!("{name} {label:?}: {other:?}"),
    }
}

/// `/metrics` parses as Prometheus text, and its figures agree with the journal and
/// `/v1/status`.
#[test]
fn metrics_parse_and_agree_with_the_journal_and_the_status() {
    let d = Daemon::start(&["--slots-max", "2"]);
    let f = acquire(&d, "m1");
    release(&d, "m1", f);
    let _held = acquire(&d, "m2");
    let _waiter = long_poll(&d, &json!({"run_id": "m3", "project": "m2"}));
    d.wait_until("m3 queues", |d| {
        d.get("/v1/runs/m3").body["state"] == "queued"
    });
    let rx = stream(&d, "", None);
    let (status, h, text) = get_raw(&d, "/metrics");
    assert_eq!(status, 200);
    assert!(h["content-type"]
        .to_str()
        .unwrap()
        .contains("openmetrics-text"));
    let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).unwrap();
    // Every metric has help text and the prefix.
    for name in [
        "grants",
        "releases",
        "expiries",
        "refusals",
        "reaps",
        "degraded",
        "queue_depth",
        "queue_waiters_by_reason",
        "capacity_total",
        "capacity_committed",
        "capacity_available",
        "ledger_commit_seconds",
        "ledger_commit_batches",
        "http_requests",
        "sse_subscribers",
    ] {
        assert!(
            scrape.docs.contains_key(&format!("berth_{name}")),
            "no help for berth_{name}:\n{text}"
        );
    }
    let grants = d
        .journal()
        .iter()
        .filter(|e| e["kind"] == "granted")
        .count();
    assert_eq!(sample(&scrape, "berth_grants_total", None), grants as f64);
    assert_eq!(sample(&scrape, "berth_releases_total", None), 1.0);
    assert_eq!(
        sample(
            &scrape,
            "berth_queue_depth",
            Some(("priority", "foreground"))
        ),
        1.0
    );
    let reason = d.get("/v1/runs/m3").body["reason"]["code"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(
        sample(
            &scrape,
            "berth_queue_waiters_by_reason",
            Some(("reason", &reason))
        ),
        1.0
    );
    let st = d.get("/v1/status").body;
    for r in st["resources"].as_array().unwrap() {
        let name = r["name"].as_str().unwrap();
        for (metric, field) in [
            ("total", "total"),
            ("committed", "committed"),
            ("available", "available"),
        ] {
            assert_eq!(
                sample(
                    &scrape,
                    &format!("berth_capacity_{metric}"),
                    Some(("resource", name))
                ),
                r[field].as_u64().unwrap() as f64,
                "{name} {field}"
            );
        }
    }
    assert_eq!(sample(&scrape, "berth_sse_subscribers", None), 1.0);
    let created = scrape.samples.iter().find(|x| {
        x.metric == "berth_http_requests_total"
            && x.labels.get("route") == Some("/v1/runs")
            && x.labels.get("status") == Some("201")
    });
    assert!(
        matches!(created.map(|x| &x.value), Some(prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Untyped(v)) if *v >= 2.0),
        "{text}"
    );
    let commits = scrape
        .samples
        .iter()
        .find(|x| x.metric == "berth_ledger_commit_seconds");
    assert!(
        matches!(commits.map(|x| &x.value), Some(prometheus_parse::Value::Histogram(b)) if !b.is_empty()),
        "{text}"
    );
    drop(rx);
    // Unauthenticated scrapes are refused like any read.
    let anon = d.call_as(None, "GET", "/metrics", None);
    assert_eq!(anon.status, 401);
}

/// Issue 34: `berth events` is the whole journal, paged, as the README says (it was the
/// last 20 entries, and `--kind` filtered only those); `--last N` keeps the last N the
/// filters admit.
#[test]
fn berth_events_reads_the_whole_journal_and_kind_filters_all_of_it() {
    let d = Daemon::start(&["--slots-max", "2"]);
    for i in 0..12 {
        let id = format!("many{i}");
        let f = acquire(&d, &id);
        release(&d, &id, f);
    }
    let kinds = |args: &[&str]| -> Vec<String> {
        let out = d.cli().args(args).output().unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| l.split_whitespace().nth(2).unwrap().to_string())
            .collect()
    };
    let all = kinds(&["events"]);
    assert!(
        all.len() >= 48,
        "every entry, not the last 20: {}",
        all.len()
    );
    let granted = kinds(&["events", "--kind", "granted"]);
    assert_eq!(granted.len(), 12, "{granted:?}");
    assert_eq!(
        kinds(&["events", "--kind", "granted", "--last", "3"]).len(),
        3
    );
}

/// `berth events` prints a run's history; `--follow` prints new events as they come.
#[test]
fn berth_events_prints_history_and_follows() {
    let d = Daemon::start(&["--slots-max", "2"]);
    let f = acquire(&d, "cli1");
    release(&d, "cli1", f);
    let out = d.cli().args(["events", "--run", "cli1"]).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    let kinds: Vec<&str> = text
        .lines()
        .map(|l| l.split_whitespace().nth(2).unwrap())
        .collect();
    assert_eq!(kinds, ["queued", "granted", "released", "ended"], "{text}");
    let mut follow = d
        .cli()
        .args(["events", "--follow", "--kind", "granted", "--json"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = mpsc::channel();
    let stdout = follow.stdout.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    // Its first line is the earlier grant (the last 20 entries), then the new one.
    let first: Value =
        serde_json::from_str(&rx.recv_timeout(Duration::from_secs(10)).unwrap()).unwrap();
    assert_eq!(first["run_id"], "cli1");
    acquire(&d, "cli2");
    let line = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the new grant, followed");
    let e: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(
        (e["kind"].as_str(), e["run_id"].as_str()),
        (Some("granted"), Some("cli2"))
    );
    let _ = follow.kill();
    let _ = follow.wait();
}
