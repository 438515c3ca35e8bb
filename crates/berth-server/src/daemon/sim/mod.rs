//! The daemon-level simulator: the whole [`Daemon`] (engine, extras, waiters, stops,
//! cleanup retries, restore) driven by a seeded workload over a fake machine that fails
//! workspace creation and removal on demand, stops processes only when the simulator
//! says so (with survivors or an unverified look, sometimes), and survives restarts and
//! crashes of the daemon. The ledger is [`MemStore`], the in-memory store that passes
//! the same conformance suite as SQLite, so a restart is a real restore.
//!
//! A crash (issue 35) cuts a step's effects after a random number of them: the commits
//! before the cut are durable and answered, the rest never happen and their callers
//! are told nothing, while what the daemon did to the machine before its commits (a
//! workspace made at a grant, one removed at an end) stays done. The start after it must
//! reconcile the two: no workspace left that no run owns, no granted run without one.
//!
//! After every step the daemon's invariants are checked against the machine (no
//! granted run without its workspace, no ended run with a workspace or a living
//! process, nothing left behind by a forgotten run, every degraded run due a retry);
//! after a clean restart every run must be back as it was; at the end, with failures
//! switched off and time run forward, nothing may be left at all. The journal (D5) is
//! followed as a reader would: gap-free across restarts and crashes, everything
//! numbered published once its step is durable, and agreeing with every run the daemon
//! knows (its fence is the one its `granted` entry names; it has an `ended` entry with
//! its state exactly when it has ended). Each seed runs twice and the two traces must
//! be equal.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use berth_core::{Class, Command, Priority, Request, Resources, RunState};
use berth_proc::StopReport;
use berth_sim::Rng;
use berth_store::MemStore;

use super::{Daemon, Error, Msg, Restore, RunInfo};

mod fleet;
mod host;
mod journal;
mod msgs;
mod shared;

use host::{Machine, SimHost, FAILURE_STEPS_MAX};
use journal::JournalModel;

/// Run ids the workload picks from: few, so runs collide, re-acquire and queue.
const RUN_IDS_MAX: u64 = 16;
/// Steps per seed in the default test run.
const STEPS: usize = 300;
/// Every this many seeds one runs in fleet mode (`sim/fleet.rs`).
const FLEET_SEED_EVERY: u64 = 4;
/// Seeds in the default test run (`BERTH_DAEMON_SIM_SEEDS` runs more), ~5 s on the
/// in-memory ledger: enough that a daemon cancelling a detached waiter when a client
/// that attached to it leaves is caught (first by seed 24..40), and that the crash
/// bugs of issue 35 were (the first of them by seed 0, the last by seed 652 of the
/// workload that found it; runs of 1,000 seeds pass).
const SEEDS: u64 = 128;
/// The ports runs are given from: small, so that they run out.
const PORT_RANGE: (u16, u16) = (30_000, 30_005);

struct Sim {
    /// The ledger: in memory, and it outlives the daemon (a clone is the same ledger).
    store: MemStore,
    machine: Arc<Mutex<Machine>>,
    daemon: Option<Daemon<SimHost>>,
    /// The daemon's shell: carries out each step's effects against the real ledger.
    shell: Option<super::Shell>,
    now: u64,
    rng: Rng,
    trace: Vec<String>,
    /// Steps until which workspace creation, and removal, fail.
    fail_until: (usize, usize),
    step: usize,
    journal: JournalModel,
    /// The connections of attached waiters that are still open, one entry per
    /// attachment (a run re-posted while it waits has two): what `leave` closes. A
    /// restart closes them all.
    attachments: Vec<String>,
    /// Each queued detached waiter at the last step, and the run this step cancelled
    /// on purpose (`cancel`): a detached waiter leaves the queue only by a grant, its
    /// deadline or an explicit cancel, never because a client left or a restart
    /// happened (A9 refined, P5).
    detached_queued: BTreeSet<String>,
    cancelled: Option<String>,
    /// The `Msg` variants sent so far (`Msg::NAMES` says which there are).
    sent: BTreeSet<&'static str>,
    /// The daemon crashes in the middle of the next effects carried out: after a
    /// random number of them (issue 35).
    crash_due: bool,
    /// Where this step's crash cut its effects (`k of n`): answers after the cut are
    /// lost, and so are the connections of attached waiters.
    crashed: Option<String>,
    /// Fleet mode (every fourth seed): the fleet store, this host's link and the peer.
    fleet: Option<fleet::FleetSim>,
    /// Fleet seeds: acquires of new runs whose answer waits for their claim (issue 38
    /// Build 2), with whether their client stays attached: answered in a later step.
    awaiting: Vec<Awaiting>,
}

/// An acquire's connection waiting for its answer: the run, whether it attaches if it
/// has to wait, and the answer's channel.
type Awaiting = (
    String,
    bool,
    tokio::sync::oneshot::Receiver<Result<RunInfo, Error>>,
);

