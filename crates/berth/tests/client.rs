//! The Rust client library against the real daemon: the same wire types on both
//! sides, and berth's refusals come back as typed errors with their stable codes.

mod common;

use berth_client::wire::{
    AcquireEvent, AcquireRequest, ControlRequest, ReconcileRequest, RenewRequest,
    ReservationRequest, ThreadClaim, TokenRequest, UniqueMap,
};
use berth_client::{Client, Error, EventsQuery};
use berth_core::{Class, RunState};
use common::Daemon;
use std::time::Duration;

fn request(id: &str) -> AcquireRequest {
    AcquireRequest {
        run_id: Some(id.into()),
        project: format!("p-{id}"),
        class: Some(Class::Managed),
        resources: Some(UniqueMap([("cpu_millis".to_string(), 100)].into())),
        ttl_s: Some(60),
        ..Default::default()
    }
}

#[test]
fn the_async_client_acquires_renews_lists_and_releases_through_the_shared_types() {
    let d = Daemon::start(&["--slots-max", "1"]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let berth = Client::new(&d.url, Some(d.token.clone())).unwrap();
        let lease = berth.acquire(&request("c1")).await.unwrap();
        assert_eq!(lease.state, RunState::Granted);
        let fence = lease.fence.expect("a fence");
        assert_eq!(lease.env["BERTH_FENCE"], fence.to_string());
        assert_eq!(lease.claim.resources["cpu_millis"], 100);
        assert!(lease.workspace.is_some());

        // A second run waits behind the one slot: its answer is a queued run.
        let mut waiter = request("c2");
        waiter.wait_s = Some(0);
        let w = berth.acquire(&waiter).await;
        assert!(
            matches!(&w, Err(Error::Refused { status: 410, .. })) || w.is_ok(),
            "{w:?}"
        );

        let renewed = berth
            .renew(
                "c1",
                &RenewRequest {
                    fence: Some(fence),
                    ttl_s: Some(30),
                },
            )
            .await
            .unwrap();
        assert_eq!(renewed.fence, Some(fence));
        let list = berth.list(false).await.unwrap();
        assert_eq!(
            list.runs
                .iter()
                .map(|r| r.run_id.as_str())
                .collect::<Vec<_>>(),
            ["c1"]
        );
        let status = berth.status().await.unwrap();
        assert_eq!(status.granted, 1);
        assert!(status.last_fence >= fence);
        let check = berth.fence_check("c1", fence).await.unwrap();
        assert!(check.current);

        // A run without a worktree has no runtime to start: a typed refusal.
        let rt = berth
            .start_runtime("c1", fence, Duration::from_secs(5))
            .await
            .unwrap_err();
        assert_eq!(rt.code(), Some("no_contract"), "{rt}");
        // A stale owner is refused with the rule's code, and nothing changes.
        let stale = berth.release("c1", fence + 1).await.unwrap_err();
        assert_eq!(stale.code(), Some("stale_fence"), "{stale}");
        assert!(matches!(stale, Error::Refused { status: 409, .. }));
        let released = berth.release("c1", fence).await.unwrap();
        assert_eq!(released.state, RunState::Released);
        let gone = berth.run("nope").await.unwrap_err();
        assert_eq!(gone.code(), Some("not_found"));

        // Without a token, the daemon's 401 comes back typed too.
        let anonymous = Client::new(&d.url, None).unwrap();
        let e = anonymous.status().await.unwrap_err();
        assert!(matches!(e, Error::Refused { status: 401, .. }), "{e}");
        // Nothing listening: unreachable, not a refusal.
        let port = common::free_port();
        let nobody = Client::new(&format!("http://127.0.0.1:{port}"), None).unwrap();
        assert!(matches!(
            nobody.status().await,
            Err(Error::Unreachable { .. })
        ));
    });
}

