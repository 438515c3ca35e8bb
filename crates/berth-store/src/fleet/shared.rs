//! What every host of a fleet mirrors rather than decides (issue 38 Build 3): the
//! bearer tokens the whole fleet honours and the fleet-wide drain. A host reads them
//! when it registers, at each heartbeat and when another host announces a change
//! (`shared` on [`super::CHANNEL`]); [`super::FleetStore::shared`] answers nothing
//! when nothing changed since the version the host last read, so a heartbeat's read
//! costs one row.

use berth_core::scopes::{Control, Mode};

use super::FleetError;

/// Bearer tokens the fleet keeps at most: operators make a few per team and user; the
/// bound keeps every host's mirror, and a read of the whole set, small.
pub const FLEET_TOKENS_MAX: usize = 1_024;
/// A token's grant text (scope, uid, expiry, as the server writes it) at most.
pub const GRANT_BYTES_MAX: usize = 128;
/// A drain's `by`, `at` and `host_id` at most, each.
pub const DRAIN_FIELD_BYTES_MAX: usize = 256;
/// A drain's reason at most (the server's limit on a host drain's reason).
pub const DRAIN_REASON_BYTES_MAX: usize = 1_024;

/// A bearer token the whole fleet honours: the SHA-256 of its secret, lowercase hex
/// (never the secret), and what it grants, as text the store does not read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FleetToken {
    pub hash: String,
    pub grant: String,
    /// The host it was made on.
    pub host_id: String,
}

/// A drain every host of the fleet honours (G4 fleet-wide): who started it, when (RFC
/// 3339, by the starting host's clock), why, and on which host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FleetDrain {
    pub by: String,
    pub at: String,
    pub reason: String,
    pub host_id: String,
}

/// The fleet's tokens (by hash), its drain and its scopes' controls, as of `version`,
/// which every change of any raises.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shared {
    pub version: i64,
    pub drain: Option<FleetDrain>,
    pub tokens: Vec<FleetToken>,
    /// By scope id.
    pub controls: Vec<FleetScopeControl>,
    /// By project.
    pub evidence: Vec<FleetEvidence>,
}

/// A token row's rules, checked before any SQL runs: a hash as `hash_token` writes
/// it, and bounded text.
pub(crate) fn check_token(t: &FleetToken) -> Result<(), FleetError> {
    let hex = |s: &str| s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    if t.hash.len() != 64 || !hex(&t.hash) {
        return Err(FleetError::Invalid(
            "token hash: must be 64 lowercase hex digits (a SHA-256)".into(),
        ));
    }
    if t.grant.is_empty() || t.grant.len() > GRANT_BYTES_MAX {
        return Err(FleetError::Invalid(format!(
            "token grant: 1 to {GRANT_BYTES_MAX} bytes, got {}",
            t.grant.len()
        )));
    }
    check_field("token host_id", &t.host_id, DRAIN_FIELD_BYTES_MAX)
}

/// A token id (what `revoke_token` takes): the first 16 hex digits of its hash.
pub(crate) fn check_token_id(id: &str) -> Result<(), FleetError> {
    match id.len() == 16 && id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        true => Ok(()),
        false => Err(FleetError::Invalid(
            "token id: must be 16 lowercase hex digits".into(),
        )),
    }
}

/// A drain to start is checked; ending one (`None`) has nothing to check.
pub(crate) fn check_drain(d: Option<&FleetDrain>) -> Result<(), FleetError> {
    let Some(d) = d else { return Ok(()) };
    check_field("drain by", &d.by, DRAIN_FIELD_BYTES_MAX)?;
    check_field("drain at", &d.at, DRAIN_FIELD_BYTES_MAX)?;
    check_field("drain host_id", &d.host_id, DRAIN_FIELD_BYTES_MAX)?;
    check_field("drain reason", &d.reason, DRAIN_REASON_BYTES_MAX)
}

