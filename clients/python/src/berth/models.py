"""berth's API v1 models: generated from docs/openapi.json by
scripts/generate_models.py. Do not edit; run the script again.

Each object schema is a dataclass (`Run.from_dict(answer)`, `run.to_dict()`); a
required property is a field without a default, a nullable one is `Optional`, an
enum is a `Literal`, and a oneOf of objects is a `Union` of one dataclass per
variant, told apart by its discriminator (`event`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional, Union

from ._model import Model

__all__ = [
    "AcquireEvent",
    "AcquireEventExpired",
    "AcquireEventGranted",
    "AcquireEventQueued",
    "AcquireEventRejected",
    "AcquireRequest",
    "BudgetClaim",
    "Busy",
    "Claim",
    "ControlReceipt",
    "ControlRequest",
    "Drain",
    "DrainRecord",
    "DrainRequest",
    "ErrorBody",
    "ErrorDetail",
    "Evidence",
    "FenceCheck",
    "Fleet",
    "FleetDrainRecord",
    "FleetHost",
    "FleetLoad",
    "FleetResource",
    "HarnessFigures",
    "Idle",
    "JournalBudgetToken",
    "JournalDegraded",
    "JournalDrain",
    "JournalEmpty",
    "JournalEnded",
    "JournalEntry",
    "JournalFence",
    "JournalFleetDrain",
    "JournalGranted",
    "JournalKey",
    "JournalKeyName",
    "JournalManifest",
    "JournalOom",
    "JournalPid",
    "JournalPids",
    "JournalPromoted",
    "JournalQueued",
    "JournalReaped",
    "JournalReason",
    "JournalRefused",
    "JournalRenewed",
    "JournalScopeControl",
    "JournalScopeForgotten",
    "JournalScopeFrozen",
    "JournalScopeReconciled",
    "JournalThreadAttached",
    "JournalThreadDeadline",
    "JournalThreadDetached",
    "JournalThreadEviction",
    "JournalThreadWorkspace",
    "JournalToken",
    "JournalWaitExtended",
    "Key",
    "LedgerStatus",
    "LimitsStatus",
    "ProcessRequest",
    "ProjectStatus",
    "Queued",
    "ReapReport",
    "ReaperStatus",
    "Reason",
    "ReconcileRequest",
    "Reconciled",
    "ReleaseRequest",
    "RenewRequest",
    "Reservation",
    "ReservationRequest",
    "ResourceStatus",
    "Run",
    "RunLimits",
    "RunList",
    "RunUsage",
    "RuntimeEvent",
    "RuntimeEventBuilding",
    "RuntimeEventDone",
    "RuntimeEventFailed",
    "RuntimeEventLaunched",
    "RuntimeEventReady",
    "RuntimeRequest",
    "RuntimeStarted",
    "Scope",
    "ScopeList",
    "ScopeManifest",
    "ScopeSummary",
    "ScopeToken",
    "ScopeWaiter",
    "Status",
    "StreamCutoff",
    "Thread",
    "ThreadClaim",
    "ThreadEviction",
    "ThreadList",
    "ThreadOwner",
    "ThreadRegistration",
    "TokenCreated",
    "TokenInfo",
    "TokenList",
    "TokenRequest",
]


@dataclass
class AcquireEventQueued(Model):
    """The run waits; sent whenever its position or reason changes."""

    run_id: str
    position: Optional[int]
    reason: Optional[Reason]
    event: Literal["queued"]


@dataclass
class AcquireEventGranted(Model):
    """AcquireEvent with `event: "granted"`."""

    lease: Run
    event: Literal["granted"]


@dataclass
class AcquireEventExpired(Model):
    """Its wait ran out."""

    error: ErrorDetail
    event: Literal["expired"]


@dataclass
class AcquireEventRejected(Model):
    """It ended without a grant for any other reason."""

    error: ErrorDetail
    event: Literal["rejected"]


#: One line of a streamed acquire (`Accept: application/x-ndjson`).
AcquireEvent = Union[
    AcquireEventQueued,
    AcquireEventGranted,
    AcquireEventExpired,
    AcquireEventRejected,
]


@dataclass
class AcquireRequest(Model):
    """`POST /v1/runs`: ask for a berth."""

    project: str
    #: A retry with the same id re-attaches to the same run (L7); default: a new id.
    run_id: Optional[str] = None
    class_: Optional[Literal["managed", "analysis"]] = field(default=None, metadata={"json": "class"})
    priority: Optional[Literal["foreground", "background"]] = None
    #: `slots`, `memory`, `cpu_millis`, `disk` and named resources (A13).
    resources: Optional[Dict[str, int]] = None
    singletons: Optional[List[str]] = None
    #: B1/B2: the experiment budget whose harness token is part of this run's claim.
    budget: Optional[BudgetClaim] = None
    worktree: Optional[str] = None
    ttl_s: Optional[int] = None
    wait_s: Optional[int] = None
    labels: Optional[Dict[str, str]] = None
    #: Grace between SIGTERM and SIGKILL when this run is stopped (P2).
    stop_grace_s: Optional[int] = None
    #: `true`: answer `202` at once with the queued run instead of holding the
    #: connection. The run keeps its place until its `wait_s` deadline without one (A9
    #: does not apply to it); follow it with `GET /v1/runs/{id}?wait_s=N` or
    #: `GET /v1/events?run=ID`, cancel it with `DELETE /v1/runs/{id}`.
    detach: Optional[bool] = None
    #: G0: the agent thread this run works in (the id rule): `BERTH_WORKSPACE` is the
    #: thread's persistent workspace (made at the grant if it has none), while `tmp`,
    #: `out` and the logs stay the run's own. While the run lives, the thread is not
    #: evicted.
    thread: Optional[str] = None
    #: `false`: a lease only, for an orchestrator that needs the fence and not a place
    #: to work: no workspace is made at the grant (the answer has no `workspace`, the
    #: run's environment no `BERTH_WORKSPACE`), so a lifecycle costs less. Not with
    #: `thread`. Default `true`.
    workspace: Optional[bool] = None


@dataclass
class BudgetClaim(Model):
    """B1/B2: a run's budget. `per_harness` (limits 1 to 1024 per canonical harness name,
    `[a-z][a-z0-9_-]*`) is required the first time `scope` is used and must equal the
    frozen policy whenever it is given; so must `manifest`. The run's token is reserved
    under (its run id, `operation_id`, default `run`).
    """

    scope: str
    harness: str
    per_harness: Optional[Dict[str, int]] = None
    operation_id: Optional[str] = None
    manifest: Optional[ScopeManifest] = None


@dataclass
class Busy(Model):
    """Something in flight: a live run or a live registration, and until when."""

    #: `run` or `registration`.
    kind: str
    #: The run id, or the thread key.
    id: str
    #: The lease's expiry, or the registration's `live_until`.
    until: Optional[str] = None
    #: A registration's owner.
    owner: Optional[ThreadOwner] = None


@dataclass
class Claim(Model):
    """What a run claims: its resources (built-in and named, by name) and keys."""

    keys: List[Key]
    resources: Dict[str, int]


@dataclass
class ControlReceipt(Model):
    """B4: an accepted control request (the same for its retries)."""

    scope: str
    request_id: str
    mode: str
    #: The scope's generation this request made.
    generation: int
    #: `open`, `paused` or `stopped`: the state it left the scope in.
    control: str
    at: str


@dataclass
class ControlRequest(Model):
    """`POST /v1/scopes/{id}/control`: `mode` is `pause`, `stop` or `resume`; the same
    `request_id` (1 to 256 characters) again returns the same receipt.
    """

    request_id: str
    mode: str


@dataclass
class Drain(Model):
    """`GET /v1/drain`: the drains in force (the host's own, the fleet's) and what they
    wait for. `draining` is true while either is.
    """

    draining: bool
    #: The fleet's drain (fleet mode), as this host last read it.
    fleet_drain: Optional[FleetDrainRecord]
    waiting_for: List[Busy]
    drain: Optional[DrainRecord] = None


@dataclass
class DrainRecord(Model):
    """Who started a drain, when and why (G4)."""

    by: str
    at: str
    reason: str


@dataclass
class DrainRequest(Model):
    """`POST /v1/drain`."""

    reason: Optional[str] = None


@dataclass
class ErrorBody(Model):
    """Every refusal: `{"error": {"code", "message", "details"}}` with a stable code."""

    error: ErrorDetail


@dataclass
class ErrorDetail(Model):
    """The ErrorDetail schema."""

    code: str
    message: str
    #: Any JSON value (`{fence, current_fence}` for `stale_fence`, ...); absent reads as null.
    details: Any = None


@dataclass
class Evidence(Model):
    """Promotion evidence a project's parallel runs rest on (D1)."""

    fingerprint: str
    commit: Optional[str]
    ports: List[str]
    run_id: str
    #: RFC 3339: when the project was promoted.
    at: str


