//! The conformance suite every [`FleetStore`] must pass (F5): SQLite and PostgreSQL run
//! the same checks. `Open` opens the *same* store again on each call (a new
//! connection), fresh and empty on the first, so several "hosts" can race.

use std::collections::BTreeSet;

use berth_core::scopes::{Control, Mode};

use super::FleetEvidence;
use super::{
    Claim, ClaimOutcome, ControlOutcome, Ending, FleetDrain, FleetError, FleetOp, FleetStore,
    FleetToken, HostInfo, OpOutcome, ScopeControlRequest, ThreadOwner, TokenClaim, BATCH_OPS_MAX,
};

pub type Open<'a> = &'a (dyn Fn() -> Box<dyn FleetStore> + Sync);
pub type Check = fn(Open);

pub const CHECKS: &[(&str, Check)] = &[
    ("generations_and_heartbeats", generations_and_heartbeats),
    (
        "fences_unique_and_retries_idempotent",
        fences_unique_and_retries_idempotent,
    ),
    ("budget_limit_holds_and_frees", budget_limit_holds_and_frees),
    (
        "a_refused_claim_writes_nothing",
        a_refused_claim_writes_nothing,
    ),
    (
        "a_lapse_marks_and_never_frees",
        a_lapse_marks_and_never_frees,
    ),
    (
        "a_dead_host_is_declared_exactly_once",
        a_dead_host_is_declared_exactly_once,
    ),
    ("thread_owners_only_move_up", thread_owners_only_move_up),
    ("a_restart_keeps_its_claims", a_restart_keeps_its_claims),
    (
        "claims_of_lists_a_hosts_claims",
        claims_of_lists_a_hosts_claims,
    ),
    (
        "a_refence_moves_the_fence_only",
        a_refence_moves_the_fence_only,
    ),
    (
        "a_stale_generation_changes_nothing",
        a_stale_generation_changes_nothing,
    ),
    ("bad_input_is_refused", bad_input_is_refused),
    (
        "a_raised_fence_floor_only_moves_up",
        a_raised_fence_floor_only_moves_up,
    ),
    (
        "racing_hosts_never_exceed_a_limit",
        racing_hosts_never_exceed_a_limit,
    ),
    (
        "a_batch_answers_as_its_calls_would",
        a_batch_answers_as_its_calls_would,
    ),
    (
        "plain_claims_in_a_batch_answer_as_their_calls_would",
        plain_claims_in_a_batch_answer_as_their_calls_would,
    ),
    (
        "crossing_batches_never_deadlock",
        crossing_batches_never_deadlock,
    ),
    (
        "tokens_and_the_drain_are_shared",
        tokens_and_the_drain_are_shared,
    ),
    (
        "a_fleet_drain_refuses_new_claims_in_the_store",
        a_fleet_drain_refuses_new_claims_in_the_store,
    ),
    (
        "a_scope_control_is_decided_once_fleet_wide",
        a_scope_control_is_decided_once_fleet_wide,
    ),
    (
        "evidence_is_shared_and_invalidated_as_it_was",
        evidence_is_shared_and_invalidated_as_it_was,
    ),
];

fn host(s: &mut dyn FleetStore, id: &str) -> i64 {
    s.register(&HostInfo {
        host_id: id.into(),
        address: format!("http://{id}"),
        version: "test".into(),
    })
    .unwrap()
    .0
}

fn claim(run: &str, host: &str, gen: i64, token: Option<(&str, u32)>, keys: &[&str]) -> Claim {
    Claim {
        run_id: run.into(),
        host_id: host.into(),
        gen,
        token: token.map(|(h, limit)| TokenClaim {
            scope: "exp".into(),
            harness: h.into(),
            limit,
        }),
        keys: keys.iter().map(|k| k.to_string()).collect(),
    }
}

fn fence(o: ClaimOutcome) -> u64 {
    match o {
        ClaimOutcome::Taken { fence } => fence,
        other => panic!("expected a taken claim, got {other:?}"),
    }
}

fn generations_and_heartbeats(open: Open) {
    let mut s = open();
    assert_eq!(host(&mut *s, "a"), 1);
    assert_eq!(
        host(&mut *s, "a"),
        2,
        "a re-registration is a new generation"
    );
    assert!(s.heartbeat("a", 2, "{\"slots\":4}").unwrap());
    assert!(
        !s.heartbeat("a", 1, "{}").unwrap(),
        "an old generation's beat is refused"
    );
    let hosts = s.hosts().unwrap();
    assert_eq!(hosts.len(), 1);
    assert_eq!(hosts[0].load, "{\"slots\":4}");
    assert!(hosts[0].alive && hosts[0].beat_age_ms < 60_000);
}

fn fences_unique_and_retries_idempotent(open: Open) {
    let mut s = open();
    let a = host(&mut *s, "a");
    let b = host(&mut *s, "b");
    let f1 = fence(s.claim(&claim("r1", "a", a, None, &[])).unwrap());
    let f2 = fence(s.claim(&claim("r2", "b", b, None, &[])).unwrap());
    assert_ne!(f1, f2);
    assert!(f1 > 0 && f2 > 0);
    assert_eq!(fence(s.claim(&claim("r1", "a", a, None, &[])).unwrap()), f1);
    assert_eq!(
        s.claim(&claim("r1", "b", b, None, &[])).unwrap(),
        ClaimOutcome::RunIdTaken {
            host_id: "a".into()
        }
    );
    let ff = s.fence("r1").unwrap().unwrap();
    assert_eq!(
        (ff.fence, ff.host_id.as_str(), ff.host_alive),
        (f1, "a", true)
    );
    assert!(s.end("r1", "a", a, Ending::Released).unwrap());
    assert_eq!(s.fence("r1").unwrap(), None);
    let f3 = fence(s.claim(&claim("r1", "b", b, None, &[])).unwrap());
    assert!(f3 > f2, "the fleet's one sequence only moves up");
}

