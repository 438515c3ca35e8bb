//! `berth fleet` (F4): a client of `GET /v1/fleet`.

use berth_client::wire::{Fleet, FleetHost, FleetResource};
use std::collections::BTreeMap;

use crate::client::{print_reply, Client, ConnArgs};

fn resources(r: &BTreeMap<String, FleetResource>) -> String {
    let show = |name: &str, v: u64| match name {
        "memory" | "disk" => berth_core::fmt_bytes(v),
        _ => v.to_string(),
    };
    r.iter()
        .map(|(n, f)| format!("{n} {}/{}", show(n, f.available), show(n, f.total)))
        .collect::<Vec<_>>()
        .join(", ")
}

fn host_line(h: &FleetHost) -> String {
    let dead = h
        .declared_by
        .as_deref()
        .map_or(String::new(), |by| format!("; declared dead by {by}"));
    format!(
        "{}\t{} v{} gen {}; beat {} ms ago; {} granted, {} queued; free {}{dead}",
        h.host_id,
        h.address,
        h.version,
        h.generation,
        h.heartbeat_age_ms,
        h.granted,
        h.queue_depth,
        resources(&h.resources)
    )
}

fn fleet_text(f: &Fleet) -> String {
    let mut out = vec![format!(
        "fleet (asked {}): {} live host(s), {} queued; free {}",
        f.host_id,
        f.hosts.len(),
        f.queue_depth,
        resources(&f.totals)
    )];
    out.extend(f.hosts.iter().map(host_line));
    if !f.dead.is_empty() {
        out.push("dead:".into());
        out.extend(f.dead.iter().map(host_line));
    }
    out.join("\n")
}

pub fn fleet_main(conn: ConnArgs) -> anyhow::Result<u8> {
    let c = Client::new(&conn)?;
    let r = match c.call::<()>("GET", "/v1/fleet", None) {
        Ok(r) => r,
        Err(e) => return Ok(c.unreachable(&e)),
    };
    print_reply(&r, conn.json, fleet_text)
}
