//! The SQLite fleet store: the same rules as [`super::PgFleet`] in one file that the
//! daemons of one machine can share (`BEGIN IMMEDIATE` serialises them). It has no
//! LISTEN/NOTIFY, so its waiters rely on the periodic re-check alone.

use std::time::Duration;

use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};

use super::{
    check_claim, check_load, fence_floor, Claim, ClaimOutcome, Ending, FleetError, FleetFence,
    FleetStore, HostInfo, HostRow, ThreadOwner, TokenRow, HOSTS_MAX,
};
use super::{
    check_control, check_drain, check_evidence, check_token, check_token_id, control_of,
    decide_read, too_many_tokens, too_much_evidence, word, ControlOutcome, FleetDrain,
    FleetEvidence, FleetReceipt, FleetToken, ScopeControlRequest, Shared, FLEET_EVIDENCE_MAX,
    FLEET_RECEIPTS_MAX, FLEET_TOKENS_MAX,
};

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS fence_seq (id INTEGER PRIMARY KEY CHECK (id = 1), last INTEGER NOT NULL);
INSERT OR IGNORE INTO fence_seq VALUES (1, 0);
CREATE TABLE IF NOT EXISTS hosts (host_id TEXT PRIMARY KEY, gen INTEGER NOT NULL,
  address TEXT NOT NULL, version TEXT NOT NULL, load TEXT NOT NULL DEFAULT '{}',
  beat_at INTEGER NOT NULL, alive INTEGER NOT NULL, declared_by TEXT);
CREATE TABLE IF NOT EXISTS dead (host_id TEXT NOT NULL, gen INTEGER NOT NULL,
  declared_by TEXT NOT NULL, declared_at INTEGER NOT NULL, PRIMARY KEY (host_id, gen));
CREATE TABLE IF NOT EXISTS runs (run_id TEXT PRIMARY KEY, host_id TEXT NOT NULL,
  gen INTEGER NOT NULL, fence INTEGER NOT NULL UNIQUE);
CREATE TABLE IF NOT EXISTS harness (scope TEXT NOT NULL, harness TEXT NOT NULL,
  lim INTEGER NOT NULL, held INTEGER NOT NULL, PRIMARY KEY (scope, harness),
  CHECK (held >= 0 AND held <= lim));
CREATE TABLE IF NOT EXISTS tokens (scope TEXT NOT NULL, owner TEXT NOT NULL,
  harness TEXT NOT NULL, host_id TEXT NOT NULL, gen INTEGER NOT NULL,
  lapsed INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (scope, owner));
