//! The state task: the one owner of the engine and the ledger writer. HTTP handlers
//! talk to it only through [`Msg`]; it applies each message to the engine, carries out
//! the events (workspaces), hands the durable effects to the writer and answers the
//! caller once they are durable (D1). Reads also wait behind every write queued before
//! them, so nobody ever sees state that a crash could take back.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use berth_core::{
    Command, EndCause, Engine, Error as CoreError, Event, RestoredRun, RunState, RunView, Snapshot,
};
use berth_store::{
    Batch, Ledger, Mutation, ProcessRecord, RunRecord, StoreError, WorkspaceIdentity, Writer,
};
use tokio::sync::{mpsc, oneshot, watch};

use crate::auth::Grant;
use crate::clock;
use crate::error::{internal, run_vanished, store_unavailable as store_error, ApiError};
use crate::workspace;

/// A run as the API shows it: the engine's view plus what the server adds.
#[derive(Clone, Debug, PartialEq)]
pub struct RunInfo {
    pub view: RunView,
    pub worktree: Option<String>,
    pub labels: BTreeMap<String, String>,
    pub workspace: Option<String>,
    pub expires_at: Option<String>,
    /// When it was granted (or queued, while it waits).
    pub since: Option<String>,
    pub env: BTreeMap<&'static str, String>,
    /// Pids that survived the last stop (a degraded run).
    pub survivors: Vec<i32>,
    /// Why a granted run was ended by berth itself at once (no workspace: W1).
    pub failure: Option<String>,
}

pub type Reply<T> = oneshot::Sender<Result<T, ApiError>>;

