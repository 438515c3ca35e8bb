//! F1–F3 in the daemon: a waiter the engine could grant but for its fleet-wide claim
//! (`Event::PermitWanted`) has the claim taken by the fleet thread; the answer comes
//! back (`Msg::FleetClaimed`) and is handed to the engine (`Command::Permit`), or the
//! run waits for a wake-up on what refused it (LISTEN/NOTIFY, with a slow re-check as
//! the fallback for lost notifications). A run's ending ends its claim, after the
//! commit that ended it. A host that cannot heartbeat stops its runs that hold
//! fleet-wide tokens or keys before the lapse at which another host may take them.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use berth_core::{Command, RunState};
use berth_store::fleet::{Claim, ClaimOutcome, Ending, FleetError, TokenClaim};

use super::extra::Extra;
use super::{Daemon, Error, Host, Reply, RunInfo};
use crate::fleet::{ClaimResult, Handle, Job, Report};

/// New runs' acquires waiting for their fleet-wide claim at most; beyond it a new
/// `wait_s = 0` one is refused as if the store were away (each holds a caller's
/// connection), and one that may wait is queued first, as before issue 38 Build 2.
const PRECLAIMS_MAX: usize = 4_096;

/// A new run's acquire waiting for its fleet-wide claim before the engine tries it.
pub(super) struct Preclaim {
    req: berth_core::Request,
    extra: Extra,
    attach: bool,
    reply: Reply<RunInfo>,
    /// When it was sent (the daemon's ms): past `ANSWER_WAIT_MS` it is answered
    /// 503 and never granted (issue 38 items 4 and 5).
    since_ms: u64,
}

/// Heartbeats without an accepted one after which new fleet-wide claims are refused
/// (503) rather than queued behind a store that does not answer (issue 38 item 4).
const STALE_BEATS: u64 = 3;

/// Waiters re-sent per re-check at most, per channel (a deep fleet queue is re-checked
/// a bounded amount at a time; its wake-ups do the rest).
const RECHECK_PER_CHANNEL_MAX: usize = 8;
/// How often the host's load is written for its next heartbeat.
const LOAD_EVERY_MS: u64 = 500;
/// The channel of refusals that wait for no particular release (the store was away,
/// the host was between generations).
const RETRY: &str = "retry";
/// Channels whose wake-ups are counted at most; past it the counts start over (a lost
/// count costs a waiter the slow re-check, nothing more).
const WAKE_CHANNELS_MAX: usize = 4_096;

/// Why a waiter was cancelled when the fleet store refused its claim for good (a
/// lapsed token of its owner, a budget limit frozen at another value): only an
/// operator can change that.
pub(super) const REFUSED_FOR_GOOD: &str =
    "the fleet store refused its claim for good (an operator must reconcile or change it)";

/// Why berth ended a run whose fleet-wide claim is no longer this host's to use.
pub(super) const FENCED_ITSELF: &str = "its fleet-wide claim is no longer this host's to use (the host lost the fleet store and fenced itself, F2); berth stopped it";

fn token_channel(scope: &str, harness: &str) -> String {
    format!("token {scope}/{harness}")
}

fn key_channel(key: &str) -> String {
    format!("key {key}")
}

