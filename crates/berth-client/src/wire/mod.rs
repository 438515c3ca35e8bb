//! The API's request and response bodies: the one vocabulary the daemon answers in,
//! the CLI speaks, and a Rust orchestrator can depend on.
//!
//! **Architecture invariant:** a JSON field of API v1 is named in exactly one place,
//! here. The daemon serializes these types and parses its requests into them; the CLI
//! and [`Client`](crate::Client) do the reverse. Classes, priorities, states and key
//! modes are `berth_core`'s words, which carry their own codec.

use std::collections::BTreeMap;

use berth_core::{Class, ConcurrencyClass, KeyMode, Priority, RunState};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::schema::words;
use serde_json::Value;

mod journal;
pub use journal::*;

/// A JSON object whose keys must each appear once: a request that names a resource or
/// label twice is refused, not silently read as its last value.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UniqueMap<V>(pub BTreeMap<String, V>);

impl<V: Serialize> Serialize for UniqueMap<V> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl<'de, V: Deserialize<'de>> Deserialize<'de> for UniqueMap<V> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit<V>(std::marker::PhantomData<V>);
        impl<'de, V: Deserialize<'de>> serde::de::Visitor<'de> for Visit<V> {
            type Value = UniqueMap<V>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut a: A,
            ) -> Result<Self::Value, A::Error> {
                let mut m = BTreeMap::new();
                while let Some((k, v)) = a.next_entry::<String, V>()? {
                    if m.contains_key(&k) {
                        return Err(serde::de::Error::custom(format!("{k:?} appears twice")));
                    }
                    m.insert(k, v);
                }
                Ok(UniqueMap(m))
            }
        }
        d.deserialize_map(Visit(std::marker::PhantomData))
    }
}

/// `POST /v1/runs`: ask for a berth.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AcquireRequest {
    /// A retry with the same id re-attaches to the same run (L7); default: a new id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<String>,
    pub project: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(schema_with = words::<Class>)]
    pub class: Option<Class>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(schema_with = words::<Priority>)]
    pub priority: Option<Priority>,
    /// `slots`, `memory`, `cpu_millis`, `disk` and named resources (A13).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<BTreeMap<String, u64>>)]
    pub resources: Option<UniqueMap<u64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub singletons: Option<Vec<String>>,
    /// B1/B2: the experiment budget whose harness token is part of this run's claim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<BudgetClaim>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worktree: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_s: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_s: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<BTreeMap<String, String>>)]
    pub labels: Option<UniqueMap<String>>,
    /// Grace between SIGTERM and SIGKILL when this run is stopped (P2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_grace_s: Option<u64>,
    /// `true`: answer `202` at once with the queued run instead of holding the
    /// connection. The run keeps its place until its `wait_s` deadline without one (A9
    /// does not apply to it); follow it with `GET /v1/runs/{id}?wait_s=N` or
    /// `GET /v1/events?run=ID`, cancel it with `DELETE /v1/runs/{id}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detach: Option<bool>,
    /// G0: the agent thread this run works in (the id rule): `BERTH_WORKSPACE` is the
    /// thread's persistent workspace (made at the grant if it has none), while `tmp`,
    /// `out` and the logs stay the run's own. While the run lives, the thread is not
    /// evicted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thread: Option<String>,
    /// `false`: a lease only, for an orchestrator that needs the fence and not a place
    /// to work: no workspace is made at the grant (the answer has no `workspace`, the
    /// run's environment no `BERTH_WORKSPACE`), so a lifecycle costs less. Not with
    /// `thread`. Default `true`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace: Option<bool>,
}

/// `POST /v1/runs/{id}/renew`: a lease (with its fence) or a waiter (without).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RenewRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fence: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_s: Option<u64>,
}

/// `POST /v1/runs/{id}/release`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReleaseRequest {
    pub fence: u64,
}

/// `POST /v1/runs/{id}/processes`: a process tree the run's client started (P1).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ProcessRequest {
    pub fence: u64,
    pub pid: i32,
}

