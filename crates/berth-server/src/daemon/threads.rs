//! G0–G4: agent threads (their registrations and persistent workspaces), the idle
//! sweep, the drain and the idle predicate. The rules are `berth_core::threads`'
//! (pure); this makes the workspaces they name, writes each change with its journal
//! entry in one transaction (D1, D5) and answers once it is durable.

use std::collections::BTreeSet;

use berth_client::wire;
use berth_core::threads::{Attached, EvictReason, Owner, Thread, ThreadError};
use berth_store::{DrainRecord, Mutation, ThreadRecord};

use super::{Daemon, Error, Host, Reply};

/// How often the idle sweep looks at the threads (ms): the idle time and ttl are
/// minutes and days, so a second late is nothing, and a sweep costs O(threads).
pub const THREAD_SWEEP_MS: u64 = 1_000;

/// The daemon's part of G0–G4.
pub(super) struct ThreadState {
    /// The pure rules' state: every thread remembered.
    pub(super) threads: berth_core::threads::Threads,
    /// Their workspaces, by key.
    pub(super) ws: std::collections::HashMap<String, berth_store::WorkspaceIdentity>,
    /// G4: the host's drain in force.
    pub(super) drain: Option<DrainRecord>,
    /// The fleet's drain in force (issue 38 Build 3), as the fleet store last said.
    pub(super) fleet_drain: Option<berth_store::fleet::FleetDrain>,
    /// When the idle sweep looks next (`THREAD_SWEEP_MS`).
    pub(super) sweep_due: u64,
    /// Threads whose disk-pressure eviction was refused (and journaled) in this spell.
    pub(super) pressure_refused: BTreeSet<String>,
    /// S9: the uid of the uid-bound token that made each thread (absent: unbound).
    pub(super) owner_uids: std::collections::HashMap<String, u32>,
}

/// What a thread message asks.
#[derive(Debug)]
pub enum ThreadOp {
    Attach {
        key: String,
        owner: Owner,
        budget_ms: u64,
    },
    Deadline {
        key: String,
        owner: Owner,
        budget_ms: u64,
    },
    Detach {
        key: String,
        owner: Owner,
        evict: bool,
    },
    Get {
        key: String,
    },
    /// An operator removes the thread's workspace (refused while registered).
    Evict {
        key: String,
    },
}

/// What a thread operation did: nothing (answer as is) or a change to journal.
enum Changed {
    Not(String),
    /// Changed and journaled already: commit, then answer.
    Done(String),
    Yes(String, wire::Journal<'static>),
}

/// The name a thread's workspace is made under: `/` is outside the run id alphabet, so
/// it can never be a run's.
fn seed(key: &str) -> String {
    format!("thread/{key}")
}

impl<H: Host> Daemon<H> {
    /// S9: refuses a caller acting for `by` on thread `key` that a token of another uid
    /// made (journaled). A thread berth does not know yet passes: the caller makes it.
    pub(super) fn check_thread_owner(&mut self, key: &str, by: super::Tenant) -> Result<(), Error> {
        let Some(uid) = by else { return Ok(()) };
        let known = self.th.threads.get(key).is_some();
        if known && self.th.owner_uids.get(key) != Some(&uid) {
            return Err(self.not_owner("thread", key.to_string(), uid));
        }
        Ok(())
    }

    /// S9: a thread made now is its maker's (kept in its record from the next change).
    pub(super) fn thread_made_by(&mut self, key: &str, by: super::Tenant) {
        if let Some(uid) = by {
            self.th.owner_uids.entry(key.to_string()).or_insert(uid);
        }
    }

    /// S9: the thread and, for a claim, the run it names must be the caller's.
    fn thread_op_owned(&mut self, op: &ThreadOp, by: super::Tenant) -> Result<(), Error> {
        let (key, run) = match op {
            ThreadOp::Get { .. } => return Ok(()),
            ThreadOp::Evict { key } => (key, None),
            ThreadOp::Attach { key, owner, .. }
            | ThreadOp::Deadline { key, owner, .. }
            | ThreadOp::Detach { key, owner, .. } => (key, Some(&owner.run_id)),
        };
        if let Some(run_id) = run {
            self.check_run_owner(run_id, by)?;
        }
        self.check_thread_owner(key, by)
    }

