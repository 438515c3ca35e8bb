//! Model-based property test: random command sequences drive both the engine and a
//! deliberately simple reference model (vectors and linear scans, no indexes, no
//! counters) and the two must agree on every grant, refusal, state, fence and position.
//! The engine's invariant checker runs after every step.
//!
//! The model covers acquire/cancel/renew/release/stop/tick/sample with resources, keys,
//! priorities, the scan window, the starvation guard, deadlines and ambient memory.
//! Promotion and demotion are covered by scenarios and the simulator.

use std::collections::BTreeMap;

use berth_core::*;
use proptest::prelude::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Excl,
    Shared,
}

#[derive(Clone, Debug)]
struct MRun {
    req: Request,
    amounts: Vec<u64>,
    keys: Vec<(String, Mode)>,
    state: RunState,
    band: usize,
    seq: u64,
    enqueued_at: u64,
    deadline: u64,
    fence: Option<u64>,
    expires_at: u64,
    cause: Option<EndCause>,
    pending_until: Option<u64>,
}

struct Model {
    cfg: Config,
    alloc: Vec<u64>,
    runs: Vec<MRun>,
    next_seq: [u64; 2],
    cursor: [Option<u64>; 2],
    last_fence: u64,
    samples: Vec<u64>,
    now: u64,
}

fn holds(s: RunState) -> bool {
    matches!(
        s,
        RunState::Granted | RunState::Releasing | RunState::Degraded
    )
}

impl Model {
    fn new(cfg: Config) -> Model {
        let mut alloc = vec![
            cfg.slots_max,
            cfg.memory_total - cfg.memory_reserve,
            cfg.cpu_total_millis - cfg.cpu_reserve_millis,
            cfg.disk_total - cfg.disk_reserve,
        ];
        alloc.extend(cfg.named.iter().map(|(_, t)| *t));
        Model {
            cfg,
            alloc,
            runs: vec![],
            next_seq: [0, 0],
            cursor: [None, None],
            last_fence: 0,
            samples: vec![],
            now: 0,
        }
    }

    fn find(&self, id: &str) -> Option<usize> {
        self.runs.iter().position(|r| r.req.run_id == id)
    }

    fn queued(&self, band: usize) -> Vec<usize> {
        let mut v: Vec<usize> = (0..self.runs.len())
            .filter(|&i| self.runs[i].state == RunState::Queued && self.runs[i].band == band)
            .collect();
        v.sort_by_key(|&i| self.runs[i].seq);
        v
    }

    fn stabilized(&self) -> Option<u64> {
        let n = self.cfg.stabilize_samples;
        self.samples.iter().rev().take(n).copied().min()
    }

    fn ambient_free(&self) -> u64 {
        match self.stabilized() {
            None => u64::MAX,
            Some(a) => {
                let pending: u64 = self
                    .runs
                    .iter()
                    .filter(|r| holds(r.state) && r.pending_until.is_some_and(|t| t > self.now))
                    .map(|r| r.amounts[1])
                    .sum();
                a.saturating_sub(self.cfg.memory_reserve)
                    .saturating_sub(pending)
            }
        }
    }

    fn committed(&self, res: usize) -> u64 {
        self.runs
            .iter()
            .filter(|r| holds(r.state))
            .map(|r| r.amounts[res])
            .sum()
    }

    fn fits(&self, i: usize, is_head: bool) -> bool {
        let r = &self.runs[i];
        if r.band == 1 && !self.queued(0).is_empty() {
            return false;
        }
        for (k, mode) in &r.keys {
            for o in self.runs.iter().filter(|o| holds(o.state)) {
                for (ok, om) in &o.keys {
                    if ok == k && (*om == Mode::Excl || *mode == Mode::Excl) {
                        return false;
                    }
                }
            }
            if *mode == Mode::Shared && !is_head {
                let writer = self.runs.iter().any(|o| {
                    o.state == RunState::Queued
                        && o.band <= r.band
                        && o.keys.iter().any(|(ok, om)| ok == k && *om == Mode::Excl)
                });
                if writer {
                    return false;
                }
            }
        }
        for res in 0..self.alloc.len() {
            if self.committed(res) + r.amounts[res] > self.alloc[res] {
                return false;
            }
        }
        r.amounts[1] <= self.ambient_free()
    }

