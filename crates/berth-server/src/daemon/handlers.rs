//! One method per message, and the tick.

use std::collections::BTreeSet;
use std::sync::Arc;

use berth_client::wire;
use berth_core::{Command, Error as CoreError, RunState, RunView, Snapshot};
use berth_store::Mutation;
use tokio::sync::{oneshot, watch};

use super::extra::Extra;
use super::{Daemon, Error, Host, Msg, ReapCounters, Reply, RunInfo};
use crate::auth::Grant;

/// A3: an acquire that never fits this host, whatever it waits for, is said in the log.
fn log_impossible(id: &str, res: &Result<Option<RunView>, CoreError>) {
    if let Err(CoreError::CapacityImpossible {
        resource,
        request,
        max,
    }) = res
    {
        tracing::info!(
            run_id = id,
            resource = resource.as_str(),
            request,
            max,
            "acquire refused (capacity_impossible): the request exceeds what this host can ever allocate"
        );
    }
}

impl<H: Host> Daemon<H> {
    /// One message from the API or a thread the daemon started, at `now`: what it
    /// leaves to be done.
    pub fn handle(&mut self, now: u64, msg: Msg) -> super::Effects {
        self.now = now;
        self.on_msg(msg);
        self.take_effects()
    }

    /// One method per message.
    fn on_msg(&mut self, msg: Msg) {
        self.shared.metrics.state_message();
        match msg {
            msg @ Msg::Acquire { .. } => self.on_acquire_msg(msg),
            Msg::Command { cmd, by, reply } => self.on_command(cmd, by, reply),
            Msg::Get { run_id, reply } => self.on_get(run_id, reply),
            Msg::List {
                limit,
                ended,
                reply,
            } => self.on_list(limit, ended, reply),
            Msg::Status { reply } => self.on_status(reply),
            Msg::FenceCheck {
                run_id,
                fence,
                reply,
            } => self.on_fence_check(run_id, fence, reply),
            Msg::Detach { run_id } => self.on_detach(run_id),
            Msg::Fleet(report) => self.on_fleet(report),
            Msg::Subscribe { run_id, reply } => self.on_subscribe(run_id, reply),
            Msg::RegisterProcess {
                run_id,
                fence,
                pid,
                uid,
                by,
                checked,
                reply,
            } => self.on_register_process(run_id, (fence, pid), (uid, by), checked, reply),
            Msg::RegistrationPlan {
                run_id,
                fence,
                by,
                reply,
            } => self.on_registration_plan(run_id, fence, by, reply),
            Msg::Reap { reply } => self.on_reap(reply),
            Msg::ReapStatus { runs, reply } => self.on_reap_status(runs, reply),
            Msg::Stopped { run_id, report } => self.on_stopped(run_id, report),
            Msg::CreateToken { grant, reply } => self.on_create_token(grant, reply),
            Msg::RevokeToken { id, reply } => self.on_revoke_token(&id, reply),
            Msg::FleetChanged {
                change,
                version,
                reply,
            } => self.on_fleet_changed(change, version, reply),
            msg @ (Msg::RuntimePlan { .. }
            | Msg::RuntimeReady { .. }
            | Msg::RuntimeFailed { .. }
            | Msg::ListenerViolation { .. }
            | Msg::ContractChanged { .. }) => self.on_runtime_msg(msg),
            Msg::Thread { op, by, reply } => self.on_thread(op, by, reply),
            Msg::ThreadList { reply } => self.on_thread_list(reply),
            Msg::Drain { start, reply } => self.on_drain(start, reply),
            Msg::DrainGet { reply } => self.on_drain_get(reply),
            Msg::Idle { reply } => self.on_idle(reply),
            Msg::Scope { op, reply } => self.on_scope(op, reply),
            Msg::ScopeList { reply } => self.on_scope_list(reply),
        }
    }