/// `POST /v1/tokens`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TokenRequest {
    /// `read`, `operator` or `admin`.
    pub scope: String,
    /// The user this token acts for when it registers processes; default: berth's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    /// Seconds from now until the token is refused (1 to 315360000, ten years);
    /// default: until revoked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_s: Option<u64>,
}

/// Why a run waits or was refused, in words a person can act on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Reason {
    pub code: String,
    pub message: String,
}

/// A key the run holds and how.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Key {
    pub key: String,
    #[schema(schema_with = words::<KeyMode>)]
    pub mode: KeyMode,
}

/// What a run claims: its resources (built-in and named, by name) and keys.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Claim {
    pub keys: Vec<Key>,
    pub resources: BTreeMap<String, u64>,
}

/// A run: what every run route answers. Fields are in alphabetical order, as a JSON
/// object prints them. An `Option` field is always sent (as null when unset), so the
/// OpenAPI document marks it `required` and nullable rather than leaving it optional.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Run {
    pub claim: Claim,
    #[schema(schema_with = words::<Class>)]
    pub class: Class,
    /// RFC 3339: when a waiter stops waiting (its `wait_s`); a waiter only.
    #[serde(default)]
    #[schema(required = true)]
    pub deadline: Option<String>,
    /// A detached waiter (`detach: true`): it keeps its place without a connection.
    #[serde(default)]
    pub detached: bool,
    /// The `BERTH_*` environment of a granted run (empty otherwise).
    pub env: BTreeMap<String, String>,
    /// RFC 3339; a lease only.
    #[schema(required = true)]
    pub expires_at: Option<String>,
    /// A lease's ttl in milliseconds: each renew moves `expires_at` to the renew's
    /// time plus this (a lease only). A client keeps its lease by this figure, not by
    /// the ttl it asked for (the daemon's default or its `ttl_max` may have decided).
    #[serde(default)]
    #[schema(required = true)]
    pub ttl_ms: Option<u64>,
    /// Why a lease that is being stopped (`releasing`, `degraded`) or was stopped is
    /// ending: `released` (its holder released it) or `expired` (it was not renewed
    /// in time, L6). A client that finds its own lease `releasing` with `expired`
    /// lost it.
    #[serde(default)]
    #[schema(required = true)]
    pub ending: Option<String>,
    /// Why berth itself ended the run (no workspace or ports at its grant, W1/W3; a
    /// listener opened by an analysis run, C6).
    #[serde(default)]
    pub failure: Option<String>,
    #[schema(required = true)]
    pub fence: Option<u64>,
    pub labels: BTreeMap<String, String>,
    pub ports: BTreeMap<String, u16>,
    /// In the queue, 1-based; a waiter only.
    #[schema(required = true)]
    pub position: Option<u64>,
    #[schema(schema_with = words::<Priority>)]
    pub priority: Priority,
    pub project: String,
    #[schema(required = true)]
    pub reason: Option<Reason>,
    pub run_id: String,
    /// RFC 3339: when it was granted (or queued, while it waits).
    #[schema(required = true)]
    pub since: Option<String>,
    #[schema(schema_with = words::<RunState>)]
    pub state: RunState,
    /// Pids that survived the last stop (a degraded run).
    pub survivors: Vec<i32>,
    /// What the run's cgroup has used against the limits it is held to: live while
    /// it holds its claim, as its stop found it after. Null for a run berth made no
    /// cgroup for (nothing registered or launched, or no cgroups on the host).
    #[serde(default)]
    #[schema(required = true)]
    pub usage: Option<RunUsage>,
    #[schema(required = true)]
    pub workspace: Option<String>,
    #[schema(required = true)]
    pub worktree: Option<String>,
}

/// `GET /v1/runs`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RunList {
    pub runs: Vec<Run>,
}

