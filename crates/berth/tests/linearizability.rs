//! Issue 16, item 3: concurrent histories against the real daemon, checked for
//! linearizability.
//!
//! 16 client threads acquire (`wait_s = 0`), renew, release and check fences of runs
//! on four projects, each project's runs naming one singleton key, while the daemon
//! is killed with SIGKILL and restarted on the same state dir now and then. Every call
//! is recorded with its call and return times on one monotonic clock; a call that got
//! no answer (the daemon died under it) is recorded as such: it may or may not have
//! taken effect. Each key's history is then checked against the sequential model of a
//! fenced lease (`berth_lincheck::lease::FencedLease`), and must be linearizable.
//!
//! The clients keep to what the model covers: leases are long (no expiry) and every
//! holder releases; a run's id is acquired once; a lease whose answer was lost is
//! found again by `GET /v1/runs/{id}` (P5: a granted run survives the restart with its
//! fence), a lost release or renew is followed by a fence check.
//!
//! The short version (8,000 calls, 4 restarts: a few seconds) runs in the default
//! `cargo test`. The long version (200,000 calls, 40 restarts: about a minute on two
//! cores, the check itself a second or two) is one command:
//!
//! ```text
//! BERTH_LINCHECK_OPS=200000 BERTH_LINCHECK_RESTARTS=40 BERTH_TEST_TIMEOUT_S=1800 \
//!     cargo test -p berth --test linearizability -- --nocapture
//! ```
//!
//! It prints `lincheck: histories=N operations=M unanswered=U restarts=R` to stderr,
//! captured or not (and, with `--nocapture`, the mix of answers and how long recording
//! and checking took);
//! `BERTH_LINCHECK_SEED` repeats the clients' choices (not the threads' timing).

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use berth_lincheck::lease::{
    Fence, FencedLease, KeyId, LeaseCall, LeaseInput, LeaseOutput, LeaseState, RunId,
};
use berth_lincheck::{check_by_key, Explanation, Limits, Operation, Verdict};
use common::Daemon;
use serde_json::{json, Value};

type Op = Operation<LeaseInput, LeaseOutput>;

/// Client threads, and the keys (projects, one singleton each) they share.
const CLIENTS: u32 = 16;
const KEYS: u64 = 4;
/// The short version: calls the clients make in all, and kill -9 restarts among them.
const OPS_DEFAULT: u64 = 8_000;
const RESTARTS_DEFAULT: u64 = 4;
/// Far longer than any lease is held (the model has no expiry).
const TTL_S: u64 = 600;
/// A call unanswered this long is recorded as unanswered.
const HTTP_TIMEOUT: Duration = Duration::from_secs(20);
/// Between tries to reach the daemon again after a call went unanswered.
const RETRY_PAUSE: Duration = Duration::from_millis(20);
/// How long a client tries to reach a restarted daemon before it gives up.
const REACH_WAIT_MAX: Duration = Duration::from_secs(60);
/// A holder releases after at most this many calls on its lease.
const HOLD_CALLS_MAX: u32 = 6;
/// Recent grants kept for other clients to check.
const RECENT_MAX: usize = 32;
/// Unexpected answers quoted when the test fails on them.
const QUOTED_MAX: usize = 10;
/// Calls on the runs an explanation names, quoted with it.
const QUOTED_RUN_OPS_MAX: usize = 40;

#[test]
fn concurrent_histories_across_kill_9_restarts_are_linearizable() {
    let (ops, restarts) = (
        env_u64("BERTH_LINCHECK_OPS", OPS_DEFAULT),
        env_u64("BERTH_LINCHECK_RESTARTS", RESTARTS_DEFAULT),
    );
    let seed = env_u64("BERTH_LINCHECK_SEED", clock_seed());
    let started = Instant::now();
    let mut d = Daemon::start(&["--slots-max", "16"]);
    let (history, unexpected) = record(&mut d, ops, restarts, seed);
    let recorded = started.elapsed();
    assert!(
        unexpected.is_empty(),
        "{} unexpected answers, e.g.:\n{}\nthe daemon logged:\n{}",
        unexpected.len(),
        unexpected
            .iter()
            .take(QUOTED_MAX)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n"),
        common::log_tail(&d.log)
    );
    let verdicts = check_by_key(&FencedLease, &history, |i| i.key, &Limits::default());
    let unanswered = history.iter().filter(|o| o.return_ns.is_none()).count();
    // Straight to the descriptor (the harness captures `eprintln!`): a benchmark
    // quotes this line from a plain `cargo test` run.
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "lincheck: histories={} operations={} unanswered={unanswered} restarts={restarts}",
        verdicts.len(),
        history.len()
    );
    eprintln!(
        "lincheck timing: recorded in {:.1} s, checked in {:.1} s (seed {seed})",
        recorded.as_secs_f64(),
        (started.elapsed() - recorded).as_secs_f64()
    );
    eprintln!("lincheck mix: {}", mix(&history));
    for (key, v) in &verdicts {
        assert_linearizable(*key, v, &history);
    }
    fences_are_never_shared(&history);
    the_checker_fails_a_doctored_copy(&history);
    assert_eq!(verdicts.len() as u64, KEYS, "every key was used");
}

