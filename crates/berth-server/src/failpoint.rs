//! Named crash points (cargo feature `failpoints`, off by default). With the feature,
//! `BERTH_FAILPOINT=name[,name...]` makes the process abort the first time it passes
//! one of those points, as a crash there would. Without the feature every call is
//! empty and compiles away. `BERTH_FAILPOINT_ARM=<path>` arms the points only once
//! that file exists. `BERTH_FAILPOINT_ACTION=pause` makes the thread that reaches the
//! point stop there for good instead of aborting the process;
//! `BERTH_FAILPOINT_ACTION=hold` makes it wait there until the file named by
//! `BERTH_FAILPOINT_RELEASE` exists, then go on (a step that takes as long as the test
//! needs).
//!
//! Points: `grant-committed` (a grant is durable but not yet answered),
//! `workspace-made` (a granted run's workspace exists, its grant is not durable yet),
//! `mid-stop` (between SIGTERM and SIGKILL of a run's tree), `mid-archive` (an archive of
//! diagnostics with its first file copied and the rest not), `mid-workspace-removal`
//! (a workspace's first file deleted, after its logs were archived), `worktree-read`
//! (a blocking thread reading a worktree: with `pause`, a worktree on a hung file
//! system), `registration-check` (the registration rule's look at `/proc`).

#[cfg(feature = "failpoints")]
pub fn hit(name: &str) {
    if let Ok(v) = std::env::var("BERTH_FAILPOINT") {
        // With BERTH_FAILPOINT_ARM=<path>, only once that file exists: a test sets
        // up its scene first, then arms the crash.
        let armed = std::env::var_os("BERTH_FAILPOINT_ARM")
            .is_none_or(|p| std::path::Path::new(&p).exists());
        if armed && v.split(',').any(|n| n.trim() == name) {
            // BERTH_FAILPOINT_ACTION=pause: the thread that got here stops for good
            // instead (a step that never finishes), and everything else goes on.
            let action = std::env::var("BERTH_FAILPOINT_ACTION");
            if action.as_deref() == Ok("hold") {
                let release = std::env::var_os("BERTH_FAILPOINT_RELEASE").unwrap_or_default();
                eprintln!("berth: failpoint {name}: holding until {release:?} exists");
                while !std::path::Path::new(&release).exists() {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                return;
            }
            if action.as_deref() == Ok("pause") {
                eprintln!("berth: failpoint {name}: pausing this thread for good");
                loop {
                    std::thread::park();
                }
            }
            eprintln!("berth: failpoint {name}: aborting");
            std::process::abort();
        }
    }
}

#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub fn hit(_name: &str) {}
