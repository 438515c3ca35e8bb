//! The embedded SQLite ledger.

use std::collections::BTreeMap;
use std::path::Path;

use berth_core::{ContractInfo, EndCause, Request, Resources};
use rusqlite::{params, Connection, OptionalExtension, Row};

use crate::{
    Batch, JournalEntry, Ledger, Mutation, ProcessRecord, Retention, RunRecord, Store, StoreError,
    WorkspaceIdentity, JOURNAL_ENTRIES_PER_RUN, JOURNAL_READ_MAX,
};

/// The most pages in use (not free) a ledger may have for its integrity check to run
/// at open: 64 MiB at 4 KiB pages, ~60 ms warm. `quick_check` reads every page in use,
/// so on a ledger that grew without retention (a million ended runs is ~400 MB) it
/// would cost seconds of every restart; retention keeps a ledger far below this.
pub const QUICK_CHECK_PAGES_MAX: i64 = 16_384;

/// D4: refuses a ledger that fails its own integrity check. Above
/// `QUICK_CHECK_PAGES_MAX` pages in use, the check waits for a start after retention
/// has pruned the ledger (said in the log); until then, what berth reads is still
/// checked page by page as SQLite reads it, and a corrupt page stops the daemon.
fn check_integrity(conn: &Connection, path: &Path) -> Result<(), StoreError> {
    let used: i64 = conn
        .query_row(
            "SELECT (SELECT page_count FROM pragma_page_count())
                  - (SELECT freelist_count FROM pragma_freelist_count())",
            [],
            |r| r.get(0),
        )
        .map_err(corrupt)?;
    if used > QUICK_CHECK_PAGES_MAX {
        tracing::warn!(
            pages = used,
            "ledger {}: larger than {QUICK_CHECK_PAGES_MAX} pages, so its integrity check is left for a start after retention has pruned it",
            path.display()
        );
        return Ok(());
    }
    let ok: String = conn
        .query_row("PRAGMA quick_check", [], |r| r.get(0))
        .map_err(corrupt)?;
    if ok != "ok" {
        return Err(StoreError::Corrupt(ok));
    }
    Ok(())
}

/// Schema migrations, applied in order; the ledger records how many have run.
const MIGRATIONS: &[&str] = &[
    // 1: meta, runs, tokens.
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) STRICT;
     INSERT INTO meta (key, value) VALUES ('last_fence', '0');
     CREATE TABLE runs (
        run_id TEXT PRIMARY KEY,
        project TEXT NOT NULL,
        class TEXT NOT NULL,
        priority TEXT NOT NULL,
        slots INTEGER NOT NULL,
        memory INTEGER NOT NULL,
        cpu_millis INTEGER NOT NULL,
        disk INTEGER NOT NULL,
        named TEXT NOT NULL,
        singletons TEXT NOT NULL,
        contract_concurrency TEXT,
        contract_fingerprint TEXT,
        contract_commit TEXT,
        ttl_ms INTEGER NOT NULL,
        wait_ms INTEGER NOT NULL,
        worktree TEXT,
        labels TEXT NOT NULL,
        state TEXT NOT NULL,
        fence INTEGER,
        queue_seq INTEGER NOT NULL,
        enqueued_ms INTEGER NOT NULL,
        deadline_ms INTEGER NOT NULL,
        granted_ms INTEGER,
        expires_ms INTEGER,
        end_cause TEXT,
        primary_mode TEXT NOT NULL,
        ws_path TEXT,
        ws_dev INTEGER,
        ws_ino INTEGER,
        terminal INTEGER NOT NULL
     ) STRICT;
     CREATE INDEX runs_terminal_seq ON runs (terminal, queue_seq);
     CREATE TABLE tokens (hash TEXT PRIMARY KEY, scope TEXT NOT NULL) STRICT;",
    // 2: process identities per run (P1).
    "CREATE TABLE processes (
        run_id TEXT NOT NULL,
        pid INTEGER NOT NULL,
        start_ticks INTEGER NOT NULL,
        boot_id TEXT NOT NULL,
        PRIMARY KEY (run_id, pid, start_ticks, boot_id)
     ) STRICT;",
    // 3: a run's own stop grace (P2).
    "ALTER TABLE runs ADD COLUMN stop_grace_ms INTEGER;",
    // 4: retention. When a run ended (wall clock: ages must survive reboots); runs that
    // ended before retention existed age from now. Not indexed: an index would cost
    // every lifecycle a write to spare a prune a scan of at most the retained rows. The
    // queue sequence floor keeps arrival numbers rising when the newest rows are gone.
    "ALTER TABLE runs ADD COLUMN ended_unix_ms INTEGER;
     UPDATE runs SET ended_unix_ms = CAST(unixepoch('subsec') * 1000 AS INTEGER)
       WHERE terminal = 1;
     INSERT INTO meta (key, value) VALUES ('queue_seq_floor', '0');",
    // 5: ports a live run declares and holds (W3); deleted when the run ends, so the
    // table only ever holds live runs.
    "CREATE TABLE ports (
        run_id TEXT NOT NULL,
        name TEXT NOT NULL,
        port INTEGER NOT NULL,
        PRIMARY KEY (run_id, name)
     ) STRICT;",
    // 6: promotion evidence per project (C3): what a run proved, until invalidated.
    "CREATE TABLE evidence (
        project TEXT PRIMARY KEY,
        fingerprint TEXT NOT NULL,
        git_commit TEXT,
        ports TEXT NOT NULL,
        at_ms INTEGER NOT NULL,
        run_id TEXT NOT NULL
     ) STRICT;",
    // 7: the journal (D5): every state change, in order, with the entry's bytes as
    // readers get them. `written_unix_ms` is for retention by age.
    "CREATE TABLE journal (
        seq INTEGER PRIMARY KEY,
        kind TEXT NOT NULL,
        run_id TEXT,
        project TEXT,
        line TEXT NOT NULL,
        written_unix_ms INTEGER NOT NULL
     ) STRICT;",
    // 8: the journal in chunks, one row per transaction: the entries a commit carries
    // (about fifty under load) as one text of records `kind TAB run_id TAB project TAB
    // line LF`, numbered from `first_seq`. A row each cost the ledger thread an insert
    // per entry and, once retention caught up, a delete per entry: some 40,000 of
    // each a second at full load. Existing entries become one chunk each.
    "CREATE TABLE journal_chunks (
        first_seq INTEGER PRIMARY KEY,
        last_seq INTEGER NOT NULL,
        entries TEXT NOT NULL,
        written_unix_ms INTEGER NOT NULL
     ) STRICT;
     INSERT INTO journal_chunks (first_seq, last_seq, entries, written_unix_ms)
       SELECT seq, seq,
              kind || char(9) || COALESCE(run_id, '') || char(9) || COALESCE(project, '')
                || char(9) || line || char(10),
              written_unix_ms
       FROM journal ORDER BY seq;
     DROP TABLE journal;",
    // 9: the chunks compressed (`pack`): a commit's JSON lines shrink about tenfold,
    // from some 14 KB (four overflow pages to write, and later to free) to one page.
    // The journal's text was the ledger thread's largest write: the commit's fsync
    // waited on it. `pack_text_chunks` moves the existing chunks in the same
    // transaction.
    "ALTER TABLE journal_chunks RENAME TO journal_chunks_text;
     CREATE TABLE journal_chunks (
        first_seq INTEGER PRIMARY KEY,
        last_seq INTEGER NOT NULL,
        packed BLOB NOT NULL,
        written_unix_ms INTEGER NOT NULL
     ) STRICT;",
    // 10: detached waiters (no connection holds their place, so a restart gives them
    // no reconnect window to lapse in).
    "ALTER TABLE runs ADD COLUMN detached INTEGER NOT NULL DEFAULT 0;",
    // 11: agent threads (G0-G2): the owner is kept for good, even with no registration
    // and no workspace; `evictions` is the audit trail, `reason@ms` comma-separated.
    // And the drain (G4), at most one row.
    "CREATE TABLE threads (
        key TEXT PRIMARY KEY,
        owner_gen TEXT,
        owner_fence INTEGER,
        owner_run TEXT,
        reg_attached_ms INTEGER,
        reg_deadline_ms INTEGER,
        has_workspace INTEGER NOT NULL,
        ws_path TEXT,
        ws_dev INTEGER,
        ws_ino INTEGER,
        created_ms INTEGER NOT NULL,
        active_ms INTEGER NOT NULL,
        evictions TEXT NOT NULL
     ) STRICT;
     CREATE TABLE drain (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        by_whom TEXT NOT NULL,
        at TEXT NOT NULL,
        reason TEXT NOT NULL
     ) STRICT;
     ALTER TABLE runs ADD COLUMN thread TEXT;",
    // 12: experiment budgets (B1-B5): a scope's frozen policy (`harness=limit`
    // comma-separated) and manifest (execution ids LF-separated), its control state and
    // generation; the receipts of accepted control requests (the newest
    // `RECEIPTS_MAX`); the tokens held by (owner, operation). A run's budget is its
    // request's, as JSON.
    "CREATE TABLE scopes (
        id TEXT PRIMARY KEY,
        policy TEXT NOT NULL,
        manifest_path TEXT,
        manifest_sha256 TEXT,
        manifest_ids TEXT,
        control TEXT NOT NULL,
        generation INTEGER NOT NULL
     ) STRICT;
     CREATE TABLE scope_receipts (
        scope TEXT NOT NULL,
        request_id TEXT NOT NULL,
        mode TEXT NOT NULL,
        generation INTEGER NOT NULL,
        control TEXT NOT NULL,
        at_ms INTEGER NOT NULL,
        PRIMARY KEY (scope, request_id)
     ) STRICT;
     CREATE TABLE scope_tokens (
        scope TEXT NOT NULL,
        owner TEXT NOT NULL,
        operation TEXT NOT NULL,
        harness TEXT NOT NULL,
        run_id TEXT,
        since_ms INTEGER NOT NULL,
        owner_lapsed INTEGER NOT NULL,
        PRIMARY KEY (scope, owner, operation)
     ) STRICT;
     ALTER TABLE runs ADD COLUMN budget TEXT;",
    // 17: lease-only runs (no workspace is made at the grant: issue 16), so a waiter
    // restored after a restart is granted as it asked.
    "ALTER TABLE runs ADD COLUMN lease_only INTEGER NOT NULL DEFAULT 0;",
    // 18: the uid of the uid-bound token that made a run (S9), so tenancy holds across
    // restarts.
    // A demoted holder's pending upgrade (C4), so a restore does not read it as an
    // exclusive holder beside the shared ones (S11: issue 32 finding 4).
    "ALTER TABLE runs ADD COLUMN owner_uid INTEGER;
     ALTER TABLE runs ADD COLUMN upgrading INTEGER NOT NULL DEFAULT 0;
     ALTER TABLE threads ADD COLUMN owner_uid INTEGER;",
    // 19: the uid whose token's run froze a scope (S9, S10: a per-uid quota, and who
    // may control or delete it).
    "ALTER TABLE scopes ADD COLUMN owner_uid INTEGER;",
    // 20: where a run's and a scope's entries start in the journal (0: unknown), so
    // retention keeps the entries of live runs and of scopes not yet forgotten
    // (issue 32 finding 8).
    "ALTER TABLE runs ADD COLUMN journal_first INTEGER NOT NULL DEFAULT 0;
     ALTER TABLE scopes ADD COLUMN journal_first INTEGER NOT NULL DEFAULT 0;",
];

