//! The `processes` table: the processes registered to each run, with their identity.

use super::*;

pub(super) const ADD_PROCESS: &str =
    "INSERT OR IGNORE INTO processes (run_id, pid, start_ticks, boot_id)
     VALUES (?1, ?2, ?3, ?4)";

/// The loaded runs' registered processes.
pub(super) fn load_processes(
    c: &Connection,
    runs: &mut [RunRecord],
    ended_max: usize,
) -> Result<(), StoreError> {
    let index = run_index(runs);
    // Only the loaded runs' (by the primary key's prefix): the processes of runs
    // retention has not yet pruned are not read at all.
    let mut stmt = c
        .prepare(
            "SELECT run_id, pid, start_ticks, boot_id FROM processes WHERE run_id IN
               (SELECT run_id FROM runs WHERE terminal = 0
                UNION ALL
                SELECT run_id FROM (SELECT run_id FROM runs WHERE terminal = 1
                                    ORDER BY queue_seq DESC LIMIT ?1))
             ORDER BY run_id, pid, start_ticks",
        )
        .map_err(corrupt)?;
    let mut rows = stmt.query([ended_max as i64]).map_err(corrupt)?;
    while let Some(row) = rows.next().map_err(corrupt)? {
        let run_id: String = row.get(0).map_err(corrupt)?;
        let Some(&i) = index.get(&run_id) else {
            continue;
        };
        // A pid is 1..=i32::MAX: another number cut to 32 bits could name any process
        // (D4: refused, never a guess).
        let pid: i64 = row.get(1).map_err(corrupt)?;
        let pid = i32::try_from(pid)
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| StoreError::Corrupt(format!("run {run_id}: process id {pid}")))?;
        runs[i].processes.push(ProcessRecord {
            pid,
            start_ticks: u(row.get(2).map_err(corrupt)?)
                .map_err(|e| of(&format!("run {run_id}: process {pid}"), e))?,
            boot_id: row.get(3).map_err(corrupt)?,
        });
    }
    Ok(())
}
