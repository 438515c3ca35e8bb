//! Run workspaces (W1): `<state_dir>/runs/<digest>/{tmp,logs,cache,browser,out}`, mode
//! 0700, created and removed through directory file descriptors with `O_NOFOLLOW`, so a
//! symlink planted in the path is never followed. The (device, inode) pair goes into the
//! ledger and must match before anything is removed.
//!
//! A run controls every file in its workspace, and berth often runs as root, so every
//! walk over a workspace's contents (removal, the clean check, archiving its logs) goes
//! through `crate::walk`: iterative with bounded descriptors whatever the depth, never
//! following a link, never crossing a mount point. A workspace with a mount inside is
//! neither recycled nor scrubbed: it stays in the trash until it is unmounted.

use std::collections::{HashMap, VecDeque};
use std::ffi::{CStr, CString};
use std::fmt::Write as _;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use berth_store::WorkspaceIdentity;
use rustix::fs::{self, inotify, AtFlags, Dir, FileType, Mode, OFlags, CWD};
use rustix::io::Errno;
use sha2::{Digest, Sha256};

use crate::walk::{self, OpenError};

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
    /// A mount point in the workspace (or over it): nothing under it is deleted, and
    /// the workspace stays until it is unmounted.
    #[error("workspace {path} has a mount point inside; nothing under it was removed; left for a later retry")]
    Mounted { path: String },
}

/// A run's workspace directory name: a digest, so any run id maps to a safe name.
pub fn dir_name(run_id: &str) -> String {
    let d = Sha256::digest(run_id.as_bytes());
    d.iter().take(16).map(|b| format!("{b:02x}")).collect()
}

/// Joins a released workspace's name in `runs/.pool` and `runs/.trash` to the id of the
/// run it was released by: `<digest>-r<n>@<run id>`. `@` is in neither a digest nor the
/// run-id alphabet, so the run id is everything after the first one. Kept in the name,
/// not in memory, so the archive of a workspace scrubbed after a crash is still named
/// after its run.
const RUN_SEP: char = '@';

/// Bytes of a run id as a name part at most (the longest valid run id).
const RUN_ID_NAME_MAX: usize = 128;

/// The run id as a part of a file name. A valid run id already is one (SPEC 2:
/// `[A-Za-z0-9][A-Za-z0-9._:-]{0,127}`: no `/`, no NUL, never `.` or `..`, a letter or
/// digit first, at most 128 bytes) and is kept exactly. Anything else (never expected:
/// the engine refuses invalid run ids) has every other character replaced by `_`, is cut
/// to 128 bytes and starts with a letter or digit; `None` when nothing is left.
fn run_id_name(run_id: &str) -> Option<String> {
    if berth_core::validate::run_id(run_id).is_ok() {
        return Some(run_id.to_string());
    }
    let safe: String = run_id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .skip_while(|c| !c.is_ascii_alphanumeric())
        .take(RUN_ID_NAME_MAX)
        .collect();
    (!safe.is_empty()).then_some(safe)
}

/// The run id a trash entry's name carries (see `RUN_SEP`), if it carries a valid one.
fn run_of(entry: &str) -> Option<&str> {
    let (_, id) = entry.split_once(RUN_SEP)?;
    berth_core::validate::run_id(id).ok().map(|()| id)
}

/// The workspace's own name in a trash entry's name: the entry without the prefixes the
/// pool adds (`archived-`, `old-`), up to its first `-` or `@`: the run's digest for a
/// released workspace.
fn digest_of(entry: &str) -> &str {
    let mut rest = entry;
    while let Some(r) = rest
        .strip_prefix(ARCHIVED_PREFIX)
        .or_else(|| rest.strip_prefix(OLD_PREFIX))
    {
        rest = r;
    }
    let end = rest.find(['-', RUN_SEP]).unwrap_or(rest.len());
    if end == 0 {
        entry
    } else {
        &rest[..end]
    }
}

