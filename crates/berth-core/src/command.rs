//! The closed set of inputs the engine accepts and the values it returns.

use std::fmt;

use crate::types::{
    fmt_bytes, EndCause, Evidence, Fence, KeyMode, Request, RunState, RunView, TimeMs,
};

/// What the host said of itself at one sampling, taken as one: admission decides on
/// every figure of a sample together, never on half of one (a sample whose memory
/// pressure rose while MemAvailable rose must not grant between the two). A figure
/// not read (or not readable) is `None` and leaves the engine's last one standing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostSample {
    /// MemAvailable, bytes (A10): stabilised before it counts.
    pub mem_available: Option<u64>,
    /// Issue 36: PSI `some avg10` of memory, cpu and io (by `PressureKind`), in
    /// hundredths of a percent: above the configured figures, waiters are held back.
    pub pressure_bp: [Option<u32>; 3],
    /// Issue 36: free space (to an unprivileged writer) on the workspaces' file
    /// system, bytes: a disk claim must fit in it, less the disk reserve and the
    /// claims of runs whose use is still pending.
    pub disk_free: Option<u64>,
}

impl HostSample {
    /// A sample of MemAvailable alone.
    pub fn memory(mem_available: u64) -> HostSample {
        HostSample {
            mem_available: Some(mem_available),
            ..HostSample::default()
        }
    }

    /// A sample of one pressure figure alone.
    pub fn pressure(kind: PressureKind, bp: u32) -> HostSample {
        let mut s = HostSample::default();
        s.pressure_bp[kind.index()] = Some(bp);
        s
    }

    /// A sample of the free disk alone.
    pub fn disk(free: u64) -> HostSample {
        HostSample {
            disk_free: Some(free),
            ..HostSample::default()
        }
    }
}

/// Issue 36: what a pressure figure (PSI) is of.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PressureKind {
    Memory,
    Cpu,
    Io,
}

impl PressureKind {
    pub const ALL: [PressureKind; 3] = [PressureKind::Memory, PressureKind::Cpu, PressureKind::Io];

