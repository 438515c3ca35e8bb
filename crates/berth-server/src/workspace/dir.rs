//! One workspace on disk, through descriptors: create, verify, remove, judge clean.

use std::ffi::CStr;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use berth_store::WorkspaceIdentity;
use rustix::fs::{self, AtFlags, FileType, Mode, OFlags, CWD};
use rustix::io::Errno;

use super::{pool::*, *};
use crate::walk::{self, OpenError};

pub(super) fn io<'a>(
    path: &'a Path,
    op: &'static str,
) -> impl FnOnce(rustix::io::Errno) -> WorkspaceError + 'a {
    move |e| WorkspaceError::Io {
        path: path.display().to_string(),
        op,
        err: e.into(),
    }
}

pub(super) fn open_dir_nofollow<Fd: std::os::fd::AsFd>(
    dir: Fd,
    name: &str,
) -> rustix::io::Result<OwnedFd> {
    fs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

/// The mount of the directory open as `dir`: what everything below it must be on.
pub(super) fn mount_of(dir: &OwnedFd, path: &Path) -> Result<walk::Mount, WorkspaceError> {
    walk::stat_fd(dir)
        .map(|m| m.mount())
        .map_err(io(path, "stat"))
}

/// Opens the runs directory at `path`, with the mount every workspace in it must be on.
fn open_runs_dir(path: &Path) -> Result<(OwnedFd, walk::Mount), WorkspaceError> {
    let dir = fs::open(
        path,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(io(path, "open runs directory"))?;
    let on = mount_of(&dir, path)?;
    Ok((dir, on))
}

/// Creates `<runs_dir>/<digest>` and its subdirectories; returns its identity.
pub fn create(runs_dir: &Path, run_id: &str) -> Result<WorkspaceIdentity, WorkspaceError> {
    let name = dir_name(run_id);
    let path = runs_dir.join(&name);
    let (parent, on) = open_runs_dir(runs_dir)?;
    // Leftovers under our name (a crash between create and record) are removed first:
    // nothing else may live at this path.
    match walk::open_dir(&parent, name.as_str(), &on) {
        Ok((fd, _)) => {
            remove_contents(&fd, &on, &path)?;
            drop(fd);
            fs::unlinkat(&parent, name.as_str(), AtFlags::REMOVEDIR)
                .map_err(io(&path, "remove leftover"))?;
        }
        Err(OpenError::Gone) => {}
        // Something mounted at our name is not ours to delete.
        Err(OpenError::Mount(_)) => {
            return Err(WorkspaceError::Mounted {
                path: path.display().to_string(),
            })
        }
        Err(OpenError::Kind | OpenError::Io(_)) => {
            // A file or symlink squatting on the name: unlink it, never follow it.
            fs::unlinkat(&parent, name.as_str(), AtFlags::empty())
                .map_err(io(&path, "remove squatter"))?;
        }
    }
    fs::mkdirat(&parent, name.as_str(), Mode::from_raw_mode(0o700)).map_err(io(&path, "mkdir"))?;
    let dir = open_dir_nofollow(&parent, name.as_str()).map_err(io(&path, "open"))?;
    let st = fs::fstat(&dir).map_err(io(&path, "stat"))?;
    for sub in SUBDIRS {
        fs::mkdirat(&dir, sub, Mode::from_raw_mode(0o700))
            .map_err(io(&path, "mkdir subdirectory"))?;
    }
    Ok(WorkspaceIdentity {
        path: path.display().to_string(),
        dev: st.st_dev,
        ino: st.st_ino,
    })
}

/// A recorded workspace path as (runs directory, entry name); a path without both is
/// not one berth made, so it is treated as swapped.
pub(super) fn split<'a>(
    ws: &WorkspaceIdentity,
    path: &'a Path,
) -> Result<(&'a Path, &'a str), WorkspaceError> {
    match (path.parent(), path.file_name().and_then(|n| n.to_str())) {
        (Some(parent), Some(name)) => Ok((parent, name)),
        _ => Err(WorkspaceError::Swapped {
            path: ws.path.clone(),
        }),
    }
}

/// Removes the workspace if and only if it is still the directory berth created.
/// Already gone is fine; swapped (other inode, a symlink, a file) is an error.
pub fn remove(ws: &WorkspaceIdentity) -> Result<(), WorkspaceError> {
    let path = PathBuf::from(&ws.path);
    let (parent_path, name) = split(ws, &path)?;
    let (parent, on) = open_runs_dir(parent_path)?;
    let Some(dir) = open_verified(&parent, name, ws, &on)? else {
        return Ok(());
    };
    remove_contents(&dir, &on, &path)?;
    drop(dir);
    fs::unlinkat(&parent, name, AtFlags::REMOVEDIR).map_err(io(&path, "rmdir"))?;
    Ok(())
}

/// Opens `name` under `parent` if it is still the workspace berth created (W1):
/// `None` when it is already gone; `Swapped` when it is another inode, a link or a file;
/// `Mounted` when the very directory is mounted over itself (same inode, another mount).
pub(super) fn open_verified(
    parent: &OwnedFd,
    name: &str,
    ws: &WorkspaceIdentity,
    on: &walk::Mount,
) -> Result<Option<OwnedFd>, WorkspaceError> {
    let swapped = || WorkspaceError::Swapped {
        path: ws.path.clone(),
    };
    let (dir, meta) = match walk::open_dir_any(parent, name) {
        Ok(x) => x,
        Err(OpenError::Gone) => return Ok(None),
        Err(_) => return Err(swapped()),
    };
    // The identity is compared as `fstat` reports it, as it was recorded.
    let st = fs::fstat(&dir).map_err(io(Path::new(&ws.path), "stat"))?;
    if st.st_dev != ws.dev || st.st_ino != ws.ino {
        return Err(swapped());
    }
    if !meta.on(on) {
        return Err(WorkspaceError::Mounted {
            path: ws.path.clone(),
        });
    }
    Ok(Some(dir))
}

/// Empties a directory through its descriptor, iteratively, never following links nor
/// crossing a mount point (see `walk::remove_contents`).
pub(super) fn remove_contents(
    dir: &OwnedFd,
    on: &walk::Mount,
    path: &Path,
) -> Result<(), WorkspaceError> {
    walk::remove_contents(dir, on)
        .map(drop)
        .map_err(|e| match e {
            walk::WalkError::Mount => WorkspaceError::Mounted {
                path: path.display().to_string(),
            },
            walk::WalkError::Io { op, errno } => WorkspaceError::Io {
                path: path.display().to_string(),
                op,
                err: errno.into(),
            },
        })
}

/// Makes the private directory `name` under `parent` (never an existing one: `EEXIST`
/// is an error) and returns it open, 0700 exactly.
pub(super) fn make_private_dir(
    parent: &OwnedFd,
    name: &CStr,
    on: &walk::Mount,
) -> Result<OwnedFd, Errno> {
    fs::mkdirat(parent, name, Mode::from_raw_mode(0o700))?;
    let (fd, _) = walk::open_dir(parent, name, on).map_err(|e| match e {
        OpenError::Io(e) => e,
        _ => Errno::NOTDIR,
    })?;
    // Exactly 0700: the umask may only have taken bits away.
    fs::fchmod(&fd, Mode::from_raw_mode(0o700))?;
    Ok(fd)
}

/// A workspace is clean when it holds exactly the five subdirectories, all empty real
/// directories (not links, not mount points: on the mount `on`, the workspace's own) of
/// mode 0700 (W1). Checked through descriptors.
pub(super) fn is_clean_fd(dir: &OwnedFd, on: &walk::Mount) -> bool {
    let mut seen = 0;
    let Ok(entries) = fs::Dir::read_from(dir) else {
        return false;
    };
    for e in entries {
        let Ok(e) = e else { return false };
        let name = e.file_name().to_bytes();
        if name == b"." || name == b".." {
            continue;
        }
        let Some(sub) = SUBDIRS.iter().find(|s| s.as_bytes() == name) else {
            return false;
        };
        if !matches!(e.file_type(), FileType::Directory | FileType::Unknown) {
            return false;
        }
        // The type, mode and mount are read from the opened descriptor.
        let Ok((fd, meta)) = walk::open_dir(dir, *sub, on) else {
            return false;
        };
        if meta.mode != 0o700 {
            return false;
        }
        let Ok(inner) = fs::Dir::read_from(&fd) else {
            return false;
        };
        for x in inner {
            match x {
                Ok(x) if matches!(x.file_name().to_bytes(), b"." | b"..") => {}
                _ => return false,
            }
        }
        seen += 1;
    }
    seen == SUBDIRS.len() && fs::fstat(dir).is_ok_and(|st| st.st_mode & 0o7777 == 0o700)
}

/// Makes a complete empty workspace `name` under `parent`; returns it open.
pub(super) fn create_named(
    parent: &OwnedFd,
    name: &str,
) -> Result<(OwnedFd, Ident), WorkspaceError> {
    let path = Path::new(".pool").join(name);
    fs::mkdirat(parent, name, Mode::from_raw_mode(0o700)).map_err(io(&path, "mkdir"))?;
    let d = open_dir_nofollow(parent, name).map_err(io(&path, "open"))?;
    let st = fs::fstat(&d).map_err(io(&path, "stat"))?;
    for sub in SUBDIRS {
        fs::mkdirat(&d, sub, Mode::from_raw_mode(0o700))
            .map_err(io(&path, "mkdir subdirectory"))?;
    }
    Ok((d, (st.st_dev, st.st_ino)))
}

/// Makes `<state_dir>/runs` (0700) if needed.
pub fn ensure_runs_dir(state_dir: &Path) -> std::io::Result<PathBuf> {
    let runs = state_dir.join("runs");
    std::fs::create_dir_all(&runs)?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&runs, std::fs::Permissions::from_mode(0o700))?;
    let _ = CWD;
    Ok(runs)
}

