//! `berth run` and `berth acquire`.
//!
//! `berth run` streams the acquire (showing position and reason), re-posts the same
//! run id if the daemon restarts while it waits (L7, P5), runs CMD in a new process
//! group with the lease's environment, renews at a third of the ttl, forwards SIGINT and
//! SIGTERM to CMD's group, releases when CMD exits and exits with CMD's code.

use berth_client::retry::{Backoff, Retry};
use std::collections::BTreeMap;
use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::anyhow;
use berth_client::wire::{
    AcquireEvent, AcquireRequest, BudgetClaim, ErrorDetail, ProcessRequest, ReleaseRequest, Run,
    RunUsage, RuntimeEvent, RuntimeRequest, UniqueMap,
};
use berth_core::validate;
use berth_core::RunState;
use clap::Args;
use serde_json::Value;

use crate::client::{error_of, error_text, Client, ConnArgs};
use crate::{EXIT_OOM, EXIT_REFUSED, EXIT_TIMEOUT};

mod admit;
mod child;
mod claim;

pub use admit::acquire_main;
use admit::*;
use child::*;
pub use child::{gate_main, GATE_ARG};
pub(crate) use claim::random_id;
use claim::*;
pub use claim::{AcquireArgs, ClaimArgs};

#[derive(Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub claim: ClaimArgs,
    /// Start the project's runtime (the worktree contract's [[port]] commands, each
    /// until its ready probe answers) before CMD; CMD finds each at BERTH_URL_<NAME>.
    #[arg(long)]
    pub runtime: bool,
    /// The command to run, after `--`.
    #[arg(last = true, required = true)]
    pub cmd: Vec<String>,
}

pub fn run_main(a: RunArgs) -> anyhow::Result<u8> {
    let client = Arc::new(Client::new(&a.claim.conn)?);
    let body = acquire_body(&a.claim)?;
    let run_id = body.run_id.clone().unwrap_or_default();
    let wait_ms = a.claim.wait.unwrap_or(1_800_000);
    let grant = match wait_for_lease(&client, &body, wait_ms) {
        Admission::Granted(l) => l,
        Admission::Refused(code, msg) => {
            eprintln!("berth: run {run_id} not admitted: {msg}");
            return Ok(code);
        }
    };
    // Read at once: every decision about the lease counts from its expiry.
    let lease = crate::lease::Lease::from_grant(&grant, Instant::now(), crate::show::now_ms());
    // A terminal on stdin, with berth run in its foreground: CMD gets the terminal (see
    // `Tty`). Terminal stops are blocked first, in every thread to come: berth run
    // talks to a terminal it no longer owns (its waiting line, `tcsetpgrp`).
    let tty = Tty::detect();
    block_terminal_stops();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(run_granted(a, client, *grant, lease, tty))
}

/// The lease of a granted run while `berth run` holds it: kept from the grant on
/// (issue 33 item 2), told apart from CMD's own end.
struct Held {
    client: Arc<Client>,
    run_id: String,
    fence: u64,
    lease: crate::lease::Shared,
    lost: tokio::sync::mpsc::Receiver<String>,
    renew_now: Arc<tokio::sync::Notify>,
    keeper: tokio::task::JoinHandle<()>,
    /// `$BERTH_LEASE_FILE`: the lease as it stands, for CMD.
    file: Option<LeaseFile>,
    /// The memory it claimed (issue 36: an OOM kill is said against it).
    memory_claim: u64,
}

impl Held {
    /// Starts keeping the lease `grant` gave: renewals run from now on, whatever
    /// else berth run is doing (starting the runtime, registering CMD).
    fn start(client: Arc<Client>, grant: &Run, lease: crate::lease::Lease) -> Held {
        let fence = grant.fence.unwrap_or(0);
        let lease = Arc::new(std::sync::Mutex::new(lease));
        let (lost_tx, lost) = tokio::sync::mpsc::channel::<String>(1);
        let renew_now = Arc::new(tokio::sync::Notify::new());
        let file = LeaseFile::create(grant);
        let writer = file.as_ref().map(|f| f.path.clone());
        let keeper = tokio::spawn(crate::lease::keep(
            client.clone(),
            grant.run_id.clone(),
            fence,
            lease.clone(),
            lost_tx,
            renew_now.clone(),
            move |run: &Run| {
                if let Some(p) = &writer {
                    LeaseFile::write(p, run);
                }
            },
        ));
        Held {
            client,
            run_id: grant.run_id.clone(),
            fence,
            lease,
            lost,
            renew_now,
            keeper,
            file,
            memory_claim: grant.claim.resources.get("memory").copied().unwrap_or(0),
        }
    }

