"""A real daemon for each test (BERTH_BIN: the berth binary to start), on a free port
with a fresh state directory."""

import json
import os
import re
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, Optional, Tuple

import pytest

import berth

ROOT = Path(__file__).resolve().parents[3]
SMALL = {"resources": {"memory": 1 << 20, "cpu_millis": 10, "disk": 0}}


def openapi() -> dict:
    return json.loads(ROOT.joinpath("docs", "openapi.json").read_text())


def operation_ids() -> Dict[Tuple[str, "re.Pattern[str]"], str]:
    """(method, path pattern) of each operation of the OpenAPI document: its operationId."""
    found = {}
    for path, item in openapi()["paths"].items():
        pattern = re.compile("^" + re.sub(r"\{[^}]+\}", "[^/]+", path) + "$")
        for method, op in item.items():
            if isinstance(op, dict) and "operationId" in op:
                found[(method.upper(), pattern)] = op["operationId"]
    return found


def operation_of(method: str, path: str) -> Optional[str]:
    for (m, pattern), op in operation_ids().items():
        if m == method and pattern.match(path):
            return op
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    token: str


@pytest.fixture
def server() -> Iterator[Server]:
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
            if proc.poll() is not None:
                pytest.fail(f"berth serve exited with {proc.returncode}")
            time.sleep(0.05)
    else:
        pytest.fail("berth serve did not answer within 10 s")
    try:
        yield Server(url, token)
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def daemon(server: Server) -> Iterator[berth.Client]:
    """A sync client of the test's daemon."""
    with berth.Client(server.url, server.token) as client:
        yield client
