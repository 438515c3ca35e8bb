//! The engine's configuration: host totals, reserves and every named limit.

use crate::types::Resources;

pub const GIB: u64 = 1 << 30;
pub const MIB: u64 = 1 << 20;

/// Upper bound on the scan window: a pass must stay cheap even if misconfigured.
pub const WINDOW_MAX: usize = 4096;
/// Upper bound on `slots_max`; also bounds the grants one pass can make.
pub const SLOTS_MAX_LIMIT: u64 = 4096;
/// Upper bound on the stabilisation sample count (A10).
pub const STABILIZE_SAMPLES_MAX: usize = 64;
/// Largest total, reserve or named count (S7): JSON's safe integers (8 PiB of memory or
/// disk), so every figure berth shows is exact in any client, and sums of a few of them
/// can never wrap a u64.
pub const TOTAL_MAX: u64 = (1 << 53) - 1;
/// Upper bound on `ended_retained_max`: every ended run remembered costs memory and
/// restart time, so the daemon's footprint has a ceiling whatever is configured.
pub const ENDED_RETAINED_LIMIT: usize = 1_000_000;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// At most this many runs hold capacity (A2). Every run takes at least one slot.
    pub slots_max: u64,
    pub memory_total: u64,
    pub memory_reserve: u64,
    pub cpu_total_millis: u64,
    pub cpu_reserve_millis: u64,
    pub disk_total: u64,
    pub disk_reserve: u64,
    /// Named counted resources (A13): name and total; they have no reserve.
    pub named: Vec<(String, u64)>,
    /// Later waiters scanned per pass after the head's first pick (A6).
    pub window: usize,
    /// Once the head has waited this long, later waiters may not take what it needs (A7).
    pub starvation_guard_ms: u64,
    /// Consecutive samples a rise in free memory must hold before it is trusted (A10).
    pub stabilize_samples: usize,
    /// Memory granted less than this long ago counts as `pending` (A2): its processes
    /// have probably not touched it yet, so MemAvailable does not show it.
    pub pending_settle_ms: u64,
    pub ttl_ms_default: u64,
    pub ttl_ms_max: u64,
    pub wait_ms_default: u64,
    pub wait_ms_max: u64,
    /// Waiters at most; acquires beyond it are refused with `queue_full`.
    pub queue_len_max: usize,
    /// Ended runs remembered for `410 gone` answers and idempotent re-acquire.
    pub ended_retained_max: usize,
    /// The request a run gets when it names no resources; also the "minimum-size run"
    /// that `status` reports the host can or cannot take (A12).
    pub default_request: Resources,
    /// F1 fleet mode: a run is granted only once its fleet-wide claim (run id, fence,
    /// budget token, fleet keys) is held; the caller takes it from the fleet store when
    /// the engine asks (`Event::PermitWanted`) and hands it in (`Command::Permit`).
    pub fleet: bool,
    /// S10: a scope nothing holds (no run, no token, no control state) is forgotten
    /// once it has been idle this long, so scopes made once never fill `SCOPES_MAX`.
    pub scope_idle_ms: u64,
    /// Issue 36: no foreground run is admitted while the host's memory pressure (the
    /// share of the last 10 s in which some task stalled on memory, PSI `some avg10`,
    /// in hundredths of a percent) is above this; background runs stop being admitted
    /// first, above `pressure_background_max_bp`. Free memory alone misses a host
    /// that is already reclaiming to keep up.
    pub pressure_foreground_max_bp: u32,
    pub pressure_background_max_bp: u32,
    /// Issue 36: the same for cpu and io pressure (PSI `some avg10` of cpu, of io):
    /// above it no foreground run is admitted, above half of it no background run.
    /// Default `PRESSURE_BP_MAX`: off (cpu contention is what cpu claims govern; a
    /// host turns these on where its runs share a disk or oversubscribe cpus).
    pub pressure_cpu_max_bp: u32,
    pub pressure_io_max_bp: u32,
    /// Issue 36: the memory reserve while no foreground run holds a claim (the host is
    /// idle: nobody at the desk is waiting on it), if smaller than `memory_reserve`;
    /// it applies to the live check against MemAvailable. `None`: the same reserve.
    pub memory_reserve_idle: Option<u64>,
}

