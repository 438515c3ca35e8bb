//! The `runs` table: the run record's columns, its upsert, and retention of ended runs.

use super::*;

/// The columns `read_run` reads, in this order: by position, not by name (looking each
/// name up was an eighth of a restart's CPU).
pub(super) const RUN_COLUMNS: &str = "run_id, project, class, priority, slots, memory, cpu_millis, disk, named, singletons, contract_concurrency, contract_fingerprint, contract_commit, ttl_ms, wait_ms, worktree, labels, state, fence, queue_seq, enqueued_ms, deadline_ms, granted_ms, expires_ms, end_cause, primary_mode, ws_path, ws_dev, ws_ino, stop_grace_ms, detached, thread, budget, lease_only, owner_uid, upgrading, journal_first";

/// Positions of `RUN_COLUMNS`.
pub(super) mod col {
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
pub(super) fn read_run(row: &Row) -> Result<RunRecord, StoreError> {
    read_run_fields(row).map_err(|e| {
        let id: String = row.get(col::RUN_ID).unwrap_or_else(|_| "?".into());
        of(&format!("run {id}"), e)
    })
}

pub(super) fn read_run_fields(row: &Row) -> Result<RunRecord, StoreError> {
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
pub(super) fn read_request(row: &Row) -> Result<Request, StoreError> {
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

pub(super) const UPSERT: &str =
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

/// Inserts or updates one run's record (D3: not once it is terminal) and adds its
/// processes. `now_ms` is when a run written terminal ended.
/// A new run under the id of an ended one the engine has forgotten (but retention has
/// not deleted yet) replaces it, processes and all. D3 still holds: the ended record
/// of the *same* run (same queue sequence) is never overwritten. Without this, the new
/// run's writes were dropped by D3's guard and a restart brought back the old one, its
/// acknowledged grant lost (found by the daemon simulator).
///
/// Only reached when an upsert changed nothing, so it costs the hot path nothing.
pub(super) fn replace_ended(tx: &rusqlite::Transaction, r: &RunRecord) -> Result<(), StoreError> {
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
    keep_fence_of(
        tx,
        "run_id = ?1 AND terminal = 1 AND queue_seq <> ?2",
        params![id, seq],
    )
    .map_err(write_err)?;
    tx.prepare_cached("DELETE FROM runs WHERE run_id = ?1 AND terminal = 1 AND queue_seq <> ?2")
        .and_then(|mut s| s.execute(params![id, seq]))
        .map_err(write_err)?;
    Ok(())
}

/// Every live run and the `ended_max` most recent ended ones, in queue order.
pub(super) fn load_runs(c: &Connection, ended_max: usize) -> Result<Vec<RunRecord>, StoreError> {
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

/// The next queue sequence number: two index lookups (not a scan of every row), and
/// never below what pruned runs had reached.
pub(super) fn next_queue_seq(c: &Connection) -> Result<u64, StoreError> {
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

/// Writes one run record; false when D3's guard left the row as it was (it is ended).
pub(super) fn upsert_run(
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
pub(super) fn prune_in(
    tx: &rusqlite::Transaction,
    policy: &Retention,
    now_unix_ms: u64,
    rows_max: usize,
) -> rusqlite::Result<(usize, u64)> {
    tx.execute_batch(
        "CREATE TEMP TABLE IF NOT EXISTS doomed
           (run_id TEXT PRIMARY KEY, queue_seq INTEGER, fence INTEGER);
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
            "INSERT OR IGNORE INTO temp.doomed SELECT run_id, queue_seq, fence FROM runs
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
        "INSERT OR IGNORE INTO temp.doomed SELECT run_id, queue_seq, fence FROM
           (SELECT run_id, queue_seq, fence, ended_unix_ms FROM runs WHERE terminal = 1
            ORDER BY queue_seq LIMIT ?2)
         WHERE ended_unix_ms < ?1",
    )?
    .execute(params![cutoff as i64, rows_max as i64])?;
    tx.prepare_cached("DELETE FROM processes WHERE run_id IN (SELECT run_id FROM temp.doomed)")?
        .execute([])?;
    tx.prepare_cached("DELETE FROM ports WHERE run_id IN (SELECT run_id FROM temp.doomed)")?
        .execute([])?;
    keep_fence_of_doomed(tx)?;
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

/// Each loaded run's place in `runs`, by id: where the per-run tables' rows go.
pub(super) fn run_index(runs: &[RunRecord]) -> std::collections::HashMap<String, usize> {
    runs.iter()
        .enumerate()
        .map(|(i, r)| (r.request.run_id.clone(), i))
        .collect()
}
