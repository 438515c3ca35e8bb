//! What a budget request may say: the named limits, ids, harness names, a policy, a
//! manifest and a run's budget, each checked with a refusal that names its field.

use super::*;

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

pub(super) fn check_scope_id(id: &str) -> Result<(), ScopeError> {
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