    pub(super) fn on_thread(
        &mut self,
        op: ThreadOp,
        by: super::Tenant,
        reply: Reply<wire::Thread>,
    ) {
        if let Err(e) = self.thread_op_owned(&op, by) {
            return self.commit_and_answer(BTreeSet::new(), reply, Err(e));
        }
        let done = match op {
            ThreadOp::Get { key } => {
                let v = self.thread_out(&key).ok_or(ThreadError::NotFound { key });
                return self.answer(reply, v.map_err(Error::Thread));
            }
            ThreadOp::Attach {
                key,
                owner,
                budget_ms,
            } => {
                let new = self.th.threads.get(&key).is_none();
                let res = self.thread_attach(key.clone(), owner, budget_ms);
                if new && self.th.threads.get(&key).is_some() {
                    self.thread_made_by(&key, by);
                }
                res
            }
            ThreadOp::Deadline {
                key,
                owner,
                budget_ms,
            } => self.thread_deadline(key, owner, budget_ms),
            ThreadOp::Detach { key, owner, evict } => self.thread_detach(key, owner, evict),
            ThreadOp::Evict { key } => self.thread_evict(key),
        };
        match done {
            // Refused: nothing changed (but a refused destroy, which is journaled).
            Err(e) => self.commit_and_answer(BTreeSet::new(), reply, Err(e)),
            Ok(Changed::Not(key)) => {
                let v = self
                    .thread_out(&key)
                    .ok_or(Error::Internal("thread vanished".into()));
                self.answer(reply, v)
            }
            Ok(Changed::Done(key)) => {
                let v = self
                    .thread_out(&key)
                    .ok_or(Error::Internal("thread vanished".into()));
                self.commit_and_answer(BTreeSet::new(), reply, v);
            }
            Ok(Changed::Yes(key, data)) => {
                self.journal_entry(None, None, data);
                self.thread_changed(&key);
                let v = self
                    .thread_out(&key)
                    .ok_or(Error::Internal("thread vanished".into()));
                self.commit_and_answer(BTreeSet::new(), reply, v);
            }
        }
    }

    fn thread_attach(
        &mut self,
        key: String,
        owner: Owner,
        budget_ms: u64,
    ) -> Result<Changed, Error> {
        let drain = self.draining();
        match self
            .th
            .threads
            .attach(self.now, &key, owner.clone(), budget_ms, drain.is_some())
        {
            Err(ThreadError::Draining) if drain.is_some() => Err(drain.expect("draining")),
            Err(e) => Err(Error::Thread(e)),
            Ok(Attached::Unchanged) => Ok(Changed::Not(key)),
            Ok(Attached::Registered) => {
                self.make_thread_workspace(&key);
                let data = wire::JournalThreadAttached {
                    key: key.clone().into(),
                    owner_fence: owner.fence,
                    owner_gen: owner.gen.into(),
                    run_budget_ms: budget_ms,
                    run_id: owner.run_id.into(),
                };
                Ok(Changed::Yes(key, wire::Journal::ThreadAttached(data)))
            }
        }
    }

    fn thread_deadline(
        &mut self,
        key: String,
        owner: Owner,
        budget_ms: u64,
    ) -> Result<Changed, Error> {
        let d = self
            .th
            .threads
            .set_deadline(self.now, &key, &owner, budget_ms)
            .map_err(Error::Thread)?;
        let data = wire::JournalThreadDeadline {
            deadline: self.host.show_time(d).into(),
            key: key.clone().into(),
            run_id: owner.run_id.into(),
        };
        Ok(Changed::Yes(key, wire::Journal::ThreadDeadline(data)))
    }

    fn thread_detach(&mut self, key: String, owner: Owner, evict: bool) -> Result<Changed, Error> {
        let must_evict = self
            .th
            .threads
            .detach(self.now, &key, &owner, evict)
            .map_err(Error::Thread)?;
        // Not under a live run working in it: the sweep evicts it once the run is done.
        if must_evict && !self.thread_in_use(&key) {
            // One that cannot go now goes at a later sweep.
            let _ = self.evict_thread(&key, EvictReason::Detach);
        }
        let data = wire::JournalThreadDetached {
            evict,
            key: key.clone().into(),
            run_id: owner.run_id.into(),
        };
        Ok(Changed::Yes(key, wire::Journal::ThreadDetached(data)))
    }

