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
    let Some(dir) = open_verified(&parent, name, ws)? else {
        return Ok(());
    };
    remove_contents(&dir, &path)?;
    drop(dir);
    fs::unlinkat(&parent, name, AtFlags::REMOVEDIR).map_err(io(&path, "rmdir"))?;
    Ok(())
}

/// Opens `name` under `parent` if it is still the workspace berth created (W1):
/// `None` when it is already gone; `Swapped` when it is another inode, a link or a file.
fn open_verified(
    parent: &OwnedFd,
    name: &str,
    ws: &WorkspaceIdentity,
) -> Result<Option<OwnedFd>, WorkspaceError> {
    let swapped = || WorkspaceError::Swapped {
        path: ws.path.clone(),
    };
    let dir = match open_dir_nofollow(parent, name) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOENT) => return Ok(None),
        Err(_) => return Err(swapped()),
    };
    let st = fs::fstat(&dir).map_err(io(Path::new(&ws.path), "stat"))?;
    if st.st_dev != ws.dev || st.st_ino != ws.ino {
        return Err(swapped());
    }
    Ok(Some(dir))
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
            crate::failpoint::hit("mid-workspace-removal");
        }
    }
    Ok(())
}

/// Ready-made workspaces, so a grant costs one `rename` instead of six `mkdir`s and a
/// release one `rename` instead of a recursive delete. A background thread keeps
/// `target` empty workspaces in `runs/.pool`, and scrubs what releases move to
/// `runs/.trash`: a workspace whose subdirectories are all present and empty is
/// recycled into the pool, anything else is deleted (through descriptors, never
/// following links). Identity checks (W1) happen before anything is moved.
pub struct Pool {
    runs_dir: PathBuf,
    runs_fd: OwnedFd,
    pool_fd: OwnedFd,
    trash_fd: OwnedFd,
    ready: std::sync::Arc<std::sync::Mutex<std::collections::VecDeque<String>>>,
    wake: std::sync::mpsc::Sender<()>,
    next: std::sync::atomic::AtomicU64,
    pub diagnostics: std::sync::Arc<DiagnosticsCounters>,
}

/// Where diagnostics go and how much they may take (P4).
#[derive(Clone, Debug)]
pub struct Diagnostics {
    pub dir: PathBuf,
    /// Bytes of one run's `logs/` kept at most; the rest is cut.
    pub run_bytes_max: u64,
    /// Bytes of all archives kept at most; the oldest archives are dropped first.
    pub total_bytes_max: u64,
}

/// Running totals of the archiving the pool thread did.
#[derive(Debug, Default)]
pub struct DiagnosticsCounters {
    pub archived: std::sync::atomic::AtomicU64,
    pub bytes: std::sync::atomic::AtomicU64,
    pub dropped: std::sync::atomic::AtomicU64,
}

/// Copies the regular files under `logs` (never following links) into `dest`, at most
/// `budget` bytes in all; returns the bytes copied.
fn archive_logs(logs: &Path, dest: &Path, budget: u64) -> u64 {
    fn walk(src: &Path, dest: &Path, left: &mut u64) -> u64 {
        let Ok(rd) = std::fs::read_dir(src) else {
            return 0;
        };
        let mut names: Vec<_> = rd.filter_map(|e| e.ok()).collect();
        names.sort_by_key(|e| e.file_name());
        let mut copied = 0;
        for e in names {
            if *left == 0 {
                break;
            }
            let Ok(meta) = std::fs::symlink_metadata(e.path()) else {
                continue;
            };
            let target = dest.join(e.file_name());
            if meta.is_dir() {
                if std::fs::create_dir_all(&target).is_ok() {
                    copied += walk(&e.path(), &target, left);
                }
            } else if meta.is_file() {
                use std::io::{Read, Write};
                let (Ok(f), Ok(mut out)) = (
                    std::fs::File::open(e.path()),
                    std::fs::File::create(&target),
                ) else {
                    continue;
                };
                let mut buf = Vec::new();
                let n = f.take(*left).read_to_end(&mut buf).unwrap_or(0) as u64;
                if out.write_all(&buf).is_ok() {
                    copied += n;
                    *left -= n;
                }
            }
        }
        copied
    }
    if std::fs::create_dir_all(dest).is_err() {
        return 0;
    }
    let mut left = budget;
    walk(logs, dest, &mut left)
}

