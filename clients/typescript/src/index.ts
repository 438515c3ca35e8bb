// berth's HTTP API v1 for TypeScript: a fetch-based client, the streamed acquire, the
// event stream (`GET /v1/events`) and `withBerth`, which holds a lease around a task.
//
// The wire types are in ./wire.ts only (see the note there); this file declares none.

import type {
  AcquireEvent,
  AcquireRequest,
  ErrorBody,
  FenceCheck,
  Fleet,
  JournalEntry,
  JsonValue,
  ProcessRequest,
  ReleaseRequest,
  RenewRequest,
  Run,
  RunList,
  Status,
  StreamCutoff,
} from "./wire.js";

export type * from "./wire.js";

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
   *  the body was not API v1. */
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
/** The daemon's default lease, when neither the grant nor the request says. */
const DEFAULT_TTL_S = 300;
const BACKOFF_FIRST_MS = 100;
const BACKOFF_MAX_MS = 1000;

/** A handle on one berth daemon. Every method is one HTTP request (or one stream). */
export class BerthClient {
  readonly baseUrl: string;
  readonly #token: string | null;
  readonly #fetch: FetchLike;

  constructor(options: BerthClientOptions) {
    const url = options.baseUrl.replace(/\/+$/, "");
    if (!/^https?:\/\/[^/]+/.test(url)) {
      throw new TypeError(`berth baseUrl ${JSON.stringify(options.baseUrl)}: must be http://host:port`);
    }
    this.baseUrl = url;
    this.#token = options.token ?? null;
    this.#fetch = options.fetch ?? ((input, init) => globalThis.fetch(input, init));
  }

