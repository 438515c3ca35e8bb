//! The stop decision (P2), as a pure function of what is still alive and how long the
//! stop has been going: TERM to everything, wait out the grace, KILL what is left, wait
//! a bounded time for the kernel to reap, then either done or degraded.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopAction {
    /// Send SIGTERM to everything alive.
    Term,
    /// Nothing to do until the next check.
    Wait,
    /// Send SIGKILL to everything alive.
    Kill,
    /// Every process is proven gone.
    Done,
    /// Some processes survived SIGKILL past the bound: report them; the run degrades.
    Degraded,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StopPlan {
    pub grace_ms: u64,
    /// How long SIGKILLed processes may take to disappear before the run degrades.
    pub kill_wait_ms: u64,
    termed_at: Option<u64>,
    killed_at: Option<u64>,
}

impl StopPlan {
    pub fn new(grace_ms: u64, kill_wait_ms: u64) -> StopPlan {
        StopPlan {
            grace_ms,
            kill_wait_ms,
            termed_at: None,
            killed_at: None,
        }
    }

    /// What to do now, given the time (monotonic ms) and whether anything is alive.
    pub fn next(&mut self, now_ms: u64, anything_alive: bool) -> StopAction {
        if !anything_alive {
            return StopAction::Done;
        }
        match (self.termed_at, self.killed_at) {
            (None, _) => {
                self.termed_at = Some(now_ms);
                StopAction::Term
            }
            (Some(t), None) if now_ms.saturating_sub(t) >= self.grace_ms => {
                self.killed_at = Some(now_ms);
                StopAction::Kill
            }
            (Some(_), None) => StopAction::Wait,
            (Some(_), Some(k)) if now_ms.saturating_sub(k) >= self.kill_wait_ms => {
                StopAction::Degraded
            }
            (Some(_), Some(_)) => StopAction::Wait,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn term_then_grace_then_kill_then_done_or_degraded() {
        let mut p = StopPlan::new(10_000, 2_000);
        assert_eq!(p.next(0, true), StopAction::Term);
        assert_eq!(p.next(5_000, true), StopAction::Wait);
        assert_eq!(p.next(10_000, true), StopAction::Kill);
        assert_eq!(p.next(11_000, true), StopAction::Wait);
        assert_eq!(p.next(12_000, true), StopAction::Degraded);
        let mut q = StopPlan::new(10_000, 2_000);
        assert_eq!(q.next(0, true), StopAction::Term);
        assert_eq!(q.next(300, false), StopAction::Done);
        assert_eq!(StopPlan::new(1, 1).next(0, false), StopAction::Done);
    }
}
