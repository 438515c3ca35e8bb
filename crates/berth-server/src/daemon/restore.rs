//! P5: the daemon rebuilt from its ledger at start.

use berth_core::Class;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;

use berth_core::{Engine, RestoredRun, RunState};
use berth_store::{Ledger, RunRecord, WorkspaceIdentity, Writer};

use super::extra::Extra;
use super::host::{Ended, Owned};
use super::{Daemon, Held, Host, ReapCounters, Shared};

/// What a start knows besides the ledger.
pub struct Restore {
    pub cfg: berth_core::Config,
    /// The ledger was written in this boot (its monotonic times still mean something).
    pub same_boot: bool,
    /// How long a restored waiter has to re-attach before it is cancelled (P5).
    pub reconnect_window_ms: u64,
    /// Where runs' ports come from (W3).
    pub port_range: (u16, u16),
    /// Agent threads' idle time, ttl and grace (G0, G1).
    pub threads: berth_core::threads::ThreadConfig,
}

/// One line at startup: what the ledger gave back (P5), then one naming the runs still
/// to be stopped (releasing, degraded: the reaper recovers them now), by id, the first
/// `RECOVERING_NAMED_MAX` of them.
fn restore_summary(ledger: &Ledger, same_boot: bool) {
    let count = |s: RunState| ledger.runs.iter().filter(|r| r.state == s).count();
    let ended = ledger.runs.iter().filter(|r| r.state.is_terminal()).count();
    tracing::info!(
        granted = count(RunState::Granted),
        queued = count(RunState::Queued),
        releasing = count(RunState::Releasing),
        degraded = count(RunState::Degraded),
        ended,
        last_fence = ledger.last_fence,
        same_boot,
        "restored from the ledger{}",
        if same_boot {
            ""
        } else {
            " (after a reboot: every lease is over, every waiter has one reconnect window)"
        }
    );
    let recovering: Vec<&str> = ledger
        .runs
        .iter()
        .filter(|r| matches!(r.state, RunState::Releasing | RunState::Degraded))
        .map(|r| r.request.run_id.as_str())
        .collect();
    if !recovering.is_empty() {
        let more = recovering.len().saturating_sub(RECOVERING_NAMED_MAX);
        let named = recovering[..recovering.len().min(RECOVERING_NAMED_MAX)].join(" ");
        let more = if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        };
        tracing::warn!(
            "recovering {} runs still to be stopped: {named}{more}",
            recovering.len()
        );
    }
}

/// Runs named by id in the startup line of those being recovered (the rest counted).
const RECOVERING_NAMED_MAX: usize = 100;

/// W1/P5: the workspaces no run or thread of the ledger owns are removed, each said.
/// A crash between making a granted run's workspace and committing its grant leaves
/// one: nothing would ever own, reuse or remove it (issue 35). So does a crash between
/// a release's commit and the pool thread's move aside: an ended run's workspace,
/// whose logs are archived under its run id.
fn sweep_workspaces<H: Host>(host: &mut H, ledger: &Ledger) {
    let key = |w: &WorkspaceIdentity| (w.path.clone(), w.dev, w.ino);
    // An ended run's record still names the workspace it had: not an owner, but its
    // logs are the run's (a crash came between its release and the pool's move).
    let (ended, live): (Vec<_>, Vec<_>) = ledger.runs.iter().partition(|r| r.state.is_terminal());
    let runs = live.iter().filter_map(|r| r.workspace.as_ref());
    let threads = ledger.threads.iter().filter_map(|t| t.workspace.as_ref());
    let owned: Owned = runs.chain(threads).map(key).collect();
    let ended: Ended = ended
        .iter()
        .filter_map(|r| Some((key(r.workspace.as_ref()?), r.request.run_id.clone())))
        .collect();
    for (path, run_id) in host.sweep_workspaces(&owned, &ended) {
        match run_id {
            Some(run_id) => tracing::warn!(
                path,
                run_id,
                "an ended run's workspace (a crash before the pool moved it aside) was removed"
            ),
            None => tracing::warn!(
                path,
                "a workspace no run owns (a crash before its grant was recorded) was removed"
            ),
        }
    }
}

/// A ledger record as the engine and the daemon take it back. Times are this boot's
/// monotonic milliseconds; after a reboot (`reboot_window` is the reconnect window)
/// every lease is over and every waiter has one reconnect window.
fn restored_run(mut r: RunRecord, now: u64, reboot_window: Option<u64>) -> (RestoredRun, Extra) {
    let (mut enqueued, mut deadline, mut expires) =
        (r.enqueued_ms, r.deadline_ms, r.expires_ms.unwrap_or(0));
    if let Some(window) = reboot_window {
        enqueued = enqueued.min(now);
        deadline = now + window;
        expires = now;
    }
    let extra = Extra::restored(&mut r);
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
        upgrading: r.upgrading,
    };
    (run, extra)
}

