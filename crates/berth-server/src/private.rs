//! The state directory is berth's alone (S5, S6): created 0700, refused when another
//! user owns it or could write to it, locked for the daemon's life, and every file
//! berth trusts in it (admin token, config, fence marker) opened without following a
//! link and checked for owner and mode on the descriptor.
//!
//! Why: berth often runs as root, and a state dir another user can write to lets them
//! plant `admin.token` as a link (and receive the admin token) or a `berth.toml` with
//! `insecure_no_auth = true`.

use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context};
use rustix::fs::{FileType, FlockOperation, Mode, OFlags};

/// Largest trusted file read (token, config, marker): they are a few lines.
pub const TRUSTED_FILE_BYTES_MAX: u64 = 1 << 20;

fn euid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// Makes the state dir (0700) if needed and checks it: a directory, owned by berth's
/// user, not group- or world-writable. A private dir with read bits for others is
/// tightened to 0700 (older berths made it 0755).
pub fn state_dir(dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("creating state directory {}", dir.display()))?;
    let fd = rustix::fs::open(
        dir,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .with_context(|| format!("opening state directory {}", dir.display()))?;
    let st = rustix::fs::fstat(&fd)?;
    if st.st_uid != euid() {
        bail!(
            "state directory {} is owned by uid {}, not by berth's user (uid {}): refused (S5)",
            dir.display(),
            st.st_uid,
            euid()
        );
    }
    if st.st_mode & 0o022 != 0 {
        bail!(
            "state directory {} is group- or world-writable (mode {:o}): refused, since another user could plant files in it (S5); chmod 700 it",
            dir.display(),
            st.st_mode & 0o7777
        );
    }
    if st.st_mode & 0o077 != 0 {
        rustix::fs::fchmod(&fd, Mode::from_raw_mode(0o700))?;
        tracing::info!("state directory {} tightened to 0700", dir.display());
    }
    Ok(())
}

/// The exclusive lock on the state dir, held for the daemon's life (S5): dropping it
/// releases the lock.
pub struct Lock {
    _fd: OwnedFd,
    _dir: OwnedFd,
}

/// The pid that holds a `flock` on the inode `ino`, as `/proc/locks` says
/// (`1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF`).
fn flock_holder(ino: u64) -> Option<String> {
    let locks = std::fs::read_to_string("/proc/locks").ok()?;
    locks.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        let on = f.get(5)?.rsplit(':').next()?.parse::<u64>().ok()?;
        (f.get(1) == Some(&"FLOCK") && on == ino).then(|| f.get(4).map(|p| p.to_string()))?
    })
}

/// Takes `<state_dir>/lock` or names the pid that holds it. The state dir itself is
/// locked too: a `lock` file someone unlinked cannot let a second daemon in (it would
/// have waited on the ledger's lock without a word), and the holder of the directory's
/// lock is named from `/proc/locks`.
pub fn lock(dir: &Path) -> anyhow::Result<Lock> {
    let dir_fd = rustix::fs::open(
        dir,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .with_context(|| format!("opening state directory {}", dir.display()))?;
    if let Err(e) = rustix::fs::flock(&dir_fd, FlockOperation::NonBlockingLockExclusive) {
        let ino = rustix::fs::fstat(&dir_fd).map(|st| st.st_ino).unwrap_or(0);
        let holder = flock_holder(ino).unwrap_or_else(|| "unknown".into());
        bail!(
            "state directory {} is in use by another berth serve (pid {holder}): one daemon per state dir (S5) [{e}]",
            dir.display()
        );
    }
    let path = dir.join("lock");
    let fd = rustix::fs::open(
        &path,
        OFlags::RDWR | OFlags::CREATE | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )
    .with_context(|| format!("opening {} (it must not be a link)", path.display()))?;
    if let Err(e) = rustix::fs::flock(&fd, FlockOperation::NonBlockingLockExclusive) {
        let mut holder = String::new();
        let _ = std::fs::File::from(fd).take(64).read_to_string(&mut holder);
        let holder = holder.trim();
        bail!(
            "state directory {} is in use by another berth serve (pid {}): one daemon per state dir (S5) [{e}]",
            dir.display(),
            if holder.is_empty() { "unknown" } else { holder }
        );
    }
    rustix::fs::ftruncate(&fd, 0)?;
    let mut f = std::fs::File::from(fd);
    write!(f, "{}", std::process::id())?;
    f.flush()?;
    Ok(Lock {
        _fd: f.into(),
        _dir: dir_fd,
    })
}

/// Opens `path` for reading if it is a regular file berth may trust: not a link (the
/// last component), owned by berth's user or root, not writable by group or others.
/// `Ok(None)` if it does not exist. The checks are made on the descriptor that is read.
pub fn read_trusted(path: &Path) -> anyhow::Result<Option<String>> {
    read_checked(path, false)
}

/// `read_trusted`, and also unreadable by group and others (a secret).
pub fn read_secret(path: &Path) -> anyhow::Result<Option<String>> {
    read_checked(path, true)
}

fn read_checked(path: &Path, secret: bool) -> anyhow::Result<Option<String>> {
    let fd = match crate::contract::open_no_follow(path) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOENT) => return Ok(None),
        Err(rustix::io::Errno::LOOP) => bail!(
            "{} is a symbolic link: refused (berth never follows a link to a file it trusts)",
            path.display()
        ),
        Err(e) => return Err(anyhow!("reading {}: {e}", path.display())),
    };
    check_trusted(&fd, path, secret)?;
    match crate::contract::read_at_most(fd, TRUSTED_FILE_BYTES_MAX)
        .with_context(|| format!("reading {}", path.display()))?
    {
        Some(text) => Ok(Some(text)),
        None => bail!(
            "{} is larger than {TRUSTED_FILE_BYTES_MAX} bytes",
            path.display()
        ),
    }
}

