//! `berth events`: the journal in the terminal, and with `--follow` the live stream.

use berth_client::retry::{Backoff, Retry};
use std::io::{BufRead, Write};

use berth_client::wire::{JournalEntry, StreamCutoff};
use clap::Args;
use serde_json::Value;

use crate::client::{error_text, Client, ConnArgs};

/// Pause before reconnecting a stream that dropped.
/// Reconnects after 250 ms, then up to every second while berth is away.
const RECONNECT: Backoff = Backoff::new(250, 1_000);

#[derive(Args)]
pub struct EventsArgs {
    #[command(flatten)]
    pub conn: ConnArgs,
    /// Keep printing events as they happen (resumes by sequence number if the stream
    /// drops or berth restarts).
    #[arg(long, short)]
    pub follow: bool,
    /// Only this run's events (and without --after, all of them).
    #[arg(long, value_name = "ID")]
    pub run: Option<String>,
    /// Only this project's events.
    #[arg(long)]
    pub project: Option<String>,
    /// Only these kinds, comma-separated (e.g. granted,expired).
    #[arg(long, value_name = "KINDS")]
    pub kind: Option<String>,
    /// Start after this sequence number [default: the whole journal, paged].
    #[arg(long, value_name = "SEQ")]
    pub after: Option<u64>,
    /// Only the last N entries the other filters admit (of the whole journal).
    #[arg(long, value_name = "N")]
    pub last: Option<usize>,
}

impl EventsArgs {
    /// What `--run`, `--project` and `--kind` ask for, as the journal's one filter.
    fn filter(&self) -> berth_client::wire::JournalFilter {
        berth_client::wire::JournalFilter {
            run: self.run.clone(),
            project: self.project.clone(),
            kinds: self
                .kind
                .iter()
                .flat_map(|k| k.split(','))
                .map(|k| k.trim().to_string())
                .collect(),
        }
    }

    fn query(&self) -> String {
        let mut q = Vec::new();
        for (k, v) in [
            ("run", &self.run),
            ("project", &self.project),
            ("kind", &self.kind),
        ] {
            if let Some(v) = v {
                q.push(format!("{k}={}", encode(v)));
            }
        }
        q.join("&")
    }
}

/// Percent-encodes a query value.
fn encode(v: &str) -> String {
    v.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b',' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// One entry as a line: sequence, time, kind, run, project, then its fields.
fn line(e: &JournalEntry) -> String {
    let mut fields = String::new();
    if let Value::Object(m) = &e.data {
        for (k, v) in m.iter().filter(|(_, v)| !v.is_null()) {
            let v = match v {
                Value::String(s) => s.clone(),
                v => v.to_string(),
            };
            fields.push_str(&format!(" {k}={v}"));
        }
    }
    format!(
        "{:>8} {} {:<14} {:<20} {:<16}{}",
        e.seq,
        e.at,
        e.kind,
        e.run_id.as_deref().unwrap_or("-"),
        e.project.as_deref().unwrap_or("-"),
        fields
    )
}

fn print(e: &JournalEntry, raw: &str, json: bool) -> bool {
    let mut out = std::io::stdout().lock();
    let text = if json { raw.to_string() } else { line(e) };
    writeln!(out, "{text}").and_then(|()| out.flush()).is_ok()
}

pub fn events_main(a: EventsArgs) -> anyhow::Result<u8> {
    let c = Client::new(&a.conn)?;
    // Where the journal ends now (one empty page says).
    let head = match c.get_stream("/v1/journal?limit=1&after=18446744073709551615", &[]) {
        Ok(r) => r,
        Err(e) => return Ok(c.unreachable(&e)),
    };
    if head.status >= 300 {
        return Ok(refused(head));
    }
    let last: u64 = head
        .headers
        .get("x-berth-journal-last")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    // The whole journal so far (issue 34: the last 20 were shown, and --kind filtered
    // only those), page by page; with --last, only the last N it admits.
    let mut after = a.after.unwrap_or(0);
    let mut kept = std::collections::VecDeque::new();
    let filter = a.filter();
    while after < last {
        let page = match c.get_stream(&format!("/v1/journal?after={after}"), &[]) {
            Ok(r) if r.status < 300 => r,
            Ok(r) => return Ok(refused(r)),
            Err(e) => return Ok(c.unreachable(&e)),
        };
        let before = after;
        for raw in page.body.lines().map_while(Result::ok) {
            let Ok(e) = serde_json::from_str::<JournalEntry>(&raw) else {
                continue;
            };
            after = e.seq;
            if !filter.admits(e.run_id.as_deref(), e.project.as_deref(), &e.kind) {
                continue;
            }
            match a.last {
                Some(n) => {
                    kept.push_back((e, raw));
                    if kept.len() > n {
                        kept.pop_front();
                    }
                }
                None if !print(&e, &raw, a.conn.json) => return Ok(0),
                None => {}
            }
        }
        if after == before {
            break;
        }
    }
    for (e, raw) in kept {
        if !print(&e, &raw, a.conn.json) {
            return Ok(0);
        }
    }
    if a.follow {
        follow(&c, &a, after)
    } else {
        Ok(0)
    }
}

fn refused(r: crate::client::Streamed) -> u8 {
    let mut text = String::new();
    let mut body = r.body;
    let _ = body.read_to_string(&mut text);
    let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
    eprintln!("berth: {}", error_text(&v));
    crate::EXIT_REFUSED
}

/// The live stream, resumed by sequence number whenever it drops (berth restarted, or
/// cut this reader off for falling behind).
fn follow(c: &Client, a: &EventsArgs, mut after: u64) -> anyhow::Result<u8> {
    let path = format!("/v1/events?{}", a.query());
    let mut retry = Retry::new(RECONNECT);
    loop {
        let headers = [("Last-Event-ID", after.to_string())];
        match c.get_stream(&path, &headers) {
            Ok(r) if r.status < 300 => {
                retry.succeeded();
                if !read_stream(r.body, &mut after, a.conn.json) {
                    return Ok(0);
                }
            }
            Ok(r) if r.status < 500 => return Ok(refused(r)),
            Ok(_) | Err(_) => {}
        }
        std::thread::sleep(retry.failed());
    }
}

/// Prints a stream's events until it ends; false once stdout is gone.
fn read_stream(body: Box<dyn BufRead + Send>, after: &mut u64, json: bool) -> bool {
    let (mut kind, mut data) = (String::new(), String::new());
    for l in body.lines() {
        let Ok(l) = l else {
            return true;
        };
        if let Some(v) = l.strip_prefix("event:") {
            kind = v.trim().to_string();
        } else if let Some(v) = l.strip_prefix("data:") {
            data.push_str(v.strip_prefix(' ').unwrap_or(v));
        } else if l.is_empty() && !data.is_empty() {
            if kind == "cutoff" {
                if let Ok(cut) = serde_json::from_str::<StreamCutoff>(&data) {
                    *after = cut.last_seq;
                }
                return true;
            }
            if let Ok(e) = serde_json::from_str::<JournalEntry>(&data) {
                *after = e.seq;
                if !print(&e, &data, json) {
                    return false;
                }
            }
            data.clear();
        }
    }
    true
}
