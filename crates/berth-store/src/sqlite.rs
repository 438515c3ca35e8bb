//! The embedded SQLite ledger.

use std::collections::BTreeMap;
use std::path::Path;

use berth_core::{
    Class, Concurrency, ContractInfo, EndCause, KeyMode, Priority, Request, Resources, RunState,
};
use rusqlite::{params, Connection, OptionalExtension, Row};

use crate::{Batch, Ledger, ProcessRecord, RunRecord, Store, StoreError, WorkspaceIdentity};

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
];

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
        conn.execute_batch("PRAGMA synchronous=FULL; PRAGMA foreign_keys=ON;")
            .map_err(open_err)?;
        // D4: refuse a ledger that fails its own integrity check.
        let ok: String = conn
            .query_row("PRAGMA quick_check", [], |r| r.get(0))
            .map_err(corrupt)?;
        if ok != "ok" {
            return Err(StoreError::Corrupt(ok));
        }
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

fn class_str(c: Class) -> &'static str {
    c.as_str()
}

fn parse_class(s: &str) -> Result<Class, StoreError> {
    match s {
        "managed" => Ok(Class::Managed),
        "analysis" => Ok(Class::Analysis),
        _ => Err(StoreError::Corrupt(format!("unknown class {s:?}"))),
    }
}

fn parse_priority(s: &str) -> Result<Priority, StoreError> {
    match s {
        "foreground" => Ok(Priority::Foreground),
        "background" => Ok(Priority::Background),
        _ => Err(StoreError::Corrupt(format!("unknown priority {s:?}"))),
    }
}

fn parse_state(s: &str) -> Result<RunState, StoreError> {
    Ok(match s {
        "queued" => RunState::Queued,
        "granted" => RunState::Granted,
        "releasing" => RunState::Releasing,
        "released" => RunState::Released,
        "expired" => RunState::Expired,
        "cancelled" => RunState::Cancelled,
        "rejected" => RunState::Rejected,
        "degraded" => RunState::Degraded,
        _ => return Err(StoreError::Corrupt(format!("unknown state {s:?}"))),
    })
}

fn concurrency_str(c: Concurrency) -> &'static str {
    match c {
        Concurrency::Serial => "serial",
        Concurrency::Parallel => "parallel",
        Concurrency::Disabled => "disabled",
    }
}

