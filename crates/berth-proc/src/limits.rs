//! Claims the kernel enforces (issue 36): the pure rule that turns a run's claim into
//! cgroup limits, and the pure rule that names the files (and values) those limits
//! are written to on a cgroup v2 group or on cgroup v1 hierarchies (hybrid hosts,
//! where the memory, pids and cpu controllers are still bound to v1). Reading a
//! group's use back is here too, as parsers of the files' text.
//!
//! Nothing here touches the machine: `cgroup::Group` writes and reads the files.

/// The CFS period every cpu quota is written against (the kernel's default).
pub const CPU_PERIOD_US: u64 = 100_000;
/// The kernel refuses a quota below 1 ms.
pub const CPU_QUOTA_US_MIN: u64 = 1_000;
/// Default `pids.max` per run: a fork bomb in one run stops here, far below the
/// host's `pid_max`, while a build with a few thousand compiler processes fits.
pub const PIDS_MAX_DEFAULT: u64 = 4_096;
/// Default hard limit as a percentage of the memory claim: `memory.high` throttles at
/// the claim itself, and the hard limit leaves a quarter more before the kernel's OOM
/// killer acts inside the run (never outside it).
pub const MEMORY_MAX_PCT_DEFAULT: u64 = 125;
/// The hard limit may not be set below the claim (it would kill a run that keeps it)
/// nor absurdly far above it (it would not be a limit).
pub const MEMORY_MAX_PCT_MIN: u64 = 100;
pub const MEMORY_MAX_PCT_MAX: u64 = 1_000;

/// How a run's cpu claim is enforced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuMode {
    /// `cpu.max`: the run gets at most its claim, even on an idle host.
    Quota,
    /// `cpu.weight` (v1 `cpu.shares`): the run gets its claim's share under
    /// contention and may burst when the host is idle.
    Weight,
}

/// The host's policy for turning claims into limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    /// `memory.max` = claim × this / 100 (`MEMORY_MAX_PCT_MIN..=MEMORY_MAX_PCT_MAX`).
    pub memory_max_pct: u64,
    /// `memory.swap.max`: swap a run may use beyond its memory; `None` leaves it to
    /// the host (unlimited). Default 0: a run's claim is memory, not swap.
    pub swap_max_bytes: Option<u64>,
    pub cpu: CpuMode,
    /// `pids.max` per run; 0 sets none.
    pub pids_max: u64,
    /// Pause (`cgroup.freeze`) the newest background run while memory pressure holds
    /// background waiters back, and resume it when the pressure falls. Off by default.
    pub freeze_background: bool,
}

impl Default for Policy {
    fn default() -> Policy {
        Policy {
            memory_max_pct: MEMORY_MAX_PCT_DEFAULT,
            swap_max_bytes: Some(0),
            cpu: CpuMode::Quota,
            pids_max: PIDS_MAX_DEFAULT,
            freeze_background: false,
        }
    }
}

/// The limits one run's cgroup gets. `None`: that limit is not set (a resource
/// claimed as 0 is not limited: the run did not say what it needs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    pub memory_high_bytes: Option<u64>,
    pub memory_max_bytes: Option<u64>,
    pub swap_max_bytes: Option<u64>,
    /// Per `CPU_PERIOD_US`.
    pub cpu_quota_us: Option<u64>,
    /// `cpu.weight`, 1..=10000 (100 is the kernel's default: one cpu's claim).
    pub cpu_weight: Option<u64>,
    pub pids_max: Option<u64>,
}

