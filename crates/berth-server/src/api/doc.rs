//! The API's routes, described once: each entry of [`routes`] is both a route of the
//! router (`super::router` adds exactly these) and an operation of the OpenAPI 3.1
//! document at `/v1/openapi.json`, whose schemas are generated from berth-client's wire
//! types. So the router and the document cannot disagree, and nothing in the document
//! is written by hand but the one-line summaries.

use axum::routing::MethodRouter;
use berth_client::wire;
use utoipa::openapi::content::ContentBuilder;
use utoipa::openapi::path::{HttpMethod, OperationBuilder, ParameterBuilder, ParameterIn};
use utoipa::openapi::request_body::RequestBodyBuilder;
use utoipa::openapi::response::ResponseBuilder;
use utoipa::openapi::schema::{ComponentsBuilder, ObjectBuilder, Type};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme};
use utoipa::openapi::{
    InfoBuilder, OpenApi, OpenApiBuilder, PathItem, PathsBuilder, Ref, RefOr, Required,
};

use super::{observe, runtime, tokens, Api};
use crate::auth::Scope;

/// What an answer's body is.
#[derive(Clone, Copy, Debug)]
pub enum Body {
    /// JSON: the named wire type.
    Json(&'static str),
    /// `application/x-ndjson`: lines of the named wire type.
    Lines(&'static str),
    /// `text/event-stream`: events whose data is the named wire type.
    Events(&'static str),
    /// Anything else, by media type (text, HTML).
    Other(&'static str),
}

/// One route: method, path, the scope its token needs (`None`: public), what it takes
/// and what it answers.
#[derive(Clone)]
pub struct Route {
    pub method: HttpMethod,
    pub path: &'static str,
    pub scope: Option<Scope>,
    pub summary: &'static str,
    pub query: &'static [(&'static str, &'static str)],
    pub request: Option<&'static str>,
    /// The success status and body; a second body is the streamed form (asked for with
    /// `Accept: application/x-ndjson`).
    pub ok: (u16, Body, Option<Body>),
    /// Another success status and its body (a detached acquire's `202`).
    pub also: Option<(u16, Body)>,
}

const fn route(
    method: HttpMethod,
    path: &'static str,
    scope: Option<Scope>,
    summary: &'static str,
) -> Route {
    Route {
        method,
        path,
        scope,
        summary,
        query: &[],
        request: None,
        ok: (200, Body::Other("application/json"), None),
        also: None,
    }
}

impl Route {
    /// The method as HTTP spells it.
    pub fn method_str(&self) -> &'static str {
        match self.method {
            HttpMethod::Get => "GET",
            HttpMethod::Post => "POST",
            HttpMethod::Delete => "DELETE",
            HttpMethod::Put => "PUT",
            HttpMethod::Patch => "PATCH",
            HttpMethod::Head => "HEAD",
            HttpMethod::Options => "OPTIONS",
            HttpMethod::Trace => "TRACE",
        }
    }
    fn query(mut self, q: &'static [(&'static str, &'static str)]) -> Route {
        self.query = q;
        self
    }
    fn takes(mut self, schema: &'static str) -> Route {
        self.request = Some(schema);
        self
    }
    fn answers(mut self, status: u16, body: Body) -> Route {
        self.ok = (status, body, None);
        self
    }
    fn or_streams(mut self, body: Body) -> Route {
        self.ok.2 = Some(body);
        self
    }
    fn or_answers(mut self, status: u16, body: Body) -> Route {
        self.also = Some((status, body));
        self
    }
}

/// Every path of the route table, once (metrics label requests with these, so that a
/// label is never a String made per request).
pub fn paths() -> &'static [&'static str] {
    static PATHS: std::sync::OnceLock<Vec<&'static str>> = std::sync::OnceLock::new();
    PATHS.get_or_init(|| routes().iter().map(|(r, _)| r.path).collect())
}

/// Every route of API v1 with its handler.
pub fn routes() -> Vec<(Route, MethodRouter<Api>)> {
    use axum::routing::get;
    use HttpMethod::Get;
    let r = Some(Scope::Read);
    vec![
        (
            route(
                Get,
                "/v1/runs",
                r,
                "List live runs (all=true: ended ones too)",
            )
            .query(&[("limit", "integer"), ("all", "boolean")])
            .answers(200, Body::Json("RunList")),
            get(super::list_runs),
        ),
        (
            route(
                Get,
                "/v1/runs/{id}",
                r,
                "One run; with wait_s, as soon as it changes (or unchanged after wait_s)",
            )
            .query(&[("wait_s", "integer")])
            .answers(200, Body::Json("Run")),
            get(super::get_run),
        ),
        (
            route(
                Get,
                "/v1/status",
                r,
                "The host's capacity, queue, projects and reaper",
            )
            .answers(200, Body::Json("Status")),
            get(super::status),
        ),
        (
            route(
                Get,
                "/v1/fleet",
                r,
                "Fleet mode: every live host's capacity and queue, the fleet-wide sums, the dead hosts (F4)",
            )
            .answers(200, Body::Json("Fleet")),
            get(super::fleet::fleet),
        ),
        (
            route(
                Get,
                "/v1/fences/check",
                r,
                "Is this fence the run's current lease (L2)?",
            )
            .query(&[("run_id", "string"), ("fence", "integer")])
            .answers(200, Body::Json("FenceCheck")),
            get(super::fence_check),
        ),
    ]
    .into_iter()
    .chain(observing())
    .collect()
}

/// (Continued: routes are listed in two functions to keep each short.)
fn observing() -> Vec<(Route, MethodRouter<Api>)> {
    use axum::routing::get;
    use HttpMethod::Get;
    let r = Some(Scope::Read);
    vec![
        (
            route(
                Get,
                "/v1/journal",
                r,
                "Journal entries after a sequence number (D5)",
            )
            .query(&[("after", "integer"), ("limit", "integer")])
            .answers(200, Body::Lines("JournalEntry")),
            get(observe::journal),
        ),
        (
            route(
                Get,
                "/v1/journal/export",
                r,
                "Entries from..through (default 1..last) with their SHA-256 (header X-Berth-Journal-Sha256), streamed; 410 journal_pruned once retention deleted the start, 429 too_many_exports; ?scope= keeps one experiment scope's entries",
            )
            .query(&[("from", "integer"), ("through", "integer"), ("scope", "string")])
            .answers(200, Body::Lines("JournalEntry")),
            get(observe::export),
        ),
        (
            route(
                Get,
                "/v1/events",
                r,
                "The journal live, as server-sent events; resumes after Last-Event-ID",
            )
            .query(&[
                ("after", "integer"),
                ("run", "string"),
                ("project", "string"),
                ("kind", "string"),
            ])
            .answers(200, Body::Events("JournalEntry")),
            get(observe::events),
        ),
        (
            route(Get, "/metrics", r, "Prometheus metrics (OpenMetrics text)")
                .answers(200, Body::Other("application/openmetrics-text")),
            get(observe::metrics),
        ),
    ]
    .into_iter()
    .chain(changes())
    .collect()
}

/// The routes that change something (operator and admin), and the public ones.
fn changes() -> Vec<(Route, MethodRouter<Api>)> {
    use axum::routing::{delete, post};
    use HttpMethod::{Delete, Post};
    let o = Some(Scope::Operator);
    vec![
        (
            route(
                Post,
                "/v1/runs",
                o,
                "Ask for a berth; waits until granted (or streams its progress, or with detach answers 202 at once)",
            )
            .takes("AcquireRequest")
            .answers(201, Body::Json("Run"))
            .or_streams(Body::Lines("AcquireEvent"))
            .or_answers(202, Body::Json("Run")),
            post(super::acquire),
        ),
        (
            route(
                Delete,
                "/v1/runs/{id}",
                o,
                "Cancel a waiter, or release a lease (?fence=)",
            )
            .query(&[("fence", "integer")])
            .answers(200, Body::Json("Run")),
            delete(super::delete_run),
        ),
        (
            route(
                Post,
                "/v1/runs/{id}/renew",
                o,
                "Renew a lease, or a waiter's deadline",
            )
            .takes("RenewRequest")
            .answers(200, Body::Json("Run")),
            post(super::renew),
        ),
        (
            route(Post, "/v1/runs/{id}/release", o, "Release a lease")
                .takes("ReleaseRequest")
                .answers(200, Body::Json("Run")),
            post(super::release),
        ),
        (
            route(
                Post,
                "/v1/runs/{id}/processes",
                o,
                "Register a process the run started (P1)",
            )
            .takes("ProcessRequest")
            .answers(201, Body::Json("Run")),
            post(super::register_process),
        ),
    ]
    .into_iter()
    .chain(public_and_admin())
    .chain(threads_and_drain())
    .chain(budgets())
    .collect()
}

/// B1–B6: experiment scopes, their tokens and their control.
fn budgets() -> Vec<(Route, MethodRouter<Api>)> {
    use super::scopes as s;
    use axum::routing::{delete, get, post};
    use HttpMethod::{Delete, Get, Post};
    let (r, o, a) = (Some(Scope::Read), Some(Scope::Operator), Some(Scope::Admin));
    vec![
        (
            route(Get, "/v1/scopes", r, "Every experiment scope: control, generation, tokens per harness")
                .answers(200, Body::Json("ScopeList")),
            get(s::list),
        ),
        (
            route(Get, "/v1/scopes/{id}", r, "A scope: policy, manifest, tokens with their owners, lapsed owners, control, generation, receipts, waiters (B6)")
                .answers(200, Body::Json("Scope")),
            get(s::get_scope),
        ),
        (
            route(Delete, "/v1/scopes/{id}", o, "Forget an idle scope (no run, token or control state holds it; S10): 409 scope_in_use otherwise")
                .answers(200, Body::Json("ScopeSummary")),
            delete(s::delete_scope),
        ),
        (
            route(Post, "/v1/scopes/{id}/reservations", o, "Reserve a turn's token by (owner, operation_id): 201 new, 200 a retry's; 409 budget_full never queues (B2)")
                .takes("ReservationRequest")
                .answers(201, Body::Json("Reservation"))
                .or_answers(200, Body::Json("Reservation")),
            post(s::reserve),
        ),
        (
            route(Delete, "/v1/scopes/{id}/reservations/{owner}/{operation_id}", o, "The owner gives its token back (B3)")
                .answers(200, Body::Json("ScopeToken")),
            delete(s::unreserve),
        ),
        (
            route(Post, "/v1/scopes/{id}/reconcile", a, "Free every token an owner holds (B3), journaled with its reason")
                .takes("ReconcileRequest")
                .answers(200, Body::Json("Reconciled")),
            post(s::reconcile),
        ),
        (
            route(Post, "/v1/scopes/{id}/control", o, "Pause, stop or resume the scope, idempotent by request_id (B4)")
                .takes("ControlRequest")
                .answers(200, Body::Json("ControlReceipt")),
            post(s::control),
        ),
    ]
}

/// G0–G4: agent threads, the drain and the idle check.
fn threads_and_drain() -> Vec<(Route, MethodRouter<Api>)> {
    use super::threads as t;
    use axum::routing::{delete, get, post};
    use HttpMethod::{Delete, Get, Post};
    let (r, o) = (Some(Scope::Read), Some(Scope::Operator));
    let claim = |path, what| {
        route(Post, path, o, what)
            .takes("ThreadClaim")
            .answers(200, Body::Json("Thread"))
    };
    vec![
        (
            claim("/v1/threads/{key}/attach", "Register the thread for a run (G1); 409 registration_mismatch names the owner (G2)"),
            post(t::attach),
        ),
        (
            claim("/v1/threads/{key}/deadline", "The owner moves its registration's deadline (G3)"),
            post(t::deadline),
        ),
        (
            claim("/v1/threads/{key}/detach", "The owner ends its registration (G3); evict: true lets the workspace go"),
            post(t::detach),
        ),
        (
            route(Get, "/v1/threads/{key}", r, "A thread: owner, registration, workspace, evictions")
                .answers(200, Body::Json("Thread")),
            get(t::get_thread),
        ),
        (
            route(Delete, "/v1/threads/{key}", o, "Evict the thread's workspace (refused while registered)")
                .answers(200, Body::Json("Thread")),
            delete(t::evict),
        ),
        (
            route(Get, "/v1/threads", r, "Every thread").answers(200, Body::Json("ThreadList")),
            get(t::list),
        ),
        (
            route(Get, "/v1/drain", r, "The drain and what it waits for (G4)").answers(200, Body::Json("Drain")),
            get(t::drain_get),
        ),
        (
            route(Post, "/v1/drain", o, "Start draining: no new runs or registrations (G4)")
                .takes("DrainRequest")
                .answers(200, Body::Json("Drain")),
            post(t::drain_start),
        ),
        (
            route(Delete, "/v1/drain", o, "End the drain").answers(200, Body::Json("Drain")),
            delete(t::drain_end),
        ),
        (
            route(Get, "/v1/idle", r, "Whether the host is idle: live runs and registrations").answers(200, Body::Json("Idle")),
            get(t::idle),
        ),
    ]
}

/// (Continued: routes are listed in two functions to keep each short.)
fn public_and_admin() -> Vec<(Route, MethodRouter<Api>)> {
    use axum::routing::{delete, get, post};
    use HttpMethod::{Delete, Get, Post};
    let (o, a) = (Some(Scope::Operator), Some(Scope::Admin));
    vec![
        (
            route(
                Post,
                "/v1/runs/{id}/runtime",
                o,
                "Start the run's runtime and prove its ports (C7)",
            )
            .takes("RuntimeRequest")
            .answers(200, Body::Json("RuntimeStarted"))
            .or_streams(Body::Lines("RuntimeEvent")),
            post(runtime::start_runtime),
        ),
        (
            route(Post, "/v1/tokens", a, "Make a token (with `uid`: one that acts for that user; with `expires_s`: refused after that)")
                .takes("TokenRequest")
                .answers(201, Body::Json("TokenCreated")),
            post(tokens::create_token),
        ),
        (
            route(Get, "/v1/tokens", a, "Every token: id, scope, user, expiry (never a secret)")
                .answers(200, Body::Json("TokenList")),
            get(tokens::list_tokens),
        ),
        (
            route(Delete, "/v1/tokens/{id}", a, "Revoke a token by its id: refused from then on, here and after restarts")
                .answers(200, Body::Json("TokenInfo")),
            delete(tokens::revoke_token),
        ),
        (
            route(Post, "/v1/reap", a, "One reaper pass now (P4)")
                .answers(200, Body::Json("ReapReport")),
            post(super::reap),
        ),
        (
            route(
                Get,
                "/",
                None,
                "The dashboard (a static page; it asks the API with your token)",
            )
            .answers(200, Body::Other("text/html")),
            get(observe::dashboard),
        ),
        (
            route(Get, "/v1/openapi.json", None, "This document")
                .answers(200, Body::Other("application/json")),
            get(openapi_json),
        ),
    ]
}

/// The document, built once.
pub fn openapi() -> &'static OpenApi {
    static DOC: std::sync::OnceLock<OpenApi> = std::sync::OnceLock::new();
    DOC.get_or_init(build)
}

async fn openapi_json() -> axum::response::Response {
    use axum::response::IntoResponse;
    axum::Json(openapi()).into_response()
}

fn schema_ref(name: &str) -> RefOr<utoipa::openapi::schema::Schema> {
    RefOr::Ref(Ref::from_schema_name(name))
}

fn content(body: Body) -> (&'static str, utoipa::openapi::content::Content) {
    let (media, schema) = match body {
        Body::Json(s) => ("application/json", Some(s)),
        Body::Lines(s) => ("application/x-ndjson", Some(s)),
        Body::Events(s) => ("text/event-stream", Some(s)),
        Body::Other(m) => (m, None),
    };
    let mut c = ContentBuilder::new();
    if let Some(s) = schema {
        c = c.schema(Some(schema_ref(s)));
    }
    (media, c.build())
}

/// A route's `operationId`: a stable name generated clients call it by (`acquireRun`,
/// `renewRun`). Every route has one (`every_route_has_a_unique_operation_id`).
pub fn operation_id(method: &HttpMethod, path: &str) -> Option<&'static str> {
    use HttpMethod::{Delete, Get, Post};
    Some(match (method, path) {
        (Get, "/v1/runs") => "listRuns",
        (Post, "/v1/runs") => "acquireRun",
        (Get, "/v1/runs/{id}") => "getRun",
        (Delete, "/v1/runs/{id}") => "cancelRun",
        (Get, "/v1/status") => "getStatus",
        (Get, "/v1/fleet") => "getFleet",
        (Get, "/v1/fences/check") => "checkFence",
        (Get, "/v1/journal") => "readJournal",
        (Get, "/v1/journal/export") => "exportJournal",
        (Get, "/v1/events") => "streamEvents",
        (Get, "/metrics") => "getMetrics",
        (Post, "/v1/runs/{id}/renew") => "renewRun",
        (Post, "/v1/runs/{id}/release") => "releaseRun",
        (Post, "/v1/runs/{id}/processes") => "registerProcess",
        (Post, "/v1/runs/{id}/runtime") => "startRuntime",
        (Get, "/v1/tokens") => "listTokens",
        (Post, "/v1/tokens") => "createToken",
        (Delete, "/v1/tokens/{id}") => "revokeToken",
        (Post, "/v1/reap") => "reap",
        (Get, "/") => "getDashboard",
        (Get, "/v1/openapi.json") => "getOpenApi",
        (Post, "/v1/threads/{key}/attach") => "attachThread",
        (Post, "/v1/threads/{key}/deadline") => "moveThreadDeadline",
        (Post, "/v1/threads/{key}/detach") => "detachThread",
        (Get, "/v1/threads/{key}") => "getThread",
        (Delete, "/v1/threads/{key}") => "evictThread",
        (Get, "/v1/threads") => "listThreads",
        (Get, "/v1/drain") => "getDrain",
        (Post, "/v1/drain") => "startDrain",
        (Delete, "/v1/drain") => "endDrain",
        (Get, "/v1/idle") => "getIdle",
        (Get, "/v1/scopes") => "listScopes",
        (Get, "/v1/scopes/{id}") => "getScope",
        (Delete, "/v1/scopes/{id}") => "forgetScope",
        (Post, "/v1/scopes/{id}/reservations") => "reserveToken",
        (Delete, "/v1/scopes/{id}/reservations/{owner}/{operation_id}") => "unreserveToken",
        (Post, "/v1/scopes/{id}/reconcile") => "reconcileScope",
        (Post, "/v1/scopes/{id}/control") => "controlScope",
        _ => return None,
    })
}