/// Makes (or checks) the directory under which the workspaces of other users' runs
/// live, `<dir>/<uid>/<digest>` (S9, issue 33 item 4). It must be a real directory
/// owned by berth's user that nobody else can write: each user owns only their own
/// `<uid>` below it, so no user can rename or replace another's (nor their own
/// `<uid>`). Made 0711 if missing: users can reach their own `<uid>` but not list.
/// Returns the ancestors that others cannot traverse (their workspaces are out of
/// their reach until that is changed), for the daemon to say at start.
pub fn ensure_users_dir(dir: &Path) -> Result<Vec<PathBuf>, String> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let bad = |why: String| format!("--user-workspaces {}: {why}", dir.display());
    match std::fs::DirBuilder::new().create(dir) {
        Ok(()) => std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))
            .map_err(|e| bad(format!("chmod: {e}")))?,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(bad(format!("cannot be made: {e}"))),
    }
    let m = std::fs::symlink_metadata(dir).map_err(|e| bad(e.to_string()))?;
    if !m.file_type().is_dir() {
        return Err(bad("must be a directory, not a link or a file".into()));
    }
    if m.uid() != rustix::process::geteuid().as_raw() || m.mode() & 0o022 != 0 {
        return Err(bad(format!(
            "must be owned by berth's user (uid {}) and writable by nobody else (it is uid {}, mode {:o})",
            rustix::process::geteuid().as_raw(),
            m.uid(),
            m.mode() & 0o7777
        )));
    }
    let mut closed = Vec::new();
    let mut at = Some(dir);
    while let Some(p) = at {
        if let Ok(m) = std::fs::metadata(p) {
            if m.mode() & 0o001 == 0 {
                closed.push(p.to_path_buf());
            }
        }
        at = p.parent();
    }
    Ok(closed)
}

