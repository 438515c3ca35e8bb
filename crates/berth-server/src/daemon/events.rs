//! What the daemon does with the engine's events: a workspace and ports for each
//! grant, a stop or a clean-up for each stop request, retries for a degraded run, and
//! the bookkeeping of a run's end.

use super::*;

impl<H: Host> Daemon<H> {
    /// P2: a stop order for the run's processes, sent once this step is durable;
    /// `Msg::Stopped` comes back.
    pub(super) fn start_stop(&mut self, run_id: &str) {
        if !self.stopping.insert(run_id.to_string()) {
            return;
        }
        let extra = self.extras.get(run_id);
        let pids: Vec<i32> =
            extra.map_or_else(Vec::new, |e| e.processes.iter().map(|p| p.pid).collect());
        let data = berth_client::wire::JournalPids { pids };
        self.journal(run_id, berth_client::wire::Journal::StopStarted(data));
        let extra = self.extras.get(run_id);
        // Sent by the next commit, once the decision to stop is durable: a crash in
        // between must not leave a run that the ledger says is granted with its
        // processes already killed.
        self.pending_stops.push(StopOrder {
            run_id: run_id.to_string(),
            roots: extra.map_or_else(Vec::new, |e| e.processes.iter().map(proc_id).collect()),
            grace_ms: extra.and_then(|e| e.stop_grace_ms),
            may_have_group: extra.is_none_or(|e| !e.processes.is_empty()),
        });
    }

    /// L3/P4: a failed stop or cleanup is retried with exponential backoff, from
    /// `CLEANUP_RETRY`.
    pub(super) fn schedule_retry(&mut self, run_id: &str) {
        let now = self.now;
        let e = self
            .cleanup_retry
            .entry(run_id.to_string())
            .or_insert((0, 0));
        e.0 += 1;
        let delay = CLEANUP_RETRY.delay_ms(e.0);
        e.1 = now + delay;
    }

    /// Applies one command and everything it sets off; records the runs it touched.
    pub(super) fn apply(
        &mut self,
        cmd: Command,
        touched: &mut BTreeSet<String>,
    ) -> Result<Option<RunView>, CoreError> {
        let out = self.engine.apply(self.now, cmd);
        self.carry_out(out.events, touched);
        out.result
    }

    /// Carries out the engine's events, and the events that doing so sets off.
    pub(super) fn carry_out(&mut self, events: Vec<Event>, touched: &mut BTreeSet<String>) {
        let mut queue: VecDeque<Event> = events.into();
        while let Some(ev) = queue.pop_front() {
            if let Some(run_id) = event_run(&ev) {
                touched.insert(run_id.to_string());
            }
            if let Event::Ended {
                run_id,
                state: RunState::Rejected,
            } = &ev
            {
                self.scope_rejected(run_id);
            }
            self.journal_event(&ev);
            if !matches!(
                ev,
                Event::Renewed { .. } | Event::QueueDeadlineExtended { .. }
            ) {
                self.queue_moves += 1;
            }
            match &ev {
                Event::Granted {
                    run_id,
                    fence,
                    expires_at_ms,
                    ..
                } => {
                    let ttl_ms = expires_at_ms.saturating_sub(self.now);
                    tracing::debug!(run_id, fence, ttl_ms, "granted");
                    self.note_listeners_at_grant(run_id);
                    queue.extend(self.on_granted(run_id, *fence));
                }
                Event::StopRequested { run_id, cause } => {
                    log_stop(&self.engine, run_id, *cause);
                    queue.extend(self.stop_or_clean(run_id));
                }
                Event::Degraded { run_id } => self.on_degraded(run_id),
                // C3/C4: evidence is durable with the step that proved or disproved it.
                Event::Promoted { .. } | Event::EvidenceInvalidated { .. } => {
                    self.on_evidence_event(&ev)
                }
                Event::ScopeFrozen { .. }
                | Event::ScopeForgotten { .. }
                | Event::TokenTaken { .. }
                | Event::TokenFreed { .. }
                | Event::TokenLapsed { .. }
                | Event::ScopeControlled { .. } => self.on_scope_event(&ev),
                Event::PermitWanted { run_id } => self.on_permit_wanted(run_id),
                Event::PermitReturned { run_id } => self.on_permit_returned(run_id),
                Event::Ended { run_id, state } => self.on_ended(run_id, *state),
                _ => {}
            }
        }
        // Forget what the engine forgot (it keeps `ended_retained_max` ended runs).
        while self.ended.len() > self.engine.config().ended_retained_max {
            if let Some(id) = self.ended.pop_front() {
                if self.engine.view_of(&id).is_none() {
                    self.extras.remove(&id);
                }
            }
        }
        shrink_sparse(&mut self.extras);
    }

