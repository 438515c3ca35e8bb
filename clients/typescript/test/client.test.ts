// The client against a real daemon: `BERTH_BIN=/path/to/berth npm test`.
//
// One daemon for the file, with one slot, so a second run always waits; each test
// leaves no run holding the slot.

import { after, before, test } from "node:test";
import assert from "node:assert/strict";

import {
  BerthClient,
  BerthError,
  LeaseLostError,
  withBerth,
  type AcquireRequest,
  type GrantedRun,
  type JournalEntry,
  type Run,
} from "../src/index.js";
import { sleep, startDaemon, type Daemon } from "./daemon.js";

const MiB = 1024 * 1024;
/** Small enough for any host; named so that no default depends on the host's size. */
const SMALL: AcquireRequest["resources"] = { memory: 64 * MiB, cpu_millis: 100, disk: MiB };

let daemon: Daemon | undefined;
let client: BerthClient;

before(async () => {
  daemon = await startDaemon(["--slots-max", "1"]);
  client = daemon.client;
});

after(async () => {
  await daemon?.stop();
});

/** The state of every queued run, polled until there is none or `ms` pass. */
async function queuedAfter(ms: number): Promise<Run[]> {
  const deadline = Date.now() + ms;
  for (;;) {
    const queued = (await client.listRuns()).runs.filter((r) => r.state === "queued");
    if (queued.length === 0 || Date.now() > deadline) return queued;
    await sleep(100);
  }
}

test("acquire, renew and release a lease; its fence is not current afterwards", { timeout: 30_000 }, async () => {
  const lease = await client.acquire({ project: "t1", ttl_s: 30, wait_s: 10, resources: SMALL });
  assert.equal(lease.state, "granted");
  const fence = lease.fence;
  assert.ok(fence > 0);
  assert.equal(lease.env["BERTH_FENCE"], String(fence));
  assert.equal(lease.env["BERTH_RUN_ID"], lease.run_id);
  assert.equal(lease.claim.resources["memory"], 64 * MiB);
  assert.equal(lease.ttl_ms, 30_000, "the lease's ttl is the one asked for");
  assert.ok(Date.parse(lease.expires_at) > Date.now(), `expires_at ${lease.expires_at} is past`);
  assert.deepEqual(await client.checkFence(lease.run_id, fence), {
    run_id: lease.run_id,
    fence,
    current: true,
    state: "granted",
  });

  await sleep(20);
  const renewed = await client.renew(lease.run_id, fence);
  assert.equal(renewed.fence, fence);
  assert.ok(
    Date.parse(renewed.expires_at ?? "") > Date.parse(lease.expires_at),
    `renew moved expires_at from ${lease.expires_at} to ${renewed.expires_at}`,
  );
  const longer = await client.renew(lease.run_id, fence, 120);
  assert.ok(
    Date.parse(longer.expires_at ?? "") >= Date.parse(lease.expires_at) + 89_000,
    `a renew with ttl_s 120 moved expires_at from ${lease.expires_at} to ${longer.expires_at}`,
  );

  const released = await client.release(lease.run_id, fence);
  assert.equal(released.run_id, lease.run_id);
  assert.equal(released.state, "released");
  assert.deepEqual(await client.checkFence(lease.run_id, fence), {
    run_id: lease.run_id,
    fence,
    current: false,
    state: "released",
  });
  assert.equal((await client.getRun(lease.run_id)).state, "released");
  // Told the state last seen (granted), a long poll answers at once: the run moved on.
  const t0 = Date.now();
  assert.equal((await client.getRun(lease.run_id, { wait_s: 30, state: "granted" })).state, "released");
  assert.ok(Date.now() - t0 < 10_000, `answered after ${Date.now() - t0} ms`);
});

