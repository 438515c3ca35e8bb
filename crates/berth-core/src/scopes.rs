//! Experiment budgets (B1–B5) as a pure state machine: scopes with a frozen per-harness
//! policy, idempotent token reservations keyed by (owner, operation id), and the
//! pause/stop/resume control with its gap-free generation and receipts.
//!
//! Nothing here reads a clock or touches a file: time comes in as an argument. Not yet
//! wired into the daemon (issue "Experiment budgets"); the engine's claim will ask
//! [`Scopes::can_take`] for a run's token and [`Scopes::reserve`] it in the same step.

use std::collections::BTreeMap;

use crate::types::TimeMs;

/// A harness limit's range (B1).
pub const HARNESS_LIMIT_MAX: u32 = 1_024;
/// Harnesses one policy may name: bounds a scope's record.
pub const HARNESSES_MAX: usize = 64;
/// A control request id's length (B4).
pub const REQUEST_ID_MAX: usize = 256;
/// Receipts a scope remembers (B4): a retry older than this many accepted requests is
/// refused as unknown rather than kept forever.
pub const RECEIPTS_MAX: usize = 1_024;
/// Tokens one scope may hold at once: the sum of its limits is at most
/// `HARNESSES_MAX × HARNESS_LIMIT_MAX`, and this bound is that.
pub const TOKENS_MAX: usize = HARNESSES_MAX * HARNESS_LIMIT_MAX as usize;

/// B1: canonical harness names, `[a-z][a-z0-9_-]*`, at most 64 bytes.
pub fn check_harness(name: &str) -> Result<(), String> {
    let b = name.as_bytes();
    if b.is_empty() || b.len() > 64 {
        return Err("must be 1 to 64 characters".into());
    }
    if !b[0].is_ascii_lowercase() {
        return Err("must start with a lower-case letter".into());
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_' || *c == '-'))
    {
        return Err(format!(
            "may only contain a-z, 0-9, '_' and '-' (found {c:?})"
        ));
    }
    Ok(())
}

/// A scope's frozen policy: a limit per harness (B1).
pub type Policy = BTreeMap<String, u32>;

/// B1: a policy's fields, checked.
pub fn check_policy(p: &Policy) -> Result<(), ScopeError> {
    if p.is_empty() || p.len() > HARNESSES_MAX {
        return Err(ScopeError::Invalid {
            field: "per_harness",
            rule: format!("must name 1 to {HARNESSES_MAX} harnesses"),
        });
    }
    for (name, &limit) in p {
        check_harness(name).map_err(|rule| ScopeError::Invalid {
            field: "per_harness",
            rule: format!("harness {name:?} {rule}"),
        })?;
        if limit == 0 || limit > HARNESS_LIMIT_MAX {
            return Err(ScopeError::Invalid {
                field: "per_harness",
                rule: format!("harness {name}: the limit must be 1 to {HARNESS_LIMIT_MAX}"),
            });
        }
    }
    Ok(())
}

/// B4: what a control request asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Mode {
    Pause,
    Stop,
    Resume,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Pause => "pause",
            Mode::Stop => "stop",
            Mode::Resume => "resume",
        }
    }
}

/// B4/B5: a scope's control state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Control {
    Open,
    Paused,
    /// Terminal: the scope never admits again.
    Stopped,
}

/// B4: the answer to an accepted control request (the same again for its retries).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Receipt {
    pub request_id: String,
    pub mode: Mode,
    /// The scope's generation this request made.
    pub generation: u64,
    /// The state it left the scope in.
    pub control: Control,
    pub at_ms: TimeMs,
}

/// One reserved token (B2): its harness, the run that holds it (if a run's claim took
/// it), since when, and whether its owner's lease lapsed (B3: it stays held).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Token {
    pub harness: String,
    pub run_id: Option<String>,
    pub since_ms: TimeMs,
    pub owner_lapsed: bool,
}

/// One scope.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scope {
    pub id: String,
    pub policy: Policy,
    pub control: Control,
    /// Bumped by exactly one per accepted control request (B4).
    pub generation: u64,
    /// Accepted control requests, oldest first, at most `RECEIPTS_MAX`.
    pub receipts: Vec<Receipt>,
    /// Tokens held, by (owner, operation id).
    pub tokens: BTreeMap<(String, String), Token>,
}

impl Scope {
    /// Tokens held of `harness`.
    pub fn holders(&self, harness: &str) -> usize {
        self.tokens
            .values()
            .filter(|t| t.harness == harness)
            .count()
    }
}

/// Refusals; none changes anything.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ScopeError {
    /// B1: the scope's frozen policy differs.
    PolicyConflict {
        scope: String,
        frozen: Policy,
        given: Policy,
    },
    /// The harness is not in the scope's policy.
    UnknownHarness {
        scope: String,
        harness: String,
    },
    /// B2: the same (owner, operation) already holds a token of another harness.
    ReservationConflict {
        scope: String,
        held: String,
        given: String,
    },
    /// B4: the same request id with another mode.
    ControlConflict {
        scope: String,
        request_id: String,
        accepted: Mode,
    },
    /// B4: `resume` or `pause` of a stopped scope (stop is terminal).
    Stopped {
        scope: String,
    },
    /// B5: no new token while paused.
    Paused {
        scope: String,
    },
    /// The harness is at its limit (the run waits with `budget.full`).
    Full {
        scope: String,
        harness: String,
        limit: u32,
        holders: usize,
    },
    /// No such scope or reservation.
    NotFound {
        what: String,
    },
    Invalid {
        field: &'static str,
        rule: String,
    },
}

