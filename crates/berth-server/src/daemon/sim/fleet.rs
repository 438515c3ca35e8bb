//! Fleet mode in the daemon simulator (issue 35): every fourth seed runs the daemon as
//! one host of a fleet, on an in-memory fleet store ([`MemFleet`]) that keeps the
//! simulator's time. The fleet link is the real one without its threads
//! ([`SimLink`]): the simulator decides when the daemon's claims and endings reach the
//! store, when heartbeats happen, when the store cannot be reached from this host, and
//! what a second host (the peer) does with the same fleet-wide key.
//!
//! Checked after every step: a granted run's fence is the one the fleet store holds
//! for it, on this host; a fleet-wide key is never held by a granted run here and by
//! the peer at once. At the end, with every job carried out, no claim of this host is
//! left in the store. Fleet seeds crash too (issue 38 item 2): an ending lost with the
//! daemon's fleet thread is ended by the registration after the restart, which ends
//! the claims of runs that ended here; clean restarts carry out what the link holds
//! first, as a graceful stop does. The store's server restarts too (issue 38 Build 6):
//! it commits a call of this host and loses the answer, then the link is down for a
//! while, and a wake-up sent meanwhile is lost. The peer reaches the store throughout
//! (its own outages are its silences).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use berth_core::RunState;
use berth_store::fleet::{
    BatchOutcome, Claim, ClaimOutcome, ControlOutcome, Ending, FleetDrain, FleetError,
    FleetEvidence, FleetFence, FleetOp, FleetStore, FleetToken, HostInfo, HostRow, MemFleet,
    ScopeControlRequest, Shared, ThreadOwner, TokenRow,
};

use super::Sim;
use crate::daemon::{Error, Msg, RunInfo};
use crate::fleet::{FleetConfig, Report, SimLink};

/// A seed the simulator runs in fleet mode.
const FLEET_SEED: u64 = super::FLEET_SEED_EVERY - 1;
/// This host's id in the fleet, and the peer's.
pub(super) const HOST: &str = "sim";
pub(super) const PEER: &str = "peer";
/// The fleet-wide key some runs and the peer take turns on.
pub(super) const KEY: &str = "db";
/// Heartbeat period and lapse (F2); the daemon fences itself a quarter of the lapse
/// early, as `berth serve` sets it up.
const BEAT_MS: u64 = 1_000;
const LAPSE_MS: u64 = 20_000;
const SELF_FENCE_MS: u64 = LAPSE_MS - LAPSE_MS / 4;
const RECHECK_MS: u64 = 5_000;
/// The longest time passes in fleet seeds without a tick and a heartbeat: shorter than
/// the self-fence margin, as a real daemon ticks every 100 ms.
pub(super) const FLEET_TICK_MS_MAX: u64 = LAPSE_MS / 8;

/// The store as this host reaches it: unreachable while `down` is set.
pub(super) struct Reach {
    pub(super) store: MemFleet,
    pub(super) down: Arc<AtomicBool>,
    /// The server restarts (issue 38 Build 6) after carrying out the next call this
    /// host makes: the call commits, its answer is lost, and the link is down until
    /// the server is back (a restart that aborts the call instead is a cut link).
    pub(super) restart: Arc<AtomicBool>,
}

impl Reach {
    fn up(&self) -> Result<(), FleetError> {
        match self.down.load(Ordering::Relaxed) {
            true => Err(FleetError::Unavailable("sim: the link is cut".into())),
            false => Ok(()),
        }
    }

    /// One call through the link: refused while it is cut; carried out but its answer
    /// lost when the server restarts right after committing it.
    fn call<T>(
        &mut self,
        f: impl FnOnce(&mut MemFleet) -> Result<T, FleetError>,
    ) -> Result<T, FleetError> {
        self.up()?;
        let answer = f(&mut self.store);
        if self.restart.swap(false, Ordering::Relaxed) {
            self.down.store(true, Ordering::Relaxed);
            return Err(FleetError::Unavailable(
                "sim: the server restarted before it answered".into(),
            ));
        }
        answer
    }
}

