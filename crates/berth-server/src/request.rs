//! One home for validating API requests: every rule a request body, path or query
//! value must meet before the daemon sees it, each refusal a `400` naming the field and
//! the rule. The limits that are the engine's (ttl, wait, resources) come from its
//! `Config`, never from numbers here; the ones named here are the API's own.

use std::collections::BTreeMap;
use std::time::Duration;

use berth_client::wire::AcquireRequest as AcquireBody;
use berth_core::{validate, Class, Config, Priority, Request as CoreRequest, Resources};

use serde_json::json;

use crate::auth;
use crate::error::ApiError;

/// Labels per run, and their sizes.
pub const LABELS_MAX: usize = 32;
pub const LABEL_KEY_BYTES_MAX: usize = 64;
pub const LABEL_VALUE_BYTES_MAX: usize = 256;
/// Largest fence a client may send: JSON's safe integers (G5).
pub const FENCE_MAX: u64 = (1 << 53) - 1;

pub fn check_fence(f: u64) -> Result<u64, ApiError> {
    if f == 0 || f > FENCE_MAX {
        return Err(ApiError::invalid(
            "fence",
            format!("must be a positive integer at most {FENCE_MAX}"),
        ));
    }
    Ok(f)
}

pub fn check_run_id(id: &str) -> Result<(), ApiError> {
    validate::run_id(id).map_err(|e| ApiError::invalid("run_id", e))
}

/// A generated run id: 64 random bits, hex.
fn new_run_id() -> String {
    let t = auth::new_token().unwrap_or_else(|_| format!("berth_{:016x}", crate::clock::mono_ms()));
    format!("r-{}", &t["berth_".len().."berth_".len() + 16])
}

/// Longest stop grace a run may ask for.
pub const STOP_GRACE_S_MAX: u64 = 3_600;

/// The server-side parts of an acquire: (worktree, labels, stop grace, thread, lease
/// only).
pub type Extras = (
    Option<String>,
    BTreeMap<String, String>,
    Option<u64>,
    Option<String>,
    bool,
);

/// Longest worktree path accepted.
pub const WORKTREE_BYTES_MAX: usize = 4096;
/// How long reading a worktree's contract may take. The worktree is the caller's: a
/// hung network file system or a FUSE mount that never answers must cost the caller a
/// `503`, never an async worker of the daemon (S1).
const WORKTREE_READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Blocking threads that may be reading worktrees at once. A read stuck on a hung
/// file system keeps its thread (and its place here) until the file system answers;
/// without a cap each request leaked one, until tokio's pool was spent and everything
/// else that needs a blocking thread waited too (issue 32 concern). A burst of healthy
/// reads waits for a place; once every place is held by a read that outlived its
/// timeout, the next is refused at once.
pub const WORKTREE_READERS_MAX: usize = 16;
static WORKTREE_READERS: tokio::sync::Semaphore =
    tokio::sync::Semaphore::const_new(WORKTREE_READERS_MAX);
/// Reads that outlived their timeout and still hold their place.
static WORKTREE_READERS_STUCK: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(0);

/// Why a worktree operation gave no answer.
#[derive(Debug)]
pub enum WorktreeOp {
    /// Every place is held by a read stuck on a file system that does not answer.
    AllStuck,
    /// No answer (or no place) within the time allowed.
    TimedOut,
    Panicked,
}

impl WorktreeOp {
    pub fn message(&self, limit: Duration) -> String {
        match self {
            WorktreeOp::AllStuck => format!(
                "all {WORKTREE_READERS_MAX} worktree readers are stuck on worktrees that do not answer (a hung network or FUSE file system): try again later"
            ),
            WorktreeOp::TimedOut => format!("it did not answer within {} s", limit.as_secs()),
            WorktreeOp::Panicked => "reading it failed".into(),
        }
    }
}

