//! The admission engine: a deterministic state machine over runs, capacity, keys and the
//! queue. This file holds its state, `apply` (the one mutator after construction) and
//! the bookkeeping every concern shares; each concern is a module of its own below.
//! See docs/design.md for the rules it keeps and why it is shaped this way.

use std::collections::{BTreeSet, HashMap, VecDeque};

use crate::command::{Command, Error, Event, HostSample, Output, PressureKind};
use crate::config::{Config, PRESSURE_BP_MAX};
use crate::queue::{Queue, Slot};
use crate::scopes::{Block, Scope, ScopeError, Scopes};
use crate::types::{
    Class, Concurrency, ConcurrencyClass, ContractInfo, EndCause, Evidence, Fence, KeyMode,
    Priority, Reason, Request, Resources, RunState, RunView, TimeMs,
};
use crate::validate;

mod admission;
mod budgets;
mod invariants;
mod lease;
mod pass;
mod promotion;
mod reasons;
mod restore;
mod snapshot;
mod views;

pub(crate) use admission::runtime_key;
use admission::{key_names, lower};
pub(crate) use promotion::concurrency_class;
use promotion::contract_matches;
pub use snapshot::{ProjectFigures, ResourceFigures, Snapshot};

/// Fixed resource indices; named resources follow from `FIXED`.
pub(crate) const SLOTS: usize = 0;
pub(crate) const MEMORY: usize = 1;
pub(crate) const CPU: usize = 2;
pub(crate) const DISK: usize = 3;
pub(crate) const FIXED: usize = 4;
pub(crate) const FIXED_NAMES: [&str; FIXED] = ["slots", "memory", "cpu_millis", "disk"];

/// Named limits on request contents, so a single request cannot make a pass expensive.
pub const SINGLETONS_MAX: usize = 32;
pub const PORTS_MAX: usize = 64;

pub(crate) type KeyId = u32;
type ProjectId = u32;

/// A singleton whose name starts with this is fleet-wide (F1): the fleet store holds it
/// as key NAME besides this host's own exclusion.
pub const FLEET_SINGLETON_PREFIX: &str = "fleet:";
/// Fleet-wide singletons a run may name at most (each is a row the fleet's claim
/// writes in its one statement).
pub const FLEET_KEYS_MAX: usize = 16;

/// What [`Engine::fleet_needs`] answers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FleetNeeds {
    /// (scope, harness, limit)
    pub token: Option<(String, String, u32)>,
    pub keys: Vec<String>,
    pub state: RunState,
}

#[derive(Clone, Debug)]
pub(crate) struct Run {
    pub(crate) req: Request,
    pub(crate) project: ProjectId,
    pub(crate) amounts: Box<[u64]>,
    /// Primary key first (runtime or analysis), then singletons.
    pub(crate) keys: Vec<(KeyId, KeyMode)>,
    /// The runtime key is shared because the project is promoted (C3).
    pub(crate) promoted_shared: bool,
    pub(crate) contract: Option<ContractInfo>,
    pub(crate) state: RunState,
    pub(crate) seq: u64,
    pub(crate) enqueued_at: TimeMs,
    pub(crate) deadline: TimeMs,
    pub(crate) fence: Option<Fence>,
    pub(crate) granted_at: TimeMs,
    pub(crate) expires_at: TimeMs,
    pub(crate) cause: Option<EndCause>,
    /// C4: waiting to hold this (runtime) key exclusively; holds nothing on it meanwhile.
    pub(crate) upgrade: Option<KeyId>,
    pub(crate) pending_mem: bool,
    /// F1: the fence of the fleet-wide claim the fleet store holds for this run, and
    /// whether the caller was asked for one (once per run and restart).
    pub(crate) permit: Option<Fence>,
    pub(crate) permit_asked: bool,
    /// A8/A11: what a waiter whose wait ran out was last waiting on, so its `expired`
    /// answer says why (it is no longer queued, so `reason` cannot be asked any more).
    /// Boxed: only expired waiters have one.
    pub(crate) last_reason: Option<Box<Reason>>,
}