impl ScopeError {
    pub fn code(&self) -> &'static str {
        match self {
            ScopeError::PolicyConflict { .. } => "budget_conflict",
            ScopeError::UnknownHarness { .. } => "unknown_harness",
            ScopeError::ReservationConflict { .. } => "reservation_conflict",
            ScopeError::ControlConflict { .. } => "control_conflict",
            ScopeError::Stopped { .. } => "scope_stopped",
            ScopeError::Paused { .. } => "scope_paused",
            ScopeError::Full { .. } => "budget_full",
            ScopeError::NotFound { .. } => "not_found",
            ScopeError::Invalid { .. } => "invalid",
        }
    }
}

fn no_scope(id: &str) -> ScopeError {
    ScopeError::NotFound {
        what: format!("scope {id}"),
    }
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
}

impl Scopes {
    pub fn get(&self, id: &str) -> Option<&Scope> {
        self.scopes.get(id)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Scope> {
        self.scopes.values()
    }

    /// Back from the ledger.
    pub fn restore(&mut self, s: Scope) {
        self.scopes.insert(s.id.clone(), s);
    }

    /// B1: the scope's policy, frozen at its first use. `given` must match it whenever
    /// it is given, and is required the first time.
    pub fn freeze(&mut self, id: &str, given: Option<&Policy>) -> Result<(), ScopeError> {
        if let Err(rule) = crate::validate::run_id(id) {
            return Err(ScopeError::Invalid {
                field: "scope",
                rule,
            });
        }
        match (self.scopes.get(id), given) {
            (Some(s), Some(g)) if s.policy != *g => Err(ScopeError::PolicyConflict {
                scope: id.into(),
                frozen: s.policy.clone(),
                given: g.clone(),
            }),
            (Some(_), _) => Ok(()),
            (None, None) => Err(ScopeError::Invalid {
                field: "per_harness",
                rule: format!("is required the first time scope {id} is used"),
            }),
            (None, Some(g)) => {
                check_policy(g)?;
                self.scopes.insert(
                    id.into(),
                    Scope {
                        id: id.into(),
                        policy: g.clone(),
                        control: Control::Open,
                        generation: 0,
                        receipts: Vec::new(),
                        tokens: BTreeMap::new(),
                    },
                );
                Ok(())
            }
        }
    }

    /// Whether a new token of `harness` may be taken in scope `id` now (B5, the limit):
    /// `Ok` or the reason a run waits (or, once stopped, is refused).
    pub fn can_take(&self, id: &str, harness: &str) -> Result<(), ScopeError> {
        let s = self.scopes.get(id).ok_or_else(|| no_scope(id))?;
        let limit = *s
            .policy
            .get(harness)
            .ok_or_else(|| ScopeError::UnknownHarness {
                scope: id.into(),
                harness: harness.into(),
            })?;
        match s.control {
            Control::Stopped => return Err(ScopeError::Stopped { scope: id.into() }),
            Control::Paused => return Err(ScopeError::Paused { scope: id.into() }),
            Control::Open => {}
        }
        let holders = s.holders(harness);
        if holders >= limit as usize {
            return Err(ScopeError::Full {
                scope: id.into(),
                harness: harness.into(),
                limit,
                holders,
            });
        }
        Ok(())
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
        Ok(Reserved::New)
    }

    /// B3: the owner gives its token back (the only way, with `reconcile`).
    pub fn release(&mut self, id: &str, owner: &str, operation: &str) -> Result<Token, ScopeError> {
        let key = (owner.to_string(), operation.to_string());
        self.scopes
            .get_mut(id)
            .and_then(|s| s.tokens.remove(&key))
            .ok_or_else(|| ScopeError::NotFound {
                what: format!("reservation {owner}/{operation} in scope {id}"),
            })
    }

    /// B3: an operator frees every token `owner` holds in the scope; returns them.
    pub fn reconcile(&mut self, id: &str, owner: &str) -> Result<Vec<Token>, ScopeError> {
        let s = self.scopes.get_mut(id).ok_or_else(|| no_scope(id))?;
        let keys: Vec<_> = s
            .tokens
            .keys()
            .filter(|(o, _)| o == owner)
            .cloned()
            .collect();
        Ok(keys.iter().filter_map(|k| s.tokens.remove(k)).collect())
    }

    /// B3: a run's lease lapsed: its tokens stay held, marked `owner_lapsed`.
    pub fn lapse_run(&mut self, run_id: &str) {
        for s in self.scopes.values_mut() {
            for t in s.tokens.values_mut() {
                if t.run_id.as_deref() == Some(run_id) {
                    t.owner_lapsed = true;
                }
            }
        }
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

    /// What must always hold: no harness over its limit, tokens only of the policy's
    /// harnesses, generations equal to the receipts accepted (while none was dropped).
    pub fn check_invariants(&self) -> Result<(), String> {
        for s in self.scopes.values() {
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
            if s.receipts.len() < RECEIPTS_MAX && s.generation != s.receipts.len() as u64 {
                return Err(format!(
                    "scope {}: generation {} after {} receipts",
                    s.id,
                    s.generation,
                    s.receipts.len()
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
