//! Tokens (S9): made, listed and revoked by an admin. Only hashes are kept; a token's
//! public name is its id, the first 16 hex digits of its hash.

use axum::extract::State as AxState;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use berth_client::wire::{TokenCreated, TokenInfo, TokenList, TokenRequest};

// A non-UTF-8 id is a JSON `400` naming `id`, not axum's plain text (found by the
// long-form HTTP fuzz).
use super::ParamPath as Path;
use super::{ask, json_body, Api, ApiError, Body, Caller};
use crate::auth::{self, Grant, Scope};
use crate::daemon::{FleetChange, Msg};
use crate::error::internal;
use berth_store::fleet::FleetToken;

/// The longest a token may be made for: ten years, in seconds.
pub const TOKEN_EXPIRES_S_MAX: u64 = 10 * 365 * 86_400;

fn info(hash: &str, g: &Grant, now_ms: u64) -> TokenInfo {
    TokenInfo {
        id: auth::token_id(hash).to_string(),
        scope: g.scope.as_str().to_string(),
        uid: g.uid,
        expires_at: g.expires_ms.map(crate::clock::rfc3339),
        expired: g.expired(now_ms),
        fleet: g.fleet,
    }
}

/// Issue 38 Build 3: in fleet mode a token is the fleet's. Its hash goes to the fleet
/// store first (a store that cannot be reached makes none: `503`), then into this
/// host's table and ledger; other hosts honour it once they read it (announced at
/// once, at their next heartbeat at the latest).
async fn make_fleet_token(api: &Api, grant: Grant) -> Result<String, ApiError> {
    let link = super::fleet::link(api)?;
    let token = tokio::task::spawn_blocking(auth::new_token)
        .await
        .map_err(|e| internal(format!("token: {e}")))?
        .map_err(|e| internal(format!("token: {e}")))?;
    let grant = Grant {
        fleet: true,
        ..grant
    };
    let hash = auth::hash_token(&token);
    let row = FleetToken {
        hash: hash.clone(),
        grant: grant.stored(),
        host_id: link.status.host_id(),
    };
    let version = link
        .ask(move |s| s.put_token(&row))
        .await
        .map_err(super::fleet::refused)?;
    let change = FleetChange::TokenMade { hash, grant };
    ask(api, |reply| Msg::FleetChanged {
        change,
        version,
        reply,
    })
    .await?;
    Ok(token)
}

/// Issue 38 Build 3: a fleet token (or one this host does not know, which may be a
/// fleet token it has not read yet) is revoked in the fleet store, then here; the
/// other hosts drop it when they read the change.
async fn revoke_fleet_token(
    api: &Api,
    link: &crate::fleet::Handle,
    id: &str,
    mirrored: Option<(String, Grant)>,
) -> Result<Option<(String, Grant)>, ApiError> {
    let asked = id.to_string();
    let (gone, version) = link
        .ask(move |s| s.revoke_token(&asked))
        .await
        .map_err(super::fleet::refused)?;
    let first = (gone.first()).and_then(|t| Some((t.hash.clone(), Grant::parse(&t.grant)?)));
    let mut hashes: Vec<String> = gone.into_iter().map(|t| t.hash).collect();
    hashes.extend(mirrored.iter().map(|(h, _)| h.clone()));
    let change = FleetChange::TokensRevoked { hashes };
    ask(api, |reply| Msg::FleetChanged {
        change,
        version,
        reply,
    })
    .await?;
    Ok(mirrored.or(first))
}

pub(super) async fn create_token(
    AxState(api): AxState<Api>,
    body: Body,
) -> Result<Response, ApiError> {
    let b: TokenRequest = json_body(body, false).await?;
    let scope = Scope::parse(&b.scope)
        .ok_or_else(|| ApiError::invalid("scope", "must be read, operator or admin"))?;
    let expires_ms = match b.expires_s {
        Some(s) if (1..=TOKEN_EXPIRES_S_MAX).contains(&s) => {
            Some(crate::clock::wall_ms() + s * 1000)
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "expires_s",
                format!("must be 1 to {TOKEN_EXPIRES_S_MAX} seconds (ten years)"),
            ))
        }
        None => None,
    };
    if let Some(uid) = b.uid {
        let known = tokio::task::spawn_blocking(move || crate::host::passwd_gid(uid).is_some())
            .await
            .unwrap_or(false);
        if !known {
            return Err(ApiError::invalid(
                "uid",
                format!("must name a user on this host; uid {uid} names none"),
            ));
        }
    }
    let grant = Grant {
        scope,
        uid: b.uid,
        expires_ms,
        fleet: false,
    };
    let token = match api.fleet.is_some() {
        true => make_fleet_token(&api, grant).await?,
        false => ask(&api, |reply| Msg::CreateToken { grant, reply }).await?,
    };
    Ok((
        StatusCode::CREATED,
        Json(TokenCreated {
            id: auth::token_id(&auth::hash_token(&token)).to_string(),
            token,
            scope: scope.as_str().to_string(),
            uid: b.uid.unwrap_or(api.uid),
            expires_at: expires_ms.map(crate::clock::rfc3339),
        }),
    )
        .into_response())
}

pub(super) async fn list_tokens(AxState(api): AxState<Api>) -> Result<Response, ApiError> {
    let now = crate::clock::wall_ms();
    let tokens = api
        .shared
        .tokens
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .map(|(hash, g)| info(hash, g, now))
        .collect();
    Ok(Json(TokenList { tokens }).into_response())
}

pub(super) async fn revoke_token(
    AxState(api): AxState<Api>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    if id.len() != 16 || !id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return Err(ApiError::invalid(
            "id",
            "must be a token's id: 16 lowercase hex digits, as `GET /v1/tokens` shows",
        ));
    }
    // The token this very request uses stays: revoking it would lock its holder out
    // mid-request (another admin token may revoke it).
    if caller.token == u64::from_str_radix(&id, 16).ok() {
        return Err(ApiError::new(
            409,
            "token_in_use",
            "that is the token this request is made with; revoke it with another admin token",
        ));
    }
    let known = (api.shared.tokens.read().unwrap_or_else(|e| e.into_inner()))
        .iter()
        .find(|(h, _)| auth::token_id(h) == id)
        .cloned();
    let revoked = match (&api.fleet, known) {
        (Some(link), known) if known.as_ref().is_none_or(|(_, g)| g.fleet) => {
            revoke_fleet_token(&api, link, &id, known).await?
        }
        _ => {
            ask(&api, |reply| Msg::RevokeToken {
                id: id.clone(),
                reply,
            })
            .await?
        }
    };
    match revoked {
        Some((hash, g)) => Ok(Json(info(&hash, &g, crate::clock::wall_ms())).into_response()),
        None => Err(
            ApiError::new(404, "not_found", format!("no token has the id {id}"))
                .with(serde_json::json!({ "id": id })),
        ),
    }
}
