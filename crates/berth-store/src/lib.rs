//! berth-store: the durable ledger (D1–D4).
//!
//! [`Store`] is what the server needs from a ledger: load what a restart needs, write a
//! group of batches in one durable transaction, and forget ended runs past the
//! retention policy. A [`Batch`] is a list of [`Mutation`]s, a closed enum: adding a
//! durable thing is one arm there, one table in each store and one conformance check. [`SqliteStore`] is the embedded
//! default (WAL, `synchronous=FULL`, `BEGIN IMMEDIATE`, schema migrations by version).
//! [`MemStore`] keeps the same ledger in memory, by the same rules, for the daemon simulator.
//! [`Writer`] owns a store on one thread and commits whatever batches are waiting in a
//! single transaction, so concurrent requests share one fsync (group commit).
//! [`conformance`] is the test suite every store implementation must pass.
//!
//! Only this crate knows SQL.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use berth_core::{EndCause, KeyMode, Request, RunState};

pub mod conformance;
pub mod fleet;
mod mem;
mod sqlite;

pub use mem::MemStore;
pub use sqlite::SqliteStore;

/// What went wrong, in two kinds the writer treats differently: [`StoreError::Conflict`]
/// refused one batch and wrote nothing of it (a fleet store's answer to a lost race;
/// the ledger is fine and the writer goes on), every other variant means the ledger
/// cannot be trusted (D4: the daemon stops; see [`StoreError::is_fatal`]).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Refused, nothing written: the batch conflicts with what the ledger holds.
    #[error("ledger refused the change (nothing written): {0}")]
    Conflict(String),
    #[error("ledger {path}: {message}")]
    Open { path: String, message: String },
    #[error("ledger is corrupt or unreadable: {0}")]
    Corrupt(String),
    #[error("ledger schema version {found} is newer than this berth understands ({supported})")]
    TooNew { found: i64, supported: i64 },
    #[error("ledger write failed: {0}")]
    Write(String),
    #[error("the ledger writer has stopped")]
    Stopped,
}

impl StoreError {
    /// False only for a refusal that wrote nothing and left the ledger sound.
    pub fn is_fatal(&self) -> bool {
        !matches!(self, StoreError::Conflict(_))
    }
}

/// Where a run's workspace is and what it was when berth created it (W1).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkspaceIdentity {
    pub path: String,
    pub dev: u64,
    pub ino: u64,
}

/// A process a run owns, by identity (P1): never a pid alone.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ProcessRecord {
    pub pid: i32,
    pub start_ticks: u64,
    pub boot_id: String,
}

/// Everything berth must remember about one run. Times are CLOCK_MONOTONIC
/// milliseconds of the boot named in the ledger's `boot_id`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunRecord {
    pub request: Request,
    pub worktree: Option<String>,
    pub labels: BTreeMap<String, String>,
    pub state: RunState,
    pub fence: Option<u64>,
    /// Arrival order across the whole host; restores queue order (P5).
    pub queue_seq: u64,
    pub enqueued_ms: u64,
    pub deadline_ms: u64,
    pub granted_ms: Option<u64>,
    pub expires_ms: Option<u64>,
    pub end_cause: Option<EndCause>,
    /// Mode of the run's primary key (runtime or analysis).
    pub primary_mode: KeyMode,
    /// C4: queued for the exclusive primary key it gave up its shared hold for
    /// (holds nothing on it until then).
    pub upgrading: bool,
    pub workspace: Option<WorkspaceIdentity>,
    /// Processes registered for the run (recorded before berth relies on them).
    pub processes: Vec<ProcessRecord>,
    /// The run's own grace between SIGTERM and SIGKILL, if it asked for one.
    pub stop_grace_ms: Option<u64>,
    /// The ports its contract declares, by name, with the number allocated at grant
    /// (0 until then) (W3). Kept while the run lives; gone once it has ended.
    pub ports: Vec<(String, u16)>,
    /// A detached waiter: no connection holds its place (A9 does not apply), so a
    /// restart restores it without a reconnect window.
    pub detached: bool,
    /// G0: the agent thread the run works in.
    pub thread: Option<String>,
    /// A lease only: no workspace is made at its grant (`"workspace": false`).
    pub lease_only: bool,
    /// S9: the uid of the uid-bound token that made the run (`None`: a token without a
    /// uid, or the admin token). Only tokens of that uid, and unbound ones, act on it.
    pub owner_uid: Option<u32>,
    /// The run's first journal entry (0: unknown): retention keeps the journal from
    /// the oldest live run's first entry on (issue 32 finding 8).
    pub journal_first: u64,
}

