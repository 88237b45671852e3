"""OpenTelemetry, when it is installed (``opentelemetry-api``; nothing is needed
otherwise): a submit made inside a span carries that span's context as the task's
``traceparent`` (PROTOCOL.md §2), and each attempt runs in a span ``ax.task <name>`` whose
parent is that context, so a trace goes from the producer's request into the task and
on to what the task calls."""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any, Generator

from ._context import TaskContext

_AVAILABLE = importlib.util.find_spec("opentelemetry") is not None


def traceparent() -> str | None:
    """The W3C ``traceparent`` of the current span, if OpenTelemetry is installed and a
    span is recording; else None."""
    if not _AVAILABLE:
        return None
    from opentelemetry import propagate

    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent")


@contextlib.contextmanager
def attempt_span(ctx: TaskContext) -> Generator[Any, None, None]:
    """The span an attempt runs in (a no-op without OpenTelemetry): its parent is the
    task's ``traceparent``; its attributes the task's identity. An exception out of the
    attempt is recorded on it and marks it failed."""
    if not _AVAILABLE:
        yield None
        return
    from opentelemetry import propagate, trace

    parent = propagate.extract({"traceparent": ctx.traceparent}) if ctx.traceparent else None
    attributes: dict[str, Any] = {"ax.task.id": ctx.id, "ax.task.name": ctx.name, "ax.queue": ctx.queue,
                                  "ax.attempt": ctx.attempt}
    for key, value in (("ax.business_id", ctx.business_id), ("ax.flow", ctx.flow), ("ax.run", ctx.run),
                       ("ax.step", ctx.step)):
        if value is not None:
            attributes[key] = value
    tracer = trace.get_tracer("ax_scheduler")
    with tracer.start_as_current_span(f"ax.task {ctx.name}", context=parent, kind=trace.SpanKind.CONSUMER,
                                      attributes=attributes) as span:
        yield span
