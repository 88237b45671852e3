"""``@ax.task``: a function ax runs as a task, its options, and how its arguments and
result travel as JSON."""

from __future__ import annotations

import asyncio
import inspect
import re
import typing
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Callable

from . import _json, _schedule
from ._arguments import Arguments
from .errors import InvalidInput, NonRetryable

REGISTRY: dict[str, "TaskDef"] = {}

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_PRIORITIES = ("high", "normal", "low")
_ON_FAILURE = ("fail", "notify_only")


def _seconds(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidInput(f"{what} must be a number of seconds, not {value!r}", field=what)
    if value != value or value in (float("inf"), float("-inf")) or value < 0:
        raise InvalidInput(f"{what} must be a finite number of seconds ≥ 0, not {value!r}", field=what)
    return float(value)


def _classes(value: Any, what: str) -> tuple[type[BaseException], ...]:
    if value is None:
        return ()
    if isinstance(value, type):
        value = (value,)
    value = tuple(value)
    for c in value:
        if not (isinstance(c, type) and issubclass(c, BaseException)):
            raise InvalidInput(f"{what} must be exception classes, not {c!r}", field=what)
    return value


@dataclass
class TaskOptions:
    """The options of ``@ax.task`` (seconds for times). Unset ones take the server's
    defaults: 5 attempts, 30 s timeout, backoff 1 s doubling to 10 min with 20 % jitter."""

    queue: str = "default"
    priority: str = "normal"
    timeout: float | None = None
    heartbeat_timeout: float | None = None
    retries: int | None = None
    retry_backoff: float | None = None
    retry_backoff_max: float | None = None
    retry_jitter: float | None = None
    retry_on_exception: tuple[type[BaseException], ...] = ()
    no_retry_on_exception: tuple[type[BaseException], ...] = ()
    on_failure: str = "fail"
    concurrency: int | None = None
    idempotency_key: Callable[..., str] | None = None
    cron: str | None = None
    tz: str | None = None
    every: float | None = None
    schedule_payload: Any = None
    rate_limit: float | None = None
    max_memory_mb: int | None = None
    max_cpu_seconds: float | None = None

    def check(self, name: str) -> None:
        if not _NAME.match(name):
            raise InvalidInput(f"task name {name!r}: 1-64 of A-Z a-z 0-9 _ -", field="name")
        if not _NAME.match(self.queue):
            raise InvalidInput(f"queue {self.queue!r}: 1-64 of A-Z a-z 0-9 _ -", field="queue")
        if self.priority not in _PRIORITIES:
            raise InvalidInput(f"priority must be one of {_PRIORITIES}, not {self.priority!r}", field="priority")
        if self.on_failure not in _ON_FAILURE:
            raise InvalidInput(f"on_failure must be one of {_ON_FAILURE}, not {self.on_failure!r}", field="on_failure")
        for what, top in (("retries", 999), ("concurrency", 100_000), ("max_memory_mb", 1 << 30)):
            v = getattr(self, what)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0 or v > top):
                raise InvalidInput(f"{what} must be an integer 0..{top}, not {v!r}", field=what)
        if self.concurrency == 0:
            raise InvalidInput("concurrency must be at least 1", field="concurrency")
        if self.max_memory_mb == 0:
            raise InvalidInput("max_memory_mb must be at least 1", field="max_memory_mb")
        if self.max_cpu_seconds is not None and not 0 < self.max_cpu_seconds <= 86_400:
            raise InvalidInput(f"max_cpu_seconds must be more than 0 and at most 24 h, not {self.max_cpu_seconds!r}",
                               field="max_cpu_seconds")
        if self.retry_jitter is not None and not 0.0 <= self.retry_jitter <= 1.0:
            raise InvalidInput(f"retry_jitter must be within 0..1, not {self.retry_jitter!r}", field="retry_jitter")
        for what in ("timeout", "heartbeat_timeout"):
            v = getattr(self, what)
            if v is not None and not 0 < v <= 86_400:
                raise InvalidInput(f"{what} must be more than 0 seconds and at most 24 h, not {v!r}", field=what)
        if self.cron is not None and self.every is not None:
            raise InvalidInput("give cron or every, not both", field="cron")
        if self.idempotency_key is not None and not callable(self.idempotency_key):
            raise InvalidInput("idempotency_key must be a function of the task's arguments", field="idempotency_key")

    def worker_options(self) -> dict[str, Any]:
        """What the Rust worker applies where the submit left an option unset."""
        out: dict[str, Any] = {}
        if self.retries is not None:
            out["max_attempts"] = self.retries + 1
        if self.timeout is not None:
            out["timeout_ms"] = max(1, round(self.timeout * 1000))
        if self.heartbeat_timeout is not None:
            out["heartbeat_timeout_ms"] = max(1, round(self.heartbeat_timeout * 1000))
        if self.retry_backoff is not None or self.retry_backoff_max is not None or self.retry_jitter is not None:
            base = self.retry_backoff if self.retry_backoff is not None else 1.0
            top = self.retry_backoff_max if self.retry_backoff_max is not None else max(600.0, base)
            out["backoff"] = {
                "base_ms": round(base * 1000),
                "max_ms": round(max(top, base) * 1000),
                "jitter": 0.2 if self.retry_jitter is None else self.retry_jitter,
            }
        if self.concurrency is not None:
            out["concurrency"] = self.concurrency
        return out


