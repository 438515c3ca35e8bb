//! The scope tables (B1–B5): scopes, receipts and budget tokens.

use super::*;

/// B1/B4: a scope's frozen policy and manifest, control state and generation.
pub(super) fn write_scope(
    tx: &rusqlite::Transaction,
    r: &crate::ScopeRecord,
) -> Result<(), StoreError> {
    let policy: Vec<String> = r.policy.iter().map(|(h, n)| format!("{h}={n}")).collect();
    let m = r.manifest.as_ref();
    tx.prepare_cached(
        // An upsert: the first entry, once known, is kept (later writes give 0).
        "INSERT INTO scopes (id, policy, manifest_path, manifest_sha256,
           manifest_ids, control, generation, owner_uid, journal_first)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)
         ON CONFLICT (id) DO UPDATE SET policy = excluded.policy,
           manifest_path = excluded.manifest_path, manifest_sha256 = excluded.manifest_sha256,
           manifest_ids = excluded.manifest_ids, control = excluded.control,
           generation = excluded.generation, owner_uid = excluded.owner_uid,
           journal_first = COALESCE(NULLIF(scopes.journal_first, 0), excluded.journal_first)",
    )
    .and_then(|mut st| {
        st.execute(params![
            r.id,
            policy.join(","),
            m.map(|m| m.path.as_str()),
            m.map(|m| m.sha256.as_str()),
            m.map(|m| m.execution_ids.join("\n")),
            r.control.as_str(),
            r.generation as i64,
            r.owner_uid.map(i64::from),
            r.journal_first.min(i64::MAX as u64) as i64,
        ])
    })
    .map_err(write_err)?;
    Ok(())
}

/// S10: a forgotten scope's rows, all of them.
pub(super) fn delete_scope(tx: &rusqlite::Transaction, id: &str) -> Result<(), StoreError> {
    for sql in [
        "DELETE FROM scope_tokens WHERE scope = ?1",
        "DELETE FROM scope_receipts WHERE scope = ?1",
        "DELETE FROM scopes WHERE id = ?1",
    ] {
        tx.prepare_cached(sql)
            .and_then(|mut st| st.execute(params![id]))
            .map_err(write_err)?;
    }
    Ok(())
}

/// B4: an accepted control request's receipt; only the newest `RECEIPTS_MAX` are kept.
pub(super) fn write_receipt(
    tx: &rusqlite::Transaction,
    scope: &str,
    r: &berth_core::scopes::Receipt,
) -> Result<(), StoreError> {
    tx.prepare_cached(
        "INSERT INTO scope_receipts (scope, request_id, mode, generation, control, at_ms)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
    )
    .and_then(|mut st| {
        st.execute(params![
            scope,
            r.request_id,
            r.mode.as_str(),
            r.generation as i64,
            r.control.as_str(),
            r.at_ms as i64,
        ])
    })
    .map_err(write_err)?;
    let keep_from = r
        .generation
        .saturating_sub(berth_core::scopes::RECEIPTS_MAX as u64);
    tx.prepare_cached("DELETE FROM scope_receipts WHERE scope = ?1 AND generation <= ?2")
        .and_then(|mut st| st.execute(params![scope, keep_from as i64]))
        .map_err(write_err)?;
    Ok(())
}

/// B2/B3: a token taken (or marked lapsed), or freed (`None`).
pub(super) fn write_budget_token(
    tx: &rusqlite::Transaction,
    scope: &str,
    owner: &str,
    operation: &str,
    token: Option<&berth_core::scopes::Token>,
) -> Result<(), StoreError> {
    let res = match token {
        Some(t) => tx
            .prepare_cached(
                "INSERT OR REPLACE INTO scope_tokens (scope, owner, operation, harness, run_id,
                   since_ms, owner_lapsed) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            )
            .and_then(|mut st| {
                st.execute(params![
                    scope,
                    owner,
                    operation,
                    t.harness,
                    t.run_id,
                    t.since_ms as i64,
                    t.owner_lapsed as i64,
                ])
            }),
        None => tx
            .prepare_cached(
                "DELETE FROM scope_tokens WHERE scope = ?1 AND owner = ?2 AND operation = ?3",
            )
            .and_then(|mut st| st.execute(params![scope, owner, operation])),
    };
    res.map_err(write_err)?;
    Ok(())
}

/// Every scope with its receipts (oldest first) and tokens. A row that breaks the
/// rules (a bad word, a policy that does not parse, a token of a harness outside the
/// policy, a harness over its limit) is a corrupt ledger (D4), never a guess.
pub(super) fn load_scopes(
    conn: &rusqlite::Connection,
) -> Result<Vec<berth_core::scopes::Scope>, StoreError> {
    use berth_core::scopes::Scopes;
    let mut out = load_scope_rows(conn)?;
    load_scope_receipts(conn, &mut out)?;
    load_scope_tokens(conn, &mut out)?;
    // The rules' own check: counts, limits, harnesses (D4: refuse, never guess).
    let mut all = Scopes::default();
    for s in out.values() {
        all.restore(s.clone());
    }
    all.check_invariants()
        .map_err(|e| StoreError::Corrupt(format!("scopes: {e}")))?;
    Ok(all.iter().cloned().collect())
}

pub(super) type ScopeMap = BTreeMap<String, berth_core::scopes::Scope>;