pub enum Msg {
    Acquire {
        req: berth_core::Request,
        worktree: Option<String>,
        labels: BTreeMap<String, String>,
        stop_grace_ms: Option<u64>,
        /// The caller keeps a connection open while it waits (A9 applies).
        attach: bool,
        reply: Reply<RunInfo>,
    },
    Command {
        cmd: Command,
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
    /// P1: a process (tree) the run's client started; recorded before it is relied on.
    RegisterProcess {
        run_id: String,
        fence: u64,
        pid: i32,
        /// The user the caller acts for (S3).
        uid: u32,
        reply: Reply<RunInfo>,
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

struct Extra {
    worktree: Option<String>,
    labels: BTreeMap<String, String>,
    queue_seq: u64,
    workspace: Option<WorkspaceIdentity>,
    processes: Vec<ProcessRecord>,
    /// Pids that survived SIGKILL in the last stop (the run is degraded).
    survivors: Vec<i32>,
    /// The run's own grace between SIGTERM and SIGKILL (P2), if it asked for one.
    stop_grace_ms: Option<u64>,
    /// Why berth ended the run at its grant (not kept in the ledger).
    failure: Option<String>,
    /// Set once the run has ended and its record is durable: the digest of
    /// (worktree, labels, stop grace), kept for the idempotent re-acquire check (L7)
    /// instead of the values themselves (see `shrink`).
    ended_digest: Option<[u8; 32]>,
}

/// What an acquire carries besides the engine's request, as one digest.
fn extras_digest(
    worktree: &Option<String>,
    labels: &BTreeMap<String, String>,
    stop_grace_ms: Option<u64>,
) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    let text = serde_json::to_vec(&(worktree, labels, stop_grace_ms)).unwrap_or_default();
    Sha256::digest(&text).into()
}

impl Extra {
    /// An ended run keeps only what answering about it needs: up to 65,536 of them are
    /// remembered, and a run's labels (up to 32 × 320 bytes), worktree path and process
    /// list would make that a gigabyte (68,000 ended runs with large labels once took
    /// 1 GB). The ledger keeps them all; `GET` of an ended run shows none of them.
    fn shrink(&mut self) {
        self.workspace = None;
        self.processes = Vec::new();
        self.survivors = Vec::new();
        // Nothing to free without labels or a worktree: no digest (hashing every
        // ended run cost the state task time on the request path).
        if self.ended_digest.is_some() || (self.labels.is_empty() && self.worktree.is_none()) {
            return;
        }
        self.ended_digest = Some(extras_digest(
            &self.worktree,
            &self.labels,
            self.stop_grace_ms,
        ));
        self.labels = BTreeMap::new();
        self.worktree = None;
    }

    /// Would an acquire with these extras be a different request (L7)?
    fn differs(
        &self,
        worktree: &Option<String>,
        labels: &BTreeMap<String, String>,
        stop_grace_ms: Option<u64>,
    ) -> bool {
        match self.ended_digest {
            Some(d) => d != extras_digest(worktree, labels, stop_grace_ms),
            None => {
                self.worktree != *worktree
                    || self.labels != *labels
                    || self.stop_grace_ms != stop_grace_ms
            }
        }
    }
}

/// How processes are stopped (P2).
#[derive(Clone, Debug)]
pub struct Supervision {
    /// Where run cgroups go, when the host allows them.
    pub cgroup_base: Option<PathBuf>,
    /// Between SIGTERM and SIGKILL.
    pub grace_ms: u64,
    /// How long SIGKILLed processes may take to vanish before the run degrades.
    pub kill_wait_ms: u64,
}

pub struct Shared {
    pub tokens: RwLock<Vec<(String, Grant)>>,
    pub url: String,
}

pub struct State {
    /// CLOCK_MONOTONIC milliseconds, as the runtime said at the latest input (`handle`,
    /// `tick`, `restore`): the state machine never reads the clock itself.
    now: u64,
    engine: Engine,
    writer: Writer,
    shared: Arc<Shared>,
    workspaces: workspace::Pool,
    extras: HashMap<String, Extra>,
    ended: VecDeque<String>,
    next_seq: u64,
    attached: HashMap<String, u32>,
    /// Restored waiters nobody has re-attached to yet, with their reclaim deadline.
    unclaimed: HashMap<String, u64>,
    watchers: HashMap<String, Arc<watch::Sender<RunInfo>>>,
    /// Runs whose cleanup must be retried (degraded, or releasing after a restart).
    /// Runs whose stop or cleanup must be retried: (failed attempts, next try at).
    cleanup_retry: BTreeMap<String, (u32, u64)>,
    fatal: Arc<crate::Fatal>,
    /// Fences are covered by the marker before they are acknowledged (L1, S6).
    marker: crate::private::FenceMarker,
    supervision: Supervision,
    /// Runs whose processes are being stopped right now.
    stopping: BTreeSet<String>,
    /// For stopping threads to report back; weak, so it does not keep the task alive.
    inbox: Option<mpsc::WeakSender<Msg>>,
    counters: ReapCounters,
    /// The one thread that stops processes, started on first use.
    stopper: Option<std::sync::mpsc::Sender<berth_proc::StopJob>>,
    /// Stops decided in this step, handed to the stopper after the commit.
    pending_stops: Vec<berth_proc::StopJob>,
    /// The daemon as the registration rule sees it (S3).
    me: crate::register::Me,
}

/// The stopper thread: takes stop jobs, runs rounds while any are active (one `/proc`
/// scan per round for all of them), reports each finished stop to the state task.
fn spawn_stopper(
    sup: &Supervision,
    inbox: Option<mpsc::WeakSender<Msg>>,
) -> std::sync::mpsc::Sender<berth_proc::StopJob> {
    let (tx, rx) = std::sync::mpsc::channel::<berth_proc::StopJob>();
    let (grace, kill_wait) = (sup.grace_ms, sup.kill_wait_ms);
    std::thread::Builder::new()
        .name("berth-stopper".into())
        .spawn(move || {
            let mut stopper = berth_proc::Stopper::new(grace, kill_wait);
            loop {
                if stopper.is_empty() {
                    match rx.recv() {
                        Ok(job) => stopper.add(job),
                        Err(_) => return,
                    }
                }
                while let Ok(job) = rx.try_recv() {
                    stopper.add(job);
                }
                let finished = stopper.round();
                if !stopper.is_empty() {
                    crate::failpoint::hit("mid-stop");
                }
                for (run_id, report) in finished {
                    if let Some(tx) = inbox.as_ref().and_then(|w| w.upgrade()) {
                        let _ = tx.blocking_send(Msg::Stopped { run_id, report });
                    }
                }
                std::thread::sleep(std::time::Duration::from_millis(berth_proc::STOP_ROUND_MS));
            }
        })
        .expect("spawn stopper thread");
    tx
}

fn proc_id(p: &ProcessRecord) -> berth_proc::ProcId {
    berth_proc::ProcId {
        pid: p.pid,
        start_ticks: p.start_ticks,
        boot_id: p.boot_id.clone(),
    }
}

/// One line at startup: what the ledger gave back (P5). The runs still to be stopped
/// (releasing, degraded) are named one per line at debug level.
fn restore_summary(ledger: &Ledger, same_boot: bool, last_fence: u64) {
    let count = |s: RunState| ledger.runs.iter().filter(|r| r.state == s).count();
    let ended = ledger.runs.iter().filter(|r| r.state.is_terminal()).count();
    tracing::info!(
        granted = count(RunState::Granted),
        queued = count(RunState::Queued),
        releasing = count(RunState::Releasing),
        degraded = count(RunState::Degraded),
        ended,
        last_fence,
        same_boot,
        "restored from the ledger{}",
        if same_boot {
            ""
        } else {
            " (after a reboot: every lease is over, every waiter has one reconnect window)"
        }
    );
    for r in &ledger.runs {
        if matches!(r.state, RunState::Releasing | RunState::Degraded) {
            tracing::debug!(
                run_id = r.request.run_id.as_str(),
                state = r.state.as_str(),
                fence = r.fence,
                "restored a run still to be stopped"
            );
        }
    }
}

/// The first retry of a failed stop or cleanup; each next one waits twice as long.
const CLEANUP_RETRY_MS: u64 = 5_000;
/// The longest wait between retries.
const CLEANUP_RETRY_MAX_MS: u64 = 300_000;

impl State {
    /// Rebuilds the state from the ledger (P5). Times in the ledger are this boot's
    /// monotonic milliseconds; after a reboot every lease is over and every waiter has
    /// one reconnect window.
    #[allow(clippy::too_many_arguments)]
    pub fn restore(
        now: u64,
        cfg: berth_core::Config,
        ledger: Ledger,
        same_boot: bool,
        writer: Writer,
        shared: Arc<Shared>,
        runs_dir: PathBuf,
        reconnect_window_ms: u64,
        fatal: Arc<crate::Fatal>,
        marker: crate::private::FenceMarker,
        supervision: Supervision,
        diagnostics: workspace::Diagnostics,
    ) -> Result<State, String> {
        restore_summary(&ledger, same_boot, ledger.last_fence);
        let mut restored = Vec::with_capacity(ledger.runs.len());
        let mut extras = HashMap::with_capacity(ledger.runs.len());
        let mut unclaimed = HashMap::new();
        let mut ended = VecDeque::new();
        let mut cleanup_retry = BTreeMap::new();
        // Moved, not copied: a restart's peak memory is one copy of what it loads.
        for r in ledger.runs {
            let id = r.request.run_id.clone();
            match r.state {
                RunState::Queued => {
                    unclaimed.insert(id.clone(), now + reconnect_window_ms);
                }
                RunState::Releasing | RunState::Degraded => {
                    cleanup_retry.insert(id.clone(), (0, 0));
                }
                s if s.is_terminal() => ended.push_back(id.clone()),
                _ => {}
            }
            let reboot_window = (!same_boot).then_some(reconnect_window_ms);
            let (run, extra) = restored_run(r, now, reboot_window);
            extras.insert(id, extra);
            restored.push(run);
        }
        let engine = Engine::restore(cfg, ledger.last_fence, now, restored)?;
        Ok(State {
            now,
            engine,
            writer,
            shared,
            workspaces: workspace::Pool::start(&runs_dir, Some(diagnostics))
                .map_err(|e| format!("workspace pool: {e}"))?,
            extras,
            ended,
            next_seq: ledger.next_queue_seq,
            attached: HashMap::new(),
            unclaimed,
            watchers: HashMap::new(),
            cleanup_retry,
            fatal,
            marker,
            supervision,
            stopping: BTreeSet::new(),
            inbox: None,
            counters: ReapCounters::default(),
            stopper: None,
            pending_stops: Vec::new(),
            me: crate::register::Me::now(),
        })
    }

    /// Gives the state task a way to hear back from the threads it starts.
    pub fn set_inbox(&mut self, tx: &mpsc::Sender<Msg>) {
        self.inbox = Some(tx.downgrade());
    }

    fn cgroup_of(&self, run_id: &str) -> Option<berth_proc::cgroup::Group> {
        // A run gets a group when its first process registers; none before.
        if self
            .extras
            .get(run_id)
            .is_some_and(|e| e.processes.is_empty())
        {
            return None;
        }
        let base = self.supervision.cgroup_base.as_ref()?;
        let path = base.join(workspace::dir_name(run_id));
        path.exists().then(|| berth_proc::cgroup::Group::open(path))
    }

    /// P2: hands the run's processes to the stopper thread; `Msg::Stopped` comes back.
    fn start_stop(&mut self, run_id: &str) {
        if !self.stopping.insert(run_id.to_string()) {
            return;
        }
        let roots: Vec<berth_proc::ProcId> = self
            .extras
            .get(run_id)
            .map(|e| e.processes.iter().map(proc_id).collect())
            .unwrap_or_default();
        let job = berth_proc::StopJob {
            key: run_id.to_string(),
            roots,
            group: self.cgroup_of(run_id),
            grace_ms: self.extras.get(run_id).and_then(|e| e.stop_grace_ms),
        };
        if self.stopper.is_none() {
            self.stopper = Some(spawn_stopper(&self.supervision, self.inbox.clone()));
        }
        // Sent by the next commit, once the decision to stop is durable: a crash in
        // between must not leave a run that the ledger says is granted with its
        // processes already killed.
        self.pending_stops.push(job);
    }

    /// L3/P4: a failed stop or cleanup is retried with exponential backoff, from
    /// `CLEANUP_RETRY_MS` up to `CLEANUP_RETRY_MAX_MS`.
    fn schedule_retry(&mut self, run_id: &str) {
        let now = self.now;
        let e = self
            .cleanup_retry
            .entry(run_id.to_string())
            .or_insert((0, 0));
        let delay = CLEANUP_RETRY_MS
            .saturating_mul(1u64 << e.0.min(16))
            .min(CLEANUP_RETRY_MAX_MS);
        e.0 += 1;
        e.1 = now + delay;
    }

    fn reap_counters(&self) -> ReapCounters {
        use std::sync::atomic::Ordering::Relaxed;
        let d = &self.workspaces.diagnostics;
        ReapCounters {
            diagnostics_bytes: d.bytes.load(Relaxed),
            diagnostics_dropped: d.dropped.load(Relaxed),
            ledger_pruned: self.writer.pruned(),
            ..self.counters
        }
    }

    fn has_processes(&self, run_id: &str) -> bool {
        self.extras
            .get(run_id)
            .is_some_and(|e| !e.processes.is_empty())
            || self.cgroup_of(run_id).is_some()
    }

    pub fn writer_commits(&self) -> u64 {
        self.writer.commits()
    }

    fn info(&self, run_id: &str) -> Option<RunInfo> {
        let view = self.engine.view_of(run_id)?;
        let extra = self.extras.get(run_id);
        let granted = view.state == RunState::Granted;
        let expires_at = view.expires_at_ms.map(clock::mono_to_rfc3339);
        let ws = extra
            .and_then(|e| e.workspace.as_ref())
            .map(|w| w.path.clone());
        let mut env = BTreeMap::new();
        if granted {
            let fence = view.fence.unwrap_or(0);
            env.insert("BERTH_URL", self.shared.url.clone());
            env.insert("BERTH_RUN_ID", view.run_id.clone());
            env.insert("BERTH_FENCE", fence.to_string());
            env.insert("BERTH_PROJECT", view.project.clone());
            env.insert("BERTH_CLASS", view.class.as_str().to_string());
            env.insert("BERTH_PRIORITY", view.priority.as_str().to_string());
            if let Some(e) = &expires_at {
                env.insert("BERTH_LEASE_EXPIRES_AT", e.clone());
            }
            let concurrency = match view.keys.first().map(|k| k.1) {
                Some(berth_core::KeyMode::Shared) => "parallel",
                _ => "serial",
            };
            env.insert("BERTH_CONCURRENCY", concurrency.to_string());
            if let Some(ws) = &ws {
                workspace::env(ws, &mut env);
            }
            if let Some(wt) = extra.and_then(|e| e.worktree.as_ref()) {
                env.insert("BERTH_WORKTREE", wt.clone());
            }
        }
        Some(RunInfo {
            worktree: extra.and_then(|e| e.worktree.clone()),
            labels: extra.map(|e| e.labels.clone()).unwrap_or_default(),
            workspace: ws,
            expires_at,
            since: self.engine.since_of(run_id).map(clock::mono_to_rfc3339),
            env,
            survivors: extra.map(|e| e.survivors.clone()).unwrap_or_default(),
            failure: extra.and_then(|e| e.failure.clone()),
            view,
        })
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
            workspace: extra.workspace.clone(),
            processes: extra.processes.clone(),
            stop_grace_ms: extra.stop_grace_ms,
        })
    }

