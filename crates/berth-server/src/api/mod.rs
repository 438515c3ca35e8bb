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

pub mod doc;
mod fleet;
mod observe;
mod runtime;
mod scopes;
mod threads;
mod tokens;

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

/// The `{id}` of a route, refused with a JSON `400` (not axum's plain text) when the
/// path is not valid percent-encoded UTF-8.
pub struct RunIdPath(pub String);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for RunIdPath {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, ApiError> {
        match Path::<String>::from_request_parts(parts, state).await {
            Ok(Path(id)) => Ok(RunIdPath(id)),
            Err(_) => Err(ApiError::invalid(
                "run_id",
                "must be valid percent-encoded UTF-8",
            )),
        }
    }
}

/// A route's other path parameters (thread keys, scope ids, owners), refused like
/// `RunIdPath` with a JSON `400` that names the parameter, never axum's plain text.
pub struct ParamPath<T>(pub T);

impl<T: DeserializeOwned + Send, S: Send + Sync> axum::extract::FromRequestParts<S>
    for ParamPath<T>
{
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, ApiError> {
        use axum::extract::path::ErrorKind;
        use axum::extract::rejection::PathRejection;
        match Path::<T>::from_request_parts(parts, state).await {
            Ok(Path(v)) => Ok(ParamPath(v)),
            Err(PathRejection::FailedToDeserializePathParams(e)) => match e.kind() {
                ErrorKind::InvalidUtf8InPathParam { key } => Err(ApiError::invalid(
                    key,
                    "must be valid percent-encoded UTF-8",
                )),
                _ => Err(ApiError::invalid("path", e.body_text())),
            },
            Err(e) => Err(ApiError::invalid("path", e.body_text())),
        }
    }
}

/// Whether the client asked for a stream (`Accept: application/x-ndjson`). Read from
/// the head and kept as one bool: a waiter that kept the request's `HeaderMap` would
/// keep hyper's whole first read buffer (its values are slices of it), 8 KiB per
/// queued long poll, while hyper allocates another to watch the socket.
pub struct WantsNdjson(pub bool);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for WantsNdjson {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _state: &S,
    ) -> Result<Self, Self::Rejection> {
        Ok(WantsNdjson(
            parts
                .headers
                .get(header::ACCEPT)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.contains("application/x-ndjson")),
        ))
    }
}

/// Query parameters, refused with a JSON `400` when malformed.
pub struct Params(pub BTreeMap<String, String>);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Params {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, ApiError> {
        match Query::<BTreeMap<String, String>>::from_request_parts(parts, state).await {
            // A pair without a name (`?=true`) has no field a refusal could name.
            Ok(Query(q)) if q.contains_key("") => Err(ApiError::invalid(
                "query",
                "every parameter must have a name (key=value)",
            )),
            Ok(Query(q)) => Ok(Params(q)),
            Err(_) => Err(ApiError::invalid(
                "query",
                "must be well-formed key=value pairs",
            )),
        }
    }
}

/// Reads a JSON body: size limit, UTF-8, unknown fields, wrong types, all as `400`s
/// that name the field.
async fn json_body<T: DeserializeOwned>(body: Body, empty_ok: bool) -> Result<T, ApiError> {
    let read = axum::body::to_bytes(body, BODY_BYTES_MAX);
    let bytes: Bytes = tokio::time::timeout(BODY_DEADLINE, read)
        .await
        .map_err(|_| {
            ApiError::new(
                408,
                "body_timeout",
                format!(
                    "the body must arrive within {} s of its head (S10)",
                    BODY_DEADLINE.as_secs()
                ),
            )
        })?
        .map_err(|_| {
            ApiError::invalid("body", format!("must be at most {BODY_BYTES_MAX} bytes"))
        })?;
    let text =
        std::str::from_utf8(&bytes).map_err(|_| ApiError::invalid("body", "must be UTF-8"))?;
    let text = if text.trim().is_empty() && empty_ok {
        "{}"
    } else {
        text
    };
    let mut de = serde_json::Deserializer::from_str(text);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let field = if path.is_empty() || path == "." {
            "body".to_string()
        } else {
            path
        };
        let inner = e.into_inner();
        ApiError::invalid(
            &field,
            inner
                .to_string()
                .split(" at line")
                .next()
                .unwrap_or_default(),
        )
    })?;
    // Strict to the last byte: `{...} GARBAGE` is not a body (only whitespace may follow).
    de.end()
        .map_err(|_| ApiError::invalid("body", "must be one JSON value with nothing after it"))?;
    Ok(value)
}

