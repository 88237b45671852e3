"""The runtime keeps serving whatever a task does (issue 38): a sync function blocked past
its hard timeout keeps its thread but not its slot, and the runtime starts another thread
so later attempts start at once; a task raising ``SystemExit`` (or another
``BaseException``) fails that attempt and nothing else."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

import ax_scheduler as ax
from conftest import eventually

# Its own queue: tasks other tests leave on py_tasks (names this runtime does not serve)
# would be fetched, handed back and fetched again beside the attempts it times.
Q = "py_capacity"
RELEASE = threading.Event()


@ax.task(queue=Q, timeout=1, retries=0)
def blocks(seconds: float) -> str:
    RELEASE.wait(seconds)  # cannot be interrupted by the runtime
    return "late"


@ax.task(queue=Q, retries=0)
def quick(x: int) -> int:
    return x


def test_threads_stuck_past_their_timeout_do_not_starve_later_tasks(runtime, client):
    RELEASE.clear()
    rt = runtime(blocks, quick, max_concurrency=2)
    stuck = [blocks.submit(15, client=client) for _ in range(2)]
    for h in stuck:
        with pytest.raises(ax.TaskFailed) as failed:
            h.result(timeout=10)
        assert failed.value.error_class == "timeout"
    started = time.monotonic()
    quick_ones = [quick.submit(i, client=client) for i in range(6)]
    assert [h.result(timeout=8) for h in quick_ones] == list(range(6))
    took = time.monotonic() - started
    assert took < 8, f"the quick tasks waited {took:.1f} s behind the stuck threads"
    # The keeper looks every 50 ms: the second abandoned attempt may be seen a tick later.
    eventually(lambda: rt._executors.stuck_threads == 2, 2, "both stuck threads counted")
    assert rt._executors.threads_replaced == 2
    RELEASE.set()  # the stuck functions return: their threads end, the count drops
    deadline = time.monotonic() + 5
    while rt._executors.stuck_threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rt._executors.stuck_threads == 0
    assert [quick.submit(i, client=client).result(timeout=10) for i in range(3)] == [0, 1, 2]


@ax.task(queue=Q, retries=3)
def exits(kind: str) -> str:
    raise {"exit": SystemExit(3), "interrupt": KeyboardInterrupt(), "generator": GeneratorExit()}[kind]


@ax.task(queue=Q, retries=3, timeout=5)
async def exits_async(kind: str) -> str:
    await asyncio.sleep(0)
    raise {"exit": SystemExit(3), "interrupt": KeyboardInterrupt()}[kind]


@ax.task(queue=Q, retries=0, timeout=5)
async def quick_async(x: int) -> int:
    await asyncio.sleep(0.01)
    return x


@pytest.mark.parametrize("kind,cls", [("exit", "SystemExit"), ("interrupt", "KeyboardInterrupt"),
                                      ("generator", "GeneratorExit")])
def test_a_base_exception_fails_its_attempt_and_the_thread_serves_on(runtime, client, kind, cls):
    runtime(exits, quick, max_concurrency=1)  # one thread: had it died, nothing would run
    with pytest.raises(ax.TaskFailed) as failed:
        exits.submit(kind, client=client).result(timeout=15)
    assert failed.value.error_class == cls
    assert failed.value.record["attempt"] == 1, "not retried unless retry_on_exception names it"
    assert [quick.submit(i, client=client).result(timeout=10) for i in range(5)] == list(range(5))


@pytest.mark.parametrize("kind,cls", [("exit", "SystemExit"), ("interrupt", "KeyboardInterrupt")])
def test_a_base_exception_in_an_async_task_leaves_the_event_loop_running(runtime, client, kind, cls):
    runtime(exits_async, quick_async)
    with pytest.raises(ax.TaskFailed) as failed:
        exits_async.submit(kind, client=client).result(timeout=15)
    assert failed.value.error_class == cls
    started = time.monotonic()
    assert [quick_async.submit(i, client=client).result(timeout=10) for i in range(5)] == list(range(5))
    assert time.monotonic() - started < 4, "later async attempts ran at once, not after their timeouts"


class _SlowHandler(logging.Handler):
    """A slow log handler (a remote sink): the attempt's end line takes 120 ms."""

    def emit(self, record: logging.LogRecord) -> None:
        time.sleep(0.12)


def test_attempts_that_end_normally_replace_no_thread(runtime, client):
    # Between an attempt's end (the worker stops waiting then) and its thread taking the
    # next one, the runtime logs the end: a slow handler there must not make the thread
    # look stuck in an abandoned attempt.
    logger = logging.getLogger("ax_scheduler.task.quick")
    slow, level = _SlowHandler(), logger.level
    logger.addHandler(slow)
    logger.setLevel(logging.INFO)
    try:
        rt = runtime(quick, max_concurrency=4)
        handles = client.submit_many(quick, range(40))
        assert [h.result(timeout=60) for h in handles if isinstance(h, ax.Handle)] == list(range(40))
    finally:
        logger.removeHandler(slow)
        logger.setLevel(level)
    assert rt._executors.threads_replaced == 0, "a thread was taken for stuck after its attempt ended"