fn check_trusted(fd: &impl AsFd, path: &Path, secret: bool) -> anyhow::Result<()> {
    let st = rustix::fs::fstat(fd)?;
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
        bail!("{} is not a regular file: refused", path.display());
    }
    if st.st_uid != euid() && st.st_uid != 0 {
        bail!(
            "{} is owned by uid {}, not by berth's user (uid {}) or root: refused",
            path.display(),
            st.st_uid,
            euid()
        );
    }
    if st.st_mode & 0o022 != 0 {
        bail!(
            "{} is writable by group or others (mode {:o}): refused",
            path.display(),
            st.st_mode & 0o7777
        );
    }
    if secret && st.st_mode & 0o077 != 0 {
        bail!(
            "{} is readable by group or others (mode {:o}): refused; chmod 600 it, or delete it for a new one",
            path.display(),
            st.st_mode & 0o7777
        );
    }
    Ok(())
}

/// Reads the admin token, or creates it (0600, `O_EXCL`, never through a link). An
/// existing token must also be unreadable by others: it is the admin credential.
pub fn admin_token(dir: &Path) -> anyhow::Result<String> {
    let path = dir.join("admin.token");
    if let Some(text) = read_secret(&path)? {
        let t = text.trim();
        if !t.is_empty() {
            return Ok(t.to_string());
        }
        // An empty token file (a crash while writing it): replaced below.
        std::fs::remove_file(&path)?;
    }
    let token = crate::auth::new_token()?;
    create_line(&path, &token)?;
    sync_dir(dir)?;
    Ok(token)
}

/// Fleet mode's default host id (issue 38 item 8): the host name and a suffix made at
/// the first fleet start and kept in `<state_dir>/fleet-host-id`, so two daemons on one
/// machine (two state dirs) never share an id by default, and a restart keeps its own.
/// (A cloned VM clones the file too: the live-instance check at registration refuses
/// the second of the two.)
pub fn default_host_id(state_dir: &Path, hostname: &str) -> anyhow::Result<String> {
    let path = state_dir.join("fleet-host-id");
    if let Some(id) = read_trusted(&path)? {
        return Ok(id.trim().to_string());
    }
    use std::io::Read;
    let mut buf = [0u8; 3];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut buf)?;
    let suffix: String = buf.iter().map(|b| format!("{b:02x}")).collect();
    // A host name is cut so the id stays within the resource-name rule's length.
    let base: String = hostname.chars().take(HOST_ID_BASE_MAX).collect();
    let id = format!("{base}-{suffix}");
    create_line(&path, &id)?;
    sync_dir(state_dir)?;
    Ok(id)
}

/// Characters of the host name kept in a default host id.
const HOST_ID_BASE_MAX: usize = 48;

/// Creates `path` holding one line, 0600, `O_EXCL` (never over anything, never
/// through a link), and fsyncs it.
fn create_line(path: &Path, line: &str) -> anyhow::Result<()> {
    let fd = rustix::fs::open(
        path,
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )
    .with_context(|| format!("creating {}", path.display()))?;
    let mut f = std::fs::File::from(fd);
    writeln!(f, "{line}")?;
    f.sync_all()?;
    Ok(())
}

