//! `POST /v1/runs`: an acquire answered at once, by long poll or as an NDJSON stream,
//! and the guard that cancels an attached waiter whose client left (A9).

use super::*;

/// Sends `Detach` when a waiting connection goes away (A9). Disarmed when the run
/// never waited (granted or refused at once): then there is nothing to detach from.
pub(super) struct AttachGuard {
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

pub(super) async fn acquire(
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

pub(super) async fn acquire_inner(
    api: Api,
    by: Caller,
    stream: bool,
    conn: Option<Arc<crate::http::ConnMark>>,
    body: Body,
) -> Result<Response, ApiError> {
    // Parsing the request and asking the daemon take far more state than waiting does
    // (4 KiB of it). In a box of their own, freed before the wait, they do not size the
    // future that a queued long poll keeps for hours.
    let (mut first, guard, detach) = Box::pin(enqueue(&api, by, body)).await?;
    let mut queued = first.view.state == RunState::Queued;
    if detach && queued {
        return Ok((StatusCode::ACCEPTED, Json(run_out(&first))).into_response());
    }
    if queued && !stream && waits_for_claim(&first) {
        // Issue 38 (Build 2): on a fleet host a new run's claim is taken before the
        // daemon answers; a run queued for its claim alone (asked again after a
        // re-fence, or queued first while the host was unregistered) is answered on
        // this connection when the claim commits. Parked, its answer would close it.
        if let Some(now) = Box::pin(claim_answer(&api, &first)).await {
            (first, queued) = (now, false);
        }
    }
    if !queued && !stream {
        let res = match first.view.state {
            RunState::Granted => (StatusCode::CREATED, Json(run_out(&first))).into_response(),
            _ => ended_error(&first).into_response(),
        };
        drop(guard);
        return Ok(res);
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

/// How long an acquire waiting only for its fleet-wide claim is held on its connection
/// before it is parked as any queued long poll (a refused claim waits for a wake-up).
pub const CLAIM_ANSWER_WAIT_MS: u64 = 1_000;

/// Queued on a fleet host for its fleet-wide claim alone (everything local fits).
fn waits_for_claim(info: &RunInfo) -> bool {
    (info.view.reason.as_ref()).is_some_and(|r| r.code == "fleet.claim")
}

/// The run once it is no longer queued, if that comes within `CLAIM_ANSWER_WAIT_MS`.
async fn claim_answer(api: &Api, first: &RunInfo) -> Option<RunInfo> {
    let mut w = subscribe(api, first.view.run_id.clone()).await?;
    let wait = async {
        loop {
            let now = w.borrow_and_update().clone();
            if now.view.state != RunState::Queued {
                return Some(now);
            }
            w.changed().await.ok()?;
        }
    };
    tokio::time::timeout(Duration::from_millis(CLAIM_ANSWER_WAIT_MS), wait)
        .await
        .ok()
        .flatten()
}

/// A long poll's answer once its wait is over: the lease (`201`), or why it never
/// came. The guard goes with the wait (A9).
pub(super) async fn long_poll_answer(
    api: &Api,
    first: RunInfo,
    guard: Option<AttachGuard>,
) -> Response {
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
pub(super) async fn enqueue(
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
pub(super) fn stream_grant(api: Api, first: RunInfo, guard: Option<AttachGuard>) -> Response {
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
pub(super) fn ndjson_line(e: &AcquireEvent) -> Bytes {
    let mut line = serde_json::to_vec(e).unwrap_or_default();
    line.push(b'\n');
    Bytes::from(line)
}

/// Waits until the run is granted or ends. With `lines`, reports position and reason
/// whenever they change; a closed stream ends the wait (and the guard cancels).
pub(super) async fn wait_for_grant(
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
pub(super) async fn subscribe(
    api: &Api,
    run_id: String,
) -> Option<tokio::sync::watch::Receiver<RunInfo>> {
    let (reply, r) = oneshot::channel();
    let _ = api.tx.send(Msg::Subscribe { run_id, reply }).await;
    r.await.ok().flatten()
}

/// The waiting run's next state: when the daemon says it changed (and whether it still
/// tells this watcher), or, for a stream, when the queue moved (its position may have
/// changed without the run changing). A closed stream is the client gone.
pub(super) async fn next_change(
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
