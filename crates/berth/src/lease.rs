//! The lease as `berth run` keeps it. Every decision is taken from the lease's own
//! expiry as the daemon last confirmed it, never from when some other step of
//! `berth run` happened to start (issue 33 item 2): the first renew is due a third of
//! the ttl after the grant even while CMD's registration is still being retried
//! across a daemon restart.
//!
//! [`Lease`] is the pure part (instants in, decisions out, as `berth-proc`'s stop
//! plan); [`keep`] is the task that carries its decisions out.
//!
//! The arithmetic, with `ttl` the lease's own (`ttl_ms` in the grant) and `until` the
//! latest instant the daemon has confirmed the lease to:
//! - `until` starts at the grant's `expires_at` (read against this host's clock, and
//!   never more than one ttl ahead), and after each renew the daemon answered is
//!   moved to *when that renew was sent* + ttl: the daemon extends from when it
//!   received it, which is later, so `until` is never later than the daemon's expiry.
//! - a renew is due when a third of the ttl has passed since `until - ttl`, i.e.
//!   while two thirds are left; one that fails is tried again every
//!   [`RENEW_RETRY`].
//! - every request gets a total deadline that ends by `stop_at = until - grace`,
//!   and at most [`REQUEST_TIMEOUT_MAX`];
//! - at `stop_at` without a confirmation, the lease is lost: `berth run` stops CMD
//!   (TERM, then KILL at `until`, when the daemon may give the claim to another run)
//!   and exits 75 with the reason.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use berth_client::wire::{RenewRequest, Run};

use crate::client::{error_text, Client, Reply};

/// The grace between `berth run`'s own TERM and KILL of CMD when it cannot confirm
/// its lease: at most this, and at most a quarter of the ttl (a short lease must keep
/// most of its life for renewing).
pub const STOP_GRACE_MAX: Duration = Duration::from_secs(10);

/// No request of `berth run` waits longer than this for an answer, however much
/// lease is left: a frozen daemon (SIGSTOP) accepts connections and never answers.
pub const REQUEST_TIMEOUT_MAX: Duration = Duration::from_secs(10);

/// After a failed renew (a daemon restarting), the next try comes this soon.
pub const RENEW_RETRY: Duration = Duration::from_millis(250);

/// The ttl assumed for a grant that says neither its ttl nor its expiry (the
/// daemon's default ttl).
const TTL_UNKNOWN_MS: u64 = 300_000;

/// A lease as `berth run` knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lease {
    pub ttl: Duration,
    /// The latest instant the daemon has confirmed the lease to (never later than
    /// its own expiry).
    pub until: Instant,
}

/// What the keeper does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Nothing is due for this long.
    Sleep(Duration),
    /// Renew now, waiting at most this long for the answer.
    Renew(Duration),
    /// Too late to confirm: stop CMD now.
    GiveUp,
}

impl Lease {
    /// The lease a grant gave, received at `now` (`wall_now_ms`: this host's clock
    /// then, to read the grant's `expires_at`). Without a readable expiry, one ttl
    /// from now (the daemon's expiry is at least that).
    pub fn from_grant(run: &Run, now: Instant, wall_now_ms: i64) -> Lease {
        let left_ms = run
            .expires_at
            .as_deref()
            .and_then(crate::show::parse_utc_ms)
            .map(|e| e.saturating_sub(wall_now_ms).max(0) as u64);
        // A daemon that does not say its ttl: what is left of this lease stands for it.
        let ttl_ms = run.ttl_ms.or(left_ms).unwrap_or(TTL_UNKNOWN_MS);
        let ttl = Duration::from_millis(ttl_ms.max(1_000));
        let left = left_ms.map_or(ttl, |ms| Duration::from_millis(ms).min(ttl));
        Lease {
            ttl,
            until: now + left,
        }
    }

    /// The grace between berth run's own TERM and KILL.
    pub fn grace(&self) -> Duration {
        (self.ttl / 4).min(STOP_GRACE_MAX)
    }

    /// From here on without a confirmation, the lease counts as lost.
    pub fn stop_at(&self) -> Instant {
        self.until.checked_sub(self.grace()).unwrap_or(self.until)
    }

    /// When the next renew is due: a third of the ttl after the last confirmation.
    pub fn renew_at(&self) -> Instant {
        let two_thirds = self.ttl * 2 / 3;
        self.until.checked_sub(two_thirds).unwrap_or(self.until)
    }