/// What an archive of the trash entry's logs is named after: its run id when the entry
/// carries one (every release by this berth), else its digest (an entry left by an
/// older berth).
fn archive_label(entry: &str) -> &str {
    run_of(entry).unwrap_or_else(|| digest_of(entry))
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

/// The mount of the directory open as `dir`: what everything below it must be on.
fn mount_of(dir: &OwnedFd, path: &Path) -> Result<walk::Mount, WorkspaceError> {
    walk::stat_fd(dir)
        .map(|m| m.mount())
        .map_err(io(path, "stat"))
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
    let on = mount_of(&parent, runs_dir)?;
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
    let on = mount_of(&parent, parent_path)?;
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
fn open_verified(
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
fn remove_contents(dir: &OwnedFd, on: &walk::Mount, path: &Path) -> Result<(), WorkspaceError> {
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

/// Where diagnostics go and how much they may take (P4). Every budget counts what the
/// archives cost on disk, not the bytes of their contents: allocated blocks (at least
/// one 4 KiB block per file or directory, `walk::BLOCK_BYTES_MIN`) and entries
/// (inodes). Counting content bytes let 100,000 one-byte files pass as 100 KB while
/// they took 400 MB and 100,000 inodes.
#[derive(Clone, Debug)]
pub struct Diagnostics {
    pub dir: PathBuf,
    /// Bytes (allocated blocks) of one run's archive at most; the rest is cut.
    pub run_bytes_max: u64,
    /// Bytes (allocated blocks) of the whole diagnostics directory at most; the oldest
    /// archives are dropped first.
    pub total_bytes_max: u64,
    /// Entries (files and directories, the archive's own included) of one run's
    /// archive at most; the rest is left out.
    pub run_entries_max: u64,
    /// Entries of the whole diagnostics directory at most; the oldest archives are
    /// dropped first.
    pub total_entries_max: u64,
}

/// Default `Diagnostics::run_entries_max`: a run's logs are a handful of files; a
/// thousand is plenty and costs at most a thousand inodes.
pub const DIAGNOSTICS_RUN_ENTRIES_MAX: u64 = 1_000;
/// Default `Diagnostics::total_entries_max`: a hundred full archives, far below the
/// inodes of any file system a state directory lives on.
pub const DIAGNOSTICS_TOTAL_ENTRIES_MAX: u64 = 100_000;

/// Running totals of the pool thread's slow path and archiving.
#[derive(Debug, Default)]
pub struct DiagnosticsCounters {
    pub archived: std::sync::atomic::AtomicU64,
    /// Bytes (allocated blocks, as budgeted) of the archives written.
    pub bytes: std::sync::atomic::AtomicU64,
    pub dropped: std::sync::atomic::AtomicU64,
    /// Workspaces that took the slow path (scanned, then recycled or deleted); a
    /// workspace whose removal is retried counts once.
    pub scrubbed: std::sync::atomic::AtomicU64,
}

/// Directory levels of `logs/` archived at most; deeper ones are left out. An archive
/// holds two descriptors per level (source and copy), so this keeps it within
/// `walk::WALK_FDS_MAX`, and the archive itself stays shallow enough to be measured.
pub const ARCHIVE_DEPTH_MAX: usize = walk::WALK_FDS_MAX / 2;
/// Entries of `logs/` looked at per archive at most, links and special files included:
/// a directory of millions of entries cannot hold the pool thread. Each directory's
/// listing is held and sorted (so what is kept, when not everything fits, is the first
/// by name: predictable), so this also bounds the memory an archive takes.
pub const ARCHIVE_VISITS_MAX: u64 = 16 * DIAGNOSTICS_RUN_ENTRIES_MAX;
/// Blocks of a run's budget kept free whenever an entry is added: one new entry can
/// grow its directory by up to two blocks (ext4 switching to an indexed directory).
/// The growth is charged once seen; keeping room for it means it never takes an
/// archive past its budget.
const DIR_GROWTH_RESERVE_BLOCKS: u64 = 2;
/// Bytes read and written per step of a copy.
const COPY_BUF_BYTES: usize = 64 * 1024;

/// One archive written: its name in the diagnostics directory, inode and cost.
struct Archived {
    name: CString,
    ino: u64,
    usage: walk::Usage,
}

/// Opens the diagnostics directory, making it if asked; `None` when it does not exist
/// and was not to be made. Private: 0700, whatever the umask or an older berth left.
/// The state directory above it is the operator's and berth's own, opened by path; the
/// diagnostics directory itself is never a link (`O_NOFOLLOW`).
fn open_diagnostics(
    d: &Diagnostics,
    create: bool,
) -> std::io::Result<Option<(OwnedFd, walk::Meta)>> {
    let (parent, name) = match (d.dir.parent(), d.dir.file_name()) {
        (Some(p), Some(n)) if p.as_os_str().is_empty() => (Path::new("."), n),
        (Some(p), Some(n)) => (p, n),
        _ => {
            return Err(std::io::Error::other(
                "a diagnostics directory needs a name",
            ))
        }
    };
    let pfd = fs::open(
        parent,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    if create {
        match fs::mkdirat(&pfd, name, Mode::from_raw_mode(0o700)) {
            Ok(()) | Err(Errno::EXIST) => {}
            Err(e) => return Err(e.into()),
        }
    }
    match walk::open_dir_any(&pfd, name) {
        Ok((fd, meta)) => {
            if meta.mode != 0o700 {
                fs::fchmod(&fd, Mode::from_raw_mode(0o700))?;
            }
            Ok(Some((fd, meta)))
        }
        Err(OpenError::Gone) => Ok(None),
        Err(OpenError::Io(e)) => Err(e.into()),
        Err(_) => Err(std::io::Error::other("not a directory")),
    }
}

/// Makes the private directory `name` under `parent` (never an existing one: `EEXIST`
/// is an error) and returns it open, 0700 exactly.
fn make_private_dir(parent: &OwnedFd, name: &CStr, on: &walk::Mount) -> Result<OwnedFd, Errno> {
    fs::mkdirat(parent, name, Mode::from_raw_mode(0o700))?;
    let (fd, _) = walk::open_dir(parent, name, on).map_err(|e| match e {
        OpenError::Io(e) => e,
        _ => Errno::NOTDIR,
    })?;
    // Exactly 0700: the umask may only have taken bits away.
    fs::fchmod(&fd, Mode::from_raw_mode(0o700))?;
    Ok(fd)
}

/// Copies at most `n` bytes of `src` into a new private file `name` under `dest`
/// (`O_CREAT | O_EXCL | O_NOFOLLOW`, 0600 exactly); returns it and the bytes copied.
fn copy_file(
    src: &OwnedFd,
    dest: &OwnedFd,
    name: &CStr,
    n: u64,
    buf: &mut [u8],
) -> Result<(OwnedFd, u64), Errno> {
    let out = fs::openat(
        dest,
        name,
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )?;
    fs::fchmod(&out, Mode::from_raw_mode(0o600))?;
    let mut copied = 0u64;
    while copied < n {
        let want = (buf.len() as u64).min(n - copied) as usize;
        let got = match rustix::io::read(src, &mut buf[..want]) {
            Ok(0) => break,
            Ok(k) => k,
            Err(Errno::INTR) => continue,
            Err(e) => return Err(e),
        };
        let mut rest = &buf[..got];
        while !rest.is_empty() {
            match rustix::io::write(&out, rest) {
                Ok(0) => return Err(Errno::NOSPC),
                Ok(k) => rest = &rest[k..],
                Err(Errno::INTR) => {}
                Err(e) => return Err(e),
            }
        }
        copied += got as u64;
    }
    Ok((out, copied))
}

/// The entries of the directory open as `dir`, at most `visits` of them (counted down),
/// sorted so that `pop` yields them by name.
fn list_sorted(dir: &OwnedFd, visits: &mut u64) -> Vec<(CString, FileType)> {
    let mut names = Vec::new();
    let Ok(mut rd) = Dir::read_from(dir) else {
        return names;
    };
    while *visits > 0 {
        let Some(Ok(e)) = rd.read() else { break };
        let name = e.file_name();
        if name == c"." || name == c".." {
            continue;
        }
        *visits -= 1;
        names.push((name.to_owned(), e.file_type()));
    }
    names.sort_unstable_by(|a, b| b.0.cmp(&a.0));
    names
}

/// What an archive may still take, in file system blocks of `block` bytes.
struct Budget {
    bytes_max: u64,
    entries_max: u64,
    spent: walk::Usage,
    block: u64,
}

impl Budget {
    /// Bytes a new entry may take now (a multiple of the block, at least one), or
    /// `None` when not even an empty file fits: then nothing else does either.
    fn room(&self) -> Option<u64> {
        if self.spent.entries >= self.entries_max {
            return None;
        }
        let avail = self
            .bytes_max
            .saturating_sub(self.spent.bytes)
            .saturating_sub(DIR_GROWTH_RESERVE_BLOCKS * self.block);
        (avail >= self.block).then_some(avail / self.block * self.block)
    }

    /// What `n` bytes of content take: whole blocks, at least one.
    fn cost(&self, n: u64) -> u64 {
        n.div_ceil(self.block).max(1) * self.block
    }

    fn charge(&mut self, bytes: u64) {
        self.spent.add(walk::Usage {
            bytes,
            entries: 1,
            complete: true,
        });
    }
}

/// One level of an archive being copied: the source directory, its entries not yet
/// copied, the copy, and what the copy's own directory has been charged so far.
struct CopyFrame {
    src: OwnedFd,
    names: Vec<(CString, FileType)>,
    dest: OwnedFd,
    dest_bytes: u64,
}

impl CopyFrame {
    /// Charges the growth of the copy's directory since it was last looked at.
    fn charge_growth(&mut self, budget: &mut Budget) {
        if let Ok(m) = walk::stat_fd(&self.dest) {
            let now = m.cost_bytes();
            if now > self.dest_bytes {
                budget.spent.bytes = budget.spent.bytes.saturating_add(now - self.dest_bytes);
                self.dest_bytes = now;
            }
        }
    }
}

/// Copies the regular files under the workspace's `logs/` into a new private archive
/// `<diagnostics>/.partial-<entry>` within the run's budgets (bytes by blocks,
/// entries), at most `ARCHIVE_DEPTH_MAX` levels deep, by name; `None` when nothing was
/// archived. The caller marks the trash entry archived, then names the archive with
/// `name_archive`: see `Worker::scrub` for why in that order.
///
/// Read only through descriptors: `logs` is opened under the workspace's descriptor
/// with `O_NOFOLLOW | O_DIRECTORY` (a `logs` link, file or mount point is not archived
/// at all: with `logs -> /etc`, /etc was archived), each file with `O_NOFOLLOW |
/// O_NONBLOCK` and kept only if its descriptor is a regular file on the workspace's
/// mount; links, fifos, sockets and devices are never opened. Written privately (a
/// root-only 0600 file was copied as 0644): directories 0700, files 0600, each created
/// with `O_EXCL | O_NOFOLLOW` under the copy's descriptor.
fn archive_logs(ws: &OwnedFd, on: &walk::Mount, d: &Diagnostics, entry: &str) -> Option<CString> {
    let (logs, _) = walk::open_dir(ws, "logs", on).ok()?;
    let mut visits = ARCHIVE_VISITS_MAX;
    let names = list_sorted(&logs, &mut visits);
    if names.is_empty() {
        return None;
    }
    let (diag, diag_meta) = match open_diagnostics(d, true) {
        Ok(Some(x)) => x,
        Ok(None) => return None,
        Err(e) => {
            tracing::warn!("diagnostics {}: {e}", d.dir.display());
            return None;
        }
    };
    let diag_on = diag_meta.mount();
    let block = fs::fstatvfs(&diag)
        .map(|v| v.f_frsize)
        .unwrap_or(0)
        .max(walk::BLOCK_BYTES_MIN);
    // Never more than the total budgets leave room for: a larger archive would only be
    // dropped at once.
    let mut budget = Budget {
        bytes_max: d
            .run_bytes_max
            .min(d.total_bytes_max.saturating_sub(diag_meta.cost_bytes())),
        entries_max: d.run_entries_max.min(d.total_entries_max.saturating_sub(1)),
        spent: walk::Usage::default(),
        block,
    };
    budget.room()?;
    // Written under `.partial-<trash entry>` and named as an archive only once complete
    // and once the entry is marked: a crash before the mark leaves a `.partial-` entry
    // that the next start drops (and the entry is archived again, whole); a crash after
    // it, one that the next start names (see `recover_partials`). Never an archive that
    // looks whole and is not, never two of one workspace. (Trash entry names are at most
    // ~190 bytes, so the prefixed name fits a file name.)
    let partial = CString::new(format!("{PARTIAL_PREFIX}{entry}")).ok()?;
    let mut made = None;
    for _ in 0..2 {
        match make_private_dir(&diag, &partial, &diag_on) {
            Ok(fd) => {
                made = Some(fd);
                break;
            }
            // Left by an attempt that failed before its mark: redone from the start.
            Err(Errno::EXIST) => {
                if let Err(e) = drop_entry(&diag, &partial, &diag_on) {
                    tracing::warn!("diagnostics {}: {e}", d.dir.display());
                    return None;
                }
            }
            Err(e) => {
                tracing::warn!("diagnostics {}: making an archive: {e}", d.dir.display());
                return None;
            }
        }
    }
    let top = made?;
    budget.charge(block);
    let mut stack = vec![CopyFrame {
        src: logs,
        names,
        dest: top,
        dest_bytes: block,
    }];
    let mut files = 0u64;
    let mut buf = vec![0u8; COPY_BUF_BYTES];
    loop {
        let depth = stack.len();
        let Some(f) = stack.last_mut() else { break };
        let Some((entry, mut kind)) = f.names.pop() else {
            stack.pop();
            continue;
        };
        if kind == FileType::Unknown {
            kind = walk::stat_at(&f.src, entry.as_c_str()).map_or(FileType::Unknown, |m| m.kind);
        }
        match kind {
            FileType::RegularFile => {
                let Some(room) = budget.room() else { break };
                // A link, a fifo or a mount swapped in since the listing is skipped.
                let Ok((src, meta)) = walk::open_file(&f.src, entry.as_c_str(), on) else {
                    continue;
                };
                match copy_file(&src, &f.dest, &entry, meta.size.min(room), &mut buf) {
                    Ok((out, copied)) => {
                        let real = walk::stat_fd(&out).map_or(0, |m| m.cost_bytes());
                        budget.charge(budget.cost(copied).max(real));
                        f.charge_growth(&mut budget);
                        files += 1;
                        // Crash tests: a crash with an archive half written.
                        if files == 1 {
                            crate::failpoint::hit("mid-archive");
                        }
                    }
                    Err(e) => {
                        tracing::warn!("diagnostics {}: copying a log: {e}", d.dir.display());
                        break;
                    }
                }
            }
            FileType::Directory if depth < ARCHIVE_DEPTH_MAX => {
                if budget.room().is_none() {
                    break;
                }
                let Ok((src, _)) = walk::open_dir(&f.src, entry.as_c_str(), on) else {
                    continue;
                };
                let dest = match make_private_dir(&f.dest, &entry, &diag_on) {
                    Ok(fd) => fd,
                    Err(e) => {
                        tracing::warn!("diagnostics {}: copying a log: {e}", d.dir.display());
                        break;
                    }
                };
                budget.charge(block);
                f.charge_growth(&mut budget);
                let names = list_sorted(&src, &mut visits);
                stack.push(CopyFrame {
                    src,
                    names,
                    dest,
                    dest_bytes: block,
                });
            }
            // Links, fifos, sockets, devices, directories too deep: not archived.
            _ => {}
        }
    }
    drop(stack);
    if files == 0 {
        if let Err(e) = drop_entry(&diag, &partial, &diag_on) {
            tracing::warn!("diagnostics {}: {e}", d.dir.display());
        }
        return None;
    }
    Some(partial)
}

/// Names the complete archive `<diagnostics>/<partial>` as `<name>`, or `<name>-1`,
/// `<name>-2`, ... when that is taken (RENAME_NOREPLACE: never over another archive),
/// and measures it; `None` (the partial dropped) when it cannot be named.
fn name_archive(d: &Diagnostics, partial: &CStr, name: &str) -> Option<Archived> {
    let (diag, diag_meta) = match open_diagnostics(d, false) {
        Ok(Some(x)) => x,
        Ok(None) => return None,
        Err(e) => {
            tracing::warn!("diagnostics {}: {e}", d.dir.display());
            return None;
        }
    };
    let diag_on = diag_meta.mount();
    let mut named = None;
    for k in 0..16 {
        let archive = CString::new(if k == 0 {
            name.to_string()
        } else {
            format!("{name}-{k}")
        })
        .ok()?;
        match fs::renameat_with(
            &diag,
            partial,
            &diag,
            archive.as_c_str(),
            fs::RenameFlags::NOREPLACE,
        ) {
            Ok(()) => {
                named = Some(archive);
                break;
            }
            Err(Errno::EXIST) => {}
            Err(e) => {
                tracing::warn!("diagnostics {}: naming an archive: {e}", d.dir.display());
                break;
            }
        }
    }
    let Some(archive) = named else {
        let _ = drop_entry(&diag, partial, &diag_on);
        return None;
    };
    // Reported as measured, which is also what `enforce_total` counts.
    let (fd, meta) = walk::open_dir(&diag, archive.as_c_str(), &diag_on).ok()?;
    let usage = walk::usage(&fd, &diag_on, u64::MAX).unwrap_or_default();
    Some(Archived {
        name: archive,
        ino: meta.ino,
        usage,
    })
}

/// An archive's name: `<time>-<label>`, the time in milliseconds since the Unix epoch,
/// 15 digits (first, so that name order is age order for `enforce_total`).
fn archive_name(label: &str) -> String {
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|t| t.as_millis())
        .unwrap_or(0);
    format!("{stamp:015}-{label}")
}

/// Deletes the entry `name` of the diagnostics directory (an archive, or anything
/// else found there), iteratively and never across a mount.
fn drop_entry(diag: &OwnedFd, name: &CStr, on: &walk::Mount) -> Result<(), String> {
    match walk::open_dir(diag, name, on) {
        Ok((fd, _)) => {
            walk::remove_contents(&fd, on).map_err(|e| e.to_string())?;
            drop(fd);
            match fs::unlinkat(diag, name, AtFlags::REMOVEDIR) {
                Ok(()) | Err(Errno::NOENT) => Ok(()),
                Err(e) => Err(format!("rmdir: {e}")),
            }
        }
        Err(OpenError::Gone) => Ok(()),
        Err(OpenError::Kind) => match fs::unlinkat(diag, name, AtFlags::empty()) {
            Ok(()) | Err(Errno::NOENT) => Ok(()),
            Err(e) => Err(format!("unlink: {e}")),
        },
        Err(OpenError::Mount(_)) => Err("a mount point; left alone".into()),
        Err(OpenError::Io(e)) => Err(format!("open: {e}")),
    }
}

/// The name prefix of an archive being written (see `archive_logs`).
const PARTIAL_PREFIX: &str = ".partial-";
/// The name prefix of a trash entry whose logs were archived already: a removal that a
/// crash cut short is finished after the restart without archiving what is left of the
/// logs a second time.
const ARCHIVED_PREFIX: &str = "archived-";
/// The name prefix of a trash entry that an earlier daemon left in `runs/.pool`.
const OLD_PREFIX: &str = "old-";

/// Archives measured so far, by name, with the inode they were measured at: an archive
/// never changes once written, so each is walked once, not again at every new archive.
type Measured = HashMap<CString, (u64, walk::Usage)>;

/// Keeps the diagnostics directory within its total budgets, bytes (by blocks) and
/// entries, the directory itself included: drops the oldest archives (names begin with
/// their time) until both hold. Returns how many were dropped.
fn enforce_total(d: &Diagnostics, measured: &mut Measured) -> u64 {
    let (diag, meta) = match open_diagnostics(d, false) {
        Ok(Some(x)) => x,
        Ok(None) => return 0,
        Err(e) => {
            tracing::warn!("diagnostics {}: {e}", d.dir.display());
            return 0;
        }
    };
    let on = meta.mount();
    let mut total = walk::Usage {
        bytes: meta.cost_bytes(),
        entries: 1,
        complete: true,
    };
    let Ok(mut rd) = Dir::read_from(&diag) else {
        return 0;
    };
    let mut archives: Vec<(CString, walk::Usage)> = Vec::new();
    while let Some(Ok(e)) = rd.read() {
        let name = e.file_name();
        if name == c"." || name == c".." {
            continue;
        }
        let name = name.to_owned();
        let Ok(m) = walk::stat_at(&diag, name.as_c_str()) else {
            continue;
        };
        // A mount inside the diagnostics directory is the operator's doing: neither
        // counted nor dropped.
        if !m.on(&on) {
            continue;
        }
        // Archives are written by this thread alone and are complete by now: a
        // `.partial-` entry is what a crash left halfway. Dropped, not counted.
        if name.to_bytes().starts_with(PARTIAL_PREFIX.as_bytes()) {
            if let Err(e) = drop_entry(&diag, &name, &on) {
                tracing::warn!(
                    "diagnostics {}: dropping a partial archive: {e}",
                    d.dir.display()
                );
            }
            continue;
        }
        let usage = if m.kind != FileType::Directory {
            walk::Usage {
                bytes: m.cost_bytes(),
                entries: 1,
                complete: true,
            }
        } else if let Some((_, u)) = measured.get(&name).filter(|(ino, _)| *ino == m.ino) {
            *u
        } else {
            let u = match walk::open_dir(&diag, name.as_c_str(), &on) {
                Ok((fd, _)) => {
                    walk::usage(&fd, &on, d.total_entries_max.saturating_add(1)).unwrap_or_default()
                }
                Err(_) => walk::Usage::default(),
            };
            // What cannot be measured whole (deeper than a walk goes, or more entries
            // than the whole budget) counts as over the budget: dropped in its turn.
            let u = if u.complete {
                u
            } else {
                walk::Usage {
                    bytes: u64::MAX / 4,
                    entries: u64::MAX / 4,
                    complete: false,
                }
            };
            measured.insert(name.clone(), (m.ino, u));
            u
        };
        total.add(usage);
        archives.push((name, usage));
    }
    archives.sort_by(|a, b| a.0.cmp(&b.0));
    measured.retain(|k, _| archives.binary_search_by(|a| a.0.cmp(k)).is_ok());
    let mut dropped = 0;
    for (name, usage) in &archives {
        if total.bytes <= d.total_bytes_max && total.entries <= d.total_entries_max {
            break;
        }
        match drop_entry(&diag, name, &on) {
            Ok(()) => {
                total.sub(*usage);
                measured.remove(name);
                dropped += 1;
            }
            Err(e) => tracing::warn!(
                "diagnostics {}: dropping {}: {e}",
                d.dir.display(),
                name.to_string_lossy()
            ),
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
        let worker = Worker {
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
    /// background thread. Its name there carries `run_id`, so that if its logs are
    /// archived, the archive is named after the run (see `RUN_SEP`), even after a crash.
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
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let aside = match run_id_name(run_id) {
            Some(id) => format!("{name}-r{n}{RUN_SEP}{id}"),
            None => format!("{name}-r{n}"),
        };
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
        let dir = match walk::open_dir(&self.trash_fd, entry, &self.trash_mount) {
            Ok((dir, _)) => dir,
            Err(OpenError::Gone) => return,
            Err(OpenError::Kind) => {
                // A file or a link: unlinked, never followed.
                let _ = fs::unlinkat(&self.trash_fd, entry, AtFlags::empty());
                return;
            }
            // Something mounted over the workspace itself: not ours to delete.
            Err(OpenError::Mount(m)) => {
                self.note_stuck(entry, (m.dev, m.ino), "it is a mount point");
                return;
            }
            Err(OpenError::Io(e)) => {
                self.note_stuck(entry, (0, 0), &format!("open: {e}"));
                return;
            }
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
                    self.stuck.remove(entry);
                    self.shared
                        .ready
                        .lock()
                        .unwrap()
                        .push_back(Pooled { name, ident });
                    // Checked on its mount just now (is_clean_fd or made here).
                    self.mount_proven.insert(ident);
                    return;
                }
            }
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
                    self.shared
                        .ready
                        .lock()
                        .unwrap()
                        .push_back(Pooled { name, ident });
                    // Checked on its mount just now (is_clean_fd or made here).
                    self.mount_proven.insert(ident);
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
/// directories (not links, not mount points: on the mount `on`, the workspace's own) of
/// mode 0700 (W1). Checked through descriptors.
fn is_clean_fd(dir: &OwnedFd, on: &walk::Mount) -> bool {
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
        pool.remove(&a, "a").unwrap();
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
            pool.remove(&w, &format!("b{i}")).unwrap();
        }
        // A swapped workspace is refused and left alone.
        let c = pool.create("c").unwrap();
        let pc = PathBuf::from(&c.path);
        std::fs::rename(&pc, runs.join("aside")).unwrap();
        std::fs::create_dir(&pc).unwrap();
        assert!(matches!(
            pool.remove(&c, "c"),
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
            pool.remove(&w, &format!("u{i}")).unwrap();
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
            pool.remove(&w, &format!("c{i}")).unwrap();
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

    /// A test's diagnostics settings: the default entry budgets, the byte budgets given.
    fn diagnostics(state: &Path, run_bytes_max: u64, total_bytes_max: u64) -> Diagnostics {
        Diagnostics {
            dir: state.join("diagnostics"),
            run_bytes_max,
            total_bytes_max,
            run_entries_max: DIAGNOSTICS_RUN_ENTRIES_MAX,
            total_entries_max: DIAGNOSTICS_TOTAL_ENTRIES_MAX,
        }
    }

    fn archived(pool: &Pool) -> u64 {
        pool.diagnostics
            .archived
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    fn trash_is_empty(runs: &Path) -> bool {
        std::fs::read_dir(runs.join(".trash"))
            .unwrap()
            .next()
            .is_none()
    }

    /// Waits until `f` holds, at most `secs` seconds.
    fn until_within(what: &str, secs: u64, mut f: impl FnMut() -> bool) {
        let end = std::time::Instant::now() + std::time::Duration::from_secs(secs);
        while !f() {
            assert!(std::time::Instant::now() < end, "never: {what}");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    /// What a tree really takes, counted here independently of the code under test:
    /// the sum of `st_blocks * 512` and the number of entries, the top included.
    fn disk_usage(top: &Path) -> (u64, u64) {
        use std::os::unix::fs::MetadataExt;
        let (mut bytes, mut entries) = (0, 0);
        let mut stack = vec![top.to_path_buf()];
        while let Some(p) = stack.pop() {
            let m = std::fs::symlink_metadata(&p).unwrap();
            bytes += m.blocks() * 512;
            entries += 1;
            if m.is_dir() {
                for e in std::fs::read_dir(&p).unwrap() {
                    stack.push(e.unwrap().path());
                }
            }
        }
        (bytes, entries)
    }

    /// Every entry under `top` as (path relative to it, mode, is a directory), sorted.
    fn tree(top: &Path) -> Vec<(String, u32, bool)> {
        let mut out = Vec::new();
        let mut stack = vec![top.to_path_buf()];
        while let Some(p) = stack.pop() {
            for e in std::fs::read_dir(&p).unwrap() {
                let e = e.unwrap();
                let m = std::fs::symlink_metadata(e.path()).unwrap();
                let rel = e.path().strip_prefix(top).unwrap().display().to_string();
                out.push((rel, m.permissions().mode() & 0o7777, m.is_dir()));
                if m.is_dir() {
                    stack.push(e.path());
                }
            }
        }
        out.sort();
        out
    }

    fn open_dir_path(p: &Path) -> OwnedFd {
        fs::open(
            p,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .unwrap()
    }

    /// Makes `depth` nested directories `d` under `top` through descriptors (no path is
    /// ever longer than one name, and one descriptor is open at a time), with a file at
    /// the bottom.
    fn nest(top: &Path, depth: usize) {
        let mut cur = open_dir_path(top);
        for _ in 0..depth {
            fs::mkdirat(&cur, "d", Mode::from_raw_mode(0o700)).unwrap();
            cur = fs::openat(
                &cur,
                "d",
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .unwrap();
        }
        let f = fs::openat(
            &cur,
            "bottom",
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
        .unwrap();
        rustix::io::write(&f, b"x").unwrap();
    }

    /// The deepest level under `top` (a child of `top` is at 1), walked with a stack.
    fn depth_of(top: &Path) -> usize {
        let mut deepest = 0;
        let mut stack = vec![(top.to_path_buf(), 0)];
        while let Some((p, d)) = stack.pop() {
            deepest = deepest.max(d);
            for e in std::fs::read_dir(&p).unwrap() {
                let e = e.unwrap();
                if e.file_type().unwrap().is_dir() {
                    stack.push((e.path(), d + 1));
                } else {
                    deepest = deepest.max(d + 1);
                }
            }
        }
        deepest
    }

    /// Finding 1: 3,000 nested directories overflowed the pool thread's stack (the
    /// recursive removal, measuring and archiving) and aborted the daemon, and again at
    /// every restart. Now every walk is iterative with bounded descriptors, and removal
    /// still removes any depth. (On the old code the recursion holds one frame and one
    /// descriptor per level: 10,000 levels overflow a 2 MiB thread stack, which aborts
    /// the whole test binary.)
    #[test]
    fn finding_1_depth_10000_nesting_is_removed_without_recursion() {
        const DEPTH: usize = 10_000;
        let state = tempfile::tempdir().unwrap();
        let runs = ensure_runs_dir(state.path()).unwrap();

        // The removal function itself, called directly on this (2 MiB) test thread.
        let ws = create(&runs, "deep").unwrap();
        nest(&Path::new(&ws.path).join("cache"), DEPTH);
        remove(&ws).unwrap();
        assert!(!Path::new(&ws.path).exists());

        // And through the pool's slow path, with diagnostics on (so `logs` is measured
        // and archived too).
        let diag = diagnostics(state.path(), 1 << 20, 1 << 30);
        let pool = Pool::start(&runs, Some(diag.clone())).unwrap();
        until("pool filled", || {
            pool.shared.ready.lock().unwrap().len() >= POOL_TARGET / 4
        });
        let w = pool.create("hostile").unwrap();
        let p = PathBuf::from(&w.path);
        nest(&p.join("tmp"), DEPTH);
        nest(&p.join("logs"), DEPTH);
        std::fs::write(p.join("logs/top.log"), b"top").unwrap();
        let before = scrubbed(&pool);
        pool.remove(&w, "hostile").unwrap();
        until_within("the hostile workspace is scrubbed", 120, || {
            scrubbed(&pool) > before && trash_is_empty(&runs)
        });
        // Its logs were archived as far as an archive goes, no deeper.
        assert_eq!(archived(&pool), 1);
        let archive = std::fs::read_dir(&diag.dir)
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .path();
        assert_eq!(std::fs::read(archive.join("top.log")).unwrap(), b"top");
        assert!(
            depth_of(&archive) <= ARCHIVE_DEPTH_MAX,
            "{}",
            depth_of(&archive)
        );
        // The thread is alive and still hands out pristine workspaces.
        for i in 0..(2 * POOL_TARGET) {
            let x = pool.create(&format!("after{i}")).unwrap();
            assert_pristine(&x, &format!("after{i}"));
            if i % 2 == 0 {
                std::fs::write(Path::new(&x.path).join("out/x"), b"x").unwrap();
            }
            pool.remove(&x, &format!("after{i}")).unwrap();
        }
        until("after-runs scrubbed", || {
            pool.shared.released.lock().unwrap().is_empty() && trash_is_empty(&runs)
        });
    }

    /// Finding 6: diagnostics followed a `logs` symlink (`logs -> /etc` archived 262
    /// files of /etc) and copied a root-only 0600 file as 0644. (The old code read
    /// `logs` by path with `read_dir`, which follows the link, and wrote with
    /// `File::create`, 0666 less the umask.)
    #[test]
    fn finding_6_a_logs_symlink_is_never_followed() {
        let state = tempfile::tempdir().unwrap();
        let runs = ensure_runs_dir(state.path()).unwrap();
        let secret = tempfile::tempdir().unwrap();
        let shadow = secret.path().join("shadow");
        std::fs::write(&shadow, b"root-only").unwrap();
        std::fs::set_permissions(&shadow, std::fs::Permissions::from_mode(0o600)).unwrap();
        let diag = diagnostics(state.path(), 1 << 20, 1 << 30);
        let pool = Pool::start(&runs, Some(diag.clone())).unwrap();
        let intact = || {
            assert_eq!(std::fs::read(&shadow).unwrap(), b"root-only");
            let m = std::fs::symlink_metadata(&shadow).unwrap();
            assert_eq!(m.permissions().mode() & 0o7777, 0o600);
            assert_eq!(std::fs::read_dir(secret.path()).unwrap().count(), 1);
        };

        // `logs` itself is a link to the secret directory: nothing is archived.
        let w = pool.create("s1").unwrap();
        let p = PathBuf::from(&w.path);
        std::fs::remove_dir(p.join("logs")).unwrap();
        std::os::unix::fs::symlink(secret.path(), p.join("logs")).unwrap();
        let before = scrubbed(&pool);
        pool.remove(&w, "s1").unwrap();
        until("s1 scrubbed", || {
            scrubbed(&pool) > before && trash_is_empty(&runs)
        });
        assert_eq!(archived(&pool), 0);
        let archives = std::fs::read_dir(&diag.dir).map_or(0, |rd| rd.count());
        assert_eq!(archives, 0);
        intact();

        // A real `logs` with a real 0600 file, a link to the secret file and one to the
        // secret directory: only the real file is archived, privately.
        let w = pool.create("s2").unwrap();
        let p = PathBuf::from(&w.path);
        std::fs::write(p.join("logs/real.log"), b"real").unwrap();
        std::fs::set_permissions(
            p.join("logs/real.log"),
            std::fs::Permissions::from_mode(0o600),
        )
        .unwrap();
        std::os::unix::fs::symlink(&shadow, p.join("logs/link")).unwrap();
        std::os::unix::fs::symlink(secret.path(), p.join("logs/dirlink")).unwrap();
        pool.remove(&w, "s2").unwrap();
        until("s2 archived", || {
            archived(&pool) == 1 && trash_is_empty(&runs)
        });
        let m = std::fs::symlink_metadata(&diag.dir).unwrap();
        assert_eq!(m.permissions().mode() & 0o7777, 0o700, "diagnostics dir");
        let archives: Vec<_> = std::fs::read_dir(&diag.dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(archives.len(), 1);
        let m = std::fs::symlink_metadata(&archives[0]).unwrap();
        assert!(m.is_dir());
        assert_eq!(m.permissions().mode() & 0o7777, 0o700, "archive dir");
        assert_eq!(tree(&archives[0]), [("real.log".to_string(), 0o600, false)]);
        assert_eq!(
            std::fs::read(archives[0].join("real.log")).unwrap(),
            b"real"
        );
        intact();
    }

    /// Finding 7: the budget counted bytes, not what they cost: 100,000 one-byte files
    /// counted as 100 KB and took about 400 MB; with a 3 MiB total budget, 238 MB and
    /// 60,002 files were kept. (The old code copied all 100,000 files, 100,000 content
    /// bytes being far below its byte budget, and kept the older archive too.)
    #[test]
    fn finding_7_hundred_thousand_tiny_files_are_budgeted_by_blocks_and_inodes() {
        const FILES: usize = 100_000;
        const OLD_FILES: usize = 1_500;
        let state = tempfile::tempdir().unwrap();
        let runs = ensure_runs_dir(state.path()).unwrap();
        let diag = Diagnostics {
            dir: state.path().join("diagnostics"),
            run_bytes_max: 16 << 20,
            total_bytes_max: 8 << 20,
            run_entries_max: DIAGNOSTICS_RUN_ENTRIES_MAX,
            total_entries_max: 2_000,
        };
        // An older archive: 1,500 one-byte files (about 6 MB on disk).
        let old = diag.dir.join("000000000000001-old");
        std::fs::create_dir_all(&old).unwrap();
        for i in 0..OLD_FILES {
            std::fs::write(old.join(format!("o{i}")), b"o").unwrap();
        }
        let pool = Pool::start(&runs, Some(diag.clone())).unwrap();
        let w = pool.create("tiny").unwrap();
        let logs = open_dir_path(&Path::new(&w.path).join("logs"));
        for i in 0..FILES {
            let f = fs::openat(
                &logs,
                format!("f{i:06}").as_str(),
                OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::CLOEXEC,
                Mode::from_raw_mode(0o600),
            )
            .unwrap();
            rustix::io::write(&f, b"x").unwrap();
        }
        drop(logs);
        pool.remove(&w, "tiny").unwrap();
        until_within("archived and scrubbed", 300, || {
            archived(&pool) == 1 && trash_is_empty(&runs)
        });
        // The archive keeps at most the entries limit (its own directory included).
        let archives: Vec<_> = std::fs::read_dir(&diag.dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(archives.len(), 1, "{archives:?}");
        let (archive_bytes, archive_entries) = disk_usage(&archives[0]);
        assert!(
            archive_entries <= DIAGNOSTICS_RUN_ENTRIES_MAX,
            "{archive_entries} entries in one archive"
        );
        assert!(archive_entries > DIAGNOSTICS_RUN_ENTRIES_MAX / 2);
        assert!(archive_bytes <= diag.run_bytes_max);
        let kept = tree(&archives[0]);
        assert_eq!(kept.len() as u64, archive_entries - 1);
        for (name, mode, is_dir) in &kept {
            assert!(
                name.starts_with('f') && name.len() == 7 && !is_dir,
                "{name}"
            );
            assert_eq!(*mode, 0o600, "{name}");
        }
        let (first, ..) = &kept[0];
        assert_eq!(std::fs::read(archives[0].join(first)).unwrap(), b"x");
        // The whole diagnostics directory is within both total budgets, on disk; the
        // older archive was dropped to get there.
        let (bytes, entries) = disk_usage(&diag.dir);
        assert!(bytes <= diag.total_bytes_max, "{bytes} bytes on disk");
        assert!(entries <= diag.total_entries_max, "{entries} entries");
        assert!(!old.exists());
        assert_eq!(
            pool.diagnostics
                .dropped
                .load(std::sync::atomic::Ordering::Relaxed),
            1
        );
        // The thread goes on.
        let x = pool.create("after").unwrap();
        assert_pristine(&x, "after");
    }

    /// Lazily unmounts, when dropped, every mount below `0` (so a failing test leaves
    /// no mount behind for the temp dir's removal to walk into).
    struct Unmount(PathBuf);

    impl Drop for Unmount {
        fn drop(&mut self) {
            let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
                return;
            };
            for line in info.lines() {
                let Some(point) = line.split(' ').nth(4) else {
                    continue;
                };
                if Path::new(point).starts_with(&self.0) {
                    let _ = std::process::Command::new("umount")
                        .arg("-l")
                        .arg(point)
                        .status();
                }
            }
        }
    }

    /// Finding 12 (part): a bind mount over a released workspace's `out/` makes no
    /// inotify event, so the workspace was recycled into another run, and scrubbing
    /// deleted the files under the mount. Needs root and `mount --bind`.
    /// (On the old code the pool vouches for the workspace and hands it out again:
    /// the identity and pristine checks below fail.)
    #[test]
    fn bind_mount_over_out_is_neither_recycled_nor_scrubbed() {
        use berth_proc::testing::{root, unavailable, REQUIRE_ROOT};
        const TEST: &str = "bind_mount_over_out_is_neither_recycled_nor_scrubbed";
        let skip = |why: &str| unavailable(REQUIRE_ROOT, TEST, why);
        if !root(TEST) {
            return;
        }
        let state = tempfile::tempdir().unwrap();
        let state_path = state.path().canonicalize().unwrap();
        let runs = ensure_runs_dir(&state_path).unwrap();
        let outside = tempfile::tempdir().unwrap();
        let keep = outside.path().join("keep");
        std::fs::write(&keep, b"keep").unwrap();
        let pool = full_pool(&runs);
        let w = pool.create("mounted").unwrap();
        let p = PathBuf::from(&w.path);
        let _unmount = Unmount(state_path.clone());
        let mounted = std::process::Command::new("mount")
            .arg("--bind")
            .arg(outside.path())
            .arg(p.join("out"))
            .status();
        if !mounted.is_ok_and(|s| s.success()) {
            return skip("mount --bind failed here");
        }
        let before = scrubbed(&pool);
        pool.remove(&w, "mounted").unwrap();
        until("the release is judged", || {
            pool.shared.released.lock().unwrap().is_empty()
        });
        // Never handed out again while mounted: more than the pool holds, all pristine.
        let all: Vec<_> = (0..(POOL_MAX + 8))
            .map(|i| pool.create(&format!("other{i}")).unwrap())
            .collect();
        for x in &all {
            assert_ne!((x.dev, x.ino), (w.dev, w.ino), "handed out while mounted");
            assert_pristine(x, &x.path);
        }
        until("the mounted workspace takes the slow path", || {
            scrubbed(&pool) == before + 1
        });
        // Retried at a few rescans of the trash, counted once, the mount untouched.
        std::thread::sleep(std::time::Duration::from_millis(3 * TRASH_RESCAN_MS));
        assert_eq!(scrubbed(&pool), before + 1);
        let in_trash = || {
            std::fs::read_dir(runs.join(".trash"))
                .unwrap()
                .map(|e| e.unwrap().path())
                .find(|e| {
                    use std::os::unix::fs::MetadataExt;
                    std::fs::symlink_metadata(e).is_ok_and(|m| (m.dev(), m.ino()) == (w.dev, w.ino))
                })
        };
        let entry = in_trash().expect("the mounted workspace stays in the trash");
        assert_eq!(std::fs::read(&keep).unwrap(), b"keep");
        assert_eq!(std::fs::read(entry.join("out/keep")).unwrap(), b"keep");
        // Unmounted, it is cleaned up at the next rescan; the file was never touched.
        let st = std::process::Command::new("umount")
            .arg(entry.join("out"))
            .status()
            .unwrap();
        assert!(st.success());
        until_within("cleaned up after umount", 10, || in_trash().is_none());
        assert_eq!(std::fs::read(&keep).unwrap(), b"keep");
    }

    /// Per-run and total budgets by blocks, the oldest archives dropped, links inside
    /// `logs` not followed, everything private.
    #[test]
    fn logs_are_archived_within_the_run_and_total_budgets() {
        let state = tempfile::tempdir().unwrap();
        let runs = ensure_runs_dir(state.path()).unwrap();
        let secret = tempfile::tempdir().unwrap();
        std::fs::write(secret.path().join("shadow"), b"root-only").unwrap();
        // Each run's logs, by name: `a/` (a directory), `a/run.log` (800 bytes),
        // `b.log` (20,000 bytes), `link` (to a file) and `linkdir` (to a directory).
        // With 4 KiB blocks and two kept free for directory growth, 32 KiB per run
        // keeps the archive's directory, `a/`, `a/run.log` and 12 KiB of `b.log`:
        // 24 KiB. The total (60,000 bytes) holds the diagnostics directory and two
        // such archives (53,248 bytes), not three.
        let diag = diagnostics(state.path(), 32 << 10, 60_000);
        let pool = Pool::start(&runs, Some(diag.clone())).unwrap();
        for i in 0..4 {
            let w = pool.create(&format!("d{i}")).unwrap();
            let p = PathBuf::from(&w.path);
            std::fs::create_dir(p.join("logs/a")).unwrap();
            std::fs::write(p.join("logs/a/run.log"), vec![b'y'; 800]).unwrap();
            std::fs::write(p.join("logs/b.log"), vec![b'x'; 20_000]).unwrap();
            std::os::unix::fs::symlink(secret.path().join("shadow"), p.join("logs/link")).unwrap();
            std::os::unix::fs::symlink(secret.path(), p.join("logs/linkdir")).unwrap();
            pool.remove(&w, &format!("d{i}")).unwrap();
            // One archive at a time, so the order (and so what is dropped) is known.
            until(&format!("archive {i}"), || {
                archived(&pool) == i + 1 && trash_is_empty(&runs)
            });
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        use std::sync::atomic::Ordering::Relaxed;
        // 2 of 4 fit: the two oldest were dropped, the two newest kept.
        assert_eq!(pool.diagnostics.dropped.load(Relaxed), 2);
        let mut left: Vec<String> = std::fs::read_dir(&diag.dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        assert_eq!(left.len(), 2, "{left:?}");
        // Each named `<15-digit time>-<run id>`.
        for (name, run) in left.iter().zip(["d2", "d3"]) {
            let (stamp, id) = name.split_at(15);
            assert!(stamp.bytes().all(|b| b.is_ascii_digit()), "{left:?}");
            assert_eq!(id, format!("-{run}"), "{left:?}");
        }
        // Each archive: cut by blocks, no link followed or copied, private.
        for name in &left {
            let a = diag.dir.join(name);
            let m = std::fs::symlink_metadata(&a).unwrap();
            assert_eq!(m.permissions().mode() & 0o7777, 0o700);
            assert_eq!(
                tree(&a),
                [
                    ("a".to_string(), 0o700, true),
                    ("a/run.log".to_string(), 0o600, false),
                    ("b.log".to_string(), 0o600, false),
                ],
                "{name}"
            );
            assert_eq!(std::fs::read(a.join("a/run.log")).unwrap(), vec![b'y'; 800]);
            assert_eq!(
                std::fs::read(a.join("b.log")).unwrap(),
                vec![b'x'; 12 << 10]
            );
            let (bytes, _) = disk_usage(&a);
            assert!(bytes <= diag.run_bytes_max, "{name}: {bytes} bytes");
        }
        let (bytes, _) = disk_usage(&diag.dir);
        assert!(bytes <= diag.total_bytes_max, "{bytes} bytes on disk");
        let counted = pool.diagnostics.bytes.load(Relaxed);
        assert!(
            counted > 0 && counted <= 4 * diag.run_bytes_max,
            "{counted}"
        );
        // The link targets are untouched.
        assert_eq!(
            std::fs::read(secret.path().join("shadow")).unwrap(),
            b"root-only"
        );
        assert_eq!(std::fs::read_dir(secret.path()).unwrap().count(), 1);
    }

    /// An archive is named `<15-digit time>-<run id>`, whatever the run id's digest,
    /// and a second archive of the same run in the same millisecond gets `-1`.
    #[test]
    fn an_archive_is_named_after_its_run_id() {
        let state = tempfile::tempdir().unwrap();
        let runs = ensure_runs_dir(state.path()).unwrap();
        let diag = diagnostics(state.path(), 1 << 20, 1 << 30);
        let pool = Pool::start(&runs, Some(diag.clone())).unwrap();
        // The whole run-id alphabet, and the longest run id.
        let long = format!("L{}", "x".repeat(127));
        for (i, id) in ["ci:job-17.attempt_2", long.as_str()].iter().enumerate() {
            let w = pool.create(id).unwrap();
            std::fs::write(Path::new(&w.path).join("logs/run.log"), b"log").unwrap();
            pool.remove(&w, id).unwrap();
            until(&format!("{id} archived"), || {
                archived(&pool) == i as u64 + 1 && trash_is_empty(&runs)
            });
            let names: Vec<String> = std::fs::read_dir(&diag.dir)
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .filter(|n| n.ends_with(&format!("-{id}")))
                .collect();
            assert_eq!(names.len(), 1, "{id}: {names:?}");
            let (stamp, rest) = names[0].split_at(15);
            assert!(stamp.bytes().all(|b| b.is_ascii_digit()), "{names:?}");
            assert_eq!(rest, format!("-{id}"));
            assert_eq!(
                std::fs::read(diag.dir.join(&names[0]).join("run.log")).unwrap(),
                b"log"
            );
        }
    }

    /// Regression (CI, `crash_after_a_grant_is_committed_but_not_answered`): a crash
    /// after an archive was named and before its trash entry was marked archived it a
    /// second time at the next start. Now the mark comes first, and the two states a
    /// crash can leave both end in exactly one whole archive: a partial archive of a
    /// marked entry is named; a partial of an unmarked one is dropped and the entry
    /// archived again from its logs.
    #[test]
    fn a_crash_between_archiving_and_marking_leaves_exactly_one_archive() {
        for marked in [true, false] {
            let state = tempfile::tempdir().unwrap();
            let runs = ensure_runs_dir(state.path()).unwrap();
            let diag = diagnostics(state.path(), 1 << 20, 1 << 30);
            let ws = create(&runs, "r-1").unwrap();
            std::fs::write(Path::new(&ws.path).join("logs/a.log"), b"aaa").unwrap();
            std::fs::write(Path::new(&ws.path).join("logs/b.log"), b"bbb").unwrap();
            let entry = format!("{}-r0@r-1", dir_name("r-1"));
            std::fs::create_dir_all(runs.join(".trash")).unwrap();
            let trashed = if marked {
                format!("{ARCHIVED_PREFIX}{entry}")
            } else {
                entry.clone()
            };
            std::fs::rename(&ws.path, runs.join(".trash").join(&trashed)).unwrap();
            // The partial: whole when the entry is marked, half written when not.
            let partial = diag.dir.join(format!("{PARTIAL_PREFIX}{entry}"));
            std::fs::create_dir_all(&partial).unwrap();
            std::fs::write(partial.join("a.log"), b"aaa").unwrap();
            if marked {
                std::fs::write(partial.join("b.log"), b"bbb").unwrap();
            }
            let pool = Pool::start(&runs, Some(diag.clone())).unwrap();
            until("the entry is removed", || {
                archived(&pool) == 1 && trash_is_empty(&runs)
            });
            std::thread::sleep(std::time::Duration::from_millis(50));
            let names: Vec<String> = std::fs::read_dir(&diag.dir)
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect();
            assert_eq!(names.len(), 1, "marked {marked}: {names:?}");
            assert!(names[0].ends_with("-r-1"), "marked {marked}: {names:?}");
            let mut logs: Vec<(String, Vec<u8>)> = std::fs::read_dir(diag.dir.join(&names[0]))
                .unwrap()
                .map(|e| {
                    let e = e.unwrap();
                    (
                        e.file_name().into_string().unwrap(),
                        std::fs::read(e.path()).unwrap(),
                    )
                })
                .collect();
            logs.sort();
            assert_eq!(
                logs,
                [
                    ("a.log".to_string(), b"aaa".to_vec()),
                    ("b.log".to_string(), b"bbb".to_vec())
                ],
                "marked {marked}"
            );
            assert_eq!(archived(&pool), 1, "marked {marked}");
        }
    }

    /// A trash entry carries its run id in its name, so an archive made after a crash
    /// (the entry found again at the next start, `old-` from the pool or already in the
    /// trash) is named after the run too; an entry without one (an older berth's) falls
    /// back to the workspace's digest.
    #[test]
    fn trash_entries_carry_the_run_id_across_a_restart() {
        let digest = dir_name("r-1");
        for (entry, label) in [
            (format!("{digest}-r3@r-1"), "r-1"),
            (format!("old-{digest}-r3@ci:a.b_c-d"), "ci:a.b_c-d"),
            (format!("archived-old-{digest}-r0@x"), "x"),
            (format!("{digest}-r3"), digest.as_str()),
            (format!("old-{digest}-r12"), digest.as_str()),
            (format!("archived-{digest}-r12"), digest.as_str()),
            // Not a valid run id after the `@`: the digest.
            (format!("{digest}-r3@-bad/"), digest.as_str()),
            ("w4-1234".to_string(), "w4"),
        ] {
            assert_eq!(archive_label(&entry), label, "{entry}");
        }
        assert_eq!(run_id_name("a.b:c_d-e").as_deref(), Some("a.b:c_d-e"));
        assert_eq!(run_id_name("../x/y é").as_deref(), Some("x_y__"));
        assert_eq!(run_id_name("/"), None);
        assert_eq!(run_id_name(&"z".repeat(500)).unwrap().len(), 128);

        // End to end: a dirty workspace released by `r-1` and left in the pool by a
        // crash (the thread never judged it) is archived at the next start as `r-1`'s.
        let state = tempfile::tempdir().unwrap();
        let runs = ensure_runs_dir(state.path()).unwrap();
        let diag = diagnostics(state.path(), 1 << 20, 1 << 30);
        let ws = create(&runs, "r-1").unwrap();
        std::fs::write(Path::new(&ws.path).join("logs/run.log"), b"log").unwrap();
        std::fs::create_dir_all(runs.join(".pool")).unwrap();
        std::fs::rename(
            &ws.path,
            runs.join(".pool").join(format!("{digest}-r0@r-1")),
        )
        .unwrap();
        let pool = Pool::start(&runs, Some(diag.clone())).unwrap();
        until("the leftover is archived", || {
            archived(&pool) == 1 && trash_is_empty(&runs)
        });
        let names: Vec<String> = std::fs::read_dir(&diag.dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
        assert!(names[0].ends_with("-r-1"), "{names:?}");
        assert_eq!(names[0].len(), 15 + "-r-1".len(), "{names:?}");
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
