"""API v1 without I/O: each operation described once as the request it makes (`Call`),
which the sync client (`_sync.Client`) and the async one (`_async.AsyncClient`) both
send, and the readers of the two streams (a streamed acquire, server-sent events)."""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import MethodType
from typing import (TYPE_CHECKING, Any, Awaitable, Callable, Dict, Generic, List, Mapping,
                    Optional, Sequence, Tuple, Type, TypeVar, Union, overload)
from urllib.parse import quote

import httpx

from . import models as m
from ._model import M, decode

if sys.version_info >= (3, 10):
    from typing import Concatenate, ParamSpec
else:  # pragma: no cover
    from typing_extensions import Concatenate, ParamSpec

if TYPE_CHECKING:
    from ._async import AsyncClient
    from ._sync import Client

T = TypeVar("T")
P = ParamSpec("P")

DEFAULT_URL = "http://127.0.0.1:7420"
NDJSON = "application/x-ndjson"


class BerthError(Exception):
    """A refusal: the API's error envelope (`{"error": {code, message, details}}`).
    `status` 0: the client's own finding (`not_granted`, `stream_ended`); code
    `bad_answer`: an answer that does not fit the OpenAPI document."""

    def __init__(self, status: int, code: str, message: str, details: Any = None):
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message, self.details = status, code, message, details


@dataclass
class Lease:
    """A granted run: its id, fence (the capability every change needs), environment,
    workspace and expiry, as the daemon answered (`run`: the whole `Run`, `raw`: as JSON)."""

    run_id: str
    fence: int
    env: Dict[str, str]
    workspace: Optional[str]
    expires_at: Optional[str]
    ttl_ms: Optional[int]
    raw: Dict[str, Any] = field(repr=False, default_factory=dict)
    run: Optional[m.Run] = field(repr=False, default=None)

    @classmethod
    def of(cls, run: Union[m.Run, Mapping[str, Any]]) -> "Lease":
        if not isinstance(run, m.Run):
            run = m.Run.from_dict(run)
        if run.state != "granted" or run.fence is None:
            raise BerthError(0, "not_granted", f"run {run.run_id} is {run.state}", run)
        return cls(run.run_id, run.fence, run.env, run.workspace, run.expires_at, run.ttl_ms,
                   run.to_dict(), run)

    @property
    def renew_every(self) -> float:
        """Seconds between renewals: a third of the lease's ttl (at least 0.2 s)."""
        return max((self.ttl_ms or 300_000) / 3000.0, 0.2)


def settings(url: Optional[str], token: Optional[str]) -> Tuple[str, Dict[str, str]]:
    """The daemon's address (`url`, BERTH_URL, the default) and the Authorization header
    (`token`, BERTH_TOKEN, the state dir's admin.token)."""
    url = (url or os.environ.get("BERTH_URL") or DEFAULT_URL).rstrip("/")
    token = token or _default_token()
    return url, ({"Authorization": f"Bearer {token}"} if token else {})


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


# ---- requests and answers --------------------------------------------------------------

@dataclass(frozen=True)
class Call(Generic[T]):
    """One request, and how to read its answer once it succeeded."""

    method: str
    path: str
    read: Callable[[httpx.Response], T]
    body: Any = None
    params: Optional[Dict[str, Any]] = None
    headers: Optional[Dict[str, str]] = None
    wait: bool = False  # no timeout: the answer may take as long as it takes

    def request(self) -> Dict[str, Any]:
        """Keyword arguments for httpx's `request` and `stream`."""
        return {"method": self.method, "url": self.path, "json": self.body,
                "params": self.params, "headers": self.headers,
                "timeout": None if self.wait else httpx.USE_CLIENT_DEFAULT}


def refusal(r: httpx.Response) -> BerthError:
    """The error of a refused request (its body already read)."""
    try:
        v = r.json()
    except ValueError:
        v = r.text
    e = v.get("error") if isinstance(v, dict) else None
    e = e if isinstance(e, dict) else {}
    return BerthError(r.status_code, e.get("code", "error"),
                      e.get("message") or str(v) or r.reason_phrase, e.get("details"))


