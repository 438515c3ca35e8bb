//! berth-proc: knowing exactly which processes belong to a run, and stopping exactly
//! those (docs/contract.md, processes).
//!
//! - [`ProcId`]: a process is (pid, start time, boot id), never a pid alone (P1).
//!   [`signal`] opens a pidfd, re-checks the start time through it, and only then
//!   signals: a recycled pid can never be hit (P3).
//! - [`members`]: the pure rule that decides which live processes belong to a run in
//!   the process-group fallback.
//! - [`cgroup`]: a cgroup v2 group per run where the host allows it.
//! - [`StopPlan`]: the pure TERM → grace → KILL → proven-gone decision (P2).
//!
//! Two rules run through everything here. "Could not look" is never "gone" (S4): a
//! failed `/proc`, pidfd or cgroup read is an error or an explicit unknown, never an
//! empty list, so a stop never reports done on a look that failed. And some processes
//! are never signalled (S3): pid 1, kernel threads, the daemon itself and its
//! ancestors ([`is_kernel_thread`], [`ancestors_of`], [`is_protected`]).

pub mod cgroup;
pub mod net;
mod stop;
#[doc(hidden)]
pub mod testing;

pub use stop::{StopAction, StopPlan};

use std::os::fd::OwnedFd;

use rustix::process::{Pid, PidfdFlags, Signal};

/// Who a process is: stable across pid reuse.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProcId {
    pub pid: i32,
    /// Start time in clock ticks since boot (`/proc/<pid>/stat` field 22).
    pub start_ticks: u64,
    pub boot_id: String,
}

/// The fields of `/proc/<pid>/stat` berth uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stat {
    pub pid: i32,
    pub state: char,
    pub ppid: i32,
    pub pgrp: i32,
    pub session: i32,
    /// The kernel's per-task flags (`/proc/<pid>/stat` field 9); berth reads only
    /// [`PF_KTHREAD`].
    pub flags: u32,
    pub start_ticks: u64,
}

/// `PF_KTHREAD` in the task flags: the task is a kernel thread (include/linux/sched.h).
pub const PF_KTHREAD: u32 = 0x0020_0000;
/// init: the whole host (or container) goes down with it.
pub const INIT_PID: i32 = 1;
/// kthreadd, the parent of every kernel thread.
pub const KTHREADD_PID: i32 = 2;

#[derive(Debug, thiserror::Error)]
pub enum ProcError {
    #[error("process {pid} does not exist")]
    NoSuchProcess { pid: i32 },
    #[error("/proc/{pid}/stat is malformed: {line:?}")]
    Malformed { pid: i32, line: String },
    #[error("process {pid}: {op}: {err}")]
    Io {
        pid: i32,
        op: &'static str,
        err: std::io::Error,
    },
}

/// Keeps the kind (NotFound for a process that is gone, InvalidData for a malformed
/// line, the OS error's kind otherwise) and the pid in the message.
impl From<ProcError> for std::io::Error {
    fn from(e: ProcError) -> std::io::Error {
        let kind = match &e {
            ProcError::NoSuchProcess { .. } => std::io::ErrorKind::NotFound,
            ProcError::Malformed { .. } => std::io::ErrorKind::InvalidData,
            ProcError::Io { err, .. } => err.kind(),
        };
        std::io::Error::new(kind, e)
    }
}

/// Parses one `/proc/<pid>/stat` line. The command name may contain spaces and
/// parentheses, so fields are counted from the last `)`.
pub fn parse_stat(line: &str) -> Option<Stat> {
    let open = line.find('(')?;
    let close = line.rfind(')')?;
    let pid = line[..open].trim().parse().ok()?;
    let rest: Vec<&str> = line[close + 1..].split_whitespace().collect();
    // rest[0] is field 3 (state); field N is rest[N - 3].
    Some(Stat {
        pid,
        state: rest.first()?.chars().next()?,
        ppid: rest.get(1)?.parse().ok()?,
        pgrp: rest.get(2)?.parse().ok()?,
        session: rest.get(3)?.parse().ok()?,
        flags: rest.get(6)?.parse().ok()?,
        start_ticks: rest.get(19)?.parse().ok()?,
    })
}

