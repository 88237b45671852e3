"""ax.testing: tasks and flows run in this process (no broker) as ax runs them, compared
with the same tasks and flows run through a real local ax (the ax_local fixture of
ax_scheduler.pytest_plugin, enabled here)."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest

import ax_scheduler as ax
from ax_scheduler import testing
from ax_scheduler._testing_task import EPOCH_MS

pytest_plugins = ["ax_scheduler.pytest_plugin"]

Q = "py_testing"  # declared by ax_local when a runtime needs it, not listed anywhere


@dataclass
class Receipt:
    order: str
    total: int


@ax.task(name="tt_flaky", queue=Q, retries=3, retry_backoff=0.1, retry_backoff_max=0.3)
def flaky(order: str, amount: int) -> Receipt:
    """Fails its first two attempts (by attempt number: the same in every run)."""
    if ax.context().attempt < 3:
        raise ConnectionError(f"gateway down (attempt {ax.context().attempt})")
    return Receipt(order, amount * 2)


def test_a_task_retried_then_succeeding_is_run_as_ax_runs_it(ax_local: testing.LocalAx) -> None:
    fake = testing.run(flaky, "o-1", amount=21)
    assert fake.state == "succeeded" and fake.output == Receipt("o-1", 42), fake
    assert fake.raw_output == {"order": "o-1", "total": 42}
    assert fake.error_classes == ["ConnectionError", "ConnectionError", None]
    assert fake.attempts[0].error_message == "gateway down (attempt 1)"
    assert fake.delays == [0.1, 0.2], "base 0.1 s doubling, un-jittered"
    assert fake.clock is not None and fake.clock.now_ms() == EPOCH_MS + 300, "the delays moved the clock"
    assert [(a.started_at_ms or 0) - EPOCH_MS for a in fake.attempts] == [0, 100, 300]
    # The same task through a broker and a runtime: the same attempts and classes.
    ax_local.runtime(flaky)  # declares the task's queue (listed nowhere) first
    assert Q in ax_local.declared
    real = ax_local.run(flaky, "o-1", amount=21)
    assert (real.state, real.output, real.error_classes) == (fake.state, fake.output, fake.error_classes)
    assert real.max_attempts == fake.max_attempts == 4
    for got, nominal in zip(real.delays, fake.delays):  # ax's 20 % jitter only shortens
        assert nominal * 0.8 - 0.002 <= got <= nominal + 0.002, (real.delays, fake.delays)
    # With a random source the jitter is drawn as ax draws it: shorter, by at most 20 %.
    import random

    jittered = testing.run(flaky, "o-1", amount=21, ax_rng=random.Random(7))
    assert all(n * 0.8 <= d <= n for d, n in zip(jittered.delays, fake.delays)), jittered.delays


class ConfigError(Exception):
    pass


@ax.task(name="tt_permanent", retries=5)
def permanent(kind: str) -> None:
    if kind == "non_retryable":
        try:
            raise KeyError("no such customer")
        except KeyError as e:
            raise ax.NonRetryable("customer gone") from e
    raise ConfigError("bad config")


@ax.task(name="tt_no_retry_config", retries=5, no_retry_on_exception=ConfigError)
def no_retry_config() -> None:
    raise ConfigError("bad config")


def test_non_retryable_failures_stop_at_once() -> None:
    r = testing.run(permanent, "non_retryable")
    assert (r.state, r.error_classes, r.error_message) == ("dead", ["KeyError"], "customer gone")
    assert r.attempts[0].permanent and r.delays == []
    with pytest.raises(ax.TaskFailed) as e:
        r.result()
    assert e.value.error_class == "KeyError"
    assert testing.run(no_retry_config).error_classes == ["ConfigError"]
    retried = testing.run(permanent, "config")
    assert retried.error_classes == ["ConfigError"] * 6 and retried.delays == [1.0, 2.0, 4.0, 8.0, 16.0], \
        "the server's backoff: 1 s doubling"


@ax.task(name="tt_bad_output", retries=3)
def bad_output(n: int) -> object:
    return {"lock": threading.Lock()}


def test_an_unserializable_result_is_bad_output_and_an_argument_is_refused_as_submit_refuses_it() -> None:
    r = testing.run(bad_output, 1)
    assert (r.state, r.error_classes) == ("dead", ["bad_output"]), r
    assert "not JSON" in (r.error_message or "")
    with pytest.raises(ax.InvalidInput):
        testing.run(flaky, threading.Lock(), amount=1)
    with pytest.raises(ax.InvalidInput):
        testing.run(flaky, "o", 1, 2)  # no such call of the function
    with pytest.raises(ax.InvalidInput):
        testing.run(flaky, "o", amount=float("nan"))  # JSON has no NaN


@ax.task(name="tt_context", retries=2, idempotency_key=lambda order: f"order:{order}")
def with_context(order: str) -> dict:
    ctx = ax.context()
    for _ in range(3):
        ax.heartbeat()
    return {"id": ctx.id, "name": ctx.name, "attempt": ctx.attempt, "max_attempts": ctx.max_attempts,
            "key": ctx.idempotency_key, "created_at_ms": ctx.created_at_ms, "token": ctx.fencing_token(),
            "cancelled": ctx.cancelled, "flow": ctx.flow}


@ax.task(name="tt_cancellable", retries=4)
def cancellable(n: int) -> int:
    done = 0
    for _ in range(n):
        ax.heartbeat()
        if ax.context().cancelled:
            break
        done += 1
    return done


def test_context_and_heartbeat_work_inside_a_task() -> None:
    with pytest.raises(ax.AxError):
        ax.heartbeat()  # outside a task, as always
    r = testing.run(with_context, "o-7")
    assert r.output == {"id": "default.test-tt_context", "name": "tt_context", "attempt": 1, "max_attempts": 3,
                        "key": "order:o-7", "created_at_ms": EPOCH_MS, "token": 1, "cancelled": False,
                        "flow": None}
    assert r.heartbeats == 3 and r.attempts[0].heartbeats == 3
    assert testing.run(with_context, "o-7", ax_id="default.mine", ax_key="k").output["id"] == "default.mine"
    # An operator's cancel: the context says so, the attempt ends cancelled, no retry.
    c = testing.run(cancellable, 10, ax_cancel_after=2)
    assert (c.state, c.error_classes, len(c.attempts)) == ("cancelled", ["cancelled"], 1), c
    # The function alone, in a context of its own (a unit test of its body).
    with testing.task_context(with_context, attempt=2) as ctx:
        assert with_context.fn("o-8")["attempt"] == 2
        assert ctx._core.heartbeats == 3


@ax.task(name="tt_slow_async", timeout=0.2, retries=1, retry_backoff=0.1)
async def slow_async() -> int:
    await asyncio.sleep(5)
    return 1


@ax.task(name="tt_slow_sync", timeout=0.1, retries=0)
def slow_sync() -> int:
    time.sleep(0.2)
    return 1


@ax.task(name="tt_stalls", heartbeat_timeout=0.1, retries=0)
async def stalls() -> int:
    ax.heartbeat()
    await asyncio.sleep(0.02)
    ax.heartbeat()
    await asyncio.sleep(5)
    return 1


def test_an_async_task_past_its_timeout_is_cancelled_and_a_sync_one_reported() -> None:
    started = time.monotonic()
    r = testing.run(slow_async)
    assert (r.state, r.error_classes) == ("dead", ["timeout", "timeout"]), r
    assert r.error_message == "attempt exceeded its 200 ms timeout"
    assert time.monotonic() - started < 2, "cancelled at its timeout, not after its 5 s sleep"
    s = testing.run(slow_sync)
    assert (s.state, s.error_classes) == ("dead", ["timeout"]), "its late result is refused"
    h = testing.run(stalls)
    assert (h.state, h.error_classes, h.heartbeats) == ("dead", ["heartbeat_timeout"], 2), h
    assert h.error_message == "no heartbeat for 100 ms (its heartbeat_timeout); 2 heartbeats before"

    async def from_a_coroutine() -> tuple[testing.Result, testing.Result]:
        with pytest.raises(RuntimeError, match="run_async"):
            testing.run(slow_async)  # a loop runs in this thread
        return await testing.run_async(slow_async), await testing.run_async(flaky, "o", amount=1)

    a, b = asyncio.run(from_a_coroutine())
    assert a.error_classes == ["timeout", "timeout"] and b.output == Receipt("o", 2)


# -- flows ----------------------------------------------------------------------------------


@ax.task(name="tt_list_orders", queue=Q)
def list_orders(event: dict) -> list:
    return [f"o-{k}" for k in range(event["n"])]


@ax.task(name="tt_price", queue=Q)
async def price(order: str, rate: int) -> dict:
    await asyncio.sleep(0)
    return {"order": order, "cents": int(order[2:]) * rate}


@ax.task(name="tt_notify", queue=Q, retries=1, retry_backoff=0.05, on_failure="notify_only")
def notify(prices: list) -> None:
    raise ConnectionError("SMTP relay down")


@ax.task(name="tt_total", queue=Q)
def total(prices: list, notified: dict | None, event: dict) -> dict:
    return {"total": sum(p["cents"] for p in prices), "notified": notified, "by": event["by"]}


@ax.flow(name="tt_orders")
def orders_flow(event: dict):
    orders = list_orders(event)
    prices = price.map(orders, rate=event["rate"])  # fan-out
    notified = notify(prices)  # fails, notify_only
    total(prices, notified, event)  # gather of the fan-out and of the failed step


def test_a_flow_runs_in_process_as_through_a_real_runtime(ax_local: testing.LocalAx) -> None:
    event = {"n": 3, "rate": 10, "by": "test"}
    fake = testing.run_flow(orders_flow, event)
    assert fake.states == {"tt_list_orders": "succeeded", "tt_price": "succeeded", "tt_notify": "failed",
                           "tt_total": "succeeded"}
    assert (fake.state, fake.reason) == ("succeeded", "no step failed (1 skipped or cancelled)")
    assert fake.outputs["tt_price"] == [{"order": "o-0", "cents": 0}, {"order": "o-1", "cents": 10},
                                        {"order": "o-2", "cents": 20}]
    assert fake.outputs["tt_total"] == {"total": 30, "notified": None, "by": "test"}
    notify_step = fake.steps["tt_notify"]
    assert (notify_step.error_class, notify_step.attempts) == ("ConnectionError", 2)
    assert fake.steps["tt_price"].items == 3
    assert fake.steps["tt_price"].tasks[2].id == f"{Q}.fl.test-run.tt_price.0.2"
    # The same flow through a broker, the server's flow engine and a runtime.
    ax_local.runtime(list_orders, price, notify, total)
    real = ax_local.run_flow(orders_flow, event, timeout=60)
    assert (real.state, real.reason) == (fake.state, fake.reason)
    assert real.states == fake.states
    assert real.outputs == fake.outputs
    for name, step in fake.steps.items():
        other = real.steps[name]
        assert (other.items, other.attempts, other.error_class) == (step.items, step.attempts, step.error_class), name


@ax.task(name="tt_fails", queue=Q, retries=0)
def fails(event: dict) -> int:
    raise ValueError("no stock")


@ax.task(name="tt_after", queue=Q)
def after(x: int) -> int:
    return x


@ax.task(name="tt_slow_retry", queue=Q, retries=2, retry_backoff=30)
def slow_retry(event: dict) -> int:
    raise ConnectionError("retry later")


@ax.flow(name="tt_fail_fast")
def fail_fast_flow(event: dict):
    after(fails(event))
    slow_retry(event)


def test_fail_fast_ends_the_run_failed_and_cancels_a_task_waiting_for_its_retry() -> None:
    r = testing.run_flow(fail_fast_flow, {})
    assert r.state == "failed" and r.reason == 'step "tt_fails" failed: ValueError: no stock', r.reason
    assert r.states == {"tt_fails": "failed", "tt_after": "upstream_failed", "tt_slow_retry": "cancelled"}
    assert r.steps["tt_slow_retry"].tasks[0].state == "cancelled"
    assert r.steps["tt_slow_retry"].error_message == "1 task(s) cancelled"
    with pytest.raises(ax.FlowFailed):
        r.result()
    # A stub in place of a step's task.
    stubbed = testing.run_flow(fail_fast_flow, {}, replace={"tt_fails": lambda event: 7,
                                                            "tt_slow_retry": lambda event: 0})
    assert stubbed.state == "succeeded" and stubbed.outputs["tt_after"] == 7
    assert asyncio.run(testing.run_flow_async(orders_flow, {"n": 1, "rate": 1, "by": "x"})).outputs["tt_total"][
        "total"] == 0


def test_what_the_test_mode_does_not_model_is_refused_by_name() -> None:
    definition: dict[str, Any] = {"name": "tt_raw", "steps": [{"name": "a", "task": {"name": "tt_rust_only",
                                                                                    "queue": Q}}]}
    with pytest.raises(NotImplementedError, match="tt_rust_only"):
        testing.run_flow(definition, None)
    definition["steps"][0]["task"] = {"name": "tt_after", "queue": Q, "limit_key": "k"}
    with pytest.raises(NotImplementedError, match="limit_key"):
        testing.run_flow(definition, None)
    definition["steps"][0]["task"] = {"name": "tt_after", "queue": Q, "delay_ms": 5}
    with pytest.raises(ax.FlowDefinitionError):
        testing.run_flow(definition, None)
    looped = {"name": "tt_loop", "steps": [{"name": "a", "needs": ["b"], "task": {"name": "tt_after", "queue": Q}},
                                           {"name": "b", "needs": ["a"], "task": {"name": "tt_after", "queue": Q}}]}
    with pytest.raises(ax.FlowDefinitionError, match="cycle"):
        testing.run_flow(looped, None)