impl FleetStore for Reach {
    fn raise_fence(&mut self, floor: u64) -> Result<(), FleetError> {
        self.call(|s| s.raise_fence(floor))
    }
    fn register(&mut self, host: &HostInfo) -> Result<(i64, bool), FleetError> {
        self.call(|s| s.register(host))
    }
    fn heartbeat(&mut self, host_id: &str, gen: i64, load: &str) -> Result<bool, FleetError> {
        self.call(|s| s.heartbeat(host_id, gen, load))
    }
    fn declare_dead(&mut self, me: &str, lapse_ms: i64) -> Result<Vec<(String, i64)>, FleetError> {
        self.call(|s| s.declare_dead(me, lapse_ms))
    }
    fn claim(&mut self, c: &Claim) -> Result<ClaimOutcome, FleetError> {
        self.call(|s| s.claim(c))
    }
    // All or nothing, as one transaction is: a cut link carries out none of it.
    fn batch(&mut self, host_id: &str, ops: &[FleetOp]) -> Result<BatchOutcome, FleetError> {
        self.call(|s| s.batch(host_id, ops))
    }
    fn refence(
        &mut self,
        run_id: &str,
        host_id: &str,
        gen: i64,
    ) -> Result<ClaimOutcome, FleetError> {
        self.call(|s| s.refence(run_id, host_id, gen))
    }
    fn end(
        &mut self,
        run_id: &str,
        host_id: &str,
        gen: i64,
        how: Ending,
    ) -> Result<bool, FleetError> {
        self.call(|s| s.end(run_id, host_id, gen, how))
    }
    fn thread_owner(
        &mut self,
        key: &str,
        owner: &ThreadOwner,
        host_id: &str,
    ) -> Result<Option<ThreadOwner>, FleetError> {
        self.call(|s| s.thread_owner(key, owner, host_id))
    }
    fn fence(&mut self, run_id: &str) -> Result<Option<FleetFence>, FleetError> {
        self.call(|s| s.fence(run_id))
    }
    fn hosts(&mut self) -> Result<Vec<HostRow>, FleetError> {
        self.call(|s| s.hosts())
    }
    fn tokens(&mut self, scope: &str) -> Result<Vec<TokenRow>, FleetError> {
        self.call(|s| s.tokens(scope))
    }
    fn reconcile(&mut self, scope: &str, owner: &str) -> Result<bool, FleetError> {
        self.call(|s| s.reconcile(scope, owner))
    }
    fn declarations(&mut self, host_id: &str) -> Result<Vec<(i64, String)>, FleetError> {
        self.call(|s| s.declarations(host_id))
    }
    fn claims_of(&mut self, host_id: &str) -> Result<Vec<(String, i64)>, FleetError> {
        self.call(|s| s.claims_of(host_id))
    }
    fn put_token(&mut self, t: &FleetToken) -> Result<i64, FleetError> {
        self.call(|s| s.put_token(t))
    }
    fn revoke_token(&mut self, id: &str) -> Result<(Vec<FleetToken>, i64), FleetError> {
        self.call(|s| s.revoke_token(id))
    }
    fn set_drain(
        &mut self,
        d: Option<&FleetDrain>,
    ) -> Result<(Option<FleetDrain>, i64), FleetError> {
        self.call(|s| s.set_drain(d))
    }
    fn shared(&mut self, since: i64) -> Result<Option<Shared>, FleetError> {
        self.call(|s| s.shared(since))
    }
    fn control_scope(
        &mut self,
        r: &ScopeControlRequest,
        host_id: &str,
    ) -> Result<(ControlOutcome, i64), FleetError> {
        self.call(|s| s.control_scope(r, host_id))
    }
    fn put_evidence(&mut self, e: &FleetEvidence) -> Result<i64, FleetError> {
        self.call(|s| s.put_evidence(e))
    }
    fn invalidate_evidence(
        &mut self,
        project: &str,
        fingerprint: &str,
        commit: Option<&str>,
    ) -> Result<i64, FleetError> {
        self.call(|s| s.invalidate_evidence(project, fingerprint, commit))
    }
}

