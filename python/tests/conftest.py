"""Fixtures: a real nats-server (random port, temp store, killed at the end) and a real
ax server, both started by the tests; worker processes started and killed for real."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ax_scheduler as ax
from ax_scheduler import _core
from ax_scheduler._embedded import LocalNats

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
# Every queue the tests use, declared by the session's ax server.
QUEUES = ["default", "py_tasks", "py_flows", "py_shared", "py_faults", "py_gil", "py_capacity"]
ACK_WAIT = 2.0


@pytest.fixture(scope="session")
def nats(tmp_path_factory):
    broker = LocalNats(tmp_path_factory.mktemp("nats")).start()
    yield broker
    broker.stop()


@pytest.fixture(scope="session")
def url(nats):
    return nats.url


@pytest.fixture(scope="session")
def server(url):
    """An ax server in this process (ax-server's own code, through the binding), with a
    short ack wait so redeliveries come within seconds."""
    conn = _core.Connection.connect(url, "ax-tests-server", 5.0, None, None, 30.0)
    handle = _core.serve(conn, QUEUES, None, None, ACK_WAIT)
    client = ax.Client(url)
    client.call("task", "queues")  # waits until the server answers
    yield handle
    handle.stop()


@pytest.fixture
def client(url, server):
    c = ax.Client(url)
    yield c
    c.close()


@pytest.fixture
def runtime(url, server):
    """Starts a Runtime for the given tasks; stopped at the end of the test."""
    started = []

    def start(*tasks, **kwargs):
        kwargs.setdefault("shutdown_grace", 5.0)
        rt = ax.Runtime(url, tasks=list(tasks), **kwargs).start()
        started.append(rt)
        deadline = time.monotonic() + 15
        while not rt.ready():
            assert time.monotonic() < deadline, "the runtime's workers never became ready"
            time.sleep(0.05)
        return rt

    yield start
    for rt in started:
        rt.stop()


def ax_binary() -> str:
    """The `ax` binary (the Rust worker): $AX_BIN, else the workspace's debug build
    (built here if missing)."""
    env = os.environ.get("AX_BIN")
    if env:
        return env
    path = REPO / "target" / "debug" / "ax"
    if not path.exists():
        subprocess.run(["cargo", "build", "--bin", "ax"], cwd=REPO, check=True)
    return str(path)


class Proc:
    """A process of the test, killed at the end if still running."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, log: Path | None = None):
        self.log = log
        out = open(log, "ab") if log else subprocess.DEVNULL
        self.p = subprocess.Popen(args, env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT,
                                  cwd=HERE)
        if log:
            out.close()

    def output(self) -> str:
        return self.log.read_text() if self.log else ""


@pytest.fixture
def procs():
    started: list[Proc] = []

    def spawn(args, env=None, log=None):
        proc = Proc(args, env, log)
        started.append(proc)
        return proc

    yield spawn
    for proc in started:  # SIGTERM first: a runtime then stops the nats-server it started
        if proc.p.poll() is None:
            proc.p.terminate()
            try:
                proc.p.wait(15)
            except subprocess.TimeoutExpired:
                proc.p.kill()
                proc.p.wait()


def python_worker(url: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ax_scheduler", "worker", str(HERE / "workload.py"), "--url", url, *extra]


def runs(path: Path) -> list[dict]:
    """The run records a worker appended (one JSON line per start)."""
    import json

    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def eventually(check, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout} s")
        time.sleep(0.05)


@pytest.fixture
def scratch_flows():
    """Flows a test defines that must not reach the runtimes of later tests (a runtime
    stores every registered flow of its tasks, and refuses to start on a broken one)."""
    from ax_scheduler._flow import FLOWS

    before = set(FLOWS)
    yield
    for name in set(FLOWS) - before:
        del FLOWS[name]
