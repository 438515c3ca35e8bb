//! `POST /v1/runs/{id}/runtime {fence}` (C7): start the run's runtime, as a JSON
//! answer or, with `Accept: application/x-ndjson`, a stream of progress lines.

use axum::body::{Body, Bytes};
use axum::extract::State as AxState;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use berth_client::wire::{RuntimeEvent, RuntimeRequest, RuntimeStarted};
use serde_json::json;
use tokio::sync::mpsc;

use super::{ask, json_body, Api, RunIdPath};
use crate::daemon::{Msg, RuntimePlan};
use crate::error::ApiError;
use crate::request::{check_fence, check_run_id, read_contract};

pub async fn start_runtime(
    AxState(api): AxState<Api>,
    axum::Extension(caller): axum::Extension<super::Caller>,
    RunIdPath(id): RunIdPath,
    super::WantsNdjson(stream): super::WantsNdjson,
    body: Body,
) -> Result<Response, ApiError> {
    check_run_id(&id)?;
    may_start(&api, &caller)?;
    let guard = Starting::take(&api, &id)?;
    let b: RuntimeRequest = json_body(body, false).await?;
    let fence = check_fence(b.fence)?;
    let run_id = id.clone();
    let by = caller.tenant;
    let plan = ask(&api, |reply| Msg::RuntimePlan {
        run_id,
        fence,
        by,
        reply,
    })
    .await?;
    let (contract, worktree) = current_contract(&api, &id, fence, &plan).await?;
    let (tx, mut rx) = mpsc::unbounded_channel::<RuntimeEvent>();
    let run_id = id.clone();
    // Its own task: a client that goes away mid-start does not leave half-launched,
    // unrecorded processes behind; the start finishes (or fails and cleans up) anyway.
    let task = tokio::spawn(async move {
        // Held until the start has finished, whether or not its client is still there.
        let _guard = guard;
        let start = crate::runtime::Start {
            plan: &plan,
            contract: &contract,
            worktree: std::path::Path::new(&worktree),
            fence,
            daemon: &api.tx,
            uid: api.uid,
            me: api.shared.me.clone(),
        };
        let result = crate::runtime::start(&start, &tx).await;
        finish(&api, &id, fence, result, &tx).await
    });
    if stream {
        let lines = futures_util::stream::unfold(rx, |mut rx| async move {
            let e = rx.recv().await?;
            let mut line = serde_json::to_vec(&e).unwrap_or_default();
            line.push(b'\n');
            Some((Ok::<_, std::convert::Infallible>(Bytes::from(line)), rx))
        });
        return Ok(Response::builder()
            .status(StatusCode::OK)
            .header(header::CONTENT_TYPE, "application/x-ndjson")
            .body(Body::from_stream(lines))
            .expect("response"));
    }
    let outcome = task
        .await
        .map_err(|_| crate::error::internal("the runtime start panicked"))?;
    let mut events = Vec::new();
    while let Ok(e) = rx.try_recv() {
        events.push(e);
    }
    answer(outcome, events, run_id)
}

/// C7: one runtime start per run at a time: a second one (a retry while the first
/// still runs, or a flood of them) would launch the same ports again.
struct Starting {
    set: std::sync::Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
    run_id: String,
}

impl Starting {
    fn take(api: &Api, run_id: &str) -> Result<Starting, ApiError> {
        let mut set = api.starting.lock().unwrap_or_else(|e| e.into_inner());
        if !set.insert(run_id.to_string()) {
            return Err(ApiError::new(
                409,
                "runtime_starting",
                format!("run {run_id}: its runtime is being started already; wait for that start to finish"),
            ));
        }
        Ok(Starting {
            set: api.starting.clone(),
            run_id: run_id.to_string(),
        })
    }
}

impl Drop for Starting {
    fn drop(&mut self) {
        let mut set = self.set.lock().unwrap_or_else(|e| e.into_inner());
        set.remove(&self.run_id);
    }
}

/// berth launches a runtime's commands as its own user. A token that acts for another
/// user (S3) must not get berth's user (root, perhaps) to run commands from a worktree
/// it controls.
fn may_start(api: &Api, caller: &super::Caller) -> Result<(), ApiError> {
    if caller.uid == api.uid {
        return Ok(());
    }
    Err(ApiError::new(
        403,
        "runtime_forbidden",
        format!(
            "berth runs a runtime's commands as its own user (uid {}); this token acts for uid {}",
            api.uid, caller.uid
        ),
    ))
}