    /// C7 and W3: the runtime's messages (its plan, ready, failed, a listener outside
    /// the run's ports, a changed contract), one method each. `handle` sends only those.
    fn on_runtime_msg(&mut self, msg: Msg) {
        match msg {
            Msg::RuntimePlan {
                run_id,
                fence,
                by,
                reply,
            } => self.on_runtime_plan(run_id, fence, by, reply),
            Msg::RuntimeReady {
                run_id,
                fence,
                ports,
                reply,
            } => self.on_runtime_ready(run_id, fence, ports, reply),
            Msg::RuntimeFailed { run_id, fence } => self.on_runtime_failed(run_id, fence),
            Msg::ListenerViolation { run_id, violation } => {
                self.on_listener_violation(run_id, violation)
            }
            Msg::ContractChanged {
                run_id,
                fence,
                contract,
                reply,
            } => self.on_contract_changed(run_id, fence, contract, reply),
            _ => debug_assert!(false, "on_runtime_msg: not a runtime message"),
        }
    }

    /// S9: refuses a caller acting for `by` on run `run_id` that a token of another uid
    /// made, and journals the refusal (it goes out with the caller's commit). A run
    /// berth does not know passes: the call's own rules answer for it.
    pub(super) fn check_run_owner(&mut self, run_id: &str, by: super::Tenant) -> Result<(), Error> {
        let Some(uid) = by else { return Ok(()) };
        match self.extras.get(run_id) {
            Some(e) if !super::may_act(by, e.owner_uid) => {
                Err(self.not_owner("run", run_id.to_string(), uid))
            }
            _ => Ok(()),
        }
    }

    /// D5: an S9 refusal, journaled like the engine's (nothing else changed).
    pub(super) fn not_owner(&mut self, what: &'static str, id: String, uid: u32) -> Error {
        let api = crate::error::not_owner(what, &id, uid);
        self.shared.metrics.refused(&api.code);
        let data = refused(&api);
        let run_id = (what == "run").then(|| id.clone());
        self.journal_entry(run_id, None, data);
        Error::NotOwner { what, id, uid }
    }

    /// An acquire: what it carries besides the engine's request becomes its `Extra`.
    fn on_acquire_msg(&mut self, msg: Msg) {
        let Msg::Acquire {
            req,
            worktree,
            labels,
            stop_grace_ms,
            ports,
            attach,
            detach,
            thread,
            lease_only,
            by,
            reply,
        } = msg
        else {
            return;
        };
        let mut req = req;
        // S10: a scope this run freezes is its user's (the engine counts them per uid).
        if let Some(b) = req.budget.as_deref_mut() {
            b.tenant = by;
        }
        let mut extra = Extra::new(worktree, labels, stop_grace_ms, 0);
        extra.thread = thread;
        extra.lease_only = lease_only;
        extra.owner_uid = by;
        extra.ports = ports.into_iter().map(|p| (p, 0)).collect();
        extra.detached = detach;
        self.on_acquire(req, extra, attach, reply)
    }

    /// Why an acquire is refused before the engine sees it, if it is.
    fn acquire_refusal(&mut self, id: &str, extra: &Extra, is_new: bool) -> Option<Error> {
        // S9: a retry re-attaches to the run (its lease and fence): only its owner's.
        if let Err(e) = self.check_run_owner(id, extra.owner_uid) {
            return Some(e);
        }
        // S9: a run works in a thread's workspace only if the thread is its owner's.
        if let Some(key) = &extra.thread {
            if let Err(e) = self.check_thread_owner(key, extra.owner_uid) {
                return Some(e);
            }
        }
        if let Some(ex) = self.extras.get(id) {
            // L7: a retry is the same request; a different thread or workspace choice is
            // another one (both are kept when an ended run shrinks: the thread's key is
            // at most 128 bytes).
            if ex.differs(&extra.worktree, &extra.labels, extra.stop_grace_ms)
                || ex.thread != extra.thread
                || ex.lease_only != extra.lease_only
            {
                let run_id = id.to_string();
                return Some(CoreError::Conflict { run_id }.into());
            }
        }
        // G4: no new run while the host drains (a retry of a queued or granted one is
        // not new: it re-attaches).
        if !is_new {
            return None;
        }
        // F1: a new run's id and fence are fleet-wide claims; none is taken (or granted
        // unrecorded) while the fleet store is away.
        self.draining().or_else(|| {
            let away = self.fleet.unavailable(self.now);
            away.then_some(Error::FleetUnavailable)
        })
    }