    /// C3/C4: promotion evidence recorded (`Some`) or invalidated (`None`), made
    /// durable with the step that proved or disproved it.
    /// C3/C4: evidence recorded or dropped, here and (in fleet mode) in the fleet.
    fn on_evidence_event(&mut self, ev: &Event) {
        match ev {
            Event::Promoted { project, evidence } => {
                self.on_evidence(project, Some(evidence), &evidence.run_id);
                self.share_evidence(project, evidence, true);
            }
            Event::EvidenceInvalidated {
                project,
                by_run,
                evidence,
            } => {
                self.on_evidence(project, None, by_run);
                self.share_evidence(project, evidence, false);
            }
            _ => {}
        }
    }

    pub(super) fn on_evidence(
        &mut self,
        project: &str,
        evidence: Option<&berth_core::Evidence>,
        by: &str,
    ) {
        match evidence {
            Some(_) => tracing::info!(project, run_id = by, "project promoted: its runtime was proven on every declared port; runs with the same contract and commit now run side by side"),
            None => tracing::info!(project, run_id = by, "promotion evidence invalidated: the project's runs are serial again"),
        }
        self.pending_mutations
            .push(berth_store::Mutation::Evidence {
                project: project.to_string(),
                evidence: evidence.cloned(),
            });
    }

    /// A run ended: its fleet claim, clean-up retries, ports, listener watch and
    /// connection bookkeeping go; it is remembered among the ended runs.
    pub(super) fn on_ended(&mut self, run_id: &str, state: RunState) {
        tracing::debug!(run_id, state = state.as_str(), "ended");
        self.on_fleet_ended(run_id, state);
        self.cleanup_retry.remove(run_id);
        if let Some(e) = self.extras.get_mut(run_id) {
            e.survivors.clear();
            // W3: its processes are gone; its ports come back.
            let held: Vec<u16> = e.ports.iter().map(|(_, p)| *p).collect();
            self.ports.release(run_id, &held);
        }
        if self.listen_watched.remove(run_id).is_some() {
            self.send_listen_watch();
        }
        self.attached.remove(run_id);
        self.unclaimed.remove(run_id);
        self.ended.push_back(run_id.to_string());
        // Its terminal record, taken now: the engine may retire the run before this
        // step's commit (it keeps `ended_retained_max`), and the commit must still
        // write its end (issue 35: it did not, and the ledger kept the run live).
        if let Some(r) = self.record(run_id) {
            self.ended_records.insert(run_id.to_string(), r);
        }
    }

    /// W1: a granted run gets its workspace, or is released in this same step (before
    /// anything is acknowledged) and its caller told why. Returns what that sets off.
    pub(super) fn on_granted(&mut self, run_id: &str, fence: u64) -> Vec<Event> {
        if let Err(e) = self.allocate_ports(run_id) {
            return self.release_at_grant(run_id, fence, e);
        }
        // A lease only (an orchestrator that needs the fence, not a place to work):
        // no workspace, so nothing to make now or to remove at its end.
        if self.extras.get(run_id).is_some_and(|e| e.lease_only) {
            return Vec::new();
        }
        let owner = self.extras.get(run_id).and_then(|e| e.owner_uid);
        match self.host.create_workspace(run_id, owner) {
            Ok(ws) => {
                let mut thread = None;
                if let Some(e) = self.extras.get_mut(run_id) {
                    e.workspace = Some(ws);
                    thread = e.thread.clone().map(|k| (k, e.owner_uid));
                }
                if let Some((key, by)) = thread {
                    self.thread_run_granted(&key, by);
                }
                Vec::new()
            }
            Err(e) => self.release_at_grant(
                run_id,
                fence,
                format!("its workspace could not be made ({e})"),
            ),
        }
    }

    /// W1/W3: a grant berth cannot furnish is released in the same step, before
    /// anything is acknowledged, and its caller told why.
    pub(super) fn release_at_grant(&mut self, run_id: &str, fence: u64, why: String) -> Vec<Event> {
        tracing::error!(run_id, "{why}; the run is released");
        if let Some(x) = self.extras.get_mut(run_id) {
            x.failure = Some(format!("the run was granted but {why}; berth released it"));
        }
        let release = Command::Release {
            run_id: run_id.to_string(),
            fence,
        };
        self.engine.apply(self.now, release).events
    }