    /// Applies one command and everything it sets off; returns the runs it touched.
    fn apply(
        &mut self,
        cmd: Command,
        touched: &mut BTreeSet<String>,
    ) -> Result<Option<RunView>, CoreError> {
        let now = self.now;
        let out = self.engine.apply(now, cmd);
        let mut queue: VecDeque<Event> = out.events.into();
        while let Some(ev) = queue.pop_front() {
            if let Some(run_id) = event_run(&ev) {
                touched.insert(run_id.to_string());
            }
            match &ev {
                Event::Granted {
                    run_id,
                    fence,
                    expires_at_ms,
                    ..
                } => {
                    let ttl_ms = expires_at_ms.saturating_sub(now);
                    tracing::debug!(run_id, fence, ttl_ms, "granted");
                    queue.extend(self.on_granted(now, run_id, *fence));
                }
                Event::StopRequested { run_id, cause } => {
                    queue.extend(self.on_stop_requested(now, run_id, *cause));
                }
                Event::Degraded { run_id } => self.on_degraded(now, run_id),
                Event::Ended { run_id, state } => {
                    tracing::debug!(run_id, state = state.as_str(), "ended");
                    self.cleanup_retry.remove(run_id);
                    if let Some(e) = self.extras.get_mut(run_id) {
                        e.survivors.clear();
                    }
                    self.attached.remove(run_id);
                    self.unclaimed.remove(run_id);
                    self.ended.push_back(run_id.clone());
                }
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
        out.result
    }

    /// W1: a granted run gets its workspace, or is released in this same step (before
    /// anything is acknowledged) and its caller told why. Returns what that sets off.
    fn on_granted(&mut self, now: u64, run_id: &str, fence: u64) -> Vec<Event> {
        match self.workspaces.create(run_id) {
            Ok(ws) => {
                if let Some(e) = self.extras.get_mut(run_id) {
                    e.workspace = Some(ws);
                }
                Vec::new()
            }
            Err(e) => {
                tracing::error!(run_id, "workspace: {e}; the run is released");
                if let Some(x) = self.extras.get_mut(run_id) {
                    x.failure = Some(format!(
                        "the run was granted but its workspace could not be made ({e}); berth released it"
                    ));
                }
                let release = Command::Release {
                    run_id: run_id.to_string(),
                    fence,
                };
                self.engine.apply(now, release).events
            }
        }
    }

    /// A run is to stop: its processes are stopped first (capacity stays counted until
    /// they are proven gone, L5), or, with none, it is cleaned up at once. Returns what
    /// that sets off.
    fn on_stop_requested(&mut self, now: u64, run_id: &str, cause: EndCause) -> Vec<Event> {
        match cause {
            // L6: one line per lease that ran out.
            EndCause::Expired => {
                let fence = self.engine.view_of(run_id).and_then(|v| v.fence);
                tracing::info!(
                    run_id,
                    fence,
                    "lease expired: not renewed in time; the run is stopped and its claim freed once its processes are gone"
                );
            }
            EndCause::Released => tracing::debug!(run_id, "released"),
        }
        if self.has_processes(run_id) {
            self.start_stop(run_id);
            return Vec::new();
        }
        let ok = self.cleanup(run_id);
        let done = Command::StopDone {
            run_id: run_id.to_string(),
            ok,
        };
        self.engine.apply(now, done).events
    }

    fn on_degraded(&mut self, now: u64, run_id: &str) {
        self.schedule_retry(run_id);
        let retry_in_ms = self
            .cleanup_retry
            .get(run_id)
            .map_or(0, |(_, at)| at.saturating_sub(now));
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
        match self.workspaces.remove(&ws, run_id) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(run_id, "cleanup failed: {e}");
                false
            }
        }
    }