/// The second host: it takes the fleet-wide key in turns with this host's runs, and
/// sometimes falls silent (no heartbeats) until this host declares it dead.
#[derive(Default)]
struct Peer {
    gen: i64,
    silent: bool,
    /// The run it holds the key for, and its fence.
    holds: Option<(String, u64)>,
    /// The run its own fence stopped while it was silent: its claim is ended once the
    /// peer reaches the store again (as this host's link does).
    fenced: Option<String>,
    runs: u64,
}

pub(super) struct FleetSim {
    pub(super) store: MemFleet,
    clock: Arc<AtomicU64>,
    pub(super) down: Arc<AtomicBool>,
    /// See [`Reach::restart`].
    restart: Arc<AtomicBool>,
    link: SimLink,
    reports: Arc<Mutex<VecDeque<Report>>>,
    peer: Peer,
}

fn host(id: &str) -> HostInfo {
    HostInfo {
        host_id: id.into(),
        address: format!("http://{id}"),
        version: "sim".into(),
    }
}

impl FleetSim {
    /// A fleet with this host's link and a registered peer.
    pub(super) fn new(now: u64) -> FleetSim {
        let clock = Arc::new(AtomicU64::new(now));
        let store = MemFleet::with_clock(clock.clone());
        let peer = Peer {
            gen: store
                .clone()
                .register(&host(PEER))
                .expect("peer registers")
                .0,
            ..Peer::default()
        };
        let down = Arc::new(AtomicBool::new(false));
        let restart = Arc::new(AtomicBool::new(false));
        let reach = Reach {
            store: store.clone(),
            down: down.clone(),
            restart: restart.clone(),
        };
        let (link, reports) = new_link(reach, &clock).1;
        FleetSim {
            store,
            clock,
            down,
            restart,
            link,
            reports,
            peer,
        }
    }
}

impl FleetSim {
    /// The link is never cut again (the drain at the end), and the server does not
    /// restart.
    pub(super) fn link_up(&mut self) {
        self.down.store(false, Ordering::Relaxed);
        self.restart.store(false, Ordering::Relaxed);
    }

    /// The store as this host's link reaches it.
    pub(super) fn reach(&self) -> Reach {
        Reach {
            store: self.store.clone(),
            down: self.down.clone(),
            restart: self.restart.clone(),
        }
    }
}

/// A link for a daemon that starts: its handle, and the link with its report queue.
#[allow(clippy::type_complexity)]
fn new_link(
    reach: Reach,
    clock: &Arc<AtomicU64>,
) -> (
    crate::fleet::Handle,
    (SimLink, Arc<Mutex<VecDeque<Report>>>),
) {
    let reports: Arc<Mutex<VecDeque<Report>>> = Arc::default();
    let queue = reports.clone();
    let inbox = crate::tell::Tell::to_fn(move |r| {
        queue.lock().unwrap().push_back(r);
        true
    });
    let cfg = FleetConfig {
        url: "sim".into(),
        host: host(HOST),
        beat_ms: BEAT_MS,
        lapse_ms: LAPSE_MS,
        recheck_ms: RECHECK_MS,
        fence_floor: 0,
    };
    let time = clock.clone();
    let now = Arc::new(move || time.load(Ordering::Relaxed));
    let (handle, link) = SimLink::new(cfg, Box::new(reach), inbox, now);
    (handle, (link, reports))
}

impl Sim {
    /// The daemon (just started) joins the fleet: a new link (the old one died with the
    /// daemon), registered at once.
    pub(super) fn join_fleet(&mut self) {
        let Some(f) = self.fleet.as_mut() else { return };
        let (handle, (link, reports)) = new_link(f.reach(), &f.clock);
        (f.link, f.reports) = (link, reports);
        self.daemon.as_mut().expect("started").set_fleet(
            handle,
            SELF_FENCE_MS,
            RECHECK_MS,
            BEAT_MS,
        );
        self.fleet_beat();
    }