    /// W3: numbers for the ports a granted run declares, each verified free (a bind
    /// test by the host) and held by no live run.
    pub(super) fn allocate_ports(&mut self, run_id: &str) -> Result<(), String> {
        let Some(e) = self.extras.get_mut(run_id) else {
            return Ok(());
        };
        if e.ports.is_empty() {
            return Ok(());
        }
        let host = &self.host;
        let got = self
            .ports
            .allocate(run_id, e.ports.len(), |p| host.port_in_use(p))
            .ok_or_else(|| {
                format!(
                    "its {} port(s) could not be allocated: the range's free ports are in use outside berth",
                    e.ports.len()
                )
            })?;
        for ((_, p), n) in e.ports.iter_mut().zip(got) {
            *p = n;
        }
        Ok(())
    }

    /// A run is to stop (released, expired, degraded and retried, or reaped): its
    /// processes are stopped first (capacity stays counted until they are proven gone,
    /// L5), or, with none, it is cleaned up at once. Returns what that sets off.
    pub(super) fn stop_or_clean(&mut self, run_id: &str) -> Vec<Event> {
        if self.has_processes(run_id) {
            self.start_stop(run_id);
            return Vec::new();
        }
        let ok = self.cleanup(run_id);
        self.stop_done(run_id, ok)
    }

    /// The run's processes are proven gone and its workspace removed (`ok`), or not.
    pub(super) fn stop_done(&mut self, run_id: &str, ok: bool) -> Vec<Event> {
        let done = Command::StopDone {
            run_id: run_id.to_string(),
            ok,
        };
        self.engine.apply(self.now, done).events
    }

    pub(super) fn on_degraded(&mut self, run_id: &str) {
        self.schedule_retry(run_id);
        let retry_in_ms = self
            .cleanup_retry
            .get(run_id)
            .map_or(0, |(_, at)| at.saturating_sub(self.now));
        tracing::warn!(
            run_id,
            retry_in_ms,
            "run degraded: its stop or cleanup failed; its capacity stays counted until a retry succeeds"
        );
    }

    /// Removes a stopping run's workspace after its identity check. False leaves the
    /// run degraded, its capacity still counted, to be retried.
    pub(super) fn cleanup(&mut self, run_id: &str) -> bool {
        let Some(ws) = self.extras.get(run_id).and_then(|e| e.workspace.clone()) else {
            return true;
        };
        match self.host.remove_workspace(&ws, run_id) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(run_id, "cleanup failed: {e}");
                false
            }
        }
    }
}

/// L6: one line per lease that ran out; a release is a debug line.
pub(super) fn log_stop(engine: &Engine, run_id: &str, cause: EndCause) {
    match cause {
        EndCause::Expired => {
            let fence = engine.view_of(run_id).and_then(|v| v.fence);
            tracing::info!(
                run_id,
                fence,
                "lease expired: not renewed in time; the run is stopped and its claim freed once its processes are gone"
            );
        }
        EndCause::Released => tracing::debug!(run_id, "released"),
    }
}

/// The run an event is about, if it changes something the ledger records.
pub(super) fn event_run(ev: &Event) -> Option<&str> {
    match ev {
        Event::Granted { run_id, .. }
        | Event::StopRequested { run_id, .. }
        | Event::Degraded { run_id }
        | Event::Ended { run_id, .. }
        | Event::Queued { run_id, .. }
        | Event::Renewed { run_id, .. }
        | Event::QueueDeadlineExtended { run_id, .. }
        | Event::KeyModeChanged { run_id, .. }
        | Event::UpgradeQueued { run_id, .. }
        | Event::UpgradeGranted { run_id, .. } => Some(run_id),
        Event::Promoted { .. }
        | Event::PermitWanted { .. }
        | Event::PermitReturned { .. }
        | Event::EvidenceInvalidated { .. }
        | Event::MemoryStabilized { .. }
        | Event::PressureChanged { .. }
        // Pending claims are not kept in the ledger (a restart recomputes them).
        | Event::Settled { .. }
        | Event::DiskFreeChanged { .. }
        | Event::ScopeFrozen { .. }
        | Event::ScopeForgotten { .. }
        | Event::TokenTaken { .. }
        | Event::TokenFreed { .. }
        | Event::TokenLapsed { .. }
        | Event::ScopeControlled { .. }
        | Event::DrainChanged { .. } => None,
    }
}