    /// Hands the touched runs to the writer; `then` runs once they are durable.
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
        let mut notes = Vec::new();
        for id in &touched {
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
        // L1/S6: a fence is never acknowledged above the durable marker; raising it is
        // one fsync per `FENCE_RESERVE_BLOCK` grants.
        if let Err(e) = self.marker.cover(self.engine.last_fence()) {
            let e = StoreError::Write(format!("fence marker: {e:#}"));
            self.fatal.raise(e.to_string());
            return then(Err(&e));
        }
        let granted = runs
            .iter()
            .any(|r| r.state == RunState::Granted && r.granted_ms.is_some());
        let batch = Batch::runs(self.engine.last_fence(), runs);
        let fatal = self.fatal.clone();
        let stops = std::mem::take(&mut self.pending_stops);
        let stopper = self.stopper.clone();
        self.writer.submit(Some(batch), move |res| {
            if res.is_ok() {
                if let Some(tx) = &stopper {
                    for job in stops {
                        let _ = tx.send(job);
                    }
                }
            }
            if granted {
                crate::failpoint::hit("grant-committed");
            }
            if let Err(e) = &res {
                // D4: never go on after the ledger refused a write.
                fatal.raise(format!("the ledger refused a write: {e}"));
            } else {
                for (tx, info) in notes {
                    let _ = tx.send(info);
                }
            }
            then(res);
        });
    }

    /// Answers after everything queued before is durable.
    fn answer<T: Send + 'static>(&self, reply: Reply<T>, value: Result<T, ApiError>) {
        self.writer.submit(None, move |res| {
            let _ = reply.send(match res {
                Ok(()) => value,
                Err(e) => Err(store_error(e)),
            });
        });
    }

    /// P1: records a process of a granted run by identity, and moves it into the
    /// run's cgroup where the host allows one.
    fn register(
        &mut self,
        run_id: &str,
        fence: u64,
        pid: i32,
        uid: u32,
    ) -> Result<RunInfo, ApiError> {
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
        // S3: the registration rule (crate::register).
        let others: Vec<crate::register::OtherRun<'_>> = self
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
            .map(|(id, e)| crate::register::OtherRun {
                run_id: id,
                roots: e.processes.iter().map(proc_id).collect(),
            })
            .collect();
        let id = crate::register::check(&self.me, uid, pid, &others)
            .map_err(|r| crate::error::registration_refused(pid, r))?;
        if let Some(base) = &self.supervision.cgroup_base {
            let group = berth_proc::cgroup::Group::create(base, &workspace::dir_name(run_id));
            if let Err(e) = group.and_then(|g| g.add(pid)) {
                tracing::warn!(
                    run_id,
                    pid,
                    "cgroup: {e}; the process group is the fallback"
                );
            }
        }
        let rec = ProcessRecord {
            pid: id.pid,
            start_ticks: id.start_ticks,
            boot_id: id.boot_id,
        };
        if let Some(e) = self.extras.get_mut(run_id) {
            if !e.processes.contains(&rec) {
                e.processes.push(rec);
            }
        }
        self.info(run_id).ok_or_else(run_vanished)
    }
}