    fn head_fits_after(&self, h: usize, c: usize) -> bool {
        let (hr, cr) = (&self.runs[h], &self.runs[c]);
        for res in 0..self.alloc.len() {
            if cr.amounts[res] > 0
                && self.committed(res) + hr.amounts[res] + cr.amounts[res] > self.alloc[res]
            {
                return false;
            }
        }
        if cr.amounts[1] > 0 && hr.amounts[1] + cr.amounts[1] > self.ambient_free() {
            return false;
        }
        !hr.keys.iter().any(|(hk, hm)| {
            cr.keys
                .iter()
                .any(|(ck, cm)| ck == hk && (*hm == Mode::Excl || *cm == Mode::Excl))
        })
    }

    fn grant(&mut self, i: usize) {
        self.last_fence += 1;
        let now = self.now;
        let settle = self.cfg.pending_settle_ms;
        let r = &mut self.runs[i];
        r.state = RunState::Granted;
        r.fence = Some(self.last_fence);
        r.expires_at = now + r.req.ttl_ms;
        r.pending_until = (r.amounts[1] > 0).then_some(now + settle);
    }

    fn pass(&mut self, extra: Option<usize>) {
        for band in 0..2 {
            if band == 1 && !self.queued(0).is_empty() {
                break;
            }
            loop {
                let q = self.queued(band);
                match q.first() {
                    Some(&h) if self.fits(h, true) => self.grant(h),
                    _ => break,
                }
            }
            let q = self.queued(band);
            let Some(&head) = q.first() else { continue };
            let guard = self.now - self.runs[head].enqueued_at > self.cfg.starvation_guard_ms;
            let hseq = self.runs[head].seq;
            let start = match self.cursor[band] {
                Some(c) if c > hseq => c,
                _ => hseq + 1,
            };
            let w = self.cfg.window;
            let mut cands: Vec<usize> = q
                .iter()
                .copied()
                .filter(|&i| self.runs[i].seq >= start)
                .take(w)
                .collect();
            if cands.len() < w {
                let more = w - cands.len();
                cands.extend(
                    q.iter()
                        .copied()
                        .filter(|&i| self.runs[i].seq > hseq && self.runs[i].seq < start)
                        .take(more),
                );
            }
            self.cursor[band] = cands.last().map(|&i| self.runs[i].seq + 1);
            if let Some(x) = extra {
                if self.runs[x].state == RunState::Queued
                    && self.runs[x].band == band
                    && x != head
                    && !cands.contains(&x)
                {
                    cands.push(x);
                }
            }
            for c in cands {
                if self.runs[c].state == RunState::Queued
                    && self.fits(c, false)
                    && (!guard || self.head_fits_after(head, c))
                {
                    self.grant(c);
                }
            }
        }
    }

    fn advance(&mut self, now: u64) -> bool {
        self.now = self.now.max(now);
        let mut changed = false;
        for r in &mut self.runs {
            if r.state == RunState::Queued && r.deadline <= self.now {
                r.state = RunState::Expired;
                changed = true;
            }
            if r.state == RunState::Granted && r.expires_at <= self.now {
                r.state = RunState::Releasing;
                r.cause = Some(EndCause::Expired);
                changed = true;
            }
            // A2: a grant's memory settling frees ambient memory: time changed something.
            if holds(r.state) && r.pending_until.is_some_and(|t| t <= self.now) {
                r.pending_until = None;
                changed = true;
            }
        }
        changed
    }

