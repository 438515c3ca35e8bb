//! berth-server: `berth serve`. One task owns the engine and the ledger writer
//! ([`state`]); HTTP handlers ([`api`]) send it commands; timers drive expiry and
//! memory sampling. See ARCHITECTURE.md.

pub mod api;
pub mod auth;
pub mod clock;
pub mod contract;
pub mod error;
pub mod failpoint;
pub mod host;
pub mod state;
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
    /// How long a waiter restored after a restart keeps its place unclaimed (P5).
    pub reconnect_window_ms: u64,
    /// Group commit on (false only for the benchmark's baseline).
    pub group_commit: bool,
    pub tick_ms: u64,
    /// Between SIGTERM and SIGKILL when a run is stopped (P2).
    pub stop_grace_ms: u64,
    /// Use a cgroup v2 group per run where the host allows it.
    pub cgroups: bool,
    /// Diagnostics kept per run and in all (P4).
    pub diagnostics_run_bytes_max: u64,
    pub diagnostics_total_bytes_max: u64,
}

/// Messages in flight to the state task at most; handlers wait beyond it.
pub const INBOX_MAX: usize = 16_384;

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

/// Reads or creates the admin token file (0600) and returns the token.
fn admin_token(state_dir: &std::path::Path) -> anyhow::Result<(String, bool)> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = state_dir.join("admin.token");
    match std::fs::read_to_string(&path) {
        Ok(t) if !t.trim().is_empty() => return Ok((t.trim().to_string(), false)),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    }
    let token = auth::new_token()?;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("writing {}", path.display()))?;
    use std::io::Write;
    writeln!(f, "{token}")?;
    f.sync_all()?;
    Ok((token, true))
}

/// Starts the daemon on the current tokio runtime and returns once it is serving.
pub async fn start(cfg: ServeConfig) -> anyhow::Result<Running> {
    if cfg.insecure_no_auth && !is_loopback(&cfg.listen) {
        bail!(
            "--insecure-no-auth is only allowed with a loopback listen address, not {}",
            cfg.listen
        );
    }
    cfg.engine
        .validate()
        .map_err(|e| anyhow::anyhow!("configuration: {e}"))?;
    std::fs::create_dir_all(&cfg.state_dir)
        .with_context(|| format!("creating state directory {}", cfg.state_dir.display()))?;
    let runs_dir = workspace::ensure_runs_dir(&cfg.state_dir)?;
    let ledger_path = cfg.state_dir.join("ledger.db");
    // D4: an unreadable ledger stops the daemon with a clear error.
    let mut store = SqliteStore::open(&ledger_path)?;
    let ledger = store.load(cfg.engine.ended_retained_max)?;
    let boot = clock::boot_id();
    let same_boot = ledger.boot_id.as_deref().is_none_or(|b| b == boot);
    store.set_boot_id(&boot)?;

    let mut tokens: Vec<(String, auth::Scope)> = ledger
        .tokens
        .iter()
        .filter_map(|(h, s)| Some((h.clone(), auth::Scope::parse(s)?)))
        .collect();
    let mut admin = None;
    if !cfg.insecure_no_auth {
        let (token, _) = admin_token(&cfg.state_dir)?;
        let hash = auth::hash_token(&token);
        if !tokens.iter().any(|(h, _)| *h == hash) {
            store.write(&[&berth_store::Batch {
                last_fence: ledger.last_fence,
                runs: vec![],
                tokens: vec![(hash.clone(), "admin".into())],
            }])?;
            tokens.push((hash, auth::Scope::Admin));
        }
        admin = Some(token);
    }

    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("binding {}", cfg.listen))?;
    let addr = listener.local_addr()?;
    let shared = Arc::new(state::Shared {
        tokens: RwLock::new(tokens),
        url: format!("http://{addr}"),
    });
    let writer = Writer::spawn(Box::new(store), cfg.group_commit);
    let fatal = Arc::new(tokio::sync::Notify::new());
    let st = state::State::restore(
        cfg.engine.clone(),
        ledger,
        same_boot,
        writer,
        shared.clone(),
        runs_dir,
        cfg.reconnect_window_ms,
        fatal.clone(),
        state::Supervision {
            // One namespace per state dir: a restarted daemon finds its runs' groups
            // again (P5), another daemon never touches them.
            cgroup_base: if cfg.cgroups {
                let state = cfg
                    .state_dir
                    .canonicalize()
                    .unwrap_or_else(|_| cfg.state_dir.clone());
                berth_proc::cgroup::base(&workspace::dir_name(&state.display().to_string()))
            } else {
                None
            },
            grace_ms: cfg.stop_grace_ms,
            kill_wait_ms: 5_000,
        },
        workspace::Diagnostics {
            dir: cfg.state_dir.join("diagnostics"),
            run_bytes_max: cfg.diagnostics_run_bytes_max,
            total_bytes_max: cfg.diagnostics_total_bytes_max,
        },
    )
    .map_err(|e| anyhow::anyhow!("ledger {}: {e}", ledger_path.display()))?;
    let commits_cell = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (tx, rx) = mpsc::channel(INBOX_MAX);
    let mut st = st;
    st.set_inbox(&tx);
    let api = api::Api {
        tx,
        shared,
        auth: !cfg.insecure_no_auth,
        cfg: Arc::new(cfg.engine.clone()),
    };
    let app = api::router(api);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let state_task = {
        let counter = commits_cell.clone();
        let (tick_ms, sample) = (cfg.tick_ms, cfg.sample_memory);
        tokio::spawn(async move {
            let probe = CommitProbe(counter);
            state::run(st, rx, tick_ms, sample, Some(probe)).await;
        })
    };
    let task = tokio::spawn(async move {
        let fatal_wait = fatal.clone();
        let shutdown = async move {
            tokio::select! {
                _ = stop_rx => {}
                _ = fatal_wait.notified() => {}
                _ = signal() => {}
            }
        };
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
            .context("serving HTTP")?;
        // The router (and every sender) is gone: the state task drains and closes
        // the writer, which makes everything acknowledged durable.
        state_task.await?;
        Ok(())
    });
    let counter = commits_cell.clone();
    Ok(Running {
        addr,
        admin_token: admin,
        shutdown: Some(stop_tx),
        task,
        commits: Arc::new(move || counter.load(std::sync::atomic::Ordering::Relaxed)),
    })
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
        let Some(base) = berth_proc::cgroup::base(&name) else {
            eprintln!("no writable cgroup2 here: nothing to check");
            return;
        };
        let cfg = ServeConfig {
            state_dir: state.clone(),
            listen: "127.0.0.1:0".parse().unwrap(),
            insecure_no_auth: false,
            engine: berth_core::Config::for_host(4, 8 << 30, 100 << 30),
            sample_memory: false,
            reconnect_window_ms: 30_000,
            group_commit: true,
            tick_ms: 100,
            stop_grace_ms: 1_000,
            cgroups: true,
            diagnostics_run_bytes_max: 1 << 20,
            diagnostics_total_bytes_max: 1 << 30,
        };
        let running = start(cfg).await.unwrap();
        assert!(base.is_dir(), "{} while serving", base.display());
        running.stop().await.unwrap();
        assert!(!base.exists(), "{} left behind", base.display());
    }
}
