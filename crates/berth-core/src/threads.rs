//! Agent threads and their registrations (G0–G3), as a pure state machine.
//!
//! A thread is a key that owns a persistent workspace across many short runs. An owner
//! (an orchestrator's generation `gen`, ordered by a positive `fence`) registers the
//! thread for one run with a deadline; while that registration is live (deadline plus
//! grace not passed) the thread's workspace is never evicted and the host is busy.
//! The highest owner accepted is remembered for good (G2), so a delayed claim from an
//! owner that has since been replaced never reopens the thread.
//!
//! Like the engine: time comes in as an argument, nothing here reads a clock or touches
//! a file. The daemon makes and removes the workspaces the decisions name.

use std::collections::BTreeMap;

use crate::units::TimeMs;

/// The longest run budget a registration may have (G1, G5): a day.
pub const RUN_BUDGET_MS_MAX: u64 = 24 * 3_600_000;
/// The largest fence a JSON client can say exactly (G5): 2^53 − 1.
pub const FENCE_SAFE_MAX: u64 = (1 << 53) - 1;
/// Threads remembered at most: each costs a ledger row kept for good (G2), so their
/// number is bounded; a new key past it is refused (`threads_full`).
pub const THREADS_MAX: usize = 100_000;
/// Evictions kept per thread for its audit trail (the journal keeps every one).
pub const EVICTIONS_KEPT_MAX: usize = 8;

/// Who owns a thread: a generation, ordered by its fence, for one run.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Owner {
    pub gen: String,
    pub fence: u64,
    pub run_id: String,
}

/// A registration (G1): its owner, when it attached and until when it protects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registration {
    pub owner: Owner,
    pub attached_ms: TimeMs,
    /// The run's budget ends here; the registration is live until `deadline_ms + grace`.
    pub deadline_ms: TimeMs,
}

/// Why a thread's workspace went.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum EvictReason {
    /// Its hard `thread_ttl` passed.
    Ttl,
    /// Nothing attached for `thread_idle_after` and no live registration.
    Idle,
    /// Its owner detached and asked for the workspace to go.
    Detach,
    /// An operator removed it.
    Operator,
    /// The workspaces' file system ran low (`disk_free_min`).
    DiskPressure,
}

impl EvictReason {
    pub fn as_str(self) -> &'static str {
        match self {
            EvictReason::Ttl => "ttl",
            EvictReason::Idle => "idle",
            EvictReason::Detach => "detach",
            EvictReason::Operator => "operator",
            EvictReason::DiskPressure => "disk_pressure",
        }
    }

    pub fn parse(s: &str) -> Option<EvictReason> {
        Some(match s {
            "ttl" => EvictReason::Ttl,
            "idle" => EvictReason::Idle,
            "detach" => EvictReason::Detach,
            "operator" => EvictReason::Operator,
            "disk_pressure" => EvictReason::DiskPressure,
            _ => return None,
        })
    }
}

/// One eviction in a thread's audit trail.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Eviction {
    pub reason: EvictReason,
    pub at_ms: TimeMs,
}

/// One thread, as remembered (durably, by the daemon's ledger).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Thread {
    pub key: String,
    /// The highest owner ever accepted (G2); kept after detach and eviction.
    pub owner: Option<Owner>,
    /// The current registration, live or lapsed.
    pub registration: Option<Registration>,
    /// Whether the thread's workspace exists now (false once evicted, until an attach
    /// or a run makes it again).
    pub has_workspace: bool,
    /// When its current workspace was made (its `thread_ttl` counts from here).
    pub created_ms: TimeMs,
    /// The last attach, detach or run that used it (its idle clock counts from here).
    pub active_ms: TimeMs,
    /// The newest evictions, oldest first, at most `EVICTIONS_KEPT_MAX`.
    pub evictions: Vec<Eviction>,
}

impl Thread {
    /// A thread seen for the first time: no owner, no registration, no workspace yet.
    pub fn new(key: &str, now: TimeMs) -> Thread {
        Thread {
            key: key.to_string(),
            owner: None,
            registration: None,
            has_workspace: false,
            created_ms: now,
            active_ms: now,
            evictions: Vec::new(),
        }
    }
}

/// How long things last (configuration, milliseconds).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ThreadConfig {
    /// A workspace with no attach and no live registration for this long is evicted.
    pub idle_after_ms: u64,
    /// A workspace is evicted this long after it was made, unless registered.
    pub ttl_ms: u64,
    /// A registration stays live this long past its deadline.
    pub grace_ms: u64,
    /// Below this many bytes free on the workspaces' file system, the sweep evicts the
    /// least recently used unprotected thread each round (reason `disk_pressure`).
    pub disk_free_min: u64,
}

