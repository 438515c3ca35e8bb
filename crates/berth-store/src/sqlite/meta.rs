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
