//! The sequential model of one exclusive key of berth (a singleton, A4) as its lease
//! API shows it (L1, L2, L4, L5, L7, L8).
//!
//! What a client can observe of one key, and so what the model holds: who holds the
//! key and under which fence, and the highest fence granted on it so far. Fences are
//! one counter for the whole daemon (L1), so the fences one key sees jump; per key the
//! rule is only that each grant's fence is above every fence granted on that key
//! before (which includes the fence of the lease it replaced).
//!
//! - `Acquire` (`wait_s = 0`, so it never queues) is granted with a fence iff the key
//!   is free, and refused as busy iff another run holds it. The same run asking again
//!   while it holds the key re-attaches to its own lease and fence (L7).
//! - `Renew`, `Release` and `Check` with (run, fence) succeed, resp. answer
//!   `current`, iff that run holds the key under that fence right now; a release frees
//!   the key (L5: with no processes to stop, in the same step).
//! - `Query` (`GET /v1/runs/{id}`) says whether the run holds the key, and its fence.
//!
//! What the model leaves out, because the test's clients never do it: expiry (leases
//! are long and every holder releases; an expiry would read as a bug), releasing a run
//! that already ended (L5's idempotence needs each run's history), an acquire retried
//! after its run ended, and waiting in the queue.
//!
//! An acquire whose answer was lost and that found the key free took it under a fence
//! nobody saw: the holder's fence is then unknown until an answer shows it (a query,
//! a check saying current, a renew or release that worked), which binds it, provided
//! it is above every fence granted on the key before.

use crate::Model;

/// A key's name, as the test numbers them.
pub type KeyId = u64;
/// A run's id, as the test numbers them.
pub type RunId = u64;
/// A fencing token (L1).
pub type Fence = u64;

