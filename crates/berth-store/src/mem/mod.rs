//! The in-memory ledger, for the daemon simulator: [`MemStore`] keeps what SQLite's
//! tables keep, by the same rules (`sqlite/`), so whatever [`Store`] shows is the same.
//! Where SQLite's answer comes from how it stores things (the journal's chunks, which
//! table a delete touches) the same shape is kept here, and said where it is.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use berth_core::scopes::{Receipt, Scope, Scopes, Token, RECEIPTS_MAX};

use crate::{
    Batch, DrainRecord, JournalEntry, Ledger, Mutation, ProcessRecord, Retention, RunRecord,
    ScopeRecord, Store, StoreError, ThreadRecord, JOURNAL_ENTRIES_PER_RUN, JOURNAL_HELD_MAX,
    JOURNAL_READ_MAX,
};

/// SQLite's chunk cut and record rules (`sqlite/journal.rs`): the same entries are
/// refused, and retention keeps the same ones.
use crate::sqlite::{record_len, CHUNK_TEXT_CUT};

/// A ledger in memory. A clone is another handle on the same ledger (the same disk, as
/// a reopened SQLite file is): what one handle writes, every other reads. Cheap to
/// clone; [`MemStore::fork`] copies the ledger instead.
#[derive(Clone, Default)]
pub struct MemStore {
    ledger: Arc<Mutex<State>>,
}

