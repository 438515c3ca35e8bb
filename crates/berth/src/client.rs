//! A small blocking client of the HTTP API, and the simple subcommands built on it.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;

use crate::EXIT_REFUSED;
use berth_client::wire::{
    ErrorBody, ErrorDetail, ReapReport, ReleaseRequest, RenewRequest, Run, RunList, Status,
};
use berth_client::Error;
use berth_core::RunState;
use clap::Args;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Args, Clone, Debug)]
pub struct ConnArgs {
    /// The daemon's URL.
    #[arg(long, env = "BERTH_URL", default_value = "http://127.0.0.1:7420")]
    pub url: String,
    /// A bearer token (takes precedence over --token-file and the state dir's admin
    /// token).
    #[arg(long, env = "BERTH_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// A file holding the token [default: <state dir>/admin.token].
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    /// The daemon's state directory, where its admin token is read from
    /// [default: $XDG_STATE_HOME/berth, else ~/.local/state/berth].
    #[arg(long, env = "BERTH_STATE_DIR", value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// Print JSON for scripts instead of a table or a line.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub conn: ConnArgs,
}

#[derive(Args)]
pub struct RunsArgs {
    /// Ended runs too (released, expired, cancelled), with how they ended.
    #[arg(long)]
    pub all: bool,
    #[command(flatten)]
    pub conn: ConnArgs,
}

#[derive(Args)]
pub struct RenewArgs {
    /// The run to renew.
    pub run_id: String,
    /// The lease's fence (required for a granted run; leave out for a queued one).
    #[arg(long)]
    pub fence: Option<u64>,
    /// New ttl, e.g. 5m [default: the run's own].
    #[arg(long, value_parser = crate::args::parse_duration)]
    pub ttl: Option<u64>,
    #[command(flatten)]
    pub conn: ConnArgs,
}

#[derive(Args)]
pub struct WaitArgs {
    /// The run to wait for (a detached waiter, or any run).
    pub run_id: String,
    /// Give up after this long, e.g. 10m (the run keeps waiting) [default: until it
    /// leaves the queue].
    #[arg(long, value_parser = crate::args::parse_duration)]
    pub timeout: Option<u64>,
    #[command(flatten)]
    pub conn: ConnArgs,
}

/// How long one `GET /v1/runs/{id}?wait_s=` of `berth wait` lasts (the server's own
/// bound is longer; a short one lets the client notice a dead daemon sooner).
const WAIT_ROUND_S: u64 = 60;

/// `berth wait RUN_ID`: follows a run until it is granted (exit 0, the lease printed)
/// or ends without a grant (75 if its wait ran out, 69 otherwise). A run still queued
/// at `--timeout` exits 75 and keeps its place.
pub fn wait_main(a: WaitArgs) -> anyhow::Result<u8> {
    let c = Client::new(&a.conn)?;
    let until = a
        .timeout
        .map(|t| std::time::Instant::now() + Duration::from_millis(t));
    // A look first: `?wait_s=` waits for a change, and a run granted already has none
    // coming (this waited a whole round for it).
    let mut first = true;
    loop {
        let left_s = until.map_or(WAIT_ROUND_S, |u| {
            u.saturating_duration_since(std::time::Instant::now())
                .as_secs()
        });
        let path = if std::mem::take(&mut first) {
            format!("/v1/runs/{}", a.run_id)
        } else {
            // `state=queued`: a grant between the last look and this poll is answered
            // at once (it is no change to wait for).
            format!(
                "/v1/runs/{}?wait_s={}&state=queued",
                a.run_id,
                left_s.clamp(1, WAIT_ROUND_S)
            )
        };
        let r = match c.call::<()>("GET", &path, None) {
            Ok(r) => r,
            Err(e) => return Ok(c.unreachable(&e)),
        };
        if r.status >= 300 {
            return print_reply(&r, a.conn.json, |_: &Value| String::new());
        }
        let run: Run = r.parse()?;
        let out_of_time = until.is_some_and(|u| std::time::Instant::now() >= u);
        if run.state == RunState::Queued && !out_of_time {
            continue;
        }
        print_reply(&r, a.conn.json, crate::show::run_line)?;
        return Ok(match run.state {
            RunState::Granted => 0,
            RunState::Queued | RunState::Expired => crate::EXIT_TIMEOUT,
            _ => crate::EXIT_REFUSED,
        });
    }
}

