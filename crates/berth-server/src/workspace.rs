//! Run workspaces (W1): `<state_dir>/runs/<digest>/{tmp,logs,cache,browser,out}`, mode
//! 0700, created and removed through directory file descriptors with `O_NOFOLLOW`, so a
//! symlink planted in the path is never followed. The (device, inode) pair goes into the
//! ledger and must match before anything is removed.

use std::collections::{HashMap, VecDeque};
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use berth_store::WorkspaceIdentity;
use rustix::fs::{self, inotify, AtFlags, FileType, Mode, OFlags, CWD};
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

/// A recorded workspace path as (runs directory, entry name); a path without both is
/// not one berth made, so it is treated as swapped.
fn split<'a>(
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

/// Ready-made workspaces, so a grant costs one `rename` instead of six `mkdir`s, and a
/// release one `rename` instead of a recursive delete.
///
/// A background thread keeps up to `POOL_TARGET` empty workspaces in `runs/.pool`. A
/// release checks the workspace's identity (W1) and moves it into `runs/.pool` under a
/// new name; the thread then judges whether it may be handed out again. Judging must
/// not cost a scan of six directories per run (that scan was the largest single cost
/// of a lifecycle), so the thread watches each workspace's six directories with inotify
/// (`Watcher`): a workspace none of whose directories saw an event since it was last
/// proven clean is still clean. Anything else (an event, an overflowed event queue, a
/// workspace it could not watch) takes the slow path through `runs/.trash`: scanned
/// through descriptors, its logs archived, then recycled if clean, else deleted.
pub struct Pool {
    runs_dir: PathBuf,
    runs_fd: OwnedFd,
    pool_fd: OwnedFd,
    trash_fd: OwnedFd,
    shared: Arc<Shared>,
    wake: mpsc::Sender<()>,
    next: AtomicU64,
    pub diagnostics: Arc<DiagnosticsCounters>,
}

/// What the state task and the pool thread share.
#[derive(Default)]
struct Shared {
    /// Proven clean, in `runs/.pool`, ready to hand out.
    ready: Mutex<VecDeque<Pooled>>,
    /// Released into `runs/.pool`, not judged yet.
    released: Mutex<Vec<Pooled>>,
}

/// A workspace directory in `runs/.pool` and its identity.
#[derive(Clone, Debug)]
struct Pooled {
    name: String,
    ident: Ident,
}

/// (device, inode) of a directory.
type Ident = (u64, u64);

/// Where diagnostics go and how much they may take (P4).
#[derive(Clone, Debug)]
pub struct Diagnostics {
    pub dir: PathBuf,
    /// Bytes of one run's `logs/` kept at most; the rest is cut.
    pub run_bytes_max: u64,
    /// Bytes of all archives kept at most; the oldest archives are dropped first.
    pub total_bytes_max: u64,
}