#[derive(Default)]
pub(super) struct FleetState {
    // (`Preclaim` holds a reply channel: no Debug, no Clone.)
    pub(super) link: Option<Handle>,
    /// Claims asked for and not answered yet, with the wake-up counts of the channels
    /// that could refuse them, as they were when the claim was sent.
    asking: BTreeMap<String, Vec<(String, u64)>>,
    /// Wake-ups received per channel. A refusal whose channel woke after its claim was
    /// sent is retried at once: the wake-up may have overtaken the refusal, and parking
    /// the run would wait for one that already came (the slow re-check would find it).
    wakes: BTreeMap<String, u64>,
    /// Runs whose fleet-wide claim is held: (generation, holds a token or key).
    held: BTreeMap<String, (i64, bool)>,
    /// Runs whose claim's answer was lost (the connection broke after the statement was
    /// sent): the store may hold it, by this generation. Asked again, it is answered
    /// again (a claim retried by its generation gets its fence back); a run that ends
    /// first has it ended, which is harmless if it was never written.
    unsure: BTreeMap<String, i64>,
    /// Refused claims waiting for a wake-up, by what refused them: `token SCOPE/HARNESS`,
    /// `key NAME` (the payloads the store notifies), or `retry`.
    waiting: BTreeMap<String, VecDeque<String>>,
    /// Runs stopped by the host's own fence (F2): their claims end as lapsed.
    fenced: BTreeSet<String>,
    /// What a waiter's last refused claim said (the key and its holder), shown as its
    /// reason while it waits for its claim; one per waiting run, gone with its wait.
    pub(super) why: BTreeMap<String, String>,
    /// Endings to hand to the fleet thread after the commit that ended the run.
    pending: Vec<Job>,
    /// New runs' acquires whose claim was sent, by run id.
    preclaims: BTreeMap<String, Preclaim>,
    next_recheck_ms: u64,
    next_load_ms: u64,
    /// Stop runs holding fleet-wide tokens or keys once no heartbeat was accepted for
    /// this long (below the lapse at which other hosts may declare this one dead).
    pub(super) self_fence_ms: u64,
    pub(super) recheck_ms: u64,
    /// How this host stands with the store, as the fleet threads last told it
    /// (`Report::Status`): inputs like any message, never read from shared state.
    available: bool,
    gen: i64,
    beat_ok_ms: u64,
    /// This host's id in the fleet (fixed at start).
    pub(super) host_id: String,
    /// The heartbeat period (0: not known, no staleness is judged).
    pub(super) beat_ms: u64,
    /// The version of the fleet's tokens and drain mirrored here (issue 38 Build 3).
    pub(super) shared_version: i64,
    /// Evidence to tell the store once the step is durable; none while a step takes
    /// the fleet's own (`mirroring`: it is not told back).
    pub(super) shared_jobs: Vec<crate::fleet::SharedJob>,
    pub(super) mirroring: bool,
}

impl FleetState {
    /// New fleet-wide claims are refused while the store is away (`503`): it failed,
    /// the host is not registered, or no heartbeat was accepted for `STALE_BEATS`
    /// heartbeats (a frozen link fails nothing; it only never answers).
    /// The host's own fence (F2) stopped this run: its stop is under way.
    #[cfg(test)]
    pub(super) fn fenced(&self, run_id: &str) -> bool {
        self.fenced.contains(run_id)
    }

    pub(super) fn unavailable(&self, now: u64) -> bool {
        let stale = self.beat_ms > 0
            && now.saturating_sub(self.beat_ok_ms) > STALE_BEATS.saturating_mul(self.beat_ms);
        self.link.is_some() && (!self.available || self.gen == 0 || stale)
    }

    /// The endings decided by the step being committed (sent once it is durable), and
    /// the evidence it shares.
    pub(super) fn take_pending(&mut self) -> (Vec<Job>, Vec<crate::fleet::SharedJob>) {
        let shared = std::mem::take(&mut self.shared_jobs);
        (std::mem::take(&mut self.pending), shared)
    }

    /// A claim's answer lost (the store may hold it, `unsure`) or come.
    fn note_answer(&mut self, run_id: &str, gen: i64, result: &ClaimResult) {
        match result {
            Err(FleetError::Unavailable(_)) => self.unsure.insert(run_id.into(), gen),
            _ => self.unsure.remove(run_id),
        };
        // Refused for a fleet drain this host has not read yet: it is read now.
        if let Ok(ClaimOutcome::Draining) = result {
            self.read_drain_now();
        }
    }

    /// The store refused a claim for a fleet drain: the fleet's drain is read now
    /// rather than at the next beat.
    fn read_drain_now(&self) {
        if let Some(link) = &self.link {
            link.nudge();
        }
    }

    fn park(&mut self, channel: String, run_id: String) {
        self.waiting.entry(channel).or_default().push_back(run_id);
    }
}

