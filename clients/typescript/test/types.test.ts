// The lease's type (`GrantedRun`, `isGranted`) and the client's checks of what it is
// given and of what it is answered, against a scripted fetch (no daemon needed).
//
// The functions exported below are compile-time checks: they are never run, but
// `npm test` compiles them under strict mode first, so tsc fails if a granted lease's
// fields become nullable again (a `!` would be needed) or if an `@ts-expect-error` below
// stops being an error (the narrowing then proves nothing).

import { test } from "node:test";
import assert from "node:assert/strict";

import {
  BerthClient,
  BerthError,
  isGranted,
  withBerth,
  type BerthClientOptions,
  type FetchLike,
  type GrantedRun,
  type Run,
} from "../src/index.js";

// ---- compile-time checks -----------------------------------------------------------

export async function acquiredLeaseNeedsNoBang(client: BerthClient): Promise<number> {
  const lease = await client.acquire({ project: "p", ttl_s: 60 });
  return lease.fence + 1 + lease.ttl_ms + Date.parse(lease.expires_at);
}

export function withBerthLeaseNeedsNoBang(client: BerthClient): Promise<number> {
  return withBerth(client, { project: "p" }, async (lease) => lease.fence + lease.ttl_ms);
}

export async function streamedLeaseNeedsNoBang(client: BerthClient): Promise<number> {
  for await (const ev of client.acquireStream({ project: "p" })) {
    if (ev.event === "granted") return ev.lease.fence + 1;
  }
  return 0;
}

export function onlyIsGrantedNarrowsARun(run: Run): number {
  if (isGranted(run)) return run.fence + 1;
  // @ts-expect-error a Run's fence may be null until isGranted says otherwise
  return run.fence + 1;
}

export async function aDetachedAcquireIsNotALease(client: BerthClient): Promise<number> {
  const run = await client.acquire({ project: "p", detach: true });
  // @ts-expect-error a detached acquire may answer a queued run, without a fence
  return run.fence + 1;
}

// ---- a scripted berth --------------------------------------------------------------

const NOW = "2026-01-01T00:00:00.000Z";

/** A run as berth shows it, `state` and the lease's fields as given. */
function runOf(state: Run["state"], lease: { fence?: number | null; expires_at?: string | null; ttl_ms?: number | null }): Run {
  return {
    claim: { keys: [], resources: { slots: 1 } },
    class: "managed",
    deadline: null,
    env: {},
    expires_at: lease.expires_at ?? null,
    ttl_ms: lease.ttl_ms ?? null,
    ending: null,
    fence: lease.fence ?? null,
    labels: {},
    ports: {},
    position: state === "queued" ? 1 : null,
    priority: "foreground",
    project: "p",
    reason: null,
    run_id: "r-1",
    since: NOW,
    state,
    survivors: [],
    usage: null,
    workspace: null,
    worktree: null,
  };
}

const LEASE = { fence: 7, expires_at: NOW, ttl_ms: 60_000 };

/** A client whose every request is answered `status` `body` (`content-type` as given),
 *  and the URLs it asked for. */
function scripted(status: number, body: string, type = "application/json"): { client: BerthClient; urls: string[] } {
  const urls: string[] = [];
  const fetch: FetchLike = async (url) => {
    urls.push(url);
    return new Response(body, { status, headers: { "content-type": type } });
  };
  return { client: new BerthClient({ baseUrl: "http://berth.test:7420", token: "t", fetch }), urls };
}

// ---- the tests ---------------------------------------------------------------------

test("isGranted: a granted run with its fence, expiry and ttl, and nothing else", () => {
  assert.equal(isGranted(runOf("granted", LEASE)), true);
  // Another user's granted run: berth hides its fence (S9).
  assert.equal(isGranted(runOf("granted", { ...LEASE, fence: null })), false);
  assert.equal(isGranted(runOf("granted", { ...LEASE, ttl_ms: null })), false);
  assert.equal(isGranted(runOf("granted", { ...LEASE, expires_at: null })), false);
  for (const state of ["queued", "releasing", "released", "expired", "cancelled", "degraded"] as const) {
    assert.equal(isGranted(runOf(state, LEASE)), false, state);
  }
});

