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

    /// The pids in the group. An error when `cgroup.procs` cannot be read, unless the
    /// group's directory itself is gone (then the group is empty); an unreadable list
    /// is never an empty one (S4).
    pub fn pids(&self) -> std::io::Result<Vec<i32>> {
        let Some(text) = self.read_unless_gone("cgroup.procs")? else {
            return Ok(Vec::new());
        };
        parse_pids(&text)
    }

    /// `cgroup.events` says `populated 0` once every process in it has exited. An
    /// error when it cannot be read, unless the group's directory itself is gone
    /// (then nothing is in it): "could not look" is not "empty" (S4).
    pub fn populated(&self) -> std::io::Result<bool> {
        let Some(text) = self.read_unless_gone("cgroup.events")? else {
            return Ok(false);
        };
        parse_populated(&text)
    }

    /// Reads one of the group's files; `None` when the group's directory no longer
    /// exists (removed by an earlier stop: nothing can be in it). A missing file in an
    /// existing directory, or any other failure, is an error.
    fn read_unless_gone(&self, file: &str) -> std::io::Result<Option<String>> {
        match std::fs::read_to_string(self.path.join(file)) {
            Ok(text) => Ok(Some(text)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                match std::fs::symlink_metadata(&self.path) {
                    Err(d) if d.kind() == std::io::ErrorKind::NotFound => Ok(None),
                    _ => Err(e),
                }
            }
            Err(e) => Err(e),
        }
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

/// `cgroup.procs`: one pid per line. A line that is not a pid means the read is not
/// what berth thinks it is: an error, not a shorter list.
fn parse_pids(text: &str) -> std::io::Result<Vec<i32>> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(|l| {
            l.parse().map_err(|_| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("cgroup.procs: not a pid: {l:?}"),
                )
            })
        })
        .collect()
}

/// `cgroup.events`: the `populated` line says 1 or 0; without one the answer is
/// unknown, which is an error, not "empty".
fn parse_populated(text: &str) -> std::io::Result<bool> {
    text.lines()
        .find_map(|l| match l.trim() {
            "populated 1" => Some(true),
            "populated 0" => Some(false),
            _ => None,
        })
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("cgroup.events has no populated line: {text:?}"),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unreadable_group_is_an_error_not_empty() {
        let dir = tempfile::tempdir().unwrap();
        // The group's directory exists, its files do not: could not look (S4).
        let g = Group::open(dir.path().to_path_buf());
        assert!(g.pids().is_err());
        assert!(g.populated().is_err());
        // Malformed contents are errors too.
        std::fs::write(dir.path().join("cgroup.procs"), "12\nnope\n").unwrap();
        std::fs::write(dir.path().join("cgroup.events"), "frozen 0\n").unwrap();
        assert!(g.pids().is_err());
        assert!(g.populated().is_err());
        std::fs::write(dir.path().join("cgroup.procs"), "12\n13\n").unwrap();
        std::fs::write(dir.path().join("cgroup.events"), "populated 1\nfrozen 0\n").unwrap();
        assert_eq!(g.pids().unwrap(), vec![12, 13]);
        assert!(g.populated().unwrap());
        // A group whose directory is gone is empty: nothing can be in it.
        let gone = Group::open(dir.path().join("removed"));
        assert_eq!(gone.pids().unwrap(), Vec::<i32>::new());
        assert!(!gone.populated().unwrap());
    }
}