impl<H: Host> Daemon<H> {
    /// A report of the fleet threads.
    pub(super) fn on_fleet(&mut self, report: Report) {
        match report {
            Report::Claimed(answers) => {
                for a in answers {
                    self.on_fleet_claimed(a.run_id, a.gen, a.result);
                }
            }
            Report::Wake { payloads } => self.on_fleet_wake(payloads),
            Report::Generation {
                gen,
                resumed,
                claims,
            } => self.on_fleet_generation(gen, resumed, claims),
            Report::Shared(sh) => self.on_fleet_shared(sh),
            Report::Declared { host_id, gen } => {
                tracing::debug!(host_id, gen, "fleet: declared dead by this host");
            }
            Report::Status {
                available,
                gen,
                beat_ok_ms,
            } => {
                // Its generation lost (declared dead while it could not beat: a
                // pause, a partition): the claims it held are gone, its keys another
                // host's to take. Its runs that hold them stop now, not at the next
                // registration (found by the daemon simulator's pause, issue 38
                // Build 6: the self-fence looks only at a live generation, and a run
                // here held a key the peer had taken).
                let lost = self.fleet.gen > 0 && gen == 0;
                self.fleet.available = available;
                self.fleet.gen = gen;
                self.fleet.beat_ok_ms = beat_ok_ms;
                if lost {
                    let mut touched = BTreeSet::new();
                    self.fence_wide_runs(&mut touched);
                    if !touched.is_empty() || !self.fleet.pending.is_empty() {
                        self.commit(touched, |_| {});
                    }
                }
            }
        }
    }

    /// `Event::PermitWanted`: take the run's claim from the fleet store.
    pub(super) fn on_permit_wanted(&mut self, run_id: &str) {
        self.send_claim(run_id);
    }

    /// `Event::PermitReturned`: the waiter is held back for the head, so its claim
    /// goes back to the fleet (issue 38 item 6); it is asked for again when the waiter
    /// may be granted. Its keys' waiters are woken by the store's notification.
    /// A new fence for it still on its way (a stale permit's) is not raced with the
    /// ending: its answer hands the engine a permit again, given back at the next pass.
    pub(super) fn on_permit_returned(&mut self, run_id: &str) {
        if self.fleet.asking.contains_key(run_id) {
            return;
        }
        tracing::debug!(run_id, "fleet: a held-back waiter's claim goes back");
        self.end_claim(run_id, Ending::Released);
    }

    fn send_claim(&mut self, run_id: &str) {
        let Some(link) = self.fleet.link.clone() else {
            return;
        };
        let Some(needs) = self.engine.fleet_needs(run_id) else {
            return;
        };
        if needs.state != RunState::Queued || self.fleet.asking.contains_key(run_id) {
            return;
        }
        let gen = self.fleet.gen;
        if gen == 0 {
            self.fleet.park(RETRY.into(), run_id.into());
            return;
        }
        // Its claim is held, its permit went stale (L1's order): a new fence only.
        if let Some(&(held_gen, _)) = self.fleet.held.get(run_id) {
            self.fleet.asking.insert(run_id.into(), Vec::new());
            link.send(Job::Refence {
                run_id: run_id.into(),
                gen: held_gen,
            });
            return;
        }
        let channels = needs
            .token
            .iter()
            .map(|(s, h, _)| token_channel(s, h))
            .chain(needs.keys.iter().map(|k| key_channel(k)))
            .map(|c| {
                let n = self.fleet.wakes.get(&c).copied().unwrap_or(0);
                (c, n)
            })
            .collect();
        self.fleet.asking.insert(run_id.into(), channels);
        link.send(Job::Claim(Claim {
            run_id: run_id.into(),
            host_id: self.fleet.host_id.clone(),
            gen,
            token: needs.token.map(|(scope, harness, limit)| TokenClaim {
                scope,
                harness,
                limit,
            }),
            keys: needs.keys,
        }));
    }