/// The scopes' own rows: policy, manifest, control, generation, owner.
pub(super) fn load_scope_rows(conn: &rusqlite::Connection) -> Result<ScopeMap, StoreError> {
    use berth_core::scopes::Scope;
    let mut out = ScopeMap::new();
    let mut st = conn
        .prepare(
            "SELECT id, policy, manifest_path, manifest_sha256, manifest_ids, control,
                    generation, owner_uid FROM scopes ORDER BY id",
        )
        .map_err(corrupt)?;
    let mut rows = st.query([]).map_err(corrupt)?;
    while let Some(row) = rows.next().map_err(corrupt)? {
        let id: String = row.get(0).map_err(corrupt)?;
        let bad = |why: String| StoreError::Corrupt(format!("scope {id}: {why}"));
        let mut policy = berth_core::scopes::Policy::new();
        for pair in row.get::<_, String>(1).map_err(corrupt)?.split(',') {
            let (h, n) = pair
                .split_once('=')
                .ok_or_else(|| bad(format!("policy entry {pair:?}")))?;
            let n = n.parse().map_err(|_| bad(format!("limit {n:?}")))?;
            policy.insert(h.to_string(), n);
        }
        berth_core::scopes::check_policy(&policy).map_err(|e| bad(e.to_string()))?;
        let manifest = read_manifest(row.get(2), row.get(3), row.get(4)).map_err(bad)?;
        let mut s = Scope::new(&id, policy, manifest);
        s.control = word(&row.get::<_, String>(5).map_err(corrupt)?)?;
        s.generation =
            u(row.get(6).map_err(corrupt)?).map_err(|e| of(&format!("scope {id}"), e))?;
        s.owner_uid = match row.get::<_, Option<i64>>(7).map_err(corrupt)? {
            None => None,
            Some(v) => Some(u32::try_from(v).map_err(|_| bad(format!("owner_uid {v}")))?),
        };
        out.insert(id, s);
    }
    Ok(out)
}

/// A frozen manifest from its three columns: all set, or none.
pub(super) fn read_manifest(
    path: rusqlite::Result<Option<String>>,
    sha: rusqlite::Result<Option<String>>,
    ids: rusqlite::Result<Option<String>>,
) -> Result<Option<berth_core::scopes::Manifest>, String> {
    let cols = (path, sha, ids);
    let (Ok(path), Ok(sha), Ok(ids)) = cols else {
        return Err("a manifest column of the wrong type".into());
    };
    match (path, sha, ids) {
        (Some(path), Some(sha256), Some(ids)) => Ok(Some(berth_core::scopes::Manifest {
            path,
            sha256,
            execution_ids: ids
                .split('\n')
                .filter(|x| !x.is_empty())
                .map(str::to_string)
                .collect(),
        })),
        (None, None, None) => Ok(None),
        _ => Err("a manifest in part".into()),
    }
}

/// Each scope's control receipts, oldest first.
pub(super) fn load_scope_receipts(
    conn: &rusqlite::Connection,
    out: &mut ScopeMap,
) -> Result<(), StoreError> {
    let mut st = conn
        .prepare(
            "SELECT scope, request_id, mode, generation, control, at_ms FROM scope_receipts
             ORDER BY scope, generation",
        )
        .map_err(corrupt)?;
    let mut rows = st.query([]).map_err(corrupt)?;
    while let Some(row) = rows.next().map_err(corrupt)? {
        let scope: String = row.get(0).map_err(corrupt)?;
        let n = |i: usize| -> Result<u64, StoreError> {
            u(row.get(i).map_err(corrupt)?).map_err(|e| of(&format!("scope {scope}: a receipt"), e))
        };
        let r = berth_core::scopes::Receipt {
            request_id: row.get(1).map_err(corrupt)?,
            mode: word(&row.get::<_, String>(2).map_err(corrupt)?)?,
            generation: n(3)?,
            control: word(&row.get::<_, String>(4).map_err(corrupt)?)?,
            at_ms: n(5)?,
        };
        out.get_mut(&scope)
            .ok_or_else(|| StoreError::Corrupt(format!("a receipt of unknown scope {scope}")))?
            .receipts
            .push(r);
    }
    Ok(())
}

/// Each scope's tokens, by (owner, operation).
pub(super) fn load_scope_tokens(
    conn: &rusqlite::Connection,
    out: &mut ScopeMap,
) -> Result<(), StoreError> {
    let mut st = conn
        .prepare(
            "SELECT scope, owner, operation, harness, run_id, since_ms, owner_lapsed
             FROM scope_tokens",
        )
        .map_err(corrupt)?;
    let mut rows = st.query([]).map_err(corrupt)?;
    while let Some(row) = rows.next().map_err(corrupt)? {
        let scope: String = row.get(0).map_err(corrupt)?;
        let key = (row.get(1).map_err(corrupt)?, row.get(2).map_err(corrupt)?);
        let t = berth_core::scopes::Token {
            harness: row.get(3).map_err(corrupt)?,
            run_id: row.get(4).map_err(corrupt)?,
            since_ms: u(row.get(5).map_err(corrupt)?)
                .map_err(|e| of(&format!("scope {scope}: a token"), e))?,
            owner_lapsed: row.get::<_, i64>(6).map_err(corrupt)? != 0,
        };
        out.get_mut(&scope)
            .ok_or_else(|| StoreError::Corrupt(format!("a token of unknown scope {scope}")))?
            .tokens
            .insert(key, t);
    }
    Ok(())
}
