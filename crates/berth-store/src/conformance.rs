//! The conformance suite every [`Store`] must pass (F5). Each check gets `open`, which
//! opens the *same* ledger again each time it is called (fresh and empty on the first
//! call), so durability across reopen is part of the contract.

use std::collections::BTreeMap;
use std::sync::Arc;

use berth_core::{
    Class, Concurrency, ContractInfo, EndCause, KeyMode, Priority, Request, Resources, RunState,
};

use crate::{
    Batch, JournalEntry, Mutation, ProcessRecord, Retention, RunRecord, Store, WorkspaceIdentity,
    Writer,
};

pub type Open<'a> = &'a dyn Fn() -> Box<dyn Store>;

/// One conformance check: it opens (and reopens) the ledger through `Open`.
pub type Check = fn(Open);

/// Every check, by name, so a test can run each as its own case.
pub const CHECKS: &[(&str, Check)] = &[
    ("empty_ledger", empty_ledger),
    ("round_trip_every_field", round_trip_every_field),
    (
        "updates_apply_and_terminal_states_stick",
        updates_apply_and_terminal_states_stick,
    ),
    (
        "fence_counter_never_goes_back",
        fence_counter_never_goes_back,
    ),
    (
        "the_fence_counter_outlives_the_rows_that_carried_it",
        the_fence_counter_outlives_the_rows_that_carried_it,
    ),
    (
        "ended_runs_are_bounded_on_load",
        ended_runs_are_bounded_on_load,
    ),
    ("tokens_round_trip", tokens_round_trip),
    (
        "group_commit_shares_transactions",
        group_commit_shares_transactions,
    ),
    ("boot_id_round_trips", boot_id_round_trips),
    (
        "retention_forgets_old_ended_runs_only",
        retention_forgets_old_ended_runs_only,
    ),
    ("retention_by_age", retention_by_age),
    (
        "a_new_run_under_an_ended_runs_id_replaces_it",
        a_new_run_under_an_ended_runs_id_replaces_it,
    ),
    (
        "ports_live_with_their_run_and_go_when_it_ends",
        ports_live_with_their_run_and_go_when_it_ends,
    ),
    (
        "evidence_is_kept_replaced_and_removed",
        evidence_is_kept_replaced_and_removed,
    ),
    (
        "journal_is_written_with_its_change_and_read_in_order",
        journal_is_written_with_its_change_and_read_in_order,
    ),
    (
        "journal_retention_keeps_the_newest_entries",
        journal_retention_keeps_the_newest_entries,
    ),
    (
        "journal_retention_keeps_what_is_still_live",
        journal_retention_keeps_what_is_still_live,
    ),
    (
        "threads_and_the_drain_survive_a_reopen",
        threads_and_the_drain_survive_a_reopen,
    ),
    (
        "scopes_receipts_tokens_and_budgets_survive_a_reopen",
        scopes_receipts_tokens_and_budgets_survive_a_reopen,
    ),
];

/// A record with every field set to something non-default.
pub fn sample_run(id: &str, seq: u64, state: RunState) -> RunRecord {
    let mut named = BTreeMap::new();
    named.insert("gpu".to_string(), 2);
    named.insert("license.ansys".to_string(), 7);
    let mut labels = BTreeMap::new();
    labels.insert("team".to_string(), "a=b%c".to_string());
    labels.insert("multi".to_string(), "line\nvalue".to_string());
    let granted = !matches!(state, RunState::Queued | RunState::Cancelled);
    RunRecord {
        request: Request {
            run_id: id.to_string(),
            project: "Acme/Web".to_string(),
            class: Class::Managed,
            priority: Priority::Background,
            resources: Resources {
                slots: 2,
                memory: 3 << 30,
                cpu_millis: 1500,
                disk: 10 << 30,
                named,
            },
            singletons: vec!["postgres".into(), "redis".into()],
            contract: Some(ContractInfo {
                concurrency: Concurrency::Parallel,
                fingerprint: "ab12".into(),
                commit: Some("deadbeef".into()),
            }),
            ttl_ms: 300_000,
            wait_ms: 60_000,
            budget: None,
        },
        worktree: Some("/src/acme".into()),
        labels,
        state,
        fence: granted.then_some(seq + 100),
        queue_seq: seq,
        enqueued_ms: 1_000 + seq,
        deadline_ms: 61_000 + seq,
        granted_ms: granted.then_some(2_000 + seq),
        expires_ms: granted.then_some(302_000 + seq),
        end_cause: matches!(state, RunState::Releasing | RunState::Released)
            .then_some(EndCause::Released),
        primary_mode: KeyMode::Shared,
        upgrading: false,
        workspace: granted.then(|| WorkspaceIdentity {
            path: format!("/state/runs/{id}"),
            dev: 2049,
            ino: 1_000_000 + seq,
        }),
        processes: if granted {
            vec![
                ProcessRecord {
                    pid: 4000 + seq as i32,
                    start_ticks: 77 + seq,
                    boot_id: "boot-a".into(),
                },
                ProcessRecord {
                    pid: 5000 + seq as i32,
                    start_ticks: 78 + seq,
                    boot_id: "boot-a".into(),
                },
            ]
        } else {
            vec![]
        },
        stop_grace_ms: Some(2_500 + seq),
        // Declared while it lives (numbers once granted); an ended run holds none.
        ports: if state.is_terminal() {
            vec![]
        } else {
            let n = |p: u16| if granted { p + seq as u16 } else { 0 };
            vec![("api".into(), n(41_100)), ("web".into(), n(41_000))]
        },
        // Both values round-trip: queued samples are detached waiters.
        detached: state == RunState::Queued,
        lease_only: false,
        owner_uid: Some(1000),
        journal_first: 1 + seq,
        thread: Some("thread-1".into()),
    }
}

