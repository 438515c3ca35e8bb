//! Issue 16, item 4: the HTTP API's request decoding, fuzzed against the real `berth`
//! binary over raw TCP, so the head and its framing are decoded by the daemon as much
//! as the JSON is. Every operation of the API's own OpenAPI document is tried with
//! structured-then-mutated requests: valid bodies with fields dropped, retyped, huge,
//! negative, deeply nested, duplicated or in odd Unicode, byte-level damage and raw
//! bytes; wrong and missing content types and tokens; odd path parameters (`..`,
//! `%00`, invalid percent-encoding, 9 KB) and query strings; chunked bodies, and heads
//! that break HTTP/1.1's framing.
//!
//! For every case: the daemon never dies or panics and answers `GET /v1/status` after
//! it; a 5xx is only one of the contract's documented 503s; a well-framed request
//! refused with a 4xx gets the error envelope (`{"error":{"code","message","details"}}`,
//! and a 400 `invalid` names its field in `details.field`); and a refused request
//! changes nothing: no journal entry but the record of its refusal (D5), the same
//! status and runs. Framing errors get hyper's 400 (or 505 for another HTTP version),
//! rewritten with the envelope (`http::enveloped`; pinned by
//! `tenancy.rs::concern_framing_errors_carry_the_error_envelope`). Every operation
//! must have been tried.
//!
//! The short run is part of `cargo test`; the long run is one command (the harness's
//! per-test deadline raised with it):
//!
//!     BERTH_TEST_TIMEOUT_S=86400 BERTH_FUZZ_CASES=100000 cargo test --release -p berth --test fuzz_http -- --nocapture
//!
//! (`BERTH_FUZZ_SEED=N` picks another seed.) It prints `fuzz-http: cases=N refused=M`.

mod common;
mod fuzz_support;

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::Daemon;
use proptest::collection::vec;
use proptest::prelude::*;
use serde_json::{json, Value};

/// Cases in the short run: ~10 s in the dev profile (~13 ms a case, most of it the
/// three reads of the state around it).
const CASES_DEFAULT: u32 = 800;
/// How long a fuzz request may take to be answered. Nothing the fuzz sends should
/// wait (its runs do not queue), but a mutation can make a valid long wait: past this
/// the test hangs up (A9: the waiter is cancelled) and goes on.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(3);
/// The most of an answer read.
const ANSWER_BYTES_MAX: usize = 1 << 20;
/// How long the daemon may take to settle after a change (stops, cleanups).
const SETTLE_TIMEOUT: Duration = Duration::from_secs(5);

/// The 5xx codes the contract documents (section 12), and `could_not_look` (S4: a
/// `/proc` read failed; retry): anything else, a 500 above all, is a bug.
const DOCUMENTED_5XX: &[&str] = &[
    "queue_full",
    "scopes_full",
    "budget_tokens_full",
    "workspace_unavailable",
    "worktree_unavailable",
    "shutting_down",
    "draining",
    "threads_full",
    "store_unavailable",
    "could_not_look",
];

/// Journal kinds that record a refusal (D5: an acquire the engine refused, an
/// operator's eviction refused), not a change.
const REFUSAL_KINDS: &[&str] = &["refused", "thread_evict_refused"];

/// Journal kinds a timer (or a stop finishing) writes on its own, about runs a refused
/// request did not name: a lease running out, its stop, its end.
const TIMER_KINDS: &[&str] = &[
    "expired",
    "stop_started",
    "ended",
    "reaped",
    "survivors",
    "degraded",
    "budget_token_lapsed",
];

// ---- the daemon and what it holds ----

/// One operation of the OpenAPI document.
#[derive(Clone, Debug)]
struct Route {
    method: String,
    path: String,
    query: Vec<String>,
    body: Option<String>,
}

/// The daemon under test and what the fuzz knows of its state.
struct Fixture {
    d: Daemon,
    routes: Vec<Route>,
    read_token: String,
    worktree: tempfile::TempDir,
    sleeper: RefCell<fuzz_support::Sleeper>,
    /// Fences of runs the fuzz saw granted, by run id.
    fences: RefCell<BTreeMap<String, u64>>,
    /// The journal's last sequence number the fuzz has seen.
    journal_seq: Cell<u64>,
    /// How much of the daemon's log has been checked for panics.
    log_checked: Cell<u64>,
}

/// The operations of the daemon's own OpenAPI document (`api/doc/tests.rs` pins it to
/// the router both ways, and to docs/openapi.json).
fn routes(d: &Daemon) -> Vec<Route> {
    let doc = d.get("/v1/openapi.json").body;
    let mut out = Vec::new();
    for (path, ops) in doc["paths"].as_object().expect("paths") {
        // A path item holds its operations by method, beside its description.
        let methods = [
            "get", "post", "put", "delete", "patch", "head", "options", "trace",
        ];
        for (method, op) in ops.as_object().unwrap() {
            if !methods.contains(&method.as_str()) {
                continue;
            }
            let query = op["parameters"]
                .as_array()
                .map(|ps| {
                    ps.iter()
                        .filter(|p| p["in"] == "query")
                        .map(|p| p["name"].as_str().unwrap().to_string())
                        .collect()
                })
                .unwrap_or_default();
            let body = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
                .as_str()
                .map(|r| r.rsplit('/').next().unwrap().to_string());
            out.push(Route {
                method: method.to_uppercase(),
                path: path.clone(),
                query,
                body,
            });
        }
    }
    out
}

