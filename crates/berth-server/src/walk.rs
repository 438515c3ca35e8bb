//! Walks over trees whose contents a run controls (W1): iterative with an explicit
//! stack (a run decides how deep its tree is, so recursion would let it decide how much
//! of our stack we use), at most `WALK_FDS_MAX` directory descriptors open at once,
//! every step through a directory descriptor with `O_NOFOLLOW` and the file type read
//! from the opened descriptor (never from a path that could change in between), and
//! never across a mount point (`Mount`).

use std::ffi::{CStr, CString};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::fs::{self, AtFlags, Dir, FileType, Mode, OFlags, StatxFlags};
use rustix::io::Errno;
use rustix::path::Arg;

/// Directory descriptors one walk keeps open at most (one per level it is inside).
/// Bounded so that a deep tree cannot exhaust the daemon's descriptors; removal goes
/// deeper by flattening (see `remove_contents`), the other walks stop there.
pub const WALK_FDS_MAX: usize = 32;

/// What a file or directory costs at least, whatever its `st_blocks` says: one 4 KiB
/// block. A one-byte file takes a block on every common file system, and an empty file
/// or a directory (tmpfs reports 0 blocks) still takes an inode; counting bytes instead
/// let 100,000 one-byte files count as 100 KB while they took 400 MB.
pub const BLOCK_BYTES_MIN: u64 = 4096;

/// Prefix of the names under which `remove_contents` moves deep subtrees up into the
/// directory it empties.
const FLAT_PREFIX: &str = ".berth-flat-";

/// The mount a tree lives on. `dev` alone does not tell a bind mount of a directory of
/// the same file system (the common case: a temp dir on the same disk) from the real
/// thing, so the mount id (`STATX_MNT_ID`, Linux 5.8) is compared too when the kernel
/// reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mount {
    pub dev: u64,
    pub mnt_id: Option<u64>,
}

/// What an object is, read without following a link.
#[derive(Clone, Copy, Debug)]
pub struct Meta {
    pub kind: FileType,
    /// Permission bits (`& 0o7777`).
    pub mode: u32,
    pub dev: u64,
    pub ino: u64,
    pub mnt_id: Option<u64>,
    pub size: u64,
    /// 512-byte units, as `st_blocks`.
    pub blocks: u64,
}

impl Meta {
    pub fn mount(&self) -> Mount {
        Mount {
            dev: self.dev,
            mnt_id: self.mnt_id,
        }
    }

    /// On the mount `m`: same device, and the same mount id where both are known.
    pub fn on(&self, m: &Mount) -> bool {
        self.dev == m.dev
            && match (self.mnt_id, m.mnt_id) {
                (Some(a), Some(b)) => a == b,
                _ => true,
            }
    }

    /// What it takes on disk: its allocated blocks, at least one 4 KiB block.
    pub fn cost_bytes(&self) -> u64 {
        self.blocks.saturating_mul(512).max(BLOCK_BYTES_MIN)
    }
}

const STATX_WANT: StatxFlags = StatxFlags::TYPE
    .union(StatxFlags::MODE)
    .union(StatxFlags::INO)
    .union(StatxFlags::SIZE)
    .union(StatxFlags::BLOCKS)
    .union(StatxFlags::MNT_ID);

fn from_statx(s: &fs::Statx) -> Meta {
    let mode = u32::from(s.stx_mode);
    Meta {
        kind: FileType::from_raw_mode(mode as _),
        mode: mode & 0o7777,
        dev: fs::makedev(s.stx_dev_major, s.stx_dev_minor),
        ino: s.stx_ino,
        mnt_id: (s.stx_mask & StatxFlags::MNT_ID.bits() != 0).then_some(s.stx_mnt_id),
        size: s.stx_size,
        blocks: s.stx_blocks,
    }
}

fn from_stat(s: &fs::Stat) -> Meta {
    Meta {
        kind: FileType::from_raw_mode(s.st_mode),
        mode: s.st_mode & 0o7777,
        dev: s.st_dev,
        ino: s.st_ino,
        mnt_id: None,
        size: s.st_size as u64,
        blocks: s.st_blocks as u64,
    }
}