/// The part of a migration SQL cannot do, run after its SQL in its transaction.
fn migrate_data(version: usize, tx: &rusqlite::Transaction) -> rusqlite::Result<()> {
    match version {
        9 => pack_text_chunks(tx),
        _ => Ok(()),
    }
}

/// Migration 9: every text chunk into a packed one, then the text table goes.
fn pack_text_chunks(tx: &rusqlite::Transaction) -> rusqlite::Result<()> {
    {
        let mut read = tx.prepare(
            "SELECT first_seq, last_seq, entries, written_unix_ms FROM journal_chunks_text",
        )?;
        let mut write = tx.prepare(
            "INSERT INTO journal_chunks (first_seq, last_seq, packed, written_unix_ms)
             VALUES (?1, ?2, ?3, ?4)",
        )?;
        let mut rows = read.query([])?;
        while let Some(r) = rows.next()? {
            let text: String = r.get(2)?;
            let (first, last, at): (i64, i64, i64) = (r.get(0)?, r.get(1)?, r.get(3)?);
            write.execute(params![first, last, pack(&text), at])?;
        }
    }
    tx.execute_batch("DROP TABLE journal_chunks_text;")
}

pub struct SqliteStore {
    conn: Connection,
}

fn corrupt(e: rusqlite::Error) -> StoreError {
    StoreError::Corrupt(e.to_string())
}

fn write_err(e: rusqlite::Error) -> StoreError {
    StoreError::Write(e.to_string())
}

impl SqliteStore {
    /// Opens (creating if needed) the ledger at `path` and migrates it. Other
    /// connections may open it too (tools, tests); the daemon uses [`Self::open_exclusive`].
    pub fn open(path: &Path) -> Result<SqliteStore, StoreError> {
        Self::open_with(path, false)
    }

    /// Like [`Self::open`], and SQLite holds an exclusive lock on the ledger for the
    /// connection's life (S5): a second daemon's open fails with "database is locked".
    pub fn open_exclusive(path: &Path) -> Result<SqliteStore, StoreError> {
        Self::open_with(path, true)
    }

    fn open_with(path: &Path, exclusive: bool) -> Result<SqliteStore, StoreError> {
        let open_err = |e: rusqlite::Error| StoreError::Open {
            path: path.display().to_string(),
            message: e.to_string(),
        };
        let conn = Connection::open(path).map_err(open_err)?;
        // D2: WAL with a full fsync at every commit; a busy timeout instead of errors.
        conn.busy_timeout(std::time::Duration::from_secs(5))
            .map_err(open_err)?;
        // S5: one daemon per ledger. Besides the daemon's lock on the state dir,
        // SQLite holds its own lock for the connection's life (set before WAL, so the
        // WAL index lives in this process's memory and no `-shm` file is shared).
        if exclusive {
            conn.execute_batch("PRAGMA locking_mode=EXCLUSIVE;")
                .map_err(open_err)?;
        }
        let mode: String = conn
            .query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
            .map_err(open_err)?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(StoreError::Open {
                path: path.display().to_string(),
                message: format!("could not switch to WAL (got {mode})"),
            });
        }
        // Sorts and the prune's scratch table in memory, not in files under /var/tmp.
        conn.execute_batch(
            "PRAGMA synchronous=FULL; PRAGMA foreign_keys=ON; PRAGMA temp_store=MEMORY;",
        )
        .map_err(open_err)?;
        check_integrity(&conn, path)?;
        let mut store = SqliteStore { conn };
        store.migrate()?;
        Ok(store)
    }

    fn migrate(&mut self) -> Result<(), StoreError> {
        let version: i64 = self
            .conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .map_err(corrupt)?;
        let supported = MIGRATIONS.len() as i64;
        // A negative version is no version berth wrote (D4; `as usize` below would
        // skip every migration).
        if version < 0 {
            return Err(StoreError::Corrupt(format!("schema version {version}")));
        }
        if version > supported {
            return Err(StoreError::TooNew {
                found: version,
                supported,
            });
        }
        for (i, sql) in MIGRATIONS.iter().enumerate().skip(version as usize) {
            let tx = self
                .conn
                .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
                .map_err(write_err)?;
            tx.execute_batch(sql).map_err(write_err)?;
            migrate_data(i + 1, &tx).map_err(write_err)?;
            tx.execute_batch(&format!("PRAGMA user_version = {}", i + 1))
                .map_err(write_err)?;
            tx.commit().map_err(write_err)?;
        }
        Ok(())
    }

    /// The `synchronous` pragma in force (tests assert it is FULL = 2).
    pub fn synchronous(&self) -> i64 {
        self.conn
            .query_row("PRAGMA synchronous", [], |r| r.get(0))
            .unwrap_or(-1)
    }

    /// The `journal_mode` pragma in force, lower case (tests assert it is `wal`).
    pub fn journal_mode(&self) -> String {
        self.conn
            .query_row("PRAGMA journal_mode", [], |r| r.get::<_, String>(0))
            .map(|m| m.to_ascii_lowercase())
            .unwrap_or_default()
    }
}

/// A word of the ledger (a class, a state, ...) read back through the one codec.
fn word<T: std::str::FromStr<Err = String>>(s: &str) -> Result<T, StoreError> {
    s.parse().map_err(StoreError::Corrupt)
}

/// `k=v` pairs joined by newlines; keys and values are validated names and labels
/// without newlines, which the server guarantees.
fn encode_map<V: ToString>(m: &BTreeMap<String, V>) -> String {
    m.iter()
        .map(|(k, v)| format!("{}={}", escape(k), escape(&v.to_string())))
        .collect::<Vec<_>>()
        .join("\n")
}

fn escape(s: &str) -> String {
    s.replace('%', "%25")
        .replace('=', "%3D")
        .replace('\n', "%0A")
}

fn unescape(s: &str) -> String {
    s.replace("%0A", "\n")
        .replace("%3D", "=")
        .replace("%25", "%")
}

fn decode_map(s: &str) -> Result<BTreeMap<String, String>, StoreError> {
    let mut m = BTreeMap::new();
    for line in s.lines().filter(|l| !l.is_empty()) {
        let (k, v) = line
            .split_once('=')
            .ok_or_else(|| StoreError::Corrupt(format!("bad map entry {line:?}")))?;
        m.insert(unescape(k), unescape(v));
    }
    Ok(m)
}

/// A count, time, sequence number or id as berth wrote it: never negative. One that is
/// was not written by berth, and is refused (D4) rather than read as a huge number.
fn u(v: i64) -> Result<u64, StoreError> {
    u64::try_from(v)
        .map_err(|_| StoreError::Corrupt(format!("{v}, where berth writes no negative number")))
}

/// A corrupt ledger's reason, said of `what` (a run, a thread, a scope).
fn of(what: &str, e: StoreError) -> StoreError {
    match e {
        StoreError::Corrupt(why) => StoreError::Corrupt(format!("{what}: {why}")),
        e => e,
    }
}

/// The columns `read_run` reads, in this order: by position, not by name (looking each
/// name up was an eighth of a restart's CPU).
const RUN_COLUMNS: &str = "run_id, project, class, priority, slots, memory, cpu_millis, disk, named, singletons, contract_concurrency, contract_fingerprint, contract_commit, ttl_ms, wait_ms, worktree, labels, state, fence, queue_seq, enqueued_ms, deadline_ms, granted_ms, expires_ms, end_cause, primary_mode, ws_path, ws_dev, ws_ino, stop_grace_ms, detached, thread, budget, lease_only, owner_uid, upgrading, journal_first";

/// Positions of `RUN_COLUMNS`.
mod col {
    pub const RUN_ID: usize = 0;
    pub const PROJECT: usize = 1;
    pub const CLASS: usize = 2;
    pub const PRIORITY: usize = 3;
    pub const SLOTS: usize = 4;
    pub const MEMORY: usize = 5;
    pub const CPU_MILLIS: usize = 6;
    pub const DISK: usize = 7;
    pub const NAMED: usize = 8;
    pub const SINGLETONS: usize = 9;
    pub const CONTRACT_CONCURRENCY: usize = 10;
    pub const CONTRACT_FINGERPRINT: usize = 11;
    pub const CONTRACT_COMMIT: usize = 12;
    pub const TTL_MS: usize = 13;
    pub const WAIT_MS: usize = 14;
    pub const WORKTREE: usize = 15;
    pub const LABELS: usize = 16;
    pub const STATE: usize = 17;
    pub const FENCE: usize = 18;
    pub const QUEUE_SEQ: usize = 19;
    pub const ENQUEUED_MS: usize = 20;
    pub const DEADLINE_MS: usize = 21;
    pub const GRANTED_MS: usize = 22;
    pub const EXPIRES_MS: usize = 23;
    pub const END_CAUSE: usize = 24;
    pub const PRIMARY_MODE: usize = 25;
    pub const WS_PATH: usize = 26;
    pub const WS_DEV: usize = 27;
    pub const WS_INO: usize = 28;
    pub const STOP_GRACE_MS: usize = 29;
    pub const DETACHED: usize = 30;
    pub const THREAD: usize = 31;
    pub const BUDGET: usize = 32;
    pub const LEASE_ONLY: usize = 33;
    pub const OWNER_UID: usize = 34;
    pub const UPGRADING: usize = 35;
    pub const JOURNAL_FIRST: usize = 36;
}

/// A run's record; what it refuses names the run.
fn read_run(row: &Row) -> Result<RunRecord, StoreError> {
    read_run_fields(row).map_err(|e| {
        let id: String = row.get(col::RUN_ID).unwrap_or_else(|_| "?".into());
        of(&format!("run {id}"), e)
    })
}

