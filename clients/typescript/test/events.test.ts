// events() against a scripted server (no daemon needed): server-sent events split at
// odd places, heartbeats, a dropped connection and a `cutoff`, each resumed with
// Last-Event-ID without gaps or duplicates.

import { test } from "node:test";
import assert from "node:assert/strict";
import { createServer, type IncomingMessage, type ServerResponse } from "node:http";
import type { AddressInfo } from "node:net";

import { BerthClient, BerthError, type JournalEntry } from "../src/index.js";

type Handler = (req: IncomingMessage, res: ServerResponse, n: number) => void;

async function serve(handler: Handler): Promise<{ url: string; seen: IncomingMessage[]; close(): Promise<void> }> {
  const seen: IncomingMessage[] = [];
  const server = createServer((req, res) => {
    seen.push(req);
    handler(req, res, seen.length);
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  const { port } = server.address() as AddressInfo;
  return {
    url: `http://127.0.0.1:${port}`,
    seen,
    close: () =>
      new Promise<void>((resolve) => {
        server.closeAllConnections();
        server.close(() => resolve());
      }),
  };
}

function entry(seq: number, kind: string): string {
  const e: JournalEntry = { seq, at: "2026-01-01T00:00:00.000Z", kind, run_id: "r-1", data: { n: seq } };
  return `id: ${seq}\nevent: ${kind}\ndata: ${JSON.stringify(e)}\n\n`;
}

test("events() parses SSE and resumes after a drop and a cutoff without gaps or duplicates", { timeout: 20_000 }, async () => {
  const srv = await serve((_req, res, n) => {
    res.writeHead(200, { "content-type": "text/event-stream" });
    if (n === 1) {
      // An event split across writes, a heartbeat, CRLF line ends; then the
      // connection drops mid-event.
      const first = entry(1, "queued");
      res.write(":heartbeat\n\n");
      res.write(first.slice(0, 10));
      setTimeout(() => {
        res.write(first.slice(10));
        res.write(entry(2, "granted").replaceAll("\n", "\r\n"));
        res.write("id: 3\nevent: released\ndata: {\"seq\":3,");
        setTimeout(() => res.socket?.destroy(), 20);
      }, 20);
    } else if (n === 2) {
      // A replay of 2 (skipped), 3, then berth cuts the reader off after 5.
      res.write(entry(2, "granted") + entry(3, "released"));
      res.end(`event: cutoff\ndata: ${JSON.stringify({ reason: "too far behind", last_seq: 5 })}\n\n`);
    } else {
      res.write(entry(6, "ended"));
    }
  });
  const client = new BerthClient({ baseUrl: srv.url + "/", token: "tok" });
  const ctl = new AbortController();
  const got: number[] = [];
  const timer = setTimeout(() => ctl.abort(), 10_000);
  try {
    for await (const e of client.events({ after: 0, run: "r-1", kinds: ["queued", "ended"], signal: ctl.signal })) {
      got.push(e.seq);
      assert.equal(e.data["n"], e.seq);
      if (e.kind === "ended") ctl.abort();
    }
  } finally {
    clearTimeout(timer);
    await srv.close();
  }
  assert.deepEqual(got, [1, 2, 3, 6]);
  assert.equal(srv.seen.length, 3);
  const [a, b, c] = srv.seen;
  assert.equal(a!.url, "/v1/events?run=r-1&kind=queued%2Cended&after=0");
  assert.equal(a!.headers["last-event-id"], undefined);
  assert.equal(a!.headers["authorization"], "Bearer tok");
  assert.equal(a!.headers["accept"], "text/event-stream");
  assert.equal(b!.url, "/v1/events?run=r-1&kind=queued%2Cended");
  assert.equal(b!.headers["last-event-id"], "2");
  assert.equal(c!.headers["last-event-id"], "5");
});

test("events() ends quietly when its signal aborts while waiting", { timeout: 10_000 }, async () => {
  const srv = await serve((_req, res) => {
    res.writeHead(200, { "content-type": "text/event-stream" });
    res.write(":heartbeat\n\n");
  });
  const ctl = new AbortController();
  setTimeout(() => ctl.abort(), 200);
  const got: JournalEntry[] = [];
  try {
    for await (const e of new BerthClient({ baseUrl: srv.url }).events({ signal: ctl.signal })) got.push(e);
  } finally {
    await srv.close();
  }
  assert.deepEqual(got, []);
  assert.equal(srv.seen.length, 1);
  assert.equal(srv.seen[0]!.url, "/v1/events");
  assert.equal(srv.seen[0]!.headers["authorization"], undefined);
});

test("events() throws a refusal as BerthError", { timeout: 10_000 }, async () => {
  const srv = await serve((_req, res) => {
    res.writeHead(400, { "content-type": "application/json" });
    res.end(JSON.stringify({ error: { code: "invalid", message: "kind: too many", details: { field: "kind" } } }));
  });
  try {
    const it = new BerthClient({ baseUrl: srv.url }).events({ kinds: ["x"] });
    await assert.rejects(it.next(), (e: unknown) => {
      assert.ok(e instanceof BerthError);
      assert.equal(e.status, 400);
      assert.equal(e.code, "invalid");
      assert.equal(e.message, "kind: too many");
      assert.deepEqual(e.details, { field: "kind" });
      return true;
    });
  } finally {
    await srv.close();
  }
});