fn config(fleet: bool) -> berth_core::Config {
    let mut cfg = berth_core::Config::for_host(4, 8 << 30, 100 << 30);
    // F1: every grant waits for its fleet-wide claim.
    cfg.fleet = fleet;
    // W3: a range of six ports, so runs wait for ports too.
    cfg.named = vec![(
        "ports".into(),
        PORT_RANGE.1 as u64 - PORT_RANGE.0 as u64 + 1,
    )];
    // Small, so that forgetting ended runs (and their extras) happens in a run.
    cfg.ended_retained_max = 6;
    cfg
}

impl Sim {
    fn new(seed: u64) -> Sim {
        let mut sim = Sim {
            store: MemStore::default(),
            machine: Arc::default(),
            daemon: None,
            shell: None,
            // Not zero: times in the ledger are monotonic milliseconds of a real boot.
            now: 1_000_000,
            rng: Rng::new(seed),
            trace: Vec::new(),
            fail_until: (0, 0),
            step: 0,
            journal: JournalModel::new(),
            attachments: Vec::new(),
            detached_queued: BTreeSet::new(),
            cancelled: None,
            sent: BTreeSet::new(),
            crash_due: false,
            crashed: None,
            fleet: (seed % FLEET_SEED_EVERY == FLEET_SEED_EVERY - 1)
                .then(|| fleet::FleetSim::new(1_000_000)),
            awaiting: Vec::new(),
        };
        sim.start();
        sim
    }

    fn d(&mut self) -> &mut Daemon<SimHost> {
        self.daemon.as_mut().expect("started")
    }

    /// Starts (or restarts) the daemon from the ledger, and joins the fleet.
    fn start(&mut self) {
        self.restore();
        self.join_fleet();
    }

    /// Starts the daemon from the ledger, before it joins the fleet.
    fn restore(&mut self) {
        let store = self.store.clone();
        let how = Restore {
            cfg: config(self.fleet.is_some()),
            same_boot: true,
            reconnect_window_ms: 30_000,
            port_range: PORT_RANGE,
            threads: Default::default(),
        };
        let host = SimHost(self.machine.clone());
        let (d, shell) = Daemon::start_for_test(self.now, how, Box::new(store), "http://sim", host);
        self.daemon = Some(d);
        self.shell = Some(shell);
    }

    /// One message, its effects carried out and durable.
    fn send(&mut self, msg: Msg) {
        self.sent.insert(msg.name());
        let now = self.now;
        let fx = self.d().handle(now, msg);
        self.carry_out(fx);
    }

    /// A tick at the simulator's time, its effects carried out and durable. Now and
    /// then the host's memory pressure is sampled too (issue 36): spikes that hold
    /// waiters back for a while.
    fn tick(&mut self) {
        let now = self.now;
        let memory_pressure_bp = self.rng.chance(0.05).then(|| {
            let spike = self.rng.chance(0.5);
            if spike {
                self.rng.range(0, 3_000) as u32
            } else {
                0
            }
        });
        // And now and then the workspaces' free disk: mostly plenty, at times scarce
        // (runs' disk claims then wait with host.disk_pressure).
        let disk_free = self.rng.chance(0.05).then(|| {
            let scarce = self.rng.chance(0.5);
            if scarce {
                self.rng.range(0, 20 << 30)
            } else {
                1 << 44
            }
        });
        let sample = super::Sample {
            mem_available: None,
            pressure_bp: [memory_pressure_bp, None, None],
            disk_free,
        };
        let fx = self.d().tick(now, Some(sample));
        self.carry_out(fx);
    }

    /// Carries out a step's effects and waits until they are durable; with a crash
    /// due, only the first k of them (k drawn from 0..=n), and then the daemon dies.
    fn carry_out(&mut self, mut fx: super::Effects) {
        let n = fx.0.len();
        let cut = std::mem::take(&mut self.crash_due).then(|| self.rng.range(0, n as u64));
        if let Some(k) = cut {
            fx.0.truncate(k as usize);
        }
        let shell = self.shell.as_ref().expect("started");
        // Nothing to carry out, nothing to wait for (most ticks).
        if !fx.0.is_empty() {
            shell.carry_out(fx);
            shell.flush();
        }
        if let Some(k) = cut {
            self.crashed = Some(format!("{k} of {n}"));
            self.crash();
        }
    }

    /// The daemon dies: the commits carried out are durable, everything after them is
    /// lost (its machine effects, made before the commits, are not), and it starts
    /// again from its ledger. Stops in flight and clients' connections die with it.
    fn crash(&mut self) {
        let shell = self.shell.take().expect("started");
        shell.crash(self.daemon.take().expect("started"));
        self.machine.lock().unwrap().orders.clear();
        self.attachments.clear();
        self.awaiting.clear();
        self.start();
    }