/// A ledger record as the engine and the server take it back. Times are this boot's
/// monotonic milliseconds; after a reboot (`reboot_window` is the reconnect window)
/// every lease is over and every waiter has one reconnect window.
fn restored_run(r: RunRecord, now: u64, reboot_window: Option<u64>) -> (RestoredRun, Extra) {
    let (mut enqueued, mut deadline, mut expires) =
        (r.enqueued_ms, r.deadline_ms, r.expires_ms.unwrap_or(0));
    if let Some(window) = reboot_window {
        enqueued = enqueued.min(now);
        deadline = now + window;
        expires = now;
    }
    let mut extra = Extra {
        worktree: r.worktree,
        labels: r.labels,
        queue_seq: r.queue_seq,
        workspace: r.workspace,
        processes: r.processes,
        survivors: Vec::new(),
        stop_grace_ms: r.stop_grace_ms,
        failure: None,
        ended_digest: None,
    };
    if r.state.is_terminal() {
        extra.shrink();
    }
    let run = RestoredRun {
        request: r.request,
        state: r.state,
        fence: r.fence,
        enqueued_at: enqueued,
        deadline,
        granted_at: r.granted_ms.unwrap_or(0).min(now),
        expires_at: expires,
        cause: r.end_cause,
        primary_mode: r.primary_mode,
    };
    (run, extra)
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
        | Event::EvidenceInvalidated { .. }
        | Event::MemoryStabilized { .. } => None,
    }
}

/// A3: an acquire that never fits this host, whatever it waits for, is said in the log.
fn log_impossible(id: &str, res: &Result<Option<RunView>, CoreError>) {
    if let Err(CoreError::CapacityImpossible {
        resource,
        request,
        max,
    }) = res
    {
        tracing::info!(
            run_id = id,
            resource = resource.as_str(),
            request,
            max,
            "acquire refused (capacity_impossible): the request exceeds what this host can ever allocate"
        );
    }
}

impl State {
    /// One message from the API or a thread the task started: one method each.
    pub fn handle(&mut self, now: u64, msg: Msg) {
        self.now = now;
        match msg {
            Msg::Acquire {
                req,
                worktree,
                labels,
                stop_grace_ms,
                attach,
                reply,
            } => self.on_acquire(req, worktree, labels, stop_grace_ms, attach, reply),
            Msg::Command { cmd, reply } => self.on_command(cmd, reply),
            Msg::Get { run_id, reply } => self.on_get(run_id, reply),
            Msg::List {
                limit,
                ended,
                reply,
            } => self.on_list(limit, ended, reply),
            Msg::Status { reply } => self.on_status(reply),
            Msg::FenceCheck {
                run_id,
                fence,
                reply,
            } => self.on_fence_check(run_id, fence, reply),
            Msg::Detach { run_id } => self.on_detach(run_id),
            Msg::Subscribe { run_id, reply } => self.on_subscribe(run_id, reply),
            Msg::RegisterProcess {
                run_id,
                fence,
                pid,
                uid,
                reply,
            } => self.on_register_process(run_id, fence, pid, uid, reply),
            Msg::Reap { reply } => self.on_reap(reply),
            Msg::ReapStatus { runs, reply } => self.on_reap_status(runs, reply),
            Msg::Stopped { run_id, report } => self.on_stopped(run_id, report),
            Msg::CreateToken { grant, reply } => self.on_create_token(grant, reply),
        }
    }

    fn on_acquire(
        &mut self,
        req: berth_core::Request,
        worktree: Option<String>,
        labels: BTreeMap<String, String>,
        stop_grace_ms: Option<u64>,
        attach: bool,
        reply: Reply<RunInfo>,
    ) {
        let id = req.run_id.clone();
        if let Some(ex) = self.extras.get(&id) {
            if ex.differs(&worktree, &labels, stop_grace_ms) {
                let e = CoreError::Conflict { run_id: id };
                return self.answer(reply, Err(e.into()));
            }
        }
        let is_new = self.engine.view_of(&id).is_none();
        let seq = self.next_seq;
        if is_new {
            // Registered before the command so grants made by it find it.
            self.extras.insert(
                id.clone(),
                Extra {
                    worktree,
                    labels,
                    queue_seq: seq,
                    workspace: None,
                    processes: Vec::new(),
                    survivors: Vec::new(),
                    stop_grace_ms,
                    failure: None,
                    ended_digest: None,
                },
            );
        }
        let mut touched = BTreeSet::new();
        let res = self.apply(Command::Acquire(req), &mut touched);
        if is_new {
            if self.engine.view_of(&id).is_some() {
                self.next_seq += 1;
                touched.insert(id.clone());
            } else {
                self.extras.remove(&id);
            }
        }
        log_impossible(&id, &res);
        let mut info = self.info(&id);
        // A run that expired on arrival (`wait_s = 0`) keeps the reason why.
        if let (Ok(Some(v)), Some(i)) = (&res, info.as_mut()) {
            if i.view.reason.is_none() {
                i.view.reason = v.reason.clone();
            }
        }
        if res.is_ok() {
            self.unclaimed.remove(&id);
            if attach
                && info
                    .as_ref()
                    .is_some_and(|i| i.view.state == RunState::Queued)
            {
                *self.attached.entry(id.clone()).or_default() += 1;
            }
        }
        let value = match (res, info) {
            (Ok(_), Some(info)) => Ok(info),
            (Ok(_), None) => Err(run_vanished()),
            (Err(e), _) => Err(e.into()),
        };
        self.commit(touched, move |r| {
            let _ = reply.send(r.map_err(store_error).and(value));
        });
    }