fn batch(fence: u64, runs: Vec<RunRecord>) -> Batch {
    Batch::runs(fence, runs)
}

pub fn empty_ledger(open: Open) {
    let mut s = open();
    let l = s.load(100).expect("load");
    assert_eq!(l.last_fence, 0);
    assert!(l.runs.is_empty());
    assert_eq!(l.next_queue_seq, 0);
}

pub fn round_trip_every_field(open: Open) {
    let runs = vec![
        sample_run("r1", 1, RunState::Queued),
        sample_run("r2", 2, RunState::Granted),
        sample_run("r3", 3, RunState::Degraded),
    ];
    open().write(&[&batch(103, runs.clone())]).expect("write");
    let l = open().load(100).expect("load");
    assert_eq!(l.runs, runs);
    assert_eq!(l.last_fence, 103);
    assert_eq!(l.next_queue_seq, 4);
}

pub fn updates_apply_and_terminal_states_stick(open: Open) {
    let mut s = open();
    let mut r = sample_run("u1", 1, RunState::Queued);
    s.write(&[&batch(0, vec![r.clone()])]).unwrap();
    r.state = RunState::Granted;
    r.fence = Some(5);
    r.expires_ms = Some(99);
    s.write(&[&batch(5, vec![r.clone()])]).unwrap();
    assert_eq!(open().load(10).unwrap().runs, vec![r.clone()]);
    let mut ended = r.clone();
    ended.state = RunState::Released;
    ended.end_cause = Some(EndCause::Released);
    s.write(&[&batch(5, vec![ended.clone()])]).unwrap();
    // D3: a late write of a non-terminal state does not resurrect the run.
    let mut late = r.clone();
    late.state = RunState::Granted;
    s.write(&[&batch(5, vec![late])]).unwrap();
    // An ended run holds no ports (W3).
    ended.ports.clear();
    assert_eq!(open().load(10).unwrap().runs, vec![ended]);
}

pub fn fence_counter_never_goes_back(open: Open) {
    let mut s = open();
    s.write(&[&batch(40, vec![])]).unwrap();
    s.write(&[&batch(0, vec![sample_run("f1", 1, RunState::Queued)])])
        .unwrap();
    s.write(&[&batch(39, vec![])]).unwrap();
    assert_eq!(open().load(10).unwrap().last_fence, 40);
    s.write(&[&batch(12, vec![]), &batch(41, vec![]), &batch(7, vec![])])
        .unwrap();
    assert_eq!(open().load(10).unwrap().last_fence, 41);
}

/// L1 (issue 37): a commit whose run carries the fence need not write the counter on
/// its own, so the counter must outlive the rows that carried it: a run replaced by a
/// new run of its id, and a run pruned, leave the fence where it was.
pub fn the_fence_counter_outlives_the_rows_that_carried_it(open: Open) {
    let mut s = open();
    let mut top = sample_run("top", 1, RunState::Released);
    top.ports.clear();
    let fence = top.fence.expect("a granted run's fence");
    s.write(&[&batch(fence, vec![top])]).unwrap();
    assert_eq!(open().load(10).unwrap().last_fence, fence);
    // A new run of the same id, queued (no fence of its own), replaces the ended one.
    let again = sample_run("top", 2, RunState::Queued);
    s.write(&[&batch(0, vec![again])]).unwrap();
    let l = open().load(10).unwrap();
    assert_eq!((l.runs.len(), l.last_fence), (1, fence), "{:?}", l.runs);
    // A run with a higher fence, ended, then pruned with everything ended.
    let mut higher = sample_run("higher", 3, RunState::Released);
    higher.ports.clear();
    let fence = higher.fence.expect("a granted run's fence");
    s.write(&[&batch(fence, vec![higher])]).unwrap();
    let forget_all = Retention {
        ended_max: 0,
        ended_age_ms: 0,
        journal_hold: None,
    };
    assert_eq!(s.prune(&forget_all, 1_900_000_000_000, 100).unwrap(), 1);
    let l = open().load(10).unwrap();
    assert_eq!((l.runs.len(), l.last_fence), (1, fence), "{:?}", l.runs);
}