use berth_client::wire::{
    AcquireEvent, Claim, ErrorDetail, FenceCheck, Key, LedgerStatus, ProcessRequest as ProcessBody,
    ProjectStatus, Queued, ReapReport, ReaperStatus, Reason, ReleaseRequest as ReleaseBody,
    RenewRequest as RenewBody, ResourceStatus, Run, RunList, Status,
};

/// A run as API v1 shows it.
pub fn run_out(i: &RunInfo) -> Run {
    let v = &i.view;
    let r = &v.resources;
    let mut resources: BTreeMap<String, u64> = r.named.clone();
    for (k, n) in [
        ("cpu_millis", r.cpu_millis),
        ("disk", r.disk),
        ("memory", r.memory),
        ("slots", r.slots),
    ] {
        resources.insert(k.to_string(), n);
    }
    let keys = v
        .keys
        .iter()
        .map(|(k, m)| Key {
            key: k.clone(),
            mode: *m,
        })
        .collect();
    Run {
        claim: Claim { keys, resources },
        class: v.class,
        deadline: i.deadline.clone(),
        detached: i.detached,
        env: i
            .env
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect(),
        expires_at: i.expires_at.clone(),
        ttl_ms: v.ttl_ms,
        ending: v.cause.map(|c| c.as_str().to_string()),
        failure: i.failure.clone(),
        fence: v.fence,
        labels: i.labels.clone(),
        ports: i.ports.clone(),
        position: v.position,
        priority: v.priority,
        project: v.project.clone(),
        reason: v.reason.as_ref().map(reason),
        run_id: v.run_id.clone(),
        since: i.since.clone(),
        state: v.state,
        survivors: i.survivors.clone(),
        workspace: i.workspace.clone(),
        worktree: i.worktree.clone(),
    }
}

/// A run as `caller` may see it: another user's run without its fence and
/// environment (a fence is a capability: S9).
pub fn run_for(caller: &Caller, i: &RunInfo) -> Run {
    let mut run = run_out(i);
    if !crate::daemon::may_act(caller.tenant, i.owner_uid) {
        run.fence = None;
        run.env = BTreeMap::new();
    }
    run
}

fn reason(r: &berth_core::Reason) -> Reason {
    Reason {
        code: r.code.to_string(),
        message: r.message.clone(),
    }
}

fn ended_error(i: &RunInfo) -> ApiError {
    let state = i.view.state;
    if state == RunState::Rejected {
        // B4: refused after it queued, because its scope stopped.
        let why = i
            .failure
            .clone()
            .unwrap_or_else(|| "refused after it queued".into());
        return ApiError::new(409, "scope_stopped", why)
            .with(json!({"run_id": i.view.run_id, "state": state.as_str()}));
    }
    if let Some(why) = &i.failure {
        return ApiError::new(503, "workspace_unavailable", why.clone())
            .with(json!({"run_id": i.view.run_id, "state": state.as_str()}));
    }
    let code = match state {
        RunState::Expired => "expired",
        RunState::Cancelled => "cancelled",
        RunState::Rejected => "rejected",
        _ => "gone",
    };
    let why = i
        .view
        .reason
        .as_ref()
        .map(|r| format!(" ({}: {})", r.code, r.message))
        .unwrap_or_default();
    ApiError::new(410, code, format!("run {} is {} without a grant{why}", i.view.run_id, state.as_str()))
        .with(json!({"run_id": i.view.run_id, "state": state.as_str(), "reason": i.view.reason.as_ref().map(|r| json!({"code": r.code, "message": r.message}))}))
}

/// Sends `Detach` when a waiting connection goes away (A9). Disarmed when the run
/// never waited (granted or refused at once): then there is nothing to detach from.
struct AttachGuard {
    tx: mpsc::Sender<Msg>,
    run_id: String,
    armed: bool,
    /// S10: the wait counted against its token's cap while it lasts.
    _slot: Option<crate::limits::Slot>,
}

impl Drop for AttachGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let tx = self.tx.clone();
        let run_id = std::mem::take(&mut self.run_id);
        // Never block in drop; the channel is large and the daemon drains it fast.
        if tx
            .try_send(Msg::Detach {
                run_id: run_id.clone(),
            })
            .is_err()
        {
            tokio::spawn(async move {
                let _ = tx.send(Msg::Detach { run_id }).await;
            });
        }
    }
}

