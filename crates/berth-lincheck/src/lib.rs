//! Linearizability checking of recorded histories (issue 16, item 3).
//!
//! A history is what clients saw: each operation's call time, its answer and the time
//! the answer came back, or no answer at all (the daemon was killed mid-request: the
//! operation may or may not have taken effect). The checker asks whether there is one
//! order of the operations that keeps real time (an operation that returned before
//! another was called comes first) and is a legal run of a sequential [`Model`]:
//! Herlihy and Wing's linearizability. The search is Wing and Gong's depth-first
//! search over linearization points with Lowe's memo of (operations linearized, model
//! state), as in Porcupine (github.com/anishathalye/porcupine). A history is split by
//! key first ([`check_by_key`]): it is linearizable iff each key's part is
//! (P-compositionality), and one key's part is a far smaller search.
//!
//! Pure: no I/O, no clock, no threads, no randomness; the same history always gets the
//! same verdict. All work is bounded by [`Limits`]: a search that reaches a limit says
//! [`Verdict::Unknown`], never a guess.
//!
//! [`lease::FencedLease`] is the model berth's lease API is checked against.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::hash::Hash;

mod explain;
pub mod lease;
mod search;

pub use explain::render;

/// One operation of a history.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Operation<I, O> {
    /// Who issued it. Only the explanation shows it: a client's own operations never
    /// overlap in time, so real-time order already orders them.
    pub client: u32,
    /// When the call was made, in ns on the one clock the whole history was timed by.
    pub call_ns: u64,
    /// When the answer came back; `None`: no answer came (the operation may take
    /// effect at any point after its call, or never).
    pub return_ns: Option<u64>,
    pub input: I,
    /// The answer; `None` when it is unknown (then any answer is possible).
    pub output: Option<O>,
}

impl<I, O> Operation<I, O> {
    /// An operation that was answered with `output` at `return_ns`.
    pub fn answered(client: u32, call_ns: u64, return_ns: u64, input: I, output: O) -> Self {
        Operation {
            client,
            call_ns,
            return_ns: Some(return_ns),
            input,
            output: Some(output),
        }
    }

    /// An operation that never got an answer.
    pub fn unanswered(client: u32, call_ns: u64, input: I) -> Self {
        Operation {
            client,
            call_ns,
            return_ns: None,
            input,
            output: None,
        }
    }
}

/// A sequential specification: what one object does, one operation at a time.
pub trait Model {
    /// Small and cheap to clone and hash: the memo holds one per state explored.
    type State: Clone + Eq + Hash + Debug;
    type Input: Debug;
    type Output: Debug;

    fn init(&self) -> Self::State;

    /// The state after `input` was answered `output` in `state`, or `None` if that
    /// answer is impossible there. With `output: None` (the answer is unknown) it must
    /// give a state: the operation happened, whatever it answered.
    fn step(
        &self,
        state: &Self::State,
        input: &Self::Input,
        output: Option<&Self::Output>,
    ) -> Option<Self::State>;

    /// Whether `input` can change the state at all. One that cannot and whose answer
    /// is unknown constrains nothing, so the search leaves it out: each unanswered
    /// operation kept could double the states the memo holds.
    fn may_change_state(&self, _input: &Self::Input) -> bool {
        true
    }
}

/// Per-key work limits: every search, and every explanation, is bounded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Distinct (linearized set, state) pairs the memo may hold: this bounds its
    /// memory too (a pair is ~100 bytes while operations are linearized near call
    /// order, up to a bit per operation of the key when they are not).
    pub states_max: u64,
    /// Model steps tried (failed ones included).
    pub steps_max: u64,
    /// Searches the explanation may run to shrink a failing history.
    pub shrink_checks_max: u32,
}

/// ~100 MB of memo at most in the common case. A linearizable history of n
/// operations needs about n to 2n states (berth's long run: under 100,000 for a key of
/// 50,000); one that is not needs every state reachable before the first answer that
/// cannot be explained, which grows with the unanswered calls before it.
pub const STATES_MAX: u64 = 1_000_000;
/// Some seconds of model steps (failed tries included), per key.
pub const STEPS_MAX: u64 = 200_000_000;
/// Two bisections (~2 log2 n searches) and a few dozen reads left out.
pub const SHRINK_CHECKS_MAX: u32 = 200;

impl Default for Limits {
    fn default() -> Self {
        Limits {
            states_max: STATES_MAX,
            steps_max: STEPS_MAX,
            shrink_checks_max: SHRINK_CHECKS_MAX,
        }
    }
}

/// What the checker concluded about one history (or one key's part of it); `S` is the
/// model's state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict<S> {
    Linearizable,
    NotLinearizable(Explanation<S>),
    /// A limit was reached first: no verdict (a test must treat this as a failure).
    Unknown(Work),
}

/// Why a history is not linearizable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Explanation<S> {
    /// The model's state before the first of `ops`, as the operations before them
    /// can leave it.
    pub start: S,
    /// A small part of the history that shows the failure (indices into the history
    /// given): the last is the first answer of the history that nothing can explain;
    /// the others (by call time) can all happen from `start`, in an order that keeps
    /// real time, and it cannot follow them.
    pub ops: Vec<usize>,
    /// When that answer came back: answers that came later were not used (those
    /// operations read as unanswered).
    pub cut_ns: u64,
    /// The most operations of the key the search could linearize, of `of`.
    pub linearized_max: usize,
    pub of: usize,
}

/// The work a search did before it stopped at a limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Work {
    pub states: u64,
    pub steps: u64,
}

/// Checks the whole history as one object.
pub fn check<M: Model>(
    model: &M,
    history: &[Operation<M::Input, M::Output>],
    limits: &Limits,
) -> Verdict<M::State> {
    let all: Vec<usize> = (0..history.len()).collect();
    check_part(model, history, &all, limits)
}

/// Checks each key's operations on their own (P-compositionality); a key's verdict
/// names operations by their index in `history`.
pub fn check_by_key<M: Model, K: Ord>(
    model: &M,
    history: &[Operation<M::Input, M::Output>],
    key: impl Fn(&M::Input) -> K,
    limits: &Limits,
) -> BTreeMap<K, Verdict<M::State>> {
    let mut parts: BTreeMap<K, Vec<usize>> = BTreeMap::new();
    for (i, op) in history.iter().enumerate() {
        parts.entry(key(&op.input)).or_default().push(i);
    }
    parts
        .into_iter()
        .map(|(k, part)| (k, check_part(model, history, &part, limits)))
        .collect()
}

/// One part: the operations that matter, searched, and explained if they fail.
fn check_part<M: Model>(
    model: &M,
    history: &[Operation<M::Input, M::Output>],
    part: &[usize],
    limits: &Limits,
) -> Verdict<M::State> {
    let mut ops: Vec<usize> = part
        .iter()
        .copied()
        .filter(|&i| history[i].output.is_some() || model.may_change_state(&history[i].input))
        .collect();
    ops.sort_by_key(|&i| (history[i].call_ns, i));
    match search::run(model, history, &ops, (model.init(), u64::MAX), limits) {
        search::Outcome::Linearizable(_) => Verdict::Linearizable,
        search::Outcome::Unknown(work) => Verdict::Unknown(work),
        search::Outcome::NotLinearizable { linearized_max } => Verdict::NotLinearizable(
            explain::explain(model, history, &ops, limits, linearized_max),
        ),
    }
}