fn fixture() -> Fixture {
    let (lo, hi) = common::run_ports(0, 10);
    let ports = format!("{lo}-{hi}");
    // Timers far out (thread idle time, its ttl): the only state changes while the
    // fuzz runs are the ones it asks for, and lease ends it can tell apart.
    let d = Daemon::start(&[
        "--slots-max",
        "64",
        "--resource",
        "gpu=2",
        "--port-range",
        &ports,
        "--thread-idle-after",
        "24h",
        "--thread-ttl",
        "30d",
    ]);
    let worktree = tempfile::tempdir().unwrap();
    std::fs::write(
        worktree.path().join(".berth.toml"),
        "concurrency = \"parallel\"\n",
    )
    .unwrap();
    let read = d.post("/v1/tokens", r#"{"scope": "read"}"#);
    assert_eq!(read.status, 201, "{:?}", read.body);
    let fx = Fixture {
        routes: routes(&d),
        read_token: read.body["token"].as_str().unwrap().to_string(),
        d,
        worktree,
        sleeper: RefCell::new(fuzz_support::Sleeper::start()),
        fences: RefCell::default(),
        journal_seq: Cell::new(0),
        log_checked: Cell::new(0),
    };
    baseline(&fx);
    fx
}

/// A run held for the whole fuzz, a scope with a token, a thread: something for every
/// path parameter to find.
fn baseline(fx: &Fixture) {
    for (path, body, want) in [
        ("/v1/runs", seed_acquire(fx, "fz-held", 0), 201),
        ("/v1/runs", seed_acquire(fx, "fz-budget", 3), 201),
        (
            "/v1/scopes/fz-scope/reservations",
            json!({"owner": "o1", "operation_id": "op1", "harness": "claude"}),
            201,
        ),
        ("/v1/threads/fz-thread/attach", seed_thread(), 200),
    ] {
        let r = fx.d.post(path, &body.to_string());
        assert_eq!(r.status, want, "{path} {body}: {:?}", r.body);
        note_fence(fx, &r.body);
    }
}

fn note_fence(fx: &Fixture, body: &Value) {
    if let (Some(id), Some(f)) = (body["run_id"].as_str(), body["fence"].as_u64()) {
        fx.fences.borrow_mut().insert(id.to_string(), f);
    }
}

// ---- what a case is ----

/// One fuzz case, as proptest makes and shrinks it; `build` turns it into bytes.
#[derive(Clone, Debug)]
struct Plan {
    /// The operation (index into the document's), and a method other than its own
    /// when `method` says so.
    route: u16,
    method: u8,
    /// Picks for the path's parameters and the body's seed.
    picks: Vec<u16>,
    /// Query parameters: (key pick, value pick).
    query: Vec<(u16, u16)>,
    /// Mutations of the JSON body, then at most one of its bytes.
    body: Vec<(u8, u16, u16)>,
    text: Option<(u8, u16, u16)>,
    /// Picks for the token, the content type, the accepted type and the framing.
    head: (u8, u8, u8, u8),
    raw: Vec<u8>,
    /// A tame case (one in four): the route's own method, a valid token, body and
    /// framing, a path parameter that exists, no query. Tame cases change the state
    /// (grants, releases, drains, scopes) that the wild ones are then refused against.
    tame: bool,
}

fn plans() -> impl Strategy<Value = Plan> {
    (
        (any::<u16>(), any::<u8>(), vec(any::<u16>(), 4)),
        vec((any::<u16>(), any::<u16>()), 0..4),
        vec((0u8..6, any::<u16>(), any::<u16>()), 0..4),
        proptest::option::weighted(0.15, (0u8..8, any::<u16>(), any::<u16>())),
        (any::<u8>(), any::<u8>(), any::<u8>(), any::<u8>()),
        (vec(any::<u8>(), 0..64), proptest::bool::weighted(0.25)),
    )
        .prop_map(
            |((route, method, picks), query, body, text, head, (raw, tame))| Plan {
                route,
                method,
                picks,
                query,
                body,
                text,
                head,
                raw,
                tame,
            },
        )
}

/// Run ids the paths and bodies use: live, budgeted, made by the fuzz, unknown, odd.
/// Odd ones are written as they go on the wire (percent-encoded where they must be).
const RUN_IDS: &[&str] = &[
    "fz-held",
    "fz-budget",
    "fz-0",
    "fz-1",
    "fz-2",
    "fz-3",
    "fz-4",
    "fz-5",
    "nope",
    "",
    ".",
    "..",
    "%2e%2e",
    "%00",
    "%FF",
    "%C3%A9",
    "%F0%9F%A6%80",
    "a%2Fb",
    "%",
    "%Z",
    "%%",
    "-x",
    "A",
    "a.b:c",
    "~",
    "a;b",
    "!$&'()*+,;=:@",
    "%20",
];
const THREAD_KEYS: &[&str] = &[
    "fz-thread",
    "fz-t1",
    "nope",
    "..",
    "%00",
    "%FF",
    "%2F",
    "",
    "-",
];
const SCOPE_IDS: &[&str] = &[
    "fz-scope", "fz-s1", "nope", "..", "%00", "%FF", "UPPER", "a%2Fb", "",
];
const OWNERS: &[&str] = &["o1", "op1", "o2", "..", "%00", "%FF", ""];

/// How many of each pool's first values name something that exists (or may).
const LIVE: usize = 2;

/// A path parameter's value for `name` in `path`, from `pick` (tame: one that exists).
fn param(path: &str, name: &str, pick: u16, tame: bool) -> String {
    let pool = match name {
        "key" => THREAD_KEYS,
        "owner" | "operation_id" => OWNERS,
        _ if path.starts_with("/v1/scopes") => SCOPE_IDS,
        _ => RUN_IDS,
    };
    let p = pick as usize;
    if tame {
        return match (pool == RUN_IDS, p % 2) {
            (true, 1) => format!("fz-{}", p / 2 % 6),
            _ => pool[p / 2 % LIVE].to_string(),
        };
    }
    match p % (pool.len() + 3) {
        i if i < pool.len() => pool[i].to_string(),
        // Long: over the id rule's 128, and over the 8 KiB target limit (414).
        i if i == pool.len() => "r".repeat(129),
        i if i == pool.len() + 1 => "r".repeat(9_000),
        _ => format!("fz-{}", p / 7 % 6),
    }
}

/// Query keys: the route's own, others', unknown and odd.
const QUERY_KEYS: &[&str] = &[
    "all",
    "limit",
    "wait_s",
    "fence",
    "run_id",
    "after",
    "through",
    "scope",
    "run",
    "project",
    "kind",
    "zz",
    "",
    "a%00",
    "%FF",
    "wait_s%00",
];
/// Query values: valid, out of range, not numbers, odd bytes, long.
const QUERY_VALUES: &[&str] = &[
    "true",
    "false",
    "0",
    "1",
    "2",
    "10",
    "301",
    "10000",
    "10001",
    "-1",
    "1e3",
    "18446744073709551616",
    "9007199254740992",
    "",
    "fz-held",
    "fz",
    "fz-scope",
    "granted,expired",
    "%00",
    "%FF",
    "a%20b",
    "+",
    "%",
    "TRUE",
    "0x10",
    "%201",
];

/// The request target: the route's path with its parameters, and a query string.
fn target(route: &Route, plan: &Plan) -> String {
    let mut path = String::new();
    let mut picks = plan.picks.iter().copied().cycle();
    for seg in route.path.split('/').skip(1) {
        path.push('/');
        match seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
            Some(name) => {
                let pick = picks.next().unwrap_or(0);
                path.push_str(&param(&route.path, name, pick, plan.tame))
            }
            None => path.push_str(seg),
        }
    }
    let pairs: Vec<String> = plan
        .query
        .iter()
        .map(|(k, v)| {
            let own = &route.query;
            let k = *k as usize;
            let key = if !own.is_empty() && k.is_multiple_of(2) {
                own[k / 2 % own.len()].as_str()
            } else {
                QUERY_KEYS[k % QUERY_KEYS.len()]
            };
            let v = *v as usize;
            let value = if v % 31 == 30 {
                "x".repeat(5_000)
            } else {
                QUERY_VALUES[v % QUERY_VALUES.len()].to_string()
            };
            format!("{key}={value}")
        })
        .collect();
    if !pairs.is_empty() && !plan.tame {
        path.push('?');
        path.push_str(&pairs.join("&"));
    }
    path
}