/// Whether a failed read of `/proc/<pid>/...` means the process is gone: the entry is
/// missing (ENOENT), or the process exited between `open` and `read` (ESRCH). Anything
/// else (EMFILE, ENFILE, EACCES, ...) means berth could not look, which is not the same
/// thing (S4).
fn is_gone_error(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::NotFound
        || e.raw_os_error() == Some(rustix::io::Errno::SRCH.raw_os_error())
}

/// One process's stat line. [`ProcError::NoSuchProcess`] only when the process is
/// gone; a read that failed for another reason is [`ProcError::Io`].
pub fn stat(pid: i32) -> Result<Stat, ProcError> {
    let line = std::fs::read_to_string(format!("/proc/{pid}/stat")).map_err(|e| {
        if is_gone_error(&e) {
            ProcError::NoSuchProcess { pid }
        } else {
            ProcError::Io {
                pid,
                op: "read stat",
                err: e,
            }
        }
    })?;
    parse_stat(&line).ok_or(ProcError::Malformed { pid, line })
}

pub fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// The identity of a live process.
pub fn identify(pid: i32) -> Result<ProcId, ProcError> {
    let st = stat(pid)?;
    if st.state == 'Z' {
        return Err(ProcError::NoSuchProcess { pid });
    }
    Ok(ProcId {
        pid,
        start_ticks: st.start_ticks,
        boot_id: boot_id(),
    })
}

/// What became of a recorded process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Liveness {
    Alive,
    /// Exited (or a zombie: it no longer runs anything).
    Gone,
    /// The pid now belongs to another process; it must not be touched (P3).
    Reused,
    /// `/proc` could not be read (e.g. EMFILE): it may well be alive (S4).
    Unknown,
}

pub fn liveness(id: &ProcId, boot: &str) -> Liveness {
    if id.boot_id != boot {
        return Liveness::Gone;
    }
    match stat(id.pid) {
        Ok(st) if st.start_ticks != id.start_ticks => Liveness::Reused,
        Ok(st) if st.state == 'Z' || st.state == 'X' => Liveness::Gone,
        Ok(_) => Liveness::Alive,
        Err(ProcError::NoSuchProcess { .. }) => Liveness::Gone,
        Err(_) => Liveness::Unknown,
    }
}

/// The outcome of [`signal`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Signalled {
    Sent,
    Gone,
    /// The pid belongs to someone else now; nothing was sent.
    Reused,
    /// The kernel refused (the process is another user's): it lives on, and the
    /// stop's next round still counts it.
    Denied,
    /// berth could not look: `pidfd_open`, the stat re-read or the send failed for a
    /// reason other than the process being gone (EMFILE, ENFILE, EACCES, ...). Nothing
    /// was sent and the process may well be alive (S4).
    Unknown,
    /// pid 1, a non-positive pid or a kernel thread: never signalled (S3).
    Protected,
}

/// Sends `sig` to exactly the process `id`: a pidfd is opened first, then the start
/// time is checked again (a pidfd pins the process, so the check cannot go stale),
/// and only then the signal goes through the pidfd. pid 1 and kernel threads are
/// refused here too, whoever asks (S3, defense in depth behind [`Stopper`]'s rule).
pub fn signal(id: &ProcId, sig: Signal) -> Signalled {
    // A non-positive pid names groups or everything for kill(2); init takes the host
    // down with it. Neither is ever a run's process.
    if id.pid <= INIT_PID {
        return Signalled::Protected;
    }
    let Some(pid) = Pid::from_raw(id.pid) else {
        return Signalled::Protected;
    };
    let fd: OwnedFd = match rustix::process::pidfd_open(pid, PidfdFlags::empty()) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::SRCH) => return Signalled::Gone,
        Err(_) => return Signalled::Unknown,
    };
    match stat(id.pid) {
        Ok(st) if st.start_ticks != id.start_ticks => return Signalled::Reused,
        Ok(st) if is_kernel_thread(&st) => return Signalled::Protected,
        Ok(_) => {}
        Err(ProcError::NoSuchProcess { .. }) => return Signalled::Gone,
        Err(_) => return Signalled::Unknown,
    }
    match rustix::process::pidfd_send_signal(&fd, sig) {
        Ok(()) => Signalled::Sent,
        Err(rustix::io::Errno::PERM) => Signalled::Denied,
        Err(rustix::io::Errno::SRCH) => Signalled::Gone,
        Err(_) => Signalled::Unknown,
    }
}

