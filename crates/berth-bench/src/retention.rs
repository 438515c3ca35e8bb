//! `berth-bench retention --runs N`: what a long-lived daemon's history costs at
//! restart. A daemon runs once (so its state dir is real), stops, and its ledger is
//! given N ended runs, as months of work without retention would leave it. Then a
//! daemon starts on it in its own process and we time from spawn to its first answer,
//! and compare its resident memory with an empty daemon's measured the same way. Last,
//! we wait for retention to prune the history and time a restart once more.
//!
//! Targets (issue 10): serving within 1 s, RSS less than 64 MiB above the empty one's.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use berth_core::RunState;
use berth_store::{Batch, SqliteStore, Store};

/// Historic runs written per transaction while the ledger is built.
const BUILD_BATCH: u64 = 20_000;
const RESTART_MS_TARGET: f64 = 1_000.0;
const RSS_ABOVE_EMPTY_MIB_TARGET: f64 = 64.0;

/// The measured daemon: `berth serve`'s own start, on loopback without auth, with the
/// benchmark's generous capacity; prints its address, then serves until killed.
pub fn daemon(state_dir: &Path) {
    let mut cfg = crate::http::config(state_dir, true);
    cfg.insecure_no_auth = true;
    serve(cfg);
}

/// Serves `cfg` as `berth serve` does: prints its address, then serves until killed.
pub(crate) fn serve(cfg: berth_server::ServeConfig) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let running = berth_server::start(cfg).await.expect("daemon");
        println!("listening on http://{}", running.addr);
        let _ = running.wait().await;
    });
}

struct Started {
    child: Child,
    url: String,
    serving_ms: f64,
}

/// Starts this binary's hidden `subcommand STATE_DIR` (a daemon in its own process)
/// and returns it with the address it printed.
pub(crate) fn spawn_daemon(subcommand: &str, state_dir: &Path) -> (Child, String) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .arg(subcommand)
        .arg(state_dir)
        .env("BERTH_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("daemon said {line:?}"))
        .to_string();
    (child, url)
}

/// Spawns the daemon on `state_dir` and waits for its first `200` from `/v1/status`.
fn start(state_dir: &Path) -> Started {
    let t0 = Instant::now();
    let (child, url) = spawn_daemon("retention-daemon", state_dir);
    while status(&url).is_none() {
        std::thread::sleep(Duration::from_millis(1));
    }
    Started {
        child,
        url,
        serving_ms: t0.elapsed().as_secs_f64() * 1e3,
    }
}

fn status(url: &str) -> Option<berth_client::wire::Status> {
    let r = ureq::get(format!("{url}/v1/status")).call().ok()?;
    r.into_body().read_json().ok()
}

/// The resident memory of process `pid`, in bytes.
pub(crate) fn rss_bytes(pid: u32) -> f64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: f64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kib * 1024.0
}

fn rss_mib(pid: u32) -> f64 {
    rss_bytes(pid) / 1048576.0
}

/// RSS once the daemon has settled (its ledger thread and pool started).
fn settled_rss_mib(d: &Started) -> f64 {
    std::thread::sleep(Duration::from_millis(500));
    rss_mib(d.child.id())
}

fn stop(mut d: Started) {
    let _ = d.child.kill();
    let _ = d.child.wait();
}

/// Gives the (stopped) daemon's ledger `n` ended runs after what it holds.
fn add_history(state_dir: &Path, n: u64) {
    let mut store = SqliteStore::open(&state_dir.join("ledger.db")).unwrap();
    let ledger = store.load(0).unwrap();
    let first = ledger.next_queue_seq;
    let mut fence = ledger.last_fence;
    let mut i = 0;
    while i < n {
        let runs = (i..(i + BUILD_BATCH).min(n))
            .map(|k| {
                let seq = first + k;
                let mut r = berth_store::conformance::sample_run(
                    &format!("hist-{k:09}"),
                    seq,
                    RunState::Released,
                );
                fence = fence.max(seq + 100);
                r.fence = Some(seq + 100);
                r.workspace = None;
                r.processes.truncate(1);
                r
            })
            .collect();
        store.write(&[&Batch::runs(fence, runs)]).unwrap();
        i += BUILD_BATCH;
    }
}

pub fn main(runs: u64) {
    let dir = tempfile::tempdir().unwrap();
    let (empty_dir, hist_dir) = (dir.path().join("empty"), dir.path().join("hist"));
    // Both state dirs are made by a daemon; the empty one is measured as it is.
    let empty = start(&empty_dir);
    let rss_empty = settled_rss_mib(&empty);
    let empty_ms = empty.serving_ms;
    stop(empty);
    stop(start(&hist_dir));
    let t = Instant::now();
    add_history(&hist_dir, runs);
    let build_s = t.elapsed().as_secs_f64();
    let ledger_mib =
        std::fs::metadata(hist_dir.join("ledger.db")).unwrap().len() as f64 / 1048576.0;
    rustix::fs::sync();

    let hist = start(&hist_dir);
    let rss_hist = settled_rss_mib(&hist);
    let restart_ms = hist.serving_ms;
    let above = rss_hist - rss_empty;
    println!(
        "{{\"bench\":\"retention\",\"historic_runs\":{runs},\"ledger_mib\":{ledger_mib:.1},\"build_s\":{build_s:.1},\"empty_serving_ms\":{empty_ms:.0},\"restart_to_serving_ms\":{restart_ms:.0},\"rss_empty_mib\":{rss_empty:.1},\"rss_historic_mib\":{rss_hist:.1},\"rss_above_empty_mib\":{above:.1},\"restart_target_ms\":{RESTART_MS_TARGET},\"rss_above_empty_target_mib\":{RSS_ABOVE_EMPTY_MIB_TARGET},\"met\":{}}}",
        restart_ms <= RESTART_MS_TARGET && above < RSS_ABOVE_EMPTY_MIB_TARGET
    );

    // Retention drains the history in the background while the daemon serves.
    let kept = crate::http::config(&hist_dir, true)
        .engine
        .ended_retained_max as u64;
    let to_prune = runs.saturating_sub(kept);
    let t = Instant::now();
    let mut latency_max_ms = 0f64;
    loop {
        let q = Instant::now();
        let s = status(&hist.url).expect("status");
        latency_max_ms = latency_max_ms.max(q.elapsed().as_secs_f64() * 1e3);
        if s.ledger.ended_runs_pruned >= to_prune {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(600),
            "retention stalled: {s:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let prune_s = t.elapsed().as_secs_f64();
    let rss_after = rss_mib(hist.child.id());
    stop(hist);
    let again = start(&hist_dir);
    let rss_again = settled_rss_mib(&again);
    println!(
        "{{\"bench\":\"retention\",\"pruned\":{to_prune},\"prune_s\":{prune_s:.1},\"rows_per_s\":{:.0},\"status_latency_max_ms_while_pruning\":{latency_max_ms:.1},\"rss_after_pruning_mib\":{rss_after:.1},\"restart_after_pruning_ms\":{:.0},\"rss_after_restart_mib\":{rss_again:.1}}}",
        to_prune as f64 / prune_s,
        again.serving_ms
    );
    stop(again);
}
