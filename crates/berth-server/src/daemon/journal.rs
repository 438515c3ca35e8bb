//! D5: the daemon's side of the journal. Every state change becomes one entry, numbered
//! here (gap-free: numbers are given out in order and a failed write stops the daemon,
//! D4) and written with the commit of the step that made the change, so the journal
//! and the state never disagree after a crash. Entries are published to readers only
//! once that commit is durable.

use berth_client::wire;
use berth_core::Event;
use berth_store::Mutation;
use serde::Serialize;
use serde_json::json;
use std::sync::Arc;
use wire::JournalData;

use super::{Daemon, Host};

impl<H: Host> Daemon<H> {
    /// One entry about a run (its project looked up), written with this step's commit.
    pub(super) fn journal(&mut self, kind: &'static str, run_id: &str, data: impl Serialize) {
        let project = self.engine.project_of(run_id).map(str::to_string);
        self.journal_entry(kind, Some(run_id.to_string()), project, data);
    }

    /// One entry, written with this step's commit.
    pub(super) fn journal_entry(
        &mut self,
        kind: &'static str,
        run_id: Option<String>,
        project: Option<String>,
        data: impl Serialize,
    ) {
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
            data,
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
                    code: &r.code,
                    message: &r.message,
                });
                let data = JournalData::Queued {
                    position: *position,
                    reason,
                };
                self.journal("queued", run_id, data);
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
                        key: k,
                        mode: m.as_str(),
                    })
                    .collect();
                let expires_at = self.host.show_time(*expires_at_ms);
                let data = JournalData::Granted {
                    expires_at: &expires_at,
                    fence: *fence,
                    keys,
                };
                self.journal("granted", run_id, data);
            }
            Event::Renewed {
                run_id,
                expires_at_ms,
            } => {
                let expires_at = self.host.show_time(*expires_at_ms);
                self.journal("renewed", run_id, json!({"expires_at": expires_at}));
            }
            Event::QueueDeadlineExtended {
                run_id,
                deadline_ms,
            } => {
                let deadline = self.host.show_time(*deadline_ms);
                self.journal("wait_extended", run_id, json!({"deadline": deadline}));
            }
            Event::StopRequested { run_id, cause } => {
                let kind = cause.as_str();
                let fence = self.engine.fence_of(run_id);
                self.journal(kind, run_id, JournalData::Fence { fence });
            }
            Event::Degraded { run_id } => {
                let survivors = self.extras.get(run_id).map(|e| e.survivors.clone());
                self.journal("degraded", run_id, json!({"survivors": survivors}));
            }
            Event::Ended { run_id, state } => {
                let failure = self.extras.get(run_id).and_then(|e| e.failure.clone());
                let data = JournalData::Ended {
                    failure: failure.as_deref(),
                    state: state.as_str(),
                };
                self.journal("ended", run_id, data);
            }
            _ => self.journal_other(ev),
        }
    }

    /// Promotion, keys changing mode, upgrades.
    fn journal_other(&mut self, ev: &Event) {
        match ev {
            Event::Promoted { project, evidence } => {
                let data = json!({
                    "fingerprint": evidence.fingerprint,
                    "commit": evidence.commit,
                    "ports": evidence.ports,
                });
                let run = Some(evidence.run_id.clone());
                self.journal_entry("promoted", run, Some(project.clone()), data);
            }
            Event::EvidenceInvalidated { project, by_run } => {
                let run = Some(by_run.clone());
                self.journal_entry(
                    "evidence_invalidated",
                    run,
                    Some(project.clone()),
                    json!({}),
                );
            }
            Event::KeyModeChanged { run_id, key, mode } => {
                let data = json!({"key": key, "mode": mode.as_str()});
                self.journal("key_mode_changed", run_id, data);
            }
            Event::UpgradeQueued { run_id, key } => {
                self.journal("upgrade_queued", run_id, json!({"key": key}));
            }
            Event::UpgradeGranted { run_id, key } => {
                self.journal("upgrade_granted", run_id, json!({"key": key}));
            }
            _ => {}
        }
    }
}
