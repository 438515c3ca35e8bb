// berth's dashboard (GET /) in a real browser against a real daemon.
//
//   cd tests/web && npm ci && BERTH_BIN=../../target/debug/berth npm test
//
// Environment:
//   BERTH_BIN       the berth binary to run (required).
//   BERTH_CHROMIUM  Chromium to drive (default /usr/bin/chromium).
//   BERTH_DASHBOARD_URL
//                   load the page from this URL instead of the daemon's own `/`, for
//                   working on the page without rebuilding the daemon: a dev server
//                   that serves a working copy of index.html at `/` and forwards
//                   `/v1/*` to the daemon. `{port}` in it is replaced by the daemon's
//                   port, e.g. BERTH_DASHBOARD_URL='http://127.0.0.1:18080/?upstream={port}'.
//
// The test starts a daemon (one slot), holds one run granted and two waiting, checks
// that the page shows what the API says, releases the granted run and waits for the
// page to follow, saves a screenshot to target/dashboard.png (of a failure:
// target/dashboard-failure.png), and checks that a refused token brings back the login.

import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { mkdtemp, mkdir, readFile, rm } from 'node:fs/promises';
import { createServer } from 'node:net';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { chromium } from 'playwright-core';

const HERE = path.dirname(fileURLToPath(import.meta.url));
const SCREENSHOT = path.resolve(HERE, '../../target/dashboard.png');
const FAILURE_SCREENSHOT = path.resolve(HERE, '../../target/dashboard-failure.png');
const CHROMIUM = process.env.BERTH_CHROMIUM || '/usr/bin/chromium';
const CHROMIUM_ARGS = [
  '--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
  '--disable-background-networking', '--disable-component-update', '--disable-sync',
];

const ctx = {
  daemon: null,       // the child process
  exited: null,       // its exit, once it has
  stderr: '',
  stateDir: null,
  base: null,         // http://127.0.0.1:PORT (the daemon)
  pageUrl: null,      // where the page is loaded from
  token: null,
  browser: null,
  page: null,
  pageErrors: [],
  cspErrors: [],
  waiters: new AbortController(),
  failed: false,      // a step failed: the ones after it, which build on it, are skipped
  granted: null,      // the run granted at the start
  queued: [],         // run ids of the two waiters, in queue order
};

// ---------- helpers ----------

function freePort() {
  return new Promise((resolve, reject) => {
    const s = createServer();
    s.unref();
    s.on('error', reject);
    s.listen(0, '127.0.0.1', () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
  });
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/** Polls `probe` until it returns a truthy value; fails after `ms` naming `what`. */
async function waitFor(what, ms, probe, every = 100) {
  const deadline = Date.now() + ms;
  let last;
  for (;;) {
    try {
      const v = await probe();
      if (v) return v;
      last = undefined;
    } catch (e) {
      last = e;
    }
    if (ctx.exited) throw new Error(`the daemon exited (${ctx.exited}) while waiting for ${what}`);
    if (Date.now() > deadline) {
      throw new Error(`timed out after ${ms / 1000} s waiting for ${what}${last ? `: ${last.message}` : ''}`);
    }
    await sleep(every);
  }
}

/** `promise`, or a failure after `ms` naming `what`. */
async function within(what, ms, promise) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`timed out after ${ms / 1000} s waiting for ${what}`)), ms);
  });
  try {
    return await Promise.race([promise, timeout]);
  } finally {
    clearTimeout(timer);
  }
}

async function api(method, route, body, signal) {
  const res = await fetch(ctx.base + route, {
    method,
    headers: {
      authorization: `Bearer ${ctx.token}`,
      ...(body === undefined ? {} : { 'content-type': 'application/json' }),
    },
    body: body === undefined ? undefined : JSON.stringify(body),
    signal: signal ?? AbortSignal.timeout(10_000),
  });
  const text = await res.text();
  let json;
  try { json = JSON.parse(text); } catch { json = text; }
  return { status: res.status, json };
}

