// The package as a user gets it: `npm pack` makes a tarball, which installs (offline:
// it has no dependencies) into a fresh project, where an ESM script imports it by its
// name and a strict TypeScript file type-checks against the declarations it ships. So
// a `files`, `main`, `types` or `exports` of package.json that leaves something out, or
// points where nothing is, fails here.
//
// Packed with --ignore-scripts: `npm test` has just built dist/ (the `prepare` script
// would build it again).

import { test } from "node:test";
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { mkdir, mkdtemp, readdir, readFile, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";

import { OPERATIONS } from "../src/index.js";

// Compiled to dist/test/: the package root is two levels up.
const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), "../..");
const run = promisify(execFile);

interface Manifest {
  name: string;
  main: string;
  types: string;
  exports: Record<string, Record<string, string>>;
}

const CHECK = `
import { BerthClient, BerthError, OPERATIONS, isGranted, withBerth } from "@berth/client";
import * as wire from "@berth/client/wire";
const client = new BerthClient({ baseUrl: "http://127.0.0.1:1" });
console.log(JSON.stringify({
  from: import.meta.resolve("@berth/client"),
  exports: [BerthClient, BerthError, isGranted, withBerth].map((f) => typeof f),
  operations: Object.keys(OPERATIONS),
  methods: Object.values(OPERATIONS).filter((m) => typeof client[m] !== "function"),
  wire: typeof wire,
}));
`;

const CONSUMER = `
import { BerthClient, isGranted, type GrantedRun, type Run } from "@berth/client";
import type { Status } from "@berth/client/wire";
export const next = (lease: GrantedRun): number => lease.fence + 1;
export const status = (c: BerthClient): Promise<Status> => c.status();
export const held = (r: Run): boolean => isGranted(r);
`;

test("npm pack: the tarball installs offline, imports by name and type-checks", { timeout: 180_000 }, async () => {
  const pkg = JSON.parse(await readFile(join(ROOT, "package.json"), "utf8")) as Manifest;
  const work = await mkdtemp(join(tmpdir(), "berth-ts-pack-"));
  try {
    const { stdout } = await run("npm", ["pack", "--json", "--ignore-scripts", "--pack-destination", work], { cwd: ROOT });
    const [packed] = JSON.parse(stdout) as { name: string; filename: string; files: { path: string }[] }[];
    assert.ok(packed !== undefined, `npm pack said: ${stdout}`);
    assert.equal(packed.name, pkg.name);
    const files = packed.files.map((f) => f.path);

    // Every declaration tsc made for src/, and everything package.json points at.
    const declarations = (await readdir(join(ROOT, "dist/src"))).filter((f) => f.endsWith(".d.ts"));
    assert.ok(declarations.includes("index.d.ts") && declarations.includes("wire.d.ts"), `dist/src: ${declarations}`);
    const wanted = [
      ...declarations.map((f) => `dist/src/${f}`),
      pkg.main,
      pkg.types,
      ...Object.values(pkg.exports).flatMap((conditions) => Object.values(conditions)),
    ].map((p) => p.replace(/^\.\//, ""));
    assert.deepEqual(wanted.filter((p) => !files.includes(p)), [], `the tarball has: ${files.join(", ")}`);
    assert.deepEqual(files.filter((p) => p.startsWith("dist/test/")), [], "tests are not shipped");

    const project = join(work, "project");
    await mkdir(project);
    await writeFile(join(project, "package.json"), JSON.stringify({ name: "berth-pack-check", private: true, type: "module" }));
    await run("npm", ["install", join(work, packed.filename), "--no-audit", "--no-fund", "--offline"], { cwd: project });

    await writeFile(join(project, "check.mjs"), CHECK);
    const out = JSON.parse((await run(process.execPath, ["check.mjs"], { cwd: project })).stdout) as {
      from: string;
      exports: string[];
      operations: string[];
      methods: string[];
      wire: string;
    };
    assert.ok(out.from.includes(`/node_modules/${pkg.name}/`), `imported from ${out.from}`);
    assert.deepEqual(out.exports, ["function", "function", "function", "function"]);
    assert.deepEqual(out.operations, Object.keys(OPERATIONS));
    assert.deepEqual(out.methods, [], "OPERATIONS names methods the installed BerthClient has not");
    assert.equal(out.wire, "object");

    // The shipped declarations, resolved through `exports`, under strict mode.
    await writeFile(join(project, "consumer.ts"), CONSUMER);
    const tsc = join(ROOT, "node_modules/typescript/bin/tsc");
    const flags = ["--noEmit", "--strict", "--target", "es2022", "--module", "nodenext", "--moduleResolution", "nodenext"];
    const types = ["--typeRoots", join(ROOT, "node_modules/@types"), "--types", "node"];
    await run(process.execPath, [tsc, ...flags, ...types, "consumer.ts"], { cwd: project }).catch((e: { stdout?: string }) => {
      assert.fail(`consumer.ts does not type-check against the tarball:\n${e.stdout ?? String(e)}`);
    });
  } finally {
    await rm(work, { recursive: true, force: true });
  }
});
