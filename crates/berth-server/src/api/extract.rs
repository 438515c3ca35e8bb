//! What a handler takes from a request: path ids and parameters refused as JSON
//! `400`s, the query, whether it asks for NDJSON, and a JSON body within its limits.

use super::*;

/// The `{id}` of a route, refused with a JSON `400` (not axum's plain text) when the
/// path is not valid percent-encoded UTF-8.
pub struct RunIdPath(pub String);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for RunIdPath {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, ApiError> {
        match Path::<String>::from_request_parts(parts, state).await {
            Ok(Path(id)) => Ok(RunIdPath(id)),
            Err(_) => Err(ApiError::invalid(
                "run_id",
                "must be valid percent-encoded UTF-8",
            )),
        }
    }
}

/// A route's other path parameters (thread keys, scope ids, owners), refused like
/// `RunIdPath` with a JSON `400` that names the parameter, never axum's plain text.
pub struct ParamPath<T>(pub T);

impl<T: DeserializeOwned + Send, S: Send + Sync> axum::extract::FromRequestParts<S>
    for ParamPath<T>
{
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, ApiError> {
        use axum::extract::path::ErrorKind;
        use axum::extract::rejection::PathRejection;
        match Path::<T>::from_request_parts(parts, state).await {
            Ok(Path(v)) => Ok(ParamPath(v)),
            Err(PathRejection::FailedToDeserializePathParams(e)) => match e.kind() {
                ErrorKind::InvalidUtf8InPathParam { key } => Err(ApiError::invalid(
                    key,
                    "must be valid percent-encoded UTF-8",
                )),
                _ => Err(ApiError::invalid("path", e.body_text())),
            },
            Err(e) => Err(ApiError::invalid("path", e.body_text())),
        }
    }
}

/// Whether the client asked for a stream (`Accept: application/x-ndjson`). Read from
/// the head and kept as one bool: a waiter that kept the request's `HeaderMap` would
/// keep hyper's whole first read buffer (its values are slices of it), 8 KiB per
/// queued long poll, while hyper allocates another to watch the socket.
pub struct WantsNdjson(pub bool);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for WantsNdjson {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _state: &S,
    ) -> Result<Self, Self::Rejection> {
        Ok(WantsNdjson(
            parts
                .headers
                .get(header::ACCEPT)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.contains("application/x-ndjson")),
        ))
    }
}

/// Query parameters, refused with a JSON `400` when malformed.
pub struct Params(pub BTreeMap<String, String>);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Params {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, ApiError> {
        match Query::<BTreeMap<String, String>>::from_request_parts(parts, state).await {
            // A pair without a name (`?=true`) has no field a refusal could name.
            Ok(Query(q)) if q.contains_key("") => Err(ApiError::invalid(
                "query",
                "every parameter must have a name (key=value)",
            )),
            Ok(Query(q)) => Ok(Params(q)),
            Err(_) => Err(ApiError::invalid(
                "query",
                "must be well-formed key=value pairs",
            )),
        }
    }
}

/// Reads a JSON body: size limit, UTF-8, unknown fields, wrong types, all as `400`s
/// that name the field.
pub(super) async fn json_body<T: DeserializeOwned>(
    body: Body,
    empty_ok: bool,
) -> Result<T, ApiError> {
    let read = axum::body::to_bytes(body, BODY_BYTES_MAX);
    let bytes: Bytes = tokio::time::timeout(BODY_DEADLINE, read)
        .await
        .map_err(|_| {
            ApiError::new(
                408,
                "body_timeout",
                format!(
                    "the body must arrive within {} s of its head (S10)",
                    BODY_DEADLINE.as_secs()
                ),
            )
        })?
        .map_err(|_| {
            ApiError::invalid("body", format!("must be at most {BODY_BYTES_MAX} bytes"))
        })?;
    let text =
        std::str::from_utf8(&bytes).map_err(|_| ApiError::invalid("body", "must be UTF-8"))?;
    let text = if text.trim().is_empty() && empty_ok {
        "{}"
    } else {
        text
    };
    let mut de = serde_json::Deserializer::from_str(text);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let field = if path.is_empty() || path == "." {
            "body".to_string()
        } else {
            path
        };
        let inner = e.into_inner();
        ApiError::invalid(
            &field,
            inner
                .to_string()
                .split(" at line")
                .next()
                .unwrap_or_default(),
        )
    })?;
    // Strict to the last byte: `{...} GARBAGE` is not a body (only whitespace may follow).
    de.end()
        .map_err(|_| ApiError::invalid("body", "must be one JSON value with nothing after it"))?;
    Ok(value)
}
