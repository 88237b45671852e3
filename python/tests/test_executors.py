"""Where functions run: a child process per attempt (killed at the hard timeout), and
async functions on the runtime's event loop (cancelled at the hard timeout)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

import ax_scheduler as ax
from conftest import eventually

Q = "py_tasks"
CHILDREN: list[int] = []  # filled in the parent from the child's result or its pid file


@ax.task(queue=Q, retries=0)
def in_a_child(x: int) -> dict:
    return {"pid": os.getpid(), "x": x}


@ax.task(queue=Q, timeout=1, retries=0)
def stuck_child(pid_file: str) -> str:
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(30)
    return "never"


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie is dead). The process may be reaped between any two
    of these looks: then its /proc entry answers ESRCH or is gone, and it is dead."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def test_the_process_executor_runs_each_attempt_in_a_child_and_kills_it_at_the_timeout(runtime, client, tmp_path):
    runtime(in_a_child, stuck_child, executor="process")
    out = in_a_child.submit(7, client=client).result(timeout=20)
    assert out["x"] == 7 and out["pid"] != os.getpid()
    pid_file = tmp_path / "child.pid"
    handle = stuck_child.submit(str(pid_file), client=client)
    with pytest.raises(ax.TaskFailed) as failed:
        handle.result(timeout=20)
    assert failed.value.error_class == "timeout"
    pid = int(pid_file.read_text())
    eventually(lambda: not alive(pid), 5, "the child was killed")


CANCELLED: list[str] = []


@ax.task(queue=Q, timeout=1, retries=0)
async def slow_async(x: int) -> str:
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        CANCELLED.append(ax.context().id)
        raise
    return "never"


def test_an_async_task_past_its_timeout_is_cancelled(runtime, client):
    runtime(slow_async)
    CANCELLED.clear()
    handle = slow_async.submit(1, client=client)
    with pytest.raises(ax.TaskFailed) as failed:
        handle.result(timeout=20)
    assert failed.value.error_class == "timeout"
    eventually(lambda: CANCELLED == [handle.id], 5, "the coroutine was cancelled")


@ax.task(queue=Q, retries=1, retry_backoff=0.1)
def after_a_runtime_bug(x: int) -> int:
    return x


def test_a_task_thread_survives_a_runtime_failure_and_the_attempt_is_retried(runtime, client, monkeypatch):
    rt = runtime(after_a_runtime_bug, max_concurrency=1)  # one thread: if it died, nothing would run
    real = rt._executors._handle
    calls: list[str] = []

    def broken_once(core):
        calls.append(core.id)
        if len(calls) == 1:
            raise RuntimeError("a runtime bug")
        real(core)

    monkeypatch.setattr(rt._executors, "_handle", broken_once)
    handle = after_a_runtime_bug.submit(5, client=client)
    assert handle.result(timeout=20) == 5
    record = client.get(handle.id)
    assert record["attempt"] == 2, "the failed attempt was recorded and retried"
    assert rt._executors.thread_failures == 1
    assert after_a_runtime_bug.submit(6, client=client).result(timeout=20) == 6


# -- issue 38: a child that uses ax, children reused, per-task limits -------------------------

@ax.task(queue=Q, retries=0)
def sub_echo(x: int) -> int:
    return x * 10


@ax.task(queue=Q, retries=0, timeout=20)
def submits_from_a_child(x: int) -> dict:
    by_task = sub_echo.submit(x)
    by_client = ax.Client().submit(sub_echo, x + 1)
    return {"pid": os.getpid(), "ids": [by_task.id, by_client.id],
            "results": [by_task.result(timeout=15), by_client.result(timeout=15)]}


def test_a_task_in_a_child_process_can_use_ax_and_children_are_reused(runtime, client):
    runtime(in_a_child, sub_echo, submits_from_a_child, executor="process", max_concurrency=2)
    out = submits_from_a_child.submit(4, client=client).result(timeout=30)
    assert out["results"] == [40, 50]
    assert out["pid"] != os.getpid()
    pids = {in_a_child.submit(i, client=client).result(timeout=20)["pid"] for i in range(6)}
    assert len(pids) <= 2, f"six attempts on two reused children, not a process each: {pids}"


@ax.task(queue=Q, retries=0, max_memory_mb=64)
def greedy(mb: int) -> int:
    block = bytearray(mb * 1024 * 1024)
    return len(block)


@ax.task(queue=Q, retries=0, max_cpu_seconds=1, timeout=30)
def spinning(seconds: float) -> int:
    end, n = time.process_time() + seconds, 0
    while time.process_time() < end:
        n += 1
    return n


def test_per_task_memory_and_cpu_limits_fail_the_attempt_and_spare_the_runtime(runtime, client):
    runtime(greedy, spinning, in_a_child, executor="process", max_concurrency=1)
    assert greedy.submit(8, client=client).result(timeout=30) == 8 * 1024 * 1024
    with pytest.raises(ax.TaskFailed) as failed:
        greedy.submit(512, client=client).result(timeout=30)
    assert failed.value.error_class == "memory_limit"
    assert failed.value.record["attempt"] == 1, "a limit is not retried"
    with pytest.raises(ax.TaskFailed) as failed:
        spinning.submit(5.0, client=client).result(timeout=30)
    assert failed.value.error_class == "cpu_limit"
    assert spinning.submit(0.1, client=client).result(timeout=30) > 0, "the next attempt has its own second"
    assert in_a_child.submit(1, client=client).result(timeout=30)["x"] == 1


def test_a_task_process_killed_from_two_threads_at_once_closes_its_pipe_once():
    """The attempt's hard timeout and the runtime's stop may kill one child at the same
    moment (seen once at stop as EBADF: its pipe closed twice at once, the second time a
    file descriptor that may already belong to something else): it is closed once."""
    import threading

    from ax_scheduler._processes import _Child

    class Pipe:
        def __init__(self) -> None:
            self.closes = 0

        def close(self) -> None:
            self.closes += 1
            time.sleep(0.05)  # a close that takes a while, as under load
            if self.closes > 1:
                raise OSError(9, "Bad file descriptor")

    class Proc:
        def is_alive(self) -> bool:
            return False

        def join(self, timeout: float | None = None) -> None:
            return None

    pipe = Pipe()
    child = _Child(pipe, Proc())
    errors: list[OSError] = []
    both = threading.Barrier(2)

    def kill() -> None:
        both.wait()
        try:
            child.kill()
        except OSError as e:
            errors.append(e)

    threads = [threading.Thread(target=kill) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (pipe.closes, errors) == (1, [])
