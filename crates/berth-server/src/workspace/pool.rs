//! The workspace pool and its thread: clean workspaces handed out at once, released
//! ones judged, then recycled or scrubbed.

use std::collections::{HashMap, VecDeque};
use std::ffi::CStr;
use std::fmt::Write as _;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use berth_store::WorkspaceIdentity;
use rustix::fs::{self, AtFlags, Dir, FileType, Mode, OFlags};
use rustix::io::Errno;

use super::{diagnostics::*, dir::*, names::*, watch::*, *};
use crate::walk::{self, OpenError};

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
    pub(super) runs_dir: PathBuf,
    pub(super) runs_fd: OwnedFd,
    pub(super) pool_fd: OwnedFd,
    pub(super) trash_fd: OwnedFd,
    pub(super) shared: Arc<Shared>,
    pub(super) wake: mpsc::Sender<()>,
    pub(super) next: Arc<AtomicU64>,
    pub diagnostics: Arc<DiagnosticsCounters>,
}

/// What the daemon and the pool thread share.
#[derive(Default)]
pub(super) struct Shared {
    /// Proven clean, in `runs/.pool`, ready to hand out.
    pub(super) ready: Mutex<VecDeque<Pooled>>,
    /// Released into `runs/.pool`, not judged yet.
    pub(super) released: Mutex<Vec<Pooled>>,
    /// Released, their identity checked, still at their run's name in `runs/`: the
    /// pool thread moves them into `runs/.pool` (issue 37: the move was a quarter of
    /// the request thread's CPU at 64 clients), or a grant to the same name first.
    pub(super) leaving: Mutex<Vec<Leaving>>,
}

/// A released workspace still at its run's name.
#[derive(Debug)]
pub(super) struct Leaving {
    pub(super) name: String,
    pub(super) ident: Ident,
    pub(super) run_id: String,
}

/// The directories a move aside goes between, and the counter that names entries.
pub(super) struct Dirs<'a> {
    pub(super) runs: &'a OwnedFd,
    pub(super) pool: &'a OwnedFd,
    pub(super) trash: &'a OwnedFd,
    pub(super) next: &'a AtomicU64,
}

impl Dirs<'_> {
    /// Moves the released workspace `l` from its run's name into `runs/.pool`, under a
    /// name that carries `run_id` (so an archive of its logs is named after the run,
    /// even after a crash). The entry moved must be the one whose identity the release
    /// checked; if something swapped it in between, it goes to the trash untouched (the
    /// pool thread skips `swapped-`) and is reported. `None`: nothing to judge.
    pub(super) fn move_aside(&self, l: Leaving) -> Option<Pooled> {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let aside = aside_name(&format!("{}-r{n}", l.name), Some(&l.run_id));
        match fs::renameat(self.runs, l.name.as_str(), self.pool, aside.as_str()) {
            Ok(()) => {}
            // Gone already (taken away by hand): nothing to recycle.
            Err(Errno::NOENT) => return None,
            Err(e) => {
                tracing::warn!(
                    run_id = l.run_id,
                    "workspace {}: move aside: {e}; left for the next start",
                    l.name
                );
                return None;
            }
        }
        match fs::statat(self.pool, aside.as_str(), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) if (st.st_dev, st.st_ino) == l.ident => Some(Pooled {
                name: aside,
                ident: l.ident,
            }),
            _ => {
                tracing::error!(
                    run_id = l.run_id,
                    "workspace {} was swapped after its release was checked: moved to the trash untouched, never removed",
                    l.name
                );
                let swapped = format!("swapped-{aside}");
                let _ = fs::renameat(self.pool, aside.as_str(), self.trash, swapped.as_str());
                None
            }
        }
    }
}

/// A workspace directory in `runs/.pool` and its identity.
#[derive(Clone, Debug)]
pub(super) struct Pooled {
    pub(super) name: String,
    pub(super) ident: Ident,
}

/// (device, inode) of a directory.
pub(super) type Ident = (u64, u64);