fn budget_limit_holds_and_frees(open: Open) {
    let mut s = open();
    let a = host(&mut *s, "a");
    fence(s.claim(&claim("r1", "a", a, Some(("h", 2)), &[])).unwrap());
    fence(s.claim(&claim("r2", "a", a, Some(("h", 2)), &[])).unwrap());
    assert_eq!(
        s.claim(&claim("r3", "a", a, Some(("h", 2)), &[])).unwrap(),
        ClaimOutcome::BudgetFull {
            holders: 2,
            limit: 2
        }
    );
    assert_eq!(
        s.claim(&claim("r3", "a", a, Some(("h", 3)), &[])).unwrap(),
        ClaimOutcome::BudgetConflict { frozen: 2 }
    );
    fence(
        s.claim(&claim("r4", "a", a, Some(("other", 1)), &[]))
            .unwrap(),
    );
    assert!(s.end("r1", "a", a, Ending::Released).unwrap());
    fence(s.claim(&claim("r3", "a", a, Some(("h", 2)), &[])).unwrap());
    let owners: Vec<String> = s
        .tokens("exp")
        .unwrap()
        .into_iter()
        .map(|t| t.owner)
        .collect();
    assert_eq!(owners, ["r2", "r3", "r4"]);
}

fn a_refused_claim_writes_nothing(open: Open) {
    let mut s = open();
    let a = host(&mut *s, "a");
    fence(s.claim(&claim("r1", "a", a, None, &["db"])).unwrap());
    assert_eq!(
        s.claim(&claim("r2", "a", a, Some(("h", 1)), &["cache", "db"]))
            .unwrap(),
        ClaimOutcome::KeyHeld {
            key: "db".into(),
            run_id: "r1".into(),
            host_id: "a".into()
        }
    );
    // Neither the run id, the token nor the first key was kept.
    assert_eq!(s.fence("r2").unwrap(), None);
    assert!(s.tokens("exp").unwrap().is_empty());
    fence(
        s.claim(&claim("r3", "a", a, Some(("h", 1)), &["cache"]))
            .unwrap(),
    );
}

fn a_lapse_marks_and_never_frees(open: Open) {
    let mut s = open();
    let a = host(&mut *s, "a");
    fence(
        s.claim(&claim("r1", "a", a, Some(("h", 1)), &["db"]))
            .unwrap(),
    );
    assert!(s.end("r1", "a", a, Ending::Lapsed).unwrap());
    let t = s.tokens("exp").unwrap();
    assert!(t.len() == 1 && t[0].lapsed, "{t:?}");
    // The key went with the run; the token did not (B3).
    fence(s.claim(&claim("r2", "a", a, None, &["db"])).unwrap());
    assert_eq!(
        s.claim(&claim("r3", "a", a, Some(("h", 1)), &[])).unwrap(),
        ClaimOutcome::BudgetFull {
            holders: 1,
            limit: 1
        }
    );
    assert_eq!(
        s.claim(&claim("r1", "a", a, Some(("h", 1)), &[])).unwrap(),
        ClaimOutcome::BudgetFull {
            holders: 1,
            limit: 1
        }
    );
    assert!(!s.reconcile("exp", "r2").unwrap(), "no lapsed token of r2");
    assert!(s.reconcile("exp", "r1").unwrap());
    fence(s.claim(&claim("r3", "a", a, Some(("h", 1)), &[])).unwrap());
}

fn a_dead_host_is_declared_exactly_once(open: Open) {
    let mut s = open();
    let (a, b) = (host(&mut *s, "a"), host(&mut *s, "b"));
    let c = host(&mut *s, "c");
    let fb = fence(
        s.claim(&claim("rb", "b", b, Some(("h", 2)), &["db"]))
            .unwrap(),
    );
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(s.heartbeat("a", a, "{}").unwrap());
    assert!(s.heartbeat("c", c, "{}").unwrap());
    // a and c race to declare; b is declared once, by one of them.
    let (mut s2, lapse) = (open(), 200);
    let t = std::thread::spawn(move || s2.declare_dead("c", lapse).unwrap());
    let mine = s.declare_dead("a", lapse).unwrap();
    let theirs = t.join().unwrap();
    let all: Vec<_> = mine.iter().chain(&theirs).cloned().collect();
    assert_eq!(all, [("b".to_string(), b)]);
    assert_eq!(s.declarations("b").unwrap().len(), 1);
    assert!(s.declare_dead("a", lapse).unwrap().is_empty());
    // Its key is free, its token lapsed but held, its fence refused everywhere.
    fence(s.claim(&claim("ra", "a", a, None, &["db"])).unwrap());
    let tk = s.tokens("exp").unwrap();
    assert!(
        tk.len() == 1 && tk[0].lapsed && tk[0].host_id == "b",
        "{tk:?}"
    );
    let ff = s.fence("rb").unwrap().unwrap();
    assert_eq!((ff.fence, ff.host_alive), (fb, false));
    // The dead generation can neither beat, claim, declare nor end anything.
    assert!(!s.heartbeat("b", b, "{}").unwrap());
    assert_eq!(
        s.claim(&claim("rx", "b", b, None, &[])).unwrap(),
        ClaimOutcome::HostDead
    );
    assert!(s.declare_dead("b", 0).unwrap().is_empty());
    // Coming back, it re-registers and finds nothing of its old claims but the lapsed
    // token, which only an operator frees.
    let (b2, resumed) = s
        .register(&HostInfo {
            host_id: "b".into(),
            address: "http://b".into(),
            version: "test".into(),
        })
        .unwrap();
    assert!(
        b2 > b && !resumed,
        "a dead host comes back as a new generation, empty"
    );
    assert_eq!(s.fence("rb").unwrap(), None);
    assert!(!s.end("rb", "b", b2, Ending::Released).unwrap());
    assert!(s.tokens("exp").unwrap()[0].lapsed);
}

