//! Carrying out a stop: rounds of looking (by cgroup and by tree) and signalling per
//! the pure plan in `stop.rs`, until every member is proven gone or the plan gives up.

use super::*;

/// What stopping a run did (P4's figures come from these).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StopReport {
    /// Processes signalled (TERM or KILL) at least once.
    pub terminated: usize,
    /// Recorded identities whose pid now belongs to another process: left alone (P3).
    pub reused_pids_protected: usize,
    /// Pids still alive when the stop gave up, as far as berth could see (with
    /// `unverified` set there may be more).
    pub survivors: Vec<i32>,
    /// The stop gave up on a round whose look failed: the `/proc` scan, the cgroup's
    /// `cgroup.procs` or `cgroup.events`, or a member's stat line could not be read
    /// (e.g. EMFILE). Nothing proves the run's processes gone, so the stop is not ok
    /// even with no survivor named (S4); the remedy is to stop again later.
    pub unverified: bool,
    /// Processes the run named (as a root, or in its cgroup) that berth never signals:
    /// pid 1, kernel threads, the daemon itself and its ancestors (S3). They are left
    /// alone and not counted as the run's; a cgroup holding one is never `cgroup.kill`ed.
    pub spared: Vec<i32>,
    /// What the run's cgroup had used, read as the stop ended (before the group is
    /// removed), where it had controllers (issue 36: an OOM kill is reported by it).
    pub usage: Option<crate::limits::Usage>,
}

impl StopReport {
    /// Every process of the run is proven gone.
    pub fn ok(&self) -> bool {
        self.survivors.is_empty() && !self.unverified
    }
}

/// One run to stop.
pub struct StopJob {
    /// The caller's name for the run.
    pub key: String,
    pub roots: Vec<ProcId>,
    pub group: Option<cgroup::Group>,
    /// This run's grace between SIGTERM and SIGKILL, instead of the stopper's default.
    pub grace_ms: Option<u64>,
}

pub(super) struct Active {
    job: StopJob,
    plan: StopPlan,
    started: std::time::Instant,
    report: StopReport,
    signalled: std::collections::BTreeSet<ProcId>,
    /// The run's processes as the last round saw them: what a round whose scan failed
    /// still signals (through pidfds, so a stale entry can never hit a stranger).
    known: std::collections::BTreeMap<i32, ProcId>,
    /// Protected processes the run named so far (see [`StopReport::spared`]).
    spared: std::collections::BTreeSet<i32>,
    /// The run's cgroup once held a protected process: `cgroup.kill` would hit it, so
    /// it is never written for this run.
    group_holds_protected: bool,
}

impl Active {
    /// What became of each process signalled this round.
    fn record(&mut self, outcomes: Vec<(ProcId, Signalled)>) {
        for (id, outcome) in outcomes {
            match outcome {
                Signalled::Sent => {
                    self.signalled.insert(id);
                }
                // Proven gone, or no longer the run's: nothing left to remember.
                Signalled::Gone | Signalled::Reused => {
                    self.known.remove(&id.pid);
                }
                Signalled::Protected => {
                    self.known.remove(&id.pid);
                    self.spared.insert(id.pid);
                }
                // Still (possibly) alive: the next round looks again.
                Signalled::Denied | Signalled::Unknown => {}
            }
        }
    }
}

/// How a round signals one process: [`signal`], except in tests, which must see what
/// would have been signalled without sending anything.
pub(crate) type SignalFn = Box<dyn FnMut(&ProcId, Signal) -> Signalled + Send>;

/// How far the daemon's parent chain is followed at start (one stat read per step).
/// Real chains are a handful deep; the bound only stops a pathological one.
pub(super) const ANCESTRY_MAX_STEPS: usize = 4096;