// ---- bodies ----

/// A valid acquire, in one of six shapes (minimal, labelled, in a worktree, with a
/// budget, in a thread, detached): every part of the request `build_request` reads.
fn seed_acquire(fx: &Fixture, id: &str, shape: u16) -> Value {
    // A project of its own: a project is serial until proven parallel, so runs of one
    // would mostly be refused for each other.
    let mut b = json!({"run_id": id, "project": id, "ttl_s": 86_400,
        "wait_s": 0, "resources": {"memory": 1 << 20, "cpu_millis": 10, "disk": 0}});
    let extra = match shape % 6 {
        0 => json!({}),
        1 => json!({"labels": {"k": "v"}, "class": "managed", "priority": "background",
            "singletons": ["db"], "stop_grace_s": 1}),
        2 => json!({"worktree": fx.worktree.path(), "class": "analysis"}),
        3 => json!({"budget": {"scope": "fz-scope", "harness": "claude",
            "per_harness": {"claude": 64, "codex": 64}, "operation_id": "op"}}),
        4 => json!({"thread": "fz-thread", "resources": {"gpu": 1, "memory": 1 << 20}}),
        _ => json!({"detach": true}),
    };
    b.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    b
}

fn seed_thread() -> Value {
    json!({"run_id": "fz-held", "owner_gen": "g1", "owner_fence": 1, "run_budget_ms": 86_400_000})
}

/// A valid body of the schema `schema` for the request at `path`: the base each
/// mutation starts from. A schema without a seed fails the test, so a new route's body
/// is fuzzed from the day it is added.
fn seed_body(fx: &Fixture, schema: &str, path: &str, pick: u16) -> Value {
    let id = path.split('/').nth(3).unwrap_or("");
    let fence = fx.fences.borrow().get(id).copied().unwrap_or(1);
    let k = pick % 4;
    let scope = ["read", "operator", "admin"][k as usize % 3];
    let mode = ["pause", "resume"][k as usize % 2];
    match schema {
        "AcquireRequest" => seed_acquire(fx, &format!("fz-{}", pick % 6), pick / 6),
        "RenewRequest" => json!({"fence": fence, "ttl_s": 86_400}),
        "ReleaseRequest" | "RuntimeRequest" => json!({"fence": fence}),
        "ProcessRequest" => json!({"fence": fence, "pid": pid(fx, pick)}),
        "TokenRequest" => json!({"scope": scope, "uid": 65_534}),
        "ThreadClaim" => seed_thread(),
        "DrainRequest" => json!({"reason": "fuzz"}),
        "ReservationRequest" => {
            json!({"owner": format!("o{k}"), "operation_id": format!("op{k}"), "harness": "claude"})
        }
        "ReconcileRequest" => json!({"owner": format!("o{k}"), "reason": "fuzz"}),
        "ControlRequest" => json!({"request_id": format!("rq{pick}"), "mode": mode}),
        other => panic!("no seed body for schema {other} ({path}): add one"),
    }
}

/// Process ids a registration names: only ones the fuzz may see stopped (its own
/// sleeper) or that berth must refuse (pid 1 and 2, the daemon, the test, none).
/// Never another process of this user: a registration that took would have it killed.
fn pid(fx: &Fixture, pick: u16) -> i64 {
    let mut s = fx.sleeper.borrow_mut();
    if s.ended() {
        *s = fuzz_support::Sleeper::start();
    }
    let daemon = fx.d.child.as_ref().map_or(0, |c| c.id() as i64);
    [
        s.pid() as i64,
        1,
        2,
        0,
        -1,
        daemon,
        std::process::id() as i64,
        i32::MAX as i64,
        4_194_305,
    ][pick as usize % 9]
}

