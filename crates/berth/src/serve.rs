//! `berth serve`: flags (each also a `BERTH_*` variable) over `berth.toml` over the
//! host's own figures and the contract's defaults (docs/contract.md).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{anyhow, bail};
use berth_core::fmt_bp;
use berth_core::validate::{parse_duration_ms, parse_size};
use clap::Args;
use serde::Deserialize;

use crate::args::{
    cpus_to_millis, parse_cpu_amount, parse_cpus, parse_duration, parse_percent, parse_port_range,
    parse_size as parse_size_arg,
};

#[derive(Args, Debug, Default)]
pub struct ServeArgs {
    /// State directory: ledger, workspaces, admin token.
    #[arg(long, env = "BERTH_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// Listen address [default: 127.0.0.1:7420].
    #[arg(long, env = "BERTH_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// Configuration file [default: <state dir>/berth.toml, if it exists].
    #[arg(long, env = "BERTH_CONFIG")]
    pub config: Option<PathBuf>,
    /// Runs granted at once at most [default: CPUs / 2, from 1 to 8].
    #[arg(long, env = "BERTH_SLOTS_MAX")]
    pub slots_max: Option<u64>,
    /// Memory total, e.g. 64GiB [default: the host's MemTotal].
    #[arg(long, env = "BERTH_MEMORY_TOTAL", value_parser = parse_size_arg)]
    pub memory_total: Option<u64>,
    /// CPU total, in CPUs (decimal: 4, 1.5) or millis (4000m) [default: the host's
    /// CPUs].
    #[arg(long, env = "BERTH_CPU_TOTAL", value_parser = parse_cpus)]
    pub cpu_total: Option<u64>,
    /// Disk total of the state dir's file system, e.g. 500GiB [default: its size].
    #[arg(long, env = "BERTH_DISK_TOTAL", value_parser = parse_size_arg)]
    pub disk_total: Option<u64>,
    /// Memory never granted [default: 12.5% of the total, from 1GiB to 4GiB].
    #[arg(long, env = "BERTH_MEMORY_RESERVE", value_parser = parse_size_arg)]
    pub memory_reserve: Option<u64>,
    /// The memory reserve while no foreground run holds a claim (an idle host lends
    /// background runs more of itself), at most --memory-reserve; checked against
    /// sampled MemAvailable [default: the same as --memory-reserve].
    #[arg(long, env = "BERTH_MEMORY_RESERVE_IDLE", value_parser = parse_size_arg)]
    pub memory_reserve_idle: Option<u64>,
    /// CPU never granted, in CPUs or millis (500m) [default: 1].
    #[arg(long, env = "BERTH_CPU_RESERVE", value_parser = parse_cpu_amount)]
    pub cpu_reserve: Option<u64>,
    /// Disk never granted [default: 10GiB].
    #[arg(long, env = "BERTH_DISK_RESERVE", value_parser = parse_size_arg)]
    pub disk_reserve: Option<u64>,
    /// CPUs a run asks for when it names none, decimal [default: 0.5: coding agents
    /// mostly wait on a model, so half a CPU lets several share a small host].
    #[arg(long, env = "BERTH_DEFAULT_CPUS", value_parser = parse_cpus)]
    pub default_cpus: Option<u64>,
    /// Memory a run asks for when it names none [default: 2GiB + 128MiB].
    #[arg(long, env = "BERTH_DEFAULT_MEMORY", value_parser = parse_size_arg)]
    pub default_memory: Option<u64>,
    /// A named counted resource, NAME=COUNT (repeatable), e.g. gpu=2.
    #[arg(long = "resource", value_name = "NAME=COUNT")]
    pub resources: Vec<String>,
    /// Waiters scanned per admission pass after the head [default: 64].
    #[arg(long, env = "BERTH_WINDOW")]
    pub window: Option<usize>,
    /// How long the queue's head may wait before capacity is held back for it
    /// [default: 30s].
    #[arg(long, env = "BERTH_STARVATION_GUARD", value_parser = parse_duration)]
    pub starvation_guard: Option<u64>,
    /// How long a waiter restored after a restart keeps its place for its client
    /// [default: 30s].
    #[arg(long, env = "BERTH_RECONNECT_WINDOW", value_parser = parse_duration)]
    pub reconnect_window: Option<u64>,
    /// Accept requests without a token (loopback listen addresses only).
    #[arg(long, env = "BERTH_INSECURE_NO_AUTH")]
    pub insecure_no_auth: bool,
    /// Do not sample MemAvailable (use only the configured totals).
    #[arg(long, env = "BERTH_NO_MEMORY_SAMPLING")]
    pub no_memory_sampling: bool,
    /// Grace between SIGTERM and SIGKILL when a run is stopped [default: 10s].
    #[arg(long, env = "BERTH_STOP_GRACE", value_parser = parse_duration)]
    pub stop_grace: Option<u64>,
    /// Never use cgroups (process groups only).
    #[arg(long, env = "BERTH_NO_CGROUPS")]
    pub no_cgroups: bool,
    /// A run's hard memory limit (memory.max) as a percentage of its memory claim
    /// (memory.high, the throttle, is the claim itself), 100 to 1000 [default: 125].
    #[arg(long, env = "BERTH_MEMORY_MAX_PERCENT")]
    pub memory_max_percent: Option<u64>,
    /// Swap a run may use beyond its memory (memory.swap.max), or `unlimited` (the
    /// host's own policy) [default: 0].
    #[arg(long, env = "BERTH_SWAP_MAX")]
    pub swap_max: Option<String>,
    /// Let runs use idle CPU beyond their claim: their claim becomes a weight
    /// (cpu.weight, their share under contention) instead of a ceiling (cpu.max).
    #[arg(long, env = "BERTH_CPU_BURST")]
    pub cpu_burst: bool,
    /// Processes (and threads) one run may have at once (pids.max; 0: no limit)
    /// [default: 4096].
    #[arg(long, env = "BERTH_PIDS_MAX")]
    pub pids_max: Option<u64>,
    /// While memory pressure holds background waiters back, pause the newest granted
    /// background run (cgroup.freeze; one more every 10 s at most) and resume them all
    /// when it falls.
    #[arg(long, env = "BERTH_FREEZE_BACKGROUND")]
    pub freeze_background: bool,
    /// No foreground run is admitted while the host's memory pressure (PSI some avg10:
    /// the share of the last 10 s in which some task stalled on memory) is above this
    /// [default: 10%].
    #[arg(long, env = "BERTH_MEMORY_PRESSURE_MAX", value_parser = parse_percent)]
    pub memory_pressure_max: Option<u32>,
    /// No background run is admitted while the pressure is above this (at most the
    /// foreground figure) [default: 5%].
    #[arg(long, env = "BERTH_MEMORY_PRESSURE_BACKGROUND_MAX", value_parser = parse_percent)]
    pub memory_pressure_background_max: Option<u32>,
    /// Where memory pressure is read, in PSI's format [default: /proc/pressure/memory,
    /// unless --no-memory-sampling]. A file of one's own makes a synthetic source.
    #[arg(long, env = "BERTH_PRESSURE_SOURCE")]
    pub pressure_source: Option<PathBuf>,
    /// No foreground run is admitted while the host's cpu pressure (PSI some avg10 of
    /// cpu) is above this, no background run above half of it [default: 100%, off].
    #[arg(long, env = "BERTH_CPU_PRESSURE_MAX", value_parser = parse_percent)]
    pub cpu_pressure_max: Option<u32>,
    /// The same for io pressure (PSI some avg10 of io) [default: 100%, off].
    #[arg(long, env = "BERTH_IO_PRESSURE_MAX", value_parser = parse_percent)]
    pub io_pressure_max: Option<u32>,
    /// Where cpu pressure is read, where a limit is set [default: /proc/pressure/cpu].
    #[arg(long, env = "BERTH_CPU_PRESSURE_SOURCE")]
    pub cpu_pressure_source: Option<PathBuf>,
    /// Where io pressure is read, where a limit is set [default: /proc/pressure/io].
    #[arg(long, env = "BERTH_IO_PRESSURE_SOURCE")]
    pub io_pressure_source: Option<PathBuf>,
    /// Diagnostics (a run's logs/) kept per run [default: 1MiB].
    #[arg(long, env = "BERTH_DIAGNOSTICS_RUN_BYTES", value_parser = parse_size_arg)]
    pub diagnostics_run_bytes: Option<u64>,
    /// Diagnostics kept in all; the oldest archives are dropped first [default:
    /// 256MiB].
    #[arg(long, env = "BERTH_DIAGNOSTICS_TOTAL_BYTES", value_parser = parse_size_arg)]
    pub diagnostics_total_bytes: Option<u64>,
    /// Ended runs remembered (answers about them, idempotent retries) and kept in the
    /// ledger; older ones are deleted in the background [default: 10000].
    #[arg(long, env = "BERTH_RETAIN_ENDED")]
    pub retain_ended: Option<usize>,
    /// Ended runs older than this are deleted from the ledger [default: 7d].
    #[arg(long, env = "BERTH_RETAIN_ENDED_FOR", value_parser = parse_duration)]
    pub retain_ended_for: Option<u64>,
    /// Event streams (`GET /v1/events`) one token may hold open at once; more are
    /// refused `429 too_many_streams` [default: 64].
    #[arg(long, env = "BERTH_TOKEN_STREAMS_MAX", value_parser = clap::value_parser!(u32).range(1..=65_536))]
    pub token_streams_max: Option<u32>,
    /// Long polls (waiting acquires, `GET /v1/runs/{id}?wait_s`) one token may hold
    /// open at once; more are refused `429 too_many_waits` [default: 256].
    #[arg(long, env = "BERTH_TOKEN_WAITS_MAX", value_parser = clap::value_parser!(u32).range(1..=65_536))]
    pub token_waits_max: Option<u32>,
    /// An experiment scope nothing holds (no run, no token, no control state) is
    /// forgotten after this long idle [default: 24h].
    #[arg(long, env = "BERTH_SCOPE_IDLE", value_parser = parse_duration)]
    pub scope_idle: Option<u64>,
    /// An agent thread's workspace with no attach and no live registration for this
    /// long is evicted [default: 30m].
    #[arg(long, env = "BERTH_THREAD_IDLE_AFTER", value_parser = parse_duration)]
    pub thread_idle_after: Option<u64>,
    /// A thread's workspace is evicted this long after it was made, unless registered [default: 7d].
    #[arg(long, env = "BERTH_THREAD_TTL", value_parser = parse_duration)]
    pub thread_ttl: Option<u64>,
    /// A registration stays live this long past its deadline [default: 60s].
    #[arg(long, env = "BERTH_THREAD_GRACE", value_parser = parse_duration)]
    pub thread_grace: Option<u64>,
    /// Below this much free space on the state dir's file system, idle threads'
    /// workspaces are evicted, least recently used first (reason disk_pressure) [default: 1GiB].
    #[arg(long, env = "BERTH_THREAD_DISK_FREE_MIN", value_parser = parse_size_arg)]
    pub thread_disk_free_min: Option<u64>,
    /// Ports for runs' `[[port]]` entries, LOW-HIGH inclusive [default: 30000-30999].
    #[arg(long, env = "BERTH_PORT_RANGE", value_parser = parse_port_range)]
    pub port_range: Option<(u16, u16)>,
    /// Start a new ledger although this state dir was used before and its ledger is
    /// missing or empty (fences still continue above the fence marker).
    #[arg(long, env = "BERTH_INIT_LEDGER")]
    pub init_ledger: bool,
    /// Fences reserved per write of the fence marker (a test knob: a small block
    /// makes the marker move within a session) [default: 1048576].
    #[arg(long, hide = true, env = "BERTH_FENCE_RESERVE_BLOCK", value_parser = clap::value_parser!(u64).range(1..=(1 << 40)))]
    pub fence_reserve_block: Option<u64>,
    /// Where the workspaces of runs made by a token of another user (`--uid`) go, each
    /// user's own: DIR/UID/..., owned by that user, mode 0700. Needs root; DIR must be
    /// owned by root and writable by nobody else, and traversable by the users
    /// [default: /var/lib/berth-users when root; else such runs' workspaces are
    /// berth's, in the state dir].
    #[arg(long, env = "BERTH_USER_WORKSPACES", value_name = "DIR")]
    pub user_workspaces: Option<PathBuf>,
    /// Print the configuration in force (flags, variables, berth.toml and defaults, as
    /// berth.toml keys) and exit without starting.
    #[arg(long)]
    pub print_config: bool,
    /// The longest lease a run may ask for [default: 24h; 10m in fleet mode]. In
    /// fleet mode a silent host is declared dead this long plus --fleet-margin after
    /// its last heartbeat, and stops its fleet-wide runs --stop-grace plus two
    /// heartbeats (at least 1 s) before then, and at least a quarter of that before.
    #[arg(long, env = "BERTH_TTL_MAX", value_parser = parse_duration)]
    pub ttl_max: Option<u64>,
    /// Fleet mode: the fleet store, postgres://USER@HOST/DB (or a libpq
    /// key=value string), or sqlite:PATH for daemons of one machine sharing a file.
    /// The local ledger stays in the state dir.
    #[arg(long, env = "BERTH_STORE")]
    pub store: Option<String>,
    /// Fleet mode: this host's id, unique in the fleet [default: the host name and a
    /// suffix kept in the state dir's `fleet-host-id`]. A host refuses to start while
    /// another live instance beats under its id.
    #[arg(long, env = "BERTH_HOST_ID")]
    pub host_id: Option<String>,
    /// Fleet mode: the URL other hosts and `berth fleet` show for this host [default:
    /// http://LISTEN].
    #[arg(long, env = "BERTH_ADVERTISE")]
    pub advertise: Option<String>,
    /// Fleet mode: heartbeat period [default: 1s].
    #[arg(long, env = "BERTH_FLEET_BEAT", value_parser = parse_duration)]
    pub fleet_beat: Option<u64>,
    /// Fleet mode: how long past the longest lease a silent host is declared dead
    /// [default: 30s].
    #[arg(long, env = "BERTH_FLEET_MARGIN", value_parser = parse_duration)]
    pub fleet_margin: Option<u64>,
}

