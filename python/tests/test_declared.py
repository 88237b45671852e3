"""What a decorator declares beyond the task: rate limits, schedules, event handlers."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import ax_scheduler as ax
from ax_scheduler import _events, _schedule

Q = "py_tasks"
STARTS: list[float] = []


@ax.task(queue=Q, rate_limit="2/s")
def throttled(i: int) -> int:
    STARTS.append(time.monotonic())
    return i


def test_a_rate_limit_is_stored_as_an_ax_limit_every_worker_applies(runtime, client):
    runtime(throttled)
    stored = client.call("limit", "get", {"queue": Q, "name": "task-throttled"})
    assert (stored["task"], stored["rate"]) == ("throttled", 2.0)
    STARTS.clear()
    handles = client.submit_many(throttled, range(6), queue=Q)
    for h in handles:
        h.wait(timeout=30)
    span = max(STARTS) - min(STARTS)
    # burst 2 (the rate rounded up), then 2 a second: six starts need two seconds.
    assert span >= 1.9, f"6 starts in {span:.2f} s under 2/s"
    with pytest.raises(ax.InvalidInput) as e:
        ax.task(name="too_fast", rate_limit="1e9/s")(lambda x: x)
    assert e.value.field == "rate_limit"


RUNS: list[str] = []


@ax.task(queue=Q)
def every_second(payload: dict) -> None:
    RUNS.append(payload["from"])


@ax.task(queue=Q, cron="0 2 * * *", tz="Asia/Shanghai", schedule_payload={"day": "yesterday"})
def nightly(payload: dict) -> None:
    pass


def test_schedules_become_triggers_when_the_runtime_starts(runtime, client):
    ax.schedule(every_second, every=1, payload={"from": "schedule"}, name="py-every-second")
    try:
        runtime(every_second, nightly)
        stored = client.call("trigger", "get", {"name": "nightly"})
        definition = stored["definition"]
        assert (definition["kind"], definition["expr"], definition["tz"]) == ("cron", "0 2 * * *", "Asia/Shanghai")
        RUNS.clear()
        deadline = time.monotonic() + 10
        while len(RUNS) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert RUNS[:2] == ["schedule", "schedule"], RUNS
    finally:
        del _schedule.SCHEDULES["py-every-second"]
        client.call("trigger", "delete", {"name": "py-every-second"})


@ax.task(queue=Q, retries=0)
def always_fails(x: int) -> None:
    raise LookupError(f"no record {x}")


def test_event_handlers_get_the_alerts_and_their_own_failures_touch_nothing(runtime, client):
    seen: list[ax.Event] = []

    def broken(event):
        raise RuntimeError("a handler bug")

    def keep(event):
        seen.append(event)

    async def first_alert():
        async for event in ax.events(client=client):
            return event

    streamed: list[ax.Event] = []
    listener = threading.Thread(target=lambda: streamed.append(asyncio.run(first_alert())), daemon=True)
    _events.HANDLERS.clear()
    ax.on_event(broken)
    ax.on_event(keep)
    try:
        runtime(always_fails)
        listener.start()
        time.sleep(0.5)  # the async iterator subscribes on its first step
        handle = always_fails.submit(7, client=client)
        with pytest.raises(ax.TaskFailed):
            handle.result(timeout=20)
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.05)
        assert seen and seen[0].kind == "task_dead" and seen[0].task_id == handle.id, seen
        assert seen[0].error_class == "LookupError"
        listener.join(10)
        assert streamed and streamed[0].task_id == handle.id, "ax.events() yields the same alert"
        assert always_fails.submit(8, client=client).wait(timeout=20)["state"] == "dead", "tasks go on"
    finally:
        _events.HANDLERS.clear()