/// Empty workspaces made ahead when the pool runs low (creating inodes is the costly
/// part on ext4, so released workspaces are recycled rather than deleted and remade).
pub const POOL_TARGET: usize = 64;
/// New workspaces made per round of the pool thread.
pub(super) const REFILL_BATCH: usize = 4;
/// Recycled workspaces kept at most; beyond it released ones are deleted.
pub const POOL_MAX: usize = 4 * POOL_TARGET;
/// How often the pool thread looks for releases while they keep coming, and when idle.
/// Releases never wait for the thread nor wake it; the pool holds enough for the gap.
pub(super) const BUSY_PAUSE_MS: u64 = 2;
pub(super) const IDLE_PAUSE_MS: u64 = 20;
/// How often the whole trash directory is listed again: leftovers of an earlier daemon
/// and entries whose deletion failed (retried until it succeeds).
pub(super) const TRASH_RESCAN_MS: u64 = 1_000;

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
                trash_dir.join(format!("{OLD_PREFIX}{}", e.file_name().to_string_lossy())),
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
        let (pool_fd, trash_fd) = (dir_fd(&pool_dir)?, dir_fd(&trash_dir)?);
        let next = Arc::new(AtomicU64::new(0));
        let worker = Worker {
            runs_fd: dir_fd(runs_dir)?,
            next: next.clone(),
            pool_mount: walk::stat_fd(&pool_fd)?.mount(),
            trash_mount: walk::stat_fd(&trash_fd)?.mount(),
            pool_fd,
            trash_fd,
            trash_dir,
            shared: shared.clone(),
            diag,
            counters: counters.clone(),
            watcher: Watcher::new(),
            made: 0,
            trash: Vec::new(),
            stuck: HashMap::new(),
            measured: HashMap::new(),
            path: String::new(),
            mounts: std::fs::File::open("/proc/self/mountinfo").ok(),
            mount_proven: std::collections::HashSet::new(),
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
            next,
        })
    }

    /// A fresh workspace for `run_id`: from the pool if one is ready, else made now.
    pub fn create(&self, run_id: &str) -> Result<WorkspaceIdentity, WorkspaceError> {
        let name = dir_name(run_id);
        let path = self.runs_dir.join(&name);
        // A run of the same id released a moment ago: its workspace leaves first (with
        // the list locked, so the pool thread is not halfway through moving it).
        let moved = {
            let mut leaving = self.shared.leaving.lock().unwrap();
            let at = leaving.iter().position(|l| l.name == name);
            at.and_then(|i| self.dirs().move_aside(leaving.swap_remove(i)))
        };
        if let Some(p) = moved {
            self.shared.released.lock().unwrap().push(p);
        }
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

    /// At start: every entry of the runs directory that is not `owned` (by path, device
    /// and inode: the directory itself, W1) and not the pool's own (`.pool`, `.trash`)
    /// goes to the trash, to be scrubbed (its logs archived) like any other; returns
    /// their paths, each with the run id it was found to be `ended`'s. Only berth
    /// writes in the runs directory (0700), so such an entry is a workspace made for a
    /// grant that a crash kept from being recorded, or one of `ended` (ended runs'
    /// workspaces, by path and identity, and their run ids): a crash between its
    /// release and the pool thread's move aside (`Dirs::move_aside`). That one's trash
    /// entry carries the run id as the move would have, so its logs are still archived
    /// under the run's id. Renamed, never followed: a link or a file goes to the trash
    /// as it is, and the trash unlinks it.
    pub fn sweep(
        &self,
        owned: &std::collections::BTreeSet<(String, u64, u64)>,
        ended: &std::collections::BTreeMap<(String, u64, u64), String>,
    ) -> Vec<(String, Option<String>)> {
        let Ok(entries) = std::fs::read_dir(&self.runs_dir) else {
            return Vec::new();
        };
        let mut swept = Vec::new();
        for name in entries.filter_map(|e| e.ok()?.file_name().into_string().ok()) {
            let path = self.runs_dir.join(&name).display().to_string();
            let ident = fs::statat(&self.runs_fd, name.as_str(), AtFlags::SYMLINK_NOFOLLOW)
                .map(|st| (st.st_dev, st.st_ino));
            let key = ident.map(|(dev, ino)| (path.clone(), dev, ino));
            let ours = key.as_ref().is_ok_and(|k| owned.contains(k));
            if name.starts_with('.') || ours {
                continue;
            }
            let n = self.next.fetch_add(1, Ordering::Relaxed);
            let run = key.ok().and_then(|k| ended.get(&k));
            let aside = aside_name(&format!("{OLD_PREFIX}{name}-s{n}"), run.map(String::as_str));
            match fs::renameat_with(
                &self.runs_fd,
                name.as_str(),
                &self.trash_fd,
                aside.as_str(),
                fs::RenameFlags::NOREPLACE,
            ) {
                Ok(()) => swept.push((path, run.cloned())),
                Err(e) => tracing::warn!("workspace sweep: moving {path} to the trash: {e}"),
            }
        }
        let _ = self.wake.send(());
        swept
    }

    /// Checks the workspace's identity (W1: a swapped one is refused here, and its run
    /// degrades), then leaves it to the pool thread, which moves it into the pool to be
    /// judged (`Dirs::move_aside`; checked again after the move). Not moved here: a
    /// release costs one `stat` on the request's thread, not a rename. A crash before
    /// the move leaves it at its run's name, which the next start sweeps to the trash.
    pub fn remove(&self, ws: &WorkspaceIdentity, run_id: &str) -> Result<(), WorkspaceError> {
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
        self.shared.leaving.lock().unwrap().push(Leaving {
            name: name.to_string(),
            ident,
            run_id: run_id.to_string(),
        });
        Ok(())
    }

    pub(super) fn dirs(&self) -> Dirs<'_> {
        Dirs {
            runs: &self.runs_fd,
            pool: &self.pool_fd,
            trash: &self.trash_fd,
            next: &self.next,
        }
    }
}