/// A JSON document as the fuzz builds it: members in order (so a key can be given
/// twice) and raw text where `serde_json::Value` cannot hold it (`1e400`, a lone
/// surrogate, an array 2,000 deep).
#[derive(Clone, Debug)]
enum J {
    Raw(String),
    Str(String),
    Arr(Vec<J>),
    Obj(Vec<(String, J)>),
}

impl J {
    fn of(v: &Value) -> J {
        match v {
            Value::String(s) => J::Str(s.clone()),
            Value::Array(a) => J::Arr(a.iter().map(J::of).collect()),
            Value::Object(o) => J::Obj(o.iter().map(|(k, v)| (k.clone(), J::of(v))).collect()),
            other => J::Raw(other.to_string()),
        }
    }

    fn render(&self, out: &mut String) {
        match self {
            J::Raw(r) => out.push_str(r),
            J::Str(s) => out.push_str(&Value::String(s.clone()).to_string()),
            J::Arr(a) => {
                out.push('[');
                for (i, v) in a.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    v.render(out);
                }
                out.push(']');
            }
            J::Obj(o) => {
                out.push('{');
                for (i, (k, v)) in o.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&Value::String(k.clone()).to_string());
                    out.push(':');
                    v.render(out);
                }
                out.push('}');
            }
        }
    }

    /// Every place in the document, as child indexes from the root.
    fn places(&self, at: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
        out.push(at.clone());
        let n = match self {
            J::Arr(a) => a.len(),
            J::Obj(o) => o.len(),
            _ => 0,
        };
        for i in 0..n {
            at.push(i);
            self.child(i).places(at, out);
            at.pop();
        }
    }

    fn child(&self, i: usize) -> &J {
        match self {
            J::Arr(a) => &a[i],
            J::Obj(o) => &o[i].1,
            _ => unreachable!("a leaf has no children"),
        }
    }

    fn at_mut(&mut self, at: &[usize]) -> &mut J {
        match (at.split_first(), self) {
            (None, j) => j,
            (Some((i, rest)), J::Arr(a)) => a[*i].at_mut(rest),
            (Some((i, rest)), J::Obj(o)) => o[*i].1.at_mut(rest),
            _ => unreachable!("a place is a path of children"),
        }
    }
}

/// Raw JSON values at every edge: types, limits of u64, i64, i32 and JSON's safe
/// integers, floats, overflow, escapes, lone surrogates, nesting past serde's 128.
fn odd_json(pick: u16) -> String {
    const ODD: &[&str] = &[
        "null",
        "true",
        "false",
        "0",
        "-0",
        "-1",
        "1",
        "1.5",
        "1.0",
        "1e3",
        "1e400",
        "-1e-400",
        "86400",
        "86401",
        "18446744073709551615",
        "18446744073709551616",
        "-9223372036854775809",
        "9007199254740991",
        "9007199254740992",
        "2147483647",
        "2147483648",
        "\"\"",
        "\"1\"",
        "[]",
        "{}",
        "[1]",
        "{\"a\":1}",
        "\"\\ud800\"",
        "\"\\u0000\"",
        "\"\\udfff\\ud800\"",
        "\"🦀é\\u202e\"",
        "\"a\\nb\"",
    ];
    let p = pick as usize;
    match p % (ODD.len() + 4) {
        i if i < ODD.len() => ODD[i].to_string(),
        i if i == ODD.len() => format!("{}1{}", "[".repeat(127), "]".repeat(127)),
        i if i == ODD.len() + 1 => format!("{}1{}", "[".repeat(129), "]".repeat(129)),
        i if i == ODD.len() + 2 => format!("{}{}", "{\"a\":".repeat(2_000), "}".repeat(2_000)),
        _ => format!("\"{}\"", "x".repeat(70_000)),
    }
}

/// Strings at every rule's edge: empty, reserved, separators, control characters,
/// non-ASCII, words of other fields, and lengths around the limits.
fn odd_string(pick: u16) -> String {
    const ODD: &[&str] = &[
        "",
        " ",
        "a",
        "fz",
        "fz-held",
        "fz-budget",
        "..",
        ".",
        "/",
        "a/b",
        "-x",
        "x-",
        "A",
        "\0",
        "\n",
        "\t",
        "\r",
        "é",
        "🦀",
        "\u{202e}",
        "a b",
        "%00",
        "null",
        "/tmp",
        "/nonexistent/berth-fuzz",
        "relative/path",
        "claude",
        "CLAUDE",
        "pause",
        "stop",
        "resume",
        "read",
        "admin",
        "operator",
        "serial",
        "background",
        "analysis",
        "exclusive",
        "fleet:x",
        "ports",
        "gpu",
        "BERTH_FENCE",
    ];
    let p = pick as usize;
    match p % (ODD.len() + 5) {
        i if i < ODD.len() => ODD[i].to_string(),
        i if i == ODD.len() => "x".repeat(65),
        i if i == ODD.len() + 1 => "x".repeat(129),
        i if i == ODD.len() + 2 => "x".repeat(257),
        i if i == ODD.len() + 3 => "x".repeat(1_025),
        _ => "x".repeat(5_000),
    }
}

/// Field names: every body's, and some no body has.
const KEYS: &[&str] = &[
    "run_id",
    "project",
    "class",
    "priority",
    "resources",
    "memory",
    "cpu_millis",
    "slots",
    "disk",
    "gpu",
    "ports",
    "singletons",
    "budget",
    "scope",
    "harness",
    "per_harness",
    "operation_id",
    "manifest",
    "worktree",
    "ttl_s",
    "wait_s",
    "labels",
    "stop_grace_s",
    "detach",
    "thread",
    "fence",
    "pid",
    "uid",
    "owner_gen",
    "owner_fence",
    "run_budget_ms",
    "evict",
    "reason",
    "owner",
    "request_id",
    "mode",
    "zz",
    "",
    "Project",
    "fence ",
];

