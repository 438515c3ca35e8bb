//! berth-server: `berth serve`. The daemon's state machine ([`daemon`]) owns the engine
//! and the ledger writer on a thread of its own; HTTP handlers ([`api`]) send it
//! messages; its runtime feeds it the clock and memory samples. See ARCHITECTURE.md.

pub mod api;
pub mod auth;
pub mod clock;
pub mod contract;
pub mod daemon;
pub mod error;
pub mod failpoint;
pub mod fleet;
pub mod host;
pub mod http;
pub mod journal;
pub mod limits;
pub mod listen;
pub mod memory;
pub mod metrics;
pub mod private;
pub mod register;
pub mod request;
pub mod runtime;
pub mod tell;
pub mod walk;
pub mod workspace;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use anyhow::{bail, Context};
use berth_store::{SqliteStore, Store, Writer};
use tokio::sync::mpsc;

/// Everything `berth serve` needs, already merged from flags, environment and file.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    pub state_dir: PathBuf,
    pub listen: SocketAddr,
    pub insecure_no_auth: bool,
    pub engine: berth_core::Config,
    pub sample_memory: bool,
    /// Issue 36: where memory pressure is read (PSI's format: `some avg10=…`), once a
    /// second; `None`: not read (admission then ignores pressure).
    pub pressure_source: Option<std::path::PathBuf>,
    /// Issue 36: the same for cpu and io pressure (read only where a limit is set).
    pub cpu_pressure_source: Option<std::path::PathBuf>,
    pub io_pressure_source: Option<std::path::PathBuf>,
    /// How long a waiter restored after a restart keeps its place unclaimed (P5).
    pub reconnect_window_ms: u64,
    /// Group commit on (false only for the benchmark's baseline).
    pub group_commit: bool,
    pub tick_ms: u64,
    /// Between SIGTERM and SIGKILL when a run is stopped (P2).
    pub stop_grace_ms: u64,
    /// Use a cgroup v2 group per run where the host allows it.
    pub cgroups: bool,
    /// Issue 36: how runs' cgroups are held to their claims (where the host has the
    /// memory and pids controllers for berth).
    pub limits: berth_proc::limits::Policy,
    /// Diagnostics kept per run and in all (P4).
    pub diagnostics_run_bytes_max: u64,
    pub diagnostics_total_bytes_max: u64,
    /// Start on a missing or empty ledger although the state dir has been used (S6).
    pub init_ledger: bool,
    /// Fences reserved per write of the fence marker (L1, S6).
    pub fence_reserve_block: u64,
    /// S9: where the workspaces of other users' runs go, theirs (`None`: in the state
    /// dir, berth's, as any run's; berth must be root to give them away).
    pub user_workspaces: Option<std::path::PathBuf>,
    /// Ended runs older than this are deleted from the ledger (and the newest
    /// `engine.ended_retained_max` are all that is kept in any case).
    pub retain_ended_for_ms: u64,
    /// The ports runs' `[[port]]` entries are given from (W3), inclusive.
    pub port_range: (u16, u16),
    /// Agent threads' idle time, ttl and registration grace (G0, G1).
    pub threads: berth_core::threads::ThreadConfig,
    /// Fleet mode (F1): the fleet store and this host's place in it.
    pub fleet: Option<fleet::FleetConfig>,
    /// S10: event streams one token may hold open at once.
    pub token_streams_max: usize,
    /// S10: long polls (waiting acquires, `GET /v1/runs/{id}?wait_s`) one token may
    /// hold open at once.
    pub token_waits_max: usize,
}

/// Where runs' ports come from unless configured: a thousand ports below Linux's
/// ephemeral range (`ip_local_port_range`, 32768-60999 by default), from which the
/// kernel picks the local port of every outgoing connection: a port there is in use
/// whenever a connection happens to hold it (the bind test then skips it), and a
/// run's server could not count on it.
pub const PORT_RANGE_DEFAULT: (u16, u16) = (30_000, 30_999);
/// The named resource that counts ports: a run's `[[port]]` entries claim it, so a run
/// waits for ports like for any other resource (A1), with reason `capacity.ports`.
pub const PORTS_RESOURCE: &str = "ports";