CREATE TABLE IF NOT EXISTS keys (key TEXT PRIMARY KEY, run_id TEXT NOT NULL,
  host_id TEXT NOT NULL, gen INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS threads (thread_key TEXT PRIMARY KEY, owner_gen TEXT NOT NULL,
  owner_fence INTEGER NOT NULL, run_id TEXT NOT NULL, host_id TEXT NOT NULL,
  live INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS bearer (hash TEXT PRIMARY KEY, grant_text TEXT NOT NULL,
  host_id TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS shared (id INTEGER PRIMARY KEY CHECK (id = 1),
  version INTEGER NOT NULL, drain_by TEXT, drain_at TEXT, drain_reason TEXT,
  drain_host TEXT);
INSERT OR IGNORE INTO shared (id, version) VALUES (1, 0);
CREATE TABLE IF NOT EXISTS scope_control (scope TEXT PRIMARY KEY, control TEXT NOT NULL,
  generation INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS scope_receipt (scope TEXT NOT NULL, request_id TEXT NOT NULL,
  mode TEXT NOT NULL, generation INTEGER NOT NULL, control TEXT NOT NULL,
  host_id TEXT NOT NULL, PRIMARY KEY (scope, request_id));
CREATE TABLE IF NOT EXISTS evidence (project TEXT PRIMARY KEY, fingerprint TEXT NOT NULL,
  git_commit TEXT, ports TEXT NOT NULL, run_id TEXT NOT NULL, host_id TEXT NOT NULL,
  valid INTEGER NOT NULL);
";
/// The schema version this build writes (`user_version`). Version 2 added the fleet's
/// bearer tokens and drain (issue 38 Build 3): a berth that knows only version 1
/// would not honour them, so it refuses the file.
const VERSION: i64 = 2;
/// The store's clock, in milliseconds (one clock for every host sharing the file).
const NOW: &str = "CAST(unixepoch('subsec') * 1000 AS INTEGER)";

pub struct SqliteFleet {
    conn: Connection,
}

fn err(e: rusqlite::Error) -> FleetError {
    FleetError::Unavailable(e.to_string())
}

type Tx<'a> = rusqlite::Transaction<'a>;

impl SqliteFleet {
    pub fn open(path: &str) -> Result<SqliteFleet, FleetError> {
        let conn = Connection::open(path).map_err(err)?;
        conn.busy_timeout(Duration::from_secs(5)).map_err(err)?;
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(err)?;
        conn.pragma_update(None, "synchronous", "FULL")
            .map_err(err)?;
        let found: i64 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .map_err(err)?;
        if found > VERSION {
            return Err(FleetError::TooNew {
                found,
                supported: VERSION,
            });
        }
        conn.execute_batch(SCHEMA).map_err(err)?;
        conn.pragma_update(None, "user_version", VERSION)
            .map_err(err)?;
        Ok(SqliteFleet { conn })
    }

    fn tx<T>(&mut self, f: impl FnOnce(&Tx) -> rusqlite::Result<T>) -> Result<T, FleetError> {
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(err)?;
        let v = f(&tx).map_err(err)?;
        tx.commit().map_err(err)?;
        Ok(v)
    }
}

/// The claim's writes; `Err(word, detail)` refuses it (the caller rolls back).
fn take(tx: &Tx, c: &Claim, keys: &[String]) -> rusqlite::Result<Result<u64, (String, String)>> {
    let fence: i64 = tx.query_row(
        "UPDATE fence_seq SET last = last + 1 RETURNING last",
        [],
        |r| r.get(0),
    )?;
    tx.execute(
        "INSERT INTO runs VALUES (?1, ?2, ?3, ?4)",
        params![c.run_id, c.host_id, c.gen, fence],
    )?;
    if let Some(t) = &c.token {
        tx.execute(
            "INSERT OR IGNORE INTO harness VALUES (?1, ?2, ?3, 0)",
            params![t.scope, t.harness, t.limit],
        )?;
        let n = tx.execute(
            "UPDATE harness SET held = held + 1
              WHERE scope = ?1 AND harness = ?2 AND lim = ?3 AND held < lim",
            params![t.scope, t.harness, t.limit],
        )?;
        if n == 0 {
            let (lim, held): (i64, i64) = tx.query_row(
                "SELECT lim, held FROM harness WHERE scope = ?1 AND harness = ?2",
                params![t.scope, t.harness],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )?;
            return Ok(Err(if lim != i64::from(t.limit) {
                ("budget_conflict".into(), lim.to_string())
            } else {
                ("budget_full".into(), format!("{held}/{lim}"))
            }));
        }
        let n = tx.execute(
            "INSERT OR IGNORE INTO tokens VALUES (?1, ?2, ?3, ?4, ?5, 0)",
            params![t.scope, c.run_id, t.harness, c.host_id, c.gen],
        )?;
        if n == 0 {
            return Ok(Err(("token_lapsed".into(), t.scope.clone())));
        }
    }
    for k in keys {
        let n = tx.execute(
            "INSERT OR IGNORE INTO keys VALUES (?1, ?2, ?3, ?4)",
            params![k, c.run_id, c.host_id, c.gen],
        )?;
        if n == 0 {
            let (holder, host): (String, String) = tx.query_row(
                "SELECT run_id, host_id FROM keys WHERE key = ?1",
                [k],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )?;
            return Ok(Err(("key_held".into(), format!("{k}\t{holder}\t{host}"))));
        }
    }
    Ok(Ok(u64::try_from(fence).unwrap_or(0)))
}

impl FleetStore for SqliteFleet {
    fn raise_fence(&mut self, floor: u64) -> Result<(), FleetError> {
        let floor = fence_floor(floor)?;
        self.tx(|tx| {
            tx.execute("UPDATE fence_seq SET last = max(last, ?1)", [floor])
                .map(|_| ())
        })
    }

    fn register(&mut self, host: &HostInfo) -> Result<(i64, bool), FleetError> {
        self.tx(|tx| {
            let old: Option<(i64, bool)> = tx
                .query_row(
                    "SELECT gen, alive FROM hosts WHERE host_id = ?1",
                    [&host.host_id],
                    |r| Ok((r.get(0)?, r.get(1)?)),
                )
                .optional()?;
            let gen = old.map_or(1, |(g, _)| g + 1);
            tx.execute(
                &format!(
                    "INSERT INTO hosts VALUES (?1, ?2, ?3, ?4, '{{}}', {NOW}, 1, NULL)
                     ON CONFLICT (host_id) DO UPDATE SET gen = ?2, address = ?3,
                       version = ?4, beat_at = {NOW}, alive = 1, declared_by = NULL"
                ),
                params![host.host_id, gen, host.address, host.version],
            )?;
            match old {
                Some((g, true)) => {
                    for t in ["runs", "keys"] {
                        tx.execute(
                            &format!("UPDATE {t} SET gen = ?1 WHERE host_id = ?2 AND gen = ?3"),
                            params![gen, host.host_id, g],
                        )?;
                    }
                    tx.execute(
                        "UPDATE tokens SET gen = ?1 WHERE host_id = ?2 AND gen = ?3 AND NOT lapsed",
                        params![gen, host.host_id, g],
                    )?;
                }
                Some((_, false)) => {
                    tx.execute(
                        "DELETE FROM runs WHERE host_id = ?1 AND gen < ?2",
                        params![host.host_id, gen],
                    )?;
                }
                None => {}
            }
            Ok((gen, old.is_none_or(|(_, alive)| alive)))
        })
    }

    fn heartbeat(&mut self, host_id: &str, gen: i64, load: &str) -> Result<bool, FleetError> {
        check_load(load)?;
        self.tx(|tx| {
            let n = tx.execute(
                &format!(
                    "UPDATE hosts SET beat_at = {NOW}, load = ?3
                      WHERE host_id = ?1 AND gen = ?2 AND alive"
                ),
                params![host_id, gen, load],
            )?;
            Ok(n == 1)
        })
    }

    fn declare_dead(&mut self, me: &str, lapse_ms: i64) -> Result<Vec<(String, i64)>, FleetError> {
        self.tx(|tx| {
            let alive: Option<bool> = tx
                .query_row("SELECT alive FROM hosts WHERE host_id = ?1", [me], |r| {
                    r.get(0)
                })
                .optional()?;
            if alive != Some(true) {
                return Ok(Vec::new());
            }
            let dead: Vec<(String, i64)> = tx
                .prepare(&format!(
                    "UPDATE hosts SET alive = 0, declared_by = ?1
                      WHERE alive AND host_id <> ?1 AND beat_at < {NOW} - ?2
                      RETURNING host_id, gen"
                ))?
                .query_map(params![me, lapse_ms], |r| Ok((r.get(0)?, r.get(1)?)))?
                .collect::<Result<_, _>>()?;
            for (h, g) in &dead {
                tx.execute(
                    &format!("INSERT INTO dead VALUES (?1, ?2, ?3, {NOW})"),
                    params![h, g, me],
                )?;
                tx.execute("DELETE FROM keys WHERE host_id = ?1", [h])?;
                tx.execute(
                    "UPDATE tokens SET lapsed = 1 WHERE host_id = ?1 AND NOT lapsed",
                    [h],
                )?;
                tx.execute("UPDATE threads SET live = 0 WHERE host_id = ?1", [h])?;
            }
            Ok(dead)
        })
    }

    fn claim(&mut self, c: &Claim) -> Result<ClaimOutcome, FleetError> {
        let keys = check_claim(c)?;
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(err)?;
        let held: Option<(String, i64, i64)> = tx
            .query_row(
                "SELECT host_id, gen, fence FROM runs WHERE run_id = ?1",
                [&c.run_id],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .optional()
            .map_err(err)?;
        let mine = match &held {
            Some((h, g, f)) if *h == c.host_id && *g == c.gen => {
                Some(u64::try_from(*f).unwrap_or(0))
            }
            _ => None,
        };
        // The fleet drain, read in the claim's own write transaction (SQLite has one
        // writer at a time): a drain committed before it refuses every claim but one
        // this generation holds already (a retry whose answer was lost), before
        // anything else is asked, as PostgreSQL's `berth_batch` does.
        let draining: bool = tx
            .query_row("SELECT drain_by IS NOT NULL FROM shared", [], |r| r.get(0))
            .map_err(err)?;
        if draining {
            return Ok(match mine {
                Some(fence) => ClaimOutcome::Taken { fence },
                None => ClaimOutcome::Draining,
            });
        }
        let alive: bool = tx
            .query_row(
                "SELECT count(*) FROM hosts WHERE host_id = ?1 AND gen = ?2 AND alive",
                params![c.host_id, c.gen],
                |r| r.get(0),
            )
            .map_err(err)?;
        if !alive {
            return Ok(ClaimOutcome::HostDead);
        }
        if let Some((h, _, _)) = held {
            return Ok(match mine {
                Some(fence) => ClaimOutcome::Taken { fence },
                None => ClaimOutcome::RunIdTaken { host_id: h },
            });
        }
        match take(&tx, c, &keys).map_err(err)? {
            Ok(fence) => {
                tx.commit().map_err(err)?;
                Ok(ClaimOutcome::Taken { fence })
            }
            // Dropping the transaction rolls the claim's writes back.
            Err((word, detail)) => super::outcome(&word, 0, &detail),
        }
    }

    fn refence(
        &mut self,
        run_id: &str,
        host_id: &str,
        gen: i64,
    ) -> Result<ClaimOutcome, FleetError> {
        self.tx(|tx| {
            let alive: bool = tx.query_row(
                "SELECT count(*) FROM hosts WHERE host_id = ?1 AND gen = ?2 AND alive",
                params![host_id, gen],
                |r| r.get(0),
            )?;
            let held: bool = tx.query_row(
                "SELECT count(*) FROM runs WHERE run_id = ?1 AND host_id = ?2 AND gen = ?3",
                params![run_id, host_id, gen],
                |r| r.get(0),
            )?;
            if !(alive && held) {
                return Ok(ClaimOutcome::HostDead);
            }
            let fence: i64 = tx.query_row(
                "UPDATE fence_seq SET last = last + 1 RETURNING last",
                [],
                |r| r.get(0),
            )?;
            tx.execute(
                "UPDATE runs SET fence = ?1 WHERE run_id = ?2",
                params![fence, run_id],
            )?;
            Ok(ClaimOutcome::Taken {
                fence: u64::try_from(fence).unwrap_or(0),
            })
        })
    }

    fn end(
        &mut self,
        run_id: &str,
        host_id: &str,
        gen: i64,
        how: Ending,
    ) -> Result<bool, FleetError> {
        self.tx(|tx| {
            let n = tx.execute(
                "DELETE FROM runs WHERE run_id = ?1 AND host_id = ?2 AND gen = ?3",
                params![run_id, host_id, gen],
            )?;
            if n == 0 {
                return Ok(false);
            }
            tx.execute(
                "DELETE FROM keys WHERE run_id = ?1 AND host_id = ?2 AND gen = ?3",
                params![run_id, host_id, gen],
            )?;
            if how == Ending::Lapsed {
                tx.execute(
                    "UPDATE tokens SET lapsed = 1 WHERE owner = ?1 AND host_id = ?2 AND gen = ?3",
                    params![run_id, host_id, gen],
                )?;
            } else {
                let freed: Vec<(String, String)> = tx
                    .prepare(
                        "DELETE FROM tokens WHERE owner = ?1 AND host_id = ?2 AND gen = ?3
                           AND NOT lapsed RETURNING scope, harness",
                    )?
                    .query_map(params![run_id, host_id, gen], |r| {
                        Ok((r.get(0)?, r.get(1)?))
                    })?
                    .collect::<Result<_, _>>()?;
                for (s, h) in freed {
                    tx.execute(
                        "UPDATE harness SET held = held - 1 WHERE scope = ?1 AND harness = ?2",
                        params![s, h],
                    )?;
                }
            }
            Ok(true)
        })
    }

    fn thread_owner(
        &mut self,
        thread_key: &str,
        owner: &ThreadOwner,
        host_id: &str,
    ) -> Result<Option<ThreadOwner>, FleetError> {
        let fence = super::owner_fence(owner)?;
        self.tx(|tx| {
            let n = tx.execute(
                "INSERT INTO threads VALUES (?1, ?2, ?3, ?4, ?5, 1)
                 ON CONFLICT (thread_key) DO UPDATE SET owner_gen = excluded.owner_gen,
                   owner_fence = excluded.owner_fence, run_id = excluded.run_id,
                   host_id = excluded.host_id, live = 1
                 WHERE (threads.owner_fence < excluded.owner_fence
                    OR (threads.owner_fence = excluded.owner_fence
                        AND threads.owner_gen = excluded.owner_gen
                        AND threads.run_id = excluded.run_id))",
                params![thread_key, owner.gen, fence, owner.run_id, host_id],
            )?;
            if n == 1 {
                return Ok(None);
            }
            tx.query_row(
                "SELECT owner_gen, owner_fence, run_id FROM threads WHERE thread_key = ?1",
                [thread_key],
                |r| {
                    Ok(Some(ThreadOwner {
                        gen: r.get(0)?,
                        fence: u64::try_from(r.get::<_, i64>(1)?).unwrap_or(0),
                        run_id: r.get(2)?,
                    }))
                },
            )
        })
    }

    fn fence(&mut self, run_id: &str) -> Result<Option<FleetFence>, FleetError> {
        self.tx(|tx| {
            tx.query_row(
                "SELECT r.fence, r.host_id, r.gen, coalesce(h.alive AND h.gen = r.gen, 0)
                   FROM runs r LEFT JOIN hosts h ON h.host_id = r.host_id
                  WHERE r.run_id = ?1",
                [run_id],
                |r| {
                    Ok(FleetFence {
                        fence: u64::try_from(r.get::<_, i64>(0)?).unwrap_or(0),
                        host_id: r.get(1)?,
                        gen: r.get(2)?,
                        host_alive: r.get(3)?,
                    })
                },
            )
            .optional()
        })
    }

    fn hosts(&mut self) -> Result<Vec<HostRow>, FleetError> {
        self.tx(|tx| {
            tx.prepare(&format!(
                "SELECT host_id, gen, address, version, load, alive, {NOW} - beat_at, declared_by
                   FROM hosts ORDER BY alive DESC, host_id LIMIT ?1"
            ))?
            .query_map([HOSTS_MAX], |r| {
                Ok(HostRow {
                    host_id: r.get(0)?,
                    gen: r.get(1)?,
                    address: r.get(2)?,
                    version: r.get(3)?,
                    load: r.get(4)?,
                    alive: r.get(5)?,
                    beat_age_ms: r.get(6)?,
                    declared_by: r.get(7)?,
                })
            })?
            .collect()
        })
    }

    fn tokens(&mut self, scope: &str) -> Result<Vec<TokenRow>, FleetError> {
        self.tx(|tx| {
            tx.prepare(
                "SELECT scope, harness, owner, host_id, lapsed FROM tokens
                  WHERE scope = ?1 ORDER BY owner",
            )?
            .query_map([scope], |r| {
                Ok(TokenRow {
                    scope: r.get(0)?,
                    harness: r.get(1)?,
                    owner: r.get(2)?,
                    host_id: r.get(3)?,
                    lapsed: r.get(4)?,
                })
            })?
            .collect()
        })
    }

    fn reconcile(&mut self, scope: &str, owner: &str) -> Result<bool, FleetError> {
        self.tx(|tx| {
            let h: Option<String> = tx
                .query_row(
                    "DELETE FROM tokens WHERE scope = ?1 AND owner = ?2 AND lapsed RETURNING harness",
                    params![scope, owner],
                    |r| r.get(0),
                )
                .optional()?;
            let Some(h) = h else { return Ok(false) };
            tx.execute(
                "UPDATE harness SET held = held - 1 WHERE scope = ?1 AND harness = ?2",
                params![scope, h],
            )?;
            Ok(true)
        })
    }

    fn declarations(&mut self, host_id: &str) -> Result<Vec<(i64, String)>, FleetError> {
        self.tx(|tx| {
            tx.prepare("SELECT gen, declared_by FROM dead WHERE host_id = ?1 ORDER BY gen")?
                .query_map([host_id], |r| Ok((r.get(0)?, r.get(1)?)))?
                .collect()
        })
    }

    fn claims_of(&mut self, host_id: &str) -> Result<Vec<(String, i64)>, FleetError> {
        self.tx(|tx| {
            tx.prepare("SELECT run_id, gen FROM runs WHERE host_id = ?1 ORDER BY run_id LIMIT ?2")?
                .query_map(params![host_id, super::CLAIMS_OF_MAX], |r| {
                    Ok((r.get(0)?, r.get(1)?))
                })?
                .collect()
        })
    }

    fn put_token(&mut self, t: &FleetToken) -> Result<i64, FleetError> {
        check_token(t)?;
        let max = i64::try_from(FLEET_TOKENS_MAX).unwrap_or(i64::MAX);
        let (room, version) = self.tx(|tx| {
            let n: i64 = tx.query_row("SELECT count(*) FROM bearer", [], |r| r.get(0))?;
            let known: bool = tx.query_row(
                "SELECT EXISTS (SELECT 1 FROM bearer WHERE hash = ?1)",
                [&t.hash],
                |r| r.get(0),
            )?;
            if !known && n < max {
                tx.execute(
                    "INSERT INTO bearer VALUES (?1, ?2, ?3)",
                    params![t.hash, t.grant, t.host_id],
                )?;
                tx.execute("UPDATE shared SET version = version + 1", [])?;
            }
            Ok((known || n < max, read_shared(tx)?.0))
        })?;
        room.then_some(version).ok_or_else(too_many_tokens)
    }

    fn revoke_token(&mut self, id: &str) -> Result<(Vec<FleetToken>, i64), FleetError> {
        check_token_id(id)?;
        self.tx(|tx| {
            let gone: Vec<FleetToken> = tx
                .prepare(
                    "DELETE FROM bearer WHERE substr(hash, 1, 16) = ?1
                      RETURNING hash, grant_text, host_id",
                )?
                .query_map([id], |r| {
                    Ok(FleetToken {
                        hash: r.get(0)?,
                        grant: r.get(1)?,
                        host_id: r.get(2)?,
                    })
                })?
                .collect::<rusqlite::Result<_>>()?;
            if !gone.is_empty() {
                tx.execute("UPDATE shared SET version = version + 1", [])?;
            }
            Ok((gone, read_shared(tx)?.0))
        })
    }

    fn set_drain(
        &mut self,
        d: Option<&FleetDrain>,
    ) -> Result<(Option<FleetDrain>, i64), FleetError> {
        check_drain(d)?;
        self.tx(|tx| {
            match d {
                Some(d) => tx.execute(
                    "UPDATE shared SET version = version + 1, drain_by = ?1, drain_at = ?2,
                       drain_reason = ?3, drain_host = ?4 WHERE drain_by IS NULL",
                    params![d.by, d.at, d.reason, d.host_id],
                )?,
                None => tx.execute(
                    "UPDATE shared SET version = version + 1, drain_by = NULL, drain_at = NULL,
                       drain_reason = NULL, drain_host = NULL WHERE drain_by IS NOT NULL",
                    [],
                )?,
            };
            let (version, drain) = read_shared(tx)?;
            Ok((drain, version))
        })
    }

    fn shared(&mut self, since: i64) -> Result<Option<Shared>, FleetError> {
        let read = self.tx(|tx| {
            let (version, drain) = read_shared(tx)?;
            if version == since {
                return Ok(None);
            }
            let tokens = tx
                .prepare("SELECT hash, grant_text, host_id FROM bearer ORDER BY hash")?
                .query_map([], |r| {
                    Ok(FleetToken {
                        hash: r.get(0)?,
                        grant: r.get(1)?,
                        host_id: r.get(2)?,
                    })
                })?
                .collect::<rusqlite::Result<_>>()?;
            let evidence = tx
                .prepare(
                    "SELECT project, fingerprint, git_commit, ports, run_id, host_id, valid
                       FROM evidence ORDER BY project",
                )?
                .query_map([], evidence_row)?
                .collect::<rusqlite::Result<_>>()?;
            let shared = Shared {
                version,
                drain,
                tokens,
                controls: Vec::new(),
                evidence,
            };
            Ok(Some((shared, read_controls(tx)?)))
        })?;
        let Some((mut shared, rows)) = read else {
            return Ok(None);
        };
        for (scope, stored) in rows {
            shared.controls.push(control_of(scope, receipt_of(stored)?));
        }
        Ok(Some(shared))
    }

    fn control_scope(
        &mut self,
        r: &ScopeControlRequest,
        host_id: &str,
    ) -> Result<(ControlOutcome, i64), FleetError> {
        check_control(r)?;
        // One transaction (`BEGIN IMMEDIATE`): the read, the rules and the write, so two
        // daemons sharing the file decide one after the other.
        self.tx(|tx| {
            let now: Option<(String, i64)> = tx
                .query_row(
                    "SELECT control, generation FROM scope_control WHERE scope = ?1",
                    [&r.scope],
                    |x| Ok((x.get(0)?, x.get(1)?)),
                )
                .optional()?;
            let earlier: Option<StoredReceipt> = tx
                .query_row(
                    "SELECT request_id, mode, generation, control, host_id FROM scope_receipt
                      WHERE scope = ?1 AND request_id = ?2",
                    params![r.scope, r.request_id],
                    stored_receipt,
                )
                .optional()?;
            let n: i64 = tx.query_row("SELECT count(*) FROM scope_control", [], |x| x.get(0))?;
            let now = now.as_ref().map(|(c, g)| (c.as_str(), *g));
            let decided = decide_read(now, n, earlier.map(receipt_of), r, host_id);
            match decided {
                Err(e) => Ok(Err(e)),
                Ok(Err(answer)) => Ok(Ok((answer, read_shared(tx)?.0))),
                Ok(Ok(receipt)) => write_control(tx, &r.scope, receipt).map(Ok),
            }
        })?
    }

    fn put_evidence(&mut self, e: &FleetEvidence) -> Result<i64, FleetError> {
        check_evidence(e)?;
        let max = FLEET_EVIDENCE_MAX as i64;
        let ports = e.ports.join("\n");
        self.tx(|tx| {
            let now: Option<FleetEvidence> = tx
                .query_row(
                    "SELECT project, fingerprint, git_commit, ports, run_id, host_id, valid
                       FROM evidence WHERE project = ?1",
                    [&e.project],
                    evidence_row,
                )
                .optional()?;
            let n: i64 = tx.query_row("SELECT count(*) FROM evidence", [], |x| x.get(0))?;
            let valid = FleetEvidence {
                valid: true,
                ..e.clone()
            };
            match &now {
                Some(now) if *now == valid => return Ok(Ok(read_shared(tx)?.0)),
                None if n >= max => return Ok(Err(too_much_evidence())),
                _ => {}
            }
            tx.execute(
                "INSERT OR REPLACE INTO evidence VALUES (?1, ?2, ?3, ?4, ?5, ?6, 1)",
                params![
                    e.project,
                    e.fingerprint,
                    e.commit,
                    ports,
                    e.run_id,
                    e.host_id
                ],
            )?;
            tx.execute("UPDATE shared SET version = version + 1", [])?;
            Ok(Ok(read_shared(tx)?.0))
        })?
    }

    fn invalidate_evidence(
        &mut self,
        project: &str,
        fingerprint: &str,
        commit: Option<&str>,
    ) -> Result<i64, FleetError> {
        self.tx(|tx| {
            let n = tx.execute(
                "UPDATE evidence SET valid = 0 WHERE project = ?1 AND fingerprint = ?2
                   AND git_commit IS ?3 AND valid = 1",
                params![project, fingerprint, commit],
            )?;
            if n > 0 {
                tx.execute("UPDATE shared SET version = version + 1", [])?;
            }
            Ok(read_shared(tx)?.0)
        })
    }
}

fn evidence_row(x: &rusqlite::Row) -> rusqlite::Result<FleetEvidence> {
    let ports: String = x.get(3)?;
    Ok(FleetEvidence {
        project: x.get(0)?,
        fingerprint: x.get(1)?,
        commit: x.get(2)?,
        ports: ports.lines().map(str::to_owned).collect(),
        run_id: x.get(4)?,
        host_id: x.get(5)?,
        valid: x.get(6)?,
    })
}

/// A receipt's row: request id, mode, generation, control, host.
type StoredReceipt = (String, String, i64, String, String);

fn stored_receipt(x: &rusqlite::Row) -> rusqlite::Result<StoredReceipt> {
    Ok((x.get(0)?, x.get(1)?, x.get(2)?, x.get(3)?, x.get(4)?))
}

fn receipt_of(s: StoredReceipt) -> Result<FleetReceipt, FleetError> {
    Ok(FleetReceipt {
        request_id: s.0,
        mode: word(&s.1)?,
        generation: u64::try_from(s.2).unwrap_or(0),
        control: word(&s.3)?,
        host_id: s.4,
    })
}

/// Writes an accepted control's receipt and state (the receipts too old to keep go),
/// and raises the shared version.
fn write_control(tx: &Tx, scope: &str, r: FleetReceipt) -> rusqlite::Result<(ControlOutcome, i64)> {
    let g = i64::try_from(r.generation).unwrap_or(i64::MAX);
    let keep = FLEET_RECEIPTS_MAX as i64;
    tx.execute(
        "INSERT OR REPLACE INTO scope_control VALUES (?1, ?2, ?3)",
        params![scope, r.control.as_str(), g],
    )?;
    tx.execute(
        "INSERT INTO scope_receipt VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        params![
            scope,
            r.request_id,
            r.mode.as_str(),
            g,
            r.control.as_str(),
            r.host_id
        ],
    )?;
    tx.execute(
        "DELETE FROM scope_receipt WHERE scope = ?1 AND generation + ?2 <= ?3",
        params![scope, keep, g],
    )?;
    tx.execute("UPDATE shared SET version = version + 1", [])?;
    Ok((ControlOutcome::Accepted(r), read_shared(tx)?.0))
}

/// Every controlled scope with the receipt that made its state.
fn read_controls(tx: &Tx) -> rusqlite::Result<Vec<(String, StoredReceipt)>> {
    tx.prepare(
        "SELECT c.scope, r.request_id, r.mode, r.generation, r.control, r.host_id
           FROM scope_control c JOIN scope_receipt r
             ON r.scope = c.scope AND r.generation = c.generation
          ORDER BY c.scope",
    )?
    .query_map([], |x| {
        Ok((
            x.get(0)?,
            (x.get(1)?, x.get(2)?, x.get(3)?, x.get(4)?, x.get(5)?),
        ))
    })?
    .collect()
}

/// The shared row: its version and the drain in force.
fn read_shared(tx: &Tx) -> rusqlite::Result<(i64, Option<FleetDrain>)> {
    tx.query_row(
        "SELECT version, drain_by, drain_at, drain_reason, drain_host FROM shared",
        [],
        |r| {
            let by: Option<String> = r.get(1)?;
            let drain = match by {
                Some(by) => Some(FleetDrain {
                    by,
                    at: r.get(2)?,
                    reason: r.get(3)?,
                    host_id: r.get(4)?,
                }),
                None => None,
            };
            Ok((r.get(0)?, drain))
        },
    )
}
