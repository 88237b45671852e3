"""The embedded broker's lifetime, with real processes: it dies with its runtime's
process however that ends (SIGTERM, ``kill -9``), the next run on the same data directory
works, a broker a dead runtime left is stopped, and a data directory a live runtime uses
is refused at once. Ports are free ones (``$AX_LOCAL_PORT``), never 4222."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

import ax_scheduler as ax
from ax_scheduler._embedded import LocalNats, binary, free_port, listening
from conftest import eventually

SCRIPT = """
import sys, time
import ax_scheduler as ax

@ax.task(queue="py_tasks")
def broker_echo(x: int) -> int:
    return x

if __name__ == "__main__":
    with ax.Runtime(data_dir=sys.argv[1], shutdown_grace=1):
        print("result", broker_echo.submit(7).result(timeout=30), flush=True)
        time.sleep(600)
"""


@ax.task(queue="py_tasks")
def broker_echo(x: int) -> int:
    return x


def stat(pid: int) -> tuple[str, str, int] | None:
    """``(command name, state, parent pid)`` of a process, None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name, rest = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
    return name, rest[0], int(rest[1])


def alive(pid: int) -> bool:
    found = stat(pid)
    return found is not None and found[1] != "Z"


def brokers_of(pid: int) -> list[int]:
    """The nats-server children of process ``pid``."""
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        found = stat(int(entry))
        if found is not None and found[0] == "nats-server" and found[2] == pid:
            out.append(int(entry))
    return out


class Script:
    def __init__(self, p: subprocess.Popen[bytes], log: Path):
        self.p, self.log = p, log

    def output(self) -> str:
        return self.log.read_text()


class Scripts:
    """Runs SCRIPT on a data directory and port; ``cleanup`` kills what is left of each
    run, its nats-server included (before the fix it outlived the script)."""

    def __init__(self, tmp_path: Path):
        self.path = tmp_path / "script.py"
        self.path.write_text(SCRIPT)
        self.started: list[Script] = []
        self.brokers: set[int] = set()

    def run(self, data: Path, port: int) -> Script:
        log = self.path.parent / f"run{len(self.started)}.log"
        env = {**os.environ, "AX_LOCAL_PORT": str(port), "AX_URL": ""}
        with open(log, "wb") as out:
            p = subprocess.Popen([sys.executable, str(self.path), str(data)], env=env, stdout=out,
                                 stderr=subprocess.STDOUT)
        self.started.append(Script(p, log))
        return self.started[-1]

    def cleanup(self) -> None:
        for s in self.started:
            self.brokers.update(brokers_of(s.p.pid))
            s.p.kill()
            s.p.wait()
        for pid in self.brokers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def scripts(tmp_path: Path) -> Iterator[Scripts]:
    made = Scripts(tmp_path)
    yield made
    made.cleanup()


def test_the_broker_dies_with_its_runtime_and_the_next_run_works(tmp_path, scripts):
    data, port = tmp_path / "data", free_port()
    for sig in (signal.SIGTERM, signal.SIGKILL, signal.SIGTERM):  # each next run finds the last one's remains
        run = scripts.run(data, port)
        eventually(lambda: "result 7" in run.output() or run.p.poll() is not None, 60, "the script's task ran")
        assert run.p.poll() is None, run.output()
        (broker,) = brokers_of(run.p.pid)
        scripts.brokers.add(broker)
        run.p.send_signal(sig)
        run.p.wait(10)
        eventually(lambda: not alive(broker), 5, f"nats-server {broker} gone after {sig.name} of its runtime")
        assert (data / "nats-server.pid").read_text().split()[:2] == [str(broker), str(run.p.pid)]


def test_a_broker_a_dead_runtime_left_is_stopped_and_the_runtime_starts(tmp_path, monkeypatch):
    data, port = tmp_path / "data", free_port()
    monkeypatch.setenv("AX_LOCAL_PORT", str(port))
    monkeypatch.delenv("AX_URL", raising=False)
    (data / "jetstream").mkdir(parents=True)
    orphan = subprocess.Popen([binary(), "-js", "-sd", str(data / "jetstream"), "-a", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    gone = subprocess.Popen(["true"])
    gone.wait()  # the runtime that started the orphan: dead
    (data / "nats-server.pid").write_text(f"{orphan.pid} {gone.pid} {port}\n")
    try:
        eventually(lambda: listening("127.0.0.1", port), 10, "the orphan listens")
        with ax.Runtime(data_dir=data, tasks=[broker_echo], shutdown_grace=1):
            assert orphan.poll() is not None, "the orphan was stopped"
            assert broker_echo.submit(5).result(timeout=30) == 5
    finally:
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait()


def test_a_data_directory_a_live_runtime_uses_is_refused_at_once(tmp_path, scripts, monkeypatch):
    data, port = tmp_path / "data", free_port()
    run = scripts.run(data, port)
    eventually(lambda: "result 7" in run.output() or run.p.poll() is not None, 60, "the script's task ran")
    monkeypatch.setenv("AX_LOCAL_PORT", str(port))
    monkeypatch.delenv("AX_URL", raising=False)
    rt = ax.Runtime(data_dir=data, tasks=[broker_echo])
    started = time.monotonic()
    try:
        with pytest.raises(ax.Conflict, match=f"process {run.p.pid}"):
            rt.start()
    finally:
        rt.stop()
    assert time.monotonic() - started < 5


def test_a_nats_the_runtime_did_not_start_is_named_at_once(tmp_path, scripts):
    port = free_port()
    other = LocalNats(tmp_path / "other", port=port).start()  # no ax server answers there
    try:
        run = scripts.run(tmp_path / "data", port)
        eventually(lambda: "did not start" in run.output(), 10, "a log line naming the NATS on the port")
    finally:
        other.stop()
