//! Tiny handwritten histories of one key (times in ns, runs A, B, C).

use super::*;
use crate::{check, check_by_key, Explanation, Limits, Operation, Verdict};

type Op = Operation<LeaseInput, LeaseOutput>;

const K: KeyId = 1;
const A: RunId = 10;
const B: RunId = 20;
const C: RunId = 30;

/// An answered call on key K by client `c` from `t0` to `t1`.
fn op(c: u32, (t0, t1): (u64, u64), run: RunId, call: LeaseCall, out: LeaseOutput) -> Op {
    Operation::answered(c, t0, t1, LeaseInput { key: K, run, call }, out)
}

/// A call on key K that never got an answer.
fn lost(c: u32, t0: u64, run: RunId, call: LeaseCall) -> Op {
    Operation::unanswered(c, t0, LeaseInput { key: K, run, call })
}

fn granted(fence: Fence) -> LeaseOutput {
    LeaseOutput::Granted { fence }
}

fn busy(holder: RunId) -> LeaseOutput {
    LeaseOutput::Busy {
        holder: Some(holder),
    }
}

use LeaseCall::{Acquire, Check, Query, Release, Renew};
use LeaseOutput::{Current, Done, NotHolding, Refused};

fn verdict(h: &[Op]) -> Verdict<LeaseState> {
    check(&FencedLease, h, &Limits::default())
}

/// The explanation of a history that must fail.
fn failing(h: &[Op]) -> Explanation<LeaseState> {
    match verdict(h) {
        Verdict::NotLinearizable(e) => e,
        v => panic!("expected not linearizable, got {v:?}"),
    }
}

#[test]
fn a_whole_lifecycle_with_refusals_is_linearizable() {
    let h = vec![
        op(0, (0, 10), A, Acquire, granted(3)),
        op(1, (12, 20), B, Acquire, busy(A)),
        op(0, (21, 25), A, Renew { fence: 3 }, Done),
        op(2, (22, 30), A, Check { fence: 3 }, Current(true)),
        op(1, (31, 35), A, Renew { fence: 4 }, Refused),
        op(0, (40, 50), A, Release { fence: 3 }, Done),
        op(1, (51, 60), B, Acquire, granted(7)),
        op(2, (61, 70), A, Check { fence: 3 }, Current(false)),
        op(0, (61, 70), A, Renew { fence: 3 }, Refused),
        op(2, (71, 80), B, Query, LeaseOutput::Holds { fence: 7 }),
        op(2, (81, 90), A, Query, NotHolding),
    ];
    assert_eq!(verdict(&h), Verdict::Linearizable);
}

#[test]
fn overlapping_calls_may_be_ordered_either_way() {
    // B's grant is inside A's release: the release took effect first.
    let h = vec![
        op(0, (0, 10), A, Acquire, granted(1)),
        op(0, (20, 40), A, Release { fence: 1 }, Done),
        op(1, (25, 30), B, Acquire, granted(2)),
        // And C's check, overlapping both, saw B's lease already.
        op(2, (15, 45), B, Check { fence: 2 }, Current(true)),
    ];
    assert_eq!(verdict(&h), Verdict::Linearizable);
}

#[test]
fn two_holders_at_once_are_caught_and_explained_by_the_two_grants() {
    let h = vec![
        op(0, (0, 10), A, Acquire, granted(1)),
        op(2, (12, 14), A, Check { fence: 1 }, Current(true)),
        op(1, (20, 30), B, Acquire, granted(2)),
        op(0, (40, 45), A, Renew { fence: 1 }, Done),
    ];
    let e = failing(&h);
    assert_eq!(e.ops, vec![0, 2], "{e:?}");
    assert_eq!((e.linearized_max, e.of), (2, 4));
}

#[test]
fn a_fence_that_went_back_is_caught() {
    let h = vec![
        op(0, (0, 10), A, Acquire, granted(5)),
        op(0, (20, 30), A, Release { fence: 5 }, Done),
        op(1, (40, 50), B, Acquire, granted(3)),
    ];
    let e = failing(&h);
    assert_eq!(
        (e.ops.clone(), e.start),
        (vec![0, 1, 2], LeaseState::default())
    );
    // The same fence again is not above it either.
    let mut again = h.clone();
    again[2].output = Some(granted(5));
    failing(&again);
    // Above it, it is fine.
    let mut up = h;
    up[2].output = Some(granted(6));
    assert_eq!(verdict(&up), Verdict::Linearizable);
}