/// One line of a streamed acquire (`Accept: application/x-ndjson`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "event", rename_all = "lowercase")]
pub enum AcquireEvent {
    /// The run waits; sent whenever its position or reason changes.
    Queued {
        run_id: String,
        #[schema(required = true)]
        position: Option<u64>,
        #[schema(required = true)]
        reason: Option<Reason>,
    },
    Granted {
        lease: Box<Run>,
    },
    /// Its wait ran out.
    Expired {
        error: ErrorDetail,
    },
    /// It ended without a grant for any other reason.
    Rejected {
        error: ErrorDetail,
    },
}

/// Every refusal: `{"error": {"code", "message", "details"}}` with a stable code.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ErrorDetail {
    pub code: String,
    pub message: String,
    /// Any JSON value (`{fence, current_fence}` for `stale_fence`, ...); absent reads as null.
    #[serde(default)]
    pub details: Value,
}

/// A resource of the host as admission sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ResourceStatus {
    pub name: String,
    pub total: u64,
    pub reserve: u64,
    pub allocatable: u64,
    pub committed: u64,
    pub available: u64,
}

/// Promotion evidence a project's parallel runs rest on (D1).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Evidence {
    pub fingerprint: String,
    #[schema(required = true)]
    pub commit: Option<String>,
    pub ports: Vec<String>,
    pub run_id: String,
    /// RFC 3339: when the project was promoted.
    pub at: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ProjectStatus {
    pub project: String,
    pub active: u64,
    pub waiting: u64,
    pub degraded: u64,
    #[schema(schema_with = words::<ConcurrencyClass>)]
    pub concurrency: ConcurrencyClass,
    #[schema(required = true)]
    pub evidence: Option<Evidence>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Queued {
    pub foreground: u64,
    pub background: u64,
}

/// What the reaper has done since the daemon started (P4).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ReaperStatus {
    pub processes_terminated: u64,
    pub reused_pids_protected: u64,
    pub diagnostics_bytes: u64,
    pub diagnostics_dropped: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct LedgerStatus {
    /// Ended runs retention has deleted since the daemon started.
    pub ended_runs_pruned: u64,
}

/// A run's use of its claim, from its cgroup (issue 36). A figure the host cannot
/// read is null.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct RunUsage {
    /// CPU time used, microseconds.
    #[schema(required = true)]
    pub cpu_usec: Option<u64>,
    /// The limits its cgroup is held to (null: not enforced on this host).
    #[schema(required = true)]
    pub limits: Option<RunLimits>,
    /// Memory in use, bytes.
    #[schema(required = true)]
    pub memory_bytes: Option<u64>,
    /// The most memory it has used, bytes.
    #[schema(required = true)]
    pub memory_peak_bytes: Option<u64>,
    /// Processes the kernel's OOM killer killed inside the run's cgroup: the run
    /// went past its hard memory limit.
    pub oom_kills: u64,
    /// `oom_kills` > 0.
    pub oom_killed: bool,
    /// Processes and threads in it now.
    #[schema(required = true)]
    pub processes: Option<u64>,
    /// Paused (`cgroup.freeze`) under memory pressure (`--freeze-background`); it
    /// resumes when the pressure falls.
    #[serde(default)]
    pub frozen: bool,
}

/// The cgroup limits a run's claim became (null: that limit is not set).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct RunLimits {
    /// `cpu.max` as CPU millis (the claim): a ceiling.
    #[schema(required = true)]
    pub cpu_max_millis: Option<u64>,
    /// `cpu.weight` (`--cpu-burst`): a share under contention, no ceiling.
    #[schema(required = true)]
    pub cpu_weight: Option<u64>,
    /// `memory.high` (the claim): above it the run is throttled and reclaimed.
    #[schema(required = true)]
    pub memory_high_bytes: Option<u64>,
    /// `memory.max`: above it the kernel OOM-kills inside the run.
    #[schema(required = true)]
    pub memory_max_bytes: Option<u64>,
    /// `pids.max`: forks beyond it fail.
    #[schema(required = true)]
    pub pids_max: Option<u64>,
    /// `memory.swap.max`.
    #[schema(required = true)]
    pub swap_max_bytes: Option<u64>,
}