/// What a [`Stopper`] never signals (S3): fixed at [`Stopper::new`], refreshed from
/// each round's scan.
pub(super) struct Guard {
    own_pid: i32,
    /// The daemon's ancestors when the stopper started, by identity: an ancestor that
    /// exits may see its pid reused by a run's process, which must still be stopped.
    ancestors_at_start: std::collections::BTreeSet<(i32, u64)>,
    /// The daemon's ancestors in the latest successful scan (it may have been
    /// reparented since the start), as pids of that snapshot.
    ancestors_now: Vec<i32>,
}

impl Guard {
    fn new() -> Guard {
        let own_pid = std::process::id() as i32;
        Guard {
            own_pid,
            ancestors_at_start: ancestry_by_stat(own_pid),
            ancestors_now: Vec::new(),
        }
    }

    /// For a process with a stat line from the current snapshot.
    fn spares(&self, s: &Stat) -> bool {
        is_protected(s, self.own_pid, &self.ancestors_now)
            || self.ancestors_at_start.contains(&(s.pid, s.start_ticks))
    }

    /// For an identity without a fresh stat line (a root, a process remembered from
    /// an earlier round): the rules a pid and start time can decide. A kernel thread
    /// among them is refused by [`signal`], which reads the stat through the pidfd.
    fn spares_id(&self, id: &ProcId) -> bool {
        id.pid <= INIT_PID
            || id.pid == KTHREADD_PID
            || id.pid == self.own_pid
            || self.ancestors_now.contains(&id.pid)
            || self.ancestors_at_start.contains(&(id.pid, id.start_ticks))
    }
}

/// The ancestors of `own_pid` by identity, one stat read per step (there is no scan at
/// start). Stops at the first line it cannot read; each round's scan adds what it shows.
pub(super) fn ancestry_by_stat(own_pid: i32) -> std::collections::BTreeSet<(i32, u64)> {
    let mut out = std::collections::BTreeSet::new();
    let Ok(mut cur) = stat(own_pid) else {
        return out;
    };
    for _ in 0..ANCESTRY_MAX_STEPS {
        if cur.ppid <= 0 {
            break;
        }
        let Ok(parent) = stat(cur.ppid) else {
            break;
        };
        // A repeat means a torn read: the chain is complete as far as it is real.
        if !out.insert((parent.pid, parent.start_ticks)) {
            break;
        }
        cur = parent;
    }
    out
}

/// One round's successful scan, shared by every run.
pub(super) struct Snapshot {
    /// Every process the stopper may touch: the scan without protected processes, so
    /// no membership rule can reach them or descend through them.
    visible: Vec<Stat>,
    by_pid: std::collections::HashMap<i32, Stat>,
}

impl Snapshot {
    fn new(all: Vec<Stat>, guard: &Guard) -> Snapshot {
        Snapshot {
            visible: all.iter().filter(|s| !guard.spares(s)).copied().collect(),
            by_pid: all.into_iter().map(|s| (s.pid, s)).collect(),
        }
    }
}

/// What one round sees of one run.
#[derive(Default)]
pub(super) struct Look {
    alive: std::collections::BTreeMap<i32, ProcId>,
    populated: bool,
    /// Something this round needed to read could not be read (S4).
    unverified: bool,
    spared: std::collections::BTreeSet<i32>,
    group_holds_protected: bool,
}

impl Look {
    /// Whether the plan must treat the run as alive: a failed look counts as alive,
    /// so a stop never finishes `Done` on it (S4).
    fn anything_alive(&self) -> bool {
        !self.alive.is_empty() || self.populated || self.unverified
    }
}