/// One mutation of the body at a place: 0 drops it, 1 makes it an odd raw value, 2 an
/// odd string, 3 adds a member (known or not) under it, 4 an odd number, 5 gives one of
/// its members twice.
fn mutate(doc: &mut J, (kind, at, pick): (u8, u16, u16)) {
    let mut all = Vec::new();
    doc.places(&mut Vec::new(), &mut all);
    let place = all[at as usize % all.len()].clone();
    if kind == 0 {
        if let Some((last, parent)) = place.split_last() {
            match doc.at_mut(parent) {
                J::Arr(a) => drop(a.remove(*last)),
                J::Obj(o) => drop(o.remove(*last)),
                _ => {}
            }
        }
        return;
    }
    let here = doc.at_mut(&place);
    match kind {
        1 => *here = J::Raw(odd_json(pick)),
        2 => *here = J::Str(odd_string(pick)),
        3 | 5 => match here {
            J::Obj(o) if kind == 5 && !o.is_empty() => {
                let key = o[pick as usize % o.len()].0.clone();
                o.push((key, J::Raw(odd_json(pick / 3))));
            }
            J::Obj(o) => o.push((
                KEYS[pick as usize % KEYS.len()].into(),
                J::Raw(odd_json(pick / 7)),
            )),
            J::Arr(a) => a.push(J::Str(odd_string(pick))),
            _ => {
                *here = J::Obj(vec![(
                    KEYS[pick as usize % KEYS.len()].into(),
                    J::Raw("1".into()),
                )])
            }
        },
        _ => *here = J::Raw(odd_json(pick % 21 + 3)),
    }
}

/// One mutation of the body's bytes: truncate, insert a significant byte, delete one,
/// prepend a BOM, append garbage, put two documents in one, make it invalid UTF-8, or
/// replace it with the raw bytes.
fn mutate_bytes(body: &mut Vec<u8>, (kind, at, pick): (u8, u16, u16), raw: &[u8]) {
    const SPECIAL: &[u8] = b"{}[]\":,\\\0\xff\xc3\n \t";
    let pos = if body.is_empty() {
        0
    } else {
        at as usize % body.len()
    };
    match kind {
        0 => body.truncate(pos),
        1 => body.insert(pos, SPECIAL[pick as usize % SPECIAL.len()]),
        2 if !body.is_empty() => drop(body.remove(pos)),
        3 => body.splice(0..0, "\u{feff}".bytes()).for_each(drop),
        4 => body.extend_from_slice(b" GARBAGE"),
        5 => {
            let copy = body.clone();
            body.extend_from_slice(&copy);
        }
        6 => body.insert(pos, 0xff),
        _ => *body = raw.to_vec(),
    }
}

/// The body of a case: its route's seed, mutated; a route without a body gets none,
/// or (now and then) garbage.
fn body(fx: &Fixture, route: &Route, path: &str, plan: &Plan) -> Vec<u8> {
    let mut bytes = match &route.body {
        Some(schema) => {
            let mut doc = J::of(&seed_body(fx, schema, path, plan.picks[1]));
            for m in plan.body.iter().filter(|_| !plan.tame) {
                mutate(&mut doc, *m);
            }
            let mut s = String::new();
            doc.render(&mut s);
            s.into_bytes()
        }
        None if plan.picks[2].is_multiple_of(8) && !plan.tame => plan.raw.clone(),
        None => Vec::new(),
    };
    if let Some(t) = plan.text.filter(|_| !plan.tame) {
        mutate_bytes(&mut bytes, t, &plan.raw);
    }
    bytes
}

// ---- requests on the wire ----

/// A request as sent: its bytes, whether its framing is valid HTTP/1.1 (so that any
/// refusal of it is berth's, with the envelope), and what it names.
struct Req {
    bytes: Vec<u8>,
    well_framed: bool,
    method: String,
    route: usize,
    target: String,
    /// The run ids it names (path and body): a refusal may not touch them.
    names: Vec<String>,
}

/// Methods besides a route's own: others the router knows, and ones it does not.
const OTHER_METHODS: &[&str] = &[
    "GET", "POST", "DELETE", "PUT", "PATCH", "HEAD", "OPTIONS", "TRACE",
];

fn build(fx: &Fixture, plan: &Plan) -> Req {
    let ri = plan.route as usize % fx.routes.len();
    let route = &fx.routes[ri];
    let method = if plan.method % 8 == 7 && !plan.tame {
        OTHER_METHODS[plan.method as usize / 8 % OTHER_METHODS.len()].to_string()
    } else {
        route.method.clone()
    };
    let target = target(route, plan);
    let body = body(fx, route, &target, plan);
    let mut names: Vec<String> = target
        .split(['/', '?'])
        .nth(3)
        .map(str::to_string)
        .into_iter()
        .collect();
    if let Some(id) = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|b| b["run_id"].as_str().map(str::to_string))
    {
        names.push(id);
    }
    let (bytes, well_framed) = frame(fx, plan, &method, &target, &body);
    Req {
        bytes,
        well_framed,
        method,
        route: ri,
        target,
        names,
    }
}

/// The head's token, content type and accepted type for a case.
fn head_lines(fx: &Fixture, plan: &Plan) -> String {
    let (auth, ctype, accept, _) = if plan.tame { (0, 0, 0, 0) } else { plan.head };
    let admin = &fx.d.token;
    let mut h = String::from("Host: 127.0.0.1\r\nConnection: close\r\n");
    let token = match auth % 16 {
        0..=12 => Some(format!("Bearer {admin}")),
        13 => Some(format!("Bearer {}", fx.read_token)),
        14 => None,
        _ => Some(
            [
                "Bearer wrong",
                "Bearer ",
                "Basic YTpi",
                "bearer x",
                "Bearer a b",
            ][auth as usize / 16 % 5]
                .to_string(),
        ),
    };
    if let Some(t) = token {
        h.push_str(&format!("Authorization: {t}\r\n"));
    }
    match ctype % 6 {
        0..=2 => h.push_str("Content-Type: application/json\r\n"),
        3 => {}
        4 => h.push_str("Content-Type: text/plain\r\n"),
        _ => h.push_str("Content-Type: application/json; charset=utf-16\r\n"),
    }
    match accept % 8 {
        6 => h.push_str("Accept: application/x-ndjson\r\n"),
        7 => h.push_str("Accept: text/event-stream\r\n"),
        _ => {}
    }
    h
}