    /// F1: a new run's acquire takes its fleet-wide claim before the engine tries it
    /// (issue 38 Build 2): a `wait_s = 0` one before its one try, and one that may wait
    /// so that it is granted as the claim is answered, without a queued record and its
    /// commit first (a wait of its own only if the claim is refused, or the run does not
    /// fit).
    pub(super) fn preclaim(
        &mut self,
        req: berth_core::Request,
        extra: Extra,
        attach: bool,
        reply: Reply<RunInfo>,
    ) {
        let Some(link) = self.fleet.link.clone() else {
            return self.answer(reply, Err(Error::FleetUnavailable));
        };
        let gen = self.fleet.gen;
        let run_id = req.run_id.clone();
        if let Some(p) = self.fleet.preclaims.get_mut(&run_id) {
            // The retry of a caller that went away while its claim was on its way (a
            // reconnect) takes its place; two live callers of one new run is a conflict.
            if p.reply.is_closed() {
                (p.reply, p.attach) = (reply, attach);
                return;
            }
            let e = berth_core::Error::Conflict { run_id };
            return self.answer(reply, Err(e.into()));
        }
        if gen == 0 || self.fleet.preclaims.len() >= PRECLAIMS_MAX {
            if req.wait_ms > 0 {
                return self.admit(Command::Acquire(req), run_id, true, extra, attach, reply);
            }
            return self.answer(reply, Err(Error::FleetUnavailable));
        }
        // The harness's limit: the request's policy, or the one its scope froze here.
        let token = req.budget.as_deref().and_then(|b| {
            let limit = b
                .per_harness
                .as_ref()
                .and_then(|p| p.get(&b.harness).copied())
                .or_else(|| {
                    self.engine
                        .scopes()
                        .get(&b.scope)?
                        .policy
                        .get(&b.harness)
                        .copied()
                })?;
            Some(TokenClaim {
                scope: b.scope.clone(),
                harness: b.harness.clone(),
                limit,
            })
        });
        let keys = req
            .singletons
            .iter()
            .filter_map(|s| s.strip_prefix(berth_core::FLEET_SINGLETON_PREFIX))
            .map(str::to_owned)
            .collect();
        link.send(Job::Claim(Claim {
            run_id: run_id.clone(),
            host_id: self.fleet.host_id.clone(),
            gen,
            token,
            keys,
        }));
        let p = Preclaim {
            req,
            extra,
            attach,
            reply,
            since_ms: self.now,
        };
        self.fleet.preclaims.insert(run_id, p);
    }

    /// The answer to a new run's claim: the engine's try, with the claim or without
    /// it (then a `wait_s = 0` run expires at once, as any run that cannot be granted
    /// on arrival, and one that may wait queues).
    fn preclaimed(&mut self, p: Preclaim, gen: i64, result: ClaimResult) {
        let id = p.req.run_id.clone();
        // Issue 38 item 5: its caller is gone (it gave up while the store stalled):
        // never granted with nobody attached; what the fleet gave it goes back.
        if p.reply.is_closed() {
            if let Ok(ClaimOutcome::Taken { .. }) = result {
                self.fleet.held.insert(id.clone(), (gen, false));
                self.end_claim(&id, Ending::Released);
                self.commit(BTreeSet::new(), |_| {});
            }
            return;
        }
        let cmd = match result {
            Ok(ClaimOutcome::Taken { fence }) => {
                let wide = p.req.budget.is_some()
                    || p.req
                        .singletons
                        .iter()
                        .any(|s| s.starts_with(berth_core::FLEET_SINGLETON_PREFIX));
                self.fleet.held.insert(id.clone(), (gen, wide));
                Command::AcquirePermitted { req: p.req, fence }
            }
            // Its answer lost, the claim may have been written: it goes back (issue 38,
            // found by the PostgreSQL restart test: the caller got 503 and asked under
            // another id, and the key stayed held for a run nobody had).
            Err(FleetError::Unavailable(_)) => {
                self.lost_claim_goes_back(&id, gen);
                self.commit(BTreeSet::new(), |_| {});
                return self.answer(p.reply, Err(Error::FleetUnavailable));
            }
            Ok(ClaimOutcome::HostDead) | Err(_) => {
                return self.answer(p.reply, Err(Error::FleetUnavailable));
            }
            // A fleet drain this host has not read yet: refused as a new run is while
            // it drains, and the drain is read now.
            Ok(ClaimOutcome::Draining) => {
                let e = self.fleet_draining();
                return self.answer(p.reply, Err(e));
            }
            // Refused (full, held, taken elsewhere): its one try fails with the reason,
            // or it waits as any run whose claim was refused, its reason naming the
            // key's holder.
            Ok(refused) => {
                if let ClaimOutcome::KeyHeld {
                    key,
                    run_id: holder,
                    host_id,
                } = refused
                {
                    let why = key_held(&key, &holder, &host_id);
                    self.fleet.why.insert(id.clone(), why);
                }
                Command::Acquire(p.req)
            }
        };
        self.admit(cmd, id.clone(), true, p.extra, p.attach, p.reply);
        // Refused by the engine: what the fleet gave it goes back.
        if self.engine.view_of(&id).is_none() && self.fleet.held.contains_key(&id) {
            self.end_claim(&id, Ending::Released);
            self.commit(BTreeSet::new(), |_| {});
        }
    }

