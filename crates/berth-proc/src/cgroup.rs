//! A cgroup v2 group per run, where the host allows it. The cgroup2 mount is found in
//! /proc/self/mountinfo (it may be a hybrid `/sys/fs/cgroup/unified` without
//! controllers: berth needs none, only `cgroup.procs`, `cgroup.kill` and
//! `cgroup.events`). Groups live under `<mount><own cgroup>/berth/<instance>/`, where
//! the instance names one daemon's state (two daemons on a host, or two tests, must
//! never share a run's group: stopping one would kill the other's processes).

use std::path::{Path, PathBuf};

/// The cgroup2 mount point, if any.
pub fn mount() -> Option<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    text.lines().find_map(|l| {
        let (left, right) = l.split_once(" - ")?;
        if right.split_whitespace().next()? == "cgroup2" {
            Some(PathBuf::from(left.split_whitespace().nth(4)?))
        } else {
            None
        }
    })
}

/// Where the run groups of daemon `instance` go, if berth may create groups there.
pub fn base(instance: &str) -> Option<PathBuf> {
    let mount = mount()?;
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let rel = own
        .lines()
        .find_map(|l| l.strip_prefix("0::"))?
        .trim_start_matches('/')
        .to_string();
    let base = mount.join(rel).join("berth").join(instance);
    std::fs::create_dir_all(&base).ok()?;
    // Can we make and remove a group here? (Read-only or undelegated trees say no.)
    let probe = base.join(format!("probe-{}", std::process::id()));
    std::fs::create_dir(&probe).ok()?;
    let ok = probe.join("cgroup.procs").exists() && probe.join("cgroup.kill").exists();
    let _ = std::fs::remove_dir(&probe);
    ok.then_some(base)
}

pub struct Group {
    pub path: PathBuf,
}

impl Group {
    pub fn create(base: &Path, name: &str) -> std::io::Result<Group> {
        let path = base.join(name);
        match std::fs::create_dir(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        Ok(Group { path })
    }

    pub fn open(path: PathBuf) -> Group {
        Group { path }
    }

    /// Moves a process (and, from then on, its new children) into the group.
    pub fn add(&self, pid: i32) -> std::io::Result<()> {
        std::fs::write(self.path.join("cgroup.procs"), pid.to_string())
    }

    pub fn pids(&self) -> Vec<i32> {
        std::fs::read_to_string(self.path.join("cgroup.procs"))
            .map(|t| t.lines().filter_map(|l| l.trim().parse().ok()).collect())
            .unwrap_or_default()
    }

    /// `cgroup.events` says `populated 0` once every process in it has exited.
    pub fn populated(&self) -> bool {
        std::fs::read_to_string(self.path.join("cgroup.events"))
            .map(|t| t.lines().any(|l| l.trim() == "populated 1"))
            .unwrap_or(false)
    }

    /// SIGKILL to every process in the group, atomically (kernel 5.14+).
    pub fn kill(&self) -> std::io::Result<()> {
        std::fs::write(self.path.join("cgroup.kill"), "1")
    }

    /// Removes the (empty) group.
    pub fn remove(&self) -> std::io::Result<()> {
        match std::fs::remove_dir(&self.path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            r => r,
        }
    }
}
