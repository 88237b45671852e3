"""Flows written in Python that wait for an approval: ``ax.approval`` in a flow body,
``Client.approve`` / ``reject`` with the announced token, and the same on
``ax.testing``'s fake clock."""

from __future__ import annotations

from datetime import timedelta

import pytest

import ax_scheduler as ax

Q = "py_flows"


@ax.task(queue=Q)
def quote(order: dict) -> dict:
    return {"order": order["id"], "amount": order["amount"]}


@ax.task(queue=Q)
def refund(quoted: dict, decision: dict | None) -> str:
    if decision is None:
        return f"no answer for {quoted['order']}"
    return f"refunded {quoted['amount']} by {decision['payload']['by']}"


@ax.flow(name="py_refund")
def refund_flow(order):
    quoted = quote(order)
    decision = ax.approval("Refund this order?", timeout=60)
    refund(quoted, decision)


@ax.flow(name="py_refund_or_not")
def refund_or_not_flow(order):
    quoted = quote(order)
    decision = ax.approval(timeout=timedelta(hours=1), on_timeout="continue")
    refund(quoted, decision)


def test_the_definition_waits_after_what_came_before_and_holds_what_follows():
    steps = {s["name"]: s for s in refund_flow.definition()["steps"]}
    assert steps["approval"]["needs"] == ["quote"]
    assert steps["approval"]["approval"] == {"message": "Refund this order?", "on_timeout": "fail",
                                             "timeout_ms": 60_000}
    assert "approval" in steps["refund"]["needs"], "the decision is an argument"


def test_a_flow_waits_for_its_approval_over_a_broker(runtime, client):
    runtime(quote, refund)
    announced = client.events("ax.events.approval.requested", poll=0.2)
    run = refund_flow.trigger({"id": 7, "amount": 30}, client=client)
    announcement = next(e.raw for e in announced if e.raw.get("run") == run)
    assert announcement["message"] == "Refund this order?"
    waiting = client.approvals()
    assert [a["run"] for a in waiting] == [run]
    assert "token" not in waiting[0]
    with pytest.raises(ax.NotFound):
        client.approve(announcement["token"][:-1] + "x", {"by": "mallory"})
    token = announcement["token"]
    assert client.approve(token, {"by": "ann"})["decision"] == "approved"
    assert client.approve(token, {"by": "bob"})["decision"] == "approved", "again: the same answer"
    with pytest.raises(ax.Conflict):
        client.reject(token, "too late")
    outputs = client.flow_result(run, timeout=30)
    assert outputs["refund"] == "refunded 30 by ann"
    assert client.approvals() == []


def test_approvals_are_decided_on_the_fake_clock():
    run = ax.testing.run_flow(refund_flow, {"id": 1, "amount": 5},
                              approvals={"approval": ("approve", {"by": "ann"}, 30)})
    assert run.state == "succeeded", run
    assert run.steps["refund"].output == "refunded 5 by ann"
    assert run.steps["approval"].output == {"decision": "approved", "payload": {"by": "ann"}}
    run = ax.testing.run_flow(refund_flow, {"id": 1, "amount": 5},
                              approvals={"approval": ("reject", "too much")})
    assert run.state == "failed", run
    assert run.steps["approval"].error["class"] == "approval_rejected"
    assert run.steps["approval"].error["message"] == "too much"
    # Decided after its 60 s timeout, or not at all: it times out.
    run = ax.testing.run_flow(refund_flow, {"id": 1, "amount": 5},
                              approvals={"approval": ("approve", {"by": "ann"}, 120)})
    assert run.steps["approval"].error["class"] == "approval_timed_out", run
    run = ax.testing.run_flow(refund_or_not_flow, {"id": 2, "amount": 5})
    assert run.steps["refund"].output == "no answer for 2", run


def test_approvals_that_a_flow_cannot_hold_are_refused(scratch_flows):
    with pytest.raises(ax.FlowDefinitionError, match="flow body"):
        ax.approval("ok?")

    @ax.flow(name="py_bad_approval_policy")
    def bad_policy(order):
        quote(order)
        ax.approval(on_timeout="retry")

    with pytest.raises(ax.FlowDefinitionError, match="on_timeout"):
        bad_policy.definition()

    @ax.flow(name="py_bad_approval_message")
    def bad_message(order):
        quote(order)
        ax.approval(order["note"])

    with pytest.raises(ax.FlowDefinitionError, match="message"):
        bad_message.definition()