/// `berth.toml`: the same keys as the flags, in snake case.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    listen: Option<SocketAddr>,
    slots_max: Option<u64>,
    memory_total: Option<String>,
    cpu_total: Option<CpuValue>,
    disk_total: Option<String>,
    memory_reserve: Option<String>,
    memory_reserve_idle: Option<String>,
    cpu_reserve: Option<CpuValue>,
    disk_reserve: Option<String>,
    resources: Option<BTreeMap<String, u64>>,
    window: Option<usize>,
    starvation_guard: Option<String>,
    reconnect_window: Option<String>,
    insecure_no_auth: Option<bool>,
    no_memory_sampling: Option<bool>,
    stop_grace: Option<String>,
    no_cgroups: Option<bool>,
    memory_pressure_max: Option<String>,
    memory_pressure_background_max: Option<String>,
    memory_max_percent: Option<u64>,
    swap_max: Option<String>,
    cpu_burst: Option<bool>,
    pids_max: Option<u64>,
    freeze_background: Option<bool>,
    pressure_source: Option<PathBuf>,
    cpu_pressure_max: Option<String>,
    io_pressure_max: Option<String>,
    cpu_pressure_source: Option<PathBuf>,
    io_pressure_source: Option<PathBuf>,
    diagnostics_run_bytes: Option<String>,
    diagnostics_total_bytes: Option<String>,
    default_cpus: Option<f64>,
    default_memory: Option<String>,
    retain_ended: Option<usize>,
    retain_ended_for: Option<String>,
    token_streams_max: Option<u32>,
    token_waits_max: Option<u32>,
    scope_idle: Option<String>,
    thread_idle_after: Option<String>,
    thread_ttl: Option<String>,
    thread_grace: Option<String>,
    thread_disk_free_min: Option<String>,
    port_range: Option<String>,
    user_workspaces: Option<PathBuf>,
}

