//! Fleet mode's shared store (F1–F5): what must be decided fleet-wide, and nothing
//! else. Each host keeps its own ledger ([`crate::Store`], SQLite) for its capacity,
//! queue, workspaces and processes; a [`FleetStore`] holds the hosts and their
//! heartbeats, run ids and their fences (one sequence for the whole fleet), budget
//! tokens, fleet-wide keys and thread owners.
//!
//! Every decision is one conditional statement or one transaction, never a read then a
//! write: two hosts racing for the last token, the same run id or the same key get one
//! winner, whatever the interleaving. Time is the database's own clock (hosts' clocks
//! may disagree; one judge of "lapsed" is what makes "declared dead exactly once" mean
//! something).
//!
//! Two SQL stores implement it: [`PgFleet`] (PostgreSQL, many hosts) and [`SqliteFleet`]
//! (a file several daemons of one machine share; also the peer that keeps the
//! conformance suite honest). [`MemFleet`] keeps the same tables in memory, by the
//! same rules, on a clock the daemon simulator can drive. [`conformance`] is the suite
//! they all pass (F5).

mod backoff;
pub mod conformance;
mod mem;
mod pg;
mod shared;
mod sqlite;
mod tls;

pub use backoff::{BACKOFF_MS_MAX, BACKOFF_MS_MIN};
pub use mem::MemFleet;
pub use pg::{PgFleet, PgListener};
pub(crate) use shared::{
    check_control, check_drain, check_evidence, check_token, check_token_id, control_of, decide,
    decide_read, too_many_scopes, too_many_tokens, too_much_evidence, word,
};
pub use shared::{
    ControlOutcome, FleetDrain, FleetEvidence, FleetReceipt, FleetScopeControl, FleetToken,
    ScopeControlRequest, Shared, DRAIN_FIELD_BYTES_MAX, DRAIN_REASON_BYTES_MAX,
    EVIDENCE_FIELD_BYTES_MAX, FLEET_EVIDENCE_MAX, FLEET_RECEIPTS_MAX, FLEET_SCOPES_MAX,
    FLEET_TOKENS_MAX, GRANT_BYTES_MAX, SCOPE_ID_BYTES_MAX, SHARED_PAYLOAD,
};
pub use sqlite::SqliteFleet;

/// Limits on what a fleet caller may send, checked before any SQL runs (the engine
/// refuses a run with more, so a claim never meets this limit from berth itself).
pub const FLEET_KEYS_MAX: usize = berth_core::FLEET_KEYS_MAX;
/// A host's load text (its capacity snapshot, JSON the server writes) at most.
pub const LOAD_BYTES_MAX: usize = 16 * 1024;
/// Rows `hosts()` returns at most (a fleet is 3 to 50 hosts; dead ones are kept).
pub const HOSTS_MAX: i64 = 1024;

/// What went wrong talking to the fleet store. Unlike the local ledger, the fleet store
/// being away is not fatal: the host keeps serving its local runs and refuses new
/// fleet-wide claims (`503 store_unavailable`) until it comes back.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    #[error("fleet store unavailable: {0}")]
    Unavailable(String),
    #[error(
        "fleet store schema version {found} is newer than this berth understands ({supported})"
    )]
    TooNew { found: i64, supported: i64 },
    #[error("fleet store refused the input: {0}")]
    Invalid(String),
    /// Issue 38 item 8: another live instance beats under this host's id.
    #[error("{0}")]
    HostIdInUse(String),
}

/// A host as it registers (F2).
#[derive(Clone, Debug)]
pub struct HostInfo {
    pub host_id: String,
    /// Where its HTTP API listens, for placement and for `berth fleet`.
    pub address: String,
    pub version: String,
}

/// A claim's budget token: the harness's fleet-wide limit, frozen by the first claim
/// (B1; a claim with another limit is refused as `budget_conflict`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenClaim {
    pub scope: String,
    pub harness: String,
    pub limit: u32,
}