fn operation(r: &Route) -> utoipa::openapi::path::Operation {
    let mut op = OperationBuilder::new()
        .summary(Some(r.summary))
        .operation_id(operation_id(&r.method, r.path));
    for p in parameters(r) {
        op = op.parameter(p);
    }
    if let Some(req) = r.request {
        let (media, mut c) = content(Body::Json(req));
        c.example = request_example(req);
        op = op.request_body(Some(
            RequestBodyBuilder::new()
                .content(media, c)
                .required(Some(Required::True))
                .build(),
        ));
    }
    let (status, body, streamed) = r.ok;
    let mut ok = ResponseBuilder::new().description("success");
    for b in std::iter::once(body).chain(streamed) {
        let (media, c) = content(b);
        ok = ok.content(media, c);
    }
    let (media, c) = content(Body::Json("ErrorBody"));
    let refused = ResponseBuilder::new()
        .description("refused: {\"error\": {code, message, details}}")
        .content(media, c);
    op = op.response(status.to_string(), ok);
    if let Some((status, body)) = r.also {
        let (media, c) = content(body);
        let also = ResponseBuilder::new()
            .description("accepted")
            .content(media, c);
        op = op.response(status.to_string(), also);
    }
    for (status, code, message) in refusals(r) {
        let (media, mut c) = content(Body::Json("ErrorBody"));
        c.example =
            Some(serde_json::json!({"error": {"code": code, "message": message, "details": {}}}));
        let says = ResponseBuilder::new()
            .description(format!("refused: {code}"))
            .content(media, c);
        op = op.response(status.to_string(), says);
    }
    op = op.response("default", refused);
    if r.scope.is_some() {
        op = op.security(SecurityRequirement::new("bearer", Vec::<String>::new()));
    }
    op.build()
}