fn owner(gen: &str, fence: u64, run_id: &str) -> ThreadOwner {
    ThreadOwner {
        gen: gen.into(),
        fence,
        run_id: run_id.into(),
    }
}

fn thread_owners_only_move_up(open: Open) {
    let mut s = open();
    assert_eq!(
        s.thread_owner("t", &owner("g1", 10, "r1"), "a").unwrap(),
        None
    );
    assert_eq!(
        s.thread_owner("t", &owner("g0", 5, "r0"), "c").unwrap(),
        Some(owner("g1", 10, "r1")),
        "an older owner on another host is refused, naming the owner"
    );
    assert_eq!(
        s.thread_owner("t", &owner("g1", 10, "r1"), "a").unwrap(),
        None
    );
    assert!(s
        .thread_owner("t", &owner("g2", 10, "r1"), "c")
        .unwrap()
        .is_some());
    assert_eq!(
        s.thread_owner("t", &owner("g2", 11, "r2"), "c").unwrap(),
        None
    );
    assert!(s
        .thread_owner("t", &owner("g1", 10, "r1"), "a")
        .unwrap()
        .is_some());
    assert_eq!(
        s.thread_owner("u", &owner("g0", 1, "r0"), "c").unwrap(),
        None
    );
}

fn a_restart_keeps_its_claims(open: Open) {
    let mut s = open();
    let a = host(&mut *s, "a");
    let f = fence(
        s.claim(&claim("r1", "a", a, Some(("h", 1)), &["db"]))
            .unwrap(),
    );
    let (a2, resumed) = s
        .register(&HostInfo {
            host_id: "a".into(),
            address: "http://a".into(),
            version: "test".into(),
        })
        .unwrap();
    assert!(resumed, "a restart nobody declared dead keeps its claims");
    assert_eq!(
        fence(
            s.claim(&claim("r1", "a", a2, Some(("h", 1)), &["db"]))
                .unwrap()
        ),
        f
    );
    assert!(s.end("r1", "a", a2, Ending::Released).unwrap());
    fence(
        s.claim(&claim("r2", "a", a2, Some(("h", 1)), &["db"]))
            .unwrap(),
    );
}

/// A host's claims, whatever their generation, by run id; another host's are not
/// among them; an ended one is gone; a restart moves them to the new generation; a
/// host declared dead holds none.
fn claims_of_lists_a_hosts_claims(open: Open) {
    let mut s = open();
    let a = host(&mut *s, "a");
    let b = host(&mut *s, "b");
    for r in ["r2", "r1", "r3"] {
        fence(s.claim(&claim(r, "a", a, None, &[])).unwrap());
    }
    fence(s.claim(&claim("rb", "b", b, None, &[])).unwrap());
    assert!(s.end("r3", "a", a, Ending::Released).unwrap());
    let mine = |s: &mut dyn FleetStore| s.claims_of("a").unwrap();
    assert_eq!(mine(&mut *s), [("r1".into(), a), ("r2".into(), a)]);
    let a2 = host(&mut *s, "a");
    assert_eq!(mine(&mut *open()), [("r1".into(), a2), ("r2".into(), a2)]);
    assert_eq!(s.claims_of("c").unwrap(), []);
    std::thread::sleep(std::time::Duration::from_millis(300));
    s.heartbeat("b", b, "{}").unwrap();
    assert_eq!(s.declare_dead("b", 200).unwrap(), [("a".to_string(), a2)]);
    host(&mut *s, "a");
    assert_eq!(mine(&mut *s), [], "a dead host's claims are gone");
}

fn a_refence_moves_the_fence_only(open: Open) {
    let mut s = open();
    let a = host(&mut *s, "a");
    let f = fence(
        s.claim(&claim("r1", "a", a, Some(("h", 1)), &["db"]))
            .unwrap(),
    );
    let other = fence(s.claim(&claim("r2", "a", a, None, &[])).unwrap());
    let g = fence(s.refence("r1", "a", a).unwrap());
    assert!(
        g > other && g > f,
        "a new fence from the one sequence: {f} -> {g}"
    );
    assert_eq!(s.fence("r1").unwrap().unwrap().fence, g);
    // Token and key stay with the run; a retried claim answers the new fence.
    assert_eq!(
        fence(
            s.claim(&claim("r1", "a", a, Some(("h", 1)), &["db"]))
                .unwrap()
        ),
        g
    );
    assert_eq!(s.tokens("exp").unwrap().len(), 1);
    assert_eq!(
        s.claim(&claim("r3", "a", a, None, &["db"])).unwrap(),
        ClaimOutcome::KeyHeld {
            key: "db".into(),
            run_id: "r1".into(),
            host_id: "a".into()
        }
    );
    // Not this generation's, or not held: nothing moves.
    assert_eq!(s.refence("r1", "a", a + 1).unwrap(), ClaimOutcome::HostDead);
    assert_eq!(s.refence("nope", "a", a).unwrap(), ClaimOutcome::HostDead);
    assert_eq!(s.fence("r1").unwrap().unwrap().fence, g);
}

