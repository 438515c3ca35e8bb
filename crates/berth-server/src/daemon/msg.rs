//! The daemon's inbox: the closed enum of messages everything else sends it, each
//! carrying its reply channel, and the names of its variants (the simulator sends
//! every one).

use std::collections::BTreeMap;

use berth_core::{Command, RunState, Snapshot};
use tokio::sync::{oneshot, watch};

use super::{Error, ReapCounters, RunInfo, RuntimePlan, ScopeAnswer, ScopeOp, Tenant, ThreadOp};
use crate::auth::Grant;

pub type Reply<T> = oneshot::Sender<Result<T, Error>>;

/// `ReapStatus`'s answer: stops still running, each asked run's state (by id), and
/// the reaper's counters.
pub type ReapStates = (usize, Vec<(String, RunState)>, ReapCounters);

pub enum Msg {
    Acquire {
        req: berth_core::Request,
        worktree: Option<String>,
        labels: BTreeMap<String, String>,
        stop_grace_ms: Option<u64>,
        /// The names of the ports its contract declares (W3).
        ports: Vec<String>,
        /// The caller keeps a connection open while it waits (A9 applies).
        attach: bool,
        /// A detached waiter: it keeps its place without a connection.
        detach: bool,
        /// G0: the agent thread it works in.
        thread: Option<String>,
        /// A lease only: no workspace at its grant.
        lease_only: bool,
        /// S9: who asks; a new run is theirs, an existing one must be.
        by: Tenant,
        reply: Reply<RunInfo>,
    },
    /// Renew, release or cancel one run (S9: `by` must own it).
    Command {
        cmd: Command,
        by: Tenant,
        reply: Reply<RunInfo>,
    },
    Get {
        run_id: String,
        reply: Reply<RunInfo>,
    },
    List {
        limit: usize,
        /// Ended runs too (those still retained), not only live ones.
        ended: bool,
        reply: Reply<Vec<RunInfo>>,
    },
    Status {
        reply: Reply<(Snapshot, ReapCounters)>,
    },
    FenceCheck {
        run_id: String,
        fence: u64,
        reply: Reply<(bool, Option<RunState>)>,
    },
    /// A waiting connection went away.
    Detach {
        run_id: String,
    },
    Subscribe {
        run_id: String,
        reply: oneshot::Sender<Option<watch::Receiver<RunInfo>>>,
    },
    CreateToken {
        grant: Grant,
        reply: Reply<String>,
    },
    /// Issue 38 Build 3: this host changed the fleet's tokens or drain, and the fleet
    /// store committed it at `version`: mirrored at once, then answered.
    FleetChanged {
        change: super::fleet_shared::FleetChange,
        version: i64,
        reply: Reply<berth_client::wire::Drain>,
    },
    /// S9: the token whose id (first 16 hex digits of its hash) this is is refused from
    /// now on; the hash and grant revoked, `None` when no token has that id.
    RevokeToken {
        id: String,
        reply: Reply<Option<(String, Grant)>>,
    },
    /// P1: a process (tree) the run's client started; recorded before it is relied on.
    RegisterProcess {
        run_id: String,
        fence: u64,
        pid: i32,
        /// The user the caller acts for (S3).
        uid: u32,
        /// S9: who asks; the run must be theirs.
        by: Tenant,
        /// The rule's answer, checked off the state task against the plan of this
        /// registration generation (issue 32 finding 7); `None`, or a generation
        /// another registration has moved past, is checked here.
        checked: Option<(berth_proc::ProcId, u64)>,
        reply: Reply<RunInfo>,
    },
    /// S3, off the state task: what a registration into the run is checked against
    /// (every other live run's roots), after the owner, fence and state checks.
    RegistrationPlan {
        run_id: String,
        fence: u64,
        by: Tenant,
        reply: Reply<RegistrationPlan>,
    },
    /// A stop started for a run has finished (sent by the stopping thread).
    Stopped {
        run_id: String,
        report: berth_proc::StopReport,
    },
    /// P4 on demand: stop and clean every run that is releasing or degraded now.
    Reap {
        reply: Reply<(Vec<String>, ReapCounters)>,
    },
    /// How the runs of a reap pass are doing.
    ReapStatus {
        runs: Vec<String>,
        reply: Reply<ReapStates>,
    },
    /// C7: what starting a granted run's runtime needs (its lease, contract, group).
    RuntimePlan {
        run_id: String,
        fence: u64,
        /// S9: who asks; the run must be theirs.
        by: Tenant,
        reply: Reply<RuntimePlan>,
    },
    /// C3: every declared port answered its probe; true if that promoted the project.
    RuntimeReady {
        run_id: String,
        fence: u64,
        ports: Vec<String>,
        reply: Reply<bool>,
    },
    /// C4: the run's runtime failed to start.
    RuntimeFailed {
        run_id: String,
        fence: u64,
    },
    /// C6: an analysis run opened a listener (sent by the watcher thread).
    ListenerViolation {
        run_id: String,
        violation: crate::listen::Violation,
    },
    /// G0–G3: attach, deadline, detach, evict or show one thread.
    Thread {
        op: ThreadOp,
        /// S9: who asks; the thread (and the run a claim names) must be theirs.
        by: Tenant,
        reply: Reply<berth_client::wire::Thread>,
    },
    ThreadList {
        reply: Reply<Vec<berth_client::wire::Thread>>,
    },
    /// G4: start (`Some((by, reason))`) or end (`None`) the drain.
    Drain {
        start: Option<(String, String)>,
        reply: Reply<berth_client::wire::Drain>,
    },
    DrainGet {
        reply: Reply<berth_client::wire::Drain>,
    },
    Idle {
        reply: Reply<berth_client::wire::Idle>,
    },
    /// F1–F3: what the fleet thread reports.
    Fleet(crate::fleet::Report),
    /// B1–B6: show, reserve, release, reconcile or control one scope.
    Scope {
        op: ScopeOp,
        reply: Reply<ScopeAnswer>,
    },
    ScopeList {
        reply: Reply<Vec<berth_client::wire::ScopeSummary>>,
    },
    /// C4: the worktree's contract or commit is no longer the run's.
    ContractChanged {
        run_id: String,
        fence: u64,
        contract: berth_core::ContractInfo,
        reply: Reply<RunInfo>,
    },
}

