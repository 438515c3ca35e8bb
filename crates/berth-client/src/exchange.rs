//! Exchanges for callers that show berth's answers as they are (the CLI prints a
//! refusal's body with `--json`, and reads streams byte for byte): any status is an
//! answer here, not an error; only a daemon that cannot be reached is.

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{HeaderMap, Method};

use crate::{Client, Error, ANSWER_BYTES_MAX};

/// An answer's status and headers, its body still to read.
pub struct Answer {
    pub status: u16,
    pub headers: HeaderMap,
    body: Incoming,
    addr: String,
}

impl Answer {
    /// The next piece of the body as it came; `None` at its end.
    pub async fn chunk(&mut self) -> Result<Option<Bytes>, Error> {
        loop {
            match self.body.frame().await {
                None => return Ok(None),
                Some(Err(e)) => return Err(self.broken(e)),
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        return Ok(Some(data));
                    }
                }
            }
        }
    }

    /// The whole body, at most [`ANSWER_BYTES_MAX`] bytes.
    pub async fn bytes(self) -> Result<Bytes, Error> {
        let addr = self.addr;
        let limited = http_body_util::Limited::new(self.body, ANSWER_BYTES_MAX);
        match limited.collect().await {
            Ok(b) => Ok(b.to_bytes()),
            Err(e) => Err(Error::Unreachable {
                addr,
                what: format!("reading the answer: {e}"),
            }),
        }
    }

    fn broken(&self, e: impl std::fmt::Display) -> Error {
        Error::Unreachable {
            addr: self.addr.clone(),
            what: format!("reading the answer: {e}"),
        }
    }
}

impl Client {
    /// One request on a fresh connection with a JSON body (if any), `accept` and extra
    /// `headers`: the answer, whatever its status. No deadline of its own: the caller
    /// bounds it (a stream may last as long as its caller wants to read).
    pub async fn exchange(
        &self,
        method: &str,
        path: &str,
        body: Option<&serde_json::Value>,
        accept: &str,
        headers: &[(&str, String)],
    ) -> Result<Answer, Error> {
        let method = Method::from_bytes(method.as_bytes()).map_err(|e| self.unreachable(e))?;
        let res = self.send_with(method, path, body, accept, headers).await?;
        let status = res.status().as_u16();
        let (parts, body) = res.into_parts();
        Ok(Answer {
            status,
            headers: parts.headers,
            body,
            addr: self.addr.clone(),
        })
    }
}