    fn thread_evict(&mut self, key: String) -> Result<Changed, Error> {
        let mut allowed = self.th.threads.check_operator_evict(self.now, &key);
        if allowed.is_ok() && self.thread_in_use(&key) {
            // A live run works in it: its workspace is not taken from under it.
            let until_ms = self.now;
            let key = key.clone();
            allowed = Err(ThreadError::Protected { key, until_ms });
        }
        match allowed {
            Err(e) => {
                // A destroy a live registration refuses is journaled (the audit trail).
                if let ThreadError::Protected { .. } = &e {
                    let data = eviction(&key, "operator");
                    self.journal_entry(None, None, wire::Journal::ThreadEvictRefused(data));
                }
                Err(Error::Thread(e))
            }
            Ok(()) => match self.evict_thread(&key, EvictReason::Operator) {
                Ok(()) => Ok(Changed::Done(key)),
                Err(e) => Err(Error::Internal(format!(
                    "thread {key}'s workspace could not be removed ({e}); it is kept and tried again later"
                ))),
            },
        }
    }

    /// Whether a live run (granted, releasing or degraded) works in thread `key`.
    fn thread_in_use(&self, key: &str) -> bool {
        self.engine.in_flight().iter().any(|v| {
            self.extras
                .get(&v.run_id)
                .is_some_and(|e| e.thread.as_deref() == Some(key))
        })
    }

    /// The thread's workspace, made if it has none (a failure leaves it without one:
    /// the registration stands, and the next attach tries again).
    fn make_thread_workspace(&mut self, key: &str) {
        if self.th.threads.get(key).is_some_and(|t| t.has_workspace) {
            return;
        }
        let owner = self.th.owner_uids.get(key).copied();
        match self.host.create_workspace(&seed(key), owner) {
            Ok(ws) => {
                self.th.threads.made_workspace(self.now, key);
                let data = wire::JournalThreadWorkspace {
                    key: key.to_string().into(),
                    workspace: ws.path.clone().into(),
                };
                self.th.ws.insert(key.to_string(), ws);
                self.journal_entry(None, None, wire::Journal::ThreadWorkspaceCreated(data));
            }
            Err(e) => tracing::warn!("thread {key}: workspace not made: {e}"),
        }
    }

    /// At start: the thread's recorded workspace is gone (a crash cut its eviction
    /// short), so it gets a new one; if none can be made, it has none (the next attach
    /// tries again).
    pub(super) fn remake_thread_workspace(&mut self, key: &str) {
        tracing::warn!("thread {key}: its workspace was gone at start (a crash cut its eviction short); it gets a new one");
        self.th.ws.remove(key);
        if let Some(t) = self.th.threads.get(key).cloned() {
            let mut t = t;
            t.has_workspace = false;
            self.th.threads.restore(t);
        }
        self.make_thread_workspace(key);
        self.thread_changed(key);
    }

    /// The thread's workspace goes (its logs archived within the diagnostics budgets by
    /// the workspace pool), and its audit trail says why.
    ///
    /// A workspace that cannot be removed now is kept, with the thread's record as it
    /// was, and tried again when the thread is next due (the sweep). (Before, it was
    /// forgotten and never removed: the daemon simulator found it left at the end.)
    fn evict_thread(&mut self, key: &str, reason: EvictReason) -> Result<(), String> {
        if let Some(ws) = self.th.ws.get(key).cloned() {
            if let Err(e) = self.host.remove_workspace(&ws, key) {
                tracing::warn!(
                    "thread {key}: workspace not removed: {e}; kept, and tried again at a later sweep"
                );
                return Err(e);
            }
            self.th.ws.remove(key);
        }
        self.th.threads.evicted(self.now, key, reason);
        let data = eviction(key, reason.as_str());
        self.journal_entry(None, None, wire::Journal::ThreadEvicted(data));
        self.thread_changed(key);
        Ok(())
    }

