"""berth's Python client: fenced leases for agent runs.

    import berth
    with berth.lease(project="shop", resources={"memory": 1 << 30}) as lease:
        run_agent(env=lease.env)          # renewed in the background, released on exit

`Client` speaks berth's HTTP API v1 (the daemon's default is http://127.0.0.1:7420; the
token is BERTH_TOKEN, else the state dir's admin.token). Refusals raise `BerthError`
with the API's stable `code`, `message` and `details`.
"""

from __future__ import annotations

import json
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import httpx

__all__ = ["BerthError", "Client", "Lease", "OPERATIONS", "lease"]

DEFAULT_URL = "http://127.0.0.1:7420"


class BerthError(Exception):
    """A refusal: the API's error envelope (`{"error": {code, message, details}}`)."""

    def __init__(self, status: int, code: str, message: str, details: Any = None):
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message, self.details = status, code, message, details


@dataclass
class Lease:
    """A granted run: its id, fence (the capability every change needs), environment,
    workspace and expiry, as the daemon answered."""

    run_id: str
    fence: int
    env: Dict[str, str]
    workspace: Optional[str]
    expires_at: Optional[str]
    ttl_ms: Optional[int]
    raw: Dict[str, Any] = field(repr=False, default_factory=dict)

    @classmethod
    def of(cls, run: Dict[str, Any]) -> "Lease":
        if run.get("state") != "granted" or run.get("fence") is None:
            raise BerthError(0, "not_granted", f"run {run.get('run_id')} is {run.get('state')}", run)
        return cls(run["run_id"], run["fence"], run.get("env") or {}, run.get("workspace"),
                   run.get("expires_at"), run.get("ttl_ms"), run)


def _default_token() -> Optional[str]:
    if os.environ.get("BERTH_TOKEN"):
        return os.environ["BERTH_TOKEN"]
    state = os.environ.get("BERTH_STATE_DIR")
    if not state:
        base = os.environ.get("XDG_STATE_HOME") or os.path.join(Path.home(), ".local", "state")
        state = os.path.join(base, "berth")
    try:
        return Path(state, "admin.token").read_text().strip()
    except OSError:
        return None


