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

fn host_row(h: &FleetHost) -> [String; 7] {
    [
        h.host_id.clone(),
        format!("{} v{}", h.address, h.version),
        h.generation.to_string(),
        format!("{} ms", h.heartbeat_age_ms),
        h.granted.to_string(),
        h.queue_depth.to_string(),
        match h.declared_by.as_deref() {
            Some(by) => format!("{}; declared dead by {by}", resources(&h.resources)),
            None => resources(&h.resources),
        },
    ]
}

const HEADER: [&str; 7] = [
    "host", "address", "gen", "beat", "granted", "queued", "free",
];

fn fleet_text(f: &Fleet) -> String {
    let mut out = vec![format!(
        "fleet (asked {}): {} live host(s), {} queued; free {}",
        f.host_id,
        f.hosts.len(),
        f.queue_depth,
        resources(&f.totals)
    )];
    let rows: Vec<[String; 7]> = f.hosts.iter().map(host_row).collect();
    out.push(crate::show::table(HEADER, &rows));
    if !f.dead.is_empty() {
        out.push("dead:".into());
        let rows: Vec<[String; 7]> = f.dead.iter().map(host_row).collect();
        out.push(crate::show::table(HEADER, &rows));
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