fn a_stale_generation_changes_nothing(open: Open) {
    let mut s = open();
    let a = host(&mut *s, "a");
    fence(
        s.claim(&claim("r1", "a", a, Some(("h", 1)), &["db"]))
            .unwrap(),
    );
    assert!(!s.end("r1", "a", a + 7, Ending::Released).unwrap());
    assert!(!s.end("r1", "b", a, Ending::Released).unwrap());
    assert!(s.fence("r1").unwrap().is_some());
    assert_eq!(s.tokens("exp").unwrap().len(), 1);
}

fn bad_input_is_refused(open: Open) {
    let mut s = open();
    let a = host(&mut *s, "a");
    let keys: Vec<String> = (0..17).map(|i| format!("k{i}")).collect();
    let mut c = claim("r1", "a", a, None, &[]);
    c.keys = keys;
    assert!(matches!(s.claim(&c), Err(FleetError::Invalid(m)) if m.contains("keys")));
    let c = claim("r1", "a", a, Some(("h", 0)), &[]);
    assert!(matches!(s.claim(&c), Err(FleetError::Invalid(m)) if m.contains("limit")));
    let big = "x".repeat(super::LOAD_BYTES_MAX + 1);
    assert!(matches!(
        s.heartbeat("a", a, &big),
        Err(FleetError::Invalid(_))
    ));
    assert_eq!(s.fence("r1").unwrap(), None);
}

fn racing_hosts_never_exceed_a_limit(open: Open) {
    const HOSTS: usize = 4;
    const RUNS: usize = 40;
    let mut s = open();
    let gens: Vec<i64> = (0..HOSTS)
        .map(|h| host(&mut *s, &format!("h{h}")))
        .collect();
    let fences = std::thread::scope(|sc| {
        let tasks: Vec<_> = (0..HOSTS)
            .map(|h| {
                let gen = gens[h];
                sc.spawn(move || {
                    let mut st = open();
                    let mut fences = Vec::new();
                    for i in 0..RUNS {
                        let (run, me) = (format!("h{h}-r{i}"), format!("h{h}"));
                        let c = claim(&run, &me, gen, Some(("h", 3)), &[]);
                        if let ClaimOutcome::Taken { fence } = st.claim(&c).unwrap() {
                            fences.push(fence);
                            // Sampled while holding: never more than the limit.
                            let held = st.tokens("exp").unwrap().len();
                            assert!(held <= 3, "{held} tokens held under a limit of 3");
                            st.end(&run, &me, gen, Ending::Released).unwrap();
                        }
                    }
                    fences
                })
            })
            .collect();
        tasks
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect::<Vec<u64>>()
    });
    let unique: BTreeSet<u64> = fences.iter().copied().collect();
    assert_eq!(unique.len(), fences.len(), "a fence was given twice");
    assert!(
        fences.len() >= RUNS,
        "too few claims succeeded: {}",
        fences.len()
    );
}

/// Issue 38 item 1: a host raises the sequence to its own last fence before it
/// registers. Every later fence is above the floor; a lower floor moves nothing back;
/// fences drawn by another host while floors are raised still only move up.
fn a_raised_fence_floor_only_moves_up(open: Open) {
    let mut s = open();
    s.raise_fence(1).unwrap();
    let a = host(&mut *s, "a");
    let f1 = fence(s.claim(&claim("r1", "a", a, None, &[])).unwrap());
    assert!(f1 > 1, "a fence at the floor: {f1}");
    s.raise_fence(1_000_000).unwrap();
    let f2 = fence(s.claim(&claim("r2", "a", a, None, &[])).unwrap());
    assert!(f2 > 1_000_000, "a fence below the raised floor: {f2}");
    s.raise_fence(10).unwrap();
    let f3 = fence(s.claim(&claim("r3", "a", a, None, &[])).unwrap());
    assert!(
        f3 > f2,
        "a lower floor moved the sequence back: {f3} after {f2}"
    );
    s.raise_fence(f3).unwrap();
    let f4 = fence(s.claim(&claim("r4", "a", a, None, &[])).unwrap());
    assert!(f4 > f3, "a floor at the last fence gave it again: {f4}");
    assert!(matches!(
        s.raise_fence(u64::MAX),
        Err(FleetError::Invalid(_))
    ));
    // Another host draws fences while floors are raised around them.
    let raiser = std::thread::scope(|sc| {
        let t = sc.spawn(|| {
            let mut r = open();
            for i in 0..20u64 {
                r.raise_fence(f4 + i * 1_000).unwrap();
            }
        });
        let mut last = f4;
        for i in 0..40 {
            let f = fence(
                s.claim(&claim(&format!("race{i}"), "a", a, None, &[]))
                    .unwrap(),
            );
            assert!(f > last, "fence {f} after {last} while floors were raised");
            last = f;
        }
        t.join()
    });
    raiser.unwrap();
}

