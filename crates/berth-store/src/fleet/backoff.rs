//! Reconnect pacing for the fleet store's connections (issue 38 Build 5). A host whose
//! database is down used to try a new connection at every call: each claim batch, each
//! heartbeat, each API question, each with a connect timeout of its own. After a failed
//! attempt the next now waits `BACKOFF_MS_MIN`, doubling to `BACKOFF_MS_MAX`; calls
//! meanwhile are refused at once (the store is unavailable, as it was), and a
//! connection that succeeds resets it. A pure rule: the time comes in.

use std::time::{Duration, Instant};

use super::FleetError;

/// The wait after the first failed attempt.
pub const BACKOFF_MS_MIN: u64 = 50;
/// The longest wait between attempts: a database back from a restart is found within
/// this (the restart test's 503s last about as long as the restart plus this).
pub const BACKOFF_MS_MAX: u64 = 1_000;

#[derive(Debug, Default)]
pub(crate) struct Backoff {
    /// The wait before the next attempt (0: none failed since the last success).
    wait_ms: u64,
    /// No attempt before this.
    next: Option<Instant>,
    /// Why the last attempt failed.
    last: String,
}

impl Backoff {
    /// Whether an attempt may be made at `now`; if not, the refusal says for how long
    /// and why.
    pub(crate) fn check(&self, now: Instant) -> Result<(), FleetError> {
        match self.next {
            Some(next) if now < next => Err(FleetError::Unavailable(format!(
                "not reconnecting for {} ms more, after: {}",
                (next - now).as_millis(),
                self.last
            ))),
            _ => Ok(()),
        }
    }

    /// An attempt at `now` failed with `why`.
    pub(crate) fn failed(&mut self, now: Instant, why: &str) {
        self.wait_ms = (self.wait_ms * 2).clamp(BACKOFF_MS_MIN, BACKOFF_MS_MAX);
        self.next = Some(now + Duration::from_millis(self.wait_ms));
        self.last = why.to_string();
    }

    /// An attempt succeeded.
    pub(crate) fn ok(&mut self) {
        *self = Backoff::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_attempts_wait_longer_up_to_the_cap_and_a_success_resets() {
        let t0 = Instant::now();
        let mut b = Backoff::default();
        assert!(b.check(t0).is_ok(), "no failure yet");
        let mut waits = Vec::new();
        let mut t = t0;
        for _ in 0..8 {
            b.failed(t, "connection refused");
            let refused = b.check(t).unwrap_err().to_string();
            assert!(refused.contains("connection refused"), "{refused}");
            waits.push(b.wait_ms);
            assert!(b.check(t + Duration::from_millis(b.wait_ms - 1)).is_err());
            t += Duration::from_millis(b.wait_ms);
            assert!(b.check(t).is_ok(), "after its wait an attempt may be made");
        }
        assert_eq!(waits, [50, 100, 200, 400, 800, 1000, 1000, 1000]);
        b.ok();
        assert!(b.check(t).is_ok());
        b.failed(t, "again");
        assert_eq!(b.wait_ms, BACKOFF_MS_MIN, "a success starts over");
    }

    /// The store as a host uses it: a database that refuses connections is tried once,
    /// then calls are refused at once until the wait is over (before, each call made a
    /// new attempt).
    #[test]
    fn a_refused_database_is_not_tried_again_at_every_call() {
        use crate::fleet::FleetStore;
        let url = "postgres://berth@127.0.0.1:1/none?sslmode=disable&connect_timeout=1";
        let mut s = crate::fleet::PgFleet::lazy(url).unwrap();
        let first = s.hosts().unwrap_err().to_string();
        assert!(!first.contains("not reconnecting"), "{first}");
        let second = s.hosts().unwrap_err().to_string();
        assert!(second.contains("not reconnecting for"), "{second}");
        std::thread::sleep(Duration::from_millis(BACKOFF_MS_MIN + 20));
        let third = s.hosts().unwrap_err().to_string();
        assert!(
            !third.contains("not reconnecting"),
            "tried again after the wait: {third}"
        );
    }
}