    fn on_command(&mut self, cmd: Command, reply: Reply<RunInfo>) {
        let id = match &cmd {
            Command::Cancel { run_id }
            | Command::Renew { run_id, .. }
            | Command::Release { run_id, .. } => run_id.clone(),
            _ => String::new(),
        };
        if matches!(cmd, Command::Renew { fence: None, .. }) {
            self.unclaimed.remove(&id);
        }
        let mut touched = BTreeSet::new();
        let res = self.apply(cmd, &mut touched);
        let value = res
            .map_err(ApiError::from)
            .and_then(|_| self.info(&id).ok_or_else(run_vanished));
        self.commit(touched, move |r| {
            let _ = reply.send(r.map_err(store_error).and(value));
        });
    }

    fn on_get(&mut self, run_id: String, reply: Reply<RunInfo>) {
        let v = self
            .info(&run_id)
            .ok_or_else(|| CoreError::NotFound { run_id }.into());
        self.answer(reply, v);
    }

    fn on_list(&mut self, limit: usize, ended: bool, reply: Reply<Vec<RunInfo>>) {
        let mut all: Vec<(u64, RunInfo)> = self
            .extras
            .iter()
            .filter_map(|(id, e)| Some((e.queue_seq, self.info(id)?)))
            .filter(|(_, i)| ended || !i.view.state.is_terminal())
            .collect();
        all.sort_by_key(|(seq, _)| *seq);
        let v = all.into_iter().take(limit).map(|(_, i)| i).collect();
        self.answer(reply, Ok(v));
    }

    fn on_status(&mut self, reply: Reply<(Snapshot, ReapCounters)>) {
        let s = self.engine.snapshot();
        let c = self.reap_counters();
        self.answer(reply, Ok((s, c)));
    }

    fn on_fence_check(
        &mut self,
        run_id: String,
        fence: u64,
        reply: Reply<(bool, Option<RunState>)>,
    ) {
        let v = self.engine.view_of(&run_id);
        let state = v.as_ref().map(|v| v.state);
        let current = v.is_some_and(|v| v.fence == Some(fence) && v.state == RunState::Granted);
        self.answer(reply, Ok((current, state)));
    }

    fn on_detach(&mut self, run_id: String) {
        let left = match self.attached.get_mut(&run_id) {
            Some(n) => {
                *n = n.saturating_sub(1);
                *n
            }
            None => return,
        };
        if left == 0 {
            self.attached.remove(&run_id);
            // A9: the waiter's client went away; it leaves the queue at once.
            if self
                .engine
                .view_of(&run_id)
                .is_some_and(|v| v.state == RunState::Queued)
            {
                let mut touched = BTreeSet::new();
                let _ = self.apply(Command::Cancel { run_id }, &mut touched);
                self.commit(touched, |_| {});
            }
        }
    }

    fn on_subscribe(
        &mut self,
        run_id: String,
        reply: oneshot::Sender<Option<watch::Receiver<RunInfo>>>,
    ) {
        let rx = self.info(&run_id).map(|info| {
            self.watchers
                .entry(run_id)
                .or_insert_with(|| Arc::new(watch::channel(info).0))
                .subscribe()
        });
        let _ = reply.send(rx);
    }

    fn on_register_process(
        &mut self,
        run_id: String,
        fence: u64,
        pid: i32,
        uid: u32,
        reply: Reply<RunInfo>,
    ) {
        let value = self.register(&run_id, fence, pid, uid);
        let mut touched = BTreeSet::new();
        if value.is_ok() {
            touched.insert(run_id);
        }
        self.commit(touched, move |r| {
            let _ = reply.send(r.map_err(store_error).and(value));
        });
    }

    fn on_reap(&mut self, reply: Reply<(Vec<String>, ReapCounters)>) {
        let runs: Vec<String> = self
            .extras
            .keys()
            .filter(|id| {
                matches!(
                    self.engine.view_of(id).map(|v| v.state),
                    Some(RunState::Releasing | RunState::Degraded)
                )
            })
            .cloned()
            .collect();
        let mut touched = BTreeSet::new();
        let with_processes: Vec<bool> = runs.iter().map(|id| self.has_processes(id)).collect();
        let stopping = with_processes.iter().filter(|p| **p).count();
        tracing::info!(
            runs = runs.len(),
            stopping,
            without_processes = runs.len() - stopping,
            "reap pass: releasing and degraded runs stopped again"
        );
        for (id, has_processes) in runs.iter().zip(with_processes) {
            if has_processes {
                self.start_stop(id);
            } else {
                let ok = self.cleanup(id);
                let _ = self.apply(
                    Command::StopDone {
                        run_id: id.clone(),
                        ok,
                    },
                    &mut touched,
                );
            }
        }
        let counters = self.reap_counters();
        self.commit(touched, move |r| {
            let _ = reply.send(r.map_err(store_error).map(|()| (runs, counters)));
        });
    }

    fn on_reap_status(
        &mut self,
        runs: Vec<String>,
        reply: Reply<(usize, Vec<RunState>, ReapCounters)>,
    ) {
        let busy = runs.iter().filter(|id| self.stopping.contains(*id)).count();
        let states = runs
            .iter()
            .filter_map(|id| self.engine.view_of(id).map(|v| v.state))
            .collect();
        let counters = self.reap_counters();
        self.answer(reply, Ok((busy, states, counters)));
    }

    fn on_stopped(&mut self, run_id: String, report: berth_proc::StopReport) {
        self.stopping.remove(&run_id);
        self.counters.processes_terminated += report.terminated as u64;
        self.counters.reused_pids_protected += report.reused_pids_protected as u64;
        let (terminated, protected) = (report.terminated, report.reused_pids_protected);
        if report.unverified {
            // S4: could not look is never gone: degraded, retried by backoff.
            tracing::warn!(run_id, terminated, reused_pids_protected = protected, survivors = ?report.survivors, "stop finished unproven: the run's processes could not be proven gone (a /proc, pidfd or cgroup read failed); the run is degraded and the stop retried");
        } else if !report.ok() {
            tracing::warn!(run_id, terminated, reused_pids_protected = protected, survivors = ?report.survivors, "stop finished with survivors: processes survived SIGKILL; the run is degraded");
        } else {
            tracing::info!(
                run_id,
                terminated,
                reused_pids_protected = protected,
                "stop finished: every process of the run is gone"
            );
        }
        if let Some(e) = self.extras.get_mut(&run_id) {
            e.survivors = report.survivors.clone();
        }
        let ok = report.ok() && self.cleanup(&run_id);
        let mut touched = BTreeSet::new();
        let state = self.engine.view_of(&run_id).map(|v| v.state);
        if matches!(state, Some(RunState::Releasing | RunState::Degraded)) {
            let _ = self.apply(
                Command::StopDone {
                    run_id: run_id.clone(),
                    ok,
                },
                &mut touched,
            );
            if !ok {
                self.schedule_retry(&run_id);
            }
        }
        self.commit(touched, |_| {});
    }