test("acquire answers a GrantedRun, and rejects an answer that is not a lease", async () => {
  const good: GrantedRun = await scripted(201, JSON.stringify(runOf("granted", LEASE))).client.acquire({ project: "p" });
  assert.equal(good.fence, 7);

  const { client } = scripted(201, JSON.stringify(runOf("granted", { ...LEASE, fence: null })));
  await assert.rejects(client.acquire({ project: "p" }), (e: unknown) => {
    assert.ok(e instanceof BerthError, `not a BerthError: ${String(e)}`);
    assert.equal(e.code, "unexpected_answer");
    assert.match(e.message, /r-1 granted without a fence/);
    return true;
  });
  await assert.rejects(
    scripted(201, JSON.stringify(runOf("queued", {}))).client.acquire({ project: "p" }),
    (e: unknown) => e instanceof BerthError && e.code === "unexpected_answer" && /r-1 queued/.test(e.message),
  );
  await assert.rejects(
    scripted(201, "<html>a proxy</html>", "text/html").client.acquire({ project: "p" }),
    (e: unknown) => e instanceof BerthError && e.code === "unexpected_answer" && /not API v1/.test(e.message),
  );
});

test("a detached acquire answers the queued run as it is", async () => {
  const run = await scripted(202, JSON.stringify(runOf("queued", {}))).client.acquire({ project: "p", detach: true });
  assert.equal(run.state, "queued");
  assert.equal(run.fence, null);
});

test("acquireStream checks the granted lease too", async () => {
  const line = (ev: object) => `${JSON.stringify(ev)}\n`;
  const queued = line({ event: "queued", run_id: "r-1", position: 1, reason: null });
  const ok = scripted(201, queued + line({ event: "granted", lease: runOf("granted", LEASE) }), "application/x-ndjson");
  const events = [];
  for await (const ev of ok.client.acquireStream({ project: "p" })) events.push(ev);
  assert.deepEqual(events.map((e) => e.event), ["queued", "granted"]);

  const bad = scripted(201, queued + line({ event: "granted", lease: runOf("granted", {}) }), "application/x-ndjson");
  await assert.rejects(
    (async () => {
      for await (const _ of bad.client.acquireStream({ project: "p" })) void _;
    })(),
    (e: unknown) => e instanceof BerthError && e.code === "unexpected_answer",
  );
});

test("bad arguments are refused with a TypeError naming them, before any request", async () => {
  const { client, urls } = scripted(200, "{}");
  const refused: [Promise<unknown>, RegExp][] = [
    [client.getRun(""), /run id must be a non-empty string, not ""/],
    [client.renew(undefined as unknown as string, 1), /run id must be a non-empty string, not undefined/],
    [client.checkFence("r-1", 1.5), /fence must be a non-negative integer, not 1.5/],
    [client.getRun("r-1", { wait_s: -1 }), /wait_s must be a non-negative integer, not -1/],
    [client.readJournal({ after: Number.NaN }), /after must be a non-negative integer, not NaN/],
    [client.unreserveToken("s", "", "op"), /owner must be a non-empty string/],
    [client.revokeToken(42 as unknown as string), /token id must be a non-empty string, not 42/],
    [client.attachThread("", { run_id: "r-1", owner_gen: "g", owner_fence: 1 }), /thread key/],
    [withBerth(client, { project: "p", detach: true }, async () => 0), /must not detach/],
  ];
  for (const [call, message] of refused) {
    await assert.rejects(call, (e: unknown) => e instanceof TypeError && message.test(e.message), String(message));
  }
  assert.deepEqual(urls, [], "nothing was sent");
  assert.throws(() => new BerthClient({ baseUrl: "localhost:7420" }), /must be http:\/\/host:port/);
  assert.throws(() => new BerthClient({} as BerthClientOptions), /berth baseUrl undefined: must be http/);
});

test("path parameters are percent-encoded, query parameters sent as given", async () => {
  const { client, urls } = scripted(200, "{}");
  await client.getThread("a/b c");
  await client.unreserveToken("exp", "owner/1", "op?2");
  await client.cancelRun("r-1", { fence: 3 });
  await client.checkFence("a/b", 1);
  await client.listRuns({ all: true, limit: 5 });
  await client.exportJournal({ from: 2, through: 9, scope: "exp" }).catch(() => undefined);
  assert.deepEqual(
    urls.map((u) => u.slice("http://berth.test:7420".length)),
    [
      "/v1/threads/a%2Fb%20c",
      "/v1/scopes/exp/reservations/owner%2F1/op%3F2",
      "/v1/runs/r-1?fence=3",
      "/v1/fences/check?run_id=a%2Fb&fence=1",
      "/v1/runs?all=true&limit=5",
      "/v1/journal/export?from=2&through=9&scope=exp",
    ],
  );
});

test("an export without its digest header is not taken for one", async () => {
  await assert.rejects(
    scripted(200, "", "application/x-ndjson").client.exportJournal(),
    (e: unknown) => e instanceof BerthError && e.code === "unexpected_answer" && /x-berth-journal-sha256/.test(e.message),
  );
});
