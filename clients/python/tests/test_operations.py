"""Each client calls every operation of the OpenAPI document: a method for each
operationId, and every one of them sent to a real daemon (each request is matched to
its operationId by the document's paths)."""

import asyncio
import inspect
import subprocess

import httpx
import pytest

import berth
from berth import models
from conftest import SMALL, openapi, operation_of

CLIENTS = [berth.Client, berth.AsyncClient]


def document_ids():
    return {op["operationId"] for item in openapi()["paths"].values() for op in item.values()
            if isinstance(op, dict) and "operationId" in op}


@pytest.mark.parametrize("cls", CLIENTS, ids=lambda c: c.__name__)
def test_every_operation_of_the_openapi_document_has_a_method(cls):
    found = berth.operations(cls)
    assert set(found) == document_ids(), set(found) ^ document_ids()
    assert found == berth.OPERATIONS  # the same names in both clients
    for name in found.values():
        assert callable(getattr(cls, name)), name
    if cls is berth.AsyncClient:  # each operation answers an awaitable, events an async iterator
        assert inspect.iscoroutinefunction(cls._send) and inspect.isasyncgenfunction(cls.events)
        assert inspect.iscoroutinefunction(cls.acquire_stream)


async def scenario(client, call, first):
    """Every operation once. `call(name, *args)` answers the method's answer (awaited for
    the async client); `first(iterator)` the first item of a stream."""
    called = set()

    async def op(name, *args, **kw):
        called.add(name)
        try:
            return await call(getattr(client, name), *args, **kw)
        except berth.BerthError as e:
            # A refusal of the request itself, never "no such endpoint" or "method not
            # allowed", nor an answer that does not fit its model.
            assert e.code not in ("method_not_allowed", "bad_answer"), (name, e)
            assert "no such endpoint" not in e.message, (name, e)
            return e

    budget = {"scope": "s", "harness": "h", "per_harness": {"h": 4}}
    run = await op("acquire_stream", {"project": "all", "budget": budget, "singletons": ["db"],
                                      **SMALL})
    assert isinstance(run, models.Run) and run.state == "granted"
    rid, fence = run.run_id, run.fence
    assert [r.run_id for r in await op("runs")] == [rid]
    assert (await op("run", rid)).fence == fence
    assert (await op("check_fence", rid, fence)).current is True
    assert (await op("renew", rid, fence)).expires_at
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        assert (await op("register", rid, fence, sleeper.pid)).run_id == rid
    finally:
        sleeper.kill()
        sleeper.wait()
    assert (await op("start_runtime", rid, fence)).code == "no_contract"  # no worktree
    assert "granted" in [e.kind for e in await op("journal")]
    assert (await op("export_journal")).strip()
    assert (await first(await op("events", 0))).seq == 1
    assert "berth_" in await op("metrics")
    assert (await op("status")).granted == 1
    assert isinstance(await op("reap"), models.ReapReport)
    assert (await op("idle")).idle is False
    assert (await op("fleet")).code == "fleet_mode_off"
    assert (await op("start_fleet_drain", "test")).code == "fleet_mode_off"
    assert (await op("end_fleet_drain")).code == "fleet_mode_off"
    assert "<html" in (await op("dashboard")).lower()
    assert (await op("openapi"))["openapi"] == "3.1.0"
    made = await op("create_token", "read", expires_s=60)
    assert isinstance(made, models.TokenCreated) and made.scope == "read"
    assert any(t.id == made.id for t in await op("tokens"))
    assert (await op("revoke_token", made.id)).id == made.id
    claim = {"run_id": rid, "owner_gen": "g", "owner_fence": 1}
    attached = await op("attach_thread", "t1", run_budget_ms=60000, **claim)
    assert attached.registration.owner.run_id == rid and attached.registration.live
    assert (await op("move_thread_deadline", "t1", run_budget_ms=90000, **claim)).key == "t1"
    assert (await op("detach_thread", "t1", **claim)).registration is None
    assert (await op("thread", "t1")).workspace
    assert [t.key for t in await op("threads")] == ["t1"]
    assert (await op("evict_thread", "t1")).evictions[0].reason == "operator"
    assert (await op("start_drain", "test")).drain.reason == "test"
    assert (await op("drain")).draining is True
    assert (await op("end_drain")).draining is False
    assert [s.scope for s in await op("scopes")] == ["s"]
    assert (await op("scope", "s")).tokens[0].run_id == rid
    assert (await op("reserve", "s", "o", "op1", "h")).new is True
    assert (await op("unreserve", "s", "o", "op1")).operation_id == "op1"
    await op("reserve", "s", "o", "op2", "h")
    assert [t.operation_id for t in (await op("reconcile", "s", "o", "test")).freed] == ["op2"]
    assert (await op("control", "s", "pause", "req-1")).control == "paused"
    waiter = await op("acquire_stream", {"project": "b", "singletons": ["db"], "detach": True,
                                         "wait_s": 60, **SMALL})
    assert waiter.state == "queued" and waiter.position == 1
    assert (await op("cancel", waiter.run_id)).state == "cancelled"
    assert (await op("release", rid, fence)).state in ("releasing", "released")
    assert (await op("forget_scope", "s")).code == "scope_in_use"  # paused: receipts kept
    return called


