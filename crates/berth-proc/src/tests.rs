//! berth-proc's unit tests: identity, trees and stops, on real processes.

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
    // Issue 36: the usage fields of the same line (14-17 cpu, 20 threads, 24 rss).
    assert_eq!(
        usage_fields(line),
        Some(UsageFields {
            cpu_ticks: 3,
            threads: 1,
            rss_pages: 10
        })
    );
    assert_eq!(usage_fields("1 (x) S 1"), None);
}

/// Issue 36: without a cgroup a run's use comes from its tree in `/proc`: this test's
/// own process, a root, uses memory, at least one task and some cpu.
#[test]
fn a_tree_without_a_cgroup_has_its_use_read_from_proc() {
    let me = identify(std::process::id() as i32).unwrap();
    let all = scan().unwrap();
    let u = tree_usage(std::slice::from_ref(&me), &all);
    assert!(u.memory_bytes.unwrap() > 1 << 20, "{u:?}");
    assert!(u.pids.unwrap() >= 1, "{u:?}");
    assert!(u.cpu_usec.is_some());
    assert_eq!((u.memory_peak_bytes, u.oom_kills), (None, 0));
    // A root that is gone: nothing.
    let gone = ProcId {
        pid: i32::MAX,
        start_ticks: 1,
        boot_id: me.boot_id.clone(),
    };
    assert_eq!(tree_usage(&[gone], &all).memory_bytes, Some(0));
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
