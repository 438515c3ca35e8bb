//! The floors of `berth-bench peers` (issue 37): what berth's own HTTP stack (axum over
//! hyper, HTTP/1.1 keep-alive, the same client) costs when the server does no work at
//! all, so the same run shows how far any server built on it could go on this machine.
//!
//! - **floor-http**: answers `POST /v1/runs` with a fence from a counter and
//!   `POST /v1/runs/{id}/release` with `{}`. No token, no state, no disk, no fsync.
//! - **floor-http-ws**: the same, plus the least that W1 asks of a run with a
//!   workspace: a ready-made directory renamed to the run's name at the grant and
//!   renamed back at the release (berth does exactly these two renames, one on the
//!   request's thread and one on its pool thread).
//!
//! - **floor-fleet** (`berth-bench fleet`, issue 38): floor-http-ws on each of the
//!   fleet's hosts, plus the least fleet mode asks of the store: each acquire's claim
//!   taken in PostgreSQL before it is answered and each release's ending sent after,
//!   both group-committed by one thread per host through berth's own
//!   `FleetStore::batch` (one round trip per batch, as berth's claim worker).
//!
//! - **floor-fleet-ledger** (`berth-bench fleet`): floor-fleet, plus the least a
//!   durable host must write: each run's record put in berth's own ledger (its SQLite
//!   file in WAL mode with `synchronous=FULL`, its group-committing `Writer`) at the
//!   grant and at the release with the journal's entries of each step (D5), each
//!   answered only once durable, and the ending sent to the store after its local
//!   commit (F1). No engine, no tokens, no watchers, no retention.
//!
//! Both run on a runtime with a worker per core, so neither is held to berth's one
//! worker: each is an upper bound for a server on this stack, never a model of berth.
//! A durable server does strictly more (a ledger write and an fsync per commit).
//! (floor-fleet's hosts run on berth's own runtime, one per host, as `fleet` runs
//! berth's.)

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::{Path as UrlPath, State};
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use berth_core::RunState;
use berth_store::fleet::{ClaimOutcome, FleetOp, OpOutcome};

/// Ready-made directories of floor-http-ws, as berth's pool keeps `POOL_TARGET`.
const POOL_DIRS: usize = 64;
/// The subdirectories berth makes in each workspace (W1).
const SUBDIRS: [&str; 5] = ["tmp", "logs", "cache", "browser", "out"];

/// The floor server's state: a fence counter and, for floor-http-ws, its directories;
/// for floor-fleet, its link to the fleet store.
struct Floor {
    fence: AtomicU64,
    dirs: Option<Dirs>,
    fleet: Option<FleetLink>,
    ledger: Option<Ledger>,
}

/// floor-fleet-ledger's ledger, and its journal's next entry: numbered and submitted
/// under one lock, so entries reach the writer in the order of their numbers (D5's
/// journal is gap-free and in order, as berth's one state task makes it).
struct Ledger {
    writer: Mutex<(u64, berth_store::Writer)>,
}

/// floor-fleet-ledger's one write: the run's record and the two journal entries of the
/// step (D5: `queued` and `granted` at the grant, `released` and `ended` at the
/// release, as berth journals a lifecycle), answered once durable.
async fn durable(ledger: &Ledger, run_id: &str, fence: u64, state: RunState) -> Result<(), String> {
    let kinds = match state {
        RunState::Granted => ["queued", "granted"],
        _ => ["released", "ended"],
    };
    let (to, done) = tokio::sync::oneshot::channel();
    let mut batch = berth_store::Batch::runs(fence, vec![floor_record(run_id, fence, state)]);
    {
        let mut w = ledger.writer.lock().unwrap();
        for kind in kinds {
            let seq = w.0;
            w.0 += 1;
            // As long as berth's entries: its time, kind, run, project and the step's data.
            let line = format!(
                r#"{{"seq":{seq},"at":"2026-12-07T00:00:00.000Z","kind":"{kind}","run_id":"{run_id}","project":"bench","data":{{"fence":{fence},"expires_at":"2026-12-07T00:05:00.000Z","keys":[]}}}}"#
            );
            batch.push(berth_store::Mutation::Journal(Arc::new(
                berth_store::JournalEntry {
                    seq,
                    kind: kind.into(),
                    run_id: Some(run_id.into()),
                    project: Some("bench".into()),
                    line,
                },
            )));
        }
        w.1.submit(Some(batch), move |r| {
            let _ = to.send(r.map_err(|e| e.to_string()));
        });
    }
    done.await.map_err(|_| "the ledger is gone".to_string())?
}