/// Counts the port range as the engine's `ports` resource. A `ports` resource of the
/// operator's own is refused: berth counts it from the range.
fn count_ports(cfg: &mut ServeConfig) -> anyhow::Result<()> {
    let (lo, hi) = cfg.port_range;
    if lo == 0 || lo > hi {
        bail!("port range {lo}-{hi}: must be LOW-HIGH with 0 < LOW <= HIGH");
    }
    if cfg.engine.named.iter().any(|(n, _)| n == PORTS_RESOURCE) {
        bail!("resource {PORTS_RESOURCE:?} is berth's own (the port range counts it); name yours differently");
    }
    cfg.engine
        .named
        .push((PORTS_RESOURCE.to_string(), (hi - lo) as u64 + 1));
    if let Some((elo, ehi)) = host::ephemeral_ports() {
        if lo <= ehi && elo <= hi {
            tracing::warn!("port range {lo}-{hi} overlaps the kernel's ephemeral ports {elo}-{ehi} (net.ipv4.ip_local_port_range): outgoing connections take ports from it, and runs get fewer; choose a range outside it");
        }
    }
    Ok(())
}

/// How long ended runs stay in the ledger by default: a week of history to look back
/// on, then gone, so the ledger does not grow forever.
pub const RETAIN_ENDED_FOR_MS_DEFAULT: u64 = 7 * 86_400_000;

/// Why the daemon must stop (D4): set once, by whoever finds it first.
#[derive(Default)]
pub struct Fatal {
    notify: tokio::sync::Notify,
    reason: std::sync::Mutex<Option<String>>,
}

impl Fatal {
    pub fn raise(&self, why: String) {
        tracing::error!("fatal: {why}");
        let mut r = self.reason.lock().unwrap_or_else(|e| e.into_inner());
        r.get_or_insert(why);
        self.notify.notify_one();
    }

