//! `berth run` and `berth acquire`.
//!
//! `berth run` streams the acquire (showing position and reason), re-posts the same
//! run id if the daemon restarts while it waits (L7, P5), runs CMD in a new process
//! group with the lease's environment, renews at a third of the ttl, forwards SIGINT and
//! SIGTERM to CMD's group, releases when CMD exits and exits with CMD's code.

use berth_client::retry::{Backoff, Retry};
use std::collections::BTreeMap;
use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::anyhow;
use berth_client::wire::{
    AcquireEvent, AcquireRequest, BudgetClaim, ErrorDetail, ProcessRequest, ReleaseRequest, Run,
    RuntimeEvent, RuntimeRequest, UniqueMap,
};
use berth_core::validate;
use berth_core::RunState;
use clap::Args;
use serde_json::Value;

use crate::client::{error_of, error_text, Client, ConnArgs};
use crate::{EXIT_REFUSED, EXIT_TIMEOUT};

/// A flag that takes one of the words of `berth_core`'s codec.
fn words(all: impl Iterator<Item = &'static str>) -> clap::builder::PossibleValuesParser {
    clap::builder::PossibleValuesParser::new(all)
}

#[derive(Args, Debug, Clone)]
pub struct ClaimArgs {
    /// Project (default: the git toplevel's directory name, else the current directory's).
    #[arg(long)]
    pub project: Option<String>,
    /// `managed` runs hold the project's runtime key; `analysis` runs only read
    /// [default: managed].
    #[arg(long, value_parser = words(berth_core::Class::ALL.iter().map(|c| c.as_str())))]
    pub class: Option<String>,
    /// `background` runs wait while any foreground run waits [default: foreground].
    #[arg(long, value_parser = words(berth_core::Priority::ALL.iter().map(|p| p.as_str())))]
    pub priority: Option<String>,
    /// Slots [default: 1].
    #[arg(long)]
    pub slots: Option<u64>,
    /// Memory, e.g. 4GiB [default: the daemon's, 2GiB + 128MiB unless configured].
    #[arg(long, value_parser = crate::args::parse_size)]
    pub memory: Option<u64>,
    /// CPUs, decimal (1.5) or millis (500m) [default: the daemon's, 0.5 unless
    /// configured].
    #[arg(long, value_parser = crate::args::parse_cpus)]
    pub cpus: Option<u64>,
    /// Disk for the workspace, e.g. 20GiB [default: the daemon's, 10GiB unless
    /// configured].
    #[arg(long, value_parser = crate::args::parse_size)]
    pub disk: Option<u64>,
    /// NAME=COUNT of a named resource (repeatable).
    #[arg(long = "resource", value_name = "NAME=COUNT")]
    pub resources: Vec<String>,
    /// An exclusive singleton key (repeatable).
    #[arg(long = "singleton")]
    pub singletons: Vec<String>,
    /// The worktree whose .berth.toml shapes the claim (absolute or relative).
    #[arg(long)]
    pub worktree: Option<PathBuf>,
    /// The run's id; a retry with the same id re-attaches to it [default: a random
    /// `r-…`].
    #[arg(long)]
    pub run_id: Option<String>,
    /// Lease ttl, e.g. 5m [default: 5m]; `berth run` renews every third of it.
    #[arg(long, value_parser = crate::args::parse_duration)]
    pub ttl: Option<u64>,
    /// How long to wait in the queue, e.g. 30m; 0 = do not wait [default: 30m].
    #[arg(long, value_parser = crate::args::parse_duration)]
    pub wait: Option<u64>,
    /// SCOPE:HARNESS: the experiment budget whose harness token is part of the claim;
    /// the run waits with `budget.full` while the harness is at its limit.
    #[arg(long, value_name = "SCOPE:HARNESS")]
    pub budget: Option<String>,
    /// HARNESS=LIMIT,...: the scope's per-harness limits, required the first time the
    /// scope is used (then frozen; a different one is refused).
    #[arg(long, value_name = "HARNESS=LIMIT,...", requires = "budget")]
    pub budget_policy: Option<String>,
    /// The operation the run's token is reserved under [default: run].
    #[arg(long, requires = "budget")]
    pub operation_id: Option<String>,
    /// The agent thread the run works in: BERTH_WORKSPACE is the thread's persistent
    /// workspace (its tmp, logs and output stay the run's own).
    #[arg(long, value_name = "KEY")]
    pub thread: Option<String>,
    #[command(flatten)]
    pub conn: ConnArgs,
}

