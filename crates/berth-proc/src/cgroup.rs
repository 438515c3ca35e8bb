//! A cgroup v2 group per run, where the host allows it, and the controllers that hold
//! it to its claim (`Controllers`: in the group, or in v1 hierarchies beside it). The
//! cgroup2 mount is found in /proc/self/mountinfo (it may be a hybrid
//! `/sys/fs/cgroup/unified` without controllers: grouping and stopping need none, only
//! `cgroup.procs`, `cgroup.kill`, `cgroup.events` and `cgroup.freeze`). Groups live under `<mount><own cgroup>/berth/<instance>/`, where
//! the instance names one daemon's state (two daemons on a host, or two tests, must
//! never share a run's group: stopping one would kill the other's processes).

use std::path::{Path, PathBuf};

pub use crate::limits::{Controller, Flavor, Limits, Usage};

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

/// Where the memory, pids and cpu controllers of daemon `instance`'s run groups are,
/// if berth may set limits there (issue 36): in the cgroup2 group itself (`V2`, the
/// controllers enabled down to it), or in cgroup v1 hierarchies beside it (`V1`, a
/// hybrid host: each controller its own mount, a run's group one directory per
/// controller, each joined by the run's processes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Controllers {
    pub flavor: Flavor,
    /// Per controller, the directory its run groups go in (`V2`: the cgroup2 base).
    pub bases: Vec<(Controller, PathBuf)>,
}

impl Controllers {
    /// Finds the controllers for `instance`'s groups beside the cgroup2 `base`:
    /// `Ok` with them, or `Err` with why limits cannot be enforced here (said at
    /// start and in status). Memory and pids are required; cpu is used if present.
    pub fn find(base: &Path, instance: &str) -> Result<Controllers, String> {
        match v2_controllers(base) {
            Ok(c) => Ok(c),
            Err(v2_why) => v1_controllers(instance).map_err(|v1_why| format!("{v2_why}; {v1_why}")),
        }
    }

    /// Removes the instance's v1 directories, if no run group is left in them (the
    /// groups of live runs stay for the next start; rmdir refuses then).
    pub fn remove_bases(&self) {
        if self.flavor == Flavor::V1 {
            for (_, b) in &self.bases {
                let _ = std::fs::remove_dir(b);
            }
        }
    }

    /// The v1 directories of run group `name` (none on v2: the group is one directory).
    fn v1_dirs(&self, name: &str) -> Vec<(Controller, PathBuf)> {
        match self.flavor {
            Flavor::V2 => Vec::new(),
            Flavor::V1 => self.bases.iter().map(|(c, b)| (*c, b.join(name))).collect(),
        }
    }
}

/// cgroup2 with the controllers: they must be in `base`'s `cgroup.controllers`; berth
/// tries to enable them down from its own group first (which fails, and says so,
/// where its own group holds processes and is not the root).
fn v2_controllers(base: &Path) -> Result<Controllers, String> {
    let has = |dir: &Path, c: &str| {
        std::fs::read_to_string(dir.join("cgroup.controllers"))
            .is_ok_and(|t| t.split_whitespace().any(|w| w == c))
    };
    let wanted = ["memory", "pids", "cpu"];
    if !wanted.iter().all(|c| has(base, c)) {
        // base = <own>/berth/<instance>: enable in <own> and <own>/berth.
        for dir in base
            .ancestors()
            .skip(1)
            .take(2)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
        {
            for c in wanted {
                let _ = std::fs::write(dir.join("cgroup.subtree_control"), format!("+{c}"));
            }
        }
    }
    for c in wanted {
        let _ = std::fs::write(base.join("cgroup.subtree_control"), format!("+{c}"));
    }
    let missing: Vec<&str> = wanted.into_iter().filter(|c| !has(base, c)).collect();
    let enabled = std::fs::read_to_string(base.join("cgroup.subtree_control")).unwrap_or_default();
    let off: Vec<&str> = ["memory", "pids"]
        .into_iter()
        .filter(|c| !enabled.split_whitespace().any(|w| w == *c))
        .collect();
    if missing.contains(&"memory") || missing.contains(&"pids") || !off.is_empty() {
        return Err(format!(
            "cgroup2 at {} does not delegate the {} controller(s)",
            base.display(),
            if missing.is_empty() {
                off.join(", ")
            } else {
                missing.join(", ")
            }
        ));
    }
    let mut bases = vec![
        (Controller::Memory, base.to_path_buf()),
        (Controller::Pids, base.to_path_buf()),
    ];
    if !missing.contains(&"cpu") && enabled.split_whitespace().any(|w| w == "cpu") {
        bases.push((Controller::Cpu, base.to_path_buf()));
    }
    Ok(Controllers {
        flavor: Flavor::V2,
        bases,
    })
}

