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

/// A harness limit's range (B1).
pub const HARNESS_LIMIT_MAX: u32 = 1_024;
/// Harnesses one policy may name: bounds a scope's record.
pub const HARNESSES_MAX: usize = 64;
/// A control request id's length (B4).
pub const REQUEST_ID_MAX: usize = 256;
/// Receipts a scope remembers (B4): a retry older than this many accepted requests is
/// taken as a new request rather than every receipt kept forever. With `SCOPES_MAX`
/// and the 64 KiB body bound on a manifest, it bounds what all scopes hold to about
/// 150 MB, whatever an operator token sends.
pub const RECEIPTS_MAX: usize = 256;
/// Scopes one host remembers: bounds the engine's memory and a listing.
pub const SCOPES_MAX: usize = 1_024;
/// Scopes one uid-bound token's user may have made and not yet forgotten (S10: one
/// tenant cannot fill `SCOPES_MAX` for everyone; issue 32 finding 6).
pub const SCOPES_PER_UID_MAX: usize = 64;
/// Tokens all scopes of a host hold at once: one scope's limits may add up to 65,536,
/// and a hostile operator could fill every scope; past this a run waits
/// (`budget.host_full`) and a turn is refused (`503 budget_tokens_full`).
pub const TOKENS_HOST_MAX: usize = 131_072;
/// A manifest's path, in bytes.
pub const MANIFEST_PATH_MAX: usize = 4_096;
/// Execution ids one manifest may name.
pub const MANIFEST_IDS_MAX: usize = 4_096;
/// An owner's or operation id's length (B2); the run id rule's characters.
pub const OWNER_MAX: usize = 128;
/// The operation a run's own token is reserved under when its budget names none.
pub const RUN_OPERATION: &str = "run";

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

/// B1: the experiment's frozen manifest, attached at a scope's first use.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub path: String,
    /// Lower-case hex SHA-256 of the manifest file.
    pub sha256: String,
    pub execution_ids: Vec<String>,
}

/// B1/B2: what a run's acquire says of its budget. `per_harness` (and `manifest`) are
/// required the first time a scope is used and must match whenever they are given.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Budget {
    pub scope: String,
    pub harness: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operation_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_harness: Option<Policy>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifest: Option<Manifest>,
    /// S9/S10: the uid of the uid-bound token that sends the acquire, set by the daemon
    /// (never from the wire, never stored with the run). A scope this run freezes is
    /// that user's, counted against `SCOPES_PER_UID_MAX`; the engine takes it out before
    /// comparing a retry (L7), so it is no part of the request's identity.
    #[serde(skip)]
    pub tenant: Option<u32>,
}

impl Budget {
    /// The operation the run's token is reserved under (its owner is the run).
    pub fn operation(&self) -> &str {
        self.operation_id.as_deref().unwrap_or(RUN_OPERATION)
    }

    /// Every field's syntax, each refusal naming its field.
    pub fn check(&self) -> Result<(), ScopeError> {
        check_scope_id(&self.scope)?;
        check_harness(&self.harness).map_err(|rule| ScopeError::Invalid {
            field: "budget.harness",
            rule,
        })?;
        if let Some(op) = &self.operation_id {
            check_id("budget.operation_id", op)?;
        }
        if let Some(p) = &self.per_harness {
            check_policy(p)?;
        }
        if let Some(m) = &self.manifest {
            check_manifest(m)?;
        }
        Ok(())
    }
}

/// A scope id, an owner or an operation id: the run id rule (1 to 128 of
/// `[A-Za-z0-9._:-]`), so each is safe in a path, a log line and a ledger key.
pub fn check_id(field: &'static str, id: &str) -> Result<(), ScopeError> {
    crate::validate::run_id(id).map_err(|rule| ScopeError::Invalid { field, rule })
}

fn check_scope_id(id: &str) -> Result<(), ScopeError> {
    check_id("scope", id)
}