    pub fn reason(&self) -> Option<String> {
        self.reason
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// Messages in flight to the daemon at most; handlers wait beyond it.
pub const INBOX_MAX: usize = 16_384;

/// The runtime workers `berth serve` runs its connections and the daemon's task on:
/// one, so neither a request nor its answer waits for another thread to wake (issue
/// 37: one client +7–23% lifecycles/s; 64 clients within the machine's drift; the
/// figures are in ARCHITECTURE.md). The disk has its own thread (the ledger's), and so
/// do the stopper and the workspace pool.
pub const SERVE_WORKERS: usize = 1;

/// A running daemon: its address and a way to stop it.
pub struct Running {
    pub addr: SocketAddr,
    pub admin_token: Option<String>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
    commits: Arc<dyn Fn() -> u64 + Send + Sync>,
}

impl Running {
    /// Ledger transactions committed so far.
    pub fn commits(&self) -> u64 {
        (self.commits)()
    }

    pub async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        self.task.await?
    }

    /// Waits until the daemon stops by itself (signal or fatal ledger error).
    pub async fn wait(self) -> anyhow::Result<()> {
        let _keep = self.shutdown;
        self.task.await?
    }
}

fn is_loopback(addr: &SocketAddr) -> bool {
    addr.ip().is_loopback()
}

/// Has this state dir been used by a berth before (S6)?
fn used(
    state_dir: &std::path::Path,
    runs_dir: &std::path::Path,
    marker: &private::FenceMarker,
) -> bool {
    marker.exists()
        || state_dir.join("admin.token").exists()
        || std::fs::read_dir(runs_dir).is_ok_and(|mut rd| {
            rd.any(|e| e.is_ok_and(|e| !e.file_name().to_string_lossy().starts_with('.')))
        })
}

/// What `start` refuses before it touches anything: a non-loopback listener without
/// auth, and an engine configuration that does not hold.
fn check_config(cfg: &mut ServeConfig) -> anyhow::Result<()> {
    count_ports(cfg)?;
    if cfg.insecure_no_auth && !is_loopback(&cfg.listen) {
        bail!(
            "--insecure-no-auth is only allowed with a loopback listen address, not {}",
            cfg.listen
        );
    }
    if let Some(f) = &cfg.fleet {
        fleet::self_fence_ms(f.lapse_ms, f.beat_ms, cfg.stop_grace_ms)
            .map_err(|e| anyhow::anyhow!("configuration: {e}"))?;
    }
    cfg.engine
        .validate()
        .map_err(|e| anyhow::anyhow!("configuration: {e}"))
}

/// The one door to the machine (`daemon::host`), with the users' workspaces directory
/// checked when runs of other users get theirs there.
fn real_host(
    cfg: &ServeConfig,
    runs_dir: &std::path::Path,
    marker: private::FenceMarker,
    supervision: daemon::Supervision,
) -> anyhow::Result<daemon::RealHost> {
    let mut host = daemon::RealHost::new(runs_dir, diagnostics(cfg), marker, supervision)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    if let Some(dir) = &cfg.user_workspaces {
        users_dir(dir, &mut host)?;
    }
    Ok(host)
}

/// Starts the daemon on the current tokio runtime and returns once it is serving.
pub async fn start(mut cfg: ServeConfig) -> anyhow::Result<Running> {
    check_config(&mut cfg)?;
    // S5: everything berth creates from here on is private to its user (ledger,
    // tokens, diagnostics, workspaces).
    rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o077));
    private::state_dir(&cfg.state_dir)?;
    let lock = private::lock(&cfg.state_dir)?;
    let runs_dir = workspace::ensure_runs_dir(&cfg.state_dir)?;
    let opened = open_ledger(&cfg, &runs_dir)?;
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("binding {}", cfg.listen))?;
    let addr = listener.local_addr()?;
    let (supervision, enforcement) = supervision(&cfg);
    let shared = Arc::new(daemon::Shared {
        tokens: RwLock::new(opened.tokens),
        url: format!("http://{addr}"),
        limits: limits::Limits::new(cfg.token_streams_max, cfg.token_waits_max),
        me: Some(register::Me::now()),
        enforcement,
        ..Default::default()
    });
    let writer = spawn_writer(&cfg, opened.store, &shared);
    let fatal = Arc::new(Fatal::default());
    let host = real_host(&cfg, &runs_dir, opened.marker, supervision)?;
    if let Some(f) = cfg.fleet.as_mut() {
        f.fence_floor = opened.ledger.last_fence;
    }
    let how = daemon::Restore {
        cfg: cfg.engine.clone(),
        same_boot: opened.same_boot,
        reconnect_window_ms: cfg.reconnect_window_ms,
        port_range: cfg.port_range,
        threads: cfg.threads,
    };
    let mut st = daemon::Daemon::restore(
        clock::mono_ms(),
        how,
        opened.ledger,
        &writer,
        shared.clone(),
        fatal.clone(),
        host,
    )
    .map_err(|e| anyhow::anyhow!("ledger {}: {e}", cfg.state_dir.join("ledger.db").display()))?;
    let commits_cell = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let shell = daemon::Shell::new(writer, shared.clone(), fatal.clone());
    shell.carry_out(st.restored_effects());
    let (api, state_done) = spawn_state(&cfg, (st, shell), shared, commits_cell.clone())?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(serve_until_stopped(
        listener,
        api::router(api),
        lock,
        fatal,
        stop_rx,
        state_done,
    ));
    let counter = commits_cell.clone();
    Ok(Running {
        addr,
        admin_token: opened.admin,
        shutdown: Some(stop_tx),
        task,
        commits: Arc::new(move || counter.load(std::sync::atomic::Ordering::Relaxed)),
    })
}

