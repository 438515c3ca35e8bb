//! What every host of a fleet mirrors rather than decides (issue 38 Build 3): the
//! bearer tokens the whole fleet honours and the fleet-wide drain. A host reads them
//! when it registers, at each heartbeat and when another host announces a change
//! (`shared` on [`super::CHANNEL`]); [`super::FleetStore::shared`] answers nothing
//! when nothing changed since the version the host last read, so a heartbeat's read
//! costs one row.

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

/// The fleet's tokens (by hash) and its drain, as of `version`, which every change of
/// either raises.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shared {
    pub version: i64,
    pub drain: Option<FleetDrain>,
    pub tokens: Vec<FleetToken>,
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

pub(crate) fn check_drain(d: &FleetDrain) -> Result<(), FleetError> {
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