@dataclass
class FenceCheck(Model):
    """`GET /v1/fences/check?run_id=…&fence=…`."""

    run_id: str
    fence: int
    #: The fence is the run's and the run holds its lease.
    current: bool
    state: Optional[Literal["queued", "granted", "releasing", "released", "expired", "cancelled", "rejected", "degraded"]] = None
    #: Fleet mode: the host that holds a run this host does not (its fence is current
    #: while that host is alive and the run holds its claim; a dead host's fences are
    #: refused everywhere).
    host: Optional[str] = None


@dataclass
class Fleet(Model):
    """`GET /v1/fleet`: every live host with its capacity, the fleet-wide sums of the live
    hosts, and the dead hosts (F4).
    """

    #: The host that answered.
    host_id: str
    hosts: List[FleetHost]
    totals: Dict[str, FleetResource]
    queue_depth: int
    dead: List[FleetHost]


@dataclass
class FleetDrainRecord(Model):
    """A drain every host of the fleet honours: who started it, when, why, and on which
    host.
    """

    by: str
    at: str
    reason: str
    host: str


@dataclass
class FleetHost(Model):
    """A host of the fleet as its last heartbeat described it (F4)."""

    host_id: str
    #: Its registration's generation (a new one after each restart or death).
    generation: int
    address: str
    version: str
    #: Milliseconds since its last heartbeat, by the fleet store's clock.
    heartbeat_age_ms: int
    queue_depth: int
    granted: int
    resources: Dict[str, FleetResource]
    #: A dead host: the live host that declared it.
    declared_by: Optional[str] = None


