//! A12: the host snapshot behind `GET /v1/status`.

use crate::engine::{concurrency_class, Blocker, Engine, FIXED, SLOTS};
use crate::types::{ConcurrencyClass, Evidence, Reason, RunState, TimeMs};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResourceFigures {
    pub name: String,
    pub total: u64,
    pub reserve: u64,
    pub allocatable: u64,
    pub committed: u64,
    pub available: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProjectFigures {
    pub name: String,
    pub active: u32,
    pub waiting: u32,
    pub degraded: u32,
    pub concurrency: ConcurrencyClass,
    pub evidence: Option<Evidence>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    pub now_ms: TimeMs,
    pub resources: Vec<ResourceFigures>,
    /// Stabilised MemAvailable (A10), if any sample has arrived.
    pub memory_available: Option<u64>,
    pub memory_pending: u64,
    /// Issue 36: free space on the workspaces' file system as last sampled, and the
    /// disk claims of grants still pending against it.
    pub disk_free: Option<u64>,
    pub disk_pending: u64,
    pub slots_max: u64,
    /// Slots in use plus how many more default-size runs would fit right now.
    pub effective_max_now: u64,
    /// Why the host cannot take one more default-size run now, if it cannot.
    pub min_run_blocked: Option<Reason>,
    pub queued_foreground: usize,
    pub queued_background: usize,
    pub granted: usize,
    pub releasing: usize,
    pub degraded: usize,
    pub last_fence: u64,
    pub projects: Vec<ProjectFigures>,
}

impl Engine {
    /// A12: what admission sees now, every figure from the engine's own state.
    pub fn snapshot(&self) -> Snapshot {
        let cfg = &self.cfg;
        let (more, blocked) = self.default_runs_that_fit();
        let slots_used = self.committed[SLOTS];
        let effective_max_now = slots_used.saturating_add(more).min(cfg.slots_max);
        let mut counts = [0usize; 3];
        for run in self.runs.iter().flatten() {
            match run.state {
                RunState::Granted => counts[0] += 1,
                RunState::Releasing => counts[1] += 1,
                RunState::Degraded => counts[2] += 1,
                _ => {}
            }
        }
        let mut projects: Vec<ProjectFigures> = self
            .projects
            .iter()
            .flatten()
            .map(|p| ProjectFigures {
                name: p.name.clone(),
                active: p.active,
                waiting: p.waiting,
                degraded: p.degraded,
                concurrency: concurrency_class(p),
                evidence: p.evidence.clone(),
            })
            .collect();
        projects.sort_by(|a, b| a.name.cmp(&b.name));
        Snapshot {
            now_ms: self.now,
            resources: self.resource_figures(),
            memory_available: self.stabilized_available,
            memory_pending: self.pending_memory,
            disk_free: self.disk_free,
            disk_pending: self.pending_disk,
            slots_max: cfg.slots_max,
            effective_max_now,
            min_run_blocked: blocked.map(|b| self.render_blocker(b)),
            queued_foreground: self.queues[0].len(),
            queued_background: self.queues[1].len(),
            granted: counts[0],
            releasing: counts[1],
            degraded: counts[2],
            last_fence: self.last_fence,
            projects,
        }
    }

    /// Each resource: its total, reserve, allocatable, committed and available.
    fn resource_figures(&self) -> Vec<ResourceFigures> {
        let cfg = &self.cfg;
        let totals = [
            (cfg.slots_max, 0),
            (cfg.memory_total, cfg.memory_reserve),
            (cfg.cpu_total_millis, cfg.cpu_reserve_millis),
            (cfg.disk_total, cfg.disk_reserve),
        ];
        (0..self.allocatable.len())
            .map(|i| {
                let (total, reserve) = if i < FIXED {
                    totals[i]
                } else {
                    (cfg.named[i - FIXED].1, 0)
                };
                ResourceFigures {
                    name: self.res_names[i].clone(),
                    total,
                    reserve,
                    allocatable: self.allocatable[i],
                    committed: self.committed[i],
                    available: self.allocatable[i] - self.committed[i],
                }
            })
            .collect()
    }

    /// How many more default-size runs fit, and if none, what stops the first.
    fn default_runs_that_fit(&self) -> (u64, Option<Blocker>) {
        let d = &self.cfg.default_request;
        let want = [d.slots, d.memory, d.cpu_millis, d.disk];
        let mut more = u64::MAX;
        let mut blocked = None;
        for (i, &need) in want.iter().enumerate() {
            if need == 0 {
                continue;
            }
            let free = self.allocatable[i] - self.committed[i];
            let n = free / need;
            if n == 0 && blocked.is_none() {
                blocked = Some(Blocker::Resource { res: i, need, free });
            }
            more = more.min(n);
        }
        if d.memory > 0 {
            let free = self.ambient_free();
            if free < d.memory && blocked.is_none() {
                blocked = Some(Blocker::Ambient {
                    need: d.memory,
                    free,
                });
            }
            more = more.min(free / d.memory);
        }
        (more, blocked)
    }
}