/// The defaults: a tenth of the time stalled holds foreground runs back, a twentieth
/// background runs (a busy but healthy host stays well below 1%).
pub const PRESSURE_FOREGROUND_MAX_BP: u32 = 1_000;
pub const PRESSURE_BACKGROUND_MAX_BP: u32 = 500;
/// A pressure figure's ceiling: all of the time (100.00%).
pub const PRESSURE_BP_MAX: u32 = 10_000;

/// The shortest idle window a scope may have: forgetting a policy a run is about to
/// use again would refreeze it under the next caller's terms.
pub const SCOPE_IDLE_MS_MIN: u64 = 1_000;
/// The longest: a year.
pub const SCOPE_IDLE_MS_MAX: u64 = 365 * 86_400_000;

impl Config {
    /// The contract's defaults (docs/contract.md), for a host with these totals.
    pub fn for_host(cpus: u64, memory_total: u64, disk_total: u64) -> Config {
        Config {
            slots_max: (cpus / 2).clamp(1, 8),
            memory_total: memory_total.min(TOTAL_MAX),
            memory_reserve: (memory_total.min(TOTAL_MAX) / 8).clamp(GIB, 4 * GIB),
            cpu_total_millis: cpus * 1000,
            cpu_reserve_millis: 1000,
            disk_total: disk_total.min(TOTAL_MAX),
            disk_reserve: 10 * GIB,
            named: Vec::new(),
            window: 64,
            starvation_guard_ms: 30_000,
            stabilize_samples: 2,
            pending_settle_ms: 30_000,
            ttl_ms_default: 300_000,
            ttl_ms_max: 86_400_000,
            wait_ms_default: 1_800_000,
            wait_ms_max: 86_400_000,
            queue_len_max: 131_072,
            ended_retained_max: 10_000,
            default_request: Resources {
                slots: 1,
                memory: 2 * GIB + 128 * MIB,
                cpu_millis: 2000,
                disk: 10 * GIB,
                named: Default::default(),
            },
            fleet: false,
            scope_idle_ms: 86_400_000,
            pressure_foreground_max_bp: PRESSURE_FOREGROUND_MAX_BP,
            pressure_background_max_bp: PRESSURE_BACKGROUND_MAX_BP,
            pressure_cpu_max_bp: PRESSURE_BP_MAX,
            pressure_io_max_bp: PRESSURE_BP_MAX,
            memory_reserve_idle: None,
        }
    }

    /// Shrinks the *default* request to what this host can ever allocate, so that a
    /// plain `berth run` works on a small host (the contract's 2000 cpu millis do not fit a
    /// 2-cpu machine with its 1000-milli reserve). Explicit requests are never changed;
    /// they are refused as impossible (A3) when they cannot fit.
    pub fn fit_default_request(&mut self) {
        let d = &mut self.default_request;
        d.memory = d
            .memory
            .min(self.memory_total.saturating_sub(self.memory_reserve));
        d.cpu_millis = d.cpu_millis.min(
            self.cpu_total_millis
                .saturating_sub(self.cpu_reserve_millis),
        );
        d.disk = d
            .disk
            .min(self.disk_total.saturating_sub(self.disk_reserve));
        d.slots = d.slots.min(self.slots_max).max(1);
    }

