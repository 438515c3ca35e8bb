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
//! Both run on a runtime with a worker per core, so neither is held to berth's one
//! worker: each is an upper bound for a server on this stack, never a model of berth.
//! A durable server does strictly more (a ledger write and an fsync per commit).

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

/// Ready-made directories of floor-http-ws, as berth's pool keeps `POOL_TARGET`.
const POOL_DIRS: usize = 64;
/// The subdirectories berth makes in each workspace (W1).
const SUBDIRS: [&str; 5] = ["tmp", "logs", "cache", "browser", "out"];

/// The floor server's state: a fence counter and, for floor-http-ws, its directories.
struct Floor {
    fence: AtomicU64,
    dirs: Option<Dirs>,
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
    if let Some(d) = &f.dirs {
        if let Err(e) = d.grant(&id) {
            return (StatusCode::INTERNAL_SERVER_ERROR, e);
        }
    }
    let fence = f.fence.fetch_add(1, Ordering::Relaxed) + 1;
    let answer = format!(r#"{{"run_id":"{id}","fence":{fence}}}"#);
    (StatusCode::CREATED, answer)
}

async fn release(
    State(f): State<Arc<Floor>>,
    UrlPath(id): UrlPath<String>,
    _body: Bytes,
) -> impl IntoResponse {
    if let Some(d) = &f.dirs {
        if let Err(e) = d.release(&id) {
            return (StatusCode::INTERNAL_SERVER_ERROR, e);
        }
    }
    (StatusCode::OK, "{}".to_string())
}

/// `berth-bench floor-daemon`: serves on `port` until killed; with `workspaces`, makes
/// its directories there first. Says `listening` on stdout once it accepts.
pub fn daemon(port: u16, workspaces: Option<&Path>) {
    let dirs = workspaces.map(|w| Dirs::make(w).expect("the floor's directories"));
    let floor = Arc::new(Floor {
        fence: AtomicU64::new(0),
        dirs,
    });
    let app = Router::new()
        .route("/v1/runs", post(acquire))
        .route("/v1/runs/{id}/release", post(release))
        .layer(axum::middleware::map_response(
            |mut r: axum::response::Response| async {
                let json = header::HeaderValue::from_static("application/json");
                r.headers_mut().insert(header::CONTENT_TYPE, json);
                r
            },
        ))
        .with_state(floor);
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
        use axum::serve::ListenerExt;
        // No Nagle delay on the answers, as berth's listener.
        let listener = listener.tap_io(|s| {
            let _ = s.set_nodelay(true);
        });
        axum::serve(listener, app).await.expect("serve");
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
}
