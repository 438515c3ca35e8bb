//! Wing and Gong's search with Lowe's memo, as Porcupine does it, plus two prunings
//! and one change of order.
//!
//! The history's calls and returns are one list in time order. Walking it from the
//! front, the search tries to linearize each call it meets (apply it to the model);
//! when that works and the (linearized set, state) pair is new, the operation leaves
//! the list and the walk starts again from the front. Meeting a return means the
//! operation it ends must have been linearized before this point and none of the
//! calls before it could be: the last choice is undone and the walk goes on after it.
//! The history is linearizable once no return is left; it is not once there is no
//! choice left to undo. The memo makes each pair be explored once.
//!
//! The prunings (each sound and complete by an exchange argument; without them a
//! failing history of a few thousand operations with a few dozen unanswered ones
//! explores millions of states before it can say so):
//!
//! - An operation that leaves the state as it is, met where it can be linearized, is
//!   linearized there and the choice is never undone on its own: every order that
//!   puts it later can put it here instead (it changes nothing, and everything that
//!   had to come before it already has, or the walk would have met that return
//!   first). So an order of concurrent reads is never tried twice.
//! - An operation that never returned has no return in the list, and is linearized
//!   only where it changes the state: where it changes nothing it might as well come
//!   last (after everything, since nothing had to wait for it), and coming last is how
//!   an unanswered operation that did not take effect is read.
//!
//! The change of order: unanswered operations are tried only where the walk is stuck
//! at a return, after the answered calls before it (see `Search::run`).

use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use crate::{Limits, Model, Operation, Work};

pub(crate) enum Outcome {
    /// One order that works: indices into the history (an operation that never
    /// returned and is not in it comes after all of them, i.e. took no effect).
    Linearizable(Vec<usize>),
    NotLinearizable {
        linearized_max: usize,
    },
    Unknown(Work),
}

/// When the history is cut at `cut` ns, the time `o` returned: answers that came
/// later are not known yet (the operation is read as unanswered).
pub(crate) fn returned<I, O>(o: &Operation<I, O>, cut: u64) -> Option<u64> {
    o.return_ns.filter(|&r| r <= cut)
}

/// Searches the operations `ops` (indices into `history`) as one object's history,
/// starting in `start`, with the answers known at `cut` (`u64::MAX`: all of them).
pub(crate) fn run<M: Model>(
    model: &M,
    history: &[Operation<M::Input, M::Output>],
    ops: &[usize],
    (start, cut): (M::State, u64),
    limits: &Limits,
) -> Outcome {
    Search {
        model,
        history,
        ops,
        cut,
        limits,
        events: Events::new(history, ops, cut),
        memo: Memo::default(),
        bits: Bits::new(ops.iter().map(|&i| returned(&history[i], cut).is_none())),
        state: start,
        stack: Vec::new(),
        steps: 0,
        linearized_max: 0,
    }
    .run()
}

struct Search<'a, M: Model> {
    model: &'a M,
    history: &'a [Operation<M::Input, M::Output>],
    ops: &'a [usize],
    cut: u64,
    limits: &'a Limits,
    events: Events,
    memo: Memo<M::State>,
    /// Which of `ops` are linearized on the current path.
    bits: Bits,
    state: M::State,
    /// The path.
    stack: Vec<Step<M::State>>,
    steps: u64,
    linearized_max: usize,
}

/// One linearized operation of the path.
struct Step<S> {
    op: usize,
    /// The state before it; `None`: it changed nothing (a read), and is never undone
    /// on its own.
    before: Option<S>,
    /// For an unanswered operation: the return node where the walk was stuck when it
    /// was tried.
    stuck_at: Option<usize>,
}

/// What came of trying to linearize an operation.
#[derive(PartialEq)]
enum Tried {
    Linearized,
    Skipped,
    /// A read whose pair was seen: this whole branch was explored already.
    DeadEnd,
}