pub fn ended_runs_are_bounded_on_load(open: Open) {
    let mut s = open();
    let mut runs = Vec::new();
    for i in 0..10u64 {
        let state = if i % 3 == 0 {
            RunState::Queued
        } else {
            RunState::Released
        };
        runs.push(sample_run(&format!("e{i}"), i, state));
    }
    s.write(&[&batch(200, runs)]).unwrap();
    let l = open().load(2).unwrap();
    let ids: Vec<&str> = l.runs.iter().map(|r| r.request.run_id.as_str()).collect();
    // Every live run, and only the two latest ended ones, in queue order.
    assert_eq!(ids, vec!["e0", "e3", "e6", "e7", "e8", "e9"]);
}

pub fn tokens_round_trip(open: Open) {
    let b = Batch {
        mutations: vec![
            Mutation::Token {
                hash: "aa".into(),
                scope: "read".into(),
            },
            Mutation::Token {
                hash: "bb".into(),
                scope: "admin".into(),
            },
        ],
    };
    open().write(&[&b]).unwrap();
    assert_eq!(
        open().load(1).unwrap().tokens,
        vec![
            ("aa".to_string(), "read".to_string()),
            ("bb".to_string(), "admin".to_string())
        ]
    );
}

pub fn group_commit_shares_transactions(open: Open) {
    let writer = Writer::spawn(open(), true);
    let (tx, rx) = std::sync::mpsc::channel();
    let n = 400u64;
    // Hold the writer inside a callback until every batch is queued, so the test does
    // not depend on timing: the first group may take a few batches along with the held
    // job, and all the rest must then go out together: at most two transactions.
    let (release, hold) = std::sync::mpsc::channel::<()>();
    writer.submit(None, move |_| {
        let _ = hold.recv();
    });
    for i in 0..n {
        let tx = tx.clone();
        writer.submit(
            Some(batch(
                i,
                vec![sample_run(&format!("g{i}"), i, RunState::Queued)],
            )),
            move |r| tx.send((i, r.is_ok())).unwrap(),
        );
    }
    release.send(()).unwrap();
    let mut done: Vec<(u64, bool)> = (0..n).map(|_| rx.recv().unwrap()).collect();
    let commits = writer.commits();
    writer.close();
    // Callbacks run in submission order, each after its batch is durable.
    assert!(done.windows(2).all(|w| w[0].0 < w[1].0));
    done.sort();
    assert!(done.iter().all(|(_, ok)| *ok));
    assert!(
        (1..=2).contains(&commits),
        "{commits} commits for {n} batches"
    );
    let l = open().load(0).unwrap();
    assert_eq!(l.runs.len() as u64, n);
    assert_eq!(l.last_fence, n - 1);
}

pub fn boot_id_round_trips(open: Open) {
    let mut s = open();
    assert_eq!(s.load(0).unwrap().boot_id, None);
    s.set_boot_id("b-1").unwrap();
    s.set_boot_id("b-2").unwrap();
    assert_eq!(open().load(0).unwrap().boot_id.as_deref(), Some("b-2"));
}

