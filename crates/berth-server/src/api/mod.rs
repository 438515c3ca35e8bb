//! HTTP API v1 (docs/contract.md): routes, handlers, auth layers.
//! The routes and handlers of API v1: each turns a request (its body one of
//! berth-client's wire types, checked by `request.rs`) into a [`Msg`] for the daemon.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, Request, State as AxState};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use berth_core::{Command, RunState, Snapshot};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};

mod acquire;
pub mod doc;
mod extract;
mod gate;
mod runs;

use acquire::*;
use extract::json_body;
pub use extract::{ParamPath, Params, RunIdPath, WantsNdjson};
use gate::*;
use runs::*;
pub use runs::{run_for, run_out, status_out, GET_WAIT_S_MAX};
mod fleet;
mod observe;
mod runtime;
mod scopes;
mod threads;
mod tokens;

use berth_client::wire::{
    AcquireEvent, Claim, ErrorDetail, FenceCheck, Key, LedgerStatus, LimitsStatus,
    ProcessRequest as ProcessBody, ProjectStatus, Queued, ReapReport, ReaperStatus, Reason,
    ReleaseRequest as ReleaseBody, RenewRequest as RenewBody, ResourceStatus, Run, RunLimits,
    RunList, RunUsage, Status,
};

use crate::auth::{self, Scope};
use crate::daemon::{Msg, RunInfo, Shared};
use crate::error::ApiError;
use crate::request::{build_request, check_fence, check_run_id, read_worktree, ttl_s};

/// Largest request body accepted.
pub const BODY_BYTES_MAX: usize = 64 * 1024;
/// How long a body may take to arrive once its head is read (S10): a token holder that
/// trickles a body holds a connection and a task; past this it is cut (`408`).
pub const BODY_DEADLINE: Duration = Duration::from_secs(10);
/// Runs listed at most by `GET /v1/runs`.
pub const LIST_MAX: usize = 10_000;

#[derive(Clone)]
pub struct Api {
    /// Fleet mode (F1): the fleet thread, for fleet-wide questions.
    pub fleet: Option<crate::fleet::Handle>,
    pub tx: mpsc::Sender<Msg>,
    pub shared: Arc<Shared>,
    pub auth: bool,
    pub cfg: Arc<berth_core::Config>,
    /// The daemon's own uid: who the admin token (and no-auth mode) acts for.
    pub uid: u32,
    /// Runs whose runtime is being started now: one start per run at a time (C7).
    pub starting: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
}

/// Who is calling: put into each request by `authenticate`.
#[derive(Clone, Copy, Debug)]
pub struct Caller {
    /// The user whose processes this caller may register (S3).
    pub uid: u32,
    /// S9: `Some(uid)` for a uid-bound token below admin: it acts only on runs, threads
    /// and scopes that tokens of that uid made, and sees others' runs without fences.
    pub tenant: crate::daemon::Tenant,
    /// S10: the key its token is counted under (`None` without auth: uncapped).
    pub token: Option<u64>,
    /// What the caller's token may do (everything without auth).
    pub scope: Scope,
}

async fn ask<T>(
    api: &Api,
    make: impl FnOnce(crate::daemon::Reply<T>) -> Msg,
) -> Result<T, ApiError> {
    Ok(crate::daemon::ask(&api.tx, make).await?)
}

/// The API: the routes of [`doc::routes`], each in the router of the scope it needs
/// (reads `read`, run changes `operator`, tokens and reaping `admin`; the dashboard page
/// and the API's description none), so a route gets the scope of the router it is
/// declared in, never one matched from its path.
pub fn router(api: Api) -> Router {
    let shared = api.shared.clone();
    let scoped = |need: Option<Scope>| {
        let shared = shared.clone();
        axum::middleware::from_fn(move |req, next| require(need, shared.clone(), req, next))
    };
    let mut read = Router::new();
    let mut operator = Router::new();
    let mut admin = Router::new();
    let mut public = Router::new();
    for (r, handler) in doc::routes() {
        let group = match r.scope {
            Some(Scope::Read) => &mut read,
            Some(Scope::Operator) => &mut operator,
            Some(Scope::Admin) => &mut admin,
            None => &mut public,
        };
        *group = std::mem::take(group).route(r.path, handler);
    }
    Router::new()
        .merge(read.route_layer(scoped(Some(Scope::Read))))
        .merge(operator.route_layer(scoped(Some(Scope::Operator))))
        .merge(admin.route_layer(scoped(Some(Scope::Admin))))
        .merge(public.route_layer(scoped(None)))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            api.clone(),
            authenticate,
        ))
        .with_state(api)
}
