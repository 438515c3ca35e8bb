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

mod openapi;

#[cfg(test)]
use openapi::*;
pub use openapi::{openapi, operation_id};

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
                "One run; with wait_s, as soon as it changes (or unchanged after wait_s); with state (the state last seen), at once if it is no longer in it",
            )
            .query(&[("wait_s", "integer"), ("state", "string")])
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
        .chain(fleet_drain())
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

/// Issue 38 Build 3: the fleet's drain (G4 fleet-wide).
fn fleet_drain() -> Vec<(Route, MethodRouter<Api>)> {
    use axum::routing::{delete, post};
    use HttpMethod::{Delete, Post};
    let o = Some(Scope::Operator);
    vec![
        (
            route(
                Post,
                "/v1/fleet/drain",
                o,
                "Fleet mode: drain every host of the fleet (G4 fleet-wide)",
            )
            .takes("DrainRequest")
            .answers(200, Body::Json("Drain")),
            post(super::fleet::drain_start),
        ),
        (
            route(
                Delete,
                "/v1/fleet/drain",
                o,
                "Fleet mode: end the fleet's drain",
            )
            .answers(200, Body::Json("Drain")),
            delete(super::fleet::drain_end),
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

async fn openapi_json() -> axum::response::Response {
    use axum::response::IntoResponse;
    axum::Json(openapi()).into_response()
}

#[cfg(test)]
mod tests;