#[derive(Clone, Debug, Default)]
pub(crate) struct KeyState {
    pub(crate) name: String,
    pub(crate) exclusive: Option<Slot>,
    pub(crate) shared: u32,
    /// Queued exclusive claimants per priority (writer preference, A4).
    pub(crate) exclusive_waiting: [u32; 2],
    /// Every queued claimant of this key: (priority, seq, slot).
    pub(crate) waiters: BTreeSet<(Priority, u64, Slot)>,
    /// C4 upgrades, first come first served; they go before any queued claimant.
    pub(crate) upgrades: VecDeque<Slot>,
}

impl KeyState {
    fn idle(&self) -> bool {
        self.exclusive.is_none()
            && self.shared == 0
            && self.waiters.is_empty()
            && self.upgrades.is_empty()
    }
}

#[derive(Clone, Debug, Default)]
pub(crate) struct ProjectState {
    pub(crate) name: String,
    pub(crate) waiting: u32,
    pub(crate) active: u32,
    pub(crate) degraded: u32,
    pub(crate) evidence: Option<Evidence>,
    /// The latest contract seen for the project asks for `parallel`.
    pub(crate) parallel_asked: bool,
}

/// Why a waiter cannot be granted now. Rendered into a [`Reason`] on demand only, so a
/// pass never formats strings.
#[derive(Clone, Debug)]
pub(crate) enum Blocker {
    ForegroundWaiting,
    Upgrade(KeyId),
    ExclusiveHeld(KeyId, Slot),
    SharedHeld(KeyId, u32),
    WriterWaiting(KeyId),
    Resource {
        res: usize,
        need: u64,
        free: u64,
    },
    Ambient {
        need: u64,
        free: u64,
    },
    Guard {
        head: Slot,
    },
    /// G4: the host is draining; nothing new is granted until the drain ends.
    Draining,
    /// Issue 36: the run's disk claim does not fit in the free space the host has
    /// now (less the reserve and the pending claims).
    Disk {
        need: u64,
        free: u64,
    },
    /// Issue 36: the host's memory, cpu or io pressure (hundredths of a percent) is
    /// above what this run's priority is admitted under.
    Pressure {
        kind: PressureKind,
        bp: u32,
        max: u32,
    },
    /// B5 / the harness limit: the run's budget token cannot be taken now.
    Budget(Slot, Block),
    /// F1: everything local fits; the fleet-wide claim is not held yet.
    Permit,
}

#[derive(Clone, Debug)]
pub struct Engine {
    pub(crate) cfg: Config,
    pub(crate) now: TimeMs,
    pub(crate) res_names: Vec<String>,
    pub(crate) allocatable: Vec<u64>,
    pub(crate) committed: Vec<u64>,
    /// Boxed: a slot that is free costs 8 bytes, not a whole `Run`, so the slab a deep
    /// queue grew is mostly given back when the queue drains (the slab never shrinks).
    pub(crate) runs: Vec<Option<Box<Run>>>,
    free_slots: Vec<Slot>,
    pub(crate) by_id: HashMap<String, Slot>,
    pub(crate) keys: Vec<Option<KeyState>>,
    free_keys: Vec<KeyId>,
    key_ids: HashMap<String, KeyId>,
    pub(crate) projects: Vec<Option<ProjectState>>,
    free_projects: Vec<ProjectId>,
    pub(crate) project_ids: HashMap<String, ProjectId>,
    pub(crate) queues: [Queue; 2],
    /// G4: while set, no waiter is granted (runs already granted go on as before).
    pub(crate) draining: bool,
    /// Issue 36: the host's memory pressure as last sampled (PSI `some avg10`, in
    /// hundredths of a percent; 0 until a sample says otherwise). Not restored: the
    /// next sample, a second after a start, says what it is.
    pub(crate) pressure_bp: [u32; 3],
    /// B1–B5: experiment budgets; a run's token is part of its claim.
    pub(crate) scopes: Scopes,
    pub(crate) deadlines: BTreeSet<(TimeMs, Slot)>,
    pub(crate) expiries: BTreeSet<(TimeMs, Slot)>,
    /// Grants whose memory and disk are still `pending` (A2): (settles at, slot, fence).
    pending: VecDeque<(TimeMs, Slot, Fence)>,
    pub(crate) pending_memory: u64,
    /// Issue 36: the disk claims of the pending grants.
    pub(crate) pending_disk: u64,
    /// Issue 36: free space on the workspaces' file system as last sampled (`None`:
    /// not sampled; the configured total alone counts). Not restored.
    pub(crate) disk_free: Option<u64>,
    /// Issue 36: foreground runs holding a claim (none: the host is idle, and the
    /// idle memory reserve applies).
    pub(crate) foreground_holding: u32,
    samples: VecDeque<u64>,
    pub(crate) stabilized_available: Option<u64>,
    pub(crate) last_fence: Fence,
    ended: VecDeque<Slot>,
    /// Runs ended by the `apply` under way: never retired by it, however many, so
    /// every run its events say ended can still be read (and recorded) after it.
    ended_in_apply: usize,
    keys_with_upgrades: BTreeSet<KeyId>,
    window_buf: Vec<(u64, Slot)>,
    pub(crate) background_grants_while_foreground_waits: u64,
    /// When idle scopes are looked for next (S10): at most once a minute.
    scope_prune_at: TimeMs,
}