/// What a run asks for when it names no CPUs: half a CPU. A coding agent mostly waits
/// on a model; the engine's own default (2 CPUs) let a 2- or 4-core host run one agent
/// at a time.
pub const DEFAULT_RUN_CPU_MILLIS: u64 = 500;

/// A CPU figure in `berth.toml`: CPUs as a number (`cpu_total = 16`, `1.5`) or a
/// string (`"16"`, `"16000m"`).
#[derive(Clone, Deserialize)]
#[serde(untagged)]
enum CpuValue {
    Number(f64),
    Text(String),
}

fn cpu_key(key: &str, v: Option<CpuValue>) -> anyhow::Result<Option<u64>> {
    let text = match v {
        None => return Ok(None),
        Some(CpuValue::Number(n)) => n.to_string(),
        Some(CpuValue::Text(t)) => t,
    };
    parse_cpu_amount(&text)
        .map(Some)
        .map_err(|e| anyhow!("berth.toml {key}: {e}"))
}

fn size(key: &str, v: Option<String>) -> anyhow::Result<Option<u64>> {
    v.map(|s| parse_size(&s).map_err(|e| anyhow!("berth.toml {key}: {e}")))
        .transpose()
}

fn duration(key: &str, v: Option<String>) -> anyhow::Result<Option<u64>> {
    v.map(|s| parse_duration_ms(&s).map_err(|e| anyhow!("berth.toml {key}: {e}")))
        .transpose()
}