fn end_op(run: &str, gen: i64, how: Ending) -> FleetOp {
    FleetOp::End {
        run_id: run.into(),
        gen,
        how,
    }
}

/// Issue 38 Build 1: a batch's ops are answered in order, each as its own call would
/// have been: a key taken earlier in the batch is held for a later claim and free
/// again after an ending in it; a refused op (bad input, another host's claim) is
/// answered alone and the others go on; a budget token counts within the batch.
fn a_batch_answers_as_its_calls_would(open: Open) {
    let mut s = open();
    let a = host(&mut *s, "a");
    let b = host(&mut *s, "b");
    let too_many: Vec<String> = (0..=crate::fleet::FLEET_KEYS_MAX)
        .map(|i| format!("k{i}"))
        .collect();
    let too_many: Vec<&str> = too_many.iter().map(String::as_str).collect();
    let ops = vec![
        FleetOp::Claim(claim("r1", "a", a, Some(("h", 1)), &["db"])),
        FleetOp::Claim(claim("r2", "a", a, None, &["cache", "db"])),
        FleetOp::Claim(claim("r3", "a", a, None, &too_many)),
        FleetOp::Claim(claim("r4", "b", b, None, &[])),
        FleetOp::Claim(claim("r5", "a", a, Some(("h", 1)), &[])),
        FleetOp::Refence {
            run_id: "r1".into(),
            gen: a,
        },
        end_op("r1", a, Ending::Released),
        end_op("r1", a, Ending::Released),
        FleetOp::Claim(claim("r2", "a", a, None, &["cache", "db"])),
        FleetOp::Claim(claim("r5", "a", a, Some(("h", 1)), &[])),
    ];
    let out = s.batch("a", &ops).unwrap();
    assert_eq!(out.len(), ops.len(), "{out:?}");
    let taken = |i: usize| match &out[i] {
        Ok(OpOutcome::Claim(ClaimOutcome::Taken { fence })) => *fence,
        other => panic!("op {i}: expected taken, got {other:?}"),
    };
    let f1 = taken(0);
    match &out[1] {
        Ok(OpOutcome::Claim(ClaimOutcome::KeyHeld { key, run_id, .. })) => {
            assert_eq!((key.as_str(), run_id.as_str()), ("db", "r1"))
        }
        other => panic!("op 1: expected db held by r1, got {other:?}"),
    }
    assert!(
        matches!(out[2], Err(FleetError::Invalid(_))),
        "{:?}",
        out[2]
    );
    assert!(
        matches!(out[3], Err(FleetError::Invalid(_))),
        "{:?}",
        out[3]
    );
    assert_eq!(
        out[4].as_ref().ok(),
        Some(&OpOutcome::Claim(ClaimOutcome::BudgetFull {
            holders: 1,
            limit: 1
        }))
    );
    let refenced = taken(5);
    assert!(refenced > f1, "re-fenced {refenced} after {f1}");
    assert_eq!(out[6].as_ref().ok(), Some(&OpOutcome::Ended(true)));
    assert_eq!(out[7].as_ref().ok(), Some(&OpOutcome::Ended(false)));
    assert!(taken(8) > refenced);
    assert!(taken(9) > taken(8));
    // Nothing of the refused ops was written; what was taken is held.
    assert_eq!(s.fence("r3").unwrap(), None);
    assert_eq!(s.fence("r4").unwrap(), None);
    assert_eq!(s.fence("r1").unwrap(), None);
    assert_eq!(s.fence("r2").unwrap().map(|f| f.fence), Some(taken(8)));
    let tokens = s.tokens("exp").unwrap();
    assert_eq!(tokens.len(), 1, "{tokens:?}");
    assert_eq!(tokens[0].owner, "r5");
    // Too many ops at once: refused, nothing done.
    let ops: Vec<FleetOp> = (0..=BATCH_OPS_MAX)
        .map(|i| FleetOp::Claim(claim(&format!("x{i}"), "a", a, None, &[])))
        .collect();
    assert!(matches!(s.batch("a", &ops), Err(FleetError::Invalid(_))));
    assert_eq!(s.fence("x0").unwrap(), None);
}

