//! Seeing what berth does: the journal (`/v1/journal`, its export), the live event
//! stream (`/v1/events`), Prometheus metrics (`/metrics`) and the dashboard (`/`).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State as AxState;
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use berth_store::JournalEntry;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

use super::{ask, Api, Params};
use crate::daemon::Msg;
use crate::error::ApiError;
use crate::journal::{Filter, Journal};

/// Entries one `GET /v1/journal` returns at most (the ledger's read bound).
pub const JOURNAL_LIMIT_MAX: usize = berth_store::JOURNAL_READ_MAX;
/// Entries one export holds at most: built in memory to give its digest in a header
/// (~300 bytes each: ~75 MiB). Retention keeps 16 per remembered run, 160,000 at the
/// default, so a default ledger always exports whole.
pub const JOURNAL_EXPORT_MAX: u64 = 262_144;
/// Events buffered for one stream; past it the stream's reader waits, and once it is
/// `SUBSCRIBER_LAG_MAX` entries behind the journal it is cut off.
const STREAM_BUFFER: usize = 64;
/// A comment this often keeps proxies from closing an idle stream.
const HEARTBEAT: Duration = Duration::from_secs(15);
/// A `kind` filter's names, at most.
const KINDS_MAX: usize = 32;

fn number(params: &Params, field: &str) -> Result<Option<u64>, ApiError> {
    params
        .0
        .get(field)
        .map(|v| {
            v.parse::<u64>()
                .map_err(|_| ApiError::invalid(field, "must be a non-negative integer"))
        })
        .transpose()
}

fn store_unavailable(e: berth_store::StoreError) -> ApiError {
    ApiError::new(
        503,
        "store_unavailable",
        format!("the journal could not be read: {e}"),
    )
}

fn ndjson(entries: &[Arc<JournalEntry>], out: &mut Vec<u8>) {
    for e in entries {
        out.extend_from_slice(e.line.as_bytes());
        out.push(b'\n');
    }
}

/// `GET /v1/journal?after=SEQ&limit=N`: entries after `after` (0: from the first kept),
/// as ndjson, at most `limit` (default and maximum 1000).
pub async fn journal(AxState(api): AxState<Api>, params: Params) -> Result<Response, ApiError> {
    let after = number(&params, "after")?.unwrap_or(0);
    let limit = number(&params, "limit")?.unwrap_or(JOURNAL_LIMIT_MAX as u64);
    if limit == 0 || limit > JOURNAL_LIMIT_MAX as u64 {
        return Err(ApiError::invalid(
            "limit",
            format!("must be from 1 to {JOURNAL_LIMIT_MAX}"),
        ));
    }
    let j = &api.shared.journal;
    let last = j.last();
    let got = j
        .read(after, limit as usize)
        .await
        .map_err(store_unavailable)?;
    let mut body = Vec::new();
    ndjson(&got, &mut body);
    Ok((
        [
            (header::CONTENT_TYPE, "application/x-ndjson".to_string()),
            (
                header::HeaderName::from_static("x-berth-journal-last"),
                last.to_string(),
            ),
        ],
        body,
    )
        .into_response())
}

/// Whether a journal entry is about experiment scope `scope` (its `data.scope`). Only
/// budget entries carry one; a cheap byte search comes first, so most lines are never
/// parsed.
fn of_scope(e: &JournalEntry, scope: &str) -> bool {
    if !e.line.contains(&format!("\"scope\":\"{scope}\"")) {
        return false;
    }
    serde_json::from_str::<serde_json::Value>(&e.line)
        .is_ok_and(|v| v["data"]["scope"].as_str() == Some(scope))
}

