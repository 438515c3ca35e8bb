// berth API v1: every request and response body, by the names of
// crates/berth-client/src/wire/.
//
// Nothing here is written by hand: each name is a schema of the daemon's OpenAPI document
// (docs/openapi.json, generated from wire/ by utoipa), turned into `src/schema.ts` by
// openapi-typescript (`npm run generate`, checked in so that no generator runs at install
// time). `test/schema.test.ts` fails when `src/schema.ts` is not what the generator makes
// of the document, and the daemon's own snapshot test fails when the document is not what
// the daemon serves, so these types cannot drift from the wire.
//
// How serde's shapes read here:
// - `Option<T>` is an optional, nullable property `name?: T | null`. Requests may leave it
//   out or send null; responses send null (or leave out the fields marked
//   `skip_serializing_if`), so read it as possibly absent.
// - Every `u64`/`i32`/`u16` is a JSON number (berth keeps them below 2^53).

import type { components, operations } from "./schema.js";

type Schemas = components["schemas"];

/** The `operationId` of each operation of the document (`acquireRun`, `renewRun`, …). */
export type OperationId = keyof operations;

/** Any JSON value (`serde_json::Value`). */
export type JsonValue =
  | null
  | boolean
  | number
  | string
  | JsonValue[]
  | { [key: string]: JsonValue };

// ---- berth_core's words (inline enums of the document) ------------------------------

/** `berth_core::Class`. */
export type Class = Schemas["Run"]["class"];
/** `berth_core::Priority`. */
export type Priority = Schemas["Run"]["priority"];
/** `berth_core::RunState`. */
export type RunState = Schemas["Run"]["state"];
/** `berth_core::KeyMode`. */
export type KeyMode = Schemas["Key"]["mode"];
/** `berth_core::ConcurrencyClass`. */
export type ConcurrencyClass = Schemas["ProjectStatus"]["concurrency"];

// ---- requests ----------------------------------------------------------------------

export type AcquireRequest = Schemas["AcquireRequest"];
export type RenewRequest = Schemas["RenewRequest"];
export type ReleaseRequest = Schemas["ReleaseRequest"];
export type ProcessRequest = Schemas["ProcessRequest"];
export type TokenRequest = Schemas["TokenRequest"];
export type RuntimeRequest = Schemas["RuntimeRequest"];

// ---- runs --------------------------------------------------------------------------

export type Reason = Schemas["Reason"];
export type Key = Schemas["Key"];
export type Claim = Schemas["Claim"];
export type Run = Schemas["Run"];
export type RunList = Schemas["RunList"];
/** One line of a streamed acquire (`Accept: application/x-ndjson`), tagged by `event`. */
export type AcquireEvent = Schemas["AcquireEvent"];

// ---- errors ------------------------------------------------------------------------

export type ErrorBody = Schemas["ErrorBody"];
export type ErrorDetail = Schemas["ErrorDetail"];

// ---- status ------------------------------------------------------------------------

export type ResourceStatus = Schemas["ResourceStatus"];
export type Evidence = Schemas["Evidence"];
export type ProjectStatus = Schemas["ProjectStatus"];
export type Queued = Schemas["Queued"];
export type ReaperStatus = Schemas["ReaperStatus"];
export type LedgerStatus = Schemas["LedgerStatus"];
/** Issue 36: whether runs are held to their claims, and by what policy. */
export type LimitsStatus = Schemas["LimitsStatus"];
/** Issue 36: a run's use of its claim (`run.usage`) and the limits it is held to. */
export type RunUsage = Schemas["RunUsage"];
export type RunLimits = Schemas["RunLimits"];
export type Status = Schemas["Status"];
export type ReapReport = Schemas["ReapReport"];
export type FenceCheck = Schemas["FenceCheck"];
// Fleet mode (F4): `GET /v1/fleet`.
export type Fleet = Schemas["Fleet"];
export type FleetHost = Schemas["FleetHost"];
export type FleetResource = Schemas["FleetResource"];
/** What a host's heartbeat writes of its load. */
export type FleetLoad = Schemas["FleetLoad"];
export type TokenCreated = Schemas["TokenCreated"];
export type TokenInfo = Schemas["TokenInfo"];
export type TokenList = Schemas["TokenList"];

