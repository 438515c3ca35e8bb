//! The daemon's state machine: the one owner of the engine and the ledger writer.
//!
//! HTTP handlers talk to it only through [`Msg`]; [`Daemon::handle`] applies each
//! message to the engine, carries out what it sets off (workspaces, stops), hands the
//! durable effects to the writer and answers the caller once they are durable (D1).
//! Reads also wait behind every write queued before them, so nobody ever sees state
//! that a crash could take back.
//!
//! Like the engine it wraps, the daemon never reads the clock: time comes in with every
//! message (`handle(now, msg)`, `tick(now, sample)`, `restore(now, …)`). Everything it
//! needs done to the machine goes through [`Host`]; the thin runtime in `runtime.rs`
//! feeds it messages and time, and `sim.rs` drives it deterministically with a fake
//! host, failed cleanups, stops and restarts.

mod ask;
mod commit;
mod events;
mod extra;
mod fleet;
mod fleet_shared;
mod freeze;
mod handlers;
mod host;
mod journal;
mod msg;
mod ports;
mod processes;
mod restore;
mod runtime;
mod runtimes;
mod scopes;
mod shell;
#[cfg(test)]
mod sim;
#[cfg(test)]
mod tests;
mod threads;
mod view;

/// Held by the tests that drive a daemon in this process: tracing caches per call site
/// whether anyone listens, so a daemon logging on one test thread with no subscriber
/// could hide the lines another test is capturing.
#[cfg(test)]
static LOGGING_TESTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, RwLock};

use berth_core::{Command, EndCause, Engine, Error as CoreError, Event, RunState, RunView};
use berth_store::{Batch, RunRecord, StoreError};
use tokio::sync::watch;

use crate::auth::Grant;
use crate::workspace;
use extra::{proc_id, Extra};
use ports::PortBroker;

pub use ask::{ask, register_off_task};
pub use fleet_shared::FleetChange;
pub use host::{
    Claimed, Enforcement, Host, ListenWatch, RealHost, StopOrder, StopSink, Supervision,
};
pub use msg::{Msg, RegistrationPlan, Reply};
pub use restore::Restore;
pub use runtime::{run, Sampler};
pub use runtimes::RuntimePlan;
pub use scopes::{ScopeAnswer, ScopeOp};
pub use shell::{Commit, Done, Effect, Effects, Shell};
pub use threads::ThreadOp;

/// A run as the API shows it: the engine's view plus what the server adds.
#[derive(Clone, Debug, PartialEq)]
pub struct RunInfo {
    pub view: RunView,
    pub worktree: Option<String>,
    pub labels: BTreeMap<String, String>,
    pub workspace: Option<String>,
    pub expires_at: Option<String>,
    /// A waiter's deadline (its `wait_s`).
    pub deadline: Option<String>,
    /// Acquired with `detach: true`.
    pub detached: bool,
    /// When it was granted (or queued, while it waits).
    pub since: Option<String>,
    /// `BERTH_*` (and `TMPDIR`) of a granted run.
    pub env: BTreeMap<Cow<'static, str>, String>,
    /// The ports a granted run holds, by name (W3).
    pub ports: BTreeMap<String, u16>,
    /// Pids that survived the last stop (a degraded run).
    pub survivors: Vec<i32>,
    /// Why a granted run was ended by berth itself at once (no workspace: W1).
    pub failure: Option<String>,
    /// S9: the uid of the uid-bound token that made it (`None`: an unbound token).
    pub owner_uid: Option<u32>,
    /// Issue 36: what its cgroup has used (live while it holds its claim, as its stop
    /// found it after), if it has one with controllers.
    pub usage: Option<berth_proc::limits::Usage>,
    /// Issue 36: the limits its cgroup is held to, where berth enforces them.
    pub limits: Option<berth_proc::limits::Limits>,
    /// Issue 36: paused under memory pressure (`--freeze-background`).
    pub frozen: bool,
    /// Issue 36: a granted run berth made no cgroup for (none on this host): its
    /// registered processes, whose trees the API reads its use from in `/proc`, off
    /// this thread (`api::runs::proc_usage`). Empty otherwise.
    pub roots: Vec<berth_proc::ProcId>,
}

/// S9: who a request acts for. `Some(uid)`: a uid-bound token below admin, which acts
/// only on runs, threads and scopes that tokens of that uid made. `None`: full reach
/// (the admin token, tokens made without a uid, no-auth mode).
pub type Tenant = Option<u32>;

/// S9: may a caller acting for `by` act on something made by `owner`?
pub fn may_act(by: Tenant, owner: Option<u32>) -> bool {
    by.is_none() || by == owner
}