/// Runs the clients against `d`, killing and restarting it `restarts` times spread
/// over the `ops` calls; every client's history, merged, and the unexpected answers.
fn record(d: &mut Daemon, ops: u64, restarts: u64, seed: u64) -> (Vec<Op>, Vec<String>) {
    let shared = Arc::new(Shared {
        url: d.url.clone(),
        token: d.token.clone(),
        clock: Instant::now(),
        calls: AtomicU64::new(0),
        calls_max: ops,
        recent: Mutex::new(Vec::new()),
    });
    let clients: Vec<_> = (0..CLIENTS)
        .map(|id| {
            let c = Client::new(id, shared.clone(), seed ^ (u64::from(id) << 40));
            std::thread::spawn(move || c.run())
        })
        .collect();
    for i in 1..=restarts {
        let at = ops * i / (restarts + 1);
        while shared.calls.load(Ordering::Relaxed) < at && !clients.iter().all(|c| c.is_finished())
        {
            std::thread::sleep(Duration::from_millis(2));
        }
        d.kill9_and_restart();
    }
    let (mut history, mut unexpected) = (Vec::new(), Vec::new());
    for c in clients {
        let (h, u) = c.join().expect("a client thread panicked");
        history.extend(h);
        unexpected.extend(u);
    }
    (history, unexpected)
}

/// A key's verdict must be `Linearizable`; anything else fails with the explanation.
fn assert_linearizable(key: KeyId, v: &Verdict<LeaseState>, history: &[Op]) {
    match v {
        Verdict::Linearizable => {}
        Verdict::NotLinearizable(e) => panic!("{}", explain(key, e, history)),
        Verdict::Unknown(w) => panic!(
            "key lc-k{key}: no verdict: the checker stopped at its limit after {} states \
             and {} steps (berth_lincheck::Limits); a smaller BERTH_LINCHECK_OPS checks",
            w.states, w.steps
        ),
    }
}

/// The checker's explanation in words, and everything else that happened to the runs
/// it names.
fn explain(key: KeyId, e: &Explanation<LeaseState>, history: &[Op]) -> String {
    let line = |&i: &usize| {
        let late = history[i].return_ns.is_some_and(|r| r > e.cut_ns);
        let note = if late {
            " (answered later: not used)"
        } else {
            ""
        };
        format!("  {}{note}\n", describe(&history[i]))
    };
    let mut runs: Vec<RunId> = e.ops.iter().map(|&i| history[i].input.run).collect();
    runs.extend(e.start.holder.map(|h| h.run));
    runs.extend(e.ops.iter().filter_map(|&i| match history[i].output {
        Some(LeaseOutput::Busy { holder }) => holder,
        _ => None,
    }));
    let mut involved: Vec<usize> = (0..history.len())
        .filter(|&i| history[i].input.key == key && runs.contains(&history[i].input.run))
        .collect();
    involved.sort_by_key(|&i| history[i].call_ns);
    involved.truncate(QUOTED_RUN_OPS_MAX);
    format!(
        "key lc-k{key}: the history is not linearizable (at best {} of its {} operations \
         fit one order). The first answer nothing explains is the last of these; from a \
         state in which {}, the others can happen and it cannot follow them:\n{}\
         Every call on the runs named (first {QUOTED_RUN_OPS_MAX}):\n{}",
        e.linearized_max,
        e.of,
        describe_state(&e.start),
        e.ops.iter().map(line).collect::<String>(),
        involved
            .iter()
            .map(|&i| format!("  {}\n", describe(&history[i])))
            .collect::<String>()
    )
}