/// Running totals of the pool thread's slow path and archiving.
#[derive(Debug, Default)]
pub struct DiagnosticsCounters {
    pub archived: std::sync::atomic::AtomicU64,
    pub bytes: std::sync::atomic::AtomicU64,
    pub dropped: std::sync::atomic::AtomicU64,
    /// Workspaces that took the slow path (scanned, then recycled or deleted).
    pub scrubbed: std::sync::atomic::AtomicU64,
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
/// How often the pool thread looks for releases while they keep coming, and when idle.
/// Releases never wait for the thread nor wake it; the pool holds enough for the gap.
const BUSY_PAUSE_MS: u64 = 2;
const IDLE_PAUSE_MS: u64 = 20;
/// How often the whole trash directory is listed again: leftovers of an earlier daemon
/// and entries whose deletion failed (retried until it succeeds).
const TRASH_RESCAN_MS: u64 = 1_000;

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
        let dir_fd = |p: &Path| {
            fs::open(
                p,
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
            )
        };
        let shared = Arc::new(Shared::default());
        let counters = Arc::new(DiagnosticsCounters::default());
        let (wake, rx) = mpsc::channel::<()>();
        let worker = Worker {
            pool_fd: dir_fd(&pool_dir)?,
            trash_fd: dir_fd(&trash_dir)?,
            trash_dir,
            shared: shared.clone(),
            diag,
            counters: counters.clone(),
            watcher: Watcher::new(),
            made: 0,
            trash: Vec::new(),
        };
        std::thread::Builder::new()
            .name("berth-workspaces".into())
            .spawn(move || worker.run(rx))?;
        let _ = wake.send(());
        Ok(Pool {
            runs_fd: dir_fd(runs_dir)?,
            pool_fd: dir_fd(&pool_dir)?,
            trash_fd: dir_fd(&runs_dir.join(".trash"))?,
            runs_dir: runs_dir.to_path_buf(),
            diagnostics: counters,
            shared,
            wake,
            next: AtomicU64::new(0),
        })
    }

    /// A fresh workspace for `run_id`: from the pool if one is ready, else made now.
    pub fn create(&self, run_id: &str) -> Result<WorkspaceIdentity, WorkspaceError> {
        let name = dir_name(run_id);
        let path = self.runs_dir.join(&name);
        let (taken, low) = {
            let mut ready = self.shared.ready.lock().unwrap();
            (ready.pop_front(), ready.len() < POOL_TARGET / 2)
        };
        if low {
            let _ = self.wake.send(());
        }
        if let Some(p) = taken {
            // RENAME_NOREPLACE: never lands on anything already at the run's name.
            let moved = fs::renameat_with(
                &self.pool_fd,
                p.name.as_str(),
                &self.runs_fd,
                name.as_str(),
                fs::RenameFlags::NOREPLACE,
            )
            .is_ok();
            if moved {
                // What arrived must be the directory the pool proved clean; anything
                // else (swapped while pooled) is replaced by a fresh one below.
                match fs::statat(&self.runs_fd, name.as_str(), AtFlags::SYMLINK_NOFOLLOW) {
                    Ok(st) if (st.st_dev, st.st_ino) == p.ident => {
                        return Ok(WorkspaceIdentity {
                            path: path.display().to_string(),
                            dev: p.ident.0,
                            ino: p.ident.1,
                        });
                    }
                    _ => tracing::warn!("workspace pool: {} was replaced while pooled", p.name),
                }
            }
        }
        create(&self.runs_dir, run_id)
    }

    /// Checks the workspace's identity, then moves it into the pool to be judged by the
    /// background thread.
    pub fn remove(&self, ws: &WorkspaceIdentity) -> Result<(), WorkspaceError> {
        let path = PathBuf::from(&ws.path);
        let (parent_path, name) = split(ws, &path)?;
        if parent_path != self.runs_dir {
            return remove(ws);
        }
        let swapped = || WorkspaceError::Swapped {
            path: ws.path.clone(),
        };
        let ident = (ws.dev, ws.ino);
        // SYMLINK_NOFOLLOW: a link planted at the name has its own inode, so it fails.
        match fs::statat(&self.runs_fd, name, AtFlags::SYMLINK_NOFOLLOW) {
            Err(rustix::io::Errno::NOENT) => return Ok(()),
            Err(e) => return Err(io(&path, "stat")(e)),
            Ok(st) if (st.st_dev, st.st_ino) != ident => return Err(swapped()),
            Ok(_) => {}
        }
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let aside = format!("{name}-r{n}");
        fs::renameat(&self.runs_fd, name, &self.pool_fd, aside.as_str())
            .map_err(io(&path, "move aside"))?;
        // The entry moved must be the one just checked; if something swapped it in
        // between, it goes to the trash untouched (the thread skips `swapped-`), reported.
        let st = fs::statat(&self.pool_fd, aside.as_str(), AtFlags::SYMLINK_NOFOLLOW)
            .map_err(io(&path, "stat"))?;
        if (st.st_dev, st.st_ino) != ident {
            let _ = fs::renameat(
                &self.pool_fd,
                aside.as_str(),
                &self.trash_fd,
                format!("swapped-{aside}").as_str(),
            );
            return Err(swapped());
        }
        self.shared
            .released
            .lock()
            .unwrap()
            .push(Pooled { name: aside, ident });
        Ok(())
    }
}