impl<M: Model> Search<'_, M> {
    /// The walk. Unanswered calls are passed over and tried only where the walk is
    /// stuck (at a return): every call before that return is still tried there, so
    /// nothing is missed, but a history that is linearizable is found without first
    /// trying each unanswered call at every point (which costs (unanswered calls) x
    /// (history) states).
    fn run(mut self) -> Outcome {
        let mut node = self.events.first();
        // Done once every answered operation is in: the unanswered ones left out
        // took no effect (or took it after everything, which is the same).
        while self.events.returns_left > 0 {
            if self.steps >= self.limits.steps_max || self.memo.len >= self.limits.states_max {
                let (states, steps) = (self.memo.len, self.steps);
                return Outcome::Unknown(Work { states, steps });
            }
            let next = match self.events.call_of(node) {
                Some(op) if !self.answered(op) => Some(self.events.next[node]),
                Some(op) => match self.try_call(op, None) {
                    Tried::Linearized => Some(self.events.first()),
                    Tried::Skipped => Some(self.events.next[node]),
                    Tried::DeadEnd => None,
                },
                None => self.try_unanswered(self.events.first(), node),
            };
            node = match next.or_else(|| self.backtrack()) {
                Some(n) => n,
                None => {
                    let linearized_max = self.linearized_max;
                    return Outcome::NotLinearizable { linearized_max };
                }
            };
        }
        Outcome::Linearizable(self.stack.iter().map(|s| self.ops[s.op]).collect())
    }

    fn answered(&self, op: usize) -> bool {
        returned(&self.history[self.ops[op]], self.cut).is_some()
    }

    /// The walk is stuck at return node `stuck`: tries the unanswered calls from
    /// `from` up to it; the node to go on from if one was linearized.
    fn try_unanswered(&mut self, from: usize, stuck: usize) -> Option<usize> {
        let mut node = from;
        while node != stuck {
            if let Some(op) = self.events.call_of(node).filter(|&op| !self.answered(op)) {
                if self.try_call(op, Some(stuck)) == Tried::Linearized {
                    return Some(self.events.first());
                }
            }
            node = self.events.next[node];
        }
        None
    }

    /// Tries to linearize `op` now (`stuck_at`: see `Step`).
    fn try_call(&mut self, op: usize, stuck_at: Option<usize>) -> Tried {
        self.steps += 1;
        let o = &self.history[self.ops[op]];
        let answered = stuck_at.is_none();
        let output = o.output.as_ref().filter(|_| answered);
        let Some(next) = self.model.step(&self.state, &o.input, output) else {
            return Tried::Skipped;
        };
        let unchanged = next == self.state;
        if unchanged && !answered {
            return Tried::Skipped;
        }
        self.bits.set(op, true);
        if !self.memo.insert(&self.bits, &next) {
            // Been here (same operations done, same state): nothing new to find, and
            // for a read not here either (it would have been linearized here).
            self.bits.set(op, false);
            return if unchanged {
                Tried::DeadEnd
            } else {
                Tried::Skipped
            };
        }
        let before = std::mem::replace(&mut self.state, next);
        let before = (!unchanged).then_some(before);
        self.stack.push(Step {
            op,
            before,
            stuck_at,
        });
        self.linearized_max = self.linearized_max.max(self.stack.len());
        self.events.lift(op);
        Tried::Linearized
    }

    /// Undoes the last choice (and the reads linearized after it) and takes the next
    /// one: the node to go on from, or `None` if there is no choice left.
    fn backtrack(&mut self) -> Option<usize> {
        loop {
            let step = self.stack.pop()?;
            self.bits.set(step.op, false);
            self.events.unlift(step.op);
            let Some(before) = step.before else {
                continue;
            };
            self.state = before;
            let after = self.events.next[self.events.call[step.op]];
            match step.stuck_at {
                None => return Some(after),
                Some(stuck) => {
                    if let Some(n) = self.try_unanswered(after, stuck) {
                        return Some(n);
                    }
                }
            }
        }
    }
}

/// The calls and returns in time order, as a doubly linked list that operations are
/// unlinked from when linearized and linked back into, in reverse order, when the
/// choice is undone (each unlinked node keeps its own neighbours, so relinking it in
/// reverse order restores the list exactly: dancing links). An operation that never
/// returned has no return node.
struct Events {
    next: Vec<usize>,
    prev: Vec<usize>,
    /// The operation a node calls, if it is a call (node 0 is the head, the last the
    /// tail: both are neither).
    calls: Vec<Option<usize>>,
    call: Vec<usize>,
    ret: Vec<Option<usize>>,
    /// Return nodes still in the list.
    returns_left: usize,
}