    /// One of the workload's steps with a crash somewhere in its effects (a step that
    /// had none to carry out crashes at its end).
    fn crash_during(&mut self) -> String {
        self.crash_due = true;
        let line = match self.rng.range(0, 5) {
            0 => self.acquire(),
            1 => self.release(),
            2 => self.renew(),
            3 => self.register(),
            4 => self.deliver_stop(),
            _ => self.pass_time(),
        };
        if std::mem::take(&mut self.crash_due) {
            self.crashed = Some("at the end".into());
            self.crash();
        }
        let at = self.crashed.take().unwrap_or_default();
        format!("{line} [crash after {at}]")
    }

    /// The daemon stops: its shell closes the ledger, then the daemon ends.
    fn stop(&mut self) {
        let shell = self.shell.take().expect("started");
        shell.close(self.daemon.take().expect("started"));
    }

    /// Sends one message and returns its answer, once durable.
    fn ask<T>(&mut self, make: impl FnOnce(super::Reply<T>) -> Msg) -> Result<T, Error> {
        let (tx, mut rx) = tokio::sync::oneshot::channel();
        self.send(make(tx));
        match rx.try_recv() {
            Ok(answer) => answer,
            // Its commit was cut by a crash: the client's connection died unanswered.
            Err(_) if self.crashed.is_some() => Err(Error::ShuttingDown),
            // F1: a `wait_s = 0` acquire waits for its fleet-wide claim; its answer
            // comes once the link carries the claim out (the trace says so).
            Err(_) if self.fleet.is_some() => Err(Error::FleetUnavailable),
            Err(e) => panic!("not answered once durable: {e}"),
        }
    }

    /// Fleet seeds: the acquires answered since the last step (their claims came
    /// back), for the trace; an attached one that has to wait holds its place from now.
    fn answers(&mut self) -> String {
        let mut line = String::new();
        let mut still = Vec::new();
        for (id, attach, mut rx) in std::mem::take(&mut self.awaiting) {
            let res = match rx.try_recv() {
                Err(tokio::sync::oneshot::error::TryRecvError::Empty) => {
                    still.push((id, attach, rx));
                    continue;
                }
                Ok(res) => res,
                Err(_) => Err(Error::ShuttingDown),
            };
            if attach && matches!(&res, Ok(i) if i.view.state == RunState::Queued) {
                self.attachments.push(id.clone());
            }
            line.push_str(&format!("; answered acquire {id} -> {}", outcome(&res)));
        }
        self.awaiting = still;
        line
    }

    fn pick_run(&mut self) -> String {
        format!("r{}", self.rng.range(0, RUN_IDS_MAX - 1))
    }

    /// Mostly a granted run (in id order, so the pick repeats), else any id.
    fn pick_granted(&mut self) -> String {
        let d = self.daemon.as_ref().expect("started");
        let mut granted: Vec<&String> = d
            .extras
            .keys()
            .filter(|id| {
                d.engine
                    .view_of(id)
                    .is_some_and(|v| v.state == RunState::Granted)
            })
            .collect();
        granted.sort();
        if granted.is_empty() || self.rng.chance(0.25) {
            return self.pick_run();
        }
        let id = self.rng.pick(&granted).to_string();
        id
    }

    /// The run's fence as the engine has it; sometimes an older one (a stale owner).
    fn fence_of(&mut self, run_id: &str) -> Option<u64> {
        let f = self.d().engine.view_of(run_id).and_then(|v| v.fence)?;
        Some(if self.rng.chance(0.15) {
            f.saturating_sub(1)
        } else {
            f
        })
    }

    fn step(&mut self, i: usize) {
        self.step = i;
        {
            let mut m = self.machine.lock().unwrap();
            m.fail_create = i < self.fail_until.0;
            m.fail_remove = i < self.fail_until.1;
        }
        self.cancelled = None;
        let fleet_turn = self.fleet.is_some() && self.rng.chance(0.25);
        let line = match self.rng.range(0, 118) {
            _ if fleet_turn => self.fleet_step(),
            0..=18 => self.acquire(),
            19..=23 => self.leave(),
            24..=31 => self.renew(),
            32..=43 => self.release(),
            44..=46 => self.cancel(),
            47..=56 => self.register(),
            57..=70 => self.deliver_stop(),
            71..=86 => self.pass_time(),
            87..=89 => self.reap(),
            90..=92 => self.restart(),
            93..=94 => self.reconcile(),
            95..=99 => self.inject_failure(),
            100..=103 => self.crash_during(),
            _ => self.other(),
        };
        let answered = self.answers();
        self.trace.push(format!("{i} {line}{answered}"));

        let checked = (self.check())
            .and_then(|()| self.check_detached())
            .and_then(|()| self.check_fleet());
        if let Err(e) = checked {
            panic!("step {i}: {e}\ntrace:\n{}", self.trace.join("\n"));
        }
    }

