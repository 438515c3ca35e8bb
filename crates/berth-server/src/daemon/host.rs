//! The daemon's one door to the machine. [`Daemon`](super::Daemon) decides; everything
//! it needs done to files, `/proc`, cgroups, threads, randomness or the wall clock goes
//! through [`Host`]. [`RealHost`] does it; the daemon simulator (`daemon::sim`) puts a
//! deterministic fake in its place that can fail any of it on demand.

use std::path::PathBuf;
use std::sync::Arc;

use berth_proc::ProcId;
use berth_store::WorkspaceIdentity;
use tokio::sync::mpsc;

use super::Msg;
use crate::register::{OtherRun, Refusal};
use crate::workspace;

/// A stop the daemon decided on (P2), handed over once that decision is durable.
#[derive(Clone, Debug, PartialEq)]
pub struct StopOrder {
    pub run_id: String,
    /// The run's registered process trees, by identity (P3).
    pub roots: Vec<ProcId>,
    /// The run's own grace between SIGTERM and SIGKILL, if it asked for one.
    pub grace_ms: Option<u64>,
    /// The run may have a cgroup: it registered a process (a run gets its group with
    /// its first one), or berth holds no record of it.
    pub may_have_group: bool,
}

/// Where stop orders go once their commit is durable: called on the writer's thread.
pub type StopSink = Arc<dyn Fn(StopOrder) + Send + Sync>;

pub use crate::listen::ListenWatch;