impl Default for ThreadConfig {
    fn default() -> ThreadConfig {
        ThreadConfig {
            idle_after_ms: 30 * 60_000,
            ttl_ms: 7 * 24 * 3_600_000,
            grace_ms: 60_000,
            disk_free_min: 1 << 30,
        }
    }
}

/// Refusals; none changes anything.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ThreadError {
    /// G2/G3: another owner holds (or held) the thread; names the current one.
    Mismatch { key: String, current: Owner },
    /// G4: the host drains and this would be a new registration.
    Draining,
    /// No such thread (or it has no registration to change).
    NotFound { key: String },
    /// `THREADS_MAX` threads are remembered already.
    Full { max: usize },
    /// A field broke a rule (G5).
    Invalid { field: &'static str, rule: String },
    /// Operator eviction of a thread a live registration protects.
    Protected { key: String, until_ms: TimeMs },
}

impl ThreadError {
    pub fn code(&self) -> &'static str {
        match self {
            ThreadError::Mismatch { .. } => "registration_mismatch",
            ThreadError::Draining => "draining",
            ThreadError::NotFound { .. } => "not_found",
            ThreadError::Full { .. } => "threads_full",
            ThreadError::Invalid { .. } => "invalid",
            ThreadError::Protected { .. } => "thread_protected",
        }
    }
}

/// What an attach did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attached {
    /// A new registration (a new owner, or the owner's lapsed one renewed).
    Registered,
    /// The same owner again while its registration is live: nothing changed.
    Unchanged,
}

/// G5: a claim's fields, checked before anything else.
pub fn check_claim(owner: &Owner) -> Result<(), ThreadError> {
    let invalid = |field, rule: String| Err(ThreadError::Invalid { field, rule });
    if let Err(rule) = crate::validate::run_id(&owner.run_id) {
        return invalid("run_id", rule);
    }
    if let Err(rule) = crate::validate::run_id(&owner.gen) {
        return invalid("owner_gen", rule);
    }
    if owner.fence == 0 || owner.fence > FENCE_SAFE_MAX {
        return invalid(
            "owner_fence",
            format!("must be a positive safe integer, 1 to {FENCE_SAFE_MAX}"),
        );
    }
    Ok(())
}

/// G5: a run budget.
pub fn check_budget(budget_ms: u64) -> Result<(), ThreadError> {
    if budget_ms == 0 || budget_ms > RUN_BUDGET_MS_MAX {
        return Err(ThreadError::Invalid {
            field: "run_budget_ms",
            rule: format!("must be 1 to {RUN_BUDGET_MS_MAX} (a day)"),
        });
    }
    Ok(())
}

/// Every thread the host remembers.
#[derive(Clone, Debug, Default)]
pub struct Threads {
    pub cfg: ThreadConfig,
    threads: BTreeMap<String, Thread>,
}

impl Threads {
    pub fn new(cfg: ThreadConfig) -> Threads {
        Threads {
            cfg,
            threads: BTreeMap::new(),
        }
    }

    /// Back from the ledger.
    pub fn restore(&mut self, t: Thread) {
        self.threads.insert(t.key.clone(), t);
    }