/// B1: a manifest's fields, checked.
pub fn check_manifest(m: &Manifest) -> Result<(), ScopeError> {
    let bad = |field: &'static str, rule: String| Err(ScopeError::Invalid { field, rule });
    if m.path.is_empty() || m.path.len() > MANIFEST_PATH_MAX || m.path.contains('\0') {
        return bad(
            "manifest.path",
            format!("must be 1 to {MANIFEST_PATH_MAX} bytes without NUL"),
        );
    }
    if m.sha256.len() != 64
        || !m
            .sha256
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return bad("manifest.sha256", "must be 64 lower-case hex digits".into());
    }
    if m.execution_ids.len() > MANIFEST_IDS_MAX {
        return bad(
            "manifest.execution_ids",
            format!("at most {MANIFEST_IDS_MAX} entries"),
        );
    }
    for id in &m.execution_ids {
        if let Err(rule) = crate::validate::run_id(id) {
            return bad("manifest.execution_ids", format!("{id:?}: {rule}"));
        }
    }
    Ok(())
}

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

// Mode's and Control's words (`as_str`, `FromStr`, serde) are `types.rs`' one codec.

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
    pub manifest: Option<Manifest>,
    pub control: Control,
    /// Bumped by exactly one per accepted control request (B4).
    pub generation: u64,
    /// Accepted control requests, oldest first, at most `RECEIPTS_MAX`.
    pub receipts: Vec<Receipt>,
    /// Tokens held, by (owner, operation id).
    pub tokens: BTreeMap<(String, String), Token>,
    /// Tokens held per harness: derived from `tokens` (recounted by
    /// [`Scopes::restore`], checked by `check_invariants`), so an admission pass asks
    /// for a count without walking the tokens.
    pub held: BTreeMap<String, u32>,
    /// S9: the uid of the uid-bound token whose run froze the scope (`None`: an
    /// unbound token's). Only that user's tokens (or unbound ones) may control,
    /// reconcile or delete it.
    pub owner_uid: Option<u32>,
    /// Runs not yet ended whose claim names this scope (derived: the engine counts
    /// them as runs come and end, and recounts them on restore).
    pub users: u32,
    /// When a run or a token last came to or left the scope (not kept in the ledger: a
    /// restart starts the idle window again, which only ever keeps a scope longer).
    pub touched_ms: TimeMs,
}

impl Scope {
    /// A scope frozen now with this policy and manifest: open, generation 0.
    pub fn new(id: &str, policy: Policy, manifest: Option<Manifest>) -> Scope {
        Scope {
            id: id.into(),
            policy,
            manifest,
            control: Control::Open,
            generation: 0,
            receipts: Vec::new(),
            tokens: BTreeMap::new(),
            held: BTreeMap::new(),
            owner_uid: None,
            users: 0,
            touched_ms: 0,
        }
    }

    /// Nothing holds the scope: no run names it, no token is held, and it was never
    /// paused or stopped (a control state is a promise kept: B4's stop is terminal).
    pub fn is_idle(&self) -> bool {
        self.users == 0
            && self.tokens.is_empty()
            && self.control == Control::Open
            && self.receipts.is_empty()
    }

    /// Tokens held of `harness`.
    pub fn holders(&self, harness: &str) -> usize {
        self.held.get(harness).copied().unwrap_or(0) as usize
    }

    fn count(&mut self, harness: &str, up: bool) {
        let n = self.held.entry(harness.to_string()).or_insert(0);
        if up {
            *n += 1;
        } else {
            *n -= 1;
        }
        if *n == 0 {
            self.held.remove(harness);
        }
    }
}

