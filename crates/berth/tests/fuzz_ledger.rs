//! Issue 16, item 4: the ledger loader fed corrupt rows (D4). A real daemon writes a
//! real ledger (a granted run with a registered process, ports, labels and a thread;
//! an ended run; a budgeted run with its scope, tokens and receipts; a detached
//! waiter; a token; a drain); then each case corrupts a copy of it with rusqlite
//! (values out of their domain, NULLs, wrong types in loosened tables, invalid UTF-8,
//! garbage words, maps and JSON, duplicated and deleted rows, another schema version,
//! flipped bytes) and starts the daemon on it in-process, exactly as `berth serve`
//! does (`berth_server::start`: the S6 checks, `SqliteStore::open_exclusive`, `load`,
//! and the engine's restore, which runs `check_invariants()` and refuses a ledger that
//! fails it).
//!
//! Each start must either refuse with an error naming the ledger (D4), or serve, and a
//! daemon that serves must answer every read route and stop cleanly. Never a panic,
//! in any thread (a panic hook counts them). And never a guess: when a corruption put
//! a value berth never writes into a column the loader reads (a negative count or
//! time, a pid outside 1..=2^31-1, an unknown word, a NULL, a wrong type), gave a fence
//! twice, removed the fence counter or changed the schema version, the start must
//! refuse.
//!
//! The short run is part of `cargo test`; the long run is one command:
//!
//!     BERTH_FUZZ_CASES=100000 cargo test --release -p berth --test fuzz_ledger -- --nocapture
//!
//! (`BERTH_FUZZ_SEED=N` picks another seed.) It prints `fuzz-ledger: cases=N refused=M`.

mod fuzz_support;

use std::cell::Cell;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use proptest::collection::vec;
use proptest::prelude::*;
use serde_json::{json, Value};

/// Cases in the short run: ~7 s in the dev profile (each case starts and stops a
/// daemon, ~30 ms with the state dir in memory, and serves `SERVE_MS` of that).
const CASES_DEFAULT: u32 = 250;
/// The daemon's tick in the fuzz: several ticks (expiries, reaping, the memory and
/// thread sweeps) run on the loaded state before it is stopped.
const TICK_MS: u64 = 10;
/// How long a daemon that loaded a corrupt ledger serves before it is stopped.
const SERVE_MS: u64 = 30;

// ---- panics in any thread ----

/// Panics anywhere in the process since the hook was set: the daemon's threads (the
/// state thread, the writer, tokio's workers) panic out of sight of the test's thread.
static PANICS: AtomicUsize = AtomicUsize::new(0);

fn count_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let before = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, Ordering::SeqCst);
            before(info);
        }));
    });
}

// ---- the daemon ----

/// A `--port-range` of ten ports for the template's run, apart from other test
/// binaries' (the scheme of `common::run_ports`, at offset 280 of this binary's block).
fn run_ports() -> (u16, u16) {
    let lo = 26_000 + (std::process::id() % 20) as u16 * 300 + 280;
    (lo, lo + 9)
}

fn serve_config(state: &Path) -> berth_server::ServeConfig {
    let mut engine = berth_core::Config::for_host(4, 8 << 30, 100 << 30);
    engine.memory_reserve = 1 << 30;
    berth_server::ServeConfig {
        state_dir: state.to_path_buf(),
        listen: "127.0.0.1:0".parse().unwrap(),
        insecure_no_auth: true,
        engine,
        sample_memory: false,
        pressure_source: None,
        cpu_pressure_source: None,
        io_pressure_source: None,
        reconnect_window_ms: 30_000,
        group_commit: true,
        tick_ms: TICK_MS,
        stop_grace_ms: 1_000,
        cgroups: false,
        limits: Default::default(),
        diagnostics_run_bytes_max: 1 << 20,
        diagnostics_total_bytes_max: 1 << 30,
        init_ledger: false,
        fence_reserve_block: berth_server::private::FENCE_RESERVE_BLOCK,
        user_workspaces: None,
        retain_ended_for_ms: berth_server::RETAIN_ENDED_FOR_MS_DEFAULT,
        token_streams_max: berth_server::limits::TOKEN_STREAMS_MAX_DEFAULT,
        token_waits_max: berth_server::limits::TOKEN_WAITS_MAX_DEFAULT,
        port_range: run_ports(),
        threads: Default::default(),
        fleet: None,
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// One HTTP call to the daemon at `base`: its status and JSON body (or text).
fn call(
    base: &str,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> Result<(u16, Value), String> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(30)))
        .build()
        .into();
    let url = format!("{base}{path}");
    let resp = match method {
        "GET" => agent.get(&url).call(),
        _ => agent
            .post(&url)
            .header("Content-Type", "application/json")
            .send(body.map(Value::to_string).unwrap_or_default().as_bytes()),
    }
    .map_err(|e| format!("{method} {path}: no answer ({e})"))?;
    let status = resp.status().as_u16();
    let text = resp.into_body().read_to_string().unwrap_or_default();
    Ok((
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    ))
}

