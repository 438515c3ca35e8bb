//! Diagnostics (P4): a released workspace's `logs/` archived within per-run and total
//! budgets, and the diagnostics directory kept within its own.

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use rustix::fs::{self, AtFlags, Dir, FileType, Mode, OFlags};
use rustix::io::Errno;

use super::dir::*;
use crate::walk::{self, OpenError};

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
pub(super) const DIR_GROWTH_RESERVE_BLOCKS: u64 = 2;
/// Bytes read and written per step of a copy.
pub(super) const COPY_BUF_BYTES: usize = 64 * 1024;

/// One archive written: its name in the diagnostics directory, inode and cost.
pub(super) struct Archived {
    pub(super) name: CString,
    pub(super) ino: u64,
    pub(super) usage: walk::Usage,
}

/// Opens the diagnostics directory, making it if asked; `None` when it does not exist
/// and was not to be made. Private: 0700, whatever the umask or an older berth left.
/// The state directory above it is the operator's and berth's own, opened by path; the
/// diagnostics directory itself is never a link (`O_NOFOLLOW`).
pub(super) fn open_diagnostics(
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

/// Copies at most `n` bytes of `src` into a new private file `name` under `dest`
/// (`O_CREAT | O_EXCL | O_NOFOLLOW`, 0600 exactly); returns it and the bytes copied.
pub(super) fn copy_file(
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
pub(super) fn list_sorted(dir: &OwnedFd, visits: &mut u64) -> Vec<(CString, FileType)> {
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
pub(super) struct Budget {
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
pub(super) struct CopyFrame {
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
/// `open_diagnostics`, with a failure said in the log: `None` when there is no
/// diagnostics directory to use.
fn diagnostics_dir(d: &Diagnostics, make: bool) -> Option<(OwnedFd, walk::Meta)> {
    match open_diagnostics(d, make) {
        Ok(x) => x,
        Err(e) => {
            tracing::warn!("diagnostics {}: {e}", d.dir.display());
            None
        }
    }
}

pub(super) fn archive_logs(
    ws: &OwnedFd,
    on: &walk::Mount,
    d: &Diagnostics,
    entry: &str,
) -> Option<CString> {
    let (logs, _) = walk::open_dir(ws, "logs", on).ok()?;
    let mut visits = ARCHIVE_VISITS_MAX;
    let names = list_sorted(&logs, &mut visits);
    if names.is_empty() {
        return None;
    }
    let (diag, diag_meta) = diagnostics_dir(d, true)?;
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
    let (partial, top) = make_partial(&diag, &diag_on, d, entry)?;
    budget.charge(block);
    let first = CopyFrame {
        src: logs,
        names,
        dest: top,
        dest_bytes: block,
    };
    let files = copy_tree(first, on, &diag_on, &mut budget, &mut visits, &d.dir);
    if files == 0 {
        if let Err(e) = drop_entry(&diag, &partial, &diag_on) {
            tracing::warn!("diagnostics {}: {e}", d.dir.display());
        }
        return None;
    }
    Some(partial)
}

/// Makes the private directory `.partial-<entry>` an archive is written into, dropping
/// one an earlier attempt left (it failed before its mark, so it is redone whole).
fn make_partial(
    diag: &OwnedFd,
    diag_on: &walk::Mount,
    d: &Diagnostics,
    entry: &str,
) -> Option<(CString, OwnedFd)> {
    let partial = CString::new(format!("{PARTIAL_PREFIX}{entry}")).ok()?;
    let mut made = None;
    for _ in 0..2 {
        match make_private_dir(diag, &partial, diag_on) {
            Ok(fd) => {
                made = Some(fd);
                break;
            }
            // Left by an attempt that failed before its mark: redone from the start.
            Err(Errno::EXIST) => {
                if let Err(e) = drop_entry(diag, &partial, diag_on) {
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
    Some((partial, made?))
}

/// Copies the tree below `first` (depth first, by name) within `budget`; returns how
/// many files it copied. Logs go to the warning log under `dir`'s name.
fn copy_tree(
    first: CopyFrame,
    on: &walk::Mount,
    diag_on: &walk::Mount,
    budget: &mut Budget,
    visits: &mut u64,
    dir: &Path,
) -> u64 {
    let mut stack = vec![first];
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
                        f.charge_growth(budget);
                        files += 1;
                        // Crash tests: a crash with an archive half written.
                        if files == 1 {
                            crate::failpoint::hit("mid-archive");
                        }
                    }
                    Err(e) => {
                        tracing::warn!("diagnostics {}: copying a log: {e}", dir.display());
                        break;
                    }
                }
            }
            FileType::Directory if depth < ARCHIVE_DEPTH_MAX => {
                let mounts = (on, diag_on);
                match enter_dir(f, &entry, mounts, budget, visits, dir) {
                    Enter::Into(frame) => stack.push(frame),
                    Enter::Skip => continue,
                    Enter::Stop => break,
                }
            }
            // Links, fifos, sockets, devices, directories too deep: not archived.
            _ => {}
        }
    }
    files
}

/// What `copy_tree` does with a directory it meets.
enum Enter {
    /// Copy what is in it next: its frame.
    Into(CopyFrame),
    /// Leave it out (a link or a mount swapped in since the listing).
    Skip,
    /// The budget is spent or the archive cannot grow: stop copying.
    Stop,
}

/// Opens `entry` under `f` (never through a link or onto another mount), makes its
/// private copy in the archive and charges the budget for it.
fn enter_dir(
    f: &mut CopyFrame,
    entry: &std::ffi::CStr,
    (on, diag_on): (&walk::Mount, &walk::Mount),
    budget: &mut Budget,
    visits: &mut u64,
    dir: &Path,
) -> Enter {
    if budget.room().is_none() {
        return Enter::Stop;
    }
    let Ok((src, _)) = walk::open_dir(&f.src, entry, on) else {
        return Enter::Skip;
    };
    let dest = match make_private_dir(&f.dest, entry, diag_on) {
        Ok(fd) => fd,
        Err(e) => {
            tracing::warn!("diagnostics {}: copying a log: {e}", dir.display());
            return Enter::Stop;
        }
    };
    budget.charge(budget.block);
    f.charge_growth(budget);
    let names = list_sorted(&src, visits);
    Enter::Into(CopyFrame {
        src,
        names,
        dest,
        dest_bytes: budget.block,
    })
}

/// Names the complete archive `<diagnostics>/<partial>` as `<name>`, or `<name>-1`,
/// `<name>-2`, ... when that is taken (RENAME_NOREPLACE: never over another archive),
/// and measures it; `None` (the partial dropped) when it cannot be named.
pub(super) fn name_archive(d: &Diagnostics, partial: &CStr, name: &str) -> Option<Archived> {
    let (diag, diag_meta) = diagnostics_dir(d, false)?;
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
pub(super) fn archive_name(label: &str) -> String {
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|t| t.as_millis())
        .unwrap_or(0);
    format!("{stamp:015}-{label}")
}

/// Deletes the entry `name` of the diagnostics directory (an archive, or anything
/// else found there), iteratively and never across a mount.
pub(super) fn drop_entry(diag: &OwnedFd, name: &CStr, on: &walk::Mount) -> Result<(), String> {
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
pub(super) const PARTIAL_PREFIX: &str = ".partial-";
/// Archives measured so far, by name, with the inode they were measured at: an archive
/// never changes once written, so each is walked once, not again at every new archive.
pub(super) type Measured = HashMap<CString, (u64, walk::Usage)>;

/// What the diagnostics entry `name` (with metadata `m`) costs, measured once per
/// archive (by inode) and remembered in `measured`. What cannot be measured whole
/// (deeper than a walk goes, or more entries than the whole budget) counts as over the
/// budget: dropped in its turn.
fn measure(
    diag: &OwnedFd,
    on: &walk::Mount,
    name: &CString,
    m: &walk::Meta,
    d: &Diagnostics,
    measured: &mut Measured,
) -> walk::Usage {
    if m.kind != FileType::Directory {
        return walk::Usage {
            bytes: m.cost_bytes(),
            entries: 1,
            complete: true,
        };
    }
    if let Some((_, u)) = measured.get(name).filter(|(ino, _)| *ino == m.ino) {
        return *u;
    }
    let u = match walk::open_dir(diag, name.as_c_str(), on) {
        Ok((fd, _)) => {
            walk::usage(&fd, on, d.total_entries_max.saturating_add(1)).unwrap_or_default()
        }
        Err(_) => walk::Usage::default(),
    };
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
}

/// Keeps the diagnostics directory within its total budgets, bytes (by blocks) and
/// entries, the directory itself included: drops the oldest archives (names begin with
/// their time) until both hold. Returns how many were dropped.
pub(super) fn enforce_total(d: &Diagnostics, measured: &mut Measured) -> u64 {
    let Some((diag, meta)) = diagnostics_dir(d, false) else {
        return 0;
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
        let usage = measure(&diag, &on, &name, &m, d, measured);
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
