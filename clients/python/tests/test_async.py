"""The asyncio client and `berth.alease()` against a real daemon (plain tests that run
their coroutine with asyncio.run)."""

import asyncio

import pytest

import berth
from berth import models
from conftest import SMALL


def run(server, body):
    """Runs `body(client)` with an AsyncClient of the test's daemon."""
    async def main():
        async with berth.AsyncClient(server.url, server.token) as client:
            return await body(client)
    return asyncio.run(main())


async def released(client, lease):
    assert (await client.run(lease.run_id)).state in ("releasing", "released")
    assert (await client.check_fence(lease.run_id, lease.fence)).current is False


def test_an_async_lease_is_granted_renewed_and_released(server):
    async def body(c):
        async with berth.alease("py", client=c, ttl_s=2, **SMALL) as lease:
            assert lease.env["BERTH_RUN_ID"] == lease.run_id
            assert (await c.check_fence(lease.run_id, lease.fence)).current is True
            await asyncio.sleep(3)  # past the 2 s ttl: the renewing task kept it
            assert (await c.run(lease.run_id)).state == "granted"
        await released(c, lease)
    run(server, body)


def test_an_exception_in_the_async_block_still_releases(server):
    async def body(c):
        with pytest.raises(RuntimeError, match="the agent failed"):
            async with berth.alease("py", client=c, **SMALL) as lease:
                assert (await c.run(lease.run_id)).state == "granted"
                raise RuntimeError("the agent failed")
        await released(c, lease)
    run(server, body)


def test_a_cancelled_task_still_releases_its_async_lease(server):
    async def body(c):
        granted = asyncio.get_running_loop().create_future()

        async def agent():
            async with berth.alease("py", client=c, **SMALL) as lease:
                granted.set_result(lease)
                await asyncio.sleep(3600)

        task = asyncio.ensure_future(agent())
        lease = await granted
        assert (await c.run(lease.run_id)).state == "granted"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await released(c, lease)
    run(server, body)


def test_a_cancelled_wait_cancels_the_waiting_run(server):
    async def body(c):
        holder = await c.acquire("a", singletons=["db"], **SMALL)
        queued = asyncio.Event()
        task = asyncio.ensure_future(c.acquire_stream(
            {"project": "b", "run_id": "waiter", "singletons": ["db"], **SMALL},
            on_queued=lambda position, reason: queued.set()))
        await asyncio.wait_for(queued.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):  # berth sees the connection close (A9)
            if (await c.run("waiter")).state != "queued":
                break
            await asyncio.sleep(0.05)
        assert (await c.run("waiter")).state == "cancelled"
        await c.release(holder.run_id, holder.fence)
    run(server, body)


def test_an_async_streamed_acquire_reports_its_place_in_the_queue(server):
    async def body(c):
        holder = await c.acquire("a", singletons=["db"], **SMALL)
        seen = []

        async def on_queued(position, reason):  # a coroutine function is awaited
            seen.append((position, reason))
            if len(seen) == 1:
                await c.release(holder.run_id, holder.fence)

        got = await c.acquire_stream({"project": "b", "singletons": ["db"], **SMALL}, on_queued)
        assert isinstance(got, models.Run) and got.state == "granted" and got.fence > holder.fence
        assert seen and isinstance(seen[0][1], models.Reason) and "db" in seen[0][1].message
        with pytest.raises(berth.BerthError) as e:
            await c.acquire("c", singletons=["db"], wait_s=0, **SMALL)
        assert e.value.status == 410 and e.value.code == "expired"
        await c.release(got.run_id, got.fence)
    run(server, body)


def test_twenty_async_leases_never_exceed_the_slots(server):
    async def body(c):
        live, most = [0], [0]

        async def agent(i):
            async with berth.alease("shop", client=c, run_id=f"agent-{i}", **SMALL):
                live[0] += 1
                most[0] = max(most[0], live[0])
                await asyncio.sleep(0.2)
                live[0] -= 1

        await asyncio.gather(*(agent(i) for i in range(20)))
        assert 1 <= most[0] <= 4
        ended = [r for r in await c.runs(all=True) if r.run_id.startswith("agent-")]
        assert len(ended) == 20 and all(r.state == "released" for r in ended)
    run(server, body)
