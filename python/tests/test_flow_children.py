"""Flows written in Python that run other flows: calling an ``@ax.flow`` in a flow body
is a child flow step (``child(x)``, ``child.map(xs)``, ``child.child(x, timeout=)``),
stored before its parent, run over a broker and on ``ax.testing``'s fake clock."""

from __future__ import annotations

import pytest

import ax_scheduler as ax

Q = "py_flows"


@ax.task(queue=Q, name="child_lines")
def lines(order: dict) -> list:
    return [{"sku": s, "qty": q} for s, q in order["lines"]]


@ax.task(queue=Q, name="child_price")
def price(line: dict) -> int:
    if line["sku"] == "bad":
        raise ax.NonRetryable("no such sku", error_class="unknown_sku")
    return 3 * line["qty"]


@ax.task(queue=Q, name="child_snooze")
def snooze(seconds: int) -> int:
    return seconds


@ax.task(queue=Q, name="child_total")
def total(priced: list) -> int:
    return sum(p["child_price"] for p in priced)


@ax.flow(name="py_line")
def line_flow(line):
    price(line)


@ax.flow(name="py_order")
def order_flow(order):
    priced = line_flow.map(lines(order))
    total(priced)


@ax.flow(name="py_one_line")
def one_line_flow(order):
    line_flow({"sku": order["sku"], "qty": 2})


@ax.flow(name="py_slow")
def slow_flow(seconds):
    ax.sleep(30)
    snooze(seconds)


@ax.flow(name="py_impatient")
def impatient_flow(seconds):
    slow_flow.child(seconds, timeout=10, on_timeout="continue")


@ax.flow(name="py_patient")
def patient_flow(seconds):
    slow_flow.child(seconds, timeout=60)


@ax.flow(name="py_forever")
def forever_flow(x):
    forever_flow(x)


def test_a_call_of_a_flow_is_a_child_step_and_its_flow_is_stored_first():
    steps = {s["name"]: s for s in order_flow.definition()["steps"]}
    assert steps["py_line"] == {"name": "py_line", "needs": ["child_lines"], "for_each": "child_lines",
                                "child_flow": {"flow": "py_line", "input": "$item", "on_timeout": "fail"}}
    assert "py_line" in steps["child_total"]["needs"]
    one = one_line_flow.definition()["steps"][0]
    assert one["child_flow"]["input"] == {"sku": "$input.sku", "qty": 2}
    timed = impatient_flow.definition()["steps"][0]["child_flow"]
    assert (timed["timeout_ms"], timed["on_timeout"]) == (10_000, "continue")
    assert [f.name for f in order_flow.child_flows()] == ["py_line"]
    with pytest.raises(ax.FlowDefinitionError, match="trigger"):
        line_flow({"sku": "a", "qty": 1})


def test_child_flows_run_over_a_broker(runtime, client):
    runtime(lines, price, total)
    run = order_flow.trigger({"lines": [["a", 1], ["b", 2], ["c", 3]]}, client=client)
    outputs = client.flow_result(run, timeout=30)
    assert outputs["child_total"] == 18
    assert outputs["py_line"] == [{"child_price": 3}, {"child_price": 6}, {"child_price": 9}], "leaves by name"
    run = order_flow.trigger({"lines": [["a", 1], ["bad", 1]]}, client=client)
    with pytest.raises(ax.FlowFailed, match="child_failed"):
        client.flow_result(run, timeout=30)


def test_child_flows_run_on_the_fake_clock():
    run = ax.testing.run_flow(order_flow, {"lines": [["a", 1], ["b", 2]]})
    assert run.state == "succeeded", run
    assert run.steps["child_total"].output == 9
    assert run.steps["py_line"].raw_output == [{"child_price": 3}, {"child_price": 6}]
    run = ax.testing.run_flow(order_flow, {"lines": [["bad", 1]]})
    assert (run.state, run.steps["py_line"].error_class) == ("failed", "child_failed")
    assert "unknown_sku" in run.steps["py_line"].error_message
    # A child slower than the step's timeout: continue passes None on; a quicker one ends it.
    run = ax.testing.run_flow(impatient_flow, 7)
    assert run.state == "succeeded" and run.steps["py_slow"].raw_output is None, run
    assert run.clock is not None and run.clock.now_ms() - ax.testing.FakeClock().now_ms() == 10_000
    run = ax.testing.run_flow(patient_flow, 7)
    assert run.steps["py_slow"].raw_output == {"child_snooze": 7}, run
    assert run.clock is not None and run.clock.now_ms() - ax.testing.FakeClock().now_ms() == 30_000
    # A flow that runs itself ends at the depth limit.
    run = ax.testing.run_flow(forever_flow, 1)
    assert (run.state, run.steps["py_forever"].error_class) == ("failed", "child_failed")
    assert "too_deep" in run.steps["py_forever"].error_message