@dataclass
class FleetLoad(Model):
    """What a host's heartbeat writes of its load (F4), and `GET /v1/fleet` reads back
    for each host. A field a peer left out (an older or hostile one) reads as zero.
    """

    granted: Optional[int] = None
    queue_depth: Optional[int] = None
    resources: Optional[Dict[str, FleetResource]] = None


@dataclass
class FleetResource(Model):
    """One resource summed over a host (or the fleet): what it has, what is granted and
    what is free now (F4).
    """

    total: int
    committed: int
    available: int


@dataclass
class HarnessFigures(Model):
    """Per harness: its limit, the tokens held now, and how many of those are held for an
    owner whose lease lapsed (B3).
    """

    limit: int
    held: int
    lapsed: int


@dataclass
class Idle(Model):
    """`GET /v1/idle`: whether the host may be taken away now."""

    idle: bool
    busy: List[Busy]


@dataclass
class JournalBudgetToken(Model):
    """`budget_token_taken`, `budget_token_freed` (with `by`: `owner` or `operator`) and
    `budget_token_lapsed` (without a harness): one budget token (B3).
    """

    operation_id: str
    owner: str
    scope: str
    by: Optional[str] = None
    harness: Optional[str] = None


@dataclass
class JournalDegraded(Model):
    """`degraded`: the processes that survived its stop, if it had any."""

    survivors: Optional[List[int]] = None


@dataclass
class JournalDrain(Model):
    """`drain_started` (G4): who started the drain, when and why."""

    at: str
    by: str
    reason: str


@dataclass
class JournalEmpty(Model):
    """A kind with no fields of its own: `evidence_invalidated`, `drain_ended`."""



@dataclass
class JournalEnded(Model):
    """`ended`: the final state, and the failure if there was one."""

    state: str
    failure: Optional[str] = None