/// A state dir whose ledger a real daemon wrote: something in every table.
fn template(sleeper: &fuzz_support::Sleeper) -> tempfile::TempDir {
    let state = scratch_dir();
    let wt = state.path().join("worktree");
    std::fs::create_dir(&wt).unwrap();
    std::fs::write(
        wt.join(".berth.toml"),
        "concurrency = \"parallel\"\n[[port]]\nname = \"web\"\nlaunch = { command = \"true\" }\n",
    )
    .unwrap();
    let rt = runtime();
    let running = rt
        .block_on(berth_server::start(serve_config(state.path())))
        .unwrap();
    let base = format!("http://{}", running.addr);
    for (method, path, body, want) in template_calls(&wt, sleeper.pid()) {
        let (status, answer) = call(&base, method, &path, Some(&body)).unwrap();
        assert_eq!(status, want, "{method} {path} {body}: {answer}");
    }
    rt.block_on(running.stop()).unwrap();
    state
}

/// What the template's daemon is asked, and the status each must answer.
fn template_calls(wt: &Path, pid: u32) -> Vec<(&'static str, String, Value, u16)> {
    let tiny = json!({"memory": 1 << 20, "cpu_millis": 10, "disk": 0});
    let run = |id: &str, extra: Value| {
        let mut b = json!({"run_id": id, "project": id, "ttl_s": 86_400, "wait_s": 0,
            "resources": tiny, "singletons": ["db"]});
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        b
    };
    vec![
        (
            "POST",
            "/v1/runs".into(),
            run("l-held", json!({"worktree": wt, "labels": {"k": "v=1"}})),
            201,
        ),
        (
            "POST",
            "/v1/runs/l-held/processes".into(),
            json!({"fence": 1, "pid": pid}),
            201,
        ),
        (
            "POST",
            "/v1/runs".into(),
            run("l-ended", json!({"singletons": []})),
            201,
        ),
        (
            "POST",
            "/v1/runs/l-ended/release".into(),
            json!({"fence": 2}),
            200,
        ),
        (
            "POST",
            "/v1/runs".into(),
            run(
                "l-budget",
                json!({"singletons": [],
            "budget": {"scope": "s1", "harness": "claude", "per_harness": {"claude": 2, "codex": 1}}}),
            ),
            201,
        ),
        (
            "POST",
            "/v1/scopes/s1/reservations".into(),
            json!({"owner": "o1", "operation_id": "op1", "harness": "claude"}),
            201,
        ),
        (
            "POST",
            "/v1/scopes/s1/control".into(),
            json!({"request_id": "r1", "mode": "pause"}),
            200,
        ),
        (
            "POST",
            "/v1/scopes/s1/control".into(),
            json!({"request_id": "r2", "mode": "resume"}),
            200,
        ),
        (
            "POST",
            "/v1/threads/t1/attach".into(),
            json!({"run_id": "l-held", "owner_gen": "g1", "owner_fence": 1, "run_budget_ms": 86_400_000}),
            200,
        ),
        (
            "POST",
            "/v1/runs".into(),
            run("l-queued", json!({"detach": true, "wait_s": 86_400})),
            202,
        ),
        ("POST", "/v1/tokens".into(), json!({"scope": "read"}), 201),
        ("POST", "/v1/drain".into(), json!({"reason": "fuzz"}), 200),
    ]
}

/// Copies the template's state dir (files and directories; nothing else is in it).
fn copy_tree(from: &Path, to: &Path) {
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let (src, dst) = (e.path(), to.join(e.file_name()));
        if e.file_type().unwrap().is_dir() {
            std::fs::create_dir(&dst).unwrap();
            copy_tree(&src, &dst);
        } else {
            std::fs::copy(&src, &dst).unwrap();
        }
    }
}

// ---- corruptions ----