    fn lease(&self) -> crate::lease::Lease {
        *self.lease.lock().expect("lease")
    }

    /// Releases the lease after CMD ended; the exit status of `berth run`. Any lost
    /// lease ends in 75 and one line that says why (never a bare signal status): lost
    /// while CMD ran, or found lost when releasing (it expired while berth run was
    /// suspended or cut off, and the broker stopped CMD: issue 33 item 3).
    async fn finish(mut self, status: ExitKind, lost_reason: Option<String>) -> u8 {
        self.keeper.abort();
        let (lost, usage) = match lost_reason.or_else(|| self.lost.try_recv().ok()) {
            Some(why) => (Some(why), None),
            None => match release(&self.client, &self.run_id, self.fence).await {
                Ok(usage) => (None, usage),
                Err(why) => (Some(why), None),
            },
        };
        drop(self.file.take());
        if let Some(why) = lost {
            eprintln!(
                "berth: the lease for run {} was lost ({why}); CMD was stopped ({})",
                self.run_id,
                status.describe()
            );
            return EXIT_TIMEOUT;
        }
        if let Some((code, line)) = kernel_kill(status, usage.as_ref(), self.memory_claim) {
            eprintln!("berth: run {}: {line}", self.run_id);
            return code;
        }
        status.code()
    }

    /// CMD never ran: the lease goes back, and berth run exits `code` after `why`.
    async fn abandon(mut self, code: u8, why: String) -> u8 {
        self.keeper.abort();
        eprintln!("berth: run {}: {why}", self.run_id);
        drop(self.file.take());
        let _ = release(&self.client, &self.run_id, self.fence).await;
        code
    }
}

/// Runs CMD under the granted lease: keeps the lease from the start, starts the
/// runtime if asked, starts CMD behind its gate, registers it, opens the gate,
/// supervises it and releases the lease after.
async fn run_granted(
    a: RunArgs,
    client: Arc<Client>,
    grant: Run,
    lease: crate::lease::Lease,
    tty: Option<Tty>,
) -> anyhow::Result<u8> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut held = Held::start(client.clone(), &grant, lease);
    let mut env: BTreeMap<String, String> = grant.env;
    if let Some(f) = &held.file {
        env.insert(
            "BERTH_LEASE_FILE".into(),
            f.path.to_string_lossy().into_owned(),
        );
    }
    if a.runtime {
        let started = tokio::select! {
            r = start_runtime(&client, &held.run_id, held.fence) => r,
            Some(why) = held.lost.recv() => Err((EXIT_TIMEOUT, format!("the lease was lost ({why})"))),
        };
        if let Err((code, why)) = started {
            let why = format!("the runtime did not start: {why}");
            return Ok(held.abandon(code, why).await);
        }
    }
    // Handlers first: a signal that arrives once CMD exists must reach CMD.
    let signals = Signals {
        int: signal(SignalKind::interrupt())?,
        term: signal(SignalKind::terminate())?,
        hup: signal(SignalKind::hangup())?,
        tstp: signal(SignalKind::from_raw(libc::SIGTSTP))?,
    };
    let (pgid, mut events, gate_write) = match launch(&held, &a.cmd, &env).await {
        Ok(l) => l,
        Err((code, why)) => return Ok(held.abandon(code, why).await),
    };
    // The terminal goes to CMD before it starts: its first read must not stop it.
    if let Some(t) = &tty {
        t.give(pgid);
    }
    // Open the gate: CMD starts now.
    rustix::io::write(&gate_write, b"go\n")?;
    drop(gate_write);
    let grace = held.lease().grace();
    let renew_now = held.renew_now.clone();
    let (status, lost_reason) = supervise(
        pgid,
        &tty,
        &mut events,
        signals,
        &mut held.lost,
        &renew_now,
        grace,
    )
    .await;
    if let Some(t) = &tty {
        t.take_back();
    }
    Ok(held.finish(status, lost_reason).await)
}

