//! Run workspaces (W1): `<state_dir>/runs/<digest>/{tmp,logs,cache,browser,out}`, mode
//! 0700, created and removed through directory file descriptors with `O_NOFOLLOW`, so a
//! symlink planted in the path is never followed. The (device, inode) pair goes into the
//! ledger and must match before anything is removed.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use berth_store::WorkspaceIdentity;
use rustix::fs::{self, AtFlags, FileType, Mode, OFlags, CWD};
use sha2::{Digest, Sha256};

pub const SUBDIRS: [&str; 5] = ["tmp", "logs", "cache", "browser", "out"];

#[derive(Debug, thiserror::Error)]
pub enum WorkspaceError {
    #[error("workspace {path}: {op}: {err}")]
    Io {
        path: String,
        op: &'static str,
        err: std::io::Error,
    },
    #[error("workspace {path} is not the directory berth created (identity mismatch); left alone")]
    Swapped { path: String },
}

/// A run's workspace directory name: a digest, so any run id maps to a safe name.
pub fn dir_name(run_id: &str) -> String {
    let d = Sha256::digest(run_id.as_bytes());
    d.iter().take(16).map(|b| format!("{b:02x}")).collect()
}

fn io<'a>(
    path: &'a Path,
    op: &'static str,
) -> impl FnOnce(rustix::io::Errno) -> WorkspaceError + 'a {
    move |e| WorkspaceError::Io {
        path: path.display().to_string(),
        op,
        err: e.into(),
    }
}

fn open_dir_nofollow<Fd: std::os::fd::AsFd>(dir: Fd, name: &str) -> rustix::io::Result<OwnedFd> {
    fs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

/// Creates `<runs_dir>/<digest>` and its subdirectories; returns its identity.
pub fn create(runs_dir: &Path, run_id: &str) -> Result<WorkspaceIdentity, WorkspaceError> {
    let name = dir_name(run_id);
    let path = runs_dir.join(&name);
    let parent = fs::open(
        runs_dir,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(io(runs_dir, "open runs directory"))?;
    // Leftovers under our name (a crash between create and record) are removed first:
    // nothing else may live at this path.
    match open_dir_nofollow(&parent, name.as_str()) {
        Ok(fd) => {
            remove_contents(&fd, &path)?;
            drop(fd);
            fs::unlinkat(&parent, name.as_str(), AtFlags::REMOVEDIR)
                .map_err(io(&path, "remove leftover"))?;
        }
        Err(rustix::io::Errno::NOENT) => {}
        Err(_) => {
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

/// Removes the workspace if and only if it is still the directory berth created.
/// Already gone is fine; swapped (other inode, a symlink, a file) is an error.
pub fn remove(ws: &WorkspaceIdentity) -> Result<(), WorkspaceError> {
    let path = PathBuf::from(&ws.path);
    let (Some(parent_path), Some(name)) =
        (path.parent(), path.file_name().and_then(|n| n.to_str()))
    else {
        return Err(WorkspaceError::Swapped {
            path: ws.path.clone(),
        });
    };
    let parent = fs::open(
        parent_path,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(io(parent_path, "open runs directory"))?;
    let dir = match open_dir_nofollow(&parent, name) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOENT) => return Ok(()),
        Err(_) => {
            return Err(WorkspaceError::Swapped {
                path: ws.path.clone(),
            })
        }
    };
    let st = fs::fstat(&dir).map_err(io(&path, "stat"))?;
    if st.st_dev != ws.dev || st.st_ino != ws.ino {
        return Err(WorkspaceError::Swapped {
            path: ws.path.clone(),
        });
    }
    remove_contents(&dir, &path)?;
    drop(dir);
    fs::unlinkat(&parent, name, AtFlags::REMOVEDIR).map_err(io(&path, "rmdir"))?;
    Ok(())
}

/// Empties a directory through its descriptor, depth first, never following links.
fn remove_contents(dir: &OwnedFd, path: &Path) -> Result<(), WorkspaceError> {
    let mut entries = Vec::new();
    for entry in fs::Dir::read_from(dir).map_err(io(path, "read directory"))? {
        let entry = entry.map_err(io(path, "read entry"))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name == "." || name == ".." {
            continue;
        }
        entries.push((name, entry.file_type()));
    }
    for (name, ft) in entries {
        let is_dir = match ft {
            FileType::Directory => true,
            FileType::Unknown => fs::statat(dir, name.as_str(), AtFlags::SYMLINK_NOFOLLOW)
                .map(|s| FileType::from_raw_mode(s.st_mode) == FileType::Directory)
                .unwrap_or(false),
            _ => false,
        };
        if is_dir {
            let sub =
                open_dir_nofollow(dir, name.as_str()).map_err(io(path, "open subdirectory"))?;
            remove_contents(&sub, &path.join(&name))?;
            drop(sub);
            fs::unlinkat(dir, name.as_str(), AtFlags::REMOVEDIR).map_err(io(path, "rmdir"))?;
        } else {
            fs::unlinkat(dir, name.as_str(), AtFlags::empty()).map_err(io(path, "unlink"))?;
        }
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn create_then_remove_and_refuse_a_swapped_directory() {
        let state = tempfile::tempdir().unwrap();
        let runs = ensure_runs_dir(state.path()).unwrap();
        let ws = create(&runs, "r-1").unwrap();
        let p = PathBuf::from(&ws.path);
        for sub in SUBDIRS {
            let m = std::fs::metadata(p.join(sub)).unwrap();
            assert!(m.is_dir());
            assert_eq!(m.permissions().mode() & 0o777, 0o700);
        }
        std::fs::write(p.join("out/result.txt"), b"x").unwrap();
        std::fs::create_dir_all(p.join("cache/a/b")).unwrap();
        // A symlink inside must be unlinked, not followed.
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("keep"), b"keep").unwrap();
        std::os::unix::fs::symlink(outside.path(), p.join("tmp/link")).unwrap();
        remove(&ws).unwrap();
        assert!(!p.exists());
        assert!(outside.path().join("keep").exists());
        remove(&ws).unwrap(); // already gone: fine

        // Same path, new inode: refused, left alone.
        let ws2 = create(&runs, "r-2").unwrap();
        let p2 = PathBuf::from(&ws2.path);
        // (The old one is moved aside, not deleted, so the new inode must differ.)
        std::fs::rename(&p2, runs.join("aside")).unwrap();
        std::fs::create_dir(&p2).unwrap();
        assert!(matches!(remove(&ws2), Err(WorkspaceError::Swapped { .. })));
        assert!(p2.exists());
        // Replaced by a symlink: refused, the target untouched.
        std::fs::remove_dir_all(&p2).unwrap();
        std::os::unix::fs::symlink(outside.path(), &p2).unwrap();
        assert!(matches!(remove(&ws2), Err(WorkspaceError::Swapped { .. })));
        assert!(outside.path().join("keep").exists());
    }
}
