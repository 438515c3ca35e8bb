//! Parsing of the CLI's and berth.toml's values, in one place for every subcommand:
//! sizes and durations (the engine's own parsers), and CPUs as decimals.

use berth_core::validate;

/// Sizes in bytes: `2GiB`, `512M`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    validate::parse_size(s)
}

/// Durations as milliseconds: `30s`, `5m`.
pub fn parse_duration(s: &str) -> Result<u64, String> {
    validate::parse_duration_ms(s)
}

/// CPUs as millis: `1.5` is 1500.
pub fn parse_cpus(s: &str) -> Result<u64, String> {
    let v: f64 = s
        .parse()
        .map_err(|_| format!("{s:?} is not a number of CPUs like 1.5"))?;
    cpus_to_millis(v)
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