#[derive(Args)]
pub struct ReleaseArgs {
    /// The run to release.
    pub run_id: String,
    /// The lease's fence.
    #[arg(long)]
    pub fence: u64,
    #[command(flatten)]
    pub conn: ConnArgs,
}

/// The default state directory: XDG_STATE_HOME/berth, else ~/.local/state/berth
/// (`--state-dir` and BERTH_STATE_DIR come first, through clap).
pub fn default_state_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("BERTH_STATE_DIR") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_STATE_HOME") {
        return PathBuf::from(d).join("berth");
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/tmp"));
    home.join(".local/state/berth")
}

/// The longest any one plain request may take (a long poll asks for its own): a daemon
/// that accepts and never answers must not hang a command for good.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(120);

/// The longest a streamed answer (a runtime's start: builds, ready probes) may take.
pub const STREAM_TIMEOUT: Duration = Duration::from_secs(3_600);

/// The CLI's handle on the daemon: berth-client's async client (the one HTTP client
/// berth has), driven on [`runtime`] by the blocking subcommands and awaited directly
/// by `berth run`'s async parts. Any status is an answer ([`Reply`]); only a daemon
/// that cannot be reached, or does not answer in time, is an error.
pub struct Client {
    inner: berth_client::Client,
    pub url: String,
    /// Without a token: which file was tried and why it gave none (said with a 401).
    no_token: Option<String>,
}

/// An answer: its status and body as sent (printed as is with `--json`), read into
/// API v1's types with [`Reply::parse`] and [`Reply::error`].
pub struct Reply {
    pub status: u16,
    pub body: Value,
}

impl Reply {
    /// The body as the API type `T`.
    pub fn parse<T: DeserializeOwned>(&self) -> anyhow::Result<T> {
        T::deserialize(&self.body).with_context(|| {
            format!(
                "berth answered {} with a body that is not API v1",
                self.status
            )
        })
    }

    /// The refusal in the body (or the body itself as the message, if it is not one).
    pub fn error(&self) -> ErrorDetail {
        error_of(&self.body)
    }
}

/// The refusal in an error body (or the body itself as the message, if it is not one).
pub fn error_of(body: &Value) -> ErrorDetail {
    match ErrorBody::deserialize(body) {
        Ok(b) => b.error,
        Err(_) => ErrorDetail {
            code: "error".into(),
            message: match body {
                Value::String(s) => s.clone(),
                v => v.to_string(),
            },
            details: Value::Null,
        },
    }
}

impl Client {
    pub fn new(a: &ConnArgs) -> anyhow::Result<Client> {
        let mut no_token = None;
        let token = match (&a.token, &a.token_file) {
            (Some(t), _) => Some(t.clone()),
            (None, Some(f)) => Some(
                std::fs::read_to_string(f)
                    .with_context(|| format!("reading the token file {}", f.display()))?
                    .trim()
                    .to_string(),
            ),
            (None, None) => {
                let dir = a.state_dir.clone().unwrap_or_else(default_state_dir);
                let f = dir.join("admin.token");
                match std::fs::read_to_string(&f) {
                    Ok(t) => Some(t.trim().to_string()),
                    Err(e) => {
                        no_token = Some(format!(
                            "no token was sent: {} could not be read ({e}); pass --token, BERTH_TOKEN, --token-file or --state-dir",
                            f.display()
                        ));
                        None
                    }
                }
            }
        };
        let url = a.url.trim_end_matches('/').to_string();
        let inner = berth_client::Client::new(&url, token)?;
        Ok(Client {
            inner,
            url,
            no_token,
        })
    }