/// Threads and the drain back from the ledger. After a reboot threads' monotonic times
/// mean nothing: registrations are over (their owners re-attach), and the idle and ttl
/// clocks start again from now, so a thread's workspace gets its whole idle time to be
/// claimed. A drain survives a restart, and the engine holds its waiters again.
fn restored_threads(
    cfg: berth_core::threads::ThreadConfig,
    ledger: (
        Vec<berth_store::ThreadRecord>,
        Option<berth_store::DrainRecord>,
    ),
    now: u64,
    same_boot: bool,
) -> super::threads::ThreadState {
    let (records, drain) = ledger;
    let mut threads = berth_core::threads::Threads::new(cfg);
    let mut ws = HashMap::new();
    let mut owner_uids = HashMap::new();
    for mut r in records {
        if let Some(uid) = r.owner_uid {
            owner_uids.insert(r.thread.key.clone(), uid);
        }
        if !same_boot {
            r.thread.registration = None;
            r.thread.created_ms = now;
            r.thread.active_ms = now;
        }
        if let Some(w) = r.workspace {
            ws.insert(r.thread.key.clone(), w);
        }
        threads.restore(r.thread);
    }
    super::threads::ThreadState {
        threads,
        ws,
        drain,
        fleet_drain: None,
        sweep_due: 0,
        pressure_refused: BTreeSet::new(),
        owner_uids,
    }
}

/// The last fence, the scopes and the promotion evidence, as the ledger kept them.
type Kept = (
    u64,
    Vec<berth_core::scopes::Scope>,
    Vec<(String, berth_core::Evidence)>,
);

/// The engine back from the ledger: its runs, the scopes (B1–B5: tokens and receipts
/// as they were; after a reboot their monotonic times mean nothing, so they read as
/// the restart's time) and the promotion evidence (C3).
fn restored_engine(
    cfg: berth_core::Config,
    now: u64,
    runs: Vec<RestoredRun>,
    kept: Kept,
    same_boot: bool,
    draining: bool,
) -> Result<Engine, String> {
    let (last_fence, mut scopes, evidence) = kept;
    if !same_boot {
        for s in &mut scopes {
            s.tokens.values_mut().for_each(|t| t.since_ms = now);
            s.receipts.iter_mut().for_each(|r| r.at_ms = now);
        }
    }
    Engine::restore_with_scopes(cfg, last_fence, now, runs, scopes, evidence, draining)
}

/// The ledger's runs, sorted into what the daemon keeps of them: the engine's view,
/// each run's extras, the waiters that must come back, the ended, the clean-ups to
/// retry, the ports held and the analysis runs whose listeners are watched again.
struct Sorted {
    restored: Vec<RestoredRun>,
    extras: HashMap<String, Box<Extra>>,
    unclaimed: BTreeMap<String, u64>,
    ended: VecDeque<String>,
    cleanup_retry: BTreeMap<String, (u32, u64)>,
    ports: super::PortBroker,
    rewatch: Vec<String>,
}

fn sort_runs(runs: Vec<RunRecord>, now: u64, how: &Restore) -> Sorted {
    let mut out = Sorted {
        restored: Vec::with_capacity(runs.len()),
        extras: HashMap::with_capacity(runs.len()),
        unclaimed: BTreeMap::new(),
        ended: VecDeque::new(),
        cleanup_retry: BTreeMap::new(),
        ports: super::PortBroker::new(how.port_range),
        rewatch: Vec::new(),
    };
    let reboot_window = (!how.same_boot).then_some(how.reconnect_window_ms);
    for r in runs {
        let id = r.request.run_id.clone();
        match r.state {
            // A detached waiter needs no client to come back for it.
            RunState::Queued if !r.detached => {
                out.unclaimed
                    .insert(id.clone(), now + how.reconnect_window_ms);
            }
            RunState::Releasing | RunState::Degraded => {
                out.cleanup_retry.insert(id.clone(), (0, 0));
            }
            s if s.is_terminal() => out.ended.push_back(id.clone()),
            _ => {}
        }
        let (run, extra) = restored_run(r, now, reboot_window);
        if !run.state.is_terminal() {
            if run.request.class == Class::Analysis && !extra.processes.is_empty() {
                out.rewatch.push(id.clone());
            }
            for (_, p) in extra.ports.iter().filter(|(_, p)| *p != 0) {
                out.ports.hold(*p, &id);
            }
        }
        out.extras.insert(id, Box::new(extra));
        out.restored.push(run);
    }
    out
}