/// cgroup v1 hierarchies (a hybrid host): each controller's mount, this process's
/// group in it, and `berth/<instance>` under that, made and probed.
fn v1_controllers(instance: &str) -> Result<Controllers, String> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let mut bases = Vec::new();
    for c in Controller::ALL {
        let Some(dir) = v1_dir(&mountinfo, &own, c.name()) else {
            continue;
        };
        let base = dir.join("berth").join(instance);
        // The instance names the probe: two callers in one process never share it.
        let probe = base.join(format!("probe-{}-{instance}", std::process::id()));
        let ok = std::fs::create_dir_all(&base).is_ok() && std::fs::create_dir(&probe).is_ok();
        let ok = ok && probe.join("cgroup.procs").exists();
        let _ = std::fs::remove_dir(&probe);
        if ok {
            bases.push((c, base));
        }
    }
    let have = |c| bases.iter().any(|(k, _)| *k == c);
    if !have(Controller::Memory) || !have(Controller::Pids) {
        return Err("no writable cgroup v1 memory and pids hierarchies either".into());
    }
    Ok(Controllers {
        flavor: Flavor::V1,
        bases,
    })
}

/// The directory of this process's group in the v1 hierarchy of `controller`: its
/// mount (a `cgroup` mount whose options name it) joined with its
/// `/proc/self/cgroup` path.
fn v1_dir(mountinfo: &str, own: &str, controller: &str) -> Option<PathBuf> {
    let mount = mountinfo.lines().find_map(|l| {
        let (left, right) = l.split_once(" - ")?;
        let mut r = right.split_whitespace();
        let (fstype, opts) = (r.next()?, r.nth(1)?);
        let point = left.split_whitespace().nth(4)?;
        (fstype == "cgroup" && opts.split(',').any(|o| o == controller))
            .then(|| PathBuf::from(point))
    })?;
    let rel = own.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (_, names, path) = (f.next()?, f.next()?, f.next()?);
        names.split(',').any(|n| n == controller).then_some(path)
    })?;
    Some(mount.join(rel.trim_start_matches('/')))
}

pub struct Group {
    pub path: PathBuf,
    /// The run's directories in cgroup v1 hierarchies (a hybrid host), if berth has
    /// controllers there; empty on cgroup2 (the controllers are in `path`).
    pub v1: Vec<(Controller, PathBuf)>,
    /// Where the controllers are, if berth has any.
    flavor: Option<Flavor>,
    /// The directory each controller's files are read and written in.
    dirs: Vec<(Controller, PathBuf)>,
}

impl Group {
    pub fn create(base: &Path, name: &str) -> std::io::Result<Group> {
        Group::create_with(base, name, None)
    }

    /// Makes the run group `name` under `base` and, with `controllers`, its
    /// directories in their hierarchies (v1).
    pub fn create_with(
        base: &Path,
        name: &str,
        controllers: Option<&Controllers>,
    ) -> std::io::Result<Group> {
        let g = Group::open_with(base.join(name), name, controllers);
        for dir in std::iter::once(&g.path).chain(g.v1.iter().map(|(_, d)| d)) {
            match std::fs::create_dir(dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(e),
            }
        }
        Ok(g)
    }