    fn check_fence(&self, i: usize, fence: Option<u64>) -> Result<(), &'static str> {
        let r = &self.runs[i];
        match (r.fence, fence) {
            (None, None) => Ok(()),
            (Some(c), Some(f)) if c == f => Ok(()),
            (Some(_), None) if !r.state.is_terminal() => Err("fence_required"),
            (Some(_), None) => Err("gone"),
            _ => Err("stale_fence"),
        }
    }

    fn apply(&mut self, now: u64, cmd: &Command) -> Result<(), &'static str> {
        let advanced = self.advance(now);
        let res = self.command(cmd);
        if (res.is_ok() && !matches!(cmd, Command::Acquire(_))) || (res.is_err() && advanced) {
            self.pass(None);
        }
        res
    }

    fn command(&mut self, cmd: &Command) -> Result<(), &'static str> {
        match cmd {
            Command::Acquire(req) => {
                if let Some(i) = self.find(&req.run_id) {
                    if self.runs[i].req != *req {
                        return Err("conflict");
                    }
                    return if self.runs[i].state.is_terminal() {
                        Err("gone")
                    } else {
                        Ok(())
                    };
                }
                let mut amounts = vec![
                    req.resources.slots,
                    req.resources.memory,
                    req.resources.cpu_millis,
                    req.resources.disk,
                ];
                for (n, _) in &self.cfg.named {
                    amounts.push(req.resources.named.get(n).copied().unwrap_or(0));
                }
                if amounts.iter().zip(&self.alloc).any(|(a, m)| a > m) {
                    return Err("capacity_impossible");
                }
                let waiting = self
                    .runs
                    .iter()
                    .filter(|r| r.state == RunState::Queued)
                    .count();
                if waiting >= self.cfg.queue_len_max {
                    return Err("queue_full");
                }
                let p = req.project.to_ascii_lowercase();
                let mut keys = vec![match req.class {
                    Class::Managed => (format!("project:{p}:runtime"), Mode::Excl),
                    Class::Analysis => (format!("project:{p}:analysis"), Mode::Shared),
                }];
                let mut singles = req.singletons.clone();
                singles.sort();
                singles.dedup();
                keys.extend(
                    singles
                        .into_iter()
                        .map(|s| (format!("singleton:{s}"), Mode::Excl)),
                );
                let band = req.priority.index_for_model();
                let seq = self.next_seq[band];
                self.next_seq[band] += 1;
                self.runs.push(MRun {
                    req: req.clone(),
                    amounts,
                    keys,
                    state: RunState::Queued,
                    band,
                    seq,
                    enqueued_at: self.now,
                    deadline: self.now + req.wait_ms,
                    fence: None,
                    expires_at: 0,
                    cause: None,
                    pending_until: None,
                });
                let i = self.runs.len() - 1;
                self.pass(Some(i));
                if req.wait_ms == 0 && self.runs[i].state == RunState::Queued {
                    self.runs[i].state = RunState::Expired;
                }
                Ok(())
            }
            Command::Cancel { run_id } => {
                let i = self.find(run_id).ok_or("not_found")?;
                match self.runs[i].state {
                    RunState::Queued => {
                        self.runs[i].state = RunState::Cancelled;
                        Ok(())
                    }
                    RunState::Cancelled => Ok(()),
                    RunState::Granted | RunState::Releasing | RunState::Degraded => {
                        Err("fence_required")
                    }
                    _ => Err("gone"),
                }
            }
            Command::Renew {
                run_id,
                fence,
                ttl_ms,
            } => {
                let i = self.find(run_id).ok_or("not_found")?;
                self.check_fence(i, *fence)?;
                let now = self.now;
                let wait_max = self.cfg.wait_ms_max;
                let r = &mut self.runs[i];
                let ttl = ttl_ms.unwrap_or(r.req.ttl_ms);
                match r.state {
                    RunState::Queued => r.deadline = r.deadline.max(now + ttl.min(wait_max)),
                    RunState::Granted => r.expires_at = r.expires_at.max(now + ttl),
                    _ => return Err("gone"),
                }
                Ok(())
            }
            Command::Release { run_id, fence } => {
                let i = self.find(run_id).ok_or("not_found")?;
                self.check_fence(i, Some(*fence))?;
                let r = &mut self.runs[i];
                if r.state == RunState::Granted {
                    r.state = RunState::Releasing;
                    r.cause = Some(EndCause::Released);
                }
                Ok(())
            }
            Command::StopDone { run_id, ok } => {
                let i = self.find(run_id).ok_or("not_found")?;
                let r = &mut self.runs[i];
                match (r.state, ok) {
                    (RunState::Releasing | RunState::Degraded, true) => {
                        r.state = match r.cause.unwrap() {
                            EndCause::Released => RunState::Released,
                            EndCause::Expired => RunState::Expired,
                        };
                        Ok(())
                    }
                    (RunState::Releasing, false) => {
                        r.state = RunState::Degraded;
                        Ok(())
                    }
                    (RunState::Degraded, false) => Ok(()),
                    _ => Err("not_eligible"),
                }
            }
            Command::Tick => Ok(()),
            Command::Sample(HostSample {
                mem_available: Some(m),
                ..
            }) => {
                self.samples.push(*m);
                Ok(())
            }
            _ => unreachable!("not generated"),
        }
    }

    fn position(&self, i: usize) -> Option<u64> {
        let r = &self.runs[i];
        if r.state != RunState::Queued {
            return None;
        }
        let before = if r.band == 1 { self.queued(0).len() } else { 0 };
        let idx = self.queued(r.band).iter().position(|&x| x == i).unwrap();
        Some((before + idx + 1) as u64)
    }
}