async fn acquire(
    AxState(api): AxState<Api>,
    axum::Extension(caller): axum::Extension<Caller>,
    WantsNdjson(stream): WantsNdjson,
    conn: Option<axum::Extension<Arc<crate::http::ConnMark>>>,
    body: Body,
) -> Response {
    let conn = conn.map(|axum::Extension(c)| c);
    match acquire_inner(api, caller, stream, conn, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn acquire_inner(
    api: Api,
    by: Caller,
    stream: bool,
    conn: Option<Arc<crate::http::ConnMark>>,
    body: Body,
) -> Result<Response, ApiError> {
    // Parsing the request and asking the daemon take far more state than waiting does
    // (4 KiB of it). In a box of their own, freed before the wait, they do not size the
    // future that a queued long poll keeps for hours.
    let (first, guard, detach) = Box::pin(enqueue(&api, by, body)).await?;
    let queued = first.view.state == RunState::Queued;
    if detach && queued {
        return Ok((StatusCode::ACCEPTED, Json(run_out(&first))).into_response());
    }
    if let (false, true, Some(conn)) = (stream, queued, conn) {
        // A queued long poll leaves hyper for the rest of its wait (`park.rs`): its
        // connection then costs a socket and this future, not hyper's 16 KiB.
        conn.park(Box::pin(async move {
            let res = long_poll_answer(&api, first, guard).await;
            let method = axum::http::Method::POST;
            api.shared
                .metrics
                .http("/v1/runs", &method, res.status().as_u16());
            res
        }));
        return Ok(crate::http::park::placeholder());
    }
    if !stream {
        return Ok(long_poll_answer(&api, first, guard).await);
    }
    Ok(stream_grant(api, first, guard))
}

/// A long poll's answer once its wait is over: the lease (`201`), or why it never
/// came. The guard goes with the wait (A9).
async fn long_poll_answer(api: &Api, first: RunInfo, guard: Option<AttachGuard>) -> Response {
    let res = match wait_for_grant(api, first, None).await {
        Ok(info) => (StatusCode::CREATED, Json(run_out(&info))).into_response(),
        Err(e) => e.into_response(),
    };
    drop(guard);
    res
}

/// Parses an acquire and asks the daemon for it: the run as the daemon answered, the
/// A9 guard of an attached waiter (armed only if the run is queued), and whether the
/// client asked to detach.
async fn enqueue(
    api: &Api,
    caller: Caller,
    body: Body,
) -> Result<(RunInfo, Option<AttachGuard>, bool), ApiError> {
    let b: berth_client::wire::AcquireRequest = json_body(body, false).await?;
    let detach = b.detach == Some(true);
    let (mut req, (worktree, labels, stop_grace_ms, thread, lease_only)) =
        build_request(&api.cfg, b)?;
    let ports = match &worktree {
        Some(wt) => read_worktree(&mut req, wt).await?,
        None => Vec::new(),
    };
    // Only an attached waiter's connection holds its place (A9).
    let waits = req.wait_ms > 0 && !detach;
    // S10: a wait is counted against its token's cap before anything is asked.
    let slot = match waits {
        true => api
            .shared
            .limits
            .take(caller.token, crate::limits::Kind::Wait)?,
        false => None,
    };
    let by = caller.tenant;
    // The guard exists before the acquire is sent: if this connection drops at any
    // point from here on, the waiter is cancelled (A9).
    let mut guard = waits.then(|| AttachGuard {
        tx: api.tx.clone(),
        run_id: req.run_id.clone(),
        armed: true,
        _slot: slot,
    });
    let first = ask(api, |reply| Msg::Acquire {
        req,
        worktree,
        labels,
        stop_grace_ms,
        ports,
        attach: waits,
        detach,
        thread,
        lease_only,
        by,
        reply,
    })
    .await;
    // The daemon counted an attachment only if the run is queued.
    if let Some(g) = guard.as_mut() {
        g.armed = matches!(&first, Ok(i) if i.view.state == RunState::Queued);
    }
    Ok((first?, guard, detach))
}

/// A streamed acquire: `queued` lines while it waits, then its outcome. The guard goes
/// with the task, so the stream closing cancels the waiter (A9).
fn stream_grant(api: Api, first: RunInfo, guard: Option<AttachGuard>) -> Response {
    let (tx, rx) = mpsc::channel::<Bytes>(16);
    tokio::spawn(async move {
        let _guard = guard;
        let res = wait_for_grant(&api, first, Some(&tx)).await;
        let last = match res {
            Ok(info) => AcquireEvent::Granted {
                lease: Box::new(run_out(&info)),
            },
            Err(e) => {
                let expired = e.code == "expired";
                let error = ErrorDetail {
                    code: e.code,
                    message: e.message,
                    details: e.details,
                };
                if expired {
                    AcquireEvent::Expired { error }
                } else {
                    AcquireEvent::Rejected { error }
                }
            }
        };
        let _ = tx.send(ndjson_line(&last)).await;
    });
    let body = Body::from_stream(futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, std::convert::Infallible>(b), rx))
    }));
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/x-ndjson")
        .body(body)
        .expect("response")
}