test("a second acquire waits while the slot is held; aborting its stream cancels it", { timeout: 30_000 }, async () => {
  const holder = await client.acquire({ project: "t2-holder", ttl_s: 60, wait_s: 10, resources: SMALL });
  try {
    // The long poll waits for its whole wait_s, then answers 410 expired.
    const t0 = Date.now();
    await assert.rejects(client.acquire({ project: "t2-poll", wait_s: 1, resources: SMALL }), (e: unknown) => {
      assert.ok(e instanceof BerthError, `not a BerthError: ${String(e)}`);
      assert.equal(e.status, 410);
      assert.equal(e.code, "expired");
      return true;
    });
    assert.ok(Date.now() - t0 >= 900, `the acquire answered after ${Date.now() - t0} ms, without waiting`);

    const ctl = new AbortController();
    const stream = client.acquireStream(
      { project: "t2-stream", wait_s: 60, resources: SMALL },
      { signal: ctl.signal },
    );
    const first = await stream.next();
    assert.equal(first.done, false);
    const ev = first.value;
    assert.ok(ev !== undefined && ev.event === "queued", `first event: ${JSON.stringify(ev)}`);
    assert.equal(ev.position, 1);
    assert.ok(ev.reason !== null, "a queued event says why it waits");
    assert.ok(ev.reason.code.length > 0 && ev.reason.message.length > 0);
    const waiting = await client.getRun(ev.run_id);
    assert.equal(waiting.state, "queued");
    assert.equal(waiting.position, 1);
    assert.deepEqual(
      (await client.listRuns()).runs.filter((r) => r.state === "queued").map((r) => r.run_id),
      [ev.run_id],
    );

    ctl.abort();
    await assert.rejects(stream.next(), (e: unknown) => {
      assert.equal((e as Error).name, "AbortError");
      return true;
    });
    const left = await queuedAfter(5_000);
    assert.deepEqual(left.map((r) => r.run_id), [], "no run is queued 5 s after the abort");
    assert.equal((await client.getRun(ev.run_id)).state, "cancelled");
  } finally {
    await client.release(holder.run_id, holder.fence);
  }
});

test("a stale fence is refused with 409 stale_fence", { timeout: 30_000 }, async () => {
  const lease = await client.acquire({ project: "t3", ttl_s: 30, wait_s: 10, resources: SMALL });
  const fence = lease.fence;
  try {
    await assert.rejects(client.renew(lease.run_id, fence + 1), (e: unknown) => {
      assert.ok(e instanceof BerthError, `not a BerthError: ${String(e)}`);
      assert.equal(e.status, 409);
      assert.equal(e.code, "stale_fence");
      assert.ok(e.message.length > 0);
      const details = e.details as Record<string, unknown>;
      assert.equal(details["fence"], fence + 1);
      assert.equal(details["current_fence"], fence);
      return true;
    });
    await assert.rejects(client.release(lease.run_id, fence + 1), (e: unknown) => {
      assert.ok(e instanceof BerthError);
      assert.equal(e.code, "stale_fence");
      return true;
    });
    // The refusals changed nothing.
    assert.equal((await client.checkFence(lease.run_id, fence)).current, true);
  } finally {
    await client.release(lease.run_id, fence);
  }
});

test("fleet() on a host without fleet mode is refused with 404 fleet_mode_off", { timeout: 30_000 }, async () => {
  await assert.rejects(client.fleet(), (e: unknown) => {
    assert.ok(e instanceof BerthError, `not a BerthError: ${String(e)}`);
    assert.equal(e.status, 404);
    assert.equal(e.code, "fleet_mode_off");
    return true;
  });
});

test("withBerth runs fn with a lease and releases it after", { timeout: 30_000 }, async () => {
  let seen: GrantedRun | undefined;
  let signal: AbortSignal | undefined;
  const out = await withBerth(client, { project: "t4a", ttl_s: 30, wait_s: 10, resources: SMALL }, async (lease, s) => {
    seen = lease;
    signal = s;
    assert.equal(lease.state, "granted");
    assert.equal((await client.checkFence(lease.run_id, lease.fence)).current, true);
    return 42;
  });
  assert.equal(out, 42);
  assert.ok(seen !== undefined && signal !== undefined);
  assert.equal(signal.aborted, false);
  assert.equal((await client.getRun(seen.run_id)).state, "released");
});

