//! The in-memory fleet store, for the daemon simulator: [`MemFleet`] keeps what
//! [`super::SqliteFleet`]'s tables keep, one map each, and decides by its rules in its
//! order of checks, so every answer the [`FleetStore`] trait shows is the same. Its
//! clock (the "database's own clock" of heartbeat ages and lapses) can be the
//! simulator's, so a lapse needs no real waiting.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Instant;

use super::{
    check_claim, check_load, fence_floor, owner_fence, Claim, ClaimOutcome, Ending, FleetError,
    FleetFence, FleetStore, HostInfo, HostRow, ThreadOwner, TokenRow, HOSTS_MAX,
};
use super::{
    check_control, check_drain, check_evidence, check_token, check_token_id, decide,
    too_many_scopes, too_many_tokens, too_much_evidence, ControlOutcome, FleetDrain, FleetEvidence,
    FleetReceipt, FleetScopeControl, FleetToken, ScopeControlRequest, Shared, FLEET_EVIDENCE_MAX,
    FLEET_RECEIPTS_MAX, FLEET_SCOPES_MAX, FLEET_TOKENS_MAX,
};
use berth_core::scopes::Control;

/// A new host's load until its first heartbeat (the tables' column default).
const EMPTY_LOAD: &str = "{}";

/// Where the store's milliseconds come from.
#[derive(Clone)]
enum Clock {
    /// Real time: milliseconds since this process first read the clock. Monotonic, so a
    /// wall-clock step cannot make a live host look lapsed; only differences (ages,
    /// lapses) mean anything, as with the SQL stores' clocks.
    Real,
    /// The simulator's virtual milliseconds, read at each call.
    Virtual(Arc<AtomicU64>),
}

impl Clock {
    fn now_ms(&self) -> i64 {
        static START: OnceLock<Instant> = OnceLock::new();
        let ms = match self {
            Clock::Real => {
                let ms = START.get_or_init(Instant::now).elapsed().as_millis();
                u64::try_from(ms).unwrap_or(u64::MAX)
            }
            Clock::Virtual(ms) => ms.load(Ordering::SeqCst),
        };
        i64::try_from(ms).unwrap_or(i64::MAX)
    }
}

/// A fleet store in memory. A clone is another connection to the same database: what
/// one handle writes, every clone reads. Each call is one transaction (the lock is held
/// for the whole decision, as SQLite's `BEGIN IMMEDIATE` holds the file), so hosts on
/// threads race exactly as on the SQL stores. It is never unavailable.
///
/// [`MemFleet::new`] runs on the real clock; [`MemFleet::with_clock`] on the
/// simulator's. Clones share the clock as they share the state.
#[derive(Clone)]
pub struct MemFleet {
    db: Arc<Mutex<State>>,
    clock: Clock,
}

impl Default for MemFleet {
    fn default() -> MemFleet {
        MemFleet::new()
    }
}

impl MemFleet {
    /// An empty store on the real clock (monotonic milliseconds, `std::time::Instant`).
    pub fn new() -> MemFleet {
        MemFleet::on(Clock::Real)
    }

    /// An empty store whose clock is `clock`, the simulator's virtual milliseconds:
    /// heartbeat ages and lapses move only when the simulator moves it.
    pub fn with_clock(clock: Arc<AtomicU64>) -> MemFleet {
        MemFleet::on(Clock::Virtual(clock))
    }

    fn on(clock: Clock) -> MemFleet {
        MemFleet {
            db: Arc::new(Mutex::new(State::default())),
            clock,
        }
    }

    /// The state and the time, read under the lock: decisions and their times are in
    /// one order, as a database reads its clock inside the transaction.
    fn open(&self) -> (MutexGuard<'_, State>, i64) {
        let st = self.db.lock().unwrap_or_else(|p| p.into_inner());
        let now = self.clock.now_ms();
        (st, now)
    }
}

struct Host {
    gen: i64,
    address: String,
    version: String,
    load: String,
    beat_at: i64,
    alive: bool,
    declared_by: Option<String>,
}

/// A host generation: what holds a run, a key or a token.
#[derive(Clone, PartialEq)]
struct HostGen {
    host_id: String,
    gen: i64,
}

impl HostGen {
    fn of(host_id: &str, gen: i64) -> HostGen {
        let host_id = host_id.to_owned();
        HostGen { host_id, gen }
    }
}

struct Run {
    by: HostGen,
    fence: u64,
}

/// A harness's frozen limit and how many tokens it holds (`held <= lim` always, the
/// SQL stores' CHECK).
struct Harness {
    lim: u32,
    held: u32,
}

struct Token {
    harness: String,
    by: HostGen,
    lapsed: bool,
}

struct Key {
    run_id: String,
    by: HostGen,
}

struct Thread {
    owner: ThreadOwner,
    host_id: String,
    /// Kept as the SQL stores keep it (a dead host's registrations are not live),
    /// though nothing the trait answers reads it yet.
    live: bool,
}

