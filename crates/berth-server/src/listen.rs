//! C6: analysis runs may not listen. One thread watches every analysis run that has
//! processes: each round (`LISTEN_POLL_MS`) it scans `/proc` once, reads the host's
//! listening sockets once (`/proc/net/tcp{,6}`, and UDP sockets bound unconnected on
//! a port outside the ephemeral range from `/proc/net/udp{,6}`), and for every process of every watched
//! run looks at the sockets it holds. A listening socket that was not in the run's
//! baseline (what its processes held when they were registered) is a violation,
//! reported to the daemon, which stops the run.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

use berth_proc::ProcId;

use crate::tell::Tell;

/// C6: an analysis run under watch for listeners: its registered roots, and the
/// listening sockets its processes already held when they were registered.
#[derive(Clone, Debug, PartialEq)]
pub struct ListenWatch {
    pub run_id: String,
    pub roots: Vec<ProcId>,
    pub baseline: std::collections::BTreeSet<u64>,
}

/// Between rounds: a listener is seen, and its run stopped, within about this long.
pub const LISTEN_POLL_MS: u64 = 200;

/// A listener an analysis run opened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    pub pid: i32,
    pub port: u16,
    pub cmdline: String,
}

/// The listening sockets the processes of `roots` (and of the cgroup at `group`)
/// hold, by inode.
pub fn listeners_of(roots: &[ProcId], group: &[i32]) -> std::io::Result<BTreeSet<u64>> {
    let all = berth_proc::scan()?;
    let listening = berth_proc::net::listening_any()?;
    Ok(held(&pids_of(roots, group, &all), &listening)
        .into_keys()
        .collect())
}

fn pids_of(roots: &[ProcId], group: &[i32], all: &[berth_proc::Stat]) -> BTreeSet<i32> {
    let mut pids: BTreeSet<i32> = berth_proc::members(roots, all)
        .iter()
        .map(|s| s.pid)
        .collect();
    pids.extend(group.iter().copied().filter(|p| *p > 1));
    pids
}

/// The listening sockets `pids` hold: inode → (pid, port).
fn held(pids: &BTreeSet<i32>, listening: &BTreeMap<u64, u16>) -> BTreeMap<u64, (i32, u16)> {
    let mut out = BTreeMap::new();
    for &pid in pids {
        for inode in berth_proc::net::sockets_of(pid).unwrap_or_default() {
            if let Some(&port) = listening.get(&inode) {
                out.insert(inode, (pid, port));
            }
        }
    }
    out
}

/// Who holds the listener a run's port was proven ready on (C3 evidence, issue 32
/// finding 5: a stranger bound the run's port, the run's server died with `Address
/// already in use`, and the stranger's answer promoted the project).
#[derive(Debug, PartialEq, Eq)]
pub enum PortHolder {
    /// A process of the launched command's tree (or of the run's cgroup) holds it.
    TheRun,
    /// Another process: its pid and command line, if this user may see its sockets.
    Stranger(Option<(i32, String)>),
}

/// Whose is the listener on `port`: the tree of `root` (the launched command) and the
/// pids of the run's cgroup count as the run's. Reads `/proc` once; a stranger is
/// looked for only when the run holds none.
pub fn port_holder(root: i32, group: &[i32], port: u16) -> std::io::Result<PortHolder> {
    let listening = berth_proc::net::listening()?;
    let wanted: BTreeSet<u64> = listening
        .iter()
        .filter(|(_, &p)| p == port)
        .map(|(&inode, _)| inode)
        .collect();
    let all = berth_proc::scan()?;
    let roots: Vec<ProcId> = berth_proc::identify(root).into_iter().collect();
    let ours = pids_of(&roots, group, &all);
    let holds = |pid: i32| {
        berth_proc::net::sockets_of(pid)
            .unwrap_or_default()
            .iter()
            .any(|i| wanted.contains(i))
    };
    if ours.iter().any(|&pid| holds(pid)) {
        return Ok(PortHolder::TheRun);
    }
    let stranger = all
        .iter()
        .map(|s| s.pid)
        .find(|&pid| !ours.contains(&pid) && holds(pid))
        .map(|pid| (pid, berth_proc::net::cmdline(pid)));
    Ok(PortHolder::Stranger(stranger))
}

/// The first listener of `w`'s processes that is not in its baseline (pure over what
/// was read).
pub fn violation(baseline: &BTreeSet<u64>, held: &BTreeMap<u64, (i32, u16)>) -> Option<(i32, u16)> {
    held.iter()
        .find(|(inode, _)| !baseline.contains(inode))
        .map(|(_, &(pid, port))| (pid, port))
}

/// Starts the watcher thread; it takes the latest watch set from the returned sender
/// and reports violations on `inbox`.
pub fn spawn_watcher(
    cgroup_base: Option<PathBuf>,
    inbox: Option<Tell<(String, Violation)>>,
) -> std::sync::mpsc::Sender<Vec<ListenWatch>> {
    let (tx, rx) = std::sync::mpsc::channel::<Vec<ListenWatch>>();
    std::thread::Builder::new()
        .name("berth-listen".into())
        .spawn(move || {
            let mut watched: Vec<ListenWatch> = Vec::new();
            loop {
                let next = if watched.is_empty() {
                    rx.recv().ok()
                } else {
                    match rx.recv_timeout(Duration::from_millis(LISTEN_POLL_MS)) {
                        Ok(w) => Some(w),
                        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => None,
                        Err(_) => return,
                    }
                };
                if let Some(w) = next {
                    watched = w;
                    // Only the latest set matters.
                    while let Ok(w) = rx.try_recv() {
                        watched = w;
                    }
                } else if watched.is_empty() {
                    return;
                }
                for (run_id, v) in round(&watched, cgroup_base.as_ref()) {
                    watched.retain(|w| w.run_id != run_id);
                    if let Some(inbox) = &inbox {
                        inbox.send((run_id, v));
                    }
                }
            }
        })
        .expect("spawn listener watcher thread");
    tx
}

/// One round over every watched run: one `/proc` scan, one read of the listening
/// sockets. A round whose reads fail finds nothing (it is tried again next round).
fn round(watched: &[ListenWatch], cgroup_base: Option<&PathBuf>) -> Vec<(String, Violation)> {
    let (Ok(all), Ok(listening)) = (berth_proc::scan(), berth_proc::net::listening_any()) else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for w in watched {
        let group: Vec<i32> = cgroup_base
            .map(|b| b.join(crate::workspace::dir_name(&w.run_id)))
            .filter(|p| p.exists())
            .and_then(|p| berth_proc::cgroup::Group::open(p).pids().ok())
            .unwrap_or_default();
        let held = held(&pids_of(&w.roots, &group, &all), &listening);
        if let Some((pid, port)) = violation(&w.baseline, &held) {
            let cmdline = berth_proc::net::cmdline(pid);
            found.push((w.run_id.clone(), Violation { pid, port, cmdline }));
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_listener_outside_the_baseline_is_a_violation() {
        let held = BTreeMap::from([(10, (100, 8080)), (11, (101, 9090))]);
        assert_eq!(violation(&BTreeSet::from([10, 11]), &held), None);
        assert_eq!(violation(&BTreeSet::from([10]), &held), Some((101, 9090)));
        assert_eq!(violation(&BTreeSet::new(), &BTreeMap::new()), None);
    }
}