/// Retention by count: the `ended_max` most recent ended runs stay, older ended runs go
/// with their processes, in bounded chunks; live runs are never pruned; arrival numbers
/// never go back even when the newest runs were pruned.
pub fn retention_forgets_old_ended_runs_only(open: Open) {
    let mut s = open();
    let mut runs = Vec::new();
    for i in 0..12u64 {
        let state = if i % 4 == 0 {
            RunState::Granted
        } else {
            RunState::Released
        };
        runs.push(sample_run(&format!("p{i}"), i, state));
    }
    s.write(&[&batch(500, runs)]).unwrap();
    let keep_two = Retention {
        ended_max: 2,
        ended_age_ms: u64::MAX,
        journal_hold: None,
    };
    let now = 1_900_000_000_000;
    // Nine ended runs, two kept: seven to prune, at most five per call.
    assert_eq!(s.prune(&keep_two, now, 5).unwrap(), 5);
    assert_eq!(s.prune(&keep_two, now, 5).unwrap(), 2);
    assert_eq!(s.prune(&keep_two, now, 5).unwrap(), 0);
    let l = open().load(100).unwrap();
    let ids: Vec<&str> = l.runs.iter().map(|r| r.request.run_id.as_str()).collect();
    assert_eq!(ids, ["p0", "p4", "p8", "p10", "p11"]);
    // The live runs keep their processes; nothing of the pruned is left.
    assert!(
        l.runs.iter().all(|r| r.processes.len() == 2),
        "{:?}",
        l.runs
    );
    // Everything ended goes at `ended_max = 0`; the next arrival still comes after p11.
    let none = Retention {
        ended_max: 0,
        ended_age_ms: u64::MAX,
        journal_hold: None,
    };
    assert_eq!(s.prune(&none, now, 100).unwrap(), 2);
    let l = open().load(100).unwrap();
    assert_eq!(l.runs.len(), 3);
    assert_eq!(l.next_queue_seq, 12);
    // A pruned run's id is free again: written anew, it is a new run with no processes
    // of the old one.
    let mut again = sample_run("p3", 20, RunState::Queued);
    again.processes.clear();
    s.write(&[&batch(500, vec![again.clone()])]).unwrap();
    let l = open().load(100).unwrap();
    assert_eq!(l.runs.last(), Some(&again));
}

/// Retention by age: runs that ended longer ago than `ended_age_ms` go, younger ones
/// stay, whatever the count. (Written now: aged by asking as of a later time.)
pub fn retention_by_age(open: Open) {
    let mut s = open();
    let written_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    s.write(&[&batch(
        500,
        vec![
            sample_run("a1", 1, RunState::Released),
            sample_run("a2", 2, RunState::Expired),
            sample_run("a3", 3, RunState::Granted),
        ],
    )])
    .unwrap();
    let day = Retention {
        ended_max: 1_000,
        ended_age_ms: 86_400_000,
        journal_hold: None,
    };
    assert_eq!(s.prune(&day, written_ms + 3_600_000, 100).unwrap(), 0);
    assert_eq!(open().load(100).unwrap().runs.len(), 3);
    assert_eq!(s.prune(&day, written_ms + 2 * 86_400_000, 100).unwrap(), 2);
    let l = open().load(100).unwrap();
    let ids: Vec<&str> = l.runs.iter().map(|r| r.request.run_id.as_str()).collect();
    assert_eq!(ids, ["a3"]);
}

/// The engine forgets ended runs before retention deletes them, so a new run may come
/// under the id of an ended one still in the ledger: it replaces it, processes and all,
/// and a late write of the ended one changes nothing (D3).
pub fn a_new_run_under_an_ended_runs_id_replaces_it(open: Open) {
    let mut s = open();
    let old = sample_run("again", 1, RunState::Degraded);
    s.write(&[&batch(200, vec![old.clone()])]).unwrap();
    let mut ended = old.clone();
    ended.state = RunState::Released;
    ended.end_cause = Some(EndCause::Released);
    s.write(&[&batch(200, vec![ended.clone()])]).unwrap();
    ended.ports.clear();
    // D3 for the same run: its ended record stays.
    s.write(&[&batch(200, vec![old])]).unwrap();
    assert_eq!(open().load(10).unwrap().runs, vec![ended.clone()]);
    let new = sample_run("again", 7, RunState::Granted);
    assert_ne!(new.processes, ended.processes);
    s.write(&[&batch(200, vec![new.clone()])]).unwrap();
    assert_eq!(open().load(10).unwrap().runs, vec![new.clone()]);
    // A late write of the old, ended run does not bring it back.
    s.write(&[&batch(200, vec![ended])]).unwrap();
    let l = open().load(10).unwrap();
    assert_eq!(l.runs, vec![new]);
    assert_eq!(l.next_queue_seq, 8);
}

