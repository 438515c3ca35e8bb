// A real daemon for a test file: `berth serve` (the binary BERTH_BIN names) on a free
// port with a fresh state directory, and a client with its admin token. Not a test file
// itself (node --test runs it and finds no tests).

import { spawn } from "node:child_process";
import { mkdtemp, readFile, rm } from "node:fs/promises";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";

import { BerthClient } from "../src/index.js";

export interface Daemon {
  baseUrl: string;
  /** The admin token (`<state dir>/admin.token`). */
  token: string;
  stateDir: string;
  /** A client with the admin token. */
  client: BerthClient;
  /** SIGTERM (SIGKILL after 10 s), then the state directory is deleted. */
  stop(): Promise<void>;
}

export const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms));

/** A port free now (the kernel's pick). */
export function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const srv = createServer();
    srv.once("error", reject);
    srv.listen(0, "127.0.0.1", () => {
      const addr = srv.address();
      const port = typeof addr === "object" && addr !== null ? addr.port : 0;
      srv.close(() => resolve(port));
    });
  });
}

/** Starts `berth serve` with `args` after the common ones (small fixed capacity, no
 *  memory sampling) and waits until it answers `/v1/status`. */
export async function startDaemon(args: string[]): Promise<Daemon> {
  const bin = process.env["BERTH_BIN"];
  if (bin === undefined || bin === "") {
    throw new Error("BERTH_BIN is not set: set it to the berth binary to test against (e.g. target/debug/berth)");
  }
  const stateDir = await mkdtemp(join(tmpdir(), "berth-ts-"));
  const listen = `127.0.0.1:${await freePort()}`;
  const child = spawn(
    bin,
    ["serve", "--state-dir", stateDir, "--listen", listen, "--memory-total", "8GiB", "--cpu-total", "4",
      "--no-memory-sampling", ...args],
    { stdio: ["ignore", "pipe", "pipe"] },
  );
  let log = "";
  const keep = (b: Buffer) => {
    log = (log + b.toString()).slice(-20_000);
  };
  child.stdout?.on("data", keep);
  child.stderr?.on("data", keep);
  let exited: string | undefined;
  let spawnError: Error | undefined;
  child.once("error", (e) => {
    spawnError = e;
  });
  child.once("exit", (code, signal) => {
    exited = `exited with ${code ?? signal}`;
  });
  const stop = async () => {
    if (child.exitCode === null && child.signalCode === null) {
      const gone = new Promise<void>((resolve) => child.once("exit", () => resolve()));
      child.kill("SIGTERM");
      let timer: ReturnType<typeof setTimeout> | undefined;
      const grace = new Promise<boolean>((resolve) => {
        timer = setTimeout(() => resolve(true), 10_000);
      });
      const timedOut = await Promise.race([gone.then(() => false), grace]);
      clearTimeout(timer);
      if (timedOut) {
        child.kill("SIGKILL");
        await gone;
      }
    }
    await rm(stateDir, { recursive: true, force: true });
  };

  const baseUrl = `http://${listen}`;
  const deadline = Date.now() + 20_000;
  for (;;) {
    const failed =
      spawnError !== undefined ? `could not start ${bin}: ${spawnError.message}`
      : exited !== undefined ? `berth serve ${exited} before it answered:\n${log}`
      : Date.now() > deadline ? `berth serve did not answer /v1/status within 20 s:\n${log}`
      : undefined;
    if (failed !== undefined) {
      await stop();
      throw new Error(failed);
    }
    try {
      const token = (await readFile(join(stateDir, "admin.token"), "utf8")).trim();
      const client = new BerthClient({ baseUrl, token });
      await client.status();
      return { baseUrl, token, stateDir, client, stop };
    } catch {
      await sleep(50);
    }
  }
}
