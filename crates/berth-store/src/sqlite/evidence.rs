//! The `evidence` table: promotion evidence per project (C1–C5).

use super::*;

/// C3/C4: a project's evidence replaced, or deleted when invalidated.
pub(super) fn write_evidence(
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

pub(super) fn load_evidence(
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