def answer(r: httpx.Response, read: Callable[[httpx.Response], T]) -> T:
    """A read answer, `BerthError` for a refusal or an answer that does not fit."""
    if r.status_code >= 300:
        raise refusal(r)
    try:
        return read(r)
    except ValueError as e:
        raise bad_answer(r, e) from e


def bad_answer(r: httpx.Response, e: Exception) -> BerthError:
    return BerthError(r.status_code, "bad_answer", f"{r.request.method} {r.request.url.path}: {e}")


def _model(tp: Type[M]) -> Callable[[httpx.Response], M]:
    return lambda r: tp.from_dict(r.json())


def _items(tp: Type[M], key: str, item: Type[T]) -> Callable[[httpx.Response], List[T]]:
    """A list answer (`{"runs": [...]}`) as its list."""
    return lambda r: getattr(tp.from_dict(r.json()), key)


def _text(r: httpx.Response) -> str:
    return r.text


def _json(r: httpx.Response) -> Any:
    return r.json()


def _journal(r: httpx.Response) -> List[m.JournalEntry]:
    return [m.JournalEntry.from_dict(json.loads(line)) for line in r.text.splitlines() if line.strip()]


def _seg(value: Any, what: str) -> str:
    """A path segment: a non-empty string, percent-encoded."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string, not {value!r}")
    return quote(value, safe="")


def _query(**params: Any) -> Dict[str, Any]:
    return {k: v for k, v in params.items() if v is not None}


def _body(model: Type[M], fields: Mapping[str, Any]) -> Dict[str, Any]:
    return model.of(fields).to_dict()


# ---- operations ------------------------------------------------------------------------

class Operation(Generic[P, T]):
    """An operation of the OpenAPI document (`operation_id`), described once by `spec` as
    the request it makes. On a `Client` it is a method answering `T`; on an `AsyncClient`
    one answering an awaitable of `T`: each sends the spec's `Call` its own way."""

    def __init__(self, operation_id: str, spec: Callable[Concatenate[Any, P], Call[T]]):
        self.operation_id, self.spec = operation_id, spec

        @functools.wraps(spec)
        def send(client: Any, *args: Any, **kwargs: Any) -> Any:
            return client._send(spec(client, *args, **kwargs))
        setattr(send, "operation_id", operation_id)
        # What help() shows: the answer's type, not the Call (an AsyncClient awaits it).
        sig = inspect.signature(spec)
        answers = str(sig.return_annotation)
        if answers.startswith("Call[") and answers.endswith("]"):
            setattr(send, "__signature__", sig.replace(return_annotation=answers[5:-1]))
        self._method = send

    @overload
    def __get__(self, obj: None, owner: Any) -> Callable[..., Any]: ...
    @overload
    def __get__(self, obj: "AsyncClient", owner: Any) -> Callable[P, Awaitable[T]]: ...
    @overload
    def __get__(self, obj: "Client", owner: Any) -> Callable[P, T]: ...

    def __get__(self, obj: Any, owner: Any) -> Any:
        # On the class: the plain function (`Client.status(client)`).
        return self._method if obj is None else MethodType(self._method, obj)


def operation(operation_id: str) -> Callable[[Callable[Concatenate[Any, P], Call[T]]], Operation[P, T]]:
    return lambda spec: Operation(operation_id, spec)


def streams(operation_id: str) -> Callable[[T], T]:
    """Marks a client's own method (a stream) as the one that calls `operation_id`."""
    def mark(method: T) -> T:
        setattr(method, "operation_id", operation_id)
        return method
    return mark


def operations(cls: type) -> Dict[str, str]:
    """Each operationId `cls` calls, and the name of its method."""
    found: Dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        for name, value in vars(klass).items():
            op = getattr(value, "operation_id", None)
            if isinstance(op, str):
                found[op] = name
    return found