fn parse_concurrency(s: &str) -> Result<Concurrency, StoreError> {
    Ok(match s {
        "serial" => Concurrency::Serial,
        "parallel" => Concurrency::Parallel,
        "disabled" => Concurrency::Disabled,
        _ => return Err(StoreError::Corrupt(format!("unknown concurrency {s:?}"))),
    })
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

fn u(v: i64) -> u64 {
    v as u64
}

fn read_run(row: &Row) -> Result<RunRecord, StoreError> {
    let g = |i: &str| -> Result<i64, StoreError> { row.get::<_, i64>(i).map_err(corrupt) };
    let s = |i: &str| -> Result<String, StoreError> { row.get::<_, String>(i).map_err(corrupt) };
    let os = |i: &str| -> Result<Option<String>, StoreError> {
        row.get::<_, Option<String>>(i).map_err(corrupt)
    };
    let oi = |i: &str| -> Result<Option<i64>, StoreError> {
        row.get::<_, Option<i64>>(i).map_err(corrupt)
    };
    let named = decode_map(&s("named")?)?
        .into_iter()
        .map(|(k, v)| {
            v.parse::<u64>()
                .map(|n| (k, n))
                .map_err(|_| StoreError::Corrupt(format!("bad named amount {v:?}")))
        })
        .collect::<Result<BTreeMap<_, _>, _>>()?;
    let singletons: Vec<String> = s("singletons")?
        .split(',')
        .filter(|x| !x.is_empty())
        .map(str::to_string)
        .collect();
    let contract = match os("contract_concurrency")? {
        Some(c) => Some(ContractInfo {
            concurrency: parse_concurrency(&c)?,
            fingerprint: os("contract_fingerprint")?.unwrap_or_default(),
            commit: os("contract_commit")?,
        }),
        None => None,
    };
    let workspace = match (os("ws_path")?, oi("ws_dev")?, oi("ws_ino")?) {
        (Some(path), Some(dev), Some(ino)) => Some(WorkspaceIdentity {
            path,
            dev: u(dev),
            ino: u(ino),
        }),
        _ => None,
    };
    Ok(RunRecord {
        request: Request {
            run_id: s("run_id")?,
            project: s("project")?,
            class: parse_class(&s("class")?)?,
            priority: parse_priority(&s("priority")?)?,
            resources: Resources {
                slots: u(g("slots")?),
                memory: u(g("memory")?),
                cpu_millis: u(g("cpu_millis")?),
                disk: u(g("disk")?),
                named,
            },
            singletons,
            contract,
            ttl_ms: u(g("ttl_ms")?),
            wait_ms: u(g("wait_ms")?),
        },
        worktree: os("worktree")?,
        labels: decode_map(&s("labels")?)?,
        state: parse_state(&s("state")?)?,
        fence: oi("fence")?.map(u),
        queue_seq: u(g("queue_seq")?),
        enqueued_ms: u(g("enqueued_ms")?),
        deadline_ms: u(g("deadline_ms")?),
        granted_ms: oi("granted_ms")?.map(u),
        expires_ms: oi("expires_ms")?.map(u),
        end_cause: match os("end_cause")?.as_deref() {
            None => None,
            Some("released") => Some(EndCause::Released),
            Some("expired") => Some(EndCause::Expired),
            Some(x) => return Err(StoreError::Corrupt(format!("unknown end cause {x:?}"))),
        },
        primary_mode: match s("primary_mode")?.as_str() {
            "exclusive" => KeyMode::Exclusive,
            "shared" => KeyMode::Shared,
            x => return Err(StoreError::Corrupt(format!("unknown key mode {x:?}"))),
        },
        workspace,
        processes: Vec::new(),
        stop_grace_ms: oi("stop_grace_ms")?.map(u),
    })
}

const UPSERT: &str =
    "INSERT INTO runs (run_id, project, class, priority, slots, memory, cpu_millis,
    disk, named, singletons, contract_concurrency, contract_fingerprint, contract_commit, ttl_ms,
    wait_ms, worktree, labels, state, fence, queue_seq, enqueued_ms, deadline_ms, granted_ms,
    expires_ms, end_cause, primary_mode, ws_path, ws_dev, ws_ino, terminal, stop_grace_ms)
  VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19,
    ?20, ?21, ?22, ?23, ?24, ?25, ?26, ?27, ?28, ?29, ?30, ?31)
  ON CONFLICT (run_id) DO UPDATE SET
    state = excluded.state, fence = excluded.fence, deadline_ms = excluded.deadline_ms,
    granted_ms = excluded.granted_ms, expires_ms = excluded.expires_ms,
    end_cause = excluded.end_cause, primary_mode = excluded.primary_mode,
    ws_path = excluded.ws_path, ws_dev = excluded.ws_dev, ws_ino = excluded.ws_ino,
    terminal = excluded.terminal
  -- D3: a terminal state is never overwritten.
  WHERE runs.terminal = 0";

