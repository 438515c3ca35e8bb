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
/// Batches buffered for one stream; past it the stream's reader waits, and once it is
/// `SUBSCRIBER_LAG_MAX` entries behind the journal it is cut off. With
/// `STREAM_BATCH_BYTES` a batch, a stream that stopped reading holds at most about
/// half a megabyte (issue 32 finding 3: 64 pages of history each held 2.8 GB for
/// 100 stalled readers).
const STREAM_BUFFER: usize = 8;
/// A batch is handed over once it holds this many bytes (a page of history is cut
/// into several).
const STREAM_BATCH_BYTES: usize = 64 * 1024;
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

/// `GET /v1/journal/export?from=SEQ&through=SEQ[&scope=ID]`: every entry from `from`
/// (default 1) through `through` (default: the last), as ndjson, with the SHA-256 of
/// exactly those bytes in `X-Berth-Journal-Sha256` and the range in
/// `X-Berth-Journal-First` and `-Through`. Entries are stored as they were first
/// rendered, so the same request always gives the same bytes, or, once retention has
/// deleted the start of its range, `410 journal_pruned` naming the first entry kept
/// (never a shorter export under the same name: issue 32 finding 8). With `scope`,
/// only that experiment scope's entries (frozen, tokens, control).
///
/// Streamed (issue 32 finding 3): the digest is taken over the range a page at a
/// time, then the same pages are sent, so an export holds about a megabyte whatever
/// its length; its range is held against retention meanwhile, and at most
/// `EXPORTS_MAX` run at once (`429 too_many_exports`).
pub async fn export(AxState(api): AxState<Api>, params: Params) -> Result<Response, ApiError> {
    let j = &api.shared.journal;
    let (from, range) = export_range(&params, j.last())?;
    let hold = j.hold(from).ok_or_else(|| {
        ApiError::new(
            429,
            "too_many_exports",
            format!(
                "{} exports are under way, the most at once: try again when one ends",
                crate::journal::EXPORTS_MAX
            ),
        )
        .with(serde_json::json!({"max": crate::journal::EXPORTS_MAX}))
    })?;
    // Read after the hold is taken: no prune after this moves the start.
    let first = j.first().await.map_err(store_unavailable)?;
    let pruned = range.through > 0 && first > from;
    let pruned_error = || {
        ApiError::new(
            410,
            "journal_pruned",
            format!(
                "entries before {first} are deleted by retention: export from {first} or later"
            ),
        )
        .with(serde_json::json!({"first": first, "from": from}))
    };
    if pruned && range.scope.is_none() {
        return Err(pruned_error());
    }
    let (hex, opens_with) = range.digest(j).await.map_err(store_unavailable)?;
    // A scope's story is whole if what is kept of it starts where it was frozen:
    // entries deleted before that were not its own.
    if pruned && opens_with.as_deref() != Some("scope_frozen") {
        return Err(pruned_error());
    }
    let through = range.through;
    let body = range.stream(api.shared.clone(), hold);
    let h = |n: &'static str| header::HeaderName::from_static(n);
    Ok((
        [
            (header::CONTENT_TYPE, "application/x-ndjson".to_string()),
            (h("x-berth-journal-sha256"), hex),
            (h("x-berth-journal-first"), from.min(through).to_string()),
            (h("x-berth-journal-through"), through.to_string()),
        ],
        body,
    )
        .into_response())
}

/// An export's `from` and range, checked.
fn export_range(params: &Params, last: u64) -> Result<(u64, Range), ApiError> {
    let scope = params.0.get("scope").cloned();
    if let Some(s) = &scope {
        crate::request::check_scope(s)?;
    }
    let through = number(params, "through")?.unwrap_or(last);
    if through > last {
        return Err(ApiError::invalid(
            "through",
            format!("is past the journal's last entry ({last})"),
        ));
    }
    let from = number(params, "from")?.unwrap_or(1);
    if from == 0 || from > through.max(1) {
        return Err(ApiError::invalid(
            "from",
            format!("must be from 1 to through ({through})"),
        ));
    }
    let range = Range {
        after: from - 1,
        through,
        scope,
    };
    Ok((from, range))
}

/// The `kind` of a page's first line.
fn first_kind(page: &[u8]) -> Option<String> {
    let line = page.split(|&b| b == b'\n').next()?;
    let v: serde_json::Value = serde_json::from_slice(line).ok()?;
    v["kind"].as_str().map(str::to_string)
}

/// Entries one export page reads (the ledger's read bound: reading less unpacks the
/// same stored chunk several times): ~300 KB.
const EXPORT_PAGE: usize = JOURNAL_LIMIT_MAX;
/// An export is sent in slices of this size, and buffers `EXPORT_PAGES_BUFFERED`
/// of them ahead of a slow reader: with the page being read and its bytes, about
/// 0.9 MiB an export.
const EXPORT_SLICE_BYTES: usize = 64 * 1024;
const EXPORT_PAGES_BUFFERED: usize = 4;
/// How long an export waits for its reader to take the next slice before it is cut
/// (its place among `EXPORTS_MAX` and its hold on the journal are given back).
const EXPORT_STALL_MAX: Duration = Duration::from_secs(30);

