//! The HTTP listener (S8): at most `connections_max` connections at once, a deadline
//! for every request head (which is also the idle limit of a kept-alive connection),
//! bounded request heads, and descriptor headroom kept for supervision.
//!
//! Why not `axum::serve`: it accepts without limit and sets no timer, so ~1,000 idle
//! connections (no token needed) took every descriptor the daemon had, and then
//! `/proc`, pidfd and cgroup reads failed while runs were being stopped.
//!
//! A cap alone would let the same idle connections lock token holders out. So at the
//! cap the oldest connection that has not yet presented a valid token is closed to
//! make room (it has nothing in flight that berth owes an answer to); connections of
//! token holders (long polls, streams) are never closed for room.
//!
//! And token holders' streams and long polls alone could still take every connection
//! (issue 32 finding 2: 300 of them at 512 descriptors and a `berth run` lost its
//! lease). So a reserve of connections (`reserve_of`) is kept for upkeep only: when
//! the rest are taken, a new connection gets a reserved place, serves one request, and
//! that request must renew, release or register into a run (`is_upkeep`); anything
//! else there is `503 busy`. A lease holder can always renew.

pub mod park;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// Connections served at once at most; beyond it new ones wait in the kernel's accept
/// queue (they cost the daemon no descriptor there).
/// Sized for a deep queue of attached waiters (10,000 long polls or streams, issue 18)
/// with room to spare; the descriptor limit (`connection_budget`) is the other bound.
pub const CONNECTIONS_MAX: usize = 16_384;
/// Descriptors never given to connections: the ledger, the pool's and the stopper's
/// directory and pidfd and `/proc` reads, cgroup files, logs. A stop needs a handful at
/// a time; 256 leaves room for many at once.
pub const FD_HEADROOM: u64 = 256;
/// The fewest connections served even on a tiny descriptor limit.
const CONNECTIONS_MIN: usize = 8;
/// How long a client may take to send a request head, and how long a kept-alive
/// connection may sit idle between requests. A long poll is not idle: its request was
/// read, and the wait is for the answer.
pub const HEAD_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest request head hyper buffers; above `HEAD_BYTES_MAX` (checked with a JSON
/// answer by `limits`) and up to here the client gets the error envelope, beyond it a
/// bare `431` from hyper and the connection closes.
pub const HEAD_BUF_BYTES_MAX: usize = 64 * 1024;
/// Longest request target and largest request head answered at all (414 and 431).
pub const URI_BYTES_MAX: usize = 8 * 1024;
pub const HEAD_BYTES_MAX: usize = 16 * 1024;
/// After a stop is asked for, how long open requests may finish before they are cut.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// The pause after a failed `accept` (EMFILE, ENFILE, ENOBUFS): never a busy loop.
const ACCEPT_RETRY: Duration = Duration::from_millis(50);

/// One connection as the listener sees it. `authed` is set by the auth middleware
/// when a request on it presents a valid token.
pub struct ConnMark {
    pub authed: AtomicBool,
    /// Accepted into the reserve: one request, and only upkeep (`is_upkeep`).
    pub reserved: bool,
    kick: tokio::sync::Notify,
    /// Set once its handler parked the request in flight (`park`): from then on hyper
    /// sees the socket as closed.
    pub(crate) is_parked: AtomicBool,
    parked: Mutex<Option<crate::http::park::Answer>>,
}

impl ConnMark {
    fn new(reserved: bool) -> ConnMark {
        ConnMark {
            authed: AtomicBool::new(false),
            reserved,
            kick: tokio::sync::Notify::new(),
            is_parked: AtomicBool::new(false),
            parked: Mutex::new(None),
        }
    }

    /// Hands the rest of the request in flight to its connection (see `park.rs`):
    /// `answer` is written to the socket once it resolves, or dropped if the client
    /// leaves or the daemon stops first. The handler then returns
    /// `park::placeholder()`.
    pub fn park(&self, answer: crate::http::park::Answer) {
        *self.parked.lock().unwrap_or_else(|e| e.into_inner()) = Some(answer);
        self.is_parked.store(true, Ordering::Release);
    }

    fn take_parked(&self) -> Option<crate::http::park::Answer> {
        self.parked.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

/// Open connections by id, so oldest first. A connection leaves it in O(log n); only
/// at the cap is it scanned (for the oldest without a token).
type Registry = Arc<Mutex<std::collections::BTreeMap<u64, Arc<ConnMark>>>>;

/// Closes the oldest connection without a valid token; false if there is none.
fn evict_one(reg: &Registry) -> bool {
    let list = reg.lock().unwrap_or_else(|e| e.into_inner());
    match list.values().find(|m| !m.authed.load(Ordering::Relaxed)) {
        Some(m) => {
            m.kick.notify_one();
            true
        }
        None => false,
    }
}

/// The app with the connection's mark put into every request.
#[derive(Clone)]
struct Marked {
    app: Router,
    mark: Arc<ConnMark>,
}

impl tower_service::Service<axum::http::Request<hyper::body::Incoming>> for Marked {
    type Response = axum::response::Response;
    type Error = std::convert::Infallible;
    type Future =
        <Router as tower_service::Service<axum::http::Request<hyper::body::Incoming>>>::Future;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut req: axum::http::Request<hyper::body::Incoming>) -> Self::Future {
        req.extensions_mut().insert(self.mark.clone());
        self.app.call(req)
    }
}

/// Connections kept for upkeep out of `max`: a sixteenth, at least one, at most 256
/// (renewals are short: a few places serve many leases).
pub fn reserve_of(max: usize) -> usize {
    (max / 16).clamp(1, 256).min(max.saturating_sub(1)).max(1)
}

/// What a reserved connection may ask: renew, release or register a process into a
/// run, the calls that keep a lease holder's lease (`POST /v1/runs/{id}/renew`,
/// `…/release`, `…/processes`).
pub fn is_upkeep(method: &axum::http::Method, path: &str) -> bool {
    let Some(rest) = path.strip_prefix("/v1/runs/") else {
        return false;
    };
    let Some((id, what)) = rest.split_once('/') else {
        return false;
    };
    method == axum::http::Method::POST
        && !id.is_empty()
        && matches!(what, "renew" | "release" | "processes")
}

/// The refusal of anything but upkeep on a reserved connection.
pub fn reserved_for_upkeep() -> crate::error::ApiError {
    crate::error::ApiError::new(
        503,
        "busy",
        "every connection berth serves is in use; the ones left are kept for renewing, releasing and registering into runs: try again shortly",
    )
}

/// A place for one connection (held until it closes): from the general pool or the
/// reserve.
struct Place {
    _permit: tokio::sync::OwnedSemaphorePermit,
    reserved: bool,
}

impl Place {
    fn general(p: tokio::sync::OwnedSemaphorePermit) -> Place {
        Place {
            _permit: p,
            reserved: false,
        }
    }

    fn reserved(p: tokio::sync::OwnedSemaphorePermit) -> Place {
        Place {
            _permit: p,
            reserved: true,
        }
    }
}

/// The next place: a general one if free, else a reserved one, else (after closing
/// the oldest connection without a token) whichever frees first; `None` at shutdown.
async fn place(
    general: &Arc<Semaphore>,
    reserve: &Arc<Semaphore>,
    registry: &Registry,
    shutdown: impl std::future::Future<Output = ()>,
) -> Option<Place> {
    if let Ok(p) = general.clone().try_acquire_owned() {
        return Some(Place::general(p));
    }
    if let Ok(p) = reserve.clone().try_acquire_owned() {
        return Some(Place::reserved(p));
    }
    // At the cap: the oldest connection without a valid token makes room.
    evict_one(registry);
    tokio::select! {
        p = general.clone().acquire_owned() => p.ok().map(Place::general),
        p = reserve.clone().acquire_owned() => p.ok().map(Place::reserved),
        _ = shutdown => None,
    }
}

/// Raises the soft descriptor limit to the hard one, and returns how many connections
/// fit below it with `FD_HEADROOM` kept back.
pub fn connection_budget() -> usize {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut lim = getrlimit(Resource::Nofile);
    if lim.current < lim.maximum {
        lim.current = lim.maximum;
        let _ = setrlimit(Resource::Nofile, lim);
        lim = getrlimit(Resource::Nofile);
    }
    let soft = lim.current.unwrap_or(u64::MAX);
    let room = soft.saturating_sub(FD_HEADROOM);
    // A descriptor per connection (the socket); the handler's own files are counted in
    // the headroom.
    (room.min(CONNECTIONS_MAX as u64) as usize).max(CONNECTIONS_MIN)
}

/// Serves `app` on `listener` until `shutdown` resolves, with at most `max_conns`
/// connections at once.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    max_conns: usize,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let reserve = reserve_of(max_conns);
    let general = Arc::new(Semaphore::new(max_conns - reserve));
    let reserved = Arc::new(Semaphore::new(reserve));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut conns = tokio::task::JoinSet::new();
    let registry: Registry = Arc::default();
    let mut next_id = 0u64;
    tokio::pin!(shutdown);
    loop {
        // A place first, then accept: over the limit, connections wait in the
        // kernel's queue instead of taking a descriptor here.
        let Some(permit) = place(&general, &reserved, &registry, &mut shutdown).await else {
            break;
        };
        let (sock, _peer): (_, SocketAddr) = tokio::select! {
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!("accept: {e}");
                    tokio::time::sleep(ACCEPT_RETRY).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
            // A finished connection's task is collected when it ends, not at the next
            // accept: 10,000 long polls that left would otherwise keep their tasks'
            // memory until someone connects.
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
        };
        let _ = sock.set_nodelay(true);
        let mark = Arc::new(ConnMark::new(permit.reserved));
        next_id += 1;
        let id = next_id;
        registry
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, mark.clone());
        let svc = hyper_util::service::TowerToHyperService::new(Marked {
            app: app.clone(),
            mark: mark.clone(),
        });
        conns.spawn(serve_connection(
            sock,
            svc,
            mark,
            permit,
            Unregister(registry.clone(), id),
            stop_rx.clone(),
        ));
    }
    drop(listener);
    let _ = stop_tx.send(true);
    // Open requests get a short grace; long polls that are still waiting are cut
    // (their clients re-post the same run id to a restarted daemon: P5).
    let _ = tokio::time::timeout(SHUTDOWN_GRACE, async {
        while conns.join_next().await.is_some() {}
    })
    .await;
    conns.abort_all();
    while conns.join_next().await.is_some() {}
}