/// Every `{name}` of the path (each declared: the reservation's three were one), then
/// the query's.
fn parameters(r: &Route) -> Vec<utoipa::openapi::path::Parameter> {
    let names = r
        .path
        .split('{')
        .skip(1)
        .filter_map(|s| s.split('}').next());
    let mut out: Vec<_> = names
        .map(|name| {
            ParameterBuilder::new()
                .name(name)
                .parameter_in(ParameterIn::Path)
                .required(Required::True)
                .schema(Some(ObjectBuilder::new().schema_type(Type::String)))
                .build()
        })
        .collect();
    for (name, ty) in r.query {
        let t = match *ty {
            "integer" => Type::Integer,
            "boolean" => Type::Boolean,
            _ => Type::String,
        };
        out.push(
            ParameterBuilder::new()
                .name(*name)
                .parameter_in(ParameterIn::Query)
                .required(Required::False)
                .schema(Some(ObjectBuilder::new().schema_type(t)))
                .build(),
        );
    }
    out
}

/// The request bodies that carry a fence: a stale one is refused (L2).
const FENCED: &[&str] = &[
    "RenewRequest",
    "ReleaseRequest",
    "ProcessRequest",
    "RuntimeRequest",
];

/// The refusals every route of its kind can answer, each documented with its status,
/// code and an example message (any other is the `default` response, the same
/// envelope). A test sends each route what these say it refuses and checks the answer.
fn refusals(r: &Route) -> Vec<(u16, &'static str, &'static str)> {
    let mut out = Vec::new();
    if r.request.is_some() || !r.query.is_empty() {
        out.push((
            400,
            "invalid",
            "ttl_s: must be at most 86400 (the daemon's --ttl-max)",
        ));
    }
    if let Some(scope) = r.scope {
        out.push((
            401,
            "unauthorized",
            "a bearer token is required (Authorization: Bearer <token>)",
        ));
        if scope > Scope::Read {
            out.push((
                403,
                "forbidden",
                "this call needs the operator scope; the token has read",
            ));
        }
    }
    if r.path.contains('{') {
        out.push((404, "not_found", "run agent-7 is not known"));
    }
    if r.request.is_some_and(|q| FENCED.contains(&q)) {
        out.push((
            409,
            "stale_fence",
            "fence 41 is not the current fence of run agent-7 (current: 42)",
        ));
        out.push((
            410,
            "gone",
            "run agent-7 is released: its lease is over and cannot be acted on",
        ));
    }
    out
}

