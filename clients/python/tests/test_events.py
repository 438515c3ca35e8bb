"""Server-sent events: resumed by `after` against a real daemon, and by Last-Event-ID
after a dropped connection and a `cutoff` against a scripted server; both clients."""

import asyncio
import json
import threading
from contextlib import closing
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import berth
from conftest import SMALL

KINDS = ["sync", "async"]


def take(server, kind, n, **options):
    """The first `n` entries of `events(**options)` by the client of `kind` (a failure,
    not a hang, when they do not come within 20 s)."""
    if kind == "async":
        async def main():
            async with berth.AsyncClient(server.url, server.token) as c:
                it = c.events(**options)
                try:
                    return [await it.__anext__() for _ in range(n)]
                finally:
                    await it.aclose()
        return asyncio.run(asyncio.wait_for(main(), 20))
    got, failed = [], []

    def read():
        try:
            with berth.Client(server.url, server.token) as c, closing(c.events(**options)) as it:
                for _ in range(n):
                    got.append(next(it))
        except BaseException as e:
            failed.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(20)
    assert not reader.is_alive(), f"{n} entries did not come within 20 s: {got}"
    if failed:
        raise failed[0]
    return got


@pytest.mark.parametrize("kind", KINDS)
def test_a_stream_resumed_after_a_noted_sequence_number_has_no_gap_nor_repeat(daemon, server, kind):
    for i in range(3):
        lease = daemon.acquire("ev", run_id=f"ev-{i}", **SMALL)
        daemon.release(lease.run_id, lease.fence)
    journal = daemon.journal()
    assert len(journal) >= 6
    head = take(server, kind, 4, after=0)
    assert [(e.seq, e.kind, e.run_id) for e in head] == \
        [(e.seq, e.kind, e.run_id) for e in journal[:4]]
    noted = head[2].seq  # resume from the third, as a reader that lost the fourth would
    # The rest of the journal, then one entry written while the stream is open.
    rest = len(journal) - noted
    late = threading.Timer(0.5, lambda: daemon.acquire("ev", run_id="ev-late", **SMALL))
    late.start()
    try:
        tail = take(server, kind, rest + 1, after=noted)
    finally:
        late.join()
    assert [e.seq for e in tail] == list(range(noted + 1, len(journal) + 2))
    assert [(e.seq, e.kind) for e in tail[:rest]] == [(e.seq, e.kind) for e in journal[noted:]]
    assert tail[-1].run_id == "ev-late"


@pytest.mark.parametrize("kind", KINDS)
def test_a_stream_from_after_the_last_entry_is_refused(daemon, server, kind):
    last = daemon.journal()[-1].seq if daemon.journal() else 0
    with pytest.raises(berth.BerthError) as e:
        take(server, kind, 1, after=last + 1000)
    assert e.value.status == 400 and "Last-Event-ID" in e.value.message


def record(seq, kind):
    entry = {"seq": seq, "at": "2026-01-01T00:00:00Z", "kind": kind, "run_id": "r-1",
             "data": {"n": seq}}
    return f"id: {seq}\nevent: {kind}\ndata: {json.dumps(entry)}\n\n"


class Scripted(BaseHTTPRequestHandler):
    """Three connections: events 1 and 2 (after a heartbeat, one with CRLF line ends)
    then a drop in the middle of 3; a replay of 2, then 3 and a cutoff after 5; then 6."""

    seen: list

    def do_GET(self):
        self.seen.append((self.path, self.headers.get("Last-Event-ID"),
                          self.headers.get("Authorization")))
        n = len(self.seen)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()  # no length: the body ends when the connection closes
        if n == 1:
            body = ": heartbeat\n\n" + record(1, "queued") + \
                record(2, "granted").replace("\n", "\r\n") + 'id: 3\nevent: released\ndata: {"seq":3,'
        elif n == 2:
            cut = {"reason": "too far behind", "last_seq": 5}
            body = record(2, "granted") + record(3, "released") + \
                f"event: cutoff\ndata: {json.dumps(cut)}\n\n"
        else:
            body = record(6, "ended")
        self.wfile.write(body.encode())
        self.wfile.flush()

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("kind", KINDS)
def test_a_dropped_stream_and_a_cutoff_resume_by_last_event_id(kind):
    handler = type("Handler", (Scripted,), {"seen": []})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    fake = type("Server", (), {"url": f"http://127.0.0.1:{httpd.server_port}", "token": "tok"})
    try:
        got = take(fake, kind, 4, after=0, run="r-1", kinds=["queued", "ended"])
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert [e.seq for e in got] == [1, 2, 3, 6]
    assert all(e.data == {"n": e.seq} for e in got)
    assert handler.seen == [
        ("/v1/events?run=r-1&kind=queued%2Cended&after=0", None, "Bearer tok"),
        ("/v1/events?run=r-1&kind=queued%2Cended", "2", "Bearer tok"),
        ("/v1/events?run=r-1&kind=queued%2Cended", "5", "Bearer tok"),
    ]