async function get(route) {
  const r = await api('GET', route);
  assert.equal(r.status, 200, `GET ${route}: ${JSON.stringify(r.json)}`);
  return r.json;
}

const runsIn = (list, state) => list.runs.filter((r) => r.state === state);

/**
 * Runs one step: skipped if an earlier one failed; on failure prints the daemon's
 * stderr and saves a screenshot of the page before failing.
 */
async function diagnosed(fn, t) {
  if (ctx.failed) {
    t?.skip('an earlier step failed');
    return undefined;
  }
  try {
    return await fn();
  } catch (e) {
    ctx.failed = true;
    console.error(`\n--- berth daemon stderr and stdout (${ctx.stateDir}) ---\n${ctx.stderr || '(empty)'}\n--- end of daemon output ---`);
    if (ctx.pageErrors.length) console.error(`page errors:\n${ctx.pageErrors.join('\n')}`);
    if (ctx.page) {
      await mkdir(path.dirname(FAILURE_SCREENSHOT), { recursive: true }).catch(() => {});
      await ctx.page.screenshot({ path: FAILURE_SCREENSHOT, fullPage: true, timeout: 5000 })
        .then(() => console.error(`screenshot of the failure: ${FAILURE_SCREENSHOT}`), () => {});
    }
    throw e;
  }
}

/** What the page shows, through its test hooks. */
function seen() {
  return ctx.page.evaluate(() => {
    const rows = (sel) => [...document.querySelectorAll(sel)];
    const text = (root, sel) => root.querySelector(sel)?.textContent.trim() ?? null;
    return {
      gauges: rows('#gauges [data-resource]').map((g) => ({
        name: g.dataset.resource,
        committed: text(g, '.committed'),
        allocatable: text(g, '.allocatable'),
      })),
      queue: rows('#queue tbody tr[data-run-id]').map((r) => ({
        run_id: r.dataset.runId,
        position: text(r, '.position'),
        code: text(r, '.reason-code'),
      })),
      runs: rows('#runs tbody tr[data-run-id]').map((r) => ({
        run_id: r.dataset.runId,
        fence: text(r, '.fence'),
      })),
      use: Object.fromEntries(rows('#runs tbody tr[data-run-id]').map((r) => [r.dataset.runId, text(r, '.use')])),
      projects: rows('#projects tbody tr[data-project]').map((r) => r.dataset.project).sort(),
      events: rows('#events li[data-seq]').map((e) => Number(e.dataset.seq)),
      conn: document.getElementById('conn')?.textContent ?? '',
      loginShown: !document.getElementById('login')?.hidden,
      href: location.href,
      stored: sessionStorage.getItem('berth.token'),
      local: Object.keys(localStorage).length,
      cookies: document.cookie,
    };
  });
}

/** Whether the daemon serves the event stream (a daemon without it answers 404). */
async function streamServed() {
  const ctl = new AbortController();
  try {
    const res = await within('GET /v1/events to answer (its headers must come at once)', 10_000,
      fetch(new URL('/v1/events', ctx.pageUrl), {
        headers: { authorization: `Bearer ${ctx.token}`, accept: 'text/event-stream' },
        signal: ctl.signal,
      }));
    return res.status === 200;
  } finally {
    ctl.abort();
  }
}

// ---------- the daemon, the runs, the browser ----------

