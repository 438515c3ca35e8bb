//! A small blocking client of the HTTP API, and the simple subcommands built on it.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;

use crate::EXIT_REFUSED;
use clap::Args;
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

pub struct Client {
    agent: ureq::Agent,
    pub url: String,
    token: Option<String>,
    /// Without a token: which file was tried and why it gave none (said with a 401).
    no_token: Option<String>,
}

pub struct Reply {
    pub status: u16,
    pub body: Value,
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
        let config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_connect(Some(Duration::from_secs(5)))
            .build();
        Ok(Client {
            agent: config.into(),
            url: a.url.trim_end_matches('/').to_string(),
            token,
            no_token,
        })
    }

    fn auth(&self) -> Option<String> {
        self.token.as_ref().map(|t| format!("Bearer {t}"))
    }

    /// One request with a JSON reply. Connection failures are `Err`.
    pub fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Reply, ureq::Error> {
        let url = format!("{}{}", self.url, path);
        let resp = match method {
            "GET" => {
                let mut r = self.agent.get(&url);
                if let Some(a) = self.auth() {
                    r = r.header("Authorization", &a);
                }
                r.call()?
            }
            "DELETE" => {
                let mut r = self.agent.delete(&url);
                if let Some(a) = self.auth() {
                    r = r.header("Authorization", &a);
                }
                r.call()?
            }
            _ => {
                let mut r = self
                    .agent
                    .post(&url)
                    .header("Content-Type", "application/json");
                if let Some(a) = self.auth() {
                    r = r.header("Authorization", &a);
                }
                r.send(body.map(|b| b.to_string()).unwrap_or_else(|| "{}".into()))?
            }
        };
        let status = resp.status().as_u16();
        let text = resp.into_body().read_to_string().unwrap_or_default();
        let mut body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        self.explain_401(status, &mut body);
        Ok(Reply { status, body })
    }

    /// A 401 without a token says which file was tried.
    pub fn explain_401(&self, status: u16, body: &mut Value) {
        if let (401, Some(why)) = (status, &self.no_token) {
            if let Some(m) = body["error"]["message"].as_str() {
                body["error"]["message"] = format!("{m} ({why})").into();
            }
        }
    }

    /// The daemon could not be reached: said once, with what to do; exit 69.
    pub fn unreachable(&self, e: &ureq::Error) -> u8 {
        eprintln!(
            "berth: cannot reach berth at {}: {e}; is `berth serve` running? (set --url or BERTH_URL)",
            self.url
        );
        EXIT_REFUSED
    }

    /// `POST /v1/runs` as a stream of JSON lines.
    pub fn acquire_stream(
        &self,
        body: &Value,
    ) -> Result<(u16, Box<dyn std::io::BufRead + Send>), ureq::Error> {
        let mut r = self
            .agent
            .post(format!("{}/v1/runs", self.url))
            .header("Content-Type", "application/json")
            .header("Accept", "application/x-ndjson");
        if let Some(a) = self.auth() {
            r = r.header("Authorization", &a);
        }
        let resp = r.send(body.to_string())?;
        let status = resp.status().as_u16();
        let reader = resp.into_body().into_reader();
        Ok((status, Box::new(std::io::BufReader::new(reader))))
    }
}

pub fn error_text(body: &Value) -> String {
    match body.get("error") {
        Some(e) => format!(
            "{}: {}",
            e.get("code").and_then(Value::as_str).unwrap_or("error"),
            e.get("message").and_then(Value::as_str).unwrap_or("")
        ),
        None => body.to_string(),
    }
}

/// A reply for scripts (`--json`) or people; 0 for success, 1 for an error reply.
fn print_reply(r: &Reply, json: bool, human: impl Fn(&Value) -> String) -> anyhow::Result<u8> {
    if json {
        println!("{}", serde_json::to_string_pretty(&r.body)?);
    } else if r.status < 300 {
        println!("{}", human(&r.body));
    } else {
        eprintln!("berth: {}", error_text(&r.body));
    }
    Ok(if r.status < 300 { 0 } else { 1 })
}

