//! `berth threads` and `berth drain` (G0–G4): clients of `/v1/threads` and `/v1/drain`.

use std::time::Duration;

use berth_client::wire::{Busy, Drain, DrainRequest, Thread, ThreadList};
use clap::Args;

use crate::client::{print_reply, Client, ConnArgs};

#[derive(Args)]
pub struct ThreadsArgs {
    /// One thread (its owner, registration, workspace and evictions); all if omitted.
    pub key: Option<String>,
    #[command(flatten)]
    pub conn: ConnArgs,
}

/// `berth drain` alone only shows the drain (it was run expecting a status view and
/// drained the host: issue 33 item 5); starting one takes `--start --reason`.
#[derive(Args)]
pub struct DrainArgs {
    /// Start draining the host: no new runs or registrations (needs --reason).
    #[arg(long, requires = "reason")]
    pub start: bool,
    /// Why the drain starts (recorded with who and when).
    #[arg(long, requires = "start")]
    pub reason: Option<String>,
    /// Block until nothing is in flight, printing what the drain waits for as it shrinks.
    #[arg(long)]
    pub wait: bool,
    /// End the drain.
    #[arg(long, conflicts_with_all = ["start", "reason", "wait"])]
    pub off: bool,
    /// Fleet mode: --start and --off act on the fleet's drain, which every host of the
    /// fleet honours, rather than this host's.
    #[arg(long)]
    pub fleet: bool,
    #[command(flatten)]
    pub conn: ConnArgs,
}

/// How often `--wait` asks again.
const DRAIN_POLL: Duration = Duration::from_millis(500);

/// One thread as a table row: key, owner, registration, workspace, last eviction.
fn thread_row(t: &Thread) -> [String; 5] {
    let owner = t.owner.as_ref().map_or("-".to_string(), |o| {
        format!("{} fence {} (run {})", o.owner_gen, o.owner_fence, o.run_id)
    });
    let reg = match &t.registration {
        Some(r) if r.live => format!("until {}", r.live_until),
        Some(r) => format!("lapsed {}", r.live_until),
        None => "-".into(),
    };
    let last = t
        .evictions
        .last()
        .map_or("-".into(), |e| format!("{} ({})", e.at, e.reason));
    [
        t.key.clone(),
        owner,
        reg,
        t.workspace.clone().unwrap_or_else(|| "-".into()),
        last,
    ]
}

const THREAD_HEADER: [&str; 5] = ["thread", "owner", "registered", "workspace", "last evicted"];

pub fn threads_main(a: ThreadsArgs) -> anyhow::Result<u8> {
    let c = Client::new(&a.conn)?;
    let path = match &a.key {
        Some(k) => format!("/v1/threads/{k}"),
        None => "/v1/threads".into(),
    };
    let r = match c.call::<()>("GET", &path, None) {
        Ok(r) => r,
        Err(e) => return Ok(c.unreachable(&e)),
    };
    if a.key.is_some() {
        return print_reply(&r, a.conn.json, |t: &Thread| {
            crate::show::table(THREAD_HEADER, &[thread_row(t)])
        });
    }
    print_reply(&r, a.conn.json, |l: &ThreadList| {
        let rows: Vec<[String; 5]> = l.threads.iter().map(thread_row).collect();
        crate::show::table(THREAD_HEADER, &rows)
    })
}

fn busy_lines(w: &[Busy]) -> String {
    w.iter()
        .map(|b| {
            let until = b.until.as_deref().unwrap_or("-");
            format!("  {} {} until {until}", b.kind, b.id)
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn drain_text(d: &Drain) -> String {
    let mut head = match &d.drain {
        Some(r) => format!("draining since {} by {}: {}", r.at, r.by, r.reason),
        None if d.fleet_drain.is_some() => String::new(),
        None => "not draining".into(),
    };
    if let Some(f) = &d.fleet_drain {
        let sep = if head.is_empty() { "" } else { "; " };
        head = format!(
            "{head}{sep}the fleet is draining since {} by {} on {}: {}",
            f.at, f.by, f.host, f.reason
        );
    }
    let n = d.waiting_for.len();
    match (n, d.draining) {
        (0, _) => format!("{head}; nothing in flight"),
        (n, true) => format!("{head}; waiting for {n}:\n{}", busy_lines(&d.waiting_for)),
        // Without a drain nothing waits for them: they are only in flight.
        (n, false) => format!("{head}; {n} in flight:\n{}", busy_lines(&d.waiting_for)),
    }
}

pub fn drain_main(a: DrainArgs) -> anyhow::Result<u8> {
    let c = Client::new(&a.conn)?;
    let path = match a.fleet {
        true => "/v1/fleet/drain",
        false => "/v1/drain",
    };
    let r = if a.off {
        c.call::<()>("DELETE", path, None)
    } else if a.start {
        let body = DrainRequest { reason: a.reason };
        c.call("POST", path, Some(&body))
    } else {
        c.call::<()>("GET", "/v1/drain", None)
    };
    let r = match r {
        Ok(r) => r,
        Err(e) => return Ok(c.unreachable(&e)),
    };
    if !a.wait || r.status >= 300 {
        return print_reply(&r, a.conn.json, drain_text);
    }
    let mut d: Drain = r.parse()?;
    let mut shown = usize::MAX;
    loop {
        if d.waiting_for.len() != shown {
            shown = d.waiting_for.len();
            println!("{}", drain_text(&d));
        }
        if d.waiting_for.is_empty() {
            return Ok(0);
        }
        std::thread::sleep(DRAIN_POLL);
        let r = match c.call::<()>("GET", "/v1/drain", None) {
            Ok(r) => r,
            Err(e) => return Ok(c.unreachable(&e)),
        };
        if r.status >= 300 {
            return print_reply(&r, a.conn.json, drain_text);
        }
        d = r.parse()?;
    }
}