test("withBerth renews a short lease while fn outlives its ttl", { timeout: 30_000 }, async () => {
  let seen: GrantedRun | undefined;
  const out = await client.withBerth({ project: "t4b", ttl_s: 3, wait_s: 10, resources: SMALL }, async (lease, signal) => {
    seen = lease;
    await sleep(5_000);
    assert.equal(signal.aborted, false, `fn's signal aborted: ${String(signal.reason)}`);
    const now = await client.getRun(lease.run_id);
    assert.equal(now.state, "granted");
    assert.ok(
      Date.parse(now.expires_at ?? "") > Date.parse(lease.expires_at) + 1_000,
      `expires_at moved from ${lease.expires_at} to ${now.expires_at}`,
    );
    assert.equal((await client.checkFence(lease.run_id, lease.fence)).current, true);
    return "kept";
  });
  assert.equal(out, "kept");
  assert.ok(seen !== undefined);
  assert.equal((await client.getRun(seen.run_id)).state, "released");
});

test("withBerth aborts fn and rejects with LeaseLostError when the lease is lost", { timeout: 30_000 }, async () => {
  let seen: GrantedRun | undefined;
  let abortedWith: unknown;
  const started = Date.now();
  const run = withBerth(client, { project: "t4c", ttl_s: 3, wait_s: 10, resources: SMALL }, async (lease, signal) => {
    seen = lease;
    // Behind withBerth's back: its next renewal is refused.
    await client.release(lease.run_id, lease.fence);
    await new Promise<void>((resolve, reject) => {
      const t = setTimeout(() => reject(new Error("fn's signal did not abort within 5 s")), 5_000);
      signal.addEventListener(
        "abort",
        () => {
          clearTimeout(t);
          abortedWith = signal.reason;
          resolve();
        },
        { once: true },
      );
    });
    return "should not be returned";
  });
  await assert.rejects(run, (e: unknown) => {
    assert.ok(e instanceof LeaseLostError, `not a LeaseLostError: ${String(e)}`);
    assert.equal(e.runId, seen?.run_id);
    assert.ok(e.cause instanceof BerthError && [404, 409, 410].includes(e.cause.status), `cause: ${String(e.cause)}`);
    return true;
  });
  assert.ok(abortedWith instanceof LeaseLostError, `fn's signal aborted with ${String(abortedWith)}`);
  // Noticed at the first renewal, a third of the 3 s ttl in.
  assert.ok(Date.now() - started < 2_900, `the loss was noticed after ${Date.now() - started} ms`);
  assert.ok(seen !== undefined);
  assert.equal((await client.getRun(seen.run_id)).state, "released");
});

// `GET /v1/events` is planned (D5): a daemon without it answers 404 and this test fails.
test("events: a run's journal in order, resumed after a given seq", { timeout: 30_000 }, async () => {
  const lease = await client.acquire({ project: "t5", ttl_s: 30, wait_s: 10, resources: SMALL });
  await client.release(lease.run_id, lease.fence);

  const got: JournalEntry[] = [];
  const ctl = new AbortController();
  const timer = setTimeout(() => ctl.abort(), 10_000);
  try {
    for await (const e of client.events({ after: 0, run: lease.run_id, signal: ctl.signal })) {
      got.push(e);
      if (e.kind === "ended") break;
    }
  } finally {
    clearTimeout(timer);
  }
  const kinds = got.map((e) => e.kind);
  assert.ok(kinds.includes("granted"), `kinds: ${kinds.join(", ")}`);
  assert.ok(kinds.includes("ended"), `no ended entry within 10 s; kinds: ${kinds.join(", ")}`);
  for (const e of got) assert.equal(e.run_id, lease.run_id);
  for (let i = 1; i < got.length; i++) {
    assert.ok(got[i]!.seq > got[i - 1]!.seq, `seqs: ${got.map((e) => e.seq).join(", ")}`);
  }

  const granted = got.find((e) => e.kind === "granted")!;
  const ctl2 = new AbortController();
  const timer2 = setTimeout(() => ctl2.abort(), 10_000);
  let next: JournalEntry | undefined;
  try {
    for await (const e of client.events({ after: granted.seq, signal: ctl2.signal })) {
      next = e;
      break;
    }
  } finally {
    clearTimeout(timer2);
  }
  assert.ok(next !== undefined, "the resumed stream yielded nothing within 10 s");
  assert.equal(next.seq, granted.seq + 1);
});