/// The most of a `berth.toml` line an error quotes.
const ERROR_LINE_CHARS_MAX: usize = 120;

/// A `berth.toml` error on one line that names the key: toml's message says what is
/// wrong (`invalid type: integer `600`, expected a string`) but not for which key, so
/// the line it points at goes with it (`line 4: default_memory = 600`).
fn toml_error(text: &str, e: &toml::de::Error) -> String {
    let Some(before) = e.span().and_then(|s| text.get(..s.start)) else {
        return e.message().to_string();
    };
    let n = before.matches('\n').count();
    let line: String = text
        .lines()
        .nth(n)
        .unwrap_or_default()
        .trim()
        .chars()
        .take(ERROR_LINE_CHARS_MAX)
        .collect();
    format!("{} (line {}: {line})", e.message(), n + 1)
}

/// `berth.toml` (or `--config`). S5: the config can turn auth off, so it is read only
/// if no other user could have planted or changed it (not a link, owned by berth's
/// user or root, not group- or world-writable).
fn file_config(a: &ServeArgs, state_dir: &std::path::Path) -> anyhow::Result<FileConfig> {
    let file_path = a
        .config
        .clone()
        .unwrap_or_else(|| state_dir.join("berth.toml"));
    Ok(match berth_server::private::read_trusted(&file_path)? {
        Some(text) => toml::from_str(&text)
            .map_err(|e| anyhow!("{}: {}", file_path.display(), toml_error(&text, &e)))?,
        None if a.config.is_none() => FileConfig::default(),
        None => bail!("reading {}: no such file", file_path.display()),
    })
}

/// Where the workspaces of other users' runs go when berth runs as root.
const USER_WORKSPACES_DEFAULT: &str = "/var/lib/berth-users";

pub fn build_config(a: ServeArgs) -> anyhow::Result<berth_server::ServeConfig> {
    let state_dir = a
        .state_dir
        .clone()
        .unwrap_or_else(crate::client::default_state_dir);
    // The state dir first: a config inside a dir another user can write is not
    // trusted whatever its own mode says (S5).
    berth_server::private::state_dir(&state_dir)?;
    let file = file_config(&a, &state_dir)?;
    let threads = thread_config(&a, &file)?;
    let limits = run_limits(&a, &file)?;
    let mut c = engine_config(&a, &file, &state_dir)?;
    c.fit_default_request();
    let listen = a
        .listen
        .or(file.listen)
        .unwrap_or_else(|| "127.0.0.1:7420".parse().expect("addr"));
    let fleet = fleet_config(&a, &c, listen, &state_dir)?;
    c.fleet = fleet.is_some();
    if let Err(e) = c.validate() {
        bail!("configuration: {e}");
    }
    let diagnostics = diagnostics_limits(&a, &file)?;
    let user_workspaces = user_workspaces(&a, &file);
    let (cpu_pressure_source, io_pressure_source) = cpu_io_sources(&a, &file, &c);
    Ok(berth_server::ServeConfig {
        fleet,
        state_dir,
        listen,
        insecure_no_auth: a.insecure_no_auth || file.insecure_no_auth.unwrap_or(false),
        engine: c,
        sample_memory: !(a.no_memory_sampling || file.no_memory_sampling.unwrap_or(false)),
        pressure_source: pressure_source(&a, &file),
        cpu_pressure_source,
        io_pressure_source,
        reconnect_window_ms: a
            .reconnect_window
            .or(duration("reconnect_window", file.reconnect_window)?)
            .unwrap_or(30_000),
        group_commit: true,
        tick_ms: 100,
        stop_grace_ms: a
            .stop_grace
            .or(duration("stop_grace", file.stop_grace)?)
            .unwrap_or(10_000),
        cgroups: !(a.no_cgroups || file.no_cgroups.unwrap_or(false)),
        limits,
        diagnostics_run_bytes_max: diagnostics.0,
        diagnostics_total_bytes_max: diagnostics.1,
        init_ledger: a.init_ledger,
        user_workspaces,
        fence_reserve_block: a
            .fence_reserve_block
            .unwrap_or(berth_server::private::FENCE_RESERVE_BLOCK),
        threads,
        retain_ended_for_ms: a
            .retain_ended_for
            .or(duration("retain_ended_for", file.retain_ended_for)?)
            .unwrap_or(berth_server::RETAIN_ENDED_FOR_MS_DEFAULT),
        token_streams_max: token_cap(
            "token_streams_max",
            a.token_streams_max,
            file.token_streams_max,
        )?
        .unwrap_or(berth_server::limits::TOKEN_STREAMS_MAX_DEFAULT),
        token_waits_max: token_cap("token_waits_max", a.token_waits_max, file.token_waits_max)?
            .unwrap_or(berth_server::limits::TOKEN_WAITS_MAX_DEFAULT),
        port_range: port_range(a.port_range, &file.port_range)?,
    })
}