/// `--budget`, `--budget-policy` and `--operation-id` as the acquire's budget.
fn budget_of(c: &ClaimArgs) -> anyhow::Result<Option<BudgetClaim>> {
    let Some(b) = &c.budget else {
        return Ok(None);
    };
    let (scope, harness) = b
        .split_once(':')
        .ok_or_else(|| anyhow!("--budget {b:?}: expected SCOPE:HARNESS"))?;
    let per_harness = match &c.budget_policy {
        Some(p) => {
            let mut m = BTreeMap::new();
            for pair in p.split(',') {
                let (h, n) = pair
                    .split_once('=')
                    .ok_or_else(|| anyhow!("--budget-policy {pair:?}: expected HARNESS=LIMIT"))?;
                let n: u32 = n
                    .parse()
                    .map_err(|_| anyhow!("--budget-policy {pair:?}: LIMIT must be 1 to 1024"))?;
                if m.insert(h.to_string(), n).is_some() {
                    return Err(anyhow!("--budget-policy: {h} appears twice"));
                }
            }
            Some(UniqueMap(m))
        }
        None => None,
    };
    Ok(Some(BudgetClaim {
        scope: scope.into(),
        harness: harness.into(),
        per_harness,
        operation_id: c.operation_id.clone(),
        manifest: None,
    }))
}

#[derive(Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub claim: ClaimArgs,
    /// Start the project's runtime (the worktree contract's [[port]] commands, each
    /// until its ready probe answers) before CMD; CMD finds each at BERTH_URL_<NAME>.
    #[arg(long)]
    pub runtime: bool,
    /// The command to run, after `--`.
    #[arg(last = true, required = true)]
    pub cmd: Vec<String>,
}

#[derive(Args)]
pub struct AcquireArgs {
    #[command(flatten)]
    pub claim: ClaimArgs,
    /// Do not wait here: print the queued run at once (it keeps its place until --wait
    /// without a connection); follow it with `berth wait RUN_ID`.
    #[arg(long)]
    pub detach: bool,
}

fn default_project() -> String {
    let top = std::process::Command::new("git")
        .args(["rev-parse", "--show-toplevel"])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
    let dir = top.or_else(|| std::env::current_dir().ok());
    dir.and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
        .filter(|n| validate::project(n).is_ok())
        .unwrap_or_else(|| "default".into())
}

pub(crate) fn random_id() -> String {
    let mut buf = [0u8; 8];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        let _ = std::io::Read::read_exact(&mut f, &mut buf);
    }
    let hex: String = buf.iter().map(|b| format!("{b:02x}")).collect();
    format!("r-{hex}")
}

/// The acquire body. The run id is chosen here, so a retry re-attaches (L7).
fn acquire_body(c: &ClaimArgs) -> anyhow::Result<AcquireRequest> {
    let mut resources = BTreeMap::new();
    for (k, v) in [
        ("slots", c.slots),
        ("memory", c.memory),
        ("cpu_millis", c.cpus),
        ("disk", c.disk),
    ] {
        if let Some(v) = v {
            resources.insert(k.to_string(), v);
        }
    }
    for r in &c.resources {
        let (n, v) = r
            .split_once('=')
            .ok_or_else(|| anyhow!("--resource {r:?}: expected NAME=COUNT"))?;
        let v: u64 = v
            .parse()
            .map_err(|_| anyhow!("--resource {r:?}: COUNT must be a whole number"))?;
        resources.insert(n.into(), v);
    }
    let worktree = match &c.worktree {
        Some(w) => Some(
            std::fs::canonicalize(w)
                .map_err(|e| anyhow!("--worktree {}: {e}", w.display()))?
                .to_string_lossy()
                .into_owned(),
        ),
        None => None,
    };
    Ok(AcquireRequest {
        run_id: Some(c.run_id.clone().unwrap_or_else(random_id)),
        project: c.project.clone().unwrap_or_else(default_project),
        class: c
            .class
            .as_deref()
            .map(str::parse)
            .transpose()
            .map_err(|e| anyhow!("--class: {e}"))?,
        priority: c
            .priority
            .as_deref()
            .map(str::parse)
            .transpose()
            .map_err(|e| anyhow!("--priority: {e}"))?,
        resources: (!resources.is_empty()).then_some(UniqueMap(resources)),
        singletons: (!c.singletons.is_empty()).then(|| c.singletons.clone()),
        worktree,
        ttl_s: c.ttl.map(|t| (t / 1000).max(1)),
        wait_s: c.wait.map(|w| w / 1000),
        budget: budget_of(c)?,
        thread: c.thread.clone(),
        ..Default::default()
    })
}

enum Admission {
    Granted(Box<Run>),
    /// Exit code and message.
    Refused(u8, String),
}