    /// A run's request follows from its id, so that asking again is the same request
    /// (L7) and only a forgotten id makes a new run.
    fn acquire(&mut self) -> String {
        let n = self.rng.range(0, RUN_IDS_MAX - 1);
        let id = format!("r{n}");
        // Some runs declare ports (W3): one, two or none, by id.
        let ports: Vec<String> = ["web", "api"][..(n % 3) as usize]
            .iter()
            .map(|p| p.to_string())
            .collect();
        let mut named = BTreeMap::new();
        if !ports.is_empty() {
            named.insert("ports".to_string(), ports.len() as u64);
        }
        let req = Request {
            run_id: id.clone(),
            project: format!("p{}", n % 4),
            class: Class::Managed,
            priority: Priority::Foreground,
            resources: Resources {
                slots: 1,
                cpu_millis: (n % 4 + 1) * 500,
                named,
                ..Default::default()
            },
            // F1: in fleet seeds some runs take the fleet-wide key the peer wants too.
            singletons: (self.fleet.is_some() && n % 4 == 3)
                .then(|| format!("{}{}", berth_core::FLEET_SINGLETON_PREFIX, fleet::KEY))
                .into_iter()
                .collect(),
            contract: None,
            ttl_ms: (n % 5 + 1) * 10_000,
            wait_ms: (n % 3) * 15_000,
            // Some runs carry an experiment budget (B1/B2): its token is part of the
            // claim, and it stays held (lapsed) when the lease expires.
            budget: (n % 5 < 2).then(|| {
                Box::new(berth_core::scopes::Budget {
                    scope: "sim".into(),
                    harness: ["a", "b"][(n % 2) as usize].into(),
                    operation_id: None,
                    per_harness: Some([("a".to_string(), 1), ("b".to_string(), 2)].into()),
                    manifest: None,
                    tenant: None,
                })
            }),
        };
        // A waiter is detached (some ids mostly, others now and then: a retry with
        // `detach` lets an attached waiter go) or held by its client's connection (a
        // client may also attach to a detached waiter, and leave it again).
        let detach =
            req.wait_ms > 0 && ((n % 4 == 1 && self.rng.chance(0.7)) || self.rng.chance(0.1));
        let attach = req.wait_ms > 0 && !detach;
        let (tx, mut rx) = tokio::sync::oneshot::channel();
        self.send(Msg::Acquire {
            req,
            worktree: None,
            labels: BTreeMap::new(),
            stop_grace_ms: None,
            ports,
            attach,
            detach,
            thread: None,
            lease_only: false,
            by: None,
            reply: tx,
        });
        let res = match rx.try_recv() {
            Ok(answer) => answer,
            Err(_) if self.crashed.is_some() => Err(Error::ShuttingDown),
            // Fleet seeds: a new run's answer waits for its claim; its connection
            // stays open for it (a later step's `answers`).
            Err(_) if self.fleet.is_some() => {
                self.awaiting.push((id.clone(), attach, rx));
                return format!("acquire {id} -> awaiting its claim");
            }
            Err(e) => panic!("not answered once durable: {e}"),
        };
        // The connection holds its place only if it had to wait (the guard is armed
        // only then).
        let waits = matches!(&res, Ok(i) if i.view.state == RunState::Queued);
        // A crash closed every connection, this one too.
        if attach && waits && self.crashed.is_none() {
            self.attachments.push(id.clone());
        }
        let how = if detach {
            " detached"
        } else if attach {
            " attached"
        } else {
            ""
        };
        format!("acquire{how} {id} -> {}", outcome(&res))
    }

    /// An attached waiter's client goes away (A9): the daemon hears `Detach`.
    fn leave(&mut self) -> String {
        if self.attachments.is_empty() {
            return self.pass_time();
        }
        let i = self.rng.range(0, self.attachments.len() as u64 - 1) as usize;
        let run_id = self.attachments.swap_remove(i);
        self.send(Msg::Detach {
            run_id: run_id.clone(),
        });
        format!("leave {run_id}")
    }

    /// A detached waiter that was queued a step ago is still queued, or granted, or
    /// ended otherwise than by being cancelled, unless this step cancelled it.
    fn check_detached(&mut self) -> Result<(), String> {
        let d = self.daemon.as_ref().expect("started");
        let state = |id: &str| d.engine.view_of(id).map(|v| v.state);
        // F1/F2: the fleet store's refusal for good (an owner's lapsed token), and a
        // host declared dead (a waiter must not be granted on a dead permit), cancel
        // too, and say so.
        let refused = |id: &str| {
            let failure = d.extras.get(id).and_then(|e| e.failure.as_deref());
            let fleet = [super::fleet::REFUSED_FOR_GOOD, super::fleet::FENCED_ITSELF];
            failure.is_some_and(|f| fleet.iter().any(|why| f.starts_with(why)))
        };
        for id in &self.detached_queued {
            let by_nobody = self.cancelled.as_ref() != Some(id) && !refused(id);
            if state(id) == Some(RunState::Cancelled) && by_nobody {
                return Err(format!("detached waiter {id} was cancelled by nobody"));
            }
        }
        self.detached_queued = d
            .extras
            .iter()
            .filter(|(id, e)| e.detached && state(id) == Some(RunState::Queued))
            .map(|(id, _)| id.clone())
            .collect();
        Ok(())
    }

