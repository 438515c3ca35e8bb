//! One method per operation of API v1 (the streams are in `stream.rs`). Each method's
//! doc names its route and `operationId`.

use std::time::Duration;

use hyper::Method;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::wire::*;
use crate::{seg, Client, Error};

const NONE: Option<&()> = None;

impl Client {
    async fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T, Error> {
        self.call(Method::GET, path, NONE, Duration::ZERO).await
    }

    async fn post<B: Serialize, T: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<T, Error> {
        self.call(Method::POST, path, Some(body), Duration::ZERO)
            .await
    }

    async fn delete<T: DeserializeOwned>(&self, path: &str) -> Result<T, Error> {
        self.call(Method::DELETE, path, NONE, Duration::ZERO).await
    }

    // ---- runs ----------------------------------------------------------------------

    /// `POST /v1/runs` (`acquireRun`): waits up to the request's `wait_s` for a grant
    /// (a long poll; [`Client::acquire_stream`] shows the wait as it goes).
    pub async fn acquire(&self, req: &AcquireRequest) -> Result<Run, Error> {
        let wait = Duration::from_secs(req.wait_s.unwrap_or(0));
        self.call(Method::POST, "/v1/runs", Some(req), wait).await
    }

    /// `GET /v1/runs/{id}` (`getRun`).
    pub async fn run(&self, run_id: &str) -> Result<Run, Error> {
        self.get(&format!("/v1/runs/{}", seg(run_id))).await
    }

    /// `GET /v1/runs` (`listRuns`): live runs, and ended ones still retained with `all`.
    pub async fn list(&self, all: bool) -> Result<RunList, Error> {
        self.get(&format!("/v1/runs?all={all}")).await
    }

    /// `DELETE /v1/runs/{id}` (`cancelRun`): a waiter leaves the queue; a granted run
    /// (with its `fence`) ends as a release does.
    pub async fn cancel(&self, run_id: &str, fence: Option<u64>) -> Result<Run, Error> {
        let q = fence.map(|f| format!("?fence={f}")).unwrap_or_default();
        self.delete(&format!("/v1/runs/{}{q}", seg(run_id))).await
    }

    /// `POST /v1/runs/{id}/renew` (`renewRun`).
    pub async fn renew(&self, run_id: &str, req: &RenewRequest) -> Result<Run, Error> {
        self.post(&format!("/v1/runs/{}/renew", seg(run_id)), req)
            .await
    }

    /// `POST /v1/runs/{id}/release` (`releaseRun`): the answer comes once the run's
    /// processes are stopped and its workspace is gone, or it is degraded.
    pub async fn release(&self, run_id: &str, fence: u64) -> Result<Run, Error> {
        let path = format!("/v1/runs/{}/release", seg(run_id));
        self.post(&path, &ReleaseRequest { fence }).await
    }

    /// `POST /v1/runs/{id}/processes` (`registerProcess`, P1).
    pub async fn register_process(&self, run_id: &str, fence: u64, pid: i32) -> Result<Run, Error> {
        let path = format!("/v1/runs/{}/processes", seg(run_id));
        self.post(&path, &ProcessRequest { fence, pid }).await
    }

    /// `POST /v1/runs/{id}/runtime` (`startRuntime`, C7): starts the run's runtime
    /// (each port's build, command and ready probe) and answers once every port is
    /// ready, or with the failing port's last lines (`Error::Refused`, code
    /// `runtime_failed`). Waits up to `within` beyond the usual call timeout.
    pub async fn start_runtime(
        &self,
        run_id: &str,
        fence: u64,
        within: Duration,
    ) -> Result<RuntimeStarted, Error> {
        let path = format!("/v1/runs/{}/runtime", seg(run_id));
        let body = RuntimeRequest { fence };
        self.call(Method::POST, &path, Some(&body), within).await
    }

    /// `GET /v1/fences/check` (`checkFence`): is `fence` still the lease of `run_id`?
    pub async fn fence_check(&self, run_id: &str, fence: u64) -> Result<FenceCheck, Error> {
        self.get(&format!(
            "/v1/fences/check?run_id={}&fence={fence}",
            seg(run_id)
        ))
        .await
    }

    // ---- the host ------------------------------------------------------------------

