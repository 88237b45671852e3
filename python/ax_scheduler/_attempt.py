"""One attempt of a task, wherever it runs (a task thread, the event loop, a child
process): its arguments and context from the delivered task, its result as stored, and
its failure as recorded."""

from __future__ import annotations

import traceback
from typing import Any, Protocol

from . import _json
from ._context import TaskContext
from ._flow import resolve
from ._task import TaskDef
from .errors import InvalidInput


class Delivered(Protocol):
    """What an attempt knows of its task: the native ``TaskContext``, or the copy a
    process-executor child gets."""

    id: str
    name: str
    queue: str
    priority: str
    attempt: int
    max_attempts: int
    payload: bytes
    is_json: bool
    idempotency_key: str | None
    created_at_ms: int
    run_at_ms: int | None
    traceparent: str | None
    business_id: str | None


def prepare(td: TaskDef, task: Delivered, core: Any) -> tuple[list[Any], dict[str, Any], TaskContext]:
    """The function's arguments from the payload (a flow step's ``ax_args``, or the call's
    JSON), and the context ``ax.context()`` answers with (``core`` reaches the worker)."""
    payload = _json.loads(task.payload) if task.is_json else bytes(task.payload)
    flow = run = step = index = None
    args_spec = payload.get("args") if isinstance(payload, dict) else None
    if isinstance(args_spec, dict) and "ax_args" in args_spec and "run" in payload:
        flow, run, step, index = payload.get("flow"), payload.get("run"), payload.get("step"), payload.get("index")
        args, kwargs = td.call_arguments(resolve(payload, args_spec["ax_args"]))
    else:
        args, kwargs = td.arguments(payload)
    ctx = TaskContext(task.id, task.name, task.queue, task.priority, task.attempt, task.max_attempts,
                      task.idempotency_key, task.created_at_ms, task.run_at_ms, task.traceparent,
                      flow, run, step, index, core, task.business_id)
    return args, kwargs, ctx


def encode(td: TaskDef, result: Any) -> tuple[bytes | None, bool]:
    """A task's result as stored: bytes as bytes, None as no output, else JSON
    (``InvalidInput`` if it has no JSON form)."""
    if isinstance(result, (bytes, bytearray)):
        return bytes(result), False
    if result is None:
        return None, True
    return _json.dumps(result, f"the result of task {td.name}"), True


def failure(td: TaskDef, error: BaseException) -> tuple[str, bool, str, str]:
    """``(class, permanent, message, detail)`` of a failed attempt. A ``BaseException``
    that is not an ``Exception`` (``SystemExit``, ``KeyboardInterrupt``,
    ``GeneratorExit``) fails the attempt like any other, permanently unless
    ``retry_on_exception`` names it."""
    cls, permanent = td.classify(error)
    if isinstance(error, InvalidInput) and error.code == "bad_payload":
        cls, permanent = "bad_payload", True
    if not isinstance(error, Exception):
        retry_on = td.options.retry_on_exception
        permanent = not (retry_on and isinstance(error, retry_on))
    detail = "".join(traceback.format_exception(error))[-8000:]
    return cls, permanent, str(error) or cls, detail
