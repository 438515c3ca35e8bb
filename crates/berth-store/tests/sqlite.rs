//! The store conformance suite against SQLite, plus SQLite-specific checks: the
//! durability pragmas, corruption detection (D4) and a kill -9 crash loop.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use berth_core::RunState;
use berth_store::conformance::{sample_run, CHECKS};
use berth_store::{Batch, SqliteStore, Store, StoreError, Writer};

fn opener(path: PathBuf) -> impl Fn() -> Box<dyn Store> {
    move || Box::new(SqliteStore::open(&path).expect("open ledger")) as Box<dyn Store>
}

#[test]
fn conformance_suite_on_sqlite() {
    for (name, check) in CHECKS {
        let dir = tempfile::tempdir().unwrap();
        let open = opener(dir.path().join("ledger.db"));
        eprintln!("conformance: {name}");
        check(&open);
    }
}

/// Issue 8, finding 10 (the ledger's half): the daemon's connection holds the ledger
/// exclusively, so a second daemon cannot write it even past the state dir's lock.
#[test]
fn finding_10_an_exclusive_ledger_refuses_a_second_connection() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l.db");
    let mut first = SqliteStore::open_exclusive(&path).unwrap();
    first.load(1).unwrap();
    let second = SqliteStore::open_exclusive(&path);
    assert!(
        matches!(second, Err(StoreError::Open { .. })),
        "a second open succeeded"
    );
    drop(first);
    SqliteStore::open_exclusive(&path).unwrap();
}

#[test]
fn durability_pragmas_are_wal_and_full() {
    // Both ways the ledger is opened: by tools, and by the daemon (exclusive).
    for exclusive in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l.db");
        let store = if exclusive {
            SqliteStore::open_exclusive(&path)
        } else {
            SqliteStore::open(&path)
        }
        .unwrap();
        assert_eq!(store.synchronous(), 2, "synchronous must be FULL");
        assert_eq!(store.journal_mode(), "wal", "the journal must be the WAL");
        // WAL mode is also what the file says, for the next opener.
        drop(store);
        let header = std::fs::read(&path).unwrap();
        assert_eq!(
            (header[18], header[19]),
            (2, 2),
            "file format bytes of a WAL ledger"
        );
    }
}

#[test]
fn a_corrupt_ledger_refuses_to_open() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l.db");
    std::fs::write(
        &path,
        b"this is not a sqlite database at all, just junk bytes....",
    )
    .unwrap();
    match SqliteStore::open(&path) {
        Err(e @ (StoreError::Corrupt(_) | StoreError::Open { .. })) => {
            assert!(e.to_string().contains("ledger"), "{e}");
        }
        other => panic!("expected a clear error, got {:?}", other.map(|_| ())),
    }
}