    /// The thread's record goes into the next commit.
    fn thread_changed(&mut self, key: &str) {
        if let Some(t) = self.th.threads.get(key) {
            self.pending_mutations.push(Mutation::Thread(ThreadRecord {
                thread: t.clone(),
                workspace: self.th.ws.get(key).cloned(),
                owner_uid: self.th.owner_uids.get(key).copied(),
            }));
        }
    }

    /// G0: a run that works in thread `key` was granted: the thread is made if new
    /// (and its workspace if it has none), and its idle clock starts again.
    pub(super) fn thread_run_granted(&mut self, key: &str, by: super::Tenant) {
        let new = self.th.threads.get(key).is_none();
        if let Err(e) = self.th.threads.ensure(self.now, key) {
            tracing::warn!("thread {key}: {e:?}; the run works in its own workspace");
            return;
        }
        if new {
            self.thread_made_by(key, by);
        }
        self.th.threads.touch(self.now, key);
        self.make_thread_workspace(key);
        self.thread_changed(key);
    }

    /// The idle sweep, at a tick: every thread past its idle time or ttl that no live
    /// registration protects loses its workspace. Returns whether anything went.
    pub(super) fn sweep_threads(&mut self) -> bool {
        // Once a second, not every tick: the sweep looks at every thread.
        if self.now < self.th.sweep_due {
            return false;
        }
        self.th.sweep_due = self.now + THREAD_SWEEP_MS;
        // A live run working in a thread protects it, and keeps its idle clock at 0.
        let mut in_use = BTreeSet::new();
        for v in self.engine.in_flight() {
            if let Some(k) = self.extras.get(&v.run_id).and_then(|e| e.thread.clone()) {
                self.th.threads.touch(self.now, &k);
                in_use.insert(k);
            }
        }
        let due = self.th.threads.due(self.now, |k| in_use.contains(k));
        for (key, why) in &due {
            // One that cannot go now is due again at the next sweep.
            let _ = self.evict_thread(key, *why);
        }
        self.relieve_disk_pressure(&in_use);
        !due.is_empty()
    }

    /// Low on disk: one unprotected thread's workspace goes per sweep, least recently
    /// used first; a registered thread's is refused, journaled once per spell of
    /// pressure (not every second).
    fn relieve_disk_pressure(&mut self, in_use: &BTreeSet<String>) {
        let low = self
            .host
            .disk_free()
            .is_some_and(|free| free < self.th.threads.cfg.disk_free_min);
        if !low {
            self.th.pressure_refused.clear();
            return;
        }
        let (victim, protected) = self.th.threads.pressure(self.now, |k| in_use.contains(k));
        if let Some(key) = victim {
            let _ = self.evict_thread(&key, EvictReason::DiskPressure);
        }
        for key in protected {
            if self.th.pressure_refused.insert(key.clone()) {
                let data = eviction(&key, "disk_pressure");
                self.journal_entry(None, None, wire::Journal::ThreadEvictRefused(data));
            }
        }
    }

    pub(super) fn on_thread_list(&mut self, reply: Reply<Vec<wire::Thread>>) {
        let keys: Vec<String> = self.th.threads.iter().map(|t| t.key.clone()).collect();
        let out = keys.iter().filter_map(|k| self.thread_out(k)).collect();
        self.answer(reply, Ok(out));
    }

    fn thread_out(&self, key: &str) -> Option<wire::Thread> {
        let t: &Thread = self.th.threads.get(key)?;
        let show = |ms| self.host.show_time(ms);
        let owner = |o: &Owner| wire::ThreadOwner {
            owner_gen: o.gen.clone(),
            owner_fence: o.fence,
            run_id: o.run_id.clone(),
        };
        let grace = self.th.threads.cfg.grace_ms;
        Some(wire::Thread {
            key: t.key.clone(),
            owner: t.owner.as_ref().map(owner),
            registration: t.registration.as_ref().map(|r| wire::ThreadRegistration {
                owner: owner(&r.owner),
                attached_at: show(r.attached_ms),
                deadline: show(r.deadline_ms),
                live_until: show(r.deadline_ms.saturating_add(grace)),
                live: self.th.threads.is_live(r, self.now),
            }),
            workspace: self.th.ws.get(key).map(|w| w.path.clone()),
            created_at: show(t.created_ms),
            active_at: show(t.active_ms),
            evictions: t
                .evictions
                .iter()
                .map(|e| wire::ThreadEviction {
                    reason: e.reason.as_str().into(),
                    at: show(e.at_ms),
                })
                .collect(),
        })
    }