/// `GET /v1/journal/export?through=SEQ[&scope=ID]`: every kept entry from the first
/// through `through` (default: the last), as ndjson, with the SHA-256 of exactly those
/// bytes in `X-Berth-Journal-Sha256`. Entries are stored as they were first rendered,
/// so the same prefix always gives the same bytes and the same digest. With `scope`,
/// only that experiment scope's entries (frozen, tokens, control), so an experiment
/// can freeze exactly what happened to its budget.
pub async fn export(AxState(api): AxState<Api>, params: Params) -> Result<Response, ApiError> {
    let scope = params.0.get("scope").cloned();
    if let Some(s) = &scope {
        crate::request::check_scope(s)?;
    }
    let j = &api.shared.journal;
    let last = j.last();
    let through = number(&params, "through")?.unwrap_or(last);
    if through > last {
        return Err(ApiError::invalid(
            "through",
            format!("is past the journal's last entry ({last})"),
        ));
    }
    let first = j.first().await.map_err(store_unavailable)?;
    if first > 0 && through >= first && through - first + 1 > JOURNAL_EXPORT_MAX {
        return Err(ApiError::invalid(
            "through",
            format!(
                "an export holds at most {JOURNAL_EXPORT_MAX} entries; the first kept is {first}"
            ),
        ));
    }
    let mut body = Vec::new();
    let mut after = first.saturating_sub(1);
    while after < through {
        let want = (through - after).min(JOURNAL_LIMIT_MAX as u64) as usize;
        let got = j.read(after, want).await.map_err(store_unavailable)?;
        let Some(end) = got.last().map(|e| e.seq) else {
            break;
        };
        match &scope {
            Some(s) => {
                let kept: Vec<Arc<JournalEntry>> =
                    got.into_iter().filter(|e| of_scope(e, s)).collect();
                ndjson(&kept, &mut body);
            }
            None => ndjson(&got, &mut body),
        }
        after = end;
    }
    let digest = Sha256::digest(&body);
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    let h = |n: &'static str| header::HeaderName::from_static(n);
    Ok((
        [
            (header::CONTENT_TYPE, "application/x-ndjson".to_string()),
            (h("x-berth-journal-sha256"), hex),
            (h("x-berth-journal-first"), first.min(through).to_string()),
            (h("x-berth-journal-through"), through.min(after).to_string()),
        ],
        body,
    )
        .into_response())
}

/// What a stream is asked for: the filter, and where to start.
fn stream_request(
    params: &Params,
    headers: &HeaderMap,
    last: u64,
) -> Result<(Filter, u64), ApiError> {
    let run = params.0.get("run").cloned();
    if let Some(r) = &run {
        crate::request::check_run_id(r).map_err(|e| ApiError::invalid("run", e.message))?;
    }
    let project = params.0.get("project").cloned();
    let kinds: Vec<String> = params
        .0
        .get("kind")
        .map(|k| {
            k.split(',')
                .map(str::trim)
                .filter(|k| !k.is_empty())
                .map(String::from)
                .collect()
        })
        .unwrap_or_default();
    if kinds.len() > KINDS_MAX || kinds.iter().any(|k| k.len() > 64) {
        return Err(ApiError::invalid(
            "kind",
            format!("at most {KINDS_MAX} comma-separated kinds of up to 64 characters"),
        ));
    }
    // Resume after the last event seen; else after `after`; else from now.
    let after = match headers.get("last-event-id") {
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .ok_or_else(|| ApiError::invalid("Last-Event-ID", "must be a sequence number"))?,
        None => number(params, "after")?.unwrap_or(last),
    };
    if after > last {
        return Err(ApiError::invalid(
            "Last-Event-ID",
            format!("is past the journal's last entry ({last})"),
        ));
    }
    Ok((
        Filter {
            run,
            project,
            kinds,
        },
        after,
    ))
}

/// `GET /v1/events`: server-sent events from the journal, `id` = sequence number,
/// resuming after `Last-Event-ID` (or `?after=`) without a gap or a duplicate, filtered
/// by `run`, `project` and `kind` (comma-separated). A reader too far behind is sent
/// one last `cutoff` event and closed; it resumes by id.
///
/// Events travel in batches: everything the journal published at once (a commit's
/// entries, or a page of history) becomes one buffer of SSE records, one channel send
/// and one body chunk. One record each cost a timer, a send, a wake-up and a write per
/// event per reader: eight readers took a fifth of the daemon's request rate.
pub async fn events(
    AxState(api): AxState<Api>,
    axum::Extension(caller): axum::Extension<super::Caller>,
    headers: HeaderMap,
    params: Params,
) -> Result<Response, ApiError> {
    let (filter, after) = stream_request(&params, &headers, api.shared.journal.last())?;
    // S10: counted against its token's cap for as long as the response body lives.
    let slot = api
        .shared
        .limits
        .take(caller.token, crate::limits::Kind::Stream)?;
    let (tx, rx) = mpsc::channel::<Bytes>(STREAM_BUFFER);
    // The stream's last event, once the pump has cut it off: sent after the batches
    // already buffered (never into a full buffer: the reader is behind), then it ends.
    let last_word: Arc<std::sync::OnceLock<Bytes>> = Arc::default();
    let shared = api.shared.clone();
    let said = last_word.clone();
    shared.metrics.subscriber(true);
    tokio::spawn(async move {
        if let Some(cut) = pump(&shared.journal, filter, after, &tx).await {
            let data = serde_json::to_string(&cut).unwrap_or_default();
            let _ = said.set(Bytes::from(format!("event: cutoff\ndata: {data}\n\n")));
        }
        drop(tx);
        shared.metrics.subscriber(false);
    });
    let stream = futures_util::stream::unfold(Some(rx), move |rx| {
        let last_word = last_word.clone();
        let _held = &slot;
        async move {
            let mut rx = rx?;
            match tokio::time::timeout(HEARTBEAT, rx.recv()).await {
                Ok(Some(batch)) => Some((Ok::<_, Infallible>(batch), Some(rx))),
                Ok(None) => last_word.get().cloned().map(|b| (Ok(b), None)),
                // Nothing to say for a while: a comment keeps proxies from closing.
                Err(_) => Some((Ok(Bytes::from_static(b": heartbeat\n\n")), Some(rx))),
            }
        }
    });
    Ok(Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        // Proxies must pass events on as they come.
        .header("x-accel-buffering", HeaderValue::from_static("no"))
        .body(Body::from_stream(stream))
        .expect("response"))
}