/// How often idle scopes are looked for (at most: half the idle window if that is
/// shorter): a walk of at most `SCOPES_MAX` scopes.
const SCOPE_PRUNE_EVERY_MS: u64 = 60_000;

/// A run as the ledger remembers it; see [`Engine::restore`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RestoredRun {
    pub request: Request,
    pub state: RunState,
    pub fence: Option<Fence>,
    pub enqueued_at: TimeMs,
    pub deadline: TimeMs,
    pub granted_at: TimeMs,
    pub expires_at: TimeMs,
    pub cause: Option<EndCause>,
    pub primary_mode: KeyMode,
    /// C4: a demoted holder queued for the exclusive key it gave up its shared hold
    /// for: it holds nothing on that key until the upgrade is granted (S11: without
    /// this, a restore read it as an exclusive holder beside the shared ones).
    pub upgrading: bool,
}

impl Engine {
    /// `last_fence` is the largest fence ever issued, from the caller's durable counter (L1).
    pub fn new(cfg: Config, last_fence: Fence) -> Result<Engine, String> {
        cfg.validate()?;
        let mut res_names: Vec<String> = FIXED_NAMES.iter().map(|s| s.to_string()).collect();
        let mut allocatable = vec![
            cfg.slots_max,
            cfg.memory_total.saturating_sub(cfg.memory_reserve),
            cfg.cpu_total_millis.saturating_sub(cfg.cpu_reserve_millis),
            cfg.disk_total.saturating_sub(cfg.disk_reserve),
        ];
        for (name, total) in &cfg.named {
            res_names.push(name.clone());
            allocatable.push(*total);
        }
        let n = allocatable.len();
        Ok(Engine {
            cfg,
            now: 0,
            res_names,
            allocatable,
            committed: vec![0; n],
            runs: Vec::new(),
            free_slots: Vec::new(),
            by_id: HashMap::new(),
            keys: Vec::new(),
            free_keys: Vec::new(),
            key_ids: HashMap::new(),
            projects: Vec::new(),
            free_projects: Vec::new(),
            project_ids: HashMap::new(),
            queues: [Queue::default(), Queue::default()],
            draining: false,
            pressure_bp: [0; 3],
            scopes: Scopes::default(),
            deadlines: BTreeSet::new(),
            expiries: BTreeSet::new(),
            pending: VecDeque::new(),
            pending_memory: 0,
            pending_disk: 0,
            disk_free: None,
            foreground_holding: 0,
            samples: VecDeque::new(),
            stabilized_available: None,
            last_fence,
            ended: VecDeque::new(),
            ended_in_apply: 0,
            keys_with_upgrades: BTreeSet::new(),
            window_buf: Vec::new(),
            background_grants_while_foreground_waits: 0,
            scope_prune_at: 0,
        })
    }

