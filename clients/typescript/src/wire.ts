// berth API v1: every request and response body, mirroring
// crates/berth-client/src/wire.rs field for field.
//
// This file is the only place a wire type is declared: it is to be replaced by types
// generated from the daemon's OpenAPI document (src/schema.d.ts,
// `components["schemas"]["Run"]` etc.), so the rest of the client imports these names
// from here and declares none of its own.
//
// Conventions, following serde:
// - `Option<T>` with `skip_serializing_if = "Option::is_none"` (requests, journal
//   entries) is an optional property `name?: T`: a client sends only what it set.
// - `Option<T>` without it (most responses) is always present, as `T | null`.
// - `#[serde(default)]` on a response field: the field may be absent when read.
// - Every `u64`/`i32`/`u16` is a JSON number (berth keeps them below 2^53).

/** Any JSON value (`serde_json::Value`). */
export type JsonValue =
  | null
  | boolean
  | number
  | string
  | JsonValue[]
  | { [key: string]: JsonValue };

// ---- berth_core's words -----------------------------------------------------------

/** `berth_core::Class`. */
export type Class = "managed" | "analysis";

/** `berth_core::Priority`. */
export type Priority = "foreground" | "background";

/** `berth_core::RunState`. */
export type RunState =
  | "queued"
  | "granted"
  | "releasing"
  | "released"
  | "expired"
  | "cancelled"
  | "rejected"
  | "degraded";

/** `berth_core::KeyMode`. */
export type KeyMode = "exclusive" | "shared";

/** `berth_core::ConcurrencyClass`. */
export type ConcurrencyClass = "serial" | "parallel_candidate" | "parallel_safe";

// ---- requests ----------------------------------------------------------------------

/** `POST /v1/runs`: ask for a berth. */
export interface AcquireRequest {
  /** A retry with the same id re-attaches to the same run (L7); default: a new id. */
  run_id?: string;
  project: string;
  class?: Class;
  priority?: Priority;
  /** `slots`, `memory`, `cpu_millis`, `disk` and named resources (A13). Each key once. */
  resources?: Record<string, number>;
  singletons?: string[];
  /** Refused until experiment budgets exist. */
  budget?: JsonValue;
  worktree?: string;
  ttl_s?: number;
  wait_s?: number;
  /** Each key once. */
  labels?: Record<string, string>;
  /** Grace between SIGTERM and SIGKILL when this run is stopped (P2). */
  stop_grace_s?: number;
}

/** `POST /v1/runs/{id}/renew`: a lease (with its fence) or a waiter (without). */
export interface RenewRequest {
  fence?: number;
  ttl_s?: number;
}

/** `POST /v1/runs/{id}/release`. */
export interface ReleaseRequest {
  fence: number;
}

/** `POST /v1/runs/{id}/processes`: a process tree the run's client started (P1). */
export interface ProcessRequest {
  fence: number;
  pid: number;
}

/** `POST /v1/tokens`. */
export interface TokenRequest {
  /** `read`, `operator` or `admin`. */
  scope: string;
  /** The user this token acts for when it registers processes; default: berth's own. */
  uid?: number;
}

/** `POST /v1/runs/{id}/runtime` (C7): start the run's runtime under its fence. */
export interface RuntimeRequest {
  fence: number;
}

// ---- runs --------------------------------------------------------------------------

/** Why a run waits or was refused, in words a person can act on. */
export interface Reason {
  code: string;
  message: string;
}

/** A key the run holds and how. */
export interface Key {
  key: string;
  mode: KeyMode;
}

/** What a run claims: its resources (built-in and named, by name) and keys. */
export interface Claim {
  keys: Key[];
  resources: Record<string, number>;
}

/** A run: what every run route answers. */
export interface Run {
  claim: Claim;
  class: Class;
  /** The `BERTH_*` environment of a granted run (empty otherwise). */
  env: Record<string, string>;
  /** RFC 3339; a lease only. */
  expires_at: string | null;
  /** Why berth itself ended the run (W1/W3, C6). `#[serde(default)]`. */
  failure?: string | null;
  fence: number | null;
  labels: Record<string, string>;
  ports: Record<string, number>;
  /** In the queue, 1-based; a waiter only. */
  position: number | null;
  priority: Priority;
  project: string;
  reason: Reason | null;
  run_id: string;
  /** RFC 3339: when it was granted (or queued, while it waits). */
  since: string | null;
  state: RunState;
  /** Pids that survived the last stop (a degraded run). */
  survivors: number[];
  workspace: string | null;
  worktree: string | null;
}

/** `GET /v1/runs`. */
export interface RunList {
  runs: Run[];
}