    /// One request with a JSON reply. Connection failures are `Err`.
    pub fn call<B: Serialize>(
        &self,
        method: &str,
        path: &str,
        body: Option<&B>,
    ) -> Result<Reply, Error> {
        self.call_within(method, path, body, CALL_TIMEOUT)
    }

    /// [`Client::call`] that gives up after `within`, however the daemon behaves (a
    /// frozen daemon accepts the connection and then says nothing: `berth run` must
    /// not wait past its lease for a renew's answer, issue 33 item 9).
    pub fn call_within<B: Serialize>(
        &self,
        method: &str,
        path: &str,
        body: Option<&B>,
        within: Duration,
    ) -> Result<Reply, Error> {
        runtime().block_on(self.call_async(method, path, body, within))
    }

    /// [`Client::call_within`] for async callers (`berth run`'s renewals, registration
    /// and release).
    pub async fn call_async<B: Serialize>(
        &self,
        method: &str,
        path: &str,
        body: Option<&B>,
        within: Duration,
    ) -> Result<Reply, Error> {
        let body = request_body(method, body);
        let exchange = async {
            let answer = self
                .inner
                .exchange(method, path, body.as_ref(), "application/json", &[])
                .await?;
            let status = answer.status;
            Ok::<_, Error>((status, answer.bytes().await?))
        };
        let (status, bytes) = self.within(within, exchange).await?;
        let text = String::from_utf8_lossy(&bytes).into_owned();
        let mut body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        self.explain_401(status, &mut body);
        Ok(Reply { status, body })
    }

    /// `f`, or an error once `within` has passed.
    async fn within<T>(
        &self,
        within: Duration,
        f: impl std::future::Future<Output = Result<T, Error>>,
    ) -> Result<T, Error> {
        let within = within.max(Duration::from_millis(1));
        tokio::time::timeout(within, f).await.unwrap_or_else(|_| {
            Err(Error::Unreachable {
                addr: self.url.clone(),
                what: format!("no answer within {within:?}"),
            })
        })
    }

    /// A 401 without a token says which file was tried.
    pub fn explain_401(&self, status: u16, body: &mut Value) {
        if let (401, Some(why)) = (status, &self.no_token) {
            if let Ok(mut b) = ErrorBody::deserialize(&*body) {
                b.error.message = format!("{} ({why})", b.error.message);
                *body = serde_json::to_value(b).unwrap_or_default();
            }
        }
    }

    /// The daemon could not be reached: said once, with what to do; exit 69.
    pub fn unreachable(&self, e: &Error) -> u8 {
        eprintln!(
            "berth: cannot reach berth at {}: {e}; is `berth serve` running? (set --url or BERTH_URL)",
            self.url
        );
        EXIT_REFUSED
    }

    /// A POST answered as a stream of JSON lines (an acquire that waits, a runtime
    /// start).
    pub fn post_stream(
        &self,
        path: &str,
        body: &impl Serialize,
    ) -> Result<(u16, Box<dyn std::io::BufRead + Send>), Error> {
        self.post_stream_within(path, body, STREAM_TIMEOUT)
    }

    /// [`Client::post_stream`] whose whole answer must have come within `within`.
    pub fn post_stream_within(
        &self,
        path: &str,
        body: &impl Serialize,
        within: Duration,
    ) -> Result<(u16, Box<dyn std::io::BufRead + Send>), Error> {
        let deadline = std::time::Instant::now() + within.max(Duration::from_millis(1));
        let body = request_body("POST", Some(body));
        let answer = runtime().block_on(
            self.within(
                within,
                self.inner
                    .exchange("POST", path, body.as_ref(), "application/x-ndjson", &[]),
            ),
        )?;
        let status = answer.status;
        let reader = BlockingBody::new(answer, Some(deadline));
        Ok((status, Box::new(std::io::BufReader::new(reader))))
    }