/// Everything [`Daemon`](super::Daemon) needs from the machine it runs on.
///
/// **Architecture invariant:** the daemon's state machine reaches files, `/proc`,
/// cgroups, threads, randomness and the wall clock only through this trait, and every
/// answer it gets back is a value it can be handed again in a simulation.
pub trait Host {
    /// W1: a fresh private workspace for a run that was just granted.
    /// W1/S9: `owner`, the uid of the uid-bound token that made it, owns it if it can.
    fn create_workspace(&mut self, run_id: &str, owner: Option<u32>) -> Made;
    /// W1/L5: removes a stopping run's workspace after its identity check.
    fn remove_workspace(&mut self, ws: &WorkspaceIdentity, run_id: &str) -> Result<(), String>;
    /// W1, at start: is the workspace still where the ledger says, the same directory?
    fn workspace_present(&self, ws: &WorkspaceIdentity) -> bool;
    /// W1/P5, at start: every workspace berth made that no live run or thread of the
    /// ledger owns (`owned`, by path and identity) is removed; returns their paths. A
    /// crash between making a workspace and committing the grant that records it
    /// leaves such a one, and so does a crash between a release and the pool's move of
    /// its workspace: one of `ended` (an ended run's, with its run id, returned beside
    /// its path), whose logs are archived under that run id.
    fn sweep_workspaces(&mut self, owned: &Owned, ended: &Ended) -> Vec<(String, Option<String>)>;
    /// Bytes free (to an unprivileged writer) on the file system of the workspaces, if
    /// it can be told: the threads' disk-pressure sweep reads it once a second.
    fn disk_free(&self) -> Option<u64>;
    /// Is there a cgroup for this run (a run with no record of its own)?
    fn has_group(&self, run_id: &str) -> bool;
    /// Where stop orders go; the stopper behind it reports back with `Msg::Stopped`.
    fn stop_sink(&mut self) -> StopSink;
    /// S3: may `pid` be registered to a run by a caller acting as `uid`? Its identity.
    fn check_process(&self, uid: u32, pid: i32, others: &[OtherRun<'_>]) -> Checked;
    /// W3: is something outside berth using this port (a bind test fails)?
    fn port_in_use(&self, port: u16) -> bool;
    /// Moves a registered process into the run's cgroup, where the host has them,
    /// the group held to the run's claim (issue 36) where it has controllers.
    fn adopt(&mut self, run_id: &str, pid: i32, claim: Claimed);
    /// C6: the listening sockets (by inode) the processes of these roots hold now.
    fn listeners_of(&self, roots: &[ProcId]) -> std::collections::BTreeSet<u64>;
    /// C6: every listening socket on the host now (by inode), whoever holds it.
    fn listening_now(&self) -> std::collections::BTreeSet<u64>;
    /// C6: the analysis runs to watch from now on (the whole set, replacing the last);
    /// a new listener is reported with `Msg::ListenerViolation`.
    fn watch_listeners(&mut self, watched: Vec<ListenWatch>);
    /// C7: makes the run's cgroup (where the host has them), held to its claim, and
    /// names every `cgroup.procs` a process berth launches joins before it runs
    /// anything (empty: no group).
    fn prepare_group(&mut self, run_id: &str, claim: Claimed) -> Vec<PathBuf>;
    /// Issue 36: what the run's cgroup has used so far, if it has one with controllers.
    fn usage(&self, run_id: &str) -> Option<berth_proc::limits::Usage>;
    /// Issue 36: pauses (or resumes) every process in the run's cgroup.
    fn freeze(&mut self, run_id: &str, frozen: bool) -> Result<(), String>;
    /// L1/S6: fences up to `last_fence` are covered by the durable marker.
    fn cover_fence(&mut self, last_fence: u64) -> Result<(), String>;
    /// A new API token (random).
    fn new_token(&mut self) -> Result<String, String>;
    /// Diagnostics archived and dropped so far: (bytes, dropped).
    fn diagnostics(&self) -> (u64, u64);
    /// A monotonic instant as people read it (RFC 3339).
    fn show_time(&self, mono_ms: u64) -> String;
    /// Many runs left and the daemon is quiet: the allocator may give its free memory
    /// back to the system.
    fn release_memory(&mut self);
    /// The daemon stops. `clean_last_fence` is the exact last fence after a clean stop.
    fn close(&mut self, clean_last_fence: Option<u64>);
}

/// What a run claimed that its cgroup is held to: (memory bytes, cpu millis).
pub type Claimed = (u64, u64);

/// Issue 36: whether runs' cgroups are held to their claims, and how, or why not
/// (said at start and in `GET /v1/status`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Enforcement {
    /// e.g. "cgroup v1 memory, pids, cpu"; `None`: limits are not enforced.
    pub how: Option<String>,
    /// Why not, when `how` is `None`.
    pub why_not: Option<String>,
    pub policy: berth_proc::limits::Policy,
}

/// How processes are stopped (P2) and held to their claims (issue 36).
#[derive(Clone, Debug)]
pub struct Supervision {
    /// Where run cgroups go, when the host allows them.
    pub cgroup_base: Option<PathBuf>,
    /// Where the controllers of run groups are, when berth may set limits.
    pub controllers: Option<berth_proc::cgroup::Controllers>,
    pub policy: berth_proc::limits::Policy,
    /// Between SIGTERM and SIGKILL.
    pub grace_ms: u64,
    /// How long SIGKILLed processes may take to vanish before the run degrades.
    pub kill_wait_ms: u64,
}

/// The machine itself.
pub struct RealHost {
    workspaces: workspace::Pool,
    runs_dir: std::path::PathBuf,
    /// Fences are covered by the marker before they are acknowledged (L1, S6).
    marker: crate::private::FenceMarker,
    supervision: Supervision,
    /// The daemon as the registration rule sees it (S3).
    me: crate::register::Me,
    /// S9: where the workspaces of other users' runs go (`<dir>/<uid>/<digest>`, theirs);
    /// `None` when berth cannot give a directory away (not root).
    users_dir: Option<PathBuf>,
    /// For the stopper thread to report back; weak, so it does not keep the task alive.
    inbox: Option<mpsc::WeakSender<Msg>>,
    /// The one thread that stops processes, started on first use.
    stopper: Option<StopSink>,
    /// The one thread that watches analysis runs for listeners, started on first use.
    listen_watch: Option<std::sync::mpsc::Sender<Vec<ListenWatch>>>,
}

impl RealHost {
    pub fn new(
        runs_dir: &std::path::Path,
        diagnostics: workspace::Diagnostics,
        marker: crate::private::FenceMarker,
        supervision: Supervision,
    ) -> Result<RealHost, String> {
        Ok(RealHost {
            workspaces: workspace::Pool::start(runs_dir, Some(diagnostics))
                .map_err(|e| format!("workspace pool: {e}"))?,
            runs_dir: runs_dir.to_path_buf(),
            marker,
            supervision,
            me: crate::register::Me::now(),
            users_dir: None,
            inbox: None,
            stopper: None,
            listen_watch: None,
        })
    }

    /// S9: other users' runs get workspaces of their own under `dir` (see
    /// `workspace::create_owned`).
    pub fn set_users_dir(&mut self, dir: PathBuf) {
        self.users_dir = Some(dir);
    }

    /// Gives the stopper a way to report back to the daemon.
    pub fn set_inbox(&mut self, tx: &mpsc::Sender<Msg>) {
        self.inbox = Some(tx.downgrade());
    }

    fn group(sup: &Supervision, run_id: &str) -> Option<berth_proc::cgroup::Group> {
        let name = workspace::dir_name(run_id);
        let path = sup.cgroup_base.as_ref()?.join(&name);
        path.exists()
            .then(|| berth_proc::cgroup::Group::open_with(path, &name, sup.controllers.as_ref()))
    }