/// One call on one key, by (or about) one run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LeaseInput {
    pub key: KeyId,
    pub run: RunId,
    pub call: LeaseCall,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LeaseCall {
    /// `POST /v1/runs` naming the key, `wait_s = 0`.
    Acquire,
    /// `POST /v1/runs/{run}/renew {fence}`.
    Renew { fence: Fence },
    /// `POST /v1/runs/{run}/release {fence}`.
    Release { fence: Fence },
    /// `GET /v1/fences/check?run_id=run&fence=`.
    Check { fence: Fence },
    /// `GET /v1/runs/{run}`: is it granted, and under which fence.
    Query,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LeaseOutput {
    /// Acquire: `201`, granted under `fence`.
    Granted { fence: Fence },
    /// Acquire: refused because the key is held (`410 expired`, reason
    /// `key.exclusive`), by `holder` if the answer named it.
    Busy { holder: Option<RunId> },
    /// Renew or release: `200`.
    Done,
    /// Renew or release: `409 stale_fence`, `410 gone` or `404`.
    Refused,
    /// Check: `current`.
    Current(bool),
    /// Query: the run is granted under `fence`.
    Holds { fence: Fence },
    /// Query: the run is not granted (unknown, ended, or never granted).
    NotHolding,
}

/// Who holds the key; `fence: None` while no answer has shown the holder's fence yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Holder {
    pub run: RunId,
    pub fence: Option<Fence>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LeaseState {
    pub holder: Option<Holder>,
    /// The highest fence granted on this key so far (0: none).
    pub fence_max: Fence,
}

impl LeaseState {
    /// The state in which `run` holds the key under `fence`, if that can be true: the
    /// same state, or one with the holder's unknown fence bound to `fence`.
    fn held_by(self, run: RunId, fence: Fence) -> Option<LeaseState> {
        let h = self.holder.filter(|h| h.run == run)?;
        match h.fence {
            Some(f) => (f == fence).then_some(self),
            None => (fence > self.fence_max).then_some(LeaseState {
                holder: Some(Holder {
                    run,
                    fence: Some(fence),
                }),
                fence_max: fence,
            }),
        }
    }

    /// Can it be that `run` does not hold the key under `fence`? (With the holder's
    /// fence unknown, another fence is possible.)
    fn maybe_not_held_by(self, run: RunId, fence: Fence) -> bool {
        self.holder
            .is_none_or(|h| h.run != run || h.fence != Some(fence))
    }

    fn freed(self) -> LeaseState {
        LeaseState {
            holder: None,
            ..self
        }
    }
}

/// The model of one exclusive key; check a history with
/// `check_by_key(&FencedLease, &history, |i| i.key, &limits)`.
#[derive(Clone, Copy, Debug, Default)]
pub struct FencedLease;

impl Model for FencedLease {
    type State = LeaseState;
    type Input = LeaseInput;
    type Output = LeaseOutput;

    fn init(&self) -> LeaseState {
        LeaseState::default()
    }

    fn step(
        &self,
        s: &LeaseState,
        i: &LeaseInput,
        out: Option<&LeaseOutput>,
    ) -> Option<LeaseState> {
        let (s, run) = (*s, i.run);
        match i.call {
            LeaseCall::Acquire => acquire(s, run, out),
            LeaseCall::Renew { fence } => renew(s, run, fence, out),
            LeaseCall::Release { fence } => release(s, run, fence, out),
            LeaseCall::Check { fence } => check(s, run, fence, out),
            LeaseCall::Query => query(s, run, out),
        }
    }

    /// Only acquires and releases change who holds the key (renew moves an expiry the
    /// model does not keep).
    fn may_change_state(&self, i: &LeaseInput) -> bool {
        matches!(i.call, LeaseCall::Acquire | LeaseCall::Release { .. })
    }
}

fn acquire(s: LeaseState, run: RunId, out: Option<&LeaseOutput>) -> Option<LeaseState> {
    let holder = s.holder;
    match (out, holder) {
        // Unanswered: it took the key if it was free, under a fence nobody saw.
        (None, None) => Some(LeaseState {
            holder: Some(Holder { run, fence: None }),
            ..s
        }),
        (None, Some(_)) => Some(s),
        // L1: a new grant's fence is above every fence this key saw.
        (Some(&LeaseOutput::Granted { fence }), None) => {
            (fence > s.fence_max).then_some(LeaseState {
                holder: Some(Holder {
                    run,
                    fence: Some(fence),
                }),
                fence_max: fence,
            })
        }
        // L7: the holder asking again re-attaches to its own lease.
        (Some(&LeaseOutput::Granted { fence }), Some(h)) if h.run == run => s.held_by(run, fence),
        // A4: refused only while another run holds the key (the one named, if named).
        (Some(&LeaseOutput::Busy { holder: named }), Some(h)) => {
            (h.run != run && named.is_none_or(|n| n == h.run)).then_some(s)
        }
        _ => None,
    }
}

fn renew(s: LeaseState, run: RunId, fence: Fence, out: Option<&LeaseOutput>) -> Option<LeaseState> {
    match out {
        None => Some(s),
        // L2, L4: only the holder's own fence renews.
        Some(LeaseOutput::Done) => s.held_by(run, fence),
        Some(LeaseOutput::Refused) => s.maybe_not_held_by(run, fence).then_some(s),
        Some(_) => None,
    }
}

fn release(
    s: LeaseState,
    run: RunId,
    fence: Fence,
    out: Option<&LeaseOutput>,
) -> Option<LeaseState> {
    match out {
        // Unanswered: it freed the key if it was the holder's (a client only sends a
        // fence it was told, so an unknown holder fence is taken to be this one).
        None => Some(s.held_by(run, fence).map_or(s, LeaseState::freed)),
        // L5: the holder's release frees the key.
        Some(LeaseOutput::Done) => s.held_by(run, fence).map(LeaseState::freed),
        Some(LeaseOutput::Refused) => s.maybe_not_held_by(run, fence).then_some(s),
        Some(_) => None,
    }
}

fn check(s: LeaseState, run: RunId, fence: Fence, out: Option<&LeaseOutput>) -> Option<LeaseState> {
    match out {
        None => Some(s),
        // L8: current only for the live lease's own fence.
        Some(LeaseOutput::Current(true)) => s.held_by(run, fence),
        Some(LeaseOutput::Current(false)) => s.maybe_not_held_by(run, fence).then_some(s),
        Some(_) => None,
    }
}

fn query(s: LeaseState, run: RunId, out: Option<&LeaseOutput>) -> Option<LeaseState> {
    match out {
        None => Some(s),
        Some(&LeaseOutput::Holds { fence }) => s.held_by(run, fence),
        Some(LeaseOutput::NotHolding) => s.holder.is_none_or(|h| h.run != run).then_some(s),
        Some(_) => None,
    }
}

#[cfg(test)]
mod tests;