/// A claim's limits under `policy`: memory.high at the claim, memory.max at
/// `memory_max_pct` of it, the cpu claim as a quota (or a weight), the pids limit.
pub fn plan(memory_bytes: u64, cpu_millis: u64, policy: &Policy) -> Limits {
    let memory = (memory_bytes > 0).then_some(memory_bytes);
    let cpu = (cpu_millis > 0).then_some(cpu_millis);
    Limits {
        memory_high_bytes: memory,
        memory_max_bytes: memory.map(|m| {
            let pct = policy.memory_max_pct.max(MEMORY_MAX_PCT_MIN);
            // Whole pages, rounded up: the kernel rounds down, and a limit below the
            // claim must never come of it.
            let pages = (m.saturating_mul(pct) / 100).max(m).div_ceil(4096);
            pages
                .checked_mul(4096)
                .unwrap_or(u64::MAX - u64::MAX % 4096)
        }),
        swap_max_bytes: memory.and(policy.swap_max_bytes),
        cpu_quota_us: match policy.cpu {
            CpuMode::Quota => {
                cpu.map(|c| (c.saturating_mul(CPU_PERIOD_US) / 1000).max(CPU_QUOTA_US_MIN))
            }
            CpuMode::Weight => None,
        },
        cpu_weight: match policy.cpu {
            CpuMode::Quota => None,
            CpuMode::Weight => cpu.map(|c| (c / 10).clamp(1, 10_000)),
        },
        pids_max: (policy.pids_max > 0).then_some(policy.pids_max),
    }
}

/// A controller a limit or a figure belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Controller {
    Memory,
    Pids,
    Cpu,
    /// v1 only: cpu time is accounted by its own hierarchy there.
    Cpuacct,
}

impl Controller {
    pub const ALL: [Controller; 4] = [
        Controller::Memory,
        Controller::Pids,
        Controller::Cpu,
        Controller::Cpuacct,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Controller::Memory => "memory",
            Controller::Pids => "pids",
            Controller::Cpu => "cpu",
            Controller::Cpuacct => "cpuacct",
        }
    }
}

/// Which cgroup interface holds the controllers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavor {
    V2,
    V1,
}

/// One file write: (controller, file, value). In order: on v1 the hard memory limit
/// goes before the memory+swap one, which may never be below it.
pub type Write = (Controller, &'static str, String);

/// The writes that set `l` on a `flavor` group. v1 has no throttle like
/// `memory.high`: the claim becomes the soft limit there (what reclaim under host
/// pressure aims for), and the hard limit is `memory.limit_in_bytes`.
pub fn writes(l: &Limits, flavor: Flavor) -> Vec<Write> {
    use Controller::*;
    let mut w: Vec<Write> = Vec::new();
    let mut put = |c, f, v: u64| w.push((c, f, v.to_string()));
    match flavor {
        Flavor::V2 => {
            if let Some(v) = l.memory_high_bytes {
                put(Memory, "memory.high", v);
            }
            if let Some(v) = l.memory_max_bytes {
                put(Memory, "memory.max", v);
            }
            if let Some(v) = l.swap_max_bytes {
                put(Memory, "memory.swap.max", v);
            }
            if let Some(v) = l.cpu_weight {
                put(Cpu, "cpu.weight", v);
            }
            if let Some(v) = l.pids_max {
                put(Pids, "pids.max", v);
            }
            if let Some(q) = l.cpu_quota_us {
                w.push((Cpu, "cpu.max", format!("{q} {CPU_PERIOD_US}")));
            }
        }
        Flavor::V1 => {
            if let Some(v) = l.memory_high_bytes {
                put(Memory, "memory.soft_limit_in_bytes", v);
            }
            if let Some(v) = l.memory_max_bytes {
                put(Memory, "memory.limit_in_bytes", v);
                if let Some(s) = l.swap_max_bytes {
                    put(Memory, "memory.memsw.limit_in_bytes", v.saturating_add(s));
                }
            }
            if let Some(q) = l.cpu_quota_us {
                put(Cpu, "cpu.cfs_period_us", CPU_PERIOD_US);
                put(Cpu, "cpu.cfs_quota_us", q);
            }
            if let Some(wt) = l.cpu_weight {
                // v2's weight 100 is v1's 1024 shares.
                put(Cpu, "cpu.shares", (wt * 1024 / 100).max(2));
            }
            if let Some(v) = l.pids_max {
                put(Pids, "pids.max", v);
            }
        }
    }
    w
}

/// A write that may fail without the limits failing: the memory+swap limit exists
/// only where the kernel accounts swap (`swapaccount=1`).
pub fn optional(file: &str) -> bool {
    file == "memory.memsw.limit_in_bytes" || file == "memory.swap.max"
}

/// What a run's group has used, as its files say. `None`: not known (no such
/// controller, or the file could not be read).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub memory_bytes: Option<u64>,
    pub memory_peak_bytes: Option<u64>,
    /// Processes the kernel's OOM killer killed inside the group.
    pub oom_kills: u64,
    pub pids: Option<u64>,
    pub cpu_usec: Option<u64>,
}

