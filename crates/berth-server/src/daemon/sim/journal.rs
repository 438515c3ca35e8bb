//! The journal (D5) as a reader follows it in the daemon simulator: entry by entry,
//! gap-free, and agreeing with the runs and budget tokens the daemon holds.

use std::collections::{BTreeMap, BTreeSet};

use super::RunRow;

/// What the journal says, read entry by entry as a client would.
pub(super) struct JournalModel {
    /// Reads go through the daemon's own reader (`Journal::read`), which is async.
    rt: tokio::runtime::Runtime,
    /// The last entry read.
    pub(super) seen: u64,
    /// Per run since its latest `queued`: the fence its `granted` named, the state its
    /// `ended` named.
    runs: BTreeMap<String, (Option<u64>, Option<String>)>,
    /// The budget tokens held, by (owner, operation), as the budget entries say (B2/B3).
    pub(super) tokens: BTreeSet<(String, String)>,
}

impl JournalModel {
    pub(super) fn new() -> JournalModel {
        JournalModel {
            rt: tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap(),
            seen: 0,
            runs: BTreeMap::new(),
            tokens: BTreeSet::new(),
        }
    }

    /// Reads every entry published since the last call, checking that they follow on.
    pub(super) fn follow(&mut self, journal: &crate::journal::Journal) -> Result<(), String> {
        let last = journal.last();
        if last < self.seen {
            return Err(format!(
                "the journal went back from {} to {last}",
                self.seen
            ));
        }
        while self.seen < last {
            let page = self
                .rt
                .block_on(journal.read(self.seen, 256))
                .map_err(|e| format!("journal read after {}: {e:?}", self.seen))?;
            if page.is_empty() {
                return Err(format!(
                    "journal entries {}..={last} unreadable",
                    self.seen + 1
                ));
            }
            for e in page {
                if e.seq != self.seen + 1 {
                    return Err(format!("journal entry {} follows {}", e.seq, self.seen));
                }
                self.seen = e.seq;
                self.fold(&e);
            }
        }
        Ok(())
    }

    fn fold(&mut self, e: &berth_store::JournalEntry) {
        let line: serde_json::Value = serde_json::from_str(&e.line).unwrap_or_default();
        let data = &line["data"];
        let key = || {
            let s = |f: &str| data[f].as_str().unwrap_or_default().to_string();
            (s("owner"), s("operation_id"))
        };
        match e.kind.as_str() {
            "budget_token_taken" => {
                self.tokens.insert(key());
            }
            "budget_token_freed" => {
                self.tokens.remove(&key());
            }
            _ => {}
        }
        let Some(run) = &e.run_id else { return };
        match e.kind.as_str() {
            // A run's life starts here (a forgotten id may come back as a new run).
            "queued" => {
                self.runs.insert(run.clone(), (None, None));
            }
            "granted" => self.runs.entry(run.clone()).or_default().0 = data["fence"].as_u64(),
            "ended" => {
                let state = data["state"].as_str().map(str::to_string);
                self.runs.entry(run.clone()).or_default().1 = state;
            }
            _ => {}
        }
    }

    /// Every run the daemon knows agrees with what the journal said of it.
    pub(super) fn agrees(&self, runs: &BTreeMap<String, RunRow>) -> Result<(), String> {
        for (id, (state, fence, _, _, _)) in runs {
            let Some((j_fence, j_ended)) = self.runs.get(id) else {
                return Err(format!("{id} ({state:?}) was never journaled"));
            };
            if fence.is_some() && fence != j_fence {
                return Err(format!(
                    "{id} holds fence {fence:?}, its journal {j_fence:?}"
                ));
            }
            let ended = state.is_terminal().then(|| state.as_str().to_string());
            if &ended != j_ended {
                return Err(format!("{id} is {state:?}, its journal's end {j_ended:?}"));
            }
        }
        Ok(())
    }
}
