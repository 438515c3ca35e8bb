//! C7: starting a run's runtime. For each `[[port]]` of the worktree's contract: its
//! `build` (once), then its command, launched by berth in the worktree with the run's
//! environment, recorded as the run's process before anything relies on it (P1) and
//! stopped with the run; its output goes to the run's `logs/<port>.log` (capped); then
//! its ready probe. Progress is reported as [`RuntimeEvent`]s.
//!
//! This runs on the async workers, never in the daemon: it only waits (on processes,
//! pipes and sockets) and talks to the daemon through messages.

mod launch;
mod probe;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use berth_client::wire::RuntimeEvent;
use tokio::sync::mpsc;

use crate::contract::{Contract, Port};
use crate::daemon::{Msg, RuntimePlan};

pub use launch::{Launched, LOG_BYTES_MAX, LOG_TAIL_LINES};

/// Why a start failed, and where.
#[derive(Debug)]
pub struct Failure {
    pub port: String,
    pub why: String,
    pub log_tail: Vec<String>,
    /// Set when the port was ready but another process holds its listener (issue 32
    /// finding 5): the number, and the stranger's pid if visible.
    pub taken: Option<(u16, Option<i32>)>,
}

impl Failure {
    fn new(port: &Port, why: impl Into<String>, log_tail: Vec<String>) -> Failure {
        Failure {
            port: port.name.clone(),
            why: why.into(),
            log_tail,
            taken: None,
        }
    }

    pub fn event(&self) -> RuntimeEvent {
        RuntimeEvent::Failed {
            port: self.port.clone(),
            why: self.why.clone(),
            log_tail: self.log_tail.clone(),
        }
    }
}

/// Everything a start needs besides the daemon.
pub struct Start<'a> {
    pub plan: &'a RuntimePlan,
    pub contract: &'a Contract,
    pub worktree: &'a Path,
    pub fence: u64,
    /// The daemon's inbox, for registrations (P1).
    pub daemon: &'a mpsc::Sender<Msg>,
    /// The uid the daemon registers its own launches for.
    pub uid: u32,
    /// What the registration rule knows of the daemon (`None`: checked on the
    /// state task).
    pub me: Option<crate::register::Me>,
}

/// Builds, launches and probes every port in declaration order; stops what it
/// launched if any port fails. Returns the ready ports by name.
pub async fn start(
    s: &Start<'_>,
    events: &mpsc::UnboundedSender<RuntimeEvent>,
) -> Result<BTreeMap<String, u16>, Failure> {
    let mut launched: Vec<Launched> = Vec::new();
    let result = launch_all(s, events, &mut launched).await;
    if result.is_err() {
        // The run stays granted to be fixed and tried again: nothing of this attempt
        // may keep holding its ports.
        for l in &mut launched {
            l.kill().await;
        }
    } else {
        // Reaped when they exit (berth stops them with the run).
        for l in launched {
            l.detach();
        }
    }
    result
}

async fn launch_all(
    s: &Start<'_>,
    events: &mpsc::UnboundedSender<RuntimeEvent>,
    launched: &mut Vec<Launched>,
) -> Result<BTreeMap<String, u16>, Failure> {
    let mut ready = BTreeMap::new();
    for port in &s.contract.ports {
        let number = *s.plan.info.ports.get(&port.name).ok_or_else(|| {
            Failure::new(
                port,
                "no port number was allocated for it (the contract changed since the grant?)",
                vec![],
            )
        })?;
        let cwd = off_worker(port, {
            let (wt, port) = (s.worktree.to_path_buf(), port.clone());
            move || launch_dir(&wt, &port)
        })
        .await?;
        let env = environment(s, port, number);
        let logs = logs_dir(s.plan)?;
        if let Some(b) = &port.build {
            let _ = events.send(RuntimeEvent::Building {
                port: port.name.clone(),
            });
            launch::build(port, b, &cwd, &env, &logs, &s.plan.group_procs).await?;
        }
        let l = off_worker(port, {
            let (port, cwd, env, logs) = (port.clone(), cwd.clone(), env.clone(), logs.clone());
            let group = s.plan.group_procs.clone();
            move || launch::spawn(&port, &cwd, &env, &logs, &group)
        })
        .await?;
        let pid = l.pid;
        launched.push(l);
        if let Err(why) = register(s, pid).await {
            let l = launched.last_mut().expect("pushed");
            // A command that exits at once is gone before it can be recorded: what
            // matters then is how it ended and what it said.
            if let Some(status) = l.exited() {
                tokio::time::sleep(Duration::from_millis(50)).await;
                let why = format!("{} before it was ready", launch::describe(status));
                return Err(Failure::new(port, why, l.tail_lines()));
            }
            let why = format!("its process could not be recorded as the run's: {why}");
            return Err(Failure::new(port, why, l.tail_lines()));
        }
        let _ = events.send(RuntimeEvent::Launched {
            port: port.name.clone(),
            number,
            pid,
        });
        let l = launched.last_mut().expect("pushed");
        probe::until_ready(port, number, l).await?;
        // C3: what answered must be the run's own listener, not a squatter's.
        owned_listener(s, port, pid, number, l).await?;
        let _ = events.send(RuntimeEvent::Ready {
            port: port.name.clone(),
        });
        ready.insert(port.name.clone(), number);
    }
    Ok(ready)
}