/// One durable change. Closed on purpose: every store must handle every arm, and each
/// arm has its own table and its own conformance check.
// Nearly every mutation is a run: boxing it would add an allocation to each for the
// sake of the rare small ones.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mutation {
    /// The fence counter is at least this; it never goes down, whatever order batches
    /// arrive in (L1).
    Fence(u64),
    /// A run's whole record, inserted or updated; a terminal state is never
    /// overwritten (D3), and processes only ever add up (P1).
    Run(RunRecord),
    /// A token, by the hash of its secret, and what it grants.
    Token { hash: String, scope: String },
    /// A token revoked: gone, by the hash of its secret.
    TokenRevoked { hash: String },
    /// C3/C4: a project's promotion evidence, written when a run proves it and
    /// removed (`None`) when it is invalidated.
    Evidence {
        project: String,
        evidence: Option<berth_core::Evidence>,
    },
    /// D5: one journal entry, written in the same transaction as the change it
    /// describes, so the journal and the state never disagree after a crash.
    /// Shared (`Arc`) with the readers the entry is published to once it is durable.
    Journal(std::sync::Arc<JournalEntry>),
    /// G0–G2: a thread's whole record (its owner kept for good, its registration, its
    /// workspace and the evictions of its audit trail), inserted or replaced.
    Thread(ThreadRecord),
    /// G4: the host's drain, started (`Some`) or ended (`None`).
    Drain(Option<DrainRecord>),
    /// B1/B4: a scope's frozen policy, control state and generation, replaced whole.
    Scope(ScopeRecord),
    /// S10: a scope forgotten (idle past its window, or deleted by an operator):
    /// its row, its receipts and its tokens (it has none: only idle scopes go).
    ScopeDeleted(String),
    /// B4: an accepted control request's receipt.
    ScopeReceipt {
        scope: String,
        receipt: berth_core::scopes::Receipt,
    },
    /// B2/B3: a budget token taken or changed (`Some`), or freed (`None`).
    BudgetToken {
        scope: String,
        owner: String,
        operation: String,
        token: Option<berth_core::scopes::Token>,
    },
}

/// A scope as its own row keeps it (receipts and tokens are rows of their own).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScopeRecord {
    pub id: String,
    pub policy: berth_core::scopes::Policy,
    pub manifest: Option<berth_core::scopes::Manifest>,
    pub control: berth_core::scopes::Control,
    pub generation: u64,
    /// S9: the uid of the uid-bound token whose run froze it (`None`: unbound).
    pub owner_uid: Option<u32>,
    /// Its `scope_frozen` entry (0: unknown): retention keeps the journal from the
    /// oldest scope's on, so a scope's export is whole while the scope is remembered.
    pub journal_first: u64,
}

/// A thread as the ledger keeps it: the core's record and its workspace's identity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ThreadRecord {
    pub thread: berth_core::threads::Thread,
    pub workspace: Option<WorkspaceIdentity>,
    /// S9: the uid of the uid-bound token that made the thread (`None`: unbound).
    pub owner_uid: Option<u32>,
}

/// G4: who started the drain, when (RFC 3339) and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DrainRecord {
    pub by: String,
    pub at: String,
    pub reason: String,
}

/// One entry of the journal (D5). `line` is the whole entry as its reader gets it (a
/// JSON object, rendered once by the server): the store keeps the bytes, so an export
/// of the same prefix is always the same bytes. `seq` is gap-free: the daemon numbers
/// entries from the ledger's last one, and a write that fails stops the daemon (D4).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JournalEntry {
    pub seq: u64,
    pub kind: String,
    pub run_id: Option<String>,
    pub project: Option<String>,
    pub line: String,
}

/// The most journal entries one read returns: bounds the time a read holds the ledger
/// thread (about a millisecond), in front of the commits waiting behind it.
pub const JOURNAL_READ_MAX: usize = 1_000;
/// How many journal entries retention keeps per ended run it keeps: a lifecycle is
/// about six entries (queued, granted, renewed, released, ended, ...), so the journal
/// covers at least the runs the ledger still remembers.
pub const JOURNAL_ENTRIES_PER_RUN: usize = 16;

