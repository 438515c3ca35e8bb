//! `berth token create|list|revoke` (S9): an admin's client of `/v1/tokens`. Tokens are
//! kept hashed by the daemon; a token's secret is shown once, when it is made.

use berth_client::wire::{TokenCreated, TokenInfo, TokenList, TokenRequest};
use clap::{Args, Subcommand};

use crate::client::{print_reply, Client, ConnArgs};

#[derive(Args)]
pub struct TokenArgs {
    #[command(subcommand)]
    pub cmd: TokenCmd,
}

#[derive(Subcommand)]
pub enum TokenCmd {
    /// Make a token; its secret is printed once (keep it: only its hash is stored).
    Create {
        /// What it may do: read, operator or admin.
        #[arg(long, value_parser = ["read", "operator", "admin"])]
        scope: String,
        /// The user it acts for: its runs' processes must be that user's, their
        /// workspaces are that user's, and it acts only on that user's runs.
        #[arg(long)]
        uid: Option<u32>,
        /// Refused after this long, e.g. 30d [default: until revoked].
        #[arg(long, value_parser = crate::args::parse_duration)]
        expires: Option<u64>,
        #[command(flatten)]
        conn: ConnArgs,
    },
    /// Every token: id, scope, user, expiry (never a secret).
    List {
        #[command(flatten)]
        conn: ConnArgs,
    },
    /// Refuse a token from now on, by its id (`berth token list`).
    Revoke {
        /// The token's id: 16 hex digits.
        id: String,
        #[command(flatten)]
        conn: ConnArgs,
    },
}

fn row(t: &TokenInfo) -> [String; 5] {
    [
        t.id.clone(),
        t.scope.clone(),
        match t.fleet {
            true => "fleet".into(),
            false => "this host".into(),
        },
        t.uid.map_or("berth's".into(), |u| u.to_string()),
        match (&t.expires_at, t.expired) {
            (Some(at), true) => format!("expired {at}"),
            (Some(at), false) => at.clone(),
            (None, _) => "never".into(),
        },
    ]
}

const HEADER: [&str; 5] = ["id", "scope", "honoured by", "uid", "expires"];

pub fn token_main(a: TokenArgs) -> anyhow::Result<u8> {
    match a.cmd {
        TokenCmd::Create {
            scope,
            uid,
            expires,
            conn,
        } => {
            let c = Client::new(&conn)?;
            let body = TokenRequest {
                scope,
                uid,
                expires_s: expires.map(|ms| ms.div_ceil(1000)),
            };
            let r = match c.call("POST", "/v1/tokens", Some(&body)) {
                Ok(r) => r,
                Err(e) => return Ok(c.unreachable(&e)),
            };
            // The secret alone on stdout (`T=$(berth token create ...)`); what it is, on
            // stderr.
            print_reply(&r, conn.json, |t: &TokenCreated| {
                eprintln!(
                    "berth: token {} ({}, uid {}, expires {}); its secret is shown this once:",
                    t.id,
                    t.scope,
                    t.uid,
                    t.expires_at.as_deref().unwrap_or("never")
                );
                t.token.clone()
            })
        }
        TokenCmd::List { conn } => {
            let c = Client::new(&conn)?;
            let r = match c.call::<()>("GET", "/v1/tokens", None) {
                Ok(r) => r,
                Err(e) => return Ok(c.unreachable(&e)),
            };
            print_reply(&r, conn.json, |l: &TokenList| {
                let rows: Vec<[String; 5]> = l.tokens.iter().map(row).collect();
                crate::show::table(HEADER, &rows)
            })
        }
        TokenCmd::Revoke { id, conn } => {
            let c = Client::new(&conn)?;
            let r = match c.call::<()>("DELETE", &format!("/v1/tokens/{id}"), None) {
                Ok(r) => r,
                Err(e) => return Ok(c.unreachable(&e)),
            };
            print_reply(&r, conn.json, |t: &TokenInfo| {
                format!("revoked {} ({})", t.id, t.scope)
            })
        }
    }
}