/// The pool thread: judges releases, scrubs the trash, refills.
struct Worker {
    pool_fd: OwnedFd,
    trash_fd: OwnedFd,
    trash_dir: PathBuf,
    shared: Arc<Shared>,
    diag: Option<Diagnostics>,
    counters: Arc<DiagnosticsCounters>,
    watcher: Watcher,
    /// Workspaces made or recycled so far; names pool entries uniquely.
    made: u64,
    /// Trash entries this thread moved there itself, scrubbed in the same round.
    trash: Vec<String>,
}

impl Worker {
    fn run(mut self, wake: mpsc::Receiver<()>) {
        let mut busy = false;
        let mut rescan_at = std::time::Instant::now();
        loop {
            let pause = if busy { BUSY_PAUSE_MS } else { IDLE_PAUSE_MS };
            match wake.recv_timeout(std::time::Duration::from_millis(pause)) {
                Ok(()) => while wake.try_recv().is_ok() {},
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            }
            // Releases first, events second: a run's changes were queued before its
            // release was, so reading the queue after taking a release sees them all.
            // (Every round reads it, so one busy run cannot fill the kernel's queue.)
            let released = std::mem::take(&mut *self.shared.released.lock().unwrap());
            let dirtied = self.watcher.drain();
            if !dirtied.is_empty() {
                self.evict_ready(&dirtied);
            }
            busy = !released.is_empty();
            for r in released {
                self.judge(r);
            }
            let entries = if std::time::Instant::now() >= rescan_at {
                rescan_at =
                    std::time::Instant::now() + std::time::Duration::from_millis(TRASH_RESCAN_MS);
                self.trash.clear();
                std::fs::read_dir(&self.trash_dir)
                    .map(|rd| {
                        rd.filter_map(|e| e.ok())
                            .map(|e| e.file_name().to_string_lossy().into_owned())
                            .collect()
                    })
                    .unwrap_or_default()
            } else {
                std::mem::take(&mut self.trash)
            };
            for entry in entries {
                if !entry.starts_with("swapped-") {
                    self.scrub(&entry);
                }
            }
            self.refill();
        }
    }

    fn pooled(&self) -> usize {
        self.shared.ready.lock().unwrap().len()
    }

    fn next_name(&mut self) -> String {
        self.made += 1;
        format!("w{}-{}", self.made, std::process::id())
    }

    /// A released workspace: back to the ready list if its watches saw nothing since it
    /// was proven clean; else down the slow path.
    fn judge(&mut self, r: Pooled) {
        if self.pooled() < POOL_MAX && self.watcher.vouches(r.ident) {
            self.shared.ready.lock().unwrap().push_back(r);
            return;
        }
        self.watcher.forget(r.ident);
        match fs::renameat(
            &self.pool_fd,
            r.name.as_str(),
            &self.trash_fd,
            r.name.as_str(),
        ) {
            Ok(()) => self.trash.push(r.name),
            Err(e) => tracing::warn!("workspace pool: moving {} to the trash: {e}", r.name),
        }
    }

    /// Ready workspaces written to while pooled are not handed out.
    fn evict_ready(&mut self, dirtied: &[Ident]) {
        let evicted: Vec<Pooled> = {
            let mut ready = self.shared.ready.lock().unwrap();
            let (bad, good): (Vec<_>, Vec<_>) =
                ready.drain(..).partition(|p| dirtied.contains(&p.ident));
            ready.extend(good);
            bad
        };
        for p in evicted {
            self.judge(p);
        }
    }