    fn on_create_token(&mut self, grant: Grant, reply: Reply<String>) {
        match crate::auth::new_token() {
            Ok(token) => {
                let hash = crate::auth::hash_token(&token);
                self.shared
                    .tokens
                    .write()
                    .unwrap()
                    .push((hash.clone(), grant));
                let batch = Batch {
                    mutations: vec![Mutation::Token {
                        hash,
                        scope: grant.stored(),
                    }],
                };
                self.writer.submit(Some(batch), move |r| {
                    let _ = reply.send(r.map_err(store_error).map(|()| token));
                });
            }
            Err(e) => {
                let _ = reply.send(Err(internal(format!("token: {e}"))));
            }
        }
    }

    /// Time passes: expiries and deadlines (L6, A8), reclaim windows (P5), cleanup
    /// retries (L3), and optionally a MemAvailable sample (A10).
    pub fn tick(&mut self, now: u64, sample: Option<u64>) {
        self.now = now;
        let mut touched = BTreeSet::new();
        let _ = self.apply(Command::Tick, &mut touched);
        if let Some(mem) = sample {
            let _ = self.apply(Command::Sample { mem_available: mem }, &mut touched);
        }
        let lapsed: Vec<String> = self
            .unclaimed
            .iter()
            .filter(|(_, &d)| d <= now)
            .map(|(id, _)| id.clone())
            .collect();
        for id in lapsed {
            self.unclaimed.remove(&id);
            if !self.attached.contains_key(&id) {
                let _ = self.apply(Command::Cancel { run_id: id }, &mut touched);
            }
        }
        let due: Vec<String> = self
            .cleanup_retry
            .iter()
            .filter(|(_, (_, at))| *at <= now)
            .map(|(id, _)| id.clone())
            .collect();
        for id in due {
            let state = self.engine.view_of(&id).map(|v| v.state);
            if !matches!(state, Some(RunState::Releasing | RunState::Degraded)) {
                self.cleanup_retry.remove(&id);
                continue;
            }
            // Not again until this attempt has had its chance.
            self.schedule_retry(&id);
            tracing::debug!(
                run_id = id.as_str(),
                attempt = self.cleanup_retry.get(&id).map_or(0, |r| r.0),
                "retrying the stop and cleanup of a run"
            );
            if self.has_processes(&id) {
                self.start_stop(&id);
                continue;
            }
            let ok = self.cleanup(&id);
            let _ = self.apply(
                Command::StopDone {
                    run_id: id.clone(),
                    ok,
                },
                &mut touched,
            );
        }
        if !touched.is_empty() || !self.pending_stops.is_empty() {
            self.commit(touched, |_| {});
        }
    }

    pub fn close(mut self) {
        self.writer.close();
        // A clean stop leaves the exact last fence as the marker: the next start
        // continues at +1 instead of skipping the rest of the reserved block.
        if self.fatal.reason().is_none() {
            if let Err(e) = self.marker.write(self.engine.last_fence()) {
                tracing::warn!("fence marker: {e:#}");
            }
        }
        // This daemon's cgroup namespace goes when no run group is left in it (groups
        // of live runs stay for the next start to re-adopt; rmdir refuses then).
        if let Some(base) = &self.supervision.cgroup_base {
            let _ = std::fs::remove_dir(base);
        }
    }
}

