"""One attempt of a task, wherever it runs (a task thread, the event loop, a child
process): its arguments and context from the delivered task, its result as stored, and
its failure as recorded."""

from __future__ import annotations

import dataclasses
import traceback
from dataclasses import dataclass
from typing import Any, Protocol, cast

from . import _json
from ._context import TaskContext
from ._flow import resolve
from ._task import TaskDef
from .errors import InvalidInput


class Delivered(Protocol):
    """What an attempt knows of its task (read only): the native ``TaskContext``, or the
    copy a process-executor child gets."""

    @property
    def id(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def queue(self) -> str: ...
    @property
    def priority(self) -> str: ...
    @property
    def attempt(self) -> int: ...
    @property
    def max_attempts(self) -> int: ...
    @property
    def payload(self) -> bytes: ...
    @property
    def is_json(self) -> bool: ...
    @property
    def idempotency_key(self) -> str | None: ...
    @property
    def created_at_ms(self) -> int: ...
    @property
    def run_at_ms(self) -> int | None: ...
    @property
    def traceparent(self) -> str | None: ...
    @property
    def business_id(self) -> str | None: ...


@dataclass(frozen=True)
class Delivery:
    """A copy of a delivered task (the fields of the native ``TaskContext``): what a
    process-executor child gets, and what the test mode makes."""

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

    @staticmethod
    def of(core: Any) -> "Delivery":
        return Delivery(*(getattr(core, f.name) for f in dataclasses.fields(Delivery)))



def _step(payload: Any) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """``(payload, ax_args)`` of a flow step's task payload (PROTOCOL.md §6); None for
    any other payload."""
    if not isinstance(payload, dict):
        return None
    step = cast(dict[str, Any], payload)
    spec = step.get("args")
    if not isinstance(spec, dict) or "ax_args" not in spec or "run" not in step:
        return None
    return step, cast(dict[str, Any], cast(dict[str, Any], spec)["ax_args"])


def prepare(td: TaskDef, task: Delivered, core: Any) -> tuple[list[Any], dict[str, Any], TaskContext]:
    """The function's arguments from the payload (a flow step's ``ax_args``, or the call's
    JSON), and the context ``ax.context()`` answers with (``core`` reaches the worker)."""
    payload: Any = _json.loads(task.payload) if task.is_json else bytes(task.payload)
    flow: str | None = None
    run: str | None = None
    step: str | None = None
    index: int | None = None
    found = _step(payload)
    if found is not None:
        body, sources = found
        flow, run, step, index = body.get("flow"), body.get("run"), body.get("step"), body.get("index")
        args, kwargs = td.call_arguments(resolve(body, sources))
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