/// An example of each request body, as a client would send it (a test parses each
/// into its wire type, so an example cannot name a field the API does not take).
fn request_example(schema: &str) -> Option<serde_json::Value> {
    use serde_json::json;
    Some(match schema {
        "AcquireRequest" => json!({
            "project": "shop", "run_id": "agent-7", "priority": "foreground",
            "resources": {"memory": 2147483648_u64, "cpu_millis": 1000},
            "singletons": ["db"], "ttl_s": 300, "wait_s": 600,
            "labels": {"ticket": "SHOP-12"}
        }),
        "RenewRequest" => json!({"fence": 42, "ttl_s": 300}),
        "ReleaseRequest" | "RuntimeRequest" => json!({"fence": 42}),
        "ProcessRequest" => json!({"fence": 42, "pid": 31337}),
        "TokenRequest" => json!({"scope": "operator", "uid": 1000, "expires_s": 86400}),
        "ThreadClaim" => json!({
            "run_id": "agent-7", "owner_gen": "orchestrator-3", "owner_fence": 1,
            "run_budget_ms": 600000
        }),
        "DrainRequest" => json!({"reason": "kernel upgrade at 18:00"}),
        "ReservationRequest" => json!({
            "owner": "agent-7", "operation_id": "turn-12", "harness": "claude-code"
        }),
        "ReconcileRequest" => json!({"owner": "agent-7", "reason": "its orchestrator crashed"}),
        "ControlRequest" => json!({"request_id": "ctl-1", "mode": "pause"}),
        _ => return None,
    })
}

