//! How the CLI shows things to people: sizes in binary units, durations as `4m12s`,
//! times relative to now (`in 4m12s`, `3s ago`), a run in one line. Scripts use
//! `--json` instead.

use std::time::{SystemTime, UNIX_EPOCH};

use std::collections::BTreeMap;

use berth_client::wire::Run;

/// `4m12s`, `1h02m`, `12s`, `3d04h`.
pub fn duration(secs: u64) -> String {
    match secs {
        s if s < 60 => format!("{s}s"),
        s if s < 3_600 => format!("{}m{:02}s", s / 60, s % 60),
        s if s < 86_400 => format!("{}h{:02}m", s / 3_600, (s % 3_600) / 60),
        s => format!("{}d{:02}h", s / 86_400, (s % 86_400) / 3_600),
    }
}

/// Seconds since the Unix epoch of an RFC 3339 UTC time as the daemon writes it
/// (`2026-12-01T00:20:03.123Z`); `None` for anything else.
pub fn parse_utc(s: &str) -> Option<i64> {
    parse_utc_ms(s).map(|ms| ms.div_euclid(1000))
}

/// [`parse_utc`] in milliseconds (a fraction of 1 to 3 digits, or none): the one
/// calendar, the daemon's own.
pub use berth_client::time::parse_ms as parse_utc_ms;

pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

pub fn now_s() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// `in 4m12s` or `4m12s ago`, relative to now.
pub fn relative(utc: &str) -> Option<String> {
    let delta = parse_utc(utc)? - now_s();
    Some(if delta >= 0 {
        format!("in {}", duration(delta as u64))
    } else {
        format!("{} ago", duration(delta.unsigned_abs()))
    })
}

/// `4m12s ago` for a time in the past (a time a clock step puts in the future is "0s
/// ago").
pub fn ago(utc: &str) -> Option<String> {
    let delta = (now_s() - parse_utc(utc)?).max(0);
    Some(format!("{} ago", duration(delta as u64)))
}

/// The time of day, UTC, for plain lines: `00:20:03Z`.
pub fn clock() -> String {
    let s = now_s().rem_euclid(86_400);
    format!("{:02}:{:02}:{:02}Z", s / 3_600, (s % 3_600) / 60, s % 60)
}

/// A claim as people read it: `1 slot, 2.1 GiB, 0.5 cpu, 10 GiB disk, gpu 1`.
pub fn claim(m: &BTreeMap<String, u64>) -> String {
    const FIXED: [&str; 4] = ["slots", "memory", "cpu_millis", "disk"];
    let n = |k: &str| m.get(k).copied();
    let mut parts = Vec::new();
    if let Some(v) = n("slots") {
        parts.push(format!("{v} slot{}", if v == 1 { "" } else { "s" }));
    }
    if let Some(v) = n("memory") {
        parts.push(berth_core::fmt_bytes(v));
    }
    if let Some(v) = n("cpu_millis") {
        parts.push(format!("{} cpu", cpus(v)));
    }
    if let Some(v) = n("disk") {
        parts.push(format!("{} disk", berth_core::fmt_bytes(v)));
    }
    for (k, v) in m.iter().filter(|(k, _)| !FIXED.contains(&k.as_str())) {
        parts.push(format!("{k} {v}"));
    }
    parts.join(", ")
}

/// A run's memory use against its claim (issue 36), for `berth runs`: `41 MiB/64 MiB,
/// 3 procs` while it holds its claim, its peak after, `oom_killed` first when the
/// kernel killed inside it; empty for a run berth made no cgroup for.
pub fn usage(run: &Run) -> String {
    let Some(u) = &run.usage else {
        return String::new();
    };
    let claim = run.claim.resources.get("memory").copied().unwrap_or(0);
    let (now, what) = match (run.state.holds_claim(), u.memory_bytes) {
        (true, Some(m)) => (Some(m), ""),
        _ => (u.memory_peak_bytes, "peak "),
    };
    let mut parts = Vec::new();
    if u.oom_killed {
        parts.push("oom_killed".to_string());
    }
    if let Some(m) = now {
        let of = if claim > 0 {
            format!("/{}", berth_core::fmt_bytes(claim))
        } else {
            String::new()
        };
        parts.push(format!("{what}{}{of}", berth_core::fmt_bytes(m)));
    }
    if let (true, Some(p)) = (run.state.holds_claim(), u.processes) {
        parts.push(format!("{p} proc{}", if p == 1 { "" } else { "s" }));
    }
    parts.join(", ")
}