@pytest.mark.parametrize("cls", CLIENTS, ids=lambda c: c.__name__)
def test_every_operation_runs_against_the_daemon(server, cls):
    sent = []

    def note(request):
        sent.append(operation_of(request.method, request.url.path))

    async def anote(request):
        note(request)

    async def main():
        if cls is berth.Client:
            with berth.Client(server.url, server.token,
                              event_hooks={"request": [note]}) as client:
                async def call(method, *args, **kw):
                    return method(*args, **kw)

                async def first(it):
                    try:
                        return next(it)
                    finally:
                        it.close()
                return await scenario(client, call, first)
        async with berth.AsyncClient(server.url, server.token,
                                     event_hooks={"request": [anote]}) as client:
            async def acall(method, *args, **kw):
                got = method(*args, **kw)
                return got if inspect.isasyncgen(got) else await got

            async def afirst(it):
                try:
                    return await it.__anext__()
                finally:
                    await it.aclose()
            return await scenario(client, acall, afirst)

    called = asyncio.run(main())
    assert called == set(berth.OPERATIONS.values()), set(berth.OPERATIONS.values()) - called
    assert None not in sent  # every request is an operation of the document
    assert set(sent) == document_ids(), document_ids() - set(sent)


def test_bad_input_is_refused_before_anything_is_sent():
    sent = []
    transport = httpx.MockTransport(lambda request: sent.append(request) or httpx.Response(500))
    with berth.Client("http://berth.invalid", "t", transport=transport) as c:
        with pytest.raises(TypeError, match="no field 'bogus'"):
            c.acquire("p", bogus=1)
        with pytest.raises(ValueError, match="AcquireRequest.ttl_s: expected int"):
            c.acquire("p", ttl_s="soon")
        with pytest.raises(ValueError, match="run_id must be a non-empty string"):
            c.release("", 1)
        with pytest.raises(TypeError, match="missing 1 required"):
            c.attach_thread("t1", run_id="r", owner_gen="g")
        with pytest.raises(ValueError, match="after must be a sequence number"):
            next(c.events(after=-1))
        with pytest.raises(TypeError, match="kinds must be a list"):
            next(c.events(kinds="granted"))
    assert sent == []


def test_an_answer_that_does_not_fit_its_model_is_a_clear_error():
    def answer(request):
        if request.url.path == "/v1/status":
            return httpx.Response(200, json={"granted": "many"})
        if request.url.path == "/v1/runs/r1":
            return httpx.Response(404, json={"error": {"code": "not_found", "message": "no run r1",
                                                       "details": {"run_id": "r1"}}})
        return httpx.Response(200, text="not json")

    with berth.Client("http://berth.invalid", "t", transport=httpx.MockTransport(answer)) as c:
        with pytest.raises(berth.BerthError) as e:
            c.status()
        assert e.value.code == "bad_answer" and "Status" in e.value.message
        with pytest.raises(berth.BerthError) as e:
            c.run("r1")
        assert (e.value.status, e.value.code, e.value.message, e.value.details) == \
            (404, "not_found", "no run r1", {"run_id": "r1"})
        with pytest.raises(berth.BerthError) as e:
            c.idle()
        assert e.value.code == "bad_answer" and "/v1/idle" in e.value.message