/// Maps a refusal to the CLI's exit code: 75 for an admission timeout, 69 otherwise.
fn refusal(err: &ErrorDetail) -> (u8, String) {
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
async fn start_runtime(client: &Arc<Client>, run_id: &str, fence: u64) -> Result<(), (u8, String)> {
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

fn start_runtime_with(
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
const RECONNECT_FOR: Duration = Duration::from_secs(30);

/// The waiting line. On a terminal it is one line redrawn every second (so its elapsed
/// time ticks between the daemon's events); otherwise a plain timestamped line per
/// event, for logs.
struct WaitLine {
    tty: bool,
    /// What the line is about: `waiting` (admission) or `runtime` (its start).
    what: &'static str,
    started: Instant,
    /// The daemon's last word (position and reason); `None` once admitted or refused.
    text: Arc<std::sync::Mutex<Option<String>>>,
}

impl WaitLine {
    fn new(what: &'static str) -> WaitLine {
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

    fn queued(&self, text: String) {
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
    fn done(&self) {
        if self.text.lock().unwrap().take().is_some() && self.tty {
            eprint!("\r\x1b[K");
            let _ = std::io::stderr().flush();
        }
    }
}

fn draw(what: &str, text: &str, started: Instant) {
    eprint!(
        "\r\x1b[Kberth: {what}: {text}, {}",
        crate::show::duration(started.elapsed().as_secs())
    );
    let _ = std::io::stderr().flush();
}

fn wait_for_lease(client: &Client, body: &AcquireRequest, wait_ms: u64) -> Admission {
    let line = WaitLine::new("waiting");
    let admission = wait_for_lease_with(client, body, wait_ms, &line);
    line.done();
    admission
}

fn wait_for_lease_with(
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
fn not_now_or_never(
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
fn transient(status: u16, error: &ErrorDetail) -> bool {
    status == 503 && error.details.get("state").is_none()
}

/// Reads a streamed acquire to its answer; `None` when the stream broke first.
fn follow_acquire(reader: Box<dyn BufRead + Send>, line: &WaitLine) -> Option<Admission> {
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

fn signal_group(pgid: i32, sig: rustix::process::Signal) {
    if let Some(pid) = rustix::process::Pid::from_raw(pgid) {
        let _ = rustix::process::kill_process_group(pid, sig);
    }
}

pub fn run_main(a: RunArgs) -> anyhow::Result<u8> {
    let client = Arc::new(Client::new(&a.claim.conn)?);
    let body = acquire_body(&a.claim)?;
    let run_id = body.run_id.clone().unwrap_or_default();
    let wait_ms = a.claim.wait.unwrap_or(1_800_000);
    let grant = match wait_for_lease(&client, &body, wait_ms) {
        Admission::Granted(l) => l,
        Admission::Refused(code, msg) => {
            eprintln!("berth: run {run_id} not admitted: {msg}");
            return Ok(code);
        }
    };
    // Read at once: every decision about the lease counts from its expiry.
    let lease = crate::lease::Lease::from_grant(&grant, Instant::now(), crate::show::now_ms());
    // A terminal on stdin, with berth run in its foreground: CMD gets the terminal (see
    // `Tty`). Terminal stops are blocked first, in every thread to come: berth run
    // talks to a terminal it no longer owns (its waiting line, `tcsetpgrp`).
    let tty = Tty::detect();
    block_terminal_stops();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(run_granted(a, client, *grant, lease, tty))
}

/// The lease of a granted run while `berth run` holds it: kept from the grant on
/// (issue 33 item 2), told apart from CMD's own end.
struct Held {
    client: Arc<Client>,
    run_id: String,
    fence: u64,
    lease: crate::lease::Shared,
    lost: tokio::sync::mpsc::Receiver<String>,
    renew_now: Arc<tokio::sync::Notify>,
    keeper: tokio::task::JoinHandle<()>,
    /// `$BERTH_LEASE_FILE`: the lease as it stands, for CMD.
    file: Option<LeaseFile>,
}

impl Held {
    /// Starts keeping the lease `grant` gave: renewals run from now on, whatever
    /// else berth run is doing (starting the runtime, registering CMD).
    fn start(client: Arc<Client>, grant: &Run, lease: crate::lease::Lease) -> Held {
        let fence = grant.fence.unwrap_or(0);
        let lease = Arc::new(std::sync::Mutex::new(lease));
        let (lost_tx, lost) = tokio::sync::mpsc::channel::<String>(1);
        let renew_now = Arc::new(tokio::sync::Notify::new());
        let file = LeaseFile::create(grant);
        let writer = file.as_ref().map(|f| f.path.clone());
        let keeper = tokio::spawn(crate::lease::keep(
            client.clone(),
            grant.run_id.clone(),
            fence,
            lease.clone(),
            lost_tx,
            renew_now.clone(),
            move |run: &Run| {
                if let Some(p) = &writer {
                    LeaseFile::write(p, run);
                }
            },
        ));
        Held {
            client,
            run_id: grant.run_id.clone(),
            fence,
            lease,
            lost,
            renew_now,
            keeper,
            file,
        }
    }

    fn lease(&self) -> crate::lease::Lease {
        *self.lease.lock().expect("lease")
    }

    /// Releases the lease after CMD ended; the exit status of `berth run`. Any lost
    /// lease ends in 75 and one line that says why (never a bare signal status): lost
    /// while CMD ran, or found lost when releasing (it expired while berth run was
    /// suspended or cut off, and the broker stopped CMD: issue 33 item 3).
    async fn finish(mut self, status: ExitKind, lost_reason: Option<String>) -> u8 {
        self.keeper.abort();
        let lost = match lost_reason.or_else(|| self.lost.try_recv().ok()) {
            Some(why) => Some(why),
            None => release(&self.client, &self.run_id, self.fence).await.err(),
        };
        drop(self.file.take());
        if let Some(why) = lost {
            eprintln!(
                "berth: the lease for run {} was lost ({why}); CMD was stopped ({})",
                self.run_id,
                status.describe()
            );
            return EXIT_TIMEOUT;
        }
        status.code()
    }

    /// CMD never ran: the lease goes back, and berth run exits `code` after `why`.
    async fn abandon(mut self, code: u8, why: String) -> u8 {
        self.keeper.abort();
        eprintln!("berth: run {}: {why}", self.run_id);
        drop(self.file.take());
        let _ = release(&self.client, &self.run_id, self.fence).await;
        code
    }
}

/// Runs CMD under the granted lease: keeps the lease from the start, starts the
/// runtime if asked, starts CMD behind its gate, registers it, opens the gate,
/// supervises it and releases the lease after.
async fn run_granted(
    a: RunArgs,
    client: Arc<Client>,
    grant: Run,
    lease: crate::lease::Lease,
    tty: Option<Tty>,
) -> anyhow::Result<u8> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut held = Held::start(client.clone(), &grant, lease);
    let mut env: BTreeMap<String, String> = grant.env;
    if let Some(f) = &held.file {
        env.insert(
            "BERTH_LEASE_FILE".into(),
            f.path.to_string_lossy().into_owned(),
        );
    }
    if a.runtime {
        let started = tokio::select! {
            r = start_runtime(&client, &held.run_id, held.fence) => r,
            Some(why) = held.lost.recv() => Err((EXIT_TIMEOUT, format!("the lease was lost ({why})"))),
        };
        if let Err((code, why)) = started {
            let why = format!("the runtime did not start: {why}");
            return Ok(held.abandon(code, why).await);
        }
    }
    // Handlers first: a signal that arrives once CMD exists must reach CMD.
    let signals = Signals {
        int: signal(SignalKind::interrupt())?,
        term: signal(SignalKind::terminate())?,
        hup: signal(SignalKind::hangup())?,
        tstp: signal(SignalKind::from_raw(libc::SIGTSTP))?,
    };
    let (pgid, mut events, gate_write) = match launch(&held, &a.cmd, &env).await {
        Ok(l) => l,
        Err((code, why)) => return Ok(held.abandon(code, why).await),
    };
    // The terminal goes to CMD before it starts: its first read must not stop it.
    if let Some(t) = &tty {
        t.give(pgid);
    }
    // Open the gate: CMD starts now.
    rustix::io::write(&gate_write, b"go\n")?;
    drop(gate_write);
    let grace = held.lease().grace();
    let renew_now = held.renew_now.clone();
    let (status, lost_reason) = supervise(
        pgid,
        &tty,
        &mut events,
        signals,
        &mut held.lost,
        &renew_now,
        grace,
    )
    .await;
    if let Some(t) = &tty {
        t.take_back();
    }
    Ok(held.finish(status, lost_reason).await)
}

/// Starts CMD behind its gate and registers it; CMD starts when the gate (returned)
/// gets its line. On failure, CMD never ran: the exit code and why.
///
/// CMD must never run unregistered (P1): it starts behind a gate (berth itself) that
/// waits for one line on a pipe and then execs CMD under the same pid. If this process
/// dies before it registers CMD, the pipe closes, the read fails and CMD never starts.
async fn launch(
    held: &Held,
    cmd: &[String],
    env: &BTreeMap<String, String>,
) -> Result<(i32, ChildEvents, std::os::fd::OwnedFd), (u8, String)> {
    let (spawned, gate_write) =
        spawn_gated(cmd, env).map_err(|e| (EXIT_REFUSED, format!("cannot start CMD: {e}")))?;
    let child = spawned.map_err(|e| (127, format!("cannot start {}: {e}", cmd[0])))?;
    let pgid = child.id() as i32;
    let mut events = watch_child(pgid);
    berth_server::failpoint::hit("spawn-before-register");
    // P1: the broker records the child by identity (and moves it into the run's
    // cgroup), so it can stop the tree if this client dies (P6). If registering
    // fails, the gate stays shut (closing the pipe makes the gate's `read` fail, so
    // it exits 125 without running CMD).
    if let Err((code, why)) = register(held, pgid).await {
        drop(gate_write);
        while let Some(ev) = events.recv().await {
            if matches!(ev, ChildEvent::Exited(_)) {
                break;
            }
        }
        let why = format!("CMD was not started, because the broker could not record it: {why}");
        return Err((code, why));
    }
    Ok((pgid, events, gate_write))
}

/// What `watch_child` reports.
type ChildEvents = tokio::sync::mpsc::UnboundedReceiver<ChildEvent>;

/// The signals berth run passes on to CMD's process group.
struct Signals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
    tstp: tokio::signal::unix::Signal,
}

/// Waits for CMD to end: passes signals on to its group, follows it into suspension
/// and back (job control), and stops it (TERM, grace, KILL) if the lease is lost.
/// Returns how CMD ended and why the lease was lost, if it was.
async fn supervise(
    pgid: i32,
    tty: &Option<Tty>,
    events: &mut tokio::sync::mpsc::UnboundedReceiver<ChildEvent>,
    mut signals: Signals,
    lost_rx: &mut tokio::sync::mpsc::Receiver<String>,
    renew_now: &tokio::sync::Notify,
    grace: Duration,
) -> (ExitKind, Option<String>) {
    let mut lost_reason = None;
    let status = loop {
        tokio::select! {
            ev = events.recv() => match ev {
                Some(ChildEvent::Exited(st)) | Some(ChildEvent::Lost(st)) => break st,
                None => break ExitKind::Unknown,
                Some(ChildEvent::Stopped(sig)) => {
                    if suspend_with(tty, pgid, sig) {
                        // Back from a suspension that may have outlasted the lease.
                        renew_now.notify_one();
                    }
                }
            },
            _ = signals.int.recv() => signal_group(pgid, rustix::process::Signal::INT),
            _ = signals.term.recv() => signal_group(pgid, rustix::process::Signal::TERM),
            _ = signals.hup.recv() => signal_group(pgid, rustix::process::Signal::HUP),
            // Asked to suspend (not from the terminal, which signals CMD itself):
            // CMD is suspended, and its stop suspends berth run in turn.
            _ = signals.tstp.recv() => signal_group(pgid, rustix::process::Signal::TSTP),
            Some(why) = lost_rx.recv(), if lost_reason.is_none() => {
                lost_reason = Some(why);
                signal_group(pgid, rustix::process::Signal::TERM);
                signal_group(pgid, rustix::process::Signal::CONT);
                let pg = pgid;
                // KILL when the lease runs out: the claim may go to another run then.
                tokio::spawn(async move {
                    tokio::time::sleep(grace).await;
                    signal_group(pg, rustix::process::Signal::KILL);
                });
            }
        }
    };
    (status, lost_reason)
}

/// The hidden first argument that makes `berth` the gate in front of CMD.
pub const GATE_ARG: &str = "__gate";

/// Starts CMD behind its gate (see `run_main`), in its own process group; returns the
/// spawn's outcome and the pipe end whose one line opens the gate.
///
/// The gate is berth itself (`berth __gate FD CMD...`), not a shell: a shell gate
/// named the pipe by its number (`read <&12`), and dash cannot parse a descriptor of
/// 10 or more, so one descriptor too many inherited from berth run's parent broke
/// every run (issue 33 item 1). Every descriptor berth run inherited passes to CMD
/// untouched (a make jobserver's too); berth's own are close-on-exec, and the gate
/// closes its pipe before it becomes CMD.
fn spawn_gated(
    cmd_args: &[String],
    env: &BTreeMap<String, String>,
) -> anyhow::Result<(std::io::Result<std::process::Child>, std::os::fd::OwnedFd)> {
    let (gate_read, gate_write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::empty())?;
    rustix::io::fcntl_setfd(&gate_write, rustix::io::FdFlags::CLOEXEC)?;
    let fd = std::os::fd::AsRawFd::as_raw_fd(&gate_read);
    let me = std::env::current_exe()?;
    // std, not tokio: the child is waited for by `watch_child` (which also sees it
    // stop), never by a runtime that would reap it behind our back.
    use std::os::unix::process::CommandExt;
    let mut cmd = std::process::Command::new(me);
    cmd.arg(GATE_ARG)
        .arg(fd.to_string())
        .args(cmd_args)
        .envs(env)
        .process_group(0);
    let spawned = cmd.spawn();
    drop(gate_read);
    Ok((spawned, gate_write))
}

/// `berth __gate FD CMD...`: waits for `go` on descriptor FD, closes it and becomes
/// CMD. Without `go` (berth run could not register it, or died) it exits 125 and CMD
/// never runs (P1). CMD not found: 127, not runnable: 126, as a shell says.
pub fn gate_main(args: &[std::ffi::OsString]) -> u8 {
    use std::os::fd::FromRawFd;
    use std::os::unix::process::CommandExt;
    let Some(fd) = args
        .first()
        .and_then(|a| a.to_str())
        .and_then(|a| a.parse::<i32>().ok())
        .filter(|&fd| fd > 2)
    else {
        eprintln!("berth: {GATE_ARG} is berth run's own");
        return crate::EXIT_USAGE;
    };
    // SAFETY: berth run made this descriptor for this process and nothing else here
    // uses it; it is owned (and closed) from now on.
    let gate = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    let mut said = Vec::new();
    let mut byte = [0u8; 1];
    while said.len() < 8 {
        match rustix::io::read(&gate, &mut byte) {
            Ok(1) if byte[0] == b'\n' => break,
            Ok(1) => said.push(byte[0]),
            Err(rustix::io::Errno::INTR) => continue,
            _ => break,
        }
    }
    drop(gate);
    if said != b"go" {
        return 125;
    }
    let Some(program) = args.get(1) else {
        return 125;
    };
    let e = std::process::Command::new(program).args(&args[2..]).exec();
    eprintln!("berth run: {}: {e}", program.to_string_lossy());
    if e.kind() == std::io::ErrorKind::NotFound {
        127
    } else {
        126
    }
}

/// How CMD ended.
#[derive(Clone, Copy, Debug)]
enum ExitKind {
    Code(i32),
    Signal(i32),
    Unknown,
}

impl ExitKind {
    /// The shell's convention: the code, or 128 + the signal.
    fn code(self) -> u8 {
        match self {
            ExitKind::Code(c) => c as u8,
            ExitKind::Signal(s) => 128u8.wrapping_add(s as u8),
            ExitKind::Unknown => 1,
        }
    }

    fn describe(self) -> String {
        match self {
            ExitKind::Code(c) => format!("it exited with {c}"),
            ExitKind::Signal(s) => format!("it was ended by signal {s}"),
            ExitKind::Unknown => "its status is unknown".into(),
        }
    }
}

enum ChildEvent {
    /// CMD stopped with this signal (Ctrl-Z, a read from a terminal it does not own).
    Stopped(i32),
    Exited(ExitKind),
    /// Waiting failed: treated as an exit of unknown status.
    Lost(ExitKind),
}

/// Waits for CMD on a thread of its own, reporting stops as well as the exit
/// (`WUNTRACED`: what a shell needs for job control).
fn watch_child(pid: i32) -> tokio::sync::mpsc::UnboundedReceiver<ChildEvent> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        let Some(p) = rustix::process::Pid::from_raw(pid) else {
            let _ = tx.send(ChildEvent::Lost(ExitKind::Unknown));
            return;
        };
        loop {
            match rustix::process::waitpid(Some(p), rustix::process::WaitOptions::UNTRACED) {
                Ok(Some((_, st))) if st.stopped() => {
                    let _ = tx.send(ChildEvent::Stopped(st.stopping_signal().unwrap_or(0)));
                }
                Ok(Some((_, st))) => {
                    let kind = match (st.exit_status(), st.terminating_signal()) {
                        (Some(c), _) => ExitKind::Code(c),
                        (None, Some(s)) => ExitKind::Signal(s),
                        _ => continue,
                    };
                    let _ = tx.send(ChildEvent::Exited(kind));
                    return;
                }
                Ok(None) | Err(rustix::io::Errno::INTR) => {}
                Err(_) => {
                    let _ = tx.send(ChildEvent::Lost(ExitKind::Unknown));
                    return;
                }
            }
        }
    });
    rx
}

/// Blocks SIGTTOU and SIGTTIN in this thread and every thread it starts: berth run
/// hands the terminal to CMD and must still write its lines and take the terminal
/// back (`tcsetpgrp` from the background) without being stopped. (CMD starts with an
/// empty mask: std resets it in the child.)
fn block_terminal_stops() {
    // SAFETY: plain libc calls on a local, initialised sigset.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTTOU);
        libc::sigaddset(&mut set, libc::SIGTTIN);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

/// The terminal on stdin, when berth run is in its foreground process group: CMD is
/// made the terminal's foreground group (it reads and writes the terminal, gets Ctrl-C,
/// Ctrl-\ and window-size changes from the driver itself), and the terminal and its
/// modes come back to berth run's group when CMD stops or ends, however it ends.
struct Tty {
    own_pgrp: rustix::process::Pid,
    modes: rustix::termios::Termios,
}

fn stdin_fd() -> std::os::fd::BorrowedFd<'static> {
    // SAFETY: descriptor 0 stays open for the life of the process.
    unsafe { std::os::fd::BorrowedFd::borrow_raw(0) }
}

impl Tty {
    fn detect() -> Option<Tty> {
        let fd = stdin_fd();
        if !rustix::termios::isatty(fd) {
            return None;
        }
        let own_pgrp = rustix::process::getpgrp();
        // In the background (`berth run … &`) the terminal is left alone.
        if rustix::termios::tcgetpgrp(fd).ok()? != own_pgrp {
            return None;
        }
        let modes = rustix::termios::tcgetattr(fd).ok()?;
        Some(Tty { own_pgrp, modes })
    }

    fn give(&self, pgid: i32) {
        if let Some(p) = rustix::process::Pid::from_raw(pgid) {
            let _ = rustix::termios::tcsetpgrp(stdin_fd(), p);
        }
    }

    fn take_back(&self) {
        let _ = rustix::termios::tcsetpgrp(stdin_fd(), self.own_pgrp);
        let _ = rustix::termios::tcsetattr(
            stdin_fd(),
            rustix::termios::OptionalActions::Drain,
            &self.modes,
        );
    }

    fn in_foreground(&self) -> bool {
        rustix::termios::tcgetpgrp(stdin_fd()).ok() == Some(self.own_pgrp)
    }
}

/// CMD stopped with `sig`. A job-control stop (Ctrl-Z, or reading a terminal it does
/// not own) suspends berth run with it, as a shell job: the terminal and its modes go
/// back to the shell, berth run stops, and when the shell continues it (`fg` or `bg`)
/// CMD is continued too, with the terminal again if in the foreground. Returns whether
/// berth run was suspended (its renewals paused meanwhile).
fn suspend_with(tty: &Option<Tty>, pgid: i32, sig: i32) -> bool {
    if ![libc::SIGTSTP, libc::SIGTTIN, libc::SIGTTOU].contains(&sig) {
        return false;
    }
    let me = rustix::process::getpid();
    // A session leader has no shell above it to continue it: CMD goes on instead.
    if rustix::process::getsid(None).ok() == Some(me) {
        eprintln!("berth: no job control here (berth run leads its session); CMD continues");
        signal_group(pgid, rustix::process::Signal::CONT);
        return false;
    }
    let cmd_modes = tty
        .as_ref()
        .and_then(|_| rustix::termios::tcgetattr(stdin_fd()).ok());
    if let Some(t) = tty {
        t.take_back();
    }
    // Stops here until continued (SIGSTOP: a shell job is its whole process group).
    let _ = rustix::process::kill_process_group(
        rustix::process::getpgrp(),
        rustix::process::Signal::STOP,
    );
    if let Some(t) = tty {
        if t.in_foreground() {
            if let Some(m) = &cmd_modes {
                let _ = rustix::termios::tcsetattr(
                    stdin_fd(),
                    rustix::termios::OptionalActions::Drain,
                    m,
                );
            }
            t.give(pgid);
        }
    }
    signal_group(pgid, rustix::process::Signal::CONT);
    true
}

/// Registers `pid` with the run; on failure, the exit code and the reason: 69 when the
/// broker refused (the rule said no), 75 when the lease was lost or could not be
/// confirmed in time. A registration the broker could not take yet (a restart, a full
/// disk) is tried again for as long as the lease can be kept (issue 33 item 2): the
/// lease is renewed meanwhile, so a daemon that is down between the grant and the
/// registration costs nothing but the wait.
async fn register(held: &Held, pid: i32) -> Result<(), (u8, String)> {
    let mut retry = Retry::new(REGISTER);
    let mut last = String::from("no answer yet");
    loop {
        let lease = held.lease();
        let Some(budget) = lease.budget(Instant::now()) else {
            return Err((
                EXIT_TIMEOUT,
                format!("the lease ran out before CMD could be registered: {last}"),
            ));
        };
        let body = ProcessRequest {
            fence: held.fence,
            pid,
        };
        let path = format!("/v1/runs/{}/processes", held.run_id);
        let r = held
            .client
            .call_async("POST", &path, Some(&body), budget)
            .await;
        last = match r {
            Ok(reply) if reply.status < 300 => return Ok(()),
            Ok(reply) if reply.status == 409 || reply.status == 410 => {
                return Err((
                    EXIT_TIMEOUT,
                    format!("the lease was lost ({})", error_text(&reply.body)),
                ))
            }
            Ok(reply) if reply.status < 500 => {
                return Err((EXIT_REFUSED, error_text(&reply.body)));
            }
            Ok(reply) => error_text(&reply.body),
            Err(e) => format!("cannot reach berth at {}: {e}", held.client.url),
        };
        let left = lease.stop_at().saturating_duration_since(Instant::now());
        tokio::time::sleep(retry.failed().min(left)).await;
    }
}

/// Releases the lease. `Err(why)` when it was no longer ours (it expired, or another
/// fence holds it): the caller reports a lost lease.
async fn release(client: &Arc<Client>, run_id: &str, fence: u64) -> Result<(), String> {
    let give_up = Instant::now() + RELEASE_FOR;
    let mut retry = Retry::new(RELEASE);
    while let Some(left) = give_up.checked_duration_since(Instant::now()) {
        let budget = left.min(crate::lease::REQUEST_TIMEOUT_MAX);
        let body = ReleaseRequest { fence };
        let path = format!("/v1/runs/{run_id}/release");
        match client.call_async("POST", &path, Some(&body), budget).await {
            Ok(reply) if reply.status < 300 => {
                return match reply.parse::<Run>() {
                    // Expired, or being stopped because it expired (the broker's stop
                    // grace): not a clean end, whatever CMD's status (item 3).
                    Ok(r)
                        if r.state == RunState::Expired
                            || r.ending.as_deref() == Some("expired") =>
                    {
                        Err("it expired before CMD ended: it was not renewed in time, and the broker stopped CMD".into())
                    }
                    // berth ended it itself, and says why (e.g. an analysis run that
                    // listened, C6).
                    Ok(Run {
                        failure: Some(why), ..
                    }) => Err(why),
                    _ => Ok(()),
                };
            }
            Ok(reply) if reply.status == 409 || reply.status == 410 => {
                return Err(error_text(&reply.body));
            }
            Ok(reply) if reply.status < 500 => return Ok(()),
            _ => tokio::time::sleep(retry.failed().min(left)).await,
        }
    }
    eprintln!("berth: could not release run {run_id}; it will expire");
    Ok(())
}

/// The pauses of `berth run`'s retries: an acquire while berth is unreachable, a
/// registration, a release.
const UNREACHABLE: Backoff = Backoff::new(250, 2_000);
const REGISTER: Backoff = Backoff::new(100, 2_000);
const RELEASE: Backoff = Backoff::new(250, 1_000);

/// How long `berth run` tries to release after CMD ended (the lease expires anyway).
const RELEASE_FOR: Duration = Duration::from_secs(30);

/// `$BERTH_LEASE_FILE`: the lease as it stands, rewritten (atomically, by rename) after
/// each renew, so CMD can read its current expiry (an environment variable keeps its
/// first value). Lines of `NAME=VALUE`, so `. "$BERTH_LEASE_FILE"` reads it in a shell.
/// It lives in a directory of its own (mode 0700) under the temporary directory,
/// removed when berth run ends.
struct LeaseFile {
    dir: PathBuf,
    path: PathBuf,
}

impl LeaseFile {
    fn create(grant: &Run) -> Option<LeaseFile> {
        use std::os::unix::fs::DirBuilderExt;
        let dir = std::env::temp_dir().join(format!("berth-lease-{}", random_id()));
        // `create`, not `create_all`: a name someone else made first is refused.
        std::fs::DirBuilder::new().mode(0o700).create(&dir).ok()?;
        let f = LeaseFile {
            path: dir.join("lease"),
            dir,
        };
        LeaseFile::write(&f.path, grant);
        Some(f)
    }

    fn write(path: &std::path::Path, run: &Run) {
        let text = format!(
            "BERTH_RUN_ID={}\nBERTH_FENCE={}\nBERTH_LEASE_EXPIRES_AT={}\nBERTH_LEASE_TTL_MS={}\n",
            run.run_id,
            run.fence.unwrap_or(0),
            run.expires_at.as_deref().unwrap_or(""),
            run.ttl_ms.unwrap_or(0)
        );
        let tmp = path.with_extension("new");
        if std::fs::write(&tmp, text).is_ok() {
            let _ = std::fs::rename(&tmp, path);
        }
    }
}

impl Drop for LeaseFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