fn read_run_fields(row: &Row) -> Result<RunRecord, StoreError> {
    let (g, s) = (|i| int(row, i), |i| text(row, i));
    let (os, oi) = (|i| opt_text(row, i), |i| opt_int(row, i));
    let (dev, ino) = (
        oi(col::WS_DEV)?.map(u).transpose()?,
        oi(col::WS_INO)?.map(u).transpose()?,
    );
    let workspace = match (os(col::WS_PATH)?, dev, ino) {
        (Some(path), Some(dev), Some(ino)) => Some(WorkspaceIdentity { path, dev, ino }),
        _ => None,
    };
    Ok(RunRecord {
        request: read_request(row)?,
        worktree: os(col::WORKTREE)?,
        labels: decode_map(&s(col::LABELS)?)?,
        state: word(&s(col::STATE)?)?,
        fence: oi(col::FENCE)?.map(u).transpose()?,
        queue_seq: u(g(col::QUEUE_SEQ)?)?,
        enqueued_ms: u(g(col::ENQUEUED_MS)?)?,
        deadline_ms: u(g(col::DEADLINE_MS)?)?,
        granted_ms: oi(col::GRANTED_MS)?.map(u).transpose()?,
        expires_ms: oi(col::EXPIRES_MS)?.map(u).transpose()?,
        end_cause: os(col::END_CAUSE)?.as_deref().map(word).transpose()?,
        primary_mode: word(&s(col::PRIMARY_MODE)?)?,
        workspace,
        processes: Vec::new(),
        ports: Vec::new(),
        stop_grace_ms: oi(col::STOP_GRACE_MS)?.map(u).transpose()?,
        detached: g(col::DETACHED)? != 0,
        thread: os(col::THREAD)?,
        lease_only: g(col::LEASE_ONLY)? != 0,
        owner_uid: oi(col::OWNER_UID)?
            .map(|v| {
                u32::try_from(v)
                    .map_err(|_| StoreError::Corrupt(format!("owner_uid {v} is not a uid")))
            })
            .transpose()?,
        upgrading: match g(col::UPGRADING)? {
            0 => false,
            1 => true,
            v => return Err(StoreError::Corrupt(format!("upgrading {v} is not 0 or 1"))),
        },
        journal_first: u(g(col::JOURNAL_FIRST)?)?,
    })
}

/// The run's request as it was accepted: its claim, contract and budget.
fn read_request(row: &Row) -> Result<Request, StoreError> {
    let (g, s, os) = (|i| int(row, i), |i| text(row, i), |i| opt_text(row, i));
    let named = decode_map(&s(col::NAMED)?)?
        .into_iter()
        .map(|(k, v)| {
            v.parse::<u64>()
                .map(|n| (k, n))
                .map_err(|_| StoreError::Corrupt(format!("bad named amount {v:?}")))
        })
        .collect::<Result<BTreeMap<_, _>, _>>()?;
    let contract = match os(col::CONTRACT_CONCURRENCY)? {
        Some(c) => Some(ContractInfo {
            concurrency: word(&c)?,
            fingerprint: os(col::CONTRACT_FINGERPRINT)?.unwrap_or_default(),
            commit: os(col::CONTRACT_COMMIT)?,
        }),
        None => None,
    };
    let budget = match os(col::BUDGET)? {
        Some(j) => Some(Box::new(serde_json::from_str(&j).map_err(|e| {
            StoreError::Corrupt(format!("a run's budget does not parse: {e}"))
        })?)),
        None => None,
    };
    Ok(Request {
        run_id: s(col::RUN_ID)?,
        project: s(col::PROJECT)?,
        class: word(&s(col::CLASS)?)?,
        priority: word(&s(col::PRIORITY)?)?,
        resources: Resources {
            slots: u(g(col::SLOTS)?)?,
            memory: u(g(col::MEMORY)?)?,
            cpu_millis: u(g(col::CPU_MILLIS)?)?,
            disk: u(g(col::DISK)?)?,
            named,
        },
        singletons: s(col::SINGLETONS)?
            .split(',')
            .filter(|x| !x.is_empty())
            .map(str::to_string)
            .collect(),
        contract,
        ttl_ms: u(g(col::TTL_MS)?)?,
        wait_ms: u(g(col::WAIT_MS)?)?,
        budget,
    })
}

fn int(row: &Row, i: usize) -> Result<i64, StoreError> {
    row.get::<_, i64>(i).map_err(corrupt)
}

fn text(row: &Row, i: usize) -> Result<String, StoreError> {
    row.get::<_, String>(i).map_err(corrupt)
}

fn opt_text(row: &Row, i: usize) -> Result<Option<String>, StoreError> {
    row.get::<_, Option<String>>(i).map_err(corrupt)
}

fn opt_int(row: &Row, i: usize) -> Result<Option<i64>, StoreError> {
    row.get::<_, Option<i64>>(i).map_err(corrupt)
}

const ADD_PROCESS: &str = "INSERT OR IGNORE INTO processes (run_id, pid, start_ticks, boot_id)
     VALUES (?1, ?2, ?3, ?4)";

const UPSERT: &str =
    "INSERT INTO runs (run_id, project, class, priority, slots, memory, cpu_millis,
    disk, named, singletons, contract_concurrency, contract_fingerprint, contract_commit, ttl_ms,
    wait_ms, worktree, labels, state, fence, queue_seq, enqueued_ms, deadline_ms, granted_ms,
    expires_ms, end_cause, primary_mode, ws_path, ws_dev, ws_ino, terminal, stop_grace_ms,
    ended_unix_ms, detached, thread, budget, lease_only, owner_uid, upgrading, journal_first)
  VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19,
    ?20, ?21, ?22, ?23, ?24, ?25, ?26, ?27, ?28, ?29, ?30, ?31, ?32, ?33, ?34, ?35, ?36, ?37, ?38,
    ?39)
  ON CONFLICT (run_id) DO UPDATE SET
    state = excluded.state, fence = excluded.fence, deadline_ms = excluded.deadline_ms,
    granted_ms = excluded.granted_ms, expires_ms = excluded.expires_ms,
    end_cause = excluded.end_cause, primary_mode = excluded.primary_mode,
    ws_path = excluded.ws_path, ws_dev = excluded.ws_dev, ws_ino = excluded.ws_ino,
    terminal = excluded.terminal, ended_unix_ms = excluded.ended_unix_ms,
    detached = excluded.detached, upgrading = excluded.upgrading,
    journal_first = COALESCE(NULLIF(runs.journal_first, 0), excluded.journal_first)
  -- D3: a terminal state is never overwritten; nor is another run's record (a late
  -- write of an ended run whose id a new run has taken, see replace_ended).
  WHERE runs.terminal = 0 AND runs.queue_seq = excluded.queue_seq";

impl Store for SqliteStore {
    /// The whole ledger, one loader per table; the cross-table checks (L1, D4) here.
    fn load(&mut self, ended_max: usize) -> Result<Ledger, StoreError> {
        let c = &self.conn;
        let (last_fence, boot_id) = load_meta(c)?;
        let mut runs = load_runs(c, ended_max)?;
        load_processes(c, &mut runs, ended_max)?;
        load_ports(c, &mut runs)?;
        // L1: no fence issued may exceed the counter; if it does the ledger is damaged.
        if let Some(max) = runs.iter().filter_map(|r| r.fence).max() {
            if max > last_fence {
                return Err(StoreError::Corrupt(format!(
                    "run fence {max} is above the fence counter {last_fence}"
                )));
            }
        }
        Ok(Ledger {
            threads: load_threads(c)?,
            scopes: load_scopes(c)?,
            drain: load_drain(c)?,
            journal_last: journal_last(c)?,
            evidence: load_evidence(c)?,
            last_fence,
            boot_id,
            runs,
            next_queue_seq: next_queue_seq(c)?,
            tokens: load_tokens(c)?,
        })
    }

    fn write(&mut self, batches: &[&Batch]) -> Result<(), StoreError> {
        let tx = self
            .conn
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
            .map_err(write_err)?;
        let now_ms = unix_ms();
        let mut fence = 0u64;
        // Prepared once per transaction: a group carries thousands of runs.
        let mut upsert = tx.prepare_cached(UPSERT).map_err(write_err)?;
        let mut add_process = tx.prepare_cached(ADD_PROCESS).map_err(write_err)?;
        let mut chunk = Chunk::default();
        for m in batches.iter().flat_map(|b| &b.mutations) {
            match m {
                Mutation::Fence(f) => fence = fence.max(*f),
                Mutation::Run(r) => {
                    if !upsert_run(&mut upsert, &mut add_process, r, now_ms)? {
                        replace_ended(&tx, r)?;
                        if !upsert_run(&mut upsert, &mut add_process, r, now_ms)? {
                            continue;
                        }
                    }
                    write_ports(&tx, r)?;
                }
                Mutation::Evidence { project, evidence } => {
                    write_evidence(&tx, project, evidence.as_ref())?
                }
                Mutation::Journal(e) => {
                    if chunk.is_full() {
                        std::mem::take(&mut chunk).write(&tx, now_ms)?;
                    }
                    chunk.push(e)?
                }
                Mutation::Thread(t) => write_thread(&tx, t)?,
                Mutation::Drain(d) => write_drain(&tx, d.as_ref())?,
                Mutation::Scope(r) => write_scope(&tx, r)?,
                Mutation::ScopeDeleted(id) => delete_scope(&tx, id)?,
                Mutation::ScopeReceipt { scope, receipt } => write_receipt(&tx, scope, receipt)?,
                Mutation::BudgetToken {
                    scope,
                    owner,
                    operation,
                    token,
                } => write_budget_token(&tx, scope, owner, operation, token.as_ref())?,
                Mutation::Token { hash, scope } => {
                    tx.prepare_cached(
                        "INSERT OR REPLACE INTO tokens (hash, scope) VALUES (?1, ?2)",
                    )
                    .and_then(|mut s| s.execute(params![hash, scope]))
                    .map_err(write_err)?;
                }
                Mutation::TokenRevoked { hash } => {
                    tx.prepare_cached("DELETE FROM tokens WHERE hash = ?1")
                        .and_then(|mut s| s.execute(params![hash]))
                        .map_err(write_err)?;
                }
            }
        }
        drop((upsert, add_process));
        chunk.write(&tx, now_ms)?;
        // L1: the counter only ever moves up, whatever order batches arrive in.
        tx.prepare_cached(
            "UPDATE meta SET value = CAST(MAX(CAST(value AS INTEGER), ?1) AS TEXT)
             WHERE key = 'last_fence'",
        )
        .and_then(|mut s| s.execute(params![fence as i64]))
        .map_err(write_err)?;
        tx.commit().map_err(write_err)
    }

    fn prune(
        &mut self,
        policy: &Retention,
        now_unix_ms: u64,
        rows_max: usize,
    ) -> Result<usize, StoreError> {
        // Without its own fsync: a prune lost to a power cut is only done again, and the
        // WAL is append-only, so the next durable commit makes it durable too. (Its own
        // fsync put a prune's whole cost in front of the commits waiting behind it.)
        self.conn
            .execute_batch("PRAGMA synchronous=NORMAL;")
            .map_err(write_err)?;
        let result = self.prune_step(policy, now_unix_ms, rows_max);
        self.conn
            .execute_batch("PRAGMA synchronous=FULL;")
            .map_err(write_err)?;
        result
    }