/// C3 (issue 32 finding 5): the listener that answered on `number` must be held by
/// the launched command's tree or the run's cgroup; otherwise the start fails,
/// naming who holds it.
async fn owned_listener(
    s: &Start<'_>,
    port: &Port,
    pid: i32,
    number: u16,
    l: &Launched,
) -> Result<(), Failure> {
    let group = group_pids(s.plan.group_procs.first().map(PathBuf::as_path));
    let holder = off_worker(port, {
        let port = port.clone();
        move || {
            crate::listen::port_holder(pid, &group, number).map_err(|e| {
                Failure::new(
                    &port,
                    format!("its listener could not be looked up: {e}"),
                    vec![],
                )
            })
        }
    })
    .await?;
    let crate::listen::PortHolder::Stranger(who) = holder else {
        return Ok(());
    };
    let by = match &who {
        Some((pid, cmd)) => format!("pid {pid} ({cmd})"),
        None => "a process berth cannot see".into(),
    };
    let why = format!(
        "runtime.port_taken: port {number} answered, but its listener is held by {by}, not by the run's processes"
    );
    let mut f = Failure::new(port, why, l.tail_lines());
    f.taken = Some((number, who.map(|w| w.0)));
    Err(f)
}

/// The pids of the run's cgroup (`cgroup.procs`), if it has one.
fn group_pids(procs: Option<&Path>) -> Vec<i32> {
    procs
        .and_then(|p| std::fs::read_to_string(p).ok())
        .map(|t| t.lines().filter_map(|l| l.trim().parse().ok()).collect())
        .unwrap_or_default()
}

/// How long resolving a port's directory or starting its command may take: both touch
/// the worktree (the caller's path), so a hung file system costs the start a failure,
/// never an async worker (S1).
const WORKTREE_OP_TIMEOUT: Duration = Duration::from_secs(5);

/// Runs `f` on a blocking thread, within `WORKTREE_OP_TIMEOUT`.
async fn off_worker<T: Send + 'static>(
    port: &Port,
    f: impl FnOnce() -> Result<T, Failure> + Send + 'static,
) -> Result<T, Failure> {
    use crate::request::WorktreeOp;
    match crate::request::worktree_op(WORKTREE_OP_TIMEOUT, f).await {
        Ok(r) => r,
        Err(WorktreeOp::Panicked) => Err(Failure::new(port, "launching it panicked", vec![])),
        Err(e) => Err(Failure::new(
            port,
            format!("its worktree: {}", e.message(WORKTREE_OP_TIMEOUT)),
            vec![],
        )),
    }
}

/// P1: the launched process is the run's before anything relies on it (its check
/// made off the state task, as a client's registration is).
async fn register(s: &Start<'_>, pid: i32) -> Result<(), String> {
    let run_id = s.plan.info.view.run_id.clone();
    // berth's own launch: the caller's ownership was checked by `RuntimePlan`.
    let by = None;
    crate::daemon::register_off_task(s.daemon, s.me.clone(), run_id, (s.fence, pid), (s.uid, by))
        .await
        .map(|_| ())
        .map_err(|e| crate::error::ApiError::from(e).message)
}

/// The port's working directory: the worktree, or a directory inside it that no link
/// leads out of (C1: `cwd` never escapes the worktree).
fn launch_dir(worktree: &Path, port: &Port) -> Result<PathBuf, Failure> {
    let root = worktree
        .canonicalize()
        .map_err(|e| Failure::new(port, format!("the worktree cannot be opened: {e}"), vec![]))?;
    let Some(rel) = &port.launch.cwd else {
        return Ok(root);
    };
    let dir = root
        .join(rel)
        .canonicalize()
        .map_err(|e| Failure::new(port, format!("launch.cwd {rel:?}: {e}"), vec![]))?;
    if !dir.starts_with(&root) || !dir.is_dir() {
        return Err(Failure::new(
            port,
            format!("launch.cwd {rel:?} leads out of the worktree (through a link) or is not a directory"),
            vec![],
        ));
    }
    Ok(dir)
}

/// The run's environment, its ports, `PORT` (the convention most servers read), and
/// the port's own variables.
fn environment(s: &Start<'_>, port: &Port, number: u16) -> BTreeMap<String, String> {
    let mut env: BTreeMap<String, String> = s
        .plan
        .info
        .env
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    env.insert("PORT".into(), number.to_string());
    env.extend(port.launch.env.clone());
    env
}

fn logs_dir(plan: &RuntimePlan) -> Result<PathBuf, Failure> {
    plan.info
        .workspace
        .as_ref()
        .map(|w| Path::new(w).join("logs"))
        .ok_or_else(|| Failure {
            port: String::new(),
            why: "the run has no workspace".into(),
            log_tail: vec![],
            taken: None,
        })
}

/// How long a stopped attempt's processes get between SIGTERM and SIGKILL.
const KILL_GRACE: Duration = Duration::from_millis(500);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::ports::{Command, Probe, Ready};

    fn port_in(cwd: &str) -> Port {
        Port {
            name: "web".into(),
            launch: Command {
                command: "true".into(),
                args: vec![],
                cwd: Some(cwd.into()),
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

    /// C1: `cwd` never leaves the worktree, not even through a link the worktree holds.
    #[test]
    fn a_cwd_that_leads_out_through_a_link_is_refused() {
        let wt = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::create_dir(wt.path().join("site")).unwrap();
        std::os::unix::fs::symlink(outside.path(), wt.path().join("escape")).unwrap();
        let inside = launch_dir(wt.path(), &port_in("site")).unwrap();
        assert_eq!(inside, wt.path().canonicalize().unwrap().join("site"));
        let f = launch_dir(wt.path(), &port_in("escape")).unwrap_err();
        assert!(f.why.contains("leads out of the worktree"), "{}", f.why);
        let f = launch_dir(wt.path(), &port_in("missing")).unwrap_err();
        assert!(f.why.starts_with("launch.cwd \"missing\""), "{}", f.why);
    }
}