/// Issue 38 Build 3: the store itself refuses new claims while a fleet drain is in
/// force, so a drain is strict whenever a host reads it (a host that had not read it
/// yet admitted new runs for those milliseconds). A claim its generation holds already
/// is answered with its fence (a retry whose answer was lost); every other claim, even
/// one for another host's run id or from a dead generation, is answered draining, on
/// every store alike; a re-fence and an ending go on, and the drain's end lets new
/// claims in again.
fn a_fleet_drain_refuses_new_claims_in_the_store(open: Open) {
    let mut s = open();
    let a = host(&mut *s, "a");
    let b = host(&mut *s, "b");
    let held = fence(s.claim(&claim("r1", "a", a, None, &["db"])).unwrap());
    fence(s.claim(&claim("rb", "b", b, None, &[])).unwrap());
    let drain = FleetDrain {
        by: "op".into(),
        at: "2026-12-05T17:00:00Z".into(),
        reason: "upgrade".into(),
        host_id: "a".into(),
    };
    s.set_drain(Some(&drain)).unwrap();
    let ops = vec![
        FleetOp::Claim(claim("r2", "a", a, None, &[])),
        FleetOp::Claim(claim("r3", "a", a, Some(("h", 2)), &["cache"])),
        FleetOp::Claim(claim("r1", "a", a, None, &["db"])),
        FleetOp::Refence {
            run_id: "r1".into(),
            gen: a,
        },
        end_op("r1", a, Ending::Released),
        // Another host's run id, and a generation that is not alive: under a drain
        // every store says draining before it asks anything else (PostgreSQL did;
        // MemFleet and SQLite said run_id_taken and host_dead).
        FleetOp::Claim(claim("rb", "a", a, None, &[])),
        FleetOp::Claim(claim("r4", "a", a + 7, None, &[])),
    ];
    let out = s.batch("a", &ops).unwrap();
    let draining = Some(&OpOutcome::Claim(ClaimOutcome::Draining));
    assert_eq!(out[0].as_ref().ok(), draining, "{out:?}");
    assert_eq!(out[1].as_ref().ok(), draining, "{out:?}");
    assert_eq!(out[5].as_ref().ok(), draining, "{out:?}");
    assert_eq!(out[6].as_ref().ok(), draining, "{out:?}");
    assert_eq!(
        out[2].as_ref().ok(),
        Some(&OpOutcome::Claim(ClaimOutcome::Taken { fence: held }))
    );
    assert!(
        matches!(out[3], Ok(OpOutcome::Claim(ClaimOutcome::Taken { fence })) if fence > held),
        "{:?}",
        out[3]
    );
    assert_eq!(out[4].as_ref().ok(), Some(&OpOutcome::Ended(true)));
    assert_eq!(s.fence("r2").unwrap(), None);
    assert_eq!(s.fence("r3").unwrap(), None);
    assert!(s.tokens("exp").unwrap().is_empty());
    s.set_drain(None).unwrap();
    fence(s.claim(&claim("r2", "a", a, None, &["db"])).unwrap());
}

/// Plain claims (no token, no key), which PostgreSQL's `berth_batch` answers itself
/// since schema version 5, answer in a batch as a claim call does: taken; taken again
/// with the same fence when retried by its generation (an answer lost); refused as
/// another host's run id; refused for a generation that is not alive.
fn plain_claims_in_a_batch_answer_as_their_calls_would(open: Open) {
    let mut s = open();
    let a = host(&mut *s, "a");
    let b = host(&mut *s, "b");
    let held_by_b = fence(s.claim(&claim("p0", "b", b, None, &[])).unwrap());
    let plain = |run: &str, gen: i64| FleetOp::Claim(claim(run, "a", gen, None, &[]));
    let ops = vec![
        plain("p1", a),
        plain("p1", a),
        plain("p0", a),
        plain("p2", a + 7),
        plain("p3", a),
    ];
    let out = s.batch("a", &ops).unwrap();
    let taken = |i: usize| match &out[i] {
        Ok(OpOutcome::Claim(ClaimOutcome::Taken { fence })) => *fence,
        other => panic!("op {i}: expected taken, got {other:?}"),
    };
    assert!(taken(0) > held_by_b);
    assert_eq!(taken(1), taken(0), "a retry gets its fence back");
    assert!(
        matches!(&out[2], Ok(OpOutcome::Claim(ClaimOutcome::RunIdTaken { host_id })) if host_id == "b"),
        "{:?}",
        out[2]
    );
    assert_eq!(
        out[3].as_ref().ok(),
        Some(&OpOutcome::Claim(ClaimOutcome::HostDead))
    );
    assert!(taken(4) > taken(0));
    // As the single calls answer, and only what was taken is written.
    assert_eq!(
        s.claim(&claim("p1", "a", a, None, &[])).unwrap(),
        ClaimOutcome::Taken { fence: taken(0) }
    );
    assert_eq!(s.fence("p0").unwrap().map(|f| f.host_id), Some("b".into()));
    assert_eq!(s.fence("p2").unwrap(), None);
}

/// Issue 38 Build 1: two hosts' batches take the same keys in crossing orders (one
/// claims x then y and z, the other z then x), round after round, and none fails: a
/// batch that held x and waited for z while the other held z and waited for x would
/// be a deadlock, which the server breaks by failing one of them.
fn crossing_batches_never_deadlock(open: Open) {
    const ROUNDS: usize = 40;
    let mut s = open();
    let gens = [host(&mut *s, "a"), host(&mut *s, "b")];
    let plans: [[&[&str]; 2]; 2] = [[&["x"], &["y", "z"]], [&["z"], &["x"]]];
    std::thread::scope(|sc| {
        for (h, name) in ["a", "b"].into_iter().enumerate() {
            let (gen, plan) = (gens[h], plans[h]);
            sc.spawn(move || {
                let mut st = open();
                for round in 0..ROUNDS {
                    let runs = [0, 1].map(|i| format!("{name}-{round}-{i}"));
                    let ops: Vec<FleetOp> = (0..2)
                        .map(|i| FleetOp::Claim(claim(&runs[i], name, gen, None, plan[i])))
                        .collect();
                    let out = st.batch(name, &ops);
                    let out = out.unwrap_or_else(|e| panic!("{name} round {round}: {e}"));
                    let ends: Vec<FleetOp> = (0..2)
                        .filter(|&i| {
                            matches!(out[i], Ok(OpOutcome::Claim(ClaimOutcome::Taken { .. })))
                        })
                        .map(|i| end_op(&runs[i], gen, Ending::Released))
                        .collect();
                    let ended = st.batch(name, &ends);
                    ended.unwrap_or_else(|e| panic!("{name} round {round}, endings: {e}"));
                }
            });
        }
    });
    // Everything ended: every key is free again.
    let c = claim("last", "a", gens[0], None, &["x", "y", "z"]);
    fence(s.claim(&c).unwrap());
}