/// W3: a run's ports are declared while it waits, numbered once granted, and gone from
/// the ledger once it has ended (so a restart never holds an ended run's port).
pub fn ports_live_with_their_run_and_go_when_it_ends(open: Open) {
    let mut s = open();
    let queued = sample_run("p1", 1, RunState::Queued);
    assert_eq!(queued.ports, [("api".into(), 0), ("web".into(), 0)]);
    s.write(&[&batch(200, vec![queued])]).unwrap();
    let mut granted = sample_run("p1", 1, RunState::Granted);
    granted.ports = vec![("api".into(), 41_101), ("web".into(), 41_001)];
    s.write(&[&batch(200, vec![granted.clone()])]).unwrap();
    assert_eq!(open().load(10).unwrap().runs, vec![granted.clone()]);
    let mut ended = granted.clone();
    ended.state = RunState::Released;
    ended.end_cause = Some(EndCause::Released);
    s.write(&[&batch(200, vec![ended])]).unwrap();
    let l = open().load(10).unwrap();
    assert_eq!(l.runs.len(), 1);
    assert!(l.runs[0].ports.is_empty(), "{:?}", l.runs[0].ports);
    // Ended with no ports in its record, or pruned: its ports go all the same, so a new
    // run under its id never loads them (found by MemStore's side-by-side test).
    let mut p2 = granted.clone();
    p2.request.run_id = "p2".into();
    p2.queue_seq = 2;
    s.write(&[&batch(200, vec![p2.clone()])]).unwrap();
    p2.state = RunState::Released;
    p2.end_cause = Some(EndCause::Released);
    p2.ports.clear();
    s.write(&[&batch(200, vec![p2.clone()])]).unwrap();
    let forget = Retention {
        ended_max: 0,
        ended_age_ms: u64::MAX,
        journal_hold: None,
    };
    assert_eq!(s.prune(&forget, u64::MAX / 2, 10).unwrap(), 2);
    let mut again = sample_run("p2", 3, RunState::Granted);
    again.ports = vec![("web".into(), 41_002)];
    s.write(&[&batch(200, vec![again.clone()])]).unwrap();
    let l = open().load(10).unwrap();
    let p2 = l.runs.iter().find(|r| r.request.run_id == "p2").unwrap();
    assert_eq!(p2.ports, again.ports, "the ended run's ports came back");
}

/// C3/C4: a project's promotion evidence survives a reopen, a newer proof replaces it,
/// and an invalidation removes it; other projects' evidence is untouched.
pub fn evidence_is_kept_replaced_and_removed(open: Open) {
    let ev = |fp: &str, run: &str| berth_core::Evidence {
        fingerprint: fp.into(),
        commit: Some("c0ffee".into()),
        ports: vec!["web".into(), "api".into()],
        at_ms: 12_345,
        run_id: run.into(),
    };
    let put = |project: &str, e: Option<berth_core::Evidence>| Batch {
        mutations: vec![Mutation::Evidence {
            project: project.into(),
            evidence: e,
        }],
    };
    let mut s = open();
    s.write(&[
        &put("web", Some(ev("fp1", "r1"))),
        &put("api", Some(ev("fp9", "r9"))),
    ])
    .unwrap();
    assert_eq!(
        open().load(10).unwrap().evidence,
        vec![
            ("api".into(), ev("fp9", "r9")),
            ("web".into(), ev("fp1", "r1"))
        ]
    );
    s.write(&[&put("web", Some(ev("fp2", "r2")))]).unwrap();
    s.write(&[&put("api", None)]).unwrap();
    let mut no_commit = ev("fp3", "r3");
    no_commit.commit = None;
    no_commit.ports = vec![];
    s.write(&[&put("db", Some(no_commit.clone()))]).unwrap();
    assert_eq!(
        open().load(10).unwrap().evidence,
        vec![("db".into(), no_commit), ("web".into(), ev("fp2", "r2"))]
    );
}

fn entry(seq: u64, run_id: &str) -> JournalEntry {
    JournalEntry {
        seq,
        kind: "granted".into(),
        run_id: Some(run_id.into()),
        project: seq.is_multiple_of(2).then(|| "Acme/Web".into()),
        line: format!("{{\"seq\":{seq},\"note\":\"é\\n\"}}"),
    }
}

/// D5: entries are written in the transaction of their change, survive a reopen byte
/// for byte, read back in order from any point, and give the last number to go on from.
pub fn journal_is_written_with_its_change_and_read_in_order(open: Open) {
    let mut b = batch(200, vec![sample_run("j1", 1, RunState::Granted)]);
    for seq in 1..=5 {
        b.push(Mutation::Journal(entry(seq, "j1").into()));
    }
    open().write(&[&b]).unwrap();
    let mut s = open();
    assert_eq!(s.load(10).unwrap().journal_last, 5);
    assert_eq!(s.journal_first().unwrap(), 1);
    let all = s.journal(0, 100).unwrap();
    assert_eq!(all, (1..=5).map(|q| entry(q, "j1")).collect::<Vec<_>>());
    let tail = s.journal(3, 100).unwrap();
    assert_eq!(tail.iter().map(|e| e.seq).collect::<Vec<_>>(), [4, 5]);
    assert_eq!(s.journal(1, 2).unwrap().len(), 2);
    assert!(s.journal(5, 100).unwrap().is_empty());
    // A batch that fails writes none of its entries (the run row's fence is fine; the
    // sequence number going back is what a store must refuse), whether it goes back
    // within the batch or behind what is stored.
    let mut dup = batch(201, vec![sample_run("j2", 2, RunState::Queued)]);
    dup.push(Mutation::Journal(entry(6, "j2").into()));
    dup.push(Mutation::Journal(entry(3, "j2").into()));
    assert!(open().write(&[&dup]).is_err());
    let mut behind = batch(202, vec![sample_run("j3", 3, RunState::Queued)]);
    behind.push(Mutation::Journal(entry(4, "j3").into()));
    assert!(open().write(&[&behind]).is_err());
    let l = open().load(10).unwrap();
    assert_eq!(l.journal_last, 5);
    assert_eq!(
        l.runs.len(),
        1,
        "the refused batches' runs were not written either"
    );
    // Entries of several transactions read back as one sequence, from any point.
    let mut more = Batch::default();
    more.push(Mutation::Journal(entry(6, "j4").into()));
    more.push(Mutation::Journal(entry(7, "j4").into()));
    open().write(&[&more]).unwrap();
    let seqs = |v: Vec<JournalEntry>| v.iter().map(|e| e.seq).collect::<Vec<_>>();
    assert_eq!(seqs(open().journal(4, 100).unwrap()), [5, 6, 7]);
    assert_eq!(seqs(open().journal(0, 6).unwrap()), [1, 2, 3, 4, 5, 6]);
    assert_eq!(open().journal(6, 1).unwrap(), [entry(7, "j4")]);
}

