//! Getting the lease: the acquire, followed on its NDJSON stream with a waiting line,
//! retried while berth is away or says "not now" (503) within `--wait`, and the
//! runtime start (C7) under the lease.

use super::*;

pub(super) enum Admission {
    Granted(Box<Run>),
    /// Exit code and message.
    Refused(u8, String),
}

/// Maps a refusal to the CLI's exit code: 75 for an admission timeout, 69 otherwise.
pub(super) fn refusal(err: &ErrorDetail) -> (u8, String) {
    let msg = format!("{}: {}", err.code, err.message);
    if err.code == "expired" {
        (EXIT_TIMEOUT, msg)
    } else {
        (EXIT_REFUSED, msg)
    }
}

/// `--runtime` (C7): starts the project's runtime under the lease, its progress on one
/// live line. Err: the exit code (69) and what failed, with the port's last lines.
/// (On a blocking thread: the lease is kept meanwhile.)
pub(super) async fn start_runtime(
    client: &Arc<Client>,
    run_id: &str,
    fence: u64,
) -> Result<(), (u8, String)> {
    let (client, run_id) = (client.clone(), run_id.to_string());
    tokio::task::spawn_blocking(move || {
        let line = WaitLine::new("runtime");
        let result = start_runtime_with(&client, &run_id, fence, &line);
        line.done();
        result
    })
    .await
    .unwrap_or_else(|e| Err((EXIT_REFUSED, e.to_string())))
}

pub(super) fn start_runtime_with(
    client: &Client,
    run_id: &str,
    fence: u64,
    line: &WaitLine,
) -> Result<(), (u8, String)> {
    let path = format!("/v1/runs/{run_id}/runtime");
    let body = RuntimeRequest { fence };
    let unreachable = |e: berth_client::Error| {
        (
            EXIT_REFUSED,
            format!("cannot reach berth at {}: {e}", client.url),
        )
    };
    let (status, reader) = client.post_stream(&path, &body).map_err(unreachable)?;
    if status != 200 {
        let mut text = String::new();
        let mut reader = reader;
        let _ = std::io::Read::read_to_string(&mut reader, &mut text);
        let v: Value = serde_json::from_str(&text).unwrap_or(Value::String(text));
        return Err((EXIT_REFUSED, error_text(&v)));
    }
    for l in reader.lines() {
        let Ok(l) = l else { break };
        let Ok(event) = serde_json::from_str::<RuntimeEvent>(&l) else {
            continue;
        };
        match event {
            RuntimeEvent::Building { port } => line.queued(format!("building {port}")),
            RuntimeEvent::Launched { port, number, .. } => {
                line.queued(format!("launched {port} on {number}"))
            }
            RuntimeEvent::Ready { port } => line.queued(format!("ready {port}")),
            RuntimeEvent::Done { .. } => return Ok(()),
            RuntimeEvent::Failed {
                port,
                why,
                log_tail,
            } => {
                let tail: String = log_tail.iter().map(|l| format!("\n  | {l}")).collect();
                return Err((EXIT_REFUSED, format!("failed {port}: {why}{tail}")));
            }
        }
    }
    Err((
        EXIT_REFUSED,
        "the runtime start ended without an answer".into(),
    ))
}

/// How long `berth run` keeps trying to reach a daemon that is restarting.
pub(super) const RECONNECT_FOR: Duration = Duration::from_secs(30);

/// The waiting line. On a terminal it is one line redrawn every second (so its elapsed
/// time ticks between the daemon's events); otherwise a plain timestamped line per
/// event, for logs.
pub(super) struct WaitLine {
    tty: bool,
    /// What the line is about: `waiting` (admission) or `runtime` (its start).
    what: &'static str,
    started: Instant,
    /// The daemon's last word (position and reason); `None` once admitted or refused.
    text: Arc<std::sync::Mutex<Option<String>>>,
}

impl WaitLine {
    pub(super) fn new(what: &'static str) -> WaitLine {
        let w = WaitLine {
            tty: std::io::stderr().is_terminal(),
            what,
            started: Instant::now(),
            text: Arc::new(std::sync::Mutex::new(None)),
        };
        if w.tty {
            let (text, started) = (w.text.clone(), w.started);
            std::thread::spawn(move || loop {
                std::thread::sleep(Duration::from_secs(1));
                match &*text.lock().unwrap() {
                    Some(t) => draw(what, t, started),
                    None => return,
                }
            });
        }
        w
    }

    pub(super) fn queued(&self, text: String) {
        if self.tty {
            draw(self.what, &text, self.started);
        } else {
            eprintln!(
                "{} berth: {}: {text}, {}",
                crate::show::clock(),
                self.what,
                crate::show::duration(self.started.elapsed().as_secs())
            );
        }
        *self.text.lock().unwrap() = Some(text);
    }

    /// Admitted or refused: the line is cleared (the ticker stops with it).
    pub(super) fn done(&self) {
        if self.text.lock().unwrap().take().is_some() && self.tty {
            eprint!("\r\x1b[K");
            let _ = std::io::stderr().flush();
        }
    }
}

pub(super) fn draw(what: &str, text: &str, started: Instant) {
    eprint!(
        "\r\x1b[Kberth: {what}: {text}, {}",
        crate::show::duration(started.elapsed().as_secs())
    );
    let _ = std::io::stderr().flush();
}

pub(super) fn wait_for_lease(client: &Client, body: &AcquireRequest, wait_ms: u64) -> Admission {
    let line = WaitLine::new("waiting");
    let admission = wait_for_lease_with(client, body, wait_ms, &line);
    line.done();
    admission
}

