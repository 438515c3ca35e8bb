// berth's HTTP API v1 for TypeScript: a fetch-based client with a method for every
// operation of docs/openapi.json (`OPERATIONS` names them), the streamed acquire, the
// event stream (`GET /v1/events`) and `withBerth`, which holds a lease around a task.
//
// The wire types are in ./wire.ts only (see the note there); this file adds only the
// client's own refinements of them (`GrantedRun`, `LeaseRequest`, `LeaseEvent`) and the
// shapes of the answers the document gives no schema for (`JournalExport`,
// `OpenApiDocument`).

import type {
  AcquireEvent,
  AcquireRequest,
  ControlReceipt,
  ControlRequest,
  Drain,
  DrainRequest,
  ErrorBody,
  FenceCheck,
  Fleet,
  Idle,
  JournalEntry,
  JsonValue,
  OperationId,
  ProcessRequest,
  ReapReport,
  ReconcileRequest,
  Reconciled,
  ReleaseRequest,
  RenewRequest,
  Reservation,
  ReservationRequest,
  Run,
  RunList,
  RuntimeRequest,
  RuntimeStarted,
  Scope,
  ScopeList,
  ScopeSummary,
  ScopeToken,
  Status,
  StreamCutoff,
  Thread,
  ThreadClaim,
  ThreadList,
  TokenCreated,
  TokenInfo,
  TokenList,
  TokenRequest,
} from "./wire.js";

export type * from "./wire.js";
export { JOURNAL_KINDS } from "./wire.js";

/**
 * A run that holds its lease: what `acquire` answers and `withBerth` hands to `fn`.
 * berth sets these fields on every granted run it shows to the run's own user (another
 * user's run shows no fence, S9), so they need no `!`; `isGranted` checks a `Run`.
 */
export type GrantedRun = Run & { state: "granted"; fence: number; expires_at: string; ttl_ms: number };

/** An acquire that waits for its lease (not `detach: true`): `acquire` answers a `GrantedRun`. */
export type LeaseRequest = AcquireRequest & { detach?: false | null };

/** A line of `acquireStream`: an `AcquireEvent` whose `granted` lease is a `GrantedRun`. */
export type LeaseEvent = Exclude<AcquireEvent, { event: "granted" }> | { event: "granted"; lease: GrantedRun };

/** `exportJournal`: the entries' exact bytes and what berth says of them. */
export interface JournalExport {
  /** The entries, one JSON object a line, exactly as berth stored them. */
  ndjson: string;
  /** The SHA-256 of `ndjson`'s bytes (lower-case hex), from `X-Berth-Journal-Sha256`. */
  sha256: string;
  /** The range exported: the first and the last sequence number. */
  first: number;
  through: number;
}

/** The daemon's OpenAPI 3.1 document (`GET /v1/openapi.json`). */
export type OpenApiDocument = { openapi: string; paths: { [path: string]: JsonValue }; [key: string]: JsonValue };

/** Whether `run` holds its lease and shows its fence, expiry and ttl (a `GrantedRun`). */
export function isGranted(run: Run): run is GrantedRun {
  return (
    run.state === "granted" &&
    typeof run.fence === "number" &&
    typeof run.expires_at === "string" &&
    typeof run.ttl_ms === "number"
  );
}

/** A fetch function: the global one by default (Node 20 or later, browsers, Deno, Bun). */
export type FetchLike = (input: string, init?: RequestInit) => Promise<Response>;

export interface BerthClientOptions {
  /** `http://host:port` (the `BERTH_URL` a run gets), optionally with a path prefix. */
  baseUrl: string;
  /** A bearer token (`<state dir>/admin.token` or one made by `POST /v1/tokens`);
   *  none with `--insecure-no-auth`. */
  token?: string | null;
  /**
   * The fetch to use. Node's global fetch (undici) gives up on an answer whose headers
   * take more than 300 s, and on a body silent for 300 s: a long-polled `acquire` with a
   * `wait_s` above that needs a fetch without those limits (for example undici's own
   * `fetch` with `dispatcher: new Agent({headersTimeout: 0, bodyTimeout: 0})`), since a
   * dropped connection cancels the waiting run.
   */
  fetch?: FetchLike;
}

export interface CallOptions {
  /** Aborting it aborts the request (a waiting acquire leaves the queue, A9). */
  signal?: AbortSignal;
}

export interface EventsOptions {
  /** Start after this sequence number (0: from the first entry kept); default: from now. */
  after?: number;
  /** Only this run's entries. */
  run?: string;
  /** Only this project's entries. */
  project?: string;
  /** Only these kinds (`granted`, `ended`, …). */
  kinds?: string[];
  /** Ends the stream (the iteration then finishes without an error). */
  signal?: AbortSignal;
}

/** berth refused a request (non-2xx), or answered with a body that is not API v1. */
export class BerthError extends Error {
  /** The HTTP status. */
  readonly status: number;
  /** The stable snake_case code (`stale_fence`, `gone`, …); `unexpected_answer` when
   *  the body was not API v1, or not what the call promises (an acquire answered
   *  without a granted lease). */
  readonly code: string;
  /** The refusal's details (`{fence, current_fence}` for `stale_fence`, …). */
  readonly details: JsonValue;