    pub fn as_str(self) -> &'static str {
        match self {
            PressureKind::Memory => "memory",
            PressureKind::Cpu => "cpu",
            PressureKind::Io => "io",
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

/// Every way the outside world can change the engine's state. One task owns the engine
/// and feeds it these, one at a time, each with the current monotonic time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// Queue a run (or re-attach to it, L7) and grant what fits.
    Acquire(Request),
    /// F1: an acquire whose fleet-wide claim is already held (`fence` from the fleet's
    /// sequence): a `wait_s = 0` run on a fleet host, tried at its arrival like any other.
    AcquirePermitted { req: Request, fence: Fence },
    /// A queued run leaves the queue (A9). Granted runs are released, not cancelled.
    Cancel { run_id: String },
    /// L4: extends a lease, or a queued run's deadline (no fence then).
    Renew {
        run_id: String,
        fence: Option<Fence>,
        ttl_ms: Option<u64>,
    },
    /// L5: starts stopping a granted run. Idempotent for the same fence.
    Release { run_id: String, fence: Fence },
    /// The caller finished stopping a releasing or degraded run's processes.
    /// `ok: false` leaves it degraded with its capacity still counted (L3).
    StopDone { run_id: String, ok: bool },
    /// Time passed: deadlines (A8), lease expiry (L6), re-evaluation (A10).
    Tick,
    /// G4: the host starts (`on`) or ends a drain. While it drains, waiters stay
    /// queued with reason `host.draining` and nothing is granted.
    Drain { on: bool },
    /// What the host said of itself at one sampling (A10, issue 36), taken whole.
    Sample(HostSample),
    /// Issue 36: the run's process tree has started and its memory was sampled, so
    /// MemAvailable (and the free disk) show its use from now on: its claim stops
    /// being pending before `pending_settle_ms` is up. Ignored for any other fence.
    Settle { run_id: String, fence: Fence },
    /// C3: the run launched every declared port and each answered its probe.
    Promote {
        run_id: String,
        fence: Fence,
        ports: Vec<String>,
    },
    /// C4: the run's runtime failed to start. If it held the runtime key on the
    /// project's evidence (shared), that evidence is no longer trusted.
    RuntimeFailed { run_id: String, fence: Fence },
    /// C4: the run's contract or commit changed under it.
    Demote {
        run_id: String,
        fence: Fence,
        fingerprint: String,
        commit: Option<String>,
    },
    /// B2: a turn inside a run reserves a token of `harness`, keyed by (owner,
    /// operation id): a retry gets the same one. Never queues: a full harness refuses.
    Reserve {
        scope: String,
        owner: String,
        operation_id: String,
        harness: String,
    },
    /// B3: the owner gives a reservation's token back.
    Unreserve {
        scope: String,
        owner: String,
        operation_id: String,
    },
    /// B3: an operator frees every token `owner` holds in the scope.
    Reconcile { scope: String, owner: String },
    /// B4: pause, stop or resume a scope, idempotent by request id.
    ScopeControl {
        scope: String,
        request_id: String,
        mode: crate::scopes::Mode,
    },
    /// S10: an operator forgets an idle scope (refused while anything holds it).
    DeleteScope { scope: String },
    /// B4 fleet-wide (issue 38 Build 3): a control the fleet store decided. The scope
    /// takes it if it is newer than its generation; a scope not used here yet takes it
    /// when it is.
    FleetControl {
        scope: String,
        receipt: crate::scopes::Receipt,
    },
    /// C3/C4 fleet-wide (issue 38 Build 3): a project's promotion evidence as the fleet
    /// holds it. Valid: the project takes it unless it has it already (its queued
    /// foreground runs with that contract become shared claimants, as at a promotion
    /// here). Not valid: the project drops it if it is the evidence it holds.
    FleetEvidence {
        project: String,
        evidence: Evidence,
        valid: bool,
    },
    /// F1: the fleet store holds this queued run's fleet-wide claim; `fence` is the one
    /// the fleet's sequence gave it, and the run's grant will carry it.
    Permit { run_id: String, fence: Fence },
}

/// Refusals. Each is a value with a stable code; none changes state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Error {
    Invalid {
        field: &'static str,
        rule: String,
    },
    NotFound {
        run_id: String,
    },
    StaleFence {
        run_id: String,
        given: Option<Fence>,
        current: Option<Fence>,
    },
    /// A call on a run that holds (or held, while it ends) a fence, without it: names
    /// the run's state, so a releasing run is not said to be granted.
    FenceRequired {
        run_id: String,
        state: RunState,
    },
    Gone {
        run_id: String,
        state: RunState,
    },
    Conflict {
        run_id: String,
    },
    CapacityImpossible {
        resource: String,
        request: u64,
        max: u64,
    },
    QueueFull {
        max: usize,
    },
    ContractDisabled {
        project: String,
    },
    NotEligible {
        run_id: String,
        why: String,
    },
    /// B1–B5: the budget rules said no. Boxed: its conflicts carry both policies, and
    /// every `Result` the engine returns would otherwise be that large.
    Scope(Box<crate::scopes::ScopeError>),
}

impl From<crate::scopes::ScopeError> for Error {
    fn from(e: crate::scopes::ScopeError) -> Error {
        Error::Scope(Box::new(e))
    }
}

impl Error {
    /// The stable snake_case code (docs/contract.md lists them).
    pub fn code(&self) -> &'static str {
        match self {
            Error::Invalid { .. } => "invalid",
            Error::NotFound { .. } => "not_found",
            Error::StaleFence { .. } => "stale_fence",
            Error::FenceRequired { .. } => "fence_required",
            Error::Gone { .. } => "gone",
            Error::Conflict { .. } => "conflict",
            Error::CapacityImpossible { .. } => "capacity_impossible",
            Error::QueueFull { .. } => "queue_full",
            Error::ContractDisabled { .. } => "contract_disabled",
            Error::NotEligible { .. } => "not_eligible",
            Error::Scope(e) => e.code(),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Invalid { field, rule } => write!(f, "{field}: {rule}"),
            Error::NotFound { run_id } => write!(f, "run {run_id} is not known"),
            Error::StaleFence {
                run_id,
                given,
                current,
            } => {
                let show = |x: &Option<Fence>| x.map_or("none".to_string(), |v| v.to_string());
                write!(
                    f,
                    "fence {} is not the current fence of run {run_id} (current: {})",
                    show(given),
                    show(current)
                )
            }
            Error::FenceRequired { run_id, state } => write!(
                f,
                "fence: run {run_id} is {}; the call must carry its fence",
                state.as_str()
            ),
            Error::Gone { run_id, state } => write!(
                f,
                "run {run_id} is {}: its lease is over and cannot be acted on",
                state.as_str()
            ),
            Error::Conflict { run_id } => write!(
                f,
                "run {run_id} exists with a different request; use a new run_id"
            ),
            Error::CapacityImpossible {
                resource,
                request,
                max,
            } => {
                let (r, m) = if resource == "memory" || resource == "disk" {
                    (fmt_bytes(*request), fmt_bytes(*max))
                } else {
                    (request.to_string(), max.to_string())
                };
                write!(
                    f,
                    "{resource}: requests {r} but this host can never allocate more than {m}"
                )
            }
            Error::QueueFull { max } => write!(f, "the queue holds its maximum of {max} waiters"),
            Error::ContractDisabled { project } => write!(
                f,
                "project {project}'s .berth.toml says concurrency = \"disabled\": host runs are refused"
            ),
            Error::NotEligible { run_id, why } => write!(f, "run {run_id}: {why}"),
            Error::Scope(e) => write!(f, "{e}"),
        }
    }
}

