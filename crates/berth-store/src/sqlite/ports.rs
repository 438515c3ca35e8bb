//! The `ports` table: each granted run's ports.

use super::*;

/// The ports of the live runs (the table holds no others).
pub(super) fn load_ports(
    conn: &rusqlite::Connection,
    runs: &mut [RunRecord],
) -> Result<(), StoreError> {
    let index = run_index(runs);
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

/// A live run's ports are written with it; an ended run's are deleted (W3), whatever
/// its record lists (one that lists none must not leave earlier rows behind).
pub(super) fn write_ports(tx: &rusqlite::Transaction, r: &RunRecord) -> Result<(), StoreError> {
    let id = &r.request.run_id;
    if r.state.is_terminal() {
        tx.prepare_cached("DELETE FROM ports WHERE run_id = ?1")
            .and_then(|mut s| s.execute(params![id]))
            .map_err(write_err)?;
        return Ok(());
    }
    if r.ports.is_empty() {
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
