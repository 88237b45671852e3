"""Waiting for results at a web service's scale: a wait holds no consumer on the broker,
so thousands of them in a row or at once all work (issue 38: a KV watch per wait left an
ordered consumer for ~30 s; 1,500 waits in a row failed 553 times with "maximum consumers
limit reached")."""

from __future__ import annotations

import concurrent.futures

import ax_scheduler as ax

QUEUE = "py_tasks"


@ax.task(queue=QUEUE)
def echo(x: int) -> int:
    return x


def test_fifteen_hundred_waits_in_a_row_all_return(runtime, client):
    runtime(echo)
    handles = [echo.submit(i) for i in range(50)]
    assert [h.result(timeout=30) for h in handles] == list(range(50))
    failures = []
    for i in range(1_500):
        try:
            assert handles[i % 50].wait(timeout=10)["state"] == "succeeded"
        except ax.AxError as e:
            failures.append(e)
    assert not failures, f"{len(failures)} waits failed, the first: {failures[0]}"


def test_a_thousand_waits_at_once_from_threads_all_return(runtime, client):
    handles = [client.submit(echo, i) for i in range(200)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=1_000) as pool:
        waits = [pool.submit(handles[i % 200].result, 60) for i in range(1_000)]
        runtime(echo)
        results = [w.result(timeout=90) for w in waits]
    assert results == [i % 200 for i in range(1_000)]
