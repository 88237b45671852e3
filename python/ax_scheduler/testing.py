"""``ax.testing``: ax's test mode — tasks and flows run in this process with no broker —
and a real local ax for integration tests.

In process (no NATS, no server)::

    result = ax.testing.run(create_invoice, payment)        # every attempt, as ax makes them
    assert result.state == "succeeded" and result.output == Invoice(...)
    assert result.error_classes == ["InvoiceApiError", None] and result.delays == [10.0]

    run = ax.testing.run_flow(order_payment_flow, {"payment_id": "pay_001"})
    assert run.states == {"parse_payment": "succeeded", ...} and run.outputs["create_invoice"] == {...}

A task's arguments and result take the JSON road of a real submit (an unserializable
argument is refused as ``submit`` refuses it; such a result fails the attempt with
``bad_output``); ``ax.context()`` and ``ax.heartbeat()`` work inside, with fake ids and a
fake clock; retries follow the task's options, and the backoff delays are recorded on the
clock, not slept. Flows run by the server's engine rules (ported, see
``_testing_flow``). With a broker: the pytest fixture ``ax_local``
(``ax_scheduler.pytest_plugin``), or ``LocalAx`` / ``local()`` without pytest.
The Python guide, "Testing", has both.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any, Iterable, Mapping, cast

from ._flow import FlowDef
from ._testing_flow import FlowResult, FlowSim, StepResult
from ._testing_local import LocalAx, local
from ._testing_task import (Attempt, FakeClock, FakeCore, Policy, Result, Runner, drive, drive_async, new_run,
                            task_context)
from .errors import InvalidInput


def run(task: Any, *args: Any, ax_id: str | None = None, ax_key: str | None = None,
        ax_clock: FakeClock | None = None, ax_rng: random.Random | None = None,
        ax_cancel_after: int | None = None, ax_business_id: str | None = None, **kwargs: Any) -> Result:
    """Runs ``task(*args, **kwargs)`` in this process as ax would run the submitted task
    — every attempt, until it succeeds, fails for good or runs out of attempts — and
    returns its ``Result``. An ``async def`` task runs on a fresh event loop (from a
    coroutine, use ``run_async``).

    The ``ax_`` options (reserved names: a task's own arguments cannot have them):
    ``ax_id`` the task id (default ``<queue>.test-<name>``), ``ax_key`` an idempotency key
    (else the task's ``idempotency_key(...)``), ``ax_clock`` the ``FakeClock`` to use
    (default: one at 2026-01-01T00:00:00Z), ``ax_rng`` a ``random.Random`` drawing the
    backoff jitter (default: none, so each delay is the un-jittered one: the longest ax
    would wait), ``ax_cancel_after`` cancel the task (as an operator would) once an attempt
    has sent that many heartbeats, ``ax_business_id`` the context's ``business_id``.

    Raises ``ax.InvalidInput`` where ``task.submit(...)`` would: arguments the function
    cannot take, or that JSON cannot hold."""
    task_run = new_run(task, args, kwargs, task_id=ax_id, key=ax_key, clock=ax_clock, rng=ax_rng,
                       cancel_after_heartbeats=ax_cancel_after, business_id=ax_business_id)
    with Runner() as runner:
        return drive(task_run, runner)


async def run_async(task: Any, *args: Any, ax_id: str | None = None, ax_key: str | None = None,
                    ax_clock: FakeClock | None = None, ax_rng: random.Random | None = None,
                    ax_cancel_after: int | None = None, ax_business_id: str | None = None,
                    **kwargs: Any) -> Result:
    """``run`` from a coroutine: an ``async def`` task runs on the running loop, a sync one
    on a thread (as a runtime runs it)."""
    task_run = new_run(task, args, kwargs, task_id=ax_id, key=ax_key, clock=ax_clock, rng=ax_rng,
                       cancel_after_heartbeats=ax_cancel_after, business_id=ax_business_id)
    return await drive_async(task_run)


def _definition(flow: object) -> dict[str, Any]:
    if isinstance(flow, FlowDef):
        return flow.definition()
    if isinstance(flow, dict):
        definition = cast("dict[str, Any]", flow)
        if "steps" in definition and "name" in definition:
            return definition
    raise InvalidInput(f"ax.testing.run_flow runs an @ax.flow (or a flow definition dict), not {flow!r}")


def run_flow(flow: FlowDef | dict[str, Any], input: Any = None, *, run_id: str = "test-run",
             clock: FakeClock | None = None, rng: random.Random | None = None,
             replace: Mapping[str, Any] | None = None, business_id: str | None = None,
             events: Iterable[Any] | None = None, approvals: Mapping[str, Any] | None = None) -> FlowResult:
    """Runs a flow (an ``@ax.flow``, or a definition dict of PROTOCOL.md §6 whose tasks are
    ``@ax.task`` functions of this process) in this process with ``input``, by the rules
    of the server's flow engine, and returns its ``FlowResult``. ``replace`` maps task
    names to functions run in their place (with the task's options): a stub for a step.
    ``business_id`` is the run's, which every step task carries. ``events`` are the events
    published meanwhile, ``(name, payload)`` at the run's start or ``(name, payload,
    after)`` (seconds or a ``timedelta`` later, on the fake clock): the run's
    ``ax.wait_for_event`` steps meet them as the server would. ``approvals`` decide the
    run's ``ax.approval`` steps by step name: ``("approve", payload)`` or ``("reject",
    reason)``, with an optional ``after`` from the step's start; a step not named times out.
    Step task ids are ``<queue>.fl.<run_id>.<step>.0.<item>``. What the test mode does not
    model is refused with ``NotImplementedError`` naming it."""
    with Runner() as runner:
        sim = FlowSim(_definition(flow), input, run_id=run_id, clock=clock or FakeClock(), rng=rng,
                      replace=replace, runner=runner, business_id=business_id, events=events,
                      approvals=approvals)
        return sim.run()


async def run_flow_async(flow: FlowDef | dict[str, Any], input: Any = None, *, run_id: str = "test-run",
                         clock: FakeClock | None = None, rng: random.Random | None = None,
                         replace: Mapping[str, Any] | None = None, business_id: str | None = None,
                         events: Iterable[Any] | None = None,
                         approvals: Mapping[str, Any] | None = None) -> FlowResult:
    """``run_flow`` from a coroutine: sync step tasks run on a thread, ``async def`` ones
    on the running loop."""
    loop = asyncio.get_running_loop()
    sim = FlowSim(_definition(flow), input, run_id=run_id, clock=clock or FakeClock(), rng=rng, replace=replace,
                  runner=Runner(loop), business_id=business_id, events=events, approvals=approvals)
    return await asyncio.to_thread(sim.run)


__all__ = [
    "Attempt", "FakeClock", "FakeCore", "FlowResult", "LocalAx", "Policy", "Result", "StepResult", "local", "run",
    "run_async", "run_flow", "run_flow_async", "task_context",
]