    /// `GET /v1/status` (`getStatus`).
    pub async fn status(&self) -> Result<Status, Error> {
        self.get("/v1/status").await
    }

    /// `GET /v1/fleet` (`getFleet`): the fleet's hosts (fleet mode), or this host alone.
    pub async fn fleet(&self) -> Result<Fleet, Error> {
        self.get("/v1/fleet").await
    }

    /// `GET /v1/idle` (`getIdle`): whether anything is in flight, and until when.
    pub async fn idle(&self) -> Result<Idle, Error> {
        self.get("/v1/idle").await
    }

    /// `POST /v1/reap` (`reap`): ends what has outlived its lease now, not at the next
    /// sweep.
    pub async fn reap(&self) -> Result<ReapReport, Error> {
        self.call(Method::POST, "/v1/reap", NONE, Duration::ZERO)
            .await
    }

    /// `GET /v1/drain` (`getDrain`).
    pub async fn drain(&self) -> Result<Drain, Error> {
        self.get("/v1/drain").await
    }

    /// `POST /v1/drain` (`startDrain`, G4): no new grants or registrations.
    pub async fn start_drain(&self, reason: Option<String>) -> Result<Drain, Error> {
        self.post("/v1/drain", &DrainRequest { reason }).await
    }

    /// `DELETE /v1/drain` (`endDrain`).
    pub async fn end_drain(&self) -> Result<Drain, Error> {
        self.delete("/v1/drain").await
    }

    /// `POST /v1/fleet/drain` (`startFleetDrain`): fleet mode, every host of the fleet
    /// admits nothing new.
    pub async fn start_fleet_drain(&self, reason: Option<String>) -> Result<Drain, Error> {
        self.post("/v1/fleet/drain", &DrainRequest { reason }).await
    }

    /// `DELETE /v1/fleet/drain` (`endFleetDrain`).
    pub async fn end_fleet_drain(&self) -> Result<Drain, Error> {
        self.delete("/v1/fleet/drain").await
    }

    /// `GET /metrics` (`getMetrics`): OpenMetrics text.
    pub async fn metrics(&self) -> Result<String, Error> {
        self.text("/metrics", "application/openmetrics-text").await
    }

    /// `GET /` (`getDashboard`): the dashboard's page.
    pub async fn dashboard(&self) -> Result<String, Error> {
        self.text("/", "text/html").await
    }

    /// `GET /v1/openapi.json` (`getOpenApi`): this API's OpenAPI 3.1 document.
    pub async fn openapi(&self) -> Result<serde_json::Value, Error> {
        self.get("/v1/openapi.json").await
    }

    // ---- the journal ---------------------------------------------------------------

    /// `GET /v1/journal` (`readJournal`): up to `limit` entries after `after`.
    pub async fn journal(
        &self,
        after: u64,
        limit: Option<u32>,
    ) -> Result<Vec<JournalEntry>, Error> {
        let limit = limit.map(|l| format!("&limit={l}")).unwrap_or_default();
        let text = self
            .text(&format!("/v1/journal?after={after}{limit}"), NDJSON)
            .await?;
        entries(&text)
    }

    /// `GET /v1/journal/export` (`exportJournal`): the journal from `from` (through
    /// `through`), archived chunks included, as NDJSON.
    pub async fn export_journal(
        &self,
        from: u64,
        through: Option<u64>,
    ) -> Result<Vec<JournalEntry>, Error> {
        let through = through.map(|t| format!("&through={t}")).unwrap_or_default();
        let text = self
            .text(&format!("/v1/journal/export?from={from}{through}"), NDJSON)
            .await?;
        entries(&text)
    }

    // ---- tokens --------------------------------------------------------------------

    /// `GET /v1/tokens` (`listTokens`).
    pub async fn tokens(&self) -> Result<TokenList, Error> {
        self.get("/v1/tokens").await
    }

    /// `POST /v1/tokens` (`createToken`): the secret is in this answer only.
    pub async fn create_token(&self, req: &TokenRequest) -> Result<TokenCreated, Error> {
        self.post("/v1/tokens", req).await
    }

    /// `DELETE /v1/tokens/{id}` (`revokeToken`).
    pub async fn revoke_token(&self, id: &str) -> Result<TokenInfo, Error> {
        self.delete(&format!("/v1/tokens/{}", seg(id))).await
    }

