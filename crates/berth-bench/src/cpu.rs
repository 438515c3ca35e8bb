//! CPU time read from `/proc`, for figures that swing far less with the machine's mood
//! than throughput does (a run's pgbench figure moved between 9,100 and 14,200/s within
//! one hour on the same machine): the whole machine's busy time, the daemons' threads in
//! this process, and the PostgreSQL server's processes. Divided by the lifecycles done
//! meanwhile, they say what one lifecycle costs, and on a machine whose cores are all
//! busy that cost is what bounds the rate.

/// CPU time so far, in microseconds.
#[derive(Clone, Debug, Default)]
pub struct Cpu {
    /// Every core's time not idle (nor waiting for I/O, nor stolen).
    pub machine_us: u64,
    /// Time the hypervisor gave the machine's cores to others (`steal`): not work done
    /// here, but a run with much of it had slower cores than one without.
    pub steal_us: u64,
    /// This process's threads but its own (the daemons': the clients' thread and the
    /// main thread keep the process's name). A thread that exits between two readings
    /// takes its time with it (tokio's blocking threads may): such time is missing,
    /// never counted against another thread.
    pub daemons_us: u64,
    /// Processes named `postgres` (the server, its backends and helpers).
    pub postgres_us: u64,
    /// `daemons_us` by thread name (`tokio-rt-worker`, `berth-ledger`,
    /// `berth-workspace`, ...): which part of the daemons a lifecycle's cost is in.
    pub by_thread_us: std::collections::BTreeMap<String, u64>,
    /// The daemons' threads by thread id: their name and time so far (each thread's
    /// time since the last reading is its own, whichever threads came and went).
    threads: std::collections::BTreeMap<u32, (String, u64)>,
}

impl Cpu {
    pub fn now() -> Cpu {
        let own = own_name();
        let threads = threads_us(|name| name != own);
        let (machine_us, steal_us) = machine_busy_us();
        Cpu {
            machine_us,
            steal_us,
            daemons_us: threads.values().map(|(_, us)| us).sum(),
            postgres_us: processes_us("postgres"),
            by_thread_us: Default::default(),
            threads,
        }
    }

    /// What was spent since `before`, per `n` (lifecycles), in microseconds.
    pub fn per(&self, before: &Cpu, n: u64) -> Cpu {
        let n = n.max(1);
        // Thread by thread: one that started since `before` counts from nothing.
        let mut by_thread_us = std::collections::BTreeMap::new();
        for (tid, (name, us)) in &self.threads {
            let was = before.threads.get(tid).map_or(0, |(_, us)| *us);
            *by_thread_us.entry(name.clone()).or_insert(0) += us.saturating_sub(was);
        }
        Cpu {
            machine_us: self.machine_us.saturating_sub(before.machine_us) / n,
            steal_us: self.steal_us.saturating_sub(before.steal_us) / n,
            daemons_us: by_thread_us.values().sum::<u64>() / n,
            postgres_us: self.postgres_us.saturating_sub(before.postgres_us) / n,
            by_thread_us: by_thread_us
                .into_iter()
                .map(|(k, us)| (k, us / n))
                .collect(),
            threads: Default::default(),
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

/// `/proc/stat`'s first line: user nice system idle iowait irq softirq steal …; the
/// busy time and the stolen time. Stolen time is no work of this machine's: counted
/// as busy, it would make a lifecycle look dearer whenever other guests took cores.
fn machine_busy_us() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let Some(line) = text.lines().next() else {
        return (0, 0);
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
    let steal = v.get(7).copied().unwrap_or(0);
    let busy = v.iter().take(8).sum::<u64>() - idle - iowait - steal;
    (busy * tick_us(), steal * tick_us())
}

/// A `stat` file's name (between the parentheses) and its utime + stime in ticks.
pub(crate) fn stat(path: &std::path::Path) -> Option<(String, u64)> {
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

/// This process's threads that `keep` takes, by thread id: name and CPU time.
fn threads_us(keep: impl Fn(&str) -> bool) -> std::collections::BTreeMap<u32, (String, u64)> {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return Default::default();
    };
    dir.flatten()
        .filter_map(|e| {
            let tid = e.file_name().to_str()?.parse().ok()?;
            let (name, ticks) = stat(&e.path().join("stat"))?;
            keep(&name).then(|| (tid, (name, ticks * tick_us())))
        })
        .collect()
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
