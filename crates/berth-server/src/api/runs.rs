//! The run routes besides the acquire (get, list, renew, release, processes, reap,
//! cancel, fence check) and the host's status, with how a run is shown on the wire.

use super::*;

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
        usage: i.usage.map(|u| usage_out(&u, i.limits.as_ref(), i.frozen)),
        workspace: i.workspace.clone(),
        worktree: i.worktree.clone(),
    }
}

/// `/proc` scans for runs' use at once, at most (`proc_usage`).
pub const PROC_SCANS_MAX: usize = 2;

/// Issue 36: the use of granted runs berth made no cgroup for (none on this host), from
/// their registered processes' trees in `/proc`: read here, on a blocking thread, with
/// one scan for all of `infos`, never on the daemon's thread.
pub(super) async fn proc_usage(infos: &mut [RunInfo]) {
    let want: Vec<(usize, Vec<berth_proc::ProcId>)> = infos
        .iter()
        .enumerate()
        .filter(|(_, i)| i.usage.is_none() && !i.roots.is_empty())
        .map(|(n, i)| (n, i.roots.clone()))
        .collect();
    if want.is_empty() {
        return;
    }
    // A scan of /proc costs milliseconds: however many requests ask at once, at most
    // `PROC_SCANS_MAX` run, and the rest wait for them (S1: nothing a token holder
    // sends may take the host's threads).
    static SCANS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(PROC_SCANS_MAX);
    let Ok(_turn) = SCANS.acquire().await else {
        return;
    };
    let read = tokio::task::spawn_blocking(move || {
        let all = berth_proc::scan().ok()?;
        Some(
            want.into_iter()
                .map(|(n, roots)| (n, berth_proc::tree_usage(&roots, &all)))
                .collect::<Vec<_>>(),
        )
    });
    for (n, usage) in read.await.ok().flatten().into_iter().flatten() {
        infos[n].usage = Some(usage);
    }
}

/// Issue 36: a run's use of its claim, and the limits it is held to.
fn usage_out(
    u: &berth_proc::limits::Usage,
    l: Option<&berth_proc::limits::Limits>,
    frozen: bool,
) -> RunUsage {
    RunUsage {
        cpu_usec: u.cpu_usec,
        limits: l.map(|l| RunLimits {
            cpu_max_millis: l
                .cpu_quota_us
                .map(|q| q * 1000 / berth_proc::limits::CPU_PERIOD_US),
            cpu_weight: l.cpu_weight,
            memory_high_bytes: l.memory_high_bytes,
            memory_max_bytes: l.memory_max_bytes,
            pids_max: l.pids_max,
            swap_max_bytes: l.swap_max_bytes,
        }),
        memory_bytes: u.memory_bytes,
        memory_peak_bytes: u.memory_peak_bytes,
        oom_kills: u.oom_kills,
        oom_killed: u.oom_kills > 0,
        processes: u.pids,
        frozen,
    }
}

