//! The API's two streams, read as they arrive: the streamed acquire (NDJSON, one
//! [`AcquireEvent`] a line) and the journal's server-sent events, which resume after
//! the last entry seen (`Last-Event-ID`) when the connection drops or berth cuts a slow
//! reader off, so a reader sees every entry once, in order.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::Method;

use crate::wire::{AcquireEvent, AcquireRequest, JournalEntry, Run, StreamCutoff};
use crate::{refusal, seg, Client, Error, CALL_TIMEOUT_MS};

/// The longest line read from a stream (a granted run's lease is a few KiB): a longer
/// one is an answer that is not API v1, not a reason to buffer without end.
pub const LINE_BYTES_MAX: usize = 1 << 20;
/// The event stream's reconnection backoff: doubled from the first to the last.
const RECONNECT: crate::retry::Backoff = crate::retry::Backoff::new(100, 1_000);
const NDJSON: &str = "application/x-ndjson";

/// A body read line by line (`\n`-terminated; a final unterminated line counts).
struct Lines {
    body: Incoming,
    buf: Vec<u8>,
    done: bool,
}

impl Lines {
    async fn next(&mut self) -> Result<Option<String>, String> {
        loop {
            if let Some(i) = self.buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=i).collect();
                return text(line).map(|l| Some(l.trim_end_matches(['\n', '\r']).to_string()));
            }
            if self.buf.len() > LINE_BYTES_MAX {
                return Err(format!("a line longer than {LINE_BYTES_MAX} bytes"));
            }
            if self.done {
                return match self.buf.is_empty() {
                    true => Ok(None),
                    false => text(std::mem::take(&mut self.buf)).map(Some),
                };
            }
            match self.body.frame().await {
                None => self.done = true,
                Some(Err(e)) => return Err(e.to_string()),
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
            }
        }
    }
}

fn text(bytes: Vec<u8>) -> Result<String, String> {
    String::from_utf8(bytes).map_err(|e| e.to_string())
}

/// A streamed acquire: `Queued` events while the run waits (whenever its position or
/// reason changes), then exactly one of `Granted`, `Expired` or `Rejected`, then
/// `None`. Dropping it closes the connection, and berth cancels the waiting run (A9).
pub struct AcquireStream {
    lines: Option<Lines>,
    /// An answer that came whole, not streamed (a detached run's 202).
    first: Option<Run>,
    addr: String,
    ended: bool,
}

impl AcquireStream {
    /// The next event, `None` after the last.
    pub async fn next(&mut self) -> Result<Option<AcquireEvent>, Error> {
        if self.ended {
            return Ok(None);
        }
        if let Some(run) = self.first.take() {
            // A whole answer: the lease, or a detached run left queued (202).
            self.ended = true;
            return Ok(Some(match run.state {
                berth_core::RunState::Granted => AcquireEvent::Granted {
                    lease: Box::new(run),
                },
                _ => AcquireEvent::Queued {
                    run_id: run.run_id,
                    position: run.position,
                    reason: run.reason,
                },
            }));
        }
        let Some(lines) = self.lines.as_mut() else {
            return Ok(None);
        };
        let broke = |what: String| Error::Unreachable {
            addr: self.addr.clone(),
            what,
        };
        loop {
            match lines.next().await.map_err(broke)? {
                None => {
                    self.ended = true;
                    return Err(broke(
                        "the acquire stream ended before the run was granted or refused".into(),
                    ));
                }
                Some(line) if line.trim().is_empty() => continue,
                Some(line) => {
                    let event: AcquireEvent =
                        serde_json::from_str(&line).map_err(|e| Error::Answer {
                            status: 201,
                            what: format!("{e}: {line}"),
                        })?;
                    self.ended = !matches!(event, AcquireEvent::Queued { .. });
                    return Ok(Some(event));
                }
            }
        }
    }

    /// Reads to the end: the lease once granted; an `Expired` or `Rejected` event as
    /// [`Error::Refused`] (410 or 409, with the event's code and details).
    pub async fn granted(mut self) -> Result<Run, Error> {
        while let Some(event) = self.next().await? {
            match event {
                AcquireEvent::Queued { .. } => continue,
                AcquireEvent::Granted { lease } => return Ok(*lease),
                AcquireEvent::Expired { error } => {
                    return Err(Error::Refused { status: 410, error })
                }
                AcquireEvent::Rejected { error } => {
                    return Err(Error::Refused { status: 409, error })
                }
            }
        }
        Err(Error::Unreachable {
            addr: self.addr,
            what: "the acquire stream had ended".into(),
        })
    }
}

/// What `GET /v1/events` selects: entries after `after` (default: from now), of one
/// run, one project, and some kinds (all when empty).
#[derive(Clone, Debug, Default)]
pub struct EventsQuery {
    pub after: Option<u64>,
    pub run: Option<String>,
    pub project: Option<String>,
    pub kinds: Vec<String>,
}

/// The journal as it is written: each entry once, in order, across reconnections.
pub struct EventStream {
    client: Client,
    query: EventsQuery,
    /// The last entry yielded (or the cutoff's), what a reconnection resumes after.
    last: Option<u64>,
    lines: Option<Lines>,
    retry: crate::retry::Retry,
}