trait BandIndex {
    fn index_for_model(self) -> usize;
}
impl BandIndex for Priority {
    fn index_for_model(self) -> usize {
        match self {
            Priority::Foreground => 0,
            Priority::Background => 1,
        }
    }
}

/// Run ids in generated commands are placeholders resolved when the step runs:
/// `new` becomes a fresh id, `again` re-sends an earlier run's exact request (L7), and
/// `#N` names the N-th run seen so far (modulo), so commands mostly hit live runs.
fn resolve(model: &Model, step: usize, cmd: &mut Command) {
    // `#N` with N < 48 prefers runs in the states the command is meant for, so most
    // commands do something; larger N picks any run, to exercise the refusals.
    let pick = |id: &str, want: &[RunState]| -> String {
        let n: usize = id.trim_start_matches('#').parse().unwrap_or(0);
        let fit: Vec<&MRun> = model
            .runs
            .iter()
            .filter(|r| want.contains(&r.state))
            .collect();
        if n < 48 && !fit.is_empty() {
            fit[n % fit.len()].req.run_id.clone()
        } else if model.runs.is_empty() {
            "nobody".to_string()
        } else {
            model.runs[n % model.runs.len()].req.run_id.clone()
        }
    };
    use RunState::*;
    let current = |id: &str| {
        model
            .find(id)
            .and_then(|m| model.runs[m].fence)
            .unwrap_or(0)
    };
    match cmd {
        Command::Acquire(req) if req.run_id == "new" => req.run_id = format!("r{step}"),
        Command::Acquire(req) => {
            let n = req
                .run_id
                .trim_start_matches('#')
                .parse::<usize>()
                .unwrap_or(0);
            if let Some(r) = (!model.runs.is_empty()).then(|| &model.runs[n % model.runs.len()]) {
                *req = r.req.clone();
                if n % 3 == 0 {
                    req.ttl_ms += 1000; // same id, different body: a conflict
                }
            } else {
                req.run_id = format!("r{step}");
            }
        }
        Command::Cancel { run_id } => *run_id = pick(run_id, &[Queued]),
        Command::StopDone { run_id, .. } => *run_id = pick(run_id, &[Releasing, Degraded]),
        Command::Release { run_id, fence } => {
            *run_id = pick(run_id, &[Granted]);
            if *fence == 0 {
                *fence = current(run_id);
            }
        }
        Command::Renew { run_id, fence, .. } => {
            *run_id = pick(run_id, &[Granted, Queued]);
            if *fence == Some(0) {
                *fence = Some(current(run_id));
            }
        }
        _ => {}
    }
}

fn arb_request() -> impl Strategy<Value = Request> {
    (
        prop::sample::select(vec![
            "new", "new", "new", "new", "new", "new", "#0", "#1", "#2",
        ]),
        prop::sample::select(vec!["a", "b", "A", "c"]),
        prop::bool::weighted(0.25),
        prop::bool::weighted(0.3),
        (
            prop::sample::select(vec![1u64, 1, 1, 2, 3]),
            0u64..=4,
            0u64..=3,
            0u64..=2,
        ),
        prop::sample::subsequence(vec!["db", "cache"], 0..=2),
        (1u64..=30, prop::sample::select(vec![0u64, 5, 20, 60])),
    )
        .prop_map(
            |(id, project, analysis, bg, (slots, mem, cpu, gpu), singles, (ttl, wait))| {
                let mut named = BTreeMap::new();
                if gpu > 0 {
                    named.insert("gpu".to_string(), gpu);
                }
                Request {
                    run_id: id.to_string(),
                    project: project.to_string(),
                    class: if analysis {
                        Class::Analysis
                    } else {
                        Class::Managed
                    },
                    priority: if bg {
                        Priority::Background
                    } else {
                        Priority::Foreground
                    },
                    resources: Resources {
                        slots,
                        memory: mem * GIB,
                        cpu_millis: cpu * 1000,
                        disk: 0,
                        named,
                    },
                    singletons: singles.into_iter().map(str::to_string).collect(),
                    contract: None,
                    ttl_ms: ttl * 1000,
                    wait_ms: wait * 1000,
                    budget: None,
                }
            },
        )
}