/// One entry as an SSE record, appended to `out`. The line is one line of JSON (serde
/// escapes every newline), so it is one `data:` field.
fn sse(e: &JournalEntry, out: &mut Vec<u8>) {
    use std::io::Write;
    let _ = write!(out, "id: {}\nevent: {}\ndata: ", e.seq, e.kind);
    out.extend_from_slice(e.line.as_bytes());
    out.extend_from_slice(b"\n\n");
}

/// Why a stream was cut off, with the last entry it was sent (or skipped).
fn cutoff(after: u64, why: &str) -> berth_client::wire::StreamCutoff {
    berth_client::wire::StreamCutoff {
        reason: format!(
            "{why}: this reader fell more than {} entries behind the journal; resume with Last-Event-ID: {after}",
            crate::journal::SUBSCRIBER_LAG_MAX
        ),
        last_seq: after,
    }
}

/// Sends `filter`'s entries after `after` to `tx`: first what is already written, then
/// live ones as they become durable, until the reader goes away (`None`) or falls too
/// far behind (the cutoff to tell it).
async fn pump(
    journal: &Journal,
    filter: Filter,
    after: u64,
    tx: &mpsc::Sender<Bytes>,
) -> Option<berth_client::wire::StreamCutoff> {
    let mut out = Out {
        journal,
        tx,
        batch: Vec::new(),
        sent: after,
    };
    match feed(&mut out, &filter, after).await {
        Err(Undelivered::Behind(why)) => Some(cutoff(out.sent, why)),
        Err(Undelivered::Gone) | Ok(()) => None,
    }
}

async fn feed(out: &mut Out<'_>, filter: &Filter, mut after: u64) -> Result<(), Undelivered> {
    // Marked seen before catching up, so nothing published meanwhile goes unnoticed.
    let mut live = out.journal.subscribe();
    live.borrow_and_update();
    catch_up(out, filter, &mut after, u64::MAX).await?;
    let mut delivered = tokio::time::Instant::now();
    loop {
        tokio::select! {
            _ = out.tx.closed() => return Ok(()),
            changed = live.changed() => if changed.is_err() { return Ok(()) },
        }
        // The first commit after a quiet spell goes out at once; under load, the
        // commits of one STREAM_LINGER go out together.
        let due = delivered + STREAM_LINGER;
        if tokio::time::Instant::now() < due {
            tokio::select! {
                _ = out.tx.closed() => return Ok(()),
                _ = tokio::time::sleep_until(due) => {}
            }
        }
        live.borrow_and_update();
        // Woken once per commit: everything since is one batch (a page at most).
        let behind = out.journal.last().saturating_sub(after);
        if behind > crate::journal::SUBSCRIBER_LAG_MAX as u64 {
            return Err(Undelivered::Behind("the live feed overtook it"));
        }
        catch_up(out, filter, &mut after, u64::MAX).await?;
        delivered = tokio::time::Instant::now();
    }
}

/// How long a live stream gathers commits before it writes them: under load a reader
/// gets one write per STREAM_LINGER, not one per commit (at ~1,000 commits a second,
/// each reader cost the daemon a wake-up, a read of the ring and a socket write per
/// commit, and its client as many reads). An event waits at most this long; far below
/// what a dashboard or an orchestrator notices, and within SUBSCRIBER_LAG_MAX at any
/// rate the daemon reaches (40,000 entries a second is 800 per linger).
const STREAM_LINGER: Duration = Duration::from_millis(20);