/// What berth ever writes into a column (for the "never a guess" oracle), or `Free`:
/// a column the loader does not read, or whose every value it may take as it is.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Dom {
    /// A count, time or sequence number: a non-negative integer.
    U,
    OptU,
    /// A process id: 1..=i32::MAX.
    Pid,
    /// A port number: 0..=65535.
    Port,
    /// One of berth's words.
    Word,
    OptWord,
    /// UTF-8 text.
    Text,
    OptText,
    /// `k=v` lines (`Named`: v a count).
    Map,
    Named,
    /// A budget as JSON, or NULL.
    Json,
    /// `runs.terminal`: 0 or 1 (anything else and the run is in neither half of the load).
    Flag,
    /// The decimal text of a non-negative integer (`meta.value` of `last_fence`).
    UText,
    Free,
}

/// Every column a corruption may hit, with its domain.
const COLUMNS: &[(&str, &str, Dom)] = &[
    ("runs", "run_id", Dom::Text),
    ("runs", "project", Dom::Text),
    ("runs", "class", Dom::Word),
    ("runs", "priority", Dom::Word),
    ("runs", "slots", Dom::U),
    ("runs", "memory", Dom::U),
    ("runs", "cpu_millis", Dom::U),
    ("runs", "disk", Dom::U),
    ("runs", "named", Dom::Named),
    ("runs", "singletons", Dom::Text),
    ("runs", "contract_concurrency", Dom::OptWord),
    // Read only for a run with a contract (its concurrency not NULL).
    ("runs", "contract_fingerprint", Dom::Free),
    ("runs", "ttl_ms", Dom::U),
    ("runs", "wait_ms", Dom::U),
    ("runs", "labels", Dom::Map),
    ("runs", "state", Dom::Word),
    ("runs", "fence", Dom::OptU),
    ("runs", "queue_seq", Dom::U),
    ("runs", "enqueued_ms", Dom::U),
    ("runs", "deadline_ms", Dom::U),
    ("runs", "granted_ms", Dom::OptU),
    ("runs", "expires_ms", Dom::OptU),
    ("runs", "end_cause", Dom::OptWord),
    ("runs", "primary_mode", Dom::Word),
    ("runs", "ws_dev", Dom::OptU),
    ("runs", "ws_ino", Dom::OptU),
    ("runs", "terminal", Dom::Flag),
    ("runs", "stop_grace_ms", Dom::OptU),
    ("runs", "thread", Dom::OptText),
    ("runs", "budget", Dom::Json),
    ("runs", "ended_unix_ms", Dom::Free),
    ("processes", "pid", Dom::Pid),
    ("processes", "start_ticks", Dom::U),
    ("processes", "boot_id", Dom::Text),
    ("ports", "name", Dom::Text),
    ("ports", "port", Dom::Port),
    ("threads", "owner_gen", Dom::OptText),
    ("threads", "owner_fence", Dom::OptU),
    ("threads", "reg_attached_ms", Dom::OptU),
    ("threads", "reg_deadline_ms", Dom::OptU),
    ("threads", "ws_dev", Dom::OptU),
    ("threads", "created_ms", Dom::U),
    ("threads", "active_ms", Dom::U),
    ("threads", "evictions", Dom::Text),
    ("drain", "reason", Dom::Text),
    ("scopes", "policy", Dom::Text),
    ("scopes", "control", Dom::Word),
    ("scopes", "generation", Dom::U),
    ("scope_receipts", "mode", Dom::Word),
    ("scope_receipts", "generation", Dom::U),
    ("scope_receipts", "at_ms", Dom::U),
    ("scope_tokens", "harness", Dom::Text),
    ("scope_tokens", "since_ms", Dom::U),
    ("meta", "value", Dom::UText),
    ("tokens", "scope", Dom::Free),
    ("journal_chunks", "first_seq", Dom::Free),
    ("journal_chunks", "last_seq", Dom::Free),
    ("journal_chunks", "packed", Dom::Free),
];

/// The values a corruption writes, as SQL.
const VALUES: &[&str] = &[
    "-1",
    "-9223372036854775808",
    "-86400000",
    "0",
    "1",
    "2",
    "9223372036854775807",
    "4294967301",
    "9007199254740993",
    "65536",
    "NULL",
    "'bogus'",
    "''",
    "'GRANTED'",
    "'granted'",
    "'released'",
    "'queued'",
    "'shared'",
    "'k'",
    "'k=x'",
    "'{'",
    "'[]'",
    "'{\"scope\":1}'",
    "'a b/../c'",
    "'7'",
    "'12abc'",
    "1.5",
    "X'00FF'",
    "CAST(X'FF' AS TEXT)",
    "CAST(X'C328' AS TEXT)",
];