    /// A GET answered with lines (the journal, an event stream), read as it comes.
    /// `headers` are sent besides the token; the answer's headers come back by name.
    pub fn get_stream(&self, path: &str, headers: &[(&str, String)]) -> Result<Streamed, Error> {
        let answer = runtime().block_on(self.within(
            CALL_TIMEOUT,
            self.inner.exchange("GET", path, None, "*/*", headers),
        ))?;
        let status = answer.status;
        let head = answer
            .headers
            .iter()
            .filter_map(|(k, v)| Some((k.as_str().to_string(), v.to_str().ok()?.to_string())))
            .collect();
        Ok(Streamed {
            status,
            headers: head,
            body: Box::new(std::io::BufReader::new(BlockingBody::new(answer, None))),
        })
    }
}

/// The one runtime the blocking subcommands drive berth-client on. Process-wide and
/// never dropped: a runtime dropped where blocking is not allowed panics.
pub fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a tokio runtime for the CLI")
    })
}

/// The JSON a request sends: `body`, or `{}` for a POST without one.
fn request_body<B: Serialize>(method: &str, body: Option<&B>) -> Option<Value> {
    match body.and_then(|b| serde_json::to_value(b).ok()) {
        Some(v) => Some(v),
        None if method == "POST" => Some(Value::Object(Default::default())),
        None => None,
    }
}

/// An answer's body as a blocking reader, pulled piece by piece on [`runtime`]; with
/// a deadline, reading past it is an error (a frozen daemon sends nothing for good).
struct BlockingBody {
    answer: berth_client::Answer,
    piece: bytes::Bytes,
    deadline: Option<std::time::Instant>,
}

impl BlockingBody {
    fn new(answer: berth_client::Answer, deadline: Option<std::time::Instant>) -> BlockingBody {
        BlockingBody {
            answer,
            piece: bytes::Bytes::new(),
            deadline,
        }
    }
}

impl std::io::Read for BlockingBody {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        use std::io::{Error as IoError, ErrorKind};
        while self.piece.is_empty() {
            let next = self.answer.chunk();
            let got = match self.deadline {
                None => runtime().block_on(next),
                Some(d) => {
                    let left = d.saturating_duration_since(std::time::Instant::now());
                    // The timer is made inside the runtime, which it needs.
                    runtime()
                        .block_on(async { tokio::time::timeout(left, next).await })
                        .map_err(|_| IoError::new(ErrorKind::TimedOut, "no answer in time"))?
                }
            };
            match got.map_err(IoError::other)? {
                Some(p) => self.piece = p,
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.piece.len());
        buf[..n].copy_from_slice(&self.piece.split_to(n));
        Ok(n)
    }
}

/// An answer read as a stream.
pub struct Streamed {
    pub status: u16,
    /// The answer's headers, by lower-case name.
    pub headers: std::collections::BTreeMap<String, String>,
    pub body: Box<dyn std::io::BufRead + Send>,
}

pub fn error_text(body: &Value) -> String {
    let e = error_of(body);
    format!("{}: {}", e.code, e.message)
}

/// A reply for scripts (`--json`) or people; 0 for success, 1 for an error reply.
pub fn print_reply<T: DeserializeOwned>(
    r: &Reply,
    json: bool,
    human: impl Fn(&T) -> String,
) -> anyhow::Result<u8> {
    if json {
        println!("{}", serde_json::to_string_pretty(&r.body)?);
    } else if r.status < 300 {
        println!("{}", human(&r.parse()?));
    } else {
        eprintln!("berth: {}", error_text(&r.body));
    }
    Ok(if r.status < 300 { 0 } else { 1 })
}