  constructor(status: number, code: string, message: string, details: JsonValue = null) {
    super(message);
    this.name = "BerthError";
    this.status = status;
    this.code = code;
    this.details = details;
  }
}

/** berth could not be reached, or the connection broke before the answer was whole. */
export class BerthConnectionError extends Error {
  constructor(message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = "BerthConnectionError";
  }
}

/** The lease `withBerth` held is gone: a renewal was refused, or none succeeded in time. */
export class LeaseLostError extends Error {
  readonly runId: string;
  readonly fence: number;
  constructor(runId: string, fence: number, message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = "LeaseLostError";
    this.runId = runId;
    this.fence = fence;
  }
}

const NDJSON = "application/x-ndjson";
const BACKOFF_FIRST_MS = 100;
const BACKOFF_MAX_MS = 1000;

/**
 * A handle on one berth daemon. Every method is one HTTP request (or one stream) of one
 * operation of the API (`OPERATIONS`). A refusal rejects with `BerthError`, an
 * unreachable daemon with `BerthConnectionError`, a bad path or query parameter (an
 * empty id, a fractional number) with a `TypeError` before anything is sent.
 */
export class BerthClient {
  readonly baseUrl: string;
  readonly #token: string | null;
  readonly #fetch: FetchLike;

  constructor(options: BerthClientOptions) {
    const given: unknown = options?.baseUrl;
    const url = typeof given === "string" ? given.replace(/\/+$/, "") : "";
    if (!/^https?:\/\/[^/]+/.test(url)) {
      throw new TypeError(`berth baseUrl ${JSON.stringify(given) ?? String(given)}: must be http://host:port`);
    }
    this.baseUrl = url;
    this.#token = options.token ?? null;
    this.#fetch = options.fetch ?? ((input, init) => globalThis.fetch(input, init));
  }

  // ---- runs ------------------------------------------------------------------------

  /**
   * `POST /v1/runs`: waits (long-poll) until the run is granted and answers its lease.
   * Throws `BerthError` 410 `expired` when `wait_s` runs out, and any other refusal.
   * With `detach: true` it answers at once: the run, queued (`202`) or granted.
   */
  acquire(req: LeaseRequest, opts?: CallOptions): Promise<GrantedRun>;
  acquire(req: AcquireRequest, opts?: CallOptions): Promise<Run>;
  async acquire(req: AcquireRequest, opts: CallOptions = {}): Promise<Run> {
    const run = await this.#call<Run>("POST", "/v1/runs", req, opts);
    return req.detach === true ? run : granted(run);
  }