    /// Applies one command at monotonic time `now_ms` (clamped so time never goes back).
    pub fn apply(&mut self, now_ms: TimeMs, cmd: Command) -> Output {
        let mut ev = Vec::new();
        self.ended_in_apply = 0;
        self.advance(now_ms, &mut ev);
        let advanced = !ev.is_empty();
        let now = self.now;
        let is_acquire = matches!(cmd, Command::Acquire(_) | Command::AcquirePermitted { .. });
        let result = self.dispatch(now, cmd, &mut ev);
        // Every command ends with a bounded admission pass: whatever it changed may let
        // someone in, and passes on ticks rotate the window through a deep queue (A6).
        // A refused command skips it unless time itself changed something; an acquire
        // has already run its own pass (which also considers the newcomer).
        if (result.is_ok() && !is_acquire) || (result.is_err() && advanced) {
            self.pass(now, None, &mut ev);
        }
        // Answer with the run as it is after the pass (a fresh acquire may be granted).
        let result = result.map(|view| {
            view.map(|v| match v.state {
                RunState::Queued => self.view_of(&v.run_id).unwrap_or(v),
                _ => v,
            })
        });
        Output { events: ev, result }
    }

    /// One command, carried out (the pass after it is `apply`'s).
    fn dispatch(
        &mut self,
        now: TimeMs,
        cmd: Command,
        ev: &mut Vec<Event>,
    ) -> Result<Option<RunView>, Error> {
        match cmd {
            Command::Acquire(req) => self.acquire(now, req, None, ev),
            Command::AcquirePermitted { req, fence } => self.acquire(now, req, Some(fence), ev),
            Command::Cancel { run_id } => self.cancel(&run_id, ev),
            Command::Renew {
                run_id,
                fence,
                ttl_ms,
            } => self.renew(now, &run_id, fence, ttl_ms, ev),
            Command::Release { run_id, fence } => self.release(&run_id, fence, ev),
            Command::StopDone { run_id, ok } => self.stop_done(&run_id, ok, ev),
            Command::Tick => Ok(None),
            cmd @ (Command::Drain { .. } | Command::Sample(_) | Command::Settle { .. }) => {
                self.host_input(cmd, ev);
                Ok(None)
            }
            Command::Promote {
                run_id,
                fence,
                ports,
            } => self.promote(now, &run_id, fence, ports, ev),
            Command::Demote {
                run_id,
                fence,
                fingerprint,
                commit,
            } => self.demote(&run_id, fence, fingerprint, commit, ev),
            Command::RuntimeFailed { run_id, fence } => self.runtime_failed(&run_id, fence, ev),
            Command::Reserve {
                scope,
                owner,
                operation_id,
                harness,
            } => self.reserve(now, &scope, &owner, &operation_id, &harness, ev),
            Command::Unreserve {
                scope,
                owner,
                operation_id,
            } => self.unreserve(&scope, &owner, &operation_id, ev),
            Command::Reconcile { scope, owner } => self.reconcile(&scope, &owner, ev),
            Command::ScopeControl {
                scope,
                request_id,
                mode,
            } => self.scope_control(now, &scope, &request_id, mode, ev),
            Command::Permit { run_id, fence } => self.permit(&run_id, fence),
            Command::DeleteScope { scope } => self.delete_scope(scope, ev),
            Command::FleetControl { scope, receipt } => {
                self.fleet_control(&scope, receipt, ev);
                Ok(None)
            }
            Command::FleetEvidence {
                project,
                evidence,
                valid,
            } => {
                self.fleet_evidence(now, &project, evidence, valid, ev);
                Ok(None)
            }
        }
    }

    // ----- time -----------------------------------------------------------------------

