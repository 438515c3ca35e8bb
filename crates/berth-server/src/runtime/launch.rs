//! Launching a port's build and command: in their own session (so a stop reaches
//! their process group), in the run's cgroup before they execute anything, output to
//! the run's `logs/` through descriptors that follow no link, capped.

use std::collections::{BTreeMap, VecDeque};
use std::ffi::CString;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustix::fs::{Mode, OFlags};
use tokio::io::{AsyncRead, AsyncReadExt};

use super::{Failure, KILL_GRACE};
use crate::contract::ports::{Build, Port};

/// Output kept per port's log file; past it, output is read and dropped (a chatty or
/// hostile server cannot fill the disk through berth).
pub const LOG_BYTES_MAX: u64 = 8 << 20;
/// Lines of output a failure report quotes.
pub const LOG_TAIL_LINES: usize = 20;
/// Output remembered for the tail.
const TAIL_BYTES: usize = 16 * 1024;

/// A launched command: its process, and the last of what it wrote.
pub struct Launched {
    pub pid: i32,
    child: tokio::process::Child,
    tail: Arc<Mutex<VecDeque<u8>>>,
}

impl Launched {
    /// The last `LOG_TAIL_LINES` lines it wrote.
    pub fn tail_lines(&self) -> Vec<String> {
        let bytes: Vec<u8> = self.tail.lock().unwrap().iter().copied().collect();
        let text = String::from_utf8_lossy(&bytes);
        let lines: Vec<&str> = text.lines().collect();
        let from = lines.len().saturating_sub(LOG_TAIL_LINES);
        lines[from..].iter().map(|l| l.to_string()).collect()
    }

    /// How it ended, if it has.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// TERM to its process group, a short grace, KILL, and it is reaped.
    pub async fn kill(&mut self) {
        signal_group(self.pid, rustix::process::Signal::TERM);
        if tokio::time::timeout(KILL_GRACE, self.child.wait())
            .await
            .is_err()
        {
            signal_group(self.pid, rustix::process::Signal::KILL);
            let _ = self.child.wait().await;
        }
    }

    /// It runs on as the run's process; it is reaped when it exits.
    pub fn detach(mut self) {
        tokio::spawn(async move {
            let _ = self.child.wait().await;
        });
    }
}

fn signal_group(pid: i32, sig: rustix::process::Signal) {
    if let Some(p) = rustix::process::Pid::from_raw(pid) {
        let _ = rustix::process::kill_process_group(p, sig);
    }
}

/// `exit 1`, `signal 9`.
pub fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit {c}"),
        (None, Some(s)) => format!("signal {s}"),
        _ => "an unknown status".into(),
    }
}

/// The port's command, started.
pub fn spawn(
    port: &Port,
    cwd: &Path,
    env: &BTreeMap<String, String>,
    logs: &Path,
    group_procs: &[PathBuf],
) -> Result<Launched, Failure> {
    let l = &port.launch;
    let log = open_log(logs, &format!("{}.log", port.name))
        .map_err(|e| Failure::new(port, format!("its log file: {e}"), vec![]))?;
    let mut cmd = command(&l.command, &l.args, cwd, env, group_procs)
        .map_err(|e| Failure::new(port, e, vec![]))?;
    let mut child = cmd.spawn().map_err(|e| {
        Failure::new(
            port,
            format!("launch.command {:?} could not be started: {e}", l.command),
            vec![],
        )
    })?;
    let pid = child.id().map(|p| p as i32).unwrap_or(0);
    let tail = Arc::new(Mutex::new(VecDeque::with_capacity(TAIL_BYTES)));
    let size = rustix::fs::fstat(&log)
        .map(|s| s.st_size.max(0) as u64)
        .unwrap_or(0);
    let file = Arc::new(Mutex::new((std::fs::File::from(log), size)));
    if let Some(out) = child.stdout.take() {
        tokio::spawn(copy_out(out, file.clone(), tail.clone()));
    }
    if let Some(err) = child.stderr.take() {
        tokio::spawn(copy_out(err, file, tail.clone()));
    }
    Ok(Launched { pid, child, tail })
}

