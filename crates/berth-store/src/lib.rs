//! berth-store: the durable ledger (D1–D4).
//!
//! [`Store`] is what the server needs from a ledger: load everything at startup, and
//! write a group of batches in one durable transaction. [`SqliteStore`] is the embedded
//! default (WAL, `synchronous=FULL`, `BEGIN IMMEDIATE`, schema migrations by version).
//! [`Writer`] owns a store on one thread and commits whatever batches are waiting in a
//! single transaction, so concurrent requests share one fsync (group commit).
//! [`conformance`] is the test suite every store implementation must pass.
//!
//! Only this crate knows SQL.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;

use berth_core::{EndCause, KeyMode, Request, RunState};

pub mod conformance;
mod sqlite;

pub use sqlite::SqliteStore;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
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
    pub workspace: Option<WorkspaceIdentity>,
    /// Processes registered for the run (recorded before berth relies on them).
    pub processes: Vec<ProcessRecord>,
    /// The run's own grace between SIGTERM and SIGKILL, if it asked for one.
    pub stop_grace_ms: Option<u64>,
}

/// One command's durable effects.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Batch {
    /// The fence counter after this batch; the store never lets it go down (L1).
    pub last_fence: u64,
    pub runs: Vec<RunRecord>,
    /// Token hashes to add: (hash hex, scope).
    pub tokens: Vec<(String, String)>,
}

impl Batch {
    pub fn is_empty(&self) -> bool {
        self.runs.is_empty() && self.tokens.is_empty()
    }
}

/// What a restarting daemon reads back.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ledger {
    pub last_fence: u64,
    pub boot_id: Option<String>,
    /// Live runs and the most recent ended ones, in `queue_seq` order.
    pub runs: Vec<RunRecord>,
    pub next_queue_seq: u64,
    pub tokens: Vec<(String, String)>,
}

pub trait Store: Send + 'static {
    /// Reads the ledger: every live run and at most `ended_max` of the latest ended ones.
    fn load(&mut self, ended_max: usize) -> Result<Ledger, StoreError>;
    /// Writes all batches in one transaction; returns once it is durable.
    fn write(&mut self, batches: &[&Batch]) -> Result<(), StoreError>;
    fn set_boot_id(&mut self, boot_id: &str) -> Result<(), StoreError>;
}

type Done = Box<dyn FnOnce(Result<(), &StoreError>) + Send>;

struct Job {
    batch: Option<Batch>,
    done: Done,
}

/// Owns a store on its own thread; commits waiting batches together (group commit).
/// `done` callbacks run on the writer thread after the commit, in submission order.
pub struct Writer {
    tx: mpsc::Sender<Job>,
    commits: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// The most batches one transaction takes; bounds a commit's latency.
pub const GROUP_MAX: usize = 4096;
/// How long a commit under load waits for more batches.
pub const GROUP_WINDOW_US: u64 = 300;

impl Writer {
    /// `group`: commit waiting batches together (true) or one per transaction (false,
    /// the benchmark's baseline). After a failed write the writer stops: D4 says the
    /// daemon must not go on guessing.
    pub fn spawn(mut store: Box<dyn Store>, group: bool) -> Writer {
        let (tx, rx) = mpsc::channel::<Job>();
        let commits = Arc::new(AtomicU64::new(0));
        let counter = commits.clone();
        let thread = std::thread::Builder::new()
            .name("berth-ledger".into())
            .spawn(move || {
                let mut failed: Option<StoreError> = None;
                let mut contended = false;
                while let Ok(first) = rx.recv() {
                    let mut jobs = vec![first];
                    if group {
                        // Under load (the last commit carried several batches), sleep a
                        // little before taking what is queued: one fsync then serves more
                        // writes. Sleeping, not waiting on the channel, so the arrivals
                        // do not wake this thread one by one. Alone, never wait.
                        if contended {
                            std::thread::sleep(std::time::Duration::from_micros(GROUP_WINDOW_US));
                        }
                        while jobs.len() < GROUP_MAX {
                            match rx.try_recv() {
                                Ok(j) => jobs.push(j),
                                Err(_) => break,
                            }
                        }
                    }
                    let batches: Vec<&Batch> = jobs
                        .iter()
                        .filter_map(|j| j.batch.as_ref())
                        .filter(|b| !b.is_empty())
                        .collect();
                    contended = batches.len() > 1;
                    if failed.is_none() && !batches.is_empty() {
                        match store.write(&batches) {
                            Ok(()) => {
                                counter.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) => failed = Some(e),
                        }
                    }
                    for job in jobs {
                        (job.done)(match &failed {
                            None => Ok(()),
                            Some(e) => Err(e),
                        });
                    }
                }
            })
            .expect("spawn ledger thread");
        Writer {
            tx,
            commits,
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
            done: Box::new(done),
        };
        if let Err(mpsc::SendError(job)) = self.tx.send(job) {
            (job.done)(Err(&StoreError::Stopped));
        }
    }

    /// Transactions committed so far.
    pub fn commits(&self) -> u64 {
        self.commits.load(Ordering::Relaxed)
    }

    /// Waits until everything submitted so far is durable, then stops the thread.
    pub fn close(mut self) {
        let (tx, _) = mpsc::channel();
        drop(std::mem::replace(&mut self.tx, tx));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