/// Runs `f`, which touches a caller's worktree, on a blocking thread within `limit`,
/// holding one of `WORKTREE_READERS_MAX` places for as long as the thread runs.
pub async fn worktree_op<T: Send + 'static>(
    limit: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, WorktreeOp> {
    use std::sync::atomic::{AtomicU8, Ordering::AcqRel};
    const RUNNING: u8 = 0;
    const DONE: u8 = 1;
    const STUCK: u8 = 2;
    if WORKTREE_READERS_STUCK.load(std::sync::atomic::Ordering::Acquire) >= WORKTREE_READERS_MAX {
        return Err(WorktreeOp::AllStuck);
    }
    let started = tokio::time::Instant::now();
    let place = tokio::time::timeout(limit, WORKTREE_READERS.acquire())
        .await
        .map_err(|_| WorktreeOp::TimedOut)?
        .map_err(|_| WorktreeOp::Panicked)?;
    let state = std::sync::Arc::new(AtomicU8::new(RUNNING));
    let seen = state.clone();
    let work = tokio::task::spawn_blocking(move || {
        // Held by the thread, not the request: a stuck read keeps its place.
        let _place = place;
        let out = f();
        if seen.swap(DONE, AcqRel) == STUCK {
            WORKTREE_READERS_STUCK.fetch_sub(1, AcqRel);
        }
        out
    });
    match tokio::time::timeout(limit.saturating_sub(started.elapsed()), work).await {
        Ok(Ok(out)) => Ok(out),
        Ok(Err(_)) => Err(WorktreeOp::Panicked),
        Err(_) => {
            if state
                .compare_exchange(RUNNING, STUCK, AcqRel, std::sync::atomic::Ordering::Acquire)
                .is_ok()
            {
                WORKTREE_READERS_STUCK.fetch_add(1, AcqRel);
            }
            Err(WorktreeOp::TimedOut)
        }
    }
}

/// Reads the worktree's contract (C1) on a blocking thread, within
/// `WORKTREE_READ_TIMEOUT`: `None` when it has none.
pub async fn read_contract(worktree: &str) -> Result<Option<crate::contract::Contract>, ApiError> {
    let wt = std::path::PathBuf::from(worktree);
    let read = worktree_op(WORKTREE_READ_TIMEOUT, move || {
        crate::failpoint::hit("worktree-read");
        // `metadata` follows links on purpose: a worktree may be reached through one;
        // what must never be followed or blocked on is the contract file itself.
        match std::fs::metadata(&wt) {
            Ok(m) if m.is_dir() => {}
            _ => {
                return Err(ApiError::invalid(
                    "worktree",
                    "must be an existing directory",
                ))
            }
        }
        crate::contract::read(&wt).map_err(|e| ApiError::invalid("worktree", e))
    });
    match read.await {
        Ok(r) => r,
        Err(WorktreeOp::Panicked) => Err(ApiError::new(
            500,
            "internal",
            "reading the worktree failed",
        )),
        Err(e) => Err(ApiError::new(
            503,
            "worktree_unavailable",
            format!(
                "worktree: its contract could not be read: {}",
                e.message(WORKTREE_READ_TIMEOUT)
            ),
        )
        .with(json!({"field": "worktree"}))),
    }
}

/// Reads the worktree's contract (C1) on a blocking thread, within
/// `WORKTREE_READ_TIMEOUT`, and folds it into the request. Returns the names of the
/// ports a managed run declares: they are part of its claim (the `ports` resource, A1)
/// and numbered at grant (W3). Analysis runs get none: they may not listen (C6).
pub async fn read_worktree(req: &mut CoreRequest, worktree: &str) -> Result<Vec<String>, ApiError> {
    let contract = read_contract(worktree).await?;
    let mut ports = Vec::new();
    if let Some(c) = contract {
        if req.class == Class::Managed {
            req.singletons.extend(c.singletons);
            ports = c.ports.into_iter().map(|p| p.name).collect::<Vec<_>>();
            if !ports.is_empty() {
                req.resources
                    .named
                    .insert(crate::PORTS_RESOURCE.to_string(), ports.len() as u64);
            }
        }
        req.contract = Some(c.info);
    }
    Ok(ports)
}

