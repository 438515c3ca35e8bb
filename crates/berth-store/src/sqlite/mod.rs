//! The embedded SQLite ledger.

use std::collections::BTreeMap;
use std::path::Path;

use berth_core::{ContractInfo, EndCause, Request, Resources};
use rusqlite::{params, Connection, OptionalExtension, Row};

use crate::{
    Batch, JournalEntry, Ledger, Mutation, ProcessRecord, Retention, RunRecord, Store, StoreError,
    WorkspaceIdentity, JOURNAL_ENTRIES_PER_RUN, JOURNAL_READ_MAX,
};

mod codec;
mod drain;
mod evidence;
mod journal;
mod meta;
mod ports;
mod processes;
mod runs;
mod schema;
mod scopes;
mod threads;

use codec::*;
use drain::*;
use evidence::*;
use journal::*;
pub(crate) use journal::{record_len, CHUNK_TEXT_CUT};
use meta::*;
use ports::*;
use processes::*;
use runs::*;
use schema::*;
use scopes::*;
use threads::*;

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

impl Store for SqliteStore {
    /// The whole ledger, one loader per table; the cross-table checks (L1, D4) here.
    fn load(&mut self, ended_max: usize) -> Result<Ledger, StoreError> {
        let c = &self.conn;
        let (last_fence, boot_id) = load_meta(c)?;
        let mut runs = load_runs(c, ended_max)?;
        load_processes(c, &mut runs, ended_max)?;
        load_ports(c, &mut runs)?;
        // L1: the counter is the highest fence in `meta` or on any run row (a commit
        // whose runs carry its fence leaves `meta` alone; a row leaving the table
        // raises `meta` to its fence first).
        let last_fence = last_fence.max(fence_on_rows(c)?);
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
        // The highest fence a run row written here carries: the counter in `meta` is
        // rewritten only when the batches' fence is above it (issue 37: that row was a
        // page of every commit, and the fence is almost always a granted run's own).
        let mut carried = 0u64;
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
                    carried = carried.max(r.fence.unwrap_or(0));
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
        if fence > carried {
            raise_fence(&tx, fence).map_err(write_err)?;
        }
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

#[cfg(test)]
mod tests;