impl Events {
    const HEAD: usize = 0;

    fn new<I, O>(history: &[Operation<I, O>], ops: &[usize], cut: u64) -> Events {
        // (time, return?, op): at one instant calls come first, so operations that
        // touch are taken as overlapping (the lenient reading of a tie).
        let mut ev: Vec<(u64, bool, usize)> = Vec::with_capacity(2 * ops.len());
        for (op, &i) in ops.iter().enumerate() {
            let o = &history[i];
            ev.push((o.call_ns, false, op));
            if let Some(r) = returned(o, cut) {
                ev.push((r.max(o.call_ns), true, op));
            }
        }
        ev.sort_unstable();
        let tail = ev.len() + 1;
        let mut e = Events {
            next: (1..=tail).chain([tail]).collect(),
            prev: [Self::HEAD].into_iter().chain(0..tail).collect(),
            calls: vec![None; tail + 1],
            call: vec![0; ops.len()],
            ret: vec![None; ops.len()],
            returns_left: 0,
        };
        for (k, &(_, is_ret, op)) in ev.iter().enumerate() {
            if is_ret {
                e.ret[op] = Some(k + 1);
                e.returns_left += 1;
            } else {
                e.call[op] = k + 1;
                e.calls[k + 1] = Some(op);
            }
        }
        e
    }

    fn first(&self) -> usize {
        self.next[Self::HEAD]
    }

    /// The operation `node` calls; `None` for a return.
    fn call_of(&self, node: usize) -> Option<usize> {
        self.calls[node]
    }

    fn unlink(&mut self, n: usize) {
        let (p, x) = (self.prev[n], self.next[n]);
        self.next[p] = x;
        self.prev[x] = p;
    }

    fn relink(&mut self, n: usize) {
        let (p, x) = (self.prev[n], self.next[n]);
        self.next[p] = n;
        self.prev[x] = n;
    }

    fn lift(&mut self, op: usize) {
        self.unlink(self.call[op]);
        if let Some(r) = self.ret[op] {
            self.unlink(r);
            self.returns_left -= 1;
        }
    }

    fn unlift(&mut self, op: usize) {
        if let Some(r) = self.ret[op] {
            self.relink(r);
            self.returns_left += 1;
        }
        self.relink(self.call[op]);
    }
}

/// Which operations are linearized, answered and unanswered ones apart. Answered ones
/// are all linearized in the end, roughly in call order, so their set is kept by the
/// memo as a window: the index of its first word not all ones and the words from there
/// to its last word not all zeros, a few words however long the history is. Unanswered
/// ones may stay out for good (a zero early on would stretch the window to the whole
/// history, and the memo with the square of its length), so they have their own set,
/// kept whole: there are few.
struct Bits {
    answered: Box<[u64]>,
    unanswered: Box<[u64]>,
    /// Each operation's set (unanswered?) and its bit there.
    slot: Vec<(bool, usize)>,
}

/// A set of bits (its window, or the whole) as the memo keeps it.
type BitsKey<'a> = (usize, &'a [u64], &'a [u64]);

impl Bits {
    /// For operations that are (`true`) or are not unanswered at the cut.
    fn new(unanswered: impl Iterator<Item = bool>) -> Bits {
        let mut n = [0, 0];
        let slot: Vec<(bool, usize)> = unanswered
            .map(|u| {
                n[usize::from(u)] += 1;
                (u, n[usize::from(u)] - 1)
            })
            .collect();
        let words = |n: usize| vec![0; n.div_ceil(64)].into_boxed_slice();
        Bits {
            answered: words(n[0]),
            unanswered: words(n[1]),
            slot,
        }
    }

    fn set(&mut self, op: usize, on: bool) {
        let (u, i) = self.slot[op];
        let words = if u {
            &mut self.unanswered
        } else {
            &mut self.answered
        };
        let (w, b) = (i / 64, 1u64 << (i % 64));
        if on {
            words[w] |= b;
        } else {
            words[w] &= !b;
        }
    }