/// Tables whose schema a `Loosen` may rewrite.
const TABLES: &[&str] = &[
    "runs",
    "processes",
    "ports",
    "threads",
    "scopes",
    "scope_receipts",
    "scope_tokens",
    "meta",
];

/// One corruption.
#[derive(Clone, Debug)]
enum Op {
    /// Column `COLUMNS[col]` of the `row`-th row (wrapping) becomes `VALUES[val]`.
    Set { col: u16, row: u16, val: u16 },
    /// The table's schema loses `STRICT` and `NOT NULL` (through `writable_schema`), so
    /// a `Set` can store a wrong type or a NULL: what a damaged or forged file holds.
    Loosen(u16),
    /// The `row`-th row of a table is deleted (`meta`: its `last_fence`).
    Delete { table: u16, row: u16 },
    /// The `row`-th run again, under another id and a later queue sequence (its fence,
    /// if any, twice).
    DupRun(u16),
    /// `PRAGMA user_version`: -1, 0, one below or above this berth's, or 1,000.
    Version(u8),
    /// The file's byte at `at` (wrapping) xor `mask`.
    Flip { at: u32, mask: u8 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (any::<u16>(), any::<u16>(), any::<u16>())
            .prop_map(|(col, row, val)| Op::Set { col, row, val }),
        2 => any::<u16>().prop_map(Op::Loosen),
        2 => (any::<u16>(), any::<u16>()).prop_map(|(table, row)| Op::Delete { table, row }),
        1 => any::<u16>().prop_map(Op::DupRun),
        1 => (0u8..5).prop_map(Op::Version),
        1 => (any::<u32>(), 1u8..=255).prop_map(|(at, mask)| Op::Flip { at, mask }),
    ]
}

/// Why a start on a corrupted ledger must refuse, if it must.
type MustRefuse = Option<String>;

/// A cell a `Set` changed: table, column, rowid, domain.
type Touched = (&'static str, &'static str, i64, Dom);

/// Applies `ops` to the ledger at `db`: `Loosen`s first (so a `Set` can use them), then
/// the rows, the version, and last the bytes of the closed file. Returns why a load
/// must refuse, judged on the ledger as the ops left it: a value berth never writes
/// where the loader reads it, a fence given twice, a missing fence counter, another
/// schema version. Not judged when a row was deleted, a run renamed (their processes,
/// ports and tokens are then not read) or bytes flipped (a flip may undo a corruption).
fn corrupt(db: &Path, ops: &[Op]) -> MustRefuse {
    for op in ops {
        if let Op::Loosen(t) = op {
            loosen(db, TABLES[*t as usize % TABLES.len()]);
        }
    }
    let conn = rusqlite::Connection::open(db).unwrap();
    conn.pragma_update(None, "synchronous", "OFF").unwrap();
    // This berth's schema version: what the template was written with.
    let current: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    let mut cells = Vec::new();
    let mut judged = true;
    for op in ops {
        match op {
            Op::Set { col, row, val } => cells.extend(set(&conn, *col, *row, *val)),
            Op::Delete { table, row } => judged &= delete(&conn, *table, *row),
            Op::DupRun(row) => dup_run(&conn, *row),
            Op::Version(pick) => {
                let v = [-1, 0, current - 1, current + 1, 1_000][*pick as usize % 5];
                conn.pragma_update(None, "user_version", v).unwrap();
            }
            Op::Loosen(_) | Op::Flip { .. } => {}
        }
    }
    judged &= !cells.iter().any(|c| (c.0, c.1) == ("runs", "run_id"));
    let must = judge(&conn, &cells, current);
    drop(conn);
    for op in ops {
        if let Op::Flip { at, mask } = op {
            judged = false;
            flip(db, *at, *mask);
        }
    }
    must.filter(|_| judged)
}