/// How often a stream whose reader has stopped reading checks how far behind it is.
const LAG_CHECK: Duration = Duration::from_millis(500);

/// Why entries were not delivered.
enum Undelivered {
    Gone,
    /// Cut off; the reader resumes after the last entry it was sent.
    Behind(&'static str),
}

/// One stream's side of the pump: the records not yet handed over, and how far the
/// reader has been sent (what a cutoff tells it to resume after).
struct Out<'a> {
    journal: &'a Journal,
    tx: &'a mpsc::Sender<Bytes>,
    batch: Vec<u8>,
    sent: u64,
}

impl Out<'_> {
    /// Hands the batch (every entry through `through`, those the filter admits) to the
    /// stream, waiting while the reader is slow, but not once it is more than
    /// `SUBSCRIBER_LAG_MAX` entries behind the journal: then the stream is cut off (a
    /// reader that stopped reading holds nothing for long).
    async fn deliver(&mut self, through: u64) -> Result<(), Undelivered> {
        if self.batch.is_empty() {
            self.sent = through;
            return Ok(());
        }
        // The common case, a reader keeping up, costs no timer.
        let permit = match self.tx.try_reserve() {
            Ok(permit) => permit,
            Err(mpsc::error::TrySendError::Closed(())) => return Err(Undelivered::Gone),
            Err(mpsc::error::TrySendError::Full(())) => loop {
                tokio::select! {
                    permit = self.tx.reserve() => break permit.map_err(|_| Undelivered::Gone)?,
                    _ = tokio::time::sleep(LAG_CHECK) => {
                        let behind = self.journal.last().saturating_sub(self.sent);
                        if behind > crate::journal::SUBSCRIBER_LAG_MAX as u64 {
                            return Err(Undelivered::Behind("it stopped reading"));
                        }
                    }
                }
            },
        };
        permit.send(Bytes::from(std::mem::take(&mut self.batch)));
        self.sent = through;
        Ok(())
    }
}

/// Sends the written entries after `*after` up to `through`, a page per batch,
/// advancing `*after`.
async fn catch_up(
    out: &mut Out<'_>,
    filter: &Filter,
    after: &mut u64,
    through: u64,
) -> Result<(), Undelivered> {
    while *after < through {
        let got = out
            .journal
            .read(*after, JOURNAL_LIMIT_MAX)
            .await
            .map_err(|_| Undelivered::Gone)?;
        if got.is_empty() {
            return Ok(());
        }
        for e in got.iter().take_while(|e| e.seq <= through) {
            if filter.admits(e) {
                sse(e, &mut out.batch);
            }
            *after = e.seq;
        }
        out.deliver(*after).await?;
    }
    Ok(())
}

/// `GET /metrics`: Prometheus' text format.
pub async fn metrics(AxState(api): AxState<Api>) -> Result<Response, ApiError> {
    let (snap, _) = ask(&api, |reply| Msg::Status { reply }).await?;
    let waiting = ask(&api, |reply| Msg::List {
        limit: super::LIST_MAX,
        ended: false,
        reply,
    })
    .await?;
    let mut scrape = crate::metrics::Scrape {
        foreground: snap.queued_foreground as u64,
        background: snap.queued_background as u64,
        ..Default::default()
    };
    for r in waiting
        .iter()
        .filter(|r| r.view.state == berth_core::RunState::Queued)
    {
        let code = r.view.reason.as_ref().map_or("none", |r| r.code.as_str());
        *scrape.reasons.entry(code.to_string()).or_default() += 1;
    }
    scrape.resources = super::status_out(&snap, &Default::default()).resources;
    scrape.scopes = ask(&api, |reply| Msg::ScopeList { reply }).await?;
    let text = api.shared.metrics.render(&scrape);
    Ok((
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
        .into_response())
}

/// The dashboard: one static page, embedded in the binary. It holds no data and no
/// token; it asks the API with the token the user gives it (kept in session storage).
const DASHBOARD: &str = include_str!("../dashboard/index.html");

pub async fn dashboard() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            // Its own inline script and style, calls to this origin, nothing else.
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
            ),
            (header::REFERRER_POLICY, "no-referrer"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        DASHBOARD,
    )
        .into_response()
}
