"""ax_scheduler: ax, the task scheduler native to NATS JetStream, for Python.

::

    import ax_scheduler as ax

    @ax.task(retries=3, timeout=60)
    def create_invoice(payment: Payment) -> Invoice: ...

    with ax.Runtime():                     # embedded nats-server + ax server if none runs
        invoice = create_invoice.submit(Payment("pay_001", 42.0)).result(timeout=30)   # an Invoice
        # async code: await create_invoice.submit_async(...), await handle.result_async()

The worker loop, claim, fencing, heartbeats, limits and retries are ax's Rust SDK (the
native module ``ax_scheduler._core``); Python runs your functions. Guide:
docs/guides/python.md.
"""

from __future__ import annotations

from . import errors
from ._aio import AsyncClient
from ._client import Client
from ._context import TaskContext, context, heartbeat
from ._core import __version__
from ._events import Event, events, on_event
from ._flow import FlowDef, FlowStarter, approval, flow, publish_event, sleep, wait_for_event
from ._runtime import Runtime
from ._schedule import schedule
from ._handle import Handle, Submitter, Submitting
from ._task import TaskDef, task
from .errors import (
    AxError,
    Conflict,
    FlowDefinitionError,
    FlowFailed,
    InvalidInput,
    NonRetryable,
    NotFound,
    PermissionDenied,
    TaskFailed,
    TimedOut,
    Unavailable,
)
from . import testing as testing  # ax.testing: the test mode, and a local ax for integration tests


def register(*items: TaskDef | FlowDef, client: Client | None = None) -> None:
    """Stores the definitions of these flows, and every ``ax.schedule`` made so far, now
    (the runtime stores those of its tasks when it starts)."""
    from ._schedule import SCHEDULES

    c = client or Client.default()
    for item in items:
        if isinstance(item, FlowDef):
            c.put_flow(item)
        elif not isinstance(item, TaskDef):  # pyright: ignore[reportUnnecessaryIsInstance] (untyped callers)
            raise InvalidInput(f"register() takes @ax.task and @ax.flow objects, not {item!r}")
    for definition in SCHEDULES.values():
        c.call("trigger", "put", definition)


__all__ = [
    "AsyncClient", "AxError", "Client", "Conflict", "Event", "FlowDef", "FlowDefinitionError", "FlowFailed",
    "FlowStarter", "Handle", "InvalidInput", "NonRetryable", "NotFound", "PermissionDenied", "Runtime", "Submitter", "Submitting",
    "TaskContext", "TaskDef", "TaskFailed", "TimedOut", "Unavailable", "__version__", "context", "errors", "events",
    "approval", "flow", "heartbeat", "on_event", "publish_event", "register", "schedule", "sleep", "task", "wait_for_event",
]
