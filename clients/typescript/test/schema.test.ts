// The checked-in wire types are exactly what openapi-typescript makes of the daemon's
// OpenAPI document (docs/openapi.json, itself pinned to what the daemon serves by the
// daemon's snapshot test). If this fails, run `npm run generate` and commit src/schema.ts.

import { test } from "node:test";
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { mkdtemp, readFile, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";

// Compiled to dist/test/: the package root is two levels up.
const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), "../..");
const DOCUMENT = resolve(ROOT, "../../docs/openapi.json");
const CHECKED_IN = join(ROOT, "src/schema.ts");
const GENERATOR = join(ROOT, "node_modules/openapi-typescript/bin/cli.js");

test("src/schema.ts is generated from docs/openapi.json and not edited", async () => {
  const out = await mkdtemp(join(tmpdir(), "berth-schema-"));
  try {
    const fresh = join(out, "schema.ts");
    await promisify(execFile)(process.execPath, [GENERATOR, DOCUMENT, "-o", fresh]);
    const want = await readFile(fresh, "utf8");
    const have = await readFile(CHECKED_IN, "utf8");
    assert.ok(want.includes("export interface components"), "the generator wrote no schemas");
    assert.equal(have, want, "src/schema.ts is stale: run `npm run generate` in clients/typescript");
  } finally {
    await rm(out, { recursive: true, force: true });
  }
});

test("every schema of the document is a named wire type", async () => {
  // wire.ts gives every component schema its Rust name, so that the rest of the client
  // never reaches into `components` itself; a new wire type must be named there too.
  const doc = JSON.parse(await readFile(DOCUMENT, "utf8")) as {
    components: { schemas: Record<string, unknown> };
  };
  const wire = await readFile(join(ROOT, "src/wire.ts"), "utf8");
  const missing = Object.keys(doc.components.schemas).filter(
    (name) => !wire.includes(`export type ${name} = Schemas["${name}"];`),
  );
  assert.deepEqual(missing, [], "schemas of docs/openapi.json not named in src/wire.ts");
});

test("every journal kind the document lists has its data type", async () => {
  // Issue 35: the daemon's journal kinds and their payload schemas come from one Rust
  // list; JOURNAL_KINDS (and the JournalData map) must name exactly those kinds.
  const doc = JSON.parse(await readFile(DOCUMENT, "utf8")) as {
    components: { schemas: Record<string, Record<string, unknown>> };
  };
  const kinds = doc.components.schemas.JournalEntry["x-berth-journal-kinds"] as Record<string, unknown>;
  const { JOURNAL_KINDS } = await import("../src/wire.js");
  assert.deepEqual([...JOURNAL_KINDS].sort(), Object.keys(kinds).sort());
});
