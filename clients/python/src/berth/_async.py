"""The asyncio client, and `alease()`: a lease for an `async with` block."""

from __future__ import annotations

import asyncio
import inspect
from contextlib import asynccontextmanager
from typing import (Any, AsyncIterator, Callable, Mapping, Optional, Sequence, TypeVar,
                    Union)

import httpx

from . import models as m
from ._api import (BerthError, Call, EventCursor, Lease, Operations, acquire_call, acquire_line,
                   acquire_outcome, answer, refusal, settings, stream_ended, streamed, streams)

T = TypeVar("T")


class AsyncClient(Operations):
    """An asyncio client of API v1: the methods of `Client`, each a coroutine (the
    streams: `acquire_stream` a coroutine, `events` an async iterator). `httpx_options`
    go to `httpx.AsyncClient`."""

    def __init__(self, url: Optional[str] = None, token: Optional[str] = None,
                 timeout: float = 30.0, **httpx_options: Any):
        self.url, headers = settings(url, token)
        self._http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout,
                                       **httpx_options)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def _send(self, call: Call[T]) -> T:
        return answer(await self._http.request(**call.request()), call.read)

    @asynccontextmanager
    async def _stream(self, call: Call[Any]) -> AsyncIterator[httpx.Response]:
        async with self._http.stream(**call.request()) as r:
            if r.status_code >= 300:
                await r.aread()
                raise refusal(r)
            yield r

    # ---- the two streams ---------------------------------------------------------------
    async def acquire(self, project: str, *, wait_s: Optional[int] = None,
                      **fields: Any) -> Lease:
        """Waits in the queue until granted (see `Client.acquire`)."""
        body = {"project": project, "wait_s": wait_s, **fields}
        return Lease.of(await self.acquire_stream(body))

    @streams("acquireRun")
    async def acquire_stream(self, body: Union[m.AcquireRequest, Mapping[str, Any]],
                             on_queued: Optional[Callable[[Optional[int], Optional[m.Reason]],
                                                          Any]] = None) -> m.Run:
        """`POST /v1/runs`, streamed (see `Client.acquire_stream`); `on_queued` may be a
        coroutine function. Cancelling the task closes the stream, and berth cancels the
        waiting run."""
        call = acquire_call(body)
        async with self._stream(call) as r:
            if not streamed(r):
                await r.aread()
                return answer(r, call.read)
            async for line in r.aiter_lines():
                event = acquire_line(r, line)
                if isinstance(event, m.AcquireEventQueued):
                    if on_queued:
                        said = on_queued(event.position, event.reason)
                        if inspect.isawaitable(said):
                            await said
                elif event is not None:
                    return acquire_outcome(event)
        raise stream_ended()

    @streams("streamEvents")
    async def events(self, after: Optional[int] = 0, kinds: Optional[Sequence[str]] = None, *,
                     run: Optional[str] = None, project: Optional[str] = None,
                     reconnect: bool = True) -> AsyncIterator[m.JournalEntry]:
        """`GET /v1/events` as an async iterator (see `Client.events`). Leaving the loop
        early leaves the connection to the generator's `aclose()`: use
        `contextlib.aclosing` to close it at once."""
        cursor = EventCursor(after, kinds, run, project)
        while True:
            try:
                async with self._stream(cursor.call()) as r:
                    async for line in r.aiter_lines():
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
            await asyncio.sleep(cursor.backoff())


async def _renew(client: AsyncClient, lease: Lease) -> Optional[BerthError]:
    """Renews a lease a third of its ttl after each confirmation; answers why it was lost."""
    while True:
        await asyncio.sleep(lease.renew_every)
        try:
            await client.renew(lease.run_id, lease.fence)
        except BerthError as e:
            if e.status in (409, 410):
                return e
        except httpx.HTTPError:
            pass  # a restart: the next renewal tries again


async def _release(client: AsyncClient, lease: Lease, quiet: bool) -> None:
    try:
        await client.release(lease.run_id, lease.fence)
    except BerthError as e:
        if not quiet and e.status not in (409, 410):
            raise
    except Exception:
        if not quiet:
            raise


@asynccontextmanager
async def alease(project: str, *, client: Optional[AsyncClient] = None,
                 **fields: Any) -> AsyncIterator[Lease]:
    """`lease()` for asyncio: acquired on entry, renewed by a background task, released
    on exit however the block ends (an exception, the task cancelled: the release is
    shielded from a second cancellation)."""
    own = client is None
    c = client or AsyncClient()
    try:
        granted = await c.acquire(project, **fields)
        renewer = asyncio.ensure_future(_renew(c, granted))
        try:
            yield granted
        except BaseException:
            renewer.cancel()
            await asyncio.shield(_release(c, granted, quiet=True))
            raise
        renewer.cancel()
        await _release(c, granted, quiet=False)
    finally:
        if own:
            await c.aclose()