    /// `extra` is what the acquire carries besides the engine's request (its queue
    /// sequence is assigned here).
    fn on_acquire(
        &mut self,
        req: berth_core::Request,
        extra: Extra,
        attach: bool,
        reply: Reply<RunInfo>,
    ) {
        let id = req.run_id.clone();
        let is_new = self.engine.view_of(&id).is_none();
        if let Some(e) = self.acquire_refusal(&id, &extra, is_new) {
            return self.commit_and_answer(BTreeSet::new(), reply, Err(e));
        }
        // F1: a new run on a fleet host takes its fleet-wide claim first, so that the
        // engine's first try (a `wait_s = 0` run's only one) can grant it.
        if is_new && self.fleet.link.is_some() {
            return self.preclaim(req, extra, attach, reply);
        }
        self.admit(Command::Acquire(req), id, is_new, extra, attach, reply)
    }

    /// The acquire itself (`Acquire`, or `AcquirePermitted` once a fleet claim is held).
    pub(super) fn admit(
        &mut self,
        cmd: Command,
        id: String,
        is_new: bool,
        extra: Extra,
        attach: bool,
        reply: Reply<RunInfo>,
    ) {
        let detach = extra.detached;
        let was_ended =
            !is_new && (self.engine.view_of(&id)).is_some_and(|v| v.state.is_terminal());
        let mut extra = Some(extra);
        if let Some(mut e) = extra.take_if(|_| is_new) {
            // Registered before the command so grants made by it find it.
            e.queue_seq = self.next_seq;
            self.extras.insert(id.clone(), Box::new(e));
        }
        let mut touched = BTreeSet::new();
        let res = self.apply(cmd, &mut touched);
        self.admitted(&id, is_new, was_ended, extra, &mut touched);
        log_impossible(&id, &res);
        let mut info = self.info(&id);
        // A run that expired on arrival (`wait_s = 0`) keeps the reason why.
        if let (Ok(Some(v)), Some(i)) = (&res, info.as_mut()) {
            if i.view.reason.is_none() {
                i.view.reason = v.reason.clone();
            }
        }
        if res.is_ok() {
            self.unclaimed.remove(&id);
            let queued = info
                .as_ref()
                .is_some_and(|i| i.view.state == RunState::Queued);
            if attach && queued {
                *self.attached.entry(id.clone()).or_default() += 1;
            }
            // A waiter its client lets go of (`detach` on a retry): it keeps its place
            // from now on without a connection, and its record says so.
            let letting_go = self
                .extras
                .get_mut(&id)
                .filter(|e| detach && queued && !e.detached);
            if let Some(ex) = letting_go {
                ex.detached = true;
                touched.insert(id.clone());
                if let Some(i) = info.as_mut() {
                    i.detached = true;
                }
            }
        }
        let value = match (res, info) {
            (Ok(_), Some(info)) => Ok(info),
            (Ok(_), None) => Err(Error::run_vanished()),
            (Err(e), _) => {
                self.journal_refusal(&id, &e);
                Err(e.into())
            }
        };
        self.commit_and_answer(touched, reply, value);
    }

    /// The acquire's extra once the engine took the command: a new run's queue
    /// sequence is used (or its extra dropped if the engine did not keep it).
    fn admitted(
        &mut self,
        id: &str,
        is_new: bool,
        was_ended: bool,
        extra: Option<Extra>,
        touched: &mut BTreeSet<String>,
    ) {
        let live = self.engine.view_of(id).map(|v| !v.state.is_terminal());
        if is_new {
            if live.is_some() {
                self.next_seq += 1;
                touched.insert(id.to_string());
            } else {
                self.extras.remove(id);
            }
        } else if let Some(mut e) = extra.filter(|_| was_ended && live == Some(true)) {
            // The ended run under this id was forgotten in this very step (ends due
            // now pushed it out of the few the engine keeps) and the acquire was a new
            // run. Taken for the ended one, it kept that run's queue sequence: the
            // ledger's D3 guard dropped its record as a late write of the ended run,
            // and a restart lost an acknowledged waiter (the daemon simulator's seed
            // 3024). Its extra differed in nothing the refusal compares, so what the
            // step did with the old one is what it would have done with this.
            e.queue_seq = self.next_seq;
            self.next_seq += 1;
            self.extras.insert(id.to_string(), Box::new(e));
            touched.insert(id.to_string());
        }
    }