/// `statx` where the kernel (or a seccomp filter) allows it, else `fstatat`: without
/// `statx` there is no mount id, and only the device is compared.
fn stat_raw(dir: BorrowedFd<'_>, path: &CStr, flags: AtFlags) -> Result<Meta, Errno> {
    match fs::statx(dir, path, flags | AtFlags::NO_AUTOMOUNT, STATX_WANT) {
        Ok(s) => Ok(from_statx(&s)),
        Err(Errno::NOSYS | Errno::PERM) => fs::statat(dir, path, flags).map(|s| from_stat(&s)),
        Err(e) => Err(e),
    }
}

/// The object open as `fd`.
pub fn stat_fd<Fd: AsFd>(fd: Fd) -> Result<Meta, Errno> {
    stat_raw(fd.as_fd(), c"", AtFlags::EMPTY_PATH)
}

/// `path` under `dir`, the last component not followed if it is a link.
pub fn stat_at<Fd: AsFd, P: Arg>(dir: Fd, path: P) -> Result<Meta, Errno> {
    path.into_with_c_str(|p| stat_raw(dir.as_fd(), p, AtFlags::SYMLINK_NOFOLLOW))
}

/// Why an entry could not be opened as asked.
#[derive(Debug)]
pub enum OpenError {
    /// Nothing by that name.
    Gone,
    /// Not the kind asked for: a link, a file where a directory was asked for, a fifo,
    /// a socket, a device.
    Kind,
    /// The root of another mount (or on another device); what it is is given.
    Mount(Meta),
    Io(Errno),
}

/// Flags for every directory a walk opens: never through a link (`O_NOFOLLOW`), only a
/// directory (`O_DIRECTORY`), and the descriptor never leaks into a child.
const DIR_FLAGS: OFlags = OFlags::RDONLY
    .union(OFlags::DIRECTORY)
    .union(OFlags::NOFOLLOW)
    .union(OFlags::CLOEXEC)
    .union(OFlags::NOCTTY);

/// Flags for every file read: never through a link, and `O_NONBLOCK` so that a fifo
/// swapped in after the type was looked at cannot block the open (its type is then
/// refused on the descriptor).
const FILE_FLAGS: OFlags = OFlags::RDONLY
    .union(OFlags::NOFOLLOW)
    .union(OFlags::NONBLOCK)
    .union(OFlags::CLOEXEC)
    .union(OFlags::NOCTTY);

/// Opens the directory `name` under `parent` wherever it lives (used for berth's own
/// directories, which an operator may put on a mount of their choosing); a link or a
/// non-directory is refused.
pub fn open_dir_any<Fd: AsFd, P: Arg>(parent: Fd, name: P) -> Result<(OwnedFd, Meta), OpenError> {
    let fd = match fs::openat(parent, name, DIR_FLAGS, Mode::empty()) {
        Ok(fd) => fd,
        Err(Errno::NOENT) => return Err(OpenError::Gone),
        Err(Errno::NOTDIR | Errno::LOOP) => return Err(OpenError::Kind),
        Err(e) => return Err(OpenError::Io(e)),
    };
    // The type is read from the descriptor: what is open is what is checked.
    let meta = stat_fd(&fd).map_err(OpenError::Io)?;
    if meta.kind != FileType::Directory {
        return Err(OpenError::Kind);
    }
    Ok((fd, meta))
}

/// Opens the directory `name` under `parent` if it is a real directory on the mount
/// `on`: a mount point is refused, so nothing under a mount is ever read or deleted.
pub fn open_dir<Fd: AsFd, P: Arg>(
    parent: Fd,
    name: P,
    on: &Mount,
) -> Result<(OwnedFd, Meta), OpenError> {
    let (fd, meta) = open_dir_any(parent, name)?;
    if !meta.on(on) {
        return Err(OpenError::Mount(meta));
    }
    Ok((fd, meta))
}

