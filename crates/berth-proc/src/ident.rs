//! Who a process is (pid, start time, boot id), read from `/proc`, and signals sent
//! only to the process that identity names (through a pidfd).

use super::*;

/// Who a process is: stable across pid reuse.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProcId {
    pub pid: i32,
    /// Start time in clock ticks since boot (`/proc/<pid>/stat` field 22).
    pub start_ticks: u64,
    pub boot_id: String,
}

/// The fields of `/proc/<pid>/stat` berth uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stat {
    pub pid: i32,
    pub state: char,
    pub ppid: i32,
    pub pgrp: i32,
    pub session: i32,
    /// The kernel's per-task flags (`/proc/<pid>/stat` field 9); berth reads only
    /// [`PF_KTHREAD`].
    pub flags: u32,
    pub start_ticks: u64,
}

/// `PF_KTHREAD` in the task flags: the task is a kernel thread (include/linux/sched.h).
pub const PF_KTHREAD: u32 = 0x0020_0000;

/// init: the whole host (or container) goes down with it.
pub const INIT_PID: i32 = 1;

/// kthreadd, the parent of every kernel thread.
pub const KTHREADD_PID: i32 = 2;

#[derive(Debug, thiserror::Error)]
pub enum ProcError {
    #[error("process {pid} does not exist")]
    NoSuchProcess { pid: i32 },
    #[error("/proc/{pid}/stat is malformed: {line:?}")]
    Malformed { pid: i32, line: String },
    #[error("process {pid}: {op}: {err}")]
    Io {
        pid: i32,
        op: &'static str,
        err: std::io::Error,
    },
}

/// Keeps the kind (NotFound for a process that is gone, InvalidData for a malformed
/// line, the OS error's kind otherwise) and the pid in the message.
impl From<ProcError> for std::io::Error {
    fn from(e: ProcError) -> std::io::Error {
        let kind = match &e {
            ProcError::NoSuchProcess { .. } => std::io::ErrorKind::NotFound,
            ProcError::Malformed { .. } => std::io::ErrorKind::InvalidData,
            ProcError::Io { err, .. } => err.kind(),
        };
        std::io::Error::new(kind, e)
    }
}

/// Parses one `/proc/<pid>/stat` line. The command name may contain spaces and
/// parentheses, so fields are counted from the last `)`.
pub fn parse_stat(line: &str) -> Option<Stat> {
    let open = line.find('(')?;
    let close = line.rfind(')')?;
    let pid = line[..open].trim().parse().ok()?;
    let rest: Vec<&str> = line[close + 1..].split_whitespace().collect();
    // rest[0] is field 3 (state); field N is rest[N - 3].
    Some(Stat {
        pid,
        state: rest.first()?.chars().next()?,
        ppid: rest.get(1)?.parse().ok()?,
        pgrp: rest.get(2)?.parse().ok()?,
        session: rest.get(3)?.parse().ok()?,
        flags: rest.get(6)?.parse().ok()?,
        start_ticks: rest.get(19)?.parse().ok()?,
    })
}

/// Whether a failed read of `/proc/<pid>/...` means the process is gone: the entry is
/// missing (ENOENT), or the process exited between `open` and `read` (ESRCH). Anything
/// else (EMFILE, ENFILE, EACCES, ...) means berth could not look, which is not the same
/// thing (S4).
pub(super) fn is_gone_error(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::NotFound
        || e.raw_os_error() == Some(rustix::io::Errno::SRCH.raw_os_error())
}

/// One process's stat line. [`ProcError::NoSuchProcess`] only when the process is
/// gone; a read that failed for another reason is [`ProcError::Io`].
pub fn stat(pid: i32) -> Result<Stat, ProcError> {
    let line = std::fs::read_to_string(format!("/proc/{pid}/stat")).map_err(|e| {
        if is_gone_error(&e) {
            ProcError::NoSuchProcess { pid }
        } else {
            ProcError::Io {
                pid,
                op: "read stat",
                err: e,
            }
        }
    })?;
    parse_stat(&line).ok_or(ProcError::Malformed { pid, line })
}

pub fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// The identity of a live process.
pub fn identify(pid: i32) -> Result<ProcId, ProcError> {
    let st = stat(pid)?;
    if st.state == 'Z' {
        return Err(ProcError::NoSuchProcess { pid });
    }
    Ok(ProcId {
        pid,
        start_ticks: st.start_ticks,
        boot_id: boot_id(),
    })
}

/// What became of a recorded process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Liveness {
    Alive,
    /// Exited (or a zombie: it no longer runs anything).
    Gone,
    /// The pid now belongs to another process; it must not be touched (P3).
    Reused,
    /// `/proc` could not be read (e.g. EMFILE): it may well be alive (S4).
    Unknown,
}

pub fn liveness(id: &ProcId, boot: &str) -> Liveness {
    if id.boot_id != boot {
        return Liveness::Gone;
    }
    match stat(id.pid) {
        Ok(st) if st.start_ticks != id.start_ticks => Liveness::Reused,
        Ok(st) if st.state == 'Z' || st.state == 'X' => Liveness::Gone,
        Ok(_) => Liveness::Alive,
        Err(ProcError::NoSuchProcess { .. }) => Liveness::Gone,
        Err(_) => Liveness::Unknown,
    }
}

/// The outcome of [`signal`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Signalled {
    Sent,
    Gone,
    /// The pid belongs to someone else now; nothing was sent.
    Reused,
    /// The kernel refused (the process is another user's): it lives on, and the
    /// stop's next round still counts it.
    Denied,
    /// berth could not look: `pidfd_open`, the stat re-read or the send failed for a
    /// reason other than the process being gone (EMFILE, ENFILE, EACCES, ...). Nothing
    /// was sent and the process may well be alive (S4).
    Unknown,
    /// pid 1, a non-positive pid or a kernel thread: never signalled (S3).
    Protected,
}

/// Sends `sig` to exactly the process `id`: a pidfd is opened first, then the start
/// time is checked again (a pidfd pins the process, so the check cannot go stale),
/// and only then the signal goes through the pidfd. pid 1 and kernel threads are
/// refused here too, whoever asks (S3, defense in depth behind [`Stopper`]'s rule).
pub fn signal(id: &ProcId, sig: Signal) -> Signalled {
    // A non-positive pid names groups or everything for kill(2); init takes the host
    // down with it. Neither is ever a run's process.
    if id.pid <= INIT_PID {
        return Signalled::Protected;
    }
    let Some(pid) = Pid::from_raw(id.pid) else {
        return Signalled::Protected;
    };
    let fd: OwnedFd = match rustix::process::pidfd_open(pid, PidfdFlags::empty()) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::SRCH) => return Signalled::Gone,
        Err(_) => return Signalled::Unknown,
    };
    match stat(id.pid) {
        Ok(st) if st.start_ticks != id.start_ticks => return Signalled::Reused,
        Ok(st) if is_kernel_thread(&st) => return Signalled::Protected,
        Ok(_) => {}
        Err(ProcError::NoSuchProcess { .. }) => return Signalled::Gone,
        Err(_) => return Signalled::Unknown,
    }
    match rustix::process::pidfd_send_signal(&fd, sig) {
        Ok(()) => Signalled::Sent,
        Err(rustix::io::Errno::PERM) => Signalled::Denied,
        Err(rustix::io::Errno::SRCH) => Signalled::Gone,
        Err(_) => Signalled::Unknown,
    }
}
