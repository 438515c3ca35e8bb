//! The one retry policy: a pause that doubles after each failure, up to a ceiling.
//! Every loop that tries again (the event streams' reconnects, `berth run`'s acquire,
//! registration and release, the daemon's clean-up retries) waits by a [`Backoff`];
//! a loop that has a deadline bounds the pause by what is left of it.

use std::time::Duration;

/// How a retry waits: `first_ms` after the first failure, twice as long after each
/// next one, never more than `max_ms`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    pub first_ms: u64,
    pub max_ms: u64,
}

impl Backoff {
    pub const fn new(first_ms: u64, max_ms: u64) -> Backoff {
        Backoff { first_ms, max_ms }
    }

    /// The pause after `failures` failures in a row (1 for the first): `first_ms ×
    /// 2^(failures - 1)`, at most `max_ms`. No failure yet: no pause.
    pub fn delay_ms(&self, failures: u32) -> u64 {
        match failures {
            0 => 0,
            n => self
                .first_ms
                .saturating_mul(1u64 << (n - 1).min(32))
                .min(self.max_ms),
        }
    }
}

/// A retry loop's place under its [`Backoff`]: how many failures in a row.
#[derive(Clone, Copy, Debug)]
pub struct Retry {
    policy: Backoff,
    failures: u32,
}

impl Retry {
    pub const fn new(policy: Backoff) -> Retry {
        Retry {
            policy,
            failures: 0,
        }
    }

    /// One more failure: the pause before the next try.
    pub fn failed(&mut self) -> Duration {
        self.failures = self.failures.saturating_add(1);
        Duration::from_millis(self.policy.delay_ms(self.failures))
    }

    /// A success: the next failure waits `first_ms` again.
    pub fn succeeded(&mut self) {
        self.failures = 0;
    }

    pub fn failures(&self) -> u32 {
        self.failures
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pause_doubles_up_to_its_ceiling_and_a_success_starts_it_over() {
        let b = Backoff::new(250, 2_000);
        let pauses: Vec<u64> = (0..7).map(|n| b.delay_ms(n)).collect();
        assert_eq!(pauses, [0, 250, 500, 1_000, 2_000, 2_000, 2_000]);
        assert_eq!(Backoff::new(5_000, 300_000).delay_ms(u32::MAX), 300_000);
        assert_eq!(Backoff::new(u64::MAX, u64::MAX).delay_ms(40), u64::MAX);
        let mut r = Retry::new(b);
        assert_eq!(r.failed(), Duration::from_millis(250));
        assert_eq!(r.failed(), Duration::from_millis(500));
        r.succeeded();
        assert_eq!(r.failures(), 0);
        assert_eq!(r.failed(), Duration::from_millis(250));
    }
}