/// One command's durable effects: written whole or not at all.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Batch {
    pub mutations: Vec<Mutation>,
}

impl Batch {
    /// A batch of these runs' records and the fence counter after them.
    pub fn runs(last_fence: u64, runs: Vec<RunRecord>) -> Batch {
        let mut mutations = Vec::with_capacity(runs.len() + 1);
        mutations.push(Mutation::Fence(last_fence));
        mutations.extend(runs.into_iter().map(Mutation::Run));
        Batch { mutations }
    }

    pub fn push(&mut self, m: Mutation) {
        self.mutations.push(m);
    }

    /// Nothing to write (a fence alone restates what the ledger holds at least).
    pub fn is_empty(&self) -> bool {
        self.mutations
            .iter()
            .all(|m| matches!(m, Mutation::Fence(_)))
    }
}

/// Which ended runs the ledger keeps: the `ended_max` most recent, and none that ended
/// more than `ended_age_ms` ago. Live runs are always kept. Pruned in the background
/// (see [`Writer::spawn_retaining`]), so restart time and memory stay flat however long
/// the daemon has run.
#[derive(Clone, Debug, Default)]
pub struct Retention {
    pub ended_max: usize,
    pub ended_age_ms: u64,
    /// The first journal entry a reader still needs (an export under way: its range
    /// must not move under it), `u64::MAX` for none: kept whatever else the policy says.
    pub journal_hold: Option<Arc<std::sync::atomic::AtomicU64>>,
}

/// The most journal entries retention keeps for the sake of live runs and remembered
/// scopes (issue 32 finding 8): about 1.2 GiB. A scope stopped for good would
/// otherwise hold every entry after its first forever; past this the oldest go anyway
/// (and an export of them answers `410 journal_pruned`).
pub const JOURNAL_HELD_MAX: u64 = 4_194_304;

/// The most ended runs one prune deletes: bounds how long it holds the ledger (a few
/// milliseconds), so commits never wait long behind it.
pub const PRUNE_ROWS_MAX: usize = 500;
/// How often the writer prunes while the ledger has nothing left to prune: often
/// enough that steady churn (every lifecycle eventually deletes one row) is pruned in
/// small steps rather than in one long drain.
pub const PRUNE_INTERVAL_MS: u64 = 1_000;
/// How soon it prunes again after a full chunk: a backlog (a ledger from before
/// retention, a lowered limit, or churn faster than `PRUNE_INTERVAL_MS` keeps up with)
/// drains at up to ~50,000 rows a second.
pub const PRUNE_BACKLOG_PAUSE_MS: u64 = 10;

/// What a restarting daemon reads back.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ledger {
    pub last_fence: u64,
    pub boot_id: Option<String>,
    /// Live runs and the most recent ended ones, in `queue_seq` order.
    pub runs: Vec<RunRecord>,
    pub next_queue_seq: u64,
    pub tokens: Vec<(String, String)>,
    /// Promotion evidence by project (C3), as last written.
    pub evidence: Vec<(String, berth_core::Evidence)>,
    /// The journal's last sequence number (0: empty). Retention never deletes the
    /// last entry, so numbering continues after a restart without a repeat.
    pub journal_last: u64,
    /// Every thread remembered, by key.
    pub threads: Vec<ThreadRecord>,
    /// The drain in force, if any.
    pub drain: Option<DrainRecord>,
    /// Every experiment scope, with its receipts and tokens (B1–B5).
    pub scopes: Vec<berth_core::scopes::Scope>,
}

pub trait Store: Send + 'static {
    /// Reads the ledger: every live run and at most `ended_max` of the latest ended ones.
    fn load(&mut self, ended_max: usize) -> Result<Ledger, StoreError>;
    /// Writes all batches in one transaction; returns once it is durable. A
    /// [`StoreError::Conflict`] means none of them was written.
    fn write(&mut self, batches: &[&Batch]) -> Result<(), StoreError>;
    fn set_boot_id(&mut self, boot_id: &str) -> Result<(), StoreError>;
    /// Deletes at most `rows_max` ended runs that `policy` no longer keeps (as of
    /// `now_unix_ms`), oldest first, with their processes; returns how many.
    fn prune(
        &mut self,
        policy: &Retention,
        now_unix_ms: u64,
        rows_max: usize,
    ) -> Result<usize, StoreError>;
    /// Journal entries after `after`, in order, at most `limit` (and `JOURNAL_READ_MAX`).
    fn journal(&mut self, after: u64, limit: usize) -> Result<Vec<JournalEntry>, StoreError>;
    /// The first journal entry retention has kept (0: empty).
    fn journal_first(&mut self) -> Result<u64, StoreError>;
}