@dataclass
class JournalEntry(Model):
    """One journal entry (D5): a line of `GET /v1/journal` and of its export, and the data
    of each event of `GET /v1/events`. Every state change berth makes is one entry,
    written in the same transaction as the change; `seq` has no gaps.
    """

    seq: int
    #: RFC 3339: when berth made the change.
    at: str
    #: What happened: `queued`, `granted`, `renewed`, `released`, `expired`,
    #: `stop_started`, `survivors`, `degraded`, `reaped`, `ended`, `refused`,
    #: `token_created`, `process_registered`, `promoted`, ... (every kind, with the
    #: schema of its `data`, is in `x-berth-journal-kinds`).
    kind: str
    #: The change's own fields (they depend on `kind`): always an object.
    data: Dict[str, Any]
    run_id: Optional[str] = None
    project: Optional[str] = None


@dataclass
class JournalFence(Model):
    """`released` and `expired`: the fence the run held."""

    fence: Optional[int] = None


@dataclass
class JournalFleetDrain(Model):
    """`fleet_drain_started` (issue 38 Build 3): the fleet's drain, as this host learnt
    it: who started it, when, on which host and why.
    """

    at: str
    by: str
    host: str
    reason: str


@dataclass
class JournalGranted(Model):
    """`granted`: the fence, when the lease expires, the keys it holds."""

    expires_at: str
    fence: int
    keys: List[JournalKey]


@dataclass
class JournalKey(Model):
    """A key and its mode (`exclusive` or `shared`): a granted run's, or
    `key_mode_changed`'s.
    """

    key: str
    mode: str


@dataclass
class JournalKeyName(Model):
    """`upgrade_queued` and `upgrade_granted` (C4): the key."""

    key: str


@dataclass
class JournalManifest(Model):
    """A frozen manifest (B1), its fields in alphabetical order as every journal object's."""

    execution_ids: List[str]
    path: str
    sha256: str


@dataclass
class JournalOom(Model):
    """`oom_killed` (issue 36): the kernel's OOM killer killed inside the run's cgroup;
    its peak against its claim.
    """

    memory_claim_bytes: int
    oom_kills: int
    memory_peak_bytes: Optional[int] = None


@dataclass
class JournalPid(Model):
    """`process_registered` (P1): the process's pid."""

    pid: int


@dataclass
class JournalPids(Model):
    """`stop_started` (the processes being stopped) and `survivors` (those a stop left)."""

    pids: List[int]


@dataclass
class JournalPromoted(Model):
    """`promoted`: the evidence that made the project's runs parallel (C3)."""

    fingerprint: str
    ports: List[str]
    commit: Optional[str] = None


@dataclass
class JournalQueued(Model):
    """`queued`: the waiter's position and why it waits."""

    position: int
    reason: Optional[JournalReason] = None


@dataclass
class JournalReaped(Model):
    """`reaped` (P4): the run's state when the reaper took it."""

    state: Optional[str] = None


@dataclass
class JournalReason(Model):
    """Why a waiter waits: a reason's stable code and its message."""

    code: str
    message: str


@dataclass
class JournalRefused(Model):
    """`refused`: the refusal's code and message, as the caller was told."""

    code: str
    message: str


@dataclass
class JournalRenewed(Model):
    """`renewed`: the lease's new expiry."""

    expires_at: str


@dataclass
class JournalScopeControl(Model):
    """`scope_control` (B4): an accepted pause, stop or resume."""

    control: str
    generation: int
    mode: str
    request_id: str
    scope: str


@dataclass
class JournalScopeForgotten(Model):
    """`scope_forgotten` (S10): by `operator` or for being `idle`."""

    by: str
    scope: str


@dataclass
class JournalScopeFrozen(Model):
    """`scope_frozen` (B1): the scope's policy and manifest, frozen at its first use."""

    policy: Dict[str, int]
    scope: str
    manifest: Optional[JournalManifest] = None


@dataclass
class JournalScopeReconciled(Model):
    """`scope_reconciled` (B3): an operator freed `owner`'s tokens."""

    by: str
    freed: int
    owner: str
    reason: str
    scope: str


@dataclass
class JournalThreadAttached(Model):
    """`thread_attached` (G1): the thread's new owner and its registration's budget."""

    key: str
    owner_fence: int
    owner_gen: str
    run_budget_ms: int
    run_id: str