class Operations:
    """The operations of API v1 but the two streams (acquire, events), once for both
    clients. Path segments must be non-empty strings (`ValueError`); a request body that
    does not fit its schema is refused before it is sent (`TypeError`, `ValueError`)."""

    # ---- runs --------------------------------------------------------------------------
    @operation("listRuns")
    def runs(self, all: bool = False, limit: Optional[int] = None) -> Call[List[m.Run]]:
        """`GET /v1/runs`: the live runs; with `all`, the ended ones remembered too."""
        return Call("GET", "/v1/runs", _items(m.RunList, "runs", m.Run),
                    params=_query(all="true" if all else None, limit=limit))

    @operation("getRun")
    def run(self, run_id: str, wait_s: Optional[int] = None,
            state: Optional[str] = None) -> Call[m.Run]:
        """`GET /v1/runs/{id}`; with `wait_s`, waits that long for a queued run to move;
        with `state` (the state last seen), answers at once if it is no longer in it."""
        return Call("GET", f"/v1/runs/{_seg(run_id, 'run_id')}", _model(m.Run),
                    params=_query(wait_s=wait_s, state=state), wait=wait_s is not None)

    @operation("cancelRun")
    def cancel(self, run_id: str, fence: Optional[int] = None) -> Call[m.Run]:
        """`DELETE /v1/runs/{id}`: cancels a waiter, or ends a lease (with its fence)."""
        return Call("DELETE", f"/v1/runs/{_seg(run_id, 'run_id')}", _model(m.Run),
                    params=_query(fence=fence))

    @operation("renewRun")
    def renew(self, run_id: str, fence: Optional[int] = None,
              ttl_s: Optional[int] = None) -> Call[m.Run]:
        """`POST /v1/runs/{id}/renew`: extends a lease (with its fence) or a wait."""
        return Call("POST", f"/v1/runs/{_seg(run_id, 'run_id')}/renew", _model(m.Run),
                    body=_body(m.RenewRequest, {"fence": fence, "ttl_s": ttl_s}))

    @operation("releaseRun")
    def release(self, run_id: str, fence: int) -> Call[m.Run]:
        """`POST /v1/runs/{id}/release`: answers once its processes are stopped."""
        return Call("POST", f"/v1/runs/{_seg(run_id, 'run_id')}/release", _model(m.Run),
                    body=_body(m.ReleaseRequest, {"fence": fence}), wait=True)

    @operation("registerProcess")
    def register(self, run_id: str, fence: int, pid: int) -> Call[m.Run]:
        """`POST /v1/runs/{id}/processes`: berth stops this process tree with the run."""
        return Call("POST", f"/v1/runs/{_seg(run_id, 'run_id')}/processes", _model(m.Run),
                    body=_body(m.ProcessRequest, {"fence": fence, "pid": pid}))

    @operation("startRuntime")
    def start_runtime(self, run_id: str, fence: int) -> Call[m.RuntimeStarted]:
        """`POST /v1/runs/{id}/runtime`: builds and starts the run's ports."""
        return Call("POST", f"/v1/runs/{_seg(run_id, 'run_id')}/runtime",
                    _model(m.RuntimeStarted), body=_body(m.RuntimeRequest, {"fence": fence}),
                    wait=True)

    @operation("checkFence")
    def check_fence(self, run_id: str, fence: int) -> Call[m.FenceCheck]:
        """`GET /v1/fences/check`: is `fence` still the lease of `run_id`?"""
        return Call("GET", "/v1/fences/check", _model(m.FenceCheck),
                    params={"run_id": run_id, "fence": fence})

    # ---- the host ----------------------------------------------------------------------
    @operation("getStatus")
    def status(self) -> Call[m.Status]:
        """`GET /v1/status`: capacity, queue, projects, reaper."""
        return Call("GET", "/v1/status", _model(m.Status))

    @operation("getFleet")
    def fleet(self) -> Call[m.Fleet]:
        """`GET /v1/fleet` (404 `fleet_mode_off` without `--store`)."""
        return Call("GET", "/v1/fleet", _model(m.Fleet))

    @operation("readJournal")
    def journal(self, after: int = 0, limit: Optional[int] = None) -> Call[List[m.JournalEntry]]:
        """`GET /v1/journal`: entries after `after` (at most `limit`, 1000)."""
        return Call("GET", "/v1/journal", _journal, params=_query(after=after, limit=limit))

    @operation("exportJournal")
    def export_journal(self, start: int = 1, through: Optional[int] = None,
                       scope: Optional[str] = None) -> Call[str]:
        """`GET /v1/journal/export`: the stored lines of `start`…`through`, exactly."""
        return Call("GET", "/v1/journal/export", _text, wait=True,
                    params=_query(**{"from": start, "through": through, "scope": scope}))

    @operation("getMetrics")
    def metrics(self) -> Call[str]:
        """`GET /metrics` (OpenMetrics text)."""
        return Call("GET", "/metrics", _text)

    @operation("reap")
    def reap(self) -> Call[m.ReapReport]:
        """`POST /v1/reap`: a reaper pass now."""
        return Call("POST", "/v1/reap", _model(m.ReapReport), wait=True)

    @operation("getDashboard")
    def dashboard(self) -> Call[str]:
        """`GET /`: the dashboard's page."""
        return Call("GET", "/", _text)

    @operation("getOpenApi")
    def openapi(self) -> Call[Dict[str, Any]]:
        """`GET /v1/openapi.json`: the OpenAPI document."""
        return Call("GET", "/v1/openapi.json", _json)

    @operation("getIdle")
    def idle(self) -> Call[m.Idle]:
        """`GET /v1/idle`: may the host be taken away now?"""
        return Call("GET", "/v1/idle", _model(m.Idle))

    @operation("getDrain")
    def drain(self) -> Call[m.Drain]:
        """`GET /v1/drain`: the drain in force, if any, and what it waits for."""
        return Call("GET", "/v1/drain", _model(m.Drain))

    @operation("startDrain")
    def start_drain(self, reason: Optional[str] = None) -> Call[m.Drain]:
        """`POST /v1/drain`: admit nothing new until `end_drain`."""
        return Call("POST", "/v1/drain", _model(m.Drain),
                    body=_body(m.DrainRequest, {"reason": reason}))

    @operation("endDrain")
    def end_drain(self) -> Call[m.Drain]:
        """`DELETE /v1/drain`: admit again."""
        return Call("DELETE", "/v1/drain", _model(m.Drain))

    @operation("startFleetDrain")
    def start_fleet_drain(self, reason: Optional[str] = None) -> Call[m.Drain]:
        """`POST /v1/fleet/drain`: fleet mode, every host admits nothing new until
        `end_fleet_drain`."""
        return Call("POST", "/v1/fleet/drain", _model(m.Drain),
                    body=_body(m.DrainRequest, {"reason": reason}))

    @operation("endFleetDrain")
    def end_fleet_drain(self) -> Call[m.Drain]:
        """`DELETE /v1/fleet/drain`: the fleet admits again."""
        return Call("DELETE", "/v1/fleet/drain", _model(m.Drain))

    # ---- tokens ------------------------------------------------------------------------
    @operation("listTokens")
    def tokens(self) -> Call[List[m.TokenInfo]]:
        return Call("GET", "/v1/tokens", _items(m.TokenList, "tokens", m.TokenInfo))

    @operation("createToken")
    def create_token(self, scope: str, uid: Optional[int] = None,
                     expires_s: Optional[int] = None) -> Call[m.TokenCreated]:
        """`POST /v1/tokens`: `scope` is `read`, `operator` or `admin`; shown once."""
        return Call("POST", "/v1/tokens", _model(m.TokenCreated), body=_body(
            m.TokenRequest, {"scope": scope, "uid": uid, "expires_s": expires_s}))

    @operation("revokeToken")
    def revoke_token(self, token_id: str) -> Call[m.TokenInfo]:
        return Call("DELETE", f"/v1/tokens/{_seg(token_id, 'token_id')}", _model(m.TokenInfo))

    # ---- threads -----------------------------------------------------------------------
    @operation("attachThread")
    def attach_thread(self, /, key: str, **claim: Any) -> Call[m.Thread]:
        """`POST /v1/threads/{key}/attach` with a `ThreadClaim` (`run_id`, `owner_gen`,
        `owner_fence`, `run_budget_ms`)."""
        return Call("POST", f"/v1/threads/{_seg(key, 'key')}/attach", _model(m.Thread),
                    body=_body(m.ThreadClaim, claim))

    @operation("moveThreadDeadline")
    def move_thread_deadline(self, /, key: str, **claim: Any) -> Call[m.Thread]:
        return Call("POST", f"/v1/threads/{_seg(key, 'key')}/deadline", _model(m.Thread),
                    body=_body(m.ThreadClaim, claim))

    @operation("detachThread")
    def detach_thread(self, /, key: str, **claim: Any) -> Call[m.Thread]:
        return Call("POST", f"/v1/threads/{_seg(key, 'key')}/detach", _model(m.Thread),
                    body=_body(m.ThreadClaim, claim))

    @operation("getThread")
    def thread(self, key: str) -> Call[m.Thread]:
        return Call("GET", f"/v1/threads/{_seg(key, 'key')}", _model(m.Thread))

    @operation("evictThread")
    def evict_thread(self, key: str) -> Call[m.Thread]:
        return Call("DELETE", f"/v1/threads/{_seg(key, 'key')}", _model(m.Thread))

    @operation("listThreads")
    def threads(self) -> Call[List[m.Thread]]:
        return Call("GET", "/v1/threads", _items(m.ThreadList, "threads", m.Thread))

    # ---- scopes (experiment budgets) ---------------------------------------------------
    @operation("listScopes")
    def scopes(self) -> Call[List[m.ScopeSummary]]:
        return Call("GET", "/v1/scopes", _items(m.ScopeList, "scopes", m.ScopeSummary))

    @operation("getScope")
    def scope(self, scope: str) -> Call[m.Scope]:
        return Call("GET", f"/v1/scopes/{_seg(scope, 'scope')}", _model(m.Scope))

    @operation("forgetScope")
    def forget_scope(self, scope: str) -> Call[m.ScopeSummary]:
        return Call("DELETE", f"/v1/scopes/{_seg(scope, 'scope')}", _model(m.ScopeSummary))

    @operation("reserveToken")
    def reserve(self, scope: str, owner: str, operation_id: str,
                harness: str) -> Call[m.Reservation]:
        """`POST /v1/scopes/{id}/reservations`: a turn's token, keyed by (owner, operation_id)."""
        body = {"owner": owner, "operation_id": operation_id, "harness": harness}
        return Call("POST", f"/v1/scopes/{_seg(scope, 'scope')}/reservations",
                    _model(m.Reservation), body=_body(m.ReservationRequest, body))

    @operation("unreserveToken")
    def unreserve(self, scope: str, owner: str, operation_id: str) -> Call[m.ScopeToken]:
        path = (f"/v1/scopes/{_seg(scope, 'scope')}/reservations/{_seg(owner, 'owner')}/"
                f"{_seg(operation_id, 'operation_id')}")
        return Call("DELETE", path, _model(m.ScopeToken))

    @operation("reconcileScope")
    def reconcile(self, scope: str, owner: str, reason: str) -> Call[m.Reconciled]:
        """`POST /v1/scopes/{id}/reconcile`: frees every token `owner` holds."""
        return Call("POST", f"/v1/scopes/{_seg(scope, 'scope')}/reconcile", _model(m.Reconciled),
                    body=_body(m.ReconcileRequest, {"owner": owner, "reason": reason}))

    @operation("controlScope")
    def control(self, scope: str, mode: str, request_id: str) -> Call[m.ControlReceipt]:
        """`mode`: pause, stop or resume; the same `request_id` again is idempotent."""
        return Call("POST", f"/v1/scopes/{_seg(scope, 'scope')}/control", _model(m.ControlReceipt),
                    body=_body(m.ControlRequest, {"mode": mode, "request_id": request_id}))