    /// Before a clean stop: what the link holds reaches the store, and what that sets
    /// off (an answered claim may end a run, whose ending is a new job) too. Endings
    /// the store missed while it was away are retried with the store reachable: a
    /// stop loses them today (issue 38, finding 2), which the simulator does not
    /// cover up by stopping while they wait.
    pub(super) fn settle_fleet(&mut self) {
        while self.fleet.is_some() {
            while self.fleet.as_mut().is_some_and(|f| f.link.all_jobs()) {}
            self.deliver_reports();
            let f = self.fleet_mut();
            if f.link.missed_ends() > 0 {
                f.link_up();
                self.fleet_beat();
            } else if !f.link.has_jobs() && f.reports.lock().unwrap().is_empty() {
                return;
            }
        }
    }

    fn fleet_mut(&mut self) -> &mut FleetSim {
        self.fleet.as_mut().expect("a fleet seed")
    }

    /// What the fleet threads told, handed to the daemon in order.
    fn deliver_reports(&mut self) {
        loop {
            let next = self
                .fleet
                .as_ref()
                .and_then(|f| f.reports.lock().unwrap().pop_front());
            let Some(report) = next else { return };
            self.send(Msg::Fleet(report));
        }
    }

    /// One heartbeat of this host's link (a registration if it has no generation) and
    /// of the peer unless it is silent, at the simulator's time. The link carries out
    /// what it was sent first: whole seconds do not go by with claims unanswered.
    pub(super) fn fleet_beat(&mut self) {
        let now = self.now;
        let f = self.fleet_mut();
        f.clock.store(now, Ordering::Relaxed);
        f.link.all_jobs();
        f.link.told();
        f.link.beat();
        if !f.peer.silent {
            let mut s = f.store.clone();
            match s.heartbeat(PEER, f.peer.gen, "{}") {
                Ok(true) => {
                    let _ = s.declare_dead(PEER, LAPSE_MS as i64);
                }
                // Declared dead while silent: it comes back as a new generation, and
                // what it held is gone.
                _ => {
                    f.peer.gen = s.register(&host(PEER)).expect("peer registers").0;
                    f.peer.holds = None;
                }
            }
        }
        self.deliver_reports();
        self.check_mirror();
    }

    /// One fleet event, picked at random.
    pub(super) fn fleet_step(&mut self) -> String {
        let now = self.now;
        self.fleet_mut().clock.store(now, Ordering::Relaxed);
        let cut = self.fleet_mut().down.load(Ordering::Relaxed);
        let line = match self.rng.range(0, 10) {
            // Now and then the whole host pauses past the lapse (issue 38 Build 6).
            10 if !cut => self.pause(),
            // A cut link comes back within a few fleet steps.
            0..=3 if cut => {
                self.fleet_mut().link_up();
                "fleet: link back".into()
            }
            0..=3 => {
                // One batch of a few (issue 38 Build 1: what gathered since the last).
                let n = self.rng.range(1, 4) as usize;
                let done = self.fleet_mut().link.jobs(n);
                self.deliver_reports();
                format!("fleet: a batch of {done} jobs carried out")
            }
            4 | 5 => {
                self.fleet_beat();
                "fleet: heartbeat".into()
            }
            6 | 7 => self.peer_turn(),
            // The fleet's tokens or drain change (issue 38 Build 3).
            8 => self.shared_turn(),
            // Cut now and then; back soon (outages are short next to the workload).
            _ if cut => {
                self.fleet_mut().down.store(false, Ordering::Relaxed);
                "fleet: link back".into()
            }
            // Or the server restarts (issue 38 Build 6): after committing the next
            // call of this host, whose answer is lost; a restart that aborts the call
            // in flight is a cut link.
            _ if self.rng.chance(0.5) => {
                self.fleet_mut().restart.store(true, Ordering::Relaxed);
                "fleet: the server restarts after the next call".into()
            }
            _ => {
                self.fleet_mut().down.store(true, Ordering::Relaxed);
                "fleet: link cut".into()
            }
        };
        line
    }

