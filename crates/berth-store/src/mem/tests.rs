//! `MemStore` against the conformance suite and, answer for answer, against SQLite.

use super::*;
use crate::conformance::{sample_run, CHECKS};
use berth_core::scopes::{Control, Mode};
use berth_core::RunState;
use std::sync::atomic::AtomicU64;

/// Every conformance check, each on a fresh ledger; `open` hands out handles on it.
#[test]
fn conformance_suite_on_mem() {
    for (name, check) in CHECKS {
        let store = MemStore::default();
        eprintln!("conformance: {name}");
        check(&|| Box::new(store.clone()) as Box<dyn Store>);
    }
}

/// A clone writes the same ledger; a fork is a copy neither side sees change.
#[test]
fn a_clone_is_the_same_ledger_and_a_fork_is_a_copy() {
    let mut a = MemStore::default();
    let run = |id: &str, seq| sample_run(id, seq, RunState::Queued);
    a.write(&[&Batch::runs(5, vec![run("r1", 1)])]).unwrap();
    let mut fork = a.fork();
    a.clone()
        .write(&[&Batch::runs(9, vec![run("r2", 2)])])
        .unwrap();
    fork.write(&[&Batch::runs(7, vec![])]).unwrap();
    let (l, f) = (a.load(10).unwrap(), fork.load(10).unwrap());
    assert_eq!((l.runs.len(), l.last_fence), (2, 9));
    assert_eq!((f.runs.len(), f.last_fence), (1, 7));
}

/// The workload's state: a seeded generator and what it has written.
struct Gen {
    seed: u64,
    queue: u64,
    journal: u64,
    /// Each scope's generation as this write group leaves it.
    scopes: BTreeMap<String, u64>,
}

/// Steps of the workload: enough for every rule to come up many times.
const STEPS: usize = 400;
/// Few ids, so runs come again under an ended run's id and updates are common.
const IDS: [&str; 5] = ["r0", "r1", "r2", "r3", "r4"];
/// Live and ended states alike (`Degraded` is live).
const STATES: [RunState; 6] = [
    RunState::Queued,
    RunState::Granted,
    RunState::Degraded,
    RunState::Released,
    RunState::Expired,
    RunState::Cancelled,
];

impl Gen {
    fn next(&mut self, n: u64) -> u64 {
        self.seed = self.seed.wrapping_mul(6364136223846793005);
        self.seed = self.seed.wrapping_add(1442695040888963407);
        (self.seed >> 33) % n
    }

    fn run(&mut self, st: &State) -> RunRecord {
        let id = IDS[self.next(IDS.len() as u64) as usize];
        let seq = match st.runs.get(id) {
            Some(r) if self.next(2) == 0 => r.run.queue_seq,
            _ => {
                self.queue += 1;
                self.queue
            }
        };
        let state = STATES[self.next(STATES.len() as u64) as usize];
        let mut r = sample_run(id, seq, state);
        match self.next(3) {
            0 => r.ports = sample_run(id, seq, RunState::Granted).ports,
            1 => r.ports.clear(),
            _ => {}
        }
        r.journal_first = self.next(4).eq(&0) as u64 * self.journal;
        // What an update keeps as first written, and what it takes.
        (r.stop_grace_ms, r.deadline_ms) = (Some(self.next(3)), self.next(3));
        r.labels.insert("k".into(), self.next(3).to_string());
        r
    }

    fn entry(&mut self) -> JournalEntry {
        self.journal += 1;
        let seq = match self.next(20) {
            0 => self.journal.saturating_sub(2),
            _ => self.journal,
        };
        let kind = if self.next(30) == 0 {
            "bad\tkind"
        } else {
            "queued"
        };
        JournalEntry {
            seq,
            kind: kind.into(),
            run_id: self.next(2).eq(&0).then(|| "r1".into()),
            project: None,
            line: format!("{{\"seq\":{seq}}}"),
        }
    }

    /// A scope's next control request: the scope at its next generation and its
    /// receipt (now and then a request id it holds already: refused).
    fn scope(&mut self, id: &str) -> Vec<Mutation> {
        let g = self.scopes.get(id).copied().unwrap_or(0) + 1;
        self.scopes.insert(id.into(), g);
        let repeat = g > 1 && self.next(15) == 0;
        let scope = ScopeRecord {
            id: id.into(),
            policy: [("claude".to_string(), 2)].into(),
            manifest: None,
            control: Control::Paused,
            generation: g,
            owner_uid: None,
            journal_first: self.next(4).eq(&0) as u64 * self.journal,
        };
        let receipt = Receipt {
            request_id: format!("q{}", if repeat { g - 1 } else { g }),
            mode: Mode::Pause,
            generation: g,
            control: Control::Paused,
            at_ms: g,
        };
        let scope_id = id.to_string();
        vec![
            Mutation::Scope(scope),
            Mutation::ScopeReceipt {
                scope: scope_id,
                receipt,
            },
        ]
    }