/// Every `Msg` variant by name: `name()` is an exhaustive match (a new variant that
/// is not listed here does not compile), and `NAMES` comes from the same list, so the
/// daemon simulator can say which variants it never sent.
macro_rules! msg_names {
    ($($v:ident $pat:tt),* $(,)?) => {
        impl Msg {
            pub const NAMES: &'static [&'static str] = &[$(stringify!($v)),*];

            pub fn name(&self) -> &'static str {
                match self {
                    $(Msg::$v $pat => stringify!($v),)*
                }
            }
        }
    };
}

msg_names! {
    Acquire {..}, Command {..}, Get {..}, List {..}, Status {..}, FenceCheck {..},
    Detach {..}, Subscribe {..}, CreateToken {..}, RevokeToken {..}, FleetChanged {..},
    RegisterProcess {..}, RegistrationPlan {..}, Stopped {..}, Reap {..},
    ReapStatus {..}, RuntimePlan {..}, RuntimeReady {..}, RuntimeFailed {..},
    ListenerViolation {..}, Thread {..}, ThreadList {..}, Drain {..}, DrainGet {..},
    Idle {..}, Fleet(_), Scope {..}, ScopeList {..}, ContractChanged {..},
}

/// What a registration is checked against off the state task: every other live run's
/// registered roots, and the registration generation they are of.
pub struct RegistrationPlan {
    pub others: Vec<(String, Vec<berth_proc::ProcId>)>,
    pub generation: u64,
}