/// Why a run's token cannot be taken now (rendered into a reason on demand only: an
/// admission pass never formats strings).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Block {
    Paused,
    Stopped,
    Full {
        limit: u32,
        holders: u32,
    },
    /// `TOKENS_HOST_MAX` tokens are held across all scopes.
    HostFull,
    /// The run's key holds a token of another harness (until that one is released).
    Conflict,
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
    /// B1: the scope's frozen manifest differs.
    /// (Boxed: a manifest may name thousands of execution ids.)
    ManifestChanged {
        scope: String,
        frozen: Option<Box<Manifest>>,
        given: Box<Manifest>,
    },
    /// B3: the token is part of a live run's claim: the run's release gives it back.
    InUse {
        scope: String,
        run_id: String,
    },
    /// `SCOPES_MAX` scopes are remembered already.
    TooMany {
        max: usize,
    },
    /// S10: this uid made `SCOPES_PER_UID_MAX` scopes not yet forgotten.
    Quota {
        uid: u32,
        max: usize,
    },
    /// Deleting a scope something still holds (a run, a token or a control state).
    Busy {
        scope: String,
        why: String,
    },
    /// `TOKENS_HOST_MAX` tokens are held across all scopes.
    TokensFull {
        max: usize,
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
            ScopeError::ManifestChanged { .. } => "scope_manifest_changed",
            ScopeError::InUse { .. } => "token_in_use",
            ScopeError::TooMany { .. } => "scopes_full",
            ScopeError::Quota { .. } => "scopes_quota",
            ScopeError::Busy { .. } => "scope_in_use",
            ScopeError::TokensFull { .. } => "budget_tokens_full",
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

impl std::fmt::Display for ScopeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let show = show_policy;
        match self {
            ScopeError::PolicyConflict { scope, frozen, given } => write!(
                f,
                "scope {scope}'s policy is frozen as {{{}}}; this request gives {{{}}} (B1)",
                show(frozen),
                show(given)
            ),
            ScopeError::ManifestChanged { scope, frozen, given } => write!(
                f,
                "scope {scope}'s manifest is frozen as {}; this request gives {} sha256 {} (B1)",
                frozen.as_ref().map_or("none".into(), |m| format!("{} sha256 {}", m.path, m.sha256)),
                given.path,
                given.sha256
            ),
            ScopeError::InUse { scope, run_id } => write!(
                f,
                "this key's token in scope {scope} belongs to live run {run_id}'s claim: the run's release gives it back (B3)"
            ),
            ScopeError::TooMany { max } => write!(f, "berth remembers its maximum of {max} scopes"),
            ScopeError::Quota { uid, max } => write!(
                f,
                "uid {uid} has made {max} scopes, its maximum: an idle one is forgotten after the idle window, or an operator deletes it (S10)"
            ),
            ScopeError::Busy { scope, why } => {
                write!(f, "scope {scope} is not idle ({why}): it is not deleted")
            }
            ScopeError::TokensFull { max } => {
                write!(f, "{max} budget tokens are held on this host, its maximum")
            }
            ScopeError::UnknownHarness { scope, harness } => write!(
                f,
                "budget.harness: {harness} is not in scope {scope}'s policy"
            ),
            ScopeError::ReservationConflict { scope, held, given } => write!(
                f,
                "this (owner, operation_id) holds a {held} token in scope {scope}; it cannot also reserve {given} (B2)"
            ),
            ScopeError::ControlConflict {
                scope,
                request_id,
                accepted,
            } => write!(
                f,
                "request_id {request_id} was accepted for scope {scope} as {}; it cannot mean another mode (B4)",
                accepted.as_str()
            ),
            ScopeError::Stopped { scope } => {
                write!(f, "scope {scope} is stopped: it never admits again (B4)")
            }
            ScopeError::Paused { scope } => {
                write!(f, "scope {scope} is paused: no new token until it resumes (B5)")
            }
            ScopeError::Full {
                scope,
                harness,
                limit,
                holders,
            } => write!(
                f,
                "scope {scope}: {holders} of {limit} {harness} tokens are held"
            ),
            ScopeError::NotFound { what } => write!(f, "{what} is not known"),
            ScopeError::Invalid { field, rule } => write!(f, "{field}: {rule}"),
        }
    }
}

/// A policy as `harness=limit,...`.
fn show_policy(p: &Policy) -> String {
    let parts: Vec<String> = p.iter().map(|(h, n)| format!("{h}={n}")).collect();
    parts.join(",")
}

fn no_scope(id: &str) -> ScopeError {
    ScopeError::NotFound {
        what: format!("scope {id}"),
    }
}

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
}

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