# ---- the streamed acquire --------------------------------------------------------------

def acquire_call(body: Union[m.AcquireRequest, Mapping[str, Any]]) -> Call[m.Run]:
    """`POST /v1/runs` as a stream (`Accept: application/x-ndjson`); its `read` reads a
    plain answer (a detached waiter's `202`)."""
    req = body if isinstance(body, m.AcquireRequest) else m.AcquireRequest.of(body)
    return Call("POST", "/v1/runs", _model(m.Run), body=req.to_dict(),
                headers={"Accept": NDJSON}, wait=True)


def streamed(r: httpx.Response) -> bool:
    return str(r.headers.get("content-type", "")).startswith(NDJSON)


def acquire_line(r: httpx.Response, line: str) -> Optional[m.AcquireEvent]:
    """One line of a streamed acquire as its event (None: a blank line)."""
    if not line.strip():
        return None
    try:
        event: m.AcquireEvent = decode(m.AcquireEvent, json.loads(line), "acquire event")
        return event
    except ValueError as e:
        raise bad_answer(r, e) from e


def acquire_outcome(event: m.AcquireEvent) -> m.Run:
    """The granted run, or the refusal (`expired`: 410, `rejected`: 409) raised."""
    if isinstance(event, m.AcquireEventGranted):
        return event.lease
    assert isinstance(event, (m.AcquireEventExpired, m.AcquireEventRejected)), event
    e = event.error
    raise BerthError(410 if event.event == "expired" else 409, e.code, e.message, e.details)


