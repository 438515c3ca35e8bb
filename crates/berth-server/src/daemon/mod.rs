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
mod extra;
mod fleet;
mod handlers;
mod host;
mod journal;
mod ports;
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

/// Held by the tests that drive a daemon in this process: tracing caches per call site
/// whether anyone listens, so a daemon logging on one test thread with no subscriber
/// could hide the lines another test is capturing.
#[cfg(test)]
static LOGGING_TESTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, RwLock};

use berth_core::{
    Command, EndCause, Engine, Error as CoreError, Event, RunState, RunView, Snapshot,
};
use berth_store::{Batch, RunRecord, StoreError};
use tokio::sync::{oneshot, watch};

use crate::auth::Grant;
use crate::workspace;
use extra::{proc_id, Extra};
use ports::PortBroker;

pub use ask::{ask, register_off_task};
pub use host::{Host, ListenWatch, RealHost, StopOrder, StopSink, Supervision};
pub use restore::Restore;
pub use runtime::run;
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

pub type Reply<T> = oneshot::Sender<Result<T, Error>>;

pub enum Msg {
    Acquire {
        req: berth_core::Request,
        worktree: Option<String>,
        labels: BTreeMap<String, String>,
        stop_grace_ms: Option<u64>,
        /// The names of the ports its contract declares (W3).
        ports: Vec<String>,
        /// The caller keeps a connection open while it waits (A9 applies).
        attach: bool,
        /// A detached waiter: it keeps its place without a connection.
        detach: bool,
        /// G0: the agent thread it works in.
        thread: Option<String>,
        /// A lease only: no workspace at its grant.
        lease_only: bool,
        /// S9: who asks; a new run is theirs, an existing one must be.
        by: Tenant,
        reply: Reply<RunInfo>,
    },
    /// Renew, release or cancel one run (S9: `by` must own it).
    Command {
        cmd: Command,
        by: Tenant,
        reply: Reply<RunInfo>,
    },
    Get {
        run_id: String,
        reply: Reply<RunInfo>,
    },
    List {
        limit: usize,
        /// Ended runs too (those still retained), not only live ones.
        ended: bool,
        reply: Reply<Vec<RunInfo>>,
    },
    Status {
        reply: Reply<(Snapshot, ReapCounters)>,
    },
    FenceCheck {
        run_id: String,
        fence: u64,
        reply: Reply<(bool, Option<RunState>)>,
    },
    /// A waiting connection went away.
    Detach {
        run_id: String,
    },
    Subscribe {
        run_id: String,
        reply: oneshot::Sender<Option<watch::Receiver<RunInfo>>>,
    },
    CreateToken {
        grant: Grant,
        reply: Reply<String>,
    },
    /// S9: the token whose id (first 16 hex digits of its hash) this is is refused from
    /// now on; the hash and grant revoked, `None` when no token has that id.
    RevokeToken {
        id: String,
        reply: Reply<Option<(String, Grant)>>,
    },
    /// P1: a process (tree) the run's client started; recorded before it is relied on.
    RegisterProcess {
        run_id: String,
        fence: u64,
        pid: i32,
        /// The user the caller acts for (S3).
        uid: u32,
        /// S9: who asks; the run must be theirs.
        by: Tenant,
        /// The rule's answer, checked off the state task against the plan of this
        /// registration generation (issue 32 finding 7); `None`, or a generation
        /// another registration has moved past, is checked here.
        checked: Option<(berth_proc::ProcId, u64)>,
        reply: Reply<RunInfo>,
    },
    /// S3, off the state task: what a registration into the run is checked against
    /// (every other live run's roots), after the owner, fence and state checks.
    RegistrationPlan {
        run_id: String,
        fence: u64,
        by: Tenant,
        reply: Reply<RegistrationPlan>,
    },
    /// A stop started for a run has finished (sent by the stopping thread).
    Stopped {
        run_id: String,
        report: berth_proc::StopReport,
    },
    /// P4 on demand: stop and clean every run that is releasing or degraded now.
    Reap {
        reply: Reply<(Vec<String>, ReapCounters)>,
    },
    /// How the runs of a reap pass are doing.
    ReapStatus {
        runs: Vec<String>,
        reply: Reply<(usize, Vec<RunState>, ReapCounters)>,
    },
    /// C7: what starting a granted run's runtime needs (its lease, contract, group).
    RuntimePlan {
        run_id: String,
        fence: u64,
        /// S9: who asks; the run must be theirs.
        by: Tenant,
        reply: Reply<RuntimePlan>,
    },
    /// C3: every declared port answered its probe; true if that promoted the project.
    RuntimeReady {
        run_id: String,
        fence: u64,
        ports: Vec<String>,
        reply: Reply<bool>,
    },
    /// C4: the run's runtime failed to start.
    RuntimeFailed {
        run_id: String,
        fence: u64,
    },
    /// C6: an analysis run opened a listener (sent by the watcher thread).
    ListenerViolation {
        run_id: String,
        violation: crate::listen::Violation,
    },
    /// G0–G3: attach, deadline, detach, evict or show one thread.
    Thread {
        op: ThreadOp,
        /// S9: who asks; the thread (and the run a claim names) must be theirs.
        by: Tenant,
        reply: Reply<berth_client::wire::Thread>,
    },
    ThreadList {
        reply: Reply<Vec<berth_client::wire::Thread>>,
    },
    /// G4: start (`Some((by, reason))`) or end (`None`) the drain.
    Drain {
        start: Option<(String, String)>,
        reply: Reply<berth_client::wire::Drain>,
    },
    DrainGet {
        reply: Reply<berth_client::wire::Drain>,
    },
    Idle {
        reply: Reply<berth_client::wire::Idle>,
    },
    /// F1–F3: what the fleet thread reports.
    Fleet(crate::fleet::Report),
    /// B1–B6: show, reserve, release, reconcile or control one scope.
    Scope {
        op: ScopeOp,
        reply: Reply<ScopeAnswer>,
    },
    ScopeList {
        reply: Reply<Vec<berth_client::wire::ScopeSummary>>,
    },
    /// C4: the worktree's contract or commit is no longer the run's.
    ContractChanged {
        run_id: String,
        fence: u64,
        contract: berth_core::ContractInfo,
        reply: Reply<RunInfo>,
    },
}