    fn journal(&mut self, after: u64, limit: usize) -> Result<Vec<JournalEntry>, StoreError> {
        let limit = limit.min(JOURNAL_READ_MAX);
        // The chunk holding `after + 1` (or the first kept) and those after it; each
        // holds at least one entry, so `limit + 1` chunks always suffice.
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT first_seq, last_seq, packed FROM journal_chunks
                 WHERE first_seq >= COALESCE(
                   (SELECT MAX(first_seq) FROM journal_chunks WHERE first_seq <= ?1 + 1), 0)
                 ORDER BY first_seq LIMIT ?2",
            )
            .map_err(corrupt)?;
        let after_sql = after.min(i64::MAX as u64 - 1) as i64;
        let mut rows = stmt
            .query(params![after_sql, limit as i64 + 1])
            .map_err(corrupt)?;
        let mut out = Vec::new();
        while let Some(row) = rows.next().map_err(corrupt)? {
            let first = u(row.get(0).map_err(corrupt)?)?;
            let last = u(row.get(1).map_err(corrupt)?)?;
            let packed: Vec<u8> = row.get(2).map_err(corrupt)?;
            let entries = parse_chunk(first, &unpack(first, &packed)?)?;
            if entries.last().map(|e| e.seq) != Some(last) {
                return Err(StoreError::Corrupt(format!(
                    "journal chunk {first} does not end at {last}"
                )));
            }
            for e in entries.into_iter().filter(|e| e.seq > after) {
                if out.len() == limit {
                    return Ok(out);
                }
                out.push(e);
            }
        }
        Ok(out)
    }

    fn journal_first(&mut self) -> Result<u64, StoreError> {
        let first: i64 = self
            .conn
            .query_row(
                "SELECT COALESCE(MIN(first_seq), 0) FROM journal_chunks",
                [],
                |r| r.get(0),
            )
            .map_err(corrupt)?;
        u(first)
    }

    fn set_boot_id(&mut self, boot_id: &str) -> Result<(), StoreError> {
        self.conn
            .execute(
                "INSERT INTO meta (key, value) VALUES ('boot_id', ?1)
                 ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                params![boot_id],
            )
            .map_err(write_err)?;
        Ok(())
    }
}

impl SqliteStore {
    fn prune_step(
        &mut self,
        policy: &Retention,
        now_unix_ms: u64,
        rows_max: usize,
    ) -> Result<usize, StoreError> {
        let tx = self
            .conn
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
            .map_err(write_err)?;
        let (n, floor) = prune_in(&tx, policy, now_unix_ms, rows_max).map_err(write_err)?;
        tx.prepare_cached(
            "UPDATE meta SET value = CAST(MAX(CAST(value AS INTEGER), ?1) AS TEXT)
             WHERE key = 'queue_seq_floor'",
        )
        .and_then(|mut s| s.execute(params![floor as i64]))
        .map_err(write_err)?;
        tx.commit().map_err(write_err)?;
        Ok(n)
    }
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Inserts or updates one run's record (D3: not once it is terminal) and adds its
/// processes. `now_ms` is when a run written terminal ended.
/// A new run under the id of an ended one the engine has forgotten (but retention has
/// not deleted yet) replaces it, processes and all. D3 still holds: the ended record
/// of the *same* run (same queue sequence) is never overwritten. Without this, the new
/// run's writes were dropped by D3's guard and a restart brought back the old one, its
/// acknowledged grant lost (found by the daemon simulator).
///
/// Only reached when an upsert changed nothing, so it costs the hot path nothing.
fn replace_ended(tx: &rusqlite::Transaction, r: &RunRecord) -> Result<(), StoreError> {
    let (id, seq) = (&r.request.run_id, r.queue_seq as i64);
    tx.prepare_cached(
        "DELETE FROM processes WHERE run_id = ?1 AND EXISTS
           (SELECT 1 FROM runs WHERE run_id = ?1 AND terminal = 1 AND queue_seq <> ?2)",
    )
    .and_then(|mut s| s.execute(params![id, seq]))
    .map_err(write_err)?;
    tx.prepare_cached(
        "DELETE FROM ports WHERE run_id = ?1 AND EXISTS
           (SELECT 1 FROM runs WHERE run_id = ?1 AND terminal = 1 AND queue_seq <> ?2)",
    )
    .and_then(|mut s| s.execute(params![id, seq]))
    .map_err(write_err)?;
    tx.prepare_cached("DELETE FROM runs WHERE run_id = ?1 AND terminal = 1 AND queue_seq <> ?2")
        .and_then(|mut s| s.execute(params![id, seq]))
        .map_err(write_err)?;
    Ok(())
}

/// G0-G2: a thread's record, replaced whole.
fn write_thread(tx: &rusqlite::Transaction, r: &crate::ThreadRecord) -> Result<(), StoreError> {
    let t = &r.thread;
    let o = t.owner.as_ref();
    let reg = t.registration.as_ref();
    if reg.is_some_and(|g| Some(&g.owner) != o) {
        return Err(StoreError::Write(format!(
            "thread {}: a registration not by its owner",
            t.key
        )));
    }
    let evictions: Vec<String> = t
        .evictions
        .iter()
        .map(|e| format!("{}@{}", e.reason.as_str(), e.at_ms))
        .collect();
    let ws = r.workspace.as_ref();
    tx.prepare_cached(
        "INSERT OR REPLACE INTO threads (key, owner_gen, owner_fence, owner_run,
           reg_attached_ms, reg_deadline_ms, has_workspace, ws_path, ws_dev, ws_ino,
           created_ms, active_ms, evictions, owner_uid)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)",
    )
    .and_then(|mut s| {
        s.execute(params![
            t.key,
            o.map(|o| o.gen.as_str()),
            o.map(|o| o.fence as i64),
            o.map(|o| o.run_id.as_str()),
            reg.map(|g| g.attached_ms as i64),
            reg.map(|g| g.deadline_ms as i64),
            t.has_workspace,
            ws.map(|w| w.path.as_str()),
            ws.map(|w| w.dev as i64),
            ws.map(|w| w.ino as i64),
            t.created_ms as i64,
            t.active_ms as i64,
            evictions.join(","),
            r.owner_uid.map(i64::from)
        ])
    })
    .map_err(write_err)?;
    Ok(())
}

/// The fence counter and the boot the ledger last ran in.
fn load_meta(c: &Connection) -> Result<(u64, Option<String>), StoreError> {
    let last_fence: String = c
        .query_row("SELECT value FROM meta WHERE key = 'last_fence'", [], |r| {
            r.get(0)
        })
        .map_err(corrupt)?;
    let last_fence: u64 = last_fence
        .parse()
        .map_err(|_| StoreError::Corrupt(format!("last_fence {last_fence:?}")))?;
    let boot_id: Option<String> = c
        .query_row("SELECT value FROM meta WHERE key = 'boot_id'", [], |r| {
            r.get(0)
        })
        .optional()
        .map_err(corrupt)?;
    Ok((last_fence, boot_id))
}

/// Every live run and the `ended_max` most recent ended ones, in queue order.
fn load_runs(c: &Connection, ended_max: usize) -> Result<Vec<RunRecord>, StoreError> {
    // D4: `terminal` says which half of the load a run is in; any other value would
    // leave the run out of both, silently.
    let astray: Option<String> = c
        .query_row(
            "SELECT CAST(run_id AS TEXT) FROM runs
             WHERE terminal IS NOT 0 AND terminal IS NOT 1 LIMIT 1",
            [],
            |r| r.get(0),
        )
        .optional()
        .map_err(corrupt)?;
    if let Some(id) = astray {
        return Err(StoreError::Corrupt(format!(
            "run {id}: terminal is neither 0 nor 1"
        )));
    }
    let mut stmt = c
        .prepare(&format!(
            "SELECT {RUN_COLUMNS} FROM runs WHERE terminal = 0
             UNION ALL
             SELECT {RUN_COLUMNS} FROM (SELECT * FROM runs WHERE terminal = 1
                            ORDER BY queue_seq DESC LIMIT ?1)
             ORDER BY queue_seq",
        ))
        .map_err(corrupt)?;
    let mut rows = stmt.query([ended_max as i64]).map_err(corrupt)?;
    let mut runs = Vec::new();
    while let Some(row) = rows.next().map_err(corrupt)? {
        runs.push(read_run(row)?);
    }
    Ok(runs)
}

/// The loaded runs' registered processes.
fn load_processes(
    c: &Connection,
    runs: &mut [RunRecord],
    ended_max: usize,
) -> Result<(), StoreError> {
    let index: std::collections::HashMap<String, usize> = runs
        .iter()
        .enumerate()
        .map(|(i, r)| (r.request.run_id.clone(), i))
        .collect();
    // Only the loaded runs' (by the primary key's prefix): the processes of runs
    // retention has not yet pruned are not read at all.
    let mut stmt = c
        .prepare(
            "SELECT run_id, pid, start_ticks, boot_id FROM processes WHERE run_id IN
               (SELECT run_id FROM runs WHERE terminal = 0
                UNION ALL
                SELECT run_id FROM (SELECT run_id FROM runs WHERE terminal = 1
                                    ORDER BY queue_seq DESC LIMIT ?1))
             ORDER BY run_id, pid, start_ticks",
        )
        .map_err(corrupt)?;
    let mut rows = stmt.query([ended_max as i64]).map_err(corrupt)?;
    while let Some(row) = rows.next().map_err(corrupt)? {
        let run_id: String = row.get(0).map_err(corrupt)?;
        let Some(&i) = index.get(&run_id) else {
            continue;
        };
        // A pid is 1..=i32::MAX: another number cut to 32 bits could name any process
        // (D4: refused, never a guess).
        let pid: i64 = row.get(1).map_err(corrupt)?;
        let pid = i32::try_from(pid)
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| StoreError::Corrupt(format!("run {run_id}: process id {pid}")))?;
        runs[i].processes.push(ProcessRecord {
            pid,
            start_ticks: u(row.get(2).map_err(corrupt)?)
                .map_err(|e| of(&format!("run {run_id}: process {pid}"), e))?,
            boot_id: row.get(3).map_err(corrupt)?,
        });
    }
    Ok(())
}

/// The next queue sequence number: two index lookups (not a scan of every row), and
/// never below what pruned runs had reached.
fn next_queue_seq(c: &Connection) -> Result<u64, StoreError> {
    let next: i64 = c
        .query_row(
            "SELECT MAX(COALESCE((SELECT MAX(queue_seq) + 1 FROM runs WHERE terminal = 0), 0),
                        COALESCE((SELECT MAX(queue_seq) + 1 FROM runs WHERE terminal = 1), 0),
                        (SELECT CAST(value AS INTEGER) FROM meta
                         WHERE key = 'queue_seq_floor'))",
            [],
            |r| r.get(0),
        )
        .map_err(corrupt)?;
    Ok(next as u64)
}

