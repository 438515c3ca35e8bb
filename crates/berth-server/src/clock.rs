//! Time for the daemon. The engine runs on CLOCK_MONOTONIC milliseconds, which are
//! system-wide, so they survive a restart of `berth serve` within one boot (P5); wall
//! time is only used to show RFC 3339 instants to people and clients (L6).

use std::time::{SystemTime, UNIX_EPOCH};

pub fn mono_ms() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1000 + t.tv_nsec as u64 / 1_000_000
}

pub fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The kernel's boot id: monotonic times from another boot mean nothing here.
pub fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// A monotonic instant shown as wall-clock time. The offset between the clocks is
/// taken once per daemon, so the same instant always prints the same (and a wall-clock
/// jump later changes what people see, never when a lease expires, L6).
pub fn mono_to_rfc3339(mono: u64) -> String {
    static OFFSET: std::sync::OnceLock<i128> = std::sync::OnceLock::new();
    let offset = *OFFSET.get_or_init(|| wall_ms() as i128 - mono_ms() as i128);
    rfc3339((mono as i128 + offset).max(0) as u64)
}

/// Formats Unix milliseconds as RFC 3339 in UTC, e.g. `2026-11-29T19:31:07.123Z` (the
/// one calendar, shared with the CLI that reads these back).
pub use berth_client::time::rfc3339;