/// The SQL stores' tables, keyed by their primary keys (so ordered as they order).
/// `dead` keeps who declared, not when: nothing the trait answers reads the time.
#[derive(Default)]
struct State {
    /// The fleet's one fence sequence: the last fence given.
    last_fence: u64,
    hosts: BTreeMap<String, Host>,
    /// (host, generation) → who declared it: one entry per declaration, ever.
    dead: BTreeMap<(String, i64), String>,
    runs: BTreeMap<String, Run>,
    /// (scope, harness) → its limit and holders.
    harness: BTreeMap<(String, String), Harness>,
    /// (scope, owner run id) → its token, lapsed ones included.
    tokens: BTreeMap<(String, String), Token>,
    keys: BTreeMap<String, Key>,
    threads: BTreeMap<String, Thread>,
    /// Issue 38 Build 3: the fleet's bearer tokens by hash, its drain, and the
    /// version every change of either raises.
    bearer: BTreeMap<String, FleetToken>,
    drain: Option<FleetDrain>,
    shared_version: i64,
    /// Scope → its control and generation (B4 fleet-wide), and its receipts by
    /// (scope, request id).
    controls: BTreeMap<String, (Control, u64)>,
    receipts: BTreeMap<(String, String), FleetReceipt>,
    /// Project → its promotion evidence (C3 fleet-wide).
    evidence: BTreeMap<String, FleetEvidence>,
}

impl State {
    fn alive(&self, host_id: &str, gen: i64) -> bool {
        self.hosts
            .get(host_id)
            .is_some_and(|h| h.gen == gen && h.alive)
    }

    /// A token given back: its harness holds one fewer.
    fn free(&mut self, scope: &str, harness: &str) {
        if let Some(h) = self
            .harness
            .get_mut(&(scope.to_owned(), harness.to_owned()))
        {
            h.held = h.held.saturating_sub(1);
        }
    }

    /// Why SQLite's `take` would roll the claim back, in its order (budget conflict or
    /// full, then a token the run id already owns, then the first held key in sorted
    /// order), decided before anything is written. A refused SQLite claim gives its
    /// fence back with the rollback, so the sequence is not moved here either.
    fn refusal(&self, c: &Claim, keys: &[String]) -> Option<ClaimOutcome> {
        if let Some(t) = &c.token {
            if let Some(h) = self.harness.get(&(t.scope.clone(), t.harness.clone())) {
                if h.lim != t.limit {
                    return Some(ClaimOutcome::BudgetConflict { frozen: h.lim });
                }
                if h.held >= h.lim {
                    return Some(ClaimOutcome::BudgetFull {
                        holders: h.held,
                        limit: h.lim,
                    });
                }
            }
            if self
                .tokens
                .contains_key(&(t.scope.clone(), c.run_id.clone()))
            {
                return Some(ClaimOutcome::TokenLapsed);
            }
        }
        keys.iter().find_map(|k| {
            self.keys.get(k).map(|held| ClaimOutcome::KeyHeld {
                key: k.clone(),
                run_id: held.run_id.clone(),
                host_id: held.by.host_id.clone(),
            })
        })
    }

    /// The claim's writes, once nothing refuses it.
    fn take(&mut self, c: &Claim, keys: Vec<String>) -> u64 {
        self.last_fence += 1;
        let (fence, run_id) = (self.last_fence, &c.run_id);
        let by = HostGen::of(&c.host_id, c.gen);
        self.runs.insert(
            run_id.clone(),
            Run {
                by: by.clone(),
                fence,
            },
        );
        if let Some(t) = &c.token {
            let (lim, held) = (t.limit, 0);
            let at = (t.scope.clone(), t.harness.clone());
            self.harness.entry(at).or_insert(Harness { lim, held }).held += 1;
            let (harness, by, lapsed) = (t.harness.clone(), by.clone(), false);
            let token = Token {
                harness,
                by,
                lapsed,
            };
            self.tokens.insert((t.scope.clone(), run_id.clone()), token);
        }
        for k in keys {
            let (run_id, by) = (run_id.clone(), by.clone());
            self.keys.insert(k, Key { run_id, by });
        }
        fence
    }
}

impl FleetStore for MemFleet {
    fn raise_fence(&mut self, floor: u64) -> Result<(), FleetError> {
        fence_floor(floor)?;
        let (mut st, _) = self.open();
        st.last_fence = st.last_fence.max(floor);
        Ok(())
    }

