//! Explaining a failure: a history of thousands of operations that is not
//! linearizable is cut down to the few operations that show why (two grants without a
//! release between them, a check that saw a lease its release had ended), and the
//! model's state before them, which a person can read.
//!
//! First the earliest answer that cannot be explained: the history cut at time `t`
//! (the operations called by then, those answered later read as unanswered) fails
//! for every `t` from some return on, and cannot fail unless the whole history does
//! (in an order of the whole, what was answered by `t` comes before anything called
//! after `t`; what was not answered by `t` may be put last, i.e. as not having taken
//! effect). So bisecting over return times finds the first answer `x` that cannot be
//! explained, and that is a fact about the whole history.
//!
//! Then the context: what came before `x` is linearizable, the search gives one order
//! of it and so the state after each of its steps. The explanation starts at the
//! latest step from which `x` still cannot follow (bisected), moved back over the last
//! `CONTEXT_CHANGES` changes of state by answered operations so that it shows how the
//! state came about; then operations that changed nothing there (reads) and
//! unanswered ones are left out while `x` still cannot follow (and, for an unanswered
//! one that changed the state, while the rest can still happen without it). Answered
//! operations that changed the state are never left out: without a lease's grant its
//! renew would fail too, a different failure than the one to explain. This part is
//! one order's view: another order of what came before might reach `x` in another
//! state (which would not explain `x` either).

use std::fmt::{Debug, Write};

use crate::search::{self, returned, Outcome};
use crate::{Explanation, Limits, Model, Operation};

/// State changes before the failure shown for context (a lease's grant and release).
const CONTEXT_CHANGES: usize = 2;

/// Why `ops` (known to fail, sorted by call time) fails; `linearized_max` is what the
/// search of the whole reached. Within `limits.shrink_checks_max` searches; once those
/// are spent, the explanation found so far.
pub(crate) fn explain<M: Model>(
    model: &M,
    history: &[Operation<M::Input, M::Output>],
    ops: &[usize],
    limits: &Limits,
    linearized_max: usize,
) -> Explanation<M::State> {
    let mut s = Shrinker {
        model,
        history,
        limits,
        budget: limits.shrink_checks_max,
        cut: u64::MAX,
    };
    let (mut start, mut kept) = (model.init(), ops.to_vec());
    let found = s.first_unexplained_answer(ops);
    s.cut = u64::MAX;
    if let Some((cut, x, upto)) = found {
        s.cut = cut;
        (start, kept) = s.around(x, &upto).unwrap_or((model.init(), upto));
    }
    Explanation {
        start,
        ops: kept,
        cut_ns: s.cut,
        linearized_max,
        of: ops.len(),
    }
}

struct Shrinker<'a, M: Model> {
    model: &'a M,
    history: &'a [Operation<M::Input, M::Output>],
    limits: &'a Limits,
    /// Searches left.
    budget: u32,
    /// Answers that came later are not used.
    cut: u64,
}

/// An order that works of what came before the unexplained answer, the state before
/// each of its steps (and after the last), and the unanswered operations not in it.
struct Before<S> {
    order: Vec<usize>,
    states: Vec<S>,
    pending: Vec<usize>,
}

