//! Parked long polls: a queued waiter's connection leaves hyper and waits on its own.
//!
//! hyper's HTTP/1 server keeps two 8 KiB buffers per connection for as long as a
//! request is in flight (its write buffer from accept, and a read buffer to notice the
//! client leaving), and no setting shrinks them. A long poll that waits for hours would
//! cost 16 KiB in hyper alone, more than a whole waiter may (issue 18). So once an
//! attached acquire is queued its handler parks it (`ConnMark::park`, with the future
//! that will make its answer) and returns a placeholder; from then on the connection's
//! socket reads as closed to hyper and swallows what hyper writes, so hyper finishes
//! the connection and hands the socket back (`into_parts`) with its buffers freed. The
//! connection task then waits on the socket alone: the answer is written as one
//! HTTP/1.1 response with `connection: close`, or the client leaving (EOF, reset, or
//! bytes it should not send) drops the answer's future, whose guard cancels the
//! waiter (A9), or the daemon stopping closes it.
//!
//! What a parked waiter keeps: its task, its socket's registration, and the answer's
//! future (its watch of the run and its A9 guard), about 3 KiB.

use std::io;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::response::Response;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

use crate::http::ConnMark;

/// The rest of a parked request: resolves to its response.
pub type Answer = Pin<Box<dyn std::future::Future<Output = Response> + Send>>;

/// Largest answer written (a run as JSON is a few KiB; its error envelope less).
pub const ANSWER_BYTES_MAX: usize = 1 << 20;
/// How long writing the answer may take: a client that does not read cannot hold its
/// task forever.
pub const ANSWER_WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// Bytes a parked client may send before it counts as gone: it has nothing more to
/// say until it is answered (a pipelined request is not served on a parked socket).
const UNEXPECTED_BYTES_MAX: usize = 4 * 1024;

/// A marker on the placeholder a parking handler returns to hyper: never written to
/// the client, and not counted as an answer (the parked answer is, when it is sent).
#[derive(Clone, Copy, Debug)]
pub struct Placeholder;

/// The placeholder response a handler returns after `ConnMark::park`.
pub fn placeholder() -> Response {
    let mut r = Response::new(axum::body::Body::empty());
    r.extensions_mut().insert(Placeholder);
    r
}

/// The connection's socket as hyper sees it: itself, until its request is parked;
/// then closed for reading and a sink for writing, so that hyper ends the connection.
pub struct ParkIo {
    pub sock: TcpStream,
    pub mark: Arc<ConnMark>,
    /// hyper's own bare error answer, rewritten with the error envelope
    /// (`http::enveloped`), and how much of it is written.
    pub rewritten: Option<(Vec<u8>, usize)>,
}

impl ParkIo {
    fn parked(&self) -> bool {
        self.mark.is_parked.load(Ordering::Acquire)
    }

    /// Writes `buf`, unless it is hyper's own bare error answer: then the enveloped
    /// one is written in its place (all of it before `buf` counts as written).
    fn poll_write_enveloped(
        &mut self,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.rewritten.is_none() {
            match crate::http::enveloped(buf) {
                Some(answer) => self.rewritten = Some((answer, 0)),
                None => return Pin::new(&mut self.sock).poll_write(cx, buf),
            }
        }
        let (answer, at) = self.rewritten.as_mut().expect("set above");
        while *at < answer.len() {
            match Pin::new(&mut self.sock).poll_write(cx, &answer[*at..]) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Poll::Ready(Ok(n)) => *at += n,
                other => return other,
            }
        }
        Poll::Ready(Ok(buf.len()))
    }
}

impl AsyncRead for ParkIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.parked() {
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.sock).poll_read(cx, buf)
    }
}

impl AsyncWrite for ParkIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.parked() {
            return Poll::Ready(Ok(buf.len()));
        }
        self.poll_write_enveloped(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if self.parked() {
            return Poll::Ready(Ok(bufs.iter().map(|b| b.len()).sum()));
        }
        // A bare error answer is one small head in the first slice.
        if self.rewritten.is_some()
            || bufs
                .first()
                .is_some_and(|b| crate::http::enveloped(b).is_some())
        {
            let first = bufs.first().map_or(&[][..], |b| &b[..]);
            return self.poll_write_enveloped(cx, first);
        }
        Pin::new(&mut self.sock).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.sock.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.parked() {
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.sock).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.parked() {
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.sock).poll_shutdown(cx)
    }
}

/// Waits for the parked request's answer and writes it, unless the client leaves or
/// the daemon stops first (then the answer's future is dropped: its guard cancels the
/// waiter).
pub async fn serve_parked(
    mut sock: TcpStream,
    answer: Answer,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let res = tokio::select! {
        r = answer => r,
        _ = client_gone(&sock) => return,
        _ = stop.wait_for(|s| *s) => return,
    };
    let Some(bytes) = encode(res).await else {
        return;
    };
    let write = async {
        sock.write_all(&bytes).await?;
        sock.shutdown().await
    };
    let _ = tokio::time::timeout(ANSWER_WRITE_TIMEOUT, write).await;
}

/// Resolves when the client closed its side, reset the connection, or sent more than
/// `UNEXPECTED_BYTES_MAX` bytes while waiting.
async fn client_gone(sock: &TcpStream) {
    let mut unexpected = 0usize;
    let mut buf = [0u8; 256];
    loop {
        if sock.readable().await.is_err() {
            return;
        }
        match sock.try_read(&mut buf) {
            Ok(0) => return,
            Ok(n) => {
                unexpected += n;
                if unexpected > UNEXPECTED_BYTES_MAX {
                    return;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(_) => return,
        }
    }
}

/// The response as HTTP/1.1 bytes: its status, its headers, `content-length`,
/// `connection: close` and `date`, then its body (`None`: larger than
/// `ANSWER_BYTES_MAX`).
async fn encode(res: Response) -> Option<Vec<u8>> {
    let (parts, body) = res.into_parts();
    let body = axum::body::to_bytes(body, ANSWER_BYTES_MAX).await.ok()?;
    let mut out = Vec::with_capacity(256 + body.len());
    let status = parts.status;
    out.extend_from_slice(
        format!(
            "HTTP/1.1 {} {}\r\n",
            status.as_u16(),
            status.canonical_reason().unwrap_or("")
        )
        .as_bytes(),
    );
    for (k, v) in &parts.headers {
        if k == axum::http::header::CONTENT_LENGTH || k == axum::http::header::CONNECTION {
            continue;
        }
        out.extend_from_slice(k.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(v.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    let date = httpdate::fmt_http_date(std::time::SystemTime::now());
    out.extend_from_slice(
        format!(
            "content-length: {}\r\nconnection: close\r\ndate: {date}\r\n\r\n",
            body.len()
        )
        .as_bytes(),
    );
    out.extend_from_slice(&body);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::response::IntoResponse;

    #[tokio::test]
    async fn an_answer_is_one_http_response_that_closes_the_connection() {
        let res = (
            axum::http::StatusCode::CREATED,
            axum::Json(serde_json::json!({"run_id": "r1"})),
        )
            .into_response();
        let text = String::from_utf8(encode(res).await.unwrap()).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 201 Created\r\n"), "{head}");
        assert!(head.contains("content-type: application/json"), "{head}");
        assert!(head.contains("connection: close"), "{head}");
        assert!(
            head.contains(&format!("content-length: {}", body.len())),
            "{head}"
        );
        assert_eq!(body, r#"{"run_id":"r1"}"#);
    }
}