/// Runs, the host, tokens, the journal, threads and drain: their wire types.
fn run_and_host_schemas(c: ComponentsBuilder) -> ComponentsBuilder {
    c.schema_from::<wire::AcquireRequest>()
        .schema_from::<wire::RenewRequest>()
        .schema_from::<wire::ReleaseRequest>()
        .schema_from::<wire::ProcessRequest>()
        .schema_from::<wire::TokenRequest>()
        .schema_from::<wire::RuntimeRequest>()
        .schema_from::<wire::Reason>()
        .schema_from::<wire::Key>()
        .schema_from::<wire::Claim>()
        .schema_from::<wire::Run>()
        .schema_from::<wire::Fleet>()
        .schema_from::<wire::FleetHost>()
        .schema_from::<wire::FleetLoad>()
        .schema_from::<wire::FleetResource>()
        .schema_from::<wire::RunList>()
        .schema_from::<wire::AcquireEvent>()
        .schema_from::<wire::ErrorBody>()
        .schema_from::<wire::ErrorDetail>()
        .schema_from::<wire::ResourceStatus>()
        .schema_from::<wire::Evidence>()
        .schema_from::<wire::ProjectStatus>()
        .schema_from::<wire::Queued>()
        .schema_from::<wire::ReaperStatus>()
        .schema_from::<wire::LedgerStatus>()
        .schema_from::<wire::Status>()
        .schema_from::<wire::ReapReport>()
        .schema_from::<wire::FenceCheck>()
        .schema_from::<wire::TokenCreated>()
        .schema_from::<wire::TokenInfo>()
        .schema_from::<wire::TokenList>()
        .schema_from::<wire::RuntimeEvent>()
        .schema_from::<wire::RuntimeStarted>()
        .schema_from::<wire::JournalEntry>()
        .schema_from::<wire::StreamCutoff>()
        .schema_from::<wire::ThreadClaim>()
        .schema_from::<wire::ThreadOwner>()
        .schema_from::<wire::ThreadRegistration>()
        .schema_from::<wire::ThreadEviction>()
        .schema_from::<wire::Thread>()
        .schema_from::<wire::ThreadList>()
        .schema_from::<wire::DrainRequest>()
        .schema_from::<wire::DrainRecord>()
        .schema_from::<wire::Busy>()
        .schema_from::<wire::Drain>()
        .schema_from::<wire::Idle>()
}