    fn command(&mut self, what: &str, cmd: Command) -> String {
        let res = self.ask(|reply| Msg::Command {
            cmd,
            by: None,
            reply,
        });
        format!("{what} -> {}", outcome(&res))
    }

    fn renew(&mut self) -> String {
        let run_id = self.pick_granted();
        let fence = self.fence_of(&run_id);
        let ttl_ms = Some(self.rng.range(5, 60) * 1_000);
        let what = format!("renew {run_id} f{fence:?}");
        self.command(
            &what,
            Command::Renew {
                run_id,
                fence,
                ttl_ms,
            },
        )
    }

    fn release(&mut self) -> String {
        let run_id = self.pick_granted();
        let fence = self.fence_of(&run_id).unwrap_or(0);
        let what = format!("release {run_id} f{fence}");
        self.command(&what, Command::Release { run_id, fence })
    }

    fn cancel(&mut self) -> String {
        let run_id = self.pick_run();
        let what = format!("cancel {run_id}");
        self.cancelled = Some(run_id.clone());
        self.command(&what, Command::Cancel { run_id })
    }

    /// A run's client starts a process and registers it; sometimes it names another
    /// run's process instead.
    fn register(&mut self) -> String {
        let run_id = self.pick_granted();
        let fence = self.fence_of(&run_id).unwrap_or(0);
        let (pid, new) = {
            let mut m = self.machine.lock().unwrap();
            let theirs = m.alive.keys().next().copied();
            match theirs {
                Some(p) if self.rng.chance(0.2) => (p, false),
                _ => {
                    m.next_pid += 1;
                    let pid = 100 + m.next_pid;
                    m.alive.insert(pid, run_id.clone());
                    (pid, true)
                }
            }
        };
        let res = self.ask(|reply| Msg::RegisterProcess {
            run_id: run_id.clone(),
            fence,
            pid,
            uid: 1000,
            by: None,
            checked: None,
            reply,
        });
        if res.is_err() && new {
            // A process berth refused to record is the client's to end; it does.
            self.machine.lock().unwrap().alive.remove(&pid);
        }
        format!("register {run_id} f{fence} pid {pid} -> {}", outcome(&res))
    }

    /// The stopper finishes the oldest stop: proven gone, survivors, or could not look.
    fn deliver_stop(&mut self) -> String {
        let order = {
            let mut m = self.machine.lock().unwrap();
            if m.orders.is_empty() {
                return "stop: none pending".into();
            }
            m.orders.remove(0)
        };
        let roll = self.rng.range(0, 9);
        let mut report = StopReport::default();
        let mut m = self.machine.lock().unwrap();
        for r in &order.roots {
            if m.alive.contains_key(&r.pid) {
                report.terminated += 1;
                if roll < 7 {
                    m.alive.remove(&r.pid);
                } else {
                    report.survivors.push(r.pid);
                }
            }
        }
        report.unverified = roll == 9;
        drop(m);
        let line = format!("stopped {} {report:?}", order.run_id);
        self.send(Msg::Stopped {
            run_id: order.run_id,
            report,
        });
        line
    }

    fn pass_time(&mut self) -> String {
        let ms = if self.rng.chance(0.1) {
            self.rng.range(60, 400) * 1_000
        } else {
            self.rng.range(1, 100) * 100
        };
        self.advance(ms);
        format!("tick +{ms}ms")
    }

    /// Time passes and the daemon ticks. In fleet mode, in steps no longer than a
    /// real daemon's ticks and heartbeats leave between them (F2's self-fence comes
    /// before the lapse only if the daemon looks in time).
    fn advance(&mut self, ms: u64) {
        if self.fleet.is_none() {
            self.now += ms;
            return self.tick();
        }
        let end = self.now + ms;
        while self.now < end {
            self.now = end.min(self.now + fleet::FLEET_TICK_MS_MAX);
            self.fleet_beat();
            self.tick();
        }
    }