fn arb_command() -> impl Strategy<Value = Command> {
    let id = (0usize..64).prop_map(|i| format!("#{i}"));
    prop_oneof![
        4 => arb_request().prop_map(Command::Acquire),
        1 => id.clone().prop_map(|run_id| Command::Cancel { run_id }),
        // Fence 0 stands for "the run's current fence", resolved when the step runs, so
        // most renewals and releases are the owner's and some are stale or missing.
        2 => (id.clone(), prop::option::weighted(0.9, prop::sample::select(vec![0u64, 0, 0, 1, 5])), prop::option::of(1u64..40))
            .prop_map(|(run_id, fence, ttl)| Command::Renew { run_id, fence, ttl_ms: ttl.map(|t| t * 1000) }),
        4 => (id.clone(), prop::sample::select(vec![0u64, 0, 0, 0, 2, 7])).prop_map(|(run_id, fence)| Command::Release { run_id, fence }),
        3 => (id.clone(), prop::bool::weighted(0.85)).prop_map(|(run_id, ok)| Command::StopDone { run_id, ok }),
        2 => Just(Command::Tick),
        1 => (2u64..=14).prop_map(|g| Command::Sample(HostSample::memory(g * GIB))),
    ]
}

fn arb_config() -> impl Strategy<Value = Config> {
    (
        1u64..=4,
        1usize..=3,
        prop::sample::select(vec![0u64, 5_000, 20_000]),
        1usize..=3,
        2usize..=16,
    )
        .prop_map(|(slots, window, guard, stabilize, queue_max)| {
            let mut c = Config::for_host(8, 10 * GIB, 0);
            c.slots_max = slots;
            c.memory_reserve = 2 * GIB;
            c.cpu_total_millis = 4000;
            c.cpu_reserve_millis = 1000;
            c.disk_reserve = 0;
            c.named = vec![("gpu".to_string(), 2)];
            c.window = window;
            c.starvation_guard_ms = guard;
            c.stabilize_samples = stabilize;
            c.pending_settle_ms = 10_000;
            c.queue_len_max = queue_max;
            c
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn engine_agrees_with_reference_model(
        cfg in arb_config(),
        steps in prop::collection::vec((0u64..4000, arb_command()), 1..160),
    ) {
        let mut engine = Engine::new(cfg.clone(), 0).unwrap();
        let mut model = Model::new(cfg);
        let mut now = 0;
        for (i, (dt, mut cmd)) in steps.into_iter().enumerate() {
            now += dt;
            resolve(&model, i, &mut cmd);
            let out = engine.apply(now, cmd.clone());
            let want = model.apply(now, &cmd);
            let got = out.result.as_ref().map(|_| ()).map_err(|e| e.code());
            prop_assert_eq!(got, want, "step {} {:?}", i, cmd);
            if let Err(msg) = engine.check_invariants() {
                prop_assert!(false, "invariant after step {}: {}", i, msg);
            }
            prop_assert_eq!(engine.last_fence(), model.last_fence, "fence counter at step {}", i);
            for (mi, r) in model.runs.iter().enumerate() {
                let v = engine.view_of(&r.req.run_id).expect("engine knows every model run");
                prop_assert_eq!(v.state, r.state, "state of {} at step {} {:?}", r.req.run_id, i, cmd);
                prop_assert_eq!(v.fence, r.fence, "fence of {} at step {}", r.req.run_id, i);
                prop_assert_eq!(v.position, model.position(mi), "position of {} at step {}", r.req.run_id, i);
                if r.state == RunState::Granted {
                    prop_assert_eq!(v.expires_at_ms, Some(r.expires_at));
                }
                if r.state == RunState::Queued {
                    prop_assert_eq!(v.deadline_ms, Some(r.deadline));
                }
            }
        }
    }
}
