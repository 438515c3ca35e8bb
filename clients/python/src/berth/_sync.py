"""The synchronous client, and `lease()`: a lease for a `with` block."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, TypeVar, Union

import httpx

from . import models as m
from ._api import (BerthError, Call, EventCursor, Lease, Operations, acquire_call, acquire_line,
                   acquire_outcome, answer, refusal, settings, stream_ended, streamed, streams)

T = TypeVar("T")


class Client(Operations):
    """A synchronous client of API v1 (thread-safe: one pooled httpx client). Every
    operation of `Operations` is a method answering its model; `httpx_options` go to
    `httpx.Client` (a `transport`, `event_hooks`, `verify`, ...)."""

    def __init__(self, url: Optional[str] = None, token: Optional[str] = None,
                 timeout: float = 30.0, **httpx_options: Any):
        self.url, headers = settings(url, token)
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout,
                                  **httpx_options)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _send(self, call: Call[T]) -> T:
        return answer(self._http.request(**call.request()), call.read)

    @contextmanager
    def _stream(self, call: Call[Any]) -> Iterator[httpx.Response]:
        with self._http.stream(**call.request()) as r:
            if r.status_code >= 300:
                r.read()
                raise refusal(r)
            yield r

    # ---- the two streams ---------------------------------------------------------------
    def acquire(self, project: str, *, wait_s: Optional[int] = None, **fields: Any) -> Lease:
        """Waits in the queue (as a stream of position and reason) until granted; the
        fields are `AcquireRequest`'s (`resources`, `ttl_s`, `run_id`, ...)."""
        return Lease.of(self.acquire_stream({"project": project, "wait_s": wait_s, **fields}))

    @streams("acquireRun")
    def acquire_stream(self, body: Union[m.AcquireRequest, Mapping[str, Any]],
                       on_queued: Optional[Callable[[Optional[int], Optional[m.Reason]], Any]] = None
                       ) -> m.Run:
        """`POST /v1/runs`, streamed: `on_queued(position, reason)` for each `queued`
        line; the granted run, or `BerthError` (410 `expired` when the wait ran out). A
        detached waiter (`detach: true`) is answered at once: its queued run."""
        call = acquire_call(body)
        with self._stream(call) as r:
            if not streamed(r):
                r.read()
                return answer(r, call.read)
            for line in r.iter_lines():
                event = acquire_line(r, line)
                if isinstance(event, m.AcquireEventQueued):
                    if on_queued:
                        on_queued(event.position, event.reason)
                elif event is not None:
                    return acquire_outcome(event)
        raise stream_ended()

    @streams("streamEvents")
    def events(self, after: Optional[int] = 0, kinds: Optional[Sequence[str]] = None, *,
               run: Optional[str] = None, project: Optional[str] = None,
               reconnect: bool = True) -> Iterator[m.JournalEntry]:
        """`GET /v1/events`: the journal live (server-sent events), from after `after`
        (None: from now), filtered by kinds, run and project. A dropped connection or a
        `cutoff` is resumed with `Last-Event-ID` (after a pause of at most 1 s), without
        a gap or a repeat, unless `reconnect` is False; a refusal raises `BerthError`."""
        cursor = EventCursor(after, kinds, run, project)
        while True:
            try:
                with self._stream(cursor.call()) as r:
                    for line in r.iter_lines():
                        entry = cursor.feed(r, line)
                        if entry is not None:
                            yield entry
            except httpx.TransportError:
                if not reconnect:
                    raise
            except BerthError as e:
                if not reconnect or e.status < 500:
                    raise
            if not reconnect:
                return
            time.sleep(cursor.backoff())


class _Renewer(threading.Thread):
    """Renews a lease a third of its ttl after each confirmation, until stopped or lost."""

    def __init__(self, client: Client, lease: Lease):
        super().__init__(daemon=True, name=f"berth-renew-{lease.run_id}")
        self.client, self.lease = client, lease
        self.stop = threading.Event()
        self.lost: Optional[BerthError] = None

    def run(self) -> None:
        while not self.stop.wait(self.lease.renew_every):
            try:
                self.client.renew(self.lease.run_id, self.lease.fence)
            except BerthError as e:
                if e.status in (409, 410):
                    self.lost = e
                    return
            except httpx.HTTPError:
                pass  # a restart: the next renewal tries again

    def close(self) -> None:
        self.stop.set()
        self.join()


def release_quietly(client: Client, lease: Lease, quiet: bool) -> None:
    """Releases; a lease already gone (409, 410) is no error, nor is anything if `quiet`."""
    try:
        client.release(lease.run_id, lease.fence)
    except BerthError as e:
        if not quiet and e.status not in (409, 410):
            raise
    except Exception:
        if not quiet:
            raise


@contextmanager
def lease(project: str, *, client: Optional[Client] = None, **fields: Any) -> Iterator[Lease]:
    """A lease for the block: acquired on entry (waiting in the queue), renewed in the
    background, released on exit however the block ends (an exception, Ctrl-C: then the
    block's exception is the one raised, whatever the release met)."""
    own = client is None
    c = client or Client()
    try:
        granted = c.acquire(project, **fields)
        renewer = _Renewer(c, granted)
        renewer.start()
        try:
            yield granted
        except BaseException:
            renewer.close()
            release_quietly(c, granted, quiet=True)
            raise
        renewer.close()
        release_quietly(c, granted, quiet=False)
    finally:
        if own:
            c.close()