/// The pool thread: moves releases aside, judges them, scrubs the trash, refills.
pub(super) struct Worker {
    runs_fd: OwnedFd,
    /// Names entries moved aside (shared with `Pool`, which moves some itself).
    next: Arc<AtomicU64>,
    pool_fd: OwnedFd,
    /// The mount of `runs/.pool`: every pooled workspace's subdirectories must be on it.
    pool_mount: walk::Mount,
    trash_fd: OwnedFd,
    /// The mount of `runs/.trash`: nothing on another one is scrubbed.
    trash_mount: walk::Mount,
    trash_dir: PathBuf,
    shared: Arc<Shared>,
    diag: Option<Diagnostics>,
    counters: Arc<DiagnosticsCounters>,
    watcher: Watcher,
    /// Workspaces made or recycled so far; names pool entries uniquely.
    made: u64,
    /// Trash entries this thread moved there itself, scrubbed in the same round.
    trash: Vec<String>,
    /// Trash entries whose removal failed (a mount inside, an undeletable file), by
    /// name, with the identity they had: retried at every rescan, but their logs are
    /// archived, they are counted and they are warned about only the first time.
    stuck: HashMap<String, Ident>,
    /// Archive sizes, so the total budget is enforced without walking every archive.
    measured: Measured,
    /// `/proc/self/mountinfo`, polled for `POLLPRI`: the kernel raises it when a mount
    /// or unmount changes the mount table.
    mounts: Option<std::fs::File>,
    /// Workspaces whose subdirectories were proven on the workspace's own mount since
    /// the mount table last changed: `judge` skips its five `statx` calls for them (they
    /// were ~3% of the daemon's CPU in the HTTP benchmark). Cleared by any mount change.
    mount_proven: std::collections::HashSet<Ident>,
    /// Scratch for `<name>/<subdirectory>` paths on the fast path.
    path: String,
}