/// Issue 34: every operation of the OpenAPI document is called by the Rust client
/// against a real daemon. The daemon's own request counters (`/metrics`, by route and
/// method) say which were reached, so a new endpoint without a client method, or a
/// method that reaches no route, fails here.
#[test]
fn every_operation_of_the_openapi_document_is_reached_by_the_rust_client() {
    let d = Daemon::start(&["--slots-max", "2"]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let metrics = rt.block_on(async {
        let berth = Client::new(&d.url, Some(d.token.clone())).unwrap();
        call_every_operation(&berth).await;
        every_entry_reads_back_as_its_kind(&berth).await;
        berth.metrics().await.unwrap()
    });
    let doc: serde_json::Value =
        serde_json::from_str(include_str!("../../../docs/openapi.json")).unwrap();
    let mut missed = Vec::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            let Some(id) = op.get("operationId") else {
                continue;
            };
            let label = format!("route=\"{path}\",method=\"{}\"", method.to_uppercase());
            let reached = metrics.lines().any(|l| {
                l.starts_with("berth_http_requests_total{")
                    && l.contains(&label)
                    && !l.contains("status=\"405\"")
            });
            if !reached {
                missed.push(id.as_str().unwrap().to_string());
            }
        }
    }
    assert!(
        missed.is_empty(),
        "operations no client method reached: {missed:?}"
    );
}

/// Issue 35: every journal entry the calls made reads back as the documented type of
/// its kind (`JournalEntry::typed`), and the kinds are many (the check is not vacuous).
async fn every_entry_reads_back_as_its_kind(berth: &Client) {
    let journal = berth.journal(0, None).await.unwrap();
    let mut kinds = std::collections::BTreeSet::new();
    for e in &journal {
        match e.typed() {
            Some(Ok(j)) => assert_eq!(j.kind(), e.kind),
            Some(Err(why)) => panic!("{} does not read as its kind: {why}: {e:?}", e.kind),
            None => panic!("{} is not a kind the journal documents: {e:?}", e.kind),
        }
        kinds.insert(e.kind.clone());
    }
    for kind in [
        "granted",
        "renewed",
        "process_registered",
        "token_created",
        "token_revoked",
        "thread_attached",
        "thread_deadline",
        "thread_detached",
        "thread_evicted",
        "drain_started",
        "drain_ended",
        "released",
    ] {
        assert!(kinds.contains(kind), "no {kind} entry in {kinds:?}");
    }
}

/// Each operation once: an answer, or a refusal of this request by its route.
async fn call_every_operation(berth: &Client) {
    let lease = berth.acquire_stream(&request("all")).await.unwrap();
    let lease = lease.granted().await.unwrap();
    let (id, fence) = (lease.run_id.as_str(), lease.fence.unwrap());
    assert_eq!(berth.run(id).await.unwrap().fence, Some(fence));
    assert_eq!(berth.list(true).await.unwrap().runs.len(), 1);
    assert!(berth.fence_check(id, fence).await.unwrap().current);
    let renew = RenewRequest {
        fence: Some(fence),
        ttl_s: None,
    };
    berth.renew(id, &renew).await.unwrap();
    let mut sleeper = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let registered = berth.register_process(id, fence, sleeper.id() as i32).await;
    sleeper.kill().unwrap();
    sleeper.wait().unwrap();
    assert_eq!(registered.unwrap().run_id, id);
    let runtime = berth.start_runtime(id, fence, Duration::from_secs(5)).await;
    assert_eq!(runtime.unwrap_err().code(), Some("no_contract"));
    let journal = berth.journal(0, None).await.unwrap();
    assert!(journal.iter().any(|e| e.kind == "granted"), "{journal:?}");
    assert_eq!(berth.export_journal(1, None).await.unwrap()[0].seq, 1);
    let mut events = berth.events(EventsQuery {
        after: Some(0),
        ..Default::default()
    });
    assert_eq!(events.next().await.unwrap().seq, 1);
    assert!(berth.metrics().await.unwrap().contains("berth_"));
    assert!(berth
        .dashboard()
        .await
        .unwrap()
        .to_lowercase()
        .contains("<html"));
    assert_eq!(berth.openapi().await.unwrap()["openapi"], "3.1.0");
    berth.status().await.unwrap();
    let fleet = berth.fleet().await.unwrap_err();
    assert_eq!(fleet.code(), Some("fleet_mode_off"), "{fleet}");
    for refused in [
        berth.start_fleet_drain(None).await.unwrap_err(),
        berth.end_fleet_drain().await.unwrap_err(),
    ] {
        assert_eq!(refused.code(), Some("fleet_mode_off"), "{refused}");
    }
    berth.idle().await.unwrap();
    berth.reap().await.unwrap();
    let token = TokenRequest {
        scope: "read".into(),
        uid: None,
        expires_s: Some(60),
    };
    let made = berth.create_token(&token).await.unwrap();
    assert!(berth
        .tokens()
        .await
        .unwrap()
        .tokens
        .iter()
        .any(|t| t.id == made.id));
    assert_eq!(berth.revoke_token(&made.id).await.unwrap().id, made.id);
    let claim = ThreadClaim {
        run_id: id.into(),
        owner_gen: "g".into(),
        owner_fence: 1,
        run_budget_ms: Some(60_000),
        evict: None,
    };
    berth.attach_thread("t1", &claim).await.unwrap();
    berth.move_thread_deadline("t1", &claim).await.unwrap();
    assert_eq!(berth.thread("t1").await.unwrap().key, "t1");
    assert_eq!(berth.threads().await.unwrap().threads.len(), 1);
    let detach = ThreadClaim {
        run_budget_ms: None,
        ..claim
    };
    berth.detach_thread("t1", &detach).await.unwrap();
    berth.evict_thread("t1").await.unwrap();
    let drain = berth.start_drain(Some("test".into())).await.unwrap();
    assert_eq!(drain.drain.unwrap().reason, "test");
    assert!(berth.drain().await.unwrap().drain.is_some());
    assert!(berth.end_drain().await.unwrap().drain.is_none());
    // Budgets: each scope call reaches its route, and a scope nobody declared is a
    // typed refusal (the counters above say the route answered, not "no such route").
    berth.scopes().await.unwrap();
    let refused = |r: Result<(), Error>| {
        let e = r.unwrap_err();
        assert!(matches!(e, Error::Refused { .. }), "{e}");
    };
    refused(berth.scope("s").await.map(|_| ()));
    let reserve = ReservationRequest {
        owner: "o".into(),
        operation_id: "op1".into(),
        harness: "h".into(),
    };
    refused(berth.reserve("s", &reserve).await.map(|_| ()));
    refused(berth.unreserve("s", "o", "op1").await.map(|_| ()));
    let reconcile = ReconcileRequest {
        owner: "o".into(),
        reason: "test".into(),
    };
    refused(berth.reconcile("s", &reconcile).await.map(|_| ()));
    let control = ControlRequest {
        request_id: "req-1".into(),
        mode: "pause".into(),
    };
    let _ = berth.control("s", &control).await;
    let _ = berth.forget_scope("s").await;
    berth.release(id, fence).await.unwrap();
    let cancelled = berth.cancel(id, None).await;
    assert!(cancelled.is_ok() || cancelled.unwrap_err().code().is_some());
}