    fn advance(&mut self, now_ms: TimeMs, ev: &mut Vec<Event>) {
        self.now = self.now.max(now_ms);
        let now = self.now;
        self.prune_scopes(now, ev);
        // A8: at its deadline a waiter leaves the queue as expired, holding nothing.
        while let Some(&(d, s)) = self.deadlines.first() {
            if d > now {
                break;
            }
            self.expire_waiter(s, ev);
        }
        // L6: a lease not renewed by its expiry is stopped; its claim frees on StopDone.
        while let Some(&(e, s)) = self.expiries.first() {
            if e > now {
                break;
            }
            self.begin_stop(s, EndCause::Expired, ev);
        }
        while let Some(&(t, s, fence)) = self.pending.front() {
            if t > now {
                break;
            }
            self.pending.pop_front();
            self.settle_pending(s, fence, ev);
        }
    }

    /// What the host says of itself (G4's drain, A10's memory, issue 36's pressure,
    /// free disk and started trees): state it keeps as given, each change an event.
    /// `dispatch` sends only these.
    fn host_input(&mut self, cmd: Command, ev: &mut Vec<Event>) {
        match cmd {
            Command::Drain { on } if self.draining != on => {
                self.draining = on;
                ev.push(Event::DrainChanged { on });
            }
            Command::Sample(sample) => self.host_sample(sample, ev),
            Command::Settle { run_id, fence } => {
                if let Some(&s) = self.by_id.get(&run_id) {
                    self.settle_pending(s, fence, ev);
                }
            }
            // A drain that did not change; no other command comes here.
            _ => {}
        }
    }

    /// A sample's figures, all kept before the pass that follows the command.
    fn host_sample(&mut self, sample: HostSample, ev: &mut Vec<Event>) {
        if let Some(m) = sample.mem_available {
            self.sample(m, ev);
        }
        for kind in PressureKind::ALL {
            let Some(bp) = sample.pressure_bp[kind.index()] else {
                continue;
            };
            let bp = bp.min(PRESSURE_BP_MAX);
            if bp != self.pressure_bp[kind.index()] {
                self.pressure_bp[kind.index()] = bp;
                ev.push(Event::PressureChanged { kind, bp });
            }
        }
        if let Some(bytes) = sample.disk_free.filter(|b| self.disk_free != Some(*b)) {
            self.disk_free = Some(bytes);
            ev.push(Event::DiskFreeChanged { bytes });
        }
    }

    fn settle_pending(&mut self, s: Slot, fence: Fence, ev: &mut Vec<Event>) {
        if let Some(Some(run)) = self.runs.get_mut(s as usize) {
            if run.fence == Some(fence) && run.pending_mem {
                run.pending_mem = false;
                self.pending_memory -= run.amounts[MEMORY];
                self.pending_disk -= run.amounts[DISK];
                ev.push(Event::Settled {
                    run_id: run.req.run_id.clone(),
                });
            }
        }
    }

    /// A10: decreases count at once, increases only once `stabilize_samples` consecutive
    /// readings show them: the stabilised value is the minimum of the last N samples.
    fn sample(&mut self, mem_available: u64, ev: &mut Vec<Event>) {
        self.samples.push_back(mem_available);
        while self.samples.len() > self.cfg.stabilize_samples {
            self.samples.pop_front();
        }
        let stable = self.samples.iter().copied().min();
        if stable != self.stabilized_available {
            self.stabilized_available = stable;
            ev.push(Event::MemoryStabilized {
                available: stable.unwrap_or(0),
            });
        }
    }

    // ----- slabs ----------------------------------------------------------------------

    pub(crate) fn run(&self, s: Slot) -> &Run {
        self.runs[s as usize].as_deref().expect("live slot")
    }

    fn run_mut(&mut self, s: Slot) -> &mut Run {
        self.runs[s as usize].as_deref_mut().expect("live slot")
    }

    pub(crate) fn key(&self, k: KeyId) -> &KeyState {
        self.keys[k as usize].as_ref().expect("live key")
    }

    fn key_mut(&mut self, k: KeyId) -> &mut KeyState {
        self.keys[k as usize].as_mut().expect("live key")
    }

    pub(crate) fn project(&self, p: ProjectId) -> &ProjectState {
        self.projects[p as usize].as_ref().expect("live project")
    }