/// Whether runs are held to their claims on this host, and by what policy (issue 36).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct LimitsStatus {
    /// Runs' cgroups get memory, pids and cpu limits from their claims.
    pub enforced: bool,
    /// How (e.g. `cgroup v1 memory, pids, cpu`), when enforced.
    #[schema(required = true)]
    pub how: Option<String>,
    /// Why not, when not enforced: runs are then admitted by their claims but not
    /// held to them.
    #[schema(required = true)]
    pub why_not: Option<String>,
    /// `memory.max` as a percentage of the memory claim.
    pub memory_max_percent: u64,
    /// `memory.swap.max` per run (null: unlimited).
    #[schema(required = true)]
    pub swap_max_bytes: Option<u64>,
    /// `max` (the claim is a ceiling) or `weight` (a share; runs may burst).
    pub cpu: String,
    /// `pids.max` per run (0: none).
    pub pids_max: u64,
}

/// `GET /v1/status`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Status {
    /// Issue 36: whether runs are held to their claims.
    pub limits: LimitsStatus,
    pub resources: Vec<ResourceStatus>,
    #[schema(required = true)]
    pub memory_available: Option<u64>,
    pub memory_pending: u64,
    /// Issue 36: free space on the workspaces' file system as last sampled (null:
    /// not sampled), and the disk claims of runs granted too recently to show in it.
    #[schema(required = true)]
    pub disk_free: Option<u64>,
    pub disk_pending: u64,
    pub slots_max: u64,
    pub effective_max_now: u64,
    #[schema(required = true)]
    pub min_run_blocked: Option<Reason>,
    pub queued: Queued,
    pub granted: u64,
    pub releasing: u64,
    pub degraded: u64,
    pub last_fence: u64,
    pub projects: Vec<ProjectStatus>,
    pub reaper: ReaperStatus,
    pub ledger: LedgerStatus,
}

/// `POST /v1/reap`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ReapReport {
    pub examined: u64,
    pub reaped: u64,
    pub degraded: u64,
    /// Issue 36: the runs the pass recovered (ended), by id.
    #[serde(default)]
    pub reaped_runs: Vec<String>,
    /// The runs it left degraded (their stop or cleanup failed), by id.
    #[serde(default)]
    pub degraded_runs: Vec<String>,
    pub processes_terminated: u64,
    pub reused_pids_protected: u64,
    pub diagnostics_bytes: u64,
    pub diagnostics_dropped: u64,
}

/// `GET /v1/fences/check?run_id=…&fence=…`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct FenceCheck {
    pub run_id: String,
    pub fence: u64,
    /// The fence is the run's and the run holds its lease.
    pub current: bool,
    #[schema(schema_with = words::<RunState>)]
    pub state: Option<RunState>,
    /// Fleet mode: the host that holds a run this host does not (its fence is current
    /// while that host is alive and the run holds its claim; a dead host's fences are
    /// refused everywhere).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
}

/// One resource summed over a host (or the fleet): what it has, what is granted and
/// what is free now (F4).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct FleetResource {
    pub total: u64,
    pub committed: u64,
    pub available: u64,
}

/// What a host's heartbeat writes of its load (F4), and `GET /v1/fleet` reads back
/// for each host. A field a peer left out (an older or hostile one) reads as zero.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct FleetLoad {
    #[serde(default)]
    pub granted: u64,
    #[serde(default)]
    pub queue_depth: u64,
    #[serde(default)]
    pub resources: BTreeMap<String, FleetResource>,
}

/// A host of the fleet as its last heartbeat described it (F4).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct FleetHost {
    pub host_id: String,
    /// Its registration's generation (a new one after each restart or death).
    pub generation: i64,
    pub address: String,
    pub version: String,
    /// Milliseconds since its last heartbeat, by the fleet store's clock.
    pub heartbeat_age_ms: i64,
    pub queue_depth: u64,
    pub granted: u64,
    pub resources: BTreeMap<String, FleetResource>,
    /// A dead host: the live host that declared it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub declared_by: Option<String>,
}