/// Runs the state task until every sender is gone.
pub async fn run(
    mut st: State,
    mut rx: mpsc::Receiver<Msg>,
    tick_ms: u64,
    sample_memory: bool,
    probe: Option<crate::CommitProbe>,
) {
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(tick_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_sample = 0u64;
    loop {
        tokio::select! {
            msg = rx.recv() => match msg {
                Some(m) => {
                    st.handle(clock::mono_ms(), m);
                    if let Some(p) = &probe {
                        p.0.store(st.writer_commits(), std::sync::atomic::Ordering::Relaxed);
                    }
                }
                None => break,
            },
            _ = tick.tick() => {
                let now = clock::mono_ms();
                let sample = if sample_memory && now >= last_sample + 1000 {
                    last_sample = now;
                    crate::host::memory_available()
                } else {
                    None
                };
                st.tick(now, sample);
            }
        }
    }
    st.close();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// One event as `Capture` saw it: its level, message and other fields (`Debug`
    /// form, strings as they are).
    #[derive(Clone, Debug)]
    struct Line {
        level: tracing::Level,
        message: String,
        fields: BTreeMap<String, String>,
    }

    /// A subscriber that keeps every event (no spans are used here).
    #[derive(Clone, Default)]
    struct Capture(Arc<Mutex<Vec<Line>>>);

    impl Capture {
        fn lines(&self) -> Vec<Line> {
            self.0.lock().unwrap().clone()
        }
    }

    impl tracing::Subscriber for Capture {
        fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
            tracing::span::Id::from_u64(1)
        }
        fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
        fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
        fn event(&self, event: &tracing::Event<'_>) {
            struct Fields(BTreeMap<String, String>);
            impl tracing::field::Visit for Fields {
                fn record_str(&mut self, f: &tracing::field::Field, v: &str) {
                    self.0.insert(f.name().to_string(), v.to_string());
                }
                fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
                    self.0.insert(f.name().to_string(), format!("{v:?}"));
                }
            }
            let mut fields = Fields(BTreeMap::new());
            event.record(&mut fields);
            let mut fields = fields.0;
            let message = fields.remove("message").unwrap_or_default();
            self.0.lock().unwrap().push(Line {
                level: *event.metadata().level(),
                message,
                fields,
            });
        }
        fn enter(&self, _: &tracing::span::Id) {}
        fn exit(&self, _: &tracing::span::Id) {}
    }

    /// The state task's state over the state directory `dir`, as a start restores it.
    fn restore(dir: &std::path::Path) -> State {
        let mut store = berth_store::SqliteStore::open_exclusive(&dir.join("ledger.db")).unwrap();
        use berth_store::Store;
        let ledger = store.load(1_000).unwrap();
        let runs_dir = workspace::ensure_runs_dir(dir).unwrap();
        State::restore(
            clock::mono_ms(),
            berth_core::Config::for_host(4, 8 << 30, 100 << 30),
            ledger,
            true,
            Writer::spawn(Box::new(store), true),
            Arc::new(Shared {
                tokens: RwLock::new(Vec::new()),
                url: "http://127.0.0.1:1".into(),
            }),
            runs_dir,
            30_000,
            Arc::new(crate::Fatal::default()),
            crate::private::FenceMarker::open(dir).unwrap(),
            Supervision {
                cgroup_base: None,
                grace_ms: 1_000,
                kill_wait_ms: 1_000,
            },
            workspace::Diagnostics {
                dir: dir.join("diagnostics"),
                run_bytes_max: 1 << 20,
                total_bytes_max: 1 << 30,
                run_entries_max: workspace::DIAGNOSTICS_RUN_ENTRIES_MAX,
                total_entries_max: workspace::DIAGNOSTICS_TOTAL_ENTRIES_MAX,
            },
        )
        .unwrap()
    }

    fn acquire(
        st: &mut State,
        run_id: &str,
        ttl_ms: u64,
        cpu_millis: u64,
    ) -> Result<RunInfo, ApiError> {
        let (reply, rx) = oneshot::channel();
        st.handle(
            clock::mono_ms(),
            Msg::Acquire {
                req: berth_core::Request {
                    run_id: run_id.into(),
                    project: run_id.replace(':', "-"),
                    class: berth_core::Class::Managed,
                    priority: berth_core::Priority::Foreground,
                    resources: berth_core::Resources {
                        slots: 1,
                        cpu_millis,
                        ..Default::default()
                    },
                    singletons: Vec::new(),
                    contract: None,
                    ttl_ms,
                    wait_ms: 0,
                },
                worktree: None,
                labels: BTreeMap::new(),
                stop_grace_ms: None,
                attach: false,
                reply,
            },
        );
        rx.blocking_recv().unwrap()
    }

    /// The one INFO line whose message starts with `prefix`.
    fn info_line(lines: &[Line], prefix: &str) -> Line {
        let found: Vec<&Line> = lines
            .iter()
            .filter(|l| l.level == tracing::Level::INFO && l.message.starts_with(prefix))
            .collect();
        assert_eq!(found.len(), 1, "{prefix}: {lines:#?}");
        found[0].clone()
    }

    /// What an operator reads: a lease that ran out and an impossible request are INFO
    /// lines naming the run; a grant is DEBUG; a restart says what it restored.
    #[test]
    fn expiry_refusal_and_restart_summary_are_logged_with_the_run_id() {
        let dir = tempfile::tempdir().unwrap();
        let cap = Capture::default();
        tracing::subscriber::with_default(cap.clone(), || {
            let mut st = restore(dir.path());
            let exp = acquire(&mut st, "exp-1", 1, 100).unwrap();
            assert_eq!(exp.view.state, RunState::Granted);
            let keep = acquire(&mut st, "keep:2", 600_000, 100).unwrap();
            let never = acquire(&mut st, "huge.3", 600_000, 1_000_000).unwrap_err();
            assert_eq!(never.code, "capacity_impossible");
            std::thread::sleep(std::time::Duration::from_millis(20));
            st.tick(clock::mono_ms(), None);
            assert_eq!(
                st.engine.view_of("exp-1").map(|v| v.state),
                Some(RunState::Expired)
            );
            st.close();
            let lines = cap.lines();

            let l = info_line(&lines, "lease expired");
            assert_eq!(l.fields["run_id"], "exp-1", "{l:?}");
            assert_eq!(l.fields["fence"], exp.view.fence.unwrap().to_string());
            let l = info_line(&lines, "acquire refused (capacity_impossible)");
            assert_eq!(l.fields["run_id"], "huge.3", "{l:?}");
            assert_eq!(l.fields["resource"], "cpu_millis", "{l:?}");
            assert_eq!(l.fields["request"], "1000000", "{l:?}");
            // Grants are DEBUG, with the run id; nothing else about them at INFO.
            for id in ["exp-1", "keep:2"] {
                assert!(
                    lines.iter().any(|l| l.level == tracing::Level::DEBUG
                        && l.message == "granted"
                        && l.fields.get("run_id").map(String::as_str) == Some(id)),
                    "{id}: {lines:#?}"
                );
            }
            assert!(!lines.iter().any(|l| l.level == tracing::Level::INFO
                && l.fields.get("run_id").map(String::as_str) == Some("keep:2")));
            // Every line about a run names it.
            for l in &lines {
                if l.level <= tracing::Level::INFO && l.message.contains("run") {
                    assert!(
                        l.fields.contains_key("run_id") || l.message.starts_with("restored"),
                        "{l:?}"
                    );
                }
            }

            // The restart says what it found.
            cap.0.lock().unwrap().clear();
            let st = restore(dir.path());
            let l = info_line(&cap.lines(), "restored from the ledger");
            for (k, v) in [
                ("granted", "1"),
                ("queued", "0"),
                ("releasing", "0"),
                ("degraded", "0"),
                ("ended", "1"),
                ("same_boot", "true"),
            ] {
                assert_eq!(l.fields[k], v, "{k}: {l:?}");
            }
            let last: u64 = l.fields["last_fence"].parse().unwrap();
            assert!(last >= keep.view.fence.unwrap(), "{l:?}");
            st.close();
        });
    }
}