/// One event of a streamed acquire, as its line.
fn ndjson_line(e: &AcquireEvent) -> Bytes {
    let mut line = serde_json::to_vec(e).unwrap_or_default();
    line.push(b'\n');
    Bytes::from(line)
}

/// Waits until the run is granted or ends. With `lines`, reports position and reason
/// whenever they change; a closed stream ends the wait (and the guard cancels).
async fn wait_for_grant(
    api: &Api,
    mut info: RunInfo,
    lines: Option<&mpsc::Sender<Bytes>>,
) -> Result<RunInfo, ApiError> {
    let mut rx = None;
    let mut last_sent = None;
    // A stream's position and reason move when the queue does, which does not touch
    // its run: it re-reads them when the daemon says the queue moved (at most once a
    // second, one signal for all). A long-poll waiter reports only its outcome.
    let mut moved = lines.map(|_| api.shared.queue_moved.subscribe());
    loop {
        match info.view.state {
            RunState::Queued => {}
            RunState::Granted => return Ok(info),
            _ => return Err(ended_error(&info)),
        }
        if let Some(tx) = lines {
            let now = (info.view.position, info.view.reason.clone());
            if last_sent.as_ref() != Some(&now) {
                let v = AcquireEvent::Queued {
                    run_id: info.view.run_id.clone(),
                    position: info.view.position,
                    reason: info.view.reason.as_ref().map(reason),
                };
                if tx.send(ndjson_line(&v)).await.is_err() {
                    return Err(ApiError::new(499, "client_gone", "the client went away"));
                }
                last_sent = Some(now);
            }
        }
        if rx.is_none() {
            // Boxed: asking takes a message's room, which the wait must not keep.
            rx = Box::pin(subscribe(api, info.view.run_id.clone())).await;
            match rx.as_mut() {
                // The run as it is now: it may have been granted between the answer
                // above and this subscription, and a new receiver counts the value it
                // starts with as seen (waiting for a change here would miss that
                // grant until the next one).
                Some(w) => {
                    info = w.borrow_and_update().clone();
                    continue;
                }
                None => {
                    return Err(ApiError::new(
                        503,
                        "shutting_down",
                        "berth is shutting down",
                    ))
                }
            }
        }
        let w = rx.as_mut().expect("subscribed");
        let (now, watching) = next_change(api, w, moved.as_mut(), &info, lines).await?;
        info = now;
        if !watching {
            rx = None;
        }
    }
}

/// The daemon's watch of a run's changes (`None`: the daemon is stopping).
async fn subscribe(api: &Api, run_id: String) -> Option<tokio::sync::watch::Receiver<RunInfo>> {
    let (reply, r) = oneshot::channel();
    let _ = api.tx.send(Msg::Subscribe { run_id, reply }).await;
    r.await.ok().flatten()
}

