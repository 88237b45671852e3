"""The options of ``@ax.task``: read, checked and turned into what the Rust worker
applies."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Callable

from . import _otel, _schedule
from .errors import InvalidInput

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_PRIORITIES = ("high", "normal", "low")
#: What a schedule does when its previous run still goes (PROTOCOL.md §5, ``overlap``).
OVERLAPS = ("buffer_one", "skip", "allow", "cancel_in_progress")
COLLISIONS = ("cancel_new", "cancel_in_progress")
_ON_FAILURE = ("fail", "notify_only")


def seconds(value: Any, what: str) -> float | None:
    """``value`` (a number or a timedelta) as seconds; None for None; ``InvalidInput``
    naming ``what`` for anything else, NaN, infinity or less than 0."""
    if value is None:
        return None
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidInput(f"{what} must be a number of seconds, not {value!r}", field=what)
    if value != value or value in (float("inf"), float("-inf")) or value < 0:
        raise InvalidInput(f"{what} must be a finite number of seconds ≥ 0, not {value!r}", field=what)
    return float(value)


def classes(value: Any, what: str) -> tuple[type[BaseException], ...]:
    """An exception class or classes as a tuple; ``InvalidInput`` naming ``what`` else."""
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
    overlap: str | None = None
    rate_limit: float | None = None
    max_memory_mb: int | None = None
    max_cpu_seconds: float | None = None
    debounce: float | None = None
    debounce_key: Callable[..., str] | None = None
    debounce_max_wait: float | None = None
    debounce_keep: str = "last"
    batch: int | None = None
    batch_key: str | Callable[..., str] | None = None
    batch_timeout: float | None = None
    fair_key: str | Callable[..., str] | None = None
    singleton: str | Callable[..., str] | None = None
    on_collision: str = "cancel_new"

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
        if self.overlap is not None and self.overlap not in OVERLAPS:
            raise InvalidInput(f"overlap must be one of {OVERLAPS}, not {self.overlap!r}", field="overlap")
        if self.overlap is not None and self.cron is None and self.every is None:
            raise InvalidInput("overlap is for a scheduled task: give cron or every", field="overlap")
        if self.idempotency_key is not None and not callable(self.idempotency_key):
            raise InvalidInput("idempotency_key must be a function of the task's arguments", field="idempotency_key")
        self._check_debounce()
        self._check_batch()
        f: Any = self.fair_key  # as given: checked here
        if f is not None and not callable(f) and not (isinstance(f, str) and _BATCH_KEY.match(f)):
            raise InvalidInput("fair_key must be 1-64 of A-Z a-z 0-9 _ - . : @, or a function of the task's "
                               f"arguments, not {f!r}", field="fair_key")
        self._check_singleton()

    def _check_singleton(self) -> None:
        if self.on_collision not in COLLISIONS:
            raise InvalidInput(f"on_collision must be one of {COLLISIONS} (to queue behind the running task, "
                               f"use concurrency=1), not {self.on_collision!r}", field="on_collision")
        k: Any = self.singleton  # as given: checked here
        if k is None:
            if self.on_collision != "cancel_new":
                raise InvalidInput("on_collision needs singleton=<key>", field="on_collision")
            return
        if not callable(k) and not (isinstance(k, str) and _BATCH_KEY.match(k)):
            raise InvalidInput("singleton must be 1-64 of A-Z a-z 0-9 _ - . : @, or a function of the task's "
                               f"arguments, not {k!r}", field="singleton")
        if self.debounce is not None or self.batch is not None or self.cron is not None or self.every is not None:
            raise InvalidInput("a singleton task has no debounce, batch, cron or every (a scheduled task's "
                               "collisions are its overlap)", field="singleton")

    def _check_debounce(self) -> None:
        if self.debounce is None:
            if self.debounce_key is not None or self.debounce_max_wait is not None or self.debounce_keep != "last":
                raise InvalidInput("debounce_key, debounce_max_wait and debounce_keep need debounce=<seconds>",
                                   field="debounce")
            return
        if not 0.001 <= self.debounce <= _WEEK:
            raise InvalidInput(f"debounce must be 1 ms to 7 days, not {self.debounce!r}", field="debounce")
        if self.debounce_key is None or not callable(self.debounce_key):
            raise InvalidInput("debounce needs debounce_key: a function of the task's arguments", field="debounce_key")
        w = self.debounce_max_wait
        if w is not None and not self.debounce <= w <= _WEEK:
            raise InvalidInput(f"debounce_max_wait must be from debounce up to 7 days, not {w!r}",
                               field="debounce_max_wait")
        if self.debounce_keep not in ("last", "first"):
            raise InvalidInput(f"debounce_keep must be 'last' or 'first', not {self.debounce_keep!r}",
                               field="debounce_keep")
        if self.cron is not None or self.every is not None or self.idempotency_key is not None:
            raise InvalidInput("a debounced task has no cron, every or idempotency_key", field="debounce")

    def _check_batch(self) -> None:
        if self.batch is None:
            if self.batch_key is not None or self.batch_timeout is not None:
                raise InvalidInput("batch_key and batch_timeout need batch=<size>", field="batch")
            return
        b: Any = self.batch  # as given: checked here
        if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= 10_000:
            raise InvalidInput(f"batch must be a size of 1 to 10000 items, not {b!r}", field="batch")
        t = self.batch_timeout
        if t is not None and not 0.001 <= t <= _WEEK:
            raise InvalidInput(f"batch_timeout must be 1 ms to 7 days, not {t!r}", field="batch_timeout")
        k: Any = self.batch_key  # as given: checked here
        if k is not None and not callable(k) and not (isinstance(k, str) and _BATCH_KEY.match(k)):
            raise InvalidInput("batch_key must be 1-64 of A-Z a-z 0-9 _ - . : @, or a function of the item, "
                               f"not {k!r}", field="batch_key")
        if self.debounce is not None or self.cron is not None or self.every is not None:
            raise InvalidInput("a batched task has no debounce, cron or every", field="batch")

    def batch_request(self, name: str, item: Any) -> dict[str, Any] | None:
        """The submit's ``batch`` object (PROTOCOL.md §2, "Batching") for one item, if the
        task is batched: the key (the task's name by default), size and timeout (5 s by
        default)."""
        if self.batch is None:
            return None
        k = self.batch_key
        key = name if k is None else k if isinstance(k, str) else str(k(item))
        timeout = self.batch_timeout if self.batch_timeout is not None else DEFAULT_BATCH_TIMEOUT
        return {"key": key, "size": self.batch, "timeout_ms": max(1, round(timeout * 1000))}

    def fair_request(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """The submit's ``fair_key`` (PROTOCOL.md §7, "Fair shares") for these arguments:
        the tenant whose share the task is dispatched in."""
        f = self.fair_key
        if f is None:
            return None
        return f if isinstance(f, str) else str(f(*args, **kwargs))

    def singleton_request(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
        """The submit's ``singleton`` object (PROTOCOL.md §2, "Singleton keys") for these
        arguments, if the task has a singleton key."""
        k = self.singleton
        if k is None:
            return None
        key = k if isinstance(k, str) else str(k(*args, **kwargs))
        return {"key": key, "on_collision": self.on_collision}

    def debounce_request(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
        """The submit's ``debounce`` object (PROTOCOL.md §2) for these arguments, if the
        task is debounced."""
        if self.debounce is None or self.debounce_key is None:
            return None
        out: dict[str, Any] = {"key": str(self.debounce_key(*args, **kwargs)),
                               "period_ms": max(1, round(self.debounce * 1000))}
        if self.debounce_max_wait is not None:
            out["max_wait_ms"] = max(1, round(self.debounce_max_wait * 1000))
        if self.debounce_keep != "last":
            out["keep"] = self.debounce_keep
        return out

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


_SECONDS = ("timeout", "heartbeat_timeout", "retry_backoff", "retry_backoff_max", "every", "max_cpu_seconds",
            "debounce", "debounce_max_wait", "batch_timeout")
#: How long a batch waits for more items after its first, when ``batch_timeout`` is not given.
DEFAULT_BATCH_TIMEOUT = 5.0
_BATCH_KEY = re.compile(r"^[A-Za-z0-9_.:@-]{1,64}$")
_WEEK = 7 * 86_400.0
_CLASSES = ("retry_on_exception", "no_retry_on_exception")
_FIELDS = frozenset(f.name for f in dataclasses.fields(TaskOptions))


def read(given: dict[str, Any]) -> tuple[str | None, TaskOptions]:
    """The ``name`` and the options of ``@ax.task(**given)``: times as seconds (or
    timedeltas), exception classes, a rate. An unknown option is a ``TypeError``, as for
    any function; a bad value an ``InvalidInput`` naming it."""
    values = dict(given)
    name = values.pop("name", None)
    for key in values:
        if key not in _FIELDS:
            raise TypeError(f"task() got an unexpected keyword argument {key!r}")
    for key in _SECONDS:
        if key in values:
            values[key] = seconds(values[key], key)
    for key in _CLASSES:
        if key in values:
            values[key] = classes(values[key], key)
    if values.get("rate_limit") is not None:
        values["rate_limit"] = _schedule.rate(values["rate_limit"])
    return name, TaskOptions(**values)


def request(name: str, options: TaskOptions, payload: Any, *, delay: Any = None, run_at: Any = None,
            key: str | None = None, priority: str | None = None) -> dict[str, Any]:
    """The submit request (PROTOCOL.md §2) of task ``name`` for ``payload``: ``delay`` in
    seconds or a timedelta, ``run_at`` an aware datetime or RFC 3339 text, ``key`` an
    idempotency key, ``priority`` else the task's; ``traceparent`` the current span's
    (OpenTelemetry)."""
    req: dict[str, Any] = {"name": name, "payload": payload}
    prio = priority or options.priority
    if prio != "normal":
        req["priority"] = prio
    d = seconds(delay, "delay")
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
    trace = _otel.traceparent()  # a submit inside a span carries it (OpenTelemetry, when installed)
    if trace is not None:
        req["traceparent"] = trace
    return req