/// Everything fleet-wide one run needs, taken all or nothing (A1): its run id, a fence
/// from the fleet's one sequence, an optional budget token and its fleet-wide keys.
#[derive(Clone, Debug)]
pub struct Claim {
    pub run_id: String,
    pub host_id: String,
    pub gen: i64,
    pub token: Option<TokenClaim>,
    pub keys: Vec<String>,
}

/// How a claim was answered. Only `Taken` wrote anything.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// Held (newly, or again by the same host generation: a retry gets the same fence).
    Taken { fence: u64 },
    /// The run id is held by another host (or another generation of this one).
    RunIdTaken { host_id: String },
    /// The harness holds `limit` tokens fleet-wide.
    BudgetFull { holders: u32, limit: u32 },
    /// The harness's limit was frozen at another value (B1).
    BudgetConflict { frozen: u32 },
    /// The run id still owns a lapsed token in the scope (an earlier run under the same
    /// id expired holding it): an operator must reconcile it first (B3).
    TokenLapsed,
    /// A fleet-wide key is held by another run, on the host `host_id` (empty when the
    /// store did not say).
    KeyHeld {
        key: String,
        run_id: String,
        host_id: String,
    },
    /// This host generation was declared dead: it must re-register first (F2).
    HostDead,
    /// Issue 38 Build 3: a fleet drain is in force, and no new claim is taken on any
    /// host until it ends (a claim this generation already holds is answered with its
    /// fence; re-fences and endings go on). Decided by the store, so a drain is strict:
    /// once it is committed, no host admits a new run, whenever it reads the drain.
    Draining,
}

/// How a run's fleet-wide claim ends. An owner's release frees its budget token; an
/// expiry only marks it lapsed (B3). Keys are freed either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    Released,
    Lapsed,
}

/// One thing a host asks of the fleet store, alone or in a batch with others
/// ([`FleetStore::batch`]; issue 38 Build 1).
#[derive(Clone, Debug)]
pub enum FleetOp {
    /// [`FleetStore::claim`].
    Claim(Claim),
    /// [`FleetStore::refence`] of this host's claim.
    Refence { run_id: String, gen: i64 },
    /// [`FleetStore::end`] of this host's claim.
    End {
        run_id: String,
        gen: i64,
        how: Ending,
    },
}

impl FleetOp {
    pub fn run_id(&self) -> &str {
        match self {
            FleetOp::Claim(c) => &c.run_id,
            FleetOp::Refence { run_id, .. } | FleetOp::End { run_id, .. } => run_id,
        }
    }

    pub fn gen(&self) -> i64 {
        match self {
            FleetOp::Claim(c) => c.gen,
            FleetOp::Refence { gen, .. } | FleetOp::End { gen, .. } => *gen,
        }
    }
}

/// How one op of a batch was answered: a claim's or re-fence's outcome, or whether an
/// ending ended anything.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OpOutcome {
    Claim(ClaimOutcome),
    Ended(bool),
}

/// Ops one batch carries at most: what a host's claim workers gather while a round
/// trip is in flight, bounded so that one statement's arguments and its transaction's
/// locks stay small (a batch holds every key it touches until its commit).
pub const BATCH_OPS_MAX: usize = 256;

/// A batch's answers, one per op, in order. An op the input rules refuse
/// ([`check_claim`]) is answered alone, with its error, and the rest go on.
pub type BatchOutcome = Vec<Result<OpOutcome, FleetError>>;

/// A host's row as `GET /v1/fleet` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostRow {
    pub host_id: String,
    pub gen: i64,
    pub address: String,
    pub version: String,
    pub load: String,
    pub alive: bool,
    /// Milliseconds since its last heartbeat, by the store's clock.
    pub beat_age_ms: i64,
    /// The host that declared it dead, if one did.
    pub declared_by: Option<String>,
}

/// A fence as the fleet knows it, for `/v1/fences/check` on a host that does not hold
/// the run (L8 fleet-wide).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FleetFence {
    pub fence: u64,
    pub host_id: String,
    pub gen: i64,
    /// False once its host generation is declared dead: its fences are refused everywhere.
    pub host_alive: bool,
}