/** One line of a streamed acquire (`Accept: application/x-ndjson`), tagged by `event`. */
export type AcquireEvent =
  /** The run waits; sent whenever its position or reason changes. */
  | { event: "queued"; run_id: string; position: number | null; reason: Reason | null }
  | { event: "granted"; lease: Run }
  /** Its wait ran out. */
  | { event: "expired"; error: ErrorDetail }
  /** It ended without a grant for any other reason. */
  | { event: "rejected"; error: ErrorDetail };

// ---- errors ------------------------------------------------------------------------

/** Every refusal: `{"error": {"code", "message", "details"}}` with a stable code. */
export interface ErrorBody {
  error: ErrorDetail;
}

export interface ErrorDetail {
  code: string;
  message: string;
  /** `#[serde(default)]`: absent reads as null. */
  details?: JsonValue;
}

// ---- status ------------------------------------------------------------------------

/** A resource of the host as admission sees it. */
export interface ResourceStatus {
  name: string;
  total: number;
  reserve: number;
  allocatable: number;
  committed: number;
  available: number;
}

/** Promotion evidence a project's parallel runs rest on (D1). */
export interface Evidence {
  fingerprint: string;
  commit: string | null;
  ports: string[];
  run_id: string;
  /** RFC 3339: when the project was promoted. */
  at: string;
}

export interface ProjectStatus {
  project: string;
  active: number;
  waiting: number;
  degraded: number;
  concurrency: ConcurrencyClass;
  evidence: Evidence | null;
}

export interface Queued {
  foreground: number;
  background: number;
}

/** What the reaper has done since the daemon started (P4). */
export interface ReaperStatus {
  processes_terminated: number;
  reused_pids_protected: number;
  diagnostics_bytes: number;
  diagnostics_dropped: number;
}

export interface LedgerStatus {
  /** Ended runs retention has deleted since the daemon started. */
  ended_runs_pruned: number;
}

/** `GET /v1/status`. */
export interface Status {
  resources: ResourceStatus[];
  memory_available: number | null;
  memory_pending: number;
  slots_max: number;
  effective_max_now: number;
  min_run_blocked: Reason | null;
  queued: Queued;
  granted: number;
  releasing: number;
  degraded: number;
  last_fence: number;
  projects: ProjectStatus[];
  reaper: ReaperStatus;
  ledger: LedgerStatus;
}

/** `POST /v1/reap`. */
export interface ReapReport {
  examined: number;
  reaped: number;
  degraded: number;
  processes_terminated: number;
  reused_pids_protected: number;
  diagnostics_bytes: number;
  diagnostics_dropped: number;
}

/** `GET /v1/fences/check?run_id=…&fence=…`. */
export interface FenceCheck {
  run_id: string;
  fence: number;
  /** The fence is the run's and the run holds its lease. */
  current: boolean;
  state: RunState | null;
}

/** `POST /v1/tokens`: the token is shown once. */
export interface TokenCreated {
  token: string;
  scope: string;
  uid: number;
}

// ---- runtime (C7) ------------------------------------------------------------------

/** One step of a runtime start, tagged by `event`. */
export type RuntimeEvent =
  /** A port's `build` command runs. */
  | { event: "building"; port: string }
  /** A port's command was started (and recorded as the run's process, P1). */
  | { event: "launched"; port: string; number: number; pid: number }
  /** A port answered its probe. */
  | { event: "ready"; port: string }
  /** A port could not be started; the run stays granted. */
  | { event: "failed"; port: string; why: string; log_tail: string[] }
  /** Every port is ready; `promoted` if this proved the project parallel (C3). */
  | { event: "done"; ports: Record<string, number>; promoted: boolean };

/** The answer to a runtime start that is not streamed. */
export interface RuntimeStarted {
  ports: Record<string, number>;
  promoted: boolean;
  events: RuntimeEvent[];
}

// ---- journal (D5) ------------------------------------------------------------------

/**
 * One journal entry: a line of `GET /v1/journal` and the data of each event of
 * `GET /v1/events`. `seq` has no gaps.
 */
export interface JournalEntry {
  seq: number;
  /** RFC 3339: when berth made the change. */
  at: string;
  /**
   * What happened: `queued`, `granted`, `renewed`, `released`, `expired`,
   * `stop_started`, `survivors`, `degraded`, `reaped`, `ended`, `refused`,
   * `token_created`, `process_registered`, `promoted`, ...
   */
  kind: string;
  run_id?: string;
  project?: string;
  /** The change's own fields (they depend on `kind`). */
  data: Record<string, unknown>;
}

/** The last event of a stream berth cut off (`event: cutoff`): resume after `last_seq`. */
export interface StreamCutoff {
  reason: string;
  last_seq: number;
}
