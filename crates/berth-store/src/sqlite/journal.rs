//! The journal: entries packed (lz4) into chunks of at most `CHUNK_TEXT_CUT` bytes of
//! text, read back by sequence, and pruned by retention.

use super::*;

/// The journal's records of one transaction, gathered as its mutations go by and
/// written as one row at its end (or, past `CHUNK_TEXT_CUT`, as several).
#[derive(Default)]
pub(super) struct Chunk {
    first: Option<u64>,
    last: u64,
    entries: String,
}

/// A chunk's text once it holds this much (bytes) is written, and a new chunk begins:
/// bounds what one read unpacks (a restart that reaps thousands of runs journals them
/// all in one transaction). `MemStore` cuts where this does, so that retention keeps
/// the same entries.
pub(crate) const CHUNK_TEXT_CUT: usize = 1 << 20;

/// The largest record a chunk takes (bytes): no request can make an entry this large,
/// so a record above it is a bug refused before it is written.
pub(crate) const JOURNAL_RECORD_MAX: usize = 16 << 20;

/// An entry's record in a chunk's text (`kind TAB run TAB project TAB line LF`): its
/// length, or why the entry would break the format (a tab or a line end in a field, an
/// empty id, a record over `JOURNAL_RECORD_MAX`). Every store refuses the same entries.
pub(crate) fn record_len(e: &JournalEntry) -> Result<usize, String> {
    let fields = [
        Some(e.kind.as_str()),
        e.run_id.as_deref(),
        e.project.as_deref(),
    ];
    if e.kind.is_empty() || fields.iter().flatten().any(|f| f.contains(['\t', '\n'])) {
        return Err("kind, run id and project must be tab- and line-free".into());
    }
    if e.run_id.as_deref() == Some("") || e.project.as_deref() == Some("") {
        return Err("an empty run id or project is ambiguous".into());
    }
    if e.line.contains('\n') {
        return Err("its line holds a line end".into());
    }
    let record = fields.iter().flatten().map(|f| f.len() + 1).sum::<usize>() + e.line.len();
    if record > JOURNAL_RECORD_MAX {
        return Err(format!("{record} bytes, over {JOURNAL_RECORD_MAX}"));
    }
    Ok(record)
}

/// The largest text a packed chunk may claim (bytes): a chunk is cut at
/// `CHUNK_TEXT_CUT` after one record of at most `JOURNAL_RECORD_MAX`. A size above
/// it is a corrupt ledger, never an allocation of whatever the disk says.
pub(super) const CHUNK_TEXT_MAX: usize = CHUNK_TEXT_CUT + JOURNAL_RECORD_MAX;

/// A chunk's text as stored: LZ4's block format, its length first (u32, little end).
pub(super) fn pack(text: &str) -> Vec<u8> {
    lz4_flex::block::compress_prepend_size(text.as_bytes())
}

/// A packed chunk's text, or why the ledger is corrupt.
pub(super) fn unpack(first: u64, packed: &[u8]) -> Result<String, StoreError> {
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

/// The newest chunk's last entry. Chunks are written in order, so the newest by its key
/// holds the last entry: one row read, never the whole table (see `HELD_QUERIES`).
pub(super) const NEWEST_LAST: &str =
    "SELECT last_seq FROM journal_chunks ORDER BY first_seq DESC LIMIT 1";

/// The last journal entry stored (0: none), from the newest chunk.
pub(super) fn journal_last(conn: &rusqlite::Connection) -> Result<u64, StoreError> {
    let last = conn
        .prepare_cached(NEWEST_LAST)
        .and_then(|mut s| s.query_row([], |r| r.get::<_, i64>(0)).optional())
        .map_err(corrupt)?;
    u(last.unwrap_or(0)).map_err(|e| of("journal", e))
}

/// A chunk's records back into entries, numbered from `first`.
pub(super) fn parse_chunk(first: u64, text: &str) -> Result<Vec<JournalEntry>, StoreError> {
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
pub(super) fn prune_journal(
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

/// What `journal_held` reads besides the newest entry (`NEWEST_LAST`): the oldest live
/// run's first entry and the oldest scope's. Each costs what the live rows do, never a
/// pass over the retained history: every prune runs them (up to every
/// `PRUNE_BACKLOG_PAUSE_MS` under load), and the newest entry was read as
/// `MAX(last_seq)`, a column without an index, which read every chunk the journal keeps
/// each time (regression test `regression_the_journal_hold_reads_no_whole_table`).
pub(super) const HELD_QUERIES: [&str; 2] = [
    // By the index on (terminal, queue_seq): the live runs only.
    "SELECT MIN(journal_first) FROM runs WHERE terminal = 0 AND journal_first > 0",
    // Scopes are few (a quota per user, idle ones forgotten).
    "SELECT MIN(journal_first) FROM scopes WHERE journal_first > 0",
];

/// The first journal entry retention must keep (issue 32 finding 8): the first of the
/// oldest live run's, of the oldest remembered scope's, and of an export under way, but
/// never more than `JOURNAL_HELD_MAX` entries behind the last.
pub(super) fn journal_held(
    tx: &rusqlite::Transaction,
    policy: &Retention,
) -> rusqlite::Result<i64> {
    let first = |sql: &str| -> rusqlite::Result<i64> {
        tx.prepare_cached(sql)?
            .query_row([], |r| r.get::<_, Option<i64>>(0))
            .map(|v| v.unwrap_or(i64::MAX))
    };
    let [run, scope] = HELD_QUERIES;
    let (run, scope) = (first(run)?, first(scope)?);
    let last = tx
        .prepare_cached(NEWEST_LAST)?
        .query_row([], |r| r.get::<_, i64>(0))
        .optional()?
        .unwrap_or(i64::MAX);
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

impl Chunk {
    /// Appends an entry. Within a transaction entries come in order; a field that would
    /// break the record format (a tab or a line end, an empty id) is refused.
    pub(super) fn push(&mut self, e: &JournalEntry) -> Result<(), StoreError> {
        let refuse = |why: String| StoreError::Write(format!("journal entry {}: {why}", e.seq));
        if self.first.is_some() && e.seq <= self.last {
            let why = format!("follows {} in the same transaction", self.last);
            return Err(refuse(why));
        }
        record_len(e).map_err(refuse)?;
        self.first.get_or_insert(e.seq);
        self.last = e.seq;
        for f in [
            Some(e.kind.as_str()),
            e.run_id.as_deref(),
            e.project.as_deref(),
        ] {
            self.entries.push_str(f.unwrap_or(""));
            self.entries.push('\t');
        }
        self.entries.push_str(&e.line);
        self.entries.push('\n');
        Ok(())
    }

    /// Whether the next entry begins a new chunk (`CHUNK_TEXT_CUT`).
    pub(super) fn is_full(&self) -> bool {
        self.entries.len() >= CHUNK_TEXT_CUT
    }

    /// The row, if the transaction journaled anything. Numbers never repeat or go back:
    /// the chunk must start after the last entry stored.
    pub(super) fn write(self, tx: &rusqlite::Transaction, now_ms: u64) -> Result<(), StoreError> {
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