/// Issue 36: whether runs are held to their claims, as `GET /v1/status` says it.
fn limits_status(e: &crate::daemon::Enforcement) -> LimitsStatus {
    LimitsStatus {
        enforced: e.how.is_some(),
        how: e.how.clone(),
        why_not: e.why_not.clone(),
        memory_max_percent: e.policy.memory_max_pct,
        swap_max_bytes: e.policy.swap_max_bytes,
        cpu: match e.policy.cpu {
            berth_proc::limits::CpuMode::Quota => "max",
            berth_proc::limits::CpuMode::Weight => "weight",
        }
        .into(),
        pids_max: e.policy.pids_max,
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

pub(super) fn reason(r: &berth_core::Reason) -> Reason {
    Reason {
        code: r.code.to_string(),
        message: r.message.clone(),
    }
}

pub(super) fn ended_error(i: &RunInfo) -> ApiError {
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

pub(super) async fn list_runs(
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
    let mut runs = ask(&api, |reply| Msg::List {
        limit,
        ended,
        reply,
    })
    .await?;
    proc_usage(&mut runs).await;
    Ok(Json(RunList {
        runs: runs.iter().map(|i| run_for(&caller, i)).collect(),
    }))
}

/// Longest `wait_s` of `GET /v1/runs/{id}`: a proxy or client timeout is the real
/// bound; this one keeps a forgotten request from holding a connection for hours.
pub const GET_WAIT_S_MAX: u64 = 300;

/// `GET /v1/runs/{id}[?wait_s=N[&state=S]]`: the run now, or, with `wait_s`, as soon as
/// the daemon says it changed (its state or reason; a waiter's position is a snapshot,
/// read anew when it answers), or unchanged after N s. Waiting costs the daemon
/// nothing: the request waits on the run's watch, which only a change to this run
/// wakes. `state` is the state the caller last saw: a run no longer in it is answered
/// at once. Without it, a waiter granted between the caller's last look and this
/// request had no change left to come, and its grant was told only after N s (`berth
/// wait` waited a whole 60 s round; `berth-bench fleet` saw a 5 s wake-up).
pub(super) async fn get_run(
    AxState(api): AxState<Api>,
    axum::Extension(caller): axum::Extension<Caller>,
    RunIdPath(id): RunIdPath,
    Params(q): Params,
) -> Result<Response, ApiError> {
    check_run_id(&id)?;
    only_params(&q, &["wait_s", "state"])?;
    let seen = q
        .get("state")
        .map(|s| {
            s.parse::<RunState>()
                .map_err(|e| ApiError::invalid("state", format!("must be a run state: {e}")))
        })
        .transpose()?;
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
        let mut one = [info];
        proc_usage(&mut one).await;
        return Ok(Json(run_for(&caller, &one[0])).into_response());
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
    if seen.is_some_and(|s| s != first.view.state) {
        return Ok(Json(run_for(&caller, &first)).into_response());
    }
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

pub(super) async fn renew(
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
    run_command(&api, &caller, cmd).await
}

/// A lease command on the caller's behalf (S9), answered with the run.
async fn run_command(api: &Api, caller: &Caller, cmd: Command) -> Result<Response, ApiError> {
    let by = caller.tenant;
    let info = ask(api, |reply| Msg::Command { cmd, by, reply }).await?;
    Ok(Json(run_out(&info)).into_response())
}

pub(super) async fn release(
    AxState(api): AxState<Api>,
    axum::Extension(caller): axum::Extension<Caller>,
    RunIdPath(id): RunIdPath,
    body: Body,
) -> Result<Response, ApiError> {
    check_run_id(&id)?;
    let b: ReleaseBody = json_body(body, false).await?;
    let fence = check_fence(b.fence)?;
    let cmd = Command::Release { run_id: id, fence };
    run_command(&api, &caller, cmd).await
}

pub(super) async fn register_process(
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
pub(super) async fn reap(
    AxState(api): AxState<Api>,
    body: Body,
) -> Result<Json<ReapReport>, ApiError> {
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
    let ids = |f: &dyn Fn(&RunState) -> bool| -> Vec<String> {
        states
            .iter()
            .filter(|(_, s)| f(s))
            .map(|(id, _)| id.clone())
            .collect()
    };
    let (reaped, degraded) = (
        ids(&|s| s.is_terminal()),
        ids(&|s| *s == RunState::Degraded),
    );
    Ok(Json(ReapReport {
        examined: runs.len() as u64,
        reaped: reaped.len() as u64,
        degraded: degraded.len() as u64,
        reaped_runs: reaped,
        degraded_runs: degraded,
        processes_terminated: after.processes_terminated - before.processes_terminated,
        reused_pids_protected: after.reused_pids_protected - before.reused_pids_protected,
        diagnostics_bytes: after.diagnostics_bytes,
        diagnostics_dropped: after.diagnostics_dropped,
    }))
}

/// How long `POST /v1/reap` waits for the stops it started.
pub(super) const REAP_WAIT: Duration = Duration::from_secs(30);

pub(super) async fn delete_run(
    AxState(api): AxState<Api>,
    axum::Extension(caller): axum::Extension<Caller>,
    RunIdPath(id): RunIdPath,
    Params(q): Params,
) -> Result<Response, ApiError> {
    check_run_id(&id)?;
    only_params(&q, &["fence"])?;
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
pub fn status_out(
    s: &Snapshot,
    c: &crate::daemon::ReapCounters,
    e: &crate::daemon::Enforcement,
) -> Status {
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
        limits: limits_status(e),
        resources,
        memory_available: s.memory_available,
        memory_pending: s.memory_pending,
        disk_free: s.disk_free,
        disk_pending: s.disk_pending,
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

pub(super) async fn status(AxState(api): AxState<Api>) -> Result<Json<Status>, ApiError> {
    let (s, c) = ask(&api, |reply| Msg::Status { reply }).await?;
    Ok(Json(status_out(&s, &c, &api.shared.enforcement)))
}

pub(super) async fn fence_check(
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

/// A query parameter the route does not take is refused, naming it.
fn only_params(q: &BTreeMap<String, String>, takes: &[&str]) -> Result<(), ApiError> {
    match q.keys().find(|k| !takes.contains(&k.as_str())) {
        Some(k) => Err(ApiError::invalid(k, "is not a known query parameter")),
        None => Ok(()),
    }
}