#[test]
fn a_check_saying_current_after_the_release_returned_is_caught() {
    let h = vec![
        op(0, (0, 10), A, Acquire, granted(1)),
        op(0, (20, 30), A, Release { fence: 1 }, Done),
        op(2, (35, 40), A, Check { fence: 1 }, Current(true)),
    ];
    assert_eq!(failing(&h).ops, vec![0, 1, 2]);
    // Overlapping the release, it may have been read before it.
    let mut overlapping = h;
    overlapping[2].call_ns = 25;
    assert_eq!(verdict(&overlapping), Verdict::Linearizable);
}

#[test]
fn a_stale_renew_that_succeeds_is_caught() {
    let after_release = vec![
        op(0, (0, 10), A, Acquire, granted(1)),
        op(0, (20, 30), A, Release { fence: 1 }, Done),
        op(0, (40, 50), A, Renew { fence: 1 }, Done),
    ];
    assert_eq!(failing(&after_release).ops, vec![0, 1, 2]);
    let wrong_fence = vec![
        op(0, (0, 10), A, Acquire, granted(1)),
        op(0, (40, 50), A, Renew { fence: 2 }, Done),
    ];
    assert_eq!(failing(&wrong_fence).ops, vec![0, 1]);
    // And the holder's own renew refused is caught too.
    let refused = vec![
        op(0, (0, 10), A, Acquire, granted(1)),
        op(0, (40, 50), A, Renew { fence: 1 }, Refused),
    ];
    failing(&refused);
}

#[test]
fn a_long_history_is_explained_by_the_few_operations_that_fail_it() {
    // 300 clean leases, one after another, each checked by another client while
    // held; then a check says an old lease is current.
    let mut h = Vec::new();
    for n in 0..300u64 {
        let (t, run, fence) = (n * 100, 100 + n, 1 + 2 * n);
        h.push(op(0, (t, t + 10), run, Acquire, granted(fence)));
        h.push(op(1, (t + 5, t + 30), run, Check { fence }, Current(true)));
        h.push(op(2, (t + 12, t + 20), C, Acquire, busy(run)));
        h.push(op(0, (t + 40, t + 50), run, Release { fence }, Done));
    }
    let late = op(
        3,
        (40_000, 40_010),
        150,
        Check { fence: 101 },
        Current(true),
    );
    h.push(late);
    let e = failing(&h);
    // The check cannot follow any state in which run 150 does not hold the key: it is
    // shown after the last lease (its grant and release; its check and the refused
    // acquire are not needed), from the state the leases before left.
    assert_eq!(e.ops, vec![1196, 1199, 1200], "{e:?}");
    assert_eq!(e.start.holder, None);
    assert_eq!(e.start.fence_max, 597);
    assert_eq!(e.of, 1201);
}

#[test]
fn an_unanswered_call_that_explains_nothing_is_left_out_of_the_explanation() {
    // C's lost acquire could take the key after A's release, but the refusal names A.
    let h = vec![
        lost(3, 0, C, Acquire),
        op(3, (5, 8), C, Query, NotHolding),
        op(0, (10, 20), A, Acquire, granted(1)),
        op(0, (30, 40), A, Release { fence: 1 }, Done),
        op(1, (50, 60), B, Acquire, busy(A)),
    ];
    assert_eq!(failing(&h).ops, vec![2, 3, 4]);
}

#[test]
fn the_explanation_is_the_first_answer_nothing_explains() {
    // B's refusal names C, granted during it (called later, answered earlier): fine.
    // What cannot be explained is C's renew with a fence it was never granted.
    let h = vec![
        op(0, (0, 10), A, Acquire, granted(1)),
        op(0, (20, 30), A, Release { fence: 1 }, Done),
        op(1, (40, 60), B, Acquire, busy(C)),
        op(2, (45, 50), C, Acquire, granted(2)),
        op(2, (70, 80), C, Renew { fence: 9 }, Done),
    ];
    let e = failing(&h);
    assert_eq!((e.ops.clone(), e.cut_ns), (vec![1, 3, 4], 80), "{e:?}");
    assert_eq!(
        e.start.holder,
        Some(Holder {
            run: A,
            fence: Some(1)
        })
    );
}

#[test]
fn an_answer_that_others_lean_on_is_explained_without_them() {
    // B's grant repeats A's fence; C, refused because B held the key, was answered
    // first (so the history cut at B's answer needs B's grant to explain C's).
    let h = vec![
        op(0, (0, 10), A, Acquire, granted(3)),
        op(0, (20, 30), A, Release { fence: 3 }, Done),
        op(1, (22, 40), B, Acquire, granted(3)),
        op(2, (25, 35), C, Acquire, busy(B)),
    ];
    let e = failing(&h);
    assert_eq!((e.ops.clone(), e.cut_ns), (vec![0, 1, 2], 40), "{e:?}");
}