pub use crate::error::Error;

/// Running totals for the reaper's report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReapCounters {
    pub processes_terminated: u64,
    pub reused_pids_protected: u64,
    pub diagnostics_bytes: u64,
    pub diagnostics_dropped: u64,
    /// Ended runs retention has deleted from the ledger since the daemon started.
    pub ledger_pruned: u64,
}

#[derive(Default)]
pub struct Shared {
    pub tokens: RwLock<Vec<(String, Grant)>>,
    /// S10: what each token holds open (streams, long polls) against its caps.
    pub limits: crate::limits::Limits,
    pub url: String,
    /// D5: the journal's readers (the daemon publishes each durable entry).
    pub journal: crate::journal::Journal,
    pub metrics: crate::metrics::Metrics,
    /// Raised (with a count) at most once per `QUEUE_MOVED_EVERY_MS` when the queue
    /// moved: a waiter came or went, or capacity was taken or given back, so positions
    /// and reasons may have changed without the waiters' own runs being touched. A
    /// stream of a waiter re-reads its position when this rises (A11), and never
    /// otherwise: one signal for every stream, no timer per waiter, nothing at all
    /// while nothing moves.
    pub queue_moved: watch::Sender<u64>,
    /// S3: what the registration rule knows of the daemon, for checks made off the
    /// state task (`None`: every check is made on it, as the simulator's are).
    pub me: Option<crate::register::Me>,
    /// Issue 36: whether runs' cgroups are held to their claims.
    pub enforcement: Enforcement,
}

/// Issue 36: registrations waiting for the next sample to settle their runs' claims,
/// at most (beyond it a run settles by the engine's window, as before).
pub const TO_SETTLE_MAX: usize = 4_096;

/// How often at most the queue's streams are told that it moved (issue: position
/// updates at most once a second per stream).
pub const QUEUE_MOVED_EVERY_MS: u64 = 1_000;

/// What the runtime read of the host for a tick (once a second; `None` between): the
/// engine's own sample, handed to it whole.
pub type Sample = berth_core::HostSample;

pub struct Daemon<H: Host> {
    /// CLOCK_MONOTONIC milliseconds, as the runtime said at the latest input (`handle`,
    /// `tick`, `restore`): the state machine never reads the clock itself.
    now: u64,
    engine: Engine,
    /// What the current step leaves to be done (commits, answers), handed to the shell
    /// by `handle` and `tick`: the daemon never writes to the ledger itself.
    effects: Vec<Effect>,
    /// Ended runs retention has deleted (the writer's count).
    pruned: Arc<std::sync::atomic::AtomicU64>,
    shared: Arc<Shared>,
    host: H,
    /// Boxed: an `Extra` is ~250 bytes, and a table sized for a deep queue's peak holds
    /// its room inline (10,000 retained runs kept 9 MB of it after a drain).
    extras: HashMap<String, Box<Extra>>,
    ended: VecDeque<String>,
    next_seq: u64,
    attached: HashMap<String, u32>,
    /// Restored waiters nobody has re-attached to yet, with their reclaim deadline.
    unclaimed: BTreeMap<String, u64>,
    /// The earliest reclaim deadline in `unclaimed` (or later: entries leave it without
    /// updating this): the tick looks at `unclaimed` only once it is due, so 10,000
    /// restored waiters cost it nothing per tick during their window.
    unclaimed_due: u64,
    watchers: HashMap<String, Arc<watch::Sender<RunInfo>>>,
    /// Runs whose stop or cleanup must be retried (degraded, or releasing after a
    /// restart): (failed attempts, next try at).
    cleanup_retry: BTreeMap<String, (u32, u64)>,
    fatal: Arc<crate::Fatal>,
    /// Runs whose processes are being stopped right now.
    stopping: BTreeSet<String>,
    counters: ReapCounters,
    /// Stops decided in this step, handed to the host's stopper after the commit.
    pending_stops: Vec<StopOrder>,
    /// Which ports live runs hold (W3).
    ports: PortBroker,
    /// Durable changes besides runs that this step set off (promotion evidence),
    /// written with its commit.
    pending_mutations: Vec<berth_store::Mutation>,
    /// The records of the runs this step ended, as they ended: written by its commit
    /// even if the engine has retired them by then.
    ended_records: HashMap<String, RunRecord>,
    /// C6: analysis runs with processes, and the listeners those held when registered.
    listen_watched: BTreeMap<String, BTreeSet<u64>>,
    /// C6: restored analysis runs with processes, watched again from the first tick
    /// (once the runtime has given the host its inbox).
    rewatch: Vec<String>,
    /// Issue 36: (run, fence) of runs whose process tree registered since the last
    /// sample: their pending claims settle once a sample sees them (`settle_started`).
    to_settle: Vec<(String, u64)>,
    /// Issue 36: background runs paused under memory pressure (`--freeze-background`).
    frozen: freeze::Frozen,
    /// D5: the next journal entry's sequence number (the ledger's last + 1).
    journal_next: u64,
    /// Processes registered so far: a check made off the state task holds only if no
    /// registration came between its plan and its record (issue 32 finding 7).
    registrations: u64,
    /// The time of the last journal entry, rendered (entries of one step share it).
    journal_at: (u64, String),
    /// Queue moves so far, and (count, time) of the last one told to `queue_moved`.
    queue_moves: u64,
    queue_moves_told: (u64, u64),
    /// When memory goes back to the system (`release_due`).
    held: Held,
    /// G0–G4: agent threads, their workspaces, the sweep and the drain.
    th: threads::ThreadState,
    /// F1–F3: the fleet-wide claims of this host's runs (fleet mode only).
    fleet: fleet::FleetState,
}