/// A port's build, run to its end within its timeout; its output goes to
/// `logs/<port>.build.log`.
pub async fn build(
    port: &Port,
    b: &Build,
    cwd: &Path,
    env: &BTreeMap<String, String>,
    logs: &Path,
    group_procs: &[PathBuf],
) -> Result<(), Failure> {
    let as_port = Port {
        name: format!("{}.build", port.name),
        launch: crate::contract::ports::Command {
            command: b.command.clone(),
            args: b.args.clone(),
            cwd: None,
            env: BTreeMap::new(),
        },
        ready: port.ready.clone(),
        build: None,
    };
    let (cwd, env, logs) = (cwd.to_path_buf(), env.clone(), logs.to_path_buf());
    let group = group_procs.to_vec();
    let mut l = super::off_worker(port, move || spawn(&as_port, &cwd, &env, &logs, &group))
        .await
        .map_err(|f| Failure::new(port, format!("build: {}", f.why), f.log_tail))?;
    let limit = Duration::from_millis(b.timeout_ms);
    match tokio::time::timeout(limit, l.child.wait()).await {
        Ok(Ok(s)) if s.success() => Ok(()),
        Ok(Ok(s)) => {
            // Let the output copiers catch up with what it wrote last.
            tokio::time::sleep(Duration::from_millis(50)).await;
            Err(Failure::new(
                port,
                format!("build failed ({})", describe(s)),
                l.tail_lines(),
            ))
        }
        Ok(Err(e)) => Err(Failure::new(port, format!("build: {e}"), l.tail_lines())),
        Err(_) => {
            l.kill().await;
            Err(Failure::new(
                port,
                format!("build did not finish within {} s", limit.as_secs()),
                l.tail_lines(),
            ))
        }
    }
}

fn command(
    program: &str,
    args: &[String],
    cwd: &Path,
    env: &BTreeMap<String, String>,
    group_procs: &[PathBuf],
) -> Result<tokio::process::Command, String> {
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args)
        .current_dir(cwd)
        // berth's own secrets never reach a run's processes.
        .env_remove("BERTH_TOKEN")
        .envs(env)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(false);
    let procs = group_procs
        .iter()
        .map(|p| {
            CString::new(p.as_os_str().as_encoded_bytes())
                .map_err(|_| "the cgroup path holds a NUL".to_string())
        })
        .collect::<Result<Vec<CString>, String>>()?;
    // SAFETY: between fork and exec only async-signal-safe system calls are made
    // (setsid, open, write, close), with nothing allocated: the path was made above.
    unsafe {
        cmd.pre_exec(move || {
            let _ = rustix::process::setsid();
            for p in &procs {
                // "0" moves the writing process itself: it is in the run's group before
                // it runs anything, so no fork of it can escape the group.
                if let Ok(fd) = rustix::fs::open(
                    p.as_c_str(),
                    OFlags::WRONLY | OFlags::CLOEXEC,
                    Mode::empty(),
                ) {
                    let _ = rustix::io::write(&fd, b"0");
                }
            }
            Ok(())
        });
    }
    Ok(cmd)
}

/// Opens `logs/<name>` for appending without following any link the run may have
/// planted (the workspace is the run's to write in), and refuses anything but a
/// regular file.
fn open_log(logs: &Path, name: &str) -> std::io::Result<OwnedFd> {
    let dir_flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let dir = rustix::fs::open(logs, dir_flags, Mode::empty())?;
    let fd = rustix::fs::openat(
        &dir,
        name,
        OFlags::WRONLY
            | OFlags::CREATE
            | OFlags::APPEND
            | OFlags::NOFOLLOW
            | OFlags::NONBLOCK
            | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )?;
    let st = rustix::fs::fstat(&fd)?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
        return Err(std::io::Error::other("not a regular file"));
    }
    Ok(fd)
}