@dataclass
class JournalThreadDeadline(Model):
    """`thread_deadline` (G2): the registration's new deadline."""

    deadline: str
    key: str
    run_id: str


@dataclass
class JournalThreadDetached(Model):
    """`thread_detached` (G3): whether the workspace was let go at once."""

    evict: bool
    key: str
    run_id: str


@dataclass
class JournalThreadEviction(Model):
    """`thread_evicted` and `thread_evict_refused`: the thread, and why (`operator`,
    `detach`, `idle`, `disk_pressure`, …).
    """

    key: str
    reason: str


@dataclass
class JournalThreadWorkspace(Model):
    """`thread_workspace_created`: the thread's workspace."""

    key: str
    workspace: str


@dataclass
class JournalToken(Model):
    """`token_created` and `token_revoked` (S9): the token's id, scope and user, never
    its secret or its hash.
    """

    id: str
    scope: str
    uid: Optional[int] = None


@dataclass
class JournalWaitExtended(Model):
    """`wait_extended`: the waiter's new deadline."""

    deadline: str


@dataclass
class Key(Model):
    """A key the run holds and how."""

    key: str
    mode: Literal["exclusive", "shared"]


@dataclass
class LedgerStatus(Model):
    """The LedgerStatus schema."""

    #: Ended runs retention has deleted since the daemon started.
    ended_runs_pruned: int


@dataclass
class LimitsStatus(Model):
    """Whether runs are held to their claims on this host, and by what policy (issue 36)."""

    #: Runs' cgroups get memory, pids and cpu limits from their claims.
    enforced: bool
    #: How (e.g. `cgroup v1 memory, pids, cpu`), when enforced.
    how: Optional[str]
    #: Why not, when not enforced: runs are then admitted by their claims but not
    #: held to them.
    why_not: Optional[str]
    #: `memory.max` as a percentage of the memory claim.
    memory_max_percent: int
    #: `memory.swap.max` per run (null: unlimited).
    swap_max_bytes: Optional[int]
    #: `max` (the claim is a ceiling) or `weight` (a share; runs may burst).
    cpu: str
    #: `pids.max` per run (0: none).
    pids_max: int


@dataclass
class ProcessRequest(Model):
    """`POST /v1/runs/{id}/processes`: a process tree the run's client started (P1)."""

    fence: int
    pid: int


@dataclass
class ProjectStatus(Model):
    """The ProjectStatus schema."""

    project: str
    active: int
    waiting: int
    degraded: int
    concurrency: Literal["serial", "parallel_candidate", "parallel_safe"]
    evidence: Optional[Evidence]


@dataclass
class Queued(Model):
    """The Queued schema."""

    foreground: int
    background: int


@dataclass
class ReapReport(Model):
    """`POST /v1/reap`."""

    examined: int
    reaped: int
    degraded: int
    processes_terminated: int
    reused_pids_protected: int
    diagnostics_bytes: int
    diagnostics_dropped: int
    #: Issue 36: the runs the pass recovered (ended), by id.
    reaped_runs: Optional[List[str]] = None
    #: The runs it left degraded (their stop or cleanup failed), by id.
    degraded_runs: Optional[List[str]] = None


@dataclass
class ReaperStatus(Model):
    """What the reaper has done since the daemon started (P4)."""

    processes_terminated: int
    reused_pids_protected: int
    diagnostics_bytes: int
    diagnostics_dropped: int


@dataclass
class Reason(Model):
    """Why a run waits or was refused, in words a person can act on."""

    code: str
    message: str


@dataclass
class ReconcileRequest(Model):
    """`POST /v1/scopes/{id}/reconcile`: an operator frees every token `owner` holds."""

    owner: str
    #: Why (one line, at most 1 KiB): journaled.
    reason: str


@dataclass
class Reconciled(Model):
    """`POST /v1/scopes/{id}/reconcile`: the tokens it freed."""

    scope: str
    owner: str
    reason: str
    freed: List[ScopeToken]


@dataclass
class ReleaseRequest(Model):
    """`POST /v1/runs/{id}/release`."""

    fence: int