/// `GET /v1/fleet`: every live host with its capacity, the fleet-wide sums of the live
/// hosts, and the dead hosts (F4).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Fleet {
    /// The host that answered.
    pub host_id: String,
    pub hosts: Vec<FleetHost>,
    pub totals: BTreeMap<String, FleetResource>,
    pub queue_depth: u64,
    pub dead: Vec<FleetHost>,
}

/// `POST /v1/tokens`: the token is shown once.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct TokenCreated {
    pub token: String,
    pub scope: String,
    pub uid: u32,
    /// Its public name (`GET /v1/tokens`, `DELETE /v1/tokens/{id}`).
    #[serde(default)]
    pub id: String,
    /// RFC 3339; `null`: until revoked.
    #[serde(default)]
    #[schema(required = true)]
    pub expires_at: Option<String>,
}

/// A token as `GET /v1/tokens` shows it: never its secret, nor its hash (only the
/// first 16 hex digits of the hash, its id).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct TokenInfo {
    pub id: String,
    pub scope: String,
    /// The user it acts for (`null`: berth's own).
    #[schema(required = true)]
    pub uid: Option<u32>,
    /// RFC 3339; `null`: until revoked.
    #[schema(required = true)]
    pub expires_at: Option<String>,
    pub expired: bool,
    /// A fleet token: honoured by every host of the fleet, revoked on any.
    #[serde(default)]
    pub fleet: bool,
}

/// `GET /v1/tokens`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct TokenList {
    pub tokens: Vec<TokenInfo>,
}

/// `POST /v1/runs/{id}/runtime` (C7): start the run's runtime under its fence.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RuntimeRequest {
    pub fence: u64,
}

/// One step of a runtime start, as the stream (`Accept: application/x-ndjson`) and the
/// answer's `events` report it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum RuntimeEvent {
    /// A port's `build` command runs.
    Building { port: String },
    /// A port's command was started (and recorded as the run's process, P1).
    Launched { port: String, number: u16, pid: i32 },
    /// A port answered its probe.
    Ready { port: String },
    /// A port could not be started: its build or command failed, it exited, or it
    /// never answered. The run stays granted so it can be fixed and tried again.
    Failed {
        port: String,
        why: String,
        /// The last lines the port's command wrote (at most 20).
        log_tail: Vec<String>,
    },
    /// Every port is ready; `promoted` if this proved the project parallel (C3).
    Done {
        ports: BTreeMap<String, u16>,
        promoted: bool,
    },
}