// ---- runtime (C7) ------------------------------------------------------------------

/** One step of a runtime start, tagged by `event`. */
export type RuntimeEvent = Schemas["RuntimeEvent"];
export type RuntimeStarted = Schemas["RuntimeStarted"];

// ---- journal (D5) ------------------------------------------------------------------

/** One journal entry: a line of `GET /v1/journal`, the data of each `GET /v1/events` event. */
export type JournalEntry = Schemas["JournalEntry"];
/**
 * The type of each journal kind's `data` (the document's `x-berth-journal-kinds`):
 * `entry.data as JournalData["granted"]` once `entry.kind === "granted"`.
 */
export type JournalBudgetToken = Schemas["JournalBudgetToken"];
export type JournalDegraded = Schemas["JournalDegraded"];
export type JournalDrain = Schemas["JournalDrain"];
export type JournalFleetDrain = Schemas["JournalFleetDrain"];
export type JournalEmpty = Schemas["JournalEmpty"];
export type JournalEnded = Schemas["JournalEnded"];
export type JournalFence = Schemas["JournalFence"];
export type JournalOom = Schemas["JournalOom"];
export type JournalGranted = Schemas["JournalGranted"];
export type JournalKey = Schemas["JournalKey"];
export type JournalKeyName = Schemas["JournalKeyName"];
export type JournalManifest = Schemas["JournalManifest"];
export type JournalPid = Schemas["JournalPid"];
export type JournalPids = Schemas["JournalPids"];
export type JournalPromoted = Schemas["JournalPromoted"];
export type JournalQueued = Schemas["JournalQueued"];
export type JournalReaped = Schemas["JournalReaped"];
export type JournalReason = Schemas["JournalReason"];
export type JournalRefused = Schemas["JournalRefused"];
export type JournalRenewed = Schemas["JournalRenewed"];
export type JournalScopeControl = Schemas["JournalScopeControl"];
export type JournalScopeForgotten = Schemas["JournalScopeForgotten"];
export type JournalScopeFrozen = Schemas["JournalScopeFrozen"];
export type JournalScopeReconciled = Schemas["JournalScopeReconciled"];
export type JournalThreadAttached = Schemas["JournalThreadAttached"];
export type JournalThreadDeadline = Schemas["JournalThreadDeadline"];
export type JournalThreadDetached = Schemas["JournalThreadDetached"];
export type JournalThreadEviction = Schemas["JournalThreadEviction"];
export type JournalThreadWorkspace = Schemas["JournalThreadWorkspace"];
export type JournalToken = Schemas["JournalToken"];
export type JournalWaitExtended = Schemas["JournalWaitExtended"];
export interface JournalData {
  budget_token_freed: JournalBudgetToken;
  budget_token_lapsed: JournalBudgetToken;
  budget_token_taken: JournalBudgetToken;
  degraded: JournalDegraded;
  drain_ended: JournalEmpty;
  drain_started: JournalDrain;
  ended: JournalEnded;
  evidence_invalidated: JournalEmpty;
  expired: JournalFence;
  fleet_drain_ended: JournalEmpty;
  fleet_drain_started: JournalFleetDrain;
  granted: JournalGranted;
  key_mode_changed: JournalKey;
  oom_killed: JournalOom;
  process_registered: JournalPid;
  promoted: JournalPromoted;
  queued: JournalQueued;
  reaped: JournalReaped;
  refused: JournalRefused;
  released: JournalFence;
  renewed: JournalRenewed;
  scope_control: JournalScopeControl;
  scope_forgotten: JournalScopeForgotten;
  scope_frozen: JournalScopeFrozen;
  scope_reconciled: JournalScopeReconciled;
  stop_started: JournalPids;
  survivors: JournalPids;
  thread_attached: JournalThreadAttached;
  thread_deadline: JournalThreadDeadline;
  thread_detached: JournalThreadDetached;
  thread_evict_refused: JournalThreadEviction;
  thread_evicted: JournalThreadEviction;
  thread_workspace_created: JournalThreadWorkspace;
  token_created: JournalToken;
  token_revoked: JournalToken;
  upgrade_granted: JournalKeyName;
  upgrade_queued: JournalKeyName;
  wait_extended: JournalWaitExtended;
}
/** Every kind of journal entry, as `x-berth-journal-kinds` lists them. */
export const JOURNAL_KINDS: readonly (keyof JournalData)[] = [
  "budget_token_freed",
  "budget_token_lapsed",
  "budget_token_taken",
  "degraded",
  "drain_ended",
  "drain_started",
  "ended",
  "evidence_invalidated",
  "expired",
  "fleet_drain_ended",
  "fleet_drain_started",
  "granted",
  "key_mode_changed",
  "oom_killed",
  "process_registered",
  "promoted",
  "queued",
  "reaped",
  "refused",
  "released",
  "renewed",
  "scope_control",
  "scope_forgotten",
  "scope_frozen",
  "scope_reconciled",
  "stop_started",
  "survivors",
  "thread_attached",
  "thread_deadline",
  "thread_detached",
  "thread_evict_refused",
  "thread_evicted",
  "thread_workspace_created",
  "token_created",
  "token_revoked",
  "upgrade_granted",
  "upgrade_queued",
  "wait_extended",
];
/** The last event of a stream berth cut off (`event: cutoff`): resume after `last_seq`. */
export type StreamCutoff = Schemas["StreamCutoff"];