/// P3: what a run's archived logs may take, and all archives together (bytes).
fn diagnostics_limits(a: &ServeArgs, file: &FileConfig) -> anyhow::Result<(u64, u64)> {
    let run = a
        .diagnostics_run_bytes
        .or(size(
            "diagnostics_run_bytes",
            file.diagnostics_run_bytes.clone(),
        )?)
        .unwrap_or(1 << 20);
    let total = a
        .diagnostics_total_bytes
        .or(size(
            "diagnostics_total_bytes",
            file.diagnostics_total_bytes.clone(),
        )?)
        .unwrap_or(256 << 20);
    Ok((run, total))
}

/// Where other users' runs get their workspaces: the flag, else the file, else (as
/// root) the default; none for a daemon that is not root and was not told.
fn user_workspaces(a: &ServeArgs, file: &FileConfig) -> Option<PathBuf> {
    a.user_workspaces
        .clone()
        .or(file.user_workspaces.clone())
        .or_else(|| {
            rustix::process::geteuid()
                .is_root()
                .then(|| PathBuf::from(USER_WORKSPACES_DEFAULT))
        })
}

/// W3: the ports runs get, from the flag, else the file, else the default.
fn port_range(flag: Option<(u16, u16)>, file: &Option<String>) -> anyhow::Result<(u16, u16)> {
    Ok(match (flag, file) {
        (Some(r), _) => r,
        (None, Some(r)) => {
            parse_port_range(r).map_err(|e| anyhow!("berth.toml port_range: {e}"))?
        }
        (None, None) => berth_server::PORT_RANGE_DEFAULT,
    })
}

/// S10: a per-token cap, from the flag (its range checked by clap), else the file.
fn token_cap(key: &str, flag: Option<u32>, file: Option<u32>) -> anyhow::Result<Option<usize>> {
    match flag.or(file) {
        Some(n @ 1..=65_536) => Ok(Some(n as usize)),
        Some(n) => bail!("berth.toml {key}: must be from 1 to 65536, not {n}"),
        None => Ok(None),
    }
}

/// F1/F2: fleet mode's store, host id and timing, if `--store` names a store.
fn fleet_config(
    a: &ServeArgs,
    c: &berth_core::Config,
    listen: SocketAddr,
    state_dir: &std::path::Path,
) -> anyhow::Result<Option<berth_server::fleet::FleetConfig>> {
    let Some(url) = a.store.clone() else {
        return Ok(None);
    };
    let host_id = match &a.host_id {
        Some(h) => h.clone(),
        None => berth_server::private::default_host_id(
            state_dir,
            &rustix::system::uname().nodename().to_string_lossy(),
        )?,
    };
    berth_core::validate::resource_name(&host_id).map_err(|e| anyhow!("--host-id: {e}"))?;
    let beat_ms = a.fleet_beat.unwrap_or(1_000).max(10);
    let margin_ms = a.fleet_margin.unwrap_or(30_000);
    if margin_ms < 3 * beat_ms {
        bail!(
            "--fleet-margin must be at least three heartbeats ({} ms), got {margin_ms} ms",
            3 * beat_ms
        );
    }
    Ok(Some(berth_server::fleet::FleetConfig {
        url,
        host: berth_server::fleet::HostInfo {
            host_id,
            address: a
                .advertise
                .clone()
                .unwrap_or_else(|| format!("http://{listen}")),
            version: env!("CARGO_PKG_VERSION").into(),
        },
        beat_ms,
        lapse_ms: c.ttl_ms_max.saturating_add(margin_ms),
        recheck_ms: 2_000,
        fence_floor: 0,
    }))
}

/// G0/G1: the threads' idle time, ttl and grace: flags, then `berth.toml`, then defaults.
fn thread_config(
    a: &ServeArgs,
    file: &FileConfig,
) -> anyhow::Result<berth_core::threads::ThreadConfig> {
    let d = berth_core::threads::ThreadConfig::default();
    let pick = |flag: Option<u64>, key: &str, v: &Option<String>, dflt: u64| {
        Ok::<_, anyhow::Error>(match flag {
            Some(ms) => ms,
            None => duration(key, v.clone())?.unwrap_or(dflt),
        })
    };
    Ok(berth_core::threads::ThreadConfig {
        idle_after_ms: pick(
            a.thread_idle_after,
            "thread_idle_after",
            &file.thread_idle_after,
            d.idle_after_ms,
        )?,
        ttl_ms: pick(a.thread_ttl, "thread_ttl", &file.thread_ttl, d.ttl_ms)?,
        grace_ms: pick(
            a.thread_grace,
            "thread_grace",
            &file.thread_grace,
            d.grace_ms,
        )?,
        disk_free_min: match a.thread_disk_free_min {
            Some(b) => b,
            None => size("thread_disk_free_min", file.thread_disk_free_min.clone())?
                .unwrap_or(d.disk_free_min),
        },
    })
}