/// G4: a drain in force, and the runs and registrations it waits for.
fn print_drain(c: &Client) {
    let Ok(r) = c.call::<()>("GET", "/v1/drain", None) else {
        return;
    };
    let Ok(d) = r.parse::<berth_client::wire::Drain>() else {
        return;
    };
    let ids: Vec<&str> = d.waiting_for.iter().map(|b| b.id.as_str()).collect();
    if let Some(rec) = &d.drain {
        println!(
            "  draining since {} by {} ({}); waiting for {}: {}",
            rec.at,
            rec.by,
            rec.reason,
            ids.len(),
            ids.join(", ")
        );
    }
    if let Some(f) = &d.fleet_drain {
        println!(
            "  the fleet is draining since {} by {} on {} ({}); waiting for {}: {}",
            f.at,
            f.by,
            f.host,
            f.reason,
            ids.len(),
            ids.join(", ")
        );
    }
}

pub fn status_main(a: StatusArgs) -> anyhow::Result<u8> {
    let c = Client::new(&a.conn)?;
    let r = match c.call::<()>("GET", "/v1/status", None) {
        Ok(r) => r,
        Err(e) => return Ok(c.unreachable(&e)),
    };
    if r.status >= 300 || a.conn.json {
        return print_reply(&r, a.conn.json, |_: &Value| String::new());
    }
    let s: Status = r.parse()?;
    println!("berth at {}", c.url);
    print_resources(&s);
    if let Some(m) = s.memory_available {
        println!(
            "  host memory available {} (granted but not yet in use {})",
            berth_core::fmt_bytes(m),
            berth_core::fmt_bytes(s.memory_pending)
        );
    }
    print_host_figures(&s);
    println!(
        "  runs: {} granted, {} degraded; queued {} foreground, {} background; at most {} at once (now {})",
        s.granted, s.degraded, s.queued.foreground, s.queued.background, s.slots_max, s.effective_max_now
    );
    if let Some(r) = &s.min_run_blocked {
        println!("  a default-size run cannot start now: {}", r.message);
    }
    print_drain(&c);
    let reaper = &s.reaper;
    println!(
        "  reaper: {} processes terminated, {} reused pids left alone, diagnostics {} ({} archives dropped)",
        reaper.processes_terminated,
        reaper.reused_pids_protected,
        berth_core::fmt_bytes(reaper.diagnostics_bytes),
        reaper.diagnostics_dropped
    );
    for p in &s.projects {
        // C3: how it runs, and the proof it runs in parallel on.
        let proof = p.evidence.as_ref().map_or(String::new(), |e| {
            let commit = e.commit.as_deref().map_or("no commit".into(), |c| {
                format!("commit {}", &c[..c.len().min(12)])
            });
            let when = crate::show::ago(&e.at).unwrap_or_else(|| e.at.clone());
            format!(
                "; proven by {} {when} on {commit}, ports {}",
                e.run_id,
                e.ports.join(",")
            )
        });
        println!(
            "  project {:<24} {} active, {} waiting, {} degraded ({}{proof})",
            p.project,
            p.active,
            p.waiting,
            p.degraded,
            p.concurrency.as_str()
        );
    }
    Ok(0)
}

/// The status table of resources.
fn print_resources(s: &Status) {
    println!(
        "  {:<12} {:>12} {:>12} {:>12} {:>12}",
        "resource", "committed", "allocatable", "total", "reserve"
    );
    for res in &s.resources {
        let name = res.name.as_str();
        let f = |n: u64| match name {
            "memory" | "disk" => berth_core::fmt_bytes(n),
            "cpu_millis" => format!("{} cpu", crate::show::cpus(n)),
            _ => n.to_string(),
        };
        println!(
            "  {:<12} {:>12} {:>12} {:>12} {:>12}",
            if name == "cpu_millis" { "cpu" } else { name },
            f(res.committed),
            f(res.allocatable),
            f(res.total),
            f(res.reserve)
        );
    }
}

