//! Issue 36 (optional, `--freeze-background`): while the host's memory pressure is
//! above the figure that already holds background waiters back, the newest granted
//! background run is paused (`cgroup.freeze`), one more at most every
//! `FREEZE_EVERY_MS`; once the pressure is back under it, every paused run resumes.
//! The decision is a pure plan (`plan`); the daemon carries it out through the host.

use std::collections::BTreeSet;

use super::{Daemon, Host};

/// PSI's `some avg10` answers a freeze only over its 10 s window: freezing one more
/// run every sample would pause them all before the figure could fall.
pub const FREEZE_EVERY_MS: u64 = 10_000;

/// What to do now: `(run id, freeze?)`. `background` are the granted background runs
/// with a cgroup, as `(fence, run id)`; `frozen` those paused now; `last_freeze_ms`
/// when the last one was paused.
pub fn plan(
    pressure_bp: u32,
    limit_bp: u32,
    background: &[(u64, String)],
    frozen: &BTreeSet<String>,
    now_ms: u64,
    last_freeze_ms: Option<u64>,
) -> Vec<(String, bool)> {
    // A paused run that is no longer a granted background run resumes: its stop must
    // reach its processes (and a resumed host owes it nothing).
    let live: BTreeSet<&String> = background.iter().map(|(_, id)| id).collect();
    let mut out: Vec<(String, bool)> = frozen
        .iter()
        .filter(|id| pressure_bp <= limit_bp || !live.contains(id))
        .map(|id| (id.clone(), false))
        .collect();
    let due = last_freeze_ms.is_none_or(|t| now_ms >= t.saturating_add(FREEZE_EVERY_MS));
    if pressure_bp > limit_bp && due {
        let newest = background
            .iter()
            .filter(|(_, id)| !frozen.contains(id))
            .max_by_key(|(fence, _)| *fence);
        if let Some((_, id)) = newest {
            out.push((id.clone(), true));
        }
    }
    out
}

impl<H: Host> Daemon<H> {
    /// At start: a pause is not remembered across a restart, so no run may stay paused
    /// by the daemon before it (the next samples pause again if the pressure holds).
    pub(super) fn thaw_restored(&mut self) {
        if !self.shared.enforcement.policy.freeze_background {
            return;
        }
        let grouped: Vec<String> = self
            .extras
            .iter()
            .filter(|(_, e)| e.grouped)
            .map(|(id, _)| id.clone())
            .collect();
        for id in grouped {
            let _ = self.host.freeze(&id, false);
        }
    }

    /// Carries out this sample's `plan`, if the host asked for it.
    pub(super) fn freeze_background(&mut self, memory_pressure_bp: Option<u32>) {
        if !self.shared.enforcement.policy.freeze_background {
            return;
        }
        let pressure = memory_pressure_bp.unwrap_or(self.frozen.pressure_bp);
        self.frozen.pressure_bp = pressure;
        if pressure == 0 && self.frozen.runs.is_empty() {
            return; // the common case: nothing to look at
        }
        let background: Vec<(u64, String)> = self
            .extras
            .iter()
            .filter(|(_, e)| e.grouped)
            .filter_map(|(id, _)| self.engine.view_of(id))
            .filter(|v| v.state == berth_core::RunState::Granted)
            .filter(|v| v.priority == berth_core::Priority::Background)
            .map(|v| (v.fence.unwrap_or(0), v.run_id))
            .collect();
        let limit = self.engine.config().pressure_background_max_bp;
        let steps = plan(
            pressure,
            limit,
            &background,
            &self.frozen.runs,
            self.now,
            self.frozen.last_ms,
        );
        for (id, freeze) in steps {
            match self.host.freeze(&id, freeze) {
                Ok(()) if freeze => {
                    tracing::warn!(run_id = id.as_str(), pressure_bp = pressure, "memory pressure: the newest background run is paused (cgroup.freeze) until it falls");
                    self.frozen.runs.insert(id);
                    self.frozen.last_ms = Some(self.now);
                }
                Ok(()) => {
                    tracing::info!(run_id = id.as_str(), "resumed");
                    self.frozen.runs.remove(&id);
                }
                Err(e) => {
                    tracing::warn!(run_id = id.as_str(), "cgroup.freeze: {e}");
                    self.frozen.runs.remove(&id);
                }
            }
        }
    }
}

/// The daemon's paused runs.
#[derive(Debug, Default)]
pub struct Frozen {
    pub runs: BTreeSet<String>,
    /// When the last run was paused.
    pub last_ms: Option<u64>,
    /// The last memory pressure sampled.
    pub pressure_bp: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runs(ids: &[(u64, &str)]) -> Vec<(u64, String)> {
        ids.iter().map(|(f, id)| (*f, id.to_string())).collect()
    }

    #[test]
    fn the_newest_background_run_is_paused_one_per_window_and_all_resume_when_it_falls() {
        let bg = runs(&[(3, "old"), (9, "new"), (5, "mid")]);
        let none = BTreeSet::new();
        // Under the limit: nothing.
        assert!(plan(400, 500, &bg, &none, 0, None).is_empty());
        // Over it: the newest (highest fence) first.
        assert_eq!(
            plan(900, 500, &bg, &none, 0, None),
            vec![("new".into(), true)]
        );
        let frozen: BTreeSet<String> = ["new".to_string()].into();
        // Within the window: no second one; after it, the next newest.
        assert!(plan(900, 500, &bg, &frozen, 5_000, Some(0)).is_empty());
        assert_eq!(
            plan(900, 500, &bg, &frozen, FREEZE_EVERY_MS, Some(0)),
            vec![("mid".into(), true)]
        );
        // Back under the limit: every paused run resumes.
        let both: BTreeSet<String> = ["new".to_string(), "mid".to_string()].into();
        let mut out = plan(500, 500, &bg, &both, 20_000, Some(10_000));
        out.sort();
        assert_eq!(out, vec![("mid".into(), false), ("new".into(), false)]);
        // A paused run that ended (or is no longer granted) resumes at once.
        let gone = runs(&[(3, "old")]);
        assert_eq!(
            plan(900, 500, &gone, &frozen, 1_000, Some(0)),
            vec![("new".into(), false)]
        );
    }
}