    /// Issue 38 Build 6: this host pauses (SIGSTOP: no tick, no heartbeat, no job)
    /// past the lapse while the peer beats on, declares it dead and takes the key its
    /// runs held; then it resumes, looking at the clock before its fleet thread beats,
    /// or after (either may run first). `check_fleet` then finds no run of this host
    /// granted with a fleet-wide claim but one its own fence is stopping.
    fn pause(&mut self) -> String {
        let ms = LAPSE_MS + self.rng.range(1, 10) * BEAT_MS;
        let end = self.now + ms;
        let mut declared = Vec::new();
        while self.now < end {
            self.now = end.min(self.now + BEAT_MS);
            let now = self.now;
            let f = self.fleet_mut();
            f.clock.store(now, Ordering::Relaxed);
            if f.peer.silent {
                continue;
            }
            let mut s = f.store.clone();
            if let Ok(true) = s.heartbeat(PEER, f.peer.gen, "{}") {
                declared.extend(s.declare_dead(PEER, LAPSE_MS as i64).unwrap_or_default());
            }
        }
        let peer = &self.fleet_mut().peer;
        let took = match (peer.silent, peer.holds.is_some()) {
            (true, _) => "silent".to_string(),
            (_, true) => "already held".to_string(),
            _ => self.peer_claims(),
        };
        let beat_first = self.rng.chance(0.5);
        if beat_first {
            self.fleet_beat();
        }
        self.tick();
        if !beat_first {
            self.fleet_beat();
        }
        format!(
            "fleet: paused {ms}ms, declared {declared:?}, peer {took}, beat first: {beat_first}"
        )
    }

    /// The peer claims the key for a new run of its own.
    fn peer_claims(&mut self) -> String {
        let f = self.fleet_mut();
        let mut s = f.store.clone();
        f.peer.runs += 1;
        let run_id = format!("peer-{}", f.peer.runs);
        let c = Claim {
            run_id: run_id.clone(),
            host_id: PEER.into(),
            gen: f.peer.gen,
            token: None,
            keys: vec![KEY.into()],
        };
        let got = s.claim(&c);
        let line = format!("claim {KEY} -> {got:?}");
        if let Ok(ClaimOutcome::Taken { fence }) = got {
            f.peer.holds = Some((run_id, fence));
        }
        line
    }

    /// The peer takes the key (if it can), lets it go, or falls silent or speaks again.
    fn peer_turn(&mut self) -> String {
        let roll = self.rng.range(0, 3);
        let f = self.fleet_mut();
        let mut s = f.store.clone();
        match (roll, f.peer.holds.take()) {
            // Cut off: it can only come back.
            _ if f.peer.silent => {
                f.peer.silent = false;
                let fenced = f.peer.fenced.take();
                let ended = fenced.map(|r| s.end(&r, PEER, f.peer.gen, Ending::Released));
                format!("peer: beats, its fenced run's claim ended: {ended:?}")
            }
            (0 | 1, None) => format!("peer: {}", self.peer_claims()),
            (0 | 1, Some((run_id, fence))) => {
                let ended = s.end(&run_id, PEER, f.peer.gen, Ending::Released);
                // A release wakes the key's waiters (F3), as the store's NOTIFY does;
                // not while this host's link is down (its listener is away too, and
                // its waiters' claims are sent again at the recheck).
                if !f.down.load(Ordering::Relaxed) {
                    let wake = Report::Wake {
                        payloads: vec![format!("key {KEY}")],
                    };
                    f.reports.lock().unwrap().push_back(wake);
                }
                self.deliver_reports();
                format!("peer: end {run_id} f{fence} -> {ended:?}")
            }
            // It falls silent (cut off from the store). A sound host stops its own run
            // before the lapse at which it may be declared dead (F2), so from now on it
            // holds nothing, while the store keeps its claim until someone declares it.
            (_, held) => {
                f.peer.silent = true;
                f.peer.fenced = held.as_ref().map(|(r, _)| r.clone());
                let line = format!("peer: silent, its run {held:?} stopped by its own fence");
                line
            }
        }
    }

    /// B3 in fleet mode: the owner's lapsed token freed in the fleet store, through
    /// this host's link (refused while it is cut). Nothing to do outside fleet seeds.
    pub(super) fn reconcile_fleet(&mut self, owner: &str) -> Result<(), FleetError> {
        let Some(f) = self.fleet.as_ref() else {
            return Ok(());
        };
        f.reach().reconcile("sim", owner).map(|_| ())
    }

