//! `berth scope` and `berth budget` (B1–B6): clients of `/v1/scopes`.

use berth_client::wire::{
    ControlReceipt, ControlRequest, HarnessFigures, ReconcileRequest, Reconciled, Scope, ScopeList,
    ScopeToken,
};
use clap::{Args, Subcommand};
use std::collections::BTreeMap;

use crate::client::{print_reply, Client, ConnArgs};

#[derive(Args)]
pub struct ScopeArgs {
    #[command(subcommand)]
    pub cmd: ScopeCmd,
}

#[derive(Subcommand)]
pub enum ScopeCmd {
    /// Policy, manifest, tokens with their owners, lapsed owners, control, generation,
    /// receipts and waiters.
    Show {
        /// The scope's id.
        scope: String,
        #[command(flatten)]
        conn: ConnArgs,
    },
    /// No new token in the scope until it resumes.
    Pause(ControlArgs),
    /// For good: the scope never admits again; its waiters are refused.
    Stop(ControlArgs),
    /// Clear a pause (never a stop).
    Resume(ControlArgs),
    /// Free every token OWNER holds in the scope (admin), with a reason.
    Reconcile {
        /// The scope's id.
        scope: String,
        /// Whose tokens: a run id (a run's own token) or a turn's owner.
        #[arg(long)]
        owner: String,
        /// Why, one line (journaled with who asked).
        #[arg(long)]
        reason: String,
        #[command(flatten)]
        conn: ConnArgs,
    },
}

#[derive(Args)]
pub struct ControlArgs {
    /// The scope's id.
    pub scope: String,
    /// The request's id: the same id again returns the same receipt, so a retry after a
    /// lost answer is safe [default: a new random id].
    #[arg(long)]
    pub request_id: Option<String>,
    #[command(flatten)]
    pub conn: ConnArgs,
}

fn figures(h: &BTreeMap<String, HarnessFigures>) -> String {
    h.iter()
        .map(|(name, f)| format!("{name} {}/{}", f.held, f.limit))
        .collect::<Vec<_>>()
        .join(", ")
}

fn token_line(t: &ScopeToken) -> String {
    let run = t
        .run_id
        .as_deref()
        .map_or(String::new(), |r| format!(" run {r}"));
    let lapsed = if t.owner_lapsed { " OWNER LAPSED" } else { "" };
    format!(
        "  {} {}/{}{run} since {}{lapsed}",
        t.harness, t.owner, t.operation_id, t.since
    )
}

fn scope_text(s: &Scope) -> String {
    let mut out = vec![format!(
        "scope {}: {} (generation {}); {}",
        s.scope,
        s.control,
        s.generation,
        figures(&s.harnesses)
    )];
    if let Some(m) = &s.manifest {
        out.push(format!("manifest {} sha256 {}", m.path, m.sha256));
    }
    out.push(format!("tokens: {}", s.tokens.len()));
    out.extend(s.tokens.iter().map(token_line));
    if !s.lapsed_owners.is_empty() {
        out.push(format!("lapsed owners: {}", s.lapsed_owners.join(", ")));
    }
    out.push(format!("waiting: {}", s.waiting));
    for w in &s.waiters {
        let why = w
            .reason
            .as_ref()
            .map_or(String::new(), |r| format!(" {}", r.message));
        out.push(format!(
            "  {} {} ({}){why}",
            w.position, w.run_id, w.harness
        ));
    }
    for r in &s.receipts {
        out.push(format!(
            "receipt {} {} -> {} generation {} at {}",
            r.request_id, r.mode, r.control, r.generation, r.at
        ));
    }
    out.join("\n")
}

fn receipt_text(r: &ControlReceipt) -> String {
    format!(
        "scope {}: {} (generation {}), request {} ({}) at {}",
        r.scope, r.control, r.generation, r.request_id, r.mode, r.at
    )
}

fn control(a: ControlArgs, mode: &str) -> anyhow::Result<u8> {
    let c = Client::new(&a.conn)?;
    let request_id = a
        .request_id
        .unwrap_or_else(|| format!("cli-{}", crate::run::random_id()));
    let body = ControlRequest {
        request_id,
        mode: mode.into(),
    };
    let path = format!("/v1/scopes/{}/control", a.scope);
    match c.call("POST", &path, Some(&body)) {
        Ok(r) => print_reply(&r, a.conn.json, receipt_text),
        Err(e) => Ok(c.unreachable(&e)),
    }
}

pub fn scope_main(a: ScopeArgs) -> anyhow::Result<u8> {
    match a.cmd {
        ScopeCmd::Show { scope, conn } => {
            let c = Client::new(&conn)?;
            match c.call::<()>("GET", &format!("/v1/scopes/{scope}"), None) {
                Ok(r) => print_reply(&r, conn.json, scope_text),
                Err(e) => Ok(c.unreachable(&e)),
            }
        }
        ScopeCmd::Pause(a) => control(a, "pause"),
        ScopeCmd::Stop(a) => control(a, "stop"),
        ScopeCmd::Resume(a) => control(a, "resume"),
        ScopeCmd::Reconcile {
            scope,
            owner,
            reason,
            conn,
        } => {
            let c = Client::new(&conn)?;
            let body = ReconcileRequest { owner, reason };
            let path = format!("/v1/scopes/{scope}/reconcile");
            match c.call("POST", &path, Some(&body)) {
                Ok(r) => print_reply(&r, conn.json, |x: &Reconciled| {
                    let mut out = vec![format!(
                        "scope {}: freed {} token(s) of {} ({})",
                        x.scope,
                        x.freed.len(),
                        x.owner,
                        x.reason
                    )];
                    out.extend(x.freed.iter().map(token_line));
                    out.join("\n")
                }),
                Err(e) => Ok(c.unreachable(&e)),
            }
        }
    }
}

/// `berth budget`: every scope, a table row each.
pub fn budget_main(conn: ConnArgs) -> anyhow::Result<u8> {
    let c = Client::new(&conn)?;
    let r = match c.call::<()>("GET", "/v1/scopes", None) {
        Ok(r) => r,
        Err(e) => return Ok(c.unreachable(&e)),
    };
    print_reply(&r, conn.json, |l: &ScopeList| {
        let rows: Vec<[String; 5]> = l
            .scopes
            .iter()
            .map(|s| {
                [
                    s.scope.clone(),
                    s.control.clone(),
                    s.generation.to_string(),
                    s.lapsed.to_string(),
                    figures(&s.harnesses),
                ]
            })
            .collect();
        crate::show::table(
            [
                "scope",
                "control",
                "generation",
                "lapsed",
                "held/limit per harness",
            ],
            &rows,
        )
    })
}