/// The waiting run's next state: when the daemon says it changed (and whether it still
/// tells this watcher), or, for a stream, when the queue moved (its position may have
/// changed without the run changing). A closed stream is the client gone.
async fn next_change(
    api: &Api,
    w: &mut tokio::sync::watch::Receiver<RunInfo>,
    moved: Option<&mut tokio::sync::watch::Receiver<u64>>,
    info: &RunInfo,
    lines: Option<&mpsc::Sender<Bytes>>,
) -> Result<(RunInfo, bool), ApiError> {
    let closed = async {
        match lines {
            Some(tx) => tx.closed().await,
            None => std::future::pending().await,
        }
    };
    let poll = async {
        match moved {
            Some(m) => {
                if m.changed().await.is_err() {
                    std::future::pending::<()>().await
                }
            }
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        changed = w.changed() => {
            // What the daemon sent once the change was durable: no need to ask it. A
            // dropped watcher: the run left the queue (its last word is read here) or
            // the daemon is stopping (subscribing again says so).
            Ok((w.borrow_and_update().clone(), changed.is_ok()))
        }
        _ = poll => {
            api.shared.metrics.waiter_polled();
            let id = info.view.run_id.clone();
            // Boxed, like `subscribe`: a long poll's wait never polls, so it never pays.
            Ok((Box::pin(ask(api, |reply| Msg::Get { run_id: id, reply })).await?, true))
        }
        _ = closed => Err(ApiError::new(499, "client_gone", "the client went away")),
    }
}

async fn list_runs(
    AxState(api): AxState<Api>,
    axum::Extension(caller): axum::Extension<Caller>,
    Params(q): Params,
) -> Result<Json<RunList>, ApiError> {
    if let Some(k) = q.keys().find(|k| *k != "limit" && *k != "all") {
        return Err(ApiError::invalid(k, "is not a known query parameter"));
    }
    let ended = match q.get("all").map(String::as_str) {
        None | Some("false") => false,
        Some("true") => true,
        Some(_) => return Err(ApiError::invalid("all", "must be true or false")),
    };
    let limit = match q.get("limit") {
        Some(l) => l
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=LIST_MAX).contains(n))
            .ok_or_else(|| {
                ApiError::invalid("limit", format!("must be an integer from 1 to {LIST_MAX}"))
            })?,
        None => LIST_MAX,
    };
    let runs = ask(&api, |reply| Msg::List {
        limit,
        ended,
        reply,
    })
    .await?;
    Ok(Json(RunList {
        runs: runs.iter().map(|i| run_for(&caller, i)).collect(),
    }))
}

/// Longest `wait_s` of `GET /v1/runs/{id}`: a proxy or client timeout is the real
/// bound; this one keeps a forgotten request from holding a connection for hours.
pub const GET_WAIT_S_MAX: u64 = 300;

/// `GET /v1/runs/{id}[?wait_s=N]`: the run now, or, with `wait_s`, as soon as the daemon
/// says it changed (its state or reason; a waiter's position is a snapshot, read anew
/// when it answers), or unchanged after N s. Waiting costs the daemon nothing: the
/// request waits on the run's watch, which only a change to this run wakes.
async fn get_run(
    AxState(api): AxState<Api>,
    axum::Extension(caller): axum::Extension<Caller>,
    RunIdPath(id): RunIdPath,
    Params(q): Params,
) -> Result<Response, ApiError> {
    check_run_id(&id)?;
    if let Some(k) = q.keys().find(|k| *k != "wait_s") {
        return Err(ApiError::invalid(k, "is not a known query parameter"));
    }
    let wait_s = match q.get("wait_s") {
        Some(w) => w
            .parse::<u64>()
            .ok()
            .filter(|n| *n <= GET_WAIT_S_MAX)
            .ok_or_else(|| {
                ApiError::invalid(
                    "wait_s",
                    format!("must be an integer from 0 to {GET_WAIT_S_MAX}"),
                )
            })?,
        None => 0,
    };
    if wait_s == 0 {
        let info = ask(&api, |reply| Msg::Get { run_id: id, reply }).await?;
        return Ok(Json(run_for(&caller, &info)).into_response());
    }
    let _slot = (api.shared.limits).take(caller.token, crate::limits::Kind::Wait)?;
    let (tx, rx) = oneshot::channel();
    api.tx
        .send(Msg::Subscribe {
            run_id: id.clone(),
            reply: tx,
        })
        .await
        .map_err(|_| ApiError::new(503, "shutting_down", "berth is shutting down"))?;
    let Some(mut w) = rx.await.ok().flatten() else {
        // No such run: the same answer as without `wait_s`.
        let info = ask(&api, |reply| Msg::Get { run_id: id, reply }).await?;
        return Ok(Json(run_for(&caller, &info)).into_response());
    };
    let first = w.borrow_and_update().clone();
    let info = match tokio::time::timeout(Duration::from_secs(wait_s), w.changed()).await {
        Ok(_) => w.borrow_and_update().clone(),
        // Unchanged: the run as it is now (a waiter's position moves without it).
        Err(_) if first.view.state == RunState::Queued => {
            ask(&api, |reply| Msg::Get { run_id: id, reply }).await?
        }
        Err(_) => first,
    };
    Ok(Json(run_for(&caller, &info)).into_response())
}

async fn renew(
    AxState(api): AxState<Api>,
    axum::Extension(caller): axum::Extension<Caller>,
    RunIdPath(id): RunIdPath,
    body: Body,
) -> Result<Response, ApiError> {
    check_run_id(&id)?;
    let b: RenewBody = json_body(body, true).await?;
    let fence = b.fence.map(check_fence).transpose()?;
    if let Some(t) = b.ttl_s {
        ttl_s(&api.cfg, t)?;
    }
    let cmd = Command::Renew {
        run_id: id,
        fence,
        ttl_ms: b.ttl_s.map(|t| t * 1000),
    };
    let by = caller.tenant;
    let info = ask(&api, |reply| Msg::Command { cmd, by, reply }).await?;
    Ok(Json(run_out(&info)).into_response())
}