    /// A granted run here holds the fence the store holds for it, on this host; the key
    /// is never held by a granted run here and by the peer at once.
    pub(super) fn check_fleet(&mut self) -> Result<(), String> {
        let Some(f) = self.fleet.as_ref() else {
            return Ok(());
        };
        let d = self.daemon.as_ref().expect("started");
        let mut s = f.store.clone();
        let mut key_holders = Vec::new();
        for id in d.extras.keys() {
            let Some(v) = d
                .engine
                .view_of(id)
                .filter(|v| v.state == RunState::Granted)
            else {
                continue;
            };
            let wide = d.engine.fleet_needs(id).is_some_and(|n| !n.keys.is_empty());
            // Its own fence is stopping it (after a pause past the lapse, its claim
            // may be gone and the key another's: `berth run`'s own fence, issue 38
            // item 3, stopped CMD by then; the simulator does not model that side).
            if d.fleet.fenced(id) {
                continue;
            }
            let row = s.fence(id).map_err(|e| format!("fleet store: {e}"))?;
            match row {
                Some(r) if r.host_id == HOST && Some(r.fence) == v.fence => {}
                // Declared dead: the run keeps no fleet-wide claim, so it may go on
                // only if it holds no key (the self-fence stopped those first).
                None if !wide => {}
                other => {
                    return Err(format!(
                        "granted {id} f{:?}, the fleet store has {other:?}",
                        v.fence
                    ))
                }
            }
            if wide {
                key_holders.push(id.clone());
            }
        }
        if let Some((peer_run, _)) = &f.peer.holds {
            key_holders.push(peer_run.clone());
        }
        if key_holders.len() > 1 {
            return Err(format!("key {KEY} held at once by {key_holders:?}"));
        }
        Ok(())
    }

    /// At the end: the link carried out everything, the store answers, and no claim
    /// of this host is left for a run that ended.
    pub(super) fn drain_fleet(&mut self) {
        if self.fleet.is_none() {
            return;
        }
        self.fleet_beat();
        self.settle_fleet();
        let mut s = self.fleet_mut().store.clone();
        let d = self.daemon.as_ref().expect("started");
        for id in (0..super::RUN_IDS_MAX).map(|n| format!("r{n}")) {
            let row = s.fence(&id).unwrap();
            let ended = d.engine.view_of(&id).is_none_or(|v| v.state.is_terminal());
            if ended && row.as_ref().is_some_and(|r| r.host_id == HOST) {
                let trace = self.trace.join("\n");
                panic!("{id} ended, its fleet claim is left: {row:?}\ntrace:\n{trace}");
            }
        }
    }
}

/// The link carries the one job waiting (the acquire's claim) as a batch, the daemon
/// takes the report, and the acquire's answer is there (`what` says why it must be).
fn after_one_batch(
    sim: &mut Sim,
    mut answer: tokio::sync::oneshot::Receiver<Result<RunInfo, Error>>,
    what: &str,
) -> Result<RunInfo, Error> {
    assert_eq!(sim.fleet_mut().link.jobs(1), 1);
    sim.deliver_reports();
    answer.try_recv().expect(what)
}

/// A new run `x` asking for the fleet-wide key: its answer, which waits for its claim
/// (issue 38 Build 2: the connection stays open).
fn acquire_with_the_key(sim: &mut Sim) -> tokio::sync::oneshot::Receiver<Result<RunInfo, Error>> {
    let req = berth_core::Request {
        run_id: "x".into(),
        project: "x".into(),
        class: berth_core::Class::Managed,
        priority: berth_core::Priority::Foreground,
        resources: berth_core::Resources {
            slots: 1,
            ..Default::default()
        },
        singletons: vec![format!("{}{KEY}", berth_core::FLEET_SINGLETON_PREFIX)],
        contract: None,
        ttl_ms: 600_000,
        wait_ms: 60_000,
        budget: None,
    };
    let (reply, answer) = tokio::sync::oneshot::channel();
    sim.send(Msg::Acquire {
        req,
        worktree: None,
        labels: Default::default(),
        stop_grace_ms: None,
        ports: Vec::new(),
        attach: false,
        detach: true,
        thread: None,
        lease_only: false,
        by: None,
        reply,
    });
    answer
}

