//! A small blocking client of the HTTP API, and the simple subcommands built on it.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{anyhow, Context};
use clap::Args;
use serde_json::Value;

#[derive(Args, Clone, Debug)]
pub struct ConnArgs {
    /// The daemon's URL.
    #[arg(long, env = "BERTH_URL", default_value = "http://127.0.0.1:7420")]
    pub url: String,
    /// A bearer token (default: BERTH_TOKEN, then --token-file).
    #[arg(long, env = "BERTH_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// A file holding the token (default: the admin token under the default state dir).
    #[arg(long)]
    pub token_file: Option<PathBuf>,
}

#[derive(Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub conn: ConnArgs,
    /// Print the raw JSON snapshot.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct RenewArgs {
    pub run_id: String,
    #[arg(long)]
    pub fence: Option<u64>,
    /// New ttl, e.g. 5m.
    #[arg(long, value_parser = crate::run::parse_duration)]
    pub ttl: Option<u64>,
    #[command(flatten)]
    pub conn: ConnArgs,
}

#[derive(Args)]
pub struct ReleaseArgs {
    pub run_id: String,
    #[arg(long)]
    pub fence: u64,
    #[command(flatten)]
    pub conn: ConnArgs,
}

/// The default state directory: BERTH_STATE_DIR, XDG_STATE_HOME/berth, ~/.local/state/berth.
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
}

pub struct Reply {
    pub status: u16,
    pub body: Value,
}

impl Client {
    pub fn new(a: &ConnArgs) -> anyhow::Result<Client> {
        let token = match (&a.token, &a.token_file) {
            (Some(t), _) => Some(t.clone()),
            (None, Some(f)) => Some(
                std::fs::read_to_string(f)
                    .with_context(|| format!("reading token file {}", f.display()))?
                    .trim()
                    .to_string(),
            ),
            (None, None) => std::fs::read_to_string(default_state_dir().join("admin.token"))
                .ok()
                .map(|t| t.trim().to_string()),
        };
        let config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_connect(Some(Duration::from_secs(5)))
            .build();
        Ok(Client {
            agent: config.into(),
            url: a.url.trim_end_matches('/').to_string(),
            token,
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
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Ok(Reply { status, body })
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

fn print_json_reply(r: Reply) -> anyhow::Result<u8> {
    println!("{}", serde_json::to_string_pretty(&r.body)?);
    Ok(if r.status < 300 { 0 } else { 1 })
}

pub fn status_main(a: StatusArgs) -> anyhow::Result<u8> {
    let c = Client::new(&a.conn)?;
    let r = c
        .call("GET", "/v1/status", None)
        .map_err(|e| anyhow!("cannot reach berth at {}: {e}", c.url))?;
    if r.status >= 300 || a.json {
        return print_json_reply(r);
    }
    let s = &r.body;
    println!("berth at {}", c.url);
    for res in s["resources"].as_array().into_iter().flatten() {
        println!(
            "  {:<14} committed {:>16} of {:>16} allocatable (total {}, reserve {})",
            res["name"].as_str().unwrap_or(""),
            res["committed"],
            res["allocatable"],
            res["total"],
            res["reserve"]
        );
    }
    println!(
        "  slots_max {}, effective max now {}; queued {} foreground, {} background; granted {}, degraded {}",
        s["slots_max"], s["effective_max_now"], s["queued"]["foreground"], s["queued"]["background"], s["granted"], s["degraded"]
    );
    if let Some(r) = s["min_run_blocked"].as_object() {
        println!(
            "  a default-size run cannot start now: {} {}",
            r["code"], r["message"]
        );
    }
    for p in s["projects"].as_array().into_iter().flatten() {
        println!(
            "  project {:<24} active {} waiting {} degraded {} ({})",
            p["project"].as_str().unwrap_or(""),
            p["active"],
            p["waiting"],
            p["degraded"],
            p["concurrency"].as_str().unwrap_or("")
        );
    }
    Ok(0)
}

pub fn runs_main(a: ConnArgs) -> anyhow::Result<u8> {
    let c = Client::new(&a)?;
    let r = c
        .call("GET", "/v1/runs", None)
        .map_err(|e| anyhow!("cannot reach berth at {}: {e}", c.url))?;
    if r.status >= 300 {
        return print_json_reply(r);
    }
    println!(
        "{:<24} {:<20} {:<10} {:>6} {:>5}  reason",
        "run", "project", "state", "fence", "pos"
    );
    for run in r.body["runs"].as_array().into_iter().flatten() {
        println!(
            "{:<24} {:<20} {:<10} {:>6} {:>5}  {}",
            run["run_id"].as_str().unwrap_or(""),
            run["project"].as_str().unwrap_or(""),
            run["state"].as_str().unwrap_or(""),
            run["fence"]
                .as_u64()
                .map(|f| f.to_string())
                .unwrap_or_default(),
            run["position"]
                .as_u64()
                .map(|f| f.to_string())
                .unwrap_or_default(),
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
    let r = c
        .call("POST", &format!("/v1/runs/{}/renew", a.run_id), Some(&body))
        .map_err(|e| anyhow!("cannot reach berth at {}: {e}", c.url))?;
    print_json_reply(r)
}

pub fn release_main(a: ReleaseArgs) -> anyhow::Result<u8> {
    let c = Client::new(&a.conn)?;
    let body = serde_json::json!({ "fence": a.fence });
    let r = c
        .call(
            "POST",
            &format!("/v1/runs/{}/release", a.run_id),
            Some(&body),
        )
        .map_err(|e| anyhow!("cannot reach berth at {}: {e}", c.url))?;
    print_json_reply(r)
}

pub fn reap_main(a: ConnArgs) -> anyhow::Result<u8> {
    let c = Client::new(&a)?;
    let r = c
        .call("POST", "/v1/reap", Some(&serde_json::json!({})))
        .map_err(|e| anyhow!("cannot reach berth at {}: {e}", c.url))?;
    print_json_reply(r)
}