/// The case's bytes on the wire, and whether their framing is valid: a body with its
/// length or chunked (13 in 16), else one of HTTP/1.1's framing errors.
fn frame(fx: &Fixture, plan: &Plan, method: &str, target: &str, body: &[u8]) -> (Vec<u8>, bool) {
    let head = head_lines(fx, plan);
    let framing = if plan.tame { 0 } else { plan.head.3 % 16 };
    let mut out = Vec::new();
    let line = |out: &mut Vec<u8>, extra: &str| {
        out.extend_from_slice(format!("{method} {target} HTTP/1.1\r\n{head}{extra}").as_bytes());
    };
    match framing {
        0..=11 => {
            line(&mut out, &format!("Content-Length: {}\r\n\r\n", body.len()));
            out.extend_from_slice(body);
        }
        12 => {
            line(&mut out, "Transfer-Encoding: chunked\r\n\r\n");
            for chunk in body.chunks(1 + plan.picks[3] as usize % 700) {
                out.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
                out.extend_from_slice(chunk);
                out.extend_from_slice(b"\r\n");
            }
            out.extend_from_slice(b"0\r\n\r\n");
        }
        _ => return (malformed(plan, method, target, &head, body), false),
    }
    (out, true)
}

/// A request whose framing is broken in one of eight ways.
fn malformed(plan: &Plan, method: &str, target: &str, head: &str, body: &[u8]) -> Vec<u8> {
    let n = body.len();
    let text = match plan.picks[3] % 8 {
        0 => format!(
            "{method} {target} HTTP/1.1\r\n{head}Content-Length: {n}\r\nContent-Length: {}\r\n\r\n",
            n + 1
        ),
        1 => {
            format!("{method} {target} HTTP/1.1\r\n{head}Transfer-Encoding: chunked\r\n\r\nzz\r\n")
        }
        2 => format!(
            "{method} {target} HTTP/1.1\n{}Content-Length: {n}\n\n",
            head.replace("\r\n", "\n")
        ),
        3 => format!("{method} {target}\u{e9}\u{0} HTTP/1.1\r\n{head}\r\n"),
        4 => format!("{method} {target} HTTP/2.0\r\n{head}Content-Length: {n}\r\n\r\n"),
        5 => format!(
            "{method} {target} HTTP/1.1\r\n{head}Broken header line\r\nX-Big: {}\r\n\r\n",
            "b".repeat(70_000)
        ),
        6 => format!(
            "{} {target} HTTP/1.1\r\n{head}Content-Length: {n}\r\n\r\n",
            method.to_lowercase()
        ),
        _ => return plan.raw.clone(),
    };
    let mut out = text.into_bytes();
    out.extend_from_slice(body);
    out
}

/// What came back: the status (none if the connection closed or timed out first), the
/// content type and the body.
#[derive(Debug, Default)]
struct Answer {
    status: Option<u16>,
    content_type: String,
    body: Vec<u8>,
    timed_out: bool,
}

/// Sends a case on its own connection and reads the answer (a stream's head only).
fn send(port: u16, req: &Req) -> Answer {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect to the daemon");
    s.set_read_timeout(Some(ANSWER_TIMEOUT)).unwrap();
    s.set_write_timeout(Some(ANSWER_TIMEOUT)).unwrap();
    // A daemon that refuses the head early closes before the body is written: what it
    // answered is still read.
    let _ = s.write_all(&req.bytes);
    read_answer(&mut s, req.method == "HEAD")
}