/// The API tokens: (hash, grant as text).
fn load_tokens(c: &Connection) -> Result<Vec<(String, String)>, StoreError> {
    let mut stmt = c
        .prepare("SELECT hash, scope FROM tokens ORDER BY hash")
        .map_err(corrupt)?;
    let mut rows = stmt.query([]).map_err(corrupt)?;
    let mut tokens = Vec::new();
    while let Some(row) = rows.next().map_err(corrupt)? {
        tokens.push((row.get(0).map_err(corrupt)?, row.get(1).map_err(corrupt)?));
    }
    Ok(tokens)
}

fn load_threads(conn: &rusqlite::Connection) -> Result<Vec<crate::ThreadRecord>, StoreError> {
    use berth_core::threads::{Owner, Thread};
    let mut stmt = conn
        .prepare(
            "SELECT key, owner_gen, owner_fence, owner_run, reg_attached_ms, reg_deadline_ms,
               has_workspace, ws_path, ws_dev, ws_ino, created_ms, active_ms, evictions,
               owner_uid
             FROM threads ORDER BY key",
        )
        .map_err(corrupt)?;
    let mut rows = stmt.query([]).map_err(corrupt)?;
    let mut out = Vec::new();
    while let Some(row) = rows.next().map_err(corrupt)? {
        let key: String = row.get(0).map_err(corrupt)?;
        let bad = |why: &str| StoreError::Corrupt(format!("thread {key}: {why}"));
        // Fences, times and workspace ids are never negative (D4: refused, not clamped).
        let ms = |v: Option<i64>| {
            v.map(u)
                .transpose()
                .map_err(|e| of(&format!("thread {key}"), e))
        };
        let gen: Option<String> = row.get(1).map_err(corrupt)?;
        let fence = ms(row.get(2).map_err(corrupt)?)?;
        let run: Option<String> = row.get(3).map_err(corrupt)?;
        let owner = match (gen, fence, run) {
            (Some(gen), Some(fence), Some(run_id)) => Some(Owner { gen, fence, run_id }),
            (None, None, None) => None,
            _ => return Err(bad("a partial owner")),
        };
        let (attached, deadline) = (
            ms(row.get(4).map_err(corrupt)?)?,
            ms(row.get(5).map_err(corrupt)?)?,
        );
        let registration = read_registration(&owner, attached, deadline).map_err(bad)?;
        let path: Option<String> = row.get(7).map_err(corrupt)?;
        let workspace = match path {
            Some(path) => Some(WorkspaceIdentity {
                path,
                dev: ms(row.get(8).map_err(corrupt)?)?.ok_or_else(|| bad("no device"))?,
                ino: ms(row.get(9).map_err(corrupt)?)?.ok_or_else(|| bad("no inode"))?,
            }),
            None => None,
        };
        let owner_uid = match row.get::<_, Option<i64>>(13).map_err(corrupt)? {
            Some(v) => Some(u32::try_from(v).map_err(|_| bad("an owner uid that is not a uid"))?),
            None => None,
        };
        let evictions = read_evictions(&row.get::<_, String>(12).map_err(corrupt)?).map_err(bad)?;
        let thread = Thread {
            owner,
            registration,
            has_workspace: row.get(6).map_err(corrupt)?,
            created_ms: ms(row.get(10).map_err(corrupt)?)?
                .ok_or_else(|| bad("no creation time"))?,
            active_ms: ms(row.get(11).map_err(corrupt)?)?.ok_or_else(|| bad("no activity time"))?,
            evictions,
            key,
        };
        out.push(crate::ThreadRecord {
            thread,
            workspace,
            owner_uid,
        });
    }
    Ok(out)
}

/// A thread's registration: both times (with an owner), or neither.
fn read_registration(
    owner: &Option<berth_core::threads::Owner>,
    attached: Option<u64>,
    deadline: Option<u64>,
) -> Result<Option<berth_core::threads::Registration>, &'static str> {
    match (attached, deadline) {
        (Some(attached_ms), Some(deadline_ms)) => Ok(Some(berth_core::threads::Registration {
            owner: owner.clone().ok_or("a registration without an owner")?,
            attached_ms,
            deadline_ms,
        })),
        (None, None) => Ok(None),
        _ => Err("a partial registration"),
    }
}

/// A thread's evictions, `reason@ms` comma-separated.
fn read_evictions(text: &str) -> Result<Vec<berth_core::threads::Eviction>, &'static str> {
    use berth_core::threads::{EvictReason, Eviction};
    let mut evictions = Vec::new();
    for e in text.split(',').filter(|e| !e.is_empty()) {
        let (reason, at) = e.split_once('@').ok_or("an eviction without a time")?;
        evictions.push(Eviction {
            reason: EvictReason::parse(reason).ok_or("an unknown eviction reason")?,
            at_ms: at
                .parse()
                .map_err(|_| "an eviction time that is not a number")?,
        });
    }
    Ok(evictions)
}

/// G4: the drain row, replaced or removed.
fn write_drain(
    tx: &rusqlite::Transaction,
    d: Option<&crate::DrainRecord>,
) -> Result<(), StoreError> {
    let done = match d {
        None => tx
            .prepare_cached("DELETE FROM drain")
            .and_then(|mut s| s.execute([])),
        Some(d) => tx
            .prepare_cached(
                "INSERT OR REPLACE INTO drain (id, by_whom, at, reason) VALUES (1, ?1, ?2, ?3)",
            )
            .and_then(|mut s| s.execute(params![d.by, d.at, d.reason])),
    };
    done.map(|_| ()).map_err(write_err)
}

fn load_drain(conn: &rusqlite::Connection) -> Result<Option<crate::DrainRecord>, StoreError> {
    conn.query_row(
        "SELECT by_whom, at, reason FROM drain WHERE id = 1",
        [],
        |r| {
            Ok(crate::DrainRecord {
                by: r.get(0)?,
                at: r.get(1)?,
                reason: r.get(2)?,
            })
        },
    )
    .optional()
    .map_err(corrupt)
}

/// C3/C4: a project's evidence replaced, or deleted when invalidated.
fn write_evidence(
    tx: &rusqlite::Transaction,
    project: &str,
    e: Option<&berth_core::Evidence>,
) -> Result<(), StoreError> {
    let Some(e) = e else {
        tx.prepare_cached("DELETE FROM evidence WHERE project = ?1")
            .and_then(|mut s| s.execute(params![project]))
            .map_err(write_err)?;
        return Ok(());
    };
    tx.prepare_cached(
        "INSERT OR REPLACE INTO evidence (project, fingerprint, git_commit, ports, at_ms, run_id)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
    )
    .and_then(|mut s| {
        s.execute(params![
            project,
            e.fingerprint,
            e.commit,
            e.ports.join(","),
            e.at_ms as i64,
            e.run_id
        ])
    })
    .map_err(write_err)?;
    Ok(())
}

fn load_evidence(
    conn: &rusqlite::Connection,
) -> Result<Vec<(String, berth_core::Evidence)>, StoreError> {
    let mut stmt = conn
        .prepare(
            "SELECT project, fingerprint, git_commit, ports, at_ms, run_id FROM evidence
             ORDER BY project",
        )
        .map_err(corrupt)?;
    let mut rows = stmt.query([]).map_err(corrupt)?;
    let mut out = Vec::new();
    while let Some(row) = rows.next().map_err(corrupt)? {
        let ports: String = row.get(3).map_err(corrupt)?;
        let e = berth_core::Evidence {
            fingerprint: row.get(1).map_err(corrupt)?,
            commit: row.get(2).map_err(corrupt)?,
            ports: ports
                .split(',')
                .filter(|p| !p.is_empty())
                .map(str::to_string)
                .collect(),
            at_ms: u(row.get(4).map_err(corrupt)?)?,
            run_id: row.get(5).map_err(corrupt)?,
        };
        out.push((row.get(0).map_err(corrupt)?, e));
    }
    Ok(out)
}

/// The ports of the live runs (the table holds no others).
fn load_ports(conn: &rusqlite::Connection, runs: &mut [RunRecord]) -> Result<(), StoreError> {
    let index: std::collections::HashMap<String, usize> = runs
        .iter()
        .enumerate()
        .map(|(i, r)| (r.request.run_id.clone(), i))
        .collect();
    let mut stmt = conn
        .prepare("SELECT run_id, name, port FROM ports ORDER BY run_id, name")
        .map_err(corrupt)?;
    let mut rows = stmt.query([]).map_err(corrupt)?;
    while let Some(row) = rows.next().map_err(corrupt)? {
        let run_id: String = row.get(0).map_err(corrupt)?;
        let port: i64 = row.get(2).map_err(corrupt)?;
        let port = u16::try_from(port)
            .map_err(|_| StoreError::Corrupt(format!("run {run_id}: port {port}")))?;
        match index.get(&run_id) {
            Some(&i) if !runs[i].state.is_terminal() => {
                runs[i].ports.push((row.get(1).map_err(corrupt)?, port));
            }
            _ => {}
        }
    }
    Ok(())
}

/// A live run's ports are written with it; an ended run's are deleted (W3).
fn write_ports(tx: &rusqlite::Transaction, r: &RunRecord) -> Result<(), StoreError> {
    if r.ports.is_empty() {
        return Ok(());
    }
    let id = &r.request.run_id;
    if r.state.is_terminal() {
        tx.prepare_cached("DELETE FROM ports WHERE run_id = ?1")
            .and_then(|mut s| s.execute(params![id]))
            .map_err(write_err)?;
        return Ok(());
    }
    let mut put = tx
        .prepare_cached("INSERT OR REPLACE INTO ports (run_id, name, port) VALUES (?1, ?2, ?3)")
        .map_err(write_err)?;
    for (name, port) in &r.ports {
        put.execute(params![id, name, *port as i64])
            .map_err(write_err)?;
    }
    Ok(())
}