    /// G4: starts (`Some((by, reason))`) or ends the drain. Starting again keeps the
    /// first record (idempotent); waiters stay queued with `host.draining`.
    pub(super) fn on_drain(&mut self, start: Option<(String, String)>, reply: Reply<wire::Drain>) {
        let mut touched = BTreeSet::new();
        match (start, self.th.drain.is_some()) {
            (Some((by, reason)), false) => {
                let at = self.host.show_time(self.now);
                let d = DrainRecord { by, at, reason };
                let data = wire::JournalDrain {
                    at: d.at.clone(),
                    by: d.by.clone(),
                    reason: d.reason.clone(),
                };
                self.journal_entry(None, None, wire::Journal::DrainStarted(data));
                self.pending_mutations
                    .push(Mutation::Drain(Some(d.clone())));
                self.th.drain = Some(d);
                self.drain_engine(&mut touched);
            }
            (None, true) => {
                let data = wire::Journal::DrainEnded(wire::JournalEmpty {});
                self.journal_entry(None, None, data);
                self.pending_mutations.push(Mutation::Drain(None));
                self.th.drain = None;
                self.drain_engine(&mut touched);
            }
            _ => {}
        }
        let v = Ok(self.drain_out());
        self.commit_and_answer(touched, reply, v);
    }

    pub(super) fn on_drain_get(&mut self, reply: Reply<wire::Drain>) {
        let v = Ok(self.drain_out());
        self.answer(reply, v);
    }

    pub(super) fn on_idle(&mut self, reply: Reply<wire::Idle>) {
        let busy = self.busy();
        self.answer(
            reply,
            Ok(wire::Idle {
                idle: busy.is_empty(),
                busy,
            }),
        );
    }

    pub(super) fn drain_out(&self) -> wire::Drain {
        let fleet = self.th.fleet_drain.as_ref();
        wire::Drain {
            draining: self.th.drain.is_some() || fleet.is_some(),
            drain: self.th.drain.as_ref().map(drain_wire),
            fleet_drain: fleet.map(|f| wire::FleetDrainRecord {
                by: f.by.clone(),
                at: f.at.clone(),
                reason: f.reason.clone(),
                host: f.host_id.clone(),
            }),
            waiting_for: self.busy(),
        }
    }

    /// What keeps the host busy: live runs (granted, releasing or degraded: a run is
    /// in flight until its processes are stopped and its workspace cleaned) and live
    /// registrations, in id order.
    fn busy(&self) -> Vec<wire::Busy> {
        let mut out = Vec::new();
        for v in self.engine.in_flight() {
            out.push(wire::Busy {
                kind: "run".into(),
                id: v.run_id.clone(),
                until: v.expires_at_ms.map(|t| self.host.show_time(t)),
                owner: None,
            });
        }
        let grace = self.th.threads.cfg.grace_ms;
        for (key, r) in self.th.threads.live_registrations(self.now) {
            out.push(wire::Busy {
                kind: "registration".into(),
                id: key.to_string(),
                until: Some(self.host.show_time(r.deadline_ms.saturating_add(grace))),
                owner: Some(wire::ThreadOwner {
                    owner_gen: r.owner.gen.clone(),
                    owner_fence: r.owner.fence,
                    run_id: r.owner.run_id.clone(),
                }),
            });
        }
        out
    }
}

/// A thread's eviction (or refused eviction) as the journal says it.
fn eviction(key: &str, reason: &str) -> wire::JournalThreadEviction<'static> {
    wire::JournalThreadEviction {
        key: key.to_string().into(),
        reason: reason.to_string().into(),
    }
}

pub(super) fn drain_wire(d: &DrainRecord) -> wire::DrainRecord {
    wire::DrainRecord {
        by: d.by.clone(),
        at: d.at.clone(),
        reason: d.reason.clone(),
    }
}
