//! The errors: the daemon's own ([`Error`], in its terms, no HTTP), and the API's
//! model (`{"error":{"code","message","details"}}` with stable codes) that this
//! module alone maps them to.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use berth_core::Error as CoreError;
use serde_json::{json, Value};

#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub code: String,
    pub message: String,
    pub details: Value,
}

impl ApiError {
    pub fn new(status: u16, code: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            code: code.to_string(),
            message: message.into(),
            details: json!({}),
        }
    }

    /// A `400` that names the field and the rule it broke.
    pub fn invalid(field: &str, rule: impl std::fmt::Display) -> ApiError {
        ApiError {
            status: 400,
            code: "invalid".into(),
            message: format!("{field}: {rule}"),
            details: json!({ "field": field }),
        }
    }

    pub fn with(mut self, details: Value) -> ApiError {
        self.details = details;
        self
    }
}

/// Something berth itself could not do (a bug or the host refusing it).
pub fn internal(what: impl Into<String>) -> ApiError {
    ApiError::new(500, "internal", what)
}

/// S3: why a process was not registered, as the API says it.
fn registration_refused(pid: i32, r: crate::register::Refusal) -> ApiError {
    use crate::register::Refusal;
    match r {
        Refusal::Forbidden(why) => ApiError::new(403, "pid_forbidden", why),
        Refusal::NotOwned(why) => ApiError::new(403, "pid_not_owned", why),
        Refusal::OwnedByRun { run_id } => ApiError::new(
            403,
            "pid_owned_by_run",
            format!(
                "pid {pid} belongs to live run {run_id}; stopping it would stop that run's processes"
            ),
        )
        .with(json!({"run_id": run_id, "pid": pid})),
        Refusal::NoSuchProcess => ApiError::invalid("pid", format!("no process {pid} is running")),
        Refusal::CouldNotLook(why) => ApiError::new(
            503,
            "could_not_look",
            format!("pid {pid} could not be checked ({why}); try again"),
        ),
    }
}

/// G0–G3: a thread refusal, as the API says it.
fn thread_refused(e: berth_core::threads::ThreadError) -> ApiError {
    use berth_core::threads::ThreadError as T;
    let code = e.code();
    match e {
        T::Mismatch { key, current } => ApiError::new(
            409,
            code,
            format!(
                "thread {key} is owned by generation {} at fence {} (run {}): a claim must come from it or a higher fence",
                current.gen, current.fence, current.run_id
            ),
        )
        .with(json!({"key": key, "current": {"owner_gen": current.gen, "owner_fence": current.fence, "run_id": current.run_id}})),
        T::Draining => ApiError::new(503, code, "the host is draining: no new registrations"),
        T::NotFound { key } => ApiError::new(404, code, format!("thread {key} has no such registration"))
            .with(json!({"key": key})),
        T::Full { max } => ApiError::new(503, code, format!("{max} threads are remembered already"))
            .with(json!({"max": max})),
        T::Invalid { field, rule } => ApiError::invalid(field, rule),
        T::Protected { key, .. } => ApiError::new(
            409,
            code,
            format!("thread {key} has a live registration: its workspace is not destroyed under it"),
        )
        .with(json!({"key": key})),
    }
}

/// B1–B5: a budget refusal, as the API says it (the details name what it is about).
fn scope_refused(e: berth_core::scopes::ScopeError) -> ApiError {
    use berth_core::scopes::ScopeError as S;
    let code = e.code();
    let message = e.to_string();
    let (status, details) = match &e {
        S::Invalid { field, .. } => return ApiError::invalid(field, rule_of(&message, field)),
        S::PolicyConflict {
            scope,
            frozen,
            given,
        } => (
            409,
            json!({"scope": scope, "frozen": frozen, "given": given}),
        ),
        S::ManifestChanged {
            scope,
            frozen,
            given,
        } => (
            409,
            json!({"scope": scope, "frozen": frozen, "given": given}),
        ),
        S::InUse { scope, run_id } => (409, json!({"scope": scope, "run_id": run_id})),
        S::TooMany { max } | S::TokensFull { max } => (503, json!({"max": max})),
        S::Quota { uid, max } => (429, json!({"uid": uid, "max": max})),
        S::Busy { scope, why } => (409, json!({"scope": scope, "why": why})),
        S::UnknownHarness { scope, harness } => (
            400,
            json!({"field": "harness", "scope": scope, "harness": harness}),
        ),
        S::ReservationConflict { scope, held, given } => {
            (409, json!({"scope": scope, "held": held, "given": given}))
        }
        S::ControlConflict {
            scope,
            request_id,
            accepted,
        } => (
            409,
            json!({"scope": scope, "request_id": request_id, "accepted": accepted.as_str()}),
        ),
        S::Stopped { scope } | S::Paused { scope } => (409, json!({"scope": scope})),
        S::Full {
            scope,
            harness,
            limit,
            holders,
        } => (
            409,
            json!({"scope": scope, "harness": harness, "limit": limit, "holders": holders}),
        ),
        S::NotFound { what } => (404, json!({"what": what})),
    };
    ApiError {
        status,
        code: code.to_string(),
        message,
        details,
    }
}

