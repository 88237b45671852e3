"""Flows written in Python: the write-up's order flow, fan-out / fan-in, notify_only, and
flow bodies that a flow cannot express."""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from datetime import datetime, timedelta

import pytest

import ax_scheduler as ax
from conftest import REPO

Q = "py_flows"


def load_example():
    spec = importlib.util.spec_from_file_location("order_flow", REPO / "examples" / "python" / "order_flow.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_order_flow_runs_end_to_end_with_each_output_passed_on(runtime, client):
    ex = load_example()
    definition = ex.order_payment_flow.definition()
    steps = {s["name"]: s for s in definition["steps"]}
    assert steps["create_invoice"]["needs"] == ["parse_payment"]
    assert steps["send_notification"]["needs"] == ["parse_payment", "create_invoice"], "a gather"
    assert steps["send_notification"]["on_failure"] == "notify_only"
    runtime(ex.parse_payment, ex.create_invoice, ex.send_notification)
    run = client.trigger_flow(ex.order_payment_flow, {"payment_id": "pay_001", "amount": 42.0})
    outputs = client.flow_result(run, timeout=30)
    assert outputs == {
        "parse_payment": {"payment_id": "pay_001", "amount": 42.0, "currency": "EUR"},
        "create_invoice": {"invoice_id": "inv_pay_001", "amount": 42.0},
        "send_notification": {"sent": True, "text": "payment pay_001: invoice inv_pay_001"},
    }
    found = client.flow_run(run)
    assert found["state"] == "succeeded" and found["flow"] == "order_payment_flow"


@ax.task(queue=Q)
def list_numbers(event: dict) -> list:
    return list(range(event["n"]))


@ax.task(queue=Q)
def square(x: int, offset: int) -> int:
    return x * x + offset


@ax.task(queue=Q)
def total(values: list, label: str) -> dict:
    return {label: sum(values)}


@ax.flow(name="py_fan")
def fan(event):
    numbers = list_numbers(event)
    squares = square.map(numbers, offset=event["offset"])
    total(squares, label="sum")


def test_map_fans_out_and_a_later_call_fans_in(runtime, client):
    runtime(list_numbers, square, total)
    run = fan.trigger({"n": 5, "offset": 1}, client=client)
    outputs = client.flow_result(run, timeout=30)
    assert outputs["total"] == {"sum": sum(x * x + 1 for x in range(5))}
    assert outputs["square"] == [x * x + 1 for x in range(5)], "a fan-out's output is its items', in order"
    steps = {s["name"]: s for s in client.flow_run(run)["steps"]}
    assert steps["square"]["items"] == 5


SEEN: list = []


@ax.task(queue=Q)
def charge(order: dict) -> dict:
    return {"charged": order["amount"]}


@ax.task(queue=Q, retries=0, on_failure="notify_only")
def notify(order: dict, receipt: dict) -> None:
    raise ConnectionError("SMTP relay down")


@ax.task(queue=Q)
def archive(receipt: dict, notified: dict) -> str:
    SEEN.append(notified)
    return "archived"


@ax.flow(name="py_notify_only")
def notify_only_flow(order):
    receipt = charge(order)
    notified = notify(order, receipt)
    archive(receipt, notified)


def test_a_notify_only_step_alerts_and_neither_blocks_nor_fails_the_run(runtime, client):
    runtime(charge, notify, archive)
    alerts: list = []
    events = client.events(f"ax.events.alert.{Q}", poll=0.2)
    threading.Thread(target=lambda: alerts.extend([next(events)]), daemon=True).start()
    SEEN.clear()
    run = notify_only_flow.trigger({"amount": 5}, client=client)
    ended = client.wait_flow(run, timeout=30)
    assert ended["state"] == "succeeded", ended
    steps = {s["name"]: s for s in client.flow_run(run)["steps"]}
    assert steps["notify"]["state"] == "failed"
    assert steps["notify"]["error"]["class"] == "ConnectionError"
    assert steps["archive"]["state"] == "succeeded"
    assert SEEN == [None], "the failed step's dependant gets None for its output"
    for _ in range(100):
        if alerts:
            break
        threading.Event().wait(0.1)
    assert alerts and alerts[0].kind == "task_dead" and alerts[0].task_name == "notify", alerts


def plain_helper(event):
    return event["payment_id"].upper()


def test_a_flow_body_that_works_on_run_values_outside_a_task_is_refused(client, scratch_flows):
    @ax.flow(name="py_bad_flow")
    def bad(event):
        payment = plain_helper(event)  # indexing is fine, .upper() is not
        charge(payment)

    with pytest.raises(ax.FlowDefinitionError) as e:
        client.trigger_flow(bad, {"payment_id": "p"})
    assert "attribute .upper" in str(e.value)
    with pytest.raises(ax.NotFound):
        client.call("flow", "def", {"name": "py_bad_flow"})  # nothing stored

    @ax.flow(name="py_bad_flow2")
    def branches(event):
        if event["vip"]:
            charge(event)

    with pytest.raises(ax.FlowDefinitionError, match="truth test"):
        branches.definition()

    @ax.flow(name="py_empty_flow")
    def empty(event):
        return event

    with pytest.raises(ax.FlowDefinitionError, match="calls no @ax.task"):
        empty.definition()


def test_a_step_definition_is_the_protocols_json(client):
    definition = fan.definition()
    assert json.loads(json.dumps(definition)) == definition
    by = {s["name"]: s for s in definition["steps"]}
    assert by["square"]["for_each"] == "list_numbers"
    assert by["square"]["task"]["payload"] == {
        "ax_args": {"x": {"from": "item"}, "offset": {"from": "input", "path": ["offset"]}}}
    assert client.put_flow(fan)["name"] == "py_fan"


@ax.task(queue=Q)
def sync_step(account: str) -> str:
    return account


@ax.flow(name="py_sync", singleton=lambda event: event["account"])
def sync_flow(event):
    sync_step(event["account"])


def test_a_singleton_flow_is_refused_while_a_run_of_its_key_runs(runtime, client):
    # No worker yet: the first run waits on its step and holds its key; a second start of
    # the key is refused naming it, another key is not.
    first = sync_flow.with_options(client=client).trigger({"account": "acme"})
    with pytest.raises(ax.Conflict) as e:
        sync_flow.with_options(client=client).trigger({"account": "acme"})
    assert (e.value.code, e.value.run_id) == ("running", first), e.value
    other = sync_flow.with_options(client=client).trigger({"account": "globex"})
    runtime(sync_step)
    assert client.flow_result(first, timeout=30) == {"sync_step": "acme"}
    assert client.flow_result(other, timeout=30) == {"sync_step": "globex"}
    # Its run ended: the key is free.
    again = sync_flow.with_options(client=client).trigger({"account": "acme"})
    assert client.flow_result(again, timeout=30) == {"sync_step": "acme"}
    for bad in ({"singleton": "a b"}, {"singleton": 7}, {"singleton": "k", "on_collision": "queue"},
                {"on_collision": "cancel_in_progress"}):
        with pytest.raises(ax.InvalidInput) as e:
            ax.flow(name="bad_singleton", **bad)(lambda: None)


WOKE: list = []


@ax.task(queue=Q)
def ordered(order: dict) -> dict:
    return {"order": order["id"]}


@ax.task(queue=Q)
def remind(order: dict, placed: dict) -> str:
    WOKE.append(time.time() * 1000)
    return f"reminded {placed['order']}"


@ax.flow(name="py_sleep")
def sleep_flow(order):
    placed = ordered(order)
    ax.sleep(1.5)
    remind(order, placed)


@ax.flow(name="py_sleep_days")
def sleep_days_flow(order):
    placed = ordered(order)
    ax.sleep(timedelta(days=3))
    remind(order, placed)


def test_a_sleep_in_a_flow_body_holds_what_follows_until_it_ends(runtime, client):
    steps = {s["name"]: s for s in sleep_flow.definition()["steps"]}
    assert steps["sleep"]["needs"] == ["ordered"], "the sleep follows the steps before it"
    assert "sleep" in steps["remind"]["needs"], "what follows the sleep waits for it"
    runtime(ordered, remind)
    WOKE.clear()
    run = sleep_flow.trigger({"id": 7}, client=client)
    until = None
    for _ in range(200):
        view = {s["name"]: s for s in client.flow_run(run)["steps"]}
        if view["sleep"].get("waiting"):
            until = view["sleep"]["waiting"]["until_ms"]
            assert view["sleep"]["waiting"]["kind"] == "sleep"
            assert view["remind"]["state"] == "waiting"
            break
        time.sleep(0.05)
    assert until is not None, "the step was seen sleeping"
    outputs = client.flow_result(run, timeout=30)
    assert outputs["remind"] == "reminded 7"
    assert outputs["sleep"] is None, "a sleep's output is None"
    assert WOKE and WOKE[0] >= until, f"remind ran {until - WOKE[0]:.0f} ms before the sleep ended"


def test_a_sleep_of_days_passes_on_the_fake_clock_at_once():
    started = time.monotonic()
    run = ax.testing.run_flow(sleep_days_flow, {"id": 1})
    assert time.monotonic() - started < 5
    assert run.state == "succeeded", run
    assert run.steps["sleep"].state == "succeeded" and run.steps["sleep"].output is None
    assert run.steps["remind"].output == "reminded 1"


def test_a_sleep_outside_a_flow_body_or_of_no_time_is_refused(scratch_flows):
    with pytest.raises(ax.FlowDefinitionError, match="flow body"):
        ax.sleep(1)

    @ax.flow(name="py_bad_sleep")
    def bad(order):
        ordered(order)
        ax.sleep(0)

    with pytest.raises(ax.FlowDefinitionError, match="over 0 s"):
        bad.definition()

    @ax.flow(name="py_naive_sleep")
    def naive(order):
        ordered(order)
        ax.sleep(until=datetime(2030, 1, 1))

    with pytest.raises(ax.FlowDefinitionError, match="aware"):
        naive.definition()