type Done = Box<dyn FnOnce(Result<(), &StoreError>) + Send>;
type Read = Box<dyn FnOnce(&mut dyn Store) + Send>;

struct Job {
    batch: Option<Batch>,
    /// A read of the ledger, made after every write submitted before it is durable.
    read: Option<Read>,
    done: Done,
    /// The last job: the thread ends after it (readers may still hold senders).
    stop: bool,
}

/// Told of each commit: how long the transaction took (fsync included) and how many
/// batches it carried. Called once the commit's jobs have all been answered, so what
/// their `done` callbacks made visible can be announced once for the whole commit
/// (the journal wakes its live readers here, not once per batch). It runs on the
/// writer thread, so it must be quick.
pub type CommitObserver = Arc<dyn Fn(Duration, usize) + Send + Sync>;

/// Owns a store on its own thread; commits waiting batches together (group commit).
/// `done` callbacks run on the writer thread after the commit, in submission order.
pub struct Writer {
    tx: mpsc::Sender<Job>,
    commits: Arc<AtomicU64>,
    pruned: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// The most batches one transaction takes; bounds a commit's latency.
pub const GROUP_MAX: usize = 4096;
/// How long a commit under load waits for more batches.
pub const GROUP_WINDOW_US: u64 = 300;

/// The writer thread's own state.
struct Committer {
    store: Box<dyn Store>,
    group: bool,
    retention: Option<Retention>,
    commits: Arc<AtomicU64>,
    pruned: Arc<AtomicU64>,
    /// D4: after a fatal error nothing more is written; every later job gets it.
    failed: Option<StoreError>,
    /// The last commit carried several batches: the next one waits a little for more.
    contended: bool,
    prune_at: Instant,
    observer: Option<CommitObserver>,
}

impl Committer {
    fn run(mut self, rx: mpsc::Receiver<Job>) {
        loop {
            let wait = self.prune_at.saturating_duration_since(Instant::now());
            let first = match rx.recv_timeout(wait) {
                Ok(job) => job,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    self.prune();
                    continue;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            };
            let jobs = self.gather(first, &rx);
            let stop = jobs.iter().any(|j| j.stop);
            self.commit(jobs);
            if stop {
                return;
            }
            // Under sustained load the channel is never idle: prune between commits.
            if Instant::now() >= self.prune_at {
                self.prune();
            }
        }
    }

    /// The first job and whatever else is waiting, up to `GROUP_MAX`.
    fn gather(&self, first: Job, rx: &mpsc::Receiver<Job>) -> Vec<Job> {
        let mut jobs = vec![first];
        if !self.group {
            return jobs;
        }
        // Under load (the last commit carried several batches), sleep a little before
        // taking what is queued: one fsync then serves more writes. Sleeping, not
        // waiting on the channel, so the arrivals do not wake this thread one by one.
        // Alone, never wait.
        if self.contended {
            std::thread::sleep(Duration::from_micros(GROUP_WINDOW_US));
        }
        while jobs.len() < GROUP_MAX {
            match rx.try_recv() {
                Ok(j) => jobs.push(j),
                Err(_) => break,
            }
        }
        jobs
    }