    /// D5: an acquire the engine refused (nothing changed but the refusal itself).
    fn journal_refusal(&mut self, run_id: &str, e: &CoreError) {
        let api = crate::error::ApiError::from(e.clone());
        self.shared.metrics.refused(&api.code);
        self.journal_entry(Some(run_id.to_string()), None, refused(&api));
    }

    fn on_command(&mut self, cmd: Command, by: super::Tenant, reply: Reply<RunInfo>) {
        let id = match &cmd {
            Command::Cancel { run_id }
            | Command::Renew { run_id, .. }
            | Command::Release { run_id, .. } => run_id.clone(),
            _ => String::new(),
        };
        if let Err(e) = self.check_run_owner(&id, by) {
            return self.commit_and_answer(BTreeSet::new(), reply, Err(e));
        }
        if matches!(cmd, Command::Renew { fence: None, .. }) {
            self.unclaimed.remove(&id);
        }
        let mut touched = BTreeSet::new();
        let res = self.apply(cmd, &mut touched);
        let value = res
            .map_err(Error::from)
            .and_then(|_| self.info(&id).ok_or_else(Error::run_vanished));
        self.commit_and_answer(touched, reply, value);
    }

    fn on_get(&mut self, run_id: String, reply: Reply<RunInfo>) {
        let v = self
            .info(&run_id)
            .ok_or_else(|| CoreError::NotFound { run_id }.into());
        self.answer(reply, v);
    }

    fn on_list(&mut self, limit: usize, ended: bool, reply: Reply<Vec<RunInfo>>) {
        let mut all: Vec<(u64, RunInfo)> = self
            .extras
            .iter()
            .filter_map(|(id, e)| Some((e.queue_seq, self.info(id)?)))
            .filter(|(_, i)| ended || !i.view.state.is_terminal())
            .collect();
        all.sort_by_key(|(seq, _)| *seq);
        let v = all.into_iter().take(limit).map(|(_, i)| i).collect();
        self.answer(reply, Ok(v));
    }

    fn on_status(&mut self, reply: Reply<(Snapshot, ReapCounters)>) {
        let s = self.engine.snapshot();
        let c = self.reap_counters();
        self.answer(reply, Ok((s, c)));
    }

    fn on_fence_check(
        &mut self,
        run_id: String,
        fence: u64,
        reply: Reply<(bool, Option<RunState>)>,
    ) {
        let v = self.engine.view_of(&run_id);
        let state = v.as_ref().map(|v| v.state);
        let current = v.is_some_and(|v| v.fence == Some(fence) && v.state == RunState::Granted);
        self.answer(reply, Ok((current, state)));
    }

    fn on_detach(&mut self, run_id: String) {
        let left = match self.attached.get_mut(&run_id) {
            Some(n) => {
                *n = n.saturating_sub(1);
                *n
            }
            None => return,
        };
        if left == 0 {
            self.attached.remove(&run_id);
            // A9: the waiter's client went away; it leaves the queue at once (unless it
            // is a detached waiter: no connection ever held its place).
            let detached = self.extras.get(&run_id).is_some_and(|e| e.detached);
            if !detached
                && self
                    .engine
                    .view_of(&run_id)
                    .is_some_and(|v| v.state == RunState::Queued)
            {
                let mut touched = BTreeSet::new();
                let _ = self.apply(Command::Cancel { run_id }, &mut touched);
                self.commit(touched, |_| {});
            }
        }
    }

    fn on_subscribe(
        &mut self,
        run_id: String,
        reply: oneshot::Sender<Option<watch::Receiver<RunInfo>>>,
    ) {
        let rx = self.info(&run_id).map(|info| {
            if info.view.state.is_terminal() {
                // Nothing will change: its last word, with no sender kept for it (one
                // per request for a run that is never touched again would pile up).
                return watch::channel(info).1;
            }
            self.watchers
                .entry(run_id)
                .or_insert_with(|| Arc::new(watch::channel(info).0))
                .subscribe()
        });
        // After every write queued before, as any read.
        self.effects.push(super::Effect::Answer(Box::new(move |_| {
            let _ = reply.send(rx);
        })));
    }

