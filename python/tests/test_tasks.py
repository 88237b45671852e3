"""Tasks through the Python runtime on ax's Rust worker: results, retries by exception
class, hard timeouts, the GIL, bad input."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import pytest

import ax_scheduler as ax
from conftest import ACK_WAIT

Q = "py_tasks"


@dataclass
class Payment:
    payment_id: str
    amount: float


@dataclass
class Invoice:
    invoice_id: str
    amount: float


@ax.task(queue=Q)
def make_invoice(payment: Payment) -> Invoice:
    assert isinstance(payment, Payment), type(payment)  # typed back on the way in
    return Invoice(f"inv_{payment.payment_id}", payment.amount)


@ax.task(queue=Q)
async def add(a: int, b: int) -> int:
    await asyncio.sleep(0.01)
    return a + b


def test_a_sync_task_round_trips_typed_values(runtime, client):
    runtime(make_invoice)
    handle = make_invoice.submit(Payment("pay_1", 12.5), client=client)
    result = handle.result(timeout=20)
    assert result == Invoice("inv_pay_1", 12.5)
    record = client.get(handle.id)
    assert (record["state"], record["attempt"]) == ("succeeded", 1)


def test_an_async_task_takes_arguments_by_name(runtime, client):
    runtime(add)
    assert add.submit(2, b=40, client=client).result(timeout=20) == 42
    # A producer that is not Python sends the same payload: an object by name.
    assert client.submit("add", {"a": 1, "b": 2}, queue=Q).result(timeout=20) == 3


class InvoiceApiError(Exception):
    pass


class ConfigError(Exception):
    pass


FLAKY: list[int] = []


@ax.task(queue=Q, retries=3, retry_backoff=0.1, retry_on_exception=(InvoiceApiError, TimeoutError),
         no_retry_on_exception=(ConfigError,))
def flaky_invoice(step: str) -> str:
    FLAKY.append(ax.context().attempt)
    if ax.context().attempt == 1:
        raise InvoiceApiError("502 from the invoice API")
    if step == "then_config":
        raise ConfigError("no tax rate configured")
    return "ok"


def test_retryable_then_non_retryable_exceptions(runtime, client):
    runtime(flaky_invoice)
    FLAKY.clear()
    handle = flaky_invoice.submit("then_config", client=client)
    with pytest.raises(ax.TaskFailed) as failed:
        handle.result(timeout=20)
    record = failed.value.record
    assert record["state"] == "dead"
    assert record["attempt"] == 2, "one retry (retryable class), then no retry (non-retryable class)"
    assert record["last_error"]["class"] == "ConfigError"
    assert "no tax rate" in record["last_error"]["message"]
    assert "Traceback" in record["last_error"]["detail"]
    assert FLAKY == [1, 2]
    history = [e["state"] for e in client.history(handle.id)["events"] if "state" in e]
    assert "retrying" in history, history
    # Retryable once, then success.
    FLAKY.clear()
    assert flaky_invoice.submit("then_ok", client=client).result(timeout=20) == "ok"
    assert FLAKY == [1, 2]


@ax.task(queue=Q, retries=0, retry_on_exception=(InvoiceApiError,))
def unlisted(x: int) -> None:
    raise KeyError("not in the retry list")


def test_an_exception_outside_retry_on_is_not_retried(runtime, client):
    runtime(unlisted)
    with pytest.raises(ax.TaskFailed) as failed:
        unlisted.submit(1, client=client).result(timeout=20)
    assert failed.value.error_class == "KeyError"
    assert failed.value.record["attempt"] == 1


LATE: list[str] = []


@ax.task(queue=Q, timeout=1, retries=0)
def blocks_past_its_timeout(seconds: float) -> str:
    time.sleep(seconds)  # cannot be interrupted
    LATE.append(ax.context().id)
    return "too late"


def test_a_sync_task_blocking_past_its_timeout_fails_and_its_late_result_is_refused(runtime, client):
    runtime(blocks_past_its_timeout)
    LATE.clear()
    handle = blocks_past_its_timeout.submit(3.0, client=client)
    with pytest.raises(ax.TaskFailed) as failed:
        handle.result(timeout=20)
    assert failed.value.error_class == "timeout"
    started = time.monotonic()
    while not LATE and time.monotonic() - started < 10:
        time.sleep(0.05)
    assert LATE == [handle.id], "the function ran to its end"
    time.sleep(0.3)
    record = client.get(handle.id)
    assert record["state"] == "dead" and record.get("output") is None, "its late result was refused"


GIL_RUNS: list[tuple[int, float]] = []


@ax.task(queue="py_gil", timeout=60, retries=2)
def hold_the_gil(n: int) -> int:
    started = time.monotonic()
    total = sum(range(n))  # one C call: the GIL is not released until it returns
    GIL_RUNS.append((ax.context().attempt, time.monotonic() - started))
    return total


def test_a_task_holding_the_gil_past_the_ack_wait_runs_once(runtime, client):
    n = 2_000_000
    started = time.perf_counter()
    sum(range(n))
    per = (time.perf_counter() - started) / n
    n = int(4 * ACK_WAIT / per)  # about four ack waits with the GIL held
    runtime(hold_the_gil)
    GIL_RUNS.clear()
    handle = hold_the_gil.submit(n, client=client)
    assert handle.result(timeout=120) == n * (n - 1) // 2
    (attempt, held), = GIL_RUNS
    assert held > 1.5 * ACK_WAIT, f"the call held the GIL {held:.1f} s, not well past the ack wait"
    record = client.get(handle.id)
    assert record["attempt"] == attempt == 1, "no redelivery: heartbeats went on without the GIL"


@ax.task(queue=Q)
def returns_a_lock(x: int):
    return threading.Lock()


def test_an_unserializable_return_value_fails_the_task_clearly(runtime, client):
    runtime(returns_a_lock)
    with pytest.raises(ax.TaskFailed) as failed:
        returns_a_lock.submit(1, client=client).result(timeout=20)
    assert failed.value.error_class == "bad_output"
    assert "lock" in failed.value.record["last_error"]["message"]
    assert failed.value.record["attempt"] == 1, "not retried: it would fail again"


def test_bad_options_and_arguments_are_refused_before_anything_is_stored(client):
    with pytest.raises(TypeError):
        ax.task(retry_count=3)  # an unknown option
    with pytest.raises(ax.InvalidInput) as e:
        ax.task(name="nan_timeout", timeout=float("nan"))(lambda x: x)
    assert e.value.field == "timeout"
    with pytest.raises(ax.InvalidInput) as e:
        ax.task(name="urgent", priority="urgent")(lambda x: x)
    assert e.value.field == "priority"
    with pytest.raises(ax.InvalidInput):
        make_invoice.submit(Payment("p", 1.0), delay=float("inf"), client=client)
    with pytest.raises(ax.InvalidInput):
        make_invoice.submit(object(), client=client)  # not JSON
    with pytest.raises(ax.InvalidInput):
        add.submit(1, 2, 3, client=client)  # three arguments for two parameters
    with pytest.raises(ax.NotFound) as e:
        client.submit("make_invoice", {"payment_id": "p", "amount": 1}, queue="no_such_queue")
    assert e.value.code == "unknown_queue"
    with pytest.raises(ax.InvalidInput) as e:
        client.submit("make_invoice", {}, queue=Q, run_at="yesterday")
    assert e.value.field == "run_at"
    with pytest.raises(ax.NotFound):
        client.cancel("py_tasks.no-such-task")


def test_a_direct_submit_runs_like_a_requested_one(runtime, url):
    """``direct_submits=True``: the client publishes the task itself (no ax server on its
    path); the result, the record and a refusal are what a requested submit gives."""
    runtime(add)
    direct = ax.Client(url, direct_submits=True)
    try:
        handle = add.submit(20, b=22, client=direct)
        assert handle.result(timeout=20) == 42
        record = direct.get(handle.id)
        assert (record["state"], record["attempt"]) == ("succeeded", 1)
        with pytest.raises(ax.InvalidInput):
            direct.submit("bad name", {}, queue=Q)
    finally:
        direct.close()