/// The rule part of a `field: rule` message.
fn rule_of<'a>(message: &'a str, field: &str) -> &'a str {
    message
        .strip_prefix(field)
        .and_then(|m| m.strip_prefix(": "))
        .unwrap_or(message)
}

/// Why the daemon refused or could not do what a message asked, in the daemon's own
/// terms. **Architecture invariant:** the daemon names no HTTP status; `ApiError`
/// alone maps these to status codes and wire codes.
#[derive(Clone, Debug, PartialEq)]
pub enum Error {
    /// The engine's rules said no (the rule and its fields are in the core error).
    Core(CoreError),
    /// S3: the process may not be registered to this run.
    Registration {
        pid: i32,
        refusal: crate::register::Refusal,
    },
    /// D4: the ledger refused the write; nothing was acknowledged.
    Store(String),
    /// berth itself could not do it: the host refused, or a bug.
    Internal(String),
    /// G0–G3: a thread's rules said no.
    Thread(berth_core::threads::ThreadError),
    /// G4: the host drains; nothing new is admitted. Carries the drain's record, and
    /// for the fleet's drain (issue 38 Build 3) the host it was started on.
    Draining {
        drain: berth_store::DrainRecord,
        fleet_host: Option<String>,
    },
    /// F1: fleet mode, and the fleet store cannot be reached: no new fleet-wide claim.
    FleetUnavailable,
    /// The daemon's task has stopped: berth is shutting down.
    ShuttingDown,
    /// S9: a uid-bound token asked to act on a run, thread or scope another uid made.
    NotOwner {
        /// `run`, `thread`, `scope` or [`FLEET_SCOPE`].
        what: &'static str,
        id: String,
        /// The uid the caller's token acts for.
        uid: u32,
    },
}

impl From<CoreError> for Error {
    fn from(e: CoreError) -> Error {
        Error::Core(e)
    }
}

impl Error {
    pub(crate) fn store(e: &berth_store::StoreError) -> Error {
        Error::Store(e.to_string())
    }

    /// A run the daemon had just touched was gone when it answered (a bug).
    pub(crate) fn run_vanished() -> Error {
        Error::Internal("run vanished".into())
    }
}

/// The one place the daemon's domain errors become HTTP statuses and wire codes.
impl From<Error> for ApiError {
    fn from(e: Error) -> ApiError {
        match e {
            Error::Core(e) => e.into(),
            Error::Registration { pid, refusal } => registration_refused(pid, refusal),
            // D4: the ledger refused a write; nothing is acknowledged.
            Error::Store(e) => ApiError::new(
                503,
                "store_unavailable",
                format!("the ledger cannot be written: {e}"),
            ),
            Error::Internal(what) => internal(what),
            Error::Thread(e) => thread_refused(e),
            // G4: with who started the drain, when and why.
            Error::Draining {
                drain: d,
                fleet_host,
            } => {
                let (who, fleet) = match fleet_host.as_deref() {
                    // (Empty: the store refused a claim for a drain this host has not
                    // read yet, so it knows neither where nor when it started.)
                    Some("") => ("the fleet is draining".to_string(), true),
                    Some(h) => (format!("the fleet is draining (started on {h})"), true),
                    None => ("the host is draining".to_string(), false),
                };
                let since = match d.at.as_str() {
                    "" => String::new(),
                    at => format!(" since {at}"),
                };
                ApiError::new(
                    503,
                    "draining",
                    format!(
                        "{who}{since} ({}): no new runs or registrations",
                        d.reason
                    ),
                )
                .with(json!({"drain": {"by": d.by, "at": d.at, "reason": d.reason, "fleet": fleet, "host": fleet_host}}))
            }
            Error::FleetUnavailable => fleet_unavailable("the fleet store cannot be reached"),
            Error::NotOwner { what, id, uid } => not_owner(what, &id, uid),
            Error::ShuttingDown => ApiError::new(503, "shutting_down", "berth is shutting down"),
        }
    }
}