/// Copies a process's output to its log (up to `LOG_BYTES_MAX`) and the tail. The
/// log is berth's own file in the state dir's file system, opened above; a write is at
/// most 8 KiB.
async fn copy_out(
    mut from: impl AsyncRead + Unpin,
    file: Arc<Mutex<(std::fs::File, u64)>>,
    tail: Arc<Mutex<VecDeque<u8>>>,
) {
    let mut buf = vec![0u8; 8192];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        {
            let mut t = tail.lock().unwrap();
            t.extend(&buf[..n]);
            let over = t.len().saturating_sub(TAIL_BYTES);
            t.drain(..over);
        }
        let mut f = file.lock().unwrap();
        let room = LOG_BYTES_MAX.saturating_sub(f.1) as usize;
        if room > 0 {
            let k = n.min(room);
            if std::io::Write::write_all(&mut f.0, &buf[..k]).is_ok() {
                f.1 += k as u64;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::ports::{Command, Probe, Ready};

    fn port(name: &str, script: &str) -> Port {
        Port {
            name: name.into(),
            launch: Command {
                command: "sh".into(),
                args: vec!["-c".into(), script.into()],
                cwd: None,
                env: BTreeMap::new(),
            },
            ready: Ready {
                probe: Probe::Tcp,
                timeout_ms: 1_000,
                interval_ms: 100,
            },
            build: None,
        }
    }

    /// A chatty command's log stops at `LOG_BYTES_MAX`; the tail still has its last
    /// words.
    #[tokio::test]
    async fn the_log_is_capped_and_the_tail_kept() {
        let logs = tempfile::tempdir().unwrap();
        let p = port(
            "web",
            "head -c 9000000 /dev/zero | tr '\\0' x; echo; echo last words",
        );
        let mut l = spawn(&p, logs.path(), &BTreeMap::new(), logs.path(), &[]).unwrap();
        let status = l.child.wait().await.unwrap();
        assert!(status.success());
        tokio::time::sleep(Duration::from_millis(200)).await;
        let size = std::fs::metadata(logs.path().join("web.log"))
            .unwrap()
            .len();
        assert_eq!(size, LOG_BYTES_MAX);
        assert_eq!(
            l.tail_lines().last().map(String::as_str),
            Some("last words")
        );
    }

    /// A link the run planted at its log's name is never followed (the run could
    /// point it at any file berth's user may write).
    #[tokio::test]
    async fn a_planted_link_at_the_log_is_refused() {
        let logs = tempfile::tempdir().unwrap();
        let victim = logs.path().join("victim");
        std::fs::write(&victim, "keep me").unwrap();
        std::os::unix::fs::symlink(&victim, logs.path().join("web.log")).unwrap();
        let p = port("web", "echo overwritten");
        let err = spawn(&p, logs.path(), &BTreeMap::new(), logs.path(), &[])
            .err()
            .expect("refused");
        assert!(err.why.starts_with("its log file"), "{}", err.why);
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep me");
    }

    /// A FIFO planted at the log's name is refused at once, never waited on.
    #[tokio::test]
    async fn a_planted_fifo_at_the_log_is_refused_without_blocking() {
        let logs = tempfile::tempdir().unwrap();
        rustix::fs::mknodat(
            rustix::fs::CWD,
            logs.path().join("web.log").as_path(),
            rustix::fs::FileType::Fifo,
            Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        let p = port("web", "echo hi");
        let t = std::time::Instant::now();
        let err = spawn(&p, logs.path(), &BTreeMap::new(), logs.path(), &[])
            .err()
            .expect("refused");
        assert!(err.why.starts_with("its log file"), "{}", err.why);
        assert!(t.elapsed() < Duration::from_secs(2));
    }
}