    /// Writes the jobs' batches in one transaction, then answers each job in order. A
    /// conflict refuses only the batch that caused it: the group is written again one
    /// batch at a time, so the others still commit.
    fn commit(&mut self, jobs: Vec<Job>) {
        let writes: Vec<usize> = (0..jobs.len())
            .filter(|&i| jobs[i].batch.as_ref().is_some_and(|b| !b.is_empty()))
            .collect();
        self.contended = writes.len() > 1;
        let mut refused: Vec<Option<StoreError>> = jobs.iter().map(|_| None).collect();
        let mut committed = None;
        if self.failed.is_none() && !writes.is_empty() {
            let batches: Vec<&Batch> = writes
                .iter()
                .filter_map(|&i| jobs[i].batch.as_ref())
                .collect();
            let started = Instant::now();
            match self.store.write(&batches) {
                Ok(()) => {
                    self.commits.fetch_add(1, Ordering::Relaxed);
                    committed = Some((started.elapsed(), batches.len()));
                }
                Err(e) if e.is_fatal() => self.failed = Some(e),
                Err(e) if writes.len() == 1 => refused[writes[0]] = Some(e),
                Err(_) => {
                    for &i in &writes {
                        if self.failed.is_some() {
                            break;
                        }
                        let b = jobs[i].batch.as_ref().expect("a write");
                        match self.store.write(&[b]) {
                            Ok(()) => {
                                self.commits.fetch_add(1, Ordering::Relaxed);
                                let n = committed.map_or(0, |(_, n)| n);
                                committed = Some((started.elapsed(), n + 1));
                            }
                            Err(e) if e.is_fatal() => self.failed = Some(e),
                            Err(e) => refused[i] = Some(e),
                        }
                    }
                }
            }
        }
        for (job, refused) in jobs.into_iter().zip(refused) {
            if let Some(read) = job.read {
                read(&mut *self.store);
            }
            (job.done)(match (&self.failed, &refused) {
                (Some(e), _) | (None, Some(e)) => Err(e),
                (None, None) => Ok(()),
            });
        }
        if let (Some((took, batches)), Some(observe)) = (committed, &self.observer) {
            observe(took, batches);
        }
    }

    /// One bounded prune; again soon if there was more to delete.
    fn prune(&mut self) {
        let Some(policy) = self.retention.clone().filter(|_| self.failed.is_none()) else {
            self.prune_at = Instant::now() + Duration::from_secs(3600);
            return;
        };
        let now_unix_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let pause = match self.store.prune(&policy, now_unix_ms, PRUNE_ROWS_MAX) {
            Ok(n) => {
                self.pruned.fetch_add(n as u64, Ordering::Relaxed);
                if n == PRUNE_ROWS_MAX {
                    PRUNE_BACKLOG_PAUSE_MS
                } else {
                    PRUNE_INTERVAL_MS
                }
            }
            // Not fatal: what was to be forgotten stays a little longer; said once per
            // interval.
            Err(e) => {
                tracing::warn!("ledger retention: {e}");
                PRUNE_INTERVAL_MS
            }
        };
        self.prune_at = Instant::now() + Duration::from_millis(pause);
    }
}

impl Writer {
    /// `group`: commit waiting batches together (true) or one per transaction (false,
    /// the benchmark's baseline). After a fatal error the writer stops writing: D4
    /// says the daemon must not go on guessing. No retention: nothing is deleted.
    pub fn spawn(store: Box<dyn Store>, group: bool) -> Writer {
        Writer::spawn_retaining(store, group, None)
    }

    /// Like [`Writer::spawn`], and ended runs past `retention` are pruned on this
    /// thread, `PRUNE_ROWS_MAX` at a time, between commits.
    pub fn spawn_retaining(
        store: Box<dyn Store>,
        group: bool,
        retention: Option<Retention>,
    ) -> Writer {
        Writer::spawn_observed(store, group, retention, None)
    }

    /// Like [`Writer::spawn_retaining`], and `observer` is told of every commit.
    pub fn spawn_observed(
        store: Box<dyn Store>,
        group: bool,
        retention: Option<Retention>,
        observer: Option<CommitObserver>,
    ) -> Writer {
        let (tx, rx) = mpsc::channel::<Job>();
        let commits = Arc::new(AtomicU64::new(0));
        let pruned = Arc::new(AtomicU64::new(0));
        let committer = Committer {
            store,
            group,
            retention,
            commits: commits.clone(),
            pruned: pruned.clone(),
            failed: None,
            contended: false,
            // The first prune soon after start: a backlog starts draining at once.
            prune_at: Instant::now() + Duration::from_millis(PRUNE_BACKLOG_PAUSE_MS),
            observer,
        };
        let thread = std::thread::Builder::new()
            .name("berth-ledger".into())
            .spawn(move || committer.run(rx))
            .expect("spawn ledger thread");
        Writer {
            tx,
            commits,
            pruned,
            thread: Some(thread),
        }
    }