/// As little as a run's record can hold: the bench's request (no keys, no contract,
/// no labels) and its grant or its end.
fn floor_record(run_id: &str, fence: u64, state: RunState) -> berth_store::RunRecord {
    let mut r = berth_store::conformance::sample_run(run_id, fence, state);
    r.request.project = "bench".into();
    r.request.singletons.clear();
    r.request.contract = None;
    r.request.resources.named.clear();
    (r.fence, r.worktree, r.stop_grace_ms) = (Some(fence), None, None);
    r.labels.clear();
    r.processes.clear();
    r.ports.clear();
    r
}

/// A claim or an ending for the link's thread, and where a claim's answer goes (its
/// fence if taken).
type LinkOp = (FleetOp, Option<tokio::sync::oneshot::Sender<Option<u64>>>);

/// floor-fleet's host: registered in the fleet store, its ops carried by one thread.
struct FleetLink {
    host_id: String,
    gen: i64,
    ops: std::sync::mpsc::Sender<LinkOp>,
}

impl FleetLink {
    /// Registers `host_id` in the store at `url` and starts its thread, which takes
    /// whatever ops wait (up to `BATCH_OPS_MAX`) as one batch while a round trip is in
    /// flight.
    fn start(url: &str, host_id: &str) -> Result<FleetLink, String> {
        use berth_store::fleet::FleetStore;
        let mut store = berth_store::fleet::PgFleet::open(url).map_err(|e| e.to_string())?;
        let host = berth_store::fleet::HostInfo {
            host_id: host_id.into(),
            address: String::new(),
            version: "floor".into(),
        };
        let (gen, _) = store.register(&host).map_err(|e| e.to_string())?;
        let (tx, rx) = std::sync::mpsc::channel::<LinkOp>();
        let id = host_id.to_owned();
        std::thread::Builder::new()
            .name("floor-fleet".into())
            .spawn(move || {
                while let Ok(first) = rx.recv() {
                    let mut ops = vec![first];
                    ops.extend(rx.try_iter().take(berth_store::fleet::BATCH_OPS_MAX - 1));
                    let (ops, answers_to): (Vec<_>, Vec<_>) = ops.into_iter().unzip();
                    let answers = store.batch(&id, &ops).unwrap_or_else(|e| {
                        eprintln!("floor-fleet {id}: a batch of {} failed: {e}", ops.len());
                        Vec::new()
                    });
                    for (i, to) in answers_to.into_iter().enumerate() {
                        let fence = match answers.get(i) {
                            Some(Ok(OpOutcome::Claim(ClaimOutcome::Taken { fence }))) => {
                                Some(*fence)
                            }
                            _ => None,
                        };
                        if let Some(to) = to {
                            let _ = to.send(fence);
                        }
                    }
                }
            })
            .map_err(|e| e.to_string())?;
        Ok(FleetLink {
            host_id: host_id.into(),
            gen,
            ops: tx,
        })
    }

    /// The run's claim, taken: its fence, or why not.
    async fn claim(&self, run_id: &str) -> Result<u64, String> {
        let claim = berth_store::fleet::Claim {
            run_id: run_id.into(),
            host_id: self.host_id.clone(),
            gen: self.gen,
            token: None,
            keys: Vec::new(),
        };
        let (to, answer) = tokio::sync::oneshot::channel();
        self.ops
            .send((FleetOp::Claim(claim), Some(to)))
            .map_err(|_| "the link's thread is gone")?;
        match answer.await {
            Ok(Some(fence)) => Ok(fence),
            _ => Err(format!("{run_id}: claim not taken")),
        }
    }

    /// The run's ending, sent (the release does not wait for it, as berth's).
    fn end(&self, run_id: &str) {
        let end = FleetOp::End {
            run_id: run_id.into(),
            gen: self.gen,
            how: berth_store::fleet::Ending::Released,
        };
        let _ = self.ops.send((end, None));
    }
}

struct Dirs {
    runs: PathBuf,
    pool: PathBuf,
    /// Ready-made directories in `pool`, by name.
    free: Mutex<Vec<String>>,
    /// Granted runs' workspace names: the run's name in `runs` and its name in `pool`.
    held: Mutex<HashMap<String, (String, String)>>,
}