fn dir_bytes(p: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(p) else {
        return 0;
    };
    rd.filter_map(|e| e.ok())
        .map(|e| match std::fs::symlink_metadata(e.path()) {
            Ok(m) if m.is_dir() => dir_bytes(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

/// Keeps the diagnostics directory under its total budget, oldest first; returns how
/// many archives were dropped.
fn enforce_total(d: &Diagnostics) -> u64 {
    let Ok(rd) = std::fs::read_dir(&d.dir) else {
        return 0;
    };
    let mut archives: Vec<(String, u64)> = rd
        .filter_map(|e| e.ok())
        .map(|e| {
            (
                e.file_name().to_string_lossy().into_owned(),
                dir_bytes(&e.path()),
            )
        })
        .collect();
    archives.sort();
    let mut total: u64 = archives.iter().map(|a| a.1).sum();
    let mut dropped = 0;
    for (name, bytes) in archives {
        if total <= d.total_bytes_max {
            break;
        }
        if std::fs::remove_dir_all(d.dir.join(&name)).is_ok() {
            total -= bytes;
            dropped += 1;
        }
    }
    dropped
}

/// Empty workspaces made ahead when the pool runs low (creating inodes is the costly
/// part on ext4, so released workspaces are recycled rather than deleted and remade).
pub const POOL_TARGET: usize = 64;
/// New workspaces made per round of the pool thread.
const REFILL_BATCH: usize = 4;
/// Recycled workspaces kept at most; beyond it released ones are deleted.
pub const POOL_MAX: usize = 4 * POOL_TARGET;

impl Pool {
    pub fn start(runs_dir: &Path, diag: Option<Diagnostics>) -> std::io::Result<Pool> {
        let pool_dir = runs_dir.join(".pool");
        let trash_dir = runs_dir.join(".trash");
        std::fs::create_dir_all(&pool_dir)?;
        std::fs::create_dir_all(&trash_dir)?;
        // Whatever a previous daemon left in the pool is scrubbed again before reuse.
        for e in std::fs::read_dir(&pool_dir)? {
            let e = e?;
            let _ = std::fs::rename(
                e.path(),
                trash_dir.join(format!("old-{}", e.file_name().to_string_lossy())),
            );
        }
        let ready = std::sync::Arc::new(std::sync::Mutex::new(std::collections::VecDeque::new()));
        let (wake, rx) = std::sync::mpsc::channel::<()>();
        let (pd, td, r) = (pool_dir.clone(), trash_dir.clone(), ready.clone());
        let counters = std::sync::Arc::new(DiagnosticsCounters::default());
        let c = counters.clone();
        std::thread::Builder::new()
            .name("berth-workspaces".into())
            .spawn(move || pool_worker(pd, td, r, rx, diag, c))?;
        let _ = wake.send(());
        let dir_fd = |p: &Path| {
            fs::open(
                p,
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
            )
        };
        Ok(Pool {
            runs_fd: dir_fd(runs_dir)?,
            pool_fd: dir_fd(&pool_dir)?,
            trash_fd: dir_fd(&trash_dir)?,
            runs_dir: runs_dir.to_path_buf(),
            diagnostics: counters,
            ready,
            wake,
            next: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// A fresh workspace for `run_id`: from the pool if one is ready, else made now.
    pub fn create(&self, run_id: &str) -> Result<WorkspaceIdentity, WorkspaceError> {
        let name = dir_name(run_id);
        let path = self.runs_dir.join(&name);
        let (taken, low) = {
            let mut ready = self.ready.lock().unwrap();
            (ready.pop_front(), ready.len() < POOL_TARGET / 2)
        };
        if low {
            let _ = self.wake.send(());
        }
        if let Some(entry) = taken {
            // RENAME_NOREPLACE: never lands on anything already at the run's name.
            if fs::renameat_with(
                &self.pool_fd,
                entry.as_str(),
                &self.runs_fd,
                name.as_str(),
                fs::RenameFlags::NOREPLACE,
            )
            .is_ok()
            {
                let dir =
                    open_dir_nofollow(&self.runs_fd, name.as_str()).map_err(io(&path, "open"))?;
                let st = fs::fstat(&dir).map_err(io(&path, "stat"))?;
                return Ok(WorkspaceIdentity {
                    path: path.display().to_string(),
                    dev: st.st_dev,
                    ino: st.st_ino,
                });
            }
        }
        create(&self.runs_dir, run_id)
    }

    /// Checks the workspace's identity, then moves it aside for the background thread.
    pub fn remove(&self, ws: &WorkspaceIdentity) -> Result<(), WorkspaceError> {
        let path = PathBuf::from(&ws.path);
        let (Some(parent_path), Some(name)) =
            (path.parent(), path.file_name().and_then(|n| n.to_str()))
        else {
            return Err(WorkspaceError::Swapped {
                path: ws.path.clone(),
            });
        };
        if parent_path != self.runs_dir {
            return remove(ws);
        }
        let parent = &self.runs_fd;
        if open_verified(parent, name, ws)?.is_none() {
            return Ok(());
        }
        let n = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let aside = format!("{name}-{n}");
        let trash = &self.trash_fd;
        fs::renameat(parent, name, trash, aside.as_str()).map_err(io(&path, "move aside"))?;
        // The entry moved must be the one just verified; if something swapped it in
        // between, it is left in the trash untouched, and reported.
        let moved = open_dir_nofollow(trash, aside.as_str()).map_err(io(&path, "reopen"))?;
        let st2 = fs::fstat(&moved).map_err(io(&path, "stat"))?;
        if (st2.st_dev, st2.st_ino) != (ws.dev, ws.ino) {
            let _ = fs::renameat(
                trash,
                aside.as_str(),
                trash,
                format!("swapped-{aside}").as_str(),
            );
            return Err(WorkspaceError::Swapped {
                path: ws.path.clone(),
            });
        }
        Ok(())
    }
}

fn pool_worker(
    pool_dir: PathBuf,
    trash_dir: PathBuf,
    ready: std::sync::Arc<std::sync::Mutex<std::collections::VecDeque<String>>>,
    wake: std::sync::mpsc::Receiver<()>,
    diag: Option<Diagnostics>,
    counters: std::sync::Arc<DiagnosticsCounters>,
) {
    use std::sync::atomic::Ordering::Relaxed;
    let mut n = 0u64;
    let mut busy = false;
    loop {
        // The trash is scanned every few milliseconds (releases never wait for this
        // thread); a nudge only comes when the pool runs low.
        // Busy: look again soon, so released workspaces return to the pool before it
        // runs dry; idle: a relaxed pace.
        let pause = if busy { 2 } else { 20 };
        match wake.recv_timeout(std::time::Duration::from_millis(pause)) {
            Ok(()) => while wake.try_recv().is_ok() {},
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
        }
        // Scrub the trash: recycle clean workspaces, delete the rest.
        let entries: Vec<String> = std::fs::read_dir(&trash_dir)
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        busy = !entries.is_empty();
        for entry in entries {
            if entry.starts_with("swapped-") {
                continue;
            }
            let path = trash_dir.join(&entry);
            let pooled = ready.lock().unwrap().len();
            let clean = is_clean(&path);
            // L5/P4: archived after the claim was freed; never holds capacity.
            if let (false, Some(d)) = (clean, &diag) {
                let logs = path.join("logs");
                if dir_bytes(&logs) > 0 {
                    let stamp = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map(|t| t.as_millis())
                        .unwrap_or(0);
                    let digest = entry.split('-').next().unwrap_or(&entry);
                    let dest = d.dir.join(format!("{stamp:015}-{digest}"));
                    let bytes = archive_logs(&logs, &dest, d.run_bytes_max);
                    crate::failpoint::hit("mid-archive");
                    counters.archived.fetch_add(1, Relaxed);
                    counters.bytes.fetch_add(bytes, Relaxed);
                    counters.dropped.fetch_add(enforce_total(d), Relaxed);
                }
            }
            if pooled < POOL_MAX && clean {
                n += 1;
                let name = format!("w{n}-{}", std::process::id());
                if std::fs::rename(&path, pool_dir.join(&name)).is_ok() {
                    ready.lock().unwrap().push_back(name);
                    continue;
                }
            }
            if let Ok(fd) = fs::open(
                &trash_dir,
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
            ) {
                if let Ok(dir) = open_dir_nofollow(&fd, entry.as_str()) {
                    let _ = remove_contents(&dir, &path);
                    drop(dir);
                    let _ = fs::unlinkat(&fd, entry.as_str(), AtFlags::REMOVEDIR);
                } else {
                    let _ = fs::unlinkat(&fd, entry.as_str(), AtFlags::empty());
                }
            }
        }
        // Refill only when low: released workspaces come back through the trash, and
        // making new ones ahead of them would only churn inodes.
        if ready.lock().unwrap().len() >= POOL_TARGET / 4 {
            continue;
        }
        // A few at a time, so the trash is scanned again soon: recycling released
        // workspaces matters more than making new ones.
        for _ in 0..REFILL_BATCH {
            if ready.lock().unwrap().len() >= POOL_TARGET {
                break;
            }
            n += 1;
            let name = format!("w{n}-{}", std::process::id());
            match create_named(&pool_dir, &name) {
                Ok(()) => ready.lock().unwrap().push_back(name),
                Err(e) => {
                    tracing::warn!("workspace pool: {e}");
                    break;
                }
            }
        }
    }
}

/// A workspace is clean when it holds exactly the five subdirectories, all empty real
/// directories (not links). Checked through descriptors: one `getdents` per directory.
fn is_clean_fd(dir: &OwnedFd) -> bool {
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
        let Ok(fd) = open_dir_nofollow(dir, *sub) else {
            return false;
        };
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
    seen == SUBDIRS.len()
}

fn is_clean(path: &Path) -> bool {
    match fs::open(
        path,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => is_clean_fd(&fd),
        Err(_) => false,
    }
}

fn create_named(dir: &Path, name: &str) -> Result<(), WorkspaceError> {
    let path = dir.join(name);
    let parent = fs::open(
        dir,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(io(dir, "open pool"))?;
    fs::mkdirat(&parent, name, Mode::from_raw_mode(0o700)).map_err(io(&path, "mkdir"))?;
    let d = open_dir_nofollow(&parent, name).map_err(io(&path, "open"))?;
    for sub in SUBDIRS {
        fs::mkdirat(&d, sub, Mode::from_raw_mode(0o700))
            .map_err(io(&path, "mkdir subdirectory"))?;
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
    fn the_pool_hands_out_clean_workspaces_and_recycles_only_clean_ones() {
        let state = tempfile::tempdir().unwrap();
        let runs = ensure_runs_dir(state.path()).unwrap();
        let pool = Pool::start(&runs, None).unwrap();
        for _ in 0..200 {
            if pool.ready.lock().unwrap().len() == POOL_TARGET {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let a = pool.create("a").unwrap();
        let pa = PathBuf::from(&a.path);
        assert!(pa.ends_with(dir_name("a")));
        for sub in SUBDIRS {
            assert_eq!(std::fs::read_dir(pa.join(sub)).unwrap().count(), 0);
        }
        std::fs::write(pa.join("out/secret"), b"x").unwrap();
        pool.remove(&a).unwrap();
        assert!(!pa.exists());
        // A dirty workspace is never handed out again: every later one is empty.
        for i in 0..(2 * POOL_TARGET) {
            let w = pool.create(&format!("b{i}")).unwrap();
            let p = PathBuf::from(&w.path);
            for sub in SUBDIRS {
                assert_eq!(
                    std::fs::read_dir(p.join(sub)).unwrap().count(),
                    0,
                    "{sub} of b{i}"
                );
            }
            pool.remove(&w).unwrap();
        }
        // A swapped workspace is refused and left alone.
        let c = pool.create("c").unwrap();
        let pc = PathBuf::from(&c.path);
        std::fs::rename(&pc, runs.join("aside")).unwrap();
        std::fs::create_dir(&pc).unwrap();
        assert!(matches!(
            pool.remove(&c),
            Err(WorkspaceError::Swapped { .. })
        ));
        assert!(pc.exists());
    }

    #[test]
    fn logs_are_archived_within_the_run_and_total_budgets() {
        let state = tempfile::tempdir().unwrap();
        let runs = ensure_runs_dir(state.path()).unwrap();
        let diag = Diagnostics {
            dir: state.path().join("diagnostics"),
            run_bytes_max: 1000,
            total_bytes_max: 2500,
        };
        let pool = Pool::start(&runs, Some(diag.clone())).unwrap();
        for i in 0..4 {
            let w = pool.create(&format!("d{i}")).unwrap();
            let p = PathBuf::from(&w.path);
            std::fs::write(p.join("logs/build.log"), vec![b'x'; 800]).unwrap();
            std::fs::create_dir(p.join("logs/sub")).unwrap();
            std::fs::write(p.join("logs/sub/run.log"), vec![b'y'; 800]).unwrap();
            std::os::unix::fs::symlink("/etc/passwd", p.join("logs/link")).unwrap();
            pool.remove(&w).unwrap();
            // One archive at a time, so the order (and so what is dropped) is known.
            let end = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while pool
                .diagnostics
                .archived
                .load(std::sync::atomic::Ordering::Relaxed)
                < i + 1
            {
                assert!(
                    std::time::Instant::now() < end,
                    "archive {i} never happened"
                );
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        use std::sync::atomic::Ordering::Relaxed;
        // Each run's 1600 bytes of logs are cut to 1000; links are not followed.
        assert_eq!(pool.diagnostics.bytes.load(Relaxed), 4000);
        // 2500 bytes total: only two archives fit; the two oldest were dropped.
        assert_eq!(pool.diagnostics.dropped.load(Relaxed), 2);
        let left: Vec<_> = std::fs::read_dir(&diag.dir).unwrap().collect();
        assert_eq!(left.len(), 2);
        assert!(dir_bytes(&diag.dir) <= 2500);
    }

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
