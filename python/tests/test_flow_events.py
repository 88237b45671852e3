"""Flows written in Python that wait for an event: ``ax.wait_for_event`` in a flow body,
``publish_event``, and the same on ``ax.testing``'s fake clock."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

import ax_scheduler as ax

Q = "py_flows"


@ax.task(queue=Q)
def order_placed(order: dict) -> dict:
    return {"order": order["id"]}


@ax.task(queue=Q)
def bill(order: dict, payment: dict | None) -> str:
    if payment is None:
        return f"no payment for {order['id']}"
    return f"invoiced {order['id']} for {payment['amount']}"


@ax.flow(name="py_pay")
def pay_flow(order):
    order_placed(order)
    payment = ax.wait_for_event("order.paid", match={"order_id": order["id"]}, timeout=60)
    bill(order, payment)


@ax.flow(name="py_pay_or_not")
def pay_or_not_flow(order):
    payment = ax.wait_for_event("order.paid", match={"order_id": order["id"], "kind": "$card"},
                                timeout=timedelta(hours=1), on_timeout="continue")
    bill(order, payment)


def test_the_definition_waits_after_what_came_before_and_holds_what_follows():
    steps = {s["name"]: s for s in pay_flow.definition()["steps"]}
    wait = steps["wait"]
    assert wait["needs"] == ["order_placed"]
    assert wait["wait_for_event"] == {"event": "order.paid", "match": {"order_id": "$input.id"},
                                      "on_timeout": "fail", "timeout_ms": 60_000}
    assert "wait" in steps["bill"]["needs"], "the event's payload is an argument"
    other = {s["name"]: s for s in pay_or_not_flow.definition()["steps"]}["wait"]["wait_for_event"]
    assert other["match"] == {"order_id": "$input.id", "kind": "$$card"}, "a literal $ is escaped"


def test_a_flow_waits_for_its_event_over_a_broker(runtime, client):
    runtime(order_placed, bill)
    run = pay_flow.trigger({"id": 7}, client=client)
    for _ in range(400):
        view = {s["name"]: s for s in client.flow_run(run)["steps"]}
        if view["wait"].get("waiting"):
            assert view["wait"]["waiting"]["kind"] == "event"
            assert view["wait"]["waiting"]["event"] == "order.paid"
            break
        time.sleep(0.05)
    else:
        pytest.fail("the step was never seen waiting for its event")
    assert client.publish_event("order.paid", {"order_id": 6, "amount": 1}) > 0
    ax.publish_event("order.paid", {"order_id": 7, "amount": 5}, id="pay-7", client=client)
    outputs = client.flow_result(run, timeout=30)
    assert outputs["bill"] == "invoiced 7 for 5"
    assert outputs["wait"] == {"order_id": 7, "amount": 5}, "the wait's output is the event"
    with pytest.raises(ax.InvalidInput):
        client.publish_event("no spaces allowed", {})


def test_events_meet_waits_on_the_fake_clock():
    # The matching event comes two hours in; another order's comes first.
    run = ax.testing.run_flow(pay_flow, {"id": 1}, events=[
        ("order.paid", {"order_id": 2, "amount": 1}),
        ("order.paid", {"order_id": 1, "amount": 9}, timedelta(seconds=30)),
    ])
    assert run.state == "succeeded", run
    assert run.steps["bill"].output == "invoiced 1 for 9"
    # None comes within the 60 s timeout: the step fails, and so does the run.
    run = ax.testing.run_flow(pay_flow, {"id": 1}, events=[("order.paid", {"order_id": 1, "amount": 9}, 120)])
    assert run.state == "failed", run
    assert run.steps["wait"].state == "failed"
    assert run.steps["wait"].error["class"] == "wait_timed_out"
    # `continue`: the step succeeds with None; a literal "$card" must match as it is.
    run = ax.testing.run_flow(pay_or_not_flow, {"id": 3}, events=[
        ("order.paid", {"order_id": 3, "kind": "card", "amount": 1})])
    assert run.steps["bill"].output == "no payment for 3", run
    run = ax.testing.run_flow(pay_or_not_flow, {"id": 3}, events=[
        ("order.paid", {"order_id": 3, "kind": "$card", "amount": 4})])
    assert run.steps["bill"].output == "invoiced 3 for 4", run


def test_waits_that_a_flow_cannot_hold_are_refused(scratch_flows):
    with pytest.raises(ax.FlowDefinitionError, match="flow body"):
        ax.wait_for_event("order.paid")

    @ax.flow(name="py_bad_policy")
    def bad_policy(order):
        order_placed(order)
        ax.wait_for_event("order.paid", on_timeout="retry")

    with pytest.raises(ax.FlowDefinitionError, match="on_timeout"):
        bad_policy.definition()

    @ax.flow(name="py_bad_match")
    def bad_match(order):
        order_placed(order)
        ax.wait_for_event("order.paid", match={"id": order["items"][0]})

    with pytest.raises(ax.FlowDefinitionError, match="field names"):
        bad_match.definition()

    @ax.flow(name="py_bad_timeout")
    def bad_timeout(order):
        ax.wait_for_event("order.paid", timeout=0)
        order_placed(order)

    with pytest.raises(ax.FlowDefinitionError, match="over 0 s"):
        bad_timeout.definition()