pub(super) fn wait_for_lease_with(
    client: &Client,
    body: &AcquireRequest,
    wait_ms: u64,
    line: &WaitLine,
) -> Admission {
    let started = Instant::now();
    let wait_until = started + Duration::from_millis(wait_ms);
    let give_up = wait_until + RECONNECT_FOR;
    let mut last_ok = Instant::now();
    // Fail fast: a daemon never reached is not running (or not there); retrying is only
    // for one that was reached and went away (a restart, P5).
    let mut ever_reached = false;
    let mut retry = Retry::new(UNREACHABLE);
    loop {
        // The whole stream has a deadline: a daemon that froze says nothing for good.
        let within = give_up.saturating_duration_since(Instant::now());
        match client.post_stream_within("/v1/runs", body, within) {
            Ok((200, reader)) => {
                ever_reached = true;
                last_ok = Instant::now();
                if let Some(done) = follow_acquire(reader, line) {
                    return done;
                }
                // The stream broke without an answer: the daemon went away. Re-post the
                // same run id; it keeps its place (P5).
            }
            Ok((status, reader)) => {
                ever_reached = true;
                if let Some(done) = not_now_or_never(client, status, reader, line, wait_until) {
                    return done;
                }
            }
            Err(e) => {
                if !ever_reached
                    || (last_ok.elapsed() > RECONNECT_FOR && started.elapsed() > RECONNECT_FOR)
                {
                    return Admission::Refused(
                        EXIT_REFUSED,
                        format!(
                            "cannot reach berth at {}: {e}; is `berth serve` running? (set --url or BERTH_URL)",
                            client.url
                        ),
                    );
                }
            }
        }
        if Instant::now() > give_up {
            return Admission::Refused(
                EXIT_TIMEOUT,
                "admission timed out while berth was unreachable".into(),
            );
        }
        std::thread::sleep(retry.failed());
    }
}

/// A refused acquire: the refusal if it is final, or if berth's "not now" (503:
/// draining, a full queue, its ledger or the fleet store away, shutting down) has
/// lasted past `--wait`; `None` to try again, the reason on the waiting line (issue 33
/// item 9).
pub(super) fn not_now_or_never(
    client: &Client,
    status: u16,
    mut reader: impl std::io::Read,
    line: &WaitLine,
    wait_until: Instant,
) -> Option<Admission> {
    let mut text = String::new();
    let _ = reader.read_to_string(&mut text);
    let mut v: Value = serde_json::from_str(&text).unwrap_or(Value::String(text));
    client.explain_401(status, &mut v);
    let error = error_of(&v);
    if !transient(status, &error) {
        let (code, msg) = refusal(&error);
        let code = if status == 410 { code } else { EXIT_REFUSED };
        return Some(Admission::Refused(code, msg));
    }
    line.queued(format!("berth answered {status}: {}", error.message));
    (Instant::now() >= wait_until).then(|| {
        let why = format!(
            "not admitted within --wait: {}: {}",
            error.code, error.message
        );
        Admission::Refused(EXIT_TIMEOUT, why)
    })
}

/// A refusal that is only "not now": a 503 about berth itself, not about the run (a
/// run that ended without a grant says its state, and that is final).
pub(super) fn transient(status: u16, error: &ErrorDetail) -> bool {
    status == 503 && error.details.get("state").is_none()
}

/// Reads a streamed acquire to its answer; `None` when the stream broke first.
pub(super) fn follow_acquire(
    reader: Box<dyn BufRead + Send>,
    line: &WaitLine,
) -> Option<Admission> {
    for l in reader.lines() {
        let Ok(l) = l else { break };
        let Ok(event) = serde_json::from_str::<AcquireEvent>(&l) else {
            continue;
        };
        match event {
            AcquireEvent::Queued {
                position, reason, ..
            } => line.queued(format!(
                "position {}, {}",
                position.map_or("?".into(), |p| p.to_string()),
                reason.map(|r| r.message).unwrap_or_default()
            )),
            AcquireEvent::Granted { lease } => return Some(Admission::Granted(lease)),
            AcquireEvent::Expired { error } | AcquireEvent::Rejected { error } => {
                let (code, msg) = refusal(&error);
                return Some(Admission::Refused(code, msg));
            }
        }
    }
    None
}

pub fn acquire_main(a: AcquireArgs) -> anyhow::Result<u8> {
    let client = Client::new(&a.claim.conn)?;
    let mut body = acquire_body(&a.claim)?;
    body.detach = a.detach.then_some(true);
    // The daemon answers a waiting acquire by its wait's end; a little after that,
    // the answer is not coming.
    let wait = Duration::from_millis(a.claim.wait.unwrap_or(1_800_000));
    let within = wait + crate::client::CALL_TIMEOUT;
    let r = match client.call_within("POST", "/v1/runs", Some(&body), within) {
        Ok(r) => r,
        Err(e) => return Ok(client.unreachable(&e)),
    };
    if a.claim.conn.json {
        println!("{}", serde_json::to_string_pretty(&r.body)?);
    } else if r.status < 300 {
        println!("{}", crate::show::run_line(&r.parse()?));
    }
    Ok(match r.status {
        200..=299 => 0,
        410 if r.error().code == "expired" => EXIT_TIMEOUT,
        _ => {
            eprintln!("berth: {}", error_text(&r.body));
            EXIT_REFUSED
        }
    })
}

/// The pauses of `berth run`'s retries: an acquire while berth is unreachable, a
/// registration, a release.
pub(super) const UNREACHABLE: Backoff = Backoff::new(250, 2_000);