/// The answer to a runtime start that is not streamed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RuntimeStarted {
    pub ports: BTreeMap<String, u16>,
    pub promoted: bool,
    pub events: Vec<RuntimeEvent>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_and_maps_refuse_what_is_not_api_v1() {
        let ok: AcquireRequest =
            serde_json::from_str(r#"{"project":"p","class":"analysis","priority":"background"}"#)
                .unwrap();
        assert_eq!(ok.class, Some(Class::Analysis));
        assert_eq!(ok.priority, Some(Priority::Background));
        let e = serde_json::from_str::<AcquireRequest>(r#"{"project":"p","class":"gold"}"#)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("unknown variant `gold`, expected `managed` or `analysis`"),
            "{e}"
        );
        let e = serde_json::from_str::<AcquireRequest>(
            r#"{"project":"p","resources":{"memory":1,"memory":9}}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("\"memory\" appears twice"), "{e}");
        let e = serde_json::from_str::<AcquireRequest>(r#"{"project":"p","colour":"red"}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field `colour`"), "{e}");
        // What a client sends is exactly what it set: no nulls for what it left out.
        let sent = serde_json::to_string(&AcquireRequest {
            project: "p".into(),
            ttl_s: Some(5),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(sent, r#"{"project":"p","ttl_s":5}"#);
    }

    #[test]
    fn stream_events_are_tagged_by_event() {
        let q = AcquireEvent::Queued {
            run_id: "r".into(),
            position: Some(2),
            reason: None,
        };
        let line = serde_json::to_string(&q).unwrap();
        assert_eq!(
            line,
            r#"{"event":"queued","run_id":"r","position":2,"reason":null}"#
        );
        assert_eq!(serde_json::from_str::<AcquireEvent>(&line).unwrap(), q);
        let e: AcquireEvent = serde_json::from_str(
            r#"{"event":"expired","error":{"code":"expired","message":"waited 5s"}}"#,
        )
        .unwrap();
        assert!(matches!(e, AcquireEvent::Expired { error } if error.details.is_null()));
    }
}

/// The last event of a stream berth cut off (a consumer too far behind): resume with
/// `Last-Event-ID: last_seq`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct StreamCutoff {
    pub reason: String,
    pub last_seq: u64,
}

/// `POST /v1/threads/{key}/attach`, `/deadline` and `/detach`: an owner's claim (G1–G3).
/// `owner_gen` and `run_id` follow the id rule; `owner_fence` orders owners (a positive
/// safe integer); `run_budget_ms` (1 ms to a day) is the registration's deadline from
/// now. `evict` (detach only) lets the thread's workspace go at once.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ThreadClaim {
    pub run_id: String,
    pub owner_gen: String,
    pub owner_fence: u64,
    #[serde(default)]
    pub run_budget_ms: Option<u64>,
    #[serde(default)]
    pub evict: Option<bool>,
}

/// A thread's owner: the highest `(owner_gen, owner_fence)` ever accepted (G2).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ThreadOwner {
    pub owner_gen: String,
    pub owner_fence: u64,
    pub run_id: String,
}

/// A thread's registration (G1): live until `live_until` (its deadline plus grace).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ThreadRegistration {
    pub owner: ThreadOwner,
    pub attached_at: String,
    pub deadline: String,
    pub live_until: String,
    pub live: bool,
}

/// One eviction of a thread's workspace: `ttl`, `idle`, `detach` or `operator`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ThreadEviction {
    pub reason: String,
    pub at: String,
}

/// `GET /v1/threads/{key}`: a thread, its owner, registration, workspace and audit trail.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Thread {
    pub key: String,
    pub owner: Option<ThreadOwner>,
    pub registration: Option<ThreadRegistration>,
    pub workspace: Option<String>,
    pub created_at: String,
    pub active_at: String,
    pub evictions: Vec<ThreadEviction>,
}

/// `GET /v1/threads`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ThreadList {
    pub threads: Vec<Thread>,
}

/// `POST /v1/drain`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DrainRequest {
    #[serde(default)]
    pub reason: Option<String>,
}

/// Who started a drain, when and why (G4).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct DrainRecord {
    pub by: String,
    pub at: String,
    pub reason: String,
}

/// Something in flight: a live run or a live registration, and until when.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Busy {
    /// `run` or `registration`.
    pub kind: String,
    /// The run id, or the thread key.
    pub id: String,
    /// The lease's expiry, or the registration's `live_until`.
    pub until: Option<String>,
    /// A registration's owner.
    pub owner: Option<ThreadOwner>,
}

/// A drain every host of the fleet honours: who started it, when, why, and on which
/// host.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct FleetDrainRecord {
    pub by: String,
    pub at: String,
    pub reason: String,
    pub host: String,
}

/// `GET /v1/drain`: the drains in force (the host's own, the fleet's) and what they
/// wait for. `draining` is true while either is.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Drain {
    pub draining: bool,
    pub drain: Option<DrainRecord>,
    /// The fleet's drain (fleet mode), as this host last read it.
    #[serde(default)]
    #[schema(required = true)]
    pub fleet_drain: Option<FleetDrainRecord>,
    pub waiting_for: Vec<Busy>,
}

/// `GET /v1/idle`: whether the host may be taken away now.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Idle {
    pub idle: bool,
    pub busy: Vec<Busy>,
}