    pub fn get(&self, key: &str) -> Option<&Thread> {
        self.threads.get(key)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Thread> {
        self.threads.values()
    }

    pub fn len(&self) -> usize {
        self.threads.len()
    }

    pub fn is_empty(&self) -> bool {
        self.threads.is_empty()
    }

    /// Whether a registration protects (G1): until its deadline plus grace.
    pub fn is_live(&self, r: &Registration, now: TimeMs) -> bool {
        now < r.deadline_ms.saturating_add(self.cfg.grace_ms)
    }

    /// The thread's live registration, if any.
    pub fn live(&self, key: &str, now: TimeMs) -> Option<&Registration> {
        self.threads
            .get(key)?
            .registration
            .as_ref()
            .filter(|r| self.is_live(r, now))
    }

    /// G2/G3: whether `claim` may act as the thread's owner. A lower fence, or the
    /// same fence with another generation or run, is refused, naming the owner.
    fn check_owner(t: &Thread, claim: &Owner) -> Result<(), ThreadError> {
        match &t.owner {
            Some(cur)
                if claim.fence < cur.fence
                    || (claim.fence == cur.fence
                        && (claim.gen != cur.gen || claim.run_id != cur.run_id)) =>
            {
                Err(ThreadError::Mismatch {
                    key: t.key.clone(),
                    current: cur.clone(),
                })
            }
            _ => Ok(()),
        }
    }

    /// G1: registers `claim` for `budget_ms`. The owner check comes before the drain
    /// gate (G2 before G4); while draining only the current owner's live registration
    /// may be re-attached. A new key makes a thread (its workspace is the daemon's to
    /// make: `has_workspace` says whether one is needed).
    pub fn attach(
        &mut self,
        now: TimeMs,
        key: &str,
        claim: Owner,
        budget_ms: u64,
        draining: bool,
    ) -> Result<Attached, ThreadError> {
        if let Err(rule) = crate::validate::run_id(key) {
            return Err(ThreadError::Invalid { field: "key", rule });
        }
        check_claim(&claim)?;
        check_budget(budget_ms)?;
        if let Some(t) = self.threads.get(key) {
            Self::check_owner(t, &claim)?;
            let same_live = t.owner.as_ref() == Some(&claim)
                && t.registration
                    .as_ref()
                    .is_some_and(|r| self.is_live(r, now));
            if same_live {
                return Ok(Attached::Unchanged);
            }
        } else if self.threads.len() >= THREADS_MAX {
            return Err(ThreadError::Full { max: THREADS_MAX });
        }
        if draining {
            return Err(ThreadError::Draining);
        }
        let t = self
            .threads
            .entry(key.to_string())
            .or_insert_with(|| Thread::new(key, now));
        t.owner = Some(claim.clone());
        t.registration = Some(Registration {
            owner: claim,
            attached_ms: now,
            deadline_ms: now.saturating_add(budget_ms),
        });
        t.active_ms = now;
        Ok(Attached::Registered)
    }

    /// The current owner's live registration, or the refusal: another owner, or none.
    fn owned(&self, now: TimeMs, key: &str, claim: &Owner) -> Result<(), ThreadError> {
        check_claim(claim)?;
        let not_found = || ThreadError::NotFound {
            key: key.to_string(),
        };
        let t = self.threads.get(key).ok_or_else(not_found)?;
        Self::check_owner(t, claim)?;
        match &t.registration {
            Some(r) if r.owner == *claim && self.is_live(r, now) => Ok(()),
            // A higher fence than the owner's is not the owner either: it has not
            // attached, so it may not change the current registration.
            Some(r) if r.owner != *claim && self.is_live(r, now) => Err(ThreadError::Mismatch {
                key: key.to_string(),
                current: r.owner.clone(),
            }),
            _ => Err(not_found()),
        }
    }

    /// G3: the owner moves its deadline to `now + budget_ms`, never past a day after
    /// it attached.
    pub fn set_deadline(
        &mut self,
        now: TimeMs,
        key: &str,
        claim: &Owner,
        budget_ms: u64,
    ) -> Result<TimeMs, ThreadError> {
        check_budget(budget_ms)?;
        self.owned(now, key, claim)?;
        let r = self
            .threads
            .get_mut(key)
            .and_then(|t| t.registration.as_mut());
        let r = r.expect("owned() found it");
        let deadline = now.saturating_add(budget_ms);
        if deadline > r.attached_ms.saturating_add(RUN_BUDGET_MS_MAX) {
            return Err(ThreadError::Invalid {
                field: "run_budget_ms",
                rule: "the deadline may not pass a day after the attach".into(),
            });
        }
        r.deadline_ms = deadline;
        Ok(deadline)
    }

    /// G3: the owner ends its registration (the owner stays remembered, G2). With
    /// `evict`, the workspace goes too (reason `detach`): returns whether it must.
    pub fn detach(
        &mut self,
        now: TimeMs,
        key: &str,
        claim: &Owner,
        evict: bool,
    ) -> Result<bool, ThreadError> {
        self.owned(now, key, claim)?;
        let t = self.threads.get_mut(key).expect("owned() found it");
        t.registration = None;
        t.active_ms = now;
        Ok(evict && t.has_workspace)
    }

    /// A run is using the thread now: its idle clock starts again.
    pub fn touch(&mut self, now: TimeMs, key: &str) {
        if let Some(t) = self.threads.get_mut(key) {
            t.active_ms = t.active_ms.max(now);
        }
    }

    /// The thread a run names, made if new (no owner, no registration).
    pub fn ensure(&mut self, now: TimeMs, key: &str) -> Result<(), ThreadError> {
        if !self.threads.contains_key(key) && self.threads.len() >= THREADS_MAX {
            return Err(ThreadError::Full { max: THREADS_MAX });
        }
        self.threads
            .entry(key.to_string())
            .or_insert_with(|| Thread::new(key, now));
        Ok(())
    }

    /// The daemon made the thread's workspace.
    pub fn made_workspace(&mut self, now: TimeMs, key: &str) {
        if let Some(t) = self.threads.get_mut(key) {
            if !t.has_workspace {
                t.has_workspace = true;
                t.created_ms = now;
            }
        }
    }

    /// An operator asks for the workspace to go; refused while a registration
    /// protects it (a registered thread's workspace is never destroyed under it).
    pub fn check_operator_evict(&self, now: TimeMs, key: &str) -> Result<(), ThreadError> {
        let t = self.threads.get(key).ok_or_else(|| ThreadError::NotFound {
            key: key.to_string(),
        })?;
        if let Some(r) = t.registration.as_ref().filter(|r| self.is_live(r, now)) {
            return Err(ThreadError::Protected {
                key: key.to_string(),
                until_ms: r.deadline_ms.saturating_add(self.cfg.grace_ms),
            });
        }
        Ok(())
    }

    /// The idle sweep: threads whose workspace must go now, and why. `in_use` says
    /// whether a live run works in a thread (that protects it like a registration).
    /// A live registration protects from both idle and ttl eviction (G0, G1).
    pub fn due(&self, now: TimeMs, in_use: impl Fn(&str) -> bool) -> Vec<(String, EvictReason)> {
        let mut out = Vec::new();
        for t in self.threads.values() {
            if !t.has_workspace
                || t.registration
                    .as_ref()
                    .is_some_and(|r| self.is_live(r, now))
                || in_use(&t.key)
            {
                continue;
            }
            if now >= t.created_ms.saturating_add(self.cfg.ttl_ms) {
                out.push((t.key.clone(), EvictReason::Ttl));
            } else if now >= t.active_ms.saturating_add(self.cfg.idle_after_ms) {
                out.push((t.key.clone(), EvictReason::Idle));
            }
        }
        out
    }

    /// Under disk pressure: the least recently used thread whose workspace nothing
    /// protects (the one to evict, reason `disk_pressure`), and the threads a live
    /// registration protects from it (their refusals are journaled).
    pub fn pressure(
        &self,
        now: TimeMs,
        in_use: impl Fn(&str) -> bool,
    ) -> (Option<String>, Vec<String>) {
        let mut victim: Option<&Thread> = None;
        let mut protected = Vec::new();
        for t in self
            .threads
            .values()
            .filter(|t| t.has_workspace && !in_use(&t.key))
        {
            if t.registration
                .as_ref()
                .is_some_and(|r| self.is_live(r, now))
            {
                protected.push(t.key.clone());
            } else if victim.is_none_or(|v| t.active_ms < v.active_ms) {
                victim = Some(t);
            }
        }
        (victim.map(|t| t.key.clone()), protected)
    }

    /// The workspace went: recorded with why (the owner stays, G2).
    pub fn evicted(&mut self, now: TimeMs, key: &str, reason: EvictReason) {
        if let Some(t) = self.threads.get_mut(key) {
            t.has_workspace = false;
            t.evictions.push(Eviction { reason, at_ms: now });
            if t.evictions.len() > EVICTIONS_KEPT_MAX {
                t.evictions.remove(0);
            }
        }
    }

    /// Live registrations, by key: what a drain and the idle check wait for.
    pub fn live_registrations(&self, now: TimeMs) -> Vec<(&str, &Registration)> {
        self.threads
            .values()
            .filter_map(|t| {
                let r = t.registration.as_ref()?;
                self.is_live(r, now).then_some((t.key.as_str(), r))
            })
            .collect()
    }

    /// Checks what must always hold: a registration's owner is the thread's owner,
    /// and owners are positive, safe fences.
    pub fn check_invariants(&self) -> Result<(), String> {
        for (k, t) in &self.threads {
            if k != &t.key {
                return Err(format!("thread {k} filed under {}", t.key));
            }
            if let Some(r) = &t.registration {
                if t.owner.as_ref() != Some(&r.owner) {
                    return Err(format!("thread {k}: registration not by its owner"));
                }
            }
            if let Some(o) = &t.owner {
                if o.fence == 0 || o.fence > FENCE_SAFE_MAX {
                    return Err(format!("thread {k}: owner fence {}", o.fence));
                }
            }
            if t.evictions.len() > EVICTIONS_KEPT_MAX {
                return Err(format!("thread {k}: {} evictions kept", t.evictions.len()));
            }
        }
        if self.threads.len() > THREADS_MAX {
            return Err(format!("{} threads", self.threads.len()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