    fn project_mut(&mut self, p: ProjectId) -> &mut ProjectState {
        self.projects[p as usize].as_mut().expect("live project")
    }

    fn intern_key(&mut self, name: String) -> KeyId {
        if let Some(&k) = self.key_ids.get(&name) {
            return k;
        }
        let state = KeyState {
            name: name.clone(),
            ..KeyState::default()
        };
        let k = match self.free_keys.pop() {
            Some(k) => {
                self.keys[k as usize] = Some(state);
                k
            }
            None => {
                self.keys.push(Some(state));
                (self.keys.len() - 1) as KeyId
            }
        };
        self.key_ids.insert(name, k);
        k
    }

    fn gc_key(&mut self, k: KeyId) {
        if self.key(k).idle() {
            let state = self.keys[k as usize].take().expect("live key");
            self.key_ids.remove(&state.name);
            self.free_keys.push(k);
        }
    }

    fn intern_project(&mut self, name: &str) -> ProjectId {
        let key = lower(name);
        if let Some(&p) = self.project_ids.get(&key) {
            return p;
        }
        let state = ProjectState {
            name: name.to_string(),
            ..ProjectState::default()
        };
        let p = match self.free_projects.pop() {
            Some(p) => {
                self.projects[p as usize] = Some(state);
                p
            }
            None => {
                self.projects.push(Some(state));
                (self.projects.len() - 1) as ProjectId
            }
        };
        self.project_ids.insert(key, p);
        p
    }

    fn gc_project(&mut self, p: ProjectId) {
        let st = self.project(p);
        if st.waiting == 0 && st.active == 0 && st.degraded == 0 && st.evidence.is_none() {
            let st = self.projects[p as usize].take().expect("live project");
            self.project_ids.remove(&lower(&st.name));
            self.free_projects.push(p);
        }
    }

    /// Moves a run to `new`, keeping the per-project counts in step.
    fn set_state(&mut self, s: Slot, new: RunState) {
        let (old, p) = {
            let r = self.run(s);
            (r.state, r.project)
        };
        assert!(
            !old.is_terminal(),
            "D3: terminal state {old:?} left for {new:?}"
        );
        let count = |st: &mut ProjectState, state: RunState, delta: i32| {
            let c = match state {
                RunState::Queued => &mut st.waiting,
                RunState::Granted | RunState::Releasing => &mut st.active,
                RunState::Degraded => &mut st.degraded,
                _ => return,
            };
            *c = (*c as i32 + delta) as u32;
        };
        let st = self.project_mut(p);
        count(st, old, -1);
        count(st, new, 1);
        if self.run(s).req.priority == Priority::Foreground {
            let holding = self.foreground_holding as i64 + new.holds_claim() as i64
                - old.holds_claim() as i64;
            self.foreground_holding = holding as u32;
        }
        self.run_mut(s).state = new;
    }

    // ----- commands -------------------------------------------------------------------

    // ----- budgets (B1-B5) -------------------------------------------------------------

    // ----- transitions ----------------------------------------------------------------

    fn lookup(&self, run_id: &str) -> Result<Slot, Error> {
        self.by_id
            .get(run_id)
            .copied()
            .ok_or_else(|| Error::NotFound {
                run_id: run_id.to_string(),
            })
    }

    /// Takes a queued run out of its band, its deadline set and its keys' waiter sets.
    fn unqueue(&mut self, s: Slot) {
        let (prio, seq, deadline, keys) = {
            let r = self.run(s);
            assert_eq!(r.state, RunState::Queued);
            (r.req.priority, r.seq, r.deadline, r.keys.clone())
        };
        self.queues[prio.index()].remove(seq);
        self.deadlines.remove(&(deadline, s));
        for (k, mode) in keys {
            let ks = self.key_mut(k);
            ks.waiters.remove(&(prio, seq, s));
            if mode == KeyMode::Exclusive {
                ks.exclusive_waiting[prio.index()] -= 1;
            }
        }
    }

    // ----- admission ------------------------------------------------------------------

    // ----- views ----------------------------------------------------------------------
}