/// A thread's owner as the fleet remembers it (G2: ordered by fence).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ThreadOwner {
    pub gen: String,
    pub fence: u64,
    pub run_id: String,
}

/// A budget token's row (for tests and `berth fleet`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenRow {
    pub scope: String,
    pub harness: String,
    pub owner: String,
    pub host_id: String,
    pub lapsed: bool,
}

/// The fleet-wide store. Methods are blocking; the server drives one from a thread of
/// its own, as it drives the local ledger from the writer thread.
pub trait FleetStore: Send {
    /// Register (or re-register) a host under a new generation. Returns it, and whether
    /// the host's claims carried over: true for a new host or one whose last generation
    /// was alive (a restart nobody declared dead); false if it had been declared dead,
    /// in which case its runs' rows are gone (their fences stay refused) and only its
    /// lapsed budget tokens remain (B3: only an operator's reconcile frees them).
    fn register(&mut self, host: &HostInfo) -> Result<(i64, bool), FleetError>;
    /// Makes every fence the sequence gives from now on greater than `floor`: a host
    /// raises it to its own last fence before it registers, so a fleet fence is never
    /// at or below one the host gave before (a ledger of fences given in single-host
    /// mode, a fleet database restored from an older backup). Never lowers it, whatever
    /// other hosts draw meanwhile (issue 38 item 1).
    fn raise_fence(&mut self, floor: u64) -> Result<(), FleetError>;
    /// Heartbeat with the host's load; false if this generation was declared dead.
    fn heartbeat(&mut self, host_id: &str, gen: i64, load: &str) -> Result<bool, FleetError>;
    /// Declare dead every other live host whose heartbeat is older than `lapse_ms`, each
    /// exactly once (a conditional update), and in the same transaction free its keys,
    /// mark its budget tokens lapsed and drop its thread registrations' liveness.
    /// Returns the (host, generation) pairs this call declared.
    fn declare_dead(&mut self, me: &str, lapse_ms: i64) -> Result<Vec<(String, i64)>, FleetError>;
    /// Take a run's fleet-wide claim, all or nothing.
    fn claim(&mut self, c: &Claim) -> Result<ClaimOutcome, FleetError>;
    /// Give a held claim a new fence from the sequence (its token and keys stay): for a
    /// permit that went stale on its host before it was granted (L1's order). `HostDead`
    /// if this generation no longer holds the claim.
    fn refence(
        &mut self,
        run_id: &str,
        host_id: &str,
        gen: i64,
    ) -> Result<ClaimOutcome, FleetError>;
    /// End a run's claim: keys freed, token freed or marked lapsed, run id released.
    /// Only the generation that holds it can end it (a stale host changes nothing).
    fn end(
        &mut self,
        run_id: &str,
        host_id: &str,
        gen: i64,
        how: Ending,
    ) -> Result<bool, FleetError>;
    /// G2 fleet-wide: accept `owner` for a thread unless the thread's remembered owner
    /// is newer (a higher fence, or the same fence of another generation or run).
    /// Returns `None` if accepted, or the owner that refused it.
    fn thread_owner(
        &mut self,
        thread_key: &str,
        owner: &ThreadOwner,
        host_id: &str,
    ) -> Result<Option<ThreadOwner>, FleetError>;
    /// The fleet's record of a run's fence.
    fn fence(&mut self, run_id: &str) -> Result<Option<FleetFence>, FleetError>;
    /// Every host, live first, then by id.
    fn hosts(&mut self) -> Result<Vec<HostRow>, FleetError>;
    /// Budget tokens of a scope.
    fn tokens(&mut self, scope: &str) -> Result<Vec<TokenRow>, FleetError>;
    /// B3: an operator frees a lapsed owner's token; false if there was none.
    fn reconcile(&mut self, scope: &str, owner: &str) -> Result<bool, FleetError>;
    /// Times a host generation was declared dead (the "exactly once" record).
    fn declarations(&mut self, host_id: &str) -> Result<Vec<(i64, String)>, FleetError>;
    /// Issue 38 Build 1: carries out `ops` (at most [`BATCH_OPS_MAX`]) of host
    /// `host_id` in order, each answered as its own call would have been had they been
    /// made one after another, in one round trip and one transaction where the store
    /// can. `Err` (the store away) means none of them is known to have happened: each
    /// is retried or refused as its own call's failure would be (every op is harmless
    /// twice: a claim retried by its generation gets its fence back). This default
    /// makes the calls one by one.
    fn batch(&mut self, host_id: &str, ops: &[FleetOp]) -> Result<BatchOutcome, FleetError> {
        check_batch(ops)?;
        let mut out = Vec::with_capacity(ops.len());
        for op in ops {
            let r = match op {
                FleetOp::Claim(c) => check_claim_host(c, host_id)
                    .and_then(|()| self.claim(c))
                    .map(OpOutcome::Claim),
                FleetOp::Refence { run_id, gen } => {
                    self.refence(run_id, host_id, *gen).map(OpOutcome::Claim)
                }
                FleetOp::End { run_id, gen, how } => {
                    self.end(run_id, host_id, *gen, *how).map(OpOutcome::Ended)
                }
            };
            if let Err(FleetError::Unavailable(e)) = r {
                return Err(FleetError::Unavailable(e));
            }
            out.push(r);
        }
        Ok(out)
    }
    /// The runs whose claims a host holds (any generation), by run id, at most
    /// [`CLAIMS_OF_MAX`]: a host that registers again ends those whose runs ended while
    /// their endings could not reach the store (a restart, a crash).
    fn claims_of(&mut self, host_id: &str) -> Result<Vec<(String, i64)>, FleetError>;
    /// Issue 38 Build 3: keeps a bearer token for the whole fleet (its hash, never its
    /// secret). The same hash again changes nothing; a token past
    /// [`FLEET_TOKENS_MAX`] is refused (`Invalid`). Announces the change. Returns the
    /// shared version that includes it.
    fn put_token(&mut self, t: &FleetToken) -> Result<i64, FleetError>;
    /// Revokes the fleet's tokens whose id (the first 16 hex digits of the hash) is
    /// `id`, and returns them (none: nothing changed) and the shared version after.
    /// Announces the change.
    fn revoke_token(&mut self, id: &str) -> Result<(Vec<FleetToken>, i64), FleetError>;
    /// Starts (`Some`) or ends (`None`) the fleet-wide drain and returns the drain in
    /// force afterwards and the shared version. Starting while one is in force keeps
    /// the first record (as a host drain does). Announces a change.
    fn set_drain(
        &mut self,
        d: Option<&FleetDrain>,
    ) -> Result<(Option<FleetDrain>, i64), FleetError>;
    /// B4 fleet-wide: a scope's control request, decided once for the whole fleet by
    /// the rules every host applies (`decide`); an accepted new request raises the
    /// scope's generation and the shared version, and is announced. Returns the answer
    /// and the shared version after.
    fn control_scope(
        &mut self,
        r: &ScopeControlRequest,
        host_id: &str,
    ) -> Result<(ControlOutcome, i64), FleetError>;
    /// C3 fleet-wide: keeps a project's promotion evidence (valid), in place of what
    /// the project had. The same evidence again changes nothing; evidence of a new
    /// project past [`FLEET_EVIDENCE_MAX`] is refused. Announces a change. Returns the
    /// shared version.
    fn put_evidence(&mut self, e: &FleetEvidence) -> Result<i64, FleetError>;
    /// C4 fleet-wide: marks the project's evidence invalid if it is still this
    /// fingerprint and commit (newer evidence is left alone). Announces a change.
    fn invalidate_evidence(
        &mut self,
        project: &str,
        fingerprint: &str,
        commit: Option<&str>,
    ) -> Result<i64, FleetError>;
    /// The fleet's tokens, drain and scope controls, or `None` if nothing changed
    /// since `since` (the version the caller last read; `-1` before its first read).
    fn shared(&mut self, since: i64) -> Result<Option<Shared>, FleetError>;
}