/// Every `Msg` variant by name: `name()` is an exhaustive match (a new variant that
/// is not listed here does not compile), and `NAMES` comes from the same list, so the
/// daemon simulator can say which variants it never sent.
macro_rules! msg_names {
    ($($v:ident $pat:tt),* $(,)?) => {
        impl Msg {
            pub const NAMES: &'static [&'static str] = &[$(stringify!($v)),*];

            pub fn name(&self) -> &'static str {
                match self {
                    $(Msg::$v $pat => stringify!($v),)*
                }
            }
        }
    };
}

msg_names! {
    Acquire {..}, Command {..}, Get {..}, List {..}, Status {..}, FenceCheck {..},
    Detach {..}, Subscribe {..}, CreateToken {..}, RevokeToken {..},
    RegisterProcess {..}, RegistrationPlan {..}, Stopped {..}, Reap {..},
    ReapStatus {..}, RuntimePlan {..}, RuntimeReady {..}, RuntimeFailed {..},
    ListenerViolation {..}, Thread {..}, ThreadList {..}, Drain {..}, DrainGet {..},
    Idle {..}, Fleet(_), Scope {..}, ScopeList {..}, ContractChanged {..},
}

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
}

/// What a registration is checked against off the state task: every other live run's
/// registered roots, and the registration generation they are of.
pub struct RegistrationPlan {
    pub others: Vec<(String, Vec<berth_proc::ProcId>)>,
    pub generation: u64,
}