    fn key(&self) -> BitsKey<'_> {
        let a = &self.answered;
        let lo = a.iter().position(|&w| w != u64::MAX).unwrap_or(a.len());
        let hi = a.iter().rposition(|&w| w != 0).map_or(lo, |i| i + 1);
        let u = &self.unanswered;
        let u_hi = u.iter().rposition(|&w| w != 0).map_or(0, |i| i + 1);
        (lo, &a[lo..hi.max(lo)], &u[..u_hi])
    }
}

/// The (linearized set, state) pairs seen, bucketed by a hash of both so a lookup
/// copies nothing; a pair is copied in only when it is new.
struct Memo<S> {
    buckets: HashMap<u64, Vec<Seen<S>>>,
    len: u64,
}

/// One pair in the memo: the sets' key (see `Bits`) and the state.
type Seen<S> = (usize, Box<[u64]>, Box<[u64]>, S);

impl<S> Default for Memo<S> {
    fn default() -> Self {
        Memo {
            buckets: HashMap::new(),
            len: 0,
        }
    }
}

impl<S: Clone + Eq + Hash> Memo<S> {
    /// Adds the pair; false if it was there already.
    fn insert(&mut self, bits: &Bits, state: &S) -> bool {
        let (lo, window, unanswered) = bits.key();
        // SipHash with fixed keys: the same history explores in the same order.
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (lo, window, unanswered, state).hash(&mut h);
        let bucket = self.buckets.entry(h.finish()).or_default();
        let seen =
            |(l, w, u, s): &Seen<S>| *l == lo && **w == *window && **u == *unanswered && s == state;
        if bucket.iter().any(seen) {
            return false;
        }
        bucket.push((lo, window.into(), unanswered.into(), state.clone()));
        self.len += 1;
        true
    }
}

#[cfg(test)]
mod tests {
    use crate::{check, Limits, Model, Operation, Verdict};

    /// A register: `Some(v)` writes v (answer ignored), `None` reads (answers v).
    struct Register;

    impl Model for Register {
        type State = u8;
        type Input = Option<u8>;
        type Output = u8;

        fn init(&self) -> u8 {
            0
        }

        fn step(&self, s: &u8, i: &Option<u8>, out: Option<&u8>) -> Option<u8> {
            match (i, out) {
                (Some(v), _) => Some(*v),
                (None, Some(v)) => (v == s).then_some(*s),
                (None, None) => Some(*s),
            }
        }
    }

    fn op(t0: u64, t1: u64, i: Option<u8>, out: u8) -> Operation<Option<u8>, u8> {
        Operation::answered(0, t0, t1, i, out)
    }

    fn verdict(h: &[Operation<Option<u8>, u8>]) -> Verdict<u8> {
        check(&Register, h, &Limits::default())
    }

    #[test]
    fn a_read_overlapping_a_write_may_see_either_value() {
        let h = vec![
            op(0, 100, Some(1), 0),
            op(10, 20, None, 0),
            op(30, 40, None, 1),
        ];
        assert_eq!(verdict(&h), Verdict::Linearizable);
    }

    #[test]
    fn a_read_may_not_go_back_to_an_older_value() {
        // Two concurrent writes take effect once each: reading 1, 2, 1 is impossible.
        let h = vec![
            op(0, 100, Some(1), 0),
            op(0, 100, Some(2), 0),
            op(10, 20, None, 1),
            op(30, 40, None, 2),
            op(50, 60, None, 1),
        ];
        assert!(matches!(verdict(&h), Verdict::NotLinearizable(_)));
        // 1, 2, 2 is fine.
        let mut ok = h;
        ok[4].output = Some(2);
        assert_eq!(verdict(&ok), Verdict::Linearizable);
    }

    #[test]
    fn a_read_after_a_write_returned_sees_it() {
        let h = vec![op(0, 10, Some(1), 0), op(20, 30, None, 0)];
        match verdict(&h) {
            Verdict::NotLinearizable(e) => assert_eq!(e.ops, vec![0, 1]),
            v => panic!("{v:?}"),
        }
    }

    #[test]
    fn the_empty_history_is_linearizable() {
        assert_eq!(verdict(&[]), Verdict::Linearizable);
    }
}