/// S9: a uid-bound token asked to act on a run, thread or scope of another user.
/// S9: `what` acts on every user's runs, and a token bound to `uid` acts only on its
/// own user's.
pub fn not_everyones(what: &str, uid: u32) -> ApiError {
    ApiError::new(
        403,
        "not_owner",
        format!("{what} acts on every user's runs: a token bound to uid {uid} may not start or end it (an operator token without a uid, or the admin token, may) (S9)"),
    )
    .with(json!({ "uid": uid, "host_wide": what }))
}

/// `NotOwner`'s `what` for a scope's fleet-wide control, which no uid-bound token may
/// ask for (see `ScopeOp::MayControl`).
pub const FLEET_SCOPE: &str = "fleet scope";

pub fn not_owner(what: &str, id: &str, uid: u32) -> ApiError {
    if what == FLEET_SCOPE {
        return ApiError::new(
            403,
            "not_owner",
            format!("scope {id}'s control acts on every host of the fleet, and no host knows whose runs made the scope on the others: a token bound to uid {uid} controls no scope fleet-wide (an operator token without a uid, or the admin token, does) (S9)"),
        )
        .with(json!({ "scope": id, "uid": uid, "fleet": true }));
    }
    ApiError::new(
        403,
        "not_owner",
        format!("{what} {id} was not made by a token of uid {uid}: this token acts only on its own user's {what}s (S9)"),
    )
    .with(json!({ (what.to_string()): id, "uid": uid }))
}

/// F1: the fleet store is away; this host refuses new fleet-wide claims (its local
/// runs go on).
pub fn fleet_unavailable(why: impl std::fmt::Display) -> ApiError {
    ApiError::new(
        503,
        "store_unavailable",
        format!("{why}: this host keeps serving its runs but takes no new fleet-wide claim until the fleet store is back"),
    )
    .with(json!({"store": "fleet"}))
}

impl From<CoreError> for ApiError {
    fn from(e: CoreError) -> ApiError {
        let e = match e {
            CoreError::Scope(e) => return scope_refused(*e),
            e => e,
        };
        let message = e.to_string();
        let (status, details) = match &e {
            CoreError::Invalid { field, .. } => (400, json!({ "field": field })),
            CoreError::NotFound { run_id } => (404, json!({ "run_id": run_id })),
            CoreError::StaleFence {
                run_id,
                given,
                current,
            } => (
                409,
                json!({ "run_id": run_id, "fence": given, "current_fence": current }),
            ),
            CoreError::FenceRequired { run_id, .. } => {
                (400, json!({ "run_id": run_id, "field": "fence" }))
            }
            CoreError::Gone { run_id, state } => {
                (410, json!({ "run_id": run_id, "state": state.as_str() }))
            }
            CoreError::Conflict { run_id } => (409, json!({ "run_id": run_id })),
            CoreError::CapacityImpossible {
                resource,
                request,
                max,
            } => (
                422,
                json!({ "resource": resource, "request": request, "max": max }),
            ),
            CoreError::QueueFull { max } => (503, json!({ "max": max })),
            CoreError::ContractDisabled { project } => (422, json!({ "project": project })),
            CoreError::NotEligible { run_id, .. } => (409, json!({ "run_id": run_id })),
            CoreError::Scope(_) => (409, json!({})), // answered above
        };
        ApiError {
            status,
            code: e.code().to_string(),
            message,
            details,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = berth_client::wire::ErrorBody {
            error: berth_client::wire::ErrorDetail {
                code: self.code,
                message: self.message,
                details: self.details,
            },
        };
        (status, axum::Json(body)).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A new run the fleet store refused for a drain this host has not read yet: the
    /// message said "started on  since  (…)", with nothing where the host and the
    /// time go. It says what the host knows, and no empty field.
    #[test]
    fn regression_a_drain_not_read_yet_is_said_without_empty_fields() {
        let unread = Error::Draining {
            drain: berth_store::DrainRecord {
                by: String::new(),
                at: String::new(),
                reason: "this host is reading the fleet drain".into(),
            },
            fleet_host: Some(String::new()),
        };
        let e = ApiError::from(unread);
        assert_eq!((e.status, e.code.as_str()), (503, "draining"));
        assert_eq!(
            e.message,
            "the fleet is draining (this host is reading the fleet drain): no new runs or registrations"
        );
        let read = Error::Draining {
            drain: berth_store::DrainRecord {
                by: "op".into(),
                at: "2026-12-05T17:00:00Z".into(),
                reason: "upgrade".into(),
            },
            fleet_host: Some("h1".into()),
        };
        assert_eq!(
            ApiError::from(read).message,
            "the fleet is draining (started on h1) since 2026-12-05T17:00:00Z (upgrade): no new runs or registrations"
        );
    }
}