    fn on_register_process(
        &mut self,
        run_id: String,
        (fence, pid): (u64, i32),
        (uid, by): (u32, super::Tenant),
        checked: Option<(berth_proc::ProcId, u64)>,
        reply: Reply<RunInfo>,
    ) {
        if let Err(e) = self.check_run_owner(&run_id, by) {
            return self.commit_and_answer(BTreeSet::new(), reply, Err(e));
        }
        let value = self.register(&run_id, fence, (pid, uid), checked);
        let mut touched = BTreeSet::new();
        if value.is_ok() {
            let data = wire::Journal::ProcessRegistered(wire::JournalPid { pid });
            self.journal(&run_id, data);
            touched.insert(run_id);
        }
        self.commit_and_answer(touched, reply, value);
    }

    /// P4 on demand: every releasing or degraded run is stopped (or cleaned) again, in
    /// run id order.
    fn on_reap(&mut self, reply: Reply<(Vec<String>, ReapCounters)>) {
        let mut runs: Vec<String> = self
            .extras
            .keys()
            .filter(|id| {
                matches!(
                    self.engine.view_of(id).map(|v| v.state),
                    Some(RunState::Releasing | RunState::Degraded)
                )
            })
            .cloned()
            .collect();
        runs.sort();
        let stopping = runs.iter().filter(|id| self.has_processes(id)).count();
        tracing::info!(
            runs = runs.len(),
            stopping,
            without_processes = runs.len() - stopping,
            "reap pass: releasing and degraded runs stopped again"
        );
        let mut touched = BTreeSet::new();
        for id in &runs {
            let state = self.engine.view_of(id).map(|v| v.state.as_str());
            let data = wire::JournalReaped {
                state: state.map(Into::into),
            };
            self.journal(id, wire::Journal::Reaped(data));
            let events = self.stop_or_clean(id);
            self.carry_out(events, &mut touched);
        }
        let counters = self.reap_counters();
        self.commit_and_answer(touched, reply, Ok((runs, counters)));
    }

    fn on_reap_status(&mut self, runs: Vec<String>, reply: Reply<super::msg::ReapStates>) {
        let busy = runs.iter().filter(|id| self.stopping.contains(*id)).count();
        let states = runs
            .into_iter()
            .filter_map(|id| self.engine.view_of(&id).map(|v| (id, v.state)))
            .collect();
        let counters = self.reap_counters();
        self.answer(reply, Ok((busy, states, counters)));
    }

    fn on_stopped(&mut self, run_id: String, report: berth_proc::StopReport) {
        self.stopping.remove(&run_id);
        self.counters.processes_terminated += report.terminated as u64;
        self.counters.reused_pids_protected += report.reused_pids_protected as u64;
        log_stopped(&run_id, &report);
        if let Some(e) = self.extras.get_mut(&run_id) {
            e.survivors = report.survivors.clone();
        }
        if let Some(usage) = report.usage {
            self.record_usage(&run_id, usage);
        }
        if !report.survivors.is_empty() {
            let pids = report.survivors.clone();
            self.journal(
                &run_id,
                wire::Journal::Survivors(wire::JournalPids { pids }),
            );
        }
        let mut touched = BTreeSet::new();
        let state = self.engine.view_of(&run_id).map(|v| v.state);
        if matches!(state, Some(RunState::Releasing | RunState::Degraded)) {
            let ok = report.ok() && self.cleanup(&run_id);
            let events = self.stop_done(&run_id, ok);
            self.carry_out(events, &mut touched);
            if !ok {
                self.schedule_retry(&run_id);
            }
        }
        self.commit(touched, |_| {});
    }

    /// Issue 36: what the run's cgroup used, as its stop found it: kept for `GET` of
    /// the ended run, and an OOM kill inside it journaled (and counted) with its peak
    /// against its claim.
    fn record_usage(&mut self, run_id: &str, usage: berth_proc::limits::Usage) {
        let Some(e) = self.extras.get_mut(run_id) else {
            return;
        };
        let first = e.usage.as_ref().map_or(0, |u| u.oom_kills);
        e.usage = Some(Box::new(usage));
        if usage.oom_kills > first {
            let claim = self.claimed(run_id).0;
            tracing::warn!(
                run_id,
                oom_kills = usage.oom_kills,
                memory_peak_bytes = usage.memory_peak_bytes,
                memory_claim_bytes = claim,
                "the kernel's OOM killer killed inside the run: it went past its hard memory limit"
            );
            let data = wire::JournalOom {
                memory_claim_bytes: claim,
                memory_peak_bytes: usage.memory_peak_bytes,
                oom_kills: usage.oom_kills,
            };
            self.journal(run_id, wire::Journal::OomKilled(data));
        }
    }

