//! CPU time read from `/proc`, for figures that swing far less with the machine's mood
//! than throughput does (a run's pgbench figure moved between 9,100 and 14,200/s within
//! one hour on the same machine): the whole machine's busy time, the daemons' threads in
//! this process, and the PostgreSQL server's processes. Divided by the lifecycles done
//! meanwhile, they say what one lifecycle costs, and on a machine whose cores are all
//! busy that cost is what bounds the rate.

/// CPU time so far, in microseconds.
#[derive(Clone, Debug, Default)]
pub struct Cpu {
    /// Every core's time not idle (nor waiting for I/O).
    pub machine_us: u64,
    /// This process's threads but its own (the daemons': the clients' thread and the
    /// main thread keep the process's name).
    pub daemons_us: u64,
    /// Processes named `postgres` (the server, its backends and helpers).
    pub postgres_us: u64,
    /// `daemons_us` by thread name (`tokio-rt-worker`, `berth-ledger`,
    /// `berth-workspace`, ...): which part of the daemons a lifecycle's cost is in.
    pub by_thread_us: std::collections::BTreeMap<String, u64>,
}

impl Cpu {
    pub fn now() -> Cpu {
        let own = own_name();
        let by_thread_us = threads_us(|name| name != own);
        Cpu {
            machine_us: machine_busy_us(),
            daemons_us: by_thread_us.values().sum(),
            postgres_us: processes_us("postgres"),
            by_thread_us,
        }
    }

    /// What was spent since `before`, per `n` (lifecycles), in microseconds.
    pub fn per(&self, before: &Cpu, n: u64) -> Cpu {
        let n = n.max(1);
        Cpu {
            machine_us: self.machine_us.saturating_sub(before.machine_us) / n,
            daemons_us: self.daemons_us.saturating_sub(before.daemons_us) / n,
            postgres_us: self.postgres_us.saturating_sub(before.postgres_us) / n,
            by_thread_us: self
                .by_thread_us
                .iter()
                .map(|(name, us)| {
                    let was = before.by_thread_us.get(name).copied().unwrap_or(0);
                    (name.clone(), us.saturating_sub(was) / n)
                })
                .collect(),
        }
    }

    /// `by_thread_us` as a JSON object.
    pub fn by_thread_json(&self) -> String {
        let fields: Vec<String> = self
            .by_thread_us
            .iter()
            .map(|(name, us)| format!("\"{name}\":{us}"))
            .collect();
        format!("{{{}}}", fields.join(","))
    }
}

fn tick_us() -> u64 {
    1_000_000 / rustix::param::clock_ticks_per_second().max(1)
}

/// `/proc/stat`'s first line: user nice system idle iowait irq softirq steal …
fn machine_busy_us() -> u64 {
    let text = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let Some(line) = text.lines().next() else {
        return 0;
    };
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let (idle, iowait) = (
        v.get(3).copied().unwrap_or(0),
        v.get(4).copied().unwrap_or(0),
    );
    (v.iter().take(8).sum::<u64>() - idle - iowait) * tick_us()
}

/// A `stat` file's name (between the parentheses) and its utime + stime in ticks.
fn stat(path: &std::path::Path) -> Option<(String, u64)> {
    let text = std::fs::read_to_string(path).ok()?;
    let (open, close) = (text.find('(')?, text.rfind(')')?);
    let name = text[open + 1..close].to_owned();
    // After the name: state is field 3, utime 14 and stime 15.
    let rest: Vec<&str> = text[close + 1..].split_whitespace().collect();
    let ticks = rest.get(11)?.parse::<u64>().ok()? + rest.get(12)?.parse::<u64>().ok()?;
    Some((name, ticks))
}

fn own_name() -> String {
    stat(std::path::Path::new("/proc/self/stat")).map_or_else(String::new, |(n, _)| n)
}

/// This process's threads that `keep` takes, their CPU time summed by thread name.
fn threads_us(keep: impl Fn(&str) -> bool) -> std::collections::BTreeMap<String, u64> {
    let mut out = std::collections::BTreeMap::new();
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    for (name, ticks) in dir
        .flatten()
        .filter_map(|e| stat(&e.path().join("stat")))
        .filter(|(name, _)| keep(name))
    {
        *out.entry(name).or_insert(0) += ticks * tick_us();
    }
    out
}

fn processes_us(name: &str) -> u64 {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0;
    };
    let ticks: u64 = dir
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .bytes()
                .all(|b| b.is_ascii_digit())
        })
        .filter_map(|e| stat(&e.path().join("stat")))
        .filter(|(n, _)| n == name)
        .map(|(_, t)| t)
        .sum();
    ticks * tick_us()
}