/// B1–B6's wire types.
fn budget_schemas(c: ComponentsBuilder) -> ComponentsBuilder {
    c.schema_from::<wire::BudgetClaim>()
        .schema_from::<wire::ScopeManifest>()
        .schema_from::<wire::ReservationRequest>()
        .schema_from::<wire::ReconcileRequest>()
        .schema_from::<wire::ControlRequest>()
        .schema_from::<wire::ControlReceipt>()
        .schema_from::<wire::ScopeToken>()
        .schema_from::<wire::Reservation>()
        .schema_from::<wire::Reconciled>()
        .schema_from::<wire::ScopeWaiter>()
        .schema_from::<wire::HarnessFigures>()
        .schema_from::<wire::Scope>()
        .schema_from::<wire::ScopeSummary>()
        .schema_from::<wire::ScopeList>()
}

/// D5: `JournalEntry` says, for every kind, which schema its `data` has
/// (`x-berth-journal-kinds`: kind → `$ref`), from the one list of kinds there is.
fn with_journal_kinds(mut c: utoipa::openapi::Components) -> utoipa::openapi::Components {
    use utoipa::openapi::{schema::Schema, RefOr};
    if let Some(RefOr::T(Schema::Object(o))) = c.schemas.get_mut("JournalEntry") {
        let kinds: serde_json::Map<String, serde_json::Value> = wire::Journal::KINDS
            .iter()
            .map(|(kind, schema)| {
                let to = format!("#/components/schemas/{schema}");
                (kind.to_string(), serde_json::json!({ "$ref": to }))
            })
            .collect();
        let ext = o.extensions.get_or_insert_with(Default::default);
        ext.insert("x-berth-journal-kinds".into(), kinds.into());
    }
    c
}