/// Issue 36: the workspaces' free disk, and whether runs are held to their claims.
fn print_host_figures(s: &Status) {
    if let Some(d) = s.disk_free {
        println!(
            "  workspaces' disk free {} (granted but not yet written {})",
            berth_core::fmt_bytes(d),
            berth_core::fmt_bytes(s.disk_pending)
        );
    }
    // Issue 36: whether runs are held to their claims.
    match (&s.limits.how, &s.limits.why_not) {
        (Some(how), _) => println!(
            "  limits: runs held to their claims by {how} (hard memory limit {}% of the claim, {} processes per run)",
            s.limits.memory_max_percent, s.limits.pids_max
        ),
        (None, why) => println!(
            "  limits: NOT enforced ({}); runs are admitted by their claims but not held to them",
            why.as_deref().unwrap_or("unknown")
        ),
    }
}

pub fn runs_main(a: RunsArgs) -> anyhow::Result<u8> {
    let c = Client::new(&a.conn)?;
    let path = if a.all {
        "/v1/runs?all=true"
    } else {
        "/v1/runs"
    };
    let r = match c.call::<()>("GET", path, None) {
        Ok(r) => r,
        Err(e) => return Ok(c.unreachable(&e)),
    };
    if r.status >= 300 || a.conn.json {
        return print_reply(&r, a.conn.json, |_: &Value| String::new());
    }
    let list: RunList = r.parse()?;
    println!(
        "{:<20} {:<16} {:<9} {:>7} {:>6} {:>4} {:<12} {:<34} {:<28} reason",
        "run", "project", "state", "age", "fence", "pos", "expires", "claim", "memory use"
    );
    for run in &list.runs {
        // How long it has been granted (or waiting).
        let age = run
            .since
            .as_deref()
            .and_then(crate::show::parse_utc)
            .map(|t| crate::show::duration((crate::show::now_s() - t).max(0) as u64))
            .unwrap_or_default();
        let num = |n: Option<u64>| n.map(|f| f.to_string()).unwrap_or_default();
        println!(
            "{:<20} {:<16} {:<9} {:>7} {:>6} {:>4} {:<12} {:<34} {:<28} {}",
            run.run_id,
            run.project,
            run.state.as_str(),
            age,
            num(run.fence),
            num(run.position),
            run.expires_at
                .as_deref()
                .and_then(crate::show::relative)
                .unwrap_or_default(),
            crate::show::claim(&run.claim.resources),
            crate::show::usage(run),
            run.reason.as_ref().map_or("", |r| r.message.as_str())
        );
    }
    Ok(0)
}

pub fn renew_main(a: RenewArgs) -> anyhow::Result<u8> {
    let c = Client::new(&a.conn)?;
    let body = RenewRequest {
        fence: a.fence,
        ttl_s: a.ttl.map(|t| (t / 1000).max(1)),
    };
    match c.call("POST", &format!("/v1/runs/{}/renew", a.run_id), Some(&body)) {
        Ok(r) => print_reply(&r, a.conn.json, crate::show::run_line),
        Err(e) => Ok(c.unreachable(&e)),
    }
}

pub fn release_main(a: ReleaseArgs) -> anyhow::Result<u8> {
    let c = Client::new(&a.conn)?;
    let body = ReleaseRequest { fence: a.fence };
    match c.call(
        "POST",
        &format!("/v1/runs/{}/release", a.run_id),
        Some(&body),
    ) {
        Ok(r) => print_reply(&r, a.conn.json, crate::show::run_line),
        Err(e) => Ok(c.unreachable(&e)),
    }
}

pub fn reap_main(a: ConnArgs) -> anyhow::Result<u8> {
    let c = Client::new(&a)?;
    match c.call::<()>("POST", "/v1/reap", None) {
        Ok(r) => print_reply(&r, a.json, |b: &ReapReport| {
            let mut line = format!(
                "reaped {} of {} runs being released ({} degraded); {} processes terminated, {} reused pids left alone",
                b.reaped, b.examined, b.degraded, b.processes_terminated, b.reused_pids_protected
            );
            for (what, ids) in [("reaped", &b.reaped_runs), ("degraded", &b.degraded_runs)] {
                if !ids.is_empty() {
                    line.push_str(&format!("\n{what}: {}", ids.join(" ")));
                }
            }
            line
        }),
        Err(e) => Ok(c.unreachable(&e)),
    }
}