/// Issue 38 Build 3: a token or drain one host writes, every other host reads; the
/// version moves only when something changed; bad input changes nothing.
fn tokens_and_the_drain_are_shared(open: Open) {
    let (mut a, mut b) = (open(), open());
    let first = a.shared(-1).unwrap().expect("the first read answers");
    assert_eq!((first.drain.clone(), first.tokens.len()), (None, 0));
    assert_eq!(b.shared(first.version).unwrap(), None, "nothing changed");
    let tok = |i: u8, host: &str| FleetToken {
        hash: format!("{i:02x}").repeat(32),
        grant: "operator;uid=1000".into(),
        host_id: host.into(),
    };
    let made = a.put_token(&tok(1, "a")).unwrap();
    let after = b
        .shared(first.version)
        .unwrap()
        .expect("a new token is a change");
    assert!(after.version > first.version);
    assert_eq!(
        made, after.version,
        "put_token answers the version that has it"
    );
    assert_eq!(after.tokens, vec![tok(1, "a")]);
    // The same hash again (a retry) changes nothing.
    assert_eq!(a.put_token(&tok(1, "a")).unwrap(), after.version);
    assert_eq!(b.shared(after.version).unwrap(), None);
    // Bad input: refused, and nothing changed.
    let mut bad = tok(2, "a");
    bad.hash = "ABC".into();
    assert!(matches!(a.put_token(&bad), Err(FleetError::Invalid(_))));
    bad = tok(2, "a");
    bad.grant = "x".repeat(crate::fleet::GRANT_BYTES_MAX + 1);
    assert!(matches!(a.put_token(&bad), Err(FleetError::Invalid(_))));
    assert!(matches!(b.revoke_token("xyz"), Err(FleetError::Invalid(_))));
    assert_eq!(b.shared(after.version).unwrap(), None);
    b.put_token(&tok(2, "b")).unwrap();
    // Revoked by id on another host than the one that made it.
    let (gone, revoked) = b.revoke_token(&tok(1, "a").hash[..16]).unwrap();
    assert_eq!(gone, vec![tok(1, "a")]);
    let again = b.revoke_token(&tok(1, "a").hash[..16]).unwrap();
    assert_eq!(again, (vec![], revoked));
    let now = a.shared(after.version).unwrap().expect("changed");
    assert_eq!(now.version, revoked);
    assert_eq!(now.tokens, vec![tok(2, "b")]);
    // The drain: the first record stays; ending it is seen everywhere.
    let drain = |by: &str| FleetDrain {
        by: by.into(),
        at: "2026-12-05T00:00:00Z".into(),
        reason: "upgrade".into(),
        host_id: "a".into(),
    };
    let (on, started) = a.set_drain(Some(&drain("ops"))).unwrap();
    assert_eq!(on, Some(drain("ops")));
    let second = b.set_drain(Some(&drain("other"))).unwrap();
    assert_eq!(
        second,
        (Some(drain("ops")), started),
        "the first record stays"
    );
    let drained = b.shared(now.version).unwrap().expect("changed");
    assert_eq!(drained.version, started);
    assert_eq!(drained.drain, Some(drain("ops")));
    let mut long = drain("ops");
    long.reason = "x".repeat(crate::fleet::DRAIN_REASON_BYTES_MAX + 1);
    assert!(matches!(
        b.set_drain(Some(&long)),
        Err(FleetError::Invalid(_))
    ));
    assert_eq!(
        b.shared(drained.version).unwrap(),
        None,
        "a refusal changed it"
    );
    assert_eq!(b.set_drain(None).unwrap().0, None);
    let ended = a.shared(drained.version).unwrap().expect("changed");
    assert_eq!((ended.drain, ended.tokens), (None, vec![tok(2, "b")]));
    assert_eq!(a.set_drain(None).unwrap(), (None, ended.version));
    assert_eq!(
        a.shared(ended.version).unwrap(),
        None,
        "ending no drain changed it"
    );
}

fn control(scope: &str, id: &str, mode: Mode) -> ScopeControlRequest {
    ScopeControlRequest {
        scope: scope.into(),
        request_id: id.into(),
        mode,
    }
}