/// The files a `flavor` group's figures are read from: (controller, file, what).
pub fn usage_files(flavor: Flavor) -> [(Controller, &'static str, Figure); 5] {
    use Controller::*;
    match flavor {
        Flavor::V2 => [
            (Memory, "memory.current", Figure::Number),
            (Memory, "memory.peak", Figure::Number),
            (Memory, "memory.events", Figure::Keyed("oom_kill")),
            (Pids, "pids.current", Figure::Number),
            (Cpu, "cpu.stat", Figure::Keyed("usage_usec")),
        ],
        Flavor::V1 => [
            (Memory, "memory.usage_in_bytes", Figure::Number),
            (Memory, "memory.max_usage_in_bytes", Figure::Number),
            (Memory, "memory.oom_control", Figure::Keyed("oom_kill")),
            (Pids, "pids.current", Figure::Number),
            (Cpuacct, "cpuacct.usage", Figure::Nanos),
        ],
    }
}

/// How a usage file's text gives its figure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Figure {
    /// The file is one number.
    Number,
    /// The file is one number of nanoseconds (reported in microseconds).
    Nanos,
    /// The file has `key value` lines; the figure is this key's.
    Keyed(&'static str),
}

/// The figure in a usage file's `text`; `None` if it is not there or not a number.
pub fn parse_figure(text: &str, how: Figure) -> Option<u64> {
    match how {
        Figure::Number => text.trim().parse().ok(),
        Figure::Nanos => text.trim().parse::<u64>().ok().map(|n| n / 1000),
        Figure::Keyed(key) => text.lines().find_map(|l| {
            let (k, v) = l.trim().split_once(' ')?;
            (k == key).then(|| v.trim().parse().ok()).flatten()
        }),
    }
}

/// Puts the figure read from the `i`th of `usage_files` into `u`.
pub fn set_figure(u: &mut Usage, i: usize, value: Option<u64>) {
    match i {
        0 => u.memory_bytes = value,
        1 => u.memory_peak_bytes = value,
        2 => u.oom_kills = value.unwrap_or(0),
        3 => u.pids = value,
        _ => u.cpu_usec = value,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_claim_becomes_its_limits() {
        let p = Policy::default();
        let l = plan(64 * MIB, 500, &p);
        assert_eq!(l.memory_high_bytes, Some(64 * MIB));
        assert_eq!(l.memory_max_bytes, Some(80 * MIB));
        assert_eq!(l.swap_max_bytes, Some(0));
        assert_eq!(l.cpu_quota_us, Some(50_000));
        assert_eq!(l.cpu_weight, None);
        assert_eq!(l.pids_max, Some(PIDS_MAX_DEFAULT));
        // Nothing claimed, nothing limited (but the pids limit, which is the host's).
        let none = plan(0, 0, &p);
        assert_eq!(none.memory_max_bytes, None);
        assert_eq!(none.swap_max_bytes, None);
        assert_eq!(none.cpu_quota_us, None);
        assert_eq!(none.pids_max, Some(PIDS_MAX_DEFAULT));
        // A tiny cpu claim still gets the kernel's smallest quota; burst mode a weight.
        assert_eq!(plan(0, 1, &p).cpu_quota_us, Some(CPU_QUOTA_US_MIN));
        let burst = Policy {
            cpu: CpuMode::Weight,
            pids_max: 0,
            ..p
        };
        let b = plan(0, 2_500, &burst);
        assert_eq!(
            (b.cpu_quota_us, b.cpu_weight, b.pids_max),
            (None, Some(250), None)
        );
    }

    #[test]
    fn the_hard_limit_is_never_below_the_claim_and_is_whole_pages() {
        let p = Policy {
            memory_max_pct: 10, // below the floor: the claim itself
            ..Policy::default()
        };
        let l = plan(10_000, 0, &p);
        assert_eq!(l.memory_max_bytes, Some(12_288));
        assert!(l.memory_max_bytes.unwrap() >= 10_000);
        assert_eq!(
            plan(u64::MAX, 0, &Policy::default())
                .memory_max_bytes
                .map(|m| m % 4096),
            Some(0)
        );
    }

    #[test]
    fn v1_and_v2_get_the_same_limits_in_their_own_files() {
        let l = plan(64 * MIB, 500, &Policy::default());
        let v2 = writes(&l, Flavor::V2);
        let v2: Vec<(&str, &str)> = v2.iter().map(|(_, f, v)| (*f, v.as_str())).collect();
        assert_eq!(
            v2,
            vec![
                ("memory.high", "67108864"),
                ("memory.max", "83886080"),
                ("memory.swap.max", "0"),
                ("pids.max", "4096"),
                ("cpu.max", "50000 100000"),
            ]
        );
        let v1 = writes(&l, Flavor::V1);
        let v1: Vec<(&str, &str)> = v1.iter().map(|(_, f, v)| (*f, v.as_str())).collect();
        assert_eq!(
            v1,
            vec![
                ("memory.soft_limit_in_bytes", "67108864"),
                ("memory.limit_in_bytes", "83886080"),
                ("memory.memsw.limit_in_bytes", "83886080"),
                ("cpu.cfs_period_us", "100000"),
                ("cpu.cfs_quota_us", "50000"),
                ("pids.max", "4096"),
            ]
        );
        let w = plan(
            0,
            2_000,
            &Policy {
                cpu: CpuMode::Weight,
                ..Policy::default()
            },
        );
        assert!(writes(&w, Flavor::V1).contains(&(Controller::Cpu, "cpu.shares", "2048".into())));
        assert!(writes(&w, Flavor::V2).contains(&(Controller::Cpu, "cpu.weight", "200".into())));
    }

    #[test]
    fn usage_files_parse_or_say_unknown() {
        assert_eq!(parse_figure("123\n", Figure::Number), Some(123));
        assert_eq!(parse_figure("max\n", Figure::Number), None);
        assert_eq!(parse_figure("2500000\n", Figure::Nanos), Some(2500));
        let events = "low 0\nhigh 3\nmax 9\noom 2\noom_kill 1\noom_group_kill 0\n";
        assert_eq!(parse_figure(events, Figure::Keyed("oom_kill")), Some(1));
        let v1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 4\n";
        assert_eq!(parse_figure(v1, Figure::Keyed("oom_kill")), Some(4));
        assert_eq!(
            parse_figure("usage_usec x\n", Figure::Keyed("usage_usec")),
            None
        );
        assert_eq!(parse_figure("", Figure::Keyed("oom_kill")), None);
        let mut u = Usage::default();
        for (i, v) in [Some(1), Some(2), Some(3), None, Some(5)]
            .into_iter()
            .enumerate()
        {
            set_figure(&mut u, i, v);
        }
        assert_eq!(
            u,
            Usage {
                memory_bytes: Some(1),
                memory_peak_bytes: Some(2),
                oom_kills: 3,
                pids: None,
                cpu_usec: Some(5)
            }
        );
    }
}