/// Claims `claims_of` lists at most: more than any host holds (its runs are bounded
/// by its queue and its capacity); the rest are found at the next registration.
pub const CLAIMS_OF_MAX: i64 = 65_536;

/// The input rules every store checks before any SQL runs (the same refusals from
/// every store): bounded sizes, a positive limit, at most [`FLEET_KEYS_MAX`] keys.
/// Returns the keys as every store takes them: sorted and without repeats, so that
/// the same key is named when several are held.
pub(crate) fn check_claim(c: &Claim) -> Result<Vec<String>, FleetError> {
    if c.keys.len() > FLEET_KEYS_MAX {
        return Err(FleetError::Invalid(format!(
            "keys: at most {FLEET_KEYS_MAX} fleet-wide keys per run, got {}",
            c.keys.len()
        )));
    }
    if let Some(t) = &c.token {
        if t.limit == 0 || t.limit > 1024 {
            return Err(FleetError::Invalid(format!(
                "budget limit: 1..1024, got {}",
                t.limit
            )));
        }
    }
    let mut keys = c.keys.clone();
    keys.sort();
    keys.dedup();
    Ok(keys)
}

/// A batch carries at most [`BATCH_OPS_MAX`] ops; more is refused whole.
pub(crate) fn check_batch(ops: &[FleetOp]) -> Result<(), FleetError> {
    match ops.len() <= BATCH_OPS_MAX {
        true => Ok(()),
        false => Err(FleetError::Invalid(format!(
            "batch: at most {BATCH_OPS_MAX} ops, got {}",
            ops.len()
        ))),
    }
}

