//! The admission engine: a deterministic state machine over runs, capacity, keys and the
//! queue. See ARCHITECTURE.md for the rules it keeps and why it is shaped this way.

use std::collections::{BTreeSet, HashMap, VecDeque};

use crate::command::{Command, Error, Event, Output};
use crate::config::Config;
use crate::queue::{Queue, Slot};
use crate::scopes::{Block, Scope, ScopeError, Scopes};
use crate::types::{
    Class, Concurrency, ConcurrencyClass, ContractInfo, EndCause, Evidence, Fence, KeyMode,
    Priority, Reason, Request, Resources, RunState, RunView, TimeMs,
};
use crate::validate;

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

/// A run refused nothing and claimed in full, ready to be queued (`Engine::enqueue`).
struct Queued {
    req: Request,
    project: ProjectId,
    amounts: Box<[u64]>,
    keys: Vec<(KeyId, KeyMode)>,
    promoted_shared: bool,
    permit: Option<Fence>,
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
    /// B1–B5: experiment budgets; a run's token is part of its claim.
    pub(crate) scopes: Scopes,
    pub(crate) deadlines: BTreeSet<(TimeMs, Slot)>,
    pub(crate) expiries: BTreeSet<(TimeMs, Slot)>,
    /// Grants whose memory is still `pending` (A2): (settles at, slot, fence).
    pending: VecDeque<(TimeMs, Slot, Fence)>,
    pub(crate) pending_memory: u64,
    samples: VecDeque<u64>,
    pub(crate) stabilized_available: Option<u64>,
    pub(crate) last_fence: Fence,
    ended: VecDeque<Slot>,
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

fn lower(s: &str) -> String {
    s.to_ascii_lowercase()
}

pub(crate) fn runtime_key(project: &str) -> String {
    format!("project:{}:runtime", lower(project))
}

fn analysis_key(project: &str) -> String {
    format!("project:{}:analysis", lower(project))
}

fn singleton_key(name: &str) -> String {
    format!("singleton:{name}")
}

/// The key names a request claims, in the order `Run::keys` holds them.
fn key_names(req: &Request) -> Vec<String> {
    let mut names = vec![match req.class {
        Class::Managed => runtime_key(&req.project),
        Class::Analysis => analysis_key(&req.project),
    }];
    names.extend(sorted_singletons(req).into_iter().map(singleton_key));
    names
}

fn sorted_singletons(req: &Request) -> Vec<&str> {
    let mut v: Vec<&str> = req.singletons.iter().map(String::as_str).collect();
    v.sort_unstable();
    v.dedup();
    v
}

fn contract_matches(c: &Option<ContractInfo>, e: &Evidence) -> bool {
    matches!(c, Some(c) if c.concurrency == Concurrency::Parallel
        && c.fingerprint == e.fingerprint && c.commit == e.commit)
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
            scopes: Scopes::default(),
            deadlines: BTreeSet::new(),
            expiries: BTreeSet::new(),
            pending: VecDeque::new(),
            pending_memory: 0,
            samples: VecDeque::new(),
            stabilized_available: None,
            last_fence,
            ended: VecDeque::new(),
            keys_with_upgrades: BTreeSet::new(),
            window_buf: Vec::new(),
            background_grants_while_foreground_waits: 0,
            scope_prune_at: 0,
        })
    }

    /// Rebuilds an engine from what the ledger remembers (P5): `runs` in arrival order,
    /// with times already on this process's monotonic clock. Live runs get their claims
    /// back in the recorded key modes; queued runs keep their order. Refuses a ledger
    /// whose runs contradict each other (D4) instead of guessing.
    pub fn restore(
        cfg: Config,
        last_fence: Fence,
        now: TimeMs,
        runs: Vec<RestoredRun>,
    ) -> Result<Engine, String> {
        Engine::restore_with_scopes(cfg, last_fence, now, runs, Vec::new(), Vec::new())
    }

    /// [`Engine::restore`] with the experiment scopes the ledger kept (B1–B5): a live
    /// run's budget token must be among them, and a waiter's scope too; and with each
    /// project's promotion evidence (C3). Restoring is building an engine: after it,
    /// `apply` is the only way its state changes.
    pub fn restore_with_scopes(
        cfg: Config,
        last_fence: Fence,
        now: TimeMs,
        runs: Vec<RestoredRun>,
        scopes: Vec<Scope>,
        evidence: Vec<(String, Evidence)>,
    ) -> Result<Engine, String> {
        let mut e = Engine::new(cfg, last_fence)?;
        e.now = now;
        for mut s in scopes {
            // The idle window starts again: the ledger does not keep when it began.
            s.touched_ms = now;
            e.scopes.restore(s);
        }
        for r in runs {
            e.restore_one(r)?;
        }
        for (project, ev) in evidence {
            let p = e.intern_project(&project);
            e.project_mut(p).evidence = Some(ev);
        }
        e.check_invariants()
            .map_err(|m| format!("restored ledger is inconsistent: {m}"))?;
        Ok(e)
    }

    fn restore_one(&mut self, r: RestoredRun) -> Result<(), String> {
        let id = r.request.run_id.clone();
        if self.by_id.contains_key(&id) {
            return Err(format!("run {id} appears twice"));
        }
        if r.fence.is_some_and(|f| f > self.last_fence) {
            return Err(format!("run {id} has a fence above the counter"));
        }
        let p = self.intern_project(&r.request.project);
        let amounts = self.amounts_of(&r.request.resources);
        let keys = self.intern_keys(&r.request, r.primary_mode);
        let slot = self.alloc_slot();
        let live = !r.state.is_terminal();
        if let Some(b) = r.request.budget.as_deref().filter(|_| live) {
            self.scopes.count_user(&b.scope, true, self.now);
        }
        let seq = if r.state == RunState::Queued {
            let seq = self.queues[r.request.priority.index()].push(slot);
            self.wait_on_keys(slot, seq, r.request.priority, &keys);
            self.deadlines.insert((r.deadline, slot));
            seq
        } else {
            0
        };
        if r.state.holds_claim() {
            self.restore_holdings(&r, slot, &amounts, &keys)?;
        }
        // Memory granted recently is still pending (A2), across a restart too.
        let settle = r.granted_at.saturating_add(self.cfg.pending_settle_ms);
        let pending = r.state.holds_claim() && amounts[MEMORY] > 0 && settle > self.now;
        if pending {
            self.pending_memory += amounts[MEMORY];
            self.pending.push_back((settle, slot, r.fence.unwrap_or(0)));
        }
        let upgrade = (r.upgrading && r.state.holds_claim()).then(|| keys[0].0);
        let promoted_shared =
            r.request.class == Class::Managed && r.primary_mode == KeyMode::Shared;
        self.runs[slot as usize] = Some(Box::new(Run {
            contract: r.request.contract.clone(),
            req: r.request,
            project: p,
            amounts,
            keys,
            promoted_shared,
            state: RunState::Queued,
            seq,
            enqueued_at: r.enqueued_at,
            deadline: r.deadline,
            fence: r.fence,
            granted_at: r.granted_at,
            expires_at: r.expires_at,
            cause: r.cause,
            upgrade,
            pending_mem: pending,
            permit: None,
            permit_asked: false,
            last_reason: None,
        }));
        self.by_id.insert(id, slot);
        self.project_mut(p).waiting += 1;
        if r.state != RunState::Queued {
            self.set_state(slot, r.state);
            if !live {
                // Terminal: remembered for `410 gone` and idempotent re-acquire.
                self.ended.push_back(slot);
                self.gc_project(p);
            }
        }
        Ok(())
    }

    /// A restored run that holds its claim takes it again: its resources (never over
    /// the allocatable), its keys (a conflict means the ledger is inconsistent), its
    /// place in an upgrade queue (C4) and its expiry.
    fn restore_holdings(
        &mut self,
        r: &RestoredRun,
        slot: Slot,
        amounts: &[u64],
        keys: &[(KeyId, KeyMode)],
    ) -> Result<(), String> {
        let id = &r.request.run_id;
        for (i, a) in amounts.iter().enumerate() {
            self.committed[i] = self.committed[i].saturating_add(*a);
            if self.committed[i] > self.allocatable[i] {
                return Err(format!("restored claims over-commit {}", self.res_names[i]));
            }
        }
        for (i, &(k, mode)) in keys.iter().enumerate() {
            if i == 0 && r.upgrading {
                // C4: back in the upgrade queue, holding nothing on the key.
                if mode != KeyMode::Exclusive || r.request.class != Class::Managed {
                    return Err(format!(
                        "run {id} upgrades a key it does not claim exclusively"
                    ));
                }
                self.key_mut(k).upgrades.push_back(slot);
                self.keys_with_upgrades.insert(k);
                continue;
            }
            let ks = self.key_mut(k);
            match mode {
                KeyMode::Exclusive if ks.exclusive.is_none() && ks.shared == 0 => {
                    ks.exclusive = Some(slot)
                }
                KeyMode::Shared if ks.exclusive.is_none() => ks.shared += 1,
                _ => return Err(format!("run {id} conflicts on key {}", ks.name)),
            }
        }
        if r.state == RunState::Granted {
            self.expiries.insert((r.expires_at, slot));
        }
        Ok(())
    }

    /// A free slot for a new run (a freed one first).
    fn alloc_slot(&mut self) -> Slot {
        self.free_slots.pop().unwrap_or_else(|| {
            self.runs.push(None);
            (self.runs.len() - 1) as Slot
        })
    }

    /// The run's keys, interned: the first (the project's runtime key) in `primary`
    /// mode, every other exclusive.
    fn intern_keys(&mut self, req: &Request, primary: KeyMode) -> Vec<(KeyId, KeyMode)> {
        let names = key_names(req);
        let mut keys = Vec::with_capacity(names.len());
        for (i, name) in names.into_iter().enumerate() {
            let mode = if i == 0 { primary } else { KeyMode::Exclusive };
            keys.push((self.intern_key(name), mode));
        }
        keys
    }

    /// A queued run waits on each of its keys (an exclusive waiter is counted per band,
    /// for writer preference, A4).
    fn wait_on_keys(&mut self, slot: Slot, seq: u64, prio: Priority, keys: &[(KeyId, KeyMode)]) {
        for &(k, mode) in keys {
            let ks = self.key_mut(k);
            ks.waiters.insert((prio, seq, slot));
            if mode == KeyMode::Exclusive {
                ks.exclusive_waiting[prio.index()] += 1;
            }
        }
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn last_fence(&self) -> Fence {
        self.last_fence
    }

    pub fn now(&self) -> TimeMs {
        self.now
    }

    /// B1–B6: every scope and its tokens.
    pub fn scopes(&self) -> &Scopes {
        &self.scopes
    }

    /// B6: a scope's waiters in admission order with their positions (at most
    /// `limit` of them), and how many it has in all.
    pub fn scope_waiters(&self, scope: &str, limit: usize) -> (Vec<RunView>, usize) {
        let mut views = Vec::new();
        let mut all = 0;
        for (_, s) in self.queues[0].iter().chain(self.queues[1].iter()) {
            let b = self.run(s).req.budget.as_deref();
            if b.is_some_and(|b| b.scope == scope) {
                all += 1;
                if views.len() < limit {
                    views.push(self.view(s));
                }
            }
        }
        (views, all)
    }

    /// G4: whether the host is draining.
    pub fn is_draining(&self) -> bool {
        self.draining
    }

    pub fn queue_len(&self) -> usize {
        self.queues[0].len() + self.queues[1].len()
    }

    /// Applies one command at monotonic time `now_ms` (clamped so time never goes back).
    pub fn apply(&mut self, now_ms: TimeMs, cmd: Command) -> Output {
        let mut ev = Vec::new();
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
            Command::Drain { on } => {
                if self.draining != on {
                    self.draining = on;
                    ev.push(Event::DrainChanged { on });
                }
                Ok(None)
            }
            Command::Sample { mem_available } => {
                self.sample(mem_available, ev);
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
            self.settle_pending(s, fence);
        }
    }

    fn settle_pending(&mut self, s: Slot, fence: Fence) {
        if let Some(Some(run)) = self.runs.get_mut(s as usize) {
            if run.fence == Some(fence) && run.pending_mem {
                run.pending_mem = false;
                self.pending_memory -= run.amounts[MEMORY];
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
        self.run_mut(s).state = new;
    }

    // ----- commands -------------------------------------------------------------------

    fn validate_request(&self, req: &Request) -> Result<(), Error> {
        let inv = |field: &'static str, rule: String| Err(Error::Invalid { field, rule });
        if let Err(e) = validate::run_id(&req.run_id) {
            return inv("run_id", e);
        }
        if let Err(e) = validate::project(&req.project) {
            return inv("project", e);
        }
        if req.singletons.len() > SINGLETONS_MAX {
            return inv("singletons", format!("at most {SINGLETONS_MAX} entries"));
        }
        for s in &req.singletons {
            if let Err(e) = validate::resource_name(s) {
                return inv("singletons", e);
            }
            if s.strip_prefix(FLEET_SINGLETON_PREFIX) == Some("") {
                return inv("singletons", format!("{s:?} names no fleet-wide key"));
            }
        }
        let fleet_keys = req
            .singletons
            .iter()
            .filter(|s| s.starts_with(FLEET_SINGLETON_PREFIX))
            .count();
        if fleet_keys > FLEET_KEYS_MAX {
            return inv(
                "singletons",
                format!("at most {FLEET_KEYS_MAX} fleet-wide (fleet:NAME) entries"),
            );
        }
        if req.ttl_ms == 0 || req.ttl_ms > self.cfg.ttl_ms_max {
            return inv(
                "ttl_s",
                format!("must be between 1 s and {} s", self.cfg.ttl_ms_max / 1000),
            );
        }
        if req.wait_ms > self.cfg.wait_ms_max {
            return inv(
                "wait_s",
                format!("must be between 0 and {} s", self.cfg.wait_ms_max / 1000),
            );
        }
        if req.resources.slots == 0 {
            return inv("resources.slots", "must be at least 1".into());
        }
        for name in req.resources.named.keys() {
            if !self.cfg.named.iter().any(|(n, _)| n == name) {
                return inv(
                    "resources",
                    format!("{name:?} is not a resource this host declares"),
                );
            }
        }
        if let Some(c) = &req.contract {
            if c.fingerprint.is_empty() || c.fingerprint.len() > 128 {
                return inv("contract.fingerprint", "must be 1 to 128 characters".into());
            }
        }
        if let Some(b) = &req.budget {
            b.check().map_err(Error::from)?;
        }
        Ok(())
    }

    /// B1, B2, B4: whether a new run's budget may queue at all (nothing changes): the
    /// policy and manifest match what is frozen, the harness is the policy's, the scope
    /// is not stopped, and the run's key holds no token of another harness.
    fn check_budget(
        &self,
        run_id: &str,
        b: &crate::scopes::Budget,
        tenant: Option<u32>,
    ) -> Result<(), Error> {
        let sc = &self.scopes;
        sc.check_freeze(
            &b.scope,
            b.per_harness.as_ref(),
            b.manifest.as_ref(),
            tenant,
        )
        .map_err(Error::from)?;
        let policy = match sc.get(&b.scope) {
            Some(s) => {
                if s.control == crate::scopes::Control::Stopped {
                    return Err(Error::from(ScopeError::Stopped {
                        scope: b.scope.clone(),
                    }));
                }
                &s.policy
            }
            None => b.per_harness.as_ref().expect("check_freeze requires it"),
        };
        if !policy.contains_key(&b.harness) {
            return Err(Error::from(ScopeError::UnknownHarness {
                scope: b.scope.clone(),
                harness: b.harness.clone(),
            }));
        }
        match sc.token(&b.scope, run_id, b.operation()) {
            Some(t) if t.harness != b.harness => {
                Err(Error::from(ScopeError::ReservationConflict {
                    scope: b.scope.clone(),
                    held: t.harness.clone(),
                    given: b.harness.clone(),
                }))
            }
            _ => Ok(()),
        }
    }

    fn amounts_of(&self, r: &Resources) -> Box<[u64]> {
        let mut a = vec![0u64; self.allocatable.len()];
        a[SLOTS] = r.slots;
        a[MEMORY] = r.memory;
        a[CPU] = r.cpu_millis;
        a[DISK] = r.disk;
        for (i, (name, _)) in self.cfg.named.iter().enumerate() {
            a[FIXED + i] = r.named.get(name).copied().unwrap_or(0);
        }
        a.into_boxed_slice()
    }

    /// A1–A3, B1, C3–C6, L7: refuse what cannot be, claim everything the run needs,
    /// enqueue it, and run a pass that considers it at once.
    fn acquire(
        &mut self,
        now: TimeMs,
        req: Request,
        permit: Option<Fence>,
        ev: &mut Vec<Event>,
    ) -> Result<Option<RunView>, Error> {
        self.validate_request(&req)?;
        if permit.is_some_and(|f| f == 0 || !self.cfg.fleet) {
            return Err(Error::Invalid {
                field: "permit",
                rule: "a permit is a positive fence, on a fleet host only".into(),
            });
        }
        let mut req = req;
        // S10: who sends it is no part of the request (L7 compares without it).
        let tenant = req.budget.as_deref_mut().and_then(|b| b.tenant.take());
        if let Some(b) = req.budget.as_deref() {
            // B1: a policy or manifest given must match the frozen one, on a retry too.
            if self.scopes.get(&b.scope).is_some() {
                let (policy, manifest) = (b.per_harness.as_ref(), b.manifest.as_ref());
                self.scopes
                    .check_freeze(&b.scope, policy, manifest, tenant)?;
            }
        }
        // L7: the same run_id re-attaches with the same body, conflicts with another.
        if let Some(&s) = self.by_id.get(&req.run_id) {
            let run = self.run(s);
            if !same_request(&run.req, &req) {
                return Err(Error::Conflict { run_id: req.run_id });
            }
            if run.state.is_terminal() {
                let state = run.state;
                return Err(Error::Gone {
                    run_id: req.run_id,
                    state,
                });
            }
            return Ok(self.view_of(&req.run_id));
        }
        let amounts = self.refuse(&req)?;
        self.freeze_budget(now, &mut req, tenant, ev)?;
        let (project, keys, promoted_shared) = self.claim(&req, ev);
        let wait_now = req.wait_ms == 0;
        let run_id = req.run_id.clone();
        let queued = Queued {
            req,
            project,
            amounts,
            keys,
            promoted_shared,
            permit,
        };
        let slot = self.enqueue(now, queued, ev);
        // The newcomer is considered in this very pass even if the window is elsewhere.
        self.pass(now, Some(slot), ev);
        if wait_now && self.run(slot).state == RunState::Queued {
            // `wait_s = 0`: not admitted at once means expired, with the reason why.
            self.expire_waiter(slot, ev);
            return Ok(Some(self.view(slot)));
        }
        Ok(self.view_of(&run_id))
    }

    /// What is refused before a run is queued: a disabled contract, a claim no empty
    /// host could hold (A3), a full queue. Answers the claim's amounts.
    fn refuse(&self, req: &Request) -> Result<Box<[u64]>, Error> {
        if req
            .contract
            .as_ref()
            .is_some_and(|c| c.concurrency == Concurrency::Disabled)
        {
            return Err(Error::ContractDisabled {
                project: req.project.clone(),
            });
        }
        let amounts = self.amounts_of(&req.resources);
        for (i, (&need, &max)) in amounts.iter().zip(&self.allocatable).enumerate() {
            if need > max {
                return Err(Error::CapacityImpossible {
                    resource: self.res_names[i].clone(),
                    request: need,
                    max,
                });
            }
        }
        if self.queue_len() >= self.cfg.queue_len_max {
            return Err(Error::QueueFull {
                max: self.cfg.queue_len_max,
            });
        }
        Ok(amounts)
    }

    /// B1: the last refusal; past it the scope's policy freezes with this admission, and
    /// the run keeps only its scope, harness and operation (the scope holds the policy:
    /// a deep queue does not hold a copy per run).
    fn freeze_budget(
        &mut self,
        now: TimeMs,
        req: &mut Request,
        tenant: Option<u32>,
        ev: &mut Vec<Event>,
    ) -> Result<(), Error> {
        let Some(b) = req.budget.as_deref_mut() else {
            return Ok(());
        };
        self.check_budget(&req.run_id, b, tenant)?;
        let (policy, manifest) = (b.per_harness.as_ref(), b.manifest.as_ref());
        let frozen = self
            .scopes
            .freeze(&b.scope, policy, manifest, tenant, now)
            .map_err(Error::from)?;
        if frozen {
            ev.push(Event::ScopeFrozen {
                scope: b.scope.clone(),
            });
        }
        b.per_harness = None;
        b.manifest = None;
        self.scopes.count_user(&b.scope, true, now);
        Ok(())
    }

    /// A1: the whole claim is known before queueing: the run's project, every key with
    /// its mode (the project's runtime key shared for an analysis run (C6) or a
    /// foreground run riding on matching promotion evidence (C3, C5), else exclusive),
    /// and whether it rides on promotion. Stale evidence is invalidated (C4).
    fn claim(
        &mut self,
        req: &Request,
        ev: &mut Vec<Event>,
    ) -> (ProjectId, Vec<(KeyId, KeyMode)>, bool) {
        let p = self.intern_project(&req.project);
        let mut promoted_shared = false;
        let primary_mode = match req.class {
            Class::Analysis => KeyMode::Shared,
            Class::Managed => {
                if let Some(c) = &req.contract {
                    self.project_mut(p).parallel_asked = c.concurrency == Concurrency::Parallel;
                }
                match self.project(p).evidence.clone() {
                    Some(e) if req.contract.is_some() && !contract_matches(&req.contract, &e) => {
                        self.invalidate_evidence(p, &req.run_id, ev);
                        KeyMode::Exclusive
                    }
                    Some(e)
                        if req.priority == Priority::Foreground
                            && contract_matches(&req.contract, &e) =>
                    {
                        promoted_shared = true;
                        KeyMode::Shared
                    }
                    _ => KeyMode::Exclusive,
                }
            }
        };
        (p, self.intern_keys(req, primary_mode), promoted_shared)
    }

    /// Puts a claimed run at the back of its band, waiting on each of its keys, with
    /// its deadline; journals `Queued` with its position.
    fn enqueue(&mut self, now: TimeMs, q: Queued, ev: &mut Vec<Event>) -> Slot {
        let slot = self.alloc_slot();
        let seq = self.queues[q.req.priority.index()].push(slot);
        let deadline = now.saturating_add(q.req.wait_ms);
        self.wait_on_keys(slot, seq, q.req.priority, &q.keys);
        self.deadlines.insert((deadline, slot));
        self.project_mut(q.project).waiting += 1;
        let run_id = q.req.run_id.clone();
        self.runs[slot as usize] = Some(Box::new(Run {
            contract: q.req.contract.clone(),
            req: q.req,
            project: q.project,
            amounts: q.amounts,
            keys: q.keys,
            promoted_shared: q.promoted_shared,
            state: RunState::Queued,
            seq,
            enqueued_at: now,
            deadline,
            fence: None,
            granted_at: 0,
            expires_at: 0,
            cause: None,
            upgrade: None,
            pending_mem: false,
            permit: q.permit,
            permit_asked: q.permit.is_some(),
            last_reason: None,
        }));
        self.by_id.insert(run_id.clone(), slot);
        let position = self.position(slot);
        ev.push(Event::Queued { run_id, position });
        slot
    }

    fn cancel(&mut self, run_id: &str, ev: &mut Vec<Event>) -> Result<Option<RunView>, Error> {
        let s = self.lookup(run_id)?;
        match self.run(s).state {
            RunState::Queued => {
                self.unqueue(s);
                self.end(s, RunState::Cancelled, ev);
                Ok(Some(self.view(s)))
            }
            RunState::Cancelled => Ok(Some(self.view(s))),
            state @ (RunState::Granted | RunState::Releasing | RunState::Degraded) => {
                Err(Error::FenceRequired {
                    run_id: run_id.to_string(),
                    state,
                })
            }
            state => Err(Error::Gone {
                run_id: run_id.to_string(),
                state,
            }),
        }
    }

    fn renew(
        &mut self,
        now: TimeMs,
        run_id: &str,
        fence: Option<Fence>,
        ttl_ms: Option<u64>,
        ev: &mut Vec<Event>,
    ) -> Result<Option<RunView>, Error> {
        let s = self.lookup(run_id)?;
        if let Some(t) = ttl_ms {
            if t == 0 || t > self.cfg.ttl_ms_max {
                return Err(Error::Invalid {
                    field: "ttl_s",
                    rule: format!("must be between 1 s and {} s", self.cfg.ttl_ms_max / 1000),
                });
            }
        }
        self.check_fence(s, fence)?;
        let (state, ttl, deadline, expires_at) = {
            let r = self.run(s);
            (
                r.state,
                ttl_ms.unwrap_or(r.req.ttl_ms),
                r.deadline,
                r.expires_at,
            )
        };
        match state {
            RunState::Queued => {
                // L4: renewing a queued run extends (never shortens) its queue deadline.
                let old = deadline;
                let new = old.max(now.saturating_add(ttl.min(self.cfg.wait_ms_max)));
                self.deadlines.remove(&(old, s));
                self.deadlines.insert((new, s));
                self.run_mut(s).deadline = new;
                ev.push(Event::QueueDeadlineExtended {
                    run_id: run_id.to_string(),
                    deadline_ms: new,
                });
            }
            RunState::Granted => {
                // Extends, never shortens: a late retry with a small ttl is harmless.
                let old = expires_at;
                let new = old.max(now.saturating_add(ttl));
                self.expiries.remove(&(old, s));
                self.expiries.insert((new, s));
                self.run_mut(s).expires_at = new;
                ev.push(Event::Renewed {
                    run_id: run_id.to_string(),
                    expires_at_ms: new,
                });
            }
            state => {
                return Err(Error::Gone {
                    run_id: run_id.to_string(),
                    state,
                })
            }
        }
        Ok(Some(self.view(s)))
    }

    /// L2: a call that acts on a granted run must carry its fence; a queued run has none.
    fn check_fence(&self, s: Slot, fence: Option<Fence>) -> Result<(), Error> {
        let run = self.run(s);
        match (run.fence, fence) {
            (None, None) => Ok(()),
            (Some(cur), Some(f)) if cur == f => Ok(()),
            (Some(_), None) if !run.state.is_terminal() => Err(Error::FenceRequired {
                run_id: run.req.run_id.clone(),
                state: run.state,
            }),
            (Some(_), None) => Err(Error::Gone {
                run_id: run.req.run_id.clone(),
                state: run.state,
            }),
            (cur, given) => Err(Error::StaleFence {
                run_id: run.req.run_id.clone(),
                given,
                current: cur,
            }),
        }
    }

    fn release(
        &mut self,
        run_id: &str,
        fence: Fence,
        ev: &mut Vec<Event>,
    ) -> Result<Option<RunView>, Error> {
        let s = self.lookup(run_id)?;
        self.check_fence(s, Some(fence))?;
        if self.run(s).state == RunState::Granted {
            self.begin_stop(s, EndCause::Released, ev);
        }
        // Releasing, degraded or ended with the same fence: idempotent (L5).
        Ok(Some(self.view(s)))
    }

    fn stop_done(
        &mut self,
        run_id: &str,
        ok: bool,
        ev: &mut Vec<Event>,
    ) -> Result<Option<RunView>, Error> {
        let s = self.lookup(run_id)?;
        let state = self.run(s).state;
        match (state, ok) {
            (RunState::Releasing | RunState::Degraded, true) => {
                let cause = self.run(s).cause.expect("stopping run has a cause");
                self.free_claim(s);
                if cause == EndCause::Released {
                    self.give_token_back(s, ev);
                }
                self.end(s, cause.terminal_state(), ev);
            }
            (RunState::Releasing, false) => {
                self.set_state(s, RunState::Degraded);
                ev.push(Event::Degraded {
                    run_id: run_id.to_string(),
                });
            }
            (RunState::Degraded, false) => {}
            (state, _) => {
                return Err(Error::NotEligible {
                    run_id: run_id.to_string(),
                    why: format!("is {}, not being stopped", state.as_str()),
                })
            }
        }
        Ok(Some(self.view(s)))
    }

    fn granted_with_fence(&self, run_id: &str, fence: Fence) -> Result<Slot, Error> {
        let s = self.lookup(run_id)?;
        self.check_fence(s, Some(fence))?;
        match self.run(s).state {
            RunState::Granted => Ok(s),
            state => Err(Error::Gone {
                run_id: run_id.to_string(),
                state,
            }),
        }
    }

    /// C3: a granted foreground run whose parallel contract started proves its project
    /// parallel-safe: the evidence is recorded, the prover's exclusive hold becomes
    /// shared, and queued runs with the same contract become shared claimants, granted
    /// at once where they fit.
    fn promote(
        &mut self,
        now: TimeMs,
        run_id: &str,
        fence: Fence,
        ports: Vec<String>,
        ev: &mut Vec<Event>,
    ) -> Result<Option<RunView>, Error> {
        let s = self.granted_with_fence(run_id, fence)?;
        if ports.len() > PORTS_MAX {
            return Err(Error::Invalid {
                field: "ports",
                rule: format!("at most {PORTS_MAX} entries"),
            });
        }
        let contract = self.promotable(s)?;
        let run = self.run(s);
        let (p, (k, held_mode)) = (run.project, run.keys[0]);
        let evidence = Evidence {
            fingerprint: contract.fingerprint.clone(),
            commit: contract.commit.clone(),
            ports,
            at_ms: now,
            run_id: run_id.to_string(),
        };
        self.project_mut(p).evidence = Some(evidence.clone());
        ev.push(Event::Promoted {
            project: self.project(p).name.clone(),
            evidence: evidence.clone(),
        });
        if held_mode == KeyMode::Exclusive {
            // The prover's exclusive hold becomes a shared one at once.
            let ks = self.key_mut(k);
            assert_eq!(ks.exclusive, Some(s));
            ks.exclusive = None;
            ks.shared += 1;
            self.share_primary_key(s, ev);
        }
        let converted = self.convert_waiters(k, &evidence, ev);
        // "Into shared holders at once": each converted waiter that fits is granted now,
        // in queue order, ahead of the window. Like the head, it is exempt from writer
        // preference: it was already queued for this key before the promotion.
        // The starvation guard (A7) still applies to those behind the head.
        let head = self.queues[0].head().map(|(_, h)| h);
        for w in converted {
            let guard_ok = match head {
                Some(h) if h != w && self.guard_active(h) => self.head_fits_after(h, w),
                _ => true,
            };
            if guard_ok && self.blocker(w, true).is_none() {
                self.grant(w, now, ev);
            }
        }
        Ok(Some(self.view(s)))
    }

    /// Whether the run at `s` may prove its project parallel (C3, C5): its contract, or
    /// why not.
    fn promotable(&self, s: Slot) -> Result<ContractInfo, Error> {
        let run = self.run(s);
        let not = |why: &str| Error::NotEligible {
            run_id: run.req.run_id.clone(),
            why: why.to_string(),
        };
        if run.req.class != Class::Managed {
            return Err(not("only managed runs prove a project parallel"));
        }
        if run.req.priority != Priority::Foreground {
            return Err(not("background runs never promote a project (C5)"));
        }
        let Some(contract) = run.contract.clone() else {
            return Err(not("the run has no runtime contract"));
        };
        if contract.concurrency != Concurrency::Parallel {
            return Err(not("the run's contract does not ask for parallel"));
        }
        if run.upgrade.is_some() {
            return Err(not(
                "the run is waiting to hold the runtime key exclusively",
            ));
        }
        Ok(contract)
    }

    /// The run's claim on its project's runtime key becomes shared (it rides on the
    /// promotion), journaled.
    fn share_primary_key(&mut self, s: Slot, ev: &mut Vec<Event>) {
        let k = self.run(s).keys[0].0;
        let key = self.key(k).name.clone();
        let run = self.run_mut(s);
        run.keys[0].1 = KeyMode::Shared;
        run.promoted_shared = true;
        let run_id = run.req.run_id.clone();
        ev.push(Event::KeyModeChanged {
            run_id,
            key,
            mode: KeyMode::Shared,
        });
    }

    /// C3: queued foreground exclusive waiters on `k` with the evidence's contract and
    /// commit become shared claimants (in queue order); the pass grants those that fit.
    fn convert_waiters(&mut self, k: KeyId, evidence: &Evidence, ev: &mut Vec<Event>) -> Vec<Slot> {
        let waiters: Vec<Slot> = self
            .key(k)
            .waiters
            .iter()
            .filter(|(prio, _, _)| *prio == Priority::Foreground)
            .map(|&(_, _, w)| w)
            .collect();
        let mut converted = Vec::new();
        for w in waiters {
            let r = self.run(w);
            if r.keys[0] == (k, KeyMode::Exclusive)
                && r.req.class == Class::Managed
                && contract_matches(&r.contract, evidence)
            {
                self.key_mut(k).exclusive_waiting[0] -= 1;
                self.share_primary_key(w, ev);
                converted.push(w);
            }
        }
        converted
    }

    fn demote(
        &mut self,
        run_id: &str,
        fence: Fence,
        fingerprint: String,
        commit: Option<String>,
        ev: &mut Vec<Event>,
    ) -> Result<Option<RunView>, Error> {
        let s = self.granted_with_fence(run_id, fence)?;
        if self.run(s).req.class != Class::Managed {
            return Err(Error::NotEligible {
                run_id: run_id.to_string(),
                why: "only managed runs hold the runtime key".into(),
            });
        }
        if fingerprint.is_empty() || fingerprint.len() > 128 {
            return Err(Error::Invalid {
                field: "fingerprint",
                rule: "must be 1 to 128 characters".into(),
            });
        }
        let p = self.run(s).project;
        {
            let run = self.run_mut(s);
            let concurrency = run
                .contract
                .as_ref()
                .map_or(Concurrency::Serial, |c| c.concurrency);
            run.contract = Some(ContractInfo {
                concurrency,
                fingerprint,
                commit,
            });
        }
        let stale = match &self.project(p).evidence {
            Some(e) => !contract_matches(&self.run(s).contract, e),
            None => false,
        };
        if stale {
            self.invalidate_evidence(p, run_id, ev);
        }
        let (k, mode) = self.run(s).keys[0];
        if mode == KeyMode::Shared && !contract_matches_project(self, s) {
            // C4: queue for the exclusive key first, then give up the shared hold, in
            // one step, so nothing can slip in between. Upgrades go before any waiter.
            let key_name = self.key(k).name.clone();
            let ks = self.key_mut(k);
            ks.upgrades.push_back(s);
            ks.shared -= 1;
            self.keys_with_upgrades.insert(k);
            let run = self.run_mut(s);
            run.keys[0].1 = KeyMode::Exclusive;
            run.promoted_shared = false;
            run.upgrade = Some(k);
            ev.push(Event::UpgradeQueued {
                run_id: run_id.to_string(),
                key: key_name,
            });
        }
        Ok(Some(self.view(s)))
    }

    /// C4: a shared holder whose runtime failed to start proves the evidence wrong; a
    /// serial (exclusive) holder's failure says nothing about running in parallel.
    fn runtime_failed(
        &mut self,
        run_id: &str,
        fence: Fence,
        ev: &mut Vec<Event>,
    ) -> Result<Option<RunView>, Error> {
        let s = self.granted_with_fence(run_id, fence)?;
        let run = self.run(s);
        if run.req.class == Class::Managed && run.keys[0].1 == KeyMode::Shared {
            let p = run.project;
            self.invalidate_evidence(p, run_id, ev);
        }
        Ok(Some(self.view(s)))
    }

    fn invalidate_evidence(&mut self, p: ProjectId, by_run: &str, ev: &mut Vec<Event>) {
        if self.project_mut(p).evidence.take().is_none() {
            return;
        }
        let name = self.project(p).name.clone();
        ev.push(Event::EvidenceInvalidated {
            project: name.clone(),
            by_run: by_run.to_string(),
        });
        // Waiters that would have ridden on the evidence claim the key exclusively again.
        // They hold nothing yet, so this cannot break anyone's hold (A1).
        let Some(&k) = self.key_ids.get(&runtime_key(&name)) else {
            return;
        };
        let waiters: Vec<(Priority, Slot)> = self
            .key(k)
            .waiters
            .iter()
            .map(|&(p, _, w)| (p, w))
            .collect();
        let key_name = self.key(k).name.clone();
        for (prio, w) in waiters {
            let r = self.run(w);
            if r.keys[0].0 == k && r.promoted_shared {
                self.key_mut(k).exclusive_waiting[prio.index()] += 1;
                let r = self.run_mut(w);
                r.keys[0].1 = KeyMode::Exclusive;
                r.promoted_shared = false;
                ev.push(Event::KeyModeChanged {
                    run_id: r.req.run_id.clone(),
                    key: key_name.clone(),
                    mode: KeyMode::Exclusive,
                });
            }
        }
    }

    // ----- budgets (B1-B5) -------------------------------------------------------------

    /// The live run whose claim holds `owner`'s token for `operation` in `scope`, if
    /// any: that token comes back with the run's release, not on its own (A1).
    fn claim_holder(&self, scope: &str, owner: &str, operation: &str) -> Option<String> {
        let t = self.scopes.token(scope, owner, operation)?;
        let run_id = t.run_id.as_deref()?;
        let s = *self.by_id.get(run_id)?;
        let r = self.run(s);
        let own = r
            .req
            .budget
            .as_deref()
            .is_some_and(|b| b.scope == scope && b.operation() == operation);
        (own && r.req.run_id == owner && r.state.holds_claim()).then(|| run_id.to_string())
    }

    /// B2: a turn's reservation. Never queues: a full harness, a paused or stopped
    /// scope is refused at once (the caller retries with the same key).
    fn reserve(
        &mut self,
        now: TimeMs,
        scope: &str,
        owner: &str,
        operation: &str,
        harness: &str,
        ev: &mut Vec<Event>,
    ) -> Result<Option<RunView>, Error> {
        crate::scopes::check_id("owner", owner).map_err(Error::from)?;
        crate::scopes::check_id("operation_id", operation).map_err(Error::from)?;
        crate::scopes::check_harness(harness).map_err(|rule| {
            Error::from(ScopeError::Invalid {
                field: "harness",
                rule,
            })
        })?;
        // A live run's own key is its claim's: a turn cannot take it from under it.
        if let Some(&s) = self.by_id.get(owner) {
            let r = self.run(s);
            let b = r.req.budget.as_deref();
            if !r.state.is_terminal()
                && b.is_some_and(|b| b.scope == scope && b.operation() == operation)
            {
                let (scope, run_id) = (scope.to_string(), owner.to_string());
                return Err(Error::from(ScopeError::InUse { scope, run_id }));
            }
        }
        let taken = self
            .scopes
            .reserve(now, scope, owner, operation, harness, None)
            .map_err(Error::from)?;
        if taken == crate::scopes::Reserved::New {
            ev.push(Event::TokenTaken {
                scope: scope.to_string(),
                owner: owner.to_string(),
                operation: operation.to_string(),
                harness: harness.to_string(),
                run_id: None,
            });
        }
        Ok(None)
    }

    /// B3: the owner gives a token back; a live run's own token comes back only with
    /// the run.
    fn unreserve(
        &mut self,
        scope: &str,
        owner: &str,
        operation: &str,
        ev: &mut Vec<Event>,
    ) -> Result<Option<RunView>, Error> {
        if let Some(run_id) = self.claim_holder(scope, owner, operation) {
            let scope = scope.to_string();
            return Err(Error::from(ScopeError::InUse { scope, run_id }));
        }
        let t = self
            .scopes
            .release(scope, owner, operation)
            .map_err(Error::from)?;
        self.scopes.touch(scope, self.now);
        ev.push(Event::TokenFreed {
            scope: scope.to_string(),
            owner: owner.to_string(),
            operation: operation.to_string(),
            harness: t.harness,
            reconciled: false,
        });
        Ok(None)
    }

    /// S10: an operator forgets an idle scope.
    fn delete_scope(
        &mut self,
        scope: String,
        ev: &mut Vec<Event>,
    ) -> Result<Option<RunView>, Error> {
        self.scopes.delete(&scope).map_err(Error::from)?;
        ev.push(Event::ScopeForgotten {
            scope,
            by_operator: true,
        });
        Ok(None)
    }

    /// S10: scopes idle past the idle window are forgotten, looked for at most once a
    /// minute (or half the window).
    fn prune_scopes(&mut self, now: TimeMs, ev: &mut Vec<Event>) {
        if now < self.scope_prune_at {
            return;
        }
        // A short window (a test's) is looked at within half of it.
        let every = SCOPE_PRUNE_EVERY_MS.min(self.cfg.scope_idle_ms / 2);
        self.scope_prune_at = now.saturating_add(every);
        for scope in self.scopes.prune_idle(now, self.cfg.scope_idle_ms) {
            ev.push(Event::ScopeForgotten {
                scope,
                by_operator: false,
            });
        }
    }

    /// B3: an operator frees every token `owner` holds in the scope, all or none: a
    /// live run's own token is refused (its release gives it back).
    fn reconcile(
        &mut self,
        scope: &str,
        owner: &str,
        ev: &mut Vec<Event>,
    ) -> Result<Option<RunView>, Error> {
        crate::scopes::check_id("owner", owner).map_err(Error::from)?;
        for (op, _) in self.scopes.owner_operations(scope, owner) {
            if let Some(run_id) = self.claim_holder(scope, owner, &op) {
                let scope = scope.to_string();
                return Err(Error::from(ScopeError::InUse { scope, run_id }));
            }
        }
        self.scopes.touch(scope, self.now);
        for (operation, t) in self.scopes.reconcile(scope, owner).map_err(Error::from)? {
            ev.push(Event::TokenFreed {
                scope: scope.to_string(),
                owner: owner.to_string(),
                operation,
                harness: t.harness,
                reconciled: true,
            });
        }
        Ok(None)
    }

    /// B4: a control request. Once a scope stops, its waiters are refused at once
    /// (ended `rejected`); the runs holding tokens keep them.
    fn scope_control(
        &mut self,
        now: TimeMs,
        scope: &str,
        request_id: &str,
        mode: crate::scopes::Mode,
        ev: &mut Vec<Event>,
    ) -> Result<Option<RunView>, Error> {
        let retry = self
            .scopes
            .get(scope)
            .is_some_and(|s| s.receipts.iter().any(|r| r.request_id == request_id));
        let receipt = self
            .scopes
            .control(now, scope, request_id, mode)
            .map_err(Error::from)?;
        if retry {
            return Ok(None); // the same receipt again: nothing changed
        }
        let stopped = receipt.control == crate::scopes::Control::Stopped;
        ev.push(Event::ScopeControlled {
            scope: scope.to_string(),
            receipt,
        });
        if stopped {
            let waiters: Vec<Slot> = self
                .queues
                .iter()
                .flat_map(|q| q.iter())
                .map(|(_, s)| s)
                .filter(|&s| {
                    let b = self.run(s).req.budget.as_deref();
                    b.is_some_and(|b| b.scope == scope)
                })
                .collect();
            for s in waiters {
                self.unqueue(s);
                self.end(s, RunState::Rejected, ev);
            }
        }
        Ok(None)
    }

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

    /// A8: a waiter whose wait ran out leaves the queue as expired, holding nothing,
    /// and keeps what it was last waiting on for its answer (A11).
    fn expire_waiter(&mut self, s: Slot, ev: &mut Vec<Event>) {
        let reason = self.reason(s);
        self.unqueue(s);
        self.run_mut(s).last_reason = Some(Box::new(reason));
        self.end(s, RunState::Expired, ev);
    }

    fn begin_stop(&mut self, s: Slot, cause: EndCause, ev: &mut Vec<Event>) {
        let expires_at = self.run(s).expires_at;
        self.expiries.remove(&(expires_at, s));
        self.set_state(s, RunState::Releasing);
        self.run_mut(s).cause = Some(cause);
        ev.push(Event::StopRequested {
            run_id: self.run(s).req.run_id.clone(),
            cause,
        });
        // B3: a lapsed lease stops the run, but its owner's tokens stay held, marked.
        if cause == EndCause::Expired {
            let run = self.run(s);
            if let Some(b) = &run.req.budget {
                let (scope, owner) = (b.scope.clone(), run.req.run_id.clone());
                for operation in self.scopes.lapse_owner(&scope, &owner) {
                    ev.push(Event::TokenLapsed {
                        scope: scope.clone(),
                        owner: owner.clone(),
                        operation,
                    });
                }
            }
        }
    }

    /// B2: the granted run's token, taken in the step that grants it (A1). Its key may
    /// hold one already (a run id's earlier incarnation): that one is reused.
    fn take_token(&mut self, s: Slot, now: TimeMs, ev: &mut Vec<Event>) {
        // The run's slot and the scopes are separate fields: borrowed apart.
        let run = self.runs[s as usize].as_deref().expect("live slot");
        let Some(b) = run.req.budget.as_deref() else {
            return;
        };
        let (owner, op) = (run.req.run_id.as_str(), b.operation());
        let taken = self
            .scopes
            .reserve(now, &b.scope, owner, op, &b.harness, Some(owner))
            .expect("blocker() let the token through");
        if taken == crate::scopes::Reserved::Existing {
            self.scopes.adopt(&b.scope, owner, op, owner);
        }
        ev.push(Event::TokenTaken {
            scope: b.scope.clone(),
            owner: owner.to_string(),
            operation: op.to_string(),
            harness: b.harness.clone(),
            run_id: Some(owner.to_string()),
        });
    }

    /// B3: the run's owner released it: its own token comes back with its claim. (A
    /// lapsed run keeps it: only its owner's explicit release or a reconciliation
    /// frees it.)
    fn give_token_back(&mut self, s: Slot, ev: &mut Vec<Event>) {
        let run = self.run(s);
        let Some(b) = run.req.budget.as_deref() else {
            return;
        };
        let (owner, op) = (run.req.run_id.clone(), b.operation().to_string());
        let scope = b.scope.clone();
        if let Ok(t) = self.scopes.release(&scope, &owner, &op) {
            self.scopes.touch(&scope, self.now);
            ev.push(Event::TokenFreed {
                scope,
                owner,
                operation: op,
                harness: t.harness,
                reconciled: false,
            });
        }
    }

    /// Returns everything a run holds to the host: resources, keys, pending memory.
    fn free_claim(&mut self, s: Slot) {
        let run = self.runs[s as usize].as_ref().expect("live slot");
        assert!(run.state.holds_claim());
        for (c, a) in self.committed.iter_mut().zip(run.amounts.iter()) {
            *c -= a;
        }
        let keys = run.keys.clone();
        let upgrade = run.upgrade;
        if run.pending_mem {
            self.pending_memory -= run.amounts[MEMORY];
        }
        for (k, mode) in keys {
            let ks = self.key_mut(k);
            if upgrade == Some(k) {
                ks.upgrades.retain(|&u| u != s);
            } else if mode == KeyMode::Exclusive {
                assert_eq!(ks.exclusive, Some(s));
                ks.exclusive = None;
            } else {
                ks.shared -= 1;
            }
            self.gc_key(k);
        }
        let run = self.run_mut(s);
        run.upgrade = None;
        run.pending_mem = false;
    }

    /// Puts a run in a terminal state and retires the oldest ended runs past the limit.
    fn end(&mut self, s: Slot, state: RunState, ev: &mut Vec<Event>) {
        assert!(state.is_terminal());
        let was_queued = self.run(s).state == RunState::Queued;
        if !self.run(s).state.is_terminal() {
            if let Some(b) = self.runs[s as usize]
                .as_deref()
                .and_then(|r| r.req.budget.as_deref())
            {
                self.scopes.count_user(&b.scope, false, self.now);
            }
        }
        self.set_state(s, state);
        if was_queued {
            for (k, _) in self.run(s).keys.clone() {
                self.gc_key(k);
            }
        }
        ev.push(Event::Ended {
            run_id: self.run(s).req.run_id.clone(),
            state,
        });
        let p = self.run(s).project;
        self.gc_project(p);
        self.ended.push_back(s);
        while self.ended.len() > self.cfg.ended_retained_max {
            let old = self.ended.pop_front().expect("non-empty");
            let run = self.runs[old as usize].take().expect("ended run");
            self.by_id.remove(&run.req.run_id);
            self.free_slots.push(old);
        }
        // The id index a deep queue grew gives its room back once it is a quarter
        // full (to a quarter more than it holds: between two rehashes at least len/4
        // runs come or go, so the rehash is amortised O(1) per run).
        if self.by_id.capacity() > 4_096 && self.by_id.capacity() > 4 * self.by_id.len() {
            self.by_id
                .shrink_to(self.by_id.len() + self.by_id.len() / 4);
        }
    }

    // ----- admission ------------------------------------------------------------------

    /// Why `s` cannot be granted right now, ignoring the starvation guard.
    /// `is_head`: the head of its band is exempt from writer preference (A4), otherwise
    /// it and a later exclusive waiter would wait for each other under the guard (A7).
    pub(crate) fn blocker(&self, s: Slot, is_head: bool) -> Option<Blocker> {
        if self.draining {
            return Some(Blocker::Draining);
        }
        let run = self.run(s);
        if run.req.priority == Priority::Background && !self.queues[0].is_empty() {
            return Some(Blocker::ForegroundWaiting);
        }
        if let Some(b) = &run.req.budget {
            let owner = &run.req.run_id;
            if let Some(block) = self
                .scopes
                .blocked(&b.scope, &b.harness, owner, b.operation())
            {
                return Some(Blocker::Budget(s, block));
            }
        }
        for &(k, mode) in &run.keys {
            let ks = self.key(k);
            if !ks.upgrades.is_empty() {
                return Some(Blocker::Upgrade(k));
            }
            if let Some(h) = ks.exclusive {
                return Some(Blocker::ExclusiveHeld(k, h));
            }
            match mode {
                KeyMode::Exclusive if ks.shared > 0 => {
                    return Some(Blocker::SharedHeld(k, ks.shared))
                }
                KeyMode::Shared if !is_head && self.writer_waiting(ks, run.req.priority) => {
                    return Some(Blocker::WriterWaiting(k))
                }
                _ => {}
            }
        }
        for (res, ((&c, &a), &need)) in self
            .committed
            .iter()
            .zip(&self.allocatable)
            .zip(run.amounts.iter())
            .enumerate()
        {
            // S7: checked, so no request can wrap the sum under the limit.
            if c.checked_add(need).is_none_or(|sum| sum > a) {
                return Some(Blocker::Resource {
                    res,
                    need,
                    free: a - c,
                });
            }
        }
        let need = run.amounts[MEMORY];
        let free = self.ambient_free();
        if need > free {
            return Some(Blocker::Ambient { need, free });
        }
        // Last: the fleet is asked only for a run that would otherwise be granted, so a
        // fleet-wide token is not held while the run waits for local capacity. A permit
        // whose fence is not above the host's last is stale (another run's permit, taken
        // later, was granted first): granting it would break L1's order.
        if self.cfg.fleet && run.permit.is_none_or(|f| f <= self.last_fence) {
            return Some(Blocker::Permit);
        }
        None
    }

    /// F1: ask the caller for this waiter's fleet-wide claim, once per permit it needs
    /// (again when the one it holds went stale: the caller then renews its fence).
    fn want_permit(&mut self, s: Slot, ev: &mut Vec<Event>) {
        let last = self.last_fence;
        let run = self.run_mut(s);
        if run.permit.is_some_and(|f| f <= last) {
            run.permit = None;
            run.permit_asked = false;
        }
        if !run.permit_asked {
            run.permit_asked = true;
            let run_id = run.req.run_id.clone();
            ev.push(Event::PermitWanted { run_id });
        }
    }

    /// F1: the fleet store holds the queued run's claim; its grant will carry `fence`.
    fn permit(&mut self, run_id: &str, fence: Fence) -> Result<Option<RunView>, Error> {
        let Some(&s) = self.by_id.get(run_id) else {
            return Err(Error::NotFound {
                run_id: run_id.into(),
            });
        };
        let run = self.run(s);
        if !self.cfg.fleet || run.state != RunState::Queued || fence == 0 {
            return Err(Error::Invalid {
                field: "permit",
                rule: format!("run {run_id} is not a queued run of a fleet host"),
            });
        }
        self.run_mut(s).permit = Some(fence);
        Ok(None)
    }

    /// Memory that the host really has for new grants (A2): stabilised MemAvailable less
    /// the reserve, less memory granted whose processes have not started using it.
    pub(crate) fn ambient_free(&self) -> u64 {
        match self.stabilized_available {
            Some(avail) => avail
                .saturating_sub(self.cfg.memory_reserve)
                .saturating_sub(self.pending_memory),
            None => u64::MAX,
        }
    }

    fn writer_waiting(&self, ks: &KeyState, prio: Priority) -> bool {
        match prio {
            Priority::Foreground => ks.exclusive_waiting[0] > 0,
            Priority::Background => ks.exclusive_waiting[0] + ks.exclusive_waiting[1] > 0,
        }
    }

    /// A7: would `head` still fit after granting `cand`? For every resource `cand` takes,
    /// what is left must still cover the head (resources `cand` does not touch are not
    /// its doing); and the two must not conflict on a key. So capacity the head needs
    /// only ever drains towards it.
    pub(crate) fn head_fits_after(&self, head: Slot, cand: Slot) -> bool {
        let h = self.run(head);
        let c = self.run(cand);
        for i in 0..self.allocatable.len() {
            if c.amounts[i] > 0
                && self.committed[i]
                    .saturating_add(h.amounts[i])
                    .saturating_add(c.amounts[i])
                    > self.allocatable[i]
            {
                return false;
            }
        }
        if c.amounts[MEMORY] > 0
            && h.amounts[MEMORY].saturating_add(c.amounts[MEMORY]) > self.ambient_free()
        {
            return false;
        }
        for &(hk, hm) in &h.keys {
            for &(ck, cm) in &c.keys {
                if hk == ck && (hm == KeyMode::Exclusive || cm == KeyMode::Exclusive) {
                    return false;
                }
            }
        }
        // B2: a token of the head's harness must still be left for the head.
        if let (Some(hb), Some(cb)) = (&h.req.budget, &c.req.budget) {
            if hb.scope == cb.scope && hb.harness == cb.harness {
                let left = self.scopes.get(&hb.scope).map_or(0, |sc| {
                    let limit = sc.policy.get(&hb.harness).copied().unwrap_or(0) as usize;
                    limit.saturating_sub(sc.holders(&hb.harness))
                });
                if left < 2 {
                    return false;
                }
            }
        }
        true
    }

    pub(crate) fn guard_active(&self, head: Slot) -> bool {
        self.now.saturating_sub(self.run(head).enqueued_at) > self.cfg.starvation_guard_ms
    }

    /// One admission pass: upgrades first (C4), then per band the head's first pick and a
    /// rotating window of later waiters (A6), under the starvation guard (A7). Work is
    /// bounded by `slots_max + window + 1` evaluations, whatever the queue's depth.
    fn pass(&mut self, now: TimeMs, extra: Option<Slot>, ev: &mut Vec<Event>) {
        self.service_upgrades(ev);
        let mut buf = std::mem::take(&mut self.window_buf);
        for band in 0..2 {
            if band == 1 && !self.queues[0].is_empty() {
                break; // A5: background only while no foreground run waits.
            }
            while let Some((_, h)) = self.queues[band].head() {
                match self.blocker(h, true) {
                    None => self.grant(h, now, ev),
                    Some(Blocker::Permit) => {
                        self.want_permit(h, ev);
                        break;
                    }
                    Some(_) => break,
                }
            }
            let Some((_, head)) = self.queues[band].head() else {
                continue;
            };
            let guard = self.guard_active(head);
            self.queues[band].window(self.cfg.window, &mut buf);
            if let Some(x) = extra {
                let r = self.run(x);
                if r.state == RunState::Queued
                    && r.req.priority.index() == band
                    && x != head
                    && !buf.iter().any(|&(_, s)| s == x)
                {
                    buf.push((r.seq, x));
                }
            }
            for &(seq, s) in &buf {
                let Some(Some(r)) = self.runs.get(s as usize) else {
                    continue;
                };
                if r.state != RunState::Queued || r.seq != seq {
                    continue;
                }
                let blocker = self.blocker(s, false);
                let fits = !guard || self.head_fits_after(head, s);
                match blocker {
                    None if fits => self.grant(s, now, ev),
                    Some(Blocker::Permit) if fits => self.want_permit(s, ev),
                    _ => {}
                }
            }
        }
        self.window_buf = buf;
    }

    fn service_upgrades(&mut self, ev: &mut Vec<Event>) {
        if self.keys_with_upgrades.is_empty() {
            return;
        }
        let keys: Vec<KeyId> = self.keys_with_upgrades.iter().copied().collect();
        for k in keys {
            let ks = self.key_mut(k);
            if ks.exclusive.is_none() && ks.shared == 0 {
                if let Some(s) = ks.upgrades.pop_front() {
                    ks.exclusive = Some(s);
                    let name = ks.name.clone();
                    self.run_mut(s).upgrade = None;
                    ev.push(Event::UpgradeGranted {
                        run_id: self.run(s).req.run_id.clone(),
                        key: name,
                    });
                }
            }
            if self.key(k).upgrades.is_empty() {
                self.keys_with_upgrades.remove(&k);
            }
        }
    }

    fn grant(&mut self, s: Slot, now: TimeMs, ev: &mut Vec<Event>) {
        {
            let r = self.run(s);
            // A8: never after the deadline (a `wait_s = 0` run is tried at its arrival).
            assert!(
                now < r.deadline || (r.req.wait_ms == 0 && now == r.enqueued_at),
                "A8: grant after deadline"
            );
        }
        // A5: a background grant while foreground waits would be a bug; it is counted
        // here and reported by `check_invariants` (which every test runs after each step).
        if self.run(s).req.priority == Priority::Background && !self.queues[0].is_empty() {
            self.background_grants_while_foreground_waits += 1;
        }
        self.unqueue(s);
        self.set_state(s, RunState::Granted);
        // F1: a fleet host's fence comes from the fleet's one sequence (unique fleet-wide,
        // not always above this host's last: another run's permit may have come first).
        let fence = self.run(s).permit.unwrap_or(self.last_fence + 1);
        self.last_fence = self.last_fence.max(fence);
        let settle = now.saturating_add(self.cfg.pending_settle_ms);
        let (keys, amounts) = {
            let r = self.run(s);
            (r.keys.clone(), r.amounts.clone())
        };
        for (c, a) in self.committed.iter_mut().zip(amounts.iter()) {
            *c += a;
        }
        for &(k, mode) in &keys {
            let ks = self.key_mut(k);
            match mode {
                KeyMode::Exclusive => {
                    assert!(ks.exclusive.is_none() && ks.shared == 0, "A4");
                    ks.exclusive = Some(s);
                }
                KeyMode::Shared => {
                    assert!(ks.exclusive.is_none(), "A4");
                    ks.shared += 1;
                }
            }
        }
        if amounts[MEMORY] > 0 {
            self.pending_memory += amounts[MEMORY];
            self.pending.push_back((settle, s, fence));
        }
        self.take_token(s, now, ev);
        let run = self.run_mut(s);
        run.fence = Some(fence);
        run.granted_at = now;
        run.expires_at = now.saturating_add(run.req.ttl_ms);
        run.pending_mem = amounts[MEMORY] > 0;
        let expires_at = run.expires_at;
        let run_id = run.req.run_id.clone();
        self.expiries.insert((expires_at, s));
        let key_names: Vec<(String, KeyMode)> = keys
            .iter()
            .map(|&(k, m)| (self.key(k).name.clone(), m))
            .collect();
        ev.push(Event::Granted {
            run_id,
            fence,
            expires_at_ms: expires_at,
            keys: key_names,
        });
    }

    // ----- views ----------------------------------------------------------------------

    /// 1-based position in the host queue: every foreground waiter comes first.
    pub(crate) fn position(&self, s: Slot) -> u64 {
        let r = self.run(s);
        let band = r.req.priority.index();
        let before = if band == 1 {
            self.queues[0].len() as u64
        } else {
            0
        };
        before + self.queues[band].rank(r.seq) + 1
    }

    /// A11: the reason a queued run is waiting, as a code and a sentence.
    pub(crate) fn reason(&self, s: Slot) -> Reason {
        let run = self.run(s);
        let band = run.req.priority.index();
        let head = self.queues[band].head().map(|(_, h)| h);
        let is_head = head == Some(s);
        let blocker = self.blocker(s, is_head).or_else(|| match head {
            Some(h) if !is_head && self.guard_active(h) && !self.head_fits_after(h, s) => {
                Some(Blocker::Guard { head: h })
            }
            _ => None,
        });
        match blocker {
            Some(b) => self.render_blocker(b),
            // Nothing blocks it, yet no pass has granted it. A later waiter waits for the
            // rotating window (A6), which may take several passes: no promise of which.
            None if is_head => Reason {
                code: "queue.scan".into(),
                message: "fits now; the next admission pass offers it the first pick".into(),
            },
            None => Reason {
                code: "queue.scan".into(),
                message: format!(
                    "fits now; waits for the rotating scan window ({} waiters per pass) to reach it",
                    self.cfg.window
                ),
            },
        }
    }

    pub(crate) fn describe_key(&self, k: KeyId) -> String {
        let name = &self.key(k).name;
        if let Some(s) = name.strip_prefix("singleton:") {
            format!("singleton {s}")
        } else if let Some(p) = name.strip_prefix("project:") {
            let (proj, kind) = p.rsplit_once(':').unwrap_or((p, ""));
            format!("project {proj} {kind} key")
        } else {
            name.clone()
        }
    }

    pub(crate) fn view(&self, s: Slot) -> RunView {
        let r = self.run(s);
        let queued = r.state == RunState::Queued;
        let held = r.state.holds_claim();
        RunView {
            run_id: r.req.run_id.clone(),
            project: r.req.project.clone(),
            class: r.req.class,
            priority: r.req.priority,
            state: r.state,
            fence: r.fence,
            expires_at_ms: held.then_some(r.expires_at),
            ttl_ms: held.then_some(r.req.ttl_ms),
            cause: r.cause,
            deadline_ms: queued.then_some(r.deadline),
            position: queued.then(|| self.position(s)),
            reason: if queued {
                Some(self.reason(s))
            } else {
                r.last_reason.as_deref().cloned()
            },
            keys: key_names(&r.req)
                .into_iter()
                .zip(r.keys.iter().map(|&(_, m)| m))
                .collect(),
            resources: r.req.resources.clone(),
        }
    }

    /// What the ledger must remember about a run (the inverse of [`Engine::restore`]).
    pub fn record(&self, run_id: &str) -> Option<RestoredRun> {
        let r = self.run(*self.by_id.get(run_id)?);
        Some(RestoredRun {
            request: r.req.clone(),
            state: r.state,
            fence: r.fence,
            enqueued_at: r.enqueued_at,
            deadline: r.deadline,
            granted_at: r.granted_at,
            expires_at: r.expires_at,
            cause: r.cause,
            primary_mode: r.keys[0].1,
            upgrading: r.upgrade.is_some(),
        })
    }

    /// The run's class, if berth still remembers the run (cheap: no view is built).
    pub fn class_of(&self, run_id: &str) -> Option<Class> {
        Some(self.run(*self.by_id.get(run_id)?).req.class)
    }

    /// The run's project, if berth still remembers the run (cheap: no view is built).
    pub fn project_of(&self, run_id: &str) -> Option<&str> {
        let s = *self.by_id.get(run_id)?;
        Some(self.run(s).req.project.as_str())
    }

    /// Why the run waits, if it is queued (no view is built: a run granted in the step
    /// that queued it, the common case, costs a lookup).
    pub fn reason_of(&self, run_id: &str) -> Option<Reason> {
        let s = *self.by_id.get(run_id)?;
        (self.run(s).state == RunState::Queued).then(|| self.reason(s))
    }

    /// The run's budget, if it has one (cheap: nothing is cloned).
    pub fn budget_of(&self, run_id: &str) -> Option<&crate::scopes::Budget> {
        self.run(*self.by_id.get(run_id)?).req.budget.as_deref()
    }

    /// F1: what a run needs of the fleet besides its id and fence: its budget token
    /// (scope, harness and the harness's limit as the scope froze it) and its
    /// fleet-wide singletons (named `fleet:NAME`; the key is NAME).
    pub fn fleet_needs(&self, run_id: &str) -> Option<FleetNeeds> {
        let run = self.run(*self.by_id.get(run_id)?);
        let token = run.req.budget.as_deref().and_then(|b| {
            let limit = *self.scopes.get(&b.scope)?.policy.get(&b.harness)?;
            Some((b.scope.clone(), b.harness.clone(), limit))
        });
        let keys = run
            .req
            .singletons
            .iter()
            .filter_map(|s| s.strip_prefix(FLEET_SINGLETON_PREFIX))
            .map(str::to_owned)
            .collect();
        Some(FleetNeeds {
            token,
            keys,
            state: run.state,
        })
    }

    /// The run's fence, if it was ever granted (cheap: no view is built).
    pub fn fence_of(&self, run_id: &str) -> Option<u64> {
        self.run(*self.by_id.get(run_id)?).fence
    }

    /// The run's current view, if berth still remembers it.
    pub fn view_of(&self, run_id: &str) -> Option<RunView> {
        self.by_id.get(run_id).map(|&s| self.view(s))
    }

    /// Since when the run holds its state's start: its grant once granted, else when
    /// it queued (what `berth runs` shows as its age).
    pub fn since_of(&self, run_id: &str) -> Option<TimeMs> {
        let r = self.run(*self.by_id.get(run_id)?);
        Some(if r.fence.is_some() {
            r.granted_at
        } else {
            r.enqueued_at
        })
    }

    /// The head of the host queue (foreground first): id, priority, when it queued.
    pub fn head(&self) -> Option<(&str, Priority, TimeMs)> {
        let (_, s) = self.queues[0].head().or_else(|| self.queues[1].head())?;
        let r = self.run(s);
        Some((&r.req.run_id, r.req.priority, r.enqueued_at))
    }

    /// G4: the runs in flight (granted, releasing or degraded: a run is in flight until
    /// its processes are stopped and its workspace is cleaned), in run id order.
    pub fn in_flight(&self) -> Vec<RunView> {
        let mut out: Vec<RunView> = self
            .runs
            .iter()
            .enumerate()
            .filter(|(_, r)| {
                r.as_ref().is_some_and(|r| {
                    matches!(
                        r.state,
                        RunState::Granted | RunState::Releasing | RunState::Degraded
                    )
                })
            })
            .map(|(s, _)| self.view(s as Slot))
            .collect();
        out.sort_by(|a, b| a.run_id.cmp(&b.run_id));
        out
    }

    /// Waiters in admission order (foreground first), at most `limit` of them.
    pub fn queued(&self, limit: usize) -> Vec<RunView> {
        self.queues[0]
            .iter()
            .chain(self.queues[1].iter())
            .take(limit)
            .map(|(_, s)| self.view(s))
            .collect()
    }
}

/// L7: a retry is the same request. A budget's policy and manifest are not part of
/// what a run keeps (they are the scope's, and were checked against it), so they are
/// left out of the comparison.
fn same_request(kept: &Request, given: &Request) -> bool {
    match given.budget.as_deref() {
        Some(b) if b.per_harness.is_some() || b.manifest.is_some() => {
            let mut g = given.clone();
            if let Some(b) = g.budget.as_deref_mut() {
                b.per_harness = None;
                b.manifest = None;
            }
            *kept == g
        }
        _ => kept == given,
    }
}

fn contract_matches_project(e: &Engine, s: Slot) -> bool {
    let r = e.run(s);
    match &e.project(r.project).evidence {
        Some(ev) => contract_matches(&r.contract, ev),
        None => false,
    }
}

/// Exposed for the snapshot module.
pub(crate) fn concurrency_class(p: &ProjectState) -> ConcurrencyClass {
    if p.evidence.is_some() {
        ConcurrencyClass::ParallelSafe
    } else if p.parallel_asked {
        ConcurrencyClass::ParallelCandidate
    } else {
        ConcurrencyClass::Serial
    }
}