/// Why the ledger as it is now must be refused, if it must.
fn judge(conn: &rusqlite::Connection, cells: &[Touched], current: i64) -> MustRefuse {
    for (table, column, rowid, dom) in cells {
        let stored = conn
            .query_row(
                &format!("SELECT {column} FROM {table} WHERE rowid = {rowid}"),
                [],
                |r| Ok(Stored::of(r.get_ref(0)?)),
            )
            // Gone: an `INTEGER PRIMARY KEY` (`journal_chunks.first_seq`) is the rowid.
            .ok();
        if let Some(v) = stored.filter(|v| !in_domain(*dom, v)) {
            return Some(format!("{table}.{column} = {v:?}"));
        }
    }
    let version: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    if version != current {
        return Some(format!(
            "schema version {version} (this berth's is {current})"
        ));
    }
    let one = |sql: &str| conn.query_row(sql, [], |_| Ok(())).is_ok();
    if !one("SELECT 1 FROM meta WHERE key = 'last_fence'") {
        return Some("no fence counter (meta.last_fence)".into());
    }
    if one("SELECT 1 FROM runs WHERE fence IS NOT NULL GROUP BY fence HAVING count(*) > 1") {
        return Some("a fence given to two runs (L1)".into());
    }
    None
}

/// Rewrites `table`'s schema without `STRICT` and `NOT NULL`.
fn loosen(db: &Path, table: &str) {
    let conn = rusqlite::Connection::open(db).unwrap();
    let sql: String = conn
        .query_row(
            "SELECT sql FROM sqlite_schema WHERE type = 'table' AND name = ?1",
            [table],
            |r| r.get(0),
        )
        .unwrap();
    let loose = sql.replace("NOT NULL", "").replace(") STRICT", ")");
    conn.pragma_update(None, "writable_schema", true).unwrap();
    conn.execute(
        "UPDATE sqlite_schema SET sql = ?1 WHERE type = 'table' AND name = ?2",
        [&loose, table],
    )
    .unwrap();
    conn.pragma_update(None, "writable_schema", false).unwrap();
}

/// The rowid of the `row`-th row of `table` (wrapping), if it has any.
fn nth_row(conn: &rusqlite::Connection, table: &str, row: u16) -> Option<i64> {
    let n: i64 = conn
        .query_row(&format!("SELECT count(*) FROM {table}"), [], |r| r.get(0))
        .ok()?;
    if n == 0 {
        return None;
    }
    conn.query_row(
        &format!("SELECT rowid FROM {table} ORDER BY rowid LIMIT 1 OFFSET ?1"),
        [row as i64 % n],
        |r| r.get(0),
    )
    .ok()
}

/// One `Set`: the cell it changed, if the schema let it.
fn set(conn: &rusqlite::Connection, col: u16, row: u16, val: u16) -> Option<Touched> {
    let (table, column, dom) = COLUMNS[col as usize % COLUMNS.len()];
    let value = VALUES[val as usize % VALUES.len()];
    // `meta` holds three values of different kinds: only `last_fence` is corrupted.
    let rowid = if table == "meta" {
        conn.query_row("SELECT rowid FROM meta WHERE key = 'last_fence'", [], |r| {
            r.get(0)
        })
        .ok()?
    } else {
        nth_row(conn, table, row)?
    };
    let sql = format!("UPDATE {table} SET {column} = {value} WHERE rowid = {rowid}");
    // Refused by the schema (a type or NULL a STRICT table will not store): no change.
    conn.execute(&sql, []).ok()?;
    Some((table, column, rowid, dom))
}

/// A value as SQLite stored it; text that is not UTF-8 is kept as `Bytes`.
#[derive(Debug)]
enum Stored {
    Null,
    Integer(i64),
    Text(String),
    /// Text that is not UTF-8.
    Bytes,
    Other,
}

impl Stored {
    fn of(v: rusqlite::types::ValueRef<'_>) -> Stored {
        use rusqlite::types::ValueRef as V;
        match v {
            V::Null => Stored::Null,
            V::Integer(n) => Stored::Integer(n),
            V::Text(t) => match std::str::from_utf8(t) {
                Ok(t) => Stored::Text(t.to_string()),
                Err(_) => Stored::Bytes,
            },
            V::Real(_) | V::Blob(_) => Stored::Other,
        }
    }
}