/// Looks at one run: its members in `snapshot` (or, when the scan failed, what the
/// last round knew and its roots), and its cgroup.
pub(super) fn look(
    job: &StopJob,
    known: &std::collections::BTreeMap<i32, ProcId>,
    snapshot: Option<&Snapshot>,
    guard: &Guard,
    boot: &str,
) -> Look {
    let mut l = Look::default();
    let id = |s: &Stat| ProcId {
        pid: s.pid,
        start_ticks: s.start_ticks,
        boot_id: boot.to_string(),
    };
    match snapshot {
        Some(snap) => {
            // A root that is protected names no group, session or children of the run's.
            let mut roots = Vec::new();
            for r in &job.roots {
                let live_protected = snap
                    .by_pid
                    .get(&r.pid)
                    .is_some_and(|s| s.start_ticks == r.start_ticks && guard.spares(s));
                if guard.spares_id(r) || live_protected {
                    l.spared.insert(r.pid);
                } else {
                    roots.push(r.clone());
                }
            }
            l.alive = members(&roots, &snap.visible)
                .iter()
                .map(|s| (s.pid, id(s)))
                .collect();
        }
        None => {
            // Could not look: keep signalling what is known (pidfds re-check each
            // identity), and let the plan see something alive.
            l.unverified = true;
            l.alive = known.clone();
            for r in &job.roots {
                if guard.spares_id(r) {
                    l.spared.insert(r.pid);
                } else {
                    l.alive.entry(r.pid).or_insert_with(|| r.clone());
                }
            }
        }
    }
    if let Some(g) = &job.group {
        look_in_group(g, guard, boot, &mut l);
    }
    l
}

/// The run's cgroup: each member (one the guard spares is noted, and the group then
/// holds a protected process) and whether anything is left in it.
pub(super) fn look_in_group(g: &cgroup::Group, guard: &Guard, boot: &str, l: &mut Look) {
    match g.pids() {
        Ok(pids) => {
            for pid in pids {
                match stat(pid) {
                    Ok(s) if guard.spares(&s) => {
                        l.spared.insert(pid);
                        l.group_holds_protected = true;
                    }
                    Ok(s) if s.state == 'Z' => {}
                    Ok(s) => {
                        l.alive.entry(pid).or_insert_with(|| ProcId {
                            pid: s.pid,
                            start_ticks: s.start_ticks,
                            boot_id: boot.to_string(),
                        });
                    }
                    Err(ProcError::NoSuchProcess { .. }) => {}
                    Err(_) => l.unverified = true,
                }
            }
        }
        Err(_) => l.unverified = true,
    }
    match g.populated() {
        Ok(p) => l.populated = p,
        Err(_) => l.unverified = true,
    }
}

/// Signals every process in `alive` the guard allows, and returns what became of each
/// signalled one.
pub(super) fn send_all(
    alive: &std::collections::BTreeMap<i32, ProcId>,
    sig: Signal,
    guard: &Guard,
    send: &mut SignalFn,
) -> Vec<(ProcId, Signalled)> {
    alive
        .values()
        .filter(|id| !guard.spares_id(id))
        .map(|id| (id.clone(), send(id, sig)))
        .collect()
}

/// Stops many runs at once: each round takes one `/proc` scan for all of them, so a
/// thousand expired runs cost a thousand membership checks, not a thousand scans.
pub struct Stopper {
    boot: String,
    grace_ms: u64,
    kill_wait_ms: u64,
    active: Vec<Active>,
    guard: Guard,
    /// How a signal is sent (the unit tests put a fake here).
    pub(crate) send: SignalFn,
}

/// The pause between rounds of a stop.
pub const STOP_ROUND_MS: u64 = 20;