impl Worker {
    fn run(mut self, wake: mpsc::Receiver<()>) {
        // What an earlier daemon left: archives complete but not yet named are named,
        // other partial archives dropped, budgets enforced.
        self.recover_partials();
        if let Some(d) = &self.diag {
            let dropped = enforce_total(d, &mut self.measured);
            self.counters
                .dropped
                .fetch_add(dropped, std::sync::atomic::Ordering::Relaxed);
        }
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
            self.move_leaving();
            let released = std::mem::take(&mut *self.shared.released.lock().unwrap());
            let dirtied = self.watcher.drain();
            if !dirtied.is_empty() {
                self.evict_ready(&dirtied);
            }
            // After taking the releases, like the inotify queue: a mount made before a
            // release shows here (the kernel counts it inside the mount call).
            if self.mounts_changed() {
                self.mount_proven.clear();
            }
            busy = !released.is_empty();
            for r in released {
                self.judge(r);
            }
            let entries = if std::time::Instant::now() >= rescan_at {
                rescan_at =
                    std::time::Instant::now() + std::time::Duration::from_millis(TRASH_RESCAN_MS);
                self.trash.clear();
                let entries: Vec<String> = std::fs::read_dir(&self.trash_dir)
                    .map(|rd| {
                        rd.filter_map(|e| e.ok())
                            .map(|e| e.file_name().to_string_lossy().into_owned())
                            .collect()
                    })
                    .unwrap_or_default();
                // What left the trash (unmounted and removed, or taken away by hand)
                // is forgotten.
                self.stuck.retain(|k, _| entries.contains(k));
                entries
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

    /// Moves the released workspaces still at their runs' names into the pool, one at
    /// a time with the list locked: a grant to the same name (`Pool::create`) then
    /// finds each either still listed (and moves it itself) or gone from its name,
    /// never taken off the list and not yet moved.
    fn move_leaving(&mut self) {
        let dirs = Dirs {
            runs: &self.runs_fd,
            pool: &self.pool_fd,
            trash: &self.trash_fd,
            next: &self.next,
        };
        loop {
            let moved = {
                let mut leaving = self.shared.leaving.lock().unwrap();
                let Some(l) = leaving.pop() else { return };
                dirs.move_aside(l)
            };
            if let Some(p) = moved {
                self.shared.released.lock().unwrap().push(p);
            }
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
    /// was proven clean and nothing is mounted over its subdirectories; else down the
    /// slow path.
    fn judge(&mut self, r: Pooled) {
        if self.pooled() < POOL_MAX
            && self.watcher.vouches(r.ident)
            && (self.mount_proven.contains(&r.ident) || self.in_place(&r))
        {
            self.mount_proven.insert(r.ident);
            self.shared.ready.lock().unwrap().push_back(r);
            return;
        }
        self.mount_proven.remove(&r.ident);
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

    /// Has the mount table changed since the last call? True when it cannot tell (no
    /// `/proc/self/mountinfo`, a failed poll): could not look is never "unchanged".
    fn mounts_changed(&mut self) -> bool {
        use rustix::event::{poll, PollFd, PollFlags, Timespec};
        let Some(f) = &self.mounts else { return true };
        let mut fds = [PollFd::new(f, PollFlags::PRI)];
        let zero = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        match poll(&mut fds, Some(&zero)) {
            Ok(0) => false,
            Ok(_) => !fds[0].revents().is_empty(),
            Err(_) => true,
        }
    }

    /// Whether the five subdirectories of the pooled workspace `r` are still directories
    /// on the workspace's own mount. A mount over one of them makes no inotify event,
    /// so the watches cannot vouch for that (found by an attacker: a bind mount over
    /// `out/` was recycled into another run). Five `statx` calls without following a
    /// link and without opening anything, so the fast path stays cheap. The path goes
    /// through the workspace's name in `runs/.pool`, berth's own directory; what is
    /// handed out is checked again by identity anyway (`Pool::create`).
    fn in_place(&mut self, r: &Pooled) -> bool {
        let on = walk::Mount {
            dev: r.ident.0,
            mnt_id: self.pool_mount.mnt_id,
        };
        SUBDIRS.iter().all(|sub| {
            self.path.clear();
            let _ = write!(self.path, "{}/{sub}", r.name);
            walk::stat_at(&self.pool_fd, self.path.as_str())
                .is_ok_and(|m| m.kind == FileType::Directory && m.on(&on))
        })
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
    /// the rest have their logs archived (P4) and are deleted, never following links
    /// and never across a mount point. An entry that cannot be deleted stays in the
    /// trash and is retried at every rescan.
    fn scrub(&mut self, entry: &str) {
        let Some(dir) = self.open_trash_entry(entry) else {
            return;
        };
        // The identity as `fstat` reports it, as the pool records it.
        let Ok(st) = fs::fstat(&dir) else { return };
        let ident = (st.st_dev, st.st_ino);
        let retry = self.stuck.get(entry) == Some(&ident);
        if !retry {
            self.counters
                .scrubbed
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        let room = self.pooled() < POOL_MAX;
        // Watch first, then look: a change made while looking shows up as an event.
        let watched = room && self.watcher.watch(&dir, ident);
        let clean = is_clean_fd(&dir, &self.trash_mount);
        if clean && room && self.recycle(entry, ident, watched) {
            return;
        }
        self.watcher.forget(ident);
        self.mount_proven.remove(&ident);
        // L5/P4: archived after the claim was freed; never holds capacity. Exactly once
        // per workspace, crashes included: the archive is written under a `.partial-`
        // name, then the entry is marked `archived-`, then the archive is named. A crash
        // before the mark: the partial is dropped at the next start and the entry
        // archived again. After it: the next start names the partial (`recover_partials`)
        // and the marked entry is only removed. (Naming first, then marking, archived a
        // workspace twice when the crash fell between the two.) A retried removal does
        // not archive again either.
        let marked;
        let mut entry = entry;
        if !clean && !retry && !entry.starts_with(ARCHIVED_PREFIX) {
            let partial = self
                .diag
                .as_ref()
                .and_then(|d| archive_logs(&dir, &self.trash_mount, d, entry));
            let source = entry;
            marked = format!("{ARCHIVED_PREFIX}{entry}");
            if fs::renameat(&self.trash_fd, entry, &self.trash_fd, marked.as_str()).is_ok() {
                self.stuck.remove(entry);
                entry = &marked;
            }
            // Crash tests: the entry is marked, its archive not yet named.
            crate::failpoint::hit("archive-marked");
            if let Some(partial) = partial {
                self.finish_archive(&partial, source);
            }
        }
        let removed = walk::remove_contents(&dir, &self.trash_mount);
        drop(dir);
        let result = removed.map_err(|e| e.to_string()).and_then(|_| {
            match fs::unlinkat(&self.trash_fd, entry, AtFlags::REMOVEDIR) {
                Ok(()) | Err(Errno::NOENT) => Ok(()),
                Err(e) => Err(format!("rmdir: {e}")),
            }
        });
        match result {
            Ok(()) => {
                self.stuck.remove(entry);
            }
            Err(e) => self.note_stuck(entry, ident, &e),
        }
    }

    /// Opens the trash entry `entry` to be scrubbed; `None` when there is nothing to
    /// scrub now: gone, a file or a link (unlinked, never followed), or a mount point
    /// or unreadable (kept, retried at the next rescan).
    fn open_trash_entry(&mut self, entry: &str) -> Option<OwnedFd> {
        match walk::open_dir(&self.trash_fd, entry, &self.trash_mount) {
            Ok((dir, _)) => Some(dir),
            Err(OpenError::Gone) => None,
            Err(OpenError::Kind) => {
                let _ = fs::unlinkat(&self.trash_fd, entry, AtFlags::empty());
                None
            }
            // Something mounted over the workspace itself: not ours to delete.
            Err(OpenError::Mount(m)) => {
                self.note_stuck(entry, (m.dev, m.ino), "it is a mount point");
                None
            }
            Err(OpenError::Io(e)) => {
                self.note_stuck(entry, (0, 0), &format!("open: {e}"));
                None
            }
        }
    }

    /// Moves the clean trash entry `entry` back into the pool, ready to hand out, if
    /// inotify vouches that nothing changed it while it was looked at (or it could not
    /// be watched: then its next release takes the slow path again). True if it did.
    fn recycle(&mut self, entry: &str, ident: Ident, watched: bool) -> bool {
        let dirtied = self.watcher.drain();
        if !dirtied.is_empty() {
            self.evict_ready(&dirtied);
        }
        if watched && !self.watcher.vouches(ident) {
            return false;
        }
        let name = self.next_name();
        if fs::renameat(&self.trash_fd, entry, &self.pool_fd, name.as_str()).is_err() {
            return false;
        }
        self.stuck.remove(entry);
        self.make_ready(name, ident);
        true
    }

    /// Hands out the pooled workspace `name` from now on. Checked on its mount just
    /// now (by `is_clean_fd`, or made here).
    fn make_ready(&mut self, name: String, ident: Ident) {
        self.shared
            .ready
            .lock()
            .unwrap()
            .push_back(Pooled { name, ident });
        self.mount_proven.insert(ident);
    }

    /// A trash entry that could not be removed stays and is retried at every rescan
    /// (every `TRASH_RESCAN_MS`): warned about the first time, then only at debug level,
    /// so a mount left over a workspace does not fill the log every second.
    fn note_stuck(&mut self, entry: &str, ident: Ident, why: &str) {
        let path = self.trash_dir.join(entry);
        if self.stuck.insert(entry.to_string(), ident) == Some(ident) {
            tracing::debug!(
                run_id = run_of(entry),
                "workspace pool: still cannot remove {}: {why}",
                path.display()
            );
        } else {
            tracing::warn!(
                run_id = run_of(entry),
                "workspace pool: cannot remove {}: {why}; kept and retried",
                path.display()
            );
        }
    }

    /// Names the complete archive `partial` of a trash entry's logs (P4), then keeps the
    /// diagnostics directory within its total budgets.
    ///
    /// The archive is named `<time>-<label>` (see `archive_name`): the label is the run
    /// id the name of `entry` (unmarked) carries, or the workspace's digest for an entry
    /// that carries none; `-1`, `-2`, ... is added when that name is taken.
    fn finish_archive(&mut self, partial: &CStr, entry: &str) {
        let Some(d) = &self.diag else { return };
        let label = archive_label(entry);
        let Some(a) = name_archive(d, partial, &archive_name(label)) else {
            return;
        };
        let archive = a.name.to_string_lossy().into_owned();
        match run_of(entry) {
            Some(run_id) => tracing::info!(
                run_id,
                archive,
                bytes = a.usage.bytes,
                entries = a.usage.entries,
                "run logs archived"
            ),
            None => tracing::info!(
                workspace = label,
                archive,
                bytes = a.usage.bytes,
                entries = a.usage.entries,
                "workspace logs archived (run unknown)"
            ),
        }
        use std::sync::atomic::Ordering::Relaxed;
        self.counters.archived.fetch_add(1, Relaxed);
        self.counters.bytes.fetch_add(a.usage.bytes, Relaxed);
        self.measured.insert(a.name, (a.ino, a.usage));
        let dropped = enforce_total(d, &mut self.measured);
        if dropped > 0 {
            tracing::info!(
                dropped,
                dir = %d.dir.display(),
                "diagnostics over budget: the oldest archives were dropped"
            );
        }
        self.counters.dropped.fetch_add(dropped, Relaxed);
    }

    /// At start: a `.partial-<entry>` archive whose trash entry is marked
    /// `archived-<entry>` is complete (the mark comes after the last byte), so it is
    /// named; every other `.partial-` entry is dropped by `enforce_total`.
    fn recover_partials(&mut self) {
        let Some(d) = &self.diag else { return };
        let Ok(Some((diag, _))) = open_diagnostics(d, false) else {
            return;
        };
        let Ok(mut rd) = Dir::read_from(&diag) else {
            return;
        };
        let mut complete = Vec::new();
        while let Some(Ok(e)) = rd.read() {
            let Some(entry) = e
                .file_name()
                .to_str()
                .ok()
                .and_then(|n| n.strip_prefix(PARTIAL_PREFIX))
            else {
                continue;
            };
            let marked = format!("{ARCHIVED_PREFIX}{entry}");
            let is_marked = walk::stat_at(&self.trash_fd, marked.as_str())
                .is_ok_and(|m| m.kind == FileType::Directory);
            if is_marked {
                complete.push((e.file_name().to_owned(), entry.to_string()));
            }
        }
        for (partial, entry) in complete {
            self.finish_archive(&partial, &entry);
        }
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
                    self.make_ready(name, ident);
                }
                Err(e) => {
                    tracing::warn!("workspace pool: {e}");
                    break;
                }
            }
        }
    }
}
