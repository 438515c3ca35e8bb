//! Ready probes (C1 `ready`): a TCP connection accepted, or `GET path` answered with
//! the expected status, on the port's loopback address, every `interval_ms` until
//! `timeout_s`. A port whose process exits first fails at once.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::launch::{describe, Launched};
use super::Failure;
use crate::contract::ports::{Port, Probe};

/// One probe may take this long (connect, send, first line back).
const PROBE_ATTEMPT: Duration = Duration::from_secs(2);
/// The status line is read from at most this many bytes.
const STATUS_LINE_BYTES_MAX: usize = 256;

pub async fn until_ready(port: &Port, number: u16, l: &mut Launched) -> Result<(), Failure> {
    let r = &port.ready;
    let deadline = Instant::now() + Duration::from_millis(r.timeout_ms);
    loop {
        if let Some(status) = l.exited() {
            // Let the output copiers catch up with what it wrote last.
            tokio::time::sleep(Duration::from_millis(50)).await;
            return Err(Failure::new(
                port,
                format!("{} before it was ready", describe(status)),
                l.tail_lines(),
            ));
        }
        if once(&r.probe, number).await {
            return Ok(());
        }
        if Instant::now() >= deadline {
            let what = match &r.probe {
                Probe::Tcp => format!("accepted a connection on {number}"),
                Probe::Http {
                    path,
                    expect_status,
                } => format!("answered GET {path} on {number} with {expect_status}"),
            };
            return Err(Failure::new(
                port,
                format!("never {what} within {} s", r.timeout_ms / 1000),
                l.tail_lines(),
            ));
        }
        tokio::time::sleep(Duration::from_millis(r.interval_ms)).await;
    }
}

/// One probe: true if the port answered as its contract says.
pub async fn once(probe: &Probe, number: u16) -> bool {
    let attempt = async {
        let mut s = TcpStream::connect(("127.0.0.1", number)).await.ok()?;
        let (path, expect) = match probe {
            Probe::Tcp => return Some(true),
            Probe::Http {
                path,
                expect_status,
            } => (path, *expect_status),
        };
        let req =
            format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1:{number}\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.ok()?;
        let mut got = Vec::with_capacity(64);
        let mut buf = [0u8; 64];
        while !got.contains(&b'\n') && got.len() < STATUS_LINE_BYTES_MAX {
            let n = s.read(&mut buf).await.ok()?;
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
        Some(status_of(&got) == Some(expect))
    };
    matches!(
        tokio::time::timeout(PROBE_ATTEMPT, attempt).await,
        Ok(Some(true))
    )
}

/// The status of an HTTP/1.x status line: `HTTP/1.1 200 OK` is 200.
fn status_of(head: &[u8]) -> Option<u16> {
    let line = head.split(|b| *b == b'\n').next()?;
    let text = std::str::from_utf8(line).ok()?;
    let mut parts = text.split_whitespace();
    if !parts.next()?.starts_with("HTTP/1.") {
        return None;
    }
    parts.next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    #[test]
    fn status_lines() {
        assert_eq!(super::status_of(b"HTTP/1.0 200 OK\r\n"), Some(200));
        assert_eq!(
            super::status_of(b"HTTP/1.1 503 Busy\r\nServer: x"),
            Some(503)
        );
        assert_eq!(super::status_of(b"SSH-2.0-OpenSSH\r\n"), None);
        assert_eq!(super::status_of(b""), None);
    }
}