impl Dirs {
    fn make(base: &Path) -> std::io::Result<Dirs> {
        let (runs, pool) = (base.join("runs"), base.join("runs/.pool"));
        std::fs::create_dir_all(&pool)?;
        let mut free = Vec::with_capacity(POOL_DIRS);
        for i in 0..POOL_DIRS {
            let name = format!("w{i}");
            for sub in SUBDIRS {
                std::fs::create_dir_all(pool.join(&name).join(sub))?;
            }
            free.push(name);
        }
        Ok(Dirs {
            runs,
            pool,
            free: Mutex::new(free),
            held: Mutex::new(HashMap::new()),
        })
    }

    /// The grant's rename: a ready-made directory to the run's name (a digest-long
    /// name, as berth's), never over anything already there.
    fn grant(&self, run_id: &str) -> Result<(), String> {
        let from = self
            .free
            .lock()
            .unwrap()
            .pop()
            .ok_or("no ready directory")?;
        let to = digest_name(run_id);
        rustix::fs::renameat_with(
            rustix::fs::CWD,
            self.pool.join(&from),
            rustix::fs::CWD,
            self.runs.join(&to),
            rustix::fs::RenameFlags::NOREPLACE,
        )
        .map_err(|e| format!("rename: {e}"))?;
        self.held.lock().unwrap().insert(run_id.into(), (to, from));
        Ok(())
    }

    /// The release's rename: back to the ready-made ones.
    fn release(&self, run_id: &str) -> Result<(), String> {
        let (at, name) = self.held.lock().unwrap().remove(run_id).ok_or("not held")?;
        std::fs::rename(self.runs.join(at), self.pool.join(&name))
            .map_err(|e| format!("rename: {e}"))?;
        self.free.lock().unwrap().push(name);
        Ok(())
    }
}

/// 32 hex digits, as long as berth's workspace names.
fn digest_name(run_id: &str) -> String {
    use std::hash::{BuildHasher, BuildHasherDefault};
    let h = BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default();
    format!(
        "{:016x}{:016x}",
        h.hash_one(run_id),
        h.hash_one((run_id, 1u8))
    )
}