fn describe_state(s: &LeaseState) -> String {
    let holder = match s.holder {
        None => "the key is free".to_string(),
        Some(h) => match h.fence {
            Some(f) => format!("{} holds the key under fence {f}", run_name(h.run)),
            None => format!(
                "{} holds the key under a fence not seen yet",
                run_name(h.run)
            ),
        },
    };
    format!(
        "{holder} (the highest fence granted on it so far is {})",
        s.fence_max
    )
}

/// One call in words: client, times (s), run, call, answer.
fn describe(o: &Op) -> String {
    let secs = |ns: u64| format!("{:.6} s", ns as f64 / 1e9);
    let call = match o.input.call {
        LeaseCall::Acquire => "acquire".to_string(),
        LeaseCall::Renew { fence } => format!("renew with fence {fence}"),
        LeaseCall::Release { fence } => format!("release with fence {fence}"),
        LeaseCall::Check { fence } => format!("fence check of fence {fence}"),
        LeaseCall::Query => "GET".to_string(),
    };
    let out = match o.output {
        None => "no answer".to_string(),
        Some(LeaseOutput::Granted { fence }) => format!("granted, fence {fence}"),
        Some(LeaseOutput::Busy { holder }) => {
            format!(
                "refused: held by {}",
                holder.map_or("?".to_string(), run_name)
            )
        }
        Some(LeaseOutput::Done) => "ok".to_string(),
        Some(LeaseOutput::Refused) => "refused".to_string(),
        Some(LeaseOutput::Current(c)) => format!("current: {c}"),
        Some(LeaseOutput::Holds { fence }) => format!("granted under fence {fence}"),
        Some(LeaseOutput::NotHolding) => "not granted".to_string(),
    };
    let ret = o.return_ns.map_or("-".to_string(), secs);
    format!(
        "client {:>2} [{} .. {ret}] {} {call} -> {out}",
        o.client,
        secs(o.call_ns),
        run_name(o.input.run)
    )
}

/// The checker is not vacuous on this very history: with one grant's fence set back
/// to that of a grant on the same key that had returned before it was called (L1
/// broken), the key's history must fail. (The first two such grants: a failure early
/// in the history is found at once, and explained from a short prefix.)
fn the_checker_fails_a_doctored_copy(history: &[Op]) {
    let mut doctored: Vec<Op> = history
        .iter()
        .filter(|o| o.input.key == 0)
        .cloned()
        .collect();
    doctored.sort_by_key(|o| o.call_ns);
    let granted = |o: &Op| matches!(o.output, Some(LeaseOutput::Granted { .. }));
    let first = doctored.iter().position(granted).expect("a grant on key 0");
    let done = doctored[first].return_ns;
    let second = (first + 1..doctored.len())
        .find(|&i| granted(&doctored[i]) && Some(doctored[i].call_ns) > done)
        .expect("a later grant on key 0");
    doctored[second].output = doctored[first].output;
    let v = berth_lincheck::check(&FencedLease, &doctored, &Limits::default());
    match v {
        Verdict::NotLinearizable(e) => assert_eq!(e.ops.last(), Some(&second), "{e:?}"),
        v => panic!("a doctored history passed: {v:?}"),
    }
}