/// Opens the regular file `name` under `parent` for reading if it is one, on the mount
/// `on` (a file bind-mounted over a log is not the run's to hand over).
pub fn open_file<Fd: AsFd, P: Arg>(
    parent: Fd,
    name: P,
    on: &Mount,
) -> Result<(OwnedFd, Meta), OpenError> {
    let fd = match fs::openat(parent, name, FILE_FLAGS, Mode::empty()) {
        Ok(fd) => fd,
        Err(Errno::NOENT) => return Err(OpenError::Gone),
        // A link (`O_NOFOLLOW`), or a socket.
        Err(Errno::LOOP | Errno::NXIO) => return Err(OpenError::Kind),
        Err(e) => return Err(OpenError::Io(e)),
    };
    let meta = stat_fd(&fd).map_err(OpenError::Io)?;
    if meta.kind != FileType::RegularFile {
        return Err(OpenError::Kind);
    }
    if !meta.on(on) {
        return Err(OpenError::Mount(meta));
    }
    Ok((fd, meta))
}

/// Why a removal stopped.
#[derive(Debug)]
pub enum WalkError {
    /// A mount point inside (another device or another mount): nothing under it was
    /// touched, and the tree cannot be removed until it is unmounted.
    Mount,
    Io {
        op: &'static str,
        errno: Errno,
    },
}

impl std::fmt::Display for WalkError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WalkError::Mount => write!(f, "a mount point inside; nothing under it was removed"),
            WalkError::Io { op, errno } => write!(f, "{op}: {}", std::io::Error::from(*errno)),
        }
    }
}

fn fail(op: &'static str) -> impl FnOnce(Errno) -> WalkError {
    move |errno| WalkError::Io { op, errno }
}

/// Empties the directory open as `top` (which must be on `on`), never following a
/// link and never descending into a mount point; returns how many entries it removed.
///
/// Any depth, bounded descriptors: the walk keeps one descriptor per level it is
/// inside, at most `WALK_FDS_MAX`. A directory met at that depth is not opened but
/// moved up into `top` under a fresh name (`renameat` with `RENAME_NOREPLACE`, checked
/// first to be a directory on the same mount), and `top` is read again once its pass
/// is over, until a pass moves nothing. Each pass deletes everything within reach, so a
/// chain of N directories takes N / `WALK_FDS_MAX` passes and never more descriptors.
/// (The alternative, climbing back with `openat("..")` and checking (dev, ino), needs
/// the same bound and more checks; a rename within one directory tree needs none.)
///
/// A mount point anywhere stops the removal with `WalkError::Mount` before anything
/// under it is touched (what is not under it may already be gone): the caller keeps the
/// entry and retries later.
pub fn remove_contents<Fd: AsFd>(top: Fd, on: &Mount) -> Result<u64, WalkError> {
    let top = top.as_fd();
    // Each frame: the directory being emptied and its name in the frame above.
    let mut stack: Vec<(Dir, CString)> = Vec::with_capacity(WALK_FDS_MAX);
    stack.push((
        Dir::read_from(top).map_err(fail("open directory"))?,
        CString::default(),
    ));
    let mut moved_up = false;
    let mut fresh: u64 = 0;
    let mut removed: u64 = 0;
    loop {
        let depth = stack.len();
        let Some((dir, _)) = stack.last_mut() else {
            break;
        };
        let entry = match dir.read() {
            Some(Ok(e)) => e,
            Some(Err(e)) => return Err(fail("read directory")(e)),
            None if depth == 1 => {
                // Entries moved up during this pass may not have been listed in it.
                if !moved_up {
                    break;
                }
                moved_up = false;
                dir.rewind();
                continue;
            }
            None => {
                removed += rmdir_emptied(&mut stack)?;
                continue;
            }
        };
        let name = entry.file_name();
        if name == c"." || name == c".." {
            continue;
        }
        let name = name.to_owned();
        let fd = dir.fd().map_err(fail("read directory"))?;
        // The type from the listing decides only which call is tried: `unlinkat`
        // without `AT_REMOVEDIR` never removes a directory, and a directory is opened
        // with `O_NOFOLLOW | O_DIRECTORY` and checked on its descriptor.
        let kind = match entry.file_type() {
            FileType::Unknown => match stat_at(fd, name.as_c_str()) {
                Ok(m) => m.kind,
                Err(Errno::NOENT) => continue,
                Err(e) => return Err(fail("stat")(e)),
            },
            kind => kind,
        };
        if kind != FileType::Directory {
            removed += unlink_file(fd, &name)?;
            continue;
        }
        if depth < WALK_FDS_MAX {
            if let Some(sub) = open_to_empty(fd, &name, on)? {
                stack.push((Dir::new(sub).map_err(fail("read directory"))?, name));
            }
            continue;
        }
        // Too deep to open another descriptor: moved up into `top` (flattening).
        moved_up |= move_up(fd, &name, top, on, &mut fresh)?;
    }
    Ok(removed)
}