/// A run `x` holding the fleet-wide key, granted on its claim; its fence.
fn granted_with_the_key(sim: &mut Sim) -> u64 {
    let mut answer = acquire_with_the_key(sim);
    assert!(answer.try_recv().is_err(), "answered before its claim");
    sim.settle_fleet();
    let granted = answer
        .try_recv()
        .expect("answered once its claim came back");
    assert_eq!(granted.map(|i| i.view.state), Ok(RunState::Granted));
    sim.d().engine.fence_of("x").expect("granted on its claim")
}

/// Regression (issue 35, found by this simulator): a run that ended after its host
/// restarted and before the host could register with the fleet store again kept its
/// fleet-wide claim for good (the daemon had no record that it held one): its key
/// was never freed. A registration that keeps the host's claims now ends those whose
/// runs ended here.
#[test]
fn a_run_ended_before_its_host_registered_again_ends_its_fleet_claim() {
    let mut sim = Sim::new(FLEET_SEED);
    let fence = granted_with_the_key(&mut sim);
    let mut store = sim.fleet_mut().store.clone();
    assert_eq!(store.fence("x").unwrap().map(|f| f.fence), Some(fence));
    // A restart while the store cannot be reached; the run ends before the host is
    // registered again.
    sim.fleet_mut().down.store(true, Ordering::Relaxed);
    sim.stop();
    sim.start();
    let release = berth_core::Command::Release {
        run_id: "x".into(),
        fence,
    };
    let ended = sim.ask(|reply| Msg::Command {
        cmd: release,
        by: None,
        reply,
    });
    assert_eq!(ended.map(|i| i.view.state), Ok(RunState::Released));
    no_claim_of_x_once_settled(&mut sim, "the ended run's claim is left");
}

/// The link back, a heartbeat, and everything the link holds carried out: no claim of
/// `x` is left in the store.
fn no_claim_of_x_once_settled(sim: &mut Sim, why: &str) {
    sim.fleet_mut().link_up();
    sim.fleet_beat();
    sim.settle_fleet();
    let mut store = sim.fleet_mut().store.clone();
    assert_eq!(store.fence("x").unwrap(), None, "{why}");
}

/// Issue 38 Build 6 (found by the simulator's pause): a host paused past the lapse,
/// declared dead meanwhile and its key taken by the peer, heard so at its first
/// heartbeat after (the store answered that its generation is gone), and its run
/// holding the key went on: the self-fence looks only at a live generation, and the
/// registration that stops such runs came a heartbeat later, or never while the store
/// could not be reached again. It stops them as soon as it hears.
#[test]
fn regression_a_host_told_it_was_declared_dead_stops_its_key_holders_at_once() {
    let mut sim = Sim::new(FLEET_SEED);
    granted_with_the_key(&mut sim);
    // Paused past the lapse: the peer beats, declares this host dead, takes the key.
    sim.now += LAPSE_MS + 2 * BEAT_MS;
    let now = sim.now;
    let f = sim.fleet_mut();
    f.clock.store(now, Ordering::Relaxed);
    let mut s = f.store.clone();
    assert!(s.heartbeat(PEER, f.peer.gen, "{}").unwrap());
    let declared = s.declare_dead(PEER, LAPSE_MS as i64).unwrap();
    assert_eq!(declared.len(), 1, "{declared:?}");
    assert!(matches!(sim.peer_claims().as_str(), l if l.contains("Taken")));
    // It resumes: its heartbeat is answered "declared dead", then the link is cut
    // before it can register again.
    sim.fleet_mut().link.beat();
    sim.fleet_mut().down.store(true, Ordering::Relaxed);
    sim.deliver_reports();
    sim.tick();
    let state = sim.d().engine.view_of("x").map(|v| v.state);
    assert_ne!(
        state,
        Some(RunState::Granted),
        "x still holds the key the peer took"
    );
}