/// Something that changed. The caller persists these (before acknowledging) and acts on
/// the ones that ask for action (`StopRequested`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// F1: this waiter could be granted but for its fleet-wide claim: the caller takes
    /// it from the fleet store and answers with `Command::Permit` (asked once per run;
    /// while the claim is refused the caller retries on its own wake-ups). Asked again
    /// for a run whose permit went stale (its fence is not above the host's last): the
    /// caller keeps the claim and gives it a new fence.
    PermitWanted {
        run_id: String,
    },
    /// F1 and A1 (issue 38 item 6): this waiter holds a permit but is held back for the
    /// head by the starvation guard: the caller gives its fleet-wide claim back, so the
    /// keys it holds fleet-wide are never held by a run the engine will not grant (the
    /// head may need them: it could never get them, nor the waiter its grant). The
    /// engine asks again (`PermitWanted`) once the waiter may be granted.
    PermitReturned {
        run_id: String,
    },
    Queued {
        run_id: String,
        position: u64,
    },
    Granted {
        run_id: String,
        fence: Fence,
        expires_at_ms: TimeMs,
        keys: Vec<(String, KeyMode)>,
    },
    Renewed {
        run_id: String,
        expires_at_ms: TimeMs,
    },
    QueueDeadlineExtended {
        run_id: String,
        deadline_ms: TimeMs,
    },
    /// Action: stop the run's processes, then send `StopDone`.
    StopRequested {
        run_id: String,
        cause: EndCause,
    },
    /// G4: admission's drain turned on or off (asking for the state it is in already
    /// changes nothing and makes no event).
    DrainChanged {
        on: bool,
    },
    Degraded {
        run_id: String,
    },
    /// A terminal state; any claim the run held is free again.
    Ended {
        run_id: String,
        state: RunState,
    },
    Promoted {
        project: String,
        evidence: Evidence,
    },
    EvidenceInvalidated {
        project: String,
        by_run: String,
        /// The evidence dropped (a fleet host tells the fleet which, C4 fleet-wide).
        evidence: Evidence,
    },
    KeyModeChanged {
        run_id: String,
        key: String,
        mode: KeyMode,
    },
    UpgradeQueued {
        run_id: String,
        key: String,
    },
    UpgradeGranted {
        run_id: String,
        key: String,
    },
    MemoryStabilized {
        available: u64,
    },
    /// Issue 36: the host's memory, cpu or io pressure changed (hundredths of a percent).
    PressureChanged {
        kind: PressureKind,
        bp: u32,
    },
    /// Issue 36: the workspaces' free disk space changed (bytes, as sampled).
    DiskFreeChanged {
        bytes: u64,
    },
    /// A2 / issue 36: the run's memory and disk claims stopped being pending (its tree
    /// was seen started, or the settle window passed).
    Settled {
        run_id: String,
    },
    /// B1: a scope's policy (and manifest) was frozen by its first admission.
    ScopeFrozen {
        scope: String,
    },
    /// S10: an idle scope was forgotten, past its idle window or by an operator's
    /// delete; the next run naming it freezes a new policy.
    ScopeForgotten {
        scope: String,
        by_operator: bool,
    },
    /// B2: a token was taken (a run's claim, `run_id` set, or a turn's reservation).
    TokenTaken {
        scope: String,
        owner: String,
        operation: String,
        harness: String,
        run_id: Option<String>,
    },
    /// B3: a token came back, by its owner's release or an operator's reconciliation.
    TokenFreed {
        scope: String,
        owner: String,
        operation: String,
        harness: String,
        reconciled: bool,
    },
    /// B3: the token's owner lapsed; the token stays held.
    TokenLapsed {
        scope: String,
        owner: String,
        operation: String,
    },
    /// B4: an accepted control request (a retry of one makes no event).
    ScopeControlled {
        scope: String,
        receipt: crate::scopes::Receipt,
    },
}

impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Event::PermitWanted { run_id } => write!(f, "permit? {run_id}"),
            Event::PermitReturned { run_id } => write!(f, "permit back {run_id}"),
            Event::Queued { run_id, position } => write!(f, "queued {run_id} pos={position}"),
            Event::Granted {
                run_id,
                fence,
                expires_at_ms,
                keys,
            } => {
                write!(f, "granted {run_id} fence={fence} expires={expires_at_ms}")?;
                for (k, m) in keys {
                    write!(f, " {k}={}", m.as_str())?;
                }
                Ok(())
            }
            Event::Renewed {
                run_id,
                expires_at_ms,
            } => write!(f, "renewed {run_id} expires={expires_at_ms}"),
            Event::QueueDeadlineExtended {
                run_id,
                deadline_ms,
            } => write!(f, "deadline {run_id} at={deadline_ms}"),
            Event::StopRequested { run_id, cause } => write!(f, "stop {run_id} cause={cause:?}"),
            Event::Degraded { run_id } => write!(f, "degraded {run_id}"),
            Event::DrainChanged { on } => write!(f, "drain {}", if *on { "on" } else { "off" }),
            Event::Ended { run_id, state } => write!(f, "ended {run_id} {}", state.as_str()),
            Event::Promoted { project, evidence } => write!(
                f,
                "promoted {project} by={} ports={}",
                evidence.run_id,
                evidence.ports.join(",")
            ),
            Event::EvidenceInvalidated {
                project, by_run, ..
            } => {
                write!(f, "evidence-invalidated {project} by={by_run}")
            }
            Event::KeyModeChanged { run_id, key, mode } => {
                write!(f, "key-mode {run_id} {key}={}", mode.as_str())
            }
            Event::UpgradeQueued { run_id, key } => write!(f, "upgrade-queued {run_id} {key}"),
            Event::UpgradeGranted { run_id, key } => write!(f, "upgrade-granted {run_id} {key}"),
            Event::MemoryStabilized { available } => {
                write!(f, "memory-stabilized {}", fmt_bytes(*available))
            }
            Event::PressureChanged { kind, bp } => {
                write!(f, "{}-pressure {}", kind.as_str(), crate::fmt_bp(*bp))
            }
            Event::DiskFreeChanged { bytes } => write!(f, "disk-free {}", fmt_bytes(*bytes)),
            Event::Settled { run_id } => write!(f, "settled {run_id}"),
            Event::ScopeFrozen { .. }
            | Event::ScopeForgotten { .. }
            | Event::TokenTaken { .. }
            | Event::TokenFreed { .. }
            | Event::TokenLapsed { .. }
            | Event::ScopeControlled { .. } => self.fmt_budget(f),
        }
    }
}

impl Event {
    /// B1–B5's events (the caller, `fmt`, sends only those).
    fn fmt_budget(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Event::ScopeFrozen { scope } => write!(f, "scope-frozen {scope}"),
            Event::ScopeForgotten { scope, by_operator } => {
                let by = if *by_operator { "operator" } else { "idle" };
                write!(f, "scope-forgotten {scope} by={by}")
            }
            Event::TokenTaken {
                scope,
                owner,
                operation,
                harness,
                ..
            } => write!(f, "token-taken {scope} {owner}/{operation} {harness}"),
            Event::TokenFreed {
                scope,
                owner,
                operation,
                harness,
                reconciled,
            } => write!(
                f,
                "token-freed {scope} {owner}/{operation} {harness}{}",
                if *reconciled { " reconciled" } else { "" }
            ),
            Event::TokenLapsed {
                scope,
                owner,
                operation,
            } => write!(f, "token-lapsed {scope} {owner}/{operation}"),
            Event::ScopeControlled { scope, receipt } => write!(
                f,
                "scope-control {scope} {} gen={}",
                receipt.mode.as_str(),
                receipt.generation
            ),
            _ => Ok(()),
        }
    }
}

/// What one command produced: the changes, in order, and the answer to the caller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Output {
    pub events: Vec<Event>,
    pub result: Result<Option<RunView>, Error>,
}
