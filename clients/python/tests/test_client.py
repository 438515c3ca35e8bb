"""The Python client against a real daemon (BERTH_BIN: the berth binary to start)."""

import os
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

import berth


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def daemon():
    binary = os.environ.get("BERTH_BIN")
    if not binary:
        pytest.fail("BERTH_BIN is not set: the berth binary to test against")
    state = tempfile.mkdtemp()
    port = free_port()
    proc = subprocess.Popen(
        [binary, "serve", "--state-dir", state, "--listen", f"127.0.0.1:{port}",
         "--slots-max", "4", "--memory-total", "8GiB", "--cpu-total", "4",
         "--disk-total", "100GiB", "--disk-reserve", "0", "--no-memory-sampling",
         "--user-workspaces", os.path.join(state, "users")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    token = None
    for _ in range(200):
        try:
            token = Path(state, "admin.token").read_text().strip()
            with berth.Client(url, token) as c:
                c.status()
            break
        except Exception:
            time.sleep(0.05)
    client = berth.Client(url, token)
    yield client
    client.close()
    proc.terminate()
    proc.wait(10)


SMALL = {"resources": {"memory": 1 << 20, "cpu_millis": 10, "disk": 0}}


def test_a_lease_is_granted_renewed_and_released_by_the_context_manager(daemon):
    with berth.lease("py", client=daemon, ttl_s=2, **SMALL) as lease:
        assert lease.env["BERTH_RUN_ID"] == lease.run_id
        assert daemon.check_fence(lease.run_id, lease.fence)["current"] is True
        time.sleep(3)  # past the 2 s ttl: the background renewals kept it
        assert daemon.run(lease.run_id)["state"] == "granted"
    assert daemon.run(lease.run_id)["state"] in ("releasing", "released")
    assert daemon.check_fence(lease.run_id, lease.fence)["current"] is False


def test_an_exception_in_the_block_still_releases(daemon):
    with pytest.raises(KeyboardInterrupt):
        with berth.lease("py", client=daemon, **SMALL) as lease:
            raise KeyboardInterrupt
    assert daemon.run(lease.run_id)["state"] in ("releasing", "released")


def test_twenty_parallel_leases_never_exceed_the_slots(daemon):
    # The closing note's program: 20 agents, 4 slots.
    live, most, lock = [0], [0], threading.Lock()

    def agent(i):
        with berth.lease("shop", client=daemon, run_id=f"agent-{i}", **SMALL):
            with lock:
                live[0] += 1
                most[0] = max(most[0], live[0])
            time.sleep(0.2)
            with lock:
                live[0] -= 1

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(20)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert most[0] <= 4
    ended = [r for r in daemon.runs(all=True) if r["run_id"].startswith("agent-")]
    assert len(ended) == 20 and all(r["state"] == "released" for r in ended)


def test_a_wait_that_runs_out_is_expired_with_its_reason(daemon):
    holder = daemon.acquire("a", singletons=["db"], **SMALL)
    with pytest.raises(berth.BerthError) as e:
        daemon.acquire("b", singletons=["db"], wait_s=0, **SMALL)
    assert e.value.code == "expired"
    assert "db" in e.value.message
    daemon.release(holder.run_id, holder.fence)
    with pytest.raises(berth.BerthError) as e:
        daemon.release(holder.run_id, holder.fence + 100)
    assert e.value.status == 409


def test_status_runs_journal_and_events(daemon):
    lease = daemon.acquire("j", **SMALL)
    assert daemon.status()["granted"] == 1
    assert [r["run_id"] for r in daemon.runs()] == [lease.run_id]
    kinds = [e["kind"] for e in daemon.journal()]
    assert "granted" in kinds
    first = next(daemon.events(after=0, kinds=["granted"]))
    assert first["kind"] == "granted" and first["run_id"] == lease.run_id
    daemon.release(lease.run_id, lease.fence)


def test_the_readmes_example_runs_as_written(daemon, monkeypatch, capsys):
    readme = Path(__file__).resolve().parents[3].joinpath("README.md").read_text()
    example = readme.split("```python\n")[1].split("```")[0]
    monkeypatch.setenv("BERTH_URL", daemon.url)
    monkeypatch.setenv("BERTH_TOKEN", daemon._http.headers["Authorization"].split()[1])
    exec(compile(example, "README.md", "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    assert sorted(int(l.split()[0]) for l in lines) == list(range(20))


def test_every_operation_of_the_openapi_document_has_a_method():
    import json
    doc = json.loads(Path(__file__).resolve().parents[3].joinpath("docs/openapi.json").read_text())
    ids = {op["operationId"] for item in doc["paths"].values() for op in item.values()
           if isinstance(op, dict) and "operationId" in op}
    assert ids == set(berth.OPERATIONS), ids ^ set(berth.OPERATIONS)
    for method in berth.OPERATIONS.values():
        assert callable(getattr(berth.Client, method)), method


def test_every_operation_runs_against_the_daemon(daemon):
    """Each method reaches its route: an answer, or a refusal of the request (never
    "no such endpoint" or "method not allowed")."""
    called = set()

    def op(name, *args, **kw):
        called.add(name)
        try:
            return getattr(daemon, name)(*args, **kw)
        except berth.BerthError as e:
            assert e.code != "method_not_allowed" and "no such endpoint" not in e.message, (name, e)
            return e

    run = op("acquire_stream", {"project": "all", **SMALL})
    rid, fence = run["run_id"], run["fence"]
    op("runs"); op("run", rid); op("check_fence", rid, fence); op("renew", rid, fence)
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        assert op("register", rid, fence, sleeper.pid)["run_id"] == rid
    finally:
        sleeper.kill()
    op("start_runtime", rid, fence)
    assert "granted" in [e["kind"] for e in op("journal")]
    assert op("export_journal").strip()
    assert next(op("events", 0))["seq"] == 1
    assert "berth_" in op("metrics")
    op("status"); op("fleet"); op("reap"); op("idle")
    assert "<html" in op("dashboard").lower()
    assert op("openapi")["openapi"] == "3.1.0"
    made = op("create_token", "read", expires_s=60)
    assert any(t["id"] == made["id"] for t in op("tokens"))
    assert op("revoke_token", made["id"])["id"] == made["id"]
    op("attach_thread", "t1", run_id=rid, owner_gen="g", owner_fence=1)
    op("move_thread_deadline", "t1", run_id=rid, owner_gen="g", owner_fence=1, run_budget_ms=60000)
    op("detach_thread", "t1", run_id=rid, owner_gen="g", owner_fence=1)
    op("thread", "t1"); op("threads"); op("evict_thread", "t1")
    assert op("start_drain", "test")["drain"]["reason"] == "test"
    op("drain"); op("end_drain")
    op("scopes"); op("scope", "s"); op("reserve", "s", "o", "op1", "h")
    op("unreserve", "s", "o", "op1"); op("reconcile", "s", "o", "test")
    op("control", "s", "pause", "req-1"); op("forget_scope", "s")
    assert op("release", rid, fence)["run_id"] == rid
    op("cancel", rid)
    assert called == set(berth.OPERATIONS.values()), set(berth.OPERATIONS.values()) - called