class Client:
    """A synchronous client of API v1 (thread-safe: one httpx client, pooled)."""

    def __init__(self, url: Optional[str] = None, token: Optional[str] = None,
                 timeout: float = 30.0):
        self.url = (url or os.environ.get("BERTH_URL") or DEFAULT_URL).rstrip("/")
        token = token or _default_token()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _call(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        r = self._http.request(method, path, json=body, **kw)
        return self._answer(r)

    @staticmethod
    def _answer(r: httpx.Response) -> Any:
        try:
            v = r.json()
        except ValueError:
            v = r.text
        if r.status_code >= 300:
            e = v.get("error", {}) if isinstance(v, dict) else {}
            raise BerthError(r.status_code, e.get("code", "error"), e.get("message", str(v)),
                             e.get("details"))
        return v

    # ---- runs -----------------------------------------------------------------------
    def acquire(self, project: str, *, wait_s: Optional[int] = None, **fields: Any) -> Lease:
        """Waits in the queue (as a stream of position and reason) until granted."""
        body = {"project": project, **fields}
        if wait_s is not None:
            body["wait_s"] = wait_s
        return Lease.of(self.acquire_stream(body, on_queued=None))

    def acquire_stream(self, body: Dict[str, Any], on_queued: Any = None) -> Dict[str, Any]:
        """The streamed acquire: `on_queued(position, reason)` for each queued line; the
        granted run, or `BerthError` (410 `expired` when the wait ran out)."""
        with self._http.stream("POST", "/v1/runs", json=body, timeout=None,
                               headers={"Accept": "application/x-ndjson"}) as r:
            if r.status_code >= 300:
                r.read()
                self._answer(r)
            for line in r.iter_lines():
                if not line.strip():
                    continue
                ev = json.loads(line)
                kind = ev.get("event")
                if kind == "queued" and on_queued:
                    on_queued(ev.get("position"), ev.get("reason"))
                elif kind == "granted":
                    return ev["lease"]
                elif kind in ("expired", "rejected"):
                    e = ev["error"]
                    raise BerthError(410 if kind == "expired" else 409, e["code"], e["message"],
                                     e.get("details"))
        raise BerthError(0, "stream_ended", "the acquire stream ended without an answer")

    def renew(self, run_id: str, fence: Optional[int] = None, ttl_s: Optional[int] = None) -> Dict[str, Any]:
        return self._call("POST", f"/v1/runs/{run_id}/renew", {"fence": fence, "ttl_s": ttl_s})

    def release(self, run_id: str, fence: int) -> Dict[str, Any]:
        return self._call("POST", f"/v1/runs/{run_id}/release", {"fence": fence})

    def cancel(self, run_id: str) -> Dict[str, Any]:
        return self._call("DELETE", f"/v1/runs/{run_id}")

    def run(self, run_id: str) -> Dict[str, Any]:
        return self._call("GET", f"/v1/runs/{run_id}")

    def runs(self, all: bool = False) -> List[Dict[str, Any]]:
        return self._call("GET", "/v1/runs", params={"all": "true"} if all else None)["runs"]

    def register(self, run_id: str, fence: int, pid: int) -> Dict[str, Any]:
        return self._call("POST", f"/v1/runs/{run_id}/processes", {"fence": fence, "pid": pid})

    def check_fence(self, run_id: str, fence: int) -> Dict[str, Any]:
        return self._call("GET", "/v1/fences/check", params={"run_id": run_id, "fence": fence})

    # ---- the host -------------------------------------------------------------------
    def status(self) -> Dict[str, Any]:
        return self._call("GET", "/v1/status")

    def journal(self, after: int = 0) -> List[Dict[str, Any]]:
        r = self._http.get("/v1/journal", params={"after": after})
        self._answer(r) if r.status_code >= 300 else None
        return [json.loads(l) for l in r.text.splitlines() if l.strip()]

    def events(self, after: int = 0, kinds: Optional[List[str]] = None) -> Iterator[Dict[str, Any]]:
        """The journal live (server-sent events), resumed after `after`."""
        params = {"kind": ",".join(kinds)} if kinds else None
        headers = {"Last-Event-ID": str(after)}
        with self._http.stream("GET", "/v1/events", params=params, headers=headers,
                               timeout=None) as r:
            if r.status_code >= 300:
                r.read()
                self._answer(r)
            data: List[str] = []
            for line in r.iter_lines():
                if line.startswith("data:"):
                    data.append(line[5:].lstrip())
                elif not line and data:
                    yield json.loads("\n".join(data))
                    data = []


    # ---- the rest of API v1, one method per operation ---------------------------------
    def fleet(self) -> Dict[str, Any]:
        return self._call("GET", "/v1/fleet")

    def export_journal(self, start: int = 1, through: Optional[int] = None) -> str:
        params = {"from": start, **({"through": through} if through else {})}
        r = self._http.get("/v1/journal/export", params=params, timeout=None)
        if r.status_code >= 300:
            self._answer(r)
        return r.text

    def metrics(self) -> str:
        r = self._http.get("/metrics")
        if r.status_code >= 300:
            self._answer(r)
        return r.text

    def start_runtime(self, run_id: str, fence: int) -> Dict[str, Any]:
        return self._call("POST", f"/v1/runs/{run_id}/runtime", {"fence": fence}, timeout=None)

    def tokens(self) -> List[Dict[str, Any]]:
        return self._call("GET", "/v1/tokens")["tokens"]

    def create_token(self, scope: str, uid: Optional[int] = None,
                     expires_s: Optional[int] = None) -> Dict[str, Any]:
        body = {"scope": scope, **({"uid": uid} if uid is not None else {}),
                **({"expires_s": expires_s} if expires_s else {})}
        return self._call("POST", "/v1/tokens", body)

    def revoke_token(self, token_id: str) -> Dict[str, Any]:
        return self._call("DELETE", f"/v1/tokens/{token_id}")

    def reap(self) -> Dict[str, Any]:
        return self._call("POST", "/v1/reap")

    def dashboard(self) -> str:
        return self._http.get("/").text

    def openapi(self) -> Dict[str, Any]:
        return self._call("GET", "/v1/openapi.json")

    def attach_thread(self, key: str, **claim: Any) -> Dict[str, Any]:
        return self._call("POST", f"/v1/threads/{key}/attach", claim)

    def move_thread_deadline(self, key: str, **claim: Any) -> Dict[str, Any]:
        return self._call("POST", f"/v1/threads/{key}/deadline", claim)

    def detach_thread(self, key: str, **claim: Any) -> Dict[str, Any]:
        return self._call("POST", f"/v1/threads/{key}/detach", claim)

    def thread(self, key: str) -> Dict[str, Any]:
        return self._call("GET", f"/v1/threads/{key}")

    def evict_thread(self, key: str) -> Dict[str, Any]:
        return self._call("DELETE", f"/v1/threads/{key}")

    def threads(self) -> List[Dict[str, Any]]:
        return self._call("GET", "/v1/threads")["threads"]

    def drain(self) -> Dict[str, Any]:
        return self._call("GET", "/v1/drain")

    def start_drain(self, reason: str) -> Dict[str, Any]:
        return self._call("POST", "/v1/drain", {"reason": reason})

    def end_drain(self) -> Dict[str, Any]:
        return self._call("DELETE", "/v1/drain")

    def idle(self) -> Dict[str, Any]:
        return self._call("GET", "/v1/idle")

    def scopes(self) -> List[Dict[str, Any]]:
        return self._call("GET", "/v1/scopes")["scopes"]

    def scope(self, scope: str) -> Dict[str, Any]:
        return self._call("GET", f"/v1/scopes/{scope}")

    def forget_scope(self, scope: str) -> Dict[str, Any]:
        return self._call("DELETE", f"/v1/scopes/{scope}")

    def reserve(self, scope: str, owner: str, operation_id: str, harness: str) -> Dict[str, Any]:
        body = {"owner": owner, "operation_id": operation_id, "harness": harness}
        return self._call("POST", f"/v1/scopes/{scope}/reservations", body)

    def unreserve(self, scope: str, owner: str, operation_id: str) -> Dict[str, Any]:
        return self._call("DELETE", f"/v1/scopes/{scope}/reservations/{owner}/{operation_id}")

    def reconcile(self, scope: str, owner: str, reason: str) -> Dict[str, Any]:
        return self._call("POST", f"/v1/scopes/{scope}/reconcile", {"owner": owner, "reason": reason})

    def control(self, scope: str, mode: str, request_id: str) -> Dict[str, Any]:
        """`mode`: pause, stop or resume; the same `request_id` again is idempotent."""
        body = {"mode": mode, "request_id": request_id}
        return self._call("POST", f"/v1/scopes/{scope}/control", body)


#: Each operation of the OpenAPI document (`operationId`) and the method that calls it
#: (a test checks this covers the document, so a new endpoint needs a method here).
OPERATIONS = {
    "listRuns": "runs", "acquireRun": "acquire_stream", "getRun": "run",
    "cancelRun": "cancel", "getStatus": "status", "getFleet": "fleet",
    "checkFence": "check_fence", "readJournal": "journal", "exportJournal": "export_journal",
    "streamEvents": "events", "getMetrics": "metrics", "renewRun": "renew",
    "releaseRun": "release", "registerProcess": "register", "startRuntime": "start_runtime",
    "listTokens": "tokens", "createToken": "create_token", "revokeToken": "revoke_token",
    "reap": "reap", "getDashboard": "dashboard", "getOpenApi": "openapi",
    "attachThread": "attach_thread", "moveThreadDeadline": "move_thread_deadline",
    "detachThread": "detach_thread", "getThread": "thread", "evictThread": "evict_thread",
    "listThreads": "threads", "getDrain": "drain", "startDrain": "start_drain",
    "endDrain": "end_drain", "getIdle": "idle", "listScopes": "scopes", "getScope": "scope",
    "forgetScope": "forget_scope", "reserveToken": "reserve", "unreserveToken": "unreserve",
    "reconcileScope": "reconcile", "controlScope": "control",
}


class _Renewer(threading.Thread):
    """Renews a lease a third of its ttl after each confirmation, until stopped."""

    def __init__(self, client: Client, lease: Lease):
        super().__init__(daemon=True, name=f"berth-renew-{lease.run_id}")
        self.client, self.lease = client, lease
        self.stop = threading.Event()
        self.lost: Optional[BaseException] = None

    def run(self) -> None:
        every = max((self.lease.ttl_ms or 300_000) / 3000.0, 0.2)
        while not self.stop.wait(every):
            try:
                self.client.renew(self.lease.run_id, self.lease.fence)
            except BerthError as e:
                if e.status in (409, 410):
                    self.lost = e
                    return
            except httpx.HTTPError:
                pass  # a restart: the next renewal tries again


@contextmanager
def lease(project: str, *, client: Optional[Client] = None, **fields: Any) -> Iterator[Lease]:
    """A lease for the block: acquired on entry (waiting in the queue), renewed in the
    background, released on exit however the block ends (an exception, Ctrl-C)."""
    own = client is None
    c = client or Client()
    try:
        granted = c.acquire(project, **fields)
        renewer = _Renewer(c, granted)
        renewer.start()
        try:
            yield granted
        finally:
            renewer.stop.set()
            renewer.join()
            try:
                c.release(granted.run_id, granted.fence)
            except BerthError as e:
                if e.status not in (409, 410):
                    raise
    finally:
        if own:
            c.close()