/// A batch is one host's: a claim in it for another host is refused.
pub(crate) fn check_claim_host(c: &Claim, host_id: &str) -> Result<(), FleetError> {
    match c.host_id == host_id {
        true => Ok(()),
        false => Err(FleetError::Invalid(format!(
            "batch: a claim of host {:?} in a batch of host {host_id:?}",
            c.host_id
        ))),
    }
}

/// The one answer of a batch of one.
pub(crate) fn one(r: Result<BatchOutcome, FleetError>) -> Result<OpOutcome, FleetError> {
    r?.pop()
        .unwrap_or_else(|| Err(FleetError::Unavailable("the store answered nothing".into())))
}

/// The one answer of a batch of one claim or re-fence.
pub(crate) fn one_claim(r: Result<BatchOutcome, FleetError>) -> Result<ClaimOutcome, FleetError> {
    match one(r)? {
        OpOutcome::Claim(o) => Ok(o),
        other => Err(answered_wrong(&other)),
    }
}

pub(crate) fn answered_wrong(o: &OpOutcome) -> FleetError {
    FleetError::Unavailable(format!("the store answered {o:?} to another kind of op"))
}

/// A thread owner's fence as the stores keep it (a signed 64-bit column).
/// A fence floor as the SQL stores keep it (signed 64 bits), or the refusal.
pub(crate) fn fence_floor(floor: u64) -> Result<i64, FleetError> {
    i64::try_from(floor)
        .map_err(|_| FleetError::Invalid(format!("fence floor {floor} is above 2^63 - 1")))
}

pub(crate) fn owner_fence(owner: &ThreadOwner) -> Result<i64, FleetError> {
    i64::try_from(owner.fence)
        .map_err(|_| FleetError::Invalid("owner_fence: at most 2^63-1".into()))
}

pub(crate) fn check_load(load: &str) -> Result<(), FleetError> {
    if load.len() > LOAD_BYTES_MAX {
        return Err(FleetError::Invalid(format!(
            "load: at most {LOAD_BYTES_MAX} bytes, got {}",
            load.len()
        )));
    }
    Ok(())
}

/// The channel fleet wake-ups are sent on (F3), and what a payload names.
pub const CHANNEL: &str = "berth_fleet";