/// Writes one run record; false when D3's guard left the row as it was (it is ended).
fn upsert_run(
    upsert: &mut rusqlite::CachedStatement,
    add_process: &mut rusqlite::CachedStatement,
    r: &RunRecord,
    now_ms: u64,
) -> Result<bool, StoreError> {
    let q = &r.request;
    let c = q.contract.as_ref();
    let ws = r.workspace.as_ref();
    let terminal = r.state.is_terminal();
    let changed = upsert
        .execute(params![
            q.run_id,
            q.project,
            q.class.as_str(),
            q.priority.as_str(),
            q.resources.slots as i64,
            q.resources.memory as i64,
            q.resources.cpu_millis as i64,
            q.resources.disk as i64,
            encode_map(&q.resources.named),
            q.singletons.join(","),
            c.map(|c| c.concurrency.as_str()),
            c.map(|c| c.fingerprint.as_str()),
            c.and_then(|c| c.commit.as_deref()),
            q.ttl_ms as i64,
            q.wait_ms as i64,
            r.worktree,
            encode_map(&r.labels),
            r.state.as_str(),
            r.fence.map(|f| f as i64),
            r.queue_seq as i64,
            r.enqueued_ms as i64,
            r.deadline_ms as i64,
            r.granted_ms.map(|x| x as i64),
            r.expires_ms.map(|x| x as i64),
            r.end_cause.map(EndCause::as_str),
            r.primary_mode.as_str(),
            ws.map(|w| w.path.as_str()),
            ws.map(|w| w.dev as i64),
            ws.map(|w| w.ino as i64),
            terminal as i64,
            r.stop_grace_ms.map(|g| g as i64),
            terminal.then_some(now_ms as i64),
            r.detached as i64,
            r.thread,
            q.budget
                .as_ref()
                .map(|b| serde_json::to_string(b).expect("a budget serializes")),
            r.lease_only as i64,
            r.owner_uid.map(i64::from),
            r.upgrading as i64,
            r.journal_first.min(i64::MAX as u64) as i64,
        ])
        .map_err(write_err)?;
    if changed == 0 {
        return Ok(false);
    }
    for p in &r.processes {
        add_process
            .execute(params![
                r.request.run_id,
                p.pid as i64,
                p.start_ticks as i64,
                p.boot_id
            ])
            .map_err(write_err)?;
    }
    Ok(true)
}

/// Deletes up to `rows_max` ended runs `policy` no longer keeps, oldest first, with
/// their processes: past the `ended_max` most recent (by arrival), or ended more than
/// `ended_age_ms` ago. Returns how many, and the queue sequence just above the newest.
///
/// Set-based: the doomed rows are chosen once into a scratch table (in memory), then
/// deleted from both tables by one statement each. Under steady churn every lifecycle
/// that ends is eventually deleted here, so a prune must cost about what an insert
/// does per row, not a statement per row.
fn prune_in(
    tx: &rusqlite::Transaction,
    policy: &Retention,
    now_unix_ms: u64,
    rows_max: usize,
) -> rusqlite::Result<(usize, u64)> {
    tx.execute_batch(
        "CREATE TEMP TABLE IF NOT EXISTS doomed (run_id TEXT PRIMARY KEY, queue_seq INTEGER);
         DELETE FROM temp.doomed;",
    )?;
    // By count: the queue sequence of the newest ended run past the kept ones.
    let past_kept: Option<i64> = if policy.ended_max == 0 {
        Some(i64::MAX)
    } else {
        tx.prepare_cached(
            "SELECT queue_seq FROM runs WHERE terminal = 1
             ORDER BY queue_seq DESC LIMIT 1 OFFSET ?1",
        )?
        .query_row(
            params![policy.ended_max.min(i64::MAX as usize) as i64],
            |r| r.get(0),
        )
        .optional()?
    };
    if let Some(through) = past_kept {
        tx.prepare_cached(
            "INSERT OR IGNORE INTO temp.doomed SELECT run_id, queue_seq FROM runs
             WHERE terminal = 1 AND queue_seq <= ?1 ORDER BY queue_seq LIMIT ?2",
        )?
        .execute(params![through, rows_max as i64])?;
    }
    // By age: among the `rows_max` oldest arrivals, those that ended long enough ago.
    // Runs end roughly in arrival order, and looking no further bounds the work: a
    // scan of every retained row for the age of each (the column has no index) cost
    // each prune ~30 ms, in front of the commits waiting behind it.
    let cutoff = now_unix_ms
        .saturating_sub(policy.ended_age_ms)
        .min(i64::MAX as u64);
    tx.prepare_cached(
        "INSERT OR IGNORE INTO temp.doomed SELECT run_id, queue_seq FROM
           (SELECT run_id, queue_seq, ended_unix_ms FROM runs WHERE terminal = 1
            ORDER BY queue_seq LIMIT ?2)
         WHERE ended_unix_ms < ?1",
    )?
    .execute(params![cutoff as i64, rows_max as i64])?;
    tx.prepare_cached("DELETE FROM processes WHERE run_id IN (SELECT run_id FROM temp.doomed)")?
        .execute([])?;
    tx.prepare_cached(
        // By the primary key. (With `terminal = 1` too, SQLite walked every ended row
        // through the terminal index and tested each: 16 ms a prune at 60,000 rows.)
        // Every doomed row was chosen terminal in this same transaction.
        "DELETE FROM runs WHERE run_id IN (SELECT run_id FROM temp.doomed)",
    )?
    .execute([])?;
    // A chunk holds a commit's entries, many runs' worth: as many chunks as runs per
    // prune keeps pace with the same churn.
    prune_journal(tx, policy, cutoff, rows_max)?;
    tx.prepare_cached("SELECT COUNT(*), COALESCE(MAX(queue_seq) + 1, 0) FROM temp.doomed")?
        .query_row([], |r| {
            Ok((r.get::<_, i64>(0)? as usize, r.get::<_, i64>(1)? as u64))
        })
}

/// The journal's records of one transaction, gathered as its mutations go by and
/// written as one row at its end (or, past `CHUNK_TEXT_CUT`, as several).
#[derive(Default)]
struct Chunk {
    first: Option<u64>,
    last: u64,
    entries: String,
}

impl Chunk {
    /// Appends an entry. Within a transaction entries come in order; a field that would
    /// break the record format (a tab or a line end, an empty id) is refused.
    fn push(&mut self, e: &JournalEntry) -> Result<(), StoreError> {
        let refuse =
            |why: String| Err(StoreError::Write(format!("journal entry {}: {why}", e.seq)));
        if self.first.is_some() && e.seq <= self.last {
            return refuse(format!("follows {} in the same transaction", self.last));
        }
        let fields = [
            Some(e.kind.as_str()),
            e.run_id.as_deref(),
            e.project.as_deref(),
        ];
        if e.kind.is_empty() || fields.iter().flatten().any(|f| f.contains(['\t', '\n'])) {
            return refuse("kind, run id and project must be tab- and line-free".into());
        }
        if e.run_id.as_deref() == Some("") || e.project.as_deref() == Some("") {
            return refuse("an empty run id or project is ambiguous".into());
        }
        if e.line.contains('\n') {
            return refuse("its line holds a line end".into());
        }
        let record = fields.iter().flatten().map(|f| f.len() + 1).sum::<usize>() + e.line.len();
        if record > JOURNAL_RECORD_MAX {
            return refuse(format!("{record} bytes, over {JOURNAL_RECORD_MAX}"));
        }
        self.first.get_or_insert(e.seq);
        self.last = e.seq;
        for f in fields {
            self.entries.push_str(f.unwrap_or(""));
            self.entries.push('\t');
        }
        self.entries.push_str(&e.line);
        self.entries.push('\n');
        Ok(())
    }

    /// Whether the next entry begins a new chunk (`CHUNK_TEXT_CUT`).
    fn is_full(&self) -> bool {
        self.entries.len() >= CHUNK_TEXT_CUT
    }

    /// The row, if the transaction journaled anything. Numbers never repeat or go back:
    /// the chunk must start after the last entry stored.
    fn write(self, tx: &rusqlite::Transaction, now_ms: u64) -> Result<(), StoreError> {
        let Some(first) = self.first else {
            return Ok(());
        };
        let stored = journal_last(tx).map_err(|e| match e {
            StoreError::Corrupt(why) => StoreError::Write(why),
            e => e,
        })?;
        if first <= stored {
            return Err(StoreError::Write(format!(
                "journal entry {first} is not after the last stored, {stored}"
            )));
        }
        tx.prepare_cached(
            "INSERT INTO journal_chunks (first_seq, last_seq, packed, written_unix_ms)
             VALUES (?1, ?2, ?3, ?4)",
        )
        .and_then(|mut s| {
            s.execute(params![
                first as i64,
                self.last as i64,
                pack(&self.entries),
                now_ms as i64
            ])
        })
        .map_err(write_err)?;
        Ok(())
    }
}

/// A chunk's text once it holds this much (bytes) is written, and a new chunk begins:
/// bounds what one read unpacks (a restart that reaps thousands of runs journals them
/// all in one transaction).
const CHUNK_TEXT_CUT: usize = 1 << 20;
/// The largest record a chunk takes (bytes): no request can make an entry this large,
/// so a record above it is a bug refused before it is written.
const JOURNAL_RECORD_MAX: usize = 16 << 20;
/// The largest text a packed chunk may claim (bytes): a chunk is cut at
/// `CHUNK_TEXT_CUT` after one record of at most `JOURNAL_RECORD_MAX`. A size above
/// it is a corrupt ledger, never an allocation of whatever the disk says.
const CHUNK_TEXT_MAX: usize = CHUNK_TEXT_CUT + JOURNAL_RECORD_MAX;

/// A chunk's text as stored: LZ4's block format, its length first (u32, little end).
fn pack(text: &str) -> Vec<u8> {
    lz4_flex::block::compress_prepend_size(text.as_bytes())
}

/// A packed chunk's text, or why the ledger is corrupt.
fn unpack(first: u64, packed: &[u8]) -> Result<String, StoreError> {
    let bad = |why: String| StoreError::Corrupt(format!("journal chunk {first}: {why}"));
    let Some((len, block)) = packed.split_first_chunk::<4>() else {
        return Err(bad("shorter than its length".into()));
    };
    let len = u32::from_le_bytes(*len) as usize;
    if len > CHUNK_TEXT_MAX {
        return Err(bad(format!("claims {len} bytes, over {CHUNK_TEXT_MAX}")));
    }
    let bytes = lz4_flex::block::decompress(block, len).map_err(|e| bad(e.to_string()))?;
    String::from_utf8(bytes).map_err(|_| bad("not UTF-8".into()))
}

/// The last journal entry stored (0: none), from the newest chunk.
fn journal_last(conn: &rusqlite::Connection) -> Result<u64, StoreError> {
    let last = conn
        .prepare_cached("SELECT last_seq FROM journal_chunks ORDER BY first_seq DESC LIMIT 1")
        .and_then(|mut s| s.query_row([], |r| r.get::<_, i64>(0)).optional())
        .map_err(corrupt)?;
    u(last.unwrap_or(0)).map_err(|e| of("journal", e))
}