  /**
   * `POST /v1/runs` with `Accept: application/x-ndjson`: yields `queued` events (when
   * the position or the reason changes), then one `granted`, `expired` or `rejected`
   * event, and ends. A refusal before the wait starts throws `BerthError`.
   *
   * Aborting `opts.signal`, or leaving the loop early, closes the connection, and berth
   * cancels the waiting run (A9); the abort rejects the iteration with the signal's
   * reason.
   */
  async *acquireStream(req: AcquireRequest, opts: CallOptions = {}): AsyncGenerator<LeaseEvent, void, undefined> {
    if (req.detach === true) throw new TypeError("berth acquireStream: a detached acquire is not streamed (use acquire)");
    const link = linkSignal(opts.signal);
    try {
      const res = await this.#send("POST", "/v1/runs", req, { signal: link.signal, accept: NDJSON });
      if (!res.ok) throw refusal(res.status, await this.#text(res, opts.signal));
      const type = res.headers.get("content-type") ?? "";
      if (!type.includes(NDJSON)) {
        // Not streamed after all: a plain answer is the lease.
        const lease = granted(parseAnswer<Run>(res.status, await this.#text(res, opts.signal)));
        yield { event: "granted", lease };
        return;
      }
      if (res.body === null) throw new BerthConnectionError("berth answered the stream without a body");
      let ended = false;
      try {
        for await (const line of lines(res.body)) {
          if (line.trim() === "") continue;
          const event = parseAnswer<AcquireEvent>(res.status, line);
          ended = event.event !== "queued";
          yield event.event === "granted" ? { event: "granted", lease: granted(event.lease) } : event;
          if (ended) return;
        }
      } catch (e) {
        if (opts.signal?.aborted || e instanceof BerthError) throw e;
        throw new BerthConnectionError(`the acquire stream broke: ${describe(e)}`, { cause: e });
      }
      if (!ended) {
        throw new BerthConnectionError("the acquire stream ended before the run was granted or refused");
      }
    } finally {
      // Leaving early (or an error) closes the connection: berth cancels the waiter.
      link.abort();
      link.dispose();
    }
  }

  /** `POST /v1/runs/{id}/renew {fence, ttl_s?}`: extends the lease. */
  async renew(runId: string, fence: number, ttl_s?: number, opts: CallOptions = {}): Promise<Run> {
    const body: RenewRequest = ttl_s === undefined ? { fence } : { fence, ttl_s };
    return this.#call<Run>("POST", `/v1/runs/${seg("run id", runId)}/renew`, body, opts);
  }

  /** `POST /v1/runs/{id}/release {fence}`: the run is `released`, or `releasing` while
   *  berth still stops its processes (`getRun` with `wait_s` follows it). */
  async release(runId: string, fence: number, opts: CallOptions = {}): Promise<Run> {
    const body: ReleaseRequest = { fence };
    return this.#call<Run>("POST", `/v1/runs/${seg("run id", runId)}/release`, body, opts);
  }

  /** `DELETE /v1/runs/{id}`: cancels a waiting run; with `fence`, releases a lease. */
  async cancelRun(runId: string, opts: CallOptions & { fence?: number } = {}): Promise<Run> {
    const q = query({ fence: opts.fence });
    return this.#call<Run>("DELETE", `/v1/runs/${seg("run id", runId)}${q}`, undefined, opts);
  }

  /** `POST /v1/runs/{id}/processes {fence, pid}`: berth stops this process tree when
   *  the run ends (P1). */
  async registerProcess(runId: string, fence: number, pid: number, opts: CallOptions = {}): Promise<Run> {
    const body: ProcessRequest = { fence, pid };
    return this.#call<Run>("POST", `/v1/runs/${seg("run id", runId)}/processes`, body, opts);
  }

  /** `POST /v1/runs/{id}/runtime {fence}` (C7): starts the ports of the contract in the
   *  run's worktree and answers once each is ready (or `BerthError` 422 `runtime_failed`). */
  async startRuntime(runId: string, fence: number, opts: CallOptions = {}): Promise<RuntimeStarted> {
    const body: RuntimeRequest = { fence };
    return this.#call<RuntimeStarted>("POST", `/v1/runs/${seg("run id", runId)}/runtime`, body, opts);
  }

  /** `GET /v1/runs/{id}`; with `wait_s`, as soon as the run changes (or unchanged after
   *  `wait_s`); with `state` (the state last seen), at once if it is no longer in it. */
  async getRun(runId: string, opts: CallOptions & { wait_s?: number; state?: Run["state"] } = {}): Promise<Run> {
    const q = query({ wait_s: opts.wait_s, state: opts.state });
    return this.#call<Run>("GET", `/v1/runs/${seg("run id", runId)}${q}`, undefined, opts);
  }

  /** `GET /v1/runs`: live runs; with `all`, ended runs still remembered too. */
  async listRuns(opts: CallOptions & { all?: boolean; limit?: number } = {}): Promise<RunList> {
    return this.#call<RunList>("GET", `/v1/runs${query({ all: opts.all, limit: opts.limit })}`, undefined, opts);
  }

  /** `GET /v1/fences/check`: is `fence` still the lease of `runId` (L8)? */
  async checkFence(runId: string, fence: number, opts: CallOptions = {}): Promise<FenceCheck> {
    const q = query({ run_id: nonEmpty("run id", runId), fence });
    return this.#call<FenceCheck>("GET", `/v1/fences/check${q}`, undefined, opts);
  }

  // ---- the host --------------------------------------------------------------------

  /** `GET /v1/status`: capacity, queue, projects, reaper (A12). */
  async status(opts: CallOptions = {}): Promise<Status> {
    return this.#call<Status>("GET", "/v1/status", undefined, opts);
  }

  /**
   * `GET /v1/fleet`: every live host's capacity and queue, the fleet's sums and the dead
   * hosts (F4; `404 fleet_mode_off` on a host without `--store`).
   */
  async fleet(opts: CallOptions = {}): Promise<Fleet> {
    return this.#call<Fleet>("GET", "/v1/fleet", undefined, opts);
  }

  /** `POST /v1/reap` (admin): one reaper pass now (P4). */
  async reap(opts: CallOptions = {}): Promise<ReapReport> {
    return this.#call<ReapReport>("POST", "/v1/reap", undefined, opts);
  }

  /** `GET /v1/idle`: whether the host may be taken away now, and what is in flight. */
  async getIdle(opts: CallOptions = {}): Promise<Idle> {
    return this.#call<Idle>("GET", "/v1/idle", undefined, opts);
  }

  /** `GET /metrics`: the OpenMetrics text (Prometheus). */
  async getMetrics(opts: CallOptions = {}): Promise<string> {
    return (await this.#getText("/metrics", "application/openmetrics-text", opts)).text;
  }

  /** `GET /`: the dashboard's HTML page (it asks the API with the token a person gives it). */
  async getDashboard(opts: CallOptions = {}): Promise<string> {
    return (await this.#getText("/", "text/html", opts)).text;
  }

  /** `GET /v1/openapi.json`: the API's OpenAPI 3.1 document, as the daemon serves it. */
  async getOpenApi(opts: CallOptions = {}): Promise<OpenApiDocument> {
    return this.#call<OpenApiDocument>("GET", "/v1/openapi.json", undefined, opts);
  }

  // ---- the journal (D5) ------------------------------------------------------------

  /** `GET /v1/journal`: the entries after `after` (default 0: from the first kept), at
   *  most `limit` (berth's default and most: 1000). */
  async readJournal(opts: CallOptions & { after?: number; limit?: number } = {}): Promise<JournalEntry[]> {
    const q = query({ after: opts.after, limit: opts.limit });
    const { status, text } = await this.#getText(`/v1/journal${q}`, NDJSON, opts);
    return parseLines<JournalEntry>(status, text);
  }

  /**
   * `GET /v1/journal/export`: the entries `from` (default 1) `through` (default: the
   * last), or only experiment scope `scope`'s, as the bytes berth stored, with their
   * SHA-256. `BerthError` 410 `journal_pruned` once retention deleted the start.
   */
  async exportJournal(
    opts: CallOptions & { from?: number; through?: number; scope?: string } = {},
  ): Promise<JournalExport> {
    const q = query({ from: opts.from, through: opts.through, scope: opts.scope });
    const { status, headers, text } = await this.#getText(`/v1/journal/export${q}`, NDJSON, opts);
    const header = (name: string): string => {
      const v = headers.get(name);
      if (v === null) throw new BerthError(status, "unexpected_answer", `berth answered an export without ${name}`);
      return v;
    };
    return {
      ndjson: text,
      sha256: header("x-berth-journal-sha256"),
      first: Number(header("x-berth-journal-first")),
      through: Number(header("x-berth-journal-through")),
    };
  }

  /**
   * `GET /v1/events` (server-sent events): journal entries as they are written,
   * filtered by run, project and kinds. A dropped connection, or a `cutoff` event (berth
   * cut off a reader too far behind), is followed by a reconnection with
   * `Last-Event-ID` (after a backoff of at most 1 s), without gaps or duplicates.
   * Runs until `opts.signal` aborts (or the loop is left); a refusal (4xx) throws
   * `BerthError`. Without `after`, the stream starts from now, and a connection dropped
   * before the first entry resumes from its own "now".
   */
  async *events(opts: EventsOptions = {}): AsyncGenerator<JournalEntry, void, undefined> {
    const outer = opts.signal;
    let last: number | undefined = opts.after;
    let resuming = false;
    let backoff = BACKOFF_FIRST_MS;
    const filter = new URLSearchParams();
    if (opts.run !== undefined) filter.set("run", opts.run);
    if (opts.project !== undefined) filter.set("project", opts.project);
    if (opts.kinds !== undefined && opts.kinds.length > 0) filter.set("kind", opts.kinds.join(","));
    while (!outer?.aborted) {
      const q = new URLSearchParams(filter);
      const headers: Record<string, string> = {};
      if (last !== undefined) {
        if (resuming) headers["last-event-id"] = String(last);
        else q.set("after", String(last));
      }
      resuming = true;
      const query = q.size > 0 ? `?${q}` : "";
      const link = linkSignal(outer);
      try {
        let res: Response;
        try {
          res = await this.#send("GET", `/v1/events${query}`, undefined, {
            signal: link.signal,
            accept: "text/event-stream",
            headers,
          });
        } catch (e) {
          if (outer?.aborted) return;
          if (!(e instanceof BerthConnectionError)) throw e;
          await sleep(backoff, outer);
          backoff = Math.min(backoff * 2, BACKOFF_MAX_MS);
          continue;
        }
        if (!res.ok) {
          const err = refusal(res.status, await this.#text(res, outer).catch(() => ""));
          if (res.status < 500) throw err;
          await sleep(backoff, outer);
          backoff = Math.min(backoff * 2, BACKOFF_MAX_MS);
          continue;
        }
        if (res.body === null) throw new BerthConnectionError("berth answered the event stream without a body");
        try {
          for await (const ev of sseEvents(lines(res.body))) {
            if (ev.event === "cutoff") {
              // berth closes the stream after this; resume after what it had sent.
              const cut = parseAnswer<StreamCutoff>(res.status, ev.data);
              if (typeof cut.last_seq === "number") last = Math.max(last ?? 0, cut.last_seq);
              break;
            }
            const entry = parseAnswer<JournalEntry>(res.status, ev.data);
            if (typeof entry.seq !== "number" && ev.id !== undefined) entry.seq = Number(ev.id);
            if (last !== undefined && entry.seq <= last) continue;
            last = entry.seq;
            backoff = BACKOFF_FIRST_MS;
            yield entry;
          }
        } catch (e) {
          if (outer?.aborted) return;
          if (e instanceof BerthError) throw e;
          // A broken connection: reconnect below.
        }
      } finally {
        link.abort();
        link.dispose();
      }
      if (outer?.aborted) return;
      await sleep(backoff, outer);
      backoff = Math.min(backoff * 2, BACKOFF_MAX_MS);
    }
  }

  // ---- tokens (admin) --------------------------------------------------------------

  /** `GET /v1/tokens`: every token's id, scope, user and expiry (never a secret). */
  async listTokens(opts: CallOptions = {}): Promise<TokenList> {
    return this.#call<TokenList>("GET", "/v1/tokens", undefined, opts);
  }

  /** `POST /v1/tokens`: a new token of `scope` (`read`, `operator`, `admin`), shown once. */
  async createToken(req: TokenRequest, opts: CallOptions = {}): Promise<TokenCreated> {
    return this.#call<TokenCreated>("POST", "/v1/tokens", req, opts);
  }

  /** `DELETE /v1/tokens/{id}`: refused from then on, here and after restarts. */
  async revokeToken(tokenId: string, opts: CallOptions = {}): Promise<TokenInfo> {
    return this.#call<TokenInfo>("DELETE", `/v1/tokens/${seg("token id", tokenId)}`, undefined, opts);
  }

  // ---- agent threads and the drain (G0–G4) -----------------------------------------

  /** `POST /v1/threads/{key}/attach`: registers the thread for `claim.run_id` until
   *  `claim.run_budget_ms` from now (G1); 409 `registration_mismatch` names the owner. */
  async attachThread(key: string, claim: ThreadClaim, opts: CallOptions = {}): Promise<Thread> {
    return this.#call<Thread>("POST", `/v1/threads/${seg("thread key", key)}/attach`, claim, opts);
  }

  /** `POST /v1/threads/{key}/deadline`: the owner moves its registration's deadline to
   *  `claim.run_budget_ms` from now (G3). */
  async moveThreadDeadline(key: string, claim: ThreadClaim, opts: CallOptions = {}): Promise<Thread> {
    return this.#call<Thread>("POST", `/v1/threads/${seg("thread key", key)}/deadline`, claim, opts);
  }

  /** `POST /v1/threads/{key}/detach`: the owner ends its registration (G3); with
   *  `claim.evict`, the thread's workspace goes too. */
  async detachThread(key: string, claim: ThreadClaim, opts: CallOptions = {}): Promise<Thread> {
    return this.#call<Thread>("POST", `/v1/threads/${seg("thread key", key)}/detach`, claim, opts);
  }

  /** `GET /v1/threads/{key}`: owner, registration, workspace, evictions. */
  async getThread(key: string, opts: CallOptions = {}): Promise<Thread> {
    return this.#call<Thread>("GET", `/v1/threads/${seg("thread key", key)}`, undefined, opts);
  }

  /** `DELETE /v1/threads/{key}`: evicts the thread's workspace (refused while registered). */
  async evictThread(key: string, opts: CallOptions = {}): Promise<Thread> {
    return this.#call<Thread>("DELETE", `/v1/threads/${seg("thread key", key)}`, undefined, opts);
  }

  /** `GET /v1/threads`: every thread. */
  async listThreads(opts: CallOptions = {}): Promise<ThreadList> {
    return this.#call<ThreadList>("GET", "/v1/threads", undefined, opts);
  }

  /** `GET /v1/drain`: the drain in force, if any, and what it waits for (G4). */
  async getDrain(opts: CallOptions = {}): Promise<Drain> {
    return this.#call<Drain>("GET", "/v1/drain", undefined, opts);
  }

  /** `POST /v1/drain {reason?}`: no new runs or registrations until `endDrain` (G4). */
  async startDrain(req: DrainRequest = {}, opts: CallOptions = {}): Promise<Drain> {
    return this.#call<Drain>("POST", "/v1/drain", req, opts);
  }

  /** `DELETE /v1/drain`: ends the drain. */
  async endDrain(opts: CallOptions = {}): Promise<Drain> {
    return this.#call<Drain>("DELETE", "/v1/drain", undefined, opts);
  }

  /** `POST /v1/fleet/drain {reason?}`: fleet mode, every host admits nothing new until `endFleetDrain`. */
  async startFleetDrain(req: DrainRequest = {}, opts: CallOptions = {}): Promise<Drain> {
    return this.#call<Drain>("POST", "/v1/fleet/drain", req, opts);
  }

  /** `DELETE /v1/fleet/drain`: ends the fleet's drain. */
  async endFleetDrain(opts: CallOptions = {}): Promise<Drain> {
    return this.#call<Drain>("DELETE", "/v1/fleet/drain", undefined, opts);
  }

  // ---- experiment scopes and their tokens (B1–B6) ----------------------------------

  /** `GET /v1/scopes`: every scope's control, generation and tokens per harness. */
  async listScopes(opts: CallOptions = {}): Promise<ScopeList> {
    return this.#call<ScopeList>("GET", "/v1/scopes", undefined, opts);
  }

  /** `GET /v1/scopes/{id}`: policy, manifest, tokens and owners, control, waiters (B6). */
  async getScope(scope: string, opts: CallOptions = {}): Promise<Scope> {
    return this.#call<Scope>("GET", `/v1/scopes/${seg("scope", scope)}`, undefined, opts);
  }

  /** `DELETE /v1/scopes/{id}`: forgets an idle scope (409 `scope_in_use` otherwise; S10). */
  async forgetScope(scope: string, opts: CallOptions = {}): Promise<ScopeSummary> {
    return this.#call<ScopeSummary>("DELETE", `/v1/scopes/${seg("scope", scope)}`, undefined, opts);
  }

  /** `POST /v1/scopes/{id}/reservations`: a turn's token, by `(owner, operation_id)`;
   *  a retry gets the same token (`new: false`); 409 `budget_full` never queues (B2). */
  async reserveToken(scope: string, req: ReservationRequest, opts: CallOptions = {}): Promise<Reservation> {
    return this.#call<Reservation>("POST", `/v1/scopes/${seg("scope", scope)}/reservations`, req, opts);
  }

  /** `DELETE /v1/scopes/{id}/reservations/{owner}/{operation_id}`: the owner gives its
   *  token back (B3). */
  async unreserveToken(scope: string, owner: string, operationId: string, opts: CallOptions = {}): Promise<ScopeToken> {
    const p = `${seg("scope", scope)}/reservations/${seg("owner", owner)}/${seg("operation id", operationId)}`;
    return this.#call<ScopeToken>("DELETE", `/v1/scopes/${p}`, undefined, opts);
  }

  /** `POST /v1/scopes/{id}/reconcile` (admin): frees every token `req.owner` holds (B3). */
  async reconcileScope(scope: string, req: ReconcileRequest, opts: CallOptions = {}): Promise<Reconciled> {
    return this.#call<Reconciled>("POST", `/v1/scopes/${seg("scope", scope)}/reconcile`, req, opts);
  }

  /** `POST /v1/scopes/{id}/control`: `pause`, `stop` or `resume`; the same `request_id`
   *  again answers the same receipt (B4). */
  async controlScope(scope: string, req: ControlRequest, opts: CallOptions = {}): Promise<ControlReceipt> {
    return this.#call<ControlReceipt>("POST", `/v1/scopes/${seg("scope", scope)}/control`, req, opts);
  }

  /** `withBerth(this, req, fn, opts)`. */
  withBerth<T>(
    req: AcquireRequest,
    fn: (lease: GrantedRun, signal: AbortSignal) => Promise<T>,
    opts: CallOptions = {},
  ): Promise<T> {
    return withBerth(this, req, fn, opts);
  }

  // ---- plumbing --------------------------------------------------------------------

  /** One JSON request: the answer parsed, or the refusal thrown. */
  async #call<T>(method: string, path: string, body: unknown, opts: CallOptions): Promise<T> {
    const res = await this.#send(method, path, body, { signal: opts.signal });
    const text = await this.#text(res, opts.signal);
    if (!res.ok) throw refusal(res.status, text);
    return parseAnswer<T>(res.status, text);
  }

  /** One `GET` whose answer is not JSON: its text and headers, or the refusal thrown. */
  async #getText(
    path: string,
    accept: string,
    opts: CallOptions,
  ): Promise<{ status: number; headers: Headers; text: string }> {
    const res = await this.#send("GET", path, undefined, { signal: opts.signal, accept });
    const text = await this.#text(res, opts.signal);
    if (!res.ok) throw refusal(res.status, text);
    return { status: res.status, headers: res.headers, text };
  }

  async #send(
    method: string,
    path: string,
    body: unknown,
    init: { signal?: AbortSignal | undefined; accept?: string; headers?: Record<string, string> },
  ): Promise<Response> {
    const headers: Record<string, string> = { accept: init.accept ?? "application/json", ...init.headers };
    if (this.#token !== null) headers["authorization"] = `Bearer ${this.#token}`;
    const request: RequestInit = { method, headers };
    if (body !== undefined) {
      headers["content-type"] = "application/json";
      request.body = JSON.stringify(body);
    }
    if (init.signal !== undefined) request.signal = init.signal;
    const url = `${this.baseUrl}${path}`;
    try {
      return await this.#fetch(url, request);
    } catch (e) {
      if (init.signal?.aborted) throw e;
      throw new BerthConnectionError(`berth at ${this.baseUrl}: ${describe(e)}`, { cause: e });
    }
  }

  async #text(res: Response, signal: AbortSignal | undefined): Promise<string> {
    try {
      return await res.text();
    } catch (e) {
      if (signal?.aborted) throw e;
      throw new BerthConnectionError(`berth at ${this.baseUrl}: reading the answer: ${describe(e)}`, { cause: e });
    }
  }
}

/** The methods of `BerthClient` by name. */
type Method = { [K in keyof BerthClient]: BerthClient[K] extends (...args: never[]) => unknown ? K : never }[keyof BerthClient];

/**
 * Each operation of the OpenAPI document (its `operationId`) and the `BerthClient` method
 * that calls it (`acquireStream` calls `acquireRun` too). tsc checks that it names every
 * operation of src/schema.ts, and a test that it covers docs/openapi.json and that a
 * daemon answers each, so a new endpoint needs a method here.
 */
export const OPERATIONS = {
  listRuns: "listRuns",
  acquireRun: "acquire",
  getRun: "getRun",
  cancelRun: "cancelRun",
  getStatus: "status",
  getFleet: "fleet",
  checkFence: "checkFence",
  readJournal: "readJournal",
  exportJournal: "exportJournal",
  streamEvents: "events",
  getMetrics: "getMetrics",
  renewRun: "renew",
  releaseRun: "release",
  registerProcess: "registerProcess",
  startRuntime: "startRuntime",
  listTokens: "listTokens",
  createToken: "createToken",
  revokeToken: "revokeToken",
  reap: "reap",
  getDashboard: "getDashboard",
  getOpenApi: "getOpenApi",
  attachThread: "attachThread",
  moveThreadDeadline: "moveThreadDeadline",
  detachThread: "detachThread",
  getThread: "getThread",
  evictThread: "evictThread",
  listThreads: "listThreads",
  getDrain: "getDrain",
  startDrain: "startDrain",
  endDrain: "endDrain",
  startFleetDrain: "startFleetDrain",
  endFleetDrain: "endFleetDrain",
  getIdle: "getIdle",
  listScopes: "listScopes",
  getScope: "getScope",
  forgetScope: "forgetScope",
  reserveToken: "reserveToken",
  unreserveToken: "unreserveToken",
  reconcileScope: "reconcileScope",
  controlScope: "controlScope",
} as const satisfies Record<OperationId, Method>;

/**
 * Holds a lease around `fn`: acquires (waiting as `req.wait_s` allows), renews every
 * third of the lease's ttl, and releases when `fn` settles. If the lease is lost (a
 * renewal refused with 404, 409 or 410, or no renewal succeeding before it expires),
 * `fn`'s signal aborts with a `LeaseLostError` and so does the returned promise, at
 * once; the lease is then not released (it is gone).
 *
 * `fn`'s own error is rethrown after the release (a release error then is dropped);
 * after a successful `fn`, a failed release rejects with its error. `opts.signal` aborts
 * the acquire and, once granted, `fn`'s signal (the lease is still released).
 */
export async function withBerth<T>(
  client: BerthClient,
  req: AcquireRequest,
  fn: (lease: GrantedRun, signal: AbortSignal) => Promise<T>,
  opts: CallOptions = {},
): Promise<T> {
  const { detach, ...waiting } = req;
  if (detach === true) throw new TypeError("berth withBerth: holds a lease, so its acquire must not detach");
  const lease = await client.acquire(waiting, opts);
  const fence = lease.fence;
  const runId = lease.run_id;
  // The lease's own ttl (berth's default or its ttl_max may have decided it), counted
  // on this clock (from the grant's answer, then from before each renewal), so that no
  // skew between this clock and berth's stretches it.
  const ttlMs = lease.ttl_ms;
  const every = Math.max(ttlMs / 3, 50);
  let expiresAt = Date.now() + ttlMs;

  const ctl = new AbortController();
  const onOuterAbort = () => ctl.abort(opts.signal?.reason);
  opts.signal?.addEventListener("abort", onOuterAbort, { once: true });
  if (opts.signal?.aborted) onOuterAbort();

  let lost: LeaseLostError | undefined;
  let rejectLost: (e: LeaseLostError) => void = () => {};
  const lostP = new Promise<never>((_, reject) => {
    rejectLost = reject;
  });
  lostP.catch(() => {});
  const loseLease = (why: string, cause: unknown) => {
    if (lost !== undefined) return;
    lost = new LeaseLostError(runId, fence, `lease of run ${runId} (fence ${fence}) lost: ${why}`, { cause });
    ctl.abort(lost);
    rejectLost(lost);
  };

  let stopped = false;
  let timer: ReturnType<typeof setTimeout> | undefined;
  let inflight: Promise<void> | undefined;
  let renewing: AbortController | undefined;
  const schedule = (ms: number) => {
    if (stopped || lost !== undefined) return;
    timer = setTimeout(() => {
      inflight = renewOnce();
    }, ms);
  };
  const renewOnce = async () => {
    const call = new AbortController();
    renewing = call;
    const limitMs = Math.max(every, 1000);
    const limit = setTimeout(() => call.abort(new Error(`no answer within ${limitMs} ms`)), limitMs);
    try {
      const sent = Date.now();
      await client.renew(runId, fence, undefined, { signal: call.signal });
      expiresAt = sent + ttlMs;
      schedule(every);
    } catch (e) {
      if (stopped) return;
      if (e instanceof BerthError && (e.status === 404 || e.status === 409 || e.status === 410)) {
        loseLease(`renewal refused: ${e.status} ${e.code}: ${e.message}`, e);
        return;
      }
      const left = expiresAt - Date.now();
      if (left <= 0) {
        loseLease(`no renewal succeeded before it expired (last: ${describe(e)})`, e);
        return;
      }
      schedule(Math.max(50, Math.min(BACKOFF_MAX_MS, left)));
    } finally {
      clearTimeout(limit);
    }
  };
  schedule(every);

  let outcome: { ok: true; value: T } | { ok: false; error: unknown };
  try {
    const work = Promise.resolve().then(() => fn(lease, ctl.signal));
    work.catch(() => {});
    outcome = { ok: true, value: await Promise.race([work, lostP]) };
  } catch (error) {
    outcome = { ok: false, error };
  }
  stopped = true;
  if (timer !== undefined) clearTimeout(timer);
  renewing?.abort(new Error("withBerth is done"));
  await inflight;
  opts.signal?.removeEventListener("abort", onOuterAbort);

  if (!outcome.ok) {
    if (lost !== undefined) throw lost;
    try {
      await client.release(runId, fence);
    } catch {
      // fn's error says more than the release's.
    }
    throw outcome.error;
  }
  if (lost === undefined) await client.release(runId, fence);
  return outcome.value;
}

// ---- helpers -----------------------------------------------------------------------

function describe(e: unknown): string {
  if (e instanceof Error) {
    const cause = (e as { cause?: unknown }).cause;
    return cause instanceof Error ? `${e.message} (${cause.message})` : e.message;
  }
  return String(e);
}

/** `value`, which must be a non-empty string; else a `TypeError` naming it. */
function nonEmpty(what: string, value: string): string {
  if (typeof value !== "string" || value === "") {
    throw new TypeError(`berth: the ${what} must be a non-empty string, not ${JSON.stringify(value) ?? String(value)}`);
  }
  return value;
}

/** A path parameter: a non-empty string, percent-encoded. */
function seg(what: string, value: string): string {
  return encodeURIComponent(nonEmpty(what, value));
}

/** `?name=value&…` of the parameters given (none: ""); a number must be a non-negative
 *  integer, else a `TypeError` naming it. */
function query(params: Record<string, string | number | boolean | undefined>): string {
  const q = new URLSearchParams();
  for (const [name, value] of Object.entries(params)) {
    if (value === undefined) continue;
    if (typeof value === "number" && !(Number.isSafeInteger(value) && value >= 0)) {
      throw new TypeError(`berth: ${name} must be a non-negative integer, not ${value}`);
    }
    q.set(name, String(value));
  }
  return q.size > 0 ? `?${q}` : "";
}

/** The run an acquire answered, which must hold its lease; `BerthError` if not. */
function granted(run: Run): GrantedRun {
  if (isGranted(run)) return run;
  throw new BerthError(
    201,
    "unexpected_answer",
    `berth answered an acquire with run ${run.run_id} ${run.state}${run.fence === null ? " without a fence" : ""}, not a lease`,
  );
}

/** NDJSON: each non-empty line as JSON. */
function parseLines<T>(status: number, text: string): T[] {
  return text
    .split("\n")
    .filter((line) => line.trim() !== "")
    .map((line) => parseAnswer<T>(status, line));
}

/** A 2xx body (or one stream line) as JSON; `BerthError` `unexpected_answer` if not. */
function parseAnswer<T>(status: number, text: string): T {
  try {
    return JSON.parse(text) as T;
  } catch {
    throw new BerthError(status, "unexpected_answer", `berth answered ${status} with a body that is not API v1: ${clip(text)}`);
  }
}

/** A non-2xx answer as `BerthError`, from `{"error":{code,message,details}}`. */
function refusal(status: number, text: string): BerthError {
  try {
    const body = JSON.parse(text) as Partial<ErrorBody> | null;
    const e = body?.error;
    if (e && typeof e.code === "string") {
      return new BerthError(status, e.code, typeof e.message === "string" ? e.message : "", (e.details ?? null) as JsonValue);
    }
  } catch {
    // Not JSON: fall through.
  }
  return new BerthError(status, "unexpected_answer", `berth answered ${status} with a body that is not API v1: ${clip(text)}`);
}

function clip(s: string): string {
  return s.length > 200 ? `${s.slice(0, 200)}…` : s;
}

/** An AbortController that follows `outer`; `dispose` stops following it. */
function linkSignal(outer: AbortSignal | undefined): { signal: AbortSignal; abort(): void; dispose(): void } {
  const ctl = new AbortController();
  const follow = () => ctl.abort(outer?.reason);
  if (outer !== undefined) {
    if (outer.aborted) follow();
    else outer.addEventListener("abort", follow, { once: true });
  }
  return {
    signal: ctl.signal,
    abort: () => ctl.abort(),
    dispose: () => outer?.removeEventListener("abort", follow),
  };
}

/** Resolves after `ms`, or at once when `signal` aborts. */
function sleep(ms: number, signal: AbortSignal | undefined): Promise<void> {
  return new Promise((resolve) => {
    if (signal?.aborted) return resolve();
    const done = () => {
      clearTimeout(t);
      signal?.removeEventListener("abort", done);
      resolve();
    };
    const t = setTimeout(done, ms);
    signal?.addEventListener("abort", done, { once: true });
  });
}

/** The body's lines (split on `\n`, a trailing `\r` dropped), the last one even
 *  without a newline. Cancels the body when the loop is left early. */
async function* lines(body: ReadableStream<Uint8Array>): AsyncGenerator<string, void, undefined> {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  let done = false;
  try {
    for (;;) {
      const chunk = await reader.read();
      if (chunk.done) break;
      buf += decoder.decode(chunk.value, { stream: true });
      let nl: number;
      while ((nl = buf.indexOf("\n")) >= 0) {
        const line = buf.slice(0, nl);
        buf = buf.slice(nl + 1);
        yield line.endsWith("\r") ? line.slice(0, -1) : line;
      }
    }
    done = true;
    buf += decoder.decode();
    if (buf !== "") yield buf.endsWith("\r") ? buf.slice(0, -1) : buf;
  } finally {
    if (!done) await reader.cancel().catch(() => {});
    reader.releaseLock();
  }
}

interface SseEvent {
  id: string | undefined;
  event: string;
  data: string;
}

/** Server-sent events from lines: `id:`, `event:`, `data:` (joined by newlines) until a
 *  blank line; comments (`:…`, berth's heartbeats) and other fields are skipped. */
async function* sseEvents(input: AsyncIterable<string>): AsyncGenerator<SseEvent, void, undefined> {
  let id: string | undefined;
  let event = "";
  let data: string[] = [];
  for await (const line of input) {
    if (line === "") {
      if (data.length > 0) yield { id, event: event === "" ? "message" : event, data: data.join("\n") };
      event = "";
      data = [];
      continue;
    }
    if (line.startsWith(":")) continue;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    switch (field) {
      case "id":
        id = value;
        break;
      case "event":
        event = value;
        break;
      case "data":
        data.push(value);
        break;
      default:
        break;
    }
  }
}
