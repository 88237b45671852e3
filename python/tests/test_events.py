"""``@ax.on_event`` across replicas, and events as typed objects: one handler call per
alert however many runtimes serve (every replica's on request), the guide's handler
spelling working, and a failing handler logged with its traceback and counted."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Iterator

import pytest

import ax_scheduler as ax
from ax_scheduler import _events
from conftest import eventually

Q = "py_tasks"


@ax.task(queue=Q, retries=0)
def dies(error_class: str) -> None:
    raise type(error_class, (Exception,), {})("it died")  # recorded with this class name


@pytest.fixture
def handlers() -> Iterator[None]:
    """The test's own ``@ax.on_event`` handlers, removed at the end."""
    before = list(_events.HANDLERS)
    yield
    _events.HANDLERS[:] = before


def unique() -> str:
    """An error class no other test raises: alerts are one per (queue, task, class) per
    window, so each test needs its own."""
    return f"Died{uuid.uuid4().hex[:10]}"


def dead_alert(client: ax.Client, error_class: str) -> None:
    with pytest.raises(ax.TaskFailed):
        dies.submit(error_class, client=client).result(timeout=20)


def test_two_runtimes_handle_each_alert_once(runtime, client, handlers):
    cls = unique()
    calls: list[Any] = []

    @ax.on_event
    def page(event: ax.Event) -> None:
        if event.error_class == cls:
            calls.append(event)

    runtime(dies)
    runtime(dies)
    dead_alert(client, cls)
    eventually(lambda: calls, 10, "the alert handled")
    time.sleep(1.0)  # a second replica's call would come now
    assert len(calls) == 1, f"{len(calls)} calls across two runtimes"


def test_every_replica_handlers_run_in_each_runtime(runtime, client, handlers):
    cls = unique()
    calls: list[Any] = []

    @ax.on_event(every_replica=True)
    def cache_bust(event: ax.Event) -> None:
        if event.error_class == cls:
            calls.append(event)

    runtime(dies)
    runtime(dies)
    dead_alert(client, cls)
    eventually(lambda: len(calls) == 2, 10, "both runtimes called the handler")
    time.sleep(0.5)
    assert len(calls) == 2


class AlertApi:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send(self, payload: dict[str, Any]) -> None:
        self.sent.append(payload)


def test_the_guides_handler_spelling_sends_the_alert(runtime, client, handlers):
    cls = unique()
    alert_api = AlertApi()
    seen: list[ax.Event] = []

    @ax.on_event
    def h(event):  # the workflow document's own spelling
        if event.name == "task_failed":
            alert_api.send(event.payload)
            seen.append(event)

    runtime(dies)
    dead_alert(client, cls)
    eventually(lambda: [p for p in alert_api.sent if p["error_class"] == cls], 10, "the alert sent")
    (event,) = [e for e in seen if e.error_class == cls]
    assert (event.kind, event.task_name, event.queue, event.attempts) == ("task_dead", "dies", Q, 1)
    assert event.task_id and event.payload["task"] == event.task_id
    with pytest.raises(TypeError, match="event.task_name"):
        event["name"]  # the task's name or the event's? Refused, loudly


def test_a_failing_handler_is_logged_with_its_traceback_and_counted(runtime, client, handlers, caplog):
    cls = unique()

    @ax.on_event
    def broken(event: ax.Event) -> None:
        if event.error_class == cls:
            raise RuntimeError("a handler bug")

    rt = runtime(dies)
    with caplog.at_level(logging.ERROR, logger="ax_scheduler"):
        dead_alert(client, cls)
        eventually(lambda: rt.event_handler_failures == 1, 10, "the failure counted")
    (record,) = [r for r in caplog.records if "broken" in r.getMessage()]
    assert record.levelno == logging.ERROR and record.exc_info and "a handler bug" in str(record.exc_info[1])
    assert dies.submit(unique(), client=client).wait(timeout=20)["state"] == "dead", "the runtime goes on"


def test_flow_alerts_are_events_too():
    event = ax.Event.from_alert({"kind": "flow_failed", "queue": "flows", "flow": "orders", "run": "r1",
                                 "error_class": "step_failed", "link": None})
    assert (event.name, event.flow, event.run, event.task_name) == ("flow_failed", "orders", "r1", None)
    assert event.payload["run"] == "r1"