impl Store for SqliteStore {
    fn load(&mut self, ended_max: usize) -> Result<Ledger, StoreError> {
        let last_fence: String = self
            .conn
            .query_row("SELECT value FROM meta WHERE key = 'last_fence'", [], |r| {
                r.get(0)
            })
            .map_err(corrupt)?;
        let last_fence: u64 = last_fence
            .parse()
            .map_err(|_| StoreError::Corrupt(format!("last_fence {last_fence:?}")))?;
        let boot_id: Option<String> = self
            .conn
            .query_row("SELECT value FROM meta WHERE key = 'boot_id'", [], |r| {
                r.get(0)
            })
            .optional()
            .map_err(corrupt)?;
        let mut runs = Vec::new();
        {
            let mut stmt = self
                .conn
                .prepare(
                    "SELECT * FROM runs WHERE terminal = 0
                     UNION ALL
                     SELECT * FROM (SELECT * FROM runs WHERE terminal = 1
                                    ORDER BY queue_seq DESC LIMIT ?1)
                     ORDER BY queue_seq",
                )
                .map_err(corrupt)?;
            let mut rows = stmt.query([ended_max as i64]).map_err(corrupt)?;
            while let Some(row) = rows.next().map_err(corrupt)? {
                runs.push(read_run(row)?);
            }
        }
        {
            let mut index: std::collections::HashMap<String, usize> =
                std::collections::HashMap::new();
            for (i, r) in runs.iter().enumerate() {
                index.insert(r.request.run_id.clone(), i);
            }
            let mut stmt = self
                .conn
                .prepare("SELECT run_id, pid, start_ticks, boot_id FROM processes ORDER BY run_id, pid, start_ticks")
                .map_err(corrupt)?;
            let mut rows = stmt.query([]).map_err(corrupt)?;
            while let Some(row) = rows.next().map_err(corrupt)? {
                let run_id: String = row.get(0).map_err(corrupt)?;
                if let Some(&i) = index.get(&run_id) {
                    runs[i].processes.push(ProcessRecord {
                        pid: row.get::<_, i64>(1).map_err(corrupt)? as i32,
                        start_ticks: row.get::<_, i64>(2).map_err(corrupt)? as u64,
                        boot_id: row.get(3).map_err(corrupt)?,
                    });
                }
            }
        }
        let next_queue_seq: i64 = self
            .conn
            .query_row(
                "SELECT COALESCE(MAX(queue_seq) + 1, 0) FROM runs",
                [],
                |r| r.get(0),
            )
            .map_err(corrupt)?;
        let mut tokens = Vec::new();
        {
            let mut stmt = self
                .conn
                .prepare("SELECT hash, scope FROM tokens ORDER BY hash")
                .map_err(corrupt)?;
            let mut rows = stmt.query([]).map_err(corrupt)?;
            while let Some(row) = rows.next().map_err(corrupt)? {
                tokens.push((row.get(0).map_err(corrupt)?, row.get(1).map_err(corrupt)?));
            }
        }
        // L1: no fence issued may exceed the counter; if it does the ledger is damaged.
        if let Some(max) = runs.iter().filter_map(|r| r.fence).max() {
            if max > last_fence {
                return Err(StoreError::Corrupt(format!(
                    "run fence {max} is above the fence counter {last_fence}"
                )));
            }
        }
        Ok(Ledger {
            last_fence,
            boot_id,
            runs,
            next_queue_seq: next_queue_seq as u64,
            tokens,
        })
    }

    fn write(&mut self, batches: &[&Batch]) -> Result<(), StoreError> {
        let tx = self
            .conn
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
            .map_err(write_err)?;
        {
            let mut upsert = tx.prepare_cached(UPSERT).map_err(write_err)?;
            let mut fence = 0u64;
            for b in batches {
                fence = fence.max(b.last_fence);
                for r in &b.runs {
                    let q = &r.request;
                    let c = q.contract.as_ref();
                    let ws = r.workspace.as_ref();
                    upsert
                        .execute(params![
                            q.run_id,
                            q.project,
                            class_str(q.class),
                            q.priority.as_str(),
                            q.resources.slots as i64,
                            q.resources.memory as i64,
                            q.resources.cpu_millis as i64,
                            q.resources.disk as i64,
                            encode_map(&q.resources.named),
                            q.singletons.join(","),
                            c.map(|c| concurrency_str(c.concurrency)),
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
                            r.end_cause.map(|c| match c {
                                EndCause::Released => "released",
                                EndCause::Expired => "expired",
                            }),
                            r.primary_mode.as_str(),
                            ws.map(|w| w.path.as_str()),
                            ws.map(|w| w.dev as i64),
                            ws.map(|w| w.ino as i64),
                            r.state.is_terminal() as i64,
                            r.stop_grace_ms.map(|g| g as i64),
                        ])
                        .map_err(write_err)?;
                }
                for r in &b.runs {
                    for p in &r.processes {
                        let mut ins = tx
                            .prepare_cached(
                                "INSERT OR IGNORE INTO processes (run_id, pid, start_ticks, boot_id)
                                 VALUES (?1, ?2, ?3, ?4)",
                            )
                            .map_err(write_err)?;
                        ins.execute(params![
                            r.request.run_id,
                            p.pid as i64,
                            p.start_ticks as i64,
                            p.boot_id
                        ])
                        .map_err(write_err)?;
                    }
                }
                for (hash, scope) in &b.tokens {
                    tx.execute(
                        "INSERT OR REPLACE INTO tokens (hash, scope) VALUES (?1, ?2)",
                        params![hash, scope],
                    )
                    .map_err(write_err)?;
                }
            }
            // L1: the counter only ever moves up, whatever order batches arrive in.
            tx.execute(
                "UPDATE meta SET value = CAST(MAX(CAST(value AS INTEGER), ?1) AS TEXT)
                 WHERE key = 'last_fence'",
                params![fence as i64],
            )
            .map_err(write_err)?;
        }
        tx.commit().map_err(write_err)
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
