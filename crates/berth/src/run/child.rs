//! CMD as a process: started behind berth's own gate (P1: it runs only once
//! registered), its signals, its exit, and the terminal it is given and taken back.

use super::*;

pub(super) fn signal_group(pgid: i32, sig: rustix::process::Signal) {
    if let Some(pid) = rustix::process::Pid::from_raw(pgid) {
        let _ = rustix::process::kill_process_group(pid, sig);
    }
}

/// What `watch_child` reports.
pub(super) type ChildEvents = tokio::sync::mpsc::UnboundedReceiver<ChildEvent>;

/// The signals berth run passes on to CMD's process group.
pub(super) struct Signals {
    pub(super) int: tokio::signal::unix::Signal,
    pub(super) term: tokio::signal::unix::Signal,
    pub(super) hup: tokio::signal::unix::Signal,
    pub(super) tstp: tokio::signal::unix::Signal,
}

/// The hidden first argument that makes `berth` the gate in front of CMD.
pub const GATE_ARG: &str = "__gate";

/// Starts CMD behind its gate (see `run_main`), in its own process group; returns the
/// spawn's outcome and the pipe end whose one line opens the gate.
///
/// The gate is berth itself (`berth __gate FD CMD...`), not a shell: a shell gate
/// named the pipe by its number (`read <&12`), and dash cannot parse a descriptor of
/// 10 or more, so one descriptor too many inherited from berth run's parent broke
/// every run (issue 33 item 1). Every descriptor berth run inherited passes to CMD
/// untouched (a make jobserver's too); berth's own are close-on-exec, and the gate
/// closes its pipe before it becomes CMD.
pub(super) fn spawn_gated(
    cmd_args: &[String],
    env: &BTreeMap<String, String>,
) -> anyhow::Result<(std::io::Result<std::process::Child>, std::os::fd::OwnedFd)> {
    let (gate_read, gate_write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::empty())?;
    rustix::io::fcntl_setfd(&gate_write, rustix::io::FdFlags::CLOEXEC)?;
    let fd = std::os::fd::AsRawFd::as_raw_fd(&gate_read);
    let me = std::env::current_exe()?;
    // std, not tokio: the child is waited for by `watch_child` (which also sees it
    // stop), never by a runtime that would reap it behind our back.
    use std::os::unix::process::CommandExt;
    let mut cmd = std::process::Command::new(me);
    cmd.arg(GATE_ARG)
        .arg(fd.to_string())
        .args(cmd_args)
        .envs(env)
        .process_group(0);
    let spawned = cmd.spawn();
    drop(gate_read);
    Ok((spawned, gate_write))
}

/// `berth __gate FD CMD...`: waits for `go` on descriptor FD, closes it and becomes
/// CMD. Without `go` (berth run could not register it, or died) it exits 125 and CMD
/// never runs (P1). CMD not found: 127, not runnable: 126, as a shell says.
pub fn gate_main(args: &[std::ffi::OsString]) -> u8 {
    use std::os::fd::FromRawFd;
    use std::os::unix::process::CommandExt;
    let Some(fd) = args
        .first()
        .and_then(|a| a.to_str())
        .and_then(|a| a.parse::<i32>().ok())
        .filter(|&fd| fd > 2)
    else {
        eprintln!("berth: {GATE_ARG} is berth run's own");
        return crate::EXIT_USAGE;
    };
    // SAFETY: berth run made this descriptor for this process and nothing else here
    // uses it; it is owned (and closed) from now on.
    let gate = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    let mut said = Vec::new();
    let mut byte = [0u8; 1];
    while said.len() < 8 {
        match rustix::io::read(&gate, &mut byte) {
            Ok(1) if byte[0] == b'\n' => break,
            Ok(1) => said.push(byte[0]),
            Err(rustix::io::Errno::INTR) => continue,
            _ => break,
        }
    }
    drop(gate);
    if said != b"go" {
        return 125;
    }
    let Some(program) = args.get(1) else {
        return 125;
    };
    let e = std::process::Command::new(program).args(&args[2..]).exec();
    eprintln!("berth run: {}: {e}", program.to_string_lossy());
    if e.kind() == std::io::ErrorKind::NotFound {
        127
    } else {
        126
    }
}

/// How CMD ended.
#[derive(Clone, Copy, Debug)]
pub(super) enum ExitKind {
    Code(i32),
    Signal(i32),
    Unknown,
}

impl ExitKind {
    /// The shell's convention: the code, or 128 + the signal.
    pub(super) fn code(self) -> u8 {
        match self {
            ExitKind::Code(c) => c as u8,
            ExitKind::Signal(s) => 128u8.wrapping_add(s as u8),
            ExitKind::Unknown => 1,
        }
    }

    pub(super) fn describe(self) -> String {
        match self {
            ExitKind::Code(c) => format!("it exited with {c}"),
            ExitKind::Signal(s) => format!("it was ended by signal {s}"),
            ExitKind::Unknown => "its status is unknown".into(),
        }
    }
}

pub(super) enum ChildEvent {
    /// CMD stopped with this signal (Ctrl-Z, a read from a terminal it does not own).
    Stopped(i32),
    Exited(ExitKind),
    /// Waiting failed: treated as an exit of unknown status.
    Lost(ExitKind),
}