    /// The slow path: a trash entry is scanned; clean ones are watched and recycled,
    /// the rest have their logs archived (P4) and are deleted, never following links.
    fn scrub(&mut self, entry: &str) {
        let path = self.trash_dir.join(entry);
        let dir = match open_dir_nofollow(&self.trash_fd, entry) {
            Ok(dir) => dir,
            Err(rustix::io::Errno::NOENT) => return,
            Err(_) => {
                // A file or a link: unlinked, never followed.
                let _ = fs::unlinkat(&self.trash_fd, entry, AtFlags::empty());
                return;
            }
        };
        let Ok(st) = fs::fstat(&dir) else { return };
        let ident = (st.st_dev, st.st_ino);
        self.counters
            .scrubbed
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let room = self.pooled() < POOL_MAX;
        // Watch first, then look: a change made while looking shows up as an event.
        let watched = room && self.watcher.watch(&dir, ident);
        let clean = is_clean_fd(&dir);
        if clean && room {
            let dirtied = self.watcher.drain();
            if !dirtied.is_empty() {
                self.evict_ready(&dirtied);
            }
            // Unwatchable (no inotify, no watches left) but clean: recycled all the
            // same; its next release takes this path again.
            if !watched || self.watcher.vouches(ident) {
                let name = self.next_name();
                if fs::renameat(&self.trash_fd, entry, &self.pool_fd, name.as_str()).is_ok() {
                    self.shared
                        .ready
                        .lock()
                        .unwrap()
                        .push_back(Pooled { name, ident });
                    return;
                }
            }
        }
        self.watcher.forget(ident);
        // L5/P4: archived after the claim was freed; never holds capacity.
        if let (false, Some(d)) = (clean, &self.diag) {
            let logs = path.join("logs");
            if dir_bytes(&logs) > 0 {
                let stamp = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|t| t.as_millis())
                    .unwrap_or(0);
                let digest = entry.split('-').next().unwrap_or(entry);
                let dest = d.dir.join(format!("{stamp:015}-{digest}"));
                let bytes = archive_logs(&logs, &dest, d.run_bytes_max);
                crate::failpoint::hit("mid-archive");
                use std::sync::atomic::Ordering::Relaxed;
                self.counters.archived.fetch_add(1, Relaxed);
                self.counters.bytes.fetch_add(bytes, Relaxed);
                self.counters.dropped.fetch_add(enforce_total(d), Relaxed);
            }
        }
        let _ = remove_contents(&dir, &path);
        drop(dir);
        let _ = fs::unlinkat(&self.trash_fd, entry, AtFlags::REMOVEDIR);
    }

    /// Makes new workspaces only when the pool runs low: released ones come back by
    /// themselves, and making new ones ahead of them would only churn inodes. A few at
    /// a time, so releases are judged again soon.
    fn refill(&mut self) {
        if self.pooled() >= POOL_TARGET / 4 {
            return;
        }
        for _ in 0..REFILL_BATCH {
            if self.pooled() >= POOL_TARGET {
                break;
            }
            let name = self.next_name();
            match create_named(&self.pool_fd, &name) {
                Ok((dir, ident)) => {
                    // Watched once it is complete: making it is not a change to it.
                    self.watcher.watch(&dir, ident);
                    self.shared
                        .ready
                        .lock()
                        .unwrap()
                        .push_back(Pooled { name, ident });
                }
                Err(e) => {
                    tracing::warn!("workspace pool: {e}");
                    break;
                }
            }
        }
    }
}

/// What a watch reports: any change to a directory's entries or to its attributes, and
/// its deletion. `IN_MOVE_SELF` is left out: the pool's own renames of a workspace are
/// not changes to it (its subdirectories moving shows as `IN_MOVED_FROM` on the top).
fn watch_flags() -> inotify::WatchFlags {
    use inotify::WatchFlags as W;
    W::CREATE | W::DELETE | W::MOVED_FROM | W::MOVED_TO | W::ATTRIB | W::DELETE_SELF | W::ONLYDIR
}