    fn register(&mut self, host: &HostInfo) -> Result<(i64, bool), FleetError> {
        let (mut guard, now) = self.open();
        let st = &mut *guard;
        let id = &host.host_id;
        let old = st.hosts.remove(id);
        let prev = old.as_ref().map(|h| (h.gen, h.alive));
        let gen = prev.map_or(1, |(g, _)| g + 1);
        // SQLite's upsert leaves the load as it was: a restart keeps its last snapshot.
        let load = old.map_or_else(|| EMPTY_LOAD.to_owned(), |h| h.load);
        let row = Host {
            gen,
            address: host.address.clone(),
            version: host.version.clone(),
            load,
            beat_at: now,
            alive: true,
            declared_by: None,
        };
        st.hosts.insert(id.clone(), row);
        match prev {
            // A restart nobody declared dead: its claims move to the new generation.
            Some((g, true)) => {
                let runs = st.runs.values_mut().map(|r| &mut r.by);
                let keys = st.keys.values_mut().map(|k| &mut k.by);
                let live = st.tokens.values_mut().filter(|t| !t.lapsed);
                for by in runs.chain(keys).chain(live.map(|t| &mut t.by)) {
                    if by.host_id == *id && by.gen == g {
                        by.gen = gen;
                    }
                }
            }
            // Declared dead: its runs are forgotten (their fences stay refused).
            Some((_, false)) => st
                .runs
                .retain(|_, r| !(r.by.host_id == *id && r.by.gen < gen)),
            None => {}
        }
        Ok((gen, prev.is_none_or(|(_, alive)| alive)))
    }