/// The engine's configuration: the host's own figures, then `berth.toml`, then flags.
fn engine_config(
    a: &ServeArgs,
    file: &FileConfig,
    state_dir: &std::path::Path,
) -> anyhow::Result<berth_core::Config> {
    let cpus = berth_server::host::cpus();
    let (mem_given, disk_given) = (
        a.memory_total.is_some() || file.memory_total.is_some(),
        a.disk_total.is_some() || file.disk_total.is_some(),
    );
    let mem = a
        .memory_total
        .or(size("memory_total", file.memory_total.clone())?)
        .unwrap_or_else(berth_server::host::memory_total);
    let disk = a
        .disk_total
        .or(size("disk_total", file.disk_total.clone())?)
        .unwrap_or_else(|| berth_server::host::disk_total(state_dir));
    let mut c = berth_core::Config::for_host(cpus, mem, disk);
    // What the host reports is clamped to the bounded totals (S7); what an operator
    // asks for is kept as given, so `validate` refuses it with the rule instead of
    // silently using another number.
    if mem_given {
        c.memory_total = mem;
    }
    if disk_given {
        c.disk_total = disk;
    }
    if let Some(v) = a
        .cpu_total
        .or(cpu_key("cpu_total", file.cpu_total.clone())?)
    {
        c.cpu_total_millis = v;
        c.slots_max = (v / 2000).clamp(1, 8);
    }
    if let Some(v) = a.slots_max.or(file.slots_max) {
        c.slots_max = v;
    }
    reserves(&mut c, a, file)?;
    pressure_limits(&mut c, a, file)?;
    if let Some(v) = a.window.or(file.window) {
        c.window = v;
    }
    if let Some(v) = a
        .starvation_guard
        .or(duration("starvation_guard", file.starvation_guard.clone())?)
    {
        c.starvation_guard_ms = v;
    }
    // Fleet mode bounds how long a silent host keeps its keys (the lapse is the
    // longest lease plus the margin): its own default.
    let fleet_default = a
        .store
        .is_some()
        .then_some(berth_server::fleet::FLEET_TTL_MS_MAX_DEFAULT);
    if let Some(ttl) = a.ttl_max.or(fleet_default) {
        c.ttl_ms_max = ttl;
        c.ttl_ms_default = c.ttl_ms_default.min(ttl);
    }
    named_and_defaults(&mut c, a, file)?;
    Ok(c)
}

/// Issue 36: the memory pressure above which waiters are held back, where given.
fn pressure_limits(
    c: &mut berth_core::Config,
    a: &ServeArgs,
    file: &FileConfig,
) -> anyhow::Result<()> {
    let key = |name: &str, v: &Option<String>| -> anyhow::Result<Option<u32>> {
        v.as_deref()
            .map(parse_percent)
            .transpose()
            .map_err(|e| anyhow::anyhow!("{name}: {e}"))
    };
    let fg = key("memory_pressure_max", &file.memory_pressure_max)?;
    if let Some(v) = a.memory_pressure_max.or(fg) {
        c.pressure_foreground_max_bp = v;
        // A lower foreground figure lowers the background one with it.
        c.pressure_background_max_bp = c.pressure_background_max_bp.min(v);
    }
    let bg = key(
        "memory_pressure_background_max",
        &file.memory_pressure_background_max,
    )?;
    if let Some(v) = a.memory_pressure_background_max.or(bg) {
        c.pressure_background_max_bp = v;
    }
    if let Some(v) = a
        .cpu_pressure_max
        .or(key("cpu_pressure_max", &file.cpu_pressure_max)?)
    {
        c.pressure_cpu_max_bp = v;
    }
    if let Some(v) = a
        .io_pressure_max
        .or(key("io_pressure_max", &file.io_pressure_max)?)
    {
        c.pressure_io_max_bp = v;
    }
    Ok(())
}

/// Issue 36: where cpu and io pressure are read.
fn cpu_io_sources(
    a: &ServeArgs,
    file: &FileConfig,
    c: &berth_core::Config,
) -> (Option<PathBuf>, Option<PathBuf>) {
    let cpu = a
        .cpu_pressure_source
        .clone()
        .or(file.cpu_pressure_source.clone());
    let io = a
        .io_pressure_source
        .clone()
        .or(file.io_pressure_source.clone());
    (
        kernel_pressure(cpu, "/proc/pressure/cpu", c.pressure_cpu_max_bp),
        kernel_pressure(io, "/proc/pressure/io", c.pressure_io_max_bp),
    )
}

/// Issue 36: where cpu or io pressure is read: the given file, else the kernel's, and
/// only where a limit is set (below 100%): a figure nothing uses is not read.
fn kernel_pressure(given: Option<PathBuf>, kernel: &str, max_bp: u32) -> Option<PathBuf> {
    if max_bp >= berth_core::PRESSURE_BP_MAX {
        return None;
    }
    let kernel = PathBuf::from(kernel);
    given.or_else(|| kernel.exists().then_some(kernel))
}

/// Issue 36: how runs' cgroups are held to their claims, from flags or file.
fn run_limits(a: &ServeArgs, file: &FileConfig) -> anyhow::Result<berth_proc::limits::Policy> {
    use berth_proc::limits::{CpuMode, Policy, MEMORY_MAX_PCT_MAX, MEMORY_MAX_PCT_MIN};
    let mut p = Policy::default();
    if let Some(pct) = a.memory_max_percent.or(file.memory_max_percent) {
        if !(MEMORY_MAX_PCT_MIN..=MEMORY_MAX_PCT_MAX).contains(&pct) {
            anyhow::bail!("memory_max_percent: {pct} must be from {MEMORY_MAX_PCT_MIN} to {MEMORY_MAX_PCT_MAX} (the hard limit is never below the claim)");
        }
        p.memory_max_pct = pct;
    }
    if let Some(s) = a.swap_max.as_ref().or(file.swap_max.as_ref()) {
        p.swap_max_bytes = match s.trim() {
            "unlimited" => None,
            s => {
                Some(parse_size(s).map_err(|e| anyhow::anyhow!("swap_max: {e} (or `unlimited`)"))?)
            }
        };
    }
    if a.cpu_burst || file.cpu_burst.unwrap_or(false) {
        p.cpu = CpuMode::Weight;
    }
    if let Some(n) = a.pids_max.or(file.pids_max) {
        p.pids_max = n;
    }
    p.freeze_background = a.freeze_background || file.freeze_background.unwrap_or(false);
    Ok(p)
}

