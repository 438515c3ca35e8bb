//! A step's durable side: the touched runs as a commit, answers behind the writes
//! before them, and the watchers told once durable; all left as effects for the shell.

use super::*;

impl<H: Host> Daemon<H> {
    /// The touched runs as a commit for the shell to make durable; `then` runs once
    /// they are (or the ledger refused them).
    pub(super) fn commit(
        &mut self,
        touched: BTreeSet<String>,
        then: impl FnOnce(Result<(), &StoreError>) + Send + 'static,
    ) {
        let mut ended = std::mem::take(&mut self.ended_records);
        let runs: Vec<RunRecord> = (touched.iter())
            .filter_map(|id| ended.remove(id).or_else(|| self.record(id)))
            .collect();
        // Their records are taken: ended runs shrink to what answering about them needs.
        for r in &runs {
            if r.state.is_terminal() {
                if let Some(e) = self.extras.get_mut(&r.request.run_id) {
                    e.shrink();
                }
            }
        }
        let notes = self.watcher_notes(&touched);
        // L1/S6: a fence is never acknowledged above the durable marker; raising it is
        // one fsync per `FENCE_RESERVE_BLOCK` grants.
        if let Err(e) = self.host.cover_fence(self.engine.last_fence()) {
            let e = StoreError::Write(e);
            self.fatal.raise(e.to_string());
            return then(Err(&e));
        }
        let granted = runs
            .iter()
            .any(|r| r.state == RunState::Granted && r.granted_ms.is_some());
        let mut batch = Batch::runs(self.engine.last_fence(), runs);
        let mut journal = Vec::new();
        for m in std::mem::take(&mut self.pending_mutations) {
            if let berth_store::Mutation::Journal(e) = &m {
                journal.push(e.clone());
            }
            batch.push(m);
        }
        let stops = std::mem::take(&mut self.pending_stops);
        let sink = (!stops.is_empty()).then(|| self.host.stop_sink());
        // F1: a run's fleet-wide claim ends only once its ending is durable here.
        let fleet_jobs = self.fleet.take_pending();
        let any = !fleet_jobs.0.is_empty() || !fleet_jobs.1.is_empty();
        let fleet = self.fleet.link.clone().filter(|_| any);
        self.effects.push(Effect::Commit(Box::new(Commit {
            batch,
            stops: sink.map(|s| (s, stops)),
            fleet: fleet.map(|f| (f, fleet_jobs)),
            journal,
            notes,
            granted,
            then: Box::new(then),
        })));
    }

    /// What the watchers of the touched runs are told once the commit is durable; a
    /// watcher of a run that stopped waiting is told once and dropped.
    pub(super) fn watcher_notes(
        &mut self,
        touched: &BTreeSet<String>,
    ) -> Vec<(Arc<watch::Sender<RunInfo>>, RunInfo)> {
        let mut notes = Vec::new();
        for id in touched {
            if let Some(tx) = self.watchers.get(id) {
                if let Some(info) = self.info(id) {
                    let waiting = info.view.state == RunState::Queued;
                    notes.push((tx.clone(), info));
                    if !waiting {
                        self.watchers.remove(id);
                    }
                }
            }
        }
        notes
    }

    /// Commits the touched runs and answers `reply` with `value` once they are durable.
    pub(super) fn commit_and_answer<T: Send + 'static>(
        &mut self,
        touched: BTreeSet<String>,
        reply: Reply<T>,
        value: Result<T, Error>,
    ) {
        self.commit(touched, move |r| {
            let _ = reply.send(r.map_err(Error::store).and(value));
        });
    }

    /// Answers after everything queued before is durable.
    pub(super) fn answer<T: Send + 'static>(&mut self, reply: Reply<T>, value: Result<T, Error>) {
        self.effects.push(Effect::Answer(Box::new(move |res| {
            let _ = reply.send(match res {
                Ok(()) => value,
                Err(e) => Err(Error::store(e)),
            });
        })));
    }

    /// What this step left to be done, in order.
    pub(super) fn take_effects(&mut self) -> Effects {
        Effects(std::mem::take(&mut self.effects))
    }
}