/// An export's range: the entries after `after` through `through`, of `scope` only if
/// given.
struct Range {
    after: u64,
    through: u64,
    scope: Option<String>,
}

impl Range {
    /// The SHA-256 of the range's bytes (hex), and the kind of its first entry.
    async fn digest(
        &self,
        j: &Journal,
    ) -> Result<(String, Option<String>), berth_store::StoreError> {
        let mut digest = Sha256::new();
        let mut opens_with = None;
        self.pages(j, |page| {
            if opens_with.is_none() {
                opens_with = Some(first_kind(page));
            }
            digest.update(page);
            std::future::ready(true)
        })
        .await?;
        let hex = digest
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        Ok((hex, opens_with.flatten()))
    }

    /// The range's bytes as a body, read again page by page as the reader takes them;
    /// `hold` keeps the range from retention until the last is sent.
    fn stream(self, shared: Arc<crate::daemon::Shared>, hold: crate::journal::Hold) -> Body {
        let (tx, rx) = mpsc::channel::<Bytes>(EXPORT_PAGES_BUFFERED);
        tokio::spawn(async move {
            let _hold = hold;
            let _reader = Reader::new();
            let sent = self
                .pages(&shared.journal, |page| {
                    // Sent in slices: a slow reader holds a few of them, not pages.
                    let tx = tx.clone();
                    let slices: Vec<Bytes> = page
                        .chunks(EXPORT_SLICE_BYTES)
                        .map(Bytes::copy_from_slice)
                        .collect();
                    async move {
                        for b in slices {
                            // A reader that stops reading is cut: it would hold an
                            // export's place and its range of the journal for good.
                            let sent = tokio::time::timeout(EXPORT_STALL_MAX, tx.send(b)).await;
                            if !matches!(sent, Ok(Ok(()))) {
                                return false;
                            }
                        }
                        true
                    }
                })
                .await;
            if sent.is_err() {
                // The reader sees a body shorter than its digest says: never other bytes.
                tracing::warn!("journal export cut short: the ledger could not be read");
            }
        });
        Body::from_stream(futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx))
        }))
    }

    /// Hands each page's ndjson bytes to `each`, in order, until the range is done or
    /// `each` answers false (the reader went away).
    async fn pages<F, Fut>(&self, j: &Journal, mut each: F) -> Result<(), berth_store::StoreError>
    where
        F: FnMut(&[u8]) -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let mut after = self.after;
        let mut page = Vec::new();
        while after < self.through {
            let want = (self.through - after).min(EXPORT_PAGE as u64) as usize;
            let got = j.read(after, want).await?;
            let Some(end) = got.last().map(|e| e.seq) else {
                break;
            };
            page.clear();
            for e in got.iter().filter(|e| e.seq <= self.through) {
                if self.scope.as_ref().is_none_or(|s| of_scope(e, s)) {
                    page.extend_from_slice(e.line.as_bytes());
                    page.push(b'\n');
                }
            }
            drop(got);
            if !page.is_empty() && !each(&page).await {
                break;
            }
            after = end;
        }
        Ok(())
    }
}

/// Streams and exports under way. When the last one ends its buffers are given back to
/// the system (issue 32 finding 3: 100 stalled streams kept 2.7 GB after they closed).
static READERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

struct Reader;

impl Reader {
    fn new() -> Reader {
        READERS.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        Reader
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        if READERS.fetch_sub(1, std::sync::atomic::Ordering::AcqRel) == 1 {
            crate::memory::release();
        }
    }
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
        let _reader = Reader::new();
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
            if crate::journal::admits(filter, e) {
                sse(e, &mut out.batch);
            }
            *after = e.seq;
            if out.batch.len() >= STREAM_BATCH_BYTES {
                out.deliver(*after).await?;
            }
        }
        out.deliver(*after).await?;
    }
    Ok(())
}

/// `GET /metrics`: Prometheus' text format.
pub async fn metrics(AxState(api): AxState<Api>) -> Result<Response, ApiError> {
    let (snap, _) = ask(&api, |reply| Msg::Status { reply }).await?;
    let mut waiting = ask(&api, |reply| Msg::List {
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
    super::runs::proc_usage(&mut waiting).await;
    for r in waiting.iter().filter(|r| r.view.state.holds_claim()) {
        if let Some(usage) = r.usage {
            scrape.runs.push(crate::metrics::RunUse {
                run_id: r.view.run_id.clone(),
                memory_claim: r.view.resources.memory,
                usage,
            });
        }
    }
    for r in waiting
        .iter()
        .filter(|r| r.view.state == berth_core::RunState::Queued)
    {
        let code = r.view.reason.as_ref().map_or("none", |r| r.code.as_str());
        *scrape.reasons.entry(code.to_string()).or_default() += 1;
    }
    scrape.resources =
        super::status_out(&snap, &Default::default(), &api.shared.enforcement).resources;
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