impl Stopper {
    pub fn new(grace_ms: u64, kill_wait_ms: u64) -> Stopper {
        Stopper {
            boot: boot_id(),
            grace_ms,
            kill_wait_ms,
            active: Vec::new(),
            guard: Guard::new(),
            send: Box::new(signal),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.active.is_empty()
    }

    pub fn add(&mut self, job: StopJob) {
        let grace = job.grace_ms.unwrap_or(self.grace_ms);
        let reused = job
            .roots
            .iter()
            .filter(|r| liveness(r, &self.boot) == Liveness::Reused)
            .count();
        self.active.push(Active {
            job,
            plan: StopPlan::new(grace, self.kill_wait_ms),
            started: std::time::Instant::now(),
            report: StopReport {
                reused_pids_protected: reused,
                ..StopReport::default()
            },
            signalled: std::collections::BTreeSet::new(),
            known: std::collections::BTreeMap::new(),
            spared: std::collections::BTreeSet::new(),
            group_holds_protected: false,
        });
    }

    /// One round: scan `/proc` once, signal what the plans say, and return the stops
    /// that finished.
    pub fn round(&mut self) -> Vec<(String, StopReport)> {
        self.round_with(scan())
    }

    /// One round against `all`, this round's look at `/proc` for every run. A failed
    /// look (`Err`) never lets a run finish `Done` (S4): each run keeps signalling what
    /// it already knows and, if its plan degrades, reports `unverified`.
    pub fn round_with(&mut self, all: std::io::Result<Vec<Stat>>) -> Vec<(String, StopReport)> {
        let snapshot = match all {
            Ok(all) => {
                // The daemon may have been reparented since the start: its ancestors
                // are those of this snapshot too.
                self.guard.ancestors_now = ancestors_of(self.guard.own_pid, &all);
                Some(Snapshot::new(all, &self.guard))
            }
            // Keep the last known ancestors: with nothing fresher, sparing too much
            // only delays a stop that the failed look already keeps going.
            Err(_) => None,
        };
        let mut finished = Vec::new();
        let mut i = 0;
        while i < self.active.len() {
            let a = &mut self.active[i];
            let look = look(&a.job, &a.known, snapshot.as_ref(), &self.guard, &self.boot);
            a.spared.extend(look.spared.iter().copied());
            a.group_holds_protected |= look.group_holds_protected;
            let now = a.started.elapsed().as_millis() as u64;
            let action = a.plan.next(now, look.anything_alive());
            let outcomes = match action {
                StopAction::Term => {
                    send_all(&look.alive, Signal::TERM, &self.guard, &mut self.send)
                }
                StopAction::Kill => {
                    if let Some(g) = &a.job.group {
                        if !a.group_holds_protected {
                            let _ = g.kill();
                        }
                    }
                    send_all(&look.alive, Signal::KILL, &self.guard, &mut self.send)
                }
                StopAction::Wait | StopAction::Done => Vec::new(),
                StopAction::Degraded => {
                    a.report.survivors = look.alive.keys().copied().collect();
                    a.report.unverified = look.unverified;
                    Vec::new()
                }
            };
            a.known = look.alive;
            a.record(outcomes);
            if matches!(action, StopAction::Done | StopAction::Degraded) {
                let mut a = self.active.swap_remove(i);
                a.report.terminated = a.signalled.len();
                a.report.spared = a.spared.into_iter().collect();
                a.report.usage = a.job.group.as_ref().and_then(|g| g.usage());
                if a.report.ok() {
                    if let Some(g) = &a.job.group {
                        let _ = g.remove();
                    }
                }
                finished.push((a.job.key, a.report));
            } else {
                i += 1;
            }
        }
        finished
    }
}

/// Stops one run's processes: its registered roots and their process groups, sessions
/// and descendants, and everything in its cgroup. TERM, `grace_ms`, KILL, then proof
/// that nothing is left (or a report of what survived). Blocking.
pub fn stop(
    roots: &[ProcId],
    group: Option<cgroup::Group>,
    grace_ms: u64,
    kill_wait_ms: u64,
) -> StopReport {
    let mut s = Stopper::new(grace_ms, kill_wait_ms);
    s.add(StopJob {
        key: String::new(),
        roots: roots.to_vec(),
        group,
        grace_ms: None,
    });
    loop {
        if let Some((_, report)) = s.round().pop() {
            return report;
        }
        std::thread::sleep(std::time::Duration::from_millis(STOP_ROUND_MS));
    }
}