// ---- agent threads and the drain (G0–G4) -------------------------------------------

/** An owner's claim on a thread: `attach`, `deadline` (with `run_budget_ms`), `detach`. */
export type ThreadClaim = Schemas["ThreadClaim"];
export type ThreadOwner = Schemas["ThreadOwner"];
export type ThreadRegistration = Schemas["ThreadRegistration"];
export type ThreadEviction = Schemas["ThreadEviction"];
export type Thread = Schemas["Thread"];
export type ThreadList = Schemas["ThreadList"];
export type DrainRequest = Schemas["DrainRequest"];
export type DrainRecord = Schemas["DrainRecord"];
export type FleetDrainRecord = Schemas["FleetDrainRecord"];
/** Something in flight: a live run or a live registration. */
export type Busy = Schemas["Busy"];
export type Drain = Schemas["Drain"];
export type Idle = Schemas["Idle"];

// ---- experiment budgets (B1–B6) ------------------------------------------------------

/** A run's budget in `POST /v1/runs`: its harness token is part of the run's claim. */
export type BudgetClaim = Schemas["BudgetClaim"];
export type ScopeManifest = Schemas["ScopeManifest"];
export type ReservationRequest = Schemas["ReservationRequest"];
export type ReconcileRequest = Schemas["ReconcileRequest"];
export type ControlRequest = Schemas["ControlRequest"];
export type ControlReceipt = Schemas["ControlReceipt"];
/** A token held; `owner_lapsed`: held until its owner releases it or an operator reconciles. */
export type ScopeToken = Schemas["ScopeToken"];
export type Reservation = Schemas["Reservation"];
export type Reconciled = Schemas["Reconciled"];
export type ScopeWaiter = Schemas["ScopeWaiter"];
export type HarnessFigures = Schemas["HarnessFigures"];
export type Scope = Schemas["Scope"];
export type ScopeSummary = Schemas["ScopeSummary"];
export type ScopeList = Schemas["ScopeList"];