/// The runs the daemon holds (`extras`: live, queued and retained ended runs), as
/// `release_due` weighs them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Held {
    /// The most held since memory was last given back.
    pub peak: usize,
    /// Held at the last look, and since when (ms) that figure has not changed.
    pub last: usize,
    pub since_ms: u64,
}

/// How far below its peak the daemon's hold must fall before memory is given back:
/// below this, what the allocator keeps is small next to the daemon itself.
pub const RELEASE_DROP_MIN: usize = 1_024;
/// How long the hold must stay unchanged first: a drain is over, not under way (each
/// release walks the allocator's arenas, so it is done once per drain, not per tick).
pub const RELEASE_QUIET_MS: u64 = 2_000;

/// At a tick: the new `Held`, and whether to give memory back now (at least
/// `RELEASE_DROP_MIN` runs fewer than the peak, and no change for `RELEASE_QUIET_MS`).
/// A daemon whose hold never falls far never releases; one that drains releases once,
/// then measures its next drain from there.
pub fn release_due(h: Held, held: usize, now_ms: u64) -> (Held, bool) {
    let mut h = h;
    if held != h.last {
        h.last = held;
        h.since_ms = now_ms;
    }
    h.peak = h.peak.max(held);
    let due = h.peak - held >= RELEASE_DROP_MIN && now_ms >= h.since_ms + RELEASE_QUIET_MS;
    if due {
        h.peak = held;
    }
    (h, due)
}

/// Tables smaller than this are never shrunk (their room costs little).
const SHRINK_ROOM_MIN: usize = 4_096;

/// A table a deep queue grew gives its room back once it holds less than a quarter of
/// it: shrunk to a quarter more than it holds. Between two rehashes (each O(len)) at
/// least len/4 entries come (to grow again) or go (to be a quarter full again), so the
/// rehash is amortised O(1) per entry added or removed. (A `HashMap` never shrinks by
/// itself: 100,000 waiters that came and went left 30 MB of empty room.)
fn shrink_sparse<K: Eq + std::hash::Hash, V>(m: &mut HashMap<K, V>) {
    if m.capacity() > SHRINK_ROOM_MIN && m.capacity() > 4 * m.len() {
        m.shrink_to(m.len() + m.len() / 4);
    }
}

/// A failed stop or cleanup is tried again after 5 s, each next time twice as late,
/// at most every 5 minutes.
const CLEANUP_RETRY: berth_client::retry::Backoff =
    berth_client::retry::Backoff::new(5_000, 300_000);

impl<H: Host> Daemon<H> {
    pub fn host_mut(&mut self) -> &mut H {
        &mut self.host
    }

    fn reap_counters(&self) -> ReapCounters {
        let (diagnostics_bytes, diagnostics_dropped) = self.host.diagnostics();
        ReapCounters {
            diagnostics_bytes,
            diagnostics_dropped,
            ledger_pruned: self.pruned.load(std::sync::atomic::Ordering::Relaxed),
            ..self.counters
        }
    }

    /// A run berth holds no record for may still have a cgroup (a run gets its group
    /// when its first process registers).
    fn has_processes(&self, run_id: &str) -> bool {
        match self.extras.get(run_id) {
            Some(e) => !e.processes.is_empty(),
            None => self.host.has_group(run_id),
        }
    }

    /// The daemon's end, after its shell has closed the writer: a clean end leaves
    /// the last fence for the next start.
    pub fn close(mut self) {
        let clean = self.fatal.reason().is_none();
        self.host.close(clean.then(|| self.engine.last_fence()));
    }
}