    /// Makes the run's group (in every hierarchy) and holds it to `claim`; a limit
    /// that cannot be set is said, and the group is used without it.
    fn make_group(&self, run_id: &str, claim: Claimed) -> Option<berth_proc::cgroup::Group> {
        let sup = &self.supervision;
        let base = sup.cgroup_base.as_ref()?;
        let name = workspace::dir_name(run_id);
        let group = berth_proc::cgroup::Group::create_with(base, &name, sup.controllers.as_ref());
        let group = match group {
            Ok(g) => g,
            Err(e) => {
                tracing::warn!(run_id, "cgroup: {e}; the process group is the fallback");
                return None;
            }
        };
        if sup.controllers.is_some() {
            let limits = berth_proc::limits::plan(claim.0, claim.1, &sup.policy);
            if let Err(e) = group.limit(&limits) {
                tracing::warn!(
                    run_id,
                    "cgroup limits not set: {e}; the run is not held to its claim"
                );
            }
        }
        Some(group)
    }
}

impl Host for RealHost {
    fn create_workspace(&mut self, run_id: &str, owner: Option<u32>) -> Made {
        // Only root can give a directory away; otherwise the workspace is berth's.
        let me = rustix::process::geteuid().as_raw();
        match (&self.users_dir, owner) {
            (Some(dir), Some(uid)) if uid != me && me == 0 => {
                workspace::create_owned(dir, uid, crate::host::passwd_gid(uid), run_id)
            }
            _ => self.workspaces.create(run_id),
        }
        .inspect(|_| crate::failpoint::hit("workspace-made"))
        .map_err(|e| e.to_string())
    }

    fn sweep_workspaces(&mut self, owned: &Owned, ended: &Ended) -> Vec<(String, Option<String>)> {
        self.workspaces.sweep(owned, ended)
    }

    fn workspace_present(&self, ws: &WorkspaceIdentity) -> bool {
        use std::os::unix::fs::MetadataExt;
        std::fs::symlink_metadata(&ws.path)
            .is_ok_and(|m| m.is_dir() && (m.dev(), m.ino()) == (ws.dev, ws.ino))
    }

    fn remove_workspace(&mut self, ws: &WorkspaceIdentity, run_id: &str) -> Result<(), String> {
        self.workspaces
            .remove(ws, run_id)
            .map_err(|e| e.to_string())
    }

    fn has_group(&self, run_id: &str) -> bool {
        RealHost::group(&self.supervision, run_id).is_some()
    }

    fn stop_sink(&mut self) -> StopSink {
        if self.stopper.is_none() {
            let tx = spawn_stopper(&self.supervision, self.inbox.clone());
            let sup = self.supervision.clone();
            let tx = std::sync::Mutex::new(tx);
            self.stopper = Some(Arc::new(move |o: StopOrder| {
                let group = if o.may_have_group {
                    RealHost::group(&sup, &o.run_id)
                } else {
                    None
                };
                let job = berth_proc::StopJob {
                    key: o.run_id,
                    roots: o.roots,
                    group,
                    grace_ms: o.grace_ms,
                };
                let _ = tx.lock().unwrap().send(job);
            }));
        }
        self.stopper.clone().expect("set above")
    }