fn check_field(name: &str, v: &str, max: usize) -> Result<(), FleetError> {
    match v.len() <= max {
        true => Ok(()),
        false => Err(FleetError::Invalid(format!(
            "{name}: at most {max} bytes, got {}",
            v.len()
        ))),
    }
}

/// The refusal of a token past [`FLEET_TOKENS_MAX`].
pub(crate) fn too_many_tokens() -> FleetError {
    FleetError::Invalid(format!(
        "tokens: the fleet keeps at most {FLEET_TOKENS_MAX} bearer tokens; revoke some first"
    ))
}

/// The payload announcing a change of tokens or drain on [`super::CHANNEL`].
pub const SHARED_PAYLOAD: &str = "shared";

/// Scopes whose control the fleet remembers at most (a host remembers `SCOPES_MAX`;
/// a fleet of them, a few times that).
pub const FLEET_SCOPES_MAX: usize = 4_096;
/// Receipts the fleet keeps per scope: as a host keeps them (B4; an older retry is
/// taken as a new request).
pub const FLEET_RECEIPTS_MAX: usize = berth_core::scopes::RECEIPTS_MAX;
/// A scope id's length at most (the fleet's budget rows take the same ids).
pub const SCOPE_ID_BYTES_MAX: usize = 128;

/// B4 fleet-wide: pause, stop or resume a scope on every host, idempotent by request
/// id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScopeControlRequest {
    pub scope: String,
    pub request_id: String,
    pub mode: Mode,
}

/// An accepted control request, as every host reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FleetReceipt {
    pub request_id: String,
    pub mode: Mode,
    /// The scope's fleet-wide generation this request made.
    pub generation: u64,
    /// The state it left the scope in.
    pub control: Control,
    /// The host it was asked on.
    pub host_id: String,
}

/// How the fleet answered a control request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ControlOutcome {
    /// Accepted now, or before (a retry gets the same receipt and changes nothing).
    Accepted(FleetReceipt),
    /// The request id was accepted with another mode.
    Conflict { accepted: Mode },
    /// The scope is stopped, which is terminal: pause and resume are refused.
    Stopped,
}

/// A scope's control as the fleet holds it: its state, its generation and the receipt
/// that made them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FleetScopeControl {
    pub scope: String,
    pub control: Control,
    pub generation: u64,
    pub last: FleetReceipt,
}

pub(crate) fn check_control(r: &ScopeControlRequest) -> Result<(), FleetError> {
    if r.scope.is_empty() || r.scope.len() > SCOPE_ID_BYTES_MAX {
        return Err(FleetError::Invalid(format!(
            "scope: 1 to {SCOPE_ID_BYTES_MAX} bytes"
        )));
    }
    let max = berth_core::scopes::REQUEST_ID_MAX;
    if r.request_id.is_empty() || r.request_id.len() > max {
        return Err(FleetError::Invalid(format!("request_id: 1 to {max} bytes")));
    }
    Ok(())
}

/// B4's rules, the same as a host's (`Scopes::control`), for a scope at `now`
/// (control and generation; `Open`, 0 for one never controlled) whose receipt of the
/// same request id is `earlier`: the receipt to write, or the answer that writes
/// nothing.
pub(crate) fn decide(
    now: (Control, u64),
    earlier: Option<FleetReceipt>,
    r: &ScopeControlRequest,
    host_id: &str,
) -> Result<FleetReceipt, ControlOutcome> {
    if let Some(e) = earlier {
        return Err(match e.mode == r.mode {
            true => ControlOutcome::Accepted(e),
            false => ControlOutcome::Conflict { accepted: e.mode },
        });
    }
    let control = match (now.0, r.mode) {
        (Control::Stopped, Mode::Pause | Mode::Resume) => return Err(ControlOutcome::Stopped),
        (_, Mode::Stop) => Control::Stopped,
        (_, Mode::Pause) => Control::Paused,
        (_, Mode::Resume) => Control::Open,
    };
    Ok(FleetReceipt {
        request_id: r.request_id.clone(),
        mode: r.mode,
        generation: now.1 + 1,
        control,
        host_id: host_id.into(),
    })
}