/// Issue 36: where pressure is read: the flag's file, else the kernel's while memory
/// is sampled (if this kernel has PSI).
fn pressure_source(a: &ServeArgs, file: &FileConfig) -> Option<PathBuf> {
    let given = a.pressure_source.clone().or(file.pressure_source.clone());
    let sampled = !(a.no_memory_sampling || file.no_memory_sampling.unwrap_or(false));
    let kernel = PathBuf::from("/proc/pressure/memory");
    given.or_else(|| (sampled && kernel.exists()).then_some(kernel))
}

/// A2: what admission keeps back of memory, CPU and disk, where given.
fn reserves(c: &mut berth_core::Config, a: &ServeArgs, file: &FileConfig) -> anyhow::Result<()> {
    let mem = size("memory_reserve", file.memory_reserve.clone())?;
    if let Some(v) = a.memory_reserve.or(mem) {
        c.memory_reserve = v;
    }
    let idle = size("memory_reserve_idle", file.memory_reserve_idle.clone())?;
    if let Some(v) = a.memory_reserve_idle.or(idle) {
        c.memory_reserve_idle = Some(v);
    }
    let cpu = cpu_key("cpu_reserve", file.cpu_reserve.clone())?;
    if let Some(v) = a.cpu_reserve.or(cpu) {
        c.cpu_reserve_millis = v;
    }
    let disk = size("disk_reserve", file.disk_reserve.clone())?;
    if let Some(v) = a.disk_reserve.or(disk) {
        c.disk_reserve = v;
    }
    Ok(())
}

/// Named resources (`--resource`, `[resources]`) and what a run that names nothing
/// asks for.
fn named_and_defaults(
    c: &mut berth_core::Config,
    a: &ServeArgs,
    file: &FileConfig,
) -> anyhow::Result<()> {
    let mut named: BTreeMap<String, u64> = file.resources.clone().unwrap_or_default();
    for r in &a.resources {
        let (name, count) = r
            .split_once('=')
            .ok_or_else(|| anyhow!("--resource {r:?}: expected NAME=COUNT"))?;
        let count: u64 = count
            .parse()
            .map_err(|_| anyhow!("--resource {r:?}: COUNT must be a whole number"))?;
        named.insert(name.to_string(), count);
    }
    c.named = named.into_iter().collect();
    c.default_request.cpu_millis = match (a.default_cpus, file.default_cpus) {
        (Some(m), _) => m,
        (None, Some(v)) => {
            cpus_to_millis(v).map_err(|e| anyhow!("berth.toml default_cpus: {e}"))?
        }
        (None, None) => DEFAULT_RUN_CPU_MILLIS,
    };
    if let Some(v) = a
        .default_memory
        .or(size("default_memory", file.default_memory.clone())?)
    {
        c.default_request.memory = v;
    }
    if let Some(v) = a.retain_ended.or(file.retain_ended) {
        c.ended_retained_max = v;
    }
    if let Some(v) = a
        .scope_idle
        .or(duration("scope_idle", file.scope_idle.clone())?)
    {
        c.scope_idle_ms = v;
    }
    Ok(())
}