    /// B3: an operator frees a lapsed owner's tokens (the only way besides the owner's
    /// release; a lapse alone never does).
    fn reconcile(&mut self) -> String {
        let lapsed: Vec<String> = self
            .d()
            .engine
            .scopes()
            .get("sim")
            .map(|s| {
                s.tokens
                    .iter()
                    .filter(|(_, t)| t.owner_lapsed)
                    .map(|((o, _), _)| o.clone())
                    .collect()
            })
            .unwrap_or_default();
        if lapsed.is_empty() {
            return "reconcile: no lapsed owner".into();
        }
        let owner = lapsed[self.rng.range(0, lapsed.len() as u64 - 1) as usize].clone();
        // In fleet mode the fleet store's token is freed first, as the API does
        // (`api::fleet::reconcile_fleet_wide`).
        if let Err(e) = self.reconcile_fleet(&owner) {
            return format!("reconcile {owner} -> {e}");
        }
        let op = super::ScopeOp::Reconcile {
            scope: "sim".into(),
            owner: owner.clone(),
            reason: "sim".into(),
            by: "sim".into(),
        };
        let res = self.ask(|reply| Msg::Scope { op, reply });
        format!(
            "reconcile {owner} -> {}",
            if res.is_ok() { "ok" } else { "refused" }
        )
    }

    fn reap(&mut self) -> String {
        let res = self.ask(|reply| Msg::Reap { reply });
        format!("reap -> {:?}", res.map(|(runs, _)| runs))
    }

    /// The daemon stops (cleanly: a crash loses nothing acknowledged either, and the
    /// crash tests cover it) and starts again from its ledger. Stops in flight die with
    /// it; their processes live on.
    fn restart(&mut self) -> String {
        self.settle_fleet();
        // What settling set off is judged by the daemon that did it (a waiter's
        // reason for being cancelled is not kept across a restart).
        if let Err(e) = self.check_detached() {
            self.wrong(format!("before a restart: {e}"));
        }
        let before = runs(self.d());
        let tokens_before = tokens(self.d());
        self.stop();
        self.machine.lock().unwrap().orders.clear();
        // Clients' connections die with the daemon.
        self.attachments.clear();
        self.awaiting.clear();
        // Judged as the ledger restored it: the registration that follows may end the
        // runs of a generation declared dead meanwhile (F2), as any registration does.
        self.restore();
        let after = runs(self.d());
        self.join_fleet();
        // Every live run comes back as it was; of the ended ones, the ledger may
        // return a different few of the newest (by end, not by forgetting order).
        let same = |a: &BTreeMap<String, RunRow>, b: &BTreeMap<String, RunRow>| {
            a.iter()
                .all(|(id, r)| b.get(id).map_or(r.0.is_terminal(), |s| s == r))
        };
        if !same(&before, &after) || !same(&after, &before) {
            panic!(
                "a restart changed the runs:\nbefore {before:?}\nafter  {after:?}\ntrace:\n{}",
                self.trace.join("\n")
            );
        }
        if tokens(self.d()) != tokens_before {
            panic!(
                "a restart changed the budget tokens:\nbefore {tokens_before:?}\nafter  {:?}\ntrace:\n{}",
                tokens(self.d()),
                self.trace.join("\n")
            );
        }
        format!("restart ({} runs)", after.len())
    }

    /// From the next step on, workspace creation or removal fails for a while.
    fn inject_failure(&mut self) -> String {
        let until = self.step + 1 + self.rng.range(1, FAILURE_STEPS_MAX) as usize;
        if self.rng.chance(0.5) {
            self.fail_until.0 = until;
            format!("workspace creation fails until step {until}")
        } else {
            self.fail_until.1 = until;
            format!("workspace removal fails until step {until}")
        }
    }

    /// The journal as a reader follows it, against the daemon.
    fn check_journal(&mut self) -> Result<(), String> {
        let d = self.daemon.as_ref().expect("started");
        self.journal.follow(&d.shared.journal)?;
        // Each step waited for its commit: everything numbered is durable and published.
        if d.journal_next != self.journal.seen + 1 {
            return Err(format!(
                "entries up to {} numbered, {} published",
                d.journal_next - 1,
                self.journal.seen
            ));
        }
        self.journal.agrees(&runs(d))?;
        // D5: the budget entries and the tokens never disagree.
        let held: BTreeSet<(String, String)> = tokens(d).into_keys().collect();
        if held != self.journal.tokens {
            return Err(format!(
                "tokens held {held:?}, the journal says {:?}",
                self.journal.tokens
            ));
        }
        Ok(())
    }