/// Millis as CPUs: `0.5`, `2`.
pub fn cpus(millis: u64) -> String {
    let t = format!("{:.3}", millis as f64 / 1000.0);
    t.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// One line about a run, as the lease commands print it.
pub fn run_line(run: &Run) -> String {
    let mut out = format!(
        "run {} ({}): {}",
        run.run_id,
        run.project,
        run.state.as_str()
    );
    if let Some(f) = run.fence {
        out.push_str(&format!(", fence {f}"));
    }
    if let Some(p) = run.position {
        out.push_str(&format!(", position {p}"));
    }
    if let Some(e) = run.expires_at.as_deref().and_then(relative) {
        out.push_str(&format!(", expires {e}"));
    }
    let c = claim(&run.claim.resources);
    if !c.is_empty() {
        out.push_str(&format!("; claims {c}"));
    }
    if let Some(w) = &run.workspace {
        out.push_str(&format!("; workspace {w}"));
    }
    if let Some(r) = &run.reason {
        out.push_str(&format!("; {}", r.message));
    }
    out
}

/// Rows under a header, each column as wide as its widest cell, the last one left
/// ragged (for people; scripts use `--json`). No rows: the header alone.
pub fn table<const N: usize>(header: [&str; N], rows: &[[String; N]]) -> String {
    let mut width = header.map(str::len);
    for row in rows {
        for (w, cell) in width.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: [&str; N]| -> String {
        let mut out = String::new();
        for (i, cell) in cells.iter().enumerate() {
            if i + 1 == N {
                out.push_str(cell);
            } else {
                let pad = width[i] - cell.chars().count();
                out.push_str(cell);
                out.push_str(&" ".repeat(pad + 2));
            }
        }
        out.trim_end().to_string()
    };
    let mut lines = vec![line(header)];
    for row in rows {
        lines.push(line(std::array::from_fn(|i| row[i].as_str())));
    }
    lines.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_times_read_as_people_write_them() {
        assert_eq!(duration(12), "12s");
        assert_eq!(duration(252), "4m12s");
        assert_eq!(duration(3_720), "1h02m");
        assert_eq!(duration(273_600), "3d04h");
        assert_eq!(parse_utc("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(parse_utc("2026-12-01T00:20:03.123Z"), Some(1_796_084_403));
        assert_eq!(parse_utc("2024-02-29T12:00:00Z"), Some(1_709_208_000));
        assert_eq!(parse_utc("2026-13-01T00:00:00Z"), None);
        assert_eq!(parse_utc("yesterday"), None);
        assert_eq!(
            parse_utc_ms("2026-12-01T00:20:03.123Z"),
            Some(1_796_084_403_123)
        );
        assert_eq!(
            parse_utc_ms("2026-12-01T00:20:03.5Z"),
            Some(1_796_084_403_500)
        );
        assert_eq!(parse_utc_ms("2026-12-01T00:20:03.Z"), None);
        assert_eq!(
            table(
                ["id", "scope", "note"],
                &[["a".into(), "operator".into(), "x y".into()]]
            ),
            "id  scope     note\na   operator  x y"
        );
        assert_eq!(cpus(500), "0.5");
        assert_eq!(cpus(2000), "2");
        assert_eq!(
            claim(&BTreeMap::from([
                ("slots".to_string(), 1),
                ("memory".to_string(), 1u64 << 30),
                ("cpu_millis".to_string(), 250)
            ])),
            "1 slot, 1 GiB, 0.25 cpu"
        );
    }
}
