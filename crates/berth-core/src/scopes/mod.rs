//! Experiment budgets (B1–B5) as a pure state machine: scopes with a frozen per-harness
//! policy, idempotent token reservations keyed by (owner, operation id), and the
//! pause/stop/resume control with its gap-free generation and receipts.
//!
//! Nothing here reads a clock or touches a file: time comes in as an argument. The
//! engine owns one [`Scopes`]: a run's claim asks [`Scopes::blocked`] for its token and
//! [`Scopes::reserve`]s it in the step that grants the run (A1: all or nothing).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::units::TimeMs;

mod error;
mod rules;
mod scope;

pub use error::*;
pub use rules::*;
pub use scope::*;

/// The keys `owner` holds in `s`: a range of the ordered map, not a walk of it.
fn owner_keys(s: &Scope, owner: &str) -> Vec<(String, String)> {
    let from = (owner.to_string(), String::new());
    s.tokens
        .range(from..)
        .take_while(|((o, _), _)| o == owner)
        .map(|(k, _)| k.clone())
        .collect()
}

/// What a reservation did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reserved {
    New,
    /// The same (owner, operation) again: the same token, nothing more taken (B2).
    Existing,
}

/// Every scope the host knows.
#[derive(Clone, Debug, Default)]
pub struct Scopes {
    scopes: BTreeMap<String, Scope>,
    /// Tokens held across all scopes (derived; `TOKENS_HOST_MAX` bounds it).
    total: usize,
    /// Scopes per owning uid (derived; `SCOPES_PER_UID_MAX` bounds each).
    per_uid: BTreeMap<u32, usize>,
    /// B4 fleet-wide: controls the fleet decided for scopes not used here yet, taken
    /// when they are (at most `PENDING_CONTROLS_MAX`; not kept across a restart: the
    /// host reads the fleet's controls again when it registers).
    pending: BTreeMap<String, Receipt>,
}

/// Fleet controls of scopes not used here that a host holds at most (the fleet
/// store's own bound on controlled scopes).
pub const PENDING_CONTROLS_MAX: usize = 4_096;

