//! D5: the daemon's side of the journal. Every state change becomes one entry, numbered
//! here (gap-free: numbers are given out in order and a failed write stops the daemon,
//! D4) and written with the commit of the step that made the change, so the journal
//! and the state never disagree after a crash. Entries are published to readers only
//! once that commit is durable.

use berth_client::wire;
use berth_core::Event;
use berth_store::Mutation;
use std::borrow::Cow::Borrowed;
use std::sync::Arc;
use wire::Journal;

use super::{Daemon, Host};

impl<H: Host> Daemon<H> {
    /// One entry about a run (its project looked up), written with this step's commit.
    pub(super) fn journal(&mut self, run_id: &str, data: Journal<'_>) {
        let project = self.engine.project_of(run_id).map(str::to_string);
        self.journal_entry(Some(run_id.to_string()), project, data);
    }

    /// One entry, written with this step's commit.
    pub(super) fn journal_entry(
        &mut self,
        run_id: Option<String>,
        project: Option<String>,
        data: Journal<'_>,
    ) {
        let kind = data.kind();
        let seq = self.journal_next;
        self.journal_next += 1;
        self.shared.metrics.journaled(kind);
        // Where the run's story starts: retention keeps it while the run lives.
        if let Some(e) = run_id.as_ref().and_then(|id| self.extras.get_mut(id)) {
            if e.journal_first == 0 {
                e.journal_first = seq;
            }
        }
        // A step makes several entries at one time: render it once.
        if self.journal_at.0 != self.now || self.journal_at.1.is_empty() {
            self.journal_at = (self.now, self.host.show_time(self.now));
        }
        // Rendered once: the ledger keeps these bytes, so exports of the same prefix
        // are always the same bytes.
        let line = serde_json::to_string(&wire::JournalLine {
            seq,
            at: &self.journal_at.1,
            kind,
            run_id: run_id.as_deref(),
            project: project.as_deref(),
            data: &data,
        })
        .unwrap_or_else(|e| format!("{{\"seq\":{seq},\"kind\":\"{kind}\",\"error\":\"{e}\"}}"));
        // Shared, not copied, with the readers it is published to after the commit.
        self.pending_mutations
            .push(Mutation::Journal(Arc::new(berth_store::JournalEntry {
                seq,
                kind: kind.to_string(),
                run_id,
                project,
                line,
            })));
    }

    /// The entry an engine event makes. (A memory sample that moved the stabilised
    /// figure is an input, not a change of any run: `/metrics` and `/v1/status` show
    /// it; journaling it would write an entry and an fsync every second.)
    pub(super) fn journal_event(&mut self, ev: &Event) {
        match ev {
            Event::Queued { run_id, position } => {
                let reason = self.engine.reason_of(run_id);
                let reason = reason.as_ref().map(|r| wire::JournalReason {
                    code: Borrowed(&r.code),
                    message: Borrowed(&r.message),
                });
                let position = *position;
                self.journal(
                    run_id,
                    Journal::Queued(wire::JournalQueued { position, reason }),
                );
            }
            Event::Granted {
                run_id,
                fence,
                expires_at_ms,
                keys,
            } => {
                let keys = keys
                    .iter()
                    .map(|(k, m)| wire::JournalKey {
                        key: Borrowed(k),
                        mode: Borrowed(m.as_str()),
                    })
                    .collect();
                let expires_at = self.host.show_time(*expires_at_ms).into();
                let data = wire::JournalGranted {
                    expires_at,
                    fence: *fence,
                    keys,
                };
                self.journal(run_id, Journal::Granted(data));
            }
            Event::Renewed {
                run_id,
                expires_at_ms,
            } => {
                let expires_at = self.host.show_time(*expires_at_ms).into();
                self.journal(
                    run_id,
                    Journal::Renewed(wire::JournalRenewed { expires_at }),
                );
            }
            Event::QueueDeadlineExtended {
                run_id,
                deadline_ms,
            } => {
                let deadline = self.host.show_time(*deadline_ms).into();
                let data = wire::JournalWaitExtended { deadline };
                self.journal(run_id, Journal::WaitExtended(data));
            }
            _ => self.journal_ending(ev),
        }
    }

    /// A stop asked for, a degraded run, an ended one.
    fn journal_ending(&mut self, ev: &Event) {
        match ev {
            Event::StopRequested { run_id, cause } => {
                let fence = wire::JournalFence {
                    fence: self.engine.fence_of(run_id),
                };
                let data = match cause {
                    berth_core::EndCause::Released => Journal::Released(fence),
                    berth_core::EndCause::Expired => Journal::Expired(fence),
                };
                self.journal(run_id, data);
            }
            Event::Degraded { run_id } => {
                let survivors = self.extras.get(run_id).map(|e| e.survivors.clone());
                let data = wire::JournalDegraded { survivors };
                self.journal(run_id, Journal::Degraded(data));
            }
            Event::Ended { run_id, state } => {
                let failure = self.extras.get(run_id).and_then(|e| e.failure.clone());
                let data = wire::JournalEnded {
                    failure: failure.map(Into::into),
                    state: Borrowed(state.as_str()),
                };
                self.journal(run_id, Journal::Ended(data));
            }
            _ => self.journal_other(ev),
        }
    }

    /// Promotion, keys changing mode, upgrades.
    fn journal_other(&mut self, ev: &Event) {
        match ev {
            Event::Promoted { project, evidence } => {
                let data = wire::JournalPromoted {
                    commit: evidence.commit.as_deref().map(Borrowed),
                    fingerprint: Borrowed(&evidence.fingerprint),
                    ports: evidence.ports.clone(),
                };
                let run = Some(evidence.run_id.clone());
                self.journal_entry(run, Some(project.clone()), Journal::Promoted(data));
            }
            Event::EvidenceInvalidated {
                project, by_run, ..
            } => {
                let data = Journal::EvidenceInvalidated(wire::JournalEmpty {});
                self.journal_entry(Some(by_run.clone()), Some(project.clone()), data);
            }
            Event::KeyModeChanged { run_id, key, mode } => {
                let data = wire::JournalKey {
                    key: Borrowed(key),
                    mode: Borrowed(mode.as_str()),
                };
                self.journal(run_id, Journal::KeyModeChanged(data));
            }
            Event::UpgradeQueued { run_id, key } => {
                let data = wire::JournalKeyName { key: Borrowed(key) };
                self.journal(run_id, Journal::UpgradeQueued(data));
            }
            Event::UpgradeGranted { run_id, key } => {
                let data = wire::JournalKeyName { key: Borrowed(key) };
                self.journal(run_id, Journal::UpgradeGranted(data));
            }
            _ => {}
        }
    }
}
