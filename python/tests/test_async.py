"""The awaitable client (issue 38: "an async def FastAPI handler blocks its event loop"):
``ax.AsyncClient``, ``task.submit_async``, ``handle.result_async`` and the rest, against a
real broker and server, with a runtime serving the tasks. Each test drives its own loop
with ``asyncio.run``."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

import ax_scheduler as ax

QUEUE = "py_tasks"


@ax.task(queue=QUEUE)
def double(x: int) -> int:
    return 2 * x


@ax.task(queue=QUEUE)
def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@ax.task(queue=QUEUE)
def pair(a: int, b: int) -> list[int]:
    return [a, b]


@ax.task(queue=QUEUE, retries=0)
def broken(x: int) -> int:
    raise RuntimeError(f"broken {x}")


@ax.flow(name="py_async_flow")
def doubled_pair(n: int) -> None:
    pair(double(n), double(n))


def test_two_thousand_concurrent_submits_and_results(runtime, url):
    runtime(double, max_concurrency=32)

    async def main() -> list[int]:
        async with await ax.AsyncClient.connect(url) as client:
            doubles = double.with_options(client=client)
            started = time.monotonic()
            handles = await asyncio.gather(*(doubles.submit_async(i) for i in range(2_000)))
            submitted = time.monotonic()
            assert len({h.id for h in handles}) == 2_000 and not any(h.duplicate for h in handles)
            halves = await asyncio.gather(*(h.result_async(timeout=120) for h in handles[:1_000]))
            records = await asyncio.gather(*(h.wait_async(timeout=120) for h in handles[1_000:]))
            assert {r["state"] for r in records} == {"succeeded"}
            rest = await asyncio.gather(*(h.result_async(timeout=10) for h in handles[1_000:]))
            print(f"2,000 submit_async at once: {submitted - started:.1f} s; all results {time.monotonic() - started:.1f} s")
            return [*halves, *rest]

    assert asyncio.run(main()) == [2 * i for i in range(2_000)]


def test_ten_thousand_waits_at_once_all_return(runtime, url):
    """Issue 38's 10,000 concurrent waits, from Python: 10,000 result_async on 2,000
    tasks, all in flight before the runtime serving them starts."""

    async def main() -> list[int]:
        async with await ax.AsyncClient.connect(url) as client:
            handles = await client.submit_many(double, range(2_000))
            assert all(isinstance(h, ax.Handle) for h in handles)
            waits = asyncio.gather(*(h.result_async(timeout=120)  # type: ignore[union-attr]
                                     for h in (handles[i % 2_000] for i in range(10_000))))
            await asyncio.sleep(0.5)
            assert not waits.done()
            started = time.monotonic()
            await asyncio.to_thread(runtime, double, max_concurrency=32)
            results = await waits
            print(f"10,000 waits at once on 2,000 tasks: all returned {time.monotonic() - started:.1f} s after the "
                  "runtime started")
            return results

    assert asyncio.run(main()) == [2 * (i % 2_000) for i in range(10_000)]


def test_a_cancelled_await_leaves_the_client_working_and_the_loop_runs_while_waiting(runtime, url):
    runtime(nap, double)

    async def main() -> None:
        async with await ax.AsyncClient.connect(url) as client:
            handle = await nap.with_options(client=client).submit_async(1.5)
            ticks = 0

            async def tick() -> None:
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.05)
                    ticks += 1

            ticker = asyncio.create_task(tick())
            waiting = asyncio.create_task(handle.wait_async(timeout=30))
            await asyncio.sleep(0.2)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(handle.result_async(timeout=30), 0.2)
            assert await handle.result_async(timeout=30) == 1.5
            ticker.cancel()
            assert ticks >= 15, f"the event loop ran on while waiting ({ticks} ticks of 50 ms in ~1.5 s)"
            assert (await handle.get_async() or {})["state"] == "succeeded"
            assert await (await double.with_options(client=client).submit_async(4)).result_async(timeout=30) == 8

    asyncio.run(main())


def test_errors_arrive_typed(runtime, url):
    runtime(broken)

    async def main() -> None:
        async with await ax.AsyncClient.connect(url) as client:
            with pytest.raises(ax.InvalidInput):
                await double.with_options(client=client).submit_async(object())  # type: ignore[arg-type]  # not JSON
            with pytest.raises(ax.InvalidInput):
                await client.submit(pair, [1, 2])  # a list for a function of two parameters
            with pytest.raises(ax.InvalidInput) as e:
                await client.submit("double", 1, queue=QUEUE, run_at="yesterday")  # refused by the server
            assert e.value.field == "run_at"
            with pytest.raises(ax.NotFound):
                await client.cancel(f"{QUEUE}.no-such-task")
            later = await double.with_options(client=client, delay=60).submit_async(1)
            with pytest.raises(ax.TimedOut):
                await later.wait_async(timeout=0.5)
            assert (await later.cancel_async())["state"] == "cancelled"
            with pytest.raises(ax.TaskFailed) as failed:
                await (await broken.submit_async(7, client=client)).result_async(timeout=30)
            assert failed.value.error_class == "RuntimeError"

    asyncio.run(main())


def test_every_client_call_has_an_awaitable_form(runtime, url):
    runtime(double, pair)
    client = ax.Client(url)

    async def main() -> dict[str, Any]:
        aio = client.aio
        assert aio is client.aio and aio.sync is client and aio.url == client.url
        later = await aio.submit(double, 5, delay=60, key="py-async-later")
        assert (await aio.submit(double, 5, delay=60, key="py-async-later")).duplicate
        await aio.run_now(later.id)
        assert await later.result_async(timeout=30) == 10
        assert "succeeded" in [e.get("state") for e in (await aio.history(later.id))["events"]]
        await aio.pause("py_shared", reason="test")
        await aio.resume("py_shared")
        stored = await aio.set_task_options("double", queue=QUEUE, retries=2)
        assert stored["max_attempts"] == 3 and (await aio.task_options("double", queue=QUEUE)) == stored
        assert any(o["name"] == "double" for o in await aio.list_task_options(QUEUE))
        assert await aio.delete_task_options("double", queue=QUEUE)
        assert await aio.task_options("double", queue=QUEUE) is None
        run = await doubled_pair.with_options(client=aio).trigger_async(3)
        assert (await aio.wait_flow(run, timeout=30))["state"] == "succeeded"
        outputs = await aio.flow_result(run, timeout=30)
        assert outputs["pair"] == [6, 6] and (await aio.flow_run(run))["state"] == "succeeded"
        many = await aio.submit_many("double", [1, 2, 3], queue=QUEUE)
        return {"many": [await h.result_async(timeout=30) for h in many if isinstance(h, ax.Handle)],
                "queues": await aio.call("task", "queues")}

    out = asyncio.run(main())
    assert out["many"] == [2, 4, 6] and out["queues"]
    handle = double.submit(21, client=client)  # a sync handle awaits too
    assert asyncio.run(handle.result_async(timeout=30)) == 42
    client.close()


def test_one_thread_keeps_many_submits_in_flight_and_each_handle_is_a_stored_task(runtime, client):
    runtime(echo_nowait)
    started = time.monotonic()
    pending = [echo_nowait.with_options(client=client).submit_nowait(i) for i in range(2_000)]
    sent = time.monotonic() - started
    handles = [p.handle(timeout=30) for p in pending]
    assert all(p.done() for p in pending)
    assert len({h.id for h in handles}) == 2_000
    assert [h.result(timeout=30) for h in handles[:50]] == list(range(50))
    print(f"2,000 submits sent in {sent:.2f} s from one thread, all stored after {time.monotonic() - started:.2f} s")
    refused = client.submit_request_nowait(QUEUE, {"name": "echo_nowait", "payload": 1, "priority": "urgent"})
    with pytest.raises(ax.InvalidInput):
        refused.handle(timeout=10)


@ax.task(queue=QUEUE)
def echo_nowait(x: int) -> int:
    return x