/// The JSON answer of a start that is not streamed.
fn answer(
    outcome: Result<(std::collections::BTreeMap<String, u16>, bool), ApiError>,
    events: Vec<RuntimeEvent>,
    run_id: String,
) -> Result<Response, ApiError> {
    match outcome {
        Ok((ports, promoted)) => Ok(Json(RuntimeStarted {
            ports,
            promoted,
            events,
        })
        .into_response()),
        Err(e) => {
            let failed = events.iter().find_map(|e| match e {
                RuntimeEvent::Failed { port, log_tail, .. } => {
                    Some((port.clone(), log_tail.clone()))
                }
                _ => None,
            });
            let (port, log_tail) = failed.unwrap_or_default();
            // Added to what the failure said (a taken port's number and holder).
            let mut details = json!({
                "run_id": run_id, "port": port, "log_tail": log_tail, "events": events
            });
            if let (Some(all), Some(own)) = (details.as_object_mut(), e.details.as_object()) {
                for (k, v) in own {
                    all.entry(k.clone()).or_insert_with(|| v.clone());
                }
            }
            Err(e.with(details))
        }
    }
}

/// The worktree's contract now, which must be the one the run was admitted with (C4:
/// otherwise the run is demoted and told to acquire again).
async fn current_contract(
    api: &Api,
    id: &str,
    fence: u64,
    plan: &RuntimePlan,
) -> Result<(crate::contract::Contract, String), ApiError> {
    let no_contract = |why: &str| {
        ApiError::new(
            409,
            "no_contract",
            format!("run {id} has no runtime to start: {why}"),
        )
    };
    let worktree = plan
        .info
        .worktree
        .clone()
        .ok_or_else(|| no_contract("it was acquired without a worktree"))?;
    let contract = read_contract(&worktree)
        .await?
        .ok_or_else(|| no_contract("its worktree has no .berth.toml"))?;
    let admitted = plan.contract.as_ref();
    let same = admitted.is_some_and(|c| {
        c.fingerprint == contract.info.fingerprint && c.commit == contract.info.commit
    });
    if !same {
        let (run_id, info) = (id.to_string(), contract.info.clone());
        let _ = ask(api, |reply| Msg::ContractChanged {
            run_id,
            fence,
            contract: info,
            reply,
        })
        .await;
        return Err(ApiError::new(
            409,
            "contract_changed",
            format!("run {id}: the worktree's contract or commit changed since it was admitted; release it and acquire again"),
        ));
    }
    if contract.ports.is_empty() {
        return Err(no_contract("its contract declares no [[port]]"));
    }
    Ok((contract, worktree))
}

/// Tells the daemon how the start went (C3 promotion or C4 invalidation) and reports
/// the last event.
async fn finish(
    api: &Api,
    id: &str,
    fence: u64,
    result: Result<std::collections::BTreeMap<String, u16>, crate::runtime::Failure>,
    tx: &mpsc::UnboundedSender<RuntimeEvent>,
) -> Result<(std::collections::BTreeMap<String, u16>, bool), ApiError> {
    match result {
        Ok(ports) => {
            let (run_id, names) = (id.to_string(), ports.keys().cloned().collect());
            let promoted = ask(api, |reply| Msg::RuntimeReady {
                run_id,
                fence,
                ports: names,
                reply,
            })
            .await?;
            let _ = tx.send(RuntimeEvent::Done {
                ports: ports.clone(),
                promoted,
            });
            Ok((ports, promoted))
        }
        Err(f) => {
            let _ = tx.send(f.event());
            let _ = api
                .tx
                .send(Msg::RuntimeFailed {
                    run_id: id.to_string(),
                    fence,
                })
                .await;
            let e = ApiError::new(422, "runtime_failed", format!("port {}: {}", f.port, f.why));
            Err(match f.taken {
                Some((number, pid)) => ApiError {
                    code: "port_taken".into(),
                    ..e
                }
                .with(serde_json::json!({"port": f.port, "number": number, "pid": pid})),
                None => e,
            })
        }
    }
}
