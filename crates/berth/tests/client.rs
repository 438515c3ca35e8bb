//! The Rust client library against the real daemon: the same wire types on both
//! sides, and berth's refusals come back as typed errors with their stable codes.

mod common;

use berth_client::wire::{AcquireRequest, RenewRequest, UniqueMap};
use berth_client::{Client, Error};
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
        let gone = berth.get("nope").await.unwrap_err();
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
