// The whole API through the client: `OPERATIONS` names a method for every operationId
// of docs/openapi.json, and each operation is called through its method against a real
// daemon and answered. The requests are recorded as they go over the wire (by matching
// each one to the document's method and path), so an operation the document gains
// without a method here, or a method that calls the wrong route, fails.

import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { createHash } from "node:crypto";
import { mkdir, mkdtemp, readFile, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

import {
  BerthClient,
  BerthError,
  OPERATIONS,
  type AcquireRequest,
  type FetchLike,
  type JournalEntry,
  type OperationId,
} from "../src/index.js";
import { freePort, startDaemon, type Daemon } from "./daemon.js";

// Compiled to dist/test/: the package root is two levels up, the repository's four.
const DOCUMENT = resolve(dirname(fileURLToPath(import.meta.url)), "../../../../docs/openapi.json");

interface Operation {
  id: string;
  method: string;
  /** The path with each `{param}` matching one segment. */
  route: RegExp;
}

/** Every operation of the checked-in document. */
async function documented(): Promise<Operation[]> {
  const doc = JSON.parse(await readFile(DOCUMENT, "utf8")) as {
    paths: Record<string, Record<string, { operationId?: string }>>;
  };
  const ops: Operation[] = [];
  for (const [path, item] of Object.entries(doc.paths)) {
    const route = new RegExp(`^${path.replace(/[.]/g, "\\.").replace(/\{[^}]+\}/g, "[^/]+")}$`);
    for (const [method, op] of Object.entries(item)) {
      if (typeof op === "object" && op !== null && typeof op.operationId === "string") {
        ops.push({ id: op.operationId, method: method.toUpperCase(), route });
      }
    }
  }
  return ops;
}

/** Operations this daemon can only refuse, and the refusal that proves the route was
 *  reached: fleet mode needs a PostgreSQL store (`--store`), which `npm test` has not. */
const REFUSED_HERE: Partial<Record<OperationId, string>> = {
  getFleet: "fleet_mode_off",
  startFleetDrain: "fleet_mode_off",
  endFleetDrain: "fleet_mode_off",
};

const MiB = 1024 * 1024;
const SMALL: AcquireRequest["resources"] = { memory: 64 * MiB, cpu_millis: 100, disk: MiB };

let daemon: Daemon | undefined;
let client: BerthClient;
let webPort: number;
let scratch: string | undefined;
/** Each request the client sent: its operationId (or `METHOD path` if none) and status. */
const sent: { op: string; status: number }[] = [];
/** The `OPERATIONS` methods called. */
const used = new Set<string>();

before(async () => {
  const ops = await documented();
  webPort = await freePort();
  daemon = await startDaemon(["--slots-max", "4", "--port-range", `${webPort}-${webPort}`]);
  const recording: FetchLike = async (url, init) => {
    const res = await fetch(url, init);
    const method = init?.method ?? "GET";
    const { pathname } = new URL(url);
    const op = ops.find((o) => o.method === method && o.route.test(pathname));
    sent.push({ op: op?.id ?? `${method} ${pathname}`, status: res.status });
    return res;
  };
  client = new BerthClient({ baseUrl: daemon.baseUrl, token: daemon.token, fetch: recording });
  // Each method of OPERATIONS, wrapped on this instance to note that it was called.
  const methods = client as unknown as Record<string, (...args: unknown[]) => unknown>;
  for (const name of new Set<string>(Object.values(OPERATIONS))) {
    const method = methods[name];
    assert.equal(typeof method, "function", `OPERATIONS names ${name}, which BerthClient has not`);
    methods[name] = (...args: unknown[]) => {
      used.add(name);
      return method.apply(client, args);
    };
  }
  scratch = await mkdtemp(join(tmpdir(), "berth-ts-ops-"));
});

after(async () => {
  await daemon?.stop();
  if (scratch !== undefined) await rm(scratch, { recursive: true, force: true });
});

/** Rejects with BerthError `status` `code`. */
async function refused(call: Promise<unknown>, status: number, code: string): Promise<void> {
  await assert.rejects(call, (e: unknown) => {
    assert.ok(e instanceof BerthError, `not a BerthError: ${String(e)}`);
    assert.equal(`${e.status} ${e.code}`, `${status} ${code}`, e.message);
    return true;
  });
}

/** A worktree (at a commit) whose contract has one port: a node HTTP server on $PORT. */
async function webWorktree(dir: string): Promise<string> {
  await mkdir(join(dir, ".git"), { recursive: true });
  await writeFile(join(dir, ".git/HEAD"), `${"a".repeat(40)}\n`);
  const server = `require("http").createServer((q, s) => s.end("served by berth")).listen(Number(process.env.PORT), "127.0.0.1")`;
  const contract = [
    "[[port]]",
    'name = "web"',
    `launch = { command = ${JSON.stringify(process.execPath)}, args = ["-e", ${JSON.stringify(server)}] }`,
    'ready = { http = "/", expect_status = 200, timeout_s = 30, interval_ms = 100 }',
    "",
  ].join("\n");
  await writeFile(join(dir, ".berth.toml"), contract);
  return dir;
}

/**
 * A process to register: a node process in a process group of its own (berth refuses
 * group leaders, so it is the leader's child), whose exit the leader reports as
 * `exit <signal>` on stdout.
 */
function processToRegister(): Promise<{ pid: number; exited: Promise<string>; kill(): void }> {
  const script = `
    const c = require("child_process").spawn(process.execPath, ["-e", "setInterval(() => {}, 1000)"], { stdio: "ignore" });
    console.log(c.pid);
    c.on("exit", (code, signal) => { console.log("exit " + (signal ?? code)); process.exit(0); });`;
  const leader = spawn(process.execPath, ["-e", script], { detached: true, stdio: ["ignore", "pipe", "ignore"] });
  let out = "";
  const lines: ((line: string) => void)[] = [];
  leader.stdout.on("data", (b: Buffer) => {
    out += b.toString();
    let nl: number;
    while ((nl = out.indexOf("\n")) >= 0) {
      const line = out.slice(0, nl);
      out = out.slice(nl + 1);
      lines.shift()?.(line);
    }
  });
  const next = () => new Promise<string>((resolve) => lines.push(resolve));
  const pid = next();
  const exited = next();
  const kill = () => {
    try {
      if (leader.pid !== undefined && leader.exitCode === null) process.kill(-leader.pid, "SIGKILL");
    } catch {
      // Gone already.
    }
  };
  return pid.then((p) => ({ pid: Number(p), exited, kill }));
}

/** `p`, or a rejection after `ms`. */
function within<T>(ms: number, p: Promise<T>, what: string): Promise<T> {
  let timer: ReturnType<typeof setTimeout> | undefined;
  const late = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${what}: nothing within ${ms} ms`)), ms);
  });
  return Promise.race([p, late]).finally(() => clearTimeout(timer));
}

test("OPERATIONS names a BerthClient method for every operationId of docs/openapi.json", async () => {
  const ids = (await documented()).map((o) => o.id);
  assert.ok(ids.length > 0, "the document has no operations");
  assert.equal(new Set(ids).size, ids.length, "an operationId is used twice");
  assert.deepEqual(Object.keys(OPERATIONS).sort(), [...ids].sort(), "OPERATIONS and the document's operationIds differ");
  const notMethods = Object.entries(OPERATIONS).filter(
    ([, name]) => typeof (BerthClient.prototype as unknown as Record<string, unknown>)[name] !== "function",
  );
  assert.deepEqual(notMethods, [], "OPERATIONS maps these to no method of BerthClient");
});

test("README.md's table names each operation's method", async () => {
  const readme = await readFile(resolve(dirname(fileURLToPath(import.meta.url)), "../../README.md"), "utf8");
  const missing = Object.entries(OPERATIONS).filter(([id, method]) => !readme.includes(`| \`${id}\` | \`${method}\``));
  assert.deepEqual(missing, [], "rows README.md lacks (| `operationId` | `method` | …)");
});