/// One connection: served until it ends, the daemon stops or the connection is
/// evicted (`mark.kick`), then shut down gracefully.
async fn serve_connection(
    sock: tokio::net::TcpStream,
    svc: hyper_util::service::TowerToHyperService<Marked>,
    mark: Arc<ConnMark>,
    permit: Place,
    gone: Unregister,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let _permit = permit;
    // Leaves the registry however the connection ends.
    let _gone = gone;
    let mut b = hyper::server::conn::http1::Builder::new();
    b.timer(TokioTimer::new())
        .header_read_timeout(HEAD_READ_TIMEOUT)
        .max_buf_size(HEAD_BUF_BYTES_MAX)
        // A reserved place serves one request, then is free for the next lease holder.
        .keep_alive(!mark.reserved);
    let io = crate::http::park::ParkIo {
        sock,
        mark: mark.clone(),
        rewritten: None,
    };
    let mut conn = b.serve_connection(TokioIo::new(io), svc);
    let finished = tokio::select! {
        _ = std::future::poll_fn(|cx| conn.poll_without_shutdown(cx)) => true,
        _ = stop.wait_for(|s| *s) => false,
        _ = mark.kick.notified() => false,
    };
    if !finished {
        std::pin::Pin::new(&mut conn).graceful_shutdown();
        let _ = std::future::poll_fn(|cx| conn.poll_without_shutdown(cx)).await;
    }
    // A parked long poll: hyper is done with the socket and its buffers are freed;
    // this task now waits on the socket alone (`park.rs`).
    if let Some(answer) = mark.take_parked() {
        let io = conn.into_parts().io.into_inner();
        crate::http::park::serve_parked(io.sock, answer, stop).await;
    }
}