    /// Queues a batch (or `None`: just wait for everything before it to be durable).
    pub fn submit(
        &self,
        batch: Option<Batch>,
        done: impl FnOnce(Result<(), &StoreError>) + Send + 'static,
    ) {
        let job = Job {
            batch,
            read: None,
            done: Box::new(done),
            stop: false,
        };
        if let Err(mpsc::SendError(job)) = self.tx.send(job) {
            (job.done)(Err(&StoreError::Stopped));
        }
    }

    /// A handle that reads the ledger on the writer thread (the daemon's connection is
    /// the only one: it holds SQLite's exclusive lock, S5).
    pub fn reader(&self) -> LedgerReader {
        LedgerReader {
            tx: self.tx.clone(),
        }
    }

    /// Transactions committed so far.
    pub fn commits(&self) -> u64 {
        self.commits.load(Ordering::Relaxed)
    }

    /// Ended runs deleted by retention so far.
    pub fn pruned(&self) -> u64 {
        self.pruned.load(Ordering::Relaxed)
    }

    /// The count behind [`Writer::pruned`], for whoever reports it without the writer.
    pub fn pruned_counter(&self) -> Arc<AtomicU64> {
        self.pruned.clone()
    }

    /// Waits until everything submitted so far is durable, then stops the thread.
    pub fn close(mut self) {
        // Said outright: a `LedgerReader` may still hold a sender, so the channel
        // alone would never tell the thread to end.
        let _ = self.tx.send(Job {
            batch: None,
            read: None,
            done: Box::new(|_| {}),
            stop: true,
        });
        let (tx, _) = mpsc::channel();
        drop(std::mem::replace(&mut self.tx, tx));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Reads the ledger between commits, on the writer thread. Each read sees every write
/// submitted before it, durable. Clone it freely; it never blocks its caller.
#[derive(Clone)]
pub struct LedgerReader {
    tx: mpsc::Sender<Job>,
}

impl LedgerReader {
    /// Runs `f` on the store; `done` gets its result, or `Stopped` if the writer is gone.
    pub fn read<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut dyn Store) -> Result<T, StoreError> + Send + 'static,
        done: impl FnOnce(Result<T, StoreError>) + Send + 'static,
    ) {
        let slot: Arc<std::sync::Mutex<Option<Result<T, StoreError>>>> = Default::default();
        let out = slot.clone();
        let job = Job {
            batch: None,
            read: Some(Box::new(move |store: &mut dyn Store| {
                *out.lock().unwrap_or_else(|p| p.into_inner()) = Some(f(store));
            })),
            done: Box::new(move |_| {
                let got = slot.lock().unwrap_or_else(|p| p.into_inner()).take();
                done(got.unwrap_or(Err(StoreError::Stopped)));
            }),
            stop: false,
        };
        if let Err(mpsc::SendError(job)) = self.tx.send(job) {
            (job.done)(Err(&StoreError::Stopped));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// A store that refuses (a conflict) any batch holding the token `conflict`, fails
    /// for good at the token `broken`, and records what it committed.
    struct Picky {
        committed: Arc<Mutex<Vec<String>>>,
    }

    fn tokens(b: &Batch) -> impl Iterator<Item = &str> {
        b.mutations.iter().filter_map(|m| match m {
            Mutation::Token { hash, .. } => Some(hash.as_str()),
            _ => None,
        })
    }

    impl Store for Picky {
        fn load(&mut self, _: usize) -> Result<Ledger, StoreError> {
            Ok(Ledger::default())
        }
        fn write(&mut self, batches: &[&Batch]) -> Result<(), StoreError> {
            let all: Vec<&str> = batches.iter().flat_map(|b| tokens(b)).collect();
            if all.contains(&"broken") {
                return Err(StoreError::Write("disk gone".into()));
            }
            if all.contains(&"conflict") {
                return Err(StoreError::Conflict("taken".into()));
            }
            self.committed
                .lock()
                .unwrap()
                .extend(all.iter().map(|t| t.to_string()));
            Ok(())
        }
        fn set_boot_id(&mut self, _: &str) -> Result<(), StoreError> {
            Ok(())
        }
        fn prune(&mut self, _: &Retention, _: u64, _: usize) -> Result<usize, StoreError> {
            Ok(0)
        }
        fn journal(&mut self, _: u64, _: usize) -> Result<Vec<JournalEntry>, StoreError> {
            Ok(Vec::new())
        }
        fn journal_first(&mut self) -> Result<u64, StoreError> {
            Ok(0)
        }
    }

    fn token(hash: &str) -> Batch {
        Batch {
            mutations: vec![Mutation::Token {
                hash: hash.into(),
                scope: "read".into(),
            }],
        }
    }

    /// A conflict refuses only its own batch, even inside a group, and the writer goes
    /// on; a fatal error fails its whole group (one transaction) and every later write
    /// (D4).
    #[test]
    fn a_conflict_refuses_one_batch_and_a_fatal_error_stops_the_writer() {
        let committed = Arc::new(Mutex::new(Vec::new()));
        let writer = Writer::spawn(
            Box::new(Picky {
                committed: committed.clone(),
            }),
            true,
        );
        let (tx, rx) = mpsc::channel();
        let group = |names: &[&'static str]| {
            // Held until all are queued, so they go out as one group.
            let (hold_tx, hold) = mpsc::channel::<()>();
            writer.submit(None, move |_| {
                let _ = hold.recv();
            });
            for &t in names {
                let tx = tx.clone();
                writer.submit(Some(token(t)), move |r| {
                    tx.send((t, r.map_err(|e| e.is_fatal()))).unwrap()
                });
            }
            hold_tx.send(()).unwrap();
            (0..names.len())
                .map(|_| rx.recv().unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(
            group(&["a", "conflict", "b"]),
            [("a", Ok(())), ("conflict", Err(false)), ("b", Ok(()))]
        );
        assert_eq!(
            group(&["d", "broken"]),
            [("d", Err(true)), ("broken", Err(true))]
        );
        assert_eq!(group(&["e"]), [("e", Err(true))]);
        writer.close();
        assert_eq!(*committed.lock().unwrap(), ["a", "b"]);
    }

    /// The observer hears of a commit once, after every job of it was answered (the
    /// journal relies on this to wake its readers once per commit with everything in
    /// place), and so after a group that fell back to one batch at a time.
    #[test]
    fn the_observer_hears_of_a_commit_once_its_jobs_are_answered() {
        let answered = Arc::new(AtomicU64::new(0));
        let (seen_tx, seen) = mpsc::channel();
        let counted = answered.clone();
        let observer: CommitObserver = Arc::new(move |_, batches| {
            let done = counted.load(Ordering::SeqCst);
            seen_tx.send((batches, done)).unwrap();
        });
        let writer = Writer::spawn_observed(
            Box::new(Picky {
                committed: Arc::default(),
            }),
            true,
            None,
            Some(observer),
        );
        let timeout = Duration::from_secs(10);
        // The first group commits whole; the second, refused once, commits its two
        // good batches one at a time: one word for each group, after all its answers.
        let groups = [
            (&["a", "b", "c"][..], (3, 3)),
            (&["d", "conflict", "e"][..], (2, 6)),
        ];
        for (names, heard) in groups {
            let (hold_tx, hold) = mpsc::channel::<()>();
            writer.submit(None, move |_| {
                let _ = hold.recv();
            });
            for &t in names {
                let answered = answered.clone();
                writer.submit(Some(token(t)), move |_| {
                    answered.fetch_add(1, Ordering::SeqCst);
                });
            }
            hold_tx.send(()).unwrap();
            assert_eq!(seen.recv_timeout(timeout), Ok(heard), "{names:?}");
        }
        assert!(seen.recv_timeout(Duration::from_millis(200)).is_err());
        writer.close();
    }

    /// Regression: a held `LedgerReader` kept the writer's channel open, so `close`
    /// waited for ever and the daemon never stopped on SIGTERM.
    #[test]
    fn close_ends_the_writer_while_a_reader_is_still_held() {
        let writer = Writer::spawn(
            Box::new(Picky {
                committed: Arc::default(),
            }),
            true,
        );
        let reader = writer.reader();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            writer.close();
            let _ = tx.send(());
        });
        assert!(
            rx.recv_timeout(Duration::from_secs(10)).is_ok(),
            "close() is still waiting for the ledger thread"
        );
        // A read after the close is told the writer has stopped.
        let (tx, rx) = mpsc::channel();
        reader.read(|s| s.journal_first(), move |r| tx.send(r.is_err()).unwrap());
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)), Ok(true));
    }
}