/// B1/B2: a run's budget. `per_harness` (limits 1 to 1024 per canonical harness name,
/// `[a-z][a-z0-9_-]*`) is required the first time `scope` is used and must equal the
/// frozen policy whenever it is given; so must `manifest`. The run's token is reserved
/// under (its run id, `operation_id`, default `run`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BudgetClaim {
    pub scope: String,
    pub harness: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<BTreeMap<String, u32>>)]
    pub per_harness: Option<UniqueMap<u32>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operation_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifest: Option<ScopeManifest>,
}

/// B1: an experiment's frozen manifest: its path, the SHA-256 of its bytes (64
/// lower-case hex digits) and the execution ids it names.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ScopeManifest {
    pub path: String,
    pub sha256: String,
    #[serde(default)]
    pub execution_ids: Vec<String>,
}

/// `POST /v1/scopes/{id}/reservations`: a turn's token, keyed by (owner, operation_id).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReservationRequest {
    pub owner: String,
    pub operation_id: String,
    pub harness: String,
}

/// `POST /v1/scopes/{id}/reconcile`: an operator frees every token `owner` holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReconcileRequest {
    pub owner: String,
    /// Why (one line, at most 1 KiB): journaled.
    pub reason: String,
}

/// `POST /v1/scopes/{id}/control`: `mode` is `pause`, `stop` or `resume`; the same
/// `request_id` (1 to 256 characters) again returns the same receipt.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ControlRequest {
    pub request_id: String,
    pub mode: String,
}

/// B4: an accepted control request (the same for its retries).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ControlReceipt {
    pub scope: String,
    pub request_id: String,
    pub mode: String,
    /// The scope's generation this request made.
    pub generation: u64,
    /// `open`, `paused` or `stopped`: the state it left the scope in.
    pub control: String,
    pub at: String,
}

/// B2/B6: one token held: by whom, for which operation, of which harness, for which
/// run (a run's claim) and since when. `owner_lapsed`: its owner's lease ran out; the
/// token stays held until its owner releases it or an operator reconciles (B3).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ScopeToken {
    pub owner: String,
    pub operation_id: String,
    pub harness: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<String>,
    pub since: String,
    pub owner_lapsed: bool,
}

/// `POST /v1/scopes/{id}/reservations`: the token, and whether this request took it
/// (`false`: a retry of the same key got the same token).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Reservation {
    pub scope: String,
    pub token: ScopeToken,
    pub new: bool,
}

/// `POST /v1/scopes/{id}/reconcile`: the tokens it freed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Reconciled {
    pub scope: String,
    pub owner: String,
    pub reason: String,
    pub freed: Vec<ScopeToken>,
}

/// B6: a waiter of the scope, in admission order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ScopeWaiter {
    pub run_id: String,
    pub harness: String,
    pub position: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<Reason>,
}

/// Per harness: its limit, the tokens held now, and how many of those are held for an
/// owner whose lease lapsed (B3).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct HarnessFigures {
    pub limit: u32,
    pub held: u32,
    pub lapsed: u32,
}

/// `GET /v1/scopes/{id}` (B6): the frozen policy and manifest, tokens per harness with
/// their owners (the first 1,000 by owner; `tokens_held` counts them all), the lapsed
/// owners, the control state, generation and receipts, and the waiters with their
/// positions (the first 100; `waiting` counts them all).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Scope {
    pub scope: String,
    pub harnesses: BTreeMap<String, HarnessFigures>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifest: Option<ScopeManifest>,
    pub control: String,
    pub generation: u64,
    pub tokens: Vec<ScopeToken>,
    pub tokens_held: u64,
    pub lapsed_owners: Vec<String>,
    pub receipts: Vec<ControlReceipt>,
    pub waiters: Vec<ScopeWaiter>,
    /// All the scope's waiters (`waiters` may show fewer).
    pub waiting: u64,
}

/// `GET /v1/scopes`: one line per scope.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ScopeSummary {
    pub scope: String,
    pub control: String,
    pub generation: u64,
    pub harnesses: BTreeMap<String, HarnessFigures>,
    pub lapsed: u64,
}

/// `GET /v1/scopes`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ScopeList {
    pub scopes: Vec<ScopeSummary>,
}
