//! F1–F4 over HTTP: `GET /v1/fleet`, and the fleet's side of `/v1/fences/check` and of
//! a thread's attach. Questions go to the fleet thread ([`crate::fleet::Handle::ask`]).

use std::collections::BTreeMap;

use axum::extract::State as AxState;
use axum::response::{IntoResponse, Response};
use axum::Json;
use berth_client::wire;
use berth_core::threads::{Owner, ThreadError};
use berth_store::fleet::{FleetDrain, FleetError, HostRow, ThreadOwner};

use super::{ask, Api, Caller};
use crate::daemon::{FleetChange, Msg};
use crate::error::{fleet_unavailable, ApiError};

pub(super) fn refused(e: FleetError) -> ApiError {
    match e {
        FleetError::Invalid(m) => ApiError::new(400, "invalid_request", m),
        e => fleet_unavailable(e),
    }
}

/// A host's load as its heartbeat wrote it (what this berth writes; anything else,
/// from a hostile or newer peer, reads as empty rather than failing the whole view).
fn host_view(h: HostRow) -> wire::FleetHost {
    let load: wire::FleetLoad = serde_json::from_str(&h.load).unwrap_or_default();
    wire::FleetHost {
        host_id: h.host_id,
        generation: h.gen,
        address: h.address,
        version: h.version,
        heartbeat_age_ms: h.beat_age_ms,
        queue_depth: load.queue_depth,
        granted: load.granted,
        resources: load.resources,
        declared_by: h.declared_by,
    }
}

/// The fleet link, or `404 fleet_mode_off`.
pub(super) fn link(api: &Api) -> Result<&crate::fleet::Handle, ApiError> {
    api.fleet.as_ref().ok_or_else(|| {
        ApiError::new(
            404,
            "fleet_mode_off",
            "this host is not in fleet mode (start it with berth serve --store postgres://…)",
        )
    })
}

/// Issue 38 Build 3: the fleet's drain started (the first record stays) or ended,
/// in the fleet store, then mirrored here before the answer; every other host reads
/// it when this one announces it, at its next heartbeat at the latest.
async fn set_drain(api: &Api, d: Option<FleetDrain>) -> Result<Response, ApiError> {
    let link = link(api)?;
    let (now, version) = link
        .ask(move |s| s.set_drain(d.as_ref()))
        .await
        .map_err(refused)?;
    let change = FleetChange::Drain(now);
    let d = ask(api, |reply| Msg::FleetChanged {
        change,
        version,
        reply,
    })
    .await?;
    Ok(Json(d).into_response())
}

pub async fn drain_start(
    AxState(api): AxState<Api>,
    axum::Extension(caller): axum::Extension<Caller>,
    body: axum::body::Body,
) -> Result<Response, ApiError> {
    let (by, reason) = super::threads::drain_request(&caller, body).await?;
    let host_id = link(&api)?.status.host_id();
    let at = crate::clock::rfc3339(crate::clock::wall_ms());
    let d = FleetDrain {
        by,
        at,
        reason,
        host_id,
    };
    set_drain(&api, Some(d)).await
}

pub async fn drain_end(
    AxState(api): AxState<Api>,
    axum::Extension(caller): axum::Extension<Caller>,
) -> Result<Response, ApiError> {
    super::threads::may_drain(&caller)?;
    set_drain(&api, None).await
}

/// F4: every live host's capacity, the live hosts' sums, and the dead hosts.
pub async fn fleet(AxState(api): AxState<Api>) -> Result<Json<wire::Fleet>, ApiError> {
    let link = link(&api)?;
    let rows = link.ask(|s| s.hosts()).await.map_err(refused)?;
    let (mut hosts, mut dead) = (Vec::new(), Vec::new());
    let mut totals: BTreeMap<String, wire::FleetResource> = BTreeMap::new();
    let mut queue_depth = 0u64;
    for row in rows {
        let alive = row.alive;
        let h = host_view(row);
        if !alive {
            dead.push(h);
            continue;
        }
        queue_depth = queue_depth.saturating_add(h.queue_depth);
        for (name, r) in &h.resources {
            let t = totals.entry(name.clone()).or_default();
            t.total = t.total.saturating_add(r.total);
            t.committed = t.committed.saturating_add(r.committed);
            t.available = t.available.saturating_add(r.available);
        }
        hosts.push(h);
    }
    Ok(Json(wire::Fleet {
        host_id: link.status.host_id(),
        hosts,
        totals,
        queue_depth,
        dead,
    }))
}

/// L8 fleet-wide: a run this host does not know, as the fleet knows it: whether
/// `fence` is current (its holder alive and the claim held) and which host holds it.
pub async fn foreign_fence(
    api: &Api,
    run_id: &str,
    fence: u64,
) -> Result<Option<(bool, String)>, ApiError> {
    let Some(link) = &api.fleet else {
        return Ok(None);
    };
    let id = run_id.to_owned();
    let me = link.status.host_id();
    let f = link.ask(move |s| s.fence(&id)).await.map_err(refused)?;
    // This host's own runs are answered by its engine alone: a row of this host the
    // engine does not know is a claim of a generation that is gone.
    Ok(f.map(|f| {
        (
            f.fence == fence && f.host_alive && f.host_id != me,
            f.host_id,
        )
    }))
}

/// G2 fleet-wide: an attach is refused if the fleet remembers a newer owner of the
/// thread, whichever host it registered on.
pub async fn check_thread_owner(api: &Api, key: &str, owner: &Owner) -> Result<(), ApiError> {
    let Some(link) = &api.fleet else {
        return Ok(());
    };
    let claim = ThreadOwner {
        gen: owner.gen.clone(),
        fence: owner.fence,
        run_id: owner.run_id.clone(),
    };
    let (k, me) = (key.to_owned(), link.status.host_id());
    let newer = link
        .ask(move |s| s.thread_owner(&k, &claim, &me))
        .await
        .map_err(refused)?;
    match newer {
        None => Ok(()),
        Some(cur) => Err(crate::daemon::Error::Thread(ThreadError::Mismatch {
            key: key.to_owned(),
            current: Owner {
                gen: cur.gen,
                fence: cur.fence,
                run_id: cur.run_id,
            },
        })
        .into()),
    }
}

/// B3 fleet-wide: an operator's reconcile frees the owner's lapsed tokens in the fleet
/// store first (`false`: it held none there), then on this host. Every host's claims
/// are refused by the store's lapsed token, so freeing only this host's (as berth did
/// until the daemon simulator found it) left the owner refused fleet-wide for good and
/// the harness short of a token for ever. A store that cannot be reached answers 503
/// and nothing is freed.
/// Returns whether the store freed a token.
pub async fn reconcile_fleet_wide(api: &Api, scope: &str, owner: &str) -> Result<bool, ApiError> {
    let Some(link) = &api.fleet else {
        return Ok(false);
    };
    let (s, o) = (scope.to_owned(), owner.to_owned());
    link.ask(move |st| st.reconcile(&s, &o))
        .await
        .map_err(refused)
}
