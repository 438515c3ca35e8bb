"""The sync client and `berth.lease()` against a real daemon."""

import threading
import time

import pytest

import berth
from berth import models
from conftest import ROOT, SMALL


def test_a_lease_is_granted_renewed_and_released_by_the_context_manager(daemon):
    with berth.lease("py", client=daemon, ttl_s=2, **SMALL) as lease:
        assert lease.env["BERTH_RUN_ID"] == lease.run_id
        assert isinstance(lease.run, models.Run) and lease.run.claim.resources["memory"] == 1 << 20
        assert daemon.check_fence(lease.run_id, lease.fence).current is True
        time.sleep(3)  # past the 2 s ttl: the background renewals kept it
        assert daemon.run(lease.run_id).state == "granted"
    assert daemon.run(lease.run_id).state in ("releasing", "released")
    assert daemon.check_fence(lease.run_id, lease.fence).current is False
    # Told the state last seen (granted), a long poll answers at once: it has moved on.
    t0 = time.monotonic()
    assert daemon.run(lease.run_id, wait_s=30, state="granted").state in ("releasing", "released")
    assert time.monotonic() - t0 < 10


def test_an_exception_in_the_block_still_releases(daemon):
    with pytest.raises(RuntimeError, match="the agent failed"):
        with berth.lease("py", client=daemon, **SMALL) as lease:
            assert daemon.run(lease.run_id).state == "granted"
            raise RuntimeError("the agent failed")
    assert daemon.run(lease.run_id).state in ("releasing", "released")
    assert daemon.check_fence(lease.run_id, lease.fence).current is False


def test_a_keyboard_interrupt_in_the_block_still_releases(daemon):
    with pytest.raises(KeyboardInterrupt):
        with berth.lease("py", client=daemon, **SMALL) as lease:
            assert daemon.run(lease.run_id).state == "granted"
            raise KeyboardInterrupt
    assert daemon.run(lease.run_id).state in ("releasing", "released")
    assert daemon.check_fence(lease.run_id, lease.fence).current is False


def test_twenty_parallel_leases_never_exceed_the_slots(daemon):
    # The closing note's program: 20 agents, each on a project of its own (one
    # project's runs take turns until it is promoted), 4 slots: they run side by side,
    # never more than 4 at once.
    live, most, lock = [0], [0], threading.Lock()

    def agent(i):
        with berth.lease(f"task-{i}", client=daemon, run_id=f"agent-{i}", **SMALL):
            with lock:
                live[0] += 1
                most[0] = max(most[0], live[0])
            time.sleep(0.2)
            with lock:
                live[0] -= 1

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(20)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert 2 <= most[0] <= 4, most[0]
    ended = [r for r in daemon.runs(all=True) if r.run_id.startswith("agent-")]
    assert len(ended) == 20 and all(r.state == "released" for r in ended)


def test_a_streamed_acquire_reports_its_place_in_the_queue(daemon):
    holder = daemon.acquire("a", singletons=["db"], **SMALL)
    seen = []

    def on_queued(position, reason):
        seen.append((position, reason))
        if len(seen) == 1:  # now that it waits, let the holder go
            daemon.release(holder.run_id, holder.fence)

    run = daemon.acquire_stream({"project": "b", "singletons": ["db"], **SMALL}, on_queued)
    assert isinstance(run, models.Run) and run.state == "granted" and run.fence > holder.fence
    assert seen and seen[0][0] == 1 and isinstance(seen[0][1], models.Reason)
    assert seen[0][1].code == "key.exclusive" and holder.run_id in seen[0][1].message
    daemon.release(run.run_id, run.fence)


def test_a_wait_that_runs_out_is_expired_with_its_reason(daemon):
    holder = daemon.acquire("a", singletons=["db"], **SMALL)
    with pytest.raises(berth.BerthError) as e:
        daemon.acquire("b", singletons=["db"], wait_s=0, **SMALL)
    assert e.value.status == 410 and e.value.code == "expired"
    assert "db" in e.value.message
    daemon.release(holder.run_id, holder.fence)
    with pytest.raises(berth.BerthError) as e:
        daemon.release(holder.run_id, holder.fence + 100)
    assert e.value.status == 409


def test_a_detached_acquire_answers_the_queued_run_at_once(daemon):
    holder = daemon.acquire("a", singletons=["db"], **SMALL)
    run = daemon.acquire_stream({"project": "b", "singletons": ["db"], "detach": True,
                                 "wait_s": 60, **SMALL})
    assert run.state == "queued" and run.detached is True and run.fence is None
    with pytest.raises(berth.BerthError) as e:
        berth.Lease.of(run)
    assert e.value.code == "not_granted"
    assert daemon.cancel(run.run_id).state == "cancelled"
    daemon.release(holder.run_id, holder.fence)


def test_status_runs_and_journal_answer_their_models(daemon):
    lease = daemon.acquire("j", **SMALL)
    status = daemon.status()
    assert isinstance(status, models.Status) and status.granted == 1
    assert status.projects[0].project == "j" and status.projects[0].active == 1
    assert [r.run_id for r in daemon.runs()] == [lease.run_id]
    entries = daemon.journal()
    assert [e.seq for e in entries] == list(range(1, len(entries) + 1))
    assert "granted" in [e.kind for e in entries]
    first = next(daemon.events(after=0, kinds=["granted"]))
    assert first.kind == "granted" and first.run_id == lease.run_id
    daemon.release(lease.run_id, lease.fence)


def test_the_readmes_example_runs_as_written(daemon, server, monkeypatch, capsys):
    readme = ROOT.joinpath("README.md").read_text()
    example = readme.split("```python\n")[1].split("```")[0]
    monkeypatch.setenv("BERTH_URL", server.url)
    monkeypatch.setenv("BERTH_TOKEN", server.token)
    exec(compile(example, "README.md", "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    assert sorted(int(l.split()[0]) for l in lines) == list(range(20))


def test_the_clients_readme_examples_run_as_written(server, monkeypatch, capsys):
    readme = ROOT.joinpath("clients", "python", "README.md").read_text()
    examples = [block.split("```")[0] for block in readme.split("```python\n")[1:]]
    assert len(examples) == 3
    monkeypatch.setenv("BERTH_URL", server.url)
    monkeypatch.setenv("BERTH_TOKEN", server.token)
    outputs = []
    for example in examples:
        exec(compile(example, "clients/python/README.md", "exec"), {})
        outputs.append(capsys.readouterr().out.split())
    assert outputs[0][:2] == ["runs", "in"] and outputs[0][-3:-1] == ["with", "fence"]
    fences = [int(f.strip("[],")) for f in outputs[1][1:]]
    assert len(set(fences)) == 8  # each agent its own lease
    state, fence, granted, *journal = outputs[2]
    assert (state, granted) == ("granted", "1") and int(fence) > max(fences)
    kinds = journal[1::2]
    assert kinds == ["granted", "released"]