/// A chunk's records back into entries, numbered from `first`.
fn parse_chunk(first: u64, text: &str) -> Result<Vec<JournalEntry>, StoreError> {
    let mut out = Vec::new();
    for (i, record) in text.split_terminator('\n').enumerate() {
        let mut f = record.splitn(4, '\t');
        let (Some(kind), Some(run_id), Some(project), Some(line)) =
            (f.next(), f.next(), f.next(), f.next())
        else {
            return Err(StoreError::Corrupt(format!(
                "journal chunk {first}: record {i} is not kind, run, project, line"
            )));
        };
        let some = |s: &str| (!s.is_empty()).then(|| s.to_string());
        out.push(JournalEntry {
            seq: first + i as u64,
            kind: kind.to_string(),
            run_id: some(run_id),
            project: some(project),
            line: line.to_string(),
        });
    }
    Ok(out)
}

/// D5: the journal follows the ledger's retention. Entries older than the age limit go,
/// and so do all but the newest `JOURNAL_ENTRIES_PER_RUN × ended_max`, oldest first, at
/// most `rows_max` chunks per prune. A chunk goes whole, once every entry in it may go,
/// so a prune may keep up to one transaction's entries more than the bound. The newest
/// chunk is never deleted, so numbering resumes after it at the next start.
fn prune_journal(
    tx: &rusqlite::Transaction,
    policy: &Retention,
    cutoff_unix_ms: u64,
    rows_max: usize,
) -> rusqlite::Result<usize> {
    let keep = policy
        .ended_max
        .max(1)
        .saturating_mul(JOURNAL_ENTRIES_PER_RUN)
        .min(i64::MAX as usize) as i64;
    let held = journal_held(tx, policy)?;
    tx.prepare_cached(
        // Only the `rows_max` oldest are looked at (entries are written in order, so
        // their ages rise with seq): a prune costs what it deletes, not a table scan.
        // Nothing at or after `held` goes (finding 8).
        "DELETE FROM journal_chunks WHERE first_seq IN (
           SELECT first_seq FROM (
             SELECT first_seq, last_seq, written_unix_ms FROM journal_chunks
             ORDER BY first_seq LIMIT ?3)
           WHERE first_seq < (SELECT MAX(first_seq) FROM journal_chunks)
             AND last_seq < ?4
             AND (last_seq <= (SELECT last_seq FROM journal_chunks
                               ORDER BY first_seq DESC LIMIT 1) - ?1
                  OR written_unix_ms < ?2))",
    )?
    .execute(params![
        keep,
        cutoff_unix_ms.min(i64::MAX as u64) as i64,
        rows_max as i64,
        held
    ])
}

/// The first journal entry retention must keep (issue 32 finding 8): the first of the
/// oldest live run's, of the oldest remembered scope's, and of an export under way, but
/// never more than `JOURNAL_HELD_MAX` entries behind the last.
fn journal_held(tx: &rusqlite::Transaction, policy: &Retention) -> rusqlite::Result<i64> {
    let first = |sql: &str| -> rusqlite::Result<i64> {
        tx.prepare_cached(sql)?
            .query_row([], |r| r.get::<_, Option<i64>>(0))
            .map(|v| v.unwrap_or(i64::MAX))
    };
    // By the partial index on live runs: a lookup, not a scan.
    let run =
        first("SELECT MIN(journal_first) FROM runs WHERE terminal = 0 AND journal_first > 0")?;
    let scope = first("SELECT MIN(journal_first) FROM scopes WHERE journal_first > 0")?;
    let last = first("SELECT MAX(last_seq) FROM journal_chunks")?;
    let export = policy
        .journal_hold
        .as_ref()
        .map_or(u64::MAX, |h| h.load(std::sync::atomic::Ordering::Acquire))
        .min(i64::MAX as u64) as i64;
    let floor = if last == i64::MAX {
        0
    } else {
        last.saturating_sub(crate::JOURNAL_HELD_MAX as i64)
    };
    Ok(run.min(scope).min(export).max(floor))
}

/// B1/B4: a scope's frozen policy and manifest, control state and generation.
fn write_scope(tx: &rusqlite::Transaction, r: &crate::ScopeRecord) -> Result<(), StoreError> {
    let policy: Vec<String> = r.policy.iter().map(|(h, n)| format!("{h}={n}")).collect();
    let m = r.manifest.as_ref();
    tx.prepare_cached(
        // An upsert: the first entry, once known, is kept (later writes give 0).
        "INSERT INTO scopes (id, policy, manifest_path, manifest_sha256,
           manifest_ids, control, generation, owner_uid, journal_first)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)
         ON CONFLICT (id) DO UPDATE SET policy = excluded.policy,
           manifest_path = excluded.manifest_path, manifest_sha256 = excluded.manifest_sha256,
           manifest_ids = excluded.manifest_ids, control = excluded.control,
           generation = excluded.generation, owner_uid = excluded.owner_uid,
           journal_first = COALESCE(NULLIF(scopes.journal_first, 0), excluded.journal_first)",
    )
    .and_then(|mut st| {
        st.execute(params![
            r.id,
            policy.join(","),
            m.map(|m| m.path.as_str()),
            m.map(|m| m.sha256.as_str()),
            m.map(|m| m.execution_ids.join("\n")),
            r.control.as_str(),
            r.generation as i64,
            r.owner_uid.map(i64::from),
            r.journal_first.min(i64::MAX as u64) as i64,
        ])
    })
    .map_err(write_err)?;
    Ok(())
}

/// S10: a forgotten scope's rows, all of them.
fn delete_scope(tx: &rusqlite::Transaction, id: &str) -> Result<(), StoreError> {
    for sql in [
        "DELETE FROM scope_tokens WHERE scope = ?1",
        "DELETE FROM scope_receipts WHERE scope = ?1",
        "DELETE FROM scopes WHERE id = ?1",
    ] {
        tx.prepare_cached(sql)
            .and_then(|mut st| st.execute(params![id]))
            .map_err(write_err)?;
    }
    Ok(())
}

/// B4: an accepted control request's receipt; only the newest `RECEIPTS_MAX` are kept.
fn write_receipt(
    tx: &rusqlite::Transaction,
    scope: &str,
    r: &berth_core::scopes::Receipt,
) -> Result<(), StoreError> {
    tx.prepare_cached(
        "INSERT INTO scope_receipts (scope, request_id, mode, generation, control, at_ms)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
    )
    .and_then(|mut st| {
        st.execute(params![
            scope,
            r.request_id,
            r.mode.as_str(),
            r.generation as i64,
            r.control.as_str(),
            r.at_ms as i64,
        ])
    })
    .map_err(write_err)?;
    let keep_from = r
        .generation
        .saturating_sub(berth_core::scopes::RECEIPTS_MAX as u64);
    tx.prepare_cached("DELETE FROM scope_receipts WHERE scope = ?1 AND generation <= ?2")
        .and_then(|mut st| st.execute(params![scope, keep_from as i64]))
        .map_err(write_err)?;
    Ok(())
}

/// B2/B3: a token taken (or marked lapsed), or freed (`None`).
fn write_budget_token(
    tx: &rusqlite::Transaction,
    scope: &str,
    owner: &str,
    operation: &str,
    token: Option<&berth_core::scopes::Token>,
) -> Result<(), StoreError> {
    let res = match token {
        Some(t) => tx
            .prepare_cached(
                "INSERT OR REPLACE INTO scope_tokens (scope, owner, operation, harness, run_id,
                   since_ms, owner_lapsed) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            )
            .and_then(|mut st| {
                st.execute(params![
                    scope,
                    owner,
                    operation,
                    t.harness,
                    t.run_id,
                    t.since_ms as i64,
                    t.owner_lapsed as i64,
                ])
            }),
        None => tx
            .prepare_cached(
                "DELETE FROM scope_tokens WHERE scope = ?1 AND owner = ?2 AND operation = ?3",
            )
            .and_then(|mut st| st.execute(params![scope, owner, operation])),
    };
    res.map_err(write_err)?;
    Ok(())
}

/// Every scope with its receipts (oldest first) and tokens. A row that breaks the
/// rules (a bad word, a policy that does not parse, a token of a harness outside the
/// policy, a harness over its limit) is a corrupt ledger (D4), never a guess.
fn load_scopes(conn: &rusqlite::Connection) -> Result<Vec<berth_core::scopes::Scope>, StoreError> {
    use berth_core::scopes::Scopes;
    let mut out = load_scope_rows(conn)?;
    load_scope_receipts(conn, &mut out)?;
    load_scope_tokens(conn, &mut out)?;
    // The rules' own check: counts, limits, harnesses (D4: refuse, never guess).
    let mut all = Scopes::default();
    for s in out.values() {
        all.restore(s.clone());
    }
    all.check_invariants()
        .map_err(|e| StoreError::Corrupt(format!("scopes: {e}")))?;
    Ok(all.iter().cloned().collect())
}

type ScopeMap = BTreeMap<String, berth_core::scopes::Scope>;

/// The scopes' own rows: policy, manifest, control, generation, owner.
fn load_scope_rows(conn: &rusqlite::Connection) -> Result<ScopeMap, StoreError> {
    use berth_core::scopes::Scope;
    let mut out = ScopeMap::new();
    let mut st = conn
        .prepare(
            "SELECT id, policy, manifest_path, manifest_sha256, manifest_ids, control,
                    generation, owner_uid FROM scopes ORDER BY id",
        )
        .map_err(corrupt)?;
    let mut rows = st.query([]).map_err(corrupt)?;
    while let Some(row) = rows.next().map_err(corrupt)? {
        let id: String = row.get(0).map_err(corrupt)?;
        let bad = |why: String| StoreError::Corrupt(format!("scope {id}: {why}"));
        let mut policy = berth_core::scopes::Policy::new();
        for pair in row.get::<_, String>(1).map_err(corrupt)?.split(',') {
            let (h, n) = pair
                .split_once('=')
                .ok_or_else(|| bad(format!("policy entry {pair:?}")))?;
            let n = n.parse().map_err(|_| bad(format!("limit {n:?}")))?;
            policy.insert(h.to_string(), n);
        }
        berth_core::scopes::check_policy(&policy).map_err(|e| bad(e.to_string()))?;
        let manifest = read_manifest(row.get(2), row.get(3), row.get(4)).map_err(bad)?;
        let mut s = Scope::new(&id, policy, manifest);
        s.control = word(&row.get::<_, String>(5).map_err(corrupt)?)?;
        s.generation =
            u(row.get(6).map_err(corrupt)?).map_err(|e| of(&format!("scope {id}"), e))?;
        s.owner_uid = match row.get::<_, Option<i64>>(7).map_err(corrupt)? {
            None => None,
            Some(v) => Some(u32::try_from(v).map_err(|_| bad(format!("owner_uid {v}")))?),
        };
        out.insert(id, s);
    }
    Ok(out)
}