def stream_ended() -> BerthError:
    return BerthError(0, "stream_ended", "the acquire stream ended without an answer")


# ---- server-sent events ----------------------------------------------------------------

class EventCursor:
    """Where an event stream is: the request of each connection (the first `?after=`,
    each later one `Last-Event-ID:` the last entry seen or the last a `cutoff` named) and
    its lines read as entries, none twice; and the pause before reconnecting."""

    PAUSE_FIRST, PAUSE_MOST = 0.1, 1.0

    def __init__(self, after: Optional[int], kinds: Optional[Sequence[str]],
                 run: Optional[str], project: Optional[str]):
        if after is not None and (not isinstance(after, int) or isinstance(after, bool)
                                  or after < 0):
            raise ValueError(f"after must be a sequence number (an int >= 0), not {after!r}")
        if isinstance(kinds, str):
            raise TypeError(f"kinds must be a list of kinds, not the string {kinds!r}")
        self.last = after
        self.filter = _query(run=run, project=project,
                             kind=",".join(kinds) if kinds else None)
        self.connections = 0
        self.pause = self.PAUSE_FIRST
        self._event: str = ""
        self._data: List[str] = []

    def call(self) -> Call[None]:
        params, headers = dict(self.filter), {"Accept": "text/event-stream"}
        if self.last is not None:
            if self.connections:
                headers["Last-Event-ID"] = str(self.last)
            else:
                params["after"] = self.last
        self.connections += 1
        self._event, self._data = "", []  # a record cut short by a drop is dropped
        return Call("GET", "/v1/events", lambda r: None, params=params, headers=headers,
                    wait=True)

    def feed(self, r: httpx.Response, line: str) -> Optional[m.JournalEntry]:
        """One line of the stream: the entry it completes, if any (and new)."""
        if line:
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "event":
                self._event = value
            elif name == "data":
                self._data.append(value)
            return None  # `id:` repeats the entry's seq; comments are heartbeats
        event, data = self._event, "\n".join(self._data)
        self._event, self._data = "", []
        if not data:
            return None
        try:
            if event == "cutoff":  # berth closes the stream after it: resume from there
                cut = m.StreamCutoff.from_dict(json.loads(data))
                self.last = max(self.last or 0, cut.last_seq)
                return None
            entry = m.JournalEntry.from_dict(json.loads(data))
        except ValueError as e:
            raise bad_answer(r, e) from e
        if self.last is not None and entry.seq <= self.last:
            return None
        self.last, self.pause = entry.seq, self.PAUSE_FIRST
        return entry

    def backoff(self) -> float:
        """Seconds to wait before the next connection (doubling to at most 1 s)."""
        pause, self.pause = self.pause, min(self.pause * 2, self.PAUSE_MOST)
        return pause
