//! Test support shared by the crates' tests: capabilities a test needs from the host.
//!
//! A test that needs root or a writable cgroup2 tree and does not have it says why and
//! does not run; under `BERTH_REQUIRE_ROOT=1` or `BERTH_REQUIRE_CGROUPS=1` (set by
//! `.ci/run`, where both are present) it fails instead, so a CI host that loses either
//! is noticed instead of passing on silently.

/// The variable under which a missing root fails the test.
pub const REQUIRE_ROOT: &str = "BERTH_REQUIRE_ROOT";
/// The variable under which a missing writable cgroup2 tree fails the test.
pub const REQUIRE_CGROUPS: &str = "BERTH_REQUIRE_CGROUPS";

/// `test` cannot run here because of `why`: panics when `var` is `1`, else prints why.
pub fn unavailable(var: &str, test: &str, why: &str) {
    assert!(
        std::env::var(var).as_deref() != Ok("1"),
        "{test}: {var}=1 but {why}"
    );
    // Straight to the descriptor, not `eprintln!`: the test harness captures the
    // macros, and a skip must be seen in a passing run.
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "{test}: skipped: {why} (set {var}=1 to make this a failure)"
    );
}

/// Is this test root? If not, `unavailable` says so (or fails, under `REQUIRE_ROOT`).
pub fn root(test: &str) -> bool {
    let root = rustix::process::geteuid().is_root();
    if !root {
        unavailable(REQUIRE_ROOT, test, "it needs root");
    }
    root
}

/// A writable cgroup2 base for `instance` (see `cgroup::base`); if there is none,
/// `unavailable` says so (or fails, under `REQUIRE_CGROUPS`).
pub fn cgroup_base(test: &str, instance: &str) -> Option<std::path::PathBuf> {
    let base = crate::cgroup::base(instance);
    if base.is_none() {
        unavailable(
            REQUIRE_CGROUPS,
            test,
            "there is no writable cgroup2 tree here",
        );
    }
    base
}

/// Does this host have a writable cgroup2 tree berth can make groups in? If not,
/// `unavailable` says so (or fails, under `REQUIRE_CGROUPS`).
pub fn cgroups(test: &str) -> bool {
    let name = format!("probe-{}", std::process::id());
    let base = cgroup_base(test, &name);
    if let Some(b) = &base {
        let _ = std::fs::remove_dir(b);
    }
    base.is_some()
}

/// Does this host give berth the memory and pids controllers for run groups (cgroup2
/// delegated, or cgroup v1 hierarchies beside it: `cgroup::Controllers::find`)? If
/// not, `unavailable` says so (or fails, under `REQUIRE_CGROUPS`).
pub fn limits(test: &str) -> bool {
    // One name per call: tests of one process probe at once.
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = format!("probe-limits-{}-{n}", std::process::id());
    let Some(base) = cgroup_base(test, &name) else {
        return false;
    };
    let found = crate::cgroup::Controllers::find(&base, &name);
    if let Ok(c) = &found {
        c.remove_bases();
    }
    let _ = std::fs::remove_dir(&base);
    if let Err(why) = &found {
        unavailable(
            REQUIRE_CGROUPS,
            test,
            &format!("limits cannot be set here: {why}"),
        );
    }
    found.is_ok()
}