fn build() -> OpenApi {
    let mut paths = PathsBuilder::new();
    for (r, _) in routes() {
        let mut item = PathItem::new(r.method.clone(), operation(&r));
        if let Some(scope) = r.scope {
            item.description = Some(format!("Needs a token of the {} scope.", scope.as_str()));
        }
        paths = paths.path(r.path, item);
    }
    let components = run_and_host_schemas(ComponentsBuilder::new());
    let components = wire::journal_schemas(budget_schemas(components))
        .security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        )
        .build();
    let components = with_journal_kinds(components);
    OpenApiBuilder::new()
        .info(
            InfoBuilder::new()
                .title("berth API v1")
                .version(env!("CARGO_PKG_VERSION"))
                .description(Some(
                    "Host admission and lease broker for agent runs and short jobs. Errors are {\"error\": {code, message, details}} with stable codes.",
                )),
        )
        .paths(paths)
        .components(Some(components))
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body as AxBody;
    use std::sync::Arc;
    use tower_service::Service;

    const SNAPSHOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/openapi.json");

    /// Issue 34: the served document passes a real validator, openapi-spec-validator
    /// (pinned in scripts/openapi-validator.txt; scripts/test.sh installs it and names
    /// it in BERTH_OPENAPI_VALIDATOR). Any error fails the test, and its output is shown.
    #[test]
    fn the_openapi_document_passes_openapi_spec_validator() {
        let Some(dir) = std::env::var_os("BERTH_OPENAPI_VALIDATOR") else {
            assert!(
                std::env::var_os("CI").is_none(),
                "BERTH_OPENAPI_VALIDATOR is not set: run the tests with scripts/test.sh"
            );
            eprintln!("skipped: BERTH_OPENAPI_VALIDATOR is not set (scripts/test.sh sets it)");
            return;
        };
        let file = std::env::temp_dir().join(format!("berth-openapi-{}.json", std::process::id()));
        std::fs::write(&file, serde_json::to_string_pretty(openapi()).unwrap()).unwrap();
        let out = std::process::Command::new("python3")
            .args(["-m", "openapi_spec_validator"])
            .arg(&file)
            .env("PYTHONPATH", &dir)
            .output()
            .expect("python3");
        let _ = std::fs::remove_file(&file);
        let said = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        eprintln!("openapi-spec-validator: {said}");
        assert!(out.status.success() && said.contains(": OK"), "{said}");
    }

    /// Issue 34: every operation has an `operationId`, once.
    #[test]
    fn every_route_has_a_unique_operation_id() {
        let mut seen = std::collections::BTreeSet::new();
        for (r, _) in routes() {
            let id = operation_id(&r.method, r.path)
                .unwrap_or_else(|| panic!("{} has no operationId", r.path));
            assert!(seen.insert(id), "{id} twice");
        }
    }

    /// The document is pinned: a change to a wire type or a route shows up here, and
    /// the TypeScript client's types (generated from this file) must follow it.
    /// `BERTH_BLESS=1` rewrites the file.
    #[test]
    fn the_openapi_document_matches_its_snapshot() {
        let now = serde_json::to_string_pretty(openapi()).unwrap() + "\n";
        if std::env::var_os("BERTH_BLESS").is_some() {
            std::fs::write(SNAPSHOT, &now).unwrap();
        }
        let pinned = std::fs::read_to_string(SNAPSHOT).unwrap_or_default();
        assert!(
            pinned == now,
            "docs/openapi.json is not the document berth serves; run BERTH_BLESS=1 cargo test -p berth-server the_openapi_document, and regenerate clients/typescript (npm run gen)"
        );
        let v: serde_json::Value = serde_json::from_str(&now).unwrap();
        assert_eq!(v["openapi"], "3.1.0");
        for schema in [
            "Run",
            "AcquireRequest",
            "Status",
            "JournalEntry",
            "ErrorBody",
        ] {
            assert!(v["components"]["schemas"][schema].is_object(), "{schema}");
        }
        // D5: every journal kind names a schema the document has.
        let kinds = &v["components"]["schemas"]["JournalEntry"]["x-berth-journal-kinds"];
        let kinds = kinds.as_object().expect("x-berth-journal-kinds");
        assert_eq!(kinds.len(), wire::Journal::KINDS.len());
        for (kind, to) in kinds {
            let name = to["$ref"].as_str().unwrap().rsplit('/').next().unwrap();
            assert!(
                v["components"]["schemas"][name].is_object(),
                "{kind}: {name}"
            );
        }
        let states = &v["components"]["schemas"]["Run"]["properties"]["state"]["enum"];
        assert_eq!(
            states.as_array().map(Vec::len),
            Some(berth_core::RunState::ALL.len())
        );
    }

    fn api() -> Api {
        // A daemon that is gone: routes that ask it answer 503, which is still routed.
        let (tx, _) = tokio::sync::mpsc::channel(1);
        Api {
            fleet: None,
            tx,
            shared: Arc::default(),
            auth: false,
            cfg: Arc::new(berth_core::Config::for_host(4, 8 << 30, 100 << 30)),
            uid: 0,
            starting: Arc::default(),
        }
    }

    /// Issue 34: each request body's example is a request the API takes: it parses
    /// into its wire type (which refuses unknown fields), and every body has one.
    #[test]
    fn every_request_example_is_a_request_the_api_takes() {
        fn parses<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> Result<(), String> {
            serde_json::from_value::<T>(v)
                .map(drop)
                .map_err(|e| e.to_string())
        }
        for (r, _) in routes() {
            let Some(name) = r.request else { continue };
            let example = request_example(name).unwrap_or_else(|| panic!("{name} has no example"));
            let parsed = match name {
                "AcquireRequest" => parses::<wire::AcquireRequest>(example),
                "RenewRequest" => parses::<wire::RenewRequest>(example),
                "ReleaseRequest" => parses::<wire::ReleaseRequest>(example),
                "RuntimeRequest" => parses::<wire::RuntimeRequest>(example),
                "ProcessRequest" => parses::<wire::ProcessRequest>(example),
                "TokenRequest" => parses::<wire::TokenRequest>(example),
                "ThreadClaim" => parses::<wire::ThreadClaim>(example),
                "DrainRequest" => parses::<wire::DrainRequest>(example),
                "ReservationRequest" => parses::<wire::ReservationRequest>(example),
                "ReconcileRequest" => parses::<wire::ReconcileRequest>(example),
                "ControlRequest" => parses::<wire::ControlRequest>(example),
                other => panic!("{other}: no wire type named here for its example"),
            };
            assert_eq!(parsed, Ok(()), "{} {}'s example", r.method_str(), r.path);
        }
    }

    /// Issue 34: the refusals the document lists for a route are what it answers:
    /// without a token, each route that lists 401 answers 401 `unauthorized`; with a
    /// read token, each that lists 403 answers 403 `forbidden` and each that does not
    /// is let through; a body that is not JSON is 400 `invalid` wherever 400 is listed.
    #[tokio::test]
    async fn every_documented_refusal_is_what_the_route_answers() {
        let mut locked = api();
        locked.auth = true;
        let read = crate::auth::Grant {
            scope: Scope::Read,
            uid: None,
            expires_ms: None,
        };
        *locked.shared.tokens.write().unwrap() = vec![(crate::auth::hash_token("r"), read)];
        let mut router = super::super::router(locked);
        for (r, _) in routes() {
            let listed: Vec<u16> = refusals(&r).iter().map(|(s, _, _)| *s).collect();
            let uri = r.path.replace(['{', '}'], "");
            for (token, status, code) in
                [(None, 401, "unauthorized"), (Some("r"), 403, "forbidden")]
            {
                let mut req = axum::http::Request::builder()
                    .method(r.method_str())
                    .uri(&uri);
                if let Some(t) = token {
                    req = req.header("authorization", format!("Bearer {t}"));
                }
                let res = router
                    .call(req.body(AxBody::empty()).unwrap())
                    .await
                    .unwrap();
                let got = res.status().as_u16();
                if listed.contains(&status) {
                    assert_eq!(got, status, "{} {}", r.method_str(), r.path);
                    let body = axum::body::to_bytes(res.into_body(), 1 << 20)
                        .await
                        .unwrap();
                    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
                    assert_eq!(v["error"]["code"], code, "{} {}", r.method_str(), r.path);
                } else if r.scope.is_some() {
                    assert_ne!(
                        got,
                        status,
                        "{} {} is not documented to answer it",
                        r.method_str(),
                        r.path
                    );
                }
            }
        }
        let mut open = super::super::router(api());
        for (r, _) in routes() {
            if r.request.is_none() {
                continue;
            }
            assert!(refusals(&r).iter().any(|(s, _, _)| *s == 400));
            let req = axum::http::Request::builder()
                .method(r.method_str())
                .uri(r.path.replace(['{', '}'], ""))
                .header("content-type", "application/json")
                .body(AxBody::from("[not json"))
                .unwrap();
            let res = open.call(req).await.unwrap();
            assert_eq!(res.status().as_u16(), 400, "{} {}", r.method_str(), r.path);
        }
    }

    /// Every operation in the document is routed (the router answers it with something
    /// other than its "no such endpoint" or "method not allowed"), and the router has
    /// no route besides the document's: `router` adds only `routes()`, and no other
    /// code in the API adds one.
    #[tokio::test]
    async fn every_documented_route_is_routed_and_every_route_documented() {
        let doc = serde_json::to_value(openapi()).unwrap();
        let paths = doc["paths"].as_object().unwrap();
        let mut ops = 0;
        let mut router = super::super::router(api());
        for (path, item) in paths {
            for method in item.as_object().unwrap().keys() {
                if !["get", "post", "delete", "put", "patch"].contains(&method.as_str()) {
                    continue;
                }
                ops += 1;
                let uri = path.replace("{id}", "x");
                let req = axum::http::Request::builder()
                    .method(method.to_uppercase().as_str())
                    .uri(&uri)
                    .header("content-type", "application/json")
                    .body(AxBody::from("{}"))
                    .unwrap();
                let res = router.call(req).await.unwrap();
                let status = res.status().as_u16();
                // (Only a 404's body is read: the event stream's never ends.)
                let text = if status == 404 {
                    let body = axum::body::to_bytes(res.into_body(), 1 << 20).await;
                    String::from_utf8_lossy(&body.unwrap_or_default()).into_owned()
                } else {
                    String::new()
                };
                assert!(
                    status != 405 && !(status == 404 && text.contains("no such endpoint")),
                    "{method} {path} is documented but not routed ({status} {text})"
                );
            }
        }
        assert_eq!(ops, routes().len(), "one operation per route");
        let unknown = axum::http::Request::builder()
            .uri("/v1/nothing")
            .body(AxBody::empty())
            .unwrap();
        assert_eq!(router.call(unknown).await.unwrap().status(), 404);
        // The converse: no code in the API adds a route of its own.
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src/api");
        let mut adders = 0;
        for f in std::fs::read_dir(dir).unwrap() {
            let path = f.unwrap().path();
            if path.ends_with("doc.rs") {
                continue; // (this test's own text names the calls)
            }
            let text = std::fs::read_to_string(path).unwrap();
            adders += text.matches(".route(").count() + text.matches(".nest(").count();
        }
        assert_eq!(adders, 1, "a route is added outside the loop over routes()");
    }
}