/// Starts CMD behind its gate and registers it; CMD starts when the gate (returned)
/// gets its line. On failure, CMD never ran: the exit code and why.
///
/// CMD must never run unregistered (P1): it starts behind a gate (berth itself) that
/// waits for one line on a pipe and then execs CMD under the same pid. If this process
/// dies before it registers CMD, the pipe closes, the read fails and CMD never starts.
async fn launch(
    held: &Held,
    cmd: &[String],
    env: &BTreeMap<String, String>,
) -> Result<(i32, ChildEvents, std::os::fd::OwnedFd), (u8, String)> {
    let (spawned, gate_write) =
        spawn_gated(cmd, env).map_err(|e| (EXIT_REFUSED, format!("cannot start CMD: {e}")))?;
    let child = spawned.map_err(|e| (127, format!("cannot start {}: {e}", cmd[0])))?;
    let pgid = child.id() as i32;
    let mut events = watch_child(pgid);
    berth_server::failpoint::hit("spawn-before-register");
    // P1: the broker records the child by identity (and moves it into the run's
    // cgroup), so it can stop the tree if this client dies (P6). If registering
    // fails, the gate stays shut (closing the pipe makes the gate's `read` fail, so
    // it exits 125 without running CMD).
    if let Err((code, why)) = register(held, pgid).await {
        drop(gate_write);
        while let Some(ev) = events.recv().await {
            if matches!(ev, ChildEvent::Exited(_)) {
                break;
            }
        }
        let why = format!("CMD was not started, because the broker could not record it: {why}");
        return Err((code, why));
    }
    Ok((pgid, events, gate_write))
}

/// Waits for CMD to end: passes signals on to its group, follows it into suspension
/// and back (job control), and stops it (TERM, grace, KILL) if the lease is lost.
/// Returns how CMD ended and why the lease was lost, if it was.
async fn supervise(
    pgid: i32,
    tty: &Option<Tty>,
    events: &mut tokio::sync::mpsc::UnboundedReceiver<ChildEvent>,
    mut signals: Signals,
    lost_rx: &mut tokio::sync::mpsc::Receiver<String>,
    renew_now: &tokio::sync::Notify,
    grace: Duration,
) -> (ExitKind, Option<String>) {
    let mut lost_reason = None;
    let status = loop {
        tokio::select! {
            ev = events.recv() => match ev {
                Some(ChildEvent::Exited(st)) | Some(ChildEvent::Lost(st)) => break st,
                None => break ExitKind::Unknown,
                Some(ChildEvent::Stopped(sig)) => {
                    if suspend_with(tty, pgid, sig) {
                        // Back from a suspension that may have outlasted the lease.
                        renew_now.notify_one();
                    }
                }
            },
            _ = signals.int.recv() => signal_group(pgid, rustix::process::Signal::INT),
            _ = signals.term.recv() => signal_group(pgid, rustix::process::Signal::TERM),
            _ = signals.hup.recv() => signal_group(pgid, rustix::process::Signal::HUP),
            // Asked to suspend (not from the terminal, which signals CMD itself):
            // CMD is suspended, and its stop suspends berth run in turn.
            _ = signals.tstp.recv() => signal_group(pgid, rustix::process::Signal::TSTP),
            Some(why) = lost_rx.recv(), if lost_reason.is_none() => {
                lost_reason = Some(why);
                signal_group(pgid, rustix::process::Signal::TERM);
                signal_group(pgid, rustix::process::Signal::CONT);
                let pg = pgid;
                // KILL when the lease runs out: the claim may go to another run then.
                tokio::spawn(async move {
                    tokio::time::sleep(grace).await;
                    signal_group(pg, rustix::process::Signal::KILL);
                });
            }
        }
    };
    (status, lost_reason)
}

