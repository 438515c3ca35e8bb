//! berth's API v1 for Rust: the wire types ([`wire`]) and an async [`Client`] with a
//! method for every operation of the OpenAPI document (each method's doc names its
//! `operationId`; a black-box test calls them all against a real daemon and checks,
//! from the daemon's own request counters, that every operation was reached).
//!
//! ```no_run
//! # async fn demo() -> Result<(), berth_client::Error> {
//! use berth_client::{wire::AcquireRequest, Client};
//! let berth = Client::new("http://127.0.0.1:7420", std::env::var("BERTH_TOKEN").ok())?;
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

mod exchange;
mod ops;
pub mod retry;
pub mod schema;
mod stream;
pub mod time;
pub mod wire;

pub use exchange::Answer;
pub use stream::{AcquireStream, EventStream, EventsQuery};

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

    /// A JSON call: the answer read as `T`, or berth's refusal as [`Error::Refused`].
    async fn call<B: Serialize, T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
        waits: Duration,
    ) -> Result<T, Error> {
        let (status, bytes) = self.whole(method, path, body, JSON, waits).await?;
        serde_json::from_slice(&bytes).map_err(|e| Error::Answer {
            status,
            what: e.to_string(),
        })
    }

    /// A call whose answer is text (metrics, the dashboard, NDJSON): the whole body.
    async fn text(&self, path: &str, accept: &str) -> Result<String, Error> {
        let (status, bytes) = self
            .whole(Method::GET, path, None::<&()>, accept, Duration::ZERO)
            .await?;
        String::from_utf8(bytes.to_vec()).map_err(|e| Error::Answer {
            status,
            what: e.to_string(),
        })
    }

    /// One exchange read whole within the call timeout (plus `waits`): a 2xx status
    /// and its body, or the refusal.
    async fn whole<B: Serialize>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
        accept: &str,
        waits: Duration,
    ) -> Result<(u16, Bytes), Error> {
        let limit = waits + Duration::from_millis(CALL_TIMEOUT_MS);
        let exchange = async {
            let res = self.send(method, path, body, accept).await?;
            let status = res.status().as_u16();
            let limited = http_body_util::Limited::new(res.into_body(), ANSWER_BYTES_MAX);
            let bytes = limited
                .collect()
                .await
                .map_err(|e| self.unreachable(format!("reading the answer: {e}")))?
                .to_bytes();
            Ok::<_, Error>((status, bytes))
        };
        let (status, bytes) = tokio::time::timeout(limit, exchange)
            .await
            .map_err(|_| self.unreachable(format!("no answer within {limit:?}")))??;
        if (200..300).contains(&status) {
            Ok((status, bytes))
        } else {
            Err(refusal(status, &bytes))
        }
    }

    fn unreachable(&self, what: impl std::fmt::Display) -> Error {
        Error::Unreachable {
            addr: self.addr.clone(),
            what: what.to_string(),
        }
    }

    /// One request on a fresh connection: the answer's head, its body still to read
    /// (a stream is read line by line as it comes).
    async fn send<B: Serialize>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
        accept: &str,
    ) -> Result<hyper::Response<hyper::body::Incoming>, Error> {
        self.send_with(method, path, body, accept, &[]).await
    }

    /// [`Client::send`] with extra request headers.
    async fn send_with<B: Serialize>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
        accept: &str,
        headers: &[(&str, String)],
    ) -> Result<hyper::Response<hyper::body::Incoming>, Error> {
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
            .header("accept", accept)
            .header("content-type", JSON);
        if let Some(t) = &self.token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        for (k, v) in headers {
            req = req.header(*k, v);
        }
        let req = req
            .body(Full::new(Bytes::from(payload)))
            .map_err(|e| self.unreachable(e))?;
        send.send_request(req)
            .await
            .map_err(|e| self.unreachable(e))
    }
}

const JSON: &str = "application/json";

/// A non-2xx answer as an error: berth's envelope, or a body that is not API v1.
fn refusal(status: u16, bytes: &[u8]) -> Error {
    match serde_json::from_slice::<ErrorBody>(bytes) {
        Ok(b) => Error::Refused {
            status,
            error: b.error,
        },
        Err(e) => Error::Answer {
            status,
            what: e.to_string(),
        },
    }
}

/// `s` as one path segment or query value: everything but RFC 3986's unreserved
/// characters percent-encoded (an id with `/` or `?` cannot reach another route).
fn seg(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_segment_cannot_leave_its_place_in_the_path() {
        assert_eq!(super::seg("run-1_a.b~"), "run-1_a.b~");
        assert_eq!(super::seg("a/b?c=d&e"), "a%2Fb%3Fc%3Dd%26e");
        assert_eq!(super::seg("é"), "%C3%A9");
    }
}
