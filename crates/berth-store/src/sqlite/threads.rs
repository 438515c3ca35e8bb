//! The `threads` table: thread registrations and their evictions.

use super::*;

/// G0-G2: a thread's record, replaced whole.
pub(super) fn write_thread(
    tx: &rusqlite::Transaction,
    r: &crate::ThreadRecord,
) -> Result<(), StoreError> {
    let t = &r.thread;
    let o = t.owner.as_ref();
    let reg = t.registration.as_ref();
    if reg.is_some_and(|g| Some(&g.owner) != o) {
        return Err(StoreError::Write(format!(
            "thread {}: a registration not by its owner",
            t.key
        )));
    }
    let evictions: Vec<String> = t
        .evictions
        .iter()
        .map(|e| format!("{}@{}", e.reason.as_str(), e.at_ms))
        .collect();
    let ws = r.workspace.as_ref();
    tx.prepare_cached(
        "INSERT OR REPLACE INTO threads (key, owner_gen, owner_fence, owner_run,
           reg_attached_ms, reg_deadline_ms, has_workspace, ws_path, ws_dev, ws_ino,
           created_ms, active_ms, evictions, owner_uid)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)",
    )
    .and_then(|mut s| {
        s.execute(params![
            t.key,
            o.map(|o| o.gen.as_str()),
            o.map(|o| o.fence as i64),
            o.map(|o| o.run_id.as_str()),
            reg.map(|g| g.attached_ms as i64),
            reg.map(|g| g.deadline_ms as i64),
            t.has_workspace,
            ws.map(|w| w.path.as_str()),
            ws.map(|w| w.dev as i64),
            ws.map(|w| w.ino as i64),
            t.created_ms as i64,
            t.active_ms as i64,
            evictions.join(","),
            r.owner_uid.map(i64::from)
        ])
    })
    .map_err(write_err)?;
    Ok(())
}

pub(super) fn load_threads(
    conn: &rusqlite::Connection,
) -> Result<Vec<crate::ThreadRecord>, StoreError> {
    use berth_core::threads::{Owner, Thread};
    let mut stmt = conn
        .prepare(
            "SELECT key, owner_gen, owner_fence, owner_run, reg_attached_ms, reg_deadline_ms,
               has_workspace, ws_path, ws_dev, ws_ino, created_ms, active_ms, evictions,
               owner_uid
             FROM threads ORDER BY key",
        )
        .map_err(corrupt)?;
    let mut rows = stmt.query([]).map_err(corrupt)?;
    let mut out = Vec::new();
    while let Some(row) = rows.next().map_err(corrupt)? {
        let key: String = row.get(0).map_err(corrupt)?;
        let bad = |why: &str| StoreError::Corrupt(format!("thread {key}: {why}"));
        // Fences, times and workspace ids are never negative (D4: refused, not clamped).
        let ms = |v: Option<i64>| {
            v.map(u)
                .transpose()
                .map_err(|e| of(&format!("thread {key}"), e))
        };
        let gen: Option<String> = row.get(1).map_err(corrupt)?;
        let fence = ms(row.get(2).map_err(corrupt)?)?;
        let run: Option<String> = row.get(3).map_err(corrupt)?;
        let owner = match (gen, fence, run) {
            (Some(gen), Some(fence), Some(run_id)) => Some(Owner { gen, fence, run_id }),
            (None, None, None) => None,
            _ => return Err(bad("a partial owner")),
        };
        let (attached, deadline) = (
            ms(row.get(4).map_err(corrupt)?)?,
            ms(row.get(5).map_err(corrupt)?)?,
        );
        let registration = read_registration(&owner, attached, deadline).map_err(bad)?;
        let path: Option<String> = row.get(7).map_err(corrupt)?;
        let workspace = match path {
            Some(path) => Some(WorkspaceIdentity {
                path,
                dev: ms(row.get(8).map_err(corrupt)?)?.ok_or_else(|| bad("no device"))?,
                ino: ms(row.get(9).map_err(corrupt)?)?.ok_or_else(|| bad("no inode"))?,
            }),
            None => None,
        };
        let owner_uid = match row.get::<_, Option<i64>>(13).map_err(corrupt)? {
            Some(v) => Some(u32::try_from(v).map_err(|_| bad("an owner uid that is not a uid"))?),
            None => None,
        };
        let evictions = read_evictions(&row.get::<_, String>(12).map_err(corrupt)?).map_err(bad)?;
        let thread = Thread {
            owner,
            registration,
            has_workspace: row.get(6).map_err(corrupt)?,
            created_ms: ms(row.get(10).map_err(corrupt)?)?
                .ok_or_else(|| bad("no creation time"))?,
            active_ms: ms(row.get(11).map_err(corrupt)?)?.ok_or_else(|| bad("no activity time"))?,
            evictions,
            key,
        };
        out.push(crate::ThreadRecord {
            thread,
            workspace,
            owner_uid,
        });
    }
    Ok(out)
}

/// A thread's registration: both times (with an owner), or neither.
pub(super) fn read_registration(
    owner: &Option<berth_core::threads::Owner>,
    attached: Option<u64>,
    deadline: Option<u64>,
) -> Result<Option<berth_core::threads::Registration>, &'static str> {
    match (attached, deadline) {
        (Some(attached_ms), Some(deadline_ms)) => Ok(Some(berth_core::threads::Registration {
            owner: owner.clone().ok_or("a registration without an owner")?,
            attached_ms,
            deadline_ms,
        })),
        (None, None) => Ok(None),
        _ => Err("a partial registration"),
    }
}

/// A thread's evictions, `reason@ms` comma-separated.
pub(super) fn read_evictions(
    text: &str,
) -> Result<Vec<berth_core::threads::Eviction>, &'static str> {
    use berth_core::threads::{EvictReason, Eviction};
    let mut evictions = Vec::new();
    for e in text.split(',').filter(|e| !e.is_empty()) {
        let (reason, at) = e.split_once('@').ok_or("an eviction without a time")?;
        evictions.push(Eviction {
            reason: EvictReason::parse(reason).ok_or("an unknown eviction reason")?,
            at_ms: at
                .parse()
                .map_err(|_| "an eviction time that is not a number")?,
        });
    }
    Ok(evictions)
}
