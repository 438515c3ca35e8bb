//! The PostgreSQL fleet store. Each decision is one statement: a claim, an ending and a
//! dead-host declaration are PL/pgSQL functions the migration installs, so each costs
//! one round trip and runs as one transaction on the server (a refusal inside a claim
//! rolls its sub-block back: nothing of a refused claim is written).

use std::time::Duration;

use postgres::fallible_iterator::FallibleIterator;
use postgres::{Client, Statement};

use super::tls::Tls;

use super::{
    check_claim, check_load, fence_floor, BatchOutcome, Claim, ClaimOutcome, Ending, FleetError,
    FleetFence, FleetOp, FleetStore, HostInfo, HostRow, OpOutcome, ThreadOwner, TokenRow,
    HOSTS_MAX,
};
use super::{
    check_control, check_drain, check_evidence, check_token, check_token_id, control_of,
    decide_read, too_many_tokens, too_much_evidence, word, ControlOutcome, FleetDrain,
    FleetEvidence, FleetReceipt, FleetToken, ScopeControlRequest, Shared, FLEET_EVIDENCE_MAX,
    FLEET_RECEIPTS_MAX, FLEET_TOKENS_MAX, SHARED_PAYLOAD,
};

/// Migrations by version, applied in order under an advisory lock so that several
/// daemons starting at once migrate exactly once (the version is the count applied).
const MIGRATIONS: &[&str] = &[
    include_str!("pg_v1.sql"),
    include_str!("pg_v2.sql"),
    include_str!("pg_v3.sql"),
    include_str!("pg_v4.sql"),
    include_str!("pg_v5.sql"),
];
/// The advisory lock id of the migration ("berth" in ASCII, as a number).
const MIGRATION_LOCK: i64 = 0x0062_6572_7468;
/// The fleet drain's advisory lock: `berth_batch` takes it shared before it reads the
/// drain, a drain's start or end exclusively (the number is written in pg_v5.sql too).
const DRAIN_LOCK: i64 = 1_650_815_605;

/// A statement that waits longer than this is cancelled by the server, so a lock held
/// by a hung peer cannot freeze this host's fleet thread.
const STATEMENT_TIMEOUT_MS: u64 = 5_000;
/// How long a connection attempt may take before the store is called unavailable.
const CONNECT_TIMEOUT_MS: u64 = 3_000;
/// Unacknowledged data older than this aborts the connection (a host cut off from the
/// database notices within this, not after the kernel's ~15 minutes of retries).
const TCP_USER_TIMEOUT_MS: u64 = 5_000;

pub struct PgFleet {
    config: postgres::Config,
    tls: Tls,
    client: Option<Conn>,
    /// The schema was checked (and migrated) on a connection of this store.
    migrated: bool,
    /// Reconnect pacing after a failed attempt (issue 38 Build 5).
    backoff: super::backoff::Backoff,
}

/// A connection and the statements prepared on it. A statement sent as text is
/// prepared and then run, two round trips and a parse and plan on the server each
/// time; the hot ones (a batch of claims) are prepared once per connection.
struct Conn {
    client: Client,
    prepared: Vec<(&'static str, Statement)>,
}

impl Conn {
    fn prepared(&mut self, sql: &'static str) -> Result<Statement, postgres::Error> {
        if let Some((_, st)) = self.prepared.iter().find(|(s, _)| *s == sql) {
            return Ok(st.clone());
        }
        let st = self.client.prepare(sql)?;
        self.prepared.push((sql, st.clone()));
        Ok(st)
    }
}

/// The error and what caused it (a TLS handshake's error says only that, its cause
/// which certificate check failed).
fn unavailable(e: postgres::Error) -> FleetError {
    let mut text = e.to_string();
    let mut cause = std::error::Error::source(&e);
    while let Some(c) = cause {
        text.push_str(&format!(": {c}"));
        cause = c.source();
    }
    FleetError::Unavailable(text)
}

impl PgFleet {
    /// Connect (and migrate). `url` is a libpq-style URL or key=value string.
    pub fn open(url: &str) -> Result<PgFleet, FleetError> {
        let mut s = PgFleet::lazy(url)?;
        s.client()?;
        Ok(s)
    }

