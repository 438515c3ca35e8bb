//! berth-proc: knowing exactly which processes belong to a run, and stopping exactly
//! those (SPEC section 7).
//!
//! - [`ProcId`]: a process is (pid, start time, boot id), never a pid alone (P1).
//!   [`signal`] opens a pidfd, re-checks the start time through it, and only then
//!   signals: a recycled pid can never be hit (P3).
//! - [`members`]: the pure rule that decides which live processes belong to a run in
//!   the process-group fallback.
//! - [`cgroup`]: a cgroup v2 group per run where the host allows it.
//! - [`StopPlan`]: the pure TERM → grace → KILL → proven-gone decision (P2).

pub mod cgroup;
mod stop;

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
    pub start_ticks: u64,
}

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
        start_ticks: rest.get(19)?.parse().ok()?,
    })
}

pub fn stat(pid: i32) -> Result<Stat, ProcError> {
    let line = std::fs::read_to_string(format!("/proc/{pid}/stat")).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
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
}

pub fn liveness(id: &ProcId, boot: &str) -> Liveness {
    if id.boot_id != boot {
        return Liveness::Gone;
    }
    match stat(id.pid) {
        Ok(st) if st.start_ticks != id.start_ticks => Liveness::Reused,
        Ok(st) if st.state == 'Z' || st.state == 'X' => Liveness::Gone,
        Ok(_) => Liveness::Alive,
        Err(_) => Liveness::Gone,
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
}

/// Sends `sig` to exactly the process `id`: a pidfd is opened first, then the start
/// time is checked again (a pidfd pins the process, so the check cannot go stale),
/// and only then the signal goes through the pidfd.
pub fn signal(id: &ProcId, sig: Signal) -> Signalled {
    let Some(pid) = Pid::from_raw(id.pid) else {
        return Signalled::Gone;
    };
    let fd: OwnedFd = match rustix::process::pidfd_open(pid, PidfdFlags::empty()) {
        Ok(fd) => fd,
        Err(_) => return Signalled::Gone,
    };
    match stat(id.pid) {
        Ok(st) if st.start_ticks != id.start_ticks => return Signalled::Reused,
        Ok(_) => {}
        Err(_) => return Signalled::Gone,
    }
    match rustix::process::pidfd_send_signal(&fd, sig) {
        Ok(()) => Signalled::Sent,
        Err(rustix::io::Errno::PERM) => Signalled::Denied,
        Err(_) => Signalled::Gone,
    }
}

/// Every process on the host, as `/proc` shows it now.
pub fn scan() -> Vec<Stat> {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| stat(pid).ok())
        .collect()
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
        if (in_group || is_root) && s.state != 'Z' {
            member.insert(s.pid, *s);
        }
    }
    // Descendants by parent chain, to a fixed point (bounded by the process count).
    loop {
        let before = member.len();
        for s in all {
            if s.state != 'Z' && !member.contains_key(&s.pid) {
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
    /// Pids still alive when the stop gave up.
    pub survivors: Vec<i32>,
}

impl StopReport {
    pub fn ok(&self) -> bool {
        self.survivors.is_empty()
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
}

/// Stops many runs at once: each round takes one `/proc` scan for all of them, so a
/// thousand expired runs cost a thousand membership checks, not a thousand scans.
pub struct Stopper {
    boot: String,
    grace_ms: u64,
    kill_wait_ms: u64,
    active: Vec<Active>,
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
        });
    }

    /// One round: signal what the plans say, and return the stops that finished.
    pub fn round(&mut self) -> Vec<(String, StopReport)> {
        let all = scan();
        let mut finished = Vec::new();
        let mut i = 0;
        while i < self.active.len() {
            let a = &mut self.active[i];
            // Everything that belongs to the run right now, each with its identity.
            let mut alive: std::collections::BTreeMap<i32, ProcId> = members(&a.job.roots, &all)
                .into_iter()
                .map(|s| {
                    (
                        s.pid,
                        ProcId {
                            pid: s.pid,
                            start_ticks: s.start_ticks,
                            boot_id: self.boot.clone(),
                        },
                    )
                })
                .collect();
            if let Some(g) = &a.job.group {
                for pid in g.pids() {
                    if let Ok(id) = identify(pid) {
                        alive.entry(pid).or_insert(id);
                    }
                }
            }
            let populated = a.job.group.as_ref().is_some_and(|g| g.populated());
            let now = a.started.elapsed().as_millis() as u64;
            let done = match a.plan.next(now, !alive.is_empty() || populated) {
                StopAction::Term => {
                    for id in alive.values() {
                        if signal(id, Signal::TERM) == Signalled::Sent {
                            a.signalled.insert(id.clone());
                        }
                    }
                    false
                }
                StopAction::Kill => {
                    if let Some(g) = &a.job.group {
                        let _ = g.kill();
                    }
                    for id in alive.values() {
                        if signal(id, Signal::KILL) == Signalled::Sent {
                            a.signalled.insert(id.clone());
                        }
                    }
                    false
                }
                StopAction::Wait => false,
                StopAction::Done => true,
                StopAction::Degraded => {
                    a.report.survivors = alive.keys().copied().collect();
                    true
                }
            };
            if done {
                let mut a = self.active.swap_remove(i);
                a.report.terminated = a.signalled.len();
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
}