#[test]
fn busy_needs_another_holder_and_the_one_it_names() {
    let free = vec![op(1, (0, 10), B, Acquire, busy(A))];
    failing(&free);
    let wrong_name = vec![
        op(0, (0, 10), A, Acquire, granted(1)),
        op(1, (20, 30), B, Acquire, busy(C)),
    ];
    failing(&wrong_name);
    let unnamed = vec![
        op(0, (0, 10), A, Acquire, granted(1)),
        op(1, (20, 30), B, Acquire, LeaseOutput::Busy { holder: None }),
    ];
    assert_eq!(verdict(&unnamed), Verdict::Linearizable);
}

#[test]
fn an_unanswered_acquire_must_be_placed_where_it_is_seen() {
    // A's answer was lost; B was refused because A held the key, and a query found
    // A's fence: the acquire took effect, before B's refusal.
    let h = vec![
        lost(0, 0, A, Acquire),
        op(1, (10, 20), B, Acquire, busy(A)),
        op(0, (30, 40), A, Query, LeaseOutput::Holds { fence: 9 }),
        op(0, (50, 60), A, Release { fence: 9 }, Done),
        op(1, (70, 80), B, Acquire, granted(10)),
    ];
    assert_eq!(verdict(&h), Verdict::Linearizable);
    // The fence it was found to hold binds: a later grant below it is caught.
    let mut below = h.clone();
    below[4].output = Some(granted(8));
    failing(&below);
    // Seen held before it was even called: caught.
    let mut early = h;
    early[0].call_ns = 25;
    failing(&early);
}

#[test]
fn an_unanswered_acquire_may_also_never_have_happened() {
    let h = vec![
        lost(0, 0, A, Acquire),
        op(1, (10, 20), B, Acquire, granted(1)),
        op(0, (30, 40), A, Query, NotHolding),
        op(1, (50, 60), B, Release { fence: 1 }, Done),
        op(2, (70, 80), C, Acquire, granted(2)),
    ];
    assert_eq!(verdict(&h), Verdict::Linearizable);
}

#[test]
fn an_unanswered_release_must_be_placed_to_free_the_key() {
    let h = vec![
        op(0, (0, 10), A, Acquire, granted(1)),
        lost(0, 20, A, Release { fence: 1 }),
        op(1, (30, 40), B, Acquire, granted(2)),
    ];
    assert_eq!(verdict(&h), Verdict::Linearizable);
    // Not before it was called, though.
    let mut early = h;
    early[2].call_ns = 5;
    early[2].return_ns = Some(8);
    failing(&early);
}

#[test]
fn unanswered_reads_constrain_nothing() {
    let h = vec![
        lost(2, 0, A, Check { fence: 1 }),
        lost(2, 1, A, Query),
        lost(2, 2, A, Renew { fence: 1 }),
        op(0, (10, 20), A, Acquire, granted(1)),
    ];
    assert_eq!(verdict(&h), Verdict::Linearizable);
}

#[test]
fn keys_are_checked_apart() {
    let mut h = vec![
        op(0, (0, 10), A, Acquire, granted(1)),
        op(1, (20, 30), B, Acquire, granted(2)),
    ];
    h[1].input.key = 2;
    let v = check_by_key(&FencedLease, &h, |i| i.key, &Limits::default());
    assert_eq!(v.len(), 2);
    assert!(v.values().all(|v| *v == Verdict::Linearizable), "{v:?}");
    h[1].input.key = K;
    let v = check_by_key(&FencedLease, &h, |i| i.key, &Limits::default());
    assert!(matches!(v[&K], Verdict::NotLinearizable(_)), "{v:?}");
}

#[test]
fn a_search_past_its_limit_says_unknown() {
    let h = vec![
        op(0, (0, 10), A, Acquire, granted(1)),
        op(0, (20, 30), A, Release { fence: 1 }, Done),
    ];
    let tight = Limits {
        states_max: 1,
        ..Limits::default()
    };
    assert!(matches!(
        check(&FencedLease, &h, &tight),
        Verdict::Unknown(w) if w.states == 1
    ));
    let few_steps = Limits {
        steps_max: 1,
        ..Limits::default()
    };
    assert!(matches!(
        check(&FencedLease, &h, &few_steps),
        Verdict::Unknown(_)
    ));
}

#[test]
fn the_explanation_renders_one_line_per_operation() {
    let h = vec![
        op(0, (0, 10), A, Acquire, granted(1)),
        lost(1, 20, B, Acquire),
    ];
    let text = crate::render(&h, &[0, 1]);
    assert_eq!(text.lines().count(), 2);
    assert!(text.contains("Granted { fence: 1 }"), "{text}");
    assert!(text.contains("no answer"), "{text}");
}