@dataclass
class RenewRequest(Model):
    """`POST /v1/runs/{id}/renew`: a lease (with its fence) or a waiter (without)."""

    fence: Optional[int] = None
    ttl_s: Optional[int] = None


@dataclass
class Reservation(Model):
    """`POST /v1/scopes/{id}/reservations`: the token, and whether this request took it
    (`false`: a retry of the same key got the same token).
    """

    scope: str
    token: ScopeToken
    new: bool


@dataclass
class ReservationRequest(Model):
    """`POST /v1/scopes/{id}/reservations`: a turn's token, keyed by (owner, operation_id)."""

    owner: str
    operation_id: str
    harness: str


@dataclass
class ResourceStatus(Model):
    """A resource of the host as admission sees it."""

    name: str
    total: int
    reserve: int
    allocatable: int
    committed: int
    available: int


@dataclass
class Run(Model):
    """A run: what every run route answers. Fields are in alphabetical order, as a JSON
    object prints them. An `Option` field is always sent (as null when unset), so the
    OpenAPI document marks it `required` and nullable rather than leaving it optional.
    """

    claim: Claim
    class_: Literal["managed", "analysis"] = field(metadata={"json": "class"})
    #: RFC 3339: when a waiter stops waiting (its `wait_s`); a waiter only.
    deadline: Optional[str]
    #: The `BERTH_*` environment of a granted run (empty otherwise).
    env: Dict[str, str]
    #: RFC 3339; a lease only.
    expires_at: Optional[str]
    #: A lease's ttl in milliseconds: each renew moves `expires_at` to the renew's
    #: time plus this (a lease only). A client keeps its lease by this figure, not by
    #: the ttl it asked for (the daemon's default or its `ttl_max` may have decided).
    ttl_ms: Optional[int]
    #: Why a lease that is being stopped (`releasing`, `degraded`) or was stopped is
    #: ending: `released` (its holder released it) or `expired` (it was not renewed
    #: in time, L6). A client that finds its own lease `releasing` with `expired`
    #: lost it.
    ending: Optional[str]
    fence: Optional[int]
    labels: Dict[str, str]
    ports: Dict[str, int]
    #: In the queue, 1-based; a waiter only.
    position: Optional[int]
    priority: Literal["foreground", "background"]
    project: str
    reason: Optional[Reason]
    run_id: str
    #: RFC 3339: when it was granted (or queued, while it waits).
    since: Optional[str]
    state: Literal["queued", "granted", "releasing", "released", "expired", "cancelled", "rejected", "degraded"]
    #: Pids that survived the last stop (a degraded run).
    survivors: List[int]
    #: What the run's cgroup has used against the limits it is held to: live while
    #: it holds its claim, as its stop found it after. Null for a run berth made no
    #: cgroup for (nothing registered or launched, or no cgroups on the host).
    usage: Optional[RunUsage]
    workspace: Optional[str]
    worktree: Optional[str]
    #: A detached waiter (`detach: true`): it keeps its place without a connection.
    detached: Optional[bool] = None
    #: Why berth itself ended the run (no workspace or ports at its grant, W1/W3; a
    #: listener opened by an analysis run, C6).
    failure: Optional[str] = None


@dataclass
class RunLimits(Model):
    """The cgroup limits a run's claim became (null: that limit is not set)."""

    #: `cpu.max` as CPU millis (the claim): a ceiling.
    cpu_max_millis: Optional[int]
    #: `cpu.weight` (`--cpu-burst`): a share under contention, no ceiling.
    cpu_weight: Optional[int]
    #: `memory.high` (the claim): above it the run is throttled and reclaimed.
    memory_high_bytes: Optional[int]
    #: `memory.max`: above it the kernel OOM-kills inside the run.
    memory_max_bytes: Optional[int]
    #: `pids.max`: forks beyond it fail.
    pids_max: Optional[int]
    #: `memory.swap.max`.
    swap_max_bytes: Optional[int]


@dataclass
class RunList(Model):
    """`GET /v1/runs`."""

    runs: List[Run]


