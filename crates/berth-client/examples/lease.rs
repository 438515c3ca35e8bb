//! Take a berth, do something under its fence, give it back.
//!
//! ```text
//! berth serve &                      # in another terminal
//! BERTH_URL=http://127.0.0.1:7420 BERTH_TOKEN=$(cat ~/.local/state/berth/admin.token) \
//!     cargo run -p berth-client --example lease -- my-project
//! ```

use berth_client::wire::{AcquireRequest, RenewRequest, UniqueMap};
use berth_client::Client;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("BERTH_URL").unwrap_or_else(|_| "http://127.0.0.1:7420".into());
    let project = std::env::args().nth(1).unwrap_or_else(|| "example".into());
    let berth = Client::new(&url, std::env::var("BERTH_TOKEN").ok())?;
    let lease = berth
        .acquire(&AcquireRequest {
            project,
            resources: Some(UniqueMap([("cpu_millis".to_string(), 500)].into())),
            ttl_s: Some(60),
            // Wait up to a minute for room.
            wait_s: Some(60),
            ..Default::default()
        })
        .await?;
    let fence = lease.fence.ok_or("granted without a fence")?;
    println!("granted {} with fence {fence}", lease.run_id);
    for (k, v) in &lease.env {
        println!("  {k}={v}");
    }
    // A long job renews before its ttl runs out; every call carries the fence, so a
    // stale owner is refused (409 stale_fence) instead of acting on someone else's run.
    let renew = RenewRequest {
        fence: Some(fence),
        ttl_s: Some(60),
    };
    berth.renew(&lease.run_id, &renew).await?;
    let done = berth.release(&lease.run_id, fence).await?;
    println!("{} is {}", done.run_id, done.state.as_str());
    Ok(())
}