/// The directory on top of the stack is empty: closed first, then removed from the
/// level above (1 if it was removed or already gone).
fn rmdir_emptied(stack: &mut Vec<(Dir, CString)>) -> Result<u64, WalkError> {
    let Some((done, name)) = stack.pop() else {
        return Ok(0);
    };
    drop(done);
    let Some((parent, _)) = stack.last() else {
        return Ok(0);
    };
    let parent = parent.fd().map_err(fail("read directory"))?;
    match fs::unlinkat(parent, name.as_c_str(), AtFlags::REMOVEDIR) {
        Ok(()) | Err(Errno::NOENT) => Ok(1),
        Err(Errno::BUSY) => Err(WalkError::Mount),
        Err(e) => Err(fail("rmdir")(e)),
    }
}

/// Unlinks the non-directory `name` under `fd`; 1 if it was removed, 0 if it was gone.
fn unlink_file(fd: BorrowedFd, name: &CStr) -> Result<u64, WalkError> {
    match fs::unlinkat(fd, name, AtFlags::empty()) {
        Ok(()) => {
            crate::failpoint::hit("mid-workspace-removal");
            Ok(1)
        }
        Err(Errno::NOENT) => Ok(0),
        // A file bind-mounted over this one.
        Err(Errno::BUSY) => Err(WalkError::Mount),
        Err(e) => Err(fail("unlink")(e)),
    }
}

/// Opens the subdirectory `name` under `fd` to be emptied, made writable if its owner
/// made it not (0500: a berth that is not root could not empty it); `None` when it is
/// gone, or was swapped for a link or a file since it was listed (unlinked as one).
fn open_to_empty(fd: BorrowedFd, name: &CStr, on: &Mount) -> Result<Option<OwnedFd>, WalkError> {
    match open_dir(fd, name, on) {
        Ok((sub, meta)) => {
            if meta.mode & 0o700 != 0o700 {
                let _ = fs::fchmod(&sub, Mode::from_raw_mode(0o700));
            }
            Ok(Some(sub))
        }
        Err(OpenError::Gone) => Ok(None),
        Err(OpenError::Kind) => match fs::unlinkat(fd, name, AtFlags::empty()) {
            Ok(()) | Err(Errno::NOENT) => Ok(None),
            Err(e) => Err(fail("unlink")(e)),
        },
        Err(OpenError::Mount(_)) => Err(WalkError::Mount),
        Err(OpenError::Io(e)) => Err(fail("open subdirectory")(e)),
    }
}

/// Moves the directory `name` under `fd`, too deep to open, up into `top` under a
/// fresh name (see `remove_contents`); true if it moved. Checked first to be a
/// directory on `on` (a link or a file swapped in is unlinked as one).
fn move_up(
    fd: BorrowedFd,
    name: &CStr,
    top: BorrowedFd,
    on: &Mount,
    fresh: &mut u64,
) -> Result<bool, WalkError> {
    match stat_at(fd, name) {
        Ok(m) if m.kind != FileType::Directory => {
            return match fs::unlinkat(fd, name, AtFlags::empty()) {
                Ok(()) | Err(Errno::NOENT) => Ok(false),
                Err(Errno::BUSY) => Err(WalkError::Mount),
                Err(e) => Err(fail("unlink")(e)),
            }
        }
        Ok(m) if !m.on(on) => return Err(WalkError::Mount),
        Ok(_) => {}
        Err(Errno::NOENT) => return Ok(false),
        Err(e) => return Err(fail("stat")(e)),
    }
    loop {
        *fresh += 1;
        let new = format!("{FLAT_PREFIX}{fresh}");
        // NOREPLACE: never lands on an entry already in `top` (the run may have made
        // one by that name); the next name is tried instead.
        match fs::renameat_with(fd, name, top, new.as_str(), fs::RenameFlags::NOREPLACE) {
            Ok(()) => return Ok(true),
            Err(Errno::EXIST) => {}
            Err(Errno::NOENT) => return Ok(false),
            Err(Errno::BUSY) => return Err(WalkError::Mount),
            // A file system without RENAME_NOREPLACE: an unused name is looked for
            // first, then renamed to plainly.
            Err(Errno::INVAL) => match stat_at(top, new.as_str()) {
                Err(Errno::NOENT) => {
                    fs::renameat(fd, name, top, new.as_str())
                        .map_err(fail("move a deep directory up"))?;
                    return Ok(true);
                }
                Ok(_) => {}
                Err(e) => return Err(fail("stat")(e)),
            },
            Err(e) => return Err(fail("move a deep directory up")(e)),
        }
    }
}