/// How many answers of each kind, and how many acquires and releases went
/// unanswered (the calls a crash leaves in doubt): the history is not vacuous.
fn mix(history: &[Op]) -> String {
    let mut n: std::collections::BTreeMap<String, usize> = Default::default();
    for o in history {
        let kind = match (&o.output, o.input.call) {
            (Some(LeaseOutput::Granted { .. }), _) => "granted",
            (Some(LeaseOutput::Busy { .. }), _) => "busy",
            (Some(LeaseOutput::Done), LeaseCall::Renew { .. }) => "renewed",
            (Some(LeaseOutput::Done), _) => "released",
            (Some(LeaseOutput::Refused), _) => "refused",
            (Some(LeaseOutput::Current(true)), _) => "current",
            (Some(LeaseOutput::Current(false)), _) => "not_current",
            (Some(LeaseOutput::Holds { .. } | LeaseOutput::NotHolding), _) => "queried",
            (None, LeaseCall::Acquire) => "unanswered_acquire",
            (None, LeaseCall::Release { .. }) => "unanswered_release",
            (None, _) => "unanswered_read_or_renew",
        };
        *n.entry(kind.to_string()).or_default() += 1;
    }
    n.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// L1 across keys (which the per-key model cannot see): a fence is granted to one run
/// only, and a run holds one fence.
fn fences_are_never_shared(history: &[Op]) {
    let mut by_fence: std::collections::BTreeMap<Fence, RunId> = Default::default();
    let mut by_run: std::collections::BTreeMap<RunId, Fence> = Default::default();
    for o in history {
        let fence = match o.output {
            Some(LeaseOutput::Granted { fence } | LeaseOutput::Holds { fence }) => fence,
            _ => continue,
        };
        let run = o.input.run;
        let other = *by_fence.entry(fence).or_insert(run);
        assert_eq!(
            other,
            run,
            "fence {fence} was granted to {} and to {}",
            run_name(other),
            run_name(run)
        );
        let had = *by_run.entry(run).or_insert(fence);
        assert_eq!(
            had,
            fence,
            "run {} was granted fences {had} and {fence}",
            run_name(run)
        );
    }
}

/// What the clients share: where the daemon is, the clock, the call budget, and
/// recent grants (so clients check each other's fences, not only their own).
struct Shared {
    url: String,
    token: String,
    clock: Instant,
    calls: AtomicU64,
    calls_max: u64,
    recent: Mutex<Vec<Lease>>,
}

impl Shared {
    fn now_ns(&self) -> u64 {
        self.clock.elapsed().as_nanos() as u64
    }

    /// Takes one call from the budget; false once it is spent.
    fn take_call(&self) -> bool {
        self.calls.fetch_add(1, Ordering::Relaxed) < self.calls_max
    }

    fn remember(&self, l: Lease) {
        let mut r = self.recent.lock().unwrap();
        if r.len() == RECENT_MAX {
            r.remove(0);
        }
        r.push(l);
    }

    fn recent(&self, pick: u64) -> Option<Lease> {
        let r = self.recent.lock().unwrap();
        (!r.is_empty()).then(|| r[pick as usize % r.len()])
    }
}

#[derive(Clone, Copy, Debug)]
struct Lease {
    key: KeyId,
    run: RunId,
    fence: Fence,
}

/// `lc-<client>-<n>`: the run's number is client << 32 | n.
fn run_name(run: RunId) -> String {
    format!("lc-{}-{}", run >> 32, run & 0xffff_ffff)
}

fn run_number(name: &str) -> Option<RunId> {
    let (c, n) = name.strip_prefix("lc-")?.split_once('-')?;
    Some((c.parse::<u64>().ok()? << 32) | n.parse::<u64>().ok()?)
}

struct Client {
    id: u32,
    sh: Arc<Shared>,
    agent: ureq::Agent,
    rng: Rng,
    runs: u64,
    held: Option<Lease>,
    /// Calls made on the lease held.
    held_calls: u32,
    /// The last lease it released (or lost): for stale calls.
    stale: Option<Lease>,
    history: Vec<Op>,
    unexpected: Vec<String>,
}

impl Client {
    fn new(id: u32, sh: Arc<Shared>, seed: u64) -> Client {
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(HTTP_TIMEOUT))
            .build()
            .into();
        Client {
            id,
            sh,
            agent,
            rng: Rng(seed),
            runs: 0,
            held: None,
            held_calls: 0,
            stale: None,
            history: Vec::new(),
            unexpected: Vec::new(),
        }
    }

    fn run(mut self) -> (Vec<Op>, Vec<String>) {
        while self.sh.take_call() && self.unexpected.is_empty() {
            match self.held {
                Some(l) => self.while_holding(l),
                None => self.while_free(),
            }
        }
        // Leave nothing held (recorded like any other call).
        if let Some(l) = self.held {
            self.release(l);
        }
        (self.history, self.unexpected)
    }

    fn while_free(&mut self) {
        match self.rng.below(100) {
            0..55 => self.acquire(),
            55..85 => self.check_someone(),
            _ => self.stale_call(),
        }
    }

    fn while_holding(&mut self, l: Lease) {
        self.held_calls += 1;
        if self.held_calls > HOLD_CALLS_MAX {
            return self.release(l);
        }
        let wrong = l.fence + 1 + self.rng.below(3);
        match self.rng.below(100) {
            0..35 => self.renew(l, l.fence),
            35..50 => self.check_own(l),
            50..75 => self.release(l),
            75..85 => self.renew(l, wrong),
            85..95 => self.check_someone(),
            _ => self.stale_call(),
        }
    }

    fn acquire(&mut self) {
        self.runs += 1;
        let key = self.rng.below(KEYS);
        let run = (u64::from(self.id) << 32) | self.runs;
        match self.call(key, run, LeaseCall::Acquire) {
            Some(LeaseOutput::Granted { fence }) => self.now_holding(Lease { key, run, fence }),
            Some(_) => {}
            None => self.find_lost_acquire(key, run),
        }
    }

    fn now_holding(&mut self, l: Lease) {
        self.held = Some(l);
        self.held_calls = 0;
        self.sh.remember(l);
    }

    /// The lease is no longer held (released, or found lost).
    fn let_go(&mut self, l: Lease) {
        self.held = None;
        self.stale = Some(l);
    }

    fn renew(&mut self, l: Lease, fence: Fence) {
        match self.call(l.key, l.run, LeaseCall::Renew { fence }) {
            Some(LeaseOutput::Done) => {}
            // Its own fence refused: the lease is lost (the checker judges whether it
            // could have been).
            Some(_) if fence == l.fence => self.let_go(l),
            Some(_) => {}
            None => self.confirm(l),
        }
    }

    fn release(&mut self, l: Lease) {
        match self.call(l.key, l.run, LeaseCall::Release { fence: l.fence }) {
            Some(_) => self.let_go(l),
            None => self.confirm(l),
        }
    }

    fn check_own(&mut self, l: Lease) {
        if let Some(LeaseOutput::Current(false)) =
            self.call(l.key, l.run, LeaseCall::Check { fence: l.fence })
        {
            self.let_go(l);
        }
    }

    /// A fence check of a lease another client (or this one) was granted lately.
    fn check_someone(&mut self) {
        let pick = self.rng.next();
        if let Some(l) = self.sh.recent(pick) {
            self.call(l.key, l.run, LeaseCall::Check { fence: l.fence });
        }
    }

    /// A call with a lease it no longer holds: a renew or check with its fence, or a
    /// release with a wrong one (a release with its own fence is L5's idempotent
    /// repeat, which the model leaves out).
    fn stale_call(&mut self) {
        let Some(l) = self.stale else {
            return self.check_someone();
        };
        let call = match self.rng.below(3) {
            0 => LeaseCall::Renew { fence: l.fence },
            1 => LeaseCall::Check { fence: l.fence },
            _ => LeaseCall::Release { fence: l.fence + 1 },
        };
        self.call(l.key, l.run, call);
    }

    /// An acquire went unanswered: asks the daemon, once it answers, whether the run
    /// holds the key (P5: a lease granted before a crash is still there after it).
    fn find_lost_acquire(&mut self, key: KeyId, run: RunId) {
        if let Some(LeaseOutput::Holds { fence }) =
            self.call_until_answered(key, run, LeaseCall::Query)
        {
            self.now_holding(Lease { key, run, fence });
        }
    }

    /// A release or renew went unanswered: is the lease still current?
    fn confirm(&mut self, l: Lease) {
        let check = LeaseCall::Check { fence: l.fence };
        if let Some(LeaseOutput::Current(false)) = self.call_until_answered(l.key, l.run, check) {
            self.let_go(l);
        }
    }

    /// The call, again and again until it is answered (the daemon is restarting);
    /// `None` if it never is within `REACH_WAIT_MAX` (an unexpected failure).
    fn call_until_answered(
        &mut self,
        key: KeyId,
        run: RunId,
        call: LeaseCall,
    ) -> Option<LeaseOutput> {
        let end = Instant::now() + REACH_WAIT_MAX;
        while Instant::now() < end {
            std::thread::sleep(RETRY_PAUSE);
            if let Some(out) = self.call(key, run, call) {
                return Some(out);
            }
        }
        self.unexpected.push(format!(
            "client {}: the daemon did not answer for {REACH_WAIT_MAX:?}",
            self.id
        ));
        None
    }

    /// One call, recorded: its answer, or `None` if none came (or one the model has no
    /// word for: recorded as unanswered, since its effect is unknown, and kept as
    /// unexpected, which fails the test).
    fn call(&mut self, key: KeyId, run: RunId, call: LeaseCall) -> Option<LeaseOutput> {
        let input = LeaseInput { key, run, call };
        let call_ns = self.sh.now_ns();
        let answer = self.http(&input);
        let return_ns = self.sh.now_ns();
        let answer = answer.map(|(status, body)| output(&input, status, &body));
        let Ok(Ok(out)) = answer else {
            if let Ok(Err(what)) = answer {
                self.unexpected
                    .push(format!("client {}: {input:?}: {what}", self.id));
            }
            self.history
                .push(Operation::unanswered(self.id, call_ns, input));
            return None;
        };
        self.history
            .push(Operation::answered(self.id, call_ns, return_ns, input, out));
        Some(out)
    }

    /// The HTTP request for `input`: status and JSON body, or the transport's error.
    fn http(&self, input: &LeaseInput) -> Result<(u16, Value), ureq::Error> {
        let (name, k) = (run_name(input.run), input.key);
        let path = match input.call {
            LeaseCall::Acquire => "/v1/runs".to_string(),
            LeaseCall::Renew { .. } => format!("/v1/runs/{name}/renew"),
            LeaseCall::Release { .. } => format!("/v1/runs/{name}/release"),
            LeaseCall::Check { fence } => format!("/v1/fences/check?run_id={name}&fence={fence}"),
            LeaseCall::Query => format!("/v1/runs/{name}"),
        };
        let body = match input.call {
            LeaseCall::Acquire => json!({
                "run_id": name, "project": format!("lc-p{k}"), "class": "analysis",
                "singletons": [format!("lc-k{k}")], "wait_s": 0, "ttl_s": TTL_S,
                "resources": {"slots": 1, "memory": 16 << 20, "cpu_millis": 10, "disk": 1 << 20},
            }),
            LeaseCall::Renew { fence } => json!({"fence": fence, "ttl_s": TTL_S}),
            LeaseCall::Release { fence } => json!({"fence": fence}),
            LeaseCall::Check { .. } | LeaseCall::Query => Value::Null,
        };
        let url = format!("{}{path}", self.sh.url);
        let auth = format!("Bearer {}", self.sh.token);
        let resp = if body.is_null() {
            self.agent.get(&url).header("Authorization", &auth).call()?
        } else {
            let post = self.agent.post(&url).header("Authorization", &auth);
            post.header("Content-Type", "application/json")
                .send(body.to_string().as_bytes())?
        };
        let status = resp.status().as_u16();
        let text = resp.into_body().read_to_string()?;
        Ok((
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        ))
    }
}