    /// The daemon against the machine, and against its journal.
    fn check(&mut self) -> Result<(), String> {
        let d = self.daemon.as_ref().expect("started");
        d.engine.check_invariants()?;
        self.check_journal()?;
        let d = self.daemon.as_ref().expect("started");
        let m = self.machine.lock().unwrap();
        let state = |id: &str| d.engine.view_of(id).map(|v| v.state);
        let live = |id: &str| {
            matches!(
                state(id),
                Some(RunState::Granted | RunState::Releasing | RunState::Degraded)
            )
        };
        for (id, ws) in &m.workspaces {
            // G0: a thread's workspace lives as long as the daemon keeps it.
            if let Some(key) = id.strip_prefix("thread/") {
                if d.th.ws.get(key) != Some(ws) {
                    return Err(format!("thread {key}'s workspace {ws:?} is left"));
                }
                continue;
            }
            if !live(id) {
                return Err(format!(
                    "{id} is {:?} but its workspace {ws:?} is left",
                    state(id)
                ));
            }
        }
        // L5: a run whose processes may still live keeps its claim.
        for (pid, id) in &m.alive {
            if !live(id) {
                return Err(format!(
                    "{id} is {:?} but its process {pid} lives",
                    state(id)
                ));
            }
        }
        for (id, e) in &d.extras {
            let v = d.engine.view_of(id);
            let granted = v.as_ref().is_some_and(|v| v.state == RunState::Granted);
            if granted && m.workspaces.get(id) != e.workspace.as_ref() {
                return Err(format!("granted {id} has no workspace of its own (W1)"));
            }
        }
        // W3: every live run holds its own ports, numbered once granted; the broker
        // holds nobody else's.
        let mut seen = BTreeMap::new();
        for (id, e) in &d.extras {
            for (name, p) in &e.ports {
                if state(id) == Some(RunState::Granted) && *p == 0 {
                    return Err(format!("granted {id} has no number for port {name}"));
                }
                if *p != 0 && live(id) {
                    if let Some(other) = seen.insert(*p, id.clone()) {
                        return Err(format!("port {p} is held by {other} and {id}"));
                    }
                    if d.ports.holder(*p) != Some(id.as_str()) {
                        return Err(format!("{id}'s port {p} is not held for it"));
                    }
                }
            }
        }
        for p in PORT_RANGE.0..=PORT_RANGE.1 {
            if let Some(h) = d.ports.holder(p) {
                if seen.get(&p) != Some(&h.to_string()) {
                    return Err(format!(
                        "port {p} is held for {h}, which is not live with it"
                    ));
                }
            }
        }
        for id in &d.stopping {
            if !matches!(state(id), Some(RunState::Releasing | RunState::Degraded)) {
                return Err(format!("{id} is being stopped but is {:?}", state(id)));
            }
        }
        for id in d.extras.keys() {
            let stuck = state(id) == Some(RunState::Degraded)
                && !d.stopping.contains(id)
                && !d.cleanup_retry.contains_key(id);
            if stuck {
                return Err(format!("degraded {id} is never retried"));
            }
        }
        Ok(())
    }

    /// Failures off, every stop succeeds, time runs on: nothing may be left.
    fn drain(&mut self) {
        self.fail_until = (0, 0);
        if self.d().th.drain.is_some() {
            let _ = self.ask(|reply| Msg::Drain { start: None, reply });
        }
        {
            let mut m = self.machine.lock().unwrap();
            m.fail_create = false;
            m.fail_remove = false;
        }
        if let Some(f) = self.fleet.as_mut() {
            f.link_up();
        }
        let calm = super::Sample {
            mem_available: None,
            pressure_bp: [Some(0); 3],
            disk_free: Some(1 << 44),
        };
        let now = self.now;
        let fx = self.d().tick(now, Some(calm));
        self.carry_out(fx);
        for round in 0..40 {
            while !self.machine.lock().unwrap().orders.is_empty() {
                let order = self.machine.lock().unwrap().orders.remove(0);
                let mut m = self.machine.lock().unwrap();
                for r in &order.roots {
                    m.alive.remove(&r.pid);
                }
                drop(m);
                let report = StopReport::default();
                let run_id = order.run_id;
                self.send(Msg::Stopped { run_id, report });
            }
            self.settle_fleet();
            self.advance(301_000);
            self.trace.push(format!("drain {round}"));
            self.check()
                .unwrap_or_else(|e| panic!("drain {round}: {e}"));
        }
        self.drain_fleet();
        let m = self.machine.lock().unwrap();
        let d = self.daemon.as_ref().unwrap();
        let left: Vec<_> = d
            .extras
            .keys()
            .filter(|id| d.engine.view_of(id).is_some_and(|v| !v.state.is_terminal()))
            .collect();
        assert!(left.is_empty(), "runs never ended: {left:?}");
        let left: Vec<&String> = m
            .workspaces
            .keys()
            .filter(|k| {
                !k.strip_prefix("thread/")
                    .is_some_and(|t| d.th.ws.contains_key(t))
            })
            .collect();
        assert!(left.is_empty(), "workspaces left: {left:?}");
        assert!(
            m.alive.is_empty(),
            "registered processes left: {:?}",
            m.alive
        );
    }
}

/// Every run the daemon knows, as (state, fence, workspace, processes).
/// State, fence, workspace inode, registered pids, detached.
type RunRow = (RunState, Option<u64>, Option<u64>, Vec<i32>, bool);