    fn on_create_token(&mut self, grant: Grant, reply: Reply<String>) {
        match self.host.new_token() {
            Ok(token) => {
                let hash = crate::auth::hash_token(&token);
                self.shared
                    .tokens
                    .write()
                    .unwrap()
                    .push((hash.clone(), grant));
                // The token's scope and user, never its secret or its hash.
                let data = journal_token(crate::auth::token_id(&hash), &grant);
                self.journal_entry(None, None, wire::Journal::TokenCreated(data));
                let scope = grant.stored();
                self.pending_mutations.push(Mutation::Token { hash, scope });
                self.commit(BTreeSet::new(), move |r| {
                    let _ = reply.send(r.map_err(Error::store).map(|()| token));
                });
            }
            Err(e) => self.answer(reply, Err(Error::Internal(e))),
        }
    }

    /// S9: the token is gone from the table requests are checked against at once, and
    /// from the ledger with this step's commit (acknowledged once durable).
    fn on_revoke_token(&mut self, id: &str, reply: Reply<Option<(String, Grant)>>) {
        let revoked = {
            let mut tokens = self.shared.tokens.write().unwrap();
            let at = tokens
                .iter()
                .position(|(h, _)| crate::auth::token_id(h) == id);
            at.map(|i| tokens.remove(i))
        };
        let Some((hash, grant)) = revoked else {
            return self.answer(reply, Ok(None));
        };
        let data = journal_token(id, &grant);
        self.journal_entry(None, None, wire::Journal::TokenRevoked(data));
        self.pending_mutations
            .push(Mutation::TokenRevoked { hash: hash.clone() });
        self.commit(BTreeSet::new(), move |r| {
            let _ = reply.send(r.map_err(Error::store).map(|()| Some((hash, grant))));
        });
    }

    /// Time passes: expiries and deadlines (L6, A8), reclaim windows (P5), cleanup
    /// retries (L3), and optionally what was sampled of the host: MemAvailable (A10)
    /// and memory pressure (issue 36).
    pub fn tick(&mut self, now: u64, sample: Option<super::Sample>) -> super::Effects {
        self.now = now;
        self.on_tick(sample.unwrap_or_default());
        self.take_effects()
    }

    fn on_tick(&mut self, sample: super::Sample) {
        let now = self.now;
        // C6: analysis runs that lived through a restart are watched again; what
        // their processes hold now is their baseline.
        for id in std::mem::take(&mut self.rewatch) {
            self.watch_analysis_run(&id);
        }
        let mut touched = BTreeSet::new();
        let _ = self.apply(Command::Tick, &mut touched);
        if sample != super::Sample::default() {
            // One command: admission decides on the whole sample, never half of it.
            let _ = self.apply(Command::Sample(sample), &mut touched);
            self.settle_started(&mut touched);
            self.freeze_background(sample.pressure_bp[0]);
        }
        self.cancel_unclaimed(&mut touched);
        self.retry_due_cleanups(&mut touched);
        self.fleet_tick(&mut touched);
        self.sweep_threads();
        self.tell_queue_moved();
        let (held, release) = super::release_due(self.held, self.extras.len(), now);
        self.held = held;
        if release {
            self.host.release_memory();
        }
        if !touched.is_empty()
            || !self.pending_stops.is_empty()
            || !self.pending_mutations.is_empty()
        {
            self.commit(touched, |_| {});
        }
    }