/// The ledger's writer. Retention: ended runs past the count the engine remembers, or
/// older than the configured age, are pruned in the background (and the journal with
/// them); each commit is timed for `/metrics`, and once it is answered the journal's
/// live readers are woken for all the entries it published.
fn spawn_writer(cfg: &ServeConfig, store: SqliteStore, shared: &Arc<daemon::Shared>) -> Writer {
    let observed = shared.clone();
    Writer::spawn_observed(
        Box::new(store),
        cfg.group_commit,
        Some(berth_store::Retention {
            ended_max: cfg.engine.ended_retained_max,
            ended_age_ms: cfg.retain_ended_for_ms,
            journal_hold: Some(shared.journal.hold_floor()),
        }),
        Some(Arc::new(move |took, batches| {
            observed.metrics.committed(took, batches);
            observed.journal.wake();
        })),
    )
}

/// Starts the daemon (the one owner of the engine and the writer) as a task on the
/// caller's runtime and returns the API's handle to it, and what resolves once it has
/// ended.
///
/// On the same thread as the connections (`berth serve` runs one worker,
/// `SERVE_WORKERS`), not a thread of its own (issue 37): a request then crosses no
/// thread boundary on its way to the daemon and one (the ledger's answer) on its way
/// back, where a thread of its own cost two more wake-ups per request. The daemon's
/// blocking work is short (a workspace rename, cgroup files); the long kind (a
/// registration's `/proc` reads) is done off it (`register_off_task`).
fn spawn_state(
    cfg: &ServeConfig,
    (mut st, shell): (daemon::Daemon<daemon::RealHost>, daemon::Shell),
    shared: Arc<daemon::Shared>,
    commits: Arc<std::sync::atomic::AtomicU64>,
) -> anyhow::Result<(api::Api, tokio::sync::oneshot::Receiver<()>)> {
    let (tx, rx) = mpsc::channel(INBOX_MAX);
    st.host_mut().set_inbox(&tx);
    let fleet = match &cfg.fleet {
        Some(f) => {
            let observed = shared.clone();
            let link = fleet::spawn(
                f.clone(),
                tell::Tell::to(tx.downgrade(), daemon::Msg::Fleet),
                Arc::new(move |ops| observed.metrics.fleet_batched(ops)),
            )
            .map_err(|e| anyhow::anyhow!("fleet store: {e}"))?;
            // F2: stop runs holding fleet-wide claims before the lapse at which another
            // host may take them (checked by `check_config`).
            let fence_ms = fleet::self_fence_ms(f.lapse_ms, f.beat_ms, cfg.stop_grace_ms)
                .map_err(|e| anyhow::anyhow!(e))?;
            st.set_fleet(link.clone(), fence_ms, f.recheck_ms, f.beat_ms);
            Some(link)
        }
        None => None,
    };
    let api = api::Api {
        fleet,
        tx,
        shared,
        auth: !cfg.insecure_no_auth,
        cfg: Arc::new(cfg.engine.clone()),
        uid: rustix::process::geteuid().as_raw(),
        starting: Arc::default(),
    };
    let tick_ms = cfg.tick_ms;
    let sample = daemon::Sampler {
        memory: cfg.sample_memory,
        pressure: cfg.pressure_source.clone(),
        cpu_pressure: cfg.cpu_pressure_source.clone(),
        io_pressure: cfg.io_pressure_source.clone(),
        disk: cfg.sample_memory.then(|| cfg.state_dir.join("runs")),
    };
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let probe = CommitProbe(commits);
        daemon::run(st, shell, rx, tick_ms, sample, Some(probe)).await;
        let _ = done_tx.send(());
    });
    Ok((api, done_rx))
}

/// What `open_ledger` hands the rest of the start.
struct Opened {
    store: SqliteStore,
    ledger: berth_store::Ledger,
    same_boot: bool,
    marker: private::FenceMarker,
    tokens: Tokens,
    admin: Option<String>,
}