async fn release(
    AxState(api): AxState<Api>,
    axum::Extension(caller): axum::Extension<Caller>,
    RunIdPath(id): RunIdPath,
    body: Body,
) -> Result<Response, ApiError> {
    check_run_id(&id)?;
    let b: ReleaseBody = json_body(body, false).await?;
    let fence = check_fence(b.fence)?;
    let cmd = Command::Release { run_id: id, fence };
    let by = caller.tenant;
    let info = ask(&api, |reply| Msg::Command { cmd, by, reply }).await?;
    Ok(Json(run_out(&info)).into_response())
}

async fn register_process(
    AxState(api): AxState<Api>,
    axum::Extension(caller): axum::Extension<Caller>,
    RunIdPath(id): RunIdPath,
    body: Body,
) -> Result<Response, ApiError> {
    check_run_id(&id)?;
    let b: ProcessBody = json_body(body, false).await?;
    let fence = check_fence(b.fence)?;
    if b.pid <= 0 {
        return Err(ApiError::invalid("pid", "must be a positive process id"));
    }
    let me = api.shared.me.clone();
    let (pid, uid) = (b.pid, caller.uid);
    let info =
        crate::daemon::register_off_task(&api.tx, me, id, (fence, pid), (uid, caller.tenant))
            .await?;
    Ok((StatusCode::CREATED, Json(run_out(&info))).into_response())
}

