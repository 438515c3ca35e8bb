//! The registration rule (S3): which processes a token holder may make berth stop.
//!
//! Registering a process with a run gives berth the duty to signal it (and its process
//! group, session and descendants: the fallback's membership rule) when the run ends.
//! So a registration must never let a caller make berth signal a process they could
//! not signal themselves, nor turn berth against itself or another run:
//!
//! 1. `pid_forbidden`: pid 1, kernel threads, thread ids (only whole processes are
//!    registered: a thread id would move the whole process into the run's cgroup),
//!    the daemon, its ancestors, and the leaders of the daemon's process group and
//!    session (their group and session contain the daemon itself).
//! 2. `pid_not_owned`: the caller acts for a uid (the admin token and tokens made
//!    without `uid` act for the daemon's own user; a token made with `uid` acts for
//!    that user). That uid must be able to signal the process by the kernel's own rule
//!    for an unprivileged sender: it is the process's real or saved uid. uid 0 may
//!    register any process that rule 1 and rule 3 allow.
//! 3. `pid_owned_by_run`: a process whose stop would reach another live run's
//!    registered root: that root itself, its ancestor, or the leader of its process
//!    group or session. (A descendant of another run's root is allowed: see below.)
//!
//! Every read here is of `/proc`; none can block. A read that fails refuses the
//! registration (the caller may retry): could not look is never allowed.

use berth_proc::ProcId;

/// Longest parent chain followed; real chains are a few dozen long.
const ANCESTRY_DEPTH_MAX: usize = 4_096;

/// Why a registration was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    Forbidden(String),
    NotOwned(String),
    OwnedByRun {
        run_id: String,
    },
    /// `/proc` could not be read for it: refused, never assumed.
    CouldNotLook(String),
    NoSuchProcess,
}

/// What the rule needs to know about the daemon, read once at start.
#[derive(Clone, Debug)]
pub struct Me {
    pub pid: i32,
    pub uid: u32,
    /// The daemon's ancestors (parent first) at start. Checked again per registration.
    pub ancestors: Vec<i32>,
    pub pgrp: i32,
    pub session: i32,
}

impl Me {
    pub fn now() -> Me {
        let pid = std::process::id() as i32;
        let (pgrp, session) = berth_proc::stat(pid)
            .map(|s| (s.pgrp, s.session))
            .unwrap_or((pid, pid));
        Me {
            pid,
            uid: rustix::process::geteuid().as_raw(),
            ancestors: ancestors(pid),
            pgrp,
            session,
        }
    }
}

/// The parent chain of `pid` (parent first), read from `/proc`, bounded.
pub fn ancestors(pid: i32) -> Vec<i32> {
    let mut out = Vec::new();
    let mut p = pid;
    while out.len() < ANCESTRY_DEPTH_MAX {
        let Ok(s) = berth_proc::stat(p) else { break };
        if s.ppid <= 0 || out.contains(&s.ppid) {
            break;
        }
        out.push(s.ppid);
        p = s.ppid;
    }
    out
}

/// The lines of `/proc/<pid>/status` the rule reads.
#[derive(Debug, PartialEq, Eq)]
pub struct Status {
    pub tgid: i32,
    /// Real, effective, saved, file-system uid.
    pub uids: [u32; 4],
}

pub fn parse_status(text: &str) -> Option<Status> {
    let mut tgid = None;
    let mut uids = None;
    for line in text.lines() {
        if let Some(v) = line.strip_prefix("Tgid:") {
            tgid = v.trim().parse().ok();
        } else if let Some(v) = line.strip_prefix("Uid:") {
            let u: Vec<u32> = v
                .split_whitespace()
                .filter_map(|x| x.parse().ok())
                .collect();
            if u.len() == 4 {
                uids = Some([u[0], u[1], u[2], u[3]]);
            }
        }
    }
    Some(Status {
        tgid: tgid?,
        uids: uids?,
    })
}

fn status(pid: i32) -> Result<Status, Refusal> {
    match std::fs::read_to_string(format!("/proc/{pid}/status")) {
        Ok(t) => parse_status(&t)
            .ok_or_else(|| Refusal::CouldNotLook(format!("/proc/{pid}/status is malformed"))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(Refusal::NoSuchProcess),
        Err(e) => Err(Refusal::CouldNotLook(format!("/proc/{pid}/status: {e}"))),
    }
}

/// A live run's registered roots, for rule 3.
pub struct OtherRun<'a> {
    pub run_id: &'a str,
    pub roots: Vec<ProcId>,
}

