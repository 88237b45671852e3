"""``ax.context()``: the attempt a task function runs in."""

from __future__ import annotations

import contextvars
import logging
from dataclasses import dataclass
from typing import Any

from .errors import AxError

_current: contextvars.ContextVar["TaskContext | None"] = contextvars.ContextVar("ax_task", default=None)


@dataclass(frozen=True)
class TaskContext:
    """What a running task knows of itself. ``flow``, ``run`` and ``step`` are set for a
    flow step's task; ``trigger`` lineage is in the task id (PROTOCOL.md §5)."""

    id: str
    name: str
    queue: str
    priority: str
    attempt: int
    max_attempts: int
    idempotency_key: str | None
    created_at_ms: int
    run_at_ms: int | None
    traceparent: str | None
    flow: str | None
    run: str | None
    step: str | None
    item_index: int | None
    _core: Any
    business_id: str | None = None
    """The business id the task works for (its submit's or its flow run's ``business_id``)."""

    @property
    def logger(self) -> "logging.LoggerAdapter[logging.Logger]":
        """The logger ``ax_scheduler.task.<name>`` with this attempt's ids (task id, name,
        attempt, flow run, step, business id) in each record's ``extra``."""
        from ._logs import task_logger

        return task_logger(self)

    @property
    def cancelled(self) -> bool:
        """True once an operator cancelled the task or the worker gave up on this attempt
        (hard timeout, shutdown): stop and return; the result will be refused anyway."""
        return self._core is not None and bool(self._core.cancelled())

    def fencing_token(self) -> int:
        """This attempt's fencing token: larger than any earlier attempt's. Pass it to
        the systems you write to and have them refuse smaller ones."""
        if self._core is None:
            raise AxError("fencing_token() is only available inside a running task")
        return int(self._core.fencing_token())

    def heartbeat(self) -> None:
        """Says the task still makes progress: a task with a ``heartbeat_timeout`` must
        call this at least that often, or its attempt is stopped and failed with class
        ``heartbeat_timeout``. Cheap; callable from any thread (and from a process-executor
        child)."""
        if self._core is not None:
            self._core.heartbeat()

    @property
    def last_attempt(self) -> bool:
        return self.attempt >= self.max_attempts


def heartbeat() -> None:
    """``ax.heartbeat()``: the running task still makes progress (see
    ``TaskContext.heartbeat``); ``AxError`` outside a task."""
    context().heartbeat()


def context() -> TaskContext:
    """The running task's context; ``AxError`` outside a task."""
    ctx = _current.get()
    if ctx is None:
        raise AxError("ax.context() is only available inside a running task")
    return ctx