impl MemStore {
    /// A handle on a copy of this ledger as it is now (what a crash would leave on
    /// disk): later writes to either are not seen by the other.
    pub fn fork(&self) -> MemStore {
        MemStore {
            ledger: Arc::new(Mutex::new(self.state().clone())),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.ledger.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A run's row: its record without processes and ports (tables of their own, as in
/// SQLite) and when it ended (wall clock, for retention by age).
#[derive(Clone)]
struct Row {
    run: RunRecord,
    ended_unix_ms: Option<u64>,
}

/// One transaction's journal entries (or a `CHUNK_TEXT_CUT` share of them): SQLite's
/// row of `journal_chunks`, the grain retention deletes at. Never empty.
#[derive(Clone)]
struct Chunk {
    entries: Vec<Arc<JournalEntry>>,
    written_unix_ms: u64,
}

impl Chunk {
    fn last(&self) -> u64 {
        self.entries.last().map_or(0, |e| e.seq)
    }
}

/// SQLite's tables, one map each, keyed and so ordered as its loads order them.
#[derive(Clone, Default)]
struct State {
    last_fence: u64,
    boot_id: Option<String>,
    /// Arrival numbers never go back, even when the newest runs were pruned.
    queue_seq_floor: u64,
    runs: BTreeMap<String, Row>,
    /// The ended runs by (queue_seq, id): SQLite's `(terminal, queue_seq)` index.
    ended: BTreeSet<(u64, String)>,
    processes: BTreeMap<String, BTreeSet<ProcessRecord>>,
    ports: BTreeMap<String, BTreeMap<String, u16>>,
    tokens: BTreeMap<String, String>,
    evidence: BTreeMap<String, berth_core::Evidence>,
    threads: BTreeMap<String, ThreadRecord>,
    drain: Option<DrainRecord>,
    scopes: BTreeMap<String, ScopeRecord>,
    /// By scope, then request id (the table's primary key).
    receipts: BTreeMap<String, BTreeMap<String, Receipt>>,
    /// By scope, then (owner, operation).
    budget_tokens: BTreeMap<String, BTreeMap<(String, String), Token>>,
    /// By first sequence number.
    journal: BTreeMap<u64, Chunk>,
}

impl Store for MemStore {
    fn load(&mut self, ended_max: usize) -> Result<Ledger, StoreError> {
        self.state().load(ended_max)
    }

    /// All or nothing, as SQLite's transaction: every refusal is made before anything
    /// changes, and what follows cannot fail.
    fn write(&mut self, batches: &[&Batch]) -> Result<(), StoreError> {
        let mut st = self.state();
        st.check(batches.iter().flat_map(|b| &b.mutations))?;
        st.apply(batches.iter().flat_map(|b| &b.mutations), unix_ms());
        Ok(())
    }

    fn set_boot_id(&mut self, boot_id: &str) -> Result<(), StoreError> {
        self.state().boot_id = Some(boot_id.to_string());
        Ok(())
    }

    fn prune(
        &mut self,
        policy: &Retention,
        now_unix_ms: u64,
        rows_max: usize,
    ) -> Result<usize, StoreError> {
        Ok(self.state().prune(policy, now_unix_ms, rows_max))
    }

    fn journal(&mut self, after: u64, limit: usize) -> Result<Vec<JournalEntry>, StoreError> {
        let st = self.state();
        let start = st
            .journal
            .range(..=after.saturating_add(1))
            .next_back()
            .map_or(0, |(first, _)| *first);
        Ok(st
            .journal
            .range(start..)
            .flat_map(|(_, c)| &c.entries)
            .filter(|e| e.seq > after)
            .take(limit.min(JOURNAL_READ_MAX))
            .map(|e| JournalEntry::clone(e))
            .collect())
    }

    fn journal_first(&mut self) -> Result<u64, StoreError> {
        Ok(self.state().journal.keys().next().copied().unwrap_or(0))
    }
}

impl State {
    /// Every refusal SQLite makes of a write, each failing its whole transaction: a
    /// journal entry not after the one before it (or the last stored) or that breaks
    /// the chunk's record format, a thread registered by another than its owner, and a
    /// receipt whose request id its scope holds already (the table's primary key).
    fn check<'a>(&'a self, ms: impl Iterator<Item = &'a Mutation>) -> Result<(), StoreError> {
        let mut last = self.journal_last();
        // The request ids and generations of the receipts each scope would hold.
        let mut receipts: HashMap<&str, BTreeMap<&str, u64>> = HashMap::new();
        for m in ms {
            match m {
                Mutation::Journal(e) => {
                    check_entry(e, last)?;
                    last = e.seq;
                }
                Mutation::Thread(r) => check_thread(r)?,
                Mutation::ScopeDeleted(id) => {
                    receipts.insert(id, BTreeMap::new());
                }
                Mutation::ScopeReceipt { scope, receipt } => {
                    let held = receipts.entry(scope).or_insert_with(|| {
                        let held = self.receipts.get(scope).into_iter().flatten();
                        held.map(|(id, r)| (id.as_str(), r.generation)).collect()
                    });
                    if held
                        .insert(&receipt.request_id, receipt.generation)
                        .is_some()
                    {
                        return Err(StoreError::Write(format!(
                            "scope {scope}: receipt {} again (UNIQUE constraint failed)",
                            receipt.request_id
                        )));
                    }
                    let from = receipts_kept_from(receipt.generation);
                    held.retain(|_, g| *g > from);
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// The mutations in order, once `check` has passed them.
    fn apply<'a>(&mut self, ms: impl Iterator<Item = &'a Mutation>, now_ms: u64) {
        let mut fence = 0;
        // This write's entries not yet in a chunk, and the bytes of their text.
        let (mut chunk, mut text) = (Vec::new(), 0);
        for m in ms {
            match m {
                Mutation::Fence(f) => fence = fence.max(*f),
                Mutation::Run(r) => self.put_run(r, now_ms),
                Mutation::Token { hash, scope } => {
                    self.tokens.insert(hash.clone(), scope.clone());
                }
                Mutation::TokenRevoked { hash } => {
                    self.tokens.remove(hash);
                }
                Mutation::Evidence {
                    project,
                    evidence: Some(e),
                } => {
                    self.evidence.insert(project.clone(), e.clone());
                }
                Mutation::Evidence { project, .. } => {
                    self.evidence.remove(project);
                }
                Mutation::Journal(e) => {
                    if text >= CHUNK_TEXT_CUT {
                        self.add_chunk(std::mem::take(&mut chunk), now_ms);
                        text = 0;
                    }
                    text += text_len(e);
                    chunk.push(e.clone());
                }
                Mutation::Thread(t) => {
                    self.threads.insert(t.thread.key.clone(), t.clone());
                }
                Mutation::Drain(d) => self.drain = d.clone(),
                Mutation::Scope(_)
                | Mutation::ScopeDeleted(_)
                | Mutation::ScopeReceipt { .. }
                | Mutation::BudgetToken { .. } => self.apply_scope(m),
            }
        }
        self.add_chunk(chunk, now_ms);
        // L1: the counter only ever moves up, whatever order batches arrive in.
        self.last_fence = self.last_fence.max(fence);
    }

    /// B1-B5: a scope's row replaced (its first journal entry kept once known, as
    /// SQLite's upsert keeps it) or deleted with its receipts and tokens; a receipt
    /// added and those past the newest `RECEIPTS_MAX` dropped; a token set or freed.
    fn apply_scope(&mut self, m: &Mutation) {
        match m {
            Mutation::Scope(r) => {
                let first = self.scopes.get(&r.id).map_or(0, |s| s.journal_first);
                let mut r = r.clone();
                if first != 0 {
                    r.journal_first = first;
                }
                self.scopes.insert(r.id.clone(), r);
            }
            Mutation::ScopeDeleted(id) => {
                self.scopes.remove(id);
                self.receipts.remove(id);
                self.budget_tokens.remove(id);
            }
            Mutation::ScopeReceipt { scope, receipt } => {
                let held = self.receipts.entry(scope.clone()).or_default();
                held.insert(receipt.request_id.clone(), receipt.clone());
                let from = receipts_kept_from(receipt.generation);
                held.retain(|_, r| r.generation > from);
            }
            Mutation::BudgetToken {
                scope,
                owner,
                operation,
                token,
            } => {
                let held = self.budget_tokens.entry(scope.clone()).or_default();
                let key = (owner.clone(), operation.clone());
                if let Some(t) = token {
                    held.insert(key, t.clone());
                } else {
                    held.remove(&key);
                }
            }
            _ => {}
        }
    }

    /// A chunk of this write's entries, if it has any (its row, written now).
    fn add_chunk(&mut self, entries: Vec<Arc<JournalEntry>>, written_unix_ms: u64) {
        if let Some(first) = entries.first().map(|e| e.seq) {
            let chunk = Chunk {
                entries,
                written_unix_ms,
            };
            self.journal.insert(first, chunk);
        }
    }

    /// SQLite's upsert of a run. The same live run (same id and queue sequence) takes
    /// the new record's changing fields; an ended one is never overwritten (D3), nor
    /// is another live run under the id; a new run under an ended run's id replaces
    /// it, processes and ports too (`replace_ended`). Processes only add up (P1); a
    /// live run's ports are set by name, an ended run's deleted (W3).
    fn put_run(&mut self, r: &RunRecord, now_ms: u64) {
        let id = &r.request.run_id;
        let row = self.runs.get(id).map(|row| {
            let same = row.run.queue_seq == r.queue_seq;
            (row.run.state.is_terminal(), same)
        });
        match row {
            Some((false, true)) => self.update_run(r, now_ms),
            Some((true, false)) => {
                self.forget_run(id);
                self.insert_run(r, now_ms);
            }
            Some(_) => return,
            None => self.insert_run(r, now_ms),
        }
        if !r.processes.is_empty() {
            let held = self.processes.entry(id.clone()).or_default();
            held.extend(r.processes.iter().cloned());
        }
        if r.state.is_terminal() {
            self.ports.remove(id);
        } else if !r.ports.is_empty() {
            let held = self.ports.entry(id.clone()).or_default();
            held.extend(r.ports.iter().cloned());
        }
    }

    fn insert_run(&mut self, r: &RunRecord, now_ms: u64) {
        let mut run = r.clone();
        (run.processes, run.ports) = (Vec::new(), Vec::new());
        let ended_unix_ms = r.state.is_terminal().then_some(now_ms);
        if ended_unix_ms.is_some() {
            self.ended.insert((r.queue_seq, r.request.run_id.clone()));
        }
        let row = Row { run, ended_unix_ms };
        self.runs.insert(r.request.run_id.clone(), row);
    }

    /// The columns SQLite's upsert updates; what was asked (the request, worktree,
    /// labels, grace, thread, owner...) stays as first written, and so does a first
    /// journal entry once known.
    fn update_run(&mut self, r: &RunRecord, now_ms: u64) {
        let Some(row) = self.runs.get_mut(&r.request.run_id) else {
            return;
        };
        let old = &mut row.run;
        old.state = r.state;
        old.fence = r.fence;
        old.deadline_ms = r.deadline_ms;
        old.granted_ms = r.granted_ms;
        old.expires_ms = r.expires_ms;
        old.end_cause = r.end_cause;
        old.primary_mode = r.primary_mode;
        old.workspace = r.workspace.clone();
        old.detached = r.detached;
        old.upgrading = r.upgrading;
        if old.journal_first == 0 {
            old.journal_first = r.journal_first;
        }
        if r.state.is_terminal() {
            row.ended_unix_ms = Some(now_ms);
            self.ended.insert((r.queue_seq, r.request.run_id.clone()));
        }
    }

    /// A run's row, processes and ports.
    fn forget_run(&mut self, id: &str) {
        if let Some(row) = self.runs.remove(id) {
            self.ended.remove(&(row.run.queue_seq, id.to_string()));
        }
        self.processes.remove(id);
        self.ports.remove(id);
    }
}

impl State {
    /// Every live run and the `ended_max` latest ended ones, in queue order (ties,
    /// which berth never makes, by id), with what the other tables hold of them.
    fn load(&self, ended_max: usize) -> Result<Ledger, StoreError> {
        let live = self.runs.iter().filter(|(_, r)| !r.run.state.is_terminal());
        let mut keys: Vec<(u64, &str)> =
            live.map(|(id, r)| (r.run.queue_seq, id.as_str())).collect();
        let ended = self.ended.iter().rev().take(ended_max);
        keys.extend(ended.map(|(seq, id)| (*seq, id.as_str())));
        keys.sort_unstable();
        let runs: Vec<RunRecord> = keys.into_iter().map(|(_, id)| self.loaded(id)).collect();
        // L1: no fence issued may exceed the counter; if it does the ledger is damaged.
        if let Some(max) = runs.iter().filter_map(|r| r.fence).max() {
            if max > self.last_fence {
                return Err(StoreError::Corrupt(format!(
                    "run fence {max} is above the fence counter {}",
                    self.last_fence
                )));
            }
        }
        let next = self
            .runs
            .values()
            .map(|r| r.run.queue_seq.saturating_add(1));
        Ok(Ledger {
            last_fence: self.last_fence,
            boot_id: self.boot_id.clone(),
            runs,
            next_queue_seq: next.max().unwrap_or(0).max(self.queue_seq_floor),
            tokens: self.tokens.clone().into_iter().collect(),
            evidence: self.evidence.clone().into_iter().collect(),
            journal_last: self.journal_last(),
            threads: self.threads.values().cloned().collect(),
            drain: self.drain.clone(),
            scopes: self.load_scopes()?,
        })
    }

    /// A run as loaded: its processes, and its ports while it lives.
    fn loaded(&self, id: &str) -> RunRecord {
        let mut r = self.runs[id].run.clone();
        r.processes = self
            .processes
            .get(id)
            .into_iter()
            .flatten()
            .cloned()
            .collect();
        if !r.state.is_terminal() {
            let ports = self.ports.get(id).into_iter().flatten();
            r.ports = ports.map(|(name, port)| (name.clone(), *port)).collect();
        }
        r
    }

    /// Every scope with its receipts (oldest first) and tokens, checked as SQLite's
    /// load checks them (D4): a policy that breaks the rules, a receipt or token of a
    /// scope not kept, or counts and limits that do not hold are a corrupt ledger.
    fn load_scopes(&self) -> Result<Vec<Scope>, StoreError> {
        let mut out = BTreeMap::new();
        for (id, r) in &self.scopes {
            berth_core::scopes::check_policy(&r.policy)
                .map_err(|e| StoreError::Corrupt(format!("scope {id}: {e}")))?;
            let mut s = Scope::new(id, r.policy.clone(), r.manifest.clone());
            (s.control, s.generation, s.owner_uid) = (r.control, r.generation, r.owner_uid);
            out.insert(id.as_str(), s);
        }
        let unknown = |what: &str, scope: &str| {
            StoreError::Corrupt(format!("a {what} of unknown scope {scope}"))
        };
        for (scope, held) in &self.receipts {
            let mut held: Vec<&Receipt> = held.values().collect();
            held.sort_by_key(|r| r.generation);
            for r in held {
                let s = out
                    .get_mut(scope.as_str())
                    .ok_or_else(|| unknown("receipt", scope))?;
                s.receipts.push(r.clone());
            }
        }
        for (scope, held) in &self.budget_tokens {
            for (key, t) in held {
                let s = out
                    .get_mut(scope.as_str())
                    .ok_or_else(|| unknown("token", scope))?;
                s.tokens.insert(key.clone(), t.clone());
            }
        }
        let mut all = Scopes::default();
        out.into_values().for_each(|s| all.restore(s));
        all.check_invariants()
            .map_err(|e| StoreError::Corrupt(format!("scopes: {e}")))?;
        Ok(all.iter().cloned().collect())
    }

    fn journal_last(&self) -> u64 {
        self.journal.values().next_back().map_or(0, Chunk::last)
    }

    /// SQLite's `prune_in`: up to `rows_max` ended runs past the `ended_max` latest,
    /// and among the `rows_max` oldest those ended before the age cutoff, go with
    /// their processes and ports; then the
    /// journal; the arrival floor rises past the newest run deleted.
    fn prune(&mut self, policy: &Retention, now_unix_ms: u64, rows_max: usize) -> usize {
        let mut doomed: BTreeSet<(u64, String)> = BTreeSet::new();
        let through = match policy.ended_max {
            0 => Some(u64::MAX),
            n => self.ended.iter().rev().nth(n).map(|(seq, _)| *seq),
        };
        if let Some(through) = through {
            let past = self.ended.iter().take_while(|(seq, _)| *seq <= through);
            doomed.extend(past.take(rows_max).cloned());
        }
        let cutoff = now_unix_ms
            .saturating_sub(policy.ended_age_ms)
            .min(i64::MAX as u64);
        let old = |(_, id): &&(u64, String)| {
            let ended = self.runs.get(id).and_then(|r| r.ended_unix_ms);
            ended.is_some_and(|at| at < cutoff)
        };
        doomed.extend(self.ended.iter().take(rows_max).filter(old).cloned());
        for (_, id) in &doomed {
            self.forget_run(id);
        }
        self.prune_journal(policy, cutoff, rows_max);
        let floor = doomed.last().map_or(0, |(seq, _)| seq + 1);
        self.queue_seq_floor = self.queue_seq_floor.max(floor);
        doomed.len()
    }

    /// SQLite's `prune_journal`: among the `rows_max` oldest chunks, a chunk goes whole
    /// once all of it is past the newest `JOURNAL_ENTRIES_PER_RUN × ended_max` entries
    /// or older than the cutoff, unless it is the newest chunk (numbering resumes after
    /// it) or reaches what is held (`journal_held`). Chunks as SQLite cuts them, so the
    /// same entries survive.
    fn prune_journal(&mut self, policy: &Retention, cutoff_unix_ms: u64, rows_max: usize) {
        let Some((&newest, chunk)) = self.journal.last_key_value() else {
            return;
        };
        let keep = policy
            .ended_max
            .max(1)
            .saturating_mul(JOURNAL_ENTRIES_PER_RUN);
        let by_count = chunk.last().checked_sub(keep.min(i64::MAX as usize) as u64);
        let held = self.journal_held(policy, chunk.last());
        let doomed: Vec<u64> = (self.journal.iter().take(rows_max))
            .filter(|(&first, c)| {
                let old = by_count.is_some_and(|t| c.last() <= t);
                first < newest && c.last() < held && (old || c.written_unix_ms < cutoff_unix_ms)
            })
            .map(|(&first, _)| first)
            .collect();
        for first in doomed {
            self.journal.remove(&first);
        }
    }

    /// The first entry retention keeps (issue 32 finding 8): the first of the oldest
    /// live run's, of the oldest scope's, and of an export under way, but never more
    /// than `JOURNAL_HELD_MAX` behind the last.
    fn journal_held(&self, policy: &Retention, last: u64) -> u64 {
        let live = self.runs.values().filter(|r| !r.run.state.is_terminal());
        let run = live.map(|r| r.run.journal_first).filter(|f| *f > 0).min();
        let scope = self
            .scopes
            .values()
            .map(|s| s.journal_first)
            .filter(|f| *f > 0)
            .min();
        let export = policy
            .journal_hold
            .as_ref()
            .map_or(u64::MAX, |h| h.load(std::sync::atomic::Ordering::Acquire));
        (run.unwrap_or(u64::MAX)
            .min(scope.unwrap_or(u64::MAX))
            .min(export))
        .max(last.saturating_sub(JOURNAL_HELD_MAX))
    }
}

/// SQLite's `Chunk::push` refusals: out of order, or what `record_len` refuses.
fn check_entry(e: &JournalEntry, last: u64) -> Result<(), StoreError> {
    let refuse = |why: String| StoreError::Write(format!("journal entry {}: {why}", e.seq));
    if e.seq <= last {
        return Err(refuse(format!("is not after the last before it, {last}")));
    }
    record_len(e).map(|_| ()).map_err(refuse)
}

/// SQLite's `write_thread` refusal: a thread is registered by its owner only.
fn check_thread(r: &ThreadRecord) -> Result<(), StoreError> {
    let t = &r.thread;
    match &t.registration {
        Some(g) if t.owner.as_ref() != Some(&g.owner) => Err(StoreError::Write(format!(
            "thread {}: a registration not by its owner",
            t.key
        ))),
        _ => Ok(()),
    }
}

/// The bytes an entry adds to its chunk's text in SQLite: `kind TAB run TAB project
/// TAB line LF`, an absent field empty.
fn text_len(e: &JournalEntry) -> usize {
    let field = |f: &Option<String>| f.as_ref().map_or(0, String::len);
    e.kind.len() + field(&e.run_id) + field(&e.project) + e.line.len() + 4
}

/// B4: writing a receipt of `generation` drops its scope's receipts at or below the
/// generation returned, so the newest `RECEIPTS_MAX` stay (SQLite's `write_receipt`;
/// below `RECEIPTS_MAX` it is 0, and a receipt of generation 0 goes at once there too).
fn receipts_kept_from(generation: u64) -> u64 {
    generation.saturating_sub(RECEIPTS_MAX as u64)
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests;