    /// Parse `url` only: the first call connects (and migrates). For a host that must
    /// start while the database is away, and for callers inside an async runtime (the
    /// blocking client runs its own).
    pub fn lazy(url: &str) -> Result<PgFleet, FleetError> {
        let (mut config, tls) = super::tls::parse(url)?;
        config
            .connect_timeout(Duration::from_millis(CONNECT_TIMEOUT_MS))
            .tcp_user_timeout(Duration::from_millis(TCP_USER_TIMEOUT_MS))
            .keepalives_idle(Duration::from_secs(5))
            .options(&format!("-c statement_timeout={STATEMENT_TIMEOUT_MS}"))
            .application_name("berth");
        Ok(PgFleet {
            config,
            tls,
            client: None,
            migrated: false,
            backoff: Default::default(),
        })
    }

    /// A second connection on the same database, for LISTEN (F3).
    pub fn listener(&self) -> PgListener {
        PgListener {
            config: self.config.clone(),
            tls: self.tls.clone(),
            client: None,
        }
    }

    /// The connection, made again if the last one broke; the first one checks (and
    /// migrates) the schema.
    fn client(&mut self) -> Result<&mut Conn, FleetError> {
        if self.client.as_ref().is_none_or(|c| c.client.is_closed()) {
            self.client = None;
            let now = std::time::Instant::now();
            self.backoff.check(now)?;
            let mut c = match self.tls.connect(&self.config).map_err(unavailable) {
                Ok(c) => c,
                Err(e) => {
                    self.backoff.failed(now, &e.to_string());
                    return Err(e);
                }
            };
            self.backoff.ok();
            if !self.migrated {
                migrate(&mut c)?;
                self.migrated = true;
            }
            let mut conn = Conn {
                client: c,
                prepared: Vec::new(),
            };
            // Prepared with the connection: a batch is then one round trip from the
            // first (and a connection that answers its handshake answers a batch).
            conn.prepared(BATCH_SQL).map_err(unavailable)?;
            self.client = Some(conn);
        }
        Ok(self.client.as_mut().expect("connected above"))
    }

    /// Run `f` on the connection; an error drops the connection so the next call
    /// reconnects (a broken socket must not be reused). A connection found broken
    /// (an error that is not the server's answer: a peer that went away while this one
    /// sat idle) is made again and `f` tried once more: every statement here is
    /// idempotent or harmless twice (a claim retried by its generation gets its fence).
    fn with<T>(
        &mut self,
        mut f: impl FnMut(&mut Client) -> Result<T, postgres::Error>,
    ) -> Result<T, FleetError> {
        self.with_conn(|c| f(&mut c.client))
    }

    /// `with`, on the connection and its prepared statements.
    fn with_conn<T>(
        &mut self,
        mut f: impl FnMut(&mut Conn) -> Result<T, postgres::Error>,
    ) -> Result<T, FleetError> {
        let mut r = f(self.client()?);
        if r.as_ref().is_err_and(|e| e.as_db_error().is_none()) {
            self.client = None;
            r = f(self.client()?);
        }
        if r.is_err() {
            self.client = None;
        }
        r.map_err(unavailable)
    }
}

/// Applies the migrations this build knows, exactly once fleet-wide; refuses a schema
/// newer than this build.
fn migrate(c: &mut Client) -> Result<(), FleetError> {
    let supported = MIGRATIONS.len() as i64;
    let found = (|| {
        let mut tx = c.transaction()?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])?;
        tx.batch_execute(
            "CREATE TABLE IF NOT EXISTS berth_fleet_schema (version integer NOT NULL);
             INSERT INTO berth_fleet_schema SELECT 0
               WHERE NOT EXISTS (SELECT 1 FROM berth_fleet_schema);",
        )?;
        let found: i32 = tx
            .query_one("SELECT version FROM berth_fleet_schema", &[])?
            .get(0);
        let found = i64::from(found);
        if found < supported {
            for m in &MIGRATIONS[found as usize..] {
                tx.batch_execute(m)?;
            }
            tx.execute(
                "UPDATE berth_fleet_schema SET version = $1",
                &[&(supported as i32)],
            )?;
        }
        tx.commit()?;
        Ok::<_, postgres::Error>(found)
    })()
    .map_err(unavailable)?;
    if found > supported {
        return Err(FleetError::TooNew { found, supported });
    }
    Ok(())
}

/// The shared version alone (`shared` when nothing changed).
const VERSION_SQL: &str = "SELECT version FROM berth_shared WHERE id = 1";

/// The one statement a batch is (`berth_batch`, schema version 3; plain claims answered
/// in it since version 5).
const BATCH_SQL: &str =
    "SELECT j, outcome, fence, detail FROM berth_batch($1, $2, $3, $4, $5, $6, $7, $8, $9)";