pub fn status_main(a: StatusArgs) -> anyhow::Result<u8> {
    let c = Client::new(&a.conn)?;
    let r = match c.call("GET", "/v1/status", None) {
        Ok(r) => r,
        Err(e) => return Ok(c.unreachable(&e)),
    };
    if r.status >= 300 || a.conn.json {
        return print_reply(&r, a.conn.json, |_| String::new());
    }
    let s = &r.body;
    println!("berth at {}", c.url);
    println!(
        "  {:<12} {:>12} {:>12} {:>12} {:>12}",
        "resource", "committed", "allocatable", "total", "reserve"
    );
    for res in s["resources"].as_array().into_iter().flatten() {
        let name = res["name"].as_str().unwrap_or("");
        let f = |v: &Value| {
            let n = v.as_u64().unwrap_or(0);
            match name {
                "memory" | "disk" => berth_core::fmt_bytes(n),
                "cpu_millis" => format!("{} cpu", crate::show::cpus(n)),
                _ => n.to_string(),
            }
        };
        println!(
            "  {:<12} {:>12} {:>12} {:>12} {:>12}",
            if name == "cpu_millis" { "cpu" } else { name },
            f(&res["committed"]),
            f(&res["allocatable"]),
            f(&res["total"]),
            f(&res["reserve"])
        );
    }
    if let Some(m) = s["memory_available"].as_u64() {
        println!(
            "  host memory available {} (granted but not yet in use {})",
            berth_core::fmt_bytes(m),
            berth_core::fmt_bytes(s["memory_pending"].as_u64().unwrap_or(0))
        );
    }
    println!(
        "  runs: {} granted, {} degraded; queued {} foreground, {} background; at most {} at once (now {})",
        s["granted"], s["degraded"], s["queued"]["foreground"], s["queued"]["background"], s["slots_max"], s["effective_max_now"]
    );
    if let Some(r) = s["min_run_blocked"].as_object() {
        println!(
            "  a default-size run cannot start now: {}",
            r["message"].as_str().unwrap_or("")
        );
    }
    let reaper = &s["reaper"];
    println!(
        "  reaper: {} processes terminated, {} reused pids left alone, diagnostics {} ({} archives dropped)",
        reaper["processes_terminated"],
        reaper["reused_pids_protected"],
        berth_core::fmt_bytes(reaper["diagnostics_bytes"].as_u64().unwrap_or(0)),
        reaper["diagnostics_dropped"]
    );
    for p in s["projects"].as_array().into_iter().flatten() {
        println!(
            "  project {:<24} {} active, {} waiting, {} degraded ({})",
            p["project"].as_str().unwrap_or(""),
            p["active"],
            p["waiting"],
            p["degraded"],
            p["concurrency"].as_str().unwrap_or("")
        );
    }
    Ok(0)
}

pub fn runs_main(a: RunsArgs) -> anyhow::Result<u8> {
    let c = Client::new(&a.conn)?;
    let path = if a.all {
        "/v1/runs?all=true"
    } else {
        "/v1/runs"
    };
    let r = match c.call("GET", path, None) {
        Ok(r) => r,
        Err(e) => return Ok(c.unreachable(&e)),
    };
    if r.status >= 300 || a.conn.json {
        return print_reply(&r, a.conn.json, |_| String::new());
    }
    println!(
        "{:<20} {:<16} {:<9} {:>7} {:>6} {:>4} {:<12} {:<34} reason",
        "run", "project", "state", "age", "fence", "pos", "expires", "claim"
    );
    for run in r.body["runs"].as_array().into_iter().flatten() {
        // How long it has been granted (or waiting).
        let age = run["since"]
            .as_str()
            .and_then(crate::show::parse_utc)
            .map(|t| crate::show::duration((crate::show::now_s() - t).max(0) as u64))
            .unwrap_or_default();
        println!(
            "{:<20} {:<16} {:<9} {:>7} {:>6} {:>4} {:<12} {:<34} {}",
            run["run_id"].as_str().unwrap_or(""),
            run["project"].as_str().unwrap_or(""),
            run["state"].as_str().unwrap_or(""),
            age,
            run["fence"]
                .as_u64()
                .map(|f| f.to_string())
                .unwrap_or_default(),
            run["position"]
                .as_u64()
                .map(|f| f.to_string())
                .unwrap_or_default(),
            run["expires_at"]
                .as_str()
                .and_then(crate::show::relative)
                .unwrap_or_default(),
            crate::show::claim(&run["claim"]["resources"]),
            run["reason"]["message"].as_str().unwrap_or("")
        );
    }
    Ok(0)
}

pub fn renew_main(a: RenewArgs) -> anyhow::Result<u8> {
    let c = Client::new(&a.conn)?;
    let mut body = serde_json::json!({});
    if let Some(f) = a.fence {
        body["fence"] = f.into();
    }
    if let Some(t) = a.ttl {
        body["ttl_s"] = (t / 1000).max(1).into();
    }
    match c.call("POST", &format!("/v1/runs/{}/renew", a.run_id), Some(&body)) {
        Ok(r) => print_reply(&r, a.conn.json, crate::show::run_line),
        Err(e) => Ok(c.unreachable(&e)),
    }
}

pub fn release_main(a: ReleaseArgs) -> anyhow::Result<u8> {
    let c = Client::new(&a.conn)?;
    let body = serde_json::json!({ "fence": a.fence });
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
    match c.call("POST", "/v1/reap", Some(&serde_json::json!({}))) {
        Ok(r) => print_reply(&r, a.json, |b| {
            format!(
                "reaped {} of {} runs being released ({} degraded); {} processes terminated, {} reused pids left alone",
                b["reaped"], b["examined"], b["degraded"], b["processes_terminated"], b["reused_pids_protected"]
            )
        }),
        Err(e) => Ok(c.unreachable(&e)),
    }
}