    /// How long a request sent at `now` may wait for its answer; `None` when the
    /// lease can no longer be confirmed in time.
    pub fn budget(&self, now: Instant) -> Option<Duration> {
        let left = self.stop_at().checked_duration_since(now)?;
        (!left.is_zero()).then_some(left.min(REQUEST_TIMEOUT_MAX))
    }

    /// The daemon answered a renew sent at `sent_at`.
    pub fn confirmed(&mut self, sent_at: Instant) {
        self.until = self.until.max(sent_at + self.ttl);
    }

    /// The next step at `now`. `retry_at`: after a failed renew, when to try again;
    /// `nudged`: renew now (back from a suspension that may have outlasted it).
    pub fn next(&self, now: Instant, retry_at: Option<Instant>, nudged: bool) -> Step {
        let Some(budget) = self.budget(now) else {
            return Step::GiveUp;
        };
        let due = match retry_at {
            _ if nudged => now,
            Some(t) => t,
            None => self.renew_at(),
        };
        if due <= now {
            Step::Renew(budget)
        } else {
            Step::Sleep((due.min(self.stop_at()) - now).max(Duration::from_millis(1)))
        }
    }
}

/// The lease shared by the keeper, the registration and the end of `berth run`.
pub type Shared = Arc<Mutex<Lease>>;

/// What the keeper reports: the lease is lost, and why.
pub type Lost = tokio::sync::mpsc::Sender<String>;

/// Why berth itself ended `run_id`, if it did and says so (`failure`: a host that
/// fenced itself, F2; an analysis run that listened, C6). A renew refused while berth
/// was still stopping the run says only that it is `releasing`, and `berth run`'s last
/// line then lacked the reason (`issue_33_berth_run_on_a_host_that_fences_itself_exits_75_with_the_reason`
/// failed so on a slow machine).
async fn ended_by_berth(client: &Client, run_id: &str, budget: Duration) -> Option<String> {
    let path = format!("/v1/runs/{run_id}");
    let reply = client
        .call_async::<()>("GET", &path, None, budget)
        .await
        .ok()?;
    (reply.status == 200).then(|| reply.parse::<Run>().ok()?.failure)?
}

/// Why a renew answered `refused` (409: another fence; 410: the run is over) lost the
/// lease: berth's own reason when it ended the run itself, else the refusal's words.
async fn lost_why(client: &Client, run_id: &str, budget: Duration, refused: &Reply) -> String {
    let ended = match refused.status {
        410 => ended_by_berth(client, run_id, budget).await,
        _ => None,
    };
    ended.unwrap_or_else(|| error_text(&refused.body))
}