/// D5: the journal follows the ledger's retention: by count (per kept run) and by age,
/// oldest first, and never its newest entry (numbering resumes after it).
pub fn journal_retention_keeps_the_newest_entries(open: Open) {
    let mut s = open();
    let written_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let per_run = crate::JOURNAL_ENTRIES_PER_RUN as u64;
    // An entry a transaction: a store may keep a transaction's entries together and
    // delete them together, so the bounds below hold exactly only at that grain.
    for seq in 1..=3 * per_run {
        let mut b = Batch::default();
        b.push(Mutation::Journal(entry(seq, "k").into()));
        s.write(&[&b]).unwrap();
    }
    let two_runs = Retention {
        ended_max: 2,
        ended_age_ms: 86_400_000,
        journal_hold: None,
    };
    s.prune(&two_runs, written_ms, 1_000).unwrap();
    assert_eq!(s.journal_first().unwrap(), per_run + 1);
    assert_eq!(s.journal(0, 1_000).unwrap().len() as u64, 2 * per_run);
    // Everything is too old: all but the newest entry go.
    s.prune(&two_runs, written_ms + 2 * 86_400_000, 1_000)
        .unwrap();
    let left = open().journal(0, 1_000).unwrap();
    assert_eq!(
        left.iter().map(|e| e.seq).collect::<Vec<_>>(),
        [3 * per_run]
    );
    assert_eq!(open().load(10).unwrap().journal_last, 3 * per_run);
}

/// Issue 32 finding 8: retention never deletes the entries of a live run, of a scope
/// still remembered, or of an export under way (from their first on), whatever its
/// count and age say; once they end (or the hold is let go) the entries go as usual.
pub fn journal_retention_keeps_what_is_still_live(open: Open) {
    use std::sync::atomic::{AtomicU64, Ordering};
    let mut s = open();
    let written_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    for seq in 1..=100 {
        let mut b = Batch::default();
        b.push(Mutation::Journal(entry(seq, "k").into()));
        s.write(&[&b]).unwrap();
    }
    let hold = Arc::new(AtomicU64::new(u64::MAX));
    let policy = Retention {
        ended_max: 1,
        ended_age_ms: 1,
        journal_hold: Some(hold.clone()),
    };
    let later = written_ms + 86_400_000;
    // A live run whose story starts at 10, a scope whose starts at 40.
    let mut live = sample_run("live", 1, RunState::Granted);
    live.journal_first = 10;
    let scope = crate::ScopeRecord {
        id: "exp".into(),
        policy: [("claude".to_string(), 1)].into(),
        manifest: None,
        control: berth_core::scopes::Control::Open,
        generation: 0,
        owner_uid: None,
        journal_first: 40,
    };
    s.write(&[&Batch {
        mutations: vec![Mutation::Run(live.clone()), Mutation::Scope(scope.clone())],
    }])
    .unwrap();
    s.prune(&policy, later, 1_000).unwrap();
    assert_eq!(
        s.journal_first().unwrap(),
        10,
        "the live run's entries are kept"
    );
    // A later write of the scope (a control change: its first entry is not known
    // then) keeps the first one written.
    s.write(&[&Batch {
        mutations: vec![Mutation::Scope(crate::ScopeRecord {
            journal_first: 0,
            ..scope
        })],
    }])
    .unwrap();
    live.state = RunState::Released;
    s.write(&[&Batch {
        mutations: vec![Mutation::Run(live)],
    }])
    .unwrap();
    // An export from 30 holds its range while it runs.
    hold.store(30, Ordering::Release);
    s.prune(&policy, later, 1_000).unwrap();
    assert_eq!(s.journal_first().unwrap(), 30, "the export's range is kept");
    hold.store(u64::MAX, Ordering::Release);
    s.prune(&policy, later, 1_000).unwrap();
    assert_eq!(
        s.journal_first().unwrap(),
        40,
        "the scope's entries are kept"
    );
    s.write(&[&Batch {
        mutations: vec![Mutation::ScopeDeleted("exp".into())],
    }])
    .unwrap();
    s.prune(&policy, later, 1_000).unwrap();
    assert_eq!(
        s.journal_first().unwrap(),
        100,
        "nothing holds them: all but the last go"
    );
}