impl EventStream {
    /// The next entry. A dropped connection or a cutoff reconnects (after a backoff of
    /// at most a second) and resumes after the last entry seen; a refusal (4xx) is an
    /// error. It waits as long as the journal is quiet.
    pub async fn next(&mut self) -> Result<JournalEntry, Error> {
        loop {
            let Some(lines) = self.lines.as_mut() else {
                self.connect().await?;
                continue;
            };
            match read_event(lines).await {
                Ok(Some((Some(kind), data))) if kind == "cutoff" => {
                    // berth closes the stream after this; resume after what it sent.
                    if let Ok(cut) = serde_json::from_str::<StreamCutoff>(&data) {
                        self.last = Some(self.last.unwrap_or(0).max(cut.last_seq));
                    }
                    self.lines = None;
                }
                Ok(Some((_, data))) => {
                    let entry: JournalEntry =
                        serde_json::from_str(&data).map_err(|e| Error::Answer {
                            status: 200,
                            what: format!("{e}: {data}"),
                        })?;
                    if self.last.is_some_and(|l| entry.seq <= l) {
                        continue;
                    }
                    self.last = Some(entry.seq);
                    self.retry.succeeded();
                    return Ok(entry);
                }
                // The connection ended or broke: reconnect after the backoff.
                Ok(None) | Err(_) => self.lines = None,
            }
        }
    }

    /// The sequence number of the last entry yielded (what a reader stores to resume).
    pub fn last_seq(&self) -> Option<u64> {
        self.last
    }

    async fn connect(&mut self) -> Result<(), Error> {
        let mut q = Vec::new();
        if let Some(r) = &self.query.run {
            q.push(format!("run={}", seg(r)));
        }
        if let Some(p) = &self.query.project {
            q.push(format!("project={}", seg(p)));
        }
        if !self.query.kinds.is_empty() {
            let kinds: Vec<String> = self.query.kinds.iter().map(|k| seg(k)).collect();
            q.push(format!("kind={}", kinds.join(",")));
        }
        if let Some(after) = self.last {
            q.push(format!("after={after}"));
        }
        let path = format!("/v1/events?{}", q.join("&"));
        let limit = Duration::from_millis(CALL_TIMEOUT_MS);
        let sent = tokio::time::timeout(
            limit,
            self.client
                .send(Method::GET, &path, None::<&()>, "text/event-stream"),
        )
        .await;
        match sent {
            Ok(Ok(res)) if res.status().is_success() => {
                self.lines = Some(Lines {
                    body: res.into_body(),
                    buf: Vec::new(),
                    done: false,
                });
                return Ok(());
            }
            Ok(Ok(res)) if res.status().as_u16() < 500 => {
                let status = res.status().as_u16();
                let body = res.into_body().collect().await.map(|b| b.to_bytes());
                return Err(refusal(status, &body.unwrap_or_else(|_| Bytes::new())));
            }
            // Unreachable, timed out or a 5xx: berth may be restarting.
            _ => {}
        }
        tokio::time::sleep(self.retry.failed()).await;
        Ok(())
    }
}

/// One server-sent event: its `event:` name and its `data:` lines joined; `None`
/// when the stream ended.
async fn read_event(lines: &mut Lines) -> Result<Option<(Option<String>, String)>, String> {
    let (mut kind, mut data): (Option<String>, Vec<String>) = (None, Vec::new());
    while let Some(line) = lines.next().await? {
        if line.is_empty() {
            if !data.is_empty() {
                return Ok(Some((kind, data.join("\n"))));
            }
            kind = None;
        } else if let Some(v) = line.strip_prefix("data:") {
            data.push(v.strip_prefix(' ').unwrap_or(v).to_string());
        } else if let Some(v) = line.strip_prefix("event:") {
            kind = Some(v.trim().to_string());
        }
        // `id:`, `retry:` and comments: the entry's own `seq` is its id.
    }
    Ok(None)
}

impl Client {
    /// `POST /v1/runs` streamed (`acquireRun` with `Accept: application/x-ndjson`):
    /// the run's wait as events. A refusal before the wait starts is an error.
    pub async fn acquire_stream(&self, req: &AcquireRequest) -> Result<AcquireStream, Error> {
        let limit = Duration::from_millis(CALL_TIMEOUT_MS);
        let res = tokio::time::timeout(
            limit,
            self.send(Method::POST, "/v1/runs", Some(req), NDJSON),
        )
        .await
        .map_err(|_| self.unreachable(format!("no answer within {limit:?}")))??;
        let status = res.status().as_u16();
        let streamed = res
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with(NDJSON));
        let mut stream = AcquireStream {
            lines: None,
            first: None,
            addr: self.addr.clone(),
            ended: false,
        };
        if streamed && (200..300).contains(&status) {
            stream.lines = Some(Lines {
                body: res.into_body(),
                buf: Vec::new(),
                done: false,
            });
            return Ok(stream);
        }
        let bytes = http_body_util::Limited::new(res.into_body(), crate::ANSWER_BYTES_MAX)
            .collect()
            .await
            .map_err(|e| self.unreachable(format!("reading the answer: {e}")))?
            .to_bytes();
        if !(200..300).contains(&status) {
            return Err(refusal(status, &bytes));
        }
        // Not streamed after all: the whole answer is the lease.
        let run = serde_json::from_slice(&bytes).map_err(|e| Error::Answer {
            status,
            what: e.to_string(),
        })?;
        stream.first = Some(run);
        Ok(stream)
    }

    /// `GET /v1/events` (`streamEvents`): the journal live, resumed without gaps or
    /// repeats across reconnections. Nothing is sent until the first `next()`.
    pub fn events(&self, query: EventsQuery) -> EventStream {
        EventStream {
            client: self.clone(),
            last: query.after,
            query,
            lines: None,
            retry: crate::retry::Retry::new(RECONNECT),
        }
    }
}