/// A claim's answer as both stores spell it (`outcome`, `detail`): PostgreSQL's claim
/// function returns these words, and the SQLite store uses the same ones.
pub(crate) fn outcome(word: &str, fence: u64, detail: &str) -> Result<ClaimOutcome, FleetError> {
    let num = |s: &str| s.parse::<u32>().unwrap_or(0);
    Ok(match word {
        "taken" => ClaimOutcome::Taken { fence },
        "run_id_taken" => ClaimOutcome::RunIdTaken {
            host_id: detail.to_owned(),
        },
        "budget_full" => {
            let (h, l) = detail.split_once('/').unwrap_or(("0", "0"));
            ClaimOutcome::BudgetFull {
                holders: num(h),
                limit: num(l),
            }
        }
        "budget_conflict" => ClaimOutcome::BudgetConflict {
            frozen: num(detail),
        },
        "token_lapsed" => ClaimOutcome::TokenLapsed,
        "key_held" => {
            // `key TAB run TAB host` (the host since the second schema).
            let mut parts = detail.splitn(3, '\t');
            let mut next = || parts.next().unwrap_or("").to_owned();
            ClaimOutcome::KeyHeld {
                key: next(),
                run_id: next(),
                host_id: next(),
            }
        }
        "host_dead" => ClaimOutcome::HostDead,
        "draining" => ClaimOutcome::Draining,
        other => {
            return Err(FleetError::Unavailable(format!(
                "the store answered a claim with {other:?}"
            )))
        }
    })
}

/// Test support: a fresh PostgreSQL database on the server the environment names
/// (`PGHOST`, `PGPORT`, `PGUSER`, `PGPASSWORD`, as `pg_virtualenv` sets them; the
/// project's `scripts/test.sh` runs the tests under it). Here because only this crate
/// knows SQL.
pub mod testing {
    use std::sync::atomic::{AtomicU32, Ordering};

    static NEXT: AtomicU32 = AtomicU32::new(0);

    /// The server's connection string without a database, or why there is none.
    pub fn pg_server() -> Result<String, String> {
        let var = |k: &str| std::env::var(k).map_err(|_| k.to_string());
        let (host, port, user) = match (var("PGHOST"), var("PGPORT"), var("PGUSER")) {
            (Ok(h), Ok(p), Ok(u)) => (h, p, u),
            _ => {
                return Err("no PostgreSQL server in the environment (PGHOST, PGPORT, \
                            PGUSER): run the tests with scripts/test.sh, which starts one \
                            with pg_virtualenv"
                    .into())
            }
        };
        Ok(conninfo(
            &host,
            &port,
            &user,
            var("PGPASSWORD").ok().as_deref(),
        ))
    }

    /// A libpq key=value string without a database. A value that is empty or has a
    /// space, quote or backslash in it is quoted, so it cannot swallow the next key: `password= dbname=x` made the
    /// database name the password, and everything ran in `postgres` (issue 38 item 9).
    /// No password at all when there is none.
    pub fn conninfo(host: &str, port: &str, user: &str, password: Option<&str>) -> String {
        // Quoted where libpq needs it (empty, or a space, quote or backslash in it).
        let quote = |v: &str| {
            let plain =
                !v.is_empty() && !v.contains(|c: char| c.is_whitespace() || c == '\'' || c == '\\');
            match plain {
                true => v.to_string(),
                false => format!("'{}'", v.replace('\\', "\\\\").replace('\'', "\\'")),
            }
        };
        let mut s = format!(
            "host={} port={} user={}",
            quote(host),
            quote(port),
            quote(user)
        );
        if let Some(p) = password {
            s.push_str(&format!(" password={}", quote(p)));
        }
        s
    }

    #[cfg(test)]
    #[test]
    fn regression_an_unset_password_does_not_swallow_the_database_name() {
        for password in [None, Some(""), Some("p w'\\x")] {
            let c = format!(
                "{} dbname=berth_x",
                conninfo("localhost", "5432", "me", password)
            );
            let parsed: postgres::Config = c.parse().unwrap_or_else(|e| panic!("{c}: {e}"));
            assert_eq!(parsed.get_dbname(), Some("berth_x"), "{c}");
            assert_eq!(parsed.get_user(), Some("me"), "{c}");
            assert_eq!(parsed.get_password(), password.map(str::as_bytes), "{c}");
        }
    }

