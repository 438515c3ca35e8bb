//! The document against the router, the validator, its snapshot and its examples.

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
    let said =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
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
        fleet: false,
    };
    *locked.shared.tokens.write().unwrap() = vec![(crate::auth::hash_token("r"), read)];
    let mut router = super::super::router(locked);
    for (r, _) in routes() {
        let listed: Vec<u16> = refusals(&r).iter().map(|(s, _, _)| *s).collect();
        let uri = r.path.replace(['{', '}'], "");
        for (token, status, code) in [(None, 401, "unauthorized"), (Some("r"), 403, "forbidden")] {
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
        if path.ends_with("doc") {
            continue; // (the table and this test's own text name the calls)
        }
        let text = std::fs::read_to_string(path).unwrap();
        adders += text.matches(".route(").count() + text.matches(".nest(").count();
    }
    assert_eq!(adders, 1, "a route is added outside the loop over routes()");
}