/// fsync of a directory, so a file just created or renamed in it survives power loss.
pub fn sync_dir(dir: &Path) -> anyhow::Result<()> {
    let fd = rustix::fs::open(
        dir,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    rustix::fs::fsync(&fd)?;
    Ok(())
}

/// The fence marker (L1, S6): `<state_dir>/fence.floor` holds a number no fence ever
/// issued exceeds. berth reserves fences ahead in blocks of `FENCE_RESERVE_BLOCK`:
/// before it acknowledges a fence above the marker, it raises the marker (written to a
/// temporary file, fsynced, renamed, the directory fsynced). At start, fences continue
/// above the larger of the ledger's counter and the marker, so restoring an older
/// `ledger.db` never re-issues a fence. A clean stop writes the exact last fence, so
/// only a crash skips numbers (at most one block).
pub struct FenceMarker {
    path: PathBuf,
    dir: PathBuf,
    /// Fences up to here may be issued without writing the marker again.
    pub reserved: u64,
    /// Fences reserved per write (`FENCE_RESERVE_BLOCK` unless a test sets less).
    pub block: u64,
}

/// Fences reserved per marker write: at 10,000 grants a second, one fsync every
/// minute and a half, and a crash skips at most this many numbers.
pub const FENCE_RESERVE_BLOCK: u64 = 1 << 20;

impl FenceMarker {
    /// Reads the marker (0 if there is none). A marker that is not a number is a
    /// corrupt state dir: refused (D4).
    pub fn open(dir: &Path) -> anyhow::Result<FenceMarker> {
        let path = dir.join("fence.floor");
        let reserved = match read_trusted(&path)? {
            None => 0,
            Some(t) => t.trim().parse::<u64>().map_err(|_| {
                anyhow!(
                    "{} does not hold a fence number ({:?}): refused (D4)",
                    path.display(),
                    t.chars().take(40).collect::<String>()
                )
            })?,
        };
        Ok(FenceMarker {
            path,
            dir: dir.to_path_buf(),
            reserved,
            block: FENCE_RESERVE_BLOCK,
        })
    }

    pub fn exists(&self) -> bool {
        self.path.exists()
    }

    /// Durably sets the marker to `value`.
    pub fn write(&mut self, value: u64) -> anyhow::Result<()> {
        let tmp = self.dir.join("fence.floor.tmp");
        let _ = std::fs::remove_file(&tmp);
        create_line(&tmp, &value.to_string())?;
        std::fs::rename(&tmp, &self.path)?;
        sync_dir(&self.dir)?;
        self.reserved = value;
        Ok(())
    }

    /// Makes sure fences up to `last_fence` are covered, reserving a new block if not.
    pub fn cover(&mut self, last_fence: u64) -> anyhow::Result<()> {
        if last_fence > self.reserved {
            self.write(last_fence.saturating_add(self.block))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_group_writable_state_dir_is_refused_and_a_readable_one_tightened() {
        let d = tempfile::tempdir().unwrap();
        let s = d.path().join("state");
        state_dir(&s).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode(&s), 0o700);
        std::fs::set_permissions(&s, std::fs::Permissions::from_mode(0o755)).unwrap();
        state_dir(&s).unwrap();
        assert_eq!(mode(&s), 0o700);
        std::fs::set_permissions(&s, std::fs::Permissions::from_mode(0o770)).unwrap();
        let e = state_dir(&s).unwrap_err().to_string();
        assert!(e.contains("group- or world-writable"), "{e}");
    }

    #[test]
    fn planted_links_and_loose_modes_are_never_trusted() {
        let d = tempfile::tempdir().unwrap();
        let secret = d.path().join("secret");
        std::fs::write(&secret, "insecure_no_auth = true\n").unwrap();
        let link = d.path().join("berth.toml");
        std::os::unix::fs::symlink(&secret, &link).unwrap();
        let e = read_trusted(&link).unwrap_err().to_string();
        assert!(e.contains("symbolic link"), "{e}");
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o666)).unwrap();
        let e = read_trusted(&secret).unwrap_err().to_string();
        assert!(e.contains("writable by group or others"), "{e}");
        // A token made here is 0600; a token readable by others is refused.
        let t = admin_token(d.path()).unwrap();
        assert_eq!(admin_token(d.path()).unwrap(), t);
        let tp = d.path().join("admin.token");
        assert_eq!(
            std::fs::metadata(&tp).unwrap().permissions().mode() & 0o777,
            0o600
        );
        std::fs::set_permissions(&tp, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(admin_token(d.path()).is_err());
    }

    #[test]
    fn the_lock_names_its_holder() {
        let d = tempfile::tempdir().unwrap();
        let held = lock(d.path()).unwrap();
        let e = lock(d.path()).err().unwrap().to_string();
        assert!(e.contains(&format!("pid {}", std::process::id())), "{e}");
        drop(held);
        // Free again once dropped. (Eventually: a child another test forks at this
        // moment shares the lock's open file until it execs, which closes it.)
        let end = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while let Err(e) = lock(d.path()) {
            assert!(
                std::time::Instant::now() < end,
                "still locked after drop: {e}"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    #[test]
    fn the_fence_marker_reserves_ahead_and_survives_reopening() {
        let d = tempfile::tempdir().unwrap();
        let mut m = FenceMarker::open(d.path()).unwrap();
        assert_eq!(m.reserved, 0);
        m.cover(0).unwrap();
        assert!(!m.exists(), "nothing issued, nothing written");
        m.cover(1).unwrap();
        assert_eq!(
            FenceMarker::open(d.path()).unwrap().reserved,
            1 + FENCE_RESERVE_BLOCK
        );
        m.cover(FENCE_RESERVE_BLOCK).unwrap();
        assert_eq!(
            m.reserved,
            1 + FENCE_RESERVE_BLOCK,
            "still covered: no write"
        );
        std::fs::write(d.path().join("fence.floor"), "twelve").unwrap();
        assert!(FenceMarker::open(d.path()).is_err());
    }
}
