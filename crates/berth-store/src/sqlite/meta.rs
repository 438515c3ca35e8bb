//! The `meta` table (fence counter, boot id) and the `tokens` table.

use super::*;

/// The fence counter and the boot the ledger last ran in.
pub(super) fn load_meta(c: &Connection) -> Result<(u64, Option<String>), StoreError> {
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

/// L1: moves the fence counter in `meta` up to `fence`, never down, whatever order
/// batches arrive in.
pub(super) fn raise_fence(tx: &rusqlite::Transaction, fence: u64) -> rusqlite::Result<()> {
    tx.prepare_cached(
        "UPDATE meta SET value = CAST(MAX(CAST(value AS INTEGER), ?1) AS TEXT)
         WHERE key = 'last_fence'",
    )?
    .execute(params![fence.min(i64::MAX as u64) as i64])?;
    Ok(())
}

/// L1: before run rows leave the table (`which` selects them, with `?1` and `?2` bound
/// to `args`; a run replaced by a new one of its id), the counter is raised to the
/// highest fence among them: a commit whose rows carried its fence did not write it to
/// `meta`. (A prune reads the fences with the rows it chooses: `keep_fence_of_doomed`.)
pub(super) fn keep_fence_of(
    tx: &rusqlite::Transaction,
    which: &str,
    args: impl rusqlite::Params,
) -> rusqlite::Result<()> {
    let highest: Option<i64> = tx
        .prepare_cached(&format!("SELECT MAX(fence) FROM runs WHERE {which}"))?
        .query_row(args, |r| r.get(0))?;
    match highest {
        Some(f) if f > 0 => raise_fence(tx, f as u64),
        _ => Ok(()),
    }
}

/// L1: a prune keeps the highest fence of the rows it deletes, read with them into
/// `temp.doomed` (a second lookup of each by its key made every prune ~3% slower).
pub(super) fn keep_fence_of_doomed(tx: &rusqlite::Transaction) -> rusqlite::Result<()> {
    let highest: Option<i64> = tx
        .prepare_cached("SELECT MAX(fence) FROM temp.doomed")?
        .query_row([], |r| r.get(0))?;
    match highest {
        Some(f) if f > 0 => raise_fence(tx, f as u64),
        _ => Ok(()),
    }
}

/// The highest fence any run row carries (0: none).
pub(super) fn fence_on_rows(c: &Connection) -> Result<u64, StoreError> {
    let highest: Option<i64> = c
        .query_row("SELECT MAX(fence) FROM runs", [], |r| r.get(0))
        .map_err(corrupt)?;
    Ok(highest.map_or(0, |f| f.max(0) as u64))
}

/// The API tokens: (hash, grant as text).
pub(super) fn load_tokens(c: &Connection) -> Result<Vec<(String, String)>, StoreError> {
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
