"""``@ax.task``: a function ax runs as a task, typed by its signature: ``TaskDef[P, R]``,
whose ``submit`` takes the function's arguments (``P``) and gives a ``Handle[R]``."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import typing
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Callable, Coroutine, Generic, Protocol, cast, overload

from . import _options
from ._arguments import Arguments
from ._handle import Handle, Submitter, Submitting
from ._options import TaskOptions
from ._typing import P, R
from .errors import InvalidInput, NonRetryable

if TYPE_CHECKING:
    from ._aio import AsyncClient
    from ._client import Client

log = logging.getLogger("ax_scheduler")
REGISTRY: dict[str, "TaskDef"] = {}
# Runtimes running (by id), and those of them that serve "every registered task"
# (`Runtime(tasks=None)`): they took the tasks and the event handlers registered when they
# started, so one registered now would not be served.
RUNNING: set[int] = set()
SERVING_EVERY_TASK: set[int] = set()


def refuse_late(what: str, every: bool = True) -> None:
    """``InvalidInput`` if a runtime that would not serve ``what`` runs: one serving every
    registered task (``every``, for a task), or any runtime (for an event handler, which
    every runtime takes at its start)."""
    if SERVING_EVERY_TASK if every else RUNNING:
        raise InvalidInput(
            f"{what} registered after Runtime.start(): the running runtime took the tasks and handlers "
            "registered when it started and would not serve this one. Register it before start() (import "
            "its module first), or start the runtime with tasks=[...] naming what it serves")
# The options ``submit`` reads from its keywords (``submit(x, delay=30)``, the older
# spelling of ``with_options(delay=30).submit(x)``) unless the function has a parameter so named.
SUBMIT_OPTIONS = ("delay", "run_at", "key", "priority", "client")


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


class TaskDef(Generic[P, R]):
    """A function registered with ``@ax.task``: ``P`` its parameters, ``R`` its result
    (for an ``async def``, what it returns when awaited). Call it as a function (it runs
    here, or, inside an ``@ax.flow`` body, becomes a step whose output stands for an
    ``R``); ``.submit(...)`` runs it through ax."""

    def __init__(self, fn: Callable[P, Any], name: str, options: TaskOptions):
        self.fn: Callable[P, Any] = fn
        self.name = name
        self.options = options
        self.is_async = inspect.iscoroutinefunction(fn)
        try:
            self.signature = inspect.signature(fn)
        except (TypeError, ValueError) as e:
            raise InvalidInput(f"task {name}: its signature cannot be read ({e}): wrap it in a def") from None
        try:
            self.hints = typing.get_type_hints(fn)
        except Exception as e:  # an unresolvable forward reference: no typing back
            log.warning("ax: task %s: its annotations cannot be resolved (%s): its arguments and result "
                        "come as decoded JSON", name, e)
            self.hints = {}
        self._arguments = Arguments(name, self.signature, self.hints)
        self.params = self._arguments.params
        self.__name__ = getattr(fn, "__name__", name)
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    def __repr__(self) -> str:
        return f"<ax task {self.name!r} on queue {self.options.queue!r}>"

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """The function's result, run here; in a flow body, the step's output (typed as
        the result it will be). An ``async def`` task's call gives its coroutine at run
        time, typed ``R`` for flow bodies: ``await task.fn(...)`` runs it here."""
        from . import _flow

        builder = _flow.tracing()
        if builder is not None:
            return cast(R, builder.call(self, args, kwargs, fan_out=False))
        return cast(R, self.fn(*args, **kwargs))

    def map(self, items: Any, *args: Any, **kwargs: Any) -> list[R]:
        """Inside a flow: one task per item of ``items`` (a task's list output), given as
        the first argument; the result is the list of their outputs, in item order."""
        from . import _flow

        builder = _flow.tracing()
        if builder is None:
            fn = cast(Callable[..., R], self.fn)
            return [fn(item, *args, **kwargs) for item in items]
        return cast(list[R], builder.call(self, (items, *args), kwargs, fan_out=True))

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
        return _options.request(self.name, self.options, payload, delay=delay, run_at=run_at, key=key,
                                priority=priority)

    def with_options(self, *, delay: float | timedelta | None = None, run_at: datetime | str | None = None,
                     key: str | None = None, priority: str | None = None,
                     client: Client | AsyncClient | None = None) -> Submitter[P, R]:
        """This task's submits with these options (``delay`` in seconds or a timedelta,
        ``run_at`` an aware datetime or RFC 3339 text, ``key`` an idempotency key, else
        ``idempotency_key(...)`` of the arguments when the task declares one,
        ``priority``, ``client``): ``task.with_options(key=k).submit(...)``. Its
        ``submit`` gives every keyword to the function."""
        return Submitter(self, delay=delay, run_at=run_at, key=key, priority=priority, client=client)

    def submit(self, *args: P.args, **kwargs: P.kwargs) -> Handle[R]:
        """Submits one run of this task with these arguments, checked against the
        function's signature; returns its handle once ax has stored it. Options go
        through ``with_options``; ``submit(x, delay=30, client=c)`` (the older spelling)
        still works for an option the function has no parameter of its name for."""
        return self._options_in(kwargs).submit(*args, **kwargs)

    def submit_nowait(self, *args: P.args, **kwargs: P.kwargs) -> Submitting[R]:
        """``submit`` without waiting for ax's answer: many submits in flight from one
        thread; ``.handle()`` of each gives its ``Handle`` once stored (or raises the
        refusal). The Python guide, "Producing"."""
        return self._options_in(kwargs).submit_nowait(*args, **kwargs)

    async def submit_async(self, *args: P.args, **kwargs: P.kwargs) -> Handle[R]:
        """``submit`` as an awaitable (on the ``AsyncClient`` of the client)."""
        return await self._options_in(kwargs).submit_async(*args, **kwargs)

    def _options_in(self, kwargs: dict[str, Any]) -> Submitter[P, R]:
        """The submit options among ``submit``'s keywords, taken out of ``kwargs``:
        those named like no parameter the function takes by keyword."""
        named = {p.name for p in self.params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        given = {k: kwargs.pop(k) for k in SUBMIT_OPTIONS if k in kwargs and k not in named}
        return self.with_options(**given)


class TaskDecorator(Protocol):
    """What ``@ax.task(...)`` with options gives: the decorator of a function."""

    @overload
    def __call__(self, fn: Callable[P, Coroutine[Any, Any, R]], /) -> TaskDef[P, R]: ...
    @overload
    def __call__(self, fn: Callable[P, R], /) -> TaskDef[P, R]: ...


@overload
def task(fn: Callable[P, Coroutine[Any, Any, R]], /) -> TaskDef[P, R]: ...
@overload
def task(fn: Callable[P, R], /) -> TaskDef[P, R]: ...
@overload
def task(*, name: str | None = None, queue: str = "default", priority: str = "normal",
         timeout: float | timedelta | None = None, heartbeat_timeout: float | timedelta | None = None,
         retries: int | None = None, retry_backoff: float | timedelta | None = None,
         retry_backoff_max: float | timedelta | None = None, retry_jitter: float | None = None,
         retry_on_exception: type[BaseException] | typing.Iterable[type[BaseException]] | None = None,
         no_retry_on_exception: type[BaseException] | typing.Iterable[type[BaseException]] | None = None,
         on_failure: str = "fail", concurrency: int | None = None, idempotency_key: Callable[..., str] | None = None,
         cron: str | None = None, tz: str | None = None, every: float | timedelta | None = None,
         schedule_payload: Any = None, overlap: str | None = None, rate_limit: str | float | None = None,
         max_memory_mb: int | None = None, max_cpu_seconds: float | timedelta | None = None,
         debounce: float | timedelta | None = None, debounce_key: Callable[..., str] | None = None,
         debounce_max_wait: float | timedelta | None = None, debounce_keep: str = "last",
         batch: int | None = None, batch_key: str | Callable[..., str] | None = None,
         batch_timeout: float | timedelta | None = None,
         fair_key: str | Callable[..., str] | None = None,
         singleton: str | Callable[..., str] | None = None, on_collision: str = "cancel_new") -> TaskDecorator: ...


def task(fn: Callable[..., Any] | None = None, /, **options: Any) -> Any:
    """Registers a function (sync or ``async def``) as an ax task: ``@ax.task`` or
    ``@ax.task(retries=3, ...)``. See the Python guide for each option; times are seconds
    (or timedeltas). An unknown option is a ``TypeError``; a bad value an
    ``InvalidInput`` naming it."""
    task_name, given = _options.read(options)

    def register(f: Callable[..., Any]) -> TaskDef:
        opts = dataclasses.replace(given)  # each function its own
        if isinstance(f, TaskDef):
            raise InvalidInput(f"{f.name} is already an ax task")
        if not callable(f):
            raise InvalidInput(f"@ax.task needs a function, not {f!r}")
        name = task_name or f.__name__
        opts.check(name)
        if inspect.isasyncgenfunction(f):
            raise InvalidInput(f"task {name}: an async generator cannot be a task")
        td: TaskDef = TaskDef(f, name, opts)
        if opts.batch is not None and [p.kind for p in td.params] != [inspect.Parameter.VAR_POSITIONAL]:
            raise InvalidInput(f"task {name} is batched: it takes its items as one *items parameter "
                               "(e.g. def invoice(*orders: Order))", field="batch")
        claim_name(REGISTRY, "task", name, f)
        if name not in REGISTRY:
            refuse_late(f"task {name}")
        REGISTRY[name] = td
        return td

    return register(fn) if fn is not None else register