    /// The fleet store's answer to a claim.
    fn on_fleet_claimed(&mut self, run_id: String, gen: i64, result: ClaimResult) {
        tracing::debug!(run_id, gen, ?result, "fleet: claim answered");
        if let Some(p) = self.fleet.preclaims.remove(&run_id) {
            return self.preclaimed(p, gen, result);
        }
        let sent = self.fleet.asking.remove(&run_id).unwrap_or_default();
        self.fleet.why.remove(&run_id);
        self.fleet.note_answer(&run_id, gen, &result);
        let queued =
            (self.engine.fleet_needs(&run_id)).is_some_and(|n| n.state == RunState::Queued);
        let mut touched = BTreeSet::new();
        match result {
            Ok(ClaimOutcome::Taken { fence }) if queued => {
                let fleet_wide = self
                    .engine
                    .fleet_needs(&run_id)
                    .is_some_and(|n| n.token.is_some() || !n.keys.is_empty());
                self.fleet.held.insert(run_id.clone(), (gen, fleet_wide));
                let cmd = Command::Permit {
                    run_id: run_id.clone(),
                    fence,
                };
                if self.apply(cmd, &mut touched).is_err() {
                    self.end_claim(&run_id, Ending::Released);
                }
            }
            // It stopped waiting meanwhile: what was taken for it goes back.
            Ok(ClaimOutcome::Taken { .. }) => {
                self.fleet.held.insert(run_id.clone(), (gen, false));
                self.end_claim(&run_id, Ending::Released);
            }
            // It ended meanwhile, its claim maybe written: that goes back too.
            Err(FleetError::Unavailable(_)) if !queued => {
                let live = (self.engine.view_of(&run_id)).is_some_and(|v| !v.state.is_terminal());
                if !live && !self.fleet.held.contains_key(&run_id) {
                    self.lost_claim_goes_back(&run_id, gen);
                }
            }
            _ if !queued => {}
            Ok(ClaimOutcome::BudgetFull { .. }) => {
                let ch = self.engine.fleet_needs(&run_id).and_then(|n| n.token);
                let ch = ch.map_or(RETRY.into(), |(s, h, _)| token_channel(&s, &h));
                self.park_or_retry(ch, run_id, &sent);
            }
            Ok(ClaimOutcome::KeyHeld {
                key,
                run_id: holder,
                host_id,
            }) => {
                // A8/A11: the waiter's reason names the key and who holds it, as a
                // single-host wait does (issue 33 item 8).
                self.fleet
                    .why
                    .insert(run_id.clone(), key_held(&key, &holder, &host_id));
                touched.insert(run_id.clone());
                self.park_or_retry(key_channel(&key), run_id, &sent)
            }
            // Refused for a fleet drain not read yet, the waiter waits too (once the
            // drain is read, the engine asks for no claim until it ends).
            Ok(ClaimOutcome::HostDead | ClaimOutcome::Draining)
            | Err(FleetError::Unavailable(_)) => self.fleet.park(RETRY.into(), run_id),
            refusal => self.refused_for_good(run_id, refusal, &mut touched),
        }
        if !touched.is_empty() || !self.fleet.pending.is_empty() {
            self.commit(touched, |_| {});
        }
    }

    /// The store refused a claim for a fleet drain: it is read now, and a new run is
    /// refused with it (with what this host knows of it, or that a fleet drain is in
    /// force, until the read comes).
    fn fleet_draining(&mut self) -> Error {
        self.fleet.read_drain_now();
        self.draining().unwrap_or_else(|| Error::Draining {
            drain: berth_store::DrainRecord {
                by: String::new(),
                at: String::new(),
                reason: "this host is reading the fleet drain".into(),
            },
            fleet_host: Some(String::new()),
        })
    }

