//! berth's API v1 for Rust: the wire types ([`wire`]) and an async [`Client`].
//!
//! ```no_run
//! # async fn demo() -> Result<(), berth_client::Error> {
//! use berth_client::{wire::AcquireRequest, Client};
//! let berth = Client::new("http://127.0.0.1:7878", std::env::var("BERTH_TOKEN").ok())?;
//! let lease = berth
//!     .acquire(&AcquireRequest { project: "shop".into(), ..Default::default() })
//!     .await?;
//! let fence = lease.fence.expect("a granted run has a fence");
//! berth.release(&lease.run_id, fence).await?;
//! # Ok(()) }
//! ```
//!
//! One connection per call (HTTP/1.1 on loopback costs a few tens of microseconds); the
//! daemon answers each call once its effect is durable (D1).

pub mod schema;
pub mod wire;

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request};
use serde::de::DeserializeOwned;
use serde::Serialize;
use wire::*;

/// How long a call may take, connection included, unless the call waits by design
/// (an acquire waits up to its `wait_s` plus this).
pub const CALL_TIMEOUT_MS: u64 = 30_000;
/// The largest answer read (a list of 1,000 runs is about 1.5 MB).
pub const ANSWER_BYTES_MAX: usize = 16 << 20;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The URL is not `http://host:port`.
    #[error("berth url {0:?}: {1}")]
    Url(String, &'static str),
    /// berth could not be reached, or the connection broke.
    #[error("berth at {addr}: {what}")]
    Unreachable { addr: String, what: String },
    /// berth said no: its status, stable code and message (the rule it applied).
    #[error("{status} {}: {}", .error.code, .error.message)]
    Refused { status: u16, error: ErrorDetail },
    /// The answer was not what API v1 says it is.
    #[error("berth answered {status} with a body that is not API v1: {what}")]
    Answer { status: u16, what: String },
}

impl Error {
    /// The refusal's stable code (`stale_fence`, `gone`, …), if berth refused.
    pub fn code(&self) -> Option<&str> {
        match self {
            Error::Refused { error, .. } => Some(&error.code),
            _ => None,
        }
    }
}

/// A handle on one berth daemon.
#[derive(Clone, Debug)]
pub struct Client {
    /// `host:port`.
    addr: String,
    token: Option<String>,
}