/// A size as berth.toml writes it: the largest binary unit that divides it exactly.
fn show_size(bytes: u64) -> String {
    for (unit, shift) in [("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)] {
        if bytes != 0 && bytes.is_multiple_of(1u64 << shift) {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    format!("{bytes}B")
}

/// A duration as berth.toml writes it: the largest unit that divides it exactly.
fn show_ms(ms: u64) -> String {
    for (unit, per) in [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1_000),
    ] {
        if ms != 0 && ms.is_multiple_of(per) {
            return format!("{}{unit}", ms / per);
        }
    }
    format!("{ms}ms")
}

/// `--print-config`: every berth.toml key with the value in force, in the file's own
/// syntax (issue 34: `contrib/berth.toml` is tested against this to show the real
/// defaults).
fn config_toml(c: &berth_server::ServeConfig) -> String {
    let e = &c.engine;
    let q = |s: String| format!("{s:?}");
    let mut lines = vec![
        format!("listen = {}", q(c.listen.to_string())),
        format!("slots_max = {}", e.slots_max),
        format!("memory_total = {}", q(show_size(e.memory_total))),
        format!("cpu_total = {}", q(format!("{}m", e.cpu_total_millis))),
        format!("disk_total = {}", q(show_size(e.disk_total))),
        format!("memory_reserve = {}", q(show_size(e.memory_reserve))),
        format!("cpu_reserve = {}", q(format!("{}m", e.cpu_reserve_millis))),
        format!("disk_reserve = {}", q(show_size(e.disk_reserve))),
        format!(
            "default_cpus = {}",
            e.default_request.cpu_millis as f64 / 1000.0
        ),
        format!(
            "default_memory = {}",
            q(show_size(e.default_request.memory))
        ),
        format!("window = {}", e.window),
        format!("starvation_guard = {}", q(show_ms(e.starvation_guard_ms))),
        format!("reconnect_window = {}", q(show_ms(c.reconnect_window_ms))),
        format!("stop_grace = {}", q(show_ms(c.stop_grace_ms))),
        format!("insecure_no_auth = {}", c.insecure_no_auth),
        format!("no_memory_sampling = {}", !c.sample_memory),
        format!("no_cgroups = {}", !c.cgroups),
        format!(
            "diagnostics_run_bytes = {}",
            q(show_size(c.diagnostics_run_bytes_max))
        ),
        format!(
            "diagnostics_total_bytes = {}",
            q(show_size(c.diagnostics_total_bytes_max))
        ),
        format!("retain_ended = {}", e.ended_retained_max),
        format!("retain_ended_for = {}", q(show_ms(c.retain_ended_for_ms))),
        format!("token_streams_max = {}", c.token_streams_max),
        format!("token_waits_max = {}", c.token_waits_max),
        format!("scope_idle = {}", q(show_ms(e.scope_idle_ms))),
        format!(
            "thread_idle_after = {}",
            q(show_ms(c.threads.idle_after_ms))
        ),
        format!("thread_ttl = {}", q(show_ms(c.threads.ttl_ms))),
        format!("thread_grace = {}", q(show_ms(c.threads.grace_ms))),
        format!(
            "thread_disk_free_min = {}",
            q(show_size(c.threads.disk_free_min))
        ),
        format!(
            "port_range = {}",
            q(format!("{}-{}", c.port_range.0, c.port_range.1))
        ),
    ];
    lines.extend(pressure_keys(c));
    lines.extend(limit_keys(c));
    if let Some(d) = &c.user_workspaces {
        lines.push(format!("user_workspaces = {}", q(d.display().to_string())));
    }
    lines.push("[resources]".into());
    for (name, n) in &e.named {
        if name != berth_server::PORTS_RESOURCE {
            lines.push(format!("{name} = {n}"));
        }
    }
    lines.join("\n") + "\n"
}

/// Issue 36: how runs' cgroups are held to their claims, and the idle host's reserve.
fn limit_keys(c: &berth_server::ServeConfig) -> Vec<String> {
    let (p, e) = (&c.limits, &c.engine);
    let swap = p.swap_max_bytes.map_or("unlimited".to_string(), show_size);
    let idle = show_size(e.memory_reserve_idle.unwrap_or(e.memory_reserve));
    vec![
        format!("memory_reserve_idle = {idle:?}"),
        format!("memory_max_percent = {}", p.memory_max_pct),
        format!("swap_max = {swap:?}"),
        format!(
            "cpu_burst = {}",
            p.cpu == berth_proc::limits::CpuMode::Weight
        ),
        format!("pids_max = {}", p.pids_max),
        format!("freeze_background = {}", p.freeze_background),
    ]
}

/// Issue 36: the memory pressure limits, and where pressure is read if it is.
fn pressure_keys(c: &berth_server::ServeConfig) -> Vec<String> {
    let (e, q) = (&c.engine, |s: String| format!("{s:?}"));
    let mut keys = vec![
        format!(
            "memory_pressure_max = {}",
            q(fmt_bp(e.pressure_foreground_max_bp))
        ),
        format!(
            "memory_pressure_background_max = {}",
            q(fmt_bp(e.pressure_background_max_bp))
        ),
    ];
    keys.push(format!(
        "cpu_pressure_max = {}",
        q(fmt_bp(e.pressure_cpu_max_bp))
    ));
    keys.push(format!(
        "io_pressure_max = {}",
        q(fmt_bp(e.pressure_io_max_bp))
    ));
    for (key, p) in [
        ("pressure_source", &c.pressure_source),
        ("cpu_pressure_source", &c.cpu_pressure_source),
        ("io_pressure_source", &c.io_pressure_source),
    ] {
        if let Some(p) = p {
            keys.push(format!("{key} = {}", q(p.display().to_string())));
        }
    }
    keys
}

/// Colour in the daemon's log only on a terminal, and never with `NO_COLOR` set to
/// anything but the empty string (no-color.org): a log redirected to a file kept ANSI
/// escapes (issue 33 item 7).
fn log_colour(stderr_is_terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    stderr_is_terminal && no_color.is_none_or(|v| v.is_empty())
}

pub fn main(a: ServeArgs) -> anyhow::Result<u8> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BERTH_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(log_colour(
            std::io::IsTerminal::is_terminal(&std::io::stderr()),
            std::env::var_os("NO_COLOR").as_deref(),
        ))
        .init();
    let print = a.print_config;
    let cfg = build_config(a)?;
    if print {
        print!("{}", config_toml(&cfg));
        return Ok(0);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(berth_server::SERVE_WORKERS)
        .enable_all()
        .build()?;
    let served = rt.block_on(async move {
        let running = berth_server::start(cfg.clone()).await?;
        // One parseable line for scripts and tests, then the human one.
        println!("listening on http://{}", running.addr);
        eprintln!(
            "berth serving on http://{} (state {}; {})",
            running.addr,
            cfg.state_dir.display(),
            if cfg.insecure_no_auth {
                "no auth".to_string()
            } else {
                format!(
                    "admin token in {}",
                    cfg.state_dir.join("admin.token").display()
                )
            }
        );
        running.wait().await
    });
    // Threads stuck on a hung file system (a worktree's) never finish: the stop does
    // not wait for them past a moment (issue 32 concern: SIGTERM was ignored).
    rt.shutdown_timeout(std::time::Duration::from_secs(1));
    served?;
    Ok(0)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_log_is_coloured_only_on_a_terminal_without_no_color() {
        use std::ffi::OsStr;
        assert!(super::log_colour(true, None));
        assert!(super::log_colour(true, Some(OsStr::new(""))));
        assert!(!super::log_colour(true, Some(OsStr::new("1"))));
        assert!(!super::log_colour(false, None));
    }
}