/// Keeps the lease of `run_id` (fence `fence`) until aborted: renews as [`Lease::next`]
/// says, and sends why on `lost` when the daemon says the lease is gone (409/410) or
/// it could not be confirmed before `stop_at`. `on_renew` is told each new expiry.
pub async fn keep(
    client: Arc<Client>,
    run_id: String,
    fence: u64,
    lease: Shared,
    lost: Lost,
    renew_now: Arc<tokio::sync::Notify>,
    on_renew: impl Fn(&Run) + Send + 'static,
) {
    let mut retry_at = None;
    let mut nudged = false;
    let mut last_error: Option<String> = None;
    loop {
        let now = Instant::now();
        let step = lease.lock().expect("lease").next(now, retry_at, nudged);
        let budget = match step {
            Step::Sleep(d) => {
                tokio::select! {
                    _ = tokio::time::sleep(d) => {}
                    _ = renew_now.notified() => nudged = true,
                }
                continue;
            }
            Step::GiveUp => {
                let why = match &last_error {
                    Some(e) => format!("berth could not confirm it before it ran out: {e}"),
                    // Nothing failed: berth run itself was not running (suspended with
                    // CMD, or starved) when the renew was due.
                    None => "it ran out before berth run could renew it: berth run was suspended or starved past its expiry".into(),
                };
                let _ = lost.send(why).await;
                return;
            }
            Step::Renew(budget) => budget,
        };
        nudged = false;
        let body = RenewRequest {
            fence: Some(fence),
            ttl_s: None,
        };
        let path = format!("/v1/runs/{run_id}/renew");
        let r = client.call_async("POST", &path, Some(&body), budget).await;
        match r {
            Ok(reply) if reply.status == 200 => {
                retry_at = None;
                lease.lock().expect("lease").confirmed(now);
                if let Ok(run) = reply.parse::<Run>() {
                    on_renew(&run);
                }
            }
            Ok(reply) if reply.status == 410 || reply.status == 409 => {
                let _ = lost
                    .send(lost_why(&client, &run_id, budget, &reply).await)
                    .await;
                return;
            }
            // Unreachable, frozen or busy (a restart): keep trying until `stop_at`.
            other => {
                last_error = Some(match other {
                    Ok(reply) => format!("{} ({})", error_text(&reply.body), reply.status),
                    Err(e) => format!("cannot reach berth at {}: {e}", client.url),
                });
                retry_at = Some(Instant::now() + RENEW_RETRY);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(ttl_s: u64, now: Instant) -> Lease {
        Lease {
            ttl: Duration::from_secs(ttl_s),
            until: now + Duration::from_secs(ttl_s),
        }
    }

    #[test]
    fn the_first_renew_is_due_a_third_of_the_ttl_after_the_grant_whatever_else_happens() {
        let t0 = Instant::now();
        let l = lease(6, t0);
        assert_eq!(l.next(t0, None, false), Step::Sleep(Duration::from_secs(2)));
        let at = t0 + Duration::from_secs(2);
        assert_eq!(
            l.next(at, None, false),
            Step::Renew(Duration::from_millis(2_500))
        );
        // A nudge renews at once.
        assert_eq!(
            l.next(t0, None, true),
            Step::Renew(Duration::from_millis(4_500))
        );
    }

    #[test]
    fn a_failed_renew_is_retried_soon_and_the_lease_is_given_up_at_expiry_minus_grace() {
        let t0 = Instant::now();
        let l = lease(6, t0);
        let at = t0 + Duration::from_secs(3);
        assert_eq!(
            l.next(at, Some(at + RENEW_RETRY), false),
            Step::Sleep(RENEW_RETRY)
        );
        // Every request ends by stop_at: 6 s - 1.5 s grace.
        assert_eq!(
            l.next(t0 + Duration::from_secs(4), Some(t0), false),
            Step::Renew(Duration::from_millis(500))
        );
        assert_eq!(
            l.next(t0 + Duration::from_millis(4_500), Some(t0), false),
            Step::GiveUp
        );
    }

    #[test]
    fn a_confirmation_counts_from_when_the_renew_was_sent_never_backwards() {
        let t0 = Instant::now();
        let mut l = lease(60, t0);
        l.confirmed(t0 + Duration::from_secs(20));
        assert_eq!(l.until, t0 + Duration::from_secs(80));
        // A late answer to an older renew does not shorten it.
        l.confirmed(t0 + Duration::from_secs(5));
        assert_eq!(l.until, t0 + Duration::from_secs(80));
        // Long leases: a request waits at most REQUEST_TIMEOUT_MAX, the grace is
        // at most STOP_GRACE_MAX.
        assert_eq!(l.budget(t0), Some(REQUEST_TIMEOUT_MAX));
        assert_eq!(l.grace(), STOP_GRACE_MAX);
    }

    #[test]
    fn a_grant_read_late_keeps_only_what_is_left_of_it() {
        let t0 = Instant::now();
        let run = |expires_at: &str| -> Run {
            serde_json::from_value(serde_json::json!({
                "claim": {"keys": [], "resources": {}}, "class": "managed",
                "deadline": null, "env": {}, "expires_at": expires_at, "ttl_ms": 6000,
                "fence": 1, "labels": {}, "ports": {}, "position": null,
                "priority": "foreground", "project": "p", "reason": null, "run_id": "r",
                "since": null, "state": "granted", "survivors": [], "workspace": null,
                "worktree": null
            }))
            .unwrap()
        };
        let now_ms = crate::show::parse_utc_ms("2026-12-01T00:00:10.000Z").unwrap();
        // 4 s of 6 left: the first renew is due at once (less than two thirds left).
        let l = Lease::from_grant(&run("2026-12-01T00:00:14.000Z"), t0, now_ms);
        assert_eq!(l.until, t0 + Duration::from_secs(4));
        assert!(matches!(l.next(t0, None, false), Step::Renew(_)));
        // A clock behind the daemon's: never more than one ttl.
        let l = Lease::from_grant(&run("2026-12-01T00:01:00.000Z"), t0, now_ms);
        assert_eq!(l.until, t0 + Duration::from_secs(6));
        // An expiry already past: lost at once.
        let l = Lease::from_grant(&run("2026-12-01T00:00:09.000Z"), t0, now_ms);
        assert_eq!(l.next(t0, None, false), Step::GiveUp);
    }
}