async fn acquire(State(f): State<Arc<Floor>>, body: Bytes) -> impl IntoResponse {
    let id = crate::peers::field_str(&String::from_utf8_lossy(&body), "\"run_id\":")
        .unwrap_or("")
        .to_string();
    let fence = match &f.fleet {
        Some(link) => match link.claim(&id).await {
            Ok(fence) => fence,
            Err(e) => return (StatusCode::SERVICE_UNAVAILABLE, e),
        },
        None => f.fence.fetch_add(1, Ordering::Relaxed) + 1,
    };
    let granted = match &f.ledger {
        Some(ledger) => durable(ledger, &id, fence, RunState::Granted).await,
        None => Ok(()),
    };
    let granted = granted.and_then(|()| f.dirs.as_ref().map_or(Ok(()), |d| d.grant(&id)));
    if let Err(e) = granted {
        if let Some(link) = &f.fleet {
            link.end(&id);
        }
        return (StatusCode::INTERNAL_SERVER_ERROR, e);
    }
    let answer = format!(r#"{{"run_id":"{id}","fence":{fence}}}"#);
    (StatusCode::CREATED, answer)
}

async fn release(
    State(f): State<Arc<Floor>>,
    UrlPath(id): UrlPath<String>,
    body: Bytes,
) -> impl IntoResponse {
    if let Some(d) = &f.dirs {
        if let Err(e) = d.release(&id) {
            return (StatusCode::INTERNAL_SERVER_ERROR, e);
        }
    }
    if let Some(ledger) = &f.ledger {
        let body = String::from_utf8_lossy(&body);
        let fence = crate::http::field_u64(&body, "\"fence\":").unwrap_or(0);
        if let Err(e) = durable(ledger, &id, fence, RunState::Released).await {
            return (StatusCode::INTERNAL_SERVER_ERROR, e);
        }
    }
    if let Some(link) = &f.fleet {
        link.end(&id);
    }
    (StatusCode::OK, "{}".to_string())
}

fn router(floor: Arc<Floor>) -> Router {
    Router::new()
        .route("/v1/runs", post(acquire))
        .route("/v1/runs/{id}/release", post(release))
        .layer(axum::middleware::map_response(
            |mut r: axum::response::Response| async {
                let json = header::HeaderValue::from_static("application/json");
                r.headers_mut().insert(header::CONTENT_TYPE, json);
                r
            },
        ))
        .with_state(floor)
}

async fn serve(listener: tokio::net::TcpListener, app: Router) {
    use axum::serve::ListenerExt;
    // No Nagle delay on the answers, as berth's listener.
    let listener = listener.tap_io(|s| {
        let _ = s.set_nodelay(true);
    });
    axum::serve(listener, app).await.expect("serve");
}

/// A floor-fleet host (issue 38): serves on `rt` (a port of its own, returned) with its
/// directories under `base` and its link to the fleet store at `url`, until `rt` is
/// dropped; with `ledger`, a floor-fleet-ledger host, its ledger in `base` too.
pub fn fleet_host(
    rt: &tokio::runtime::Runtime,
    url: &str,
    host_id: &str,
    base: &Path,
    ledger: bool,
) -> Result<std::net::SocketAddr, String> {
    let ledger = if ledger {
        let store =
            berth_store::SqliteStore::open(&base.join("ledger.db")).map_err(|e| e.to_string())?;
        let writer = berth_store::Writer::spawn(Box::new(store), true);
        Some(Ledger {
            writer: Mutex::new((1, writer)),
        })
    } else {
        None
    };
    let floor = Arc::new(Floor {
        fence: AtomicU64::new(0),
        dirs: Some(Dirs::make(base).map_err(|e| e.to_string())?),
        fleet: Some(FleetLink::start(url, host_id)?),
        ledger,
    });
    let listener = rt
        .block_on(tokio::net::TcpListener::bind(("127.0.0.1", 0)))
        .map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    rt.spawn(serve(listener, router(floor)));
    Ok(addr)
}

/// `berth-bench floor-daemon`: serves on `port` until killed; with `workspaces`, makes
/// its directories there first. Says `listening` on stdout once it accepts.
pub fn daemon(port: u16, workspaces: Option<&Path>) {
    let dirs = workspaces.map(|w| Dirs::make(w).expect("the floor's directories"));
    let floor = Arc::new(Floor {
        fence: AtomicU64::new(0),
        dirs,
        fleet: None,
        ledger: None,
    });
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cores)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .expect("bind");
        println!("listening on 127.0.0.1:{port}");
        serve(listener, router(floor)).await;
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_granted_directory_is_at_the_runs_name_until_its_release() {
        let base = tempfile::tempdir().unwrap();
        let d = Dirs::make(base.path()).unwrap();
        d.grant("c1-1").unwrap();
        let at = d.runs.join(digest_name("c1-1"));
        assert!(at.join("tmp").is_dir(), "{at:?} has no tmp");
        assert_eq!(d.free.lock().unwrap().len(), POOL_DIRS - 1);
        d.release("c1-1").unwrap();
        assert!(!at.exists(), "{at:?} is still there");
        assert_eq!(d.free.lock().unwrap().len(), POOL_DIRS);
        assert!(
            d.release("c1-1").is_err(),
            "a second release found a directory"
        );
    }

    #[test]
    fn the_ledger_floor_writes_a_lifecycles_record_and_journal_durably() {
        use berth_store::Store;
        let base = tempfile::tempdir().unwrap();
        let path = base.path().join("ledger.db");
        let store = berth_store::SqliteStore::open(&path).unwrap();
        let ledger = Ledger {
            writer: Mutex::new((1, berth_store::Writer::spawn(Box::new(store), true))),
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async {
            durable(&ledger, "c1-1", 7, RunState::Granted)
                .await
                .unwrap();
            durable(&ledger, "c1-1", 7, RunState::Released)
                .await
                .unwrap();
        });
        ledger.writer.into_inner().unwrap().1.close();
        let mut store = berth_store::SqliteStore::open(&path).unwrap();
        let kinds: Vec<_> = (store.journal(0, 10).unwrap().into_iter())
            .map(|e| (e.seq, e.kind))
            .collect();
        let want = ["queued", "granted", "released", "ended"];
        let want: Vec<_> = (1..).zip(want.map(String::from)).collect();
        assert_eq!(kinds, want);
        let ledger = store.load(10).unwrap();
        let run = ledger.runs.iter().find(|r| r.request.run_id == "c1-1");
        let run = run.expect("the run's record");
        assert_eq!((run.state, run.fence), (RunState::Released, Some(7)));
    }
}
