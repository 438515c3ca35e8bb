//! The schema as numbered migrations, and the data migrations some of them need.

use super::*;

/// Schema migrations, applied in order; the ledger records how many have run.
pub(super) const MIGRATIONS: &[&str] = &[
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
pub(super) fn migrate_data(version: usize, tx: &rusqlite::Transaction) -> rusqlite::Result<()> {
    match version {
        9 => pack_text_chunks(tx),
        _ => Ok(()),
    }
}

/// Migration 9: every text chunk into a packed one, then the text table goes.
pub(super) fn pack_text_chunks(tx: &rusqlite::Transaction) -> rusqlite::Result<()> {
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