/// Issue 38 Build 3 (B4 fleet-wide): a control request is decided once for the whole
/// fleet by B4's rules, whichever host asks (a retry from another host gets the same
/// receipt); every host reads the scope's state; racing hosts' requests each get their
/// own generation.
fn a_scope_control_is_decided_once_fleet_wide(open: Open) {
    let (mut a, mut b) = (open(), open());
    let accepted = |o: ControlOutcome| match o {
        ControlOutcome::Accepted(r) => r,
        other => panic!("expected accepted, got {other:?}"),
    };
    let (paused, v1) = a
        .control_scope(&control("exp", "r1", Mode::Pause), "a")
        .unwrap();
    let paused = accepted(paused);
    assert_eq!((paused.generation, paused.control), (1, Control::Paused));
    let read = b.shared(-1).unwrap().expect("a first read");
    assert_eq!(read.version, v1);
    assert_eq!(read.controls.len(), 1, "{read:?}");
    let c = &read.controls[0];
    assert_eq!(
        (c.scope.as_str(), c.control, c.generation),
        ("exp", Control::Paused, 1)
    );
    assert_eq!(c.last, paused);
    // A retry from another host: the same receipt, nothing changed.
    let (again, v) = b
        .control_scope(&control("exp", "r1", Mode::Pause), "b")
        .unwrap();
    assert_eq!((accepted(again), v), (paused.clone(), v1));
    let (conflict, _) = b
        .control_scope(&control("exp", "r1", Mode::Stop), "b")
        .unwrap();
    assert_eq!(
        conflict,
        ControlOutcome::Conflict {
            accepted: Mode::Pause
        }
    );
    let (resumed, _) = b
        .control_scope(&control("exp", "r2", Mode::Resume), "b")
        .unwrap();
    assert_eq!(accepted(resumed).generation, 2);
    let (stopped, _) = a
        .control_scope(&control("exp", "r3", Mode::Stop), "a")
        .unwrap();
    assert_eq!(accepted(stopped).control, Control::Stopped);
    for (id, mode) in [("r4", Mode::Pause), ("r5", Mode::Resume)] {
        let (o, _) = b.control_scope(&control("exp", id, mode), "b").unwrap();
        assert_eq!(o, ControlOutcome::Stopped, "{id}");
    }
    // Bad input: refused, nothing changed.
    let before = a.shared(-1).unwrap().unwrap();
    for bad in [
        control("exp", "", Mode::Pause),
        control(&"s".repeat(129), "r", Mode::Pause),
    ] {
        let r = a.control_scope(&bad, "a");
        assert!(matches!(r, Err(FleetError::Invalid(_))), "{bad:?}: {r:?}");
    }
    assert_eq!(a.shared(before.version).unwrap(), None);
    // Two hosts racing requests on one scope: each accepted once, generations 1..=40.
    std::thread::scope(|sc| {
        for host in ["a", "b"] {
            sc.spawn(move || {
                let mut s = open();
                for i in 0..20 {
                    let mode = if i % 2 == 0 {
                        Mode::Pause
                    } else {
                        Mode::Resume
                    };
                    let r = control("race", &format!("{host}-{i}"), mode);
                    let (o, _) = s.control_scope(&r, host).unwrap();
                    accepted(o);
                }
            });
        }
    });
    let read = a.shared(-1).unwrap().unwrap();
    let race = read.controls.iter().find(|c| c.scope == "race").unwrap();
    assert_eq!(race.generation, 40, "{race:?}");
}

fn evidence(project: &str, fingerprint: &str, commit: Option<&str>) -> FleetEvidence {
    FleetEvidence {
        project: project.into(),
        fingerprint: fingerprint.into(),
        commit: commit.map(Into::into),
        ports: vec!["web".into(), "api".into()],
        run_id: "prover".into(),
        host_id: "a".into(),
        valid: true,
    }
}

/// Issue 38 Build 3 (C3/C4 fleet-wide): evidence one host proves every host reads;
/// an invalidation names the evidence it found wrong and leaves newer evidence alone;
/// the same evidence again changes nothing; bad input changes nothing.
fn evidence_is_shared_and_invalidated_as_it_was(open: Open) {
    let (mut a, mut b) = (open(), open());
    let e1 = evidence("shop", "f1", Some("c1"));
    let v1 = a.put_evidence(&e1).unwrap();
    let read = b.shared(-1).unwrap().expect("a first read");
    assert_eq!(
        (read.version, read.evidence.clone()),
        (v1, vec![e1.clone()])
    );
    assert_eq!(b.put_evidence(&e1).unwrap(), v1, "the same evidence again");
    // Another fingerprint's or commit's invalidation is not this evidence's.
    assert_eq!(b.invalidate_evidence("shop", "f0", Some("c1")).unwrap(), v1);
    assert_eq!(b.invalidate_evidence("shop", "f1", None).unwrap(), v1);
    let v2 = b.invalidate_evidence("shop", "f1", Some("c1")).unwrap();
    assert!(v2 > v1);
    let read = a.shared(v1).unwrap().expect("changed");
    assert!(!read.evidence[0].valid, "{read:?}");
    assert_eq!(a.invalidate_evidence("shop", "f1", Some("c1")).unwrap(), v2);
    // Newer evidence: an invalidation of the old one leaves it.
    let e2 = evidence("shop", "f2", Some("c2"));
    let v3 = a.put_evidence(&e2).unwrap();
    assert_eq!(b.invalidate_evidence("shop", "f1", Some("c1")).unwrap(), v3);
    let read = b.shared(v2).unwrap().expect("changed");
    assert_eq!(read.evidence, vec![e2]);
    // Without a commit.
    let e3 = evidence("docs", "f", None);
    a.put_evidence(&e3).unwrap();
    let v4 = b.invalidate_evidence("docs", "f", None).unwrap();
    let read = a.shared(v3).unwrap().expect("changed");
    assert_eq!(
        (read.version, read.evidence[0].valid),
        (v4, false),
        "{read:?}"
    );
    // Bad input: refused, nothing changed.
    let mut bad = evidence("shop", "f9", None);
    bad.ports = (0..=berth_core::PORTS_MAX)
        .map(|i| format!("p{i}"))
        .collect();
    assert!(matches!(a.put_evidence(&bad), Err(FleetError::Invalid(_))));
    bad = evidence("shop", &"f".repeat(257), None);
    assert!(matches!(a.put_evidence(&bad), Err(FleetError::Invalid(_))));
    assert_eq!(a.shared(v4).unwrap(), None);
}