/// G0-G2, G4: a thread's record (owner, registration, workspace, audit trail) survives
/// a reopen, is replaced whole, and keeps its owner with no registration; the drain
/// survives a reopen and goes when ended.
pub fn threads_and_the_drain_survive_a_reopen(open: Open) {
    use crate::{DrainRecord, ThreadRecord};
    use berth_core::threads::{EvictReason, Eviction, Owner, Registration, Thread};
    let owner = Owner {
        gen: "gen-2".into(),
        fence: (1 << 53) - 1,
        run_id: "r-9".into(),
    };
    let mut rec = ThreadRecord {
        thread: Thread {
            key: "thread:a".into(),
            owner: Some(owner.clone()),
            registration: Some(Registration {
                owner: owner.clone(),
                attached_ms: 10,
                deadline_ms: 86_400_010,
            }),
            has_workspace: true,
            created_ms: 5,
            active_ms: 10,
            evictions: vec![Eviction {
                reason: EvictReason::Idle,
                at_ms: 3,
            }],
        },
        workspace: Some(WorkspaceIdentity {
            path: "/state/runs/abc".into(),
            dev: 7,
            ino: 99,
        }),
        owner_uid: Some(4242),
    };
    let bare = ThreadRecord {
        thread: Thread {
            key: "b".into(),
            owner: None,
            registration: None,
            has_workspace: false,
            created_ms: 0,
            active_ms: 0,
            evictions: vec![],
        },
        workspace: None,
        owner_uid: None,
    };
    let drain = DrainRecord {
        by: "uid 0 (admin)".into(),
        at: "2026-12-01T00:00:00.000Z".into(),
        reason: "deploy".into(),
    };
    let mut s = open();
    let batch = |ms: Vec<Mutation>| Batch { mutations: ms };
    s.write(&[&batch(vec![
        Mutation::Thread(rec.clone()),
        Mutation::Thread(bare.clone()),
        Mutation::Drain(Some(drain.clone())),
    ])])
    .unwrap();
    let l = open().load(10).unwrap();
    assert_eq!(l.threads, vec![bare.clone(), rec.clone()]);
    assert_eq!(l.drain, Some(drain));
    rec.thread.registration = None;
    rec.thread.has_workspace = false;
    rec.workspace = None;
    rec.thread.evictions.push(Eviction {
        reason: EvictReason::Detach,
        at_ms: 20,
    });
    s.write(&[&batch(vec![
        Mutation::Thread(rec.clone()),
        Mutation::Drain(None),
    ])])
    .unwrap();
    let l = open().load(10).unwrap();
    assert_eq!(
        l.threads,
        vec![bare, rec],
        "the owner stays without a registration"
    );
    assert_eq!(l.drain, None);
}