@dataclass
class RunUsage(Model):
    """A run's use of its claim, from its cgroup (issue 36). A figure the host cannot
    read is null.
    """

    #: CPU time used, microseconds.
    cpu_usec: Optional[int]
    #: The limits its cgroup is held to (null: not enforced on this host).
    limits: Optional[RunLimits]
    #: Memory in use, bytes.
    memory_bytes: Optional[int]
    #: The most memory it has used, bytes.
    memory_peak_bytes: Optional[int]
    #: Processes the kernel's OOM killer killed inside the run's cgroup: the run
    #: went past its hard memory limit.
    oom_kills: int
    #: `oom_kills` > 0.
    oom_killed: bool
    #: Processes and threads in it now.
    processes: Optional[int]
    #: Paused (`cgroup.freeze`) under memory pressure (`--freeze-background`); it
    #: resumes when the pressure falls.
    frozen: Optional[bool] = None


@dataclass
class RuntimeEventBuilding(Model):
    """A port's `build` command runs."""

    port: str
    event: Literal["building"]


@dataclass
class RuntimeEventLaunched(Model):
    """A port's command was started (and recorded as the run's process, P1)."""

    port: str
    number: int
    pid: int
    event: Literal["launched"]


@dataclass
class RuntimeEventReady(Model):
    """A port answered its probe."""

    port: str
    event: Literal["ready"]


@dataclass
class RuntimeEventFailed(Model):
    """A port could not be started: its build or command failed, it exited, or it
    never answered. The run stays granted so it can be fixed and tried again.
    """

    port: str
    why: str
    #: The last lines the port's command wrote (at most 20).
    log_tail: List[str]
    event: Literal["failed"]


@dataclass
class RuntimeEventDone(Model):
    """Every port is ready; `promoted` if this proved the project parallel (C3)."""

    ports: Dict[str, int]
    promoted: bool
    event: Literal["done"]


#: One step of a runtime start, as the stream (`Accept: application/x-ndjson`) and the
#: answer's `events` report it.
RuntimeEvent = Union[
    RuntimeEventBuilding,
    RuntimeEventLaunched,
    RuntimeEventReady,
    RuntimeEventFailed,
    RuntimeEventDone,
]


@dataclass
class RuntimeRequest(Model):
    """`POST /v1/runs/{id}/runtime` (C7): start the run's runtime under its fence."""

    fence: int


@dataclass
class RuntimeStarted(Model):
    """The answer to a runtime start that is not streamed."""

    ports: Dict[str, int]
    promoted: bool
    events: List[RuntimeEvent]


@dataclass
class Scope(Model):
    """`GET /v1/scopes/{id}` (B6): the frozen policy and manifest, tokens per harness with
    their owners (the first 1,000 by owner; `tokens_held` counts them all), the lapsed
    owners, the control state, generation and receipts, and the waiters with their
    positions (the first 100; `waiting` counts them all).
    """

    scope: str
    harnesses: Dict[str, HarnessFigures]
    control: str
    generation: int
    tokens: List[ScopeToken]
    tokens_held: int
    lapsed_owners: List[str]
    receipts: List[ControlReceipt]
    waiters: List[ScopeWaiter]
    #: All the scope's waiters (`waiters` may show fewer).
    waiting: int
    manifest: Optional[ScopeManifest] = None


@dataclass
class ScopeList(Model):
    """`GET /v1/scopes`."""

    scopes: List[ScopeSummary]


@dataclass
class ScopeManifest(Model):
    """B1: an experiment's frozen manifest: its path, the SHA-256 of its bytes (64
    lower-case hex digits) and the execution ids it names.
    """

    path: str
    sha256: str
    execution_ids: Optional[List[str]] = None


@dataclass
class ScopeSummary(Model):
    """`GET /v1/scopes`: one line per scope."""

    scope: str
    control: str
    generation: int
    harnesses: Dict[str, HarnessFigures]
    lapsed: int


@dataclass
class ScopeToken(Model):
    """B2/B6: one token held: by whom, for which operation, of which harness, for which
    run (a run's claim) and since when. `owner_lapsed`: its owner's lease ran out; the
    token stays held until its owner releases it or an operator reconciles (B3).
    """

    owner: str
    operation_id: str
    harness: str
    since: str
    owner_lapsed: bool
    run_id: Optional[str] = None