/// Issue 38 Build 6: the store's server commits a new run's claim and restarts before
/// answering. The caller is told 503 and may never ask again, so the claim goes back
/// once the store is reached again; kept, it held the key for a run nobody had (the
/// PostgreSQL restart test found it first; with that fix taken out, the simulator's
/// restarts now find it too, at seed 7 of the default run).
#[test]
fn regression_a_claim_a_restarting_server_committed_without_answering_goes_back() {
    let mut sim = Sim::new(FLEET_SEED);
    let answer = acquire_with_the_key(&mut sim);
    sim.fleet_mut().restart.store(true, Ordering::Relaxed);
    let refused = after_one_batch(&mut sim, answer, "answered once the answer was lost");
    assert!(
        matches!(refused, Err(Error::FleetUnavailable)),
        "{refused:?}"
    );
    let mut store = sim.fleet_mut().store.clone();
    assert!(
        store.fence("x").unwrap().is_some(),
        "the server committed it"
    );
    no_claim_of_x_once_settled(&mut sim, "the key is held for a run nobody has");
}

/// Issue 38 Build 3: evidence invalidations told while the store is away are taken once
/// it is back, at most `INVALIDATIONS_PER_BEAT_MAX` a heartbeat (each is a round trip on
/// the heartbeat's thread). Lost, as they were, the other hosts kept promoting projects
/// a run here had shown are not parallel-safe.
#[test]
fn regression_an_invalidation_the_store_missed_is_taken_when_it_is_back() {
    const PROJECTS: usize = 20;
    let mut sim = Sim::new(FLEET_SEED);
    let mut store = sim.fleet_mut().store.clone();
    for p in 0..PROJECTS {
        let proven = FleetEvidence {
            project: format!("p{p}"),
            fingerprint: "f".into(),
            commit: Some("c1".into()),
            ports: Vec::new(),
            run_id: "r".into(),
            host_id: PEER.into(),
            valid: true,
        };
        store.put_evidence(&proven).unwrap();
    }
    let valid = |store: &mut MemFleet| {
        let shared = store.shared(-1).unwrap().expect("a version");
        shared.evidence.iter().filter(|e| e.valid).count()
    };
    let link = sim.d().fleet.link.clone().expect("a fleet host");
    sim.fleet_mut().down.store(true, Ordering::Relaxed);
    for p in 0..PROJECTS {
        link.share(crate::fleet::SharedJob::InvalidateEvidence {
            project: format!("p{p}"),
            fingerprint: "f".into(),
            commit: Some("c1".into()),
        });
    }
    sim.fleet_mut().link.told();
    sim.fleet_beat();
    assert_eq!(
        valid(&mut store),
        PROJECTS,
        "taken while the store was away"
    );
    sim.fleet_mut().link_up();
    sim.fleet_beat();
    let per_beat = crate::fleet::INVALIDATIONS_PER_BEAT_MAX;
    assert_eq!(valid(&mut store), PROJECTS - per_beat, "one beat's worth");
    sim.fleet_beat();
    assert_eq!(
        valid(&mut store),
        0,
        "the missed invalidations were not all taken"
    );
}

/// Issue 38 Build 3: a fleet drain is decided by the store. A host that has not read a
/// drain another host started (its notification not come yet) admitted a new run in
/// those milliseconds; the store now refuses its claim, and the run is refused as a new
/// run is while the host drains.
#[test]
fn regression_a_host_that_has_not_read_the_fleet_drain_admits_no_new_run() {
    let mut sim = Sim::new(FLEET_SEED);
    let drain = berth_store::fleet::FleetDrain {
        by: "op".into(),
        at: "2026-12-05T17:00:00Z".into(),
        reason: "upgrade".into(),
        host_id: PEER.into(),
    };
    let mut store = sim.fleet_mut().store.clone();
    store.set_drain(Some(&drain)).unwrap();
    let answer = acquire_with_the_key(&mut sim);
    let refused = after_one_batch(&mut sim, answer, "answered once its claim came back");
    assert!(
        matches!(refused, Err(Error::Draining { .. })),
        "{refused:?}"
    );
    assert_eq!(store.fence("x").unwrap(), None);
}