def definition_of(fn: Callable[..., Any]) -> str:
    """Where a function is defined, ``module.qualname``; a spawned child's re-import of
    the main script (``__mp_main__``) is the script (``__main__``)."""
    module = getattr(fn, "__module__", None) or "?"
    if module == "__mp_main__":
        module = "__main__"
    return f"{module}.{getattr(fn, '__qualname__', None) or getattr(fn, '__name__', repr(fn))}"


def claim_name(registry: dict[str, Any], kind: str, name: str, fn: Callable[..., Any]) -> None:
    """Refuses ``name`` when another function has it: both would be served under one
    name, and every run would go to one of them. The same function again (a re-import,
    ``importlib.reload``) keeps it."""
    taken = registry.get(name)
    if taken is None or definition_of(taken.fn) == definition_of(fn):
        return
    raise InvalidInput(f"@ax.{kind} name {name!r} is taken by {definition_of(taken.fn)}, and "
                       f"{definition_of(fn)} has it too: pass name=\"...\" to one of them "
                       f"(@ax.{kind}(name=...))", field="name")


class TaskDef:
    """A function registered with ``@ax.task``. Call it as a function (it runs here, or,
    inside an ``@ax.flow`` body, becomes a step); ``.submit(...)`` runs it through ax."""

    def __init__(self, fn: Callable[..., Any], name: str, options: TaskOptions):
        self.fn = fn
        self.name = name
        self.options = options
        self.is_async = inspect.iscoroutinefunction(fn)
        try:
            self.signature = inspect.signature(fn)
        except (TypeError, ValueError) as e:
            raise InvalidInput(f"task {name}: its signature cannot be read ({e}): wrap it in a def") from None
        try:
            self.hints = typing.get_type_hints(fn)
        except Exception:  # unresolvable forward references: no typing back
            self.hints = {}
        self._arguments = Arguments(name, self.signature, self.hints)
        self.params = self._arguments.params
        self.__name__ = getattr(fn, "__name__", name)
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    def __repr__(self) -> str:
        return f"<ax task {self.name!r} on queue {self.options.queue!r}>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from . import _flow

        builder = _flow.tracing()
        if builder is not None:
            return builder.call(self, args, kwargs, fan_out=False)
        return self.fn(*args, **kwargs)

    def map(self, items: Any, *args: Any, **kwargs: Any) -> Any:
        """Inside a flow: one task per item of ``items`` (a task's list output), given as
        the first argument; the result is the list of their outputs, in item order."""
        from . import _flow

        builder = _flow.tracing()
        if builder is None:
            return [self.fn(item, *args, **kwargs) for item in items]
        return builder.call(self, (items, *args), kwargs, fan_out=True)

    # -- arguments as JSON ------------------------------------------------------------

    def payload(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The JSON payload of a direct call (``_arguments`` says how each kind of
        parameter maps): the one argument of a one-parameter function, else an object of
        arguments by name."""
        return self._arguments.payload(args, kwargs)

    def arguments(self, payload: Any) -> tuple[list[Any], dict[str, Any]]:
        """Arguments of this function from a task payload (the inverse of ``payload``),
        typed back by the annotations; ``InvalidInput`` (``bad_payload``) if it does not fit."""
        return self._arguments.call(payload)

    def check_payload(self, payload: Any) -> None:
        """Refuses, before it is submitted, a payload this function cannot take."""
        self._arguments.call(payload, typed=False, code="bad_request")

    def named_arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """A call's arguments as an object by name, whatever the function's parameters
        (a flow step passes every argument by name)."""
        return self._arguments.by_name(self._arguments.bind(args, kwargs))

    def call_arguments(self, resolved: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        """The call of a flow step's resolved arguments (``named_arguments`` of the flow
        body's call), typed back by the annotations."""
        return self._arguments.call_by_name(resolved)

    def output_type(self) -> Any:
        return self.hints.get("return")

    # -- failures ---------------------------------------------------------------------

    def classify(self, error: BaseException) -> tuple[str, bool]:
        """The error class recorded for ``error``, and whether it is permanent: a
        ``NonRetryable``, a ``no_retry_on_exception`` instance, or (when
        ``retry_on_exception`` is given) anything not an instance of those."""
        o = self.options
        if isinstance(error, NonRetryable):
            cause = error.__cause__ or error.__context__
            name = error.error_class or (type(cause).__name__ if cause else "NonRetryable")
            return name, True
        name = type(error).__name__
        if o.no_retry_on_exception and isinstance(error, o.no_retry_on_exception):
            return name, True
        if o.retry_on_exception and not isinstance(error, o.retry_on_exception):
            return name, True
        return name, False

    # -- submitting -------------------------------------------------------------------

    def request(self, payload: Any, *, delay: Any = None, run_at: Any = None, key: str | None = None,
                priority: str | None = None) -> dict[str, Any]:
        """The submit request (PROTOCOL.md §2) for ``payload``."""
        req: dict[str, Any] = {"name": self.name, "payload": payload}
        prio = priority or self.options.priority
        if prio != "normal":
            req["priority"] = prio
        d = _seconds(delay, "delay")
        if d is not None:
            req["delay_ms"] = round(d * 1000)
        if run_at is not None:
            if isinstance(run_at, datetime):
                if run_at.tzinfo is None:
                    raise InvalidInput("run_at must be timezone-aware", field="run_at")
                run_at = run_at.isoformat()
            req["run_at"] = run_at
        if key is not None:
            req["idempotency_key"] = key
        return req

    def submit(self, *args: Any, delay: Any = None, run_at: Any = None, key: str | None = None,
               priority: str | None = None, client: Any = None, **kwargs: Any) -> "Handle":
        """Submits one run of this task with these arguments (``delay`` in seconds or a
        timedelta, ``run_at`` an aware datetime or RFC 3339 text, ``key`` an idempotency
        key, else ``idempotency_key(...)`` of the arguments when the task declares one);
        returns its handle once ax has stored it."""
        from ._client import Client

        payload = self.payload(args, kwargs)
        if key is None and self.options.idempotency_key is not None:
            key = str(self.options.idempotency_key(*args, **kwargs))
        c = client or Client.default()
        return c.submit_request(self.options.queue, self.request(payload, delay=delay, run_at=run_at, key=key,
                                                                   priority=priority), task=self)


@dataclass
class Handle:
    """A submitted task: ``id``, and ``wait`` / ``result`` / ``get`` / ``cancel``."""

    id: str
    duplicate: bool
    state: str
    client: Any = field(repr=False)
    task: TaskDef | None = field(default=None, repr=False)

    def get(self) -> dict[str, Any] | None:
        """The task's current record, or None before it has one."""
        return self.client.get(self.id)

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        """Waits until the task is finished and returns its final record (``TimedOut``
        after ``timeout`` seconds)."""
        return self.client.wait(self.id, timeout=timeout)

    def result(self, timeout: float | None = None) -> Any:
        """The task's output once it succeeded, typed by the function's return
        annotation; ``TaskFailed`` if it ended otherwise."""
        hint = self.task.output_type() if self.task else None
        return _json.typed(self.client.result(self.id, timeout=timeout), hint)

    def cancel(self) -> dict[str, Any]:
        return self.client.cancel(self.id)


def task(fn: Callable[..., Any] | None = None, *, name: str | None = None, queue: str = "default",
         priority: str = "normal", timeout: Any = None, heartbeat_timeout: Any = None,
         retries: int | None = None,
         retry_backoff: Any = None, retry_backoff_max: Any = None, retry_jitter: float | None = None,
         retry_on_exception: Any = None, no_retry_on_exception: Any = None, on_failure: str = "fail",
         concurrency: int | None = None, idempotency_key: Callable[..., str] | None = None,
         cron: str | None = None, tz: str | None = None, every: Any = None,
         schedule_payload: Any = None, rate_limit: Any = None, max_memory_mb: int | None = None,
         max_cpu_seconds: Any = None) -> Any:
    """Registers a function (sync or ``async def``) as an ax task. See the Python guide
    for each option; times are seconds (or timedeltas). An unknown option is a
    ``TypeError``; a bad value an ``InvalidInput`` naming it."""

    def register(f: Callable[..., Any]) -> TaskDef:
        if isinstance(f, TaskDef):
            raise InvalidInput(f"{f.name} is already an ax task")
        if not callable(f):
            raise InvalidInput(f"@ax.task needs a function, not {f!r}")
        opts = TaskOptions(
            queue=queue, priority=priority, timeout=_seconds(timeout, "timeout"),
            heartbeat_timeout=_seconds(heartbeat_timeout, "heartbeat_timeout"), retries=retries,
            retry_backoff=_seconds(retry_backoff, "retry_backoff"),
            retry_backoff_max=_seconds(retry_backoff_max, "retry_backoff_max"), retry_jitter=retry_jitter,
            retry_on_exception=_classes(retry_on_exception, "retry_on_exception"),
            no_retry_on_exception=_classes(no_retry_on_exception, "no_retry_on_exception"),
            on_failure=on_failure, concurrency=concurrency, idempotency_key=idempotency_key,
            cron=cron, tz=tz, every=_seconds(every, "every"), schedule_payload=schedule_payload,
            rate_limit=None if rate_limit is None else _schedule.rate(rate_limit),
            max_memory_mb=max_memory_mb, max_cpu_seconds=_seconds(max_cpu_seconds, "max_cpu_seconds"))
        task_name = name or f.__name__
        opts.check(task_name)
        if asyncio.iscoroutinefunction(f) is False and inspect.isasyncgenfunction(f):
            raise InvalidInput(f"task {task_name}: an async generator cannot be a task")
        td = TaskDef(f, task_name, opts)
        claim_name(REGISTRY, "task", task_name, f)
        REGISTRY[task_name] = td
        return td

    return register(fn) if fn is not None else register