/// The model's word for an answer, or why it has none.
fn output(input: &LeaseInput, status: u16, body: &Value) -> Result<LeaseOutput, String> {
    let code = body["error"]["code"].as_str().unwrap_or("");
    let refused = matches!(
        (status, code),
        (409, "stale_fence") | (410, "gone") | (404, _)
    );
    let out = match (input.call, status) {
        (LeaseCall::Acquire, 201) => body["fence"]
            .as_u64()
            .map(|fence| LeaseOutput::Granted { fence }),
        (LeaseCall::Acquire, 410) => busy(body),
        (LeaseCall::Renew { .. }, 200) => Some(LeaseOutput::Done),
        (LeaseCall::Release { .. }, 200) if body["state"] == "released" => Some(LeaseOutput::Done),
        (LeaseCall::Renew { .. } | LeaseCall::Release { .. }, _) if refused => {
            Some(LeaseOutput::Refused)
        }
        (LeaseCall::Check { .. }, 200) => body["current"].as_bool().map(LeaseOutput::Current),
        (LeaseCall::Query, 200) if body["state"] == "granted" => body["fence"]
            .as_u64()
            .map(|fence| LeaseOutput::Holds { fence }),
        (LeaseCall::Query, 200 | 404) => Some(LeaseOutput::NotHolding),
        _ => None,
    };
    out.ok_or_else(|| format!("answered {status} {body}"))
}

/// `410 expired` because the singleton is held (A4), naming the holder if it can be
/// read from the reason's message; any other reason is not the model's.
fn busy(body: &Value) -> Option<LeaseOutput> {
    let reason = &body["error"]["details"]["reason"];
    if body["error"]["code"] != "expired" || reason["code"] != "key.exclusive" {
        return None;
    }
    let message = reason["message"].as_str().unwrap_or("");
    let holder = message
        .rsplit_once("by run ")
        .and_then(|(_, r)| run_number(r.trim()));
    Some(LeaseOutput::Busy { holder })
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A seed for the clients' choices (printed, so a run's mix can be repeated; the
/// threads' interleaving cannot be).
fn clock_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64)
}

/// splitmix64: enough for choosing calls.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}
