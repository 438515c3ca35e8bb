//! Who may call what: `authenticate` (limits, the reserve, the caller by token) and
//! `require` (the scope of the router a route is declared in), and the fallbacks.

use super::*;

/// Refuses a caller whose scope is below `need` (the public group needs none) and
/// counts what was answered as `berth_http_requests_total{route, method, status}`, the
/// refusal included. Attached to each router of `router` (one per scope), so a route
/// gets the scope of the router it is declared in, never one matched from its path.
/// What no route answers is counted as `unmatched` where it is refused
/// (`count_unmatched`).
///
/// One layer for both, and the head's limits checked in `authenticate`: each
/// `from_fn` layer boxes a future of about 1 KiB that a queued long poll keeps for as
/// long as it waits.
pub(super) async fn require(
    need: Option<Scope>,
    shared: Arc<Shared>,
    req: Request,
    next: Next,
) -> Response {
    let method = req.method().clone();
    // The route table's own path: a static label, no String per request.
    let route = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .and_then(|m| doc::paths().iter().find(|p| **p == m.as_str()).copied())
        .unwrap_or("unmatched");
    let scope = req
        .extensions()
        .get::<Caller>()
        .map_or(Scope::Read, |c| c.scope);
    let res = match need {
        Some(need) if scope < need => ApiError::new(
            403,
            "forbidden",
            format!(
                "this call needs the {} scope; the token has {}",
                need.as_str(),
                scope.as_str()
            ),
        )
        .into_response(),
        _ => next.run(req).await,
    };
    // A parked long poll is counted when its answer is sent.
    if res
        .extensions()
        .get::<crate::http::park::Placeholder>()
        .is_none()
    {
        shared.metrics.http(route, &method, res.status().as_u16());
    }
    res
}

/// The outermost layer: an oversized head is refused before anything else reads it,
/// then the caller's token is looked up.
pub(super) async fn authenticate(
    AxState(api): AxState<Api>,
    mut req: Request,
    next: Next,
) -> Response {
    if let Err(refused) = crate::http::limits(&req) {
        return refused.into_response();
    }
    let mark = req
        .extensions()
        .get::<Arc<crate::http::ConnMark>>()
        .cloned();
    // Issue 32 finding 2: a reserved connection serves upkeep only.
    if mark.as_ref().is_some_and(|m| m.reserved)
        && !crate::http::is_upkeep(req.method(), req.uri().path())
    {
        let busy = crate::http::reserved_for_upkeep().into_response();
        return count_unmatched(&api, req.method(), busy);
    }
    let authed = || {
        // This connection belongs to a token holder now: never closed for room.
        if let Some(m) = &mark {
            m.authed.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    };
    // HEAD answers as GET does (without the body): the same rule for both.
    let reads = matches!(
        *req.method(),
        axum::http::Method::GET | axum::http::Method::HEAD
    );
    if api.auth && reads && is_public(req.uri().path()) {
        // No caller, so no scope: these routes are in no scoped router.
        return next.run(req).await;
    }
    if !api.auth {
        authed();
        req.extensions_mut().insert(Caller {
            uid: api.uid,
            tenant: None,
            token: None,
            scope: Scope::Admin,
        });
        return next.run(req).await;
    }
    match caller_of(&api, &req) {
        Ok(caller) => {
            req.extensions_mut().insert(caller);
            authed();
            next.run(req).await
        }
        Err(refused) => count_unmatched(&api, req.method(), refused.into_response()),
    }
}

/// Who calls, by the bearer token: a known token that has not expired, or `401`.
pub(super) fn caller_of(api: &Api, req: &Request) -> Result<Caller, ApiError> {
    let token = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let Some(token) = token else {
        return Err(ApiError::new(
            401,
            "unauthorized",
            "a bearer token is required (Authorization: Bearer <token>)",
        ));
    };
    let grant = {
        let tokens = api.shared.tokens.read().unwrap();
        auth::lookup_keyed(&tokens, token)
    };
    let Some((grant, key)) = grant else {
        return Err(ApiError::new(401, "unauthorized", "the token is not valid"));
    };
    // The clock is read only for a token that can expire.
    if grant.expires_ms.is_some() && grant.expired(crate::clock::wall_ms()) {
        return Err(ApiError::new(401, "unauthorized", "the token has expired"));
    }
    let auth::Grant { scope, uid, .. } = grant;
    Ok(Caller {
        uid: uid.unwrap_or(api.uid),
        // The admin token keeps full reach whatever uid it was made for (S9).
        tenant: uid.filter(|_| scope != Scope::Admin),
        token: Some(key),
        scope,
    })
}

pub(super) async fn not_found(AxState(api): AxState<Api>, method: axum::http::Method) -> Response {
    let refused = ApiError::new(404, "not_found", "no such endpoint");
    count_unmatched(&api, &method, refused.into_response())
}

pub(super) async fn method_not_allowed(
    AxState(api): AxState<Api>,
    method: axum::http::Method,
) -> Response {
    let refused = ApiError::new(
        405,
        "method_not_allowed",
        "this endpoint does not take that method",
    );
    count_unmatched(&api, &method, refused.into_response())
}

/// Paths anyone may GET without a token: the routes the one route table declares
/// without a scope (the dashboard page, static, holding no data and asking the API with
/// the user's token; and the API's description). Read from the table, not listed here.
fn is_public(path: &str) -> bool {
    static PUBLIC: std::sync::OnceLock<Vec<&'static str>> = std::sync::OnceLock::new();
    let public = PUBLIC.get_or_init(|| {
        super::doc::routes()
            .into_iter()
            .filter(|(r, _)| r.scope.is_none())
            .map(|(r, _)| r.path)
            .collect()
    });
    public.contains(&path)
}

/// A refusal no route saw: counted as `unmatched`.
pub(super) fn count_unmatched(api: &Api, method: &axum::http::Method, res: Response) -> Response {
    api.shared
        .metrics
        .http("unmatched", method, res.status().as_u16());
    res
}