    /// A claim whose answer was lost, of a run that does not wait for it (any more):
    /// the store may hold it, so it is ended (harmless if it was never written).
    fn lost_claim_goes_back(&mut self, run_id: &str, gen: i64) {
        self.fleet.unsure.remove(run_id);
        self.fleet.held.entry(run_id.into()).or_insert((gen, false));
        self.end_claim(run_id, Ending::Released);
    }

    /// Nothing but an operator can change these (a lapsed token of its owner, a limit
    /// frozen at another value): the run cannot be admitted, and its holder is told
    /// why (`berth run`'s last line, the run's status).
    fn refused_for_good(
        &mut self,
        run_id: String,
        refusal: ClaimResult,
        touched: &mut BTreeSet<String>,
    ) {
        tracing::warn!(
            run_id,
            ?refusal,
            "fleet: claim refused for good; the run is cancelled"
        );
        if let Some(e) = self.extras.get_mut(&run_id) {
            e.failure = Some(format!("{REFUSED_FOR_GOOD}: {refusal:?}"));
        }
        let _ = self.apply(Command::Cancel { run_id }, touched);
    }

    /// A refused claim waits on `channel`, unless that channel woke since the claim
    /// was sent: then it is sent again at once.
    fn park_or_retry(&mut self, channel: String, run_id: String, sent: &[(String, u64)]) {
        let then = sent
            .iter()
            .find(|(c, _)| *c == channel)
            .map_or(0, |(_, n)| *n);
        if self.fleet.wakes.get(&channel).copied().unwrap_or(0) > then {
            self.send_claim(&run_id);
        } else {
            self.fleet.park(channel, run_id);
        }
    }

    /// F3: something another host held came free.
    fn on_fleet_wake(&mut self, payloads: Vec<String>) {
        tracing::debug!(?payloads, "fleet: wake-up");
        for p in payloads {
            if self.fleet.wakes.len() >= WAKE_CHANNELS_MAX && !self.fleet.wakes.contains_key(&p) {
                self.fleet.wakes.clear();
            }
            *self.fleet.wakes.entry(p.clone()).or_insert(0) += 1;
            self.resend(&p, 1);
        }
    }

    /// Re-sends the claims of up to `n` waiters of `channel` that still wait.
    fn resend(&mut self, channel: &str, n: usize) {
        let mut sent = 0;
        while sent < n {
            let Some(run_id) = self
                .fleet
                .waiting
                .get_mut(channel)
                .and_then(|q| q.pop_front())
            else {
                break;
            };
            let queued = self
                .engine
                .fleet_needs(&run_id)
                .is_some_and(|x| x.state == RunState::Queued);
            if queued {
                self.send_claim(&run_id);
                sent += 1;
            }
        }
        if self
            .fleet
            .waiting
            .get(channel)
            .is_some_and(|q| q.is_empty())
        {
            self.fleet.waiting.remove(channel);
        }
    }

    /// A run ended: its fleet-wide claim ends with it (after this step's commit).
    pub(super) fn on_fleet_ended(&mut self, run_id: &str, state: RunState) {
        self.fleet.why.remove(run_id);
        if let Some(gen) = self.fleet.unsure.remove(run_id) {
            self.fleet.held.entry(run_id.into()).or_insert((gen, false));
        }
        if !self.fleet.held.contains_key(run_id) {
            return;
        }
        // A run the host's own fence stopped ends as it ended here: released (berth
        // stopped it and its processes are gone before its claim ends). Ending it as
        // lapsed left its token lapsed in the fleet store while this host had freed
        // it, so the owner was refused fleet-wide for good and no host showed why
        // (found by the daemon simulator, issue 35).
        self.fleet.fenced.remove(run_id);
        let lapsed = state == RunState::Expired && self.engine.fence_of(run_id).is_some();
        let how = if lapsed {
            Ending::Lapsed
        } else {
            Ending::Released
        };
        self.end_claim(run_id, how);
    }

    fn end_claim(&mut self, run_id: &str, how: Ending) {
        if let Some((gen, _)) = self.fleet.held.remove(run_id) {
            self.fleet.pending.push(Job::End {
                run_id: run_id.into(),
                gen,
                how,
            });
        }
    }