fn read_answer(s: &mut std::net::TcpStream, head_only: bool) -> Answer {
    let mut buf = Vec::new();
    let mut a = Answer::default();
    let head_end = loop {
        if let Some(i) = find(&buf, b"\r\n\r\n") {
            break i + 4;
        }
        if !fill(s, &mut buf, &mut a) {
            return a;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    a.status = head.split(' ').nth(1).and_then(|c| c.parse().ok());
    let header = |name: &str| {
        head.lines()
            .find_map(|l| {
                l.split_once(':')
                    .filter(|(k, _)| k.eq_ignore_ascii_case(name))
            })
            .map(|(_, v)| v.trim().to_string())
    };
    a.content_type = header("content-type").unwrap_or_default();
    let streaming = a.content_type.contains("event-stream") || a.content_type.contains("ndjson");
    if head_only || (streaming && a.status == Some(200)) {
        return a;
    }
    let length: Option<usize> = header("content-length").and_then(|v| v.parse().ok());
    let chunked = header("transfer-encoding").is_some_and(|v| v.contains("chunked"));
    while length.is_none_or(|n| buf.len() < head_end + n)
        && !(chunked && buf.ends_with(b"0\r\n\r\n"))
        && buf.len() < ANSWER_BYTES_MAX
    {
        if !fill(s, &mut buf, &mut a) {
            break;
        }
    }
    let body = &buf[head_end.min(buf.len())..];
    a.body = if chunked {
        dechunk(body)
    } else {
        body.to_vec()
    };
    a
}

/// Reads more of the answer; false at its end (closed, failed or timed out).
fn fill(s: &mut std::net::TcpStream, buf: &mut Vec<u8>, a: &mut Answer) -> bool {
    let mut chunk = [0u8; 16 << 10];
    match s.read(&mut chunk) {
        Ok(0) => false,
        Ok(n) => {
            buf.extend_from_slice(&chunk[..n]);
            buf.len() < ANSWER_BYTES_MAX
        }
        Err(e) => {
            a.timed_out = matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            );
            false
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn dechunk(mut body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(i) = find(body, b"\r\n") {
        let size = std::str::from_utf8(&body[..i])
            .ok()
            .and_then(|s| usize::from_str_radix(s.trim(), 16).ok())
            .unwrap_or(0);
        if size == 0 || body.len() < i + 2 + size {
            break;
        }
        out.extend_from_slice(&body[i + 2..i + 2 + size]);
        body = &body[(i + 4 + size).min(body.len())..];
    }
    out
}

// ---- the checks ----

/// The state a refused request must leave alone: the status, the live runs, and the
/// journal's new entries.
#[derive(Debug)]
struct Snapshot {
    status: Value,
    runs: Value,
    entries: Vec<Value>,
}

/// Figures that move with time alone, with no journal entry: memory granted in the
/// last 30 s is pending (A2), which sets what may be granted now and why a waiter waits.
const MOVING: &[&str] = &[
    "memory_pending",
    "memory_available",
    "effective_max_now",
    "min_run_blocked",
    "reason",
    "position",
];

/// `v` without its `MOVING` figures, at any depth.
fn settled(mut v: Value) -> Value {
    match &mut v {
        Value::Object(o) => {
            o.retain(|k, _| !MOVING.contains(&k.as_str()));
            for x in o.values_mut() {
                *x = settled(x.take());
            }
        }
        Value::Array(a) => a.iter_mut().for_each(|x| *x = settled(x.take())),
        _ => {}
    }
    v
}

/// The state now, and every journal entry since the last snapshot (which it moves on).
fn snapshot(fx: &Fixture) -> Snapshot {
    let status = fx.d.get("/v1/status");
    assert_eq!(
        status.status, 200,
        "GET /v1/status after a case: {:?}",
        status.body
    );
    let status = settled(status.body);
    let runs = settled(fx.d.get("/v1/runs").body);
    let mut entries = Vec::new();
    loop {
        let page =
            fx.d.get(&format!("/v1/journal?after={}", fx.journal_seq.get()));
        let lines: Vec<Value> = match page.body {
            Value::String(text) => text
                .lines()
                .filter_map(|l| serde_json::from_str(l).ok())
                .collect(),
            one => vec![one],
        };
        if lines.is_empty() {
            break;
        }
        fx.journal_seq
            .set(lines.last().unwrap()["seq"].as_u64().unwrap());
        entries.extend(lines);
    }
    Snapshot {
        status,
        runs,
        entries,
    }
}

/// The daemon is alive and has not panicked (its log says so if a thread did).
fn alive(fx: &Fixture) -> Result<(), String> {
    let child = fx.d.child.as_ref().ok_or("the daemon is gone")?;
    if !common::alive(child.id() as i32) {
        return Err(format!(
            "the daemon died; it logged:\n{}",
            common::log_tail(&fx.d.log)
        ));
    }
    let log = std::fs::read(&fx.d.log).unwrap_or_default();
    let new = &log[(fx.log_checked.get() as usize).min(log.len())..];
    fx.log_checked.set(log.len() as u64);
    if find(new, b"panicked").is_some() {
        return Err(format!(
            "the daemon panicked:\n{}",
            String::from_utf8_lossy(new)
        ));
    }
    Ok(())
}

/// A 5xx is a documented one; a refusal of a well-framed request has the envelope, a
/// 400 `invalid` naming its field.
fn check_answer(req: &Req, a: &Answer) -> Result<(), String> {
    let Some(status) = a.status else {
        return Ok(());
    };
    let body: Value = serde_json::from_slice(&a.body).unwrap_or(Value::Null);
    let code = body["error"]["code"].as_str().unwrap_or("");
    // hyper answers a request line of another HTTP version with a bare 505 (one of
    // its framing answers, a stated limit): only a well-framed request is held to it.
    let hypers = status == 505 && !req.well_framed;
    if status >= 500 && !DOCUMENTED_5XX.contains(&code) && !hypers {
        return Err(format!(
            "answered {status} {}",
            String::from_utf8_lossy(&a.body)
        ));
    }
    if status < 400 || !req.well_framed || req.method == "HEAD" {
        return Ok(());
    }
    let e = &body["error"];
    let enveloped = !code.is_empty()
        && e["message"].as_str().is_some_and(|m| !m.is_empty())
        && e["details"].is_object()
        && a.content_type.starts_with("application/json");
    if !enveloped {
        return Err(format!(
            "a {status} without the error envelope: {:?}",
            String::from_utf8_lossy(&a.body)
        ));
    }
    let field = e["details"]["field"].as_str().unwrap_or("");
    if code == "invalid" && field.is_empty() {
        return Err(format!("a 400 invalid that names no field: {body}"));
    }
    Ok(())
}

/// Did berth refuse the request (so that nothing may have changed)? A 4xx but `410`
/// (a wait that ran out is an outcome: the run was recorded as expired), or a 503.
fn refused(a: &Answer) -> bool {
    matches!(a.status, Some(s) if ((400..500).contains(&s) && s != 410) || s == 503)
}

/// A refused request changed nothing: no journal entry but its refusal's record and what
/// timers write about runs it did not name, and (with no such entries) the same status
/// and runs.
fn check_unchanged(req: &Req, before: &Snapshot, after: &Snapshot) -> Result<(), String> {
    let mut timers = false;
    for e in &after.entries {
        let kind = e["kind"].as_str().unwrap_or("");
        let run = e["run_id"].as_str().unwrap_or("");
        if REFUSAL_KINDS.contains(&kind) {
            continue;
        }
        if TIMER_KINDS.contains(&kind) && !req.names.iter().any(|n| n == run) {
            timers = true;
            continue;
        }
        return Err(format!("a refused request changed the state: journal {e}"));
    }
    if !timers && (before.status != after.status || before.runs != after.runs) {
        return Err(format!(
            "a refused request changed the state:\nstatus {} -> {}\nruns {} -> {}",
            before.status, after.status, before.runs, after.runs
        ));
    }
    Ok(())
}

/// After a change, waits until the daemon is done with it (no stop in flight, the
/// journal quiet for a moment): the next refused case is judged against settled state.
fn settle(fx: &Fixture) -> Snapshot {
    let end = Instant::now() + SETTLE_TIMEOUT;
    loop {
        std::thread::sleep(Duration::from_millis(20));
        let now = snapshot(fx);
        let busy = now.status["releasing"].as_u64().unwrap_or(0) > 0;
        if (now.entries.is_empty() && !busy) || Instant::now() > end {
            return now;
        }
    }
}

/// One case: sent, answered, checked; the state settled for the next.
fn case(fx: &Fixture, before: &mut Snapshot, plan: &Plan, tally: &Tally) -> Result<(), String> {
    let req = build(fx, plan);
    let a = send(fx.d.port, &req);
    alive(fx)?;
    let what = || {
        format!(
            "{} {} ({} bytes)",
            req.method,
            clip(&req.target),
            req.bytes.len()
        )
    };
    check_answer(&req, &a).map_err(|e| format!("{}: {e}", what()))?;
    tally.note(req.route, &a);
    let after = snapshot(fx);
    if refused(&a) {
        check_unchanged(&req, before, &after).map_err(|e| format!("{}: {e}", what()))?;
        *before = after;
        return Ok(());
    }
    if let Ok(b) = serde_json::from_slice::<Value>(&a.body) {
        note_fence(fx, &b);
    }
    *before = settle(fx);
    Ok(())
}

/// At most `CLIP_CHARS` of a target in a failure (one may be 9 KB of one letter).
fn clip(s: &str) -> String {
    const CLIP_CHARS: usize = 200;
    match s.char_indices().nth(CLIP_CHARS) {
        Some((at, _)) => format!("{}… ({} bytes)", &s[..at], s.len()),
        None => s.to_string(),
    }
}

/// What the run tried: cases, refusals, and cases per route (every route must be tried).
#[derive(Default)]
struct Tally {
    cases: Cell<u64>,
    refused: Cell<u64>,
    per_route: RefCell<BTreeMap<usize, u64>>,
}

impl Tally {
    fn note(&self, route: usize, a: &Answer) {
        self.cases.set(self.cases.get() + 1);
        if a.status.is_none_or(|s| s >= 400) {
            self.refused.set(self.refused.get() + 1);
        }
        *self.per_route.borrow_mut().entry(route).or_default() += 1;
    }
}

#[test]
fn fuzz_http() {
    let fx = fixture();
    let cases = fuzz_support::cases(CASES_DEFAULT);
    let tally = Tally::default();
    let before = RefCell::new(snapshot(&fx));
    let result = fuzz_support::runner(cases).run(&plans(), |plan| {
        case(&fx, &mut before.borrow_mut(), &plan, &tally).map_err(TestCaseError::fail)
    });
    fuzz_support::report("fuzz-http", tally.cases.get(), tally.refused.get(), "");
    fuzz_support::verdict("fuzz-http", result);
    let per_route = tally.per_route.borrow();
    for (i, r) in fx.routes.iter().enumerate() {
        assert!(
            cases < 10 * fx.routes.len() as u32 || per_route.contains_key(&i),
            "{} {} was never tried",
            r.method,
            r.path
        );
    }
}

/// Found by this fuzz: a thread key, scope id, owner or operation id in a path that
/// is not valid percent-encoded UTF-8 got axum's plain-text 400 ("Invalid URL: Invalid
/// UTF-8 in `id`"), not the error envelope; run ids already had theirs (`RunIdPath`).
#[test]
fn regression_a_non_utf8_path_parameter_gets_the_envelope() {
    let d = Daemon::start(&[]);
    for (method, path, field) in [
        ("GET", "/v1/threads/%FF", "key"),
        ("DELETE", "/v1/threads/%FF", "key"),
        ("POST", "/v1/threads/%FF/attach", "key"),
        ("GET", "/v1/scopes/%FF", "id"),
        ("POST", "/v1/scopes/%FF/control", "id"),
        ("DELETE", "/v1/scopes/s1/reservations/%FF/op1", "owner"),
        (
            "DELETE",
            "/v1/scopes/s1/reservations/o1/%C3%28",
            "operation_id",
        ),
        // Found by the long form of this fuzz (`scripts/reliability.sh`): the token
        // revocation's id was axum's plain-text 400.
        ("DELETE", "/v1/tokens/%FF", "id"),
    ] {
        let r = d.call(method, path, Some("{}"));
        assert_eq!(
            (
                r.status,
                r.code(),
                r.body["error"]["details"]["field"].as_str()
            ),
            (400, "invalid", Some(field)),
            "{method} {path}: {:?}",
            r.body
        );
    }
}

/// Found by this fuzz: a query parameter without a name (`?=true`) was refused as
/// ": is not a known query parameter" with `details.field` empty: a 400 naming nothing.
#[test]
fn regression_a_nameless_query_parameter_is_refused_naming_the_query() {
    let d = Daemon::start(&[]);
    for path in [
        "/v1/runs?=true",
        "/v1/runs/fz?=1",
        "/v1/fences/check?=1&run_id=a&fence=1",
        "/v1/journal?=1",
    ] {
        let r = d.get(path);
        assert_eq!(
            (
                r.status,
                r.code(),
                r.body["error"]["details"]["field"].as_str()
            ),
            (400, "invalid", Some("query")),
            "{path}: {:?}",
            r.body
        );
    }
}