/// inotify watches on workspaces' six directories, by identity. A workspace is vouched
/// for while none of its watches reported an event since it was last proven clean.
/// Sound because inotify queues an event inside the system call that makes the change:
/// once `drain` has read the queue, every change made before it was called is known.
struct Watcher {
    fd: Option<OwnedFd>,
    by_wd: HashMap<i32, Ident>,
    by_ident: HashMap<Ident, Watched>,
    buf: Vec<MaybeUninit<u8>>,
}

struct Watched {
    wds: Vec<i32>,
    dirty: bool,
}

/// Bytes read from the event queue per `read`.
const EVENT_BUF_BYTES: usize = 16 * 1024;

impl Watcher {
    fn new() -> Watcher {
        let fd = inotify::init(inotify::CreateFlags::CLOEXEC | inotify::CreateFlags::NONBLOCK)
            .map_err(|e| {
                tracing::warn!("workspace pool: no inotify ({e}); every release is scanned")
            })
            .ok();
        Watcher {
            fd,
            by_wd: HashMap::new(),
            by_ident: HashMap::new(),
            buf: vec![MaybeUninit::uninit(); EVENT_BUF_BYTES],
        }
    }

    /// Watches the workspace open as `dir`: the top, then each subdirectory. False when
    /// it cannot (no inotify, the user's watch limit reached, a subdirectory missing).
    fn watch(&mut self, dir: &OwnedFd, ident: Ident) -> bool {
        self.forget(ident);
        let Some(fd) = &self.fd else { return false };
        // The magic link names exactly the directory open here, wherever it is now.
        let top = format!("/proc/self/fd/{}", dir.as_raw_fd());
        let mut wds = Vec::with_capacity(1 + SUBDIRS.len());
        let mut ok = true;
        for p in std::iter::once(top.clone()).chain(SUBDIRS.iter().map(|s| format!("{top}/{s}"))) {
            // DONT_FOLLOW only below the top (a link planted under a subdirectory's
            // name is not watched through; ONLYDIR then fails on it).
            let flags = if wds.is_empty() {
                watch_flags()
            } else {
                watch_flags() | inotify::WatchFlags::DONT_FOLLOW
            };
            match inotify::add_watch(fd, p.as_str(), flags) {
                Ok(wd) => wds.push(wd),
                Err(_) => {
                    ok = false;
                    break;
                }
            }
        }
        if !ok {
            for wd in wds {
                let _ = inotify::remove_watch(fd, wd);
            }
            return false;
        }
        for wd in &wds {
            self.by_wd.insert(*wd, ident);
        }
        self.by_ident.insert(ident, Watched { wds, dirty: false });
        true
    }

    fn forget(&mut self, ident: Ident) {
        if let Some(w) = self.by_ident.remove(&ident) {
            self.unwatch(w.wds);
        }
    }

    fn unwatch(&mut self, wds: Vec<i32>) {
        for wd in wds {
            self.by_wd.remove(&wd);
            if let Some(fd) = &self.fd {
                let _ = inotify::remove_watch(fd, wd);
            }
        }
    }

    fn vouches(&self, ident: Ident) -> bool {
        self.by_ident.get(&ident).is_some_and(|w| !w.dirty)
    }

    /// Reads every queued event and marks the workspaces they concern dirty (all of
    /// them if the queue overflowed); returns those newly dirtied. A dirty workspace's
    /// watches are dropped at once, so a busy run cannot flood the queue.
    fn drain(&mut self) -> Vec<Ident> {
        let Some(fd) = &self.fd else {
            return Vec::new();
        };
        let mut hit = Vec::new();
        let mut overflow = false;
        let mut reader = inotify::Reader::new(fd, &mut self.buf);
        loop {
            match reader.next() {
                Ok(ev) if ev.events().contains(inotify::ReadFlags::QUEUE_OVERFLOW) => {
                    overflow = true
                }
                Ok(ev) => {
                    if let Some(ident) = self.by_wd.get(&ev.wd()) {
                        hit.push(*ident);
                    }
                }
                Err(rustix::io::Errno::AGAIN) => break,
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => {
                    tracing::warn!("workspace pool: reading inotify events: {e}");
                    overflow = true;
                    break;
                }
            }
        }
        if overflow {
            hit.extend(self.by_ident.keys().copied());
        }
        let mut dirtied = Vec::new();
        for ident in hit {
            let wds = match self.by_ident.get_mut(&ident) {
                Some(w) if !w.dirty => {
                    w.dirty = true;
                    std::mem::take(&mut w.wds)
                }
                _ => continue,
            };
            self.unwatch(wds);
            dirtied.push(ident);
        }
        dirtied
    }
}