fn runs(d: &Daemon<SimHost>) -> BTreeMap<String, RunRow> {
    d.extras
        .iter()
        .filter_map(|(id, e)| {
            let v = d.engine.view_of(id)?;
            let pids = e.processes.iter().map(|p| p.pid).collect();
            let ws = e.workspace.as_ref().map(|w| w.ino);
            Some((id.clone(), (v.state, v.fence, ws, pids, e.detached)))
        })
        .collect()
}

/// A step's answer for the trace: the run's state and fence, or the refusal's code.
fn outcome(res: &Result<RunInfo, Error>) -> String {
    match res {
        Ok(i) => format!("ok {} {:?}", i.view.state.as_str(), i.view.fence),
        Err(Error::Core(e)) => e.code().to_string(),
        Err(e) => format!("{e:?}"),
    }
}

fn one_seed(seed: u64) -> Vec<String> {
    one_seed_sent(seed).0
}

/// A seed's trace, and the `Msg` variants it sent.
fn one_seed_sent(seed: u64) -> (Vec<String>, BTreeSet<&'static str>) {
    let mut sim = Sim::new(seed);
    for i in 0..STEPS {
        sim.step(i);
    }
    sim.drain();
    let mut trace = std::mem::take(&mut sim.trace);
    // The outcome of each step with the state it left, so a divergence shows where.
    let end = runs(sim.d());
    trace.push(format!("end {end:?}"));
    sim.stop();
    (trace, std::mem::take(&mut sim.sent))
}

#[test]
fn the_daemon_simulation_holds_its_invariants_and_repeats_exactly() {
    let _one = super::LOGGING_TESTS
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let seeds = std::env::var("BERTH_DAEMON_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(SEEDS);
    // Acquires granted at once (single-host seeds); fleet seeds' grants after their
    // claim came back (any step that answered a granted run holding a fence).
    // `BERTH_DAEMON_SIM_FROM=N` starts at seed N, to look at one that failed (the
    // every-message check below is then skipped).
    let first = std::env::var("BERTH_DAEMON_SIM_FROM")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let (mut granted, mut fleet_granted) = (0, 0);
    let mut sent = BTreeSet::new();
    for seed in first..seeds {
        // Which seed failed, whatever the failure (a step's check or a restore).
        let run = std::panic::catch_unwind(|| one_seed_sent(seed));
        let (a, sent_a) = run.unwrap_or_else(|e| {
            eprintln!("daemon sim: seed {seed} failed");
            std::panic::resume_unwind(e)
        });
        sent.extend(sent_a);
        let b = one_seed(seed);
        if let Some(i) = (0..a.len().min(b.len())).find(|&i| a[i] != b[i]) {
            panic!("seed {seed} diverged at line {i}:\n{}\n{}", a[i], b[i]);
        }
        assert_eq!(a.len(), b.len(), "seed {seed}");
        let step = |l: &&String| l.starts_with(|c: char| c.is_ascii_digit());
        if seed % FLEET_SEED_EVERY == FLEET_SEED_EVERY - 1 {
            let fenced = |l: &&String| l.contains("-> ok granted Some(");
            fleet_granted += a.iter().filter(step).filter(fenced).count();
            continue;
        }
        granted += (a.iter().filter(step))
            .filter(|l| l.contains("acquire") && l.contains("-> ok granted"))
            .count();
    }
    let fleet_seeds = (seeds - first) / FLEET_SEED_EVERY;
    eprintln!("daemon sim: {} seeds ({fleet_seeds} in fleet mode), {granted} acquires granted at once, {fleet_granted} answers of granted fleet runs", seeds - first);
    if std::env::var("BERTH_DAEMON_SIM_TRACE").is_ok() {
        eprintln!("{}", one_seed(0).join("\n"));
    }
    // Issue 35: every message the daemon takes is sent (a new `Msg` variant fails
    // here until the simulator sends it).
    let never: Vec<&str> = Msg::NAMES
        .iter()
        .copied()
        .filter(|n| !sent.contains(n))
        .collect();
    assert!(
        never.is_empty() || first > 0,
        "Msg variants the simulator never sent: {never:?}"
    );
    // The workload must reach the paths it is for, not only refusals.
    assert!(
        granted > (seeds - first - fleet_seeds) as usize * 10,
        "only {granted} acquires succeeded"
    );
    assert!(
        fleet_granted > fleet_seeds as usize * 5,
        "only {fleet_granted} answers of granted fleet runs"
    );
}

/// The budget tokens the daemon holds: (owner, operation) -> (harness, lapsed).
fn tokens(d: &Daemon<SimHost>) -> BTreeMap<(String, String), (String, bool)> {
    d.engine
        .scopes()
        .get("sim")
        .map_or_else(BTreeMap::new, |s| {
            s.tokens
                .iter()
                .map(|(k, t)| (k.clone(), (t.harness.clone(), t.owner_lapsed)))
                .collect()
        })
}