/// [`decide`] for an SQL store, from what it read in the decision's transaction: the
/// scope's row (its control word and generation), how many scopes have one, and the
/// receipt of the same request id. `Err`: refused as input (too many scopes) or a row
/// the store cannot read.
pub(crate) fn decide_read(
    now: Option<(&str, i64)>,
    scopes: i64,
    earlier: Option<Result<FleetReceipt, FleetError>>,
    r: &ScopeControlRequest,
    host_id: &str,
) -> Result<Result<FleetReceipt, ControlOutcome>, FleetError> {
    if now.is_none() && scopes >= FLEET_SCOPES_MAX as i64 {
        return Err(too_many_scopes());
    }
    let now = match now {
        Some((c, g)) => (word::<Control>(c)?, u64::try_from(g).unwrap_or(0)),
        None => (Control::Open, 0),
    };
    Ok(decide(now, earlier.transpose()?, r, host_id))
}

/// A controlled scope as `shared` lists it: its state is the one its last receipt made.
pub(crate) fn control_of(scope: String, last: FleetReceipt) -> FleetScopeControl {
    FleetScopeControl {
        scope,
        control: last.control,
        generation: last.generation,
        last,
    }
}

/// The refusal of a control for a new scope past [`FLEET_SCOPES_MAX`].
pub(crate) fn too_many_scopes() -> FleetError {
    FleetError::Invalid(format!(
        "scope: the fleet remembers the control of at most {FLEET_SCOPES_MAX} scopes"
    ))
}

/// A stored word read back (a row another writer spoiled is the store's fault, not
/// the caller's: unavailable, named).
pub(crate) fn word<T: std::str::FromStr<Err = String>>(s: &str) -> Result<T, FleetError> {
    s.parse()
        .map_err(|e| FleetError::Unavailable(format!("the fleet store holds {e}")))
}

/// Projects whose promotion evidence the fleet keeps at most (C3 fleet-wide).
pub const FLEET_EVIDENCE_MAX: usize = 4_096;
/// A project's name, a fingerprint, a commit, a run id or a port name, at most.
pub const EVIDENCE_FIELD_BYTES_MAX: usize = 256;

/// C3 fleet-wide (issue 38 Build 3): a project's promotion evidence as the fleet keeps
/// it: proven on one host, honoured on every host for runs with the same contract
/// fingerprint and commit; `valid` false once a host found it wrong (C4), which every
/// host that holds the same evidence then drops.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FleetEvidence {
    pub project: String,
    pub fingerprint: String,
    pub commit: Option<String>,
    pub ports: Vec<String>,
    pub run_id: String,
    pub host_id: String,
    pub valid: bool,
}

pub(crate) fn check_evidence(e: &FleetEvidence) -> Result<(), FleetError> {
    let max = EVIDENCE_FIELD_BYTES_MAX;
    check_field("evidence project", &e.project, max)?;
    check_field("evidence fingerprint", &e.fingerprint, max)?;
    check_field("evidence commit", e.commit.as_deref().unwrap_or(""), max)?;
    check_field("evidence run_id", &e.run_id, max)?;
    check_field("evidence host_id", &e.host_id, max)?;
    let ports = berth_core::PORTS_MAX;
    if e.ports.len() > ports || e.ports.iter().any(|p| p.len() > max || p.contains('\n')) {
        return Err(FleetError::Invalid(format!(
            "evidence ports: at most {ports} names of at most {max} bytes, one line each"
        )));
    }
    Ok(())
}

/// The refusal of evidence for a new project past [`FLEET_EVIDENCE_MAX`].
pub(crate) fn too_much_evidence() -> FleetError {
    FleetError::Invalid(format!(
        "evidence: the fleet keeps the evidence of at most {FLEET_EVIDENCE_MAX} projects"
    ))
}