/// Opens the ledger (refusing a vanished one in a used state dir, S6, and an
/// unreadable one, D4), moves the fence marker ahead (L1), records this boot and makes
/// sure the admin token is known.
fn open_ledger(cfg: &ServeConfig, runs_dir: &std::path::Path) -> anyhow::Result<Opened> {
    let ledger_path = cfg.state_dir.join("ledger.db");
    let mut marker = private::FenceMarker::open(&cfg.state_dir)?;
    marker.block = cfg.fence_reserve_block;
    // S6: a ledger that vanished from a used state dir would restart fences and forget
    // every run; refused unless the operator says to start afresh.
    let ledger_empty = std::fs::symlink_metadata(&ledger_path).map_or(true, |m| m.len() == 0);
    if ledger_empty && !cfg.init_ledger && used(&cfg.state_dir, runs_dir, &marker) {
        bail!(
            "{} is missing or empty, but this state directory has been used (admin token, fence marker or workspaces present): refusing to start from nothing (S6). Restore the ledger, or start with --init-ledger to begin a new one (fences still continue above the marker)",
            ledger_path.display()
        );
    }
    // D4: an unreadable ledger stops the daemon with a clear error.
    let mut store = SqliteStore::open_exclusive(&ledger_path)?;
    for suffix in ["", "-wal", "-shm"] {
        // Ledgers made by older berths were 0644; it holds token hashes.
        let p = cfg.state_dir.join(format!("ledger.db{suffix}"));
        use std::os::unix::fs::PermissionsExt;
        if let Ok(m) = std::fs::symlink_metadata(&p) {
            if m.is_file() && m.permissions().mode() & 0o077 != 0 {
                std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600))?;
            }
        }
    }
    let mut ledger = store.load(cfg.engine.ended_retained_max)?;
    // S6: every start writes the marker before anything is granted or a token made, so
    // a used state dir without one lost it: with an older ledger restored beside it,
    // fences would start again below ones already given out (8 -> 4). Refused unless
    // the operator says to start afresh.
    if !marker.exists()
        && !cfg.init_ledger
        && (ledger.last_fence > 0 || used(&cfg.state_dir, runs_dir, &marker))
    {
        bail!(
            "{}/fence.floor is missing, but this state directory has been used (fences, admin token or workspaces present): refusing to start, since fences could go back (S6). Restore the marker, or start with --init-ledger to continue from the ledger's own counter ({})",
            cfg.state_dir.display(),
            ledger.last_fence
        );
    }
    continue_fences(cfg, &mut marker, &mut ledger)?;
    let boot = clock::boot_id();
    let same_boot = ledger.boot_id.as_deref().is_none_or(|b| b == boot);
    store.set_boot_id(&boot)?;
    let (tokens, admin) = known_tokens(cfg, &mut store, &ledger)?;
    Ok(Opened {
        store,
        ledger,
        same_boot,
        marker,
        tokens,
        admin,
    })
}

/// L1/S6: where fences continue after a start, and the marker moved ahead of them.
fn continue_fences(
    cfg: &ServeConfig,
    marker: &mut private::FenceMarker,
    ledger: &mut berth_store::Ledger,
) -> anyhow::Result<()> {
    // L1/S6: fences continue above the marker even if the ledger is older than it.
    // Not in fleet mode (issue 38 item 1): there every fence comes from the fleet's one
    // sequence, which is above every fence ever given (this host's too, since the
    // fleet thread raises it to the ledger's at registration), so the marker's block
    // reserved ahead would put this host's counter above every fleet fence: after a
    // kill -9 every permit was stale, re-fenced in a loop, and nothing was granted.
    if marker.reserved > ledger.last_fence && cfg.fleet.is_none() {
        // After a crash this is expected (the marker reserves ahead); after an older
        // ledger was restored it is what keeps fences from repeating.
        tracing::info!(
            "fences continue above the fence marker {} (the ledger's counter is {}: berth crashed, or the ledger is older than the marker)",
            marker.reserved,
            ledger.last_fence
        );
        ledger.last_fence = marker.reserved;
    }
    // Never lowered (in fleet mode the marker may be above the ledger's counter).
    marker.write((ledger.last_fence.saturating_add(marker.block)).max(marker.reserved))?;
    Ok(())
}