    fn check_process(
        &self,
        uid: u32,
        pid: i32,
        others: &[OtherRun<'_>],
    ) -> Result<ProcId, Refusal> {
        crate::register::check(&self.me, uid, pid, others)
    }

    fn port_in_use(&self, port: u16) -> bool {
        // The wildcard address: it fails if anything listens on the port at any
        // address. std sets SO_REUSEADDR, so a closed connection's TIME_WAIT does not
        // count as use.
        std::net::TcpListener::bind(("0.0.0.0", port)).is_err()
    }

    fn adopt(&mut self, run_id: &str, pid: i32, claim: Claimed) {
        if let Some(group) = self.make_group(run_id, claim) {
            if let Err(e) = group.add(pid) {
                tracing::warn!(
                    run_id,
                    pid,
                    "cgroup: {e}; the process group is the fallback"
                );
            }
        }
    }

    fn listeners_of(&self, roots: &[ProcId]) -> std::collections::BTreeSet<u64> {
        crate::listen::listeners_of(roots, &[]).unwrap_or_default()
    }

    fn listening_now(&self) -> std::collections::BTreeSet<u64> {
        berth_proc::net::listening_any()
            .map(|m| m.into_keys().collect())
            .unwrap_or_default()
    }

    fn watch_listeners(&mut self, watched: Vec<ListenWatch>) {
        if self.listen_watch.is_none() {
            let base = self.supervision.cgroup_base.clone();
            self.listen_watch = Some(crate::listen::spawn_watcher(
                base,
                self.inbox.clone().map(|w| {
                    crate::tell::Tell::to(w, |(run_id, violation)| Msg::ListenerViolation {
                        run_id,
                        violation,
                    })
                }),
            ));
        }
        if let Some(tx) = &self.listen_watch {
            let _ = tx.send(watched);
        }
    }

    fn prepare_group(&mut self, run_id: &str, claim: Claimed) -> Vec<PathBuf> {
        self.make_group(run_id, claim)
            .map(|g| g.procs_files())
            .unwrap_or_default()
    }

    fn usage(&self, run_id: &str) -> Option<berth_proc::limits::Usage> {
        RealHost::group(&self.supervision, run_id)?.usage()
    }

    fn freeze(&mut self, run_id: &str, frozen: bool) -> Result<(), String> {
        let group = RealHost::group(&self.supervision, run_id).ok_or("the run has no cgroup")?;
        group.freeze(frozen).map_err(|e| e.to_string())
    }

    fn cover_fence(&mut self, last_fence: u64) -> Result<(), String> {
        self.marker
            .cover(last_fence)
            .map_err(|e| format!("fence marker: {e:#}"))
    }

    fn new_token(&mut self) -> Result<String, String> {
        crate::auth::new_token().map_err(|e| format!("token: {e}"))
    }

    fn diagnostics(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        let d = &self.workspaces.diagnostics;
        (d.bytes.load(Relaxed), d.dropped.load(Relaxed))
    }

    fn show_time(&self, mono_ms: u64) -> String {
        crate::clock::mono_to_rfc3339(mono_ms)
    }

    fn release_memory(&mut self) {
        crate::memory::release();
    }

    fn disk_free(&self) -> Option<u64> {
        crate::host::disk_free(&self.runs_dir)
    }

    fn close(&mut self, clean_last_fence: Option<u64>) {
        // A clean stop leaves the exact last fence as the marker: the next start
        // continues at +1 instead of skipping the rest of the reserved block.
        if let Some(last) = clean_last_fence {
            if let Err(e) = self.marker.write(last) {
                tracing::warn!("fence marker: {e:#}");
            }
        }
        // This daemon's cgroup namespace goes when no run group is left in it (groups
        // of live runs stay for the next start to re-adopt; rmdir refuses then).
        if let Some(base) = &self.supervision.cgroup_base {
            let _ = std::fs::remove_dir(base);
        }
        if let Some(c) = &self.supervision.controllers {
            c.remove_bases();
        }
    }
}

/// The stopper thread: takes stop jobs, runs rounds while any are active (one `/proc`
/// scan per round for all of them), reports each finished stop to the daemon.
fn spawn_stopper(
    sup: &Supervision,
    inbox: Option<mpsc::WeakSender<Msg>>,
) -> std::sync::mpsc::Sender<berth_proc::StopJob> {
    let (tx, rx) = std::sync::mpsc::channel::<berth_proc::StopJob>();
    let (grace, kill_wait) = (sup.grace_ms, sup.kill_wait_ms);
    std::thread::Builder::new()
        .name("berth-stopper".into())
        .spawn(move || {
            let mut stopper = berth_proc::Stopper::new(grace, kill_wait);
            loop {
                if stopper.is_empty() {
                    match rx.recv() {
                        Ok(job) => stopper.add(job),
                        Err(_) => return,
                    }
                }
                while let Ok(job) = rx.try_recv() {
                    stopper.add(job);
                }
                let finished = stopper.round();
                if !stopper.is_empty() {
                    crate::failpoint::hit("mid-stop");
                }
                for (run_id, report) in finished {
                    if let Some(tx) = inbox.as_ref().and_then(|w| w.upgrade()) {
                        let _ = tx.blocking_send(Msg::Stopped { run_id, report });
                    }
                }
                std::thread::sleep(std::time::Duration::from_millis(berth_proc::STOP_ROUND_MS));
            }
        })
        .expect("spawn stopper thread");
    tx
}

/// Workspaces the ledger gives an owner, as (path, device, inode).
pub type Owned = std::collections::BTreeSet<(String, u64, u64)>;
/// Ended runs' workspaces by (path, device, inode), and the run each was (W1/P4).
pub type Ended = std::collections::BTreeMap<(String, u64, u64), String>;

/// A workspace made, or why not.
pub type Made = Result<WorkspaceIdentity, String>;

/// A process the registration rule allows (its identity), or why not.
pub type Checked = Result<ProcId, Refusal>;