/// A frozen manifest from its three columns: all set, or none.
fn read_manifest(
    path: rusqlite::Result<Option<String>>,
    sha: rusqlite::Result<Option<String>>,
    ids: rusqlite::Result<Option<String>>,
) -> Result<Option<berth_core::scopes::Manifest>, String> {
    let cols = (path, sha, ids);
    let (Ok(path), Ok(sha), Ok(ids)) = cols else {
        return Err("a manifest column of the wrong type".into());
    };
    match (path, sha, ids) {
        (Some(path), Some(sha256), Some(ids)) => Ok(Some(berth_core::scopes::Manifest {
            path,
            sha256,
            execution_ids: ids
                .split('\n')
                .filter(|x| !x.is_empty())
                .map(str::to_string)
                .collect(),
        })),
        (None, None, None) => Ok(None),
        _ => Err("a manifest in part".into()),
    }
}

/// Each scope's control receipts, oldest first.
fn load_scope_receipts(conn: &rusqlite::Connection, out: &mut ScopeMap) -> Result<(), StoreError> {
    let mut st = conn
        .prepare(
            "SELECT scope, request_id, mode, generation, control, at_ms FROM scope_receipts
             ORDER BY scope, generation",
        )
        .map_err(corrupt)?;
    let mut rows = st.query([]).map_err(corrupt)?;
    while let Some(row) = rows.next().map_err(corrupt)? {
        let scope: String = row.get(0).map_err(corrupt)?;
        let n = |i: usize| -> Result<u64, StoreError> {
            u(row.get(i).map_err(corrupt)?).map_err(|e| of(&format!("scope {scope}: a receipt"), e))
        };
        let r = berth_core::scopes::Receipt {
            request_id: row.get(1).map_err(corrupt)?,
            mode: word(&row.get::<_, String>(2).map_err(corrupt)?)?,
            generation: n(3)?,
            control: word(&row.get::<_, String>(4).map_err(corrupt)?)?,
            at_ms: n(5)?,
        };
        out.get_mut(&scope)
            .ok_or_else(|| StoreError::Corrupt(format!("a receipt of unknown scope {scope}")))?
            .receipts
            .push(r);
    }
    Ok(())
}

/// Each scope's tokens, by (owner, operation).
fn load_scope_tokens(conn: &rusqlite::Connection, out: &mut ScopeMap) -> Result<(), StoreError> {
    let mut st = conn
        .prepare(
            "SELECT scope, owner, operation, harness, run_id, since_ms, owner_lapsed
             FROM scope_tokens",
        )
        .map_err(corrupt)?;
    let mut rows = st.query([]).map_err(corrupt)?;
    while let Some(row) = rows.next().map_err(corrupt)? {
        let scope: String = row.get(0).map_err(corrupt)?;
        let key = (row.get(1).map_err(corrupt)?, row.get(2).map_err(corrupt)?);
        let t = berth_core::scopes::Token {
            harness: row.get(3).map_err(corrupt)?,
            run_id: row.get(4).map_err(corrupt)?,
            since_ms: u(row.get(5).map_err(corrupt)?)
                .map_err(|e| of(&format!("scope {scope}: a token"), e))?,
            owner_lapsed: row.get::<_, i64>(6).map_err(corrupt)? != 0,
        };
        out.get_mut(&scope)
            .ok_or_else(|| StoreError::Corrupt(format!("a token of unknown scope {scope}")))?
            .tokens
            .insert(key, t);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Migration 8: a ledger whose journal has a row per entry (version 7) opens with
    /// the same entries, byte for byte, in chunks, and numbering goes on after them.
    #[test]
    fn a_row_per_entry_journal_migrates_to_chunks() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ledger.db");
        {
            let conn = Connection::open(&path).unwrap();
            for sql in &MIGRATIONS[..7] {
                conn.execute_batch(sql).unwrap();
            }
            conn.execute_batch("PRAGMA user_version = 7").unwrap();
            let mut insert = conn
                .prepare(
                    "INSERT INTO journal (seq, kind, run_id, project, line, written_unix_ms)
                     VALUES (?1, ?2, ?3, ?4, ?5, 1)",
                )
                .unwrap();
            insert
                .execute(params![
                    1,
                    "token_created",
                    None::<String>,
                    None::<String>,
                    "{\"seq\":1}"
                ])
                .unwrap();
            insert
                .execute(params![
                    2,
                    "queued",
                    "r1",
                    "acme/web",
                    "{\"seq\":2,\"x\":\"a\\tb\"}"
                ])
                .unwrap();
        }
        let mut s = SqliteStore::open(&path).unwrap();
        let got = s.journal(0, 10).unwrap();
        let want = vec![
            JournalEntry {
                seq: 1,
                kind: "token_created".into(),
                run_id: None,
                project: None,
                line: "{\"seq\":1}".into(),
            },
            JournalEntry {
                seq: 2,
                kind: "queued".into(),
                run_id: Some("r1".into()),
                project: Some("acme/web".into()),
                line: "{\"seq\":2,\"x\":\"a\\tb\"}".into(),
            },
        ];
        assert_eq!(got, want);
        assert_eq!(s.load(10).unwrap().journal_last, 2);
        assert_eq!(s.journal_first().unwrap(), 1);
    }

    /// A field that would break the chunk's record format is refused, not stored.
    #[test]
    fn a_journal_field_with_a_tab_or_line_end_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = SqliteStore::open(&dir.path().join("ledger.db")).unwrap();
        let bad = [
            ("ki\tnd", Some("r"), "{}"),
            ("kind", Some("r\n"), "{}"),
            ("kind", Some(""), "{}"),
            ("kind", Some("r"), "{\n}"),
        ];
        for (i, (kind, run_id, line)) in bad.into_iter().enumerate() {
            let mut b = Batch::default();
            b.push(Mutation::Journal(std::sync::Arc::new(JournalEntry {
                seq: i as u64 + 1,
                kind: kind.into(),
                run_id: run_id.map(str::to_string),
                project: None,
                line: line.into(),
            })));
            assert!(s.write(&[&b]).is_err(), "{kind:?} {run_id:?} {line:?}");
        }
        assert_eq!(s.load(10).unwrap().journal_last, 0);
    }

    /// D4: a journal chunk that does not unpack, does not parse, or does not end where
    /// its row says, is a corrupt ledger (an error), never a panic, never a guess and
    /// never an allocation of the size a corrupt block claims.
    #[test]
    fn a_malformed_journal_chunk_is_refused_as_corrupt() {
        let huge = {
            let mut b = (u32::MAX).to_le_bytes().to_vec();
            b.extend_from_slice(&pack("k\t\t\t{}\n")[4..]);
            b
        };
        let truncated = pack(&"k\t\t\t{\"seq\":1}\n".repeat(50));
        let not_utf8 = lz4_flex::block::compress_prepend_size(b"k\t\t\t\xff\n");
        let cases: [(&str, Vec<u8>, i64); 6] = [
            ("a record of two fields", pack("kind\tr\n"), 1),
            (
                "two records, the row says one",
                pack("k\t\t\t{}\nk\t\t\t{}\n"),
                1,
            ),
            ("no length", vec![1, 2], 1),
            ("a length of 4 GiB", huge, 1),
            ("a cut block", truncated[..truncated.len() / 2].to_vec(), 50),
            ("not UTF-8", not_utf8, 1),
        ];
        for (what, packed, last) in cases {
            let dir = tempfile::tempdir().unwrap();
            let mut s = SqliteStore::open(&dir.path().join("ledger.db")).unwrap();
            s.conn
                .execute(
                    "INSERT INTO journal_chunks (first_seq, last_seq, packed, written_unix_ms)
                     VALUES (1, ?1, ?2, 0)",
                    params![last, packed],
                )
                .unwrap();
            match s.journal(0, 10) {
                Err(StoreError::Corrupt(_)) => {}
                other => panic!("{what}: {other:?}"),
            }
        }
    }

    /// Migration 9: a ledger of text chunks (version 8) opens with the same entries,
    /// byte for byte, packed, and numbering goes on after them.
    #[test]
    fn text_chunks_migrate_to_packed_chunks() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ledger.db");
        let text =
            "queued\tr1\tacme/web\t{\"seq\":4,\"x\":\"a\\tb\"}\ntoken_created\t\t\t{\"seq\":5}\n";
        {
            let conn = Connection::open(&path).unwrap();
            for sql in &MIGRATIONS[..8] {
                conn.execute_batch(sql).unwrap();
            }
            conn.execute_batch("PRAGMA user_version = 8").unwrap();
            conn.execute(
                "INSERT INTO journal_chunks (first_seq, last_seq, entries, written_unix_ms)
                 VALUES (4, 5, ?1, 1)",
                params![text],
            )
            .unwrap();
        }
        let mut s = SqliteStore::open(&path).unwrap();
        let lines: Vec<String> = s
            .journal(0, 10)
            .unwrap()
            .into_iter()
            .map(|e| e.line)
            .collect();
        assert_eq!(lines, ["{\"seq\":4,\"x\":\"a\\tb\"}", "{\"seq\":5}"]);
        let got = s.journal(4, 10).unwrap();
        assert_eq!(got[0].kind, "token_created");
        assert_eq!(
            (got[0].run_id.as_deref(), got[0].project.as_deref()),
            (None, None)
        );
        assert_eq!(s.load(10).unwrap().journal_last, 5);
        assert_eq!(s.journal_first().unwrap(), 4);
    }

    /// One transaction's entries past `CHUNK_TEXT_CUT` become several chunks, each
    /// within the bound a read unpacks, read back in order without a gap.
    #[test]
    fn a_large_transaction_journals_in_several_chunks() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = SqliteStore::open(&dir.path().join("ledger.db")).unwrap();
        let line = format!("{{\"pad\":\"{}\"}}", "x".repeat(4_000));
        let n = (3 * CHUNK_TEXT_CUT / line.len()) as u64;
        let mut b = Batch::default();
        for seq in 1..=n {
            b.push(Mutation::Journal(std::sync::Arc::new(JournalEntry {
                seq,
                kind: "queued".into(),
                run_id: Some(format!("r{seq}")),
                project: None,
                line: line.clone(),
            })));
        }
        s.write(&[&b]).unwrap();
        let chunks: i64 = s
            .conn
            .query_row("SELECT COUNT(*) FROM journal_chunks", [], |r| r.get(0))
            .unwrap();
        assert!((3..=4).contains(&chunks), "{chunks} chunks");
        let mut after = 0;
        while after < n {
            let got = s.journal(after, JOURNAL_READ_MAX).unwrap();
            assert!(!got.is_empty());
            for e in got {
                assert_eq!(
                    (e.seq, e.run_id),
                    (after + 1, Some(format!("r{}", after + 1)))
                );
                after = e.seq;
            }
        }
        assert_eq!(s.load(10).unwrap().journal_last, n);
    }
}