    /// A setting of the test server (`SHOW name`).
    pub fn pg_setting(name: &str) -> Result<String, String> {
        let mut c = postgres::Client::connect(
            &format!("{} dbname=postgres", pg_server()?),
            postgres::NoTls,
        )
        .map_err(|e| format!("connect: {e}"))?;
        let row = c
            .query_one(&format!("SHOW {name}"), &[])
            .map_err(|e| e.to_string())?;
        Ok(row.get(0))
    }

    /// Restarts the test server (`pg_ctlcluster … restart -m fast`, the cluster found
    /// by `PGPORT` among `pg_lsclusters`' lines): every connection is cut, and what
    /// was committed must be there after it. Only pg_virtualenv's throwaway cluster
    /// (`regress`): a server of the caller's own is never restarted by a test.
    pub fn pg_restart() -> Result<(), String> {
        let port = std::env::var("PGPORT").map_err(|_| "no PGPORT".to_string())?;
        let out = std::process::Command::new("pg_lsclusters")
            .arg("-h")
            .output()
            .map_err(|e| format!("pg_lsclusters: {e}"))?;
        let listed = String::from_utf8_lossy(&out.stdout).into_owned();
        let (version, cluster) = (listed.lines())
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .find(|f| f.len() > 2 && f[2] == port)
            .map(|f| (f[0].to_string(), f[1].to_string()))
            .ok_or_else(|| format!("no cluster on port {port} in: {listed}"))?;
        if cluster != "regress" {
            return Err(format!(
                "the server on port {port} is cluster {version}/{cluster}, not pg_virtualenv's throwaway one: not restarting it (run the tests with scripts/test.sh)"
            ));
        }
        let st = std::process::Command::new("pg_ctlcluster")
            .args([&version, &cluster, "restart", "-m", "fast"])
            .status()
            .map_err(|e| format!("pg_ctlcluster: {e}"))?;
        match st.success() {
            true => Ok(()),
            false => Err(format!("pg_ctlcluster {version} {cluster} restart: {st}")),
        }
    }

    /// Connections to the database `db` names whose application name is `app`.
    pub fn pg_connections(db: &str, app: &str) -> Result<i64, String> {
        let mut c =
            postgres::Client::connect(db, postgres::NoTls).map_err(|e| format!("connect: {e}"))?;
        let row = c
            .query_one(
                "SELECT count(*) FROM pg_stat_activity
                  WHERE datname = current_database() AND application_name = $1",
                &[&app],
            )
            .map_err(|e| e.to_string())?;
        Ok(row.get(0))
    }

    /// Whether each connection to the database `db` names whose application name is
    /// `app` is encrypted (`pg_stat_ssl`).
    pub fn pg_encrypted(db: &str, app: &str) -> Result<Vec<bool>, String> {
        let mut c =
            postgres::Client::connect(db, postgres::NoTls).map_err(|e| format!("connect: {e}"))?;
        let rows = c
            .query(
                "SELECT s.ssl FROM pg_stat_ssl s JOIN pg_stat_activity a ON a.pid = s.pid
                  WHERE a.datname = current_database() AND a.application_name = $1",
                &[&app],
            )
            .map_err(|e| e.to_string())?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    /// Runs `sql` (several statements) on the database `db` names.
    pub fn pg_execute(db: &str, sql: &str) -> Result<(), String> {
        let mut c =
            postgres::Client::connect(db, postgres::NoTls).map_err(|e| format!("connect: {e}"))?;
        c.batch_execute(sql).map_err(|e| e.to_string())
    }

    /// Create an empty database and return its connection string.
    pub fn pg_fresh_database(tag: &str) -> Result<String, String> {
        let server = pg_server()?;
        let name = format!(
            "berth_{tag}_{}_{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let mut c =
            postgres::Client::connect(&format!("{server} dbname=postgres"), postgres::NoTls)
                .map_err(|e| format!("connect to the test server: {e}"))?;
        c.batch_execute(&format!("CREATE DATABASE {name}"))
            .map_err(|e| format!("create database {name}: {e}"))?;
        Ok(format!("{server} dbname={name}"))
    }
}