/// A workspace for a run of another user `uid` (S9): `<users_dir>/<uid>/<digest>`,
/// with the same five subdirectories, all owned by `uid` (group `gid` when known) and
/// mode 0700, so the run's `ls` and `mktemp` work and no other user can look in.
///
/// Made root-owned through descriptors first and given away last, innermost first: while
/// berth works in it, the user cannot touch its entries; the user owns `<uid>` and can
/// rename the workspace meanwhile, but every step is relative to the descriptor berth
/// opened, and the identity recorded is that directory's (W1).
pub fn create_owned(
    users_dir: &Path,
    uid: u32,
    gid: Option<u32>,
    run_id: &str,
) -> Result<WorkspaceIdentity, WorkspaceError> {
    let home = users_dir.join(uid.to_string());
    let users = fs::open(
        users_dir,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(io(users_dir, "open"))?;
    let name = uid.to_string();
    let owner = Some(rustix::fs::Uid::from_raw(uid));
    let group = gid.map(rustix::fs::Gid::from_raw);
    match fs::mkdirat(&users, name.as_str(), Mode::from_raw_mode(0o700)) {
        Ok(()) | Err(Errno::EXIST) => {}
        Err(e) => return Err(io(&home, "mkdir")(e)),
    }
    let home_fd = open_dir_nofollow(&users, name.as_str()).map_err(io(&home, "open"))?;
    let st = fs::fstat(&home_fd).map_err(io(&home, "stat"))?;
    let me = rustix::process::geteuid().as_raw();
    if st.st_uid == me {
        fs::fchown(&home_fd, owner, group).map_err(io(&home, "chown"))?;
        fs::fchmod(&home_fd, Mode::from_raw_mode(0o700)).map_err(io(&home, "chmod"))?;
    } else if st.st_uid != uid {
        return Err(WorkspaceError::Swapped {
            path: home.display().to_string(),
        });
    }
    drop(home_fd);
    let ws = create(&home, run_id)?;
    let path = PathBuf::from(&ws.path);
    let parent = fs::open(
        &home,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(io(&home, "open"))?;
    let on = mount_of(&parent, &home)?;
    let Some(dir) = open_verified(&parent, &dir_name(run_id), &ws, &on)? else {
        return Err(WorkspaceError::Swapped { path: ws.path });
    };
    for sub in SUBDIRS {
        fs::chownat(&dir, sub, owner, group, AtFlags::SYMLINK_NOFOLLOW)
            .map_err(io(&path, "chown subdirectory"))?;
    }
    fs::fchown(&dir, owner, group).map_err(io(&path, "chown"))?;
    Ok(ws)
}
