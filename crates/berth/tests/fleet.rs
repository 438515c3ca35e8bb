//! Black-box tests of fleet mode (issue 15, F1–F5): several real daemons on loopback
//! share one real PostgreSQL database (the server `scripts/test.sh` starts with
//! pg_virtualenv). One budget limit and one fence sequence fleet-wide under 300
//! concurrent acquires; a host killed with -9 declared dead exactly once, its keys
//! freed, its tokens lapsed and its fences refused everywhere; thread owners ordered
//! fleet-wide; a host cut off from the database keeps its runs, refuses new claims
//! with 503 and never grants one it cannot record, and recovers.

mod common;

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use berth_store::fleet::{FleetStore, PgFleet};
use common::fleet::{acquire, database, granted, host, release, ROOMY};
use common::Daemon;
use serde_json::{json, Value};

fn fence_check(d: &Daemon, run: &str, fence: u64) -> Value {
    let r = d.get(&format!("/v1/fences/check?run_id={run}&fence={fence}"));
    assert_eq!(r.status, 200, "{:?}", r.body);
    r.body
}

fn budget(limit: u32) -> Value {
    json!({"budget": {"scope": "fleet-exp", "harness": "claude", "per_harness": {"claude": limit}}})
}

/// F1/B2: 300 concurrent acquires over three hosts, each with a token of one harness
/// limited to 5 fleet-wide. Sampled at every grant (the fleet's own token rows) the
/// holders never exceed 5 and reach 5 (there is contention to fail on); every fence is
/// unique fleet-wide; every run ends and every token comes back.
#[test]
fn three_hosts_share_one_budget_limit_and_one_fence_sequence() {
    let db = database();
    let hosts: Vec<Arc<Daemon>> = (0..3)
        .map(|i| Arc::new(host(&db, &format!("h{i}"), "60s", "5s")))
        .collect();
    let peak = Arc::new(AtomicUsize::new(0));
    let fences = Arc::new(Mutex::new(Vec::new()));
    let threads: Vec<_> = (0..30)
        .map(|t| {
            let (d, peak, fences, db) = (
                hosts[t % 3].clone(),
                peak.clone(),
                fences.clone(),
                db.clone(),
            );
            std::thread::spawn(move || {
                let mut pg = PgFleet::open(&db).unwrap();
                for i in 0..10 {
                    let run = format!("r{t}-{i}");
                    let r = acquire(&d, &run, budget(5));
                    assert!((200..=202).contains(&r.status), "{run}: {:?}", r.body);
                    let fence = granted(&d, &run);
                    let held = pg
                        .tokens("fleet-exp")
                        .unwrap()
                        .iter()
                        .filter(|t| !t.lapsed)
                        .count();
                    assert!(
                        held <= 5,
                        "{held} tokens held fleet-wide at the grant of {run}"
                    );
                    peak.fetch_max(held, Ordering::Relaxed);
                    fences.lock().unwrap().push(fence);
                    std::thread::sleep(Duration::from_millis(5));
                    release(&d, &run, fence);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let fences = fences.lock().unwrap();
    let unique: BTreeSet<u64> = fences.iter().copied().collect();
    assert_eq!(fences.len(), 300);
    assert_eq!(unique.len(), 300, "a fence was granted twice in the fleet");
    assert_eq!(
        peak.load(Ordering::Relaxed),
        5,
        "the limit was never reached: no contention"
    );
    let mut pg = PgFleet::open(&db).unwrap();
    hosts[0].wait_until("every token back", |_| {
        pg.tokens("fleet-exp").unwrap().is_empty()
    });
    // The fleet view sums the three live hosts.
    let f = hosts[1].get("/v1/fleet");
    assert_eq!(f.status, 200, "{:?}", f.body);
    assert_eq!(f.body["hosts"].as_array().unwrap().len(), 3, "{}", f.body);
    assert_eq!(f.body["totals"]["slots"]["total"], 192, "{}", f.body);
}

/// F2: a host killed with -9 while it holds a budget token and a fleet key. After the
/// lapse another host declares it dead exactly once; its key is free for another host,
/// its token is marked lapsed and still counts; its fences are refused on every host
/// (they were current before the kill).
#[test]
fn a_killed_host_is_declared_dead_once_and_its_fences_are_refused_everywhere() {
    let db = database();
    let a = host(&db, "a", "3s", "1s");
    let mut b = host(&db, "b", "3s", "1s");
    let c = host(&db, "c", "3s", "1s");
    let r = acquire(&b, "rb-token", budget(2));
    assert!(r.status < 300, "{:?}", r.body);
    let f_token = granted(&b, "rb-token");
    let r = acquire(&b, "rb-key", json!({"singletons": ["fleet:staging-db"]}));
    assert!(r.status < 300, "{:?}", r.body);
    let f_key = granted(&b, "rb-key");
    // Before: the other hosts see the fences as current, and the key as held.
    for d in [&a, &c] {
        assert_eq!(fence_check(d, "rb-token", f_token)["current"], true);
        assert_eq!(fence_check(d, "rb-key", f_key)["host"], "b");
    }
    // A `wait_s = 0` run is tried once: the key is b's, so it is not granted.
    let r = acquire(
        &a,
        "ra-key",
        json!({"singletons": ["fleet:staging-db"], "wait_s": 0}),
    );
    assert_eq!(r.code(), "expired", "the key is held by b: {:?}", r.body);
    let r = acquire(&a, "ra-now", json!({"wait_s": 0}));
    assert_eq!(
        r.status, 201,
        "a run with nothing held elsewhere: {:?}",
        r.body
    );
    assert_eq!(r.body["state"], "granted");
    b.kill9();
    let mut pg = PgFleet::open(&db).unwrap();
    a.wait_until("b declared dead", |_| {
        !pg.declarations("b").unwrap().is_empty()
    });
    std::thread::sleep(Duration::from_millis(1_500));
    let decl = pg.declarations("b").unwrap();
    assert_eq!(decl.len(), 1, "declared more than once: {decl:?}");
    assert!(decl[0].1 == "a" || decl[0].1 == "c", "{decl:?}");
    // Its fences are refused on every live host.
    for d in [&a, &c] {
        for (run, f) in [("rb-token", f_token), ("rb-key", f_key)] {
            let v = fence_check(d, run, f);
            assert_eq!(v["current"], false, "{run} on a dead host: {v}");
        }
    }
    // Its key is free; its token is lapsed, held, not freed (B3).
    let r = acquire(&c, "rc-key", json!({"singletons": ["fleet:staging-db"]}));
    assert!(r.status < 300, "{:?}", r.body);
    granted(&c, "rc-key");
    let t = pg.tokens("fleet-exp").unwrap();
    assert!(
        t.len() == 1 && t[0].lapsed && t[0].owner == "rb-token",
        "{t:?}"
    );
    // The dead host is listed as dead, by the host that declared it.
    let f = a.get("/v1/fleet").body;
    assert_eq!(f["dead"][0]["host_id"], "b", "{f}");
    assert_eq!(f["hosts"].as_array().unwrap().len(), 2, "{f}");
    // Back from the dead, b re-registers empty and its old runs are ended: its old
    // fences are refused on b too.
    b.spawn();
    b.wait_until("b's old run ended", |d| {
        fence_check(d, "rb-key", f_key)["current"] == false
    });
    assert_eq!(fence_check(&b, "rb-token", f_token)["current"], false);
    assert_eq!(pg.declarations("b").unwrap().len(), 1);
    // B3 fleet-wide (issue 35, found by the daemon simulator): an operator's reconcile
    // frees the lapsed token in the fleet store, on whichever host it is asked (the
    // scope is a's too, or none of a's: the answer is the same). Before, it freed only
    // the asking host's own token, and the owner stayed refused fleet-wide for good.
    let r = a.post(
        "/v1/scopes/fleet-exp/reconcile",
        &json!({"owner": "rb-token", "reason": "b was declared dead"}).to_string(),
    );
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(
        pg.tokens("fleet-exp").unwrap(),
        [],
        "the lapsed token stayed"
    );
    let r = acquire(&c, "rb-token", budget(2));
    assert!(r.status < 300, "{:?}", r.body);
    granted(&c, "rb-token");
}

/// The run's state within `within`, waiting while it is queued.
fn state_within(d: &Daemon, run: &str, within: Duration) -> Value {
    let end = Instant::now() + within;
    loop {
        let r = d.get(&format!("/v1/runs/{run}?wait_s=1"));
        assert_eq!(r.status, 200, "{run}: {:?}", r.body);
        if r.body["state"] != "queued" || Instant::now() >= end {
            return r.body;
        }
    }
}

/// Issue 38 item 1: after a kill -9 the host's counter jumped to its fence marker's
/// block (1,048,576 ahead), above every fleet fence: every permit was stale and
/// re-fenced in a loop, and nothing was granted, not even a run with no key. The
/// fleet's sequence is the source of fences in fleet mode.
#[test]
fn regression_a_host_restarted_after_kill_9_grants_again() {
    let db = database();
    let mut a = host(&db, "a", "60s", "5s");
    let r = acquire(&a, "before", json!({}));
    assert!(r.status < 300, "{:?}", r.body);
    let before = granted(&a, "before");
    a.kill9_and_restart();
    for (run, extra) in [
        ("plain", json!({})),
        ("keyed", json!({"singletons": ["fleet:after-crash"]})),
    ] {
        let r = acquire(&a, run, extra);
        assert!(r.status < 300, "{run}: {:?}", r.body);
        let v = state_within(&a, run, Duration::from_secs(10));
        assert_eq!(v["state"], "granted", "{run} after the restart: {v}");
        let fence = v["fence"].as_u64().unwrap();
        assert!(
            fence > before,
            "{run}'s fence {fence} is not above {before}"
        );
        assert_eq!(fence_check(&a, run, fence)["current"], true);
    }
    // The run granted before the crash still holds its fence (the restart resumed it).
    assert_eq!(fence_check(&a, "before", before)["current"], true);
}

/// Issue 38 item 8: two daemons with one host id took it from each other at every
/// heartbeat (54 of 90 budgeted acquires expired). A second daemon with a live host's
/// id is refused at start, naming the id and the live host's address; two daemons
/// that name no id get one each (the host name and a suffix kept in the state dir)
/// and keep their generations.
#[test]
fn regression_a_host_id_held_by_a_live_daemon_is_refused() {
    let db = database();
    let first = host(&db, "dup", "60s", "5s");
    let second = Daemon::unstarted(&[]);
    let args = [
        "--store",
        &db,
        "--host-id",
        "dup",
        "--fleet-beat",
        "100ms",
        "--stop-grace",
        "1s",
    ];
    let (st, out) = second.start_fails(&args);
    assert!(!st.success(), "a second daemon with a live id started");
    assert!(
        out.contains("dup") && out.contains(&first.url),
        "the refusal names neither the id nor {}: {out}",
        first.url
    );
    let unnamed = || {
        let mut args: Vec<&str> = ROOMY.to_vec();
        args.extend([
            "--store",
            &db,
            "--fleet-beat",
            "100ms",
            "--stop-grace",
            "1s",
        ]);
        Daemon::start(&args)
    };
    let (x, y) = (unnamed(), unnamed());
    let gens = |d: &Daemon| -> Vec<(String, i64)> {
        let f = d.get("/v1/fleet").body;
        let mut v: Vec<(String, i64)> = (f["hosts"].as_array().unwrap().iter())
            .map(|h| {
                (
                    h["host_id"].as_str().unwrap().to_string(),
                    h["generation"].as_i64().unwrap(),
                )
            })
            .collect();
        v.sort();
        v
    };
    x.wait_until("three live hosts", |d| gens(d).len() == 3);
    let then = gens(&x);
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(gens(&y), then, "the hosts took ids from each other");
    let ids: BTreeSet<&String> = then.iter().map(|(id, _)| id).collect();
    assert_eq!(ids.len(), 3, "{then:?}");
    // A restart keeps its default id (kept in the state dir).
    let x_id = std::fs::read_to_string(x.state.join("fleet-host-id")).unwrap();
    assert!(
        ids.contains(&x_id.trim().to_string()),
        "{x_id} not in {then:?}"
    );
}

/// Issue 38 item 3 (consul's failure, hashicorp/consul#9788): a daemon frozen with
/// SIGSTOP cannot stop its own runs, so `berth run` does: it cannot confirm its lease,
/// and stops CMD by the lease's expiry, before the lapse (the longest lease plus the
/// margin after the frozen host's last heartbeat) lets another host take the fleet
/// key. CMD is gone, by a margin, when the other host's grant is seen.
#[test]
fn regression_a_frozen_hosts_run_is_gone_before_another_host_takes_its_key() {
    let db = database();
    let a = host(&db, "fa", "3s", "1s");
    let b = host(&db, "fb", "3s", "1s");
    let mut cmd = Beating::under_berth_run(&a, "frozen", "3s");
    let daemon = rustix::process::Pid::from_raw(a.child.as_ref().unwrap().id() as i32).unwrap();
    rustix::process::kill_process(daemon, rustix::process::Signal::STOP).unwrap();
    let r = acquire(
        &b,
        "taker",
        json!({"singletons": ["fleet:k"], "wait_s": 60}),
    );
    assert!(r.status < 300, "{:?}", r.body);
    granted(&b, "taker");
    let gone = cmd.gone_before_now();
    rustix::process::kill_process(daemon, rustix::process::Signal::CONT).unwrap();
    gone.unwrap();
}

/// A CMD that writes the time every 20 ms: under `berth run` holding `fleet:k`, or
/// started here (ignoring SIGTERM) to be registered. Was it gone, by a margin, before
/// another host's grant was seen?
struct Beating {
    child: std::process::Child,
    pid: i32,
    beat: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Beating {
    fn script(dir: &std::path::Path, trap: &str) -> String {
        let (p, b) = (dir.join("pid"), dir.join("beat"));
        format!(
            "{trap} echo $$ > {p}; while :; do date +%s%3N > {b}.tmp && mv {b}.tmp {b}; sleep 0.02; done",
            p = p.display(),
            b = b.display()
        )
    }

    fn from(child: std::process::Child, dir: tempfile::TempDir) -> Beating {
        let pid = common::wait_pids(&dir.path().join("pid"), 1)[0];
        Beating {
            child,
            pid,
            beat: dir.path().join("beat"),
            _dir: dir,
        }
    }

    /// `berth run` on `d` of run `run` with a lease of `ttl`, holding `fleet:k`.
    fn under_berth_run(d: &Daemon, run: &str, ttl: &str) -> Beating {
        let dir = tempfile::tempdir().unwrap();
        let script = Beating::script(dir.path(), "");
        let child = d
            .cli()
            .args(["run", "--project", "p", "--run-id", run, "--singleton"])
            .args(["fleet:k", "--cpus", "0.1", "--memory", "0", "--disk", "0"])
            .args(["--ttl", ttl, "--", "sh", "-c", &script])
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        Beating::from(child, dir)
    }

    /// Started here in a group of its own, ignoring SIGTERM: only a KILL ends it.
    fn stubborn() -> Beating {
        use std::os::unix::process::CommandExt;
        let dir = tempfile::tempdir().unwrap();
        let child = std::process::Command::new("sh")
            .args(["-c", &Beating::script(dir.path(), "trap '' TERM;")])
            .process_group(0)
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        Beating::from(child, dir)
    }

    /// CMD is dead now and its last beat is more than 100 ms old.
    fn gone_before_now(&mut self) -> Result<(), String> {
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64;
        let alive = common::alive(self.pid);
        let last: i64 = std::fs::read_to_string(&self.beat)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let _ = self.child.kill();
        let _ = self.child.wait();
        match (alive, now_ms - last) {
            (true, _) => Err("CMD still ran when another host held its key".into()),
            (false, gap) if gap <= 100 => Err(format!(
                "CMD's last beat was {gap} ms before another host's grant was seen"
            )),
            _ => Ok(()),
        }
    }
}

/// Issue 38 item 7: `--ttl-max 20s --fleet-margin 10s` and a 10 s grace: the host cut
/// off from the database fenced itself a quarter of the lapse early, 7.5 s, shorter
/// than the grace, and a CMD that ignored SIGTERM ran 2.5 s beside the next holder.
/// Here the lapse is 6 s and the grace 2 s (a quarter, 1.5 s, was shorter), and the
/// run's client keeps renewing it: only the host's own fence stops it, leaving the grace
/// and the slack before the lapse.
#[test]
fn regression_a_cmd_ignoring_sigterm_is_killed_before_the_lapse() {
    let db = database();
    let (relay, relayed) = through_relay(&db);
    let mut args: Vec<&str> = ROOMY.to_vec();
    args.extend([
        "--store",
        &relayed,
        "--host-id",
        "d",
        "--fleet-beat",
        "100ms",
    ]);
    args.extend([
        "--ttl-max",
        "3s",
        "--fleet-margin",
        "3s",
        "--stop-grace",
        "2s",
    ]);
    let d = Arc::new(Daemon::start(&args));
    let e = host(&db, "e", "3s", "3s");
    let r = acquire(
        &d,
        "stubborn",
        json!({"singletons": ["fleet:k"], "ttl_s": 3}),
    );
    assert!(r.status < 300, "{:?}", r.body);
    let fence = granted(&d, "stubborn");
    let mut cmd = Beating::stubborn();
    let reg = d.post(
        "/v1/runs/stubborn/processes",
        &json!({"fence": fence, "pid": cmd.pid}).to_string(),
    );
    assert_eq!(reg.status, 201, "{:?}", reg.body);
    let renewing = Arc::new(AtomicBool::new(true));
    let renewer = {
        let (d, renewing) = (d.clone(), renewing.clone());
        std::thread::spawn(move || {
            while renewing.load(Ordering::SeqCst) {
                d.post(
                    "/v1/runs/stubborn/renew",
                    &json!({ "fence": fence }).to_string(),
                );
                std::thread::sleep(Duration::from_millis(200));
            }
        })
    };
    relay.cut();
    let r = acquire(&e, "next", json!({"singletons": ["fleet:k"], "wait_s": 60}));
    assert!(r.status < 300, "{:?}", r.body);
    granted(&e, "next");
    let gone = cmd.gone_before_now();
    renewing.store(false, Ordering::SeqCst);
    renewer.join().unwrap();
    relay.restore();
    gone.unwrap();
}

/// A host through a relay, granted a run, then the link frozen and a caller that
/// sent a `wait_s = 0` acquire (run `ghost`) and hung up 200 ms later.
fn frozen_with_a_ghost(db: &str) -> (Relay, Daemon) {
    let (relay, relayed) = through_relay(db);
    let d = host(&relayed, "d", "60s", "5s");
    assert!(acquire(&d, "before", json!({})).status < 300);
    granted(&d, "before");
    relay.freeze(true);
    let mut ghost = TcpStream::connect(("127.0.0.1", d.port)).unwrap();
    let body = json!({"run_id": "ghost", "project": "p-ghost", "wait_s": 0,
                      "resources": {"slots": 1, "memory": 0, "cpu_millis": 0, "disk": 0}});
    write_request(&mut ghost, &d.token, "POST", "/v1/runs", &body.to_string());
    std::thread::sleep(Duration::from_millis(200));
    drop(ghost);
    (relay, d)
}

/// Waits until `d` grants `wait_s = 0` runs again (its link healed).
fn claims_resume_without_the_ghost(d: &Daemon) {
    let mut n = 0;
    d.wait_until("claims resume", |d| {
        n += 1;
        acquire(d, &format!("after-{n}"), json!({"wait_s": 0})).status == 201
    });
}

fn assert_no_ghost(d: &Daemon) {
    let g = d.get("/v1/runs/ghost");
    assert!(
        g.status == 404 || g.body["state"] != "granted",
        "a run whose caller was gone was granted: {}",
        g.body
    );
}

/// One HTTP/1.1 request on `s`, kept alive.
fn write_request(s: &mut TcpStream, token: &str, method: &str, path: &str, body: &str) {
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {token}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
}

/// Issue 38 items 4 and 5: with the link to the database frozen (its peer still
/// acknowledging TCP), every acquire hung for as long as it lasted, even `wait_s = 0`
/// with no key, `/v1/fleet` too, and a `wait_s = 0` acquire whose caller gave up was
/// granted after the heal with nobody attached. Now: the fleet's questions and a
/// `wait_s = 0` claim get `503 store_unavailable` within `ANSWER_WAIT_MS` (new
/// claims at once once no heartbeat was accepted for three), local questions are
/// answered, nothing is granted to a caller that is gone, and claims resume after.
#[test]
fn regression_a_frozen_database_link_answers_503_and_grants_no_ghost() {
    let db = database();
    let (relay, d) = frozen_with_a_ghost(&db);
    let bound = Duration::from_millis(berth_server::fleet::ANSWER_WAIT_MS + 2_000);
    let t = Instant::now();
    let r = acquire(&d, "now", json!({"wait_s": 0}));
    assert_eq!(
        (r.status, r.code()),
        (503, "store_unavailable"),
        "{:?}",
        r.body
    );
    assert!(t.elapsed() < bound, "the acquire took {:?}", t.elapsed());
    let t = Instant::now();
    assert_eq!(d.get("/v1/fleet").status, 503);
    assert!(t.elapsed() < bound, "/v1/fleet took {:?}", t.elapsed());
    let t = Instant::now();
    assert_eq!(d.get("/v1/status").status, 200);
    assert_eq!(d.get("/v1/runs/before").body["state"], "granted");
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "local questions waited"
    );
    relay.freeze(false);
    // Healed: new runs are granted again, and the caller that left was not.
    claims_resume_without_the_ghost(&d);
    std::thread::sleep(Duration::from_millis(500));
    assert_no_ghost(&d);
}

/// Issue 38 item 2: a release acknowledged just before a kill -9 ended the run here,
/// but its ending had not reached the fleet yet: the restarted host carried the claim
/// over to its new generation and never ended it, and the key stayed held for good
/// (18 of 20 kills). The registration ends the claims of runs that ended here, so the
/// key is free again as soon as the host is back, long before any lapse (65 s here).
#[test]
fn regression_a_release_just_before_a_kill_9_frees_its_fleet_key() {
    let db = database();
    let mut a = host(&db, "a", "60s", "5s");
    let b = host(&db, "b", "60s", "5s");
    for i in 0..3 {
        let run = format!("held-{i}");
        let r = acquire(&a, &run, json!({"singletons": ["fleet:shared"]}));
        assert!(r.status < 300, "{:?}", r.body);
        let fence = granted(&a, &run);
        release(&a, &run, fence);
        a.kill9_and_restart();
        let taker = format!("taker-{i}");
        let r = acquire(&b, &taker, json!({"singletons": ["fleet:shared"]}));
        assert!(r.status < 300, "{:?}", r.body);
        let v = state_within(&b, &taker, Duration::from_secs(10));
        assert_eq!(
            v["state"], "granted",
            "the key stayed held after {run}: {v}"
        );
        release(&b, &taker, v["fence"].as_u64().unwrap());
    }
}

/// One HTTP/1.1 request on `s`, kept alive; the status and the head of the answer
/// (its body read by its length).
fn exchange(s: &mut TcpStream, token: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    write_request(s, token, method, path, body);
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        s.read_exact(&mut byte).unwrap();
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
    let len: usize = (head.lines())
        .find_map(|l| l.strip_prefix("content-length:"))
        .map_or(0, |v| v.trim().parse().unwrap());
    let mut rest = vec![0u8; len];
    s.read_exact(&mut rest).unwrap();
    (head[9..12].parse().unwrap(), head)
}

/// Issue 38 (Build 2): on a fleet host every acquire waited for its claim as a queued
/// long poll, and a parked long poll's answer closes its connection, so every client
/// made a new connection per run. An acquire that can be claimed now is answered when
/// its claim commits, on its kept-alive connection, and without being queued first
/// (the queued record was a ledger commit of its own: now the acquire's one commit is
/// its grant's).
#[test]
fn regression_a_fleet_acquire_is_answered_on_its_kept_alive_connection() {
    let db = database();
    let d = host(&db, "d", "60s", "5s");
    let mut s = TcpStream::connect(("127.0.0.1", d.port)).unwrap();
    for i in 0..3 {
        let body = json!({"run_id": format!("kept-{i}"), "project": format!("p{i}"), "wait_s": 30,
                          "resources": {"slots": 1, "memory": 0, "cpu_millis": 0, "disk": 0}});
        let before = ledger_commits(&d);
        let (status, head) = exchange(&mut s, &d.token, "POST", "/v1/runs", &body.to_string());
        assert_eq!(status, 201, "{head}");
        let commits = ledger_commits(&d) - before;
        eprintln!("kept-{i}: {commits} commits");
        assert_eq!(commits, 1, "kept-{i}: ledger commits of its acquire");
        assert!(
            !head.contains("connection: close"),
            "closed after the grant: {head}"
        );
        let v = d.get(&format!("/v1/runs/kept-{i}")).body;
        assert_eq!(v["state"], "granted", "{v}");
    }
}

/// Ledger transactions committed so far (`/metrics`).
fn ledger_commits(d: &Daemon) -> u64 {
    let text = d
        .get("/metrics")
        .body
        .as_str()
        .unwrap_or_default()
        .to_string();
    (text.lines())
        .find_map(|l| l.strip_prefix("berth_ledger_commit_seconds_count "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no commit count in {text}"))
}

/// Issue 38 item 5, inside the bound: a `wait_s = 0` acquire whose caller hung up
/// while its claim waited on a frozen link, the link healed 1.5 s later (well within
/// `ANSWER_WAIT_MS`), is not admitted: nobody is there to hold it. (This short stall
/// granted no ghost on the old main either; the issue's 45 s one did, which
/// `regression_a_frozen_database_link_answers_503_and_grants_no_ghost` pins.)
#[test]
fn a_caller_gone_before_its_claim_came_back_is_never_granted() {
    let db = database();
    let (relay, d) = frozen_with_a_ghost(&db);
    std::thread::sleep(Duration::from_millis(1_300));
    relay.freeze(false);
    // The claim's answer comes back; a run with the same fleet store works again.
    claims_resume_without_the_ghost(&d);
    assert_no_ghost(&d);
}

/// Issue 38 item 8: the default host id kept in `<state>/fleet-host-id` is read as any
/// state file berth trusts: a malformed id refuses the start naming `--host-id`, and
/// a symbolic link planted there is never followed.
#[test]
fn a_hostile_fleet_host_id_file_refuses_the_start() {
    let db = database();
    let d = Daemon::unstarted(&[]);
    let file = d.state.join("fleet-host-id");
    std::fs::write(&file, "bad host/../id\n").unwrap();
    let (st, out) = d.start_fails(&["--store", &db]);
    assert!(!st.success() && out.contains("--host-id"), "{out}");
    std::fs::remove_file(&file).unwrap();
    std::os::unix::fs::symlink("/etc/hostname", &file).unwrap();
    let (st, out) = d.start_fails(&["--store", &db]);
    assert!(!st.success() && out.contains("symbolic link"), "{out}");
}

/// G2 fleet-wide: a thread registered on host A refuses an older owner on host C.
#[test]
fn a_thread_registered_on_one_host_refuses_an_older_owner_on_another() {
    let db = database();
    let a = host(&db, "a", "60s", "5s");
    let c = host(&db, "c", "60s", "5s");
    assert!(acquire(&c, "rc", json!({})).status < 300);
    let fc = granted(&c, "rc");
    assert!(acquire(&a, "ra", json!({})).status < 300);
    let fa = granted(&a, "ra");
    assert!(fa > fc, "the fleet's sequence orders the two grants");
    let claim = |run: &str, fence: u64| {
        json!({"owner_gen": "orch-1", "owner_fence": fence, "run_id": run,
               "run_budget_ms": 60_000})
        .to_string()
    };
    let r = a.post("/v1/threads/t1/attach", &claim("ra", fa));
    assert_eq!(r.status, 200, "{:?}", r.body);
    let r = c.post("/v1/threads/t1/attach", &claim("rc", fc));
    assert_eq!(r.status, 409, "{:?}", r.body);
    assert_eq!(r.code(), "registration_mismatch");
    // A newer owner takes it on C.
    let r = c.post("/v1/threads/t1/attach", &claim("rc", fa + 1000));
    assert_eq!(r.status, 200, "{:?}", r.body);
    let r = a.post("/v1/threads/t1/attach", &claim("ra", fa));
    assert_eq!(r.status, 409, "A's owner is older now: {:?}", r.body);
}

/// A TCP relay to the database that the test can cut (every connection closed, new
/// ones closed at once) and restore.
struct Relay {
    port: u16,
    cut: Arc<AtomicBool>,
    /// Frozen: connections stay open and accepted, nothing is passed on (the peer's
    /// kernel still acknowledges what is sent).
    frozen: Arc<AtomicBool>,
    /// Deaf: what the client sends is passed on, what the database answers is held.
    deaf: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
}

impl Relay {
    fn start(target: String) -> Relay {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let cut = Arc::new(AtomicBool::new(false));
        let frozen = Arc::new(AtomicBool::new(false));
        let deaf = Arc::new(AtomicBool::new(false));
        let conns: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let (cut2, conns2, frozen2) = (cut.clone(), conns.clone(), frozen.clone());
        let deaf2 = deaf.clone();
        std::thread::spawn(move || {
            for s in l.incoming().flatten() {
                if cut2.load(Ordering::SeqCst) {
                    let _ = s.shutdown(Shutdown::Both);
                    continue;
                }
                let Ok(up) = TcpStream::connect(&target) else {
                    continue;
                };
                conns2
                    .lock()
                    .unwrap()
                    .extend([s.try_clone().unwrap(), up.try_clone().unwrap()]);
                let answers = [false, true];
                for (answer, (mut from, mut to)) in answers
                    .into_iter()
                    .zip([(s.try_clone().unwrap(), up.try_clone().unwrap()), (up, s)])
                {
                    let (frozen, deaf) = (frozen2.clone(), deaf2.clone());
                    std::thread::spawn(move || {
                        let mut buf = [0u8; 16384];
                        while let Ok(n) = from.read(&mut buf) {
                            while frozen.load(Ordering::SeqCst)
                                || (answer && deaf.load(Ordering::SeqCst))
                            {
                                std::thread::sleep(Duration::from_millis(10));
                            }
                            if n == 0 || to.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                        let _ = to.shutdown(Shutdown::Both);
                    });
                }
            }
        });
        Relay {
            port,
            cut,
            frozen,
            deaf,
            conns,
        }
    }

    fn freeze(&self, frozen: bool) {
        self.frozen.store(frozen, Ordering::SeqCst);
    }

    fn deafen(&self, deaf: bool) {
        self.deaf.store(deaf, Ordering::SeqCst);
    }

    fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        for c in self.conns.lock().unwrap().drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
    }

    fn restore(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }
}

/// F1/F2: a host cut off from the database keeps serving its runs (renew, fence check,
/// release), refuses new runs with 503 store_unavailable, never grants a run whose
/// claim it cannot record (a token another host frees meanwhile stays unclaimed), and
/// takes claims again once the database is back.
#[test]
fn a_host_cut_off_from_the_database_keeps_its_runs_and_takes_no_new_claim() {
    let db = database();
    let target = format!(
        "{}:{}",
        std::env::var("PGHOST").unwrap(),
        std::env::var("PGPORT").unwrap()
    );
    let relay = Relay::start(target.clone());
    let relayed = db.replace(
        &format!("port={}", std::env::var("PGPORT").unwrap()),
        &format!("port={}", relay.port),
    );
    let relayed = relayed.replace(
        &format!("host={}", std::env::var("PGHOST").unwrap()),
        "host=127.0.0.1",
    );
    let d = host(&relayed, "d", "60s", "5s");
    let e = host(&db, "e", "60s", "5s");
    // d holds a plain run; e holds the only token of a harness d's waiter wants.
    assert!(acquire(&d, "rd", json!({})).status < 300);
    let fd = granted(&d, "rd");
    assert!(acquire(&e, "re", budget(1)).status < 300);
    let fe = granted(&e, "re");
    assert!(acquire(&d, "rq", budget(1)).status < 300);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(d.get("/v1/runs/rq").body["state"], "queued");
    relay.cut();
    let mut probe = 0;
    d.wait_until("d sees the store gone", |d| {
        probe += 1;
        acquire(d, &format!("probe-{probe}"), json!({})).status == 503
    });
    let r = acquire(&d, "rn", budget(1));
    assert_eq!(
        (r.status, r.code()),
        (503, "store_unavailable"),
        "{:?}",
        r.body
    );
    // Its own run goes on.
    let r = d.post("/v1/runs/rd/renew", &json!({"fence": fd}).to_string());
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(fence_check(&d, "rd", fd)["current"], true);
    // e frees the token; d cannot record a claim, so its waiter stays queued.
    release(&e, "re", fe);
    std::thread::sleep(Duration::from_millis(2_500));
    assert_eq!(
        d.get("/v1/runs/rq").body["state"],
        "queued",
        "granted without a record"
    );
    relay.restore();
    let fq = granted(&d, "rq");
    assert!(fq > fe);
    let r = acquire(&d, "rn2", json!({}));
    assert!(r.status < 300, "{:?}", r.body);
    granted(&d, "rn2");
    release(&d, "rd", fd);
}

/// `db` reached through a relay that can cut or restore the link: the relay, and the
/// connection string that goes through it.
fn through_relay(db: &str) -> (Relay, String) {
    let port = std::env::var("PGPORT").unwrap();
    let relay = Relay::start(format!("{}:{port}", std::env::var("PGHOST").unwrap()));
    let relayed = db
        .replace(&format!("port={port}"), &format!("port={}", relay.port))
        .replace(
            &format!("host={}", std::env::var("PGHOST").unwrap()),
            "host=127.0.0.1",
        );
    (relay, relayed)
}

/// F2: a host that cannot heartbeat fences itself first. Cut off from the database, it
/// stops its run holding a fleet-wide key before the lapse at which another host may
/// declare it dead and hand the key on (its client kept renewing it), while its plain
/// run goes on; the key is then taken on another host only after the lapse.
#[test]
fn a_host_that_cannot_heartbeat_stops_its_fleet_wide_runs_before_the_lapse() {
    let db = database();
    let (relay, relayed) = through_relay(&db);
    // Lapse 4 s (ttl max 2 s + 2 s); the host fences itself its 1 s grace and 1 s of
    // slack earlier.
    let d = host(&relayed, "d", "2s", "2s");
    let e = host(&db, "e", "2s", "2s");
    assert!(acquire(&d, "rd-key", json!({"singletons": ["fleet:staging-db"]})).status < 300);
    let f_key = granted(&d, "rd-key");
    assert!(acquire(&d, "rd-plain", json!({})).status < 300);
    let f_plain = granted(&d, "rd-plain");
    let cut_at = Instant::now();
    relay.cut();
    // The client renews both all along; the fleet-wide one is stopped by d itself.
    let mut stopped_after = None;
    while cut_at.elapsed() < Duration::from_secs(6) {
        for (run, f) in [("rd-key", f_key), ("rd-plain", f_plain)] {
            d.post(
                &format!("/v1/runs/{run}/renew"),
                &json!({ "fence": f }).to_string(),
            );
        }
        let state = d.get("/v1/runs/rd-key").body["state"].clone();
        if stopped_after.is_none() && state != "granted" {
            stopped_after = Some(cut_at.elapsed());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let stopped_after = stopped_after.expect("the fleet-wide run was never stopped");
    assert!(
        stopped_after < Duration::from_millis(3_900),
        "stopped {stopped_after:?} after the cut: not before the 4 s lapse"
    );
    assert_eq!(d.get("/v1/runs/rd-plain").body["state"], "granted");
    // e declared d dead after the lapse; the key is e's to give now.
    let mut pg = PgFleet::open(&db).unwrap();
    e.wait_until("d declared dead", |_| {
        !pg.declarations("d").unwrap().is_empty()
    });
    assert!(acquire(&e, "re-key", json!({"singletons": ["fleet:staging-db"]})).status < 300);
    granted(&e, "re-key");
    // Back, d finds itself dead: it re-registers and ends the runs of its dead
    // generation (the plain one too: its fence is refused fleet-wide already), and
    // takes claims again.
    assert_eq!(fence_check(&e, "rd-plain", f_plain)["current"], false);
    relay.restore();
    d.wait_until("d's old plain run ended", |d| {
        d.post(
            "/v1/runs/rd-plain/renew",
            &json!({ "fence": f_plain }).to_string(),
        );
        d.get("/v1/runs/rd-plain").body["state"] != "granted"
    });
    assert_eq!(fence_check(&d, "rd-plain", f_plain)["current"], false);
    assert!(acquire(&d, "rd-new", json!({})).status < 300);
    granted(&d, "rd-new");
    let r = acquire(
        &d,
        "rd-key2",
        json!({"singletons": ["fleet:staging-db"], "wait_s": 0}),
    );
    assert_eq!(r.code(), "expired", "e holds the key now: {:?}", r.body);
}

/// Issue 33 item 8: a run waiting for a fleet key another host holds names the key
/// and its holder (run and host), as a single-host wait does. (Before: only "waiting
/// for its fleet-wide claim (run id, fence, budget token, fleet keys)".)
#[test]
fn issue_33_a_fleet_wait_names_the_key_and_its_holder() {
    let db = database();
    let d = host(&db, "d", "1h", "2s");
    let e = host(&db, "e", "1h", "2s");
    assert!(acquire(&d, "holder", json!({"singletons": ["fleet:db"]})).status < 300);
    granted(&d, "holder");
    let r = acquire(
        &e,
        "waiter",
        json!({"singletons": ["fleet:db"], "wait_s": 60}),
    );
    assert!(r.status < 300, "{:?}", r.body);
    e.wait_until("the waiter's reason names the holder", |e| {
        let v = e.get("/v1/runs/waiter").body;
        let m = v["reason"]["message"].as_str().unwrap_or("").to_string();
        m.contains("fleet:db") && m.contains("holder") && m.contains("host d")
    });
    let v = e.get("/v1/runs/waiter").body;
    assert_eq!(v["reason"]["code"], "fleet.claim", "{v}");
}

/// Issue 33 item 9: when a fleet host fences itself (F2), the `berth run` whose
/// fleet-wide run it stopped exits 75 with one line saying why, not CMD's bare 143.
#[test]
fn issue_33_berth_run_on_a_host_that_fences_itself_exits_75_with_the_reason() {
    let db = database();
    let (relay, relayed) = through_relay(&db);
    let d = host(&relayed, "d", "2s", "2s");
    let child = d
        .cli()
        .args([
            "run",
            "--project",
            "p",
            "--run-id",
            "fenced",
            "--singleton",
            "fleet:db",
            "--cpus",
            "0.1",
            "--memory",
            "0",
            "--disk",
            "0",
            "--ttl",
            "2s",
            "--",
            "sleep",
            "30",
        ])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    d.wait_until("fenced is granted", |d| {
        d.get("/v1/runs/fenced").body["state"] == "granted"
    });
    relay.cut();
    let out = child.wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    relay.restore();
    assert_eq!(out.status.code(), Some(75), "berth run said: {said}");
    assert!(said.contains("fenced itself"), "{said}");
}

/// F4: `berth fleet` shows every live host and the fleet's sums.
#[test]
fn berth_fleet_lists_the_live_hosts() {
    let db = database();
    let a = host(&db, "fa", "60s", "5s");
    let _b = host(&db, "fb", "60s", "5s");
    // Each host's capacity arrives with its heartbeat.
    a.wait_until("both hosts' capacity known", |a| {
        a.get("/v1/fleet").body["totals"]["slots"]["total"] == 128
    });
    let out = a.cli().arg("fleet").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("2 live host(s)"), "{text}");
    assert!(text.contains("\nhost "), "a header: {text}");
    assert!(text.contains("\nfa ") && text.contains("\nfb "), "{text}");
    let out = a.cli().args(["fleet", "--json"]).output().unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["totals"]["slots"]["total"], 128, "{v}");
    // Without fleet mode the route says so.
    let plain = Daemon::start(&[]);
    let r = plain.get("/v1/fleet");
    assert_eq!((r.status, r.code()), (404, "fleet_mode_off"));
}

/// Malformed fleet flags are refused at start with the flag and the rule named, and
/// nothing is written to the fleet's database.
#[test]
fn malformed_fleet_flags_refuse_to_start_and_write_nothing() {
    let db = database();
    let d = Daemon::unstarted(&[]);
    let bad_tls = format!("{db} sslmode=sometimes");
    let cases: [(&[&str], &str); 6] = [
        (&["--store", "postgres://[::1", "--host-id", "ok"], "store"),
        // Issue 38 Build 5: a TLS mode libpq does not know.
        (&["--store", &bad_tls, "--host-id", "ok"], "sslmode"),
        (
            &["--store", &db, "--host-id", "bad host/../id"],
            "--host-id",
        ),
        (
            &[
                "--store",
                &db,
                "--host-id",
                "ok",
                "--fleet-beat",
                "1s",
                "--fleet-margin",
                "2s",
            ],
            "--fleet-margin",
        ),
        (
            &["--store", &db, "--host-id", "ok", "--ttl-max", "soon"],
            "--ttl-max",
        ),
        // Issue 38 item 7: the self-fence must leave the stop grace before the lapse
        // (8 s here, with a 10 s grace).
        (
            &[
                "--store",
                &db,
                "--host-id",
                "ok",
                "--ttl-max",
                "5s",
                "--fleet-margin",
                "3s",
                "--stop-grace",
                "10s",
            ],
            "--stop-grace",
        ),
    ];
    for (args, names) in cases {
        let (st, out) = d.start_fails(args);
        assert!(!st.success(), "{args:?} started");
        assert!(
            out.contains(names),
            "{args:?}: the refusal does not name {names}: {out}"
        );
    }
    let mut c = postgres::Client::connect(&db, postgres::NoTls).unwrap();
    let tables: i64 = c
        .query_one(
            "SELECT count(*) FROM pg_tables WHERE tablename LIKE 'berth_%'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(tables, 0, "a refused start wrote to the fleet's database");
}

/// Issue 38 (found by the PostgreSQL restart test): a new run's claim reached the
/// database and committed, its answer was lost with the connection, and its caller got
/// `503`. Nothing ended that claim: its key stayed held, for a run nobody had, until
/// the host registered again. Now a claim whose answer was lost goes back once the
/// store answers again: another host takes the key.
#[test]
fn regression_a_claim_whose_answer_was_lost_does_not_keep_its_key() {
    let db = database();
    let (relay, relayed) = through_relay(&db);
    let d = host(&relayed, "d", "60s", "5s");
    // The claim worker connected (its batch prepared with its connection): then a
    // claim is one round trip, whose answer the relay can hold.
    let mut n = 0;
    d.wait_until("the claim worker connected", |d| {
        let warm: Vec<_> = (0..8)
            .map(|_| {
                n += 1;
                let (port, token, run) = (d.port, d.token.clone(), format!("warm-{n}"));
                std::thread::spawn(move || {
                    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
                    let body = json!({"run_id": run, "project": run, "wait_s": 0,
                        "resources": {"slots": 1, "memory": 0, "cpu_millis": 0, "disk": 0}});
                    (
                        run,
                        exchange(&mut s, &token, "POST", "/v1/runs", &body.to_string()),
                    )
                })
            })
            .collect();
        for w in warm {
            let (run, (status, head)) = w.join().unwrap();
            let v = d.get(&format!("/v1/runs/{run}")).body;
            assert_eq!(status, 201, "{head}{v}");
        }
        // The heartbeat's, the listener's and the claim worker's.
        berth_store::fleet::testing::pg_connections(&db, "berth").unwrap() >= 3
    });
    let mut pg = PgFleet::open(&db).unwrap();
    relay.deafen(true);
    let lost = std::thread::spawn({
        let (port, token) = (d.port, d.token.clone());
        move || {
            let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            let body = json!({"run_id": "lost", "project": "p-lost", "wait_s": 0,
                "singletons": ["fleet:lost-db"],
                "resources": {"slots": 1, "memory": 0, "cpu_millis": 0, "disk": 0}});
            exchange(&mut s, &token, "POST", "/v1/runs", &body.to_string())
        }
    });
    // The claim is written (the database holds the key) while its answer is held.
    let end = Instant::now() + Duration::from_secs(20);
    while pg.fence("lost").unwrap().is_none() {
        assert!(Instant::now() < end, "the claim never reached the database");
        std::thread::sleep(Duration::from_millis(20));
    }
    relay.cut();
    let (status, head) = lost.join().unwrap();
    assert_eq!(status, 503, "{head}");
    relay.deafen(false);
    relay.restore();
    let e = host(&db, "e", "60s", "5s");
    e.wait_until("another host takes the key", |e| {
        n += 1;
        let run = format!("next-{n}");
        let r = acquire(
            e,
            &run,
            json!({"singletons": ["fleet:lost-db"], "wait_s": 0}),
        );
        r.body["state"] == "granted"
    });
}