/// Registers `pid` with the run; on failure, the exit code and the reason: 69 when the
/// broker refused (the rule said no), 75 when the lease was lost or could not be
/// confirmed in time. A registration the broker could not take yet (a restart, a full
/// disk) is tried again for as long as the lease can be kept (issue 33 item 2): the
/// lease is renewed meanwhile, so a daemon that is down between the grant and the
/// registration costs nothing but the wait.
async fn register(held: &Held, pid: i32) -> Result<(), (u8, String)> {
    let mut retry = Retry::new(REGISTER);
    let mut last = String::from("no answer yet");
    loop {
        let lease = held.lease();
        let Some(budget) = lease.budget(Instant::now()) else {
            return Err((
                EXIT_TIMEOUT,
                format!("the lease ran out before CMD could be registered: {last}"),
            ));
        };
        let body = ProcessRequest {
            fence: held.fence,
            pid,
        };
        let path = format!("/v1/runs/{}/processes", held.run_id);
        let r = held
            .client
            .call_async("POST", &path, Some(&body), budget)
            .await;
        last = match r {
            Ok(reply) if reply.status < 300 => return Ok(()),
            Ok(reply) if reply.status == 409 || reply.status == 410 => {
                return Err((
                    EXIT_TIMEOUT,
                    format!("the lease was lost ({})", error_text(&reply.body)),
                ))
            }
            Ok(reply) if reply.status < 500 => {
                return Err((EXIT_REFUSED, error_text(&reply.body)));
            }
            Ok(reply) => error_text(&reply.body),
            Err(e) => format!("cannot reach berth at {}: {e}", held.client.url),
        };
        let left = lease.stop_at().saturating_duration_since(Instant::now());
        tokio::time::sleep(retry.failed().min(left)).await;
    }
}

/// Issue 36: the kernel's OOM killer killed inside the run: the line `berth run` ends
/// with (its peak against its claim) and its exit code: `EXIT_OOM` unless CMD
/// succeeded anyway (a child was killed and CMD recovered), when CMD's 0 stands and
/// the line is a warning. `None`: no OOM kill.
fn kernel_kill(status: ExitKind, usage: Option<&RunUsage>, claim: u64) -> Option<(u8, String)> {
    let u = usage.filter(|u| u.oom_killed)?;
    let used = u
        .memory_peak_bytes
        .map_or("used more than its limit".into(), |p| {
            format!("used {}", berth_core::fmt_bytes(p))
        });
    let limit = u
        .limits
        .as_ref()
        .and_then(|l| l.memory_max_bytes)
        .map_or(String::new(), |m| {
            format!(", hard limit {}", berth_core::fmt_bytes(m))
        });
    let line = format!(
        "killed by the kernel: {used} of a {} claim (oom_killed{limit}); {}",
        berth_core::fmt_bytes(claim),
        status.describe()
    );
    let code = if matches!(status, ExitKind::Code(0)) {
        0
    } else {
        EXIT_OOM
    };
    Some((code, line))
}

/// Releases the lease; the run's use of its claim, as the release answer gives it.
/// `Err(why)` when it was no longer ours (it expired, or another fence holds it):
/// the caller reports a lost lease.
async fn release(
    client: &Arc<Client>,
    run_id: &str,
    fence: u64,
) -> Result<Option<RunUsage>, String> {
    let give_up = Instant::now() + RELEASE_FOR;
    let mut retry = Retry::new(RELEASE);
    while let Some(left) = give_up.checked_duration_since(Instant::now()) {
        let budget = left.min(crate::lease::REQUEST_TIMEOUT_MAX);
        let body = ReleaseRequest { fence };
        let path = format!("/v1/runs/{run_id}/release");
        match client.call_async("POST", &path, Some(&body), budget).await {
            Ok(reply) if reply.status < 300 => {
                return match reply.parse::<Run>() {
                    // Expired, or being stopped because it expired (the broker's stop
                    // grace): not a clean end, whatever CMD's status (item 3).
                    Ok(r)
                        if r.state == RunState::Expired
                            || r.ending.as_deref() == Some("expired") =>
                    {
                        Err("it expired before CMD ended: it was not renewed in time, and the broker stopped CMD".into())
                    }
                    // berth ended it itself, and says why (e.g. an analysis run that
                    // listened, C6).
                    Ok(Run {
                        failure: Some(why), ..
                    }) => Err(why),
                    Ok(r) => Ok(r.usage),
                    Err(_) => Ok(None),
                };
            }
            Ok(reply) if reply.status == 409 || reply.status == 410 => {
                return Err(error_text(&reply.body));
            }
            Ok(reply) if reply.status < 500 => return Ok(None),
            _ => tokio::time::sleep(retry.failed().min(left)).await,
        }
    }
    eprintln!("berth: could not release run {run_id}; it will expire");
    Ok(None)
}