/// The streamed acquire shows the wait as it goes: a `Queued` event with the run's
/// position while the slot is held, then `Granted` once it is released; the journal's
/// event stream resumed after an entry yields the very next one.
#[test]
fn the_rust_client_streams_the_wait_and_resumes_the_journal_without_a_gap() {
    let d = Daemon::start(&["--slots-max", "1"]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let berth = Client::new(&d.url, Some(d.token.clone())).unwrap();
        let holder = berth.acquire(&request("s1")).await.unwrap();
        let mut waiter = request("s2");
        waiter.wait_s = Some(30);
        let mut stream = berth.acquire_stream(&waiter).await.unwrap();
        match stream.next().await.unwrap() {
            Some(AcquireEvent::Queued {
                run_id, position, ..
            }) => {
                assert_eq!((run_id.as_str(), position), ("s2", Some(1)));
            }
            other => panic!("a queued event first, not {other:?}"),
        }
        berth.release("s1", holder.fence.unwrap()).await.unwrap();
        let lease = loop {
            match stream.next().await.unwrap() {
                Some(AcquireEvent::Queued { .. }) => continue,
                Some(AcquireEvent::Granted { lease }) => break lease,
                other => panic!("granted, not {other:?}"),
            }
        };
        assert_eq!(lease.run_id, "s2");
        assert!(
            stream.next().await.unwrap().is_none(),
            "nothing after the grant"
        );

        let mut events = berth.events(EventsQuery {
            after: Some(0),
            ..Default::default()
        });
        let first = events.next().await.unwrap();
        let second = events.next().await.unwrap();
        assert_eq!(second.seq, first.seq + 1);
        let mut resumed = berth.events(EventsQuery {
            after: Some(first.seq),
            ..Default::default()
        });
        assert_eq!(resumed.next().await.unwrap(), second);
        // Filtered by kind: only grants, in order.
        let mut grants = berth.events(EventsQuery {
            after: Some(0),
            kinds: vec!["granted".into()],
            ..Default::default()
        });
        assert_eq!(grants.next().await.unwrap().run_id.as_deref(), Some("s1"));
        assert_eq!(grants.next().await.unwrap().run_id.as_deref(), Some("s2"));
    });
}