/// Token hashes and what each grants.
type Tokens = Vec<(String, auth::Grant)>;

/// The ledger's tokens, with the admin token's hash added (durably) if it is new.
fn known_tokens(
    cfg: &ServeConfig,
    store: &mut SqliteStore,
    ledger: &berth_store::Ledger,
) -> anyhow::Result<(Tokens, Option<String>)> {
    let mut tokens: Tokens = ledger
        .tokens
        .iter()
        .filter_map(|(h, s)| Some((h.clone(), auth::Grant::parse(s)?)))
        .collect();
    if cfg.insecure_no_auth {
        return Ok((tokens, None));
    }
    let token = private::admin_token(&cfg.state_dir)?;
    let hash = auth::hash_token(&token);
    if !tokens.iter().any(|(h, _)| *h == hash) {
        let grant = auth::Grant {
            scope: auth::Scope::Admin,
            uid: None,
            expires_ms: None,
            fleet: false,
        };
        store.write(&[&berth_store::Batch {
            mutations: vec![berth_store::Mutation::Token {
                hash: hash.clone(),
                scope: grant.stored(),
            }],
        }])?;
        tokens.push((hash, grant));
    }
    Ok((tokens, Some(token)))
}

/// S9: the directory other users' workspaces go under, checked (or made) and handed
/// to the host; an ancestor they cannot traverse is said at start.
fn users_dir(dir: &std::path::Path, host: &mut daemon::RealHost) -> anyhow::Result<()> {
    let closed = workspace::ensure_users_dir(dir).map_err(|e| anyhow::anyhow!("{e}"))?;
    for p in closed {
        tracing::warn!(
            "other users cannot reach their workspaces under {}: {} is not traversable by them (chmod o+x it, or set --user-workspaces elsewhere)",
            dir.display(),
            p.display()
        );
    }
    host.set_users_dir(dir.to_path_buf());
    Ok(())
}

/// How runs' processes are grouped, stopped and held to their claims, and whether
/// they are (said once here, at start, and in `GET /v1/status`).
fn supervision(cfg: &ServeConfig) -> (daemon::Supervision, daemon::Enforcement) {
    // One namespace per state dir: a restarted daemon finds its runs' groups again
    // (P5), another daemon never touches them.
    let state = cfg
        .state_dir
        .canonicalize()
        .unwrap_or_else(|_| cfg.state_dir.clone());
    let instance = workspace::dir_name(&state.display().to_string());
    let cgroup_base = cfg
        .cgroups
        .then(|| berth_proc::cgroup::base(&instance))
        .flatten();
    let controllers = match &cgroup_base {
        None if !cfg.cgroups => Err("cgroups are off (--no-cgroups)".to_string()),
        None => Err("there is no writable cgroup2 tree for run groups".to_string()),
        Some(base) => berth_proc::cgroup::Controllers::find(base, &instance),
    };
    let mut enforcement = daemon::Enforcement {
        policy: cfg.limits,
        ..Default::default()
    };
    match &controllers {
        Ok(c) => {
            let names: Vec<&str> = c.bases.iter().map(|(k, _)| k.name()).collect();
            let flavor = match c.flavor {
                berth_proc::limits::Flavor::V2 => "cgroup2",
                berth_proc::limits::Flavor::V1 => "cgroup v1",
            };
            let how = format!("{flavor} {}", names.join(", "));
            tracing::info!("runs are held to their claims by {how}");
            enforcement.how = Some(how);
        }
        Err(why) => {
            tracing::warn!("limits are not enforced: {why}; runs are admitted by their claims but not held to them");
            enforcement.why_not = Some(why.clone());
        }
    }
    let supervision = daemon::Supervision {
        cgroup_base,
        controllers: controllers.ok(),
        policy: cfg.limits,
        grace_ms: cfg.stop_grace_ms,
        kill_wait_ms: 5_000,
    };
    (supervision, enforcement)
}