/// A workspace is clean when it holds exactly the five subdirectories, all empty real
/// directories (not links) of mode 0700 (W1). Checked through descriptors.
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
        let Ok(fd) = open_dir_nofollow(dir, sub) else {
            return false;
        };
        match fs::fstat(&fd) {
            Ok(st) if st.st_mode & 0o7777 == 0o700 => {}
            _ => return false,
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
fn create_named(parent: &OwnedFd, name: &str) -> Result<(OwnedFd, Ident), WorkspaceError> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn the_pool_hands_out_clean_workspaces_and_recycles_only_clean_ones() {
        let state = tempfile::tempdir().unwrap();
        let runs = ensure_runs_dir(state.path()).unwrap();
        let pool = Pool::start(&runs, None).unwrap();
        until("pool filled", || {
            pool.shared.ready.lock().unwrap().len() >= POOL_TARGET / 4
        });
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

    /// Waits until `f` holds, at most 10 s.
    fn until(what: &str, mut f: impl FnMut() -> bool) {
        let end = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !f() {
            assert!(std::time::Instant::now() < end, "never: {what}");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    fn full_pool(runs: &Path) -> Pool {
        let pool = Pool::start(runs, None).unwrap();
        until("pool filled", || {
            pool.shared.ready.lock().unwrap().len() >= POOL_TARGET / 4
        });
        pool
    }

    fn scrubbed(pool: &Pool) -> u64 {
        pool.diagnostics
            .scrubbed
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Every workspace the pool hands out is complete, empty and private.
    fn assert_pristine(w: &WorkspaceIdentity, what: &str) {
        let p = PathBuf::from(&w.path);
        let mut names: Vec<_> = std::fs::read_dir(&p)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["browser", "cache", "logs", "out", "tmp"], "{what}");
        for sub in SUBDIRS {
            let m = std::fs::symlink_metadata(p.join(sub)).unwrap();
            assert!(m.is_dir(), "{what}: {sub}");
            assert_eq!(m.permissions().mode() & 0o7777, 0o700, "{what}: {sub}");
            assert_eq!(
                std::fs::read_dir(p.join(sub)).unwrap().count(),
                0,
                "{what}: {sub}"
            );
        }
    }

    #[test]
    fn an_untouched_workspace_is_recycled_without_a_scan() {
        let state = tempfile::tempdir().unwrap();
        let runs = ensure_runs_dir(state.path()).unwrap();
        let pool = full_pool(&runs);
        let mut seen = std::collections::HashSet::new();
        for i in 0..(3 * POOL_TARGET) {
            let w = pool.create(&format!("u{i}")).unwrap();
            assert_pristine(&w, &format!("u{i}"));
            seen.insert((w.dev, w.ino));
            pool.remove(&w).unwrap();
            // Give the thread a chance to judge, so the pool never runs dry here.
            if i % 16 == 15 {
                until("releases judged", || {
                    pool.shared.released.lock().unwrap().is_empty()
                });
            }
        }
        until("releases judged", || {
            pool.shared.released.lock().unwrap().is_empty()
        });
        // Nothing took the slow path, and no new inodes were needed: every run got one
        // of the first pool's workspaces back.
        assert_eq!(scrubbed(&pool), 0);
        assert!(seen.len() <= POOL_TARGET, "{} distinct inodes", seen.len());
    }

    #[test]
    fn every_kind_of_change_sends_a_workspace_down_the_slow_path() {
        let state = tempfile::tempdir().unwrap();
        let runs = ensure_runs_dir(state.path()).unwrap();
        let outside = state.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        let pool = full_pool(&runs);
        type Change = fn(&Path, &Path);
        let changes: Vec<(&str, Change)> = vec![
            ("file in out", |p, _| {
                std::fs::write(p.join("out/x"), b"x").unwrap()
            }),
            ("file in tmp", |p, _| {
                std::fs::write(p.join("tmp/x"), b"x").unwrap()
            }),
            ("file in logs", |p, _| {
                std::fs::write(p.join("logs/x"), b"x").unwrap()
            }),
            ("file in browser", |p, _| {
                std::fs::write(p.join("browser/x"), b"x").unwrap()
            }),
            ("nested dir in cache", |p, _| {
                std::fs::create_dir_all(p.join("cache/a/b")).unwrap()
            }),
            ("file at the top", |p, _| {
                std::fs::write(p.join("stray"), b"x").unwrap()
            }),
            ("created then deleted", |p, _| {
                std::fs::write(p.join("tmp/x"), b"x").unwrap();
                std::fs::remove_file(p.join("tmp/x")).unwrap();
            }),
            ("chmod out", |p, _| {
                std::fs::set_permissions(p.join("out"), std::fs::Permissions::from_mode(0o755))
                    .unwrap()
            }),
            ("out replaced by a new directory", |p, _| {
                std::fs::remove_dir(p.join("out")).unwrap();
                std::fs::create_dir(p.join("out")).unwrap();
                std::fs::write(p.join("out/x"), b"x").unwrap();
            }),
            ("file moved in", |p, o| {
                std::fs::write(o.join("m"), b"x").unwrap();
                std::fs::rename(o.join("m"), p.join("cache/m")).unwrap();
            }),
            ("hard link in", |p, o| {
                std::fs::write(o.join("h"), b"x").unwrap();
                std::fs::hard_link(o.join("h"), p.join("tmp/h")).unwrap();
            }),
            ("symlink in", |p, o| {
                std::os::unix::fs::symlink(o, p.join("browser/l")).unwrap()
            }),
            ("subdirectory replaced by a symlink", |p, o| {
                std::fs::remove_dir(p.join("logs")).unwrap();
                std::os::unix::fs::symlink(o, p.join("logs")).unwrap();
            }),
        ];
        for (i, (what, change)) in changes.iter().enumerate() {
            let before = scrubbed(&pool);
            let w = pool.create(&format!("c{i}")).unwrap();
            assert_pristine(&w, what);
            change(Path::new(&w.path), &outside);
            pool.remove(&w).unwrap();
            until(what, || scrubbed(&pool) == before + 1);
        }
        // Hand out more than the pool can hold: every one is pristine.
        let all: Vec<_> = (0..(POOL_MAX + 8))
            .map(|i| pool.create(&format!("after{i}")).unwrap())
            .collect();
        for w in &all {
            assert_pristine(w, &w.path);
        }
        // Links were removed, never followed: the linked file outside is intact.
        assert_eq!(std::fs::read(outside.join("h")).unwrap(), b"x");
    }

    #[test]
    fn a_workspace_written_to_while_pooled_is_not_handed_out() {
        let state = tempfile::tempdir().unwrap();
        let runs = ensure_runs_dir(state.path()).unwrap();
        let pool = full_pool(&runs);
        let name = pool.shared.ready.lock().unwrap()[5].name.clone();
        std::fs::write(runs.join(".pool").join(&name).join("out/planted"), b"x").unwrap();
        until("evicted", || scrubbed(&pool) == 1);
        for i in 0..POOL_TARGET {
            let w = pool.create(&format!("p{i}")).unwrap();
            assert_pristine(&w, &format!("p{i}"));
        }
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
