//! "Could not look" is never "gone" (S4), with real descriptors: with this process's
//! file descriptors exhausted (EMFILE) a stop can neither scan `/proc` nor open a pidfd,
//! and must not report the run stopped while its process lives on. Its own test binary
//! (one process, one test): lowering the descriptor limit cannot hurt any other test.

use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};

/// Low enough to exhaust in a few opens, high enough for the test harness itself.
const STARVED_NOFILE: u64 = 64;
/// More opens than the starved limit allows: the hoarding loop always ends.
const HOARD_MAX_OPENS: usize = 4096;
/// How long a killed process may take to disappear from `/proc`.
const GONE_WITHIN_MS: u64 = 10_000;
const POLL_MS: u64 = 20;

/// Gone for good: no `/proc/<pid>/stat`, or a zombie (it runs nothing any more).
fn proven_gone(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(line) => berth_proc::parse_stat(&line).is_some_and(|s| s.state == 'Z'),
        Err(e) => e.kind() == std::io::ErrorKind::NotFound,
    }
}

fn alive(pid: i32) -> bool {
    berth_proc::stat(pid).is_ok_and(|s| s.state != 'Z')
}

/// Opens /dev/null until the descriptor table is full; the files are kept open.
fn hoard_until_emfile() -> (Vec<std::fs::File>, Option<std::io::Error>) {
    let mut hoard = Vec::new();
    for _ in 0..HOARD_MAX_OPENS {
        match std::fs::File::open("/dev/null") {
            Ok(f) => hoard.push(f),
            Err(e) => return (hoard, Some(e)),
        }
    }
    (hoard, None)
}

#[test]
fn a_stop_with_descriptors_exhausted_is_not_ok_and_the_process_lives_on_until_a_real_stop() {
    let mut child = Command::new("sleep")
        .arg("600")
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    let id = berth_proc::identify(pid).unwrap();

    let limit = getrlimit(Resource::Nofile);
    let starved = Rlimit {
        current: Some(STARVED_NOFILE.min(limit.current.unwrap_or(u64::MAX))),
        maximum: limit.maximum,
    };
    setrlimit(Resource::Nofile, starved).unwrap();
    let (hoard, why) = hoard_until_emfile();
    // Nothing below may panic before the descriptors are back: a panic message needs
    // none, but the child must be killed on every path.
    let report = berth_proc::stop(std::slice::from_ref(&id), None, 200, 200);
    drop(hoard);
    let restored = setrlimit(Resource::Nofile, limit);
    let still_alive = alive(pid);

    let starved_ok = report.ok();
    if starved_ok || !still_alive || restored.is_err() {
        let _ = child.kill();
        let _ = child.wait();
    }
    restored.unwrap();
    let why = why.expect("the descriptor table filled up");
    assert_eq!(
        why.raw_os_error(),
        Some(rustix::io::Errno::MFILE.raw_os_error()),
        "{why}"
    );
    assert!(
        !starved_ok,
        "a stop that could not look reported success: {report:?}"
    );
    assert!(report.unverified, "{report:?}");
    assert!(
        still_alive,
        "the stop could not look, yet the process is gone"
    );

    // With descriptors back, the same stop proves the process gone.
    let report = berth_proc::stop(std::slice::from_ref(&id), None, 200, 2_000);
    let end = Instant::now() + Duration::from_millis(GONE_WITHIN_MS);
    while !proven_gone(pid) && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(POLL_MS));
    }
    let gone = proven_gone(pid);
    if !gone {
        let _ = child.kill();
    }
    let _ = child.wait();
    assert!(report.ok(), "{report:?}");
    // `sleep 600` outlives the test by far: only the stop can have ended it.
    assert!(gone, "pid {pid} still runs after an ok stop");
}