    fn mutations(&mut self, st: &State) -> Vec<Mutation> {
        let scope = ["s0", "s1"][self.next(2) as usize];
        let hash = format!("t{}", self.next(3));
        match self.next(10) {
            0..=2 => vec![Mutation::Run(self.run(st))],
            3 => vec![Mutation::Journal(self.entry().into())],
            4 if self.next(2) == 0 => vec![Mutation::TokenRevoked { hash }],
            4 => vec![Mutation::Token {
                hash,
                scope: "read".into(),
            }],
            5 => vec![Mutation::Evidence {
                project: scope.into(),
                evidence: (self.next(2) == 0).then(|| berth_core::Evidence {
                    fingerprint: hash,
                    commit: None,
                    ports: vec!["web".into()],
                    at_ms: 1,
                    run_id: "r1".into(),
                }),
            }],
            6 => self.scope(scope),
            7 if self.scopes.contains_key(scope) => vec![Mutation::BudgetToken {
                scope: scope.into(),
                owner: format!("w{}", self.next(2)),
                operation: "op".into(),
                token: (self.next(2) == 0).then(|| Token {
                    harness: "claude".into(),
                    run_id: None,
                    since_ms: 3,
                    owner_lapsed: false,
                }),
            }],
            8 => {
                self.scopes.remove(scope);
                vec![Mutation::ScopeDeleted(scope.into())]
            }
            _ if self.next(2) == 0 => vec![Mutation::Thread(self.thread())],
            _ => vec![Mutation::Drain((self.next(2) == 0).then(|| DrainRecord {
                by: "admin".into(),
                at: "now".into(),
                reason: hash,
            }))],
        }
    }

    /// A thread record; now and then registered by another than its owner (refused).
    fn thread(&mut self) -> ThreadRecord {
        use berth_core::threads::{Owner, Registration, Thread};
        let owner = |run: &str| Owner {
            gen: "g".into(),
            fence: 1,
            run_id: run.into(),
        };
        let registrant = if self.next(8) == 0 { "r2" } else { "r1" };
        ThreadRecord {
            thread: Thread {
                key: format!("th{}", self.next(2)),
                owner: Some(owner("r1")),
                registration: (self.next(2) == 0).then(|| Registration {
                    owner: owner(registrant),
                    attached_ms: 1,
                    deadline_ms: 2,
                }),
                has_workspace: false,
                created_ms: 0,
                active_ms: self.next(9),
                evictions: vec![],
            },
            workspace: None,
            owner_uid: None,
        }
    }
}

/// One write's batches: each a fence and a few mutations.
fn group(g: &mut Gen, mem: &MemStore) -> Vec<Batch> {
    let st = mem.state();
    g.journal = st.journal_last();
    g.scopes = (st.scopes.iter())
        .map(|(id, s)| (id.clone(), s.generation))
        .collect();
    (0..=g.next(3))
        .map(|_| {
            let mut b = Batch::runs(10_000, vec![]);
            for _ in 0..=g.next(4) {
                b.mutations.extend(g.mutations(&st));
            }
            b
        })
        .collect()
}

/// A retention policy, and the time it prunes as of: an hour before or after now,
/// so an age limit of 1 ms keeps everything or nothing on either store.
fn policy(g: &mut Gen, journal_last: u64) -> (Retention, u64, usize) {
    let hold = match g.next(3) {
        0 => Some(Arc::new(AtomicU64::new(g.next(journal_last + 2)))),
        _ => None,
    };
    let policy = Retention {
        ended_max: g.next(4) as usize,
        ended_age_ms: if g.next(2) == 0 { 1 } else { u64::MAX },
        journal_hold: hold,
    };
    let now = match g.next(2) {
        0 => unix_ms() - 3_600_000,
        _ => unix_ms() + 3_600_000,
    };
    (policy, now, 1 + g.next(6) as usize)
}

/// One answer of both stores: the same value, or the same kind of error.
fn same<T: PartialEq + std::fmt::Debug>(
    at: &str,
    mem: Result<T, StoreError>,
    sql: Result<T, StoreError>,
) {
    match (mem, sql) {
        (Ok(m), Ok(s)) => assert_eq!(m, s, "{at}"),
        (Err(m), Err(s)) => assert_eq!(
            std::mem::discriminant(&m),
            std::mem::discriminant(&s),
            "{at}: {m} / {s}"
        ),
        (m, s) => panic!("{at}: mem {m:?}, sqlite {s:?}"),
    }
}