/// Waits for CMD on a thread of its own, reporting stops as well as the exit
/// (`WUNTRACED`: what a shell needs for job control).
pub(super) fn watch_child(pid: i32) -> tokio::sync::mpsc::UnboundedReceiver<ChildEvent> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        let Some(p) = rustix::process::Pid::from_raw(pid) else {
            let _ = tx.send(ChildEvent::Lost(ExitKind::Unknown));
            return;
        };
        loop {
            match rustix::process::waitpid(Some(p), rustix::process::WaitOptions::UNTRACED) {
                Ok(Some((_, st))) if st.stopped() => {
                    let _ = tx.send(ChildEvent::Stopped(st.stopping_signal().unwrap_or(0)));
                }
                Ok(Some((_, st))) => {
                    let kind = match (st.exit_status(), st.terminating_signal()) {
                        (Some(c), _) => ExitKind::Code(c),
                        (None, Some(s)) => ExitKind::Signal(s),
                        _ => continue,
                    };
                    let _ = tx.send(ChildEvent::Exited(kind));
                    return;
                }
                Ok(None) | Err(rustix::io::Errno::INTR) => {}
                Err(_) => {
                    let _ = tx.send(ChildEvent::Lost(ExitKind::Unknown));
                    return;
                }
            }
        }
    });
    rx
}

/// Blocks SIGTTOU and SIGTTIN in this thread and every thread it starts: berth run
/// hands the terminal to CMD and must still write its lines and take the terminal
/// back (`tcsetpgrp` from the background) without being stopped. (CMD starts with an
/// empty mask: std resets it in the child.)
pub(super) fn block_terminal_stops() {
    // SAFETY: plain libc calls on a local, initialised sigset.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTTOU);
        libc::sigaddset(&mut set, libc::SIGTTIN);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

/// The terminal on stdin, when berth run is in its foreground process group: CMD is
/// made the terminal's foreground group (it reads and writes the terminal, gets Ctrl-C,
/// Ctrl-\ and window-size changes from the driver itself), and the terminal and its
/// modes come back to berth run's group when CMD stops or ends, however it ends.
pub(super) struct Tty {
    own_pgrp: rustix::process::Pid,
    modes: rustix::termios::Termios,
}

pub(super) fn stdin_fd() -> std::os::fd::BorrowedFd<'static> {
    // SAFETY: descriptor 0 stays open for the life of the process.
    unsafe { std::os::fd::BorrowedFd::borrow_raw(0) }
}

impl Tty {
    pub(super) fn detect() -> Option<Tty> {
        let fd = stdin_fd();
        if !rustix::termios::isatty(fd) {
            return None;
        }
        let own_pgrp = rustix::process::getpgrp();
        // In the background (`berth run … &`) the terminal is left alone.
        if rustix::termios::tcgetpgrp(fd).ok()? != own_pgrp {
            return None;
        }
        let modes = rustix::termios::tcgetattr(fd).ok()?;
        Some(Tty { own_pgrp, modes })
    }

    pub(super) fn give(&self, pgid: i32) {
        if let Some(p) = rustix::process::Pid::from_raw(pgid) {
            let _ = rustix::termios::tcsetpgrp(stdin_fd(), p);
        }
    }

    pub(super) fn take_back(&self) {
        let _ = rustix::termios::tcsetpgrp(stdin_fd(), self.own_pgrp);
        let _ = rustix::termios::tcsetattr(
            stdin_fd(),
            rustix::termios::OptionalActions::Drain,
            &self.modes,
        );
    }

    pub(super) fn in_foreground(&self) -> bool {
        rustix::termios::tcgetpgrp(stdin_fd()).ok() == Some(self.own_pgrp)
    }
}

/// CMD stopped with `sig`. A job-control stop (Ctrl-Z, or reading a terminal it does
/// not own) suspends berth run with it, as a shell job: the terminal and its modes go
/// back to the shell, berth run stops, and when the shell continues it (`fg` or `bg`)
/// CMD is continued too, with the terminal again if in the foreground. Returns whether
/// berth run was suspended (its renewals paused meanwhile).
pub(super) fn suspend_with(tty: &Option<Tty>, pgid: i32, sig: i32) -> bool {
    if ![libc::SIGTSTP, libc::SIGTTIN, libc::SIGTTOU].contains(&sig) {
        return false;
    }
    let me = rustix::process::getpid();
    // A session leader has no shell above it to continue it: CMD goes on instead.
    if rustix::process::getsid(None).ok() == Some(me) {
        eprintln!("berth: no job control here (berth run leads its session); CMD continues");
        signal_group(pgid, rustix::process::Signal::CONT);
        return false;
    }
    let cmd_modes = tty
        .as_ref()
        .and_then(|_| rustix::termios::tcgetattr(stdin_fd()).ok());
    if let Some(t) = tty {
        t.take_back();
    }
    // Stops here until continued (SIGSTOP: a shell job is its whole process group).
    let _ = rustix::process::kill_process_group(
        rustix::process::getpgrp(),
        rustix::process::Signal::STOP,
    );
    if let Some(t) = tty {
        if t.in_foreground() {
            if let Some(m) = &cmd_modes {
                let _ = rustix::termios::tcsetattr(
                    stdin_fd(),
                    rustix::termios::OptionalActions::Drain,
                    m,
                );
            }
            t.give(pgid);
        }
    }
    signal_group(pgid, rustix::process::Signal::CONT);
    true
}