/// `POST /v1/reap`: one reaper pass now (P4). Waits for the stops it starts (at most
/// the grace period plus the kill wait and a margin) and reports what it did.
async fn reap(AxState(api): AxState<Api>, body: Body) -> Result<Json<ReapReport>, ApiError> {
    let _: serde_json::Map<String, Value> = json_body(body, true).await?;
    let (runs, before) = ask(&api, |reply| Msg::Reap { reply }).await?;
    let deadline = tokio::time::Instant::now() + REAP_WAIT;
    let (states, after) = loop {
        let ids = runs.clone();
        let (busy, states, counters) =
            ask(&api, |reply| Msg::ReapStatus { runs: ids, reply }).await?;
        if busy == 0 || tokio::time::Instant::now() >= deadline {
            break (states, counters);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let count = |f: &dyn Fn(&RunState) -> bool| states.iter().filter(|s| f(s)).count() as u64;
    Ok(Json(ReapReport {
        examined: runs.len() as u64,
        reaped: count(&|s| s.is_terminal()),
        degraded: count(&|s| *s == RunState::Degraded),
        processes_terminated: after.processes_terminated - before.processes_terminated,
        reused_pids_protected: after.reused_pids_protected - before.reused_pids_protected,
        diagnostics_bytes: after.diagnostics_bytes,
        diagnostics_dropped: after.diagnostics_dropped,
    }))
}

/// How long `POST /v1/reap` waits for the stops it started.
const REAP_WAIT: Duration = Duration::from_secs(30);

async fn delete_run(
    AxState(api): AxState<Api>,
    axum::Extension(caller): axum::Extension<Caller>,
    RunIdPath(id): RunIdPath,
    Params(q): Params,
) -> Result<Response, ApiError> {
    check_run_id(&id)?;
    if let Some(k) = q.keys().find(|k| *k != "fence") {
        return Err(ApiError::invalid(k, "is not a known query parameter"));
    }
    let cmd = match q.get("fence") {
        Some(f) => {
            let f = f
                .parse::<u64>()
                .map_err(|_| ApiError::invalid("fence", "must be a positive integer"))?;
            Command::Release {
                run_id: id,
                fence: check_fence(f)?,
            }
        }
        None => Command::Cancel { run_id: id },
    };
    let by = caller.tenant;
    let info = ask(&api, |reply| Msg::Command { cmd, by, reply }).await?;
    Ok(Json(run_out(&info)).into_response())
}

/// `GET /v1/status` from the engine's snapshot and the reaper's counters.
pub fn status_out(s: &Snapshot, c: &crate::daemon::ReapCounters) -> Status {
    let resources = s
        .resources
        .iter()
        .map(|r| ResourceStatus {
            name: r.name.clone(),
            total: r.total,
            reserve: r.reserve,
            allocatable: r.allocatable,
            committed: r.committed,
            available: r.available,
        })
        .collect();
    let projects = s
        .projects
        .iter()
        .map(|p| ProjectStatus {
            project: p.name.clone(),
            active: p.active.into(),
            waiting: p.waiting.into(),
            degraded: p.degraded.into(),
            concurrency: p.concurrency,
            evidence: p.evidence.as_ref().map(|e| berth_client::wire::Evidence {
                fingerprint: e.fingerprint.clone(),
                commit: e.commit.clone(),
                ports: e.ports.clone(),
                run_id: e.run_id.clone(),
                at: crate::clock::mono_to_rfc3339(e.at_ms),
            }),
        })
        .collect();
    Status {
        resources,
        memory_available: s.memory_available,
        memory_pending: s.memory_pending,
        slots_max: s.slots_max,
        effective_max_now: s.effective_max_now,
        min_run_blocked: s.min_run_blocked.as_ref().map(reason),
        queued: Queued {
            foreground: s.queued_foreground as u64,
            background: s.queued_background as u64,
        },
        granted: s.granted as u64,
        releasing: s.releasing as u64,
        degraded: s.degraded as u64,
        last_fence: s.last_fence,
        projects,
        reaper: ReaperStatus {
            processes_terminated: c.processes_terminated,
            reused_pids_protected: c.reused_pids_protected,
            diagnostics_bytes: c.diagnostics_bytes,
            diagnostics_dropped: c.diagnostics_dropped,
        },
        ledger: LedgerStatus {
            ended_runs_pruned: c.ledger_pruned,
        },
    }
}

async fn status(AxState(api): AxState<Api>) -> Result<Json<Status>, ApiError> {
    let (s, c) = ask(&api, |reply| Msg::Status { reply }).await?;
    Ok(Json(status_out(&s, &c)))
}

async fn fence_check(
    AxState(api): AxState<Api>,
    Params(q): Params,
) -> Result<Json<FenceCheck>, ApiError> {
    if let Some(k) = q.keys().find(|k| *k != "fence" && *k != "run_id") {
        return Err(ApiError::invalid(k, "is not a known query parameter"));
    }
    let run_id = q
        .get("run_id")
        .ok_or_else(|| ApiError::invalid("run_id", "is required"))?
        .clone();
    check_run_id(&run_id)?;
    let fence = q
        .get("fence")
        .ok_or_else(|| ApiError::invalid("fence", "is required"))?
        .parse::<u64>()
        .map_err(|_| ApiError::invalid("fence", "must be a positive integer"))?;
    let fence = check_fence(fence)?;
    let id = run_id.clone();
    let (current, state) = ask(&api, |reply| Msg::FenceCheck {
        run_id: id,
        fence,
        reply,
    })
    .await?;
    // F2/L8: a run this host does not hold is answered from the fleet's record.
    let (current, host) = match state {
        Some(_) => (current, None),
        None => match fleet::foreign_fence(&api, &run_id, fence).await? {
            Some((current, host)) => (current, Some(host)),
            None => (current, None),
        },
    };
    Ok(Json(FenceCheck {
        run_id,
        fence,
        current,
        state,
        host,
    }))
}

/// Whether `uid` names a user on this host (the password database, through NSS).
pub(super) fn user_exists(uid: u32) -> bool {
    let mut buf = vec![0u8; 16 * 1024];
    // SAFETY: a zeroed passwd is a valid out-parameter; `buf` outlives the call and its
    // length is passed; `found` is only read, never dereferenced.
    let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
    let mut found: *mut libc::passwd = std::ptr::null_mut();
    let rc = unsafe {
        libc::getpwuid_r(
            uid,
            &mut pwd,
            buf.as_mut_ptr().cast(),
            buf.len(),
            &mut found,
        )
    };
    rc == 0 && !found.is_null()
}

/// Refuses a caller whose scope is below `need` (the public group needs none) and
/// counts what was answered as `berth_http_requests_total{route, method, status}`, the
/// refusal included. Attached to each router of `router` (one per scope), so a route
/// gets the scope of the router it is declared in, never one matched from its path.
/// What no route answers is counted as `unmatched` where it is refused
/// (`count_unmatched`).
///
/// One layer for both, and the head's limits checked in `authenticate`: each
/// `from_fn` layer boxes a future of about 1 KiB that a queued long poll keeps for as
/// long as it waits.
async fn require(need: Option<Scope>, shared: Arc<Shared>, req: Request, next: Next) -> Response {
    let method = req.method().clone();
    // The route table's own path: a static label, no String per request.
    let route = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .and_then(|m| doc::paths().iter().find(|p| **p == m.as_str()).copied())
        .unwrap_or("unmatched");
    let scope = req
        .extensions()
        .get::<Caller>()
        .map_or(Scope::Read, |c| c.scope);
    let res = match need {
        Some(need) if scope < need => ApiError::new(
            403,
            "forbidden",
            format!(
                "this call needs the {} scope; the token has {}",
                need.as_str(),
                scope.as_str()
            ),
        )
        .into_response(),
        _ => next.run(req).await,
    };
    // A parked long poll is counted when its answer is sent.
    if res
        .extensions()
        .get::<crate::http::park::Placeholder>()
        .is_none()
    {
        shared.metrics.http(route, &method, res.status().as_u16());
    }
    res
}

/// The outermost layer: an oversized head is refused before anything else reads it,
/// then the caller's token is looked up.
async fn authenticate(AxState(api): AxState<Api>, mut req: Request, next: Next) -> Response {
    if let Err(refused) = crate::http::limits(&req) {
        return refused.into_response();
    }
    let mark = req
        .extensions()
        .get::<Arc<crate::http::ConnMark>>()
        .cloned();
    // Issue 32 finding 2: a reserved connection serves upkeep only.
    if mark.as_ref().is_some_and(|m| m.reserved)
        && !crate::http::is_upkeep(req.method(), req.uri().path())
    {
        let busy = crate::http::reserved_for_upkeep().into_response();
        return count_unmatched(&api, req.method(), busy);
    }
    let authed = || {
        // This connection belongs to a token holder now: never closed for room.
        if let Some(m) = &mark {
            m.authed.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    };
    // HEAD answers as GET does (without the body): the same rule for both.
    let reads = matches!(
        *req.method(),
        axum::http::Method::GET | axum::http::Method::HEAD
    );
    if api.auth && reads && PUBLIC_PATHS.contains(&req.uri().path()) {
        // No caller, so no scope: these routes are in no scoped router.
        return next.run(req).await;
    }
    if !api.auth {
        authed();
        req.extensions_mut().insert(Caller {
            uid: api.uid,
            tenant: None,
            token: None,
            scope: Scope::Admin,
        });
        return next.run(req).await;
    }
    match caller_of(&api, &req) {
        Ok(caller) => {
            req.extensions_mut().insert(caller);
            authed();
            next.run(req).await
        }
        Err(refused) => count_unmatched(&api, req.method(), refused.into_response()),
    }
}

/// Who calls, by the bearer token: a known token that has not expired, or `401`.
fn caller_of(api: &Api, req: &Request) -> Result<Caller, ApiError> {
    let token = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let Some(token) = token else {
        return Err(ApiError::new(
            401,
            "unauthorized",
            "a bearer token is required (Authorization: Bearer <token>)",
        ));
    };
    let grant = {
        let tokens = api.shared.tokens.read().unwrap();
        auth::lookup_keyed(&tokens, token)
    };
    let Some((grant, key)) = grant else {
        return Err(ApiError::new(401, "unauthorized", "the token is not valid"));
    };
    // The clock is read only for a token that can expire.
    if grant.expires_ms.is_some() && grant.expired(crate::clock::wall_ms()) {
        return Err(ApiError::new(401, "unauthorized", "the token has expired"));
    }
    let auth::Grant { scope, uid, .. } = grant;
    Ok(Caller {
        uid: uid.unwrap_or(api.uid),
        // The admin token keeps full reach whatever uid it was made for (S9).
        tenant: uid.filter(|_| scope != Scope::Admin),
        token: Some(key),
        scope,
    })
}

async fn not_found(AxState(api): AxState<Api>, method: axum::http::Method) -> Response {
    let refused = ApiError::new(404, "not_found", "no such endpoint");
    count_unmatched(&api, &method, refused.into_response())
}

async fn method_not_allowed(AxState(api): AxState<Api>, method: axum::http::Method) -> Response {
    let refused = ApiError::new(
        405,
        "method_not_allowed",
        "this endpoint does not take that method",
    );
    count_unmatched(&api, &method, refused.into_response())
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

/// Paths anyone may GET without a token: the dashboard page (static; it holds no data
/// and asks the API with the user's token) and the API's description.
const PUBLIC_PATHS: &[&str] = &["/", "/v1/openapi.json"];

/// A refusal no route saw: counted as `unmatched`.
fn count_unmatched(api: &Api, method: &axum::http::Method, res: Response) -> Response {
    api.shared
        .metrics
        .http("unmatched", method, res.status().as_u16());
    res
}