/// What a tree costs on disk: allocated bytes (at least one block per entry, see
/// `BLOCK_BYTES_MIN`) and entries (inodes), the top included.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub bytes: u64,
    pub entries: u64,
    /// False when part of the tree could not be seen: deeper than `WALK_FDS_MAX`, a
    /// mount inside, an unreadable directory, or more than the entries asked for.
    pub complete: bool,
}

impl Usage {
    pub fn add(&mut self, o: Usage) {
        self.bytes = self.bytes.saturating_add(o.bytes);
        self.entries = self.entries.saturating_add(o.entries);
    }

    pub fn sub(&mut self, o: Usage) {
        self.bytes = self.bytes.saturating_sub(o.bytes);
        self.entries = self.entries.saturating_sub(o.entries);
    }
}

/// Counts the directory `name` under `fd` into `u` and opens it to be walked; `None`
/// when it is gone or cannot be opened (then `u` is incomplete).
fn measure_dir(fd: BorrowedFd, name: &CStr, on: &Mount, u: &mut Usage) -> Option<OwnedFd> {
    match open_dir(fd, name, on) {
        Ok((sub, meta)) => {
            u.add(Usage {
                bytes: meta.cost_bytes(),
                entries: 1,
                complete: true,
            });
            Some(sub)
        }
        Err(OpenError::Gone) => None,
        Err(_) => {
            u.complete = false;
            None
        }
    }
}

/// Counts the entry `name` under `fd` into `u` without opening it: a file, or a
/// directory too deep to open (then `u` is incomplete: not seen inside).
fn measure_other(fd: BorrowedFd, name: &CStr, u: &mut Usage) {
    match stat_at(fd, name) {
        Ok(m) => {
            u.add(Usage {
                bytes: m.cost_bytes(),
                entries: 1,
                complete: true,
            });
            if m.kind == FileType::Directory {
                u.complete = false;
            }
        }
        Err(Errno::NOENT) => {}
        Err(_) => u.complete = false,
    }
}

/// Measures the tree open as `top` on `on`, iteratively through descriptors, never
/// following a link nor crossing a mount; stops (incomplete) after `entries_max`.
pub fn usage<Fd: AsFd>(top: Fd, on: &Mount, entries_max: u64) -> Result<Usage, Errno> {
    let top = top.as_fd();
    let mut u = Usage {
        bytes: stat_fd(top)?.cost_bytes(),
        entries: 1,
        complete: true,
    };
    let mut stack: Vec<Dir> = Vec::with_capacity(WALK_FDS_MAX);
    stack.push(Dir::read_from(top)?);
    loop {
        let depth = stack.len();
        let Some(dir) = stack.last_mut() else { break };
        let entry = match dir.read() {
            Some(Ok(e)) => e,
            Some(Err(_)) => {
                u.complete = false;
                stack.pop();
                continue;
            }
            None => {
                stack.pop();
                continue;
            }
        };
        let name = entry.file_name();
        if name == c"." || name == c".." {
            continue;
        }
        if u.entries >= entries_max {
            u.complete = false;
            break;
        }
        let fd = dir.fd()?;
        let mut kind = entry.file_type();
        if kind == FileType::Unknown {
            kind = match stat_at(fd, name) {
                Ok(m) => m.kind,
                Err(Errno::NOENT) => continue,
                Err(_) => {
                    u.complete = false;
                    continue;
                }
            };
        }
        let sub = if kind == FileType::Directory && depth < WALK_FDS_MAX {
            measure_dir(fd, name, on, &mut u)
        } else {
            measure_other(fd, name, &mut u);
            None
        };
        if let Some(sub) = sub {
            stack.push(Dir::new(sub)?);
        }
    }
    Ok(u)
}
