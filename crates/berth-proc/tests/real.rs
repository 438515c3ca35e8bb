//! Real processes, real signals: identity, pidfd signalling, PID-reuse protection,
//! process-group membership and stopping trees (with and without cgroups).

use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use berth_proc::{
    cgroup, identify, liveness, members, scan, signal, stop, Liveness, ProcId, Signalled,
};
use rustix::process::Signal;

fn alive(pid: i32) -> bool {
    berth_proc::stat(pid)
        .map(|s| s.state != 'Z')
        .unwrap_or(false)
}

fn wait_gone(pids: &[i32], within: Duration) -> bool {
    let end = Instant::now() + within;
    while Instant::now() < end {
        if pids.iter().all(|p| !alive(*p)) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// Spawns `sh -c script` as a process-group leader; it prints child pids one per line
/// into `out`.
fn tree(script: &str) -> std::process::Child {
    Command::new("sh")
        .arg("-c")
        .arg(script)
        .process_group(0)
        .stdout(Stdio::null())
        .spawn()
        .unwrap()
}

fn read_pids(path: &std::path::Path, n: usize) -> Vec<i32> {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let v: Vec<i32> = std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect();
        if v.len() >= n || Instant::now() > end {
            return v;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_reused_pid_is_never_signalled() {
    let mut child = Command::new("sleep").arg("30").spawn().unwrap();
    let id = identify(child.id() as i32).unwrap();
    // The same pid with another start time: the ledger's process is gone and the pid
    // belongs to someone else now.
    let stranger = ProcId {
        start_ticks: id.start_ticks + 1,
        ..id.clone()
    };
    assert_eq!(liveness(&stranger, &id.boot_id), Liveness::Reused);
    assert_eq!(signal(&stranger, Signal::KILL), Signalled::Reused);
    assert!(alive(id.pid), "the unrelated process must be untouched");
    let report = stop(&[stranger], None, 100, 100);
    assert_eq!(report.reused_pids_protected, 1);
    assert!(alive(id.pid));
    assert_eq!(signal(&id, Signal::KILL), Signalled::Sent);
    child.wait().unwrap();
    assert_eq!(liveness(&id, &id.boot_id), Liveness::Gone);
}

#[test]
fn the_fallback_stops_a_term_ignoring_three_generation_tree_with_a_setsid_grandchild() {
    let dir = tempfile::tempdir().unwrap();
    let pids = dir.path().join("pids");
    let p = pids.display();
    // child ignores TERM; grandchild; a grandchild that calls setsid (its parent stays).
    let script = format!(
        "trap '' TERM; (trap '' TERM; sleep 60 & echo $! >> {p}; (sleep 60 & echo $! >> {p}; wait) & wait) & \
         setsid sh -c 'echo $$ >> {p}; exec sleep 60' & echo $$ >> {p}; wait"
    );
    let mut root = tree(&script);
    let all = read_pids(&pids, 4);
    assert_eq!(all.len(), 4, "{all:?}");
    let id = identify(root.id() as i32).unwrap();
    let inside: Vec<i32> = members(std::slice::from_ref(&id), &scan().unwrap())
        .iter()
        .map(|s| s.pid)
        .collect();
    for p in &all {
        assert!(inside.contains(p), "{p} not seen as a member: {inside:?}");
    }
    let report = stop(&[id], None, 300, 3000);
    assert!(report.ok(), "{report:?}");
    let _ = root.wait();
    assert!(
        wait_gone(&all, Duration::from_secs(3)),
        "survivors among {all:?}"
    );
}

#[test]
fn the_fallback_misses_a_double_forked_daemon_and_a_cgroup_catches_it() {
    let dir = tempfile::tempdir().unwrap();
    let pids = dir.path().join("pids");
    let p = pids.display();
    // A double fork: the middle process exits at once, the daemon calls setsid and is
    // reparented to init — outside the group, the session and the parent chain.
    let script = format!("setsid sh -c 'echo $$ >> {p}; exec sleep 60' & exit 0");
    let daemon_pid = {
        let mut root = tree(&script);
        root.wait().unwrap();
        let v = read_pids(&pids, 1);
        v[0]
    };
    // Documented limit: nothing ties the daemon to the run without a cgroup.
    assert!(alive(daemon_pid));
    let d = identify(daemon_pid).unwrap();
    signal(&d, Signal::KILL);
    assert!(wait_gone(&[daemon_pid], Duration::from_secs(3)));

    let Some(base) = berth_proc::testing::cgroup_base(
        "the cgroup half of this test",
        &format!("test-{}", std::process::id()),
    ) else {
        return;
    };
    let group = cgroup::Group::create(&base, &format!("test-{}", std::process::id())).unwrap();
    std::fs::remove_file(&pids).ok();
    // Start the tree inside the group (as `berth serve` does for registered runs): the
    // shell is moved in first, so everything it forks lands there too.
    let mut root = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "read go; setsid sh -c 'echo $$ >> {p}; exec sleep 60' & exit 0"
        ))
        .process_group(0)
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    group.add(root.id() as i32).unwrap();
    use std::io::Write;
    writeln!(root.stdin.take().unwrap(), "go").unwrap();
    root.wait().unwrap();
    let daemon = read_pids(&pids, 1)[0];
    assert!(
        group.pids().unwrap().contains(&daemon),
        "the escaped daemon is still in the cgroup"
    );
    let report = stop(
        &[],
        Some(cgroup::Group::open(group.path.clone())),
        200,
        3000,
    );
    assert!(report.ok(), "{report:?}");
    assert!(!group.populated().unwrap());
    assert!(wait_gone(&[daemon], Duration::from_secs(3)));
    group.remove().unwrap();
}