    /// F2: registered (again). If the last generation was declared dead, nothing it
    /// held comes back: its runs are ended here (their fences are refused fleet-wide
    /// already), and waiters ask again under the new generation.
    fn on_fleet_generation(&mut self, gen: i64, resumed: bool, claims: Vec<String>) {
        let mut touched = BTreeSet::new();
        if resumed {
            self.reconcile_claims(gen, claims);
        }
        // Every run that holds (or held, before a restart) a fence, and every waiter
        // holding a permit: all were claimed under an earlier generation of this host.
        let mut claimed: BTreeSet<String> = self.fleet.held.keys().cloned().collect();
        claimed.extend(
            self.extras
                .keys()
                .filter(|id| {
                    self.engine
                        .view_of(id)
                        .is_some_and(|v| !v.state.is_terminal() && v.fence.is_some())
                })
                .cloned(),
        );
        for run_id in claimed {
            if resumed {
                // Its claim moved to the new generation with the host's.
                let wide = self
                    .engine
                    .fleet_needs(&run_id)
                    .is_some_and(|n| n.token.is_some() || !n.keys.is_empty());
                self.fleet.held.insert(run_id, (gen, wide));
            } else {
                // Declared dead meanwhile: its claim is gone and its fence refused
                // fleet-wide; it must not go on here, nor be granted on a dead permit.
                self.fleet.held.remove(&run_id);
                self.stop_for_fleet(&run_id, &mut touched);
            }
        }
        let retry = self.fleet.waiting.remove(RETRY).unwrap_or_default();
        for run_id in retry {
            self.send_claim(&run_id);
        }
        if !touched.is_empty() || !self.fleet.pending.is_empty() {
            self.commit(touched, |_| {});
        }
    }

    /// F1 after a registration that kept the host's claims: each claim the store
    /// holds for it belongs to a run that still lives here (it is held from now on,
    /// also a waiter's whose permit the ledger does not keep) or to one that ended
    /// while its ending could not reach the store: a restart or a crash lost it, or
    /// it ended before the host registered again. Those end now, as they ended here
    /// (lapsed after an expiry, else released). (Issue 35: the daemon simulator found
    /// them leaked, the key or token held for good; issue 38 finding 2 is the crash.)
    fn reconcile_claims(&mut self, gen: i64, claims: Vec<String>) {
        for run_id in claims {
            let view = self.engine.view_of(&run_id);
            if view.as_ref().is_some_and(|v| !v.state.is_terminal()) {
                let needs = self.engine.fleet_needs(&run_id);
                let wide = needs.is_some_and(|n| n.token.is_some() || !n.keys.is_empty());
                self.fleet.held.entry(run_id).or_insert((gen, wide));
                continue;
            }
            let expired = view.is_some_and(|v| v.state == RunState::Expired && v.fence.is_some());
            let how = if expired {
                Ending::Lapsed
            } else {
                Ending::Released
            };
            tracing::info!(
                run_id,
                ?how,
                "fleet: a claim whose run ended here is ended now"
            );
            self.fleet.pending.push(Job::End { run_id, gen, how });
        }
    }

    /// Ends a run whose fleet-wide claim is not (or no longer) this host's to use.
    fn stop_for_fleet(&mut self, run_id: &str, touched: &mut BTreeSet<String>) {
        // berth itself ends it, and says why: its holder's `berth run` exits 75 with
        // this line, not with CMD's bare 143 (issue 33 item 9).
        if let Some(e) = self.extras.get_mut(run_id) {
            e.failure = Some(FENCED_ITSELF.into());
        }
        let cmd = match self.engine.fence_of(run_id) {
            Some(fence) => Command::Release {
                run_id: run_id.into(),
                fence,
            },
            None => Command::Cancel {
                run_id: run_id.into(),
            },
        };
        if self.apply(cmd, touched).is_ok() {
            tracing::warn!(
                run_id,
                "fleet: run stopped: its fleet-wide claim is no longer this host's to use"
            );
        }
    }