/// How often at most the queue's streams are told that it moved (issue: position
/// updates at most once a second per stream).
pub const QUEUE_MOVED_EVERY_MS: u64 = 1_000;

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
    /// C6: analysis runs with processes, and the listeners those held when registered.
    listen_watched: BTreeMap<String, BTreeSet<u64>>,
    /// C6: restored analysis runs with processes, watched again from the first tick
    /// (once the runtime has given the host its inbox).
    rewatch: Vec<String>,
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

    /// P2: a stop order for the run's processes, sent once this step is durable;
    /// `Msg::Stopped` comes back.
    fn start_stop(&mut self, run_id: &str) {
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
    fn schedule_retry(&mut self, run_id: &str) {
        let now = self.now;
        let e = self
            .cleanup_retry
            .entry(run_id.to_string())
            .or_insert((0, 0));
        e.0 += 1;
        let delay = CLEANUP_RETRY.delay_ms(e.0);
        e.1 = now + delay;
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

    fn info(&self, run_id: &str) -> Option<RunInfo> {
        let mut view = self.engine.view_of(run_id)?;
        // F1: a waiter for its fleet-wide claim says what refused it last.
        if let (Some(r), Some(why)) = (view.reason.as_mut(), self.fleet.why.get(run_id)) {
            if r.code == "fleet.claim" {
                r.message = why.clone();
            }
        }
        let extra = self.extras.get(run_id).map(|e| &**e);
        let expires_at = view.expires_at_ms.map(|t| self.host.show_time(t));
        let ws = extra
            .and_then(|e| e.workspace.as_ref())
            .map(|w| w.path.clone());
        let mut env = BTreeMap::new();
        if view.state == RunState::Granted {
            self.granted_env(&view, extra, expires_at.as_deref(), &mut env);
        }
        let ports = match (view.state, extra) {
            (RunState::Granted, Some(e)) => {
                e.ports.iter().filter(|(_, p)| *p != 0).cloned().collect()
            }
            _ => BTreeMap::new(),
        };
        Some(RunInfo {
            ports,
            worktree: extra.and_then(|e| e.worktree.clone()),
            labels: extra.map(|e| e.labels.clone()).unwrap_or_default(),
            workspace: ws,
            expires_at,
            deadline: view.deadline_ms.map(|t| self.host.show_time(t)),
            detached: extra.is_some_and(|e| e.detached),
            since: self.engine.since_of(run_id).map(|t| self.host.show_time(t)),
            env,
            survivors: extra.map(|e| e.survivors.clone()).unwrap_or_default(),
            failure: extra.and_then(|e| e.failure.clone()),
            owner_uid: extra.and_then(|e| e.owner_uid),
            view,
        })
    }

    /// The `BERTH_*` environment of a granted run.
    fn granted_env(
        &self,
        view: &RunView,
        extra: Option<&Extra>,
        expires_at: Option<&str>,
        env: &mut BTreeMap<Cow<'static, str>, String>,
    ) {
        let fence = view.fence.unwrap_or(0);
        let mut put = |k: &'static str, v: String| env.insert(k.into(), v);
        put("BERTH_URL", self.shared.url.clone());
        put("BERTH_RUN_ID", view.run_id.clone());
        put("BERTH_FENCE", fence.to_string());
        put("BERTH_PROJECT", view.project.clone());
        put("BERTH_CLASS", view.class.as_str().to_string());
        put("BERTH_PRIORITY", view.priority.as_str().to_string());
        if let Some(e) = expires_at {
            put("BERTH_LEASE_EXPIRES_AT", e.to_string());
        }
        let concurrency = match view.keys.first().map(|k| k.1) {
            Some(berth_core::KeyMode::Shared) => "parallel",
            _ => "serial",
        };
        put("BERTH_CONCURRENCY", concurrency.to_string());
        if let Some(wt) = extra.and_then(|e| e.worktree.as_ref()) {
            put("BERTH_WORKTREE", wt.clone());
        }
        if let Some(ws) = extra.and_then(|e| e.workspace.as_ref()) {
            workspace::env(&ws.path, env);
        }
        // G0: a thread's run works in the thread's workspace; its tmp, out and logs
        // stay its own.
        if let Some(key) = extra.and_then(|e| e.thread.as_ref()) {
            env.insert("BERTH_THREAD".into(), key.clone());
            if let Some(tw) = self.th.ws.get(key) {
                env.insert("BERTH_WORKSPACE".into(), tw.path.clone());
            }
        }
        // W3: each port as a number and as a URL on loopback.
        for (name, port) in extra.iter().flat_map(|e| &e.ports) {
            let name = name.to_ascii_uppercase();
            env.insert(format!("BERTH_PORT_{name}").into(), port.to_string());
            env.insert(
                format!("BERTH_URL_{name}").into(),
                format!("http://127.0.0.1:{port}"),
            );
        }
    }

    fn record(&self, run_id: &str) -> Option<RunRecord> {
        let r = self.engine.record(run_id)?;
        let extra = self.extras.get(run_id)?;
        let granted = r.fence.is_some();
        Some(RunRecord {
            request: r.request,
            worktree: extra.worktree.clone(),
            labels: extra.labels.clone(),
            state: r.state,
            fence: r.fence,
            queue_seq: extra.queue_seq,
            enqueued_ms: r.enqueued_at,
            deadline_ms: r.deadline,
            granted_ms: granted.then_some(r.granted_at),
            expires_ms: granted.then_some(r.expires_at),
            end_cause: r.cause,
            primary_mode: r.primary_mode,
            upgrading: r.upgrading,
            workspace: extra.workspace.clone(),
            processes: extra.processes.clone(),
            stop_grace_ms: extra.stop_grace_ms,
            ports: extra.ports.clone(),
            detached: extra.detached,
            thread: extra.thread.clone(),
            lease_only: extra.lease_only,
            owner_uid: extra.owner_uid,
            journal_first: extra.journal_first,
        })
    }

    /// Applies one command and everything it sets off; records the runs it touched.
    fn apply(
        &mut self,
        cmd: Command,
        touched: &mut BTreeSet<String>,
    ) -> Result<Option<RunView>, CoreError> {
        let out = self.engine.apply(self.now, cmd);
        self.carry_out(out.events, touched);
        out.result
    }

    /// Carries out the engine's events, and the events that doing so sets off.
    fn carry_out(&mut self, events: Vec<Event>, touched: &mut BTreeSet<String>) {
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
                Event::Promoted { project, evidence } => {
                    self.on_evidence(project, Some(evidence), &evidence.run_id)
                }
                Event::EvidenceInvalidated { project, by_run } => {
                    self.on_evidence(project, None, by_run)
                }
                Event::ScopeFrozen { .. }
                | Event::ScopeForgotten { .. }
                | Event::TokenTaken { .. }
                | Event::TokenFreed { .. }
                | Event::TokenLapsed { .. }
                | Event::ScopeControlled { .. } => self.on_scope_event(&ev),
                Event::PermitWanted { run_id } => self.on_permit_wanted(run_id),
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
    fn on_evidence(&mut self, project: &str, evidence: Option<&berth_core::Evidence>, by: &str) {
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
    fn on_ended(&mut self, run_id: &str, state: RunState) {
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
    }

    /// W1: a granted run gets its workspace, or is released in this same step (before
    /// anything is acknowledged) and its caller told why. Returns what that sets off.
    fn on_granted(&mut self, run_id: &str, fence: u64) -> Vec<Event> {
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
    fn release_at_grant(&mut self, run_id: &str, fence: u64, why: String) -> Vec<Event> {
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
    fn allocate_ports(&mut self, run_id: &str) -> Result<(), String> {
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
    fn stop_or_clean(&mut self, run_id: &str) -> Vec<Event> {
        if self.has_processes(run_id) {
            self.start_stop(run_id);
            return Vec::new();
        }
        let ok = self.cleanup(run_id);
        self.stop_done(run_id, ok)
    }

    /// The run's processes are proven gone and its workspace removed (`ok`), or not.
    fn stop_done(&mut self, run_id: &str, ok: bool) -> Vec<Event> {
        let done = Command::StopDone {
            run_id: run_id.to_string(),
            ok,
        };
        self.engine.apply(self.now, done).events
    }

    fn on_degraded(&mut self, run_id: &str) {
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
    fn cleanup(&mut self, run_id: &str) -> bool {
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

    /// The touched runs as a commit for the shell to make durable; `then` runs once
    /// they are (or the ledger refused them).
    fn commit(
        &mut self,
        touched: BTreeSet<String>,
        then: impl FnOnce(Result<(), &StoreError>) + Send + 'static,
    ) {
        let runs: Vec<RunRecord> = touched.iter().filter_map(|id| self.record(id)).collect();
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
        let fleet = self.fleet.link.clone().filter(|_| !fleet_jobs.is_empty());
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
    fn watcher_notes(
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
    fn commit_and_answer<T: Send + 'static>(
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
    fn answer<T: Send + 'static>(&mut self, reply: Reply<T>, value: Result<T, Error>) {
        self.effects.push(Effect::Answer(Box::new(move |res| {
            let _ = reply.send(match res {
                Ok(()) => value,
                Err(e) => Err(Error::store(e)),
            });
        })));
    }

    /// What this step left to be done, in order.
    fn take_effects(&mut self) -> Effects {
        Effects(std::mem::take(&mut self.effects))
    }

    /// The run, granted under exactly this fence (L2), or the refusal that says why not.
    fn granted_view(&self, run_id: &str, fence: u64) -> Result<RunView, Error> {
        let view = self
            .engine
            .view_of(run_id)
            .ok_or_else(|| CoreError::NotFound {
                run_id: run_id.to_string(),
            })?;
        if view.fence != Some(fence) {
            return Err(CoreError::StaleFence {
                run_id: run_id.to_string(),
                given: Some(fence),
                current: view.fence,
            }
            .into());
        }
        if view.state != RunState::Granted {
            return Err(CoreError::Gone {
                run_id: run_id.to_string(),
                state: view.state,
            }
            .into());
        }
        Ok(view)
    }

    /// P1: records a process of a granted run by identity, and moves it into the
    /// run's cgroup where the host allows one.
    fn register(
        &mut self,
        run_id: &str,
        fence: u64,
        (pid, uid): (i32, u32),
        checked: Option<(berth_proc::ProcId, u64)>,
    ) -> Result<RunInfo, Error> {
        let view = self.granted_view(run_id, fence)?;
        // S3: the registration rule (crate::register), against every other live run
        // with processes, in run id order: checked off this task when no registration
        // came between its plan and now, else here.
        let id = match checked {
            Some((id, generation)) if generation == self.registrations && id.pid == pid => id,
            _ => {
                let plan = self.registration_others(run_id);
                let others: Vec<crate::register::OtherRun<'_>> = plan
                    .iter()
                    .map(|(id, roots)| crate::register::OtherRun {
                        run_id: id,
                        roots: roots.clone(),
                    })
                    .collect();
                self.host
                    .check_process(uid, pid, &others)
                    .map_err(|refusal| Error::Registration { pid, refusal })?
            }
        };
        self.registrations += 1;
        self.host.adopt(run_id, pid);
        let rec = berth_store::ProcessRecord {
            pid: id.pid,
            start_ticks: id.start_ticks,
            boot_id: id.boot_id,
        };
        if let Some(e) = self.extras.get_mut(run_id) {
            if !e.processes.contains(&rec) {
                e.processes.push(rec);
            }
        }
        if view.class == berth_core::Class::Analysis {
            self.watch_analysis_run(run_id);
        }
        self.info(run_id).ok_or_else(Error::run_vanished)
    }

    /// Every other live run with processes and its roots, in run id order.
    fn registration_others(&self, run_id: &str) -> Vec<(String, Vec<berth_proc::ProcId>)> {
        let mut others: Vec<(String, Vec<berth_proc::ProcId>)> = self
            .extras
            .iter()
            .filter(|(id, e)| {
                id.as_str() != run_id
                    && !e.processes.is_empty()
                    && self
                        .engine
                        .view_of(id)
                        .is_some_and(|v| !v.state.is_terminal())
            })
            .map(|(id, e)| (id.clone(), e.processes.iter().map(proc_id).collect()))
            .collect();
        others.sort_by(|a, b| a.0.cmp(&b.0));
        others
    }

    /// S3: a registration's plan, for its check off the state task.
    pub(super) fn on_registration_plan(
        &mut self,
        run_id: String,
        fence: u64,
        by: Tenant,
        reply: Reply<RegistrationPlan>,
    ) {
        let plan = self
            .check_run_owner(&run_id, by)
            .and_then(|()| self.granted_view(&run_id, fence))
            .map(|_| RegistrationPlan {
                others: self.registration_others(&run_id),
                generation: self.registrations,
            });
        self.answer(reply, plan);
    }

    /// C6: an analysis run with processes is watched for listeners; what its processes
    /// hold when registered is its baseline.
    pub(super) fn watch_analysis_run(&mut self, run_id: &str) {
        let roots: Vec<berth_proc::ProcId> = self
            .extras
            .get(run_id)
            .map(|e| e.processes.iter().map(proc_id).collect())
            .unwrap_or_default();
        let mut now = self.host.listeners_of(&roots);
        // Only what the host already had at the grant is tolerated: a listener opened
        // before the registration is the run's own (issue 32 concern).
        if let Some(at_grant) = self
            .extras
            .get(run_id)
            .and_then(|e| e.listeners_at_grant.as_deref())
        {
            now.retain(|inode| at_grant.binary_search(inode).is_ok());
        }
        self.listen_watched
            .entry(run_id.to_string())
            .or_default()
            .extend(now);
        self.send_listen_watch();
    }

    /// C6: an analysis run's grant notes the host's listeners (its baseline's bound).
    fn note_listeners_at_grant(&mut self, run_id: &str) {
        if self.engine.class_of(run_id) == Some(berth_core::Class::Analysis) {
            let now = self.host.listening_now();
            if let Some(e) = self.extras.get_mut(run_id) {
                e.listeners_at_grant = Some(now.into_iter().collect());
            }
        }
    }

    fn send_listen_watch(&mut self) {
        let watched = self
            .listen_watched
            .iter()
            .map(|(id, baseline)| ListenWatch {
                run_id: id.clone(),
                roots: self
                    .extras
                    .get(id)
                    .map(|e| e.processes.iter().map(proc_id).collect())
                    .unwrap_or_default(),
                baseline: baseline.clone(),
            })
            .collect();
        self.host.watch_listeners(watched);
    }

    /// The daemon's end, after its shell has closed the writer: a clean end leaves
    /// the last fence for the next start.
    pub fn close(mut self) {
        let clean = self.fatal.reason().is_none();
        self.host.close(clean.then(|| self.engine.last_fence()));
    }
}

/// L6: one line per lease that ran out; a release is a debug line.
fn log_stop(engine: &Engine, run_id: &str, cause: EndCause) {
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
fn event_run(ev: &Event) -> Option<&str> {
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
        | Event::EvidenceInvalidated { .. }
        | Event::MemoryStabilized { .. }
        | Event::ScopeFrozen { .. }
        | Event::ScopeForgotten { .. }
        | Event::TokenTaken { .. }
        | Event::TokenFreed { .. }
        | Event::TokenLapsed { .. }
        | Event::ScopeControlled { .. }
        | Event::DrainChanged { .. } => None,
    }
}