impl Scopes {
    pub fn get(&self, id: &str) -> Option<&Scope> {
        self.scopes.get(id)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Scope> {
        self.scopes.values()
    }

    pub fn len(&self) -> usize {
        self.scopes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.scopes.is_empty()
    }

    /// Back from the ledger; the per-harness counts are recounted from the tokens.
    pub fn restore(&mut self, mut s: Scope) {
        s.held.clear();
        let harnesses: Vec<String> = s.tokens.values().map(|t| t.harness.clone()).collect();
        for h in harnesses {
            s.count(&h, true);
        }
        self.total += s.tokens.len();
        s.users = 0;
        self.own(s.owner_uid, true);
        if let Some(old) = self.scopes.insert(s.id.clone(), s) {
            self.total -= old.tokens.len();
            self.own(old.owner_uid, false);
        }
    }

    fn own(&mut self, uid: Option<u32>, up: bool) {
        let Some(uid) = uid else { return };
        let n = self.per_uid.entry(uid).or_insert(0);
        if up {
            *n += 1;
        } else {
            *n -= 1;
        }
        if *n == 0 {
            self.per_uid.remove(&uid);
        }
    }

    /// A run naming scope `id` came (`up`) or ended, at `now`.
    pub fn count_user(&mut self, id: &str, up: bool, now: TimeMs) {
        if let Some(s) = self.scopes.get_mut(id) {
            if up {
                s.users += 1;
            } else {
                s.users -= 1;
            }
            s.touched_ms = s.touched_ms.max(now);
        }
    }

    /// Forgets every scope idle (nothing holds it) and untouched for `idle_ms` as of
    /// `now`; returns their ids. At most `SCOPES_MAX` looked at: cheap, and done at
    /// most once a minute by the engine.
    pub fn prune_idle(&mut self, now: TimeMs, idle_ms: u64) -> Vec<String> {
        let gone: Vec<String> = self
            .scopes
            .values()
            .filter(|s| s.is_idle() && now.saturating_sub(s.touched_ms) >= idle_ms)
            .map(|s| s.id.clone())
            .collect();
        for id in &gone {
            self.forget(id);
        }
        gone
    }

    /// An operator forgets an idle scope now (its frozen policy with it: the next run
    /// naming it freezes a new one). Refused while anything holds it.
    pub fn delete(&mut self, id: &str) -> Result<(), ScopeError> {
        let s = self.scopes.get(id).ok_or_else(|| no_scope(id))?;
        let why = if s.users > 0 {
            format!("{} runs not yet ended name it", s.users)
        } else if !s.tokens.is_empty() {
            format!("{} tokens are held", s.tokens.len())
        } else if s.control != Control::Open || !s.receipts.is_empty() {
            format!(
                "it has a control state ({}, generation {}): B4's receipts are kept",
                s.control.as_str(),
                s.generation
            )
        } else {
            self.forget(id);
            return Ok(());
        };
        Err(ScopeError::Busy {
            scope: id.into(),
            why,
        })
    }

    fn forget(&mut self, id: &str) {
        if let Some(s) = self.scopes.remove(id) {
            debug_assert!(s.tokens.is_empty());
            self.own(s.owner_uid, false);
        }
    }

    /// B1: whether `freeze` would accept this (nothing changes).
    pub fn check_freeze(
        &self,
        id: &str,
        given: Option<&Policy>,
        manifest: Option<&Manifest>,
        owner: Option<u32>,
    ) -> Result<(), ScopeError> {
        check_scope_id(id)?;
        if let Some(m) = manifest {
            check_manifest(m)?;
        }
        match (self.scopes.get(id), given) {
            (Some(s), Some(g)) if s.policy != *g => Err(ScopeError::PolicyConflict {
                scope: id.into(),
                frozen: s.policy.clone(),
                given: g.clone(),
            }),
            (Some(s), _) => match manifest {
                Some(m) if s.manifest.as_ref() != Some(m) => Err(ScopeError::ManifestChanged {
                    scope: id.into(),
                    frozen: s.manifest.clone().map(Box::new),
                    given: Box::new(m.clone()),
                }),
                _ => Ok(()),
            },
            (None, None) => Err(ScopeError::Invalid {
                field: "per_harness",
                rule: format!("is required the first time scope {id} is used"),
            }),
            (None, Some(_)) if self.scopes.len() >= SCOPES_MAX => {
                Err(ScopeError::TooMany { max: SCOPES_MAX })
            }
            (None, Some(_))
                if owner.is_some_and(|u| {
                    self.per_uid.get(&u).copied().unwrap_or(0) >= SCOPES_PER_UID_MAX
                }) =>
            {
                Err(ScopeError::Quota {
                    uid: owner.expect("checked"),
                    max: SCOPES_PER_UID_MAX,
                })
            }
            (None, Some(g)) => check_policy(g),
        }
    }

    /// B1: the scope's policy (and manifest), frozen at its first use. `given` must
    /// match it whenever it is given, and is required the first time. True if this
    /// froze a new scope.
    pub fn freeze(
        &mut self,
        id: &str,
        given: Option<&Policy>,
        manifest: Option<&Manifest>,
        owner: Option<u32>,
        now: TimeMs,
    ) -> Result<bool, ScopeError> {
        self.check_freeze(id, given, manifest, owner)?;
        if self.scopes.contains_key(id) {
            return Ok(false);
        }
        let policy = given.expect("check_freeze requires it").clone();
        let mut s = Scope::new(id, policy, manifest.cloned());
        s.owner_uid = owner;
        s.touched_ms = now;
        self.own(owner, true);
        self.scopes.insert(id.into(), s);
        Ok(true)
    }

    /// B5 and the limits, without allocating: why a new token of `harness` cannot be
    /// taken in `s` now. The one statement of these rules: `blocked` (a run's claim)
    /// and `can_take` (a turn's reservation) both ask it.
    fn new_token_block(&self, s: &Scope, harness: &str) -> Option<Block> {
        match s.control {
            Control::Stopped => return Some(Block::Stopped),
            Control::Paused => return Some(Block::Paused),
            Control::Open => {}
        }
        let limit = s.policy.get(harness).copied().unwrap_or(0);
        let holders = s.holders(harness) as u32;
        if holders >= limit {
            return Some(Block::Full { limit, holders });
        }
        (self.total >= TOKENS_HOST_MAX).then_some(Block::HostFull)
    }

    /// Why `owner`/`operation` cannot take a token of `harness` now. A key that already
    /// holds one of that harness needs no new token (B2), but a paused or stopped scope
    /// admits nothing.
    pub fn blocked(&self, id: &str, harness: &str, owner: &str, operation: &str) -> Option<Block> {
        let Some(s) = self.scopes.get(id) else {
            return Some(Block::Stopped);
        };
        if s.control != Control::Open {
            return self.new_token_block(s, harness);
        }
        match s.tokens.get(&(owner.to_string(), operation.to_string())) {
            Some(t) if t.harness == harness => None,
            Some(_) => Some(Block::Conflict),
            None => self.new_token_block(s, harness),
        }
    }

    /// Whether a new token of `harness` may be taken in scope `id` now (B5, the limit):
    /// `Ok` or the reason a run waits (or, once stopped, is refused).
    pub fn can_take(&self, id: &str, harness: &str) -> Result<(), ScopeError> {
        let s = self.scopes.get(id).ok_or_else(|| no_scope(id))?;
        if !s.policy.contains_key(harness) {
            return Err(ScopeError::UnknownHarness {
                scope: id.into(),
                harness: harness.into(),
            });
        }
        let scope = || id.to_string();
        match self.new_token_block(s, harness) {
            None => Ok(()),
            Some(Block::Stopped) => Err(ScopeError::Stopped { scope: scope() }),
            Some(Block::Paused) => Err(ScopeError::Paused { scope: scope() }),
            Some(Block::Full { limit, holders }) => Err(ScopeError::Full {
                scope: scope(),
                harness: harness.into(),
                limit,
                holders: holders as usize,
            }),
            // (`new_token_block` never names a key's conflict: that is `blocked`'s.)
            Some(Block::HostFull | Block::Conflict) => Err(ScopeError::TokensFull {
                max: TOKENS_HOST_MAX,
            }),
        }
    }

    /// B2: the token `owner` holds for `operation`, if any.
    pub fn token(&self, id: &str, owner: &str, operation: &str) -> Option<&Token> {
        self.scopes
            .get(id)?
            .tokens
            .get(&(owner.to_string(), operation.to_string()))
    }

    /// B2: reserves a token keyed by (owner, operation). A retry gets the same one and
    /// takes nothing more; the same key with another harness is refused.
    pub fn reserve(
        &mut self,
        now: TimeMs,
        id: &str,
        owner: &str,
        operation: &str,
        harness: &str,
        run_id: Option<&str>,
    ) -> Result<Reserved, ScopeError> {
        let key = (owner.to_string(), operation.to_string());
        if let Some(t) = self.scopes.get(id).and_then(|s| s.tokens.get(&key)) {
            if t.harness != harness {
                return Err(ScopeError::ReservationConflict {
                    scope: id.into(),
                    held: t.harness.clone(),
                    given: harness.into(),
                });
            }
            return Ok(Reserved::Existing);
        }
        self.can_take(id, harness)?;
        let s = self.scopes.get_mut(id).expect("can_take found it");
        s.tokens.insert(
            key,
            Token {
                harness: harness.into(),
                run_id: run_id.map(str::to_string),
                since_ms: now,
                owner_lapsed: false,
            },
        );
        s.count(harness, true);
        s.touched_ms = s.touched_ms.max(now);
        self.total += 1;
        Ok(Reserved::New)
    }

    /// A run takes back the token its key already holds (B2: a retry reuses it): it is
    /// the run's now, and its owner is no longer lapsed.
    pub fn adopt(&mut self, id: &str, owner: &str, operation: &str, run_id: &str) {
        let key = (owner.to_string(), operation.to_string());
        if let Some(t) = self.scopes.get_mut(id).and_then(|s| s.tokens.get_mut(&key)) {
            t.run_id = Some(run_id.to_string());
            t.owner_lapsed = false;
        }
    }

    /// Something came to or left scope `id` at `now`: its idle window starts again.
    pub fn touch(&mut self, id: &str, now: TimeMs) {
        if let Some(s) = self.scopes.get_mut(id) {
            s.touched_ms = s.touched_ms.max(now);
        }
    }

    /// B3: the owner gives its token back (the only way, with `reconcile`).
    pub fn release(&mut self, id: &str, owner: &str, operation: &str) -> Result<Token, ScopeError> {
        let key = (owner.to_string(), operation.to_string());
        let s = self.scopes.get_mut(id);
        let t = s
            .and_then(|s| {
                let t = s.tokens.remove(&key)?;
                s.count(&t.harness, false);
                Some(t)
            })
            .inspect(|_| self.total -= 1)
            .ok_or_else(|| ScopeError::NotFound {
                what: format!("reservation {owner}/{operation} in scope {id}"),
            })?;
        Ok(t)
    }

    /// B3: an operator frees every token `owner` holds in the scope; returns them with
    /// their operation ids.
    pub fn reconcile(&mut self, id: &str, owner: &str) -> Result<Vec<(String, Token)>, ScopeError> {
        let s = self.scopes.get_mut(id).ok_or_else(|| no_scope(id))?;
        let keys = owner_keys(s, owner);
        let mut out = Vec::with_capacity(keys.len());
        for k in keys {
            if let Some(t) = s.tokens.remove(&k) {
                s.count(&t.harness, false);
                self.total -= 1;
                out.push((k.1, t));
            }
        }
        Ok(out)
    }

    /// The operations `owner` holds tokens for in scope `id`, in order.
    pub fn owner_operations(&self, id: &str, owner: &str) -> Vec<(String, Token)> {
        match self.scopes.get(id) {
            Some(s) => owner_keys(s, owner)
                .into_iter()
                .map(|k| {
                    let t = s.tokens[&k].clone();
                    (k.1, t)
                })
                .collect(),
            None => Vec::new(),
        }
    }

    /// B3: `owner`'s lease lapsed: its tokens in scope `id` stay held, marked
    /// `owner_lapsed`. Returns the operations newly marked.
    pub fn lapse_owner(&mut self, id: &str, owner: &str) -> Vec<String> {
        let Some(s) = self.scopes.get_mut(id) else {
            return Vec::new();
        };
        let mut marked = Vec::new();
        for k in owner_keys(s, owner) {
            if let Some(t) = s.tokens.get_mut(&k) {
                if !t.owner_lapsed {
                    t.owner_lapsed = true;
                    marked.push(k.1);
                }
            }
        }
        marked
    }

    /// B4: a control request. The same request id again returns its receipt; with
    /// another mode it is refused. `pause` never weakens `stop`, `resume` clears only a
    /// pause, and `stop` is terminal. Each accepted request bumps the generation by one.
    pub fn control(
        &mut self,
        now: TimeMs,
        id: &str,
        request_id: &str,
        mode: Mode,
    ) -> Result<Receipt, ScopeError> {
        if request_id.is_empty() || request_id.len() > REQUEST_ID_MAX {
            return Err(ScopeError::Invalid {
                field: "request_id",
                rule: format!("must be 1 to {REQUEST_ID_MAX} characters"),
            });
        }
        let s = self.scopes.get_mut(id).ok_or_else(|| no_scope(id))?;
        if let Some(r) = s.receipts.iter().find(|r| r.request_id == request_id) {
            if r.mode != mode {
                return Err(ScopeError::ControlConflict {
                    scope: id.into(),
                    request_id: request_id.into(),
                    accepted: r.mode,
                });
            }
            return Ok(r.clone());
        }
        let next = match (s.control, mode) {
            (Control::Stopped, Mode::Pause | Mode::Resume) => {
                return Err(ScopeError::Stopped { scope: id.into() })
            }
            (_, Mode::Stop) => Control::Stopped,
            (_, Mode::Pause) => Control::Paused,
            (_, Mode::Resume) => Control::Open,
        };
        s.control = next;
        s.generation += 1;
        let r = Receipt {
            request_id: request_id.into(),
            mode,
            generation: s.generation,
            control: next,
            at_ms: now,
        };
        s.receipts.push(r.clone());
        if s.receipts.len() > RECEIPTS_MAX {
            s.receipts.remove(0);
        }
        Ok(r)
    }

    /// B4 fleet-wide: takes a control the fleet store decided if it is newer than the
    /// scope's generation; true if it did. A scope not used here yet has it held
    /// until it is ([`Scopes::take_pending`]).
    pub fn mirror(&mut self, id: &str, r: Receipt) -> bool {
        let Some(s) = self.scopes.get_mut(id) else {
            let newer = self
                .pending
                .get(id)
                .is_none_or(|p| p.generation < r.generation);
            let room = self.pending.len() < PENDING_CONTROLS_MAX || self.pending.contains_key(id);
            if newer && room {
                self.pending.insert(id.into(), r);
            }
            return false;
        };
        if r.generation <= s.generation {
            return false;
        }
        s.control = r.control;
        s.generation = r.generation;
        s.receipts.retain(|x| x.request_id != r.request_id);
        s.receipts.push(r);
        if s.receipts.len() > RECEIPTS_MAX {
            s.receipts.remove(0);
        }
        true
    }

    /// The fleet's control of a scope not used here yet, if it has one.
    pub fn pending(&self, id: &str) -> Option<&Receipt> {
        self.pending.get(id)
    }

    /// The fleet's control of a scope this host just started using, if it had one.
    pub fn take_pending(&mut self, id: &str) -> Option<Receipt> {
        self.pending.remove(id)
    }

    /// What must always hold: no harness over its limit, tokens only of the policy's
    /// harnesses, generations equal to the receipts accepted (while none was dropped).
    pub fn check_invariants(&self) -> Result<(), String> {
        if self.scopes.len() > SCOPES_MAX {
            return Err(format!("{} scopes", self.scopes.len()));
        }
        let total: usize = self.scopes.values().map(|s| s.tokens.len()).sum();
        if total != self.total || total > TOKENS_HOST_MAX {
            return Err(format!("{total} tokens held, counted {}", self.total));
        }
        let mut per_uid: BTreeMap<u32, usize> = BTreeMap::new();
        for u in self.scopes.values().filter_map(|s| s.owner_uid) {
            *per_uid.entry(u).or_insert(0) += 1;
        }
        if per_uid != self.per_uid {
            return Err(format!(
                "scopes per uid {per_uid:?}, counted {:?}",
                self.per_uid
            ));
        }
        for s in self.scopes.values() {
            let mut counted: BTreeMap<String, u32> = BTreeMap::new();
            for t in s.tokens.values() {
                *counted.entry(t.harness.clone()).or_insert(0) += 1;
            }
            if counted != s.held {
                return Err(format!(
                    "scope {}: counts {:?}, tokens say {counted:?}",
                    s.id, s.held
                ));
            }
            for (h, &limit) in &s.policy {
                let n = s.holders(h);
                if n > limit as usize {
                    return Err(format!("scope {}: {n} tokens of {h}, limit {limit}", s.id));
                }
            }
            if let Some(t) = s
                .tokens
                .values()
                .find(|t| !s.policy.contains_key(&t.harness))
            {
                return Err(format!("scope {}: a token of unknown {}", s.id, t.harness));
            }
            // Each receipt made a generation, in order, the last one the scope's. (A
            // fleet host mirrors generations decided elsewhere, so it may hold fewer
            // receipts than its generation; a host alone holds one per generation
            // until `RECEIPTS_MAX`.)
            let gens: Vec<u64> = s.receipts.iter().map(|r| r.generation).collect();
            let ordered = gens.windows(2).all(|w| w[0] < w[1]);
            let last_ok = gens.last().is_none_or(|&g| g == s.generation);
            if !ordered || !last_ok || gens.len() as u64 > s.generation {
                return Err(format!(
                    "scope {}: generation {} with receipts of generations {gens:?}",
                    s.id, s.generation
                ));
            }
            if s.tokens.len() > TOKENS_MAX {
                return Err(format!("scope {}: {} tokens", s.id, s.tokens.len()));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
