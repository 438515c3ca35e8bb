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

/// Formats Unix milliseconds as RFC 3339 in UTC, e.g. `2026-11-29T19:31:07.123Z`.
pub fn rfc3339(unix_ms: u64) -> String {
    let secs = unix_ms / 1000;
    let ms = unix_ms % 1000;
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    // Digits by hand: this runs for every journal entry and every run shown, and the
    // formatting machinery cost more than the calendar arithmetic above.
    let mut out = String::with_capacity(24);
    let mut digits = |v: u64, n: u32, after: char| {
        let mut p = 10u64.pow(n - 1);
        for _ in 0..n {
            out.push(char::from(b'0' + ((v / p) % 10) as u8));
            p /= 10;
        }
        out.push(after);
    };
    digits(y.clamp(0, 9999) as u64, 4, '-');
    digits(m as u64, 2, '-');
    digits(d as u64, 2, 'T');
    digits(rem / 3600, 2, ':');
    digits((rem / 60) % 60, 2, ':');
    digits(rem % 60, 2, '.');
    digits(ms, 3, 'Z');
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn rfc3339_formats_known_instants() {
        assert_eq!(super::rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            super::rfc3339(1_796_000_000_123),
            "2026-11-30T00:53:20.123Z"
        );
        assert_eq!(super::rfc3339(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(
            super::rfc3339(253_402_300_799_999),
            "9999-12-31T23:59:59.999Z"
        );
        assert_eq!(
            super::rfc3339(1_709_251_199_999),
            "2024-02-29T23:59:59.999Z"
        );
        assert_eq!(
            super::rfc3339(1_709_251_200_000),
            "2024-03-01T00:00:00.000Z"
        );
    }
}