    fn heartbeat(&mut self, host_id: &str, gen: i64, load: &str) -> Result<bool, FleetError> {
        check_load(load)?;
        let (mut st, now) = self.open();
        match st.hosts.get_mut(host_id) {
            Some(h) if h.gen == gen && h.alive => {
                h.beat_at = now;
                h.load = load.to_owned();
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    fn declare_dead(&mut self, me: &str, lapse_ms: i64) -> Result<Vec<(String, i64)>, FleetError> {
        let (mut guard, now) = self.open();
        let st = &mut *guard;
        // Only a live host declares (a dead one's view of the fleet is not trusted).
        if !st.hosts.get(me).is_some_and(|h| h.alive) {
            return Ok(Vec::new());
        }
        // Saturating: a negative lapse means "every other live host", as in SQL.
        let cut = now.saturating_sub(lapse_ms);
        let mut dead = Vec::new();
        for (id, h) in &mut st.hosts {
            if h.alive && id != me && h.beat_at < cut {
                h.alive = false;
                h.declared_by = Some(me.to_owned());
                dead.push((id.clone(), h.gen));
            }
        }
        for (id, gen) in &dead {
            st.dead.insert((id.clone(), *gen), me.to_owned());
            st.keys.retain(|_, k| k.by.host_id != *id);
            for t in st.tokens.values_mut().filter(|t| t.by.host_id == *id) {
                t.lapsed = true;
            }
            for t in st.threads.values_mut().filter(|t| t.host_id == *id) {
                t.live = false;
            }
        }
        Ok(dead)
    }

    fn claim(&mut self, c: &Claim) -> Result<ClaimOutcome, FleetError> {
        let keys = check_claim(c)?;
        let (mut st, _) = self.open();
        // A fleet drain refuses every claim but one this generation holds already (a
        // retry whose answer was lost), before anything else is asked, as PostgreSQL's
        // `berth_batch` does.
        if st.drain.is_some() {
            return Ok(match st.runs.get(&c.run_id) {
                Some(r) if r.by == HostGen::of(&c.host_id, c.gen) => {
                    ClaimOutcome::Taken { fence: r.fence }
                }
                _ => ClaimOutcome::Draining,
            });
        }
        if !st.alive(&c.host_id, c.gen) {
            return Ok(ClaimOutcome::HostDead);
        }
        if let Some(r) = st.runs.get(&c.run_id) {
            return Ok(if r.by.host_id == c.host_id && r.by.gen == c.gen {
                ClaimOutcome::Taken { fence: r.fence }
            } else {
                let host_id = r.by.host_id.clone();
                ClaimOutcome::RunIdTaken { host_id }
            });
        }
        if let Some(refused) = st.refusal(c, &keys) {
            return Ok(refused);
        }
        let fence = st.take(c, keys);
        Ok(ClaimOutcome::Taken { fence })
    }

    fn refence(
        &mut self,
        run_id: &str,
        host_id: &str,
        gen: i64,
    ) -> Result<ClaimOutcome, FleetError> {
        let (mut guard, _) = self.open();
        let st = &mut *guard;
        let (alive, me) = (st.alive(host_id, gen), HostGen::of(host_id, gen));
        match st.runs.get_mut(run_id) {
            Some(r) if alive && r.by == me => {
                st.last_fence += 1;
                r.fence = st.last_fence;
                Ok(ClaimOutcome::Taken { fence: r.fence })
            }
            _ => Ok(ClaimOutcome::HostDead),
        }
    }

    fn end(
        &mut self,
        run_id: &str,
        host_id: &str,
        gen: i64,
        how: Ending,
    ) -> Result<bool, FleetError> {
        let (mut guard, _) = self.open();
        let st = &mut *guard;
        let me = HostGen::of(host_id, gen);
        if !st.runs.get(run_id).is_some_and(|r| r.by == me) {
            return Ok(false);
        }
        st.runs.remove(run_id);
        st.keys.retain(|_, k| !(k.run_id == run_id && k.by == me));
        let mut freed = Vec::new();
        st.tokens.retain(|(scope, owner), t| {
            if owner != run_id || t.by != me {
                return true;
            }
            match how {
                Ending::Lapsed => t.lapsed = true,
                // Released frees only a token not already lapsed (B3: that is the
                // operator's to free).
                Ending::Released if !t.lapsed => {
                    freed.push((scope.clone(), t.harness.clone()));
                    return false;
                }
                Ending::Released => {}
            }
            true
        });
        for (scope, harness) in freed {
            st.free(&scope, &harness);
        }
        Ok(true)
    }

    fn thread_owner(
        &mut self,
        thread_key: &str,
        owner: &ThreadOwner,
        host_id: &str,
    ) -> Result<Option<ThreadOwner>, FleetError> {
        // The same refusal as the SQL stores' signed column; then the fence fits i64,
        // so comparing it unsigned orders it as they do.
        owner_fence(owner)?;
        let (mut st, _) = self.open();
        if let Some(t) = st.threads.get(thread_key) {
            let o = &t.owner;
            let same = o.fence == owner.fence && o.gen == owner.gen && o.run_id == owner.run_id;
            if !(o.fence < owner.fence || same) {
                return Ok(Some(o.clone()));
            }
        }
        let t = Thread {
            owner: owner.clone(),
            host_id: host_id.to_owned(),
            live: true,
        };
        st.threads.insert(thread_key.to_owned(), t);
        Ok(None)
    }

    fn fence(&mut self, run_id: &str) -> Result<Option<FleetFence>, FleetError> {
        let (st, _) = self.open();
        Ok(st.runs.get(run_id).map(|r| FleetFence {
            fence: r.fence,
            host_id: r.by.host_id.clone(),
            gen: r.by.gen,
            host_alive: st.alive(&r.by.host_id, r.by.gen),
        }))
    }

    fn hosts(&mut self) -> Result<Vec<HostRow>, FleetError> {
        let (st, now) = self.open();
        let mut rows: Vec<HostRow> = (st.hosts.iter())
            .map(|(id, h)| HostRow {
                host_id: id.clone(),
                gen: h.gen,
                address: h.address.clone(),
                version: h.version.clone(),
                load: h.load.clone(),
                alive: h.alive,
                beat_age_ms: now.saturating_sub(h.beat_at),
                declared_by: h.declared_by.clone(),
            })
            .collect();
        // Live first; the sort is stable, so by id within each (the map's order).
        rows.sort_by_key(|r| !r.alive);
        rows.truncate(usize::try_from(HOSTS_MAX).unwrap_or(usize::MAX));
        Ok(rows)
    }

    fn tokens(&mut self, scope: &str) -> Result<Vec<TokenRow>, FleetError> {
        let (st, _) = self.open();
        Ok((st.tokens.iter())
            .filter(|((s, _), _)| s == scope)
            .map(|((s, owner), t)| TokenRow {
                scope: s.clone(),
                harness: t.harness.clone(),
                owner: owner.clone(),
                host_id: t.by.host_id.clone(),
                lapsed: t.lapsed,
            })
            .collect())
    }

    fn reconcile(&mut self, scope: &str, owner: &str) -> Result<bool, FleetError> {
        let (mut st, _) = self.open();
        let at = (scope.to_owned(), owner.to_owned());
        if !st.tokens.get(&at).is_some_and(|t| t.lapsed) {
            return Ok(false);
        }
        if let Some(t) = st.tokens.remove(&at) {
            st.free(scope, &t.harness);
        }
        Ok(true)
    }

    fn declarations(&mut self, host_id: &str) -> Result<Vec<(i64, String)>, FleetError> {
        let (st, _) = self.open();
        let id = host_id.to_owned();
        Ok((st.dead.range((id.clone(), i64::MIN)..=(id, i64::MAX)))
            .map(|((_, gen), by)| (*gen, by.clone()))
            .collect())
    }

    fn claims_of(&mut self, host_id: &str) -> Result<Vec<(String, i64)>, FleetError> {
        let (st, _) = self.open();
        let mine = st.runs.iter().filter(|(_, r)| r.by.host_id == host_id);
        let max = usize::try_from(super::CLAIMS_OF_MAX).unwrap_or(usize::MAX);
        Ok(mine
            .take(max)
            .map(|(id, r)| (id.clone(), r.by.gen))
            .collect())
    }

    fn put_token(&mut self, t: &FleetToken) -> Result<i64, FleetError> {
        check_token(t)?;
        let (mut st, _) = self.open();
        if st.bearer.contains_key(&t.hash) {
            return Ok(st.shared_version);
        }
        if st.bearer.len() >= FLEET_TOKENS_MAX {
            return Err(too_many_tokens());
        }
        st.bearer.insert(t.hash.clone(), t.clone());
        st.shared_version += 1;
        Ok(st.shared_version)
    }

    fn revoke_token(&mut self, id: &str) -> Result<(Vec<FleetToken>, i64), FleetError> {
        check_token_id(id)?;
        let (mut st, _) = self.open();
        let gone: Vec<FleetToken> = (st.bearer.values())
            .filter(|t| t.hash.starts_with(id))
            .cloned()
            .collect();
        for t in &gone {
            st.bearer.remove(&t.hash);
        }
        if !gone.is_empty() {
            st.shared_version += 1;
        }
        Ok((gone, st.shared_version))
    }

    fn set_drain(
        &mut self,
        d: Option<&FleetDrain>,
    ) -> Result<(Option<FleetDrain>, i64), FleetError> {
        check_drain(d)?;
        let (mut st, _) = self.open();
        let changed = match d {
            Some(d) if st.drain.is_none() => Some(d.clone()),
            None if st.drain.is_some() => None,
            _ => return Ok((st.drain.clone(), st.shared_version)),
        };
        st.drain = changed;
        st.shared_version += 1;
        Ok((st.drain.clone(), st.shared_version))
    }

    fn shared(&mut self, since: i64) -> Result<Option<Shared>, FleetError> {
        let (st, _) = self.open();
        if st.shared_version == since {
            return Ok(None);
        }
        let controls = (st.controls.iter())
            .filter_map(|(scope, &(control, generation))| {
                let mut of_scope = st.receipts.iter();
                let (_, last) =
                    of_scope.find(|((s, _), r)| s == scope && r.generation == generation)?;
                Some(FleetScopeControl {
                    scope: scope.clone(),
                    control,
                    generation,
                    last: last.clone(),
                })
            })
            .collect();
        Ok(Some(Shared {
            version: st.shared_version,
            drain: st.drain.clone(),
            tokens: st.bearer.values().cloned().collect(),
            controls,
            evidence: st.evidence.values().cloned().collect(),
        }))
    }

    fn put_evidence(&mut self, e: &FleetEvidence) -> Result<i64, FleetError> {
        check_evidence(e)?;
        let (mut st, _) = self.open();
        let valid = FleetEvidence {
            valid: true,
            ..e.clone()
        };
        match st.evidence.get(&e.project) {
            Some(now) if *now == valid => return Ok(st.shared_version),
            None if st.evidence.len() >= FLEET_EVIDENCE_MAX => return Err(too_much_evidence()),
            _ => {}
        }
        st.evidence.insert(e.project.clone(), valid);
        st.shared_version += 1;
        Ok(st.shared_version)
    }

    fn invalidate_evidence(
        &mut self,
        project: &str,
        fingerprint: &str,
        commit: Option<&str>,
    ) -> Result<i64, FleetError> {
        let (mut st, _) = self.open();
        let hit = st
            .evidence
            .get_mut(project)
            .filter(|e| e.valid && e.fingerprint == fingerprint && e.commit.as_deref() == commit);
        if let Some(e) = hit {
            e.valid = false;
            st.shared_version += 1;
        }
        Ok(st.shared_version)
    }

    fn control_scope(
        &mut self,
        r: &ScopeControlRequest,
        host_id: &str,
    ) -> Result<(ControlOutcome, i64), FleetError> {
        check_control(r)?;
        let (mut st, _) = self.open();
        let now = st.controls.get(&r.scope).copied();
        if now.is_none() && st.controls.len() >= FLEET_SCOPES_MAX {
            return Err(too_many_scopes());
        }
        let at = (r.scope.clone(), r.request_id.clone());
        let earlier = st.receipts.get(&at).cloned();
        let receipt = match decide(now.unwrap_or((Control::Open, 0)), earlier, r, host_id) {
            Ok(receipt) => receipt,
            Err(answer) => return Ok((answer, st.shared_version)),
        };
        let g = receipt.generation;
        st.controls.insert(r.scope.clone(), (receipt.control, g));
        st.receipts.insert(at, receipt.clone());
        let old = FLEET_RECEIPTS_MAX as u64;
        st.receipts
            .retain(|(s, _), x| s != &r.scope || x.generation + old > g);
        st.shared_version += 1;
        Ok((ControlOutcome::Accepted(receipt), st.shared_version))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::conformance::CHECKS;
    use crate::fleet::{SqliteFleet, TokenClaim, LOAD_BYTES_MAX};
    use std::collections::BTreeSet;

    /// Every conformance check, each on a fresh store; `open` hands out clones of it
    /// (other connections to the same database).
    #[test]
    fn conformance_suite_on_mem() {
        for (name, check) in CHECKS {
            eprintln!("mem: {name}");
            let store = MemFleet::new();
            check(&|| Box::new(store.clone()) as Box<dyn FleetStore>);
        }
    }

    fn info(id: &str) -> HostInfo {
        HostInfo {
            host_id: id.into(),
            address: format!("http://{id}"),
            version: "test".into(),
        }
    }

    /// A lapse by the simulator's clock alone: no real time passes.
    #[test]
    fn the_virtual_clock_drives_lapses() {
        let clock = Arc::new(AtomicU64::new(1_000));
        let mut s = MemFleet::with_clock(clock.clone());
        let a = s.register(&info("a")).unwrap().0;
        let b = s.register(&info("b")).unwrap().0;
        let c_gen = s.register(&info("c")).unwrap().0;
        let token = TokenClaim {
            scope: "exp".into(),
            harness: "h".into(),
            limit: 1,
        };
        let mut c = Claim {
            run_id: "rb".into(),
            host_id: "b".into(),
            gen: b,
            token: Some(token),
            keys: vec!["db".into()],
        };
        assert!(matches!(s.claim(&c), Ok(ClaimOutcome::Taken { .. })));
        clock.store(6_000, Ordering::SeqCst);
        assert!(s.heartbeat("a", a, "{}").unwrap());
        assert!(s.heartbeat("c", c_gen, "{}").unwrap());
        let ages: Vec<(String, i64)> = (s.hosts().unwrap().into_iter())
            .map(|h| (h.host_id, h.beat_age_ms))
            .collect();
        assert_eq!(
            ages,
            [("a".into(), 0), ("b".into(), 5_000), ("c".into(), 0)]
        );
        // Exactly `lapse_ms` old is not older than it; one more millisecond is, and
        // only for the host that stopped beating.
        assert!(s.declare_dead("a", 5_000).unwrap().is_empty());
        clock.store(6_001, Ordering::SeqCst);
        let mut other = s.clone();
        assert_eq!(other.declare_dead("a", 5_000).unwrap(), [("b".into(), b)]);
        assert!(s.declare_dead("a", 5_000).unwrap().is_empty());
        assert_eq!(s.declarations("b").unwrap(), [(b, "a".to_string())]);
        assert!(!s.heartbeat("b", b, "{}").unwrap());
        let t = s.tokens("exp").unwrap();
        assert!(t.len() == 1 && t[0].lapsed, "{t:?}");
        // Its key is free for the living.
        (c.run_id, c.host_id, c.gen, c.token) = ("ra".into(), "a".into(), a, None);
        assert!(matches!(s.claim(&c), Ok(ClaimOutcome::Taken { .. })));
        let hosts = s.hosts().unwrap();
        assert_eq!(hosts[2].declared_by.as_deref(), Some("a"));
    }

    /// A tiny xorshift64* (berth-sim is not a dependency of this crate).
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n
        }
        fn name(&mut self, prefix: &str, n: u64) -> String {
            format!("{prefix}{}", self.below(n))
        }
    }

    const HOSTS: [&str; 3] = ["a", "b", "c"];
    /// Run ids the operations pick from: few, so that they collide.
    const RUNS: u64 = 12;
    /// Lapses that do not depend on time, since SQLite's clock cannot be driven: every
    /// other live host (an hour ahead of any heartbeat), or none.
    const LAPSE_ALL: i64 = -3_600_000;
    const LAPSE_NONE: i64 = i64::MAX;

    fn random_claim(r: &mut Rng, run_id: String, host: &str, gen: i64) -> Claim {
        let n = if r.below(40) == 0 { 17 } else { r.below(3) };
        let token = (r.below(3) != 0).then(|| TokenClaim {
            scope: r.name("s", 2),
            harness: r.name("h", 2),
            limit: [2, 2, 2, 3, 0][r.below(5) as usize],
        });
        let keys = (0..n).map(|_| r.name("k", 6)).collect();
        let host_id = host.to_owned();
        Claim {
            run_id,
            host_id,
            gen,
            token,
            keys,
        }
    }

    /// The hosts without their ages (the two stores' clocks differ).
    fn hosts(s: &mut dyn FleetStore) -> String {
        let rows = s.hosts().map(|mut rows| {
            rows.iter_mut().for_each(|r| r.beat_age_ms = 0);
            rows
        });
        format!("{rows:?}")
    }

    /// One random operation on `s`, spelled out with its answer: both stores are given
    /// the same `r`, so they are asked the same. A declaration's hosts are sorted
    /// (their order is not promised).
    fn step(r: &mut Rng, gens: &mut [i64; 3], s: &mut dyn FleetStore) -> String {
        let run = r.below(RUNS);
        // A run id is mostly claimed, refenced and ended by "its" host.
        let h = if r.below(5) == 0 { r.below(3) } else { run % 3 } as usize;
        let (run, host) = (format!("r{run}"), HOSTS[h]);
        let gen = gens[h] + [0, 0, 0, 0, -1, 1][r.below(6) as usize];
        match r.below(24) {
            0 => {
                let got = s.register(&info(host));
                if let Ok((g, _)) = got {
                    gens[h] = g;
                }
                format!("register {host} -> {got:?}")
            }
            1 | 2 => {
                let big = r.below(30) == 0;
                let load = if big {
                    "x".repeat(LOAD_BYTES_MAX + 1)
                } else {
                    r.name("n", 9)
                };
                format!("beat {host}/{gen} -> {:?}", s.heartbeat(host, gen, &load))
            }
            3 => {
                let lapse = if r.below(3) == 0 {
                    LAPSE_ALL
                } else {
                    LAPSE_NONE
                };
                let got = s.declare_dead(host, lapse).map(|mut d| {
                    d.sort();
                    d
                });
                format!("declare {host} {lapse} -> {got:?}")
            }
            4..=10 => {
                let c = random_claim(r, run, host, gen);
                format!("{c:?} -> {:?}", s.claim(&c))
            }
            11 => format!(
                "refence {run} {host}/{gen} -> {:?}",
                s.refence(&run, host, gen)
            ),
            12..=15 => {
                let how = [Ending::Lapsed, Ending::Released, Ending::Released][r.below(3) as usize];
                let got = s.end(&run, host, gen, how);
                format!("end {run} {host}/{gen} {how:?} -> {got:?}")
            }
            16 | 17 => {
                let fence = if r.below(40) == 0 {
                    u64::MAX
                } else {
                    r.below(8)
                };
                let (gen, run_id, key) = (r.name("g", 3), r.name("r", 3), r.name("t", 3));
                let o = ThreadOwner { gen, fence, run_id };
                format!(
                    "thread {key} {o:?} {host} -> {:?}",
                    s.thread_owner(&key, &o, host)
                )
            }
            18 => format!("fence {run} -> {:?}", s.fence(&run)),
            19 | 20 => {
                let scope = r.name("s", 2);
                let got = if r.below(2) == 0 {
                    format!("{:?}", s.tokens(&scope))
                } else {
                    format!("{:?}", s.reconcile(&scope, &run))
                };
                format!("tokens/reconcile {scope} {run} -> {got}")
            }
            _ => format!("hosts -> {}", hosts(s)),
        }
    }

    /// Everything a store shows at the end.
    fn snapshot(s: &mut dyn FleetStore) -> Vec<String> {
        let mut out = vec![hosts(s)];
        out.extend(["s0", "s1"].map(|sc| format!("{:?}", s.tokens(sc))));
        out.extend((0..RUNS).map(|i| format!("{:?}", s.fence(&format!("r{i}")))));
        out.extend(HOSTS.map(|h| format!("{:?}", s.declarations(h))));
        out
    }

    /// A fresh SqliteFleet (in `dir`) and a fresh MemFleet, for a check run on both.
    fn sqlite_and_mem(dir: &std::path::Path) -> [Box<dyn FleetStore>; 2] {
        let path = dir.join("fleet.db").to_string_lossy().into_owned();
        [
            Box::new(SqliteFleet::open(&path).unwrap()),
            Box::new(MemFleet::new()),
        ]
    }

    /// Issue 38 Build 3: the fleet keeps at most `FLEET_TOKENS_MAX` bearer tokens, on
    /// both stores; one past it is refused and changes nothing, a retry of one kept is
    /// not refused.
    #[test]
    fn the_fleet_token_bound_holds() {
        let dir = tempfile::tempdir().unwrap();
        for mut s in sqlite_and_mem(dir.path()) {
            let tok = |i: usize| FleetToken {
                hash: format!("{i:064x}"),
                grant: "read".into(),
                host_id: "a".into(),
            };
            for i in 0..FLEET_TOKENS_MAX {
                s.put_token(&tok(i)).unwrap();
            }
            let full = s.shared(-1).unwrap().unwrap();
            assert_eq!(full.tokens.len(), FLEET_TOKENS_MAX);
            let refused = s.put_token(&tok(FLEET_TOKENS_MAX));
            assert!(matches!(refused, Err(FleetError::Invalid(ref e)) if e.contains("at most")));
            assert_eq!(s.put_token(&tok(7)).unwrap(), full.version);
            assert_eq!(s.shared(full.version).unwrap(), None);
        }
    }

    /// Issue 38 Build 3, the other bounds, on both stores: evidence of at most
    /// `FLEET_EVIDENCE_MAX` projects and the control of at most `FLEET_SCOPES_MAX`
    /// scopes (one more new one refused, naming the bound; a kept one still changes),
    /// and `FLEET_RECEIPTS_MAX` receipts per scope (the newest retry still gets its
    /// receipt; one older than that is taken as a new request).
    #[test]
    fn the_fleet_evidence_scope_and_receipt_bounds_hold() {
        use berth_core::scopes::Mode;
        let dir = tempfile::tempdir().unwrap();
        for mut s in sqlite_and_mem(dir.path()) {
            let proof = |i: usize, commit: &str| FleetEvidence {
                project: format!("p{i}"),
                fingerprint: "f".into(),
                commit: Some(commit.into()),
                ports: Vec::new(),
                run_id: format!("r{i}"),
                host_id: "a".into(),
                valid: true,
            };
            for i in 0..FLEET_EVIDENCE_MAX {
                s.put_evidence(&proof(i, "c1")).unwrap();
            }
            let refused = s.put_evidence(&proof(FLEET_EVIDENCE_MAX, "c1"));
            assert!(matches!(refused, Err(FleetError::Invalid(ref e)) if e.contains("at most")));
            s.put_evidence(&proof(3, "c2")).unwrap();
            let shared = s.shared(-1).unwrap().unwrap();
            assert_eq!(shared.evidence.len(), FLEET_EVIDENCE_MAX);
            assert!(shared
                .evidence
                .iter()
                .any(|e| e.project == "p3" && e.commit.as_deref() == Some("c2")));

            let ask = |scope: String, id: String, mode| ScopeControlRequest {
                scope,
                request_id: id,
                mode,
            };
            for i in 0..FLEET_SCOPES_MAX {
                let r = ask(format!("s{i}"), "q0".into(), Mode::Pause);
                s.control_scope(&r, "a").unwrap();
            }
            let one_more = ask(format!("s{FLEET_SCOPES_MAX}"), "q0".into(), Mode::Pause);
            let refused = s.control_scope(&one_more, "a");
            assert!(matches!(refused, Err(FleetError::Invalid(ref e)) if e.contains("at most")));
            // Scope s0: past its receipt bound, in turns of resume and pause.
            let mode = |i: usize| {
                if i.is_multiple_of(2) {
                    Mode::Pause
                } else {
                    Mode::Resume
                }
            };
            let mut last = None;
            for i in 1..=FLEET_RECEIPTS_MAX + 1 {
                let r = ask("s0".into(), format!("q{i}"), mode(i));
                last = Some((r.clone(), s.control_scope(&r, "a").unwrap().0));
            }
            let (r, answer) = last.unwrap();
            let generation = |o: &ControlOutcome| match o {
                ControlOutcome::Accepted(rec) => rec.generation,
                other => panic!("not accepted: {other:?}"),
            };
            let top = generation(&answer);
            assert_eq!(
                s.control_scope(&r, "a").unwrap().0,
                answer,
                "the newest retry"
            );
            // q1 is older than the receipts kept: taken as a new request, it makes a
            // new generation (kept, it would answer with its old receipt).
            let old = ask("s0".into(), "q1".into(), Mode::Resume);
            assert_eq!(generation(&s.control_scope(&old, "a").unwrap().0), top + 1);
        }
    }

    /// The same random operations on MemFleet and on SqliteFleet get the same answers.
    #[test]
    fn mem_answers_as_sqlite_does() {
        const SEEDS: u64 = 4;
        const OPS: usize = 400;
        let mut seen = String::new();
        for seed in 1..=SEEDS {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("fleet.db").to_string_lossy().into_owned();
            let mut sql = SqliteFleet::open(&path).unwrap();
            let mut mem = MemFleet::new();
            for h in HOSTS {
                let want = sql.register(&info(h)).unwrap();
                assert_eq!(mem.register(&info(h)).unwrap(), want);
            }
            let mut r = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            let mut gens = [1; 3];
            for i in 0..OPS {
                let mut sql_gens = gens;
                let want = step(&mut Rng(r.0), &mut sql_gens, &mut sql);
                let got = step(&mut r, &mut gens, &mut mem);
                assert_eq!(got, want, "seed {seed}, operation {i}");
                seen.push_str(&got);
                seen.push('\n');
            }
            assert_eq!(snapshot(&mut mem), snapshot(&mut sql), "seed {seed}");
        }
        // The operations reached every answer worth comparing.
        let answers = [
            "Ok(Taken",
            "Ok(RunIdTaken",
            "Ok(BudgetFull",
            "Ok(BudgetConflict",
            "Ok(TokenLapsed",
            "Ok(KeyHeld",
            "Ok(HostDead",
            "Err(Invalid",
            "Ok([(\"",
            "false))",
            "Ok(Some(ThreadOwner",
            "Lapsed -> Ok(true)",
            "-> Ok(Some(FleetFence",
        ];
        let missing: BTreeSet<_> = answers.iter().filter(|a| !seen.contains(*a)).collect();
        assert!(missing.is_empty(), "never answered: {missing:?}");
    }
}