impl Client {
    /// `url` is `http://host:port` (the `BERTH_URL` a run gets); `token` is a bearer
    /// token (none with `--insecure-no-auth`).
    pub fn new(url: &str, token: Option<String>) -> Result<Client, Error> {
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| Error::Url(url.into(), "must start with http://"))?;
        let addr = rest.trim_end_matches('/');
        if addr.is_empty() || addr.contains('/') {
            return Err(Error::Url(url.into(), "must be http://host:port"));
        }
        Ok(Client {
            addr: addr.to_string(),
            token,
        })
    }

    /// `POST /v1/runs`: waits up to the request's `wait_s` for a grant.
    pub async fn acquire(&self, req: &AcquireRequest) -> Result<Run, Error> {
        let wait = Duration::from_secs(req.wait_s.unwrap_or(0));
        self.call(Method::POST, "/v1/runs", Some(req), wait).await
    }

    /// `GET /v1/runs/{id}`.
    pub async fn get(&self, run_id: &str) -> Result<Run, Error> {
        let path = format!("/v1/runs/{run_id}");
        self.call(Method::GET, &path, None::<&()>, Duration::ZERO)
            .await
    }

    /// `GET /v1/runs`: live runs (and ended ones still retained with `all`).
    pub async fn list(&self, all: bool) -> Result<RunList, Error> {
        let path = format!("/v1/runs?all={all}");
        self.call(Method::GET, &path, None::<&()>, Duration::ZERO)
            .await
    }

    /// `POST /v1/runs/{id}/renew`.
    pub async fn renew(&self, run_id: &str, req: &RenewRequest) -> Result<Run, Error> {
        let path = format!("/v1/runs/{run_id}/renew");
        self.call(Method::POST, &path, Some(req), Duration::ZERO)
            .await
    }

    /// `POST /v1/runs/{id}/release`: the answer comes once the run's processes are
    /// stopped and its workspace is gone, or it is degraded.
    pub async fn release(&self, run_id: &str, fence: u64) -> Result<Run, Error> {
        let path = format!("/v1/runs/{run_id}/release");
        let body = ReleaseRequest { fence };
        self.call(Method::POST, &path, Some(&body), Duration::ZERO)
            .await
    }

    /// `POST /v1/runs/{id}/processes` (P1).
    pub async fn register_process(&self, run_id: &str, fence: u64, pid: i32) -> Result<Run, Error> {
        let path = format!("/v1/runs/{run_id}/processes");
        let body = ProcessRequest { fence, pid };
        self.call(Method::POST, &path, Some(&body), Duration::ZERO)
            .await
    }

    /// `POST /v1/runs/{id}/runtime` (C7): starts the run's runtime (each port's build,
    /// command and ready probe) and answers once every port is ready, or with the
    /// failing port's last lines (`Error::Refused`, code `runtime_failed`). Waits up
    /// to `within` beyond the usual call timeout (builds and probes take their time).
    pub async fn start_runtime(
        &self,
        run_id: &str,
        fence: u64,
        within: Duration,
    ) -> Result<RuntimeStarted, Error> {
        let path = format!("/v1/runs/{run_id}/runtime");
        let body = RuntimeRequest { fence };
        self.call(Method::POST, &path, Some(&body), within).await
    }

    /// `GET /v1/status`.
    pub async fn status(&self) -> Result<Status, Error> {
        self.call(Method::GET, "/v1/status", None::<&()>, Duration::ZERO)
            .await
    }

    /// `GET /v1/fences/check`: is `fence` still the lease of `run_id`?
    pub async fn fence_check(&self, run_id: &str, fence: u64) -> Result<FenceCheck, Error> {
        let path = format!("/v1/fences/check?run_id={run_id}&fence={fence}");
        self.call(Method::GET, &path, None::<&()>, Duration::ZERO)
            .await
    }

    async fn call<B: Serialize, T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
        waits: Duration,
    ) -> Result<T, Error> {
        let limit = waits + Duration::from_millis(CALL_TIMEOUT_MS);
        let (status, bytes) = tokio::time::timeout(limit, self.exchange(method, path, body))
            .await
            .map_err(|_| self.unreachable(format!("no answer within {limit:?}")))??;
        let bad = |what: String| Error::Answer { status, what };
        if (200..300).contains(&status) {
            return serde_json::from_slice(&bytes).map_err(|e| bad(e.to_string()));
        }
        match serde_json::from_slice::<ErrorBody>(&bytes) {
            Ok(b) => Err(Error::Refused {
                status,
                error: b.error,
            }),
            Err(e) => Err(bad(e.to_string())),
        }
    }

    fn unreachable(&self, what: impl std::fmt::Display) -> Error {
        Error::Unreachable {
            addr: self.addr.clone(),
            what: what.to_string(),
        }
    }

    /// One request on a fresh connection: its status and whole body.
    async fn exchange<B: Serialize>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
    ) -> Result<(u16, Bytes), Error> {
        let stream = tokio::net::TcpStream::connect(&self.addr)
            .await
            .map_err(|e| self.unreachable(e))?;
        let io = hyper_util::rt::TokioIo::new(stream);
        let (mut send, conn) = hyper::client::conn::http1::handshake(io)
            .await
            .map_err(|e| self.unreachable(e))?;
        tokio::spawn(conn);
        let payload = match body {
            Some(b) => serde_json::to_vec(b).map_err(|e| Error::Answer {
                status: 0,
                what: format!("request: {e}"),
            })?,
            None => Vec::new(),
        };
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header("host", &self.addr)
            .header("content-type", "application/json");
        if let Some(t) = &self.token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        let req = req
            .body(Full::new(Bytes::from(payload)))
            .map_err(|e| self.unreachable(e))?;
        let res = send
            .send_request(req)
            .await
            .map_err(|e| self.unreachable(e))?;
        let status = res.status().as_u16();
        let limited = http_body_util::Limited::new(res.into_body(), ANSWER_BYTES_MAX);
        let bytes = limited
            .collect()
            .await
            .map_err(|e| self.unreachable(format!("reading the answer: {e}")))?
            .to_bytes();
        Ok((status, bytes))
    }
}