    /// F2: the runs holding fleet-wide tokens or keys stop (their claims are, or may
    /// soon be, another host's to take).
    fn fence_wide_runs(&mut self, touched: &mut BTreeSet<String>) {
        let fence: Vec<String> = (self.fleet.held.iter())
            .filter(|(r, (_, wide))| *wide && !self.fleet.fenced.contains(*r))
            .map(|(r, _)| r.clone())
            .collect();
        for run_id in fence {
            self.fleet.fenced.insert(run_id.clone());
            self.stop_for_fleet(&run_id, touched);
        }
    }

    /// At every tick: the host's own fence (F2), the fallback re-check (F3) and the
    /// load the next heartbeat writes (F4).
    pub(super) fn fleet_tick(&mut self, touched: &mut BTreeSet<String>) {
        let Some(link) = self.fleet.link.clone() else {
            return;
        };
        self.expire_preclaims();
        let beat_ok = self.fleet.beat_ok_ms;
        if self.fleet.gen > 0 && self.now.saturating_sub(beat_ok) > self.fleet.self_fence_ms {
            self.fence_wide_runs(touched);
        }
        if self.now >= self.fleet.next_recheck_ms {
            self.fleet.next_recheck_ms = self.now + self.fleet.recheck_ms;
            let channels: Vec<String> = self.fleet.waiting.keys().cloned().collect();
            for ch in channels {
                self.resend(&ch, RECHECK_PER_CHANNEL_MAX);
            }
        }
        if self.now >= self.fleet.next_load_ms {
            self.fleet.next_load_ms = self.now + LOAD_EVERY_MS;
            let load = self.load_json();
            *link.status.load.lock().unwrap_or_else(|e| e.into_inner()) = load;
        }
    }

    /// Issue 38 items 4 and 5: a new run's acquire whose claim the store has not
    /// answered within `ANSWER_WAIT_MS` is answered 503 and forgotten: its claim's
    /// answer, when it comes, finds no waiting run and gives back what was taken.
    fn expire_preclaims(&mut self) {
        let now = self.now;
        let late: Vec<String> = (self.fleet.preclaims.iter())
            .filter(|(_, p)| now.saturating_sub(p.since_ms) >= crate::fleet::ANSWER_WAIT_MS)
            .map(|(id, _)| id.clone())
            .collect();
        for id in late {
            if let Some(p) = self.fleet.preclaims.remove(&id) {
                tracing::warn!(
                    run_id = id,
                    "fleet: the store did not answer a new run's claim in time: 503"
                );
                self.answer(p.reply, Err(Error::FleetUnavailable));
            }
        }
    }

    /// F4: what `GET /v1/fleet` shows of this host (written with each heartbeat).
    fn load_json(&self) -> String {
        let s = self.engine.snapshot();
        let resources = s.resources.iter().map(|r| {
            let v = berth_client::wire::FleetResource {
                total: r.allocatable,
                committed: r.committed,
                available: r.available,
            };
            (r.name.clone(), v)
        });
        let load = berth_client::wire::FleetLoad {
            granted: s.granted as u64,
            queue_depth: (s.queued_foreground + s.queued_background) as u64,
            resources: resources.collect(),
        };
        serde_json::to_string(&load).unwrap_or_default()
    }
}

impl<H: Host> Daemon<H> {
    /// Fleet mode on: claims go to `link`'s thread. `self_fence_ms` and `recheck_ms`
    /// as in [`FleetState`].
    pub fn set_fleet(&mut self, link: Handle, self_fence_ms: u64, recheck_ms: u64, beat_ms: u64) {
        // Its capacity is known before its first heartbeat.
        *link.status.load.lock().unwrap_or_else(|e| e.into_inner()) = self.load_json();
        self.fleet.host_id = link.status.host_id();
        self.fleet.link = Some(link);
        self.fleet.self_fence_ms = self_fence_ms;
        self.fleet.recheck_ms = recheck_ms;
        self.fleet.beat_ms = beat_ms;
    }
}

/// Why a fleet waiter waits, as the run named the key (`--singleton fleet:KEY`).
fn key_held(key: &str, holder: &str, host_id: &str) -> String {
    let on = if host_id.is_empty() {
        String::new()
    } else {
        format!(" on host {host_id}")
    };
    format!("waiting for fleet:{key}, held by run {holder}{on}")
}