/// B1–B5: a scope's frozen policy and manifest, its control and generation, its
/// receipts (the newest `RECEIPTS_MAX`) and tokens, and a run's budget come back as
/// written; a freed token stays freed; a lapse mark survives.
pub fn scopes_receipts_tokens_and_budgets_survive_a_reopen(open: Open) {
    use crate::ScopeRecord;
    use berth_core::scopes::{Budget, Control, Manifest, Mode, Receipt, Token, RECEIPTS_MAX};
    let policy: berth_core::scopes::Policy =
        [("claude".to_string(), 2), ("codex".to_string(), 5)].into();
    let manifest = Manifest {
        path: "exp/manifest.json".into(),
        sha256: "ab".repeat(32),
        execution_ids: vec!["e1".into(), "e-2".into()],
    };
    let rec = ScopeRecord {
        id: "exp-1".into(),
        policy: policy.clone(),
        manifest: Some(manifest.clone()),
        control: Control::Paused,
        generation: 1,
        owner_uid: Some(1000),
        journal_first: 0,
    };
    let receipt = |g: u64, mode: Mode, control: Control| Receipt {
        request_id: format!("req-{g}"),
        mode,
        generation: g,
        control,
        at_ms: 1_000 + g,
    };
    let token = |h: &str, run: Option<&str>, lapsed: bool| Token {
        harness: h.into(),
        run_id: run.map(str::to_string),
        since_ms: 77,
        owner_lapsed: lapsed,
    };
    let tok = |owner: &str, op: &str, t: Option<Token>| Mutation::BudgetToken {
        scope: "exp-1".into(),
        owner: owner.into(),
        operation: op.into(),
        token: t,
    };
    let mut run = sample_run("r1", 1, RunState::Granted);
    run.request.budget = Some(Box::new(Budget {
        scope: "exp-1".into(),
        harness: "claude".into(),
        operation_id: None,
        per_harness: Some(policy.clone()),
        manifest: Some(manifest.clone()),
        tenant: None,
    }));
    let mut s = open();
    let batch = |ms: Vec<Mutation>| Batch { mutations: ms };
    s.write(&[&batch(vec![
        Mutation::Fence(1_000),
        Mutation::Run(run.clone()),
        Mutation::Scope(rec.clone()),
        Mutation::ScopeReceipt {
            scope: "exp-1".into(),
            receipt: receipt(1, Mode::Pause, Control::Paused),
        },
        tok("r1", "run", Some(token("claude", Some("r1"), false))),
        tok("w1", "turn-1", Some(token("codex", None, false))),
        tok("w1", "turn-2", Some(token("codex", None, false))),
    ])])
    .unwrap();
    let l = open().load(10).unwrap();
    assert_eq!(
        l.runs[0].request.budget, run.request.budget,
        "a run's budget"
    );
    assert_eq!(l.scopes.len(), 1);
    let sc = &l.scopes[0];
    assert_eq!(
        (&sc.id, &sc.policy, &sc.manifest, sc.control, sc.generation),
        (&rec.id, &policy, &Some(manifest), Control::Paused, 1)
    );
    assert_eq!(sc.owner_uid, Some(1000), "the uid that froze it");
    assert_eq!(sc.receipts, vec![receipt(1, Mode::Pause, Control::Paused)]);
    assert_eq!(sc.tokens.len(), 3);
    assert_eq!(sc.holders("codex"), 2, "counts are recounted at load");
    // A freed token stays freed; a lapse mark survives; receipts past RECEIPTS_MAX go.
    let mut ms = vec![
        tok("w1", "turn-1", None),
        tok("r1", "run", Some(token("claude", Some("r1"), true))),
    ];
    let last = RECEIPTS_MAX as u64 + 3;
    for g in 2..=last {
        ms.push(Mutation::ScopeReceipt {
            scope: "exp-1".into(),
            receipt: receipt(g, Mode::Stop, Control::Stopped),
        });
    }
    ms.push(Mutation::Scope(ScopeRecord {
        control: Control::Stopped,
        generation: last,
        manifest: None,
        ..rec
    }));
    s.write(&[&batch(ms)]).unwrap();
    let l = open().load(10).unwrap();
    let sc = &l.scopes[0];
    assert_eq!(
        (sc.control, sc.generation, sc.manifest.clone()),
        (Control::Stopped, last, None)
    );
    assert_eq!(sc.receipts.len(), RECEIPTS_MAX);
    assert_eq!(sc.receipts.last().map(|r| r.generation), Some(last));
    assert_eq!(sc.receipts[0].generation, last - RECEIPTS_MAX as u64 + 1);
    let keys: Vec<_> = sc.tokens.keys().cloned().collect();
    assert_eq!(
        keys,
        vec![("r1".into(), "run".into()), ("w1".into(), "turn-2".into())]
    );
    assert!(sc.tokens[&("r1".to_string(), "run".to_string())].owner_lapsed);
    // S10: a forgotten scope leaves no row behind (and a second, unrelated one stays).
    let other = ScopeRecord {
        id: "exp-2".into(),
        policy: policy.clone(),
        manifest: None,
        control: Control::Open,
        generation: 0,
        owner_uid: None,
        journal_first: 0,
    };
    s.write(&[&batch(vec![
        tok("r1", "run", None),
        tok("w1", "turn-2", None),
        Mutation::Scope(other.clone()),
    ])])
    .unwrap();
    s.write(&[&batch(vec![Mutation::ScopeDeleted("exp-1".into())])])
        .unwrap();
    let l = open().load(10).unwrap();
    let ids: Vec<_> = l
        .scopes
        .iter()
        .map(|s| (s.id.as_str(), s.owner_uid))
        .collect();
    assert_eq!(
        ids,
        vec![("exp-2", None)],
        "exp-1 and its receipts are gone"
    );
}