/// Turns an acquire body into the engine's request (without touching the file system:
/// the worktree's contract is read by `read_worktree`).
pub fn build_request(cfg: &Config, b: AcquireBody) -> Result<(CoreRequest, Extras), ApiError> {
    if b.stop_grace_s.is_some_and(|g| g > STOP_GRACE_S_MAX) {
        return Err(ApiError::invalid(
            "stop_grace_s",
            format!("must be between 0 and {STOP_GRACE_S_MAX}"),
        ));
    }
    let run_id = match b.run_id {
        Some(id) => {
            check_run_id(&id)?;
            id
        }
        None => new_run_id(),
    };
    validate::project(&b.project).map_err(|e| ApiError::invalid("project", e))?;
    let budget = b.budget.map(budget).transpose()?.map(Box::new);
    let ttl_s = ttl_s(cfg, b.ttl_s.unwrap_or(cfg.ttl_ms_default / 1000))?;
    let wait_s = b.wait_s.unwrap_or(cfg.wait_ms_default / 1000);
    let wait_s_max = cfg.wait_ms_max / 1000;
    if wait_s > wait_s_max {
        return Err(ApiError::invalid(
            "wait_s",
            format!("must be between 0 and {wait_s_max}"),
        ));
    }
    let res = resources(cfg, b.resources.unwrap_or_default().0)?;
    let labels = labels(b.labels.unwrap_or_default().0)?;
    let singletons = singletons(b.singletons.unwrap_or_default())?;
    if let Some(wt) = &b.worktree {
        if !std::path::Path::new(wt).is_absolute() || wt.len() > WORKTREE_BYTES_MAX {
            return Err(ApiError::invalid(
                "worktree",
                format!("must be an absolute path of at most {WORKTREE_BYTES_MAX} bytes"),
            ));
        }
    }
    let req = CoreRequest {
        run_id,
        project: b.project,
        class: b.class.unwrap_or(Class::Managed),
        priority: b.priority.unwrap_or(Priority::Foreground),
        resources: res,
        singletons,
        // Filled in by `read_worktree`, off the async workers.
        contract: None,
        ttl_ms: ttl_s * 1000,
        wait_ms: wait_s * 1000,
        budget,
    };
    if let Some(t) = &b.thread {
        validate::run_id(t).map_err(|e| ApiError::invalid("thread", e))?;
    }
    let lease_only = b.workspace == Some(false);
    if lease_only && b.thread.is_some() {
        return Err(ApiError::invalid(
            "workspace",
            "cannot be false with `thread`: a thread's runs work in its workspace",
        ));
    }
    let stop_grace_ms = b.stop_grace_s.map(|g| g * 1000);
    Ok((
        req,
        (b.worktree, labels, stop_grace_ms, b.thread, lease_only),
    ))
}

/// A lease's ttl in seconds, within the engine's `ttl_ms_max` (the one limit).
pub fn ttl_s(cfg: &berth_core::Config, ttl_s: u64) -> Result<u64, ApiError> {
    let max = cfg.ttl_ms_max / 1000;
    if ttl_s == 0 || ttl_s > max {
        return Err(ApiError::invalid(
            "ttl_s",
            format!("must be between 1 and {max}"),
        ));
    }
    Ok(ttl_s)
}

/// The resources asked for, over the host's defaults; named ones must be declared.
fn resources(
    cfg: &berth_core::Config,
    asked: BTreeMap<String, u64>,
) -> Result<Resources, ApiError> {
    let d = &cfg.default_request;
    let mut res = Resources {
        slots: d.slots,
        memory: d.memory,
        cpu_millis: d.cpu_millis,
        disk: d.disk,
        named: BTreeMap::new(),
    };
    for (k, v) in asked {
        match k.as_str() {
            "slots" => res.slots = v,
            "memory" => res.memory = v,
            "cpu_millis" => res.cpu_millis = v,
            "disk" => res.disk = v,
            crate::PORTS_RESOURCE => {
                return Err(ApiError::invalid(
                    "resources.ports",
                    "is counted by berth from the worktree contract's [[port]] entries",
                ))
            }
            name => {
                if !cfg.named.iter().any(|(n, _)| n == name) {
                    return Err(ApiError::invalid(
                        &format!("resources.{name}"),
                        "is not a resource this host declares",
                    ));
                }
                res.named.insert(name.to_string(), v);
            }
        }
    }
    if res.slots == 0 {
        return Err(ApiError::invalid("resources.slots", "must be at least 1"));
    }
    Ok(res)
}

fn labels(labels: BTreeMap<String, String>) -> Result<BTreeMap<String, String>, ApiError> {
    if labels.len() > LABELS_MAX {
        return Err(ApiError::invalid(
            "labels",
            format!("at most {LABELS_MAX} entries"),
        ));
    }
    for (k, v) in &labels {
        if k.is_empty() || k.len() > LABEL_KEY_BYTES_MAX || k.chars().any(char::is_control) {
            return Err(ApiError::invalid(
                "labels",
                format!("keys must be 1 to {LABEL_KEY_BYTES_MAX} bytes without control characters"),
            ));
        }
        if v.len() > LABEL_VALUE_BYTES_MAX || v.chars().any(char::is_control) {
            return Err(ApiError::invalid(
                &format!("labels.{k}"),
                format!("must be at most {LABEL_VALUE_BYTES_MAX} bytes without control characters"),
            ));
        }
    }
    Ok(labels)
}

