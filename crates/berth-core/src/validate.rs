//! Syntax rules for names and the unit parsers (docs/contract.md).
//! Pure functions; each error names the rule it broke.

fn id_like(s: &str, max_len: usize, extra: &[u8]) -> Result<(), String> {
    let b = s.as_bytes();
    if b.is_empty() || b.len() > max_len {
        return Err(format!("must be 1 to {max_len} characters"));
    }
    if !b[0].is_ascii_alphanumeric() {
        return Err("must start with a letter or digit".into());
    }
    // By character, not by byte: a non-ASCII character is named as itself (a byte of
    // its UTF-8 form shown as a char would be mojibake).
    if let Some(c) = s
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || (c.is_ascii() && extra.contains(&(*c as u8)))))
    {
        return Err(format!(
            "may only contain letters, digits and {:?} (found {:?})",
            String::from_utf8_lossy(extra),
            c
        ));
    }
    Ok(())
}

/// `[A-Za-z0-9][A-Za-z0-9._:-]{0,127}`
pub fn run_id(s: &str) -> Result<(), String> {
    id_like(s, 128, b"._:-")
}

/// `[A-Za-z0-9][A-Za-z0-9._/-]{0,199}`
pub fn project(s: &str) -> Result<(), String> {
    id_like(s, 200, b"._/-")
}

/// Singleton and named-resource names share the run-id alphabet.
pub fn resource_name(s: &str) -> Result<(), String> {
    id_like(s, 128, b"._:-")
}

/// Parses `2GiB`, `512MiB`, `1.5GiB`, `4GB`, `4096` (bytes): IEC units binary, SI units
/// decimal, a bare `K`/`M`/`G`/`T` refused.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    // Each unit exactly what it says: IEC binary (`GiB` = 2^30) and SI decimal (`GB` =
    // 10^9). A bare `G` could be either, so it is refused naming both (it was read as
    // GiB, so `4GB` silently meant 4 GiB: issue 33 item 7).
    let unit = unit.trim();
    let mult: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        short @ ("k" | "m" | "g" | "t") => {
            let up = short.to_ascii_uppercase();
            let (iec, si) = match short {
                "k" => (1u64 << 10, 1_000u64),
                "m" => (1 << 20, 1_000_000),
                "g" => (1 << 30, 1_000_000_000),
                _ => (1 << 40, 1_000_000_000_000),
            };
            let both = |m| scale(num, m).map_or("too many".into(), |b| b.to_string());
            return Err(format!(
                "{s:?} is ambiguous: write {num}{up}iB ({} bytes) or {num}{up}B ({} bytes)",
                both(iec),
                both(si)
            ));
        }
        other => {
            return Err(format!(
                "unknown size unit {other:?} (use B, KiB, MiB, GiB, TiB or kB, MB, GB, TB)"
            ))
        }
    };
    scale(num, mult).ok_or_else(|| format!("{s:?} is not a size like 2GiB or 512MB"))
}

/// A decimal with at most two places as hundredths (`12.5` is 1250, `7` is 700): how
/// percentages are given (`--memory-pressure-max 12.5%`) and how PSI writes them
/// (`avg10=12.34`). `None` for anything else, a sign or a third place included.
pub fn parse_hundredths(s: &str) -> Option<u32> {
    let (whole, frac) = s.split_once('.').unwrap_or((s, ""));
    let digits = |t: &str| t.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty() || !digits(whole) || frac.len() > 2 || !digits(frac) {
        return None;
    }
    let frac: u32 = format!("{frac:0<2}").parse().ok()?;
    whole
        .parse::<u32>()
        .ok()?
        .checked_mul(100)?
        .checked_add(frac)
}

/// Parses `30s`, `5m`, `1h`, `250ms`, `1.5s` into milliseconds. A bare number is seconds.
pub fn parse_duration_ms(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let mult: u64 = match unit.trim() {
        "ms" => 1,
        "" | "s" => 1000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        other => {
            return Err(format!(
                "unknown duration unit {other:?} (use ms, s, m, h, d)"
            ))
        }
    };
    scale(num, mult).ok_or_else(|| format!("{s:?} is not a duration like 30s or 5m"))
}

fn scale(num: &str, mult: u64) -> Option<u64> {
    if num.is_empty() || num.starts_with('.') || num.ends_with('.') {
        return None;
    }
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if frac.contains('.') || frac.len() > 9 {
        return None;
    }
    let int: u64 = int.parse().ok()?;
    let mut value = int.checked_mul(mult)?;
    if !frac.is_empty() {
        let digits: u64 = frac.parse().ok()?;
        let denom = 10u64.pow(frac.len() as u32);
        value = value.checked_add((digits as u128 * mult as u128 / denom as u128) as u64)?;
    }
    Some(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hundredths_take_two_places_and_nothing_else() {
        assert_eq!(parse_hundredths("12.5"), Some(1_250));
        assert_eq!(parse_hundredths("12.34"), Some(1_234));
        assert_eq!(parse_hundredths("7"), Some(700));
        for bad in ["", ".5", "1.234", "-1", "+1", "1.x", "4294967296"] {
            assert_eq!(parse_hundredths(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn ids_follow_the_spec_alphabet() {
        assert!(run_id("r-17").is_ok());
        assert!(run_id("a.b:c_d-e").is_ok());
        assert!(run_id("").is_err());
        assert!(run_id("-x").is_err());
        assert!(run_id("a/b").is_err());
        assert!(run_id(&"a".repeat(128)).is_ok());
        assert!(run_id(&"a".repeat(129)).is_err());
        assert!(project("acme/web").is_ok());
        assert!(project("acme:web").is_err());
        assert!(project(&"p".repeat(201)).is_err());
    }

    /// Issue 8, finding 12: a non-ASCII character was shown as one of its UTF-8 bytes.
    #[test]
    fn finding_12_a_non_ascii_character_is_named_as_itself() {
        let e = run_id("abé").unwrap_err();
        assert!(e.ends_with("(found 'é')"), "{e}");
        let e = project("a→b").unwrap_err();
        assert!(e.ends_with("(found '→')"), "{e}");
    }

    #[test]
    fn sizes_and_durations_parse() {
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        // Issue 33 item 7: SI units are decimal, exactly; a bare letter is refused
        // naming both readings.
        assert_eq!(parse_size("4GB"), Ok(4_000_000_000));
        assert_eq!(parse_size("512kB"), Ok(512_000));
        let e = parse_size("4G").unwrap_err();
        assert!(
            e.contains("4GiB (4294967296 bytes)") && e.contains("4GB (4000000000 bytes)"),
            "{e}"
        );
        assert!(parse_size("512M").is_err());
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("2 parsecs").is_err());
        assert!(parse_size("").is_err());
        assert!(parse_size("99999999999999999999GiB").is_err());
        assert_eq!(parse_duration_ms("30s"), Ok(30_000));
        assert_eq!(parse_duration_ms("5m"), Ok(300_000));
        assert_eq!(parse_duration_ms("250ms"), Ok(250));
        assert_eq!(parse_duration_ms("1.5s"), Ok(1500));
        assert!(parse_duration_ms("5 fortnights").is_err());
    }
}