test("every operation, called through its method, is answered by a real daemon", { timeout: 120_000 }, async () => {
  assert.ok(scratch !== undefined);
  // Public pages and the document itself (the daemon serves the checked-in one).
  const served = await client.getOpenApi();
  const checkedIn = JSON.parse(await readFile(DOCUMENT, "utf8")) as { paths: object };
  assert.equal(served.openapi, "3.1.0");
  assert.deepEqual(Object.keys(served.paths).sort(), Object.keys(checkedIn.paths).sort());
  assert.match(await client.getDashboard(), /<html/i);
  assert.deepEqual(await client.getIdle(), { idle: true, busy: [] });
  assert.equal((await client.status()).slots_max, 4);

  // Runs: a lease holding a singleton and a budget token, and one with a runtime.
  const a = await client.acquire({
    project: "ops-a",
    run_id: "ops-a",
    ttl_s: 60,
    wait_s: 10,
    resources: SMALL,
    singletons: ["db"],
    budget: { scope: "exp-a", harness: "h", per_harness: { h: 3 } },
  });
  const wt = await webWorktree(join(scratch, "wt"));
  const web = await client.acquire({ project: "ops-web", run_id: "ops-web", worktree: wt, ttl_s: 60, wait_s: 10, resources: SMALL });
  assert.equal(web.ports["web"], webPort);
  assert.deepEqual((await client.listRuns()).runs.map((r) => r.run_id).sort(), ["ops-a", "ops-web"]);
  assert.equal((await client.getRun(a.run_id)).fence, a.fence);
  assert.deepEqual(await client.checkFence(a.run_id, a.fence), { run_id: "ops-a", fence: a.fence, current: true, state: "granted" });
  const renewed = await client.renew(a.run_id, a.fence, 600);
  assert.ok(Date.parse(renewed.expires_at ?? "") > Date.now() + 300_000, `renewed to ${renewed.expires_at}`);

  const started = await client.startRuntime(web.run_id, web.fence);
  assert.deepEqual(started.ports, { web: webPort });
  assert.deepEqual(started.events.map((e) => e.event), ["launched", "ready", "done"]);
  assert.equal(await (await fetch(`http://127.0.0.1:${webPort}/`)).text(), "served by berth");

  const proc = await processToRegister();
  try {
    assert.equal((await client.registerProcess(a.run_id, a.fence, proc.pid)).run_id, a.run_id);

    // A detached waiter behind the singleton: followed, then cancelled.
    const c = await client.acquire({ project: "ops-c", singletons: ["db"], wait_s: 60, detach: true, resources: SMALL });
    assert.equal(c.state, "queued");
    const still = await client.getRun(c.run_id, { wait_s: 1 });
    assert.equal(still.state, "queued");
    assert.equal(still.position, 1);
    assert.equal((await client.cancelRun(c.run_id)).state, "cancelled");

    // Threads: registered for run a, moved, ended, evicted.
    const claim = { run_id: a.run_id, owner_gen: "g1", owner_fence: 1 };
    const attached = await client.attachThread("ops-thread", { ...claim, run_budget_ms: 60_000 });
    assert.equal(attached.registration?.live, true);
    const moved = await client.moveThreadDeadline("ops-thread", { ...claim, run_budget_ms: 600_000 });
    assert.ok(
      Date.parse(moved.registration?.deadline ?? "") > Date.parse(attached.registration?.deadline ?? "") + 500_000,
      `deadline ${attached.registration?.deadline} moved to ${moved.registration?.deadline}`,
    );
    assert.deepEqual(await client.getThread("ops-thread"), moved);
    assert.deepEqual((await client.listThreads()).threads.map((t) => t.key), ["ops-thread"]);
    const idle = await client.getIdle();
    assert.equal(idle.idle, false);
    assert.deepEqual(idle.busy.map((b) => `${b.kind} ${b.id}`).sort(), ["registration ops-thread", "run ops-a", "run ops-web"]);
    assert.equal((await client.detachThread("ops-thread", claim)).registration ?? null, null);
    const evicted = await client.evictThread("ops-thread");
    assert.deepEqual(evicted.evictions.map((e) => e.reason), ["operator"]);

    // The drain: in force until ended, waiting for the live runs.
    const drain = await client.startDrain({ reason: "ts client test" });
    assert.equal(drain.draining, true);
    assert.equal(drain.drain?.reason, "ts client test");
    assert.deepEqual((await client.getDrain()).waiting_for.map((b) => b.id).sort(), ["ops-a", "ops-web"]);
    assert.equal((await client.endDrain()).draining, false);

    // Tokens: a read token works until it is revoked, and only for reading.
    const made = await client.createToken({ scope: "read", expires_s: 600 });
    assert.equal(made.scope, "read");
    assert.ok(made.id !== undefined && made.token.length > 0);
    const listed = (await client.listTokens()).tokens.find((t) => t.id === made.id);
    assert.equal(listed?.scope, "read");
    assert.equal(listed?.expired, false);
    const reader = new BerthClient({ baseUrl: client.baseUrl, token: made.token });
    assert.equal((await reader.getRun(a.run_id)).run_id, a.run_id);
    await assert.rejects(reader.reap(), (e: unknown) => e instanceof BerthError && e.status === 403);
    assert.equal((await client.revokeToken(made.id)).id, made.id);
    await assert.rejects(reader.status(), (e: unknown) => e instanceof BerthError && e.status === 401);

    // Scopes: run a holds one of exp-a's three tokens; an agent reserves, gives back,
    // reserves again, and an operator frees what it holds.
    const summary = (await client.listScopes()).scopes.find((s) => s.scope === "exp-a");
    assert.deepEqual(summary?.harnesses, { h: { limit: 3, held: 1, lapsed: 0 } });
    const scope = await client.getScope("exp-a");
    assert.deepEqual(scope.tokens.map((t) => `${t.owner}/${t.operation_id}`), ["ops-a/run"]);
    const turn = { owner: "agent-1", operation_id: "turn-1", harness: "h" };
    assert.equal((await client.reserveToken("exp-a", turn)).new, true);
    assert.equal((await client.reserveToken("exp-a", turn)).new, false, "a retry gets the same token");
    assert.equal((await client.unreserveToken("exp-a", "agent-1", "turn-1")).operation_id, "turn-1");
    await client.reserveToken("exp-a", { ...turn, operation_id: "turn-2" });
    const freed = await client.reconcileScope("exp-a", { owner: "agent-1", reason: "ts client test" });
    assert.deepEqual(freed.freed.map((t) => t.operation_id), ["turn-2"]);

    // Control (of another scope: a scope that was ever controlled is never idle).
    const b = await client.acquire({
      project: "ops-b",
      ttl_s: 60,
      wait_s: 10,
      resources: SMALL,
      workspace: false,
      budget: { scope: "exp-b", harness: "h", per_harness: { h: 1 } },
    });
    await client.release(b.run_id, b.fence);
    const paused = await client.controlScope("exp-b", { request_id: "pause-1", mode: "pause" });
    assert.equal(paused.control, "paused");
    assert.deepEqual(await client.controlScope("exp-b", { request_id: "pause-1", mode: "pause" }), paused);
    assert.equal((await client.controlScope("exp-b", { request_id: "resume-1", mode: "resume" })).control, "open");
    await refused(client.forgetScope("exp-b"), 409, "scope_in_use");

    // Released: the registered process is stopped with the run, and its scope is idle.
    assert.match((await client.release(a.run_id, a.fence)).state, /^releas(ing|ed)$/);
    assert.equal(await within(10_000, proc.exited, "the registered process's exit"), "exit SIGTERM");
    let state = (await client.getRun(a.run_id)).state;
    for (let i = 0; state === "releasing" && i < 10; i++) state = (await client.getRun(a.run_id, { wait_s: 2 })).state;
    assert.equal(state, "released");
    assert.equal((await client.forgetScope("exp-a")).scope, "exp-a");
    await refused(client.getScope("exp-a"), 404, "not_found");
    await client.release(web.run_id, web.fence);
  } finally {
    proc.kill();
  }

  // The host: a reaper pass, the metrics, the journal (read, exported, streamed).
  const reaped = await client.reap();
  for (const field of ["examined", "reaped", "degraded", "processes_terminated"] as const) {
    assert.equal(typeof reaped[field], "number", field);
  }
  const metrics = await client.getMetrics();
  assert.match(metrics, /^berth_\w+/m);
  assert.ok(metrics.endsWith("# EOF\n"), "OpenMetrics text ends with # EOF");

  const journal = await client.readJournal({ after: 0 });
  assert.equal(journal[0]?.seq, 1);
  journal.forEach((e, i) => assert.equal(e.seq, i + 1, "seqs without gaps"));
  assert.ok(journal.some((e) => e.kind === "granted" && e.run_id === "ops-a"));
  assert.deepEqual((await client.readJournal({ after: 1, limit: 1 })).map((e) => e.seq), [2]);
  const exported = await client.exportJournal();
  assert.equal(createHash("sha256").update(exported.ndjson).digest("hex"), exported.sha256);
  assert.equal(exported.first, 1);
  assert.equal(exported.ndjson.trimEnd().split("\n").length, exported.through);
  const ofScope = await client.exportJournal({ scope: "exp-b" });
  const entries = ofScope.ndjson.trimEnd().split("\n").map((l) => JSON.parse(l) as JournalEntry);
  assert.ok(entries.length > 0 && entries.every((e) => e.data["scope"] === "exp-b"), ofScope.ndjson);

  const ctl = new AbortController();
  const timer = setTimeout(() => ctl.abort(), 10_000);
  try {
    for await (const e of client.events({ after: 0, run: "ops-a", signal: ctl.signal })) {
      assert.equal(e.run_id, "ops-a");
      break;
    }
  } finally {
    clearTimeout(timer);
  }

  await refused(client.fleet(), 404, REFUSED_HERE.getFleet ?? "");
  await refused(client.startFleetDrain({ reason: "ts" }), 404, REFUSED_HERE.startFleetDrain ?? "");
  await refused(client.endFleetDrain(), 404, REFUSED_HERE.endFleetDrain ?? "");
});

test("the daemon test called every operationId of docs/openapi.json, each answered", async () => {
  const ids = (await documented()).map((o) => o.id as OperationId);
  const unknown = sent.filter((s) => !ids.includes(s.op as OperationId));
  assert.deepEqual(unknown, [], "requests that match no operation of the document");
  const answered = (id: OperationId) => {
    const refusal = REFUSED_HERE[id];
    return sent.some((s) => s.op === id && (refusal === undefined ? s.status < 300 : s.status === 404));
  };
  assert.deepEqual(ids.filter((id) => !answered(id)), [], "operations never answered through the client");
  assert.deepEqual(ids.filter((id) => !used.has(OPERATIONS[id])), [], "operations whose OPERATIONS method was never called");
});
