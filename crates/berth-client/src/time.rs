//! The one calendar: RFC 3339 instants in UTC as the API writes them
//! (`2026-11-29T19:31:07.123Z`), from and to Unix milliseconds. The daemon writes them
//! (`rfc3339`), the CLI reads them back (`parse_ms`); both use the same pair of
//! civil-date conversions (Howard Hinnant's algorithms), so what one writes the other
//! reads exactly.

/// The civil date (year, month 1–12, day 1–31) of a day counted from 1970-01-01.
pub fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m as u32, d as u32)
}

/// Days from 1970-01-01 to the civil date (month 1–12, day 1–31).
pub fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let (m, d) = (i64::from(m), i64::from(d));
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Unix milliseconds as RFC 3339 in UTC, always with milliseconds; years past 9999
/// are shown as 9999.
pub fn rfc3339(unix_ms: u64) -> String {
    let secs = unix_ms / 1000;
    let rem = secs % 86_400;
    let (y, m, d) = civil_from_days((secs / 86_400) as i64);
    // Digits by hand: this runs for every journal entry and every run shown, and the
    // formatting machinery cost more than the calendar arithmetic.
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
    digits(u64::from(m), 2, '-');
    digits(u64::from(d), 2, 'T');
    digits(rem / 3600, 2, ':');
    digits((rem / 60) % 60, 2, ':');
    digits(rem % 60, 2, '.');
    digits(unix_ms % 1000, 3, 'Z');
    out
}

/// Unix milliseconds of an RFC 3339 UTC time as [`rfc3339`] writes it (a fraction of 1
/// to 3 digits, or none); `None` for anything else.
pub fn parse_ms(s: &str) -> Option<i64> {
    let (date, time) = s.strip_suffix('Z')?.split_once('T')?;
    let mut d = date.splitn(3, '-').map(|p| p.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let (time, frac) = time.split_once('.').unwrap_or((time, "0"));
    if frac.is_empty() || frac.len() > 3 || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let ms: i64 = format!("{frac:0<3}").parse().ok()?;
    let mut t = time.splitn(3, ':').map(|p| p.parse::<i64>().ok());
    let (hh, mm, ss) = (t.next()??, t.next()??, t.next()??);
    if !(1..=12).contains(&m) || !(1..=31).contains(&day) || hh > 23 || mm > 59 || ss > 60 {
        return None;
    }
    let days = days_from_civil(y, m as u32, day as u32);
    Some((days * 86_400 + hh * 3_600 + mm * 60 + ss) * 1000 + ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_formats_known_instants() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(1_796_000_000_123), "2026-11-30T00:53:20.123Z");
        assert_eq!(rfc3339(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(rfc3339(253_402_300_799_999), "9999-12-31T23:59:59.999Z");
        assert_eq!(rfc3339(1_709_251_199_999), "2024-02-29T23:59:59.999Z");
        assert_eq!(rfc3339(1_709_251_200_000), "2024-03-01T00:00:00.000Z");
    }

    #[test]
    fn what_the_daemon_writes_the_cli_reads_back_exactly() {
        // Every day from 1970 to 2400 (leap centuries included), at a moment that
        // changes with the day, and the two conversions are inverses.
        for day in 0..(430 * 366) {
            let ms = day as u64 * 86_400_000 + (day as u64 * 7_919_123) % 86_400_000;
            assert_eq!(parse_ms(&rfc3339(ms)), Some(ms as i64), "day {day}");
            let (y, m, d) = civil_from_days(day);
            assert_eq!(days_from_civil(y, m, d), day);
        }
        assert_eq!(parse_ms("2026-12-01T00:20:03Z"), Some(1_796_084_403_000));
        assert_eq!(parse_ms("2026-12-01T00:20:03.5Z"), Some(1_796_084_403_500));
        for bad in [
            "",
            "2026-13-01T00:00:00Z",
            "2026-12-01T24:00:00Z",
            "2026-12-01 00:00:00Z",
            "2026-12-01T00:00:00.1234Z",
            "2026-12-01T00:00:00",
        ] {
            assert_eq!(parse_ms(bad), None, "{bad}");
        }
    }
}