    /// Refuses configurations the engine cannot keep its promises under (issue 36).
    /// Background runs are held back first, so their pressure figure is the lower; an
    /// idle host's reserve is a smaller one, never a larger one.
    fn check_pressure(&self) -> Result<(), String> {
        let (fg, bg) = (
            self.pressure_foreground_max_bp,
            self.pressure_background_max_bp,
        );
        if fg > PRESSURE_BP_MAX || bg > fg {
            return Err(
                "memory pressure limits: background <= foreground <= 100% (PSI some avg10)".into(),
            );
        }
        if self.pressure_cpu_max_bp > PRESSURE_BP_MAX || self.pressure_io_max_bp > PRESSURE_BP_MAX {
            return Err("cpu and io pressure limits: at most 100% (PSI some avg10)".into());
        }
        if self
            .memory_reserve_idle
            .is_some_and(|r| r > self.memory_reserve)
        {
            return Err(
                "memory_reserve_idle must be <= memory_reserve (it is the reserve of an idle host)"
                    .into(),
            );
        }
        Ok(())
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.slots_max == 0 || self.slots_max > SLOTS_MAX_LIMIT {
            return Err(format!("slots_max must be 1..={SLOTS_MAX_LIMIT}"));
        }
        if self.window == 0 || self.window > WINDOW_MAX {
            return Err(format!("window must be 1..={WINDOW_MAX}"));
        }
        if self.stabilize_samples == 0 || self.stabilize_samples > STABILIZE_SAMPLES_MAX {
            return Err(format!(
                "stabilize_samples must be 1..={STABILIZE_SAMPLES_MAX}"
            ));
        }
        if self.ttl_ms_max == 0 || self.ttl_ms_default == 0 || self.ttl_ms_default > self.ttl_ms_max
        {
            return Err("ttl_ms_default must be 1..=ttl_ms_max".into());
        }
        if self.wait_ms_default > self.wait_ms_max {
            return Err("wait_ms_default must be <= wait_ms_max".into());
        }
        if self.queue_len_max == 0 {
            return Err("queue_len_max must be positive".into());
        }
        self.check_pressure()?;
        if self.ended_retained_max == 0 || self.ended_retained_max > ENDED_RETAINED_LIMIT {
            return Err(format!(
                "retain_ended (ended_retained_max) must be 1..={ENDED_RETAINED_LIMIT}"
            ));
        }
        // Names first: the bound below names the figure it refuses, and a named
        // resource's name is only fit to be shown once it is valid (an empty one was not).
        for (i, (name, _)) in self.named.iter().enumerate() {
            if crate::validate::resource_name(name).is_err() {
                return Err(format!("named resource {name:?} is not a valid name"));
            }
            if ["slots", "memory", "cpu", "cpu_millis", "disk"].contains(&name.as_str())
                || self.named[..i].iter().any(|(n, _)| n == name)
            {
                return Err(format!("named resource {name:?} is declared twice"));
            }
        }
        for (name, v) in [
            ("memory_total", self.memory_total),
            ("memory_reserve", self.memory_reserve),
            ("cpu_total_millis", self.cpu_total_millis),
            ("cpu_reserve_millis", self.cpu_reserve_millis),
            ("disk_total", self.disk_total),
            ("disk_reserve", self.disk_reserve),
        ]
        .into_iter()
        .chain(self.named.iter().map(|(n, v)| (n.as_str(), *v)))
        {
            if v > TOTAL_MAX {
                return Err(format!("{name} must be at most {TOTAL_MAX} (S7)"));
            }
        }
        if !(SCOPE_IDLE_MS_MIN..=SCOPE_IDLE_MS_MAX).contains(&self.scope_idle_ms) {
            return Err(format!(
                "scope_idle_ms must be {SCOPE_IDLE_MS_MIN}..={SCOPE_IDLE_MS_MAX}"
            ));
        }
        if self.default_request.slots == 0 {
            return Err("default_request.slots must be positive".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 8, finding 11: `--disk-total 18446744073709551615` was accepted, and two
    /// runs of 2^63 bytes each were both granted (the sum wrapped).
    #[test]
    fn finding_11_totals_are_bounded() {
        let mut c = Config::for_host(4, 8 * GIB, 100 * GIB);
        assert!(c.validate().is_ok());
        c.disk_total = u64::MAX;
        let e = c.validate().unwrap_err();
        assert!(e.starts_with("disk_total must be at most"), "{e}");
        c.disk_total = TOTAL_MAX;
        assert!(c.validate().is_ok());
        c.named = vec![("gpu".into(), TOTAL_MAX + 1)];
        assert!(c.validate().unwrap_err().starts_with("gpu must be at most"));
        // What the host reports is clamped, never refused.
        assert_eq!(
            Config::for_host(4, u64::MAX, u64::MAX).disk_total,
            TOTAL_MAX
        );
    }

    #[test]
    fn the_default_request_fits_a_small_host_and_is_unchanged_on_a_big_one() {
        // 2 cpus (1000 reserved), 2 GiB memory (1 GiB reserved), 12 GiB disk (10 reserved).
        let mut small = Config::for_host(2, 2 * GIB, 12 * GIB);
        small.fit_default_request();
        assert_eq!(small.default_request.cpu_millis, 1000);
        assert_eq!(small.default_request.memory, GIB);
        assert_eq!(small.default_request.disk, 2 * GIB);
        let mut big = Config::for_host(64, 256 * GIB, 4096 * GIB);
        let before = big.default_request.clone();
        big.fit_default_request();
        assert_eq!(big.default_request, before);
    }
}