/// A seeded workload of writes (refused ones too) and prunes on both stores, step
/// by step: every answer the trait gives must be the same as SQLite's.
#[test]
fn mem_answers_as_sqlite_does() {
    let dir = tempfile::tempdir().unwrap();
    let mut sql = crate::SqliteStore::open(&dir.path().join("l.db")).unwrap();
    let mut mem = MemStore::default();
    let mut g = Gen {
        seed: 7,
        queue: 0,
        journal: 0,
        scopes: BTreeMap::new(),
    };
    let (mut writes, mut refused, mut pruned) = (0, 0, 0);
    for step in 0..STEPS {
        let at = format!("step {step}");
        let last = mem.state().journal_last();
        if g.next(4) == 0 {
            let (p, now, rows) = policy(&mut g, last);
            let n = mem.prune(&p, now, rows);
            pruned += n.as_ref().map_or(0, |n| *n);
            same(&at, n, sql.prune(&p, now, rows));
        } else {
            let batches = group(&mut g, &mem);
            let refs: Vec<&Batch> = batches.iter().collect();
            let w = mem.write(&refs);
            (writes, refused) = (writes + 1, refused + w.is_err() as usize);
            same(&at, w, sql.write(&refs));
        }
        for n in [0, 2, 100] {
            same(&at, mem.load(n), sql.load(n));
        }
        let (after, limit) = (g.next(last + 2), g.next(6) as usize);
        same(&at, mem.journal(after, limit), sql.journal(after, limit));
        same(&at, mem.journal(0, usize::MAX), sql.journal(0, usize::MAX));
        same(&at, mem.journal_first(), sql.journal_first());
    }
    eprintln!("{writes} writes ({refused} refused), {pruned} runs pruned");
    assert!(refused > 0 && refused < writes / 2 && pruned > 0);
}
/// What only large amounts show: a transaction's entries past `CHUNK_TEXT_CUT` are
/// cut into chunks as SQLite cuts them (so a prune keeps the same entries), and a
/// receipt's request id may come again once `RECEIPTS_MAX` newer ones evicted it,
/// within the same write too.
#[test]
fn chunks_and_receipt_trails_answer_as_sqlite_does() {
    let dir = tempfile::tempdir().unwrap();
    let mut sql = crate::SqliteStore::open(&dir.path().join("l.db")).unwrap();
    let mut mem = MemStore::default();
    let line = format!("{{\"pad\":\"{}\"}}", "x".repeat(4_000));
    let entry = |seq| {
        Mutation::Journal(Arc::new(JournalEntry {
            seq,
            kind: "queued".into(),
            run_id: None,
            project: None,
            line: line.clone(),
        }))
    };
    let big = Batch {
        mutations: (1..=700).map(entry).collect(),
    };
    let receipt = |g: u64, id: u64| Mutation::ScopeReceipt {
        scope: "s".into(),
        receipt: Receipt {
            request_id: format!("q{id}"),
            mode: Mode::Stop,
            generation: g,
            control: Control::Stopped,
            at_ms: g,
        },
    };
    let scope = |g| {
        Mutation::Scope(ScopeRecord {
            id: "s".into(),
            policy: [("claude".to_string(), 1)].into(),
            manifest: None,
            control: Control::Stopped,
            generation: g,
            owner_uid: None,
            journal_first: 0,
        })
    };
    let mut trail = Batch {
        mutations: (1..=300).map(|g| receipt(g, g)).collect(),
    };
    // Within one write: the first receipt, evicted, comes again.
    trail
        .mutations
        .extend([receipt(301, 1), scope(301), entry(701)]);
    let repeat = Batch {
        mutations: vec![receipt(302, 1), scope(302)],
    };
    let keep_one = Retention {
        ended_max: 1,
        ended_age_ms: u64::MAX,
        journal_hold: None,
    };
    for (i, store) in [&mut mem as &mut dyn Store, &mut sql]
        .into_iter()
        .enumerate()
    {
        store.write(&[&big]).unwrap();
        store.write(&[&trail]).unwrap();
        assert!(store.write(&[&repeat]).is_err(), "store {i}");
        store.prune(&keep_one, unix_ms(), 1_000).unwrap();
    }
    // 261 entries of 4,020 bytes fill a chunk: the third begins at 523.
    assert_eq!(mem.journal_first().unwrap(), 523);
    same("first", mem.journal_first(), sql.journal_first());
    same(
        "journal",
        mem.journal(0, usize::MAX),
        sql.journal(522, 1_000),
    );
    same("load", mem.load(10), sql.load(10));
}