impl<H: Host> Daemon<H> {
    /// Rebuilds the daemon from the ledger (P5). Times in the ledger are this boot's
    /// monotonic milliseconds; after a reboot every lease is over and every waiter has
    /// one reconnect window. The ledger's runs are moved, not copied: a restart's peak
    /// memory is one copy of what it loads.
    pub fn restore(
        now: u64,
        how: Restore,
        ledger: Ledger,
        writer: &Writer,
        shared: Arc<Shared>,
        fatal: Arc<crate::Fatal>,
        host: H,
    ) -> Result<Daemon<H>, String> {
        restore_summary(&ledger, how.same_boot);
        let mut host = host;
        sweep_workspaces(&mut host, &ledger);
        shared.journal.start(ledger.journal_last, writer.reader());
        let Sorted {
            restored,
            extras,
            unclaimed,
            ended,
            cleanup_retry,
            ports,
            rewatch,
        } = sort_runs(ledger.runs, now, &how);
        let kept = (ledger.last_fence, ledger.scopes, ledger.evidence);
        let draining = ledger.drain.is_some();
        let engine = restored_engine(how.cfg, now, restored, kept, how.same_boot, draining)?;
        let g = (ledger.threads, ledger.drain);
        let th = restored_threads(how.threads, g, now, how.same_boot);
        let mut d = Daemon {
            now,
            engine,
            effects: Vec::new(),
            pruned: writer.pruned_counter(),
            shared,
            host,
            extras,
            ended,
            next_seq: ledger.next_queue_seq,
            attached: HashMap::new(),
            unclaimed_due: unclaimed.values().min().copied().unwrap_or(u64::MAX),
            unclaimed,
            watchers: HashMap::new(),
            cleanup_retry,
            fatal,
            stopping: BTreeSet::new(),
            counters: ReapCounters::default(),
            pending_stops: Vec::new(),
            ports,
            pending_mutations: Vec::new(),
            ended_records: HashMap::new(),
            listen_watched: BTreeMap::new(),
            rewatch,
            to_settle: Vec::new(),
            frozen: Default::default(),
            journal_next: ledger.journal_last + 1,
            registrations: 0,
            journal_at: (0, String::new()),
            queue_moves: 0,
            queue_moves_told: (0, 0),
            held: Held::default(),
            th,
            fleet: super::fleet::FleetState::default(),
        };
        d.repair_workspaces();
        d.thaw_restored();
        Ok(d)
    }

    /// What the restore itself left to be done (its repairs), for the shell to carry
    /// out before the first step. Left alone, the first step carries it out first.
    pub fn restored_effects(&mut self) -> super::Effects {
        self.take_effects()
    }

    /// W1 after a crash (issue 35): a workspace is removed before the commit that ends
    /// its run or evicts its thread (the removal's outcome decides between released and
    /// degraded), so a crash between the two leaves the ledger naming a workspace that
    /// is gone. A granted run gets a fresh one or, if none can be made, is released as
    /// at a grant; a thread gets a fresh one (its eviction is decided again by the
    /// sweep). Committed by the first step, ahead of its own effects.
    fn repair_workspaces(&mut self) {
        let mut touched = BTreeSet::new();
        let gone = |ws: &Option<berth_store::WorkspaceIdentity>, host: &H| {
            ws.as_ref().is_some_and(|w| !host.workspace_present(w))
        };
        let runs: Vec<(String, u64)> = (self.engine.in_flight().iter())
            .filter(|v| v.state == RunState::Granted)
            .filter(|v| {
                gone(
                    &self.extras.get(&v.run_id).and_then(|e| e.workspace.clone()),
                    &self.host,
                )
            })
            .map(|v| (v.run_id.clone(), v.fence.unwrap_or(0)))
            .collect();
        for (run_id, fence) in runs {
            let owner = self.extras.get(&run_id).and_then(|e| e.owner_uid);
            tracing::warn!(run_id, "a granted run's workspace was gone at start (a crash cut its end short); it gets a new one");
            touched.insert(run_id.clone());
            match self.host.create_workspace(&run_id, owner) {
                Ok(ws) => self
                    .extras
                    .get_mut(&run_id)
                    .into_iter()
                    .for_each(|e| e.workspace = Some(ws.clone())),
                Err(e) => {
                    let why = format!("its workspace was gone after a restart and a new one could not be made: {e}");
                    let events = self.release_at_grant(&run_id, fence, why);
                    self.carry_out(events, &mut touched);
                }
            }
        }
        let threads: Vec<String> = (self.th.ws.iter())
            .filter(|(_, w)| !self.host.workspace_present(w))
            .map(|(k, _)| k.clone())
            .collect();
        for key in threads {
            self.remake_thread_workspace(&key);
        }
        if !touched.is_empty() || !self.pending_mutations.is_empty() {
            self.commit(touched, |_| {});
        }
    }
}

impl<H: Host> Daemon<H> {
    /// A daemon and its shell over `store`, as a start makes them, for the tests and
    /// the simulator: one same-boot restore, a fresh token table, a group-committing
    /// writer.
    #[cfg(test)]
    pub(super) fn start_for_test(
        now: u64,
        how: Restore,
        mut store: Box<dyn berth_store::Store>,
        url: &str,
        host: H,
    ) -> (Daemon<H>, super::Shell) {
        let ledger = store.load(how.cfg.ended_retained_max).unwrap();
        let shared = Arc::new(Shared {
            url: url.into(),
            ..Default::default()
        });
        let writer = Writer::spawn(store, true);
        let fatal = Arc::new(crate::Fatal::default());
        let d = Daemon::restore(
            now,
            how,
            ledger,
            &writer,
            shared.clone(),
            fatal.clone(),
            host,
        );
        let mut d = d.expect("restore");
        let shell = super::Shell::new(writer, shared, fatal);
        shell.carry_out(d.restored_effects());
        shell.flush();
        (d, shell)
    }
}
