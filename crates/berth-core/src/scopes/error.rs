//! Why a token cannot be taken now (`Block`) and why a budget request is refused
//! (`ScopeError`), each with its stable code and its message.

use super::*;

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
pub(super) fn show_policy(p: &Policy) -> String {
    let parts: Vec<String> = p.iter().map(|(h, n)| format!("{h}={n}")).collect();
    parts.join(",")
}

pub(super) fn no_scope(id: &str) -> ScopeError {
    ScopeError::NotFound {
        what: format!("scope {id}"),
    }
}