/// Does berth ever write `v` into a column of domain `dom`?
fn in_domain(dom: Dom, v: &Stored) -> bool {
    use Stored as V;
    match (dom, v) {
        (Dom::Free, _) => true,
        (Dom::OptU | Dom::OptWord | Dom::OptText | Dom::Json, V::Null) => true,
        (Dom::U | Dom::OptU, V::Integer(n)) => *n >= 0,
        (Dom::Pid, V::Integer(n)) => (1..=i32::MAX as i64).contains(n),
        (Dom::Port, V::Integer(n)) => (0..=65_535).contains(n),
        (Dom::Flag, V::Integer(n)) => *n == 0 || *n == 1,
        (Dom::Word | Dom::OptWord, V::Text(t)) => WORDS.contains(&t.as_str()),
        (Dom::Text | Dom::OptText, V::Text(_)) => true,
        (Dom::Map, V::Text(t)) => t.lines().all(|l| l.is_empty() || l.contains('=')),
        (Dom::Named, V::Text(t)) => t.lines().filter(|l| !l.is_empty()).all(|l| {
            l.split_once('=')
                .is_some_and(|(_, n)| n.parse::<u64>().is_ok())
        }),
        (Dom::Json, V::Text(t)) => serde_json::from_str::<Value>(t)
            .is_ok_and(|j| j["scope"].is_string() && j["harness"].is_string()),
        (Dom::UText, V::Text(t)) => t.parse::<u64>().is_ok(),
        _ => false,
    }
}

/// Every word berth writes in a word column (a word of another column is a semantic
/// corruption, which the loader or the engine's invariants may or may not refuse).
const WORDS: &[&str] = &[
    "queued",
    "granted",
    "releasing",
    "released",
    "expired",
    "cancelled",
    "rejected",
    "degraded",
    "managed",
    "analysis",
    "foreground",
    "background",
    "exclusive",
    "shared",
    "serial",
    "parallel",
    "disabled",
    "open",
    "paused",
    "stopped",
    "pause",
    "stop",
    "resume",
];

/// Deletes the `row`-th row of a table (`meta`: `last_fence`). Returns whether the
/// ledger can still be judged: a deleted row leaves others unread (a run's processes).
fn delete(conn: &rusqlite::Connection, table: u16, row: u16) -> bool {
    let table = TABLES[table as usize % TABLES.len()];
    if table == "meta" {
        let _ = conn.execute("DELETE FROM meta WHERE key = 'last_fence'", []);
        return true;
    }
    let Some(rowid) = nth_row(conn, table, row) else {
        return true;
    };
    conn.execute(&format!("DELETE FROM {table} WHERE rowid = {rowid}"), [])
        .is_err()
}

/// The `row`-th run again under another id (a fence it has, given twice: L1).
fn dup_run(conn: &rusqlite::Connection, row: u16) {
    let Some(rowid) = nth_row(conn, "runs", row) else {
        return;
    };
    let cols: Vec<String> = conn
        .prepare("SELECT name FROM pragma_table_info('runs')")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let select: Vec<String> = cols
        .iter()
        .map(|c| match c.as_str() {
            "run_id" => "run_id || '-dup'".to_string(),
            "queue_seq" => "queue_seq + 1000".to_string(),
            c => c.to_string(),
        })
        .collect();
    let sql = format!(
        "INSERT INTO runs ({}) SELECT {} FROM runs WHERE rowid = {rowid}",
        cols.join(", "),
        select.join(", ")
    );
    // A table `Loosen`ed or a row `Set` may refuse the copy: then there is none.
    let _ = conn.execute(&sql, []);
}

fn flip(db: &Path, at: u32, mask: u8) {
    let mut bytes = std::fs::read(db).unwrap();
    if bytes.is_empty() {
        return;
    }
    let i = at as usize % bytes.len();
    bytes[i] ^= mask;
    std::fs::write(db, bytes).unwrap();
}

// ---- one start ----

/// How a start on a corrupt ledger went.
#[derive(Debug)]
enum Outcome {
    Refused(String),
    Served,
}

/// Starts the daemon on `state` the way `berth serve` does; if it serves, reads every
/// read route, lets it tick, and stops it. A panic anywhere, a route that fails, or a
/// stop that reports the daemon died is an `Err`.
fn start_on(state: &Path) -> Result<Outcome, String> {
    let rt = runtime();
    let started = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        rt.block_on(berth_server::start(serve_config(state)))
    }))
    .map_err(|_| "berth_server::start panicked".to_string())?;
    let running = match started {
        Err(e) => return Ok(Outcome::Refused(format!("{e:#}"))),
        Ok(r) => r,
    };
    let base = format!("http://{}", running.addr);
    let probed = probe(&base);
    std::thread::sleep(Duration::from_millis(SERVE_MS));
    let stopped = rt.block_on(running.stop());
    probed?;
    stopped.map_err(|e| format!("the daemon did not stop cleanly: {e:#}"))?;
    Ok(Outcome::Served)
}