@dataclass
class ScopeWaiter(Model):
    """B6: a waiter of the scope, in admission order."""

    run_id: str
    harness: str
    position: int
    reason: Optional[Reason] = None


@dataclass
class Status(Model):
    """`GET /v1/status`."""

    #: Issue 36: whether runs are held to their claims.
    limits: LimitsStatus
    resources: List[ResourceStatus]
    memory_available: Optional[int]
    memory_pending: int
    #: Issue 36: free space on the workspaces' file system as last sampled (null:
    #: not sampled), and the disk claims of runs granted too recently to show in it.
    disk_free: Optional[int]
    disk_pending: int
    slots_max: int
    effective_max_now: int
    min_run_blocked: Optional[Reason]
    queued: Queued
    granted: int
    releasing: int
    degraded: int
    last_fence: int
    projects: List[ProjectStatus]
    reaper: ReaperStatus
    ledger: LedgerStatus


@dataclass
class StreamCutoff(Model):
    """The last event of a stream berth cut off (a consumer too far behind): resume with
    `Last-Event-ID: last_seq`.
    """

    reason: str
    last_seq: int


@dataclass
class Thread(Model):
    """`GET /v1/threads/{key}`: a thread, its owner, registration, workspace and audit trail."""

    key: str
    created_at: str
    active_at: str
    evictions: List[ThreadEviction]
    owner: Optional[ThreadOwner] = None
    registration: Optional[ThreadRegistration] = None
    workspace: Optional[str] = None


@dataclass
class ThreadClaim(Model):
    """`POST /v1/threads/{key}/attach`, `/deadline` and `/detach`: an owner's claim (G1–G3).
    `owner_gen` and `run_id` follow the id rule; `owner_fence` orders owners (a positive
    safe integer); `run_budget_ms` (1 ms to a day) is the registration's deadline from
    now. `evict` (detach only) lets the thread's workspace go at once.
    """

    run_id: str
    owner_gen: str
    owner_fence: int
    run_budget_ms: Optional[int] = None
    evict: Optional[bool] = None


@dataclass
class ThreadEviction(Model):
    """One eviction of a thread's workspace: `ttl`, `idle`, `detach` or `operator`."""

    reason: str
    at: str


@dataclass
class ThreadList(Model):
    """`GET /v1/threads`."""

    threads: List[Thread]


@dataclass
class ThreadOwner(Model):
    """A thread's owner: the highest `(owner_gen, owner_fence)` ever accepted (G2)."""

    owner_gen: str
    owner_fence: int
    run_id: str


@dataclass
class ThreadRegistration(Model):
    """A thread's registration (G1): live until `live_until` (its deadline plus grace)."""

    owner: ThreadOwner
    attached_at: str
    deadline: str
    live_until: str
    live: bool


@dataclass
class TokenCreated(Model):
    """`POST /v1/tokens`: the token is shown once."""

    token: str
    scope: str
    uid: int
    #: RFC 3339; `null`: until revoked.
    expires_at: Optional[str]
    #: Its public name (`GET /v1/tokens`, `DELETE /v1/tokens/{id}`).
    id: Optional[str] = None


@dataclass
class TokenInfo(Model):
    """A token as `GET /v1/tokens` shows it: never its secret, nor its hash (only the
    first 16 hex digits of the hash, its id).
    """

    id: str
    scope: str
    #: The user it acts for (`null`: berth's own).
    uid: Optional[int]
    #: RFC 3339; `null`: until revoked.
    expires_at: Optional[str]
    expired: bool
    #: A fleet token: honoured by every host of the fleet, revoked on any.
    fleet: Optional[bool] = None


@dataclass
class TokenList(Model):
    """`GET /v1/tokens`."""

    tokens: List[TokenInfo]


@dataclass
class TokenRequest(Model):
    """`POST /v1/tokens`."""

    #: `read`, `operator` or `admin`.
    scope: str
    #: The user this token acts for when it registers processes; default: berth's own.
    uid: Optional[int] = None
    #: Seconds from now until the token is refused (1 to 315360000, ten years);
    #: default: until revoked.
    expires_s: Optional[int] = None