    pub fn open(path: PathBuf) -> Group {
        Group {
            path,
            v1: Vec::new(),
            flavor: None,
            dirs: Vec::new(),
        }
    }

    /// The group at `path` (named `name`), with its controllers' directories.
    pub fn open_with(path: PathBuf, name: &str, controllers: Option<&Controllers>) -> Group {
        let Some(c) = controllers else {
            return Group::open(path);
        };
        let v1 = c.v1_dirs(name);
        let dirs = match c.flavor {
            Flavor::V1 => v1.clone(),
            Flavor::V2 => c.bases.iter().map(|(k, _)| (*k, path.clone())).collect(),
        };
        Group {
            path,
            v1,
            flavor: Some(c.flavor),
            dirs,
        }
    }

    fn dir(&self, c: Controller) -> Option<&Path> {
        self.dirs
            .iter()
            .find(|(k, _)| *k == c)
            .map(|(_, p)| p.as_path())
    }

    /// Every `cgroup.procs` a process joins to be in the group (the cgroup2 one
    /// first; a v1 hierarchy each after it).
    pub fn procs_files(&self) -> Vec<PathBuf> {
        std::iter::once(&self.path)
            .chain(self.v1.iter().map(|(_, d)| d))
            .map(|d| d.join("cgroup.procs"))
            .collect()
    }

    /// Moves a process (and, from then on, its new children) into the group, in
    /// every hierarchy it has.
    pub fn add(&self, pid: i32) -> std::io::Result<()> {
        for f in self.procs_files() {
            std::fs::write(f, pid.to_string())?;
        }
        Ok(())
    }

    /// Sets `limits` on the group. An error names the file that refused; a file the
    /// kernel may lack (swap accounting) is skipped.
    pub fn limit(&self, limits: &Limits) -> Result<(), String> {
        let Some(flavor) = self.flavor else {
            return Err("no controllers".into());
        };
        for (c, file, value) in crate::limits::writes(limits, flavor) {
            let Some(dir) = self.dir(c) else {
                continue; // cpu may be absent: memory and pids are not (`Controllers::find`)
            };
            let path = dir.join(file);
            if let Err(e) = std::fs::write(&path, &value) {
                if !(crate::limits::optional(file) && e.kind() == std::io::ErrorKind::NotFound) {
                    return Err(format!("{}: {value}: {e}", path.display()));
                }
            }
        }
        Ok(())
    }

    /// What the group has used (unknown figures `None`), if it has controllers.
    pub fn usage(&self) -> Option<Usage> {
        let flavor = self.flavor?;
        let mut u = Usage::default();
        for (i, (c, file, how)) in crate::limits::usage_files(flavor).into_iter().enumerate() {
            let text = self
                .dir(c)
                .and_then(|d| std::fs::read_to_string(d.join(file)).ok());
            crate::limits::set_figure(
                &mut u,
                i,
                text.and_then(|t| crate::limits::parse_figure(&t, how)),
            );
        }
        Some(u)
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

    /// Pauses (or resumes) every process in the group (cgroup2's `cgroup.freeze`, in
    /// the group itself: no controller needed, so a hybrid host has it too).
    pub fn freeze(&self, frozen: bool) -> std::io::Result<()> {
        std::fs::write(
            self.path.join("cgroup.freeze"),
            if frozen { "1" } else { "0" },
        )
    }

    /// SIGKILL to every process in the group, atomically (kernel 5.14+).
    pub fn kill(&self) -> std::io::Result<()> {
        std::fs::write(self.path.join("cgroup.kill"), "1")
    }

    /// Removes the (empty) group, in every hierarchy it has.
    pub fn remove(&self) -> std::io::Result<()> {
        for (_, d) in &self.v1 {
            let _ = remove_dir(d);
        }
        remove_dir(&self.path)
    }
}

fn remove_dir(d: &Path) -> std::io::Result<()> {
    match std::fs::remove_dir(d) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        r => r,
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
