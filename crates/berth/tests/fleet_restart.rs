//! Issue 38 (Done when): a PostgreSQL restart under load, in a test binary of its own
//! (cargo runs test binaries one after another): restarting the server cuts every
//! connection, which the other fleet tests, running in parallel threads of theirs,
//! must not meet.

mod common;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use berth_store::fleet::{FleetStore, PgFleet};
use common::fleet::{acquire, database, granted, host, release};
use common::Daemon;
use serde_json::json;

/// One acknowledged grant of the restart test: its key, fence, when its grant was
/// answered and when its holder let it go.
struct Held {
    key: String,
    fence: u64,
    granted: Instant,
    released: Instant,
}

/// One client of the restart test: acquire (a 503 while the store restarts is asked
/// again), hold 20 ms, release, until `stop`.
fn restart_client(d: &Daemon, t: usize, stop: &AtomicBool, log: &Mutex<Vec<Held>>) {
    let mut i = 0;
    while !stop.load(Ordering::Relaxed) {
        let (run, key) = (format!("load-{t}-{i}"), format!("fleet:k{}", (t + i) % 2));
        i += 1;
        let r = acquire(d, &run, json!({"singletons": [key], "wait_s": 20}));
        if r.status == 503 {
            std::thread::sleep(Duration::from_millis(100));
            continue;
        }
        assert!(r.status < 300, "{run}: {} {:?}", r.status, r.body);
        let fence = granted(d, &run);
        let granted = Instant::now();
        std::thread::sleep(Duration::from_millis(20));
        let released = Instant::now();
        release(d, &run, fence);
        let key = key.trim_start_matches("fleet:").to_string();
        log.lock().unwrap().push(Held {
            key,
            fence,
            granted,
            released,
        });
    }
}

/// Issue 38 (Done when): a PostgreSQL restart under load. Two hosts' clients take
/// two fleet-wide keys in turns while the server restarts (fast): every fence
/// acknowledged is unique, each key's holders follow one another (the next grant is
/// answered after the last holder let go, with a higher fence), grants go on after the
/// restart, a claim acknowledged before it is still held after it (another host is
/// refused its key), and every claim is ended in the store at the end.
#[test]
fn a_postgres_restart_under_load_loses_no_claim_and_gives_no_fence_twice() {
    let db = database();
    let hosts: Vec<Arc<Daemon>> = ["ra", "rb"]
        .iter()
        .map(|id| Arc::new(host(&db, id, "60s", "5s")))
        .collect();
    assert!(acquire(&hosts[0], "held", json!({"singletons": ["fleet:held"]})).status < 300);
    let held = granted(&hosts[0], "held");
    let (stop, log) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(Mutex::new(Vec::new())),
    );
    let clients: Vec<_> = (0..6)
        .map(|t| {
            let (d, stop, log) = (hosts[t % 2].clone(), stop.clone(), log.clone());
            std::thread::spawn(move || restart_client(&d, t, &stop, &log))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(1_500));
    let restarted = Instant::now();
    berth_store::fleet::testing::pg_restart().unwrap();
    std::thread::sleep(Duration::from_secs(5));
    stop.store(true, Ordering::Relaxed);
    clients.into_iter().for_each(|c| c.join().unwrap());
    let mut log = std::mem::take(&mut *log.lock().unwrap());
    let fences: BTreeSet<u64> = log.iter().map(|h| h.fence).collect();
    assert_eq!(fences.len(), log.len(), "a fence was acknowledged twice");
    let after = log.iter().filter(|h| h.granted > restarted).count();
    assert!(
        after > 10 && log.len() > after,
        "{} grants, {after} after the restart",
        log.len()
    );
    log.sort_by_key(|h| h.granted);
    for key in ["k0", "k1"] {
        let turns: Vec<&Held> = log.iter().filter(|h| h.key == key).collect();
        for w in turns.windows(2) {
            assert!(
                w[1].granted > w[0].released && w[1].fence > w[0].fence,
                "{key}: f{} granted before f{} was let go, or with a lower fence",
                w[1].fence,
                w[0].fence
            );
        }
    }
    // The claim acknowledged before the restart is there after it.
    let mut pg = PgFleet::open(&db).unwrap();
    assert_eq!(pg.fence("held").unwrap().map(|f| f.fence), Some(held));
    let r = acquire(
        &hosts[1],
        "held-too",
        json!({"singletons": ["fleet:held"], "wait_s": 0}),
    );
    assert_ne!(r.body["state"], "granted", "{:?}", r.body);
    release(&hosts[0], "held", held);
    // Every ending reaches the store (those the restart cut are retried).
    hosts[0].wait_until("every claim ended in the store", |_| {
        ["ra", "rb"]
            .iter()
            .all(|h| pg.claims_of(h).unwrap().is_empty())
    });
}