  /**
   * `POST /v1/runs`: waits (long-poll) until the run is granted and answers its lease.
   * Throws `BerthError` 410 `expired` when `wait_s` runs out, and any other refusal.
   */
  acquire(req: AcquireRequest, opts: CallOptions = {}): Promise<Run> {
    return this.#call<Run>("POST", "/v1/runs", req, opts);
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
  async *acquireStream(req: AcquireRequest, opts: CallOptions = {}): AsyncGenerator<AcquireEvent, void, undefined> {
    const link = linkSignal(opts.signal);
    try {
      const res = await this.#send("POST", "/v1/runs", req, { signal: link.signal, accept: NDJSON });
      if (!res.ok) throw refusal(res.status, await this.#text(res, opts.signal));
      const type = res.headers.get("content-type") ?? "";
      if (!type.includes(NDJSON)) {
        // Not streamed after all: a plain answer is the lease.
        const lease = parseAnswer<Run>(res.status, await this.#text(res, opts.signal));
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
          yield event;
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
  renew(runId: string, fence: number, ttl_s?: number, opts: CallOptions = {}): Promise<Run> {
    const body: RenewRequest = ttl_s === undefined ? { fence } : { fence, ttl_s };
    return this.#call<Run>("POST", `/v1/runs/${enc(runId)}/renew`, body, opts);
  }

  /** `POST /v1/runs/{id}/release {fence}`: answers once the run's processes are
   *  stopped and its workspace is gone (or it is degraded). */
  release(runId: string, fence: number, opts: CallOptions = {}): Promise<Run> {
    const body: ReleaseRequest = { fence };
    return this.#call<Run>("POST", `/v1/runs/${enc(runId)}/release`, body, opts);
  }

  /** `POST /v1/runs/{id}/processes {fence, pid}`: berth stops this process tree when
   *  the run ends (P1). */
  registerProcess(runId: string, fence: number, pid: number, opts: CallOptions = {}): Promise<Run> {
    const body: ProcessRequest = { fence, pid };
    return this.#call<Run>("POST", `/v1/runs/${enc(runId)}/processes`, body, opts);
  }

  /** `GET /v1/runs/{id}`. */
  getRun(runId: string, opts: CallOptions = {}): Promise<Run> {
    return this.#call<Run>("GET", `/v1/runs/${enc(runId)}`, undefined, opts);
  }

  /** `GET /v1/runs`: live runs; with `all`, ended runs still remembered too. */
  listRuns(opts: CallOptions & { all?: boolean; limit?: number } = {}): Promise<RunList> {
    const q = new URLSearchParams();
    if (opts.all !== undefined) q.set("all", String(opts.all));
    if (opts.limit !== undefined) q.set("limit", String(opts.limit));
    const query = q.size > 0 ? `?${q}` : "";
    return this.#call<RunList>("GET", `/v1/runs${query}`, undefined, opts);
  }

  /** `GET /v1/status`: capacity, queue, projects, reaper (A12). */
  status(opts: CallOptions = {}): Promise<Status> {
    return this.#call<Status>("GET", "/v1/status", undefined, opts);
  }

  /** `GET /v1/fences/check`: is `fence` still the lease of `runId` (L8)? */
  checkFence(runId: string, fence: number, opts: CallOptions = {}): Promise<FenceCheck> {
    const q = new URLSearchParams({ run_id: runId, fence: String(fence) });
    return this.#call<FenceCheck>("GET", `/v1/fences/check?${q}`, undefined, opts);
  }

  /**
   * `GET /v1/fleet`: every live host's capacity and queue, the fleet's sums and the dead
   * hosts (F4; `404 fleet_mode_off` on a host without `--store`).
   */
  fleet(opts: CallOptions = {}): Promise<Fleet> {
    return this.#call<Fleet>("GET", "/v1/fleet", undefined, opts);
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

  /** `withBerth(this, req, fn, opts)`. */
  withBerth<T>(
    req: AcquireRequest,
    fn: (lease: Run, signal: AbortSignal) => Promise<T>,
    opts: CallOptions = {},
  ): Promise<T> {
    return withBerth(this, req, fn, opts);
  }

  // ---- plumbing --------------------------------------------------------------------

  async #call<T>(method: string, path: string, body: unknown, opts: CallOptions): Promise<T> {
    const res = await this.#send(method, path, body, { signal: opts.signal });
    const text = await this.#text(res, opts.signal);
    if (!res.ok) throw refusal(res.status, text);
    return parseAnswer<T>(res.status, text);
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
  fn: (lease: Run, signal: AbortSignal) => Promise<T>,
  opts: CallOptions = {},
): Promise<T> {
  const lease = await client.acquire(req, opts);
  const fence = lease.fence;
  const runId = lease.run_id;
  if (fence === null) {
    throw new BerthError(201, "unexpected_answer", `run ${runId} was granted without a fence`);
  }
  const grantedAt = Date.now();
  const requestedMs = (req.ttl_s ?? DEFAULT_TTL_S) * 1000;
  let expiresAt = parseTime(lease.expires_at) ?? grantedAt + requestedMs;
  let ttlMs = expiresAt - grantedAt;
  if (!(ttlMs > 0)) ttlMs = requestedMs;
  // A clock skewed ahead of berth's must not stretch the interval past what was asked.
  if (req.ttl_s != null) ttlMs = Math.min(ttlMs, req.ttl_s * 1000);
  const every = Math.max(ttlMs / 3, 50);
  if (!(expiresAt > grantedAt)) expiresAt = grantedAt + ttlMs;

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
      const r = await client.renew(runId, fence, undefined, { signal: call.signal });
      expiresAt = parseTime(r.expires_at) ?? Date.now() + ttlMs;
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

function enc(s: string): string {
  return encodeURIComponent(s);
}

function describe(e: unknown): string {
  if (e instanceof Error) {
    const cause = (e as { cause?: unknown }).cause;
    return cause instanceof Error ? `${e.message} (${cause.message})` : e.message;
  }
  return String(e);
}

function parseTime(s: string | null | undefined): number | undefined {
  if (s === null || s === undefined) return undefined;
  const t = Date.parse(s);
  return Number.isFinite(t) ? t : undefined;
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