struct Unregister(Registry, u64);

impl Drop for Unregister {
    fn drop(&mut self) {
        let mut list = self.0.lock().unwrap_or_else(|e| e.into_inner());
        list.remove(&self.1);
    }
}

/// hyper's own answer to a request it could not parse (a head over its buffer, two
/// `Content-Length`s, a malformed line, an unknown version) is a bare status with
/// `content-length: 0`; berth's answers never are (every error carries the envelope,
/// and nothing else berth sends is an empty 4xx or 5xx). This is that answer with the
/// envelope (pure over the bytes hyper writes), or `None` for anything else.
pub fn enveloped(written: &[u8]) -> Option<Vec<u8>> {
    const HEAD_MAX: usize = 512;
    // Cheap refusals first: this looks at every write hyper makes.
    let error_status = written.get(9).is_some_and(|&d| d == b'4' || d == b'5');
    if !error_status
        || written.len() > HEAD_MAX
        || !written.starts_with(b"HTTP/1.1 ")
        || !written.ends_with(b"\r\n\r\n")
    {
        return None;
    }
    let head = std::str::from_utf8(written).ok()?.to_ascii_lowercase();
    let status: u16 = head.get(9..12)?.parse().ok()?;
    if status < 400 || !head.contains("\r\ncontent-length: 0\r\n") || head.contains("content-type")
    {
        return None;
    }
    let (code, message) = match status {
        431 => ("headers_too_large", format!("the request head must be at most {HEAD_BYTES_MAX} bytes")),
        414 => ("uri_too_long", format!("the request target must be at most {URI_BYTES_MAX} bytes")),
        505 => ("http_version_not_supported", "berth speaks HTTP/1.1 (and 1.0)".to_string()),
        400 => ("bad_request", "the request is not valid HTTP/1.1: a malformed head, two Content-Length headers, or a bad chunk".to_string()),
        _ => ("http_error", "the request could not be read as HTTP/1.1".to_string()),
    };
    let body =
        serde_json::json!({"error": {"code": code, "message": message, "details": {}}}).to_string();
    let reason = written
        .split(|&b| b == b'\r')
        .next()
        .and_then(|l| std::str::from_utf8(l.get(13..)?).ok())
        .unwrap_or("Error");
    Some(
        format!(
            "HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
        .into_bytes(),
    )
}

/// `414` and `431` with the error envelope, for heads hyper accepted (it buffers up to
/// `HEAD_BUF_BYTES_MAX`) but berth will not serve.
pub fn limits(req: &axum::extract::Request) -> Result<(), crate::error::ApiError> {
    let uri_len = req.uri().path_and_query().map_or(0, |p| p.as_str().len());
    if uri_len > URI_BYTES_MAX {
        return Err(crate::error::ApiError::new(
            414,
            "uri_too_long",
            format!("the request target must be at most {URI_BYTES_MAX} bytes"),
        ));
    }
    let head: usize = req
        .headers()
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len() + 4)
        .sum();
    if head > HEAD_BYTES_MAX {
        return Err(crate::error::ApiError::new(
            431,
            "headers_too_large",
            format!("the request headers must be at most {HEAD_BYTES_MAX} bytes"),
        ));
    }
    Ok(())
}