/// Every process on the host, as `/proc` shows it now. An error when `/proc` cannot
/// be listed or a process's stat cannot be read for any reason but its exit: a list
/// with a live process missing would let a stop call it gone (S4). A process that
/// exited between the listing and the read is simply not in the list.
pub fn scan() -> std::io::Result<Vec<Stat>> {
    let mut all = Vec::new();
    for entry in std::fs::read_dir("/proc")? {
        let entry = entry?;
        // Non-numeric entries (`self`, `meminfo`, ...) are not processes.
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        match stat(pid) {
            Ok(st) => all.push(st),
            Err(ProcError::NoSuchProcess { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(all)
}

/// Whether `s` is a kernel thread: `PF_KTHREAD` in its flags, or kthreadd itself, or
/// a child of kthreadd. Kernel threads belong to no run, and signalling one is at best
/// useless and at worst harmful (S3); the ppid test covers a kernel whose flags
/// layout ever differs.
pub fn is_kernel_thread(s: &Stat) -> bool {
    s.flags & PF_KTHREAD != 0 || s.pid == KTHREADD_PID || s.ppid == KTHREADD_PID
}

/// The ancestors of `pid` in `all`, parent first, up to the root of the tree. The
/// daemon must never signal its ancestors (S3): stopping the shell or supervisor that
/// started it would take the daemon down, or hit whatever else that process runs.
/// The walk is bounded by the number of processes, so a cycle in a torn snapshot
/// cannot loop forever; `pid` itself is not included.
pub fn ancestors_of(pid: i32, all: &[Stat]) -> Vec<i32> {
    let parent: std::collections::HashMap<i32, i32> = all.iter().map(|s| (s.pid, s.ppid)).collect();
    let mut out = Vec::new();
    let mut cur = pid;
    for _ in 0..all.len() {
        let Some(&ppid) = parent.get(&cur) else {
            break;
        };
        // ppid 0: the top of the tree (init, kthreadd); a repeat: a torn snapshot.
        if ppid <= 0 || ppid == pid || out.contains(&ppid) {
            break;
        }
        out.push(ppid);
        cur = ppid;
    }
    out
}

/// Whether the stopper must never signal `s` (S3): init, a kernel thread, the daemon
/// itself (`own_pid`) or one of its `ancestors` (pids from the same snapshot as `s`).
/// None of them can be a run's process, and hitting any one takes down the daemon,
/// its supervisor or the host.
pub fn is_protected(s: &Stat, own_pid: i32, ancestors: &[i32]) -> bool {
    s.pid <= INIT_PID || is_kernel_thread(s) || s.pid == own_pid || ancestors.contains(&s.pid)
}

/// Whether `s` may be any run's member at all: a zombie runs nothing, and init and
/// kernel threads belong to the host (S3), even when they share a number with a
/// root's group or session.
fn can_belong(s: &Stat) -> bool {
    s.state != 'Z' && s.pid > INIT_PID && !is_kernel_thread(s)
}

/// The process-group fallback's membership rule (pure): a live process belongs to the
/// run if it is a registered root, or it is in a root's process group or session and
/// started no earlier than that root, or its parent chain reaches a member. What it
/// cannot see: a descendant that left the group with `setsid` *and* whose parent died
/// (it is reparented to init), e.g. a double-forked daemon. cgroups catch those.
pub fn members(roots: &[ProcId], all: &[Stat]) -> Vec<Stat> {
    let by_pid: std::collections::HashMap<i32, &Stat> = all.iter().map(|s| (s.pid, s)).collect();
    let live_roots: Vec<&Stat> = roots
        .iter()
        .filter_map(|r| {
            by_pid
                .get(&r.pid)
                .copied()
                .filter(|s| s.start_ticks == r.start_ticks)
        })
        .collect();
    // A root whose pid now belongs to another process (P3) says nothing about groups:
    // its old group is empty (Linux does not reuse a pid still used as a group id), and
    // the new owner may lead a group of the same number.
    let usable: Vec<&ProcId> = roots
        .iter()
        .filter(|r| {
            by_pid
                .get(&r.pid)
                .is_none_or(|s| s.start_ticks == r.start_ticks)
        })
        .collect();
    let mut member: std::collections::BTreeMap<i32, Stat> = std::collections::BTreeMap::new();
    for s in all {
        let in_group = usable
            .iter()
            .any(|r| (s.pgrp == r.pid || s.session == r.pid) && s.start_ticks >= r.start_ticks);
        let is_root = live_roots.iter().any(|r| r.pid == s.pid);
        if (in_group || is_root) && can_belong(s) {
            member.insert(s.pid, *s);
        }
    }
    // Descendants by parent chain, to a fixed point (bounded by the process count).
    loop {
        let before = member.len();
        for s in all {
            if can_belong(s) && !member.contains_key(&s.pid) {
                if let Some(p) = member.get(&s.ppid) {
                    if s.start_ticks >= p.start_ticks {
                        member.insert(s.pid, *s);
                    }
                }
            }
        }
        if member.len() == before {
            break;
        }
    }
    member.into_values().collect()
}

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

struct Active {
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
type SignalFn = Box<dyn FnMut(&ProcId, Signal) -> Signalled + Send>;

/// How far the daemon's parent chain is followed at start (one stat read per step).
/// Real chains are a handful deep; the bound only stops a pathological one.
const ANCESTRY_MAX_STEPS: usize = 4096;

/// What a [`Stopper`] never signals (S3): fixed at [`Stopper::new`], refreshed from
/// each round's scan.
struct Guard {
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
fn ancestry_by_stat(own_pid: i32) -> std::collections::BTreeSet<(i32, u64)> {
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
struct Snapshot {
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
struct Look {
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
fn look(
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
fn look_in_group(g: &cgroup::Group, guard: &Guard, boot: &str, l: &mut Look) {
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
fn send_all(
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
    send: SignalFn,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_lines_parse_even_with_odd_command_names() {
        let line = "4242 (a b) (c)) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10 18446744073709551615 0 0 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0";
        let st = parse_stat(line).unwrap();
        assert_eq!(
            (
                st.pid,
                st.state,
                st.ppid,
                st.pgrp,
                st.session,
                st.start_ticks
            ),
            (4242, 'S', 1, 4242, 4242, 987654)
        );
        assert_eq!(st.flags, 4194560);
        assert!(!is_kernel_thread(&st));
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn membership_follows_groups_sessions_and_parents() {
        let s = |pid, ppid, pgrp, session, start| Stat {
            pid,
            state: 'S',
            ppid,
            pgrp,
            session,
            flags: 0,
            start_ticks: start,
        };
        let root = ProcId {
            pid: 100,
            start_ticks: 50,
            boot_id: "b".into(),
        };
        let all = vec![
            s(1, 0, 1, 1, 0),
            s(100, 1, 100, 100, 50),   // root
            s(101, 100, 100, 100, 51), // child in the group
            s(102, 101, 102, 102, 52), // grandchild that called setsid: parent chain
            s(103, 1, 100, 100, 60),   // orphan still in the group
            s(104, 1, 104, 104, 70),   // double-forked daemon: escaped (documented)
            s(200, 1, 200, 200, 10),   // a stranger
            s(201, 200, 100, 100, 5),  // older than the root: cannot be ours
        ];
        let m: Vec<i32> = members(&[root], &all).iter().map(|s| s.pid).collect();
        assert_eq!(m, vec![100, 101, 102, 103]);
        // pid 300 was a root once; now it is a stranger leading its own group. Neither
        // it nor its group may be taken for the run's.
        let gone = ProcId {
            pid: 300,
            start_ticks: 40,
            boot_id: "b".into(),
        };
        let all = vec![s(300, 1, 300, 300, 90), s(301, 300, 300, 300, 91)];
        assert!(members(&[gone], &all).is_empty());
    }

    /// A synthetic process for the stopper's tests.
    fn proc(pid: i32, ppid: i32, pgrp: i32, flags: u32, start_ticks: u64) -> Stat {
        Stat {
            pid,
            state: 'S',
            ppid,
            pgrp,
            session: pgrp,
            flags,
            start_ticks,
        }
    }

    /// Above PID_MAX_LIMIT (2^22): never a real process, so nothing real is touched
    /// even if the fake signaller below were bypassed.
    const FAKE_ROOT_PID: i32 = 4_500_000;

    type Sent = std::sync::Arc<std::sync::Mutex<Vec<(i32, Signal)>>>;

    /// A stopper whose signals are only recorded, never sent.
    fn recording_stopper(grace_ms: u64, kill_wait_ms: u64) -> (Stopper, Sent) {
        let sent: Sent = Default::default();
        let mut stopper = Stopper::new(grace_ms, kill_wait_ms);
        let log = sent.clone();
        stopper.send = Box::new(move |id, sig| {
            log.lock().unwrap().push((id.pid, sig));
            Signalled::Sent
        });
        (stopper, sent)
    }

    fn job(key: &str, roots: Vec<ProcId>, grace_ms: Option<u64>) -> StopJob {
        StopJob {
            key: key.into(),
            roots,
            group: None,
            grace_ms,
        }
    }

    fn emfile() -> std::io::Result<Vec<Stat>> {
        Err(std::io::Error::from_raw_os_error(
            rustix::io::Errno::MFILE.raw_os_error(),
        ))
    }

    #[test]
    fn a_stop_fed_a_failed_scan_never_finishes_done() {
        // The bug: with descriptors exhausted, scan() gave an empty list and the stop
        // finished Done while the run's processes lived on, untracked.
        let (mut stopper, sent) = recording_stopper(0, 0);
        stopper.add(job("waiting", Vec::new(), Some(60_000)));
        for _ in 0..5 {
            assert_eq!(stopper.round_with(emfile()), Vec::new());
        }
        // A later successful look that shows nothing proves the run gone.
        let done = stopper.round_with(Ok(Vec::new()));
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].0, "waiting");
        assert!(done[0].1.ok(), "{:?}", done[0].1);
        assert!(stopper.is_empty());

        // A run seen once, then never again: what is known is still signalled
        // (TERM, then KILL), and the stop degrades as unverified, never Done.
        let root = ProcId {
            pid: FAKE_ROOT_PID,
            start_ticks: 100,
            boot_id: boot_id(),
        };
        let child = proc(FAKE_ROOT_PID + 1, FAKE_ROOT_PID, FAKE_ROOT_PID, 0, 101);
        stopper.add(job("blind", vec![root.clone()], None));
        let seen = vec![proc(FAKE_ROOT_PID, 1, FAKE_ROOT_PID, 0, 100), child];
        assert_eq!(stopper.round_with(Ok(seen)), Vec::new());
        let mut finished = Vec::new();
        for _ in 0..100 {
            finished = stopper.round_with(emfile());
            if !finished.is_empty() {
                break;
            }
        }
        let (key, report) = finished.pop().expect("the stop degrades in bounded time");
        assert_eq!(key, "blind");
        assert!(report.unverified, "{report:?}");
        assert!(!report.ok(), "{report:?}");
        assert_eq!(report.survivors, vec![FAKE_ROOT_PID, FAKE_ROOT_PID + 1]);
        let sent = sent.lock().unwrap().clone();
        for pid in [FAKE_ROOT_PID, FAKE_ROOT_PID + 1] {
            assert!(sent.contains(&(pid, Signal::TERM)), "{sent:?}");
            assert!(sent.contains(&(pid, Signal::KILL)), "{sent:?}");
        }
    }

    #[test]
    fn pid_1_kernel_threads_the_daemon_and_its_ancestors_are_never_signalled() {
        let own = std::process::id() as i32;
        let own_stat = stat(own).unwrap();
        let parent = rustix::process::getppid().map_or(0, |p| p.as_raw_nonzero().get());
        let parent_start = stat(parent).map_or(0, |s| s.start_ticks);
        let r = FAKE_ROOT_PID;

        // The pure rules.
        let kthreadd = proc(2, 0, 0, PF_KTHREAD, 0);
        let kworker = proc(60, 2, r, PF_KTHREAD, 300);
        let unflagged_kthread = proc(61, 2, r, 0, 300);
        assert!(is_kernel_thread(&kthreadd) && is_kernel_thread(&kworker));
        assert!(is_kernel_thread(&unflagged_kthread));
        assert!(!is_kernel_thread(&own_stat));
        let chain = vec![
            proc(1, 0, 1, 0, 0),
            proc(10, 1, 10, 0, 5),
            proc(20, 10, 10, 0, 6),
            proc(30, 20, 30, 0, 7),
        ];
        assert_eq!(ancestors_of(30, &chain), vec![20, 10, 1]);
        assert_eq!(ancestors_of(1, &chain), Vec::<i32>::new());
        // A torn snapshot with a cycle still ends.
        let cycle = vec![proc(5, 6, 5, 0, 1), proc(6, 5, 5, 0, 1)];
        assert_eq!(ancestors_of(5, &cycle), vec![6]);
        assert!(is_protected(&chain[0], 30, &[]));
        assert!(is_protected(&chain[3], 30, &[]));
        assert!(is_protected(&chain[1], 30, &[20, 10, 1]));
        assert!(!is_protected(&proc(40, 30, 30, 0, 8), 30, &[20, 10, 1]));

        // A synthetic host where init, kernel threads, this process and its parent all
        // look like members of the run rooted at r. The signaller only records, so a
        // broken rule could not hurt the test runner.
        let mut own_fake = own_stat;
        (own_fake.ppid, own_fake.pgrp, own_fake.session) = (parent, r, r);
        let all = vec![
            proc(1, 0, r, 0, 150),
            kthreadd,
            kworker,
            unflagged_kthread,
            proc(parent, 1, r, 0, parent_start),
            own_fake,
            proc(r, parent, r, 0, 0),
            proc(r + 1, r, r, 0, 400),
            // The daemon's own child (another run's root): reachable only through the
            // daemon, which is never a member, so never the run's.
            proc(r + 2, own, r + 2, 0, 500),
        ];
        let root = ProcId {
            pid: r,
            start_ticks: 0,
            boot_id: boot_id(),
        };
        let m: Vec<i32> = members(std::slice::from_ref(&root), &all)
            .iter()
            .map(|s| s.pid)
            .collect();
        for never in [1, 2, 60, 61] {
            assert!(!m.contains(&never), "{never} in {m:?}");
        }
        let (mut stopper, sent) = recording_stopper(0, 0);
        stopper.add(job("run", vec![root], None));
        let mut finished = Vec::new();
        for _ in 0..100 {
            // Every round sees the same host: the run's own processes "survive".
            finished = stopper.round_with(Ok(all.clone()));
            if !finished.is_empty() {
                break;
            }
        }
        let signalled: std::collections::BTreeSet<i32> =
            sent.lock().unwrap().iter().map(|(pid, _)| *pid).collect();
        assert_eq!(
            signalled,
            [r, r + 1].into(),
            "own {own}, parent {parent}: {finished:?}"
        );
        let (_, report) = finished.pop().expect("the stop ends");
        assert_eq!(report.survivors, vec![r, r + 1]);

        // A root that is the daemon's parent names nothing: not the parent, not the
        // daemon, not the daemon's children. Here the snapshot hides the chain (the
        // daemon looks orphaned), so only the identity recorded at start protects it.
        if parent > INIT_PID {
            let (mut stopper, sent) = recording_stopper(0, 0);
            let parent_id = ProcId {
                pid: parent,
                start_ticks: parent_start,
                boot_id: boot_id(),
            };
            let mut orphaned = own_stat;
            (orphaned.ppid, orphaned.pgrp, orphaned.session) = (0, parent, parent);
            let host = vec![
                proc(parent, 1, parent, 0, parent_start),
                orphaned,
                proc(r + 2, own, r + 2, 0, parent_start + 1),
            ];
            stopper.add(job("parent", vec![parent_id], None));
            let finished = stopper.round_with(Ok(host));
            assert!(
                sent.lock().unwrap().is_empty(),
                "{:?}",
                sent.lock().unwrap()
            );
            assert_eq!(finished.len(), 1, "nothing of the run's is alive");
            assert_eq!(finished[0].1.spared, vec![parent]);
        }

        // The same through a failed scan: roots that are protected are not signalled.
        let (mut stopper, sent) = recording_stopper(0, 0);
        let me = ProcId {
            pid: own,
            start_ticks: own_stat.start_ticks,
            boot_id: boot_id(),
        };
        let init = ProcId {
            pid: 1,
            start_ticks: 0,
            boot_id: boot_id(),
        };
        stopper.add(job("blind", vec![me, init], None));
        for _ in 0..5 {
            stopper.round_with(emfile());
        }
        assert!(
            sent.lock().unwrap().is_empty(),
            "{:?}",
            sent.lock().unwrap()
        );
    }

    #[test]
    fn signal_itself_refuses_pid_1_and_kernel_threads() {
        // SIGCONT: harmless to its target even if the refusal were broken.
        let init = ProcId {
            pid: 1,
            start_ticks: stat(1).map_or(0, |s| s.start_ticks),
            boot_id: boot_id(),
        };
        assert_eq!(signal(&init, Signal::CONT), Signalled::Protected);
        let all = scan().unwrap();
        assert!(all.iter().any(|s| s.pid == std::process::id() as i32));
        if let Some(k) = all.iter().find(|s| s.flags & PF_KTHREAD != 0) {
            let id = ProcId {
                pid: k.pid,
                start_ticks: k.start_ticks,
                boot_id: boot_id(),
            };
            assert_eq!(signal(&id, Signal::CONT), Signalled::Protected);
        }
        // kthreadd as a run's root (a forged registration) names no member: neither
        // itself nor, through the parent chain, any kernel thread.
        if let Some(k) = all.iter().find(|s| s.pid == KTHREADD_PID) {
            let forged = ProcId {
                pid: k.pid,
                start_ticks: k.start_ticks,
                boot_id: boot_id(),
            };
            assert_eq!(members(&[forged], &all), Vec::new());
        }
    }

    /// P2: `cgroup.kill` is what ends a group whose processes per-pid signals cannot
    /// reach (a tree that hops to a new pid at every fork outruns them). Real group,
    /// real processes; only the per-pid signaller is replaced by one that never lands.
    #[test]
    fn the_cgroup_kill_ends_a_group_that_per_pid_signals_miss() {
        const TEST: &str = "the_cgroup_kill_ends_a_group_that_per_pid_signals_miss";
        let name = format!("unit-{}", std::process::id());
        let Some(base) = crate::testing::cgroup_base(TEST, &name) else {
            return;
        };
        let group = cgroup::Group::create(&base, "g").unwrap();
        let mut children: Vec<std::process::Child> = (0..3)
            .map(|_| {
                std::process::Command::new("sleep")
                    .arg("3600")
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .spawn()
                    .unwrap()
            })
            .collect();
        for c in &children {
            group.add(c.id() as i32).unwrap();
        }
        let (mut stopper, sent) = recording_stopper(0, 2_000);
        stopper.add(StopJob {
            key: "g".into(),
            roots: Vec::new(),
            group: Some(cgroup::Group::open(group.path.clone())),
            grace_ms: Some(0),
        });
        let end = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let report = loop {
            let mut done = stopper.round();
            if let Some((_, r)) = done.pop() {
                break r;
            }
            assert!(std::time::Instant::now() < end, "the stop never finished");
            std::thread::sleep(std::time::Duration::from_millis(STOP_ROUND_MS));
        };
        // Every child was signalled pid by pid (and nothing landed) ...
        let signalled: std::collections::BTreeSet<i32> =
            sent.lock().unwrap().iter().map(|(p, _)| *p).collect();
        for c in &children {
            assert!(signalled.contains(&(c.id() as i32)));
        }
        // ... yet the group is empty and the stop clean: the group kill did it.
        let gone = children.iter_mut().all(|c| {
            let end = std::time::Instant::now() + std::time::Duration::from_secs(3);
            loop {
                if c.try_wait().unwrap().is_some() {
                    break true;
                }
                if std::time::Instant::now() > end {
                    let _ = c.kill();
                    let _ = c.wait();
                    break false;
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        });
        assert!(report.ok(), "{report:?}");
        assert!(gone, "a process of the group outlived its stop");
        assert!(!group.populated().unwrap());
        group.remove().unwrap();
        let _ = std::fs::remove_dir(&base);
    }
}