/// Every read route answers, with no 5xx but a documented 503 (the journal's
/// `store_unavailable` when a chunk of it does not read).
fn probe(base: &str) -> Result<(), String> {
    for path in [
        "/v1/status",
        "/v1/runs?all=true",
        "/v1/runs/l-held",
        "/v1/threads",
        "/v1/threads/t1",
        "/v1/scopes",
        "/v1/scopes/s1",
        "/v1/drain",
        "/v1/idle",
        "/v1/journal?after=0",
        "/v1/journal/export",
        "/v1/fences/check?run_id=l-held&fence=1",
        "/metrics",
    ] {
        let (status, body) = call(base, "GET", path, None)?;
        let documented = status == 503 && body["error"]["code"] == "store_unavailable";
        if status >= 500 && !documented {
            return Err(format!("GET {path}: {status} {body}"));
        }
    }
    Ok(())
}

/// A temporary directory in memory where there is one (`/dev/shm`): a case's copy,
/// its corruption and the daemon's start fsync a dozen times, which on a disk costs
/// more than the rest of the case.
fn scratch_dir() -> tempfile::TempDir {
    match tempfile::tempdir_in("/dev/shm") {
        Ok(d) => d,
        Err(_) => tempfile::tempdir().unwrap(),
    }
}

/// One case: a fresh copy of the template, corrupted, started on.
fn case(template: &Path, ops: &[Op], refused: &Cell<u64>) -> Result<(), String> {
    let dir = scratch_dir();
    copy_tree(template, dir.path());
    let must = corrupt(&dir.path().join("ledger.db"), ops);
    let panics = PANICS.load(Ordering::SeqCst);
    let outcome = start_on(dir.path());
    if PANICS.load(Ordering::SeqCst) != panics {
        return Err(format!("a thread panicked ({outcome:?})"));
    }
    match (outcome?, must) {
        (Outcome::Refused(e), _) => {
            refused.set(refused.get() + 1);
            if !e.contains("ledger") {
                return Err(format!("a refusal that does not name the ledger (D4): {e}"));
            }
            Ok(())
        }
        (Outcome::Served, Some(why)) => Err(format!(
            "served a ledger with {why}: a guess, not a refusal (D4)"
        )),
        (Outcome::Served, None) => Ok(()),
    }
}

#[test]
fn fuzz_ledger() {
    count_panics();
    let s = fuzz_support::Sleeper::start();
    let template = template(&s);
    let cases = fuzz_support::cases(CASES_DEFAULT);
    let (tried, refused) = (Cell::new(0u64), Cell::new(0u64));
    let result = fuzz_support::runner(cases).run(&vec(op(), 1..4), |ops| {
        tried.set(tried.get() + 1);
        case(template.path(), &ops, &refused).map_err(TestCaseError::fail)
    });
    fuzz_support::report("fuzz-ledger", tried.get(), refused.get(), "");
    fuzz_support::verdict("fuzz-ledger", result);
}

/// The template itself loads: the fuzz starts from a ledger berth accepts.
#[test]
fn the_template_ledger_loads() {
    count_panics();
    let s = fuzz_support::Sleeper::start();
    let template = template(&s);
    let refused = Cell::new(0);
    case(template.path(), &[], &refused).unwrap();
    assert_eq!(refused.get(), 0, "the untouched template was refused");
}

/// The refusal a start gives on a copy of `template` after `sql` (with `loose` tables
/// loosened first); fails the test if it served or panicked.
fn refusal_after(template: &Path, loose: &[&str], sql: &str) -> String {
    let dir = scratch_dir();
    copy_tree(template, dir.path());
    let db = dir.path().join("ledger.db");
    for t in loose {
        loosen(&db, t);
    }
    rusqlite::Connection::open(&db)
        .unwrap()
        .execute_batch(sql)
        .unwrap();
    let panics = PANICS.load(Ordering::SeqCst);
    let outcome = start_on(dir.path());
    assert_eq!(
        PANICS.load(Ordering::SeqCst),
        panics,
        "{sql}: a thread panicked"
    );
    match outcome {
        Ok(Outcome::Refused(e)) => e,
        other => panic!("{sql}: {other:?}, not a refusal (D4)"),
    }
}

