//! B1–B6 over HTTP: `/v1/scopes/*`.

use axum::body::Body;
use axum::extract::State as AxState;
use axum::response::{IntoResponse, Response};
use axum::Json;
use berth_client::wire;
use berth_core::scopes::ScopeError;
use berth_core::{Command, Error as CoreError};
use berth_store::fleet::{ControlOutcome, ScopeControlRequest};

// Path parameters refused with the error envelope (not axum's plain text).
use super::ParamPath as Path;
use super::{ask, json_body, Api, Caller};
use crate::daemon::{Error, FleetChange, Msg, ScopeAnswer, ScopeOp};
use crate::error::ApiError;
use crate::request;

async fn scope_op(api: &Api, op: ScopeOp) -> Result<Response, ApiError> {
    let answer = ask(api, |reply| Msg::Scope { op, reply }).await?;
    Ok(match answer {
        ScopeAnswer::Scope(s) => Json(s).into_response(),
        ScopeAnswer::Reservation(r) => {
            let status = if r.new {
                axum::http::StatusCode::CREATED
            } else {
                axum::http::StatusCode::OK
            };
            (status, Json(r)).into_response()
        }
        ScopeAnswer::Token(t) => Json(t).into_response(),
        ScopeAnswer::Reconciled(r) => Json(r).into_response(),
        ScopeAnswer::Receipt(r) => Json(r).into_response(),
        ScopeAnswer::Deleted(s) => Json(s).into_response(),
        ScopeAnswer::Allowed => axum::http::StatusCode::NO_CONTENT.into_response(),
    })
}

pub async fn list(AxState(api): AxState<Api>) -> Result<Response, ApiError> {
    let scopes = ask(&api, |reply| Msg::ScopeList { reply }).await?;
    Ok(Json(wire::ScopeList { scopes }).into_response())
}

pub async fn get_scope(
    AxState(api): AxState<Api>,
    Path(scope): Path<String>,
) -> Result<Response, ApiError> {
    request::check_scope(&scope)?;
    scope_op(&api, ScopeOp::Get { scope }).await
}

/// B2: a turn's token; `201` when this request took it, `200` for a retry's.
pub async fn reserve(
    AxState(api): AxState<Api>,
    Path(scope): Path<String>,
    body: Body,
) -> Result<Response, ApiError> {
    request::check_scope(&scope)?;
    let b: wire::ReservationRequest = json_body(body, false).await?;
    request::reservation(&b.owner, &b.operation_id, Some(&b.harness))?;
    let op = ScopeOp::Apply(Command::Reserve {
        scope,
        owner: b.owner,
        operation_id: b.operation_id,
        harness: b.harness,
    });
    scope_op(&api, op).await
}

/// B3: the owner gives its token back.
pub async fn unreserve(
    AxState(api): AxState<Api>,
    Path((scope, owner, operation_id)): Path<(String, String, String)>,
) -> Result<Response, ApiError> {
    request::check_scope(&scope)?;
    request::reservation(&owner, &operation_id, None)?;
    let op = ScopeOp::Apply(Command::Unreserve {
        scope,
        owner,
        operation_id,
    });
    scope_op(&api, op).await
}

/// B3: an operator frees every token an owner holds (admin).
pub async fn reconcile(
    AxState(api): AxState<Api>,
    axum::Extension(caller): axum::Extension<Caller>,
    Path(scope): Path<String>,
    body: Body,
) -> Result<Response, ApiError> {
    request::check_scope(&scope)?;
    let b: wire::ReconcileRequest = json_body(body, false).await?;
    request::reconcile(&b)?;
    let fleet_freed = super::fleet::reconcile_fleet_wide(&api, &scope, &b.owner).await?;
    let by = format!("uid {} ({} token)", caller.uid, caller.scope.as_str());
    let op = ScopeOp::Reconcile {
        scope: scope.clone(),
        owner: b.owner.clone(),
        reason: b.reason.clone(),
        by,
    };
    match scope_op(&api, op).await {
        // The scope lives on another host of the fleet; its token was freed in the
        // fleet store, and there is nothing of it here.
        Err(e) if fleet_freed && e.status == 404 => Ok(Json(wire::Reconciled {
            scope,
            owner: b.owner,
            reason: b.reason,
            freed: Vec::new(),
        })
        .into_response()),
        answer => answer,
    }
}

/// B4: pause, stop or resume, idempotent by request id.
pub async fn control(
    AxState(api): AxState<Api>,
    axum::Extension(caller): axum::Extension<Caller>,
    Path(scope): Path<String>,
    body: Body,
) -> Result<Response, ApiError> {
    request::check_scope(&scope)?;
    let b: wire::ControlRequest = json_body(body, false).await?;
    let mode = request::control(&b)?;
    if api.fleet.is_some() {
        let r = ScopeControlRequest {
            scope,
            request_id: b.request_id,
            mode,
        };
        return control_fleet_wide(&api, r, caller.tenant).await;
    }
    let cmd = Command::ScopeControl {
        scope,
        request_id: b.request_id,
        mode,
    };
    let by = caller.tenant;
    scope_op(&api, ScopeOp::Owned { cmd, by }).await
}

/// B4 fleet-wide (issue 38 Build 3): the fleet store decides the request for every
/// host; this host mirrors the answer before it is given, the others when they read it
/// (announced at once; at their next heartbeat at the latest).
async fn control_fleet_wide(
    api: &Api,
    r: ScopeControlRequest,
    by: crate::daemon::Tenant,
) -> Result<Response, ApiError> {
    let link = super::fleet::link(api)?;
    let (scope, request_id) = (r.scope.clone(), r.request_id.clone());
    let may = ScopeOp::MayControl {
        scope: scope.clone(),
        by,
    };
    scope_op(api, may).await?;
    let host = link.status.host_id();
    let (outcome, version) = link
        .ask(move |s| s.control_scope(&r, &host))
        .await
        .map_err(super::fleet::refused)?;
    let refused = |e: ScopeError| ApiError::from(Error::Core(CoreError::from(e)));
    let receipt = match outcome {
        ControlOutcome::Accepted(receipt) => receipt,
        ControlOutcome::Conflict { accepted } => {
            return Err(refused(ScopeError::ControlConflict {
                scope,
                request_id,
                accepted,
            }))
        }
        ControlOutcome::Stopped => return Err(refused(ScopeError::Stopped { scope })),
    };
    let change = FleetChange::Control {
        scope: scope.clone(),
        receipt: receipt.clone(),
    };
    ask(api, |reply| Msg::FleetChanged {
        change,
        version,
        reply,
    })
    .await?;
    Ok(Json(wire::ControlReceipt {
        scope,
        request_id: receipt.request_id,
        mode: receipt.mode.as_str().into(),
        generation: receipt.generation,
        control: receipt.control.as_str().into(),
        at: crate::clock::rfc3339(crate::clock::wall_ms()),
    })
    .into_response())
}

/// S10: an operator forgets an idle scope (nothing holds it: no run, no token, no
/// control state); the next run naming it freezes a new policy.
pub async fn delete_scope(
    AxState(api): AxState<Api>,
    axum::Extension(caller): axum::Extension<Caller>,
    Path(scope): Path<String>,
) -> Result<Response, ApiError> {
    request::check_scope(&scope)?;
    let cmd = Command::DeleteScope { scope };
    let by = caller.tenant;
    scope_op(&api, ScopeOp::Owned { cmd, by }).await
}