before(async () => diagnosed(async () => {
  const bin = process.env.BERTH_BIN;
  if (!bin) {
    throw new Error('BERTH_BIN is not set: point it at a berth binary, e.g. BERTH_BIN=$PWD/../../target/debug/berth npm test');
  }
  ctx.stateDir = await mkdtemp(path.join(tmpdir(), 'berth-web-'));
  const port = await freePort();
  ctx.base = `http://127.0.0.1:${port}`;
  const args = [
    'serve', '--state-dir', ctx.stateDir, '--listen', `127.0.0.1:${port}`,
    '--slots-max', '1', '--memory-total', '8GiB', '--cpu-total', '4', '--no-memory-sampling',
  ];
  ctx.daemon = spawn(bin, args, { stdio: ['ignore', 'pipe', 'pipe'], env: { ...process.env, NO_COLOR: '1' } });
  for (const out of [ctx.daemon.stdout, ctx.daemon.stderr]) {
    out.setEncoding('utf8');
    out.on('data', (d) => { ctx.stderr = (ctx.stderr + d.replace(/\x1b\[[0-9;]*m/g, '')).slice(-64 * 1024); });
  }
  ctx.daemon.on('error', (e) => { ctx.exited = `could not start ${bin}: ${e.message}`; });
  ctx.daemon.on('exit', (code, signal) => { ctx.exited = `code ${code}, signal ${signal}`; });

  ctx.token = await waitFor('the admin token in the state dir', 15_000, async () =>
    (await readFile(path.join(ctx.stateDir, 'admin.token'), 'utf8')).trim());
  await waitFor(`GET ${ctx.base}/v1/status to answer 200`, 15_000, async () =>
    (await api('GET', '/v1/status')).status === 200);

  const tmpl = process.env.BERTH_DASHBOARD_URL;
  ctx.pageUrl = tmpl ? tmpl.replaceAll('{port}', String(port)) : `${ctx.base}/`;

  // One run holds the only slot...
  const g = await api('POST', '/v1/runs', { project: 'web', ttl_s: 300 });
  assert.equal(g.status, 201, `the first run should be granted at once: ${JSON.stringify(g.json)}`);
  assert.equal(g.json.state, 'granted');
  ctx.granted = g.json;

  // ...and two wait behind it. Their requests long-poll until granted; dropping one
  // would cancel its waiter, so they stay pending until `after` aborts them.
  for (const project of ['api', 'docs']) {
    const pending = api('POST', '/v1/runs', { project, wait_s: 120 }, ctx.waiters.signal);
    pending.catch(() => {}); // aborted at the end, or answered once granted
    const want = ctx.queued.length + 1;
    const run = await waitFor(`the ${project} waiter to be queued at position ${want}`, 10_000, async () => {
      const list = await get('/v1/runs');
      return runsIn(list, 'queued').find((r) => r.project === project && r.position === want);
    });
    ctx.queued.push(run.run_id);
  }

  ctx.browser = await within(`Chromium (${CHROMIUM}) to start`, 30_000, chromium.launch({
    executablePath: CHROMIUM,
    args: CHROMIUM_ARGS,
  }));
  const context = await ctx.browser.newContext({ viewport: { width: 1280, height: 900 } });
  ctx.page = await context.newPage();
  ctx.page.setDefaultTimeout(10_000);
  ctx.page.on('pageerror', (e) => ctx.pageErrors.push(String(e)));
  ctx.page.on('console', (m) => {
    if (m.type() === 'error' && /Content Security Policy/i.test(m.text())) ctx.cspErrors.push(m.text());
  });
}));

after(async () => {
  ctx.waiters.abort();
  if (ctx.browser) await ctx.browser.close().catch(() => {});
  const d = ctx.daemon;
  if (d && d.exitCode === null && d.signalCode === null) {
    const gone = new Promise((r) => d.once('exit', r));
    d.kill('SIGTERM');
    const stopped = await within('the daemon to stop on SIGTERM', 5_000, gone).then(() => true, () => false);
    if (!stopped) {
      console.log('# the daemon did not stop within 5 s of SIGTERM: killed');
      d.kill('SIGKILL');
      await within('the daemon to die on SIGKILL', 5_000, gone).catch(() => {});
    }
  }
  if (ctx.stateDir) await rm(ctx.stateDir, { recursive: true, force: true }).catch(() => {});
});

// ---------- the tests (in order: each builds on the one before) ----------

test('the page takes the token from the URL into sessionStorage and shows the queue', (t) => diagnosed(async () => {
  const url = `${ctx.pageUrl}#token=${encodeURIComponent(ctx.token)}`;
  const res = await within(`the page at ${ctx.pageUrl} to load`, 15_000, ctx.page.goto(url, { waitUntil: 'load' }));
  assert.equal(res?.status(), 200, `GET ${ctx.pageUrl} should answer 200 with the dashboard (a public route: no token)`);
  await within('two rows in the #queue table', 10_000,
    ctx.page.waitForFunction(() => document.querySelectorAll('#queue tbody tr[data-run-id]').length === 2));

  const s = await seen();
  assert.ok(!s.href.includes(ctx.token), `the token must not stay in the address: ${s.href}`);
  assert.ok(!s.href.includes('token='), `the #token= fragment must be cleared: ${s.href}`);
  assert.equal(s.stored, ctx.token, 'the token should be in sessionStorage under berth.token');
  assert.equal(s.local, 0, 'nothing may be kept in localStorage');
  assert.equal(s.cookies, '', 'no cookies may be set');
  assert.equal(s.loginShown, false, 'the login form should be hidden when a token is given');
}, t));

test('the page shows what the API says: capacity, queue, live runs, projects', (t) => diagnosed(async () => {
  const status = await get('/v1/status');
  const runs = await get('/v1/runs');
  const s = await seen();

  assert.deepEqual(
    s.gauges,
    status.resources.map((r) => ({ name: r.name, committed: String(r.committed), allocatable: String(r.allocatable) })),
    'one gauge per resource of /v1/status, with its committed and allocatable',
  );
  const slots = s.gauges.find((g) => g.name === 'slots');
  assert.deepEqual(slots, { name: 'slots', committed: '1', allocatable: '1' }, 'the one slot is committed');

  const queued = runsIn(runs, 'queued').sort((a, b) => a.position - b.position);
  assert.deepEqual(queued.map((r) => r.run_id), ctx.queued, 'the API queues both waiters, in order');
  assert.deepEqual(
    s.queue,
    queued.map((r) => ({ run_id: r.run_id, position: String(r.position), code: r.reason.code })),
    'the queue shows exactly the queued runs, by position, with their reason codes',
  );
  assert.deepEqual(s.queue.map((r) => r.position), ['1', '2']);

  assert.deepEqual(
    s.runs,
    [{ run_id: ctx.granted.run_id, fence: String(ctx.granted.fence) }],
    'the granted run is the one live run, with its fence',
  );
  assert.deepEqual(s.projects, status.projects.map((p) => p.project).sort(), 'one row per project of /v1/status');
  assert.deepEqual(s.projects, ['api', 'docs', 'web']);
}, t));

// Issue 36: a live run with a registered process shows its memory use against its claim
// (from its cgroup, or from /proc where it has none) and its process count.
test('the live runs show memory use against the claim', (t) => diagnosed(async () => {
  const proc = spawn('sleep', ['60'], { stdio: 'ignore' });
  try {
    const reg = await api('POST', `/v1/runs/${ctx.granted.run_id}/processes`, { fence: ctx.granted.fence, pid: proc.pid });
    assert.equal(reg.status, 201, `register: ${JSON.stringify(reg.json)}`);
    const run = await waitFor('the API to tell the run\'s use', 10_000, async () => {
      const r = await get(`/v1/runs/${ctx.granted.run_id}`);
      return r.usage && r.usage.processes >= 1 ? r : null;
    });
    const claim = run.claim.resources.memory;
    assert.ok(claim > 0, 'the run claims memory');
    const cell = await waitFor('the page to show the run\'s memory use', 10_000, async () => {
      const use = (await seen()).use[ctx.granted.run_id];
      return use && /procs?$/.test(use) ? use : null;
    });
    assert.match(cell, /\/ \d/, `the use is shown against the claim: ${cell}`);
  } finally {
    proc.kill('SIGKILL');
  }
}, t));

test('the page follows a release: the first waiter goes live, one row stays queued', (t) => diagnosed(async () => {
  const live = await streamServed();
  if (live) {
    await within('#conn to say "live" (the event stream is served)', 10_000,
      ctx.page.waitForFunction(() => /live/.test(document.getElementById('conn')?.textContent ?? '')));
  } else {
    console.log('# /v1/events is not served by this daemon: the page must follow by polling');
  }
  const eventsBefore = (await seen()).events.length;

  const rel = await api('POST', `/v1/runs/${ctx.granted.run_id}/release`, { fence: ctx.granted.fence });
  assert.ok(rel.status >= 200 && rel.status < 300, `release: ${rel.status} ${JSON.stringify(rel.json)}`);

  const [first, second] = ctx.queued;
  await waitFor(`the page to show ${first} as a live run and only ${second} queued`, 10_000, async () => {
    const s = await seen();
    return s.runs.some((r) => r.run_id === first)
      && s.queue.length === 1 && s.queue[0].run_id === second && s.queue[0].position === '1';
  }, 200);

  // And it agrees with the API once more.
  const runs = await get('/v1/runs');
  const granted = runsIn(runs, 'granted').find((r) => r.run_id === first);
  assert.ok(granted, `the API should show ${first} granted`);
  const s = await seen();
  assert.deepEqual(s.runs.find((r) => r.run_id === first), { run_id: first, fence: String(granted.fence) },
    'the new live run shows its fence');
  assert.ok(!s.runs.some((r) => r.run_id === ctx.granted.run_id), 'the released run is no longer live');

  if (live) {
    await waitFor('the release to appear in #events', 10_000, async () => (await seen()).events.length > eventsBefore);
    const ev = (await seen()).events;
    assert.deepEqual(ev, [...ev].sort((a, b) => b - a), 'events are newest first');
    assert.ok(ev.length <= 50, 'at most 50 events are shown');
  }
  assert.deepEqual(ctx.pageErrors, [], 'the page throws no errors');
  assert.deepEqual(ctx.cspErrors, [], 'the page breaks no rule of its Content-Security-Policy');

  await mkdir(path.dirname(SCREENSHOT), { recursive: true });
  await within('the screenshot', 10_000, ctx.page.screenshot({ path: SCREENSHOT, fullPage: true }));
}, t));

test('the page shows a drain banner with its reason and the threads with their owners', (t) => diagnosed(async () => {
  const claim = { run_id: 'turn-1', owner_gen: 'orch-1', owner_fence: 7, run_budget_ms: 600_000 };
  const a = await api('POST', '/v1/threads/conv-1/attach', claim);
  assert.equal(a.status, 200, `attach: ${JSON.stringify(a.json)}`);
  const d = await api('POST', '/v1/drain', { reason: 'deploy 42' });
  assert.equal(d.status, 200, `drain: ${JSON.stringify(d.json)}`);
  await within('the drain banner', 15_000,
    ctx.page.waitForFunction(() => !document.getElementById('drain').hidden));
  const banner = await ctx.page.textContent('#drain');
  assert.match(banner, /deploy 42/, 'the banner says why');
  assert.match(banner, /registration conv-1/, 'the banner names what the drain waits for');
  await within('the thread row', 10_000,
    ctx.page.waitForFunction(() => document.querySelector('#threads tbody tr[data-thread="conv-1"]')));
  const row = await ctx.page.textContent('#threads tbody tr[data-thread="conv-1"]');
  assert.match(row, /orch-1 #7 \(turn-1\)/, 'the row shows the owner and its fence');
  const off = await api('DELETE', '/v1/drain');
  assert.equal(off.status, 200);
  await within('the banner to go', 15_000,
    ctx.page.waitForFunction(() => document.getElementById('drain').hidden));
  const det = await api('POST', '/v1/threads/conv-1/detach', { run_id: 'turn-1', owner_gen: 'orch-1', owner_fence: 7 });
  assert.equal(det.status, 200);
  assert.deepEqual(ctx.pageErrors, [], 'the page throws no errors');
  assert.deepEqual(ctx.cspErrors, [], 'the page breaks no rule of its Content-Security-Policy');
}, t));

test('the budgets panel shows each scope with its control, generation and tokens', (t) => diagnosed(async () => {
  const budget = { scope: 'exp-web', harness: 'claude', per_harness: { claude: 2, codex: 1 } };
  const r = await api('POST', '/v1/runs', { project: 'budgets-web', detach: true, budget });
  assert.ok(r.status === 201 || r.status === 202, `acquire: ${r.status} ${JSON.stringify(r.json)}`);
  // The run may wait for a slot the earlier tests hold; a turn's token is taken at once.
  const turn = await api('POST', '/v1/scopes/exp-web/reservations',
    { owner: 'web-worker', operation_id: 'turn-1', harness: 'codex' });
  assert.equal(turn.status, 201, `reserve: ${JSON.stringify(turn.json)}`);
  const c = await api('POST', '/v1/scopes/exp-web/control', { request_id: 'web-1', mode: 'pause' });
  assert.equal(c.status, 200, `pause: ${JSON.stringify(c.json)}`);
  await within('the scope row', 15_000, ctx.page.waitForFunction(() => {
    const row = document.querySelector('#scopes tbody tr[data-scope="exp-web"]');
    return row && /paused/.test(row.textContent);
  }));
  const row = await ctx.page.textContent('#scopes tbody tr[data-scope="exp-web"]');
  // Paused, nothing more is granted: the page must agree with the API (the run holds
  // its own claude token only if it was granted).
  const held = (await api('GET', '/v1/scopes/exp-web')).json.harnesses.claude.held;
  assert.match(row, new RegExp(`claude ${held}/2, codex 1/1`),
    'the row shows tokens held per harness and the limits');
  assert.match(row, /paused\s*1/, 'the row shows the control and the generation');
  const rid = r.json.run_id;
  const fence = (await api('GET', `/v1/runs/${rid}`)).json.fence;
  const end = fence === undefined || fence === null
    ? await api('DELETE', `/v1/runs/${rid}`)
    : await api('POST', `/v1/runs/${rid}/release`, { fence });
  assert.equal(end.status, 200, `release or cancel: ${JSON.stringify(end.json)}`);
  const un = await api('DELETE', '/v1/scopes/exp-web/reservations/web-worker/turn-1');
  assert.equal(un.status, 200, `unreserve: ${JSON.stringify(un.json)}`);
  await api('POST', '/v1/scopes/exp-web/control', { request_id: 'web-2', mode: 'resume' });
  assert.deepEqual(ctx.pageErrors, [], 'the page throws no errors');
  assert.deepEqual(ctx.cspErrors, [], 'the page breaks no rule of its Content-Security-Policy');
}, t));

test('a refused token brings the login form back', (t) => diagnosed(async () => {
  await ctx.page.evaluate(() => sessionStorage.setItem('berth.token', 'not-a-token'));
  await within('the page to reload', 15_000, ctx.page.reload({ waitUntil: 'load' }));
  await within('#login to be shown after a 401', 10_000,
    ctx.page.waitForFunction(() => !document.getElementById('login').hidden));
  const msg = await ctx.page.textContent('#login');
  assert.match(msg, /401/, 'the login form says the token was refused');
  assert.equal(await ctx.page.evaluate(() => sessionStorage.getItem('berth.token')), null,
    'the refused token is dropped from sessionStorage');

  // Signing in through the form works again, and keeps the token out of the URL.
  await ctx.page.fill('#login input[type=password]', ctx.token);
  await ctx.page.click('#login button[type=submit]');
  await within('#gauges to fill after signing in', 10_000,
    ctx.page.waitForFunction(() => document.querySelectorAll('#gauges [data-resource]').length > 0));
  const s = await seen();
  assert.equal(s.stored, ctx.token);
  assert.ok(!s.href.includes(ctx.token), 'the token is not put in the address');
  assert.equal(s.local, 0, 'nothing may be kept in localStorage');
}, t));