fn singletons(singletons: Vec<String>) -> Result<Vec<String>, ApiError> {
    if singletons.len() > berth_core::SINGLETONS_MAX {
        return Err(ApiError::invalid(
            "singletons",
            format!("at most {} entries", berth_core::SINGLETONS_MAX),
        ));
    }
    for s in &singletons {
        validate::resource_name(s).map_err(|e| ApiError::invalid("singletons", e))?;
    }
    Ok(singletons)
}

/// B1/B2: a run's budget, its syntax checked (the frozen policy is the engine's to
/// compare). Each refusal names its field under `budget.`.
fn budget(b: berth_client::wire::BudgetClaim) -> Result<berth_core::scopes::Budget, ApiError> {
    let core = berth_core::scopes::Budget {
        scope: b.scope,
        harness: b.harness,
        operation_id: b.operation_id,
        per_harness: b.per_harness.map(|p| p.0),
        manifest: b.manifest.map(manifest),
        tenant: None,
    };
    core.check().map_err(|e| match e {
        berth_core::scopes::ScopeError::Invalid { field, rule } => {
            let field = field.strip_prefix("budget.").unwrap_or(field);
            ApiError::invalid(&format!("budget.{field}"), rule)
        }
        other => ApiError::invalid("budget", other),
    })?;
    Ok(core)
}

fn manifest(m: berth_client::wire::ScopeManifest) -> berth_core::scopes::Manifest {
    berth_core::scopes::Manifest {
        path: m.path,
        sha256: m.sha256,
        execution_ids: m.execution_ids,
    }
}

/// The core's word for a field refusal, as the API's `400`.
fn scope_invalid(e: berth_core::scopes::ScopeError) -> ApiError {
    match e {
        berth_core::scopes::ScopeError::Invalid { field, rule } => ApiError::invalid(field, rule),
        other => ApiError::invalid("body", other),
    }
}

/// A scope id in a path: the id rule.
pub fn check_scope(id: &str) -> Result<(), ApiError> {
    berth_core::scopes::check_id("scope", id).map_err(scope_invalid)
}

/// `POST /v1/scopes/{id}/reservations` and its `DELETE`: owner and operation id follow
/// the id rule, the harness the canonical name rule.
pub fn reservation(owner: &str, operation_id: &str, harness: Option<&str>) -> Result<(), ApiError> {
    use berth_core::scopes::{check_harness, check_id};
    check_id("owner", owner).map_err(scope_invalid)?;
    check_id("operation_id", operation_id).map_err(scope_invalid)?;
    if let Some(h) = harness {
        check_harness(h).map_err(|e| ApiError::invalid("harness", e))?;
    }
    Ok(())
}

/// The most a reconciliation's reason may say (bytes).
pub const RECONCILE_REASON_MAX: usize = 1_024;

/// `POST /v1/scopes/{id}/reconcile`: an owner and a one-line reason.
pub fn reconcile(b: &berth_client::wire::ReconcileRequest) -> Result<(), ApiError> {
    berth_core::scopes::check_id("owner", &b.owner).map_err(scope_invalid)?;
    if b.reason.is_empty()
        || b.reason.len() > RECONCILE_REASON_MAX
        || b.reason.contains(['\n', '\r', '\t', '\0'])
    {
        return Err(ApiError::invalid(
            "reason",
            format!("must be one line of 1 to {RECONCILE_REASON_MAX} bytes"),
        ));
    }
    Ok(())
}

/// `POST /v1/scopes/{id}/control`: the request id's length and the mode's word.
pub fn control(
    b: &berth_client::wire::ControlRequest,
) -> Result<berth_core::scopes::Mode, ApiError> {
    use berth_core::scopes::{Mode, REQUEST_ID_MAX};
    if b.request_id.is_empty()
        || b.request_id.len() > REQUEST_ID_MAX
        || b.request_id.chars().any(char::is_control)
    {
        return Err(ApiError::invalid(
            "request_id",
            format!("must be 1 to {REQUEST_ID_MAX} characters, none of them a control character"),
        ));
    }
    b.mode
        .parse::<Mode>()
        .map_err(|e| ApiError::invalid("mode", e))
}
