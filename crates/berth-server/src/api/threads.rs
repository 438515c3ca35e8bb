//! G0–G4 over HTTP: `/v1/threads/*`, `/v1/drain`, `/v1/idle`.

use axum::body::Body;
use axum::extract::State as AxState;
use axum::response::{IntoResponse, Response};
use axum::Json;
use berth_client::wire;
use berth_core::threads::{Owner, ThreadError};

// Path parameters refused with the error envelope (not axum's plain text).
use super::ParamPath as Path;
use super::{ask, json_body, Api, Caller};
use crate::daemon::{Msg, ThreadOp};
use crate::error::ApiError;

/// G5: a claim's owner; the budget where one is needed (`attach`, `deadline`).
fn claim(b: &wire::ThreadClaim, budget: bool) -> Result<(Owner, u64), ApiError> {
    let owner = Owner {
        gen: b.owner_gen.clone(),
        fence: b.owner_fence,
        run_id: b.run_id.clone(),
    };
    berth_core::threads::check_claim(&owner).map_err(invalid)?;
    let budget_ms = match (budget, b.run_budget_ms) {
        (true, None) => return Err(ApiError::invalid("run_budget_ms", "is required")),
        (true, Some(ms)) => {
            berth_core::threads::check_budget(ms).map_err(invalid)?;
            ms
        }
        (false, Some(_)) => {
            return Err(ApiError::invalid("run_budget_ms", "is not taken by detach"))
        }
        (false, None) => 0,
    };
    if budget && b.evict.is_some() {
        return Err(ApiError::invalid("evict", "is taken by detach only"));
    }
    Ok((owner, budget_ms))
}

/// A refusal of the thread rules, as the API says it (one mapping, in error.rs).
fn invalid(e: ThreadError) -> ApiError {
    crate::daemon::Error::Thread(e).into()
}

fn check_key(key: &str) -> Result<(), ApiError> {
    berth_core::validate::run_id(key).map_err(|rule| ApiError::invalid("key", rule))
}

async fn thread_op(api: &Api, caller: &Caller, op: ThreadOp) -> Result<Response, ApiError> {
    let by = caller.tenant;
    let t = ask(api, |reply| Msg::Thread { op, by, reply }).await?;
    Ok(Json(t).into_response())
}

/// Which claim a route takes.
#[derive(Clone, Copy)]
enum Claimed {
    Attach,
    Deadline,
    Detach,
}

async fn claimed(
    api: &Api,
    caller: &Caller,
    key: String,
    body: Body,
    what: Claimed,
) -> Result<Response, ApiError> {
    check_key(&key)?;
    let b: wire::ThreadClaim = json_body(body, false).await?;
    let (owner, budget_ms) = claim(&b, !matches!(what, Claimed::Detach))?;
    if matches!(what, Claimed::Attach) {
        super::fleet::check_thread_owner(api, &key, &owner).await?;
    }
    let op = match what {
        Claimed::Attach => ThreadOp::Attach {
            key,
            owner,
            budget_ms,
        },
        Claimed::Deadline => ThreadOp::Deadline {
            key,
            owner,
            budget_ms,
        },
        Claimed::Detach => ThreadOp::Detach {
            key,
            owner,
            evict: b.evict.unwrap_or(false),
        },
    };
    thread_op(api, caller, op).await
}

pub async fn attach(
    AxState(api): AxState<Api>,
    axum::Extension(caller): axum::Extension<Caller>,
    Path(key): Path<String>,
    body: Body,
) -> Result<Response, ApiError> {
    claimed(&api, &caller, key, body, Claimed::Attach).await
}

pub async fn deadline(
    AxState(api): AxState<Api>,
    axum::Extension(caller): axum::Extension<Caller>,
    Path(key): Path<String>,
    body: Body,
) -> Result<Response, ApiError> {
    claimed(&api, &caller, key, body, Claimed::Deadline).await
}

pub async fn detach(
    AxState(api): AxState<Api>,
    axum::Extension(caller): axum::Extension<Caller>,
    Path(key): Path<String>,
    body: Body,
) -> Result<Response, ApiError> {
    claimed(&api, &caller, key, body, Claimed::Detach).await
}

pub async fn get_thread(
    AxState(api): AxState<Api>,
    axum::Extension(caller): axum::Extension<Caller>,
    Path(key): Path<String>,
) -> Result<Response, ApiError> {
    check_key(&key)?;
    thread_op(&api, &caller, ThreadOp::Get { key }).await
}

/// An operator's eviction (reason `operator`); refused while registered.
pub async fn evict(
    AxState(api): AxState<Api>,
    axum::Extension(caller): axum::Extension<Caller>,
    Path(key): Path<String>,
) -> Result<Response, ApiError> {
    check_key(&key)?;
    thread_op(&api, &caller, ThreadOp::Evict { key }).await
}

pub async fn list(AxState(api): AxState<Api>) -> Result<Response, ApiError> {
    let threads = ask(&api, |reply| Msg::ThreadList { reply }).await?;
    Ok(Json(wire::ThreadList { threads }).into_response())
}

/// The most a drain's reason may say (bytes).
const DRAIN_REASON_MAX: usize = 1_024;

pub async fn drain_start(
    AxState(api): AxState<Api>,
    axum::Extension(caller): axum::Extension<Caller>,
    body: Body,
) -> Result<Response, ApiError> {
    let (by, reason) = drain_request(&caller, body).await?;
    let start = Some((by, reason));
    let d = ask(&api, |reply| Msg::Drain { start, reply }).await?;
    Ok(Json(d).into_response())
}

/// A drain's request (the host's or the fleet's): who starts it, and why.
pub(super) async fn drain_request(
    caller: &Caller,
    body: Body,
) -> Result<(String, String), ApiError> {
    may_drain(caller)?;
    let b: wire::DrainRequest = json_body(body, true).await?;
    let reason = b.reason.unwrap_or_default();
    if reason.len() > DRAIN_REASON_MAX || reason.contains(['\n', '\r', '\t']) {
        return Err(ApiError::invalid(
            "reason",
            format!("must be one line of at most {DRAIN_REASON_MAX} bytes"),
        ));
    }
    let by = format!("uid {} ({} token)", caller.uid, caller.scope.as_str());
    Ok((by, reason))
}

/// S9: a drain (the host's or the fleet's) holds back every user's new runs, so only
/// a token with full reach (made without a uid, or the admin token) starts or ends
/// one. Before, any user's uid-bound operator token drained the host (or the whole
/// fleet) for everyone, or ended the drain an operator had started for maintenance.
/// Decided by the token alone (nothing of the state is read), so before any work.
pub(super) fn may_drain(caller: &Caller) -> Result<(), ApiError> {
    match caller.tenant {
        None => Ok(()),
        Some(uid) => Err(crate::error::not_everyones("the drain", uid)),
    }
}

pub async fn drain_end(
    AxState(api): AxState<Api>,
    axum::Extension(caller): axum::Extension<Caller>,
) -> Result<Response, ApiError> {
    may_drain(&caller)?;
    let d = ask(&api, |reply| Msg::Drain { start: None, reply }).await?;
    Ok(Json(d).into_response())
}

pub async fn drain_get(AxState(api): AxState<Api>) -> Result<Response, ApiError> {
    let d = ask(&api, |reply| Msg::DrainGet { reply }).await?;
    Ok(Json(d).into_response())
}

pub async fn idle(AxState(api): AxState<Api>) -> Result<Response, ApiError> {
    let i = ask(&api, |reply| Msg::Idle { reply }).await?;
    Ok(Json(i).into_response())
}
