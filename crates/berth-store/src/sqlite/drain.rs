//! The `drain` table: the host's drain (G4), one row.

use super::*;

/// G4: the drain row, replaced or removed.
pub(super) fn write_drain(
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

pub(super) fn load_drain(
    conn: &rusqlite::Connection,
) -> Result<Option<crate::DrainRecord>, StoreError> {
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
