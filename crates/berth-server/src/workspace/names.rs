//! Names of entries in `runs/.pool` and `runs/.trash`: which run a released workspace
//! came from, and which steps of its removal are done. Kept in names, not in memory, so
//! they survive a crash.

/// Joins a released workspace's name in `runs/.pool` and `runs/.trash` to the id of the
/// run it was released by: `<digest>-r<n>@<run id>`. `@` is in neither a digest nor the
/// run-id alphabet, so the run id is everything after the first one. Kept in the name,
/// not in memory, so the archive of a workspace scrubbed after a crash is still named
/// after its run.
pub(super) const RUN_SEP: char = '@';

/// Bytes of a run id as a name part at most (the longest valid run id).
pub(super) const RUN_ID_NAME_MAX: usize = 128;

/// The run id as a part of a file name. A valid run id already is one (the id rule,
/// `[A-Za-z0-9][A-Za-z0-9._:-]{0,127}`: no `/`, no NUL, never `.` or `..`, a letter or
/// digit first, at most 128 bytes) and is kept exactly. Anything else (never expected:
/// the engine refuses invalid run ids) has every other character replaced by `_`, is cut
/// to 128 bytes and starts with a letter or digit; `None` when nothing is left.
pub(super) fn run_id_name(run_id: &str) -> Option<String> {
    if berth_core::validate::run_id(run_id).is_ok() {
        return Some(run_id.to_string());
    }
    let safe: String = run_id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .skip_while(|c| !c.is_ascii_alphanumeric())
        .take(RUN_ID_NAME_MAX)
        .collect();
    (!safe.is_empty()).then_some(safe)
}

/// A pool or trash entry's name: `base`, and the id of the run it came from after
/// `RUN_SEP` when there is one that makes a name part.
pub(super) fn aside_name(base: &str, run_id: Option<&str>) -> String {
    match run_id.and_then(run_id_name) {
        Some(id) => format!("{base}{RUN_SEP}{id}"),
        None => base.to_string(),
    }
}

/// The run id a trash entry's name carries (see `RUN_SEP`), if it carries a valid one.
pub(super) fn run_of(entry: &str) -> Option<&str> {
    let (_, id) = entry.split_once(RUN_SEP)?;
    berth_core::validate::run_id(id).ok().map(|()| id)
}

/// The workspace's own name in a trash entry's name: the entry without the prefixes the
/// pool adds (`archived-`, `old-`), up to its first `-` or `@`: the run's digest for a
/// released workspace.
pub(super) fn digest_of(entry: &str) -> &str {
    let mut rest = entry;
    while let Some(r) = rest
        .strip_prefix(ARCHIVED_PREFIX)
        .or_else(|| rest.strip_prefix(OLD_PREFIX))
    {
        rest = r;
    }
    let end = rest.find(['-', RUN_SEP]).unwrap_or(rest.len());
    if end == 0 {
        entry
    } else {
        &rest[..end]
    }
}

/// What an archive of the trash entry's logs is named after: its run id when the entry
/// carries one (every release by this berth), else its digest (an entry left by an
/// older berth).
pub(super) fn archive_label(entry: &str) -> &str {
    run_of(entry).unwrap_or_else(|| digest_of(entry))
}

/// The name prefix of a trash entry whose logs were archived already: a removal that a
/// crash cut short is finished after the restart without archiving what is left of the
/// logs a second time.
pub(super) const ARCHIVED_PREFIX: &str = "archived-";
/// The name prefix of a trash entry that an earlier daemon left in `runs/.pool`.
pub(super) const OLD_PREFIX: &str = "old-";