fn diagnostics(cfg: &ServeConfig) -> workspace::Diagnostics {
    workspace::Diagnostics {
        dir: cfg.state_dir.join("diagnostics"),
        run_bytes_max: cfg.diagnostics_run_bytes_max,
        total_bytes_max: cfg.diagnostics_total_bytes_max,
        run_entries_max: workspace::DIAGNOSTICS_RUN_ENTRIES_MAX,
        total_entries_max: workspace::DIAGNOSTICS_TOTAL_ENTRIES_MAX,
    }
}

/// Serves until asked to stop, a signal or a fatal error; then lets the daemon
/// drain (every acknowledged change durable) and says why it stopped.
async fn serve_until_stopped(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    lock: private::Lock,
    fatal: Arc<Fatal>,
    stop_rx: tokio::sync::oneshot::Receiver<()>,
    state_done: tokio::sync::oneshot::Receiver<()>,
) -> anyhow::Result<()> {
    let _lock = lock;
    let fatal_wait = fatal.clone();
    let shutdown = async move {
        tokio::select! {
            _ = stop_rx => {}
            _ = fatal_wait.notify.notified() => {}
            _ = signal() => {}
        }
    };
    http::serve(listener, app, http::connection_budget(), shutdown).await;
    // The router (and every sender) is gone: the daemon drains and closes
    // the writer, which makes everything acknowledged durable.
    // Dropped without a word: the daemon's task panicked (its message is in the log).
    if state_done.await.is_err() {
        bail!("stopped: the daemon ended unexpectedly");
    }
    // D4: a fatal error is an error exit, with its reason (so a supervisor's
    // restart-on-failure restarts it and the log says why).
    match fatal.reason() {
        Some(why) => bail!("stopped: {why}"),
        None => Ok(()),
    }
}

/// Publishes the writer's commit count for benchmarks and tests.
pub struct CommitProbe(pub Arc<std::sync::atomic::AtomicU64>);

async fn signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A daemon's cgroup namespace is named by its state dir and goes away with a clean
    /// stop when no run group is left in it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_cgroup_namespace_goes_with_a_clean_stop() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().canonicalize().unwrap();
        let name = workspace::dir_name(&state.display().to_string());
        let Some(base) =
            berth_proc::testing::cgroup_base("the_cgroup_namespace_goes_with_a_clean_stop", &name)
        else {
            return;
        };
        let cfg = ServeConfig {
            state_dir: state.clone(),
            listen: "127.0.0.1:0".parse().unwrap(),
            insecure_no_auth: false,
            engine: berth_core::Config::for_host(4, 8 << 30, 100 << 30),
            sample_memory: false,
            pressure_source: None,
            cpu_pressure_source: None,
            io_pressure_source: None,
            reconnect_window_ms: 30_000,
            group_commit: true,
            tick_ms: 100,
            stop_grace_ms: 1_000,
            cgroups: true,
            limits: Default::default(),
            diagnostics_run_bytes_max: 1 << 20,
            diagnostics_total_bytes_max: 1 << 30,
            init_ledger: false,
            fence_reserve_block: private::FENCE_RESERVE_BLOCK,
            user_workspaces: None,
            retain_ended_for_ms: RETAIN_ENDED_FOR_MS_DEFAULT,
            token_streams_max: crate::limits::TOKEN_STREAMS_MAX_DEFAULT,
            token_waits_max: crate::limits::TOKEN_WAITS_MAX_DEFAULT,
            port_range: PORT_RANGE_DEFAULT,
            threads: Default::default(),
            fleet: None,
        };
        let running = start(cfg).await.unwrap();
        assert!(base.is_dir(), "{} while serving", base.display());
        running.stop().await.unwrap();
        assert!(!base.exists(), "{} left behind", base.display());
    }
}