const REGISTER: Backoff = Backoff::new(100, 2_000);
const RELEASE: Backoff = Backoff::new(250, 1_000);

/// How long `berth run` tries to release after CMD ended (the lease expires anyway).
const RELEASE_FOR: Duration = Duration::from_secs(30);

/// `$BERTH_LEASE_FILE`: the lease as it stands, rewritten (atomically, by rename) after
/// each renew, so CMD can read its current expiry (an environment variable keeps its
/// first value). Lines of `NAME=VALUE`, so `. "$BERTH_LEASE_FILE"` reads it in a shell.
/// It lives in a directory of its own (mode 0700) under the temporary directory,
/// removed when berth run ends.
struct LeaseFile {
    dir: PathBuf,
    path: PathBuf,
}

impl LeaseFile {
    fn create(grant: &Run) -> Option<LeaseFile> {
        use std::os::unix::fs::DirBuilderExt;
        let dir = std::env::temp_dir().join(format!("berth-lease-{}", random_id()));
        // `create`, not `create_all`: a name someone else made first is refused.
        std::fs::DirBuilder::new().mode(0o700).create(&dir).ok()?;
        let f = LeaseFile {
            path: dir.join("lease"),
            dir,
        };
        LeaseFile::write(&f.path, grant);
        Some(f)
    }

    fn write(path: &std::path::Path, run: &Run) {
        let text = format!(
            "BERTH_RUN_ID={}\nBERTH_FENCE={}\nBERTH_LEASE_EXPIRES_AT={}\nBERTH_LEASE_TTL_MS={}\n",
            run.run_id,
            run.fence.unwrap_or(0),
            run.expires_at.as_deref().unwrap_or(""),
            run.ttl_ms.unwrap_or(0)
        );
        let tmp = path.with_extension("new");
        if std::fs::write(&tmp, text).is_ok() {
            let _ = std::fs::rename(&tmp, path);
        }
    }
}

impl Drop for LeaseFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn oom(peak: Option<u64>) -> RunUsage {
        RunUsage {
            memory_peak_bytes: peak,
            oom_kills: 1,
            oom_killed: true,
            limits: Some(berth_client::wire::RunLimits {
                memory_max_bytes: Some(80 << 20),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// Issue 36: the line and code `berth run` ends with after an OOM kill in its run.
    #[test]
    fn an_oom_kill_is_said_with_its_peak_against_the_claim_and_its_own_exit_code() {
        let killed = ExitKind::Signal(9);
        let (code, line) = kernel_kill(killed, Some(&oom(Some(80 << 20))), 64 << 20).unwrap();
        assert_eq!(code, EXIT_OOM);
        assert_eq!(
            line,
            "killed by the kernel: used 80 MiB of a 64 MiB claim (oom_killed, hard limit 80 MiB); it was ended by signal 9"
        );
        // CMD recovered (a child was killed): its 0 stands, the line is a warning.
        let (code, _) = kernel_kill(ExitKind::Code(0), Some(&oom(None)), 64 << 20).unwrap();
        assert_eq!(code, 0);
        let (code, line) = kernel_kill(ExitKind::Code(1), Some(&oom(None)), 64 << 20).unwrap();
        assert_eq!(code, EXIT_OOM);
        assert!(
            line.starts_with("killed by the kernel: used more than its limit of a 64 MiB claim")
        );
        // No OOM kill, no line: CMD's own status.
        let calm = RunUsage::default();
        assert_eq!(kernel_kill(killed, Some(&calm), 64 << 20), None);
        assert_eq!(kernel_kill(killed, None, 64 << 20), None);
    }
}