/// Applies rules 1–3 to `pid` for a caller acting as `uid`; returns the identity to
/// record.
pub fn check(me: &Me, uid: u32, pid: i32, others: &[OtherRun<'_>]) -> Result<ProcId, Refusal> {
    // A check that takes its time (a deep tree, a slow `/proc`): with `pause`, one that
    // never ends. It must cost only the registration that asked (issue 32 finding 7).
    crate::failpoint::hit("registration-check");
    let forbidden = |why: &str| Err(Refusal::Forbidden(format!("pid {pid} is {why}")));
    if pid <= 1 {
        return forbidden("init (or not a process id)");
    }
    if pid == me.pid {
        return forbidden("the berth daemon itself");
    }
    let st = match berth_proc::stat(pid) {
        Ok(s) => s,
        Err(berth_proc::ProcError::NoSuchProcess { .. }) => return Err(Refusal::NoSuchProcess),
        Err(e) => return Err(Refusal::CouldNotLook(e.to_string())),
    };
    if st.state == 'Z' || st.state == 'X' {
        return Err(Refusal::NoSuchProcess);
    }
    // Kernel threads have no user space to stop; signalling kthreadd's children is how
    // a run once degraded forever (pid 2: 59 kernel threads signalled).
    if berth_proc::is_kernel_thread(&st) {
        return forbidden("a kernel thread");
    }
    let status = status(pid)?;
    if let Some(why) = part_of_berth(me, pid, status.tgid) {
        return forbidden(&why);
    }
    // Rule 2: the kernel lets an unprivileged sender signal a process whose real or
    // saved uid is its own.
    let [real, _effective, saved, _fs] = status.uids;
    if uid != 0 && uid != real && uid != saved {
        return Err(Refusal::NotOwned(format!(
            "pid {pid} belongs to uid {real}; this token acts for uid {uid}"
        )));
    }
    // Rule 3: stopping `pid`'s tree must not reach another run's root. It would if
    // `pid` were that root, its ancestor (descendants are stopped with a root), or the
    // leader of its process group or session (the fallback stops groups and sessions).
    // A descendant of another run's root is allowed: a `berth run` inside a run (an
    // agent running its tests under berth) registers its command, which lives in the
    // outer run's tree; stopping the inner run stops only that subtree, and stopping
    // the outer run stops both, as it should. One scan of `/proc`, walked once
    // (issue 32 finding 7: each root's chain read from `/proc` step by step made a
    // registration cost the sum of every other run's depth).
    if !others.is_empty() {
        let all = berth_proc::scan().map_err(|e| Refusal::CouldNotLook(e.to_string()))?;
        if let Some(run_id) = reaches_other_run(pid, others, &all).0 {
            return Err(Refusal::OwnedByRun {
                run_id: run_id.to_string(),
            });
        }
    }
    Ok(ProcId {
        pid,
        start_ticks: st.start_ticks,
        boot_id: berth_proc::boot_id(),
    })
}

/// Rule 1's relatives of the daemon: a thread rather than a process, a thread of the
/// daemon, the leader of its group or session, one of its ancestors (read again now:
/// the daemon may have been re-parented since it started). What `pid` is, if so.
fn part_of_berth(me: &Me, pid: i32, tgid: i32) -> Option<String> {
    if tgid != pid {
        return Some(format!("a thread of process {tgid}, not a process"));
    }
    if tgid == me.pid {
        return Some("a thread of the berth daemon".into());
    }
    if pid == me.pgrp || pid == me.session {
        return Some("the leader of the berth daemon's process group or session".into());
    }
    if me.ancestors.contains(&pid) || ancestors(me.pid).contains(&pid) {
        return Some("an ancestor of the berth daemon".into());
    }
    None
}

/// Rule 3 over one reading of `/proc` (pure): the run whose live root `pid`'s tree
/// would reach (`pid` is the root, its process group or session leader, or its
/// ancestor), if any, and how many processes were looked at. Chains shared by several
/// roots are walked once: whatever the depth, at most every process once plus each
/// root (issue 32 finding 7).
pub fn reaches_other_run<'a>(
    pid: i32,
    others: &[OtherRun<'a>],
    all: &[berth_proc::Stat],
) -> (Option<&'a str>, usize) {
    let by_pid: std::collections::HashMap<i32, &berth_proc::Stat> =
        all.iter().map(|s| (s.pid, s)).collect();
    let mut seen = std::collections::HashSet::new();
    let mut steps = 0;
    for o in others {
        for r in &o.roots {
            steps += 1;
            // A root that is gone: its pid is someone else's now (P3).
            let Some(rs) = by_pid
                .get(&r.pid)
                .filter(|s| s.start_ticks == r.start_ticks)
            else {
                continue;
            };
            if pid == r.pid || pid == rs.pgrp || pid == rs.session {
                return (Some(o.run_id), steps);
            }
            let mut p = rs.ppid;
            while p > 0 && seen.insert(p) {
                steps += 1;
                if p == pid {
                    return (Some(o.run_id), steps);
                }
                p = by_pid.get(&p).map_or(0, |s| s.ppid);
            }
        }
    }
    (None, steps)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(pid: i32, ppid: i32) -> berth_proc::Stat {
        berth_proc::Stat {
            pid,
            state: 'S',
            ppid,
            pgrp: pid,
            session: pid,
            flags: 0,
            start_ticks: pid as u64,
        }
    }

    fn root(pid: i32) -> ProcId {
        ProcId {
            pid,
            start_ticks: pid as u64,
            boot_id: String::new(),
        }
    }

    /// Issue 32 finding 7: 20 roots at the bottom of a 1,500-deep chain made an
    /// unrelated registration read 30,000 `/proc` entries on the state task. The rule
    /// now looks at each process at most once: the cost is the host's process count,
    /// not the sum of every run's depth; and the answer is the same.
    #[test]
    fn finding_7_rule_3_looks_at_each_process_once_whatever_the_depth() {
        const DEPTH: i32 = 1_500;
        // A chain 10 -> 11 -> ... -> 1509, and 20 roots under its bottom.
        let mut all: Vec<_> = (10..10 + DEPTH).map(|p| st(p, p - 1)).collect();
        all.push(st(9, 1));
        let bottom = 10 + DEPTH - 1;
        all.extend((0..20).map(|i| st(5_000 + i, bottom)));
        all.push(st(7_000, 1)); // unrelated
        let roots: Vec<ProcId> = (0..20).map(|i| root(5_000 + i)).collect();
        let others = [OtherRun {
            run_id: "deep",
            roots,
        }];
        let (hit, steps) = reaches_other_run(7_000, &others, &all);
        assert_eq!(hit, None);
        assert!(
            steps <= all.len() + 20,
            "{steps} steps for {} processes",
            all.len()
        );
        // An ancestor anywhere up the chain reaches them; a root itself too.
        assert_eq!(reaches_other_run(500, &others, &all).0, Some("deep"));
        assert_eq!(reaches_other_run(9, &others, &all).0, Some("deep"));
        assert_eq!(reaches_other_run(5_003, &others, &all).0, Some("deep"));
        // A root whose pid was reused (another start time) protects nothing.
        let stale = [OtherRun {
            run_id: "gone",
            roots: vec![ProcId {
                start_ticks: 1,
                ..root(5_000)
            }],
        }];
        assert_eq!(reaches_other_run(500, &stale, &all).0, None);
    }

    #[test]
    fn status_lines_parse() {
        let t =
            "Name:\tsleep\nTgid:\t42\nPid:\t43\nUid:\t1000\t1001\t1002\t1003\nGid:\t1\t1\t1\t1\n";
        assert_eq!(
            parse_status(t),
            Some(Status {
                tgid: 42,
                uids: [1000, 1001, 1002, 1003]
            })
        );
        assert_eq!(parse_status("Tgid:\t1\n"), None);
    }

    #[test]
    fn the_daemon_its_parent_and_init_are_refused() {
        let me = Me::now();
        let mine = me.uid;
        for pid in [1, me.pid, me.ancestors[0]] {
            assert!(
                matches!(check(&me, mine, pid, &[]), Err(Refusal::Forbidden(_))),
                "pid {pid}"
            );
        }
        // A thread id of this process, kept alive while it is checked.
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            tx.send(rustix::thread::gettid().as_raw_nonzero().get())
                .unwrap();
            let _ = done_rx.recv();
        });
        let tid = rx.recv().unwrap();
        assert_ne!(tid, me.pid);
        let r = check(&me, mine, tid, &[]);
        done_tx.send(()).unwrap();
        t.join().unwrap();
        assert!(matches!(r, Err(Refusal::Forbidden(_))), "{r:?}");
    }

    #[test]
    fn a_child_is_allowed_for_its_owner_and_refused_for_another_uid_or_run() {
        let me = Me::now();
        let mut child = std::process::Command::new("sleep")
            .arg("600")
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        let id = check(&me, me.uid, pid, &[]).expect("own child");
        assert_eq!(id.pid, pid);
        let other_uid = if me.uid == 0 { 4242 } else { me.uid + 1 };
        assert!(matches!(
            check(&me, other_uid, pid, &[]),
            Err(Refusal::NotOwned(_))
        ));
        let other = OtherRun {
            run_id: "r1",
            roots: vec![id.clone()],
        };
        assert_eq!(
            check(&me, me.uid, pid, std::slice::from_ref(&other)),
            Err(Refusal::OwnedByRun {
                run_id: "r1".into()
            })
        );
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(check(&me, me.uid, pid, &[]), Err(Refusal::NoSuchProcess));
    }
}
