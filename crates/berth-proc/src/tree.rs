//! A run's tree in one `/proc` scan: the members of its roots, and what is never a
//! member (kernel threads, init, berth and its ancestors).

use super::*;

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
pub(super) fn can_belong(s: &Stat) -> bool {
    s.state != 'Z' && s.pid > INIT_PID && !is_kernel_thread(s)
}

/// Issue 36: what a run's processes use, from `/proc`, where it has no cgroup to say:
/// the members of its tree (`members`) summed: resident memory, cpu time (its own and
/// its waited-for children's) and tasks (threads, as `pids.current` counts them). A
/// member that exits between the scan and its read is skipped. No peak, no OOM count:
/// only a cgroup knows those.
pub fn tree_usage(roots: &[ProcId], all: &[Stat]) -> crate::limits::Usage {
    let page = rustix::param::page_size() as u64;
    let hz = rustix::param::clock_ticks_per_second().max(1);
    let (mut rss, mut ticks, mut tasks) = (0u64, 0u64, 0u64);
    for m in members(roots, all) {
        let Ok(line) = std::fs::read_to_string(format!("/proc/{}/stat", m.pid)) else {
            continue;
        };
        if let Some(f) = usage_fields(&line) {
            rss = rss.saturating_add(f.rss_pages.saturating_mul(page));
            ticks = ticks.saturating_add(f.cpu_ticks);
            tasks = tasks.saturating_add(f.threads);
        }
    }
    crate::limits::Usage {
        memory_bytes: Some(rss),
        memory_peak_bytes: None,
        oom_kills: 0,
        pids: Some(tasks),
        cpu_usec: Some(ticks.saturating_mul(1_000_000) / hz),
    }
}

/// The usage fields of one `/proc/<pid>/stat` line.
#[derive(Debug, PartialEq, Eq)]
pub struct UsageFields {
    /// utime + stime + cutime + cstime, clock ticks.
    pub cpu_ticks: u64,
    pub threads: u64,
    pub rss_pages: u64,
}

/// Parses them (fields 14-17, 20 and 24, counted from the last `)` as `parse_stat`).
pub fn usage_fields(line: &str) -> Option<UsageFields> {
    let close = line.rfind(')')?;
    let rest: Vec<&str> = line[close + 1..].split_whitespace().collect();
    let n = |field: usize| rest.get(field - 3)?.parse::<i64>().ok();
    let cpu: i64 = [14, 15, 16, 17]
        .iter()
        .map(|&f| n(f).unwrap_or(0).max(0))
        .sum();
    Some(UsageFields {
        cpu_ticks: cpu as u64,
        threads: n(20)?.max(0) as u64,
        rss_pages: n(24)?.max(0) as u64,
    })
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