/// Found by this fuzz: a negative count, time or sequence number was read as a huge
/// one (`-1` as 18446744073709551615: a lease that never expires, a queue position past
/// every other) or clamped to 0 (a thread's times), where berth writes no negative
/// number. Each is now refused, naming what holds it.
#[test]
fn regression_a_negative_figure_is_refused_not_read_as_huge() {
    count_panics();
    let s = fuzz_support::Sleeper::start();
    let template = template(&s);
    for (sql, names) in [
        (
            "UPDATE runs SET expires_ms = -1 WHERE run_id = 'l-held'",
            "run l-held",
        ),
        (
            "UPDATE runs SET memory = -1 WHERE run_id = 'l-held'",
            "run l-held",
        ),
        (
            "UPDATE runs SET queue_seq = -5 WHERE run_id = 'l-ended'",
            "run l-ended",
        ),
        (
            "UPDATE runs SET ws_dev = -1 WHERE run_id = 'l-held'",
            "run l-held",
        ),
        (
            "UPDATE processes SET start_ticks = -1",
            "run l-held: process",
        ),
        ("UPDATE threads SET reg_deadline_ms = -1", "thread t1"),
        ("UPDATE threads SET created_ms = -86400000", "thread t1"),
        ("UPDATE scopes SET generation = -1", "scope s1"),
        (
            "UPDATE scope_receipts SET at_ms = -1",
            "scope s1: a receipt",
        ),
        ("UPDATE scope_tokens SET since_ms = -1", "scope s1: a token"),
        ("UPDATE journal_chunks SET last_seq = -1", "journal"),
    ] {
        let e = refusal_after(template.path(), &[], sql);
        assert!(
            e.contains("negative") && e.contains(names) && e.contains("ledger"),
            "{sql}: {e}"
        );
    }
}

/// Found by this fuzz: a process id outside 1..=2^31-1 was cut to 32 bits (4294967301
/// became pid 5) or taken as it was (0, -1): a process berth never registered.
#[test]
fn regression_a_pid_outside_its_range_is_refused_not_truncated() {
    count_panics();
    let s = fuzz_support::Sleeper::start();
    let template = template(&s);
    for pid in ["4294967301", "0", "-1", "9223372036854775807"] {
        let sql = format!("UPDATE processes SET pid = {pid}");
        let e = refusal_after(template.path(), &[], &sql);
        assert!(e.contains(&format!("process id {pid}")), "{sql}: {e}");
    }
}

/// Found by this fuzz: a negative schema version (`user_version`) skipped every
/// migration (`-1 as usize`) and the ledger was read as current.
#[test]
fn regression_a_negative_schema_version_is_refused() {
    count_panics();
    let s = fuzz_support::Sleeper::start();
    let template = template(&s);
    let e = refusal_after(template.path(), &[], "PRAGMA user_version = -1");
    assert!(e.contains("schema version -1"), "{e}");
}

/// Found by this fuzz: a run whose `terminal` was neither 0 nor 1 was in neither half of
/// the load (`WHERE terminal = 0` / `= 1`), so it silently vanished.
#[test]
fn regression_a_run_neither_live_nor_ended_is_refused_not_dropped() {
    count_panics();
    let s = fuzz_support::Sleeper::start();
    let template = template(&s);
    for v in ["2", "-1"] {
        let sql = format!("UPDATE runs SET terminal = {v} WHERE run_id = 'l-held'");
        let e = refusal_after(template.path(), &[], &sql);
        assert!(
            e.contains("run l-held: terminal is neither 0 nor 1"),
            "{sql}: {e}"
        );
    }
    let e = refusal_after(
        template.path(),
        &["runs"],
        "UPDATE runs SET terminal = NULL WHERE run_id = 'l-ended'",
    );
    assert!(
        e.contains("run l-ended: terminal is neither 0 nor 1"),
        "{e}"
    );
}

/// Found by this fuzz: a thread whose creation or activity time was NULL (a table
/// without its NOT NULL) was read as created at time 0.
#[test]
fn regression_a_thread_without_its_times_is_refused() {
    count_panics();
    let s = fuzz_support::Sleeper::start();
    let template = template(&s);
    for column in ["created_ms", "active_ms"] {
        let sql = format!("UPDATE threads SET {column} = NULL");
        let e = refusal_after(template.path(), &["threads"], &sql);
        assert!(e.contains("thread t1: no"), "{sql}: {e}");
    }
}
