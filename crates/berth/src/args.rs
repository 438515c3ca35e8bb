//! Parsing of the CLI's and berth.toml's values, in one place for every subcommand:
//! sizes and durations (the engine's own parsers), and CPUs as decimals.

use berth_core::validate;

/// Sizes in bytes: `2GiB`, `512MiB`, `4GB` (decimal).
pub fn parse_size(s: &str) -> Result<u64, String> {
    validate::parse_size(s)
}

/// Durations as milliseconds: `30s`, `5m`.
pub fn parse_duration(s: &str) -> Result<u64, String> {
    validate::parse_duration_ms(s)
}

/// A percentage as hundredths of a percent (PSI's precision): `10%`, `12.5%`, `0.25%`,
/// at most `100%`.
pub fn parse_percent(s: &str) -> Result<u32, String> {
    let bad = || format!("{s:?} is not a percentage like 10% or 2.5% (0% to 100%)");
    let t = s.trim().strip_suffix('%').ok_or_else(bad)?;
    let bp = validate::parse_hundredths(t).ok_or_else(bad)?;
    (bp <= berth_core::PRESSURE_BP_MAX)
        .then_some(bp)
        .ok_or_else(bad)
}

/// CPUs as millis, one unit everywhere (issue 33 item 7: `--cpu-total` was millis
/// while `--cpus` was CPUs): decimal CPUs (`1.5` is 1500) or millis with an `m`, as
/// Kubernetes writes them (`500m` is half a CPU). More than 0.
pub fn parse_cpus(s: &str) -> Result<u64, String> {
    match parse_cpu_amount(s)? {
        0 => Err(format!(
            "{s:?}: must be more than 0 and at most {CPUS_MAX} CPUs"
        )),
        m => Ok(m),
    }
}

/// [`parse_cpus`] that takes 0 too (a reserve).
pub fn parse_cpu_amount(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let bad = || format!("{s:?} is not CPUs like 1.5 or millis like 500m");
    if let Some(m) = s.strip_suffix('m') {
        let m: u64 = m.parse().map_err(|_| bad())?;
        if m > (CPUS_MAX as u64) * 1000 {
            return Err(format!("{s:?}: at most {CPUS_MAX} CPUs"));
        }
        return Ok(m);
    }
    let v: f64 = s.parse().map_err(|_| bad())?;
    if v == 0.0 {
        return Ok(0);
    }
    cpus_to_millis(v).map_err(|e| format!("{s:?}: {e}"))
}

/// At most this many CPUs in one figure.
const CPUS_MAX: f64 = 4096.0;

pub fn cpus_to_millis(v: f64) -> Result<u64, String> {
    if !(v > 0.0 && v <= CPUS_MAX) {
        return Err(format!("must be more than 0 and at most {CPUS_MAX} CPUs"));
    }
    Ok((v * 1000.0).round() as u64)
}

/// A port range, `LOW-HIGH` inclusive: `30000-30999`.
pub fn parse_port_range(s: &str) -> Result<(u16, u16), String> {
    let bad = || format!("{s:?} is not a port range like 30000-30999 (1 <= LOW <= HIGH <= 65535)");
    let (lo, hi) = s.split_once('-').ok_or_else(bad)?;
    let (lo, hi): (u16, u16) = (
        lo.trim().parse().map_err(|_| bad())?,
        hi.trim().parse().map_err(|_| bad())?,
    );
    if lo == 0 || lo > hi {
        return Err(bad());
    }
    Ok((lo, hi))
}

#[cfg(test)]
mod tests {
    #[test]
    fn cpus_are_decimal_or_millis_with_an_m() {
        use super::*;
        assert_eq!(parse_cpus("1.5"), Ok(1500));
        assert_eq!(parse_cpus("4"), Ok(4000));
        assert_eq!(parse_cpus("500m"), Ok(500));
        assert_eq!(parse_cpu_amount("0"), Ok(0));
        assert!(parse_cpus("0").is_err());
        assert!(parse_cpus("4097").is_err());
        assert!(parse_cpus("1.5m").is_err());
        assert!(parse_cpus("lots").unwrap_err().contains("500m"));
    }

    #[test]
    fn percentages_are_hundredths_of_a_percent() {
        use super::*;
        assert_eq!(parse_percent("10%"), Ok(1_000));
        assert_eq!(parse_percent("12.5%"), Ok(1_250));
        assert_eq!(parse_percent("0.25%"), Ok(25));
        assert_eq!(parse_percent("100%"), Ok(10_000));
        for bad in ["10", "101%", "1.234%", "-1%", "x%", "%"] {
            assert!(parse_percent(bad).unwrap_err().contains("10%"), "{bad}");
        }
    }

    #[test]
    fn port_ranges_are_low_dash_high() {
        assert_eq!(super::parse_port_range("30000-30999"), Ok((30_000, 30_999)));
        assert_eq!(super::parse_port_range("80-80"), Ok((80, 80)));
        for bad in [
            "",
            "30000",
            "5-3",
            "0-10",
            "1-70000",
            "a-b",
            "30000-30999-31000",
        ] {
            let e = super::parse_port_range(bad).unwrap_err();
            assert!(e.contains("is not a port range like"), "{bad}: {e}");
        }
    }
}