impl<M: Model> Shrinker<'_, M> {
    /// The search of `sub` from `start` at the cut; `None` when it gave no verdict (a
    /// limit, or no budget left).
    fn search(&mut self, start: &M::State, sub: &[usize]) -> Option<Outcome> {
        if self.budget == 0 {
            return None;
        }
        self.budget -= 1;
        let mut sorted = sub.to_vec();
        sorted.sort_by_key(|&i| (self.history[i].call_ns, i));
        let at = (start.clone(), self.cut);
        match search::run(self.model, self.history, &sorted, at, self.limits) {
            Outcome::Unknown(_) => None,
            o => Some(o),
        }
    }

    fn linearizable(&mut self, start: &M::State, sub: &[usize]) -> bool {
        matches!(self.search(start, sub), Some(Outcome::Linearizable(_)))
    }

    fn fails(&mut self, start: &M::State, sub: &[usize]) -> bool {
        matches!(
            self.search(start, sub),
            Some(Outcome::NotLinearizable { .. })
        )
    }

    fn answered(&self, i: usize) -> bool {
        returned(&self.history[i], self.cut).is_some()
    }

    /// The earliest cut at which `ops` fails (bisected over return times: failing is
    /// monotone in the cut), the operation answered then, and the operations called
    /// by then.
    fn first_unexplained_answer(&mut self, ops: &[usize]) -> Option<(u64, usize, Vec<usize>)> {
        let mut returns: Vec<u64> = ops
            .iter()
            .filter_map(|&i| self.history[i].return_ns)
            .collect();
        returns.sort_unstable();
        returns.dedup();
        let upto = |cut: u64| -> Vec<usize> {
            let called = ops.iter().filter(|&&i| self.history[i].call_ns <= cut);
            called.copied().collect()
        };
        let init = self.model.init();
        let (mut lo, mut hi) = (0, returns.len());
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            self.cut = returns[mid];
            if self.fails(&init, &upto(returns[mid])) {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        let cut = *returns.get(lo)?;
        let x = *ops
            .iter()
            .rev()
            .find(|&&i| self.history[i].return_ns == Some(cut))?;
        Some((cut, x, upto(cut)))
    }

    /// `x` and the few operations before it that show why it cannot be explained,
    /// with the state they start in; `None` if that cannot be worked out.
    fn around(&mut self, x: usize, upto: &[usize]) -> Option<(M::State, Vec<usize>)> {
        let b = self.before(upto)?;
        let k = self.window_start(&b, x);
        let window = b.order[k..].iter().chain(&b.pending).filter(|&&i| i != x);
        let window: Vec<usize> = window.copied().collect();
        let reads: Vec<usize> = (k..b.order.len())
            .filter(|&j| b.states[j] == b.states[j + 1] && b.order[j] != x)
            .map(|j| b.order[j])
            .collect();
        let unanswered = window.iter().filter(|&&i| !self.answered(i));
        let removable: Vec<usize> = unanswered.chain(&reads).copied().collect();
        let mut kept = self.leave_out(&b.states[k], window, &removable, &reads, x);
        kept.sort_by_key(|&i| (self.history[i].call_ns, i));
        kept.push(x);
        Some((b.states[k].clone(), kept))
    }

    /// One order of `upto` just before the cut: its last answer, `x`'s, not known
    /// yet (`x` may be in the order, taking effect as an unanswered call would).
    fn before(&mut self, upto: &[usize]) -> Option<Before<M::State>> {
        let cut = self.cut;
        self.cut = cut.saturating_sub(1);
        let b = self.order_of(upto);
        self.cut = cut;
        b
    }

    /// One order of `ops` at the cut and the states along it.
    fn order_of(&mut self, ops: &[usize]) -> Option<Before<M::State>> {
        let Some(Outcome::Linearizable(order)) = self.search(&self.model.init(), ops) else {
            return None;
        };
        let mut states = vec![self.model.init()];
        for &i in &order {
            let o = &self.history[i];
            let out = o.output.as_ref().filter(|_| self.answered(i));
            states.push(self.model.step(states.last()?, &o.input, out)?);
        }
        let pending = ops.iter().filter(|i| !order.contains(i)).copied().collect();
        Some(Before {
            order,
            states,
            pending,
        })
    }

    /// The step of `b.order` to explain `x` from: the latest from which it still
    /// cannot follow (bisected; not after `x` itself, if the order has it), then back
    /// over the last `CONTEXT_CHANGES` changes.
    fn window_start(&mut self, b: &Before<M::State>, x: usize) -> usize {
        let fails_from = |s: &mut Self, k: usize| {
            let rest = b.order[k..].iter().chain(&b.pending).filter(|&&i| i != x);
            let sub: Vec<usize> = rest.chain([&x]).copied().collect();
            s.fails(&b.states[k], &sub)
        };
        // From 0 it fails: that is the whole history at the cut.
        let x_at = b.order.iter().position(|&i| i == x);
        let (mut lo, mut hi) = (0, x_at.unwrap_or(b.order.len()));
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if fails_from(self, mid) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        let changes: Vec<usize> = (0..lo)
            .filter(|&j| b.states[j] != b.states[j + 1] && self.answered(b.order[j]))
            .collect();
        let back = changes.len().saturating_sub(CONTEXT_CHANGES);
        changes[back..]
            .iter()
            .copied()
            .find(|&k| fails_from(self, k))
            .unwrap_or(lo)
    }

    /// Whether `sub` can happen from `start` just before the cut (its last answer,
    /// `x`'s, not known yet: `x` may take effect, as an unanswered call would).
    fn possible_before_cut(&mut self, start: &M::State, sub: &[usize]) -> bool {
        let cut = self.cut;
        self.cut = cut.saturating_sub(1);
        let possible = self.linearizable(start, sub);
        self.cut = cut;
        possible
    }

    /// Leaves out of `window` the operations of `removable` that `x` does not need to
    /// fail from `start`, one at a time (the windows are short), in passes until one
    /// leaves nothing out (leaving out a read can make an unanswered call unneeded).
    /// Leaving out a read keeps the rest possible (with `x` unanswered); anything else
    /// must be shown to.
    fn leave_out(
        &mut self,
        start: &M::State,
        mut window: Vec<usize>,
        removable: &[usize],
        reads: &[usize],
        x: usize,
    ) -> Vec<usize> {
        let mut left = removable.to_vec();
        loop {
            let before = left.len();
            left.retain(|r| {
                let without: Vec<usize> = window.iter().copied().filter(|i| i != r).collect();
                let with_x: Vec<usize> = without.iter().copied().chain([x]).collect();
                let possible = reads.contains(r) || self.possible_before_cut(start, &with_x);
                let unneeded = possible && self.fails(start, &with_x);
                if unneeded {
                    window = without;
                }
                !unneeded
            });
            if left.len() == before || self.budget == 0 {
                return window;
            }
        }
    }
}

/// The operations `ops` of `history`, one a line: client, call and return times in
/// seconds, input and output ("no answer" when none came).
pub fn render<I: Debug, O: Debug>(history: &[Operation<I, O>], ops: &[usize]) -> String {
    let secs = |ns: u64| ns as f64 / 1e9;
    let mut s = String::new();
    for &i in ops {
        let o = &history[i];
        let ret = o
            .return_ns
            .map_or("no answer".to_string(), |r| format!("{:.6} s", secs(r)));
        let out = o
            .output
            .as_ref()
            .map_or("?".to_string(), |out| format!("{out:?}"));
        let _ = writeln!(
            s,
            "  #{i} client {} [{:.6} s .. {ret}] {:?} -> {out}",
            o.client,
            secs(o.call_ns),
            o.input
        );
    }
    s
}