    /// Issue 36: runs whose process tree was registered since the last sample have
    /// started; once their group's memory has been read (or at once, where there is no
    /// group to read), this sample shows their use, and their claims stop being pending.
    fn settle_started(&mut self, touched: &mut BTreeSet<String>) {
        for (run_id, fence) in std::mem::take(&mut self.to_settle) {
            let grouped = self.extras.get(&run_id).is_some_and(|e| e.grouped);
            let seen = self.host.usage(&run_id).and_then(|u| u.memory_bytes);
            if grouped && seen == Some(0) {
                self.to_settle.push((run_id, fence)); // not sampled with any use yet
                continue;
            }
            let _ = self.apply(Command::Settle { run_id, fence }, touched);
        }
    }

    /// P5: restored waiters nobody re-attached to within their window are cancelled.
    /// Looked at only once the earliest window is up (no per-waiter work per tick).
    fn cancel_unclaimed(&mut self, touched: &mut BTreeSet<String>) {
        let now = self.now;
        if now < self.unclaimed_due {
            return;
        }
        let lapsed: Vec<String> = self
            .unclaimed
            .iter()
            .filter(|(_, &d)| d <= now)
            .map(|(id, _)| id.clone())
            .collect();
        for id in lapsed {
            self.unclaimed.remove(&id);
            if !self.attached.contains_key(&id) {
                let _ = self.apply(Command::Cancel { run_id: id }, touched);
            }
        }
        self.unclaimed_due = self.unclaimed.values().min().copied().unwrap_or(u64::MAX);
    }

    /// Raises `queue_moved` if the queue moved since it was last raised, at most once
    /// per `QUEUE_MOVED_EVERY_MS` (the tick calls this; a move is told within a tick
    /// of the second being up).
    fn tell_queue_moved(&mut self) {
        let (told, at) = self.queue_moves_told;
        if self.queue_moves != told && self.now >= at + super::QUEUE_MOVED_EVERY_MS {
            self.queue_moves_told = (self.queue_moves, self.now);
            self.shared.queue_moved.send_replace(self.queue_moves);
        }
    }

    /// L3/P4: stops and cleanups whose backoff has run out are tried again.
    fn retry_due_cleanups(&mut self, touched: &mut BTreeSet<String>) {
        let now = self.now;
        let due: Vec<String> = self
            .cleanup_retry
            .iter()
            .filter(|(_, (_, at))| *at <= now)
            .map(|(id, _)| id.clone())
            .collect();
        for id in due {
            let state = self.engine.view_of(&id).map(|v| v.state);
            if !matches!(state, Some(RunState::Releasing | RunState::Degraded)) {
                self.cleanup_retry.remove(&id);
                continue;
            }
            // Not again until this attempt has had its chance.
            self.schedule_retry(&id);
            tracing::debug!(
                run_id = id.as_str(),
                attempt = self.cleanup_retry.get(&id).map_or(0, |r| r.0),
                "retrying the stop and cleanup of a run"
            );
            let events = self.stop_or_clean(&id);
            self.carry_out(events, touched);
        }
    }
}

/// How a stop ended, for the operator (S4: could not look is never gone).
fn log_stopped(run_id: &str, report: &berth_proc::StopReport) {
    let (terminated, protected) = (report.terminated, report.reused_pids_protected);
    if report.unverified {
        tracing::warn!(run_id, terminated, reused_pids_protected = protected, survivors = ?report.survivors, "stop finished unproven: the run's processes could not be proven gone (a /proc, pidfd or cgroup read failed); the run is degraded and the stop retried");
    } else if !report.ok() {
        tracing::warn!(run_id, terminated, reused_pids_protected = protected, survivors = ?report.survivors, "stop finished with survivors: processes survived SIGKILL; the run is degraded");
    } else {
        tracing::info!(
            run_id,
            terminated,
            reused_pids_protected = protected,
            "stop finished: every process of the run is gone"
        );
    }
}

/// A refusal as the journal says it: what the caller was told.
fn refused(api: &crate::error::ApiError) -> wire::Journal<'static> {
    wire::Journal::Refused(wire::JournalRefused {
        code: api.code.clone().into(),
        message: api.message.clone().into(),
    })
}

/// A token as the journal says it: its id, scope and user, never its secret or hash.
pub(super) fn journal_token<'a>(id: &'a str, grant: &Grant) -> wire::JournalToken<'a> {
    wire::JournalToken {
        id: id.into(),
        scope: grant.scope.as_str().into(),
        uid: grant.uid,
    }
}
