//! Column codecs: integers that must fit, words parsed by their `FromStr`, escaped
//! maps, and errors that name the column.

use super::*;

/// A word of the ledger (a class, a state, ...) read back through the one codec.
pub(super) fn word<T: std::str::FromStr<Err = String>>(s: &str) -> Result<T, StoreError> {
    s.parse().map_err(StoreError::Corrupt)
}

/// `k=v` pairs joined by newlines; keys and values are validated names and labels
/// without newlines, which the server guarantees.
pub(super) fn encode_map<V: ToString>(m: &BTreeMap<String, V>) -> String {
    m.iter()
        .map(|(k, v)| format!("{}={}", escape(k), escape(&v.to_string())))
        .collect::<Vec<_>>()
        .join("\n")
}

pub(super) fn escape(s: &str) -> String {
    s.replace('%', "%25")
        .replace('=', "%3D")
        .replace('\n', "%0A")
}

pub(super) fn unescape(s: &str) -> String {
    s.replace("%0A", "\n")
        .replace("%3D", "=")
        .replace("%25", "%")
}

pub(super) fn decode_map(s: &str) -> Result<BTreeMap<String, String>, StoreError> {
    let mut m = BTreeMap::new();
    for line in s.lines().filter(|l| !l.is_empty()) {
        let (k, v) = line
            .split_once('=')
            .ok_or_else(|| StoreError::Corrupt(format!("bad map entry {line:?}")))?;
        m.insert(unescape(k), unescape(v));
    }
    Ok(m)
}

/// A count, time, sequence number or id as berth wrote it: never negative. One that is
/// was not written by berth, and is refused (D4) rather than read as a huge number.
pub(super) fn u(v: i64) -> Result<u64, StoreError> {
    u64::try_from(v)
        .map_err(|_| StoreError::Corrupt(format!("{v}, where berth writes no negative number")))
}

/// A corrupt ledger's reason, said of `what` (a run, a thread, a scope).
pub(super) fn of(what: &str, e: StoreError) -> StoreError {
    match e {
        StoreError::Corrupt(why) => StoreError::Corrupt(format!("{what}: {why}")),
        e => e,
    }
}

pub(super) fn int(row: &Row, i: usize) -> Result<i64, StoreError> {
    row.get::<_, i64>(i).map_err(corrupt)
}

pub(super) fn text(row: &Row, i: usize) -> Result<String, StoreError> {
    row.get::<_, String>(i).map_err(corrupt)
}

pub(super) fn opt_text(row: &Row, i: usize) -> Result<Option<String>, StoreError> {
    row.get::<_, Option<String>>(i).map_err(corrupt)
}

pub(super) fn opt_int(row: &Row, i: usize) -> Result<Option<i64>, StoreError> {
    row.get::<_, Option<i64>>(i).map_err(corrupt)
}