    // ---- threads (G0–G3) -----------------------------------------------------------

    /// `GET /v1/threads` (`listThreads`).
    pub async fn threads(&self) -> Result<ThreadList, Error> {
        self.get("/v1/threads").await
    }

    /// `GET /v1/threads/{key}` (`getThread`).
    pub async fn thread(&self, key: &str) -> Result<Thread, Error> {
        self.get(&format!("/v1/threads/{}", seg(key))).await
    }

    /// `POST /v1/threads/{key}/attach` (`attachThread`).
    pub async fn attach_thread(&self, key: &str, claim: &ThreadClaim) -> Result<Thread, Error> {
        self.post(&format!("/v1/threads/{}/attach", seg(key)), claim)
            .await
    }

    /// `POST /v1/threads/{key}/deadline` (`moveThreadDeadline`).
    pub async fn move_thread_deadline(
        &self,
        key: &str,
        claim: &ThreadClaim,
    ) -> Result<Thread, Error> {
        self.post(&format!("/v1/threads/{}/deadline", seg(key)), claim)
            .await
    }

    /// `POST /v1/threads/{key}/detach` (`detachThread`).
    pub async fn detach_thread(&self, key: &str, claim: &ThreadClaim) -> Result<Thread, Error> {
        self.post(&format!("/v1/threads/{}/detach", seg(key)), claim)
            .await
    }

    /// `DELETE /v1/threads/{key}` (`evictThread`).
    pub async fn evict_thread(&self, key: &str) -> Result<Thread, Error> {
        self.delete(&format!("/v1/threads/{}", seg(key))).await
    }

    // ---- scopes and budgets (B1–B6) ------------------------------------------------

    /// `GET /v1/scopes` (`listScopes`).
    pub async fn scopes(&self) -> Result<ScopeList, Error> {
        self.get("/v1/scopes").await
    }

    /// `GET /v1/scopes/{id}` (`getScope`).
    pub async fn scope(&self, scope: &str) -> Result<Scope, Error> {
        self.get(&format!("/v1/scopes/{}", seg(scope))).await
    }

    /// `DELETE /v1/scopes/{id}` (`forgetScope`).
    pub async fn forget_scope(&self, scope: &str) -> Result<ScopeSummary, Error> {
        self.delete(&format!("/v1/scopes/{}", seg(scope))).await
    }

    /// `POST /v1/scopes/{id}/reservations` (`reserveToken`): a turn's token; the same
    /// `(owner, operation_id)` again answers the same reservation.
    pub async fn reserve(
        &self,
        scope: &str,
        req: &ReservationRequest,
    ) -> Result<Reservation, Error> {
        self.post(&format!("/v1/scopes/{}/reservations", seg(scope)), req)
            .await
    }

    /// `DELETE /v1/scopes/{id}/reservations/{owner}/{operation_id}` (`unreserveToken`).
    pub async fn unreserve(
        &self,
        scope: &str,
        owner: &str,
        operation_id: &str,
    ) -> Result<ScopeToken, Error> {
        let path = format!(
            "/v1/scopes/{}/reservations/{}/{}",
            seg(scope),
            seg(owner),
            seg(operation_id)
        );
        self.delete(&path).await
    }

    /// `POST /v1/scopes/{id}/reconcile` (`reconcileScope`).
    pub async fn reconcile(
        &self,
        scope: &str,
        req: &ReconcileRequest,
    ) -> Result<Reconciled, Error> {
        self.post(&format!("/v1/scopes/{}/reconcile", seg(scope)), req)
            .await
    }

    /// `POST /v1/scopes/{id}/control` (`controlScope`): pause, stop or resume.
    pub async fn control(
        &self,
        scope: &str,
        req: &ControlRequest,
    ) -> Result<ControlReceipt, Error> {
        self.post(&format!("/v1/scopes/{}/control", seg(scope)), req)
            .await
    }
}

const NDJSON: &str = "application/x-ndjson";

/// An NDJSON answer's entries.
fn entries(text: &str) -> Result<Vec<JournalEntry>, Error> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            serde_json::from_str(l).map_err(|e| Error::Answer {
                status: 200,
                what: format!("{e}: {l}"),
            })
        })
        .collect()
}