/// The child side of the crash test: writes numbered batches through a group-commit
/// writer and prints "ack N" only after N is durable.
fn crash_child(path: &Path) {
    let writer = Writer::spawn(Box::new(SqliteStore::open(path).unwrap()), true);
    let start = SqliteStore::open(path)
        .unwrap()
        .load(0)
        .unwrap()
        .next_queue_seq;
    let out = std::sync::Arc::new(std::sync::Mutex::new(std::io::stdout()));
    for i in start.. {
        let mut run = sample_run(&format!("c{i}"), i, RunState::Granted);
        run.fence = Some(i + 1);
        let b = Batch::runs(i + 1, vec![run]);
        let out = out.clone();
        writer.submit(Some(b), move |r| {
            if r.is_ok() {
                let mut o = out.lock().unwrap();
                let _ = writeln!(o, "ack {i}");
                let _ = o.flush();
            }
        });
        if i % 64 == 0 {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

#[test]
fn crash_child_entry() {
    if let Ok(path) = std::env::var("BERTH_STORE_CRASH_CHILD") {
        crash_child(Path::new(&path));
    }
}

#[test]
fn kill_9_at_random_points_loses_no_acknowledged_write() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    let exe = std::env::current_exe().unwrap();
    let mut seed = 0x5eed_u64;
    let rounds = 25;
    for round in 0..rounds {
        let mut child = Command::new(&exe)
            .args([
                "--exact",
                "crash_child_entry",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("BERTH_STORE_CRASH_CHILD", &path)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        // Let it acknowledge a pseudo-random number of writes, then kill -9.
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let wait_for = 5 + (seed >> 33) % 200;
        let mut acked = Vec::new();
        for line in lines.by_ref() {
            let line = line.unwrap();
            if let Some(n) = line.strip_prefix("ack ") {
                acked.push(n.parse::<u64>().unwrap());
                if acked.len() as u64 >= wait_for {
                    break;
                }
            }
        }
        child.kill().unwrap(); // SIGKILL
                               // Acks printed before the kill landed may still be in the pipe: they count too.
        for line in lines.map_while(Result::ok) {
            if let Some(n) = line.strip_prefix("ack ") {
                acked.push(n.parse::<u64>().unwrap());
            }
        }
        let _ = child.wait();
        let ledger = SqliteStore::open(&path)
            .unwrap_or_else(|e| panic!("round {round}: reopen failed: {e}"))
            .load(usize::MAX >> 1)
            .unwrap_or_else(|e| panic!("round {round}: load failed: {e}"));
        let ids: std::collections::HashSet<u64> = ledger
            .runs
            .iter()
            .map(|r| r.request.run_id[1..].parse().unwrap())
            .collect();
        for n in &acked {
            assert!(
                ids.contains(n),
                "round {round}: acknowledged write {n} is missing"
            );
        }
        let max_fence = ledger
            .runs
            .iter()
            .filter_map(|r| r.fence)
            .max()
            .unwrap_or(0);
        assert!(
            ledger.last_fence >= max_fence,
            "round {round}: fence counter behind a run"
        );
        assert!(
            !acked.is_empty(),
            "round {round}: the child acknowledged nothing"
        );
    }
}

/// D4 for budgets: a scope row that breaks the rules (a harness over its limit, a token
/// of a harness outside the policy, a bad control word) refuses to load, naming the
/// scope, rather than being guessed at.
#[test]
fn a_corrupt_scope_refuses_to_load() {
    let cases = [
        (
            "INSERT INTO scope_tokens VALUES ('exp', 'w2', 'op', 'claude', NULL, 0, 0)",
            "2 tokens of claude, limit 1",
        ),
        (
            "INSERT INTO scope_tokens VALUES ('exp', 'w2', 'op', 'gemini', NULL, 0, 0)",
            "a token of unknown gemini",
        ),
        (
            "UPDATE scopes SET control = 'maybe'",
            "\"maybe\" is not a Control",
        ),
        ("UPDATE scopes SET policy = 'claude=x'", "scope exp: limit"),
        (
            "INSERT INTO scope_tokens VALUES ('nope', 'w', 'op', 'claude', NULL, 0, 0)",
            "a token of unknown scope nope",
        ),
    ];
    for (sql, want) in cases {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l.db");
        let mut s = SqliteStore::open(&path).unwrap();
        let rec = berth_store::ScopeRecord {
            id: "exp".into(),
            policy: [("claude".to_string(), 1)].into(),
            manifest: None,
            control: berth_core::scopes::Control::Open,
            generation: 0,
            owner_uid: None,
            journal_first: 0,
        };
        let token = berth_core::scopes::Token {
            harness: "claude".into(),
            run_id: None,
            since_ms: 0,
            owner_lapsed: false,
        };
        let b = Batch {
            mutations: vec![
                berth_store::Mutation::Scope(rec),
                berth_store::Mutation::BudgetToken {
                    scope: "exp".into(),
                    owner: "w1".into(),
                    operation: "op".into(),
                    token: Some(token),
                },
            ],
        };
        s.write(&[&b]).unwrap();
        assert_eq!(s.load(10).unwrap().scopes.len(), 1);
        drop(s);
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch(sql).unwrap();
        drop(conn);
        match SqliteStore::open(&path).and_then(|mut s| s.load(10)) {
            Err(e @ StoreError::Corrupt(_)) => {
                assert!(e.to_string().contains(want), "{sql}: {e}")
            }
            other => panic!("{sql}: expected a refusal, got {:?}", other.map(|_| ())),
        }
    }
}

/// D4: a run whose stored budget does not parse refuses to load, naming it.
#[test]
fn a_corrupt_run_budget_refuses_to_load() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l.db");
    let mut s = SqliteStore::open(&path).unwrap();
    let mut run = sample_run("b1", 1, RunState::Queued);
    run.request.budget = Some(Box::new(berth_core::scopes::Budget {
        scope: "exp".into(),
        harness: "claude".into(),
        operation_id: None,
        per_harness: None,
        manifest: None,
        tenant: None,
    }));
    s.write(&[&Batch::runs(0, vec![run.clone()])]).unwrap();
    assert_eq!(
        s.load(10).unwrap().runs[0].request.budget,
        run.request.budget
    );
    drop(s);
    let conn = rusqlite::Connection::open(&path).unwrap();
    conn.execute_batch("UPDATE runs SET budget = '{\"scope\":'")
        .unwrap();
    drop(conn);
    match SqliteStore::open(&path).and_then(|mut s| s.load(10)) {
        Err(e @ StoreError::Corrupt(_)) => {
            assert!(e.to_string().contains("budget does not parse"), "{e}")
        }
        other => panic!("expected a refusal, got {:?}", other.map(|_| ())),
    }
}

/// WAL frames (pages) a commit of `batch` adds to the ledger at `path`.
fn frames_of(store: &mut SqliteStore, path: &Path, batch: &Batch) -> u64 {
    let wal = path.with_file_name("ledger.db-wal");
    let size = || std::fs::metadata(&wal).map_or(0, |m| m.len());
    let before = size();
    store.write(&[batch]).unwrap();
    // A frame is a 24-byte header and a 4096-byte page.
    (size() - before) / (24 + 4096)
}

/// Issue 37 (a lean ledger record): a lease's release writes three pages (the run's
/// row, the queue-order index, the journal's chunk) and its grant four (and the run-id
/// index). The fence counter in `meta` was one more page of every commit, though the
/// granted run's own row already carries its fence (the counter is the higher of both).
#[test]
fn a_lifecycle_writes_no_page_for_the_fence_counter() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    let mut store = SqliteStore::open_exclusive(&path).unwrap();
    store.load(10).unwrap();
    let journal = |seq: u64, kind: &str, id: &str| {
        berth_store::Mutation::Journal(std::sync::Arc::new(berth_store::JournalEntry {
            seq,
            kind: kind.into(),
            run_id: Some(id.into()),
            project: Some("bench-1".into()),
            line: format!("{{\"seq\":{seq},\"kind\":\"{kind}\",\"run_id\":\"{id}\"}}"),
        }))
    };
    let mut seq = 0;
    let mut frames = Vec::new();
    // Enough lifecycles that the tables have grown past their first pages, and few
    // enough that the WAL is not checkpointed (at 1,000 pages) and written over.
    for i in 1..=100u64 {
        let id = format!("c0-{i}");
        let mut run = sample_run(&id, i, RunState::Granted);
        run.processes.clear();
        run.ports.clear();
        let fence = run.fence.unwrap();
        let mut grant = Batch::runs(fence, vec![run.clone()]);
        seq += 1;
        grant.push(journal(seq, "granted", &id));
        let granted = frames_of(&mut store, &path, &grant);
        run.state = RunState::Released;
        run.end_cause = Some(berth_core::EndCause::Released);
        let mut release = Batch::runs(fence, vec![run]);
        seq += 1;
        release.push(journal(seq, "released", &id));
        frames.push((granted, frames_of(&mut store, &path, &release)));
    }
    // The typical commit (a page split now and then adds one or two).
    let typical = |pick: fn(&(u64, u64)) -> u64| {
        let mut v: Vec<u64> = frames[50..].iter().map(pick).collect();
        v.sort();
        v[v.len() / 2]
    };
    let (grant, release) = (typical(|f| f.0), typical(|f| f.1));
    eprintln!("pages per commit: grant {grant}, release {release}");
    assert!(
        grant <= 4 && release <= 3,
        "pages per commit, median of the last 50 lifecycles: grant {grant}, release {release}"
    );
    // The counter is still the last fence, on a reopen.
    drop(store);
    let last = SqliteStore::open(&path)
        .unwrap()
        .load(10)
        .unwrap()
        .last_fence;
    assert_eq!(last, 200);
}
