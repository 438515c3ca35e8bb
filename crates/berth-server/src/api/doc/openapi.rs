//! The OpenAPI document, built once from the route table: each route's operation,
//! parameters, refusals and examples, and every wire type's schema.

use super::*;

/// The document, built once.
pub fn openapi() -> &'static OpenApi {
    static DOC: std::sync::OnceLock<OpenApi> = std::sync::OnceLock::new();
    DOC.get_or_init(build)
}

pub(super) fn schema_ref(name: &str) -> RefOr<utoipa::openapi::schema::Schema> {
    RefOr::Ref(Ref::from_schema_name(name))
}

pub(super) fn content(body: Body) -> (&'static str, utoipa::openapi::content::Content) {
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
        (Post, "/v1/fleet/drain") => "startFleetDrain",
        (Delete, "/v1/fleet/drain") => "endFleetDrain",
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

pub(super) fn operation(r: &Route) -> utoipa::openapi::path::Operation {
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
pub(super) fn parameters(r: &Route) -> Vec<utoipa::openapi::path::Parameter> {
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
pub(super) const FENCED: &[&str] = &[
    "RenewRequest",
    "ReleaseRequest",
    "ProcessRequest",
    "RuntimeRequest",
];

/// The refusals every route of its kind can answer, each documented with its status,
/// code and an example message (any other is the `default` response, the same
/// envelope). A test sends each route what these say it refuses and checks the answer.
pub(super) fn refusals(r: &Route) -> Vec<(u16, &'static str, &'static str)> {
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
pub(super) fn request_example(schema: &str) -> Option<serde_json::Value> {
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
pub(super) fn run_and_host_schemas(c: ComponentsBuilder) -> ComponentsBuilder {
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
        .schema_from::<wire::LimitsStatus>()
        .schema_from::<wire::RunUsage>()
        .schema_from::<wire::RunLimits>()
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
        .schema_from::<wire::FleetDrainRecord>()
        .schema_from::<wire::Busy>()
        .schema_from::<wire::Drain>()
        .schema_from::<wire::Idle>()
}

/// B1–B6's wire types.
pub(super) fn budget_schemas(c: ComponentsBuilder) -> ComponentsBuilder {
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
pub(super) fn with_journal_kinds(
    mut c: utoipa::openapi::Components,
) -> utoipa::openapi::Components {
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

pub(super) fn build() -> OpenApi {
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