/// A batch's ops as `berth_batch` takes them: one array per field, and every claim's
/// keys one after another in `keys` (`nkeys` of each).
struct BatchArgs<'a> {
    host: &'a str,
    kind: Vec<&'static str>,
    run: Vec<&'a str>,
    gen: Vec<i64>,
    scope: Vec<Option<&'a str>>,
    harness: Vec<Option<&'a str>>,
    limit: Vec<i32>,
    nkeys: Vec<i32>,
    keys: Vec<String>,
}

impl<'a> BatchArgs<'a> {
    fn new(host: &'a str) -> BatchArgs<'a> {
        BatchArgs {
            host,
            kind: Vec::new(),
            run: Vec::new(),
            gen: Vec::new(),
            scope: Vec::new(),
            harness: Vec::new(),
            limit: Vec::new(),
            nkeys: Vec::new(),
            keys: Vec::new(),
        }
    }

    /// Adds `op`, or refuses it by the input rules every store checks.
    fn push(&mut self, op: &'a FleetOp) -> Result<(), FleetError> {
        let (kind, mut nkeys) = match op {
            FleetOp::Claim(_) => ("claim", 0),
            FleetOp::Refence { .. } => ("refence", 0),
            FleetOp::End { how, .. } => match how {
                Ending::Released => ("end", 0),
                Ending::Lapsed => ("lapse", 0),
            },
        };
        let (mut scope, mut harness, mut limit) = (None, None, 0);
        if let FleetOp::Claim(c) = op {
            let keys = check_claim(c)?;
            super::check_claim_host(c, self.host)?;
            nkeys = keys.len() as i32;
            self.keys.extend(keys);
            if let Some(t) = &c.token {
                (scope, harness, limit) = (
                    Some(t.scope.as_str()),
                    Some(t.harness.as_str()),
                    t.limit as i32,
                );
            }
        }
        self.kind.push(kind);
        self.run.push(op.run_id());
        self.gen.push(op.gen());
        self.scope.push(scope);
        self.harness.push(harness);
        self.limit.push(limit);
        self.nkeys.push(nkeys);
        Ok(())
    }
}

fn to_fence(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

impl FleetStore for PgFleet {
    fn raise_fence(&mut self, floor: u64) -> Result<(), FleetError> {
        let floor = fence_floor(floor)?;
        self.with(|c| {
            // Read without a lock first: the sequence only moves up, so once it is at
            // the floor it stays there (the case of every restart of a fleet host).
            let row = c.query_one("SELECT last_value, is_called FROM berth_fence", &[])?;
            let (last, called): (i64, bool) = (row.get(0), row.get(1));
            if last > floor || (last == floor && called) {
                return Ok(());
            }
            // `setval` alone could move the sequence back below a fence another host
            // drew between the read and the set. ALTER SEQUENCE takes a lock that
            // `nextval` waits for (PostgreSQL 10 and later), held to the commit: under
            // it nothing is drawn between this read and the set.
            let mut tx = c.transaction()?;
            tx.batch_execute("ALTER SEQUENCE berth_fence INCREMENT BY 1")?;
            let last: i64 = tx.query_one("SELECT nextval('berth_fence')", &[])?.get(0);
            if last < floor {
                tx.execute("SELECT setval('berth_fence', $1)", &[&floor])?;
            }
            tx.commit()
        })
    }

    fn register(&mut self, host: &HostInfo) -> Result<(i64, bool), FleetError> {
        let h = host;
        self.with(|c| {
            let row = c.query_one(
                "SELECT new_gen, resumed FROM berth_register($1, $2, $3)",
                &[&h.host_id, &h.address, &h.version],
            )?;
            Ok((row.get(0), row.get(1)))
        })
    }

    fn heartbeat(&mut self, host_id: &str, gen: i64, load: &str) -> Result<bool, FleetError> {
        check_load(load)?;
        self.with(|c| {
            let n = c.execute(
                "UPDATE berth_hosts SET beat_at = clock_timestamp(), load = $3
                  WHERE host_id = $1 AND gen = $2 AND alive",
                &[&host_id, &gen, &load],
            )?;
            Ok(n == 1)
        })
    }

    fn declare_dead(&mut self, me: &str, lapse_ms: i64) -> Result<Vec<(String, i64)>, FleetError> {
        self.with(|c| {
            let rows = c.query(
                "SELECT dead_host, dead_gen FROM berth_declare_dead($1, $2)",
                &[&me, &lapse_ms],
            )?;
            Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
        })
    }

    // A claim, a re-fence and an ending alone are batches of one: the same statement,
    // prepared once, and the same lock order as every batch.
    fn claim(&mut self, cl: &Claim) -> Result<ClaimOutcome, FleetError> {
        let op = FleetOp::Claim(cl.clone());
        super::one_claim(self.batch(&cl.host_id, &[op]))
    }

    fn batch(&mut self, host_id: &str, ops: &[FleetOp]) -> Result<BatchOutcome, FleetError> {
        super::check_batch(ops)?;
        // Each op's answer; the input rules' refusals are answered here and not sent.
        let mut out: Vec<Option<Result<OpOutcome, FleetError>>> = Vec::with_capacity(ops.len());
        let mut args = BatchArgs::new(host_id);
        // Which op each sent row answers.
        let mut sent = Vec::with_capacity(ops.len());
        for (i, op) in ops.iter().enumerate() {
            match args.push(op) {
                Ok(()) => {
                    sent.push(i);
                    out.push(None);
                }
                Err(e) => out.push(Some(Err(e))),
            }
        }
        if sent.is_empty() {
            return Ok(out.into_iter().flatten().collect());
        }
        let a = &args;
        let rows = self.with_conn(|c| {
            let st = c.prepared(BATCH_SQL)?;
            c.client.query(
                &st,
                &[
                    &host_id, &a.kind, &a.run, &a.gen, &a.scope, &a.harness, &a.limit, &a.nkeys,
                    &a.keys,
                ],
            )
        })?;
        for row in rows {
            let (j, word, fence, detail): (i32, String, i64, String) =
                (row.get(0), row.get(1), row.get(2), row.get(3));
            let Some(&i) = usize::try_from(j - 1).ok().and_then(|j| sent.get(j)) else {
                return Err(FleetError::Unavailable(format!(
                    "the store answered a batch of {} with op {j}",
                    sent.len()
                )));
            };
            out[i] = Some(match word.as_str() {
                "ended" => Ok(OpOutcome::Ended(true)),
                "none" => Ok(OpOutcome::Ended(false)),
                _ => super::outcome(&word, to_fence(fence), &detail).map(OpOutcome::Claim),
            });
        }
        let answered = out.iter().filter(|o| o.is_some()).count();
        match answered == ops.len() {
            true => Ok(out.into_iter().flatten().collect()),
            false => Err(FleetError::Unavailable(format!(
                "the store answered {answered} of a batch's {} ops",
                ops.len()
            ))),
        }
    }

    fn refence(
        &mut self,
        run_id: &str,
        host_id: &str,
        gen: i64,
    ) -> Result<ClaimOutcome, FleetError> {
        let run_id = run_id.to_owned();
        super::one_claim(self.batch(host_id, &[FleetOp::Refence { run_id, gen }]))
    }

    fn end(
        &mut self,
        run_id: &str,
        host_id: &str,
        gen: i64,
        how: Ending,
    ) -> Result<bool, FleetError> {
        let run_id = run_id.to_owned();
        match super::one(self.batch(host_id, &[FleetOp::End { run_id, gen, how }]))? {
            OpOutcome::Ended(ended) => Ok(ended),
            other => Err(super::answered_wrong(&other)),
        }
    }

    fn thread_owner(
        &mut self,
        thread_key: &str,
        owner: &ThreadOwner,
        host_id: &str,
    ) -> Result<Option<ThreadOwner>, FleetError> {
        let fence = super::owner_fence(owner)?;
        self.with(|c| {
            let n = c.execute(
                "INSERT INTO berth_threads VALUES ($1, $2, $3, $4, $5, true)
                 ON CONFLICT (thread_key) DO UPDATE SET owner_gen = excluded.owner_gen,
                   owner_fence = excluded.owner_fence, run_id = excluded.run_id,
                   host_id = excluded.host_id, live = true
                 WHERE (berth_threads.owner_fence < excluded.owner_fence
                    OR (berth_threads.owner_fence = excluded.owner_fence
                        AND berth_threads.owner_gen = excluded.owner_gen
                        AND berth_threads.run_id = excluded.run_id))",
                &[&thread_key, &owner.gen, &fence, &owner.run_id, &host_id],
            )?;
            if n == 1 {
                return Ok(None);
            }
            let r = c.query_one(
                "SELECT owner_gen, owner_fence, run_id FROM berth_threads WHERE thread_key = $1",
                &[&thread_key],
            )?;
            Ok(Some(ThreadOwner {
                gen: r.get(0),
                fence: to_fence(r.get(1)),
                run_id: r.get(2),
            }))
        })
    }

    fn fence(&mut self, run_id: &str) -> Result<Option<FleetFence>, FleetError> {
        self.with(|c| {
            let row = c.query_opt(
                "SELECT r.fence, r.host_id, r.gen, coalesce(h.alive AND h.gen = r.gen, false)
                   FROM berth_runs r LEFT JOIN berth_hosts h ON h.host_id = r.host_id
                  WHERE r.run_id = $1",
                &[&run_id],
            )?;
            Ok(row.map(|r| FleetFence {
                fence: to_fence(r.get(0)),
                host_id: r.get(1),
                gen: r.get(2),
                host_alive: r.get(3),
            }))
        })
    }

    fn hosts(&mut self) -> Result<Vec<HostRow>, FleetError> {
        self.with(|c| {
            let rows = c.query(
                "SELECT host_id, gen, address, version, load, alive,
                        (extract(epoch FROM clock_timestamp() - beat_at) * 1000)::bigint,
                        declared_by
                   FROM berth_hosts ORDER BY alive DESC, host_id LIMIT $1",
                &[&HOSTS_MAX],
            )?;
            Ok(rows
                .iter()
                .map(|r| HostRow {
                    host_id: r.get(0),
                    gen: r.get(1),
                    address: r.get(2),
                    version: r.get(3),
                    load: r.get(4),
                    alive: r.get(5),
                    beat_age_ms: r.get(6),
                    declared_by: r.get(7),
                })
                .collect())
        })
    }

    fn tokens(&mut self, scope: &str) -> Result<Vec<TokenRow>, FleetError> {
        self.with(|c| {
            let rows = c.query(
                "SELECT scope, harness, owner, host_id, lapsed FROM berth_tokens
                  WHERE scope = $1 ORDER BY owner",
                &[&scope],
            )?;
            Ok(rows
                .iter()
                .map(|r| TokenRow {
                    scope: r.get(0),
                    harness: r.get(1),
                    owner: r.get(2),
                    host_id: r.get(3),
                    lapsed: r.get(4),
                })
                .collect())
        })
    }

    fn reconcile(&mut self, scope: &str, owner: &str) -> Result<bool, FleetError> {
        self.with(|c| {
            let row = c.query_one("SELECT berth_reconcile($1, $2)", &[&scope, &owner])?;
            Ok(row.get(0))
        })
    }

    fn declarations(&mut self, host_id: &str) -> Result<Vec<(i64, String)>, FleetError> {
        self.with(|c| {
            let rows = c.query(
                "SELECT gen, declared_by FROM berth_dead WHERE host_id = $1 ORDER BY gen",
                &[&host_id],
            )?;
            Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
        })
    }

    fn claims_of(&mut self, host_id: &str) -> Result<Vec<(String, i64)>, FleetError> {
        self.with(|c| {
            let rows = c.query(
                "SELECT run_id, gen FROM berth_runs WHERE host_id = $1
                  ORDER BY run_id COLLATE \"C\" LIMIT $2",
                &[&host_id, &super::CLAIMS_OF_MAX],
            )?;
            Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
        })
    }

    fn put_token(&mut self, t: &FleetToken) -> Result<i64, FleetError> {
        check_token(t)?;
        let max = i64::try_from(FLEET_TOKENS_MAX).unwrap_or(i64::MAX);
        let room = self.with(|c| {
            // The shared row's lock orders every change of the set (the count stays
            // within the bound however many hosts add at once).
            let mut tx = c.transaction()?;
            tx.execute("SELECT 1 FROM berth_shared WHERE id = 1 FOR UPDATE", &[])?;
            let row = tx.query_one(
                "SELECT EXISTS (SELECT 1 FROM berth_bearer WHERE hash = $1),
                        (SELECT count(*) FROM berth_bearer)",
                &[&t.hash],
            )?;
            let (known, n): (bool, i64) = (row.get(0), row.get(1));
            if !known && n < max {
                tx.execute(
                    "INSERT INTO berth_bearer (hash, grant_text, host_id) VALUES ($1, $2, $3)",
                    &[&t.hash, &t.grant, &t.host_id],
                )?;
                changed(&mut tx)?;
            }
            let (version, _) = read_shared(&mut tx)?;
            tx.commit()?;
            Ok((known || n < max, version))
        })?;
        room.0.then_some(room.1).ok_or_else(too_many_tokens)
    }

    fn revoke_token(&mut self, id: &str) -> Result<(Vec<FleetToken>, i64), FleetError> {
        check_token_id(id)?;
        self.with(|c| {
            let mut tx = c.transaction()?;
            tx.execute("SELECT 1 FROM berth_shared WHERE id = 1 FOR UPDATE", &[])?;
            let rows = tx.query(
                "DELETE FROM berth_bearer WHERE substr(hash, 1, 16) = $1
                  RETURNING hash, grant_text, host_id",
                &[&id],
            )?;
            let gone: Vec<FleetToken> = rows.iter().map(token_row).collect();
            if !gone.is_empty() {
                changed(&mut tx)?;
            }
            let (version, _) = read_shared(&mut tx)?;
            tx.commit()?;
            Ok((gone, version))
        })
    }

    fn set_drain(
        &mut self,
        d: Option<&FleetDrain>,
    ) -> Result<(Option<FleetDrain>, i64), FleetError> {
        check_drain(d)?;
        self.with(|c| {
            let mut tx = c.transaction()?;
            // Waits for the batches taking claims now, and holds new ones back until
            // this commits (`berth_batch`, schema v5): the drain is strict.
            tx.execute("SELECT pg_advisory_xact_lock($1)", &[&DRAIN_LOCK])?;
            let n = match d {
                Some(d) => tx.execute(
                    "UPDATE berth_shared SET version = version + 1, drain_by = $1,
                       drain_at = $2, drain_reason = $3, drain_host = $4
                     WHERE id = 1 AND drain_by IS NULL",
                    &[&d.by, &d.at, &d.reason, &d.host_id],
                )?,
                None => tx.execute(
                    "UPDATE berth_shared SET version = version + 1, drain_by = NULL,
                       drain_at = NULL, drain_reason = NULL, drain_host = NULL
                     WHERE id = 1 AND drain_by IS NOT NULL",
                    &[],
                )?,
            };
            if n > 0 {
                notify_shared(&mut tx)?;
            }
            let (version, drain) = read_shared(&mut tx)?;
            tx.commit()?;
            Ok((drain, version))
        })
    }

    fn shared(&mut self, since: i64) -> Result<Option<Shared>, FleetError> {
        // The heartbeat thread asks this every beat: when nothing changed (nearly
        // always) it costs one prepared statement, one round trip. The full read is a
        // transaction of five; added to every beat it made a beat through a slow link
        // late enough that the host counted itself away (the relay tests caught it).
        let version: i64 = self.with_conn(|c| {
            let st = c.prepared(VERSION_SQL)?;
            Ok(c.client.query_one(&st, &[])?.get(0))
        })?;
        if version == since {
            return Ok(None);
        }
        let read = self.with(|c| {
            // One snapshot for the version and the set it names.
            let mut tx = c
                .build_transaction()
                .isolation_level(postgres::IsolationLevel::RepeatableRead)
                .read_only(true)
                .start()?;
            let (version, drain) = read_shared(&mut tx)?;
            if version == since {
                tx.commit()?;
                return Ok(None);
            }
            let rows = tx.query(
                "SELECT hash, grant_text, host_id FROM berth_bearer ORDER BY hash COLLATE \"C\"",
                &[],
            )?;
            let tokens = rows.iter().map(token_row).collect();
            let controls = tx.query(
                "SELECT c.scope, r.request_id, r.mode, r.generation, r.control, r.host_id
                   FROM berth_scope_control c JOIN berth_scope_receipt r
                     ON r.scope = c.scope AND r.generation = c.generation
                  ORDER BY c.scope COLLATE \"C\"",
                &[],
            )?;
            let evidence = tx
                .query(
                    "SELECT project, fingerprint, git_commit, ports, run_id, host_id, valid
                       FROM berth_evidence ORDER BY project COLLATE \"C\"",
                    &[],
                )?
                .iter()
                .map(evidence_row)
                .collect();
            tx.commit()?;
            let shared = Shared {
                version,
                drain,
                tokens,
                controls: Vec::new(),
                evidence,
            };
            Ok(Some((shared, controls)))
        })?;
        let Some((mut shared, rows)) = read else {
            return Ok(None);
        };
        for r in &rows {
            shared
                .controls
                .push(control_of(r.get(0), receipt_row(r, 1)?));
        }
        Ok(Some(shared))
    }

    fn control_scope(
        &mut self,
        r: &ScopeControlRequest,
        host_id: &str,
    ) -> Result<(ControlOutcome, i64), FleetError> {
        check_control(r)?;
        self.with(|c| {
            // The shared row's lock orders every control request fleet-wide: the read,
            // the rules and the write are one decision.
            let mut tx = c.transaction()?;
            tx.execute("SELECT 1 FROM berth_shared WHERE id = 1 FOR UPDATE", &[])?;
            let now = tx.query_opt(
                "SELECT control, generation FROM berth_scope_control WHERE scope = $1",
                &[&r.scope],
            )?;
            let earlier = tx.query_opt(
                "SELECT request_id, mode, generation, control, host_id FROM berth_scope_receipt
                  WHERE scope = $1 AND request_id = $2",
                &[&r.scope, &r.request_id],
            )?;
            let n: i64 = tx
                .query_one("SELECT count(*) FROM berth_scope_control", &[])?
                .get(0);
            let now = now.as_ref().map(|row| (row.get(0), row.get(1)));
            let earlier = earlier.as_ref().map(|e| receipt_row(e, 0));
            let decided = decide_read(now, n, earlier, r, host_id);
            let answer = match decided {
                Err(e) => Err(e),
                Ok(Err(answer)) => Ok((answer, read_shared(&mut tx)?.0)),
                Ok(Ok(receipt)) => Ok(write_control(&mut tx, &r.scope, receipt)?),
            };
            tx.commit()?;
            Ok(answer)
        })?
    }

    fn put_evidence(&mut self, e: &FleetEvidence) -> Result<i64, FleetError> {
        check_evidence(e)?;
        let max = FLEET_EVIDENCE_MAX as i64;
        let ports = e.ports.join("\n");
        let valid = FleetEvidence {
            valid: true,
            ..e.clone()
        };
        self.with(|c| {
            let mut tx = c.transaction()?;
            tx.execute("SELECT 1 FROM berth_shared WHERE id = 1 FOR UPDATE", &[])?;
            let now = tx
                .query_opt(
                    "SELECT project, fingerprint, git_commit, ports, run_id, host_id, valid
                       FROM berth_evidence WHERE project = $1",
                    &[&e.project],
                )?
                .map(|r| evidence_row(&r));
            let n: i64 = tx
                .query_one("SELECT count(*) FROM berth_evidence", &[])?
                .get(0);
            let answer = match &now {
                Some(now) if *now == valid => Ok(()),
                None if n >= max => Err(too_much_evidence()),
                _ => {
                    tx.execute(
                        "INSERT INTO berth_evidence VALUES ($1, $2, $3, $4, $5, $6, true)
                         ON CONFLICT (project) DO UPDATE SET fingerprint = $2, git_commit = $3,
                           ports = $4, run_id = $5, host_id = $6, valid = true",
                        &[
                            &e.project,
                            &e.fingerprint,
                            &e.commit,
                            &ports,
                            &e.run_id,
                            &e.host_id,
                        ],
                    )?;
                    changed(&mut tx)?;
                    Ok(())
                }
            };
            let (version, _) = read_shared(&mut tx)?;
            tx.commit()?;
            Ok(answer.map(|()| version))
        })?
    }

    fn invalidate_evidence(
        &mut self,
        project: &str,
        fingerprint: &str,
        commit: Option<&str>,
    ) -> Result<i64, FleetError> {
        self.with(|c| {
            let mut tx = c.transaction()?;
            tx.execute("SELECT 1 FROM berth_shared WHERE id = 1 FOR UPDATE", &[])?;
            let n = tx.execute(
                "UPDATE berth_evidence SET valid = false WHERE project = $1 AND fingerprint = $2
                   AND git_commit IS NOT DISTINCT FROM $3 AND valid",
                &[&project, &fingerprint, &commit],
            )?;
            if n > 0 {
                changed(&mut tx)?;
            }
            let (version, _) = read_shared(&mut tx)?;
            tx.commit()?;
            Ok(version)
        })
    }
}

fn evidence_row(r: &postgres::Row) -> FleetEvidence {
    let ports: String = r.get(3);
    FleetEvidence {
        project: r.get(0),
        fingerprint: r.get(1),
        commit: r.get(2),
        ports: ports.lines().map(str::to_owned).collect(),
        run_id: r.get(4),
        host_id: r.get(5),
        valid: r.get(6),
    }
}

/// A receipt read from `row`'s columns from `at` on: request id, mode, generation,
/// control, host.
fn receipt_row(row: &postgres::Row, at: usize) -> Result<FleetReceipt, FleetError> {
    Ok(FleetReceipt {
        request_id: row.get(at),
        mode: word(row.get(at + 1))?,
        generation: u64::try_from(row.get::<_, i64>(at + 2)).unwrap_or(0),
        control: word(row.get(at + 3))?,
        host_id: row.get(at + 4),
    })
}

/// Writes an accepted control's state and receipt (the receipts too old to keep go),
/// raises the shared version and announces the change.
fn write_control(
    tx: &mut postgres::Transaction,
    scope: &str,
    r: FleetReceipt,
) -> Result<(ControlOutcome, i64), postgres::Error> {
    let g = i64::try_from(r.generation).unwrap_or(i64::MAX);
    let keep = FLEET_RECEIPTS_MAX as i64;
    tx.execute(
        "INSERT INTO berth_scope_control VALUES ($1, $2, $3)
         ON CONFLICT (scope) DO UPDATE SET control = $2, generation = $3",
        &[&scope, &r.control.as_str(), &g],
    )?;
    tx.execute(
        "INSERT INTO berth_scope_receipt VALUES ($1, $2, $3, $4, $5, $6)",
        &[
            &scope,
            &r.request_id,
            &r.mode.as_str(),
            &g,
            &r.control.as_str(),
            &r.host_id,
        ],
    )?;
    tx.execute(
        "DELETE FROM berth_scope_receipt WHERE scope = $1 AND generation + $2 <= $3",
        &[&scope, &keep, &g],
    )?;
    changed(tx)?;
    let (version, _) = read_shared(tx)?;
    Ok((ControlOutcome::Accepted(r), version))
}

fn token_row(r: &postgres::Row) -> FleetToken {
    FleetToken {
        hash: r.get(0),
        grant: r.get(1),
        host_id: r.get(2),
    }
}

/// Raises the shared version and announces the change (sent at the commit).
fn changed(tx: &mut postgres::Transaction) -> Result<(), postgres::Error> {
    tx.execute(
        "UPDATE berth_shared SET version = version + 1 WHERE id = 1",
        &[],
    )?;
    notify_shared(tx)
}

fn notify_shared(tx: &mut postgres::Transaction) -> Result<(), postgres::Error> {
    tx.execute(
        "SELECT pg_notify($1, $2)",
        &[&super::CHANNEL, &SHARED_PAYLOAD],
    )
    .map(|_| ())
}

/// The shared row: its version and the drain in force.
fn read_shared(
    tx: &mut postgres::Transaction,
) -> Result<(i64, Option<FleetDrain>), postgres::Error> {
    let r = tx.query_one(
        "SELECT version, drain_by, drain_at, drain_reason, drain_host FROM berth_shared",
        &[],
    )?;
    let by: Option<String> = r.get(1);
    let drain = by.map(|by| FleetDrain {
        by,
        at: r.get(2),
        reason: r.get(3),
        host_id: r.get(4),
    });
    Ok((r.get(0), drain))
}

/// F3: the wake-ups other hosts send when a fleet-wide claim frees (a token, a key),
/// on a connection of their own. It reconnects (and listens again) after an error;
/// notifications sent while it was away are lost, which is what the daemon's slow
/// periodic re-check is for.
pub struct PgListener {
    config: postgres::Config,
    tls: Tls,
    client: Option<Client>,
}

impl PgListener {
    /// Payloads received within `timeout` (empty if none came).
    pub fn wait(&mut self, timeout: Duration) -> Result<Vec<String>, FleetError> {
        if self.client.as_ref().is_none_or(|c| c.is_closed()) {
            let mut c = self.tls.connect(&self.config).map_err(unavailable)?;
            c.batch_execute(&format!("LISTEN {}", super::CHANNEL))
                .map_err(unavailable)?;
            self.client = Some(c);
        }
        let c = self.client.as_mut().expect("connected above");
        let mut got = Vec::new();
        let mut failed = None;
        {
            // Wait for the first; then take what else has already arrived, without
            // waiting again (a wake-up must not sit here for another `timeout`).
            let mut n = c.notifications();
            match n.timeout_iter(timeout).next() {
                Ok(Some(first)) => got.push(first.payload().to_owned()),
                Ok(None) => {}
                Err(e) => failed = Some(e),
            }
            if failed.is_none() && !got.is_empty() {
                let mut rest = n.iter();
                while got.len() < 1024 {
                    match rest.next() {
                        Ok(Some(more)) => got.push(more.payload().to_owned()),
                        Ok(None) => break,
                        Err(e) => {
                            failed = Some(e);
                            break;
                        }
                    }
                }
            }
        }
        if let Some(e) = failed {
            self.client = None;
            if got.is_empty() {
                return Err(unavailable(e));
            }
        }
        Ok(got)
    }
}
