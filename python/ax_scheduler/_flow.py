"""``@ax.flow``: a flow definition built by running its body once with placeholders.

Each call of an ``@ax.task`` in the body becomes a step; an argument that is the run's
input or another call's result becomes a ``need`` and is passed by name; ``task.map(xs)``
fans out over a list output, and a call on its result fans in. The definition is ax's
own (PROTOCOL.md §6): the step's task payload ``args`` says where each argument comes
from, ``{"ax_args": {param: source}}`` (the arguments by name, as in a task's payload;
``*args`` as ``{"list": [source, ...]}``), and the Python runtime rebuilds the call.
"""

from __future__ import annotations

import contextvars
import inspect
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Callable, Generic, Mapping, Protocol, cast, overload

from . import _json
from ._options import _BATCH_KEY, COLLISIONS  # pyright: ignore[reportPrivateUsage]
from ._task import claim_name
from ._typing import P
from .errors import FlowDefinitionError, InvalidInput

if TYPE_CHECKING:
    from ._aio import AsyncClient
    from ._client import Client

FLOWS: dict[str, "FlowDef"] = {}
_tracer: contextvars.ContextVar["_Builder | None"] = contextvars.ContextVar("ax_flow", default=None)


def tracing() -> "_Builder | None":
    return _tracer.get()


def _refuse(what: str) -> Callable[..., Any]:
    def refuse(self: "Value", *args: Any, **kwargs: Any) -> Any:
        raise FlowDefinitionError(
            f"flow {self._flow}: {what} on {self!r}, a value known only when the run runs. In a "
            "flow body, only pass it to @ax.task functions (or index it: value['key']); do the "
            "work inside a task.")
    return refuse


class Value:
    """A value a flow run will have: its input, a step's output, or a path into one."""

    __slots__ = ("_flow", "_source", "_path")

    def __init__(self, flow: str, source: tuple[str, str | None], path: tuple[str | int, ...] = ()):
        self._flow = flow
        self._source = source
        self._path = path

    def __getitem__(self, key: Any) -> "Value":
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            raise FlowDefinitionError(f"flow {self._flow}: index {key!r} is not a string or an integer")
        return Value(self._flow, self._source, self._path + (key,))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _refuse(f"attribute .{name}")(self)

    def __repr__(self) -> str:
        kind, step = self._source
        base = "the run's input" if kind == "input" else f"the output of step {step!r}" if kind == "step" else "the item"
        return base + "".join(f"[{p!r}]" for p in self._path)

    __bool__ = _refuse("a truth test (if / and / or)")
    __iter__ = _refuse("iteration")
    __len__ = _refuse("len()")
    __str__ = _refuse("str()")
    __format__ = _refuse("formatting")
    __call__ = _refuse("a call")
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _refuse("arithmetic")
    __truediv__ = __floordiv__ = __mod__ = _refuse("arithmetic")
    __lt__ = __le__ = __gt__ = __ge__ = _refuse("a comparison")
    __contains__ = _refuse("`in`")
    __int__ = __float__ = __index__ = _refuse("a conversion")

    def _spec(self) -> dict[str, Any]:
        kind, step = self._source
        spec: dict[str, Any] = {"from": kind}
        if step is not None:
            spec["step"] = step
        if self._path:
            spec["path"] = list(self._path)
        return spec


def _has_value(obj: Any) -> bool:
    if isinstance(obj, Value):
        return True
    if isinstance(obj, dict):
        return any(_has_value(v) for v in cast(dict[Any, Any], obj).values())
    if isinstance(obj, (list, tuple)):
        return any(_has_value(v) for v in cast(list[Any], obj))
    return False


class _Builder:
    def __init__(self, flow: str):
        self.flow = flow
        self.steps: list[dict[str, Any]] = []
        self.names: set[str] = set()
        # The last ax.sleep of the body: every step called after it waits for it.
        self.barrier: str | None = None
        # The flows its child flow steps run (stored before it).
        self.children: dict[str, FlowDef[Any]] = {}

    def _name(self, base: str) -> str:
        step, n = base, 2
        while step in self.names:
            step, n = f"{base}_{n}", n + 1
        return step

    def sleep(self, spec: dict[str, Any]) -> None:
        """A sleep step after every step so far that nothing waits for yet."""
        self._barrier("sleep", "sleep", spec, [])

    def wait_for_event(self, spec: dict[str, Any], needs: list[str]) -> Value:
        """A wait for an event after every step so far that nothing waits for yet (and the
        steps its match reads); its output is the event."""
        return Value(self.flow, ("step", self._barrier("wait", "wait_for_event", spec, needs)))

    def approval(self, spec: dict[str, Any]) -> Value:
        """An approval after every step so far that nothing waits for yet; its output is
        the decision."""
        return Value(self.flow, ("step", self._barrier("approval", "approval", spec, [])))

    def _barrier(self, base: str, key: str, spec: dict[str, Any], needs: list[str]) -> str:
        """A wait step (``key``: ``sleep``, ``wait_for_event``, ``approval``) after the body's leaves so
        far and ``needs``; every step called after it waits for it."""
        needed = {n for s in self.steps for n in s.get("needs", [])}
        leaves = [s["name"] for s in self.steps if s["name"] not in needed]
        leaves += [n for n in needs if n not in leaves]
        if len(leaves) > 64:
            raise FlowDefinitionError(f"flow {self.flow}: ax.{key} would wait for {len(leaves)} steps, at most 64")
        step = self._name(base)
        step_def: dict[str, Any] = {"name": step, key: spec}
        if leaves:
            step_def["needs"] = leaves
        self.steps.append(step_def)
        self.names.add(step)
        self.barrier = step
        return step

    def child(self, fd: "FlowDef[Any]", input: Any, fan_out: bool, spec: dict[str, Any]) -> Value:
        """A child flow step (PROTOCOL.md §6, "Child flows") running ``fd`` with ``input``
        (a run value, a constant, or JSON holding run values), or one per item of a
        step's list output (``fan_out``); its output is the child's leaf outputs by step
        name (a list of those for a fan-out)."""
        what = f"{fd.name}.map()" if fan_out else f"{fd.name}()"
        needs: list[str] = []
        child: dict[str, Any] = {"flow": fd.name, **spec}
        for_each = None
        if fan_out:
            if not isinstance(input, Value) or input._source[0] != "step" or input._path:
                raise FlowDefinitionError(f"flow {self.flow}: {what} fans out over a task's list output (the whole "
                                          f"result of a call), not {input!r}")
            for_each = cast(str, input._source[1])
            needs.append(for_each)
            child["input"] = "$item"
        else:
            child["input"] = _template(self.flow, what, input, needs)
        if self.barrier is not None and self.barrier not in needs:
            needs.append(self.barrier)
        step = self._name(fd.name)
        step_def: dict[str, Any] = {"name": step, "child_flow": child}
        if needs:
            step_def["needs"] = needs
        if for_each:
            step_def["for_each"] = for_each
        self.steps.append(step_def)
        self.names.add(step)
        self.children[fd.name] = fd
        return Value(self.flow, ("step", step))

    def call(self, td: Any, args: tuple[Any, ...], kwargs: dict[str, Any], fan_out: bool) -> Value:
        try:
            named: dict[str, Any] = td.named_arguments(args, kwargs)
        except InvalidInput as e:
            raise FlowDefinitionError(f"flow {self.flow}: {e}") from None
        step = self._name(td.name)
        needs: list[str] = []
        sources: dict[str, Any] = {}
        for_each = None
        params: list[inspect.Parameter] = td.params
        first = params[0] if params else None
        item = first.name if first is not None and first.kind in (first.POSITIONAL_ONLY, first.POSITIONAL_OR_KEYWORD) \
            else None
        if fan_out and item is None:
            raise FlowDefinitionError(f"flow {self.flow}: {td.name}.map() passes each item as the first "
                                      "argument, and its first parameter is not a positional one")
        var_args = next((p.name for p in params if p.kind is p.VAR_POSITIONAL), None)
        for param, value in named.items():
            if fan_out and param == item:
                if not isinstance(value, Value) or value._source[0] != "step" or value._path:
                    raise FlowDefinitionError(
                        f"flow {self.flow}: {td.name}.map() fans out over a task's list output "
                        f"(the whole result of a call), not {value!r}")
                for_each = cast(str, value._source[1])  # a step's output names its step
                needs.append(for_each)
                sources[param] = {"from": "item"}
            elif param == var_args and _has_value(value):  # *args: each item its own source
                sources[param] = {"list": [self._source(td, param, v, needs) for v in cast(list[Any], value)]}
            else:
                sources[param] = self._source(td, param, value, needs)
        if self.barrier is not None and self.barrier not in needs:
            needs.append(self.barrier)
        o = td.options
        task: dict[str, Any] = {"name": td.name, "queue": o.queue, "payload": {"ax_args": sources}}
        if o.priority != "normal":
            task["priority"] = o.priority
        step_def: dict[str, Any] = {"name": step, "task": task}
        if needs:
            step_def["needs"] = needs
        if for_each:
            step_def["for_each"] = for_each
        if o.on_failure == "notify_only":
            step_def["on_failure"] = "notify_only"
        self.steps.append(step_def)
        self.names.add(step)
        return Value(self.flow, ("step", step))

    def _source(self, td: Any, param: str, value: Any, needs: list[str]) -> dict[str, Any]:
        """Where an argument comes from: a run value (its step becomes a need) or a constant."""
        if isinstance(value, Value):
            step = value._source[1]
            if value._source[0] == "step" and step is not None and step not in needs:
                needs.append(step)
            return value._spec()
        if _has_value(value):
            raise FlowDefinitionError(
                f"flow {self.flow}: task {td.name}: argument {param!r} holds a run value inside a "
                "list or dict; pass run values as whole arguments")
        _json.dumps(value, f"flow {self.flow}: task {td.name}: argument {param!r}")
        return {"value": value}


def sleep(duration: timedelta | float | None = None, /, *, until: datetime | str | None = None,
          queue: str | None = None) -> None:
    """In an ``@ax.flow`` body: a durable sleep (PROTOCOL.md §6, "Waits"). Every step
    called after it in the body starts once it ends: ``duration`` (a ``timedelta`` or
    seconds) after the steps before it ended, or ``until`` a time (an aware ``datetime`` or
    RFC 3339 text; a past one ends it at once). Held by the broker as a delayed task of
    ``queue`` (default: the flow's first task's queue) that no worker runs, so it outlives
    every process; ``ax flow get`` shows the step ``sleeping``."""
    builder = tracing()
    if builder is None:
        raise FlowDefinitionError("ax.sleep is a step of an @ax.flow body; in a task, use time.sleep or "
                                  "asyncio.sleep")
    spec: dict[str, Any] = {}
    if (duration is None) == (until is None):
        raise FlowDefinitionError(f"flow {builder.flow}: ax.sleep takes a duration or until=, one of them")
    if duration is not None:
        seconds = duration.total_seconds() if isinstance(duration, timedelta) else float(duration)
        if not seconds > 0 or seconds == float("inf"):
            raise FlowDefinitionError(f"flow {builder.flow}: ax.sleep needs a duration over 0 s, not {duration!r}")
        spec["for_ms"] = max(1, round(seconds * 1000))
    elif isinstance(until, datetime):
        if until.tzinfo is None:
            raise FlowDefinitionError(f"flow {builder.flow}: ax.sleep(until=) needs an aware datetime (a time zone)")
        spec["until"] = until.isoformat()
    else:
        spec["until"] = until
    if queue is not None:
        spec["queue"] = queue
    builder.sleep(spec)


def _reference(flow: str, field: str, value: Any, needs: list[str]) -> Any:
    """A ``match`` value as the server reads it: a run value becomes ``"$input.a.b"`` or
    ``"$parents.<step>.a"`` (its step a need), a string starting with ``$`` is escaped,
    anything else is itself (JSON)."""
    if isinstance(value, Value):
        kind, step = value._source  # pyright: ignore[reportPrivateUsage]
        path = value._path  # pyright: ignore[reportPrivateUsage]
        if kind == "item" or any(not isinstance(p, str) or not p or "." in p for p in path):
            raise FlowDefinitionError(
                f"flow {flow}: ax.wait_for_event match {field!r}: {value!r} is not the input or a task's "
                "output indexed by field names (no list indexes, no dots in a name)")
        if kind == "step" and step is not None:
            if step not in needs:
                needs.append(step)
            return "$" + ".".join(["parents", step, *cast(tuple[str, ...], path)])
        return "$" + ".".join(["input", *cast(tuple[str, ...], path)])
    if _has_value(value):
        raise FlowDefinitionError(f"flow {flow}: ax.wait_for_event match {field!r} holds a run value inside a "
                                  "list or dict; match on each field by its own path")
    _json.dumps(value, f"flow {flow}: ax.wait_for_event match {field!r}")
    if isinstance(value, str) and value.startswith("$"):
        return "$" + value
    return value


def _template(flow: str, what: str, value: Any, needs: list[str]) -> Any:
    """A child's input as the server reads it: run values as ``"$input.a"`` /
    ``"$parents.<step>.a"`` references (their steps needs), in dicts and lists too;
    strings starting with ``$`` escaped; anything else itself (JSON)."""
    if isinstance(value, Value):
        kind, step = value._source  # pyright: ignore[reportPrivateUsage]
        path = value._path  # pyright: ignore[reportPrivateUsage]
        if kind == "item" or any(not isinstance(p, str) or not p or "." in p for p in path):
            raise FlowDefinitionError(f"flow {flow}: {what}: {value!r} is not the input or a task's output indexed "
                                      "by field names (no list indexes, no dots in a name)")
        if kind == "step" and step is not None:
            if step not in needs:
                needs.append(step)
            return "$" + ".".join(["parents", step, *cast(tuple[str, ...], path)])
        return "$" + ".".join(["input", *cast(tuple[str, ...], path)])
    if isinstance(value, dict):
        return {str(k): _template(flow, what, v, needs) for k, v in cast(dict[Any, Any], value).items()}
    if isinstance(value, (list, tuple)):
        return [_template(flow, what, v, needs) for v in cast(list[Any], value)]
    _json.dumps(value, f"flow {flow}: {what}'s input")
    if isinstance(value, str) and value.startswith("$"):
        return "$" + value
    return value


def _ms(what: str, flow: str, value: timedelta | float) -> int:
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not seconds > 0 or seconds == float("inf"):
        raise FlowDefinitionError(f"flow {flow}: {what} must be over 0 s, not {value!r}")
    return max(1, round(seconds * 1000))


def wait_for_event(event: str, /, *, match: Mapping[str, Any] | None = None,
                   timeout: timedelta | float | None = None, on_timeout: str = "fail",
                   lookback: timedelta | float | None = None, queue: str | None = None) -> Any:
    """In an ``@ax.flow`` body: wait for event ``event`` (PROTOCOL.md §6, "Events"),
    published with ``ax.publish_event`` (or on ``ax.events.<event>``), whose payload has the
    values ``match`` names (dotted field path → a constant, the run's input or a task's
    result indexed by field names). Returns the event's payload, to pass to tasks called
    after it; every step called after it starts once it ends. An event published up to
    ``lookback`` (default 5 minutes, at most an hour) before the wait began counts.
    ``timeout`` (default the server's max delay, 30 days) ends it as ``on_timeout`` says:
    ``"fail"`` the step (class ``wait_timed_out``), or ``"continue"`` with ``None``. Held by
    the broker (no process waits), shown ``waiting for event`` by ``ax flow get``."""
    builder = tracing()
    if builder is None:
        raise FlowDefinitionError("ax.wait_for_event is a step of an @ax.flow body; to wait for a task, "
                                  "use its handle")
    flow = builder.flow
    if on_timeout not in ("fail", "continue"):
        raise FlowDefinitionError(f"flow {flow}: on_timeout is 'fail' or 'continue', not {on_timeout!r}")
    needs: list[str] = []
    matches = {str(k): _reference(flow, str(k), v, needs) for k, v in (match or {}).items()}
    spec: dict[str, Any] = {"event": event, "match": matches, "on_timeout": on_timeout}
    if timeout is not None:
        spec["timeout_ms"] = _ms("ax.wait_for_event's timeout", flow, timeout)
    if lookback is not None:
        spec["lookback_ms"] = _ms("ax.wait_for_event's lookback", flow, lookback)
    if queue is not None:
        spec["queue"] = queue
    return builder.wait_for_event(spec, needs)


def approval(message: str | None = None, /, *, timeout: timedelta | float | None = None,
             on_timeout: str = "fail", queue: str | None = None) -> Any:
    """In an ``@ax.flow`` body: wait for someone to approve (PROTOCOL.md §6, "Approvals").
    When the step starts, ax draws a token and announces it on
    ``ax.events.approval.requested`` (with the console's hook URL); whoever holds it
    approves (``Client.approve(token, payload)``, ``ax approval approve``, the hook or the
    console's button) or rejects, once. Returns the decision,
    ``{"decision": "approved", "payload": ...}``, to pass to tasks called after it; every
    step called after it starts once it ends. A rejection fails the step (class
    ``approval_rejected``). ``timeout`` (default the server's max delay) ends it as
    ``on_timeout`` says: ``"fail"`` (class ``approval_timed_out``) or ``"continue"`` with
    ``None``. Held by the broker; ``ax flow get`` shows it ``waiting for approval``."""
    builder = tracing()
    if builder is None:
        raise FlowDefinitionError("ax.approval is a step of an @ax.flow body")
    flow = builder.flow
    if on_timeout not in ("fail", "continue"):
        raise FlowDefinitionError(f"flow {flow}: on_timeout is 'fail' or 'continue', not {on_timeout!r}")
    spec: dict[str, Any] = {"on_timeout": on_timeout}
    if message is not None:
        if _has_value(message) or not isinstance(cast(Any, message), str):
            raise FlowDefinitionError(f"flow {flow}: ax.approval's message is text known when the flow is "
                                      f"defined, not {message!r}")
        spec["message"] = message
    if timeout is not None:
        spec["timeout_ms"] = _ms("ax.approval's timeout", flow, timeout)
    if queue is not None:
        spec["queue"] = queue
    return builder.approval(spec)


def publish_event(name: str, payload: Any = None, *, id: str | None = None,
                  client: Client | AsyncClient | None = None) -> int:
    """Publishes event ``name`` with ``payload`` over ``client`` (default: the process's
    client): ``Client.publish_event``. From a coroutine, use ``AsyncClient.publish_event``."""
    from ._client import Client

    return Client.of(client).publish_event(name, payload, id=id)


class FlowDef(Generic[P]):
    """A function registered with ``@ax.flow``: ``definition()`` is the ax flow it
    describes; ``trigger(input)`` starts a run (``P``: the body's parameter, the run's
    input, or none)."""

    def __init__(self, fn: Callable[P, Any], name: str, failure: str,
                 singleton: str | Callable[..., str] | None = None, on_collision: str = "cancel_new"):
        self.fn: Callable[P, Any] = fn
        self.name = name
        self.failure = failure
        self.singleton = singleton
        self.on_collision = on_collision
        self._definition: dict[str, Any] | None = None
        self._children: dict[str, FlowDef[Any]] = {}
        self.__name__ = getattr(fn, "__name__", name)
        self.__doc__ = fn.__doc__

    def __repr__(self) -> str:
        return f"<ax flow {self.name!r}>"

    def definition(self) -> dict[str, Any]:
        """The flow definition (PROTOCOL.md §6), built once by running the body with
        placeholders; ``FlowDefinitionError`` when the body does what a flow cannot."""
        if self._definition is None:
            if len(self._inputs()) > 1:
                raise FlowDefinitionError(f"flow {self.name}: the body takes the run's input as its one argument")
            builder = _Builder(self.name)
            token = _tracer.set(builder)
            try:
                cast(Callable[..., Any], self.fn)(*([Value(self.name, ("input", None))] if self._inputs() else []))
            finally:
                _tracer.reset(token)
            if not builder.steps:
                raise FlowDefinitionError(f"flow {self.name}: the body calls no @ax.task")
            self._children = builder.children
            self._definition = {"name": self.name, "failure": self.failure, "steps": builder.steps}
        return self._definition

    def child_flows(self) -> list["FlowDef[Any]"]:
        """The flows this one's child flow steps run (stored before it)."""
        self.definition()
        return list(self._children.values())

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Any:
        """In an ``@ax.flow`` body: a child flow step running this flow with the body's
        argument as its input (PROTOCOL.md §6, "Child flows"); returns the child's
        outputs — each of its last steps' results by step name — to pass to tasks called
        after it. ``child(...)`` gives the step a timeout; outside a body, use
        ``trigger``."""
        return self.child(self.input(args, kwargs))

    def child(self, input: Any = None, /, *, timeout: timedelta | float | None = None,
              on_timeout: str = "fail", queue: str | None = None) -> Any:
        """In an ``@ax.flow`` body: a child flow step running this flow with ``input``
        (a run value, a constant, or a dict or list holding run values), ended at
        ``timeout`` (default the server's max delay) as ``on_timeout`` says — ``"fail"``
        (class ``child_timed_out``) or ``"continue"`` with ``None`` — the child then
        cancelled. A child that fails fails the step (class ``child_failed``); the
        parent's cancel cancels the child."""
        return self._child_step(input, False, timeout, on_timeout, queue)

    def map(self, items: Any, /, *, timeout: timedelta | float | None = None, on_timeout: str = "fail",
            queue: str | None = None) -> Any:
        """In an ``@ax.flow`` body: one child run of this flow per item of a task's list
        result (at most 1,000), each item its input; returns the list of the children's
        outputs in item order. Options as ``child``."""
        return self._child_step(items, True, timeout, on_timeout, queue)

    def _child_step(self, input: Any, fan_out: bool, timeout: timedelta | float | None, on_timeout: str,
                    queue: str | None) -> Any:
        builder = tracing()
        if builder is None:
            raise FlowDefinitionError(f"flow {self.name}: calling a flow makes it a child flow step of an @ax.flow "
                                      "body; to start a run, use .trigger()")
        if on_timeout not in ("fail", "continue"):
            raise FlowDefinitionError(f"flow {builder.flow}: on_timeout is 'fail' or 'continue', not {on_timeout!r}")
        spec: dict[str, Any] = {"on_timeout": on_timeout}
        if timeout is not None:
            spec["timeout_ms"] = _ms(f"{self.name}'s timeout", builder.flow, timeout)
        if queue is not None:
            spec["queue"] = queue
        return builder.child(cast("FlowDef[Any]", self), input, fan_out, spec)

    def with_options(self, *, client: Client | AsyncClient | None = None) -> FlowStarter[P]:
        """This flow's runs started through ``client``: ``flow.with_options(client=c).trigger(x)``."""
        return FlowStarter(self, client)

    def trigger(self, *args: P.args, **kwargs: P.kwargs) -> str:
        """Starts a run with the body's argument as its input (None for a body of no
        parameter); returns the run id once ax has stored it. ``trigger(x, client=c)``
        (the older spelling of ``with_options(client=c).trigger(x)``) still works."""
        return self._options_in(kwargs).trigger(*args, **kwargs)

    async def trigger_async(self, *args: P.args, **kwargs: P.kwargs) -> str:
        """``trigger`` as an awaitable."""
        return await self._options_in(kwargs).trigger_async(*args, **kwargs)

    def start_options(self, payload: Any) -> dict[str, Any]:
        """What a start of a run with input ``payload`` carries besides it: its singleton
        key (PROTOCOL.md §6, "Singleton runs"), the function's answer for the input when
        ``singleton`` is one."""
        if self.singleton is None:
            return {}
        key: Any = self.singleton
        if callable(key):
            key = key(payload) if self._inputs() else key()
            if not isinstance(key, str) or not _BATCH_KEY.match(key):
                raise InvalidInput(f"flow {self.name}: singleton gave {key!r}, not 1-64 of A-Z a-z 0-9 _ - . : @",
                                   field="singleton")
        return {"singleton": {"key": key, "on_collision": self.on_collision}}

    def _inputs(self) -> list[inspect.Parameter]:
        return [p for p in inspect.signature(self.fn).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

    def _options_in(self, kwargs: dict[str, Any]) -> FlowStarter[P]:
        """``client=`` among ``trigger``'s keywords unless the body has a parameter so named."""
        if "client" in kwargs and all(p.name != "client" for p in self._inputs()):
            return self.with_options(client=kwargs.pop("client"))
        return self.with_options()

    def input(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The run's input of a ``trigger`` call: its one argument (by position, by the
        body's parameter's name or, the older spelling, as ``payload=``), else None."""
        names = {p.name for p in self._inputs()} | {"payload"}
        given = [*args, *kwargs.values()]
        if len(given) > 1 or any(k not in names for k in kwargs):
            raise InvalidInput(f"flow {self.name}: trigger takes one argument, the run's input, not "
                               f"{len(args)} and the keywords {sorted(kwargs)}", field="input")
        return given[0] if given else None


@dataclass(frozen=True)
class FlowStarter(Generic[P]):
    """``flow.with_options(...)``: runs of ``flow`` started through ``client``."""

    flow: FlowDef[P]
    client: Client | AsyncClient | None = field(default=None, repr=False)

    def trigger(self, *args: P.args, **kwargs: P.kwargs) -> str:
        """Starts a run with the body's argument as its input; returns the run id."""
        from ._client import Client

        return Client.of(self.client).trigger_flow(self.flow, self.flow.input(args, kwargs))

    async def trigger_async(self, *args: P.args, **kwargs: P.kwargs) -> str:
        """``trigger`` as an awaitable."""
        from ._aio import AsyncClient

        payload = self.flow.input(args, kwargs)
        return await (await AsyncClient.of(self.client)).trigger_flow(self.flow, payload)


class FlowDecorator(Protocol):
    """What ``@ax.flow(...)`` with options gives: the decorator of a flow body."""

    def __call__(self, fn: Callable[P, Any], /) -> FlowDef[P]: ...


@overload
def flow(fn: Callable[P, Any], /) -> FlowDef[P]: ...
@overload
def flow(*, name: str | None = None, failure: str = "fail_fast", singleton: str | Callable[..., str] | None = None,
         on_collision: str = "cancel_new") -> FlowDecorator: ...


def flow(fn: Callable[..., Any] | None = None, /, *, name: str | None = None, failure: str = "fail_fast",
         singleton: str | Callable[..., str] | None = None, on_collision: str = "cancel_new") -> Any:
    """Registers a flow: its body, run once with placeholders, calls ``@ax.task``
    functions. ``failure`` is ``fail_fast`` (default) or ``continue``. ``singleton`` (a
    key, or a function of the run's input giving one) lets one run of the key run at a
    time: a start that finds one running is refused (``on_collision="cancel_new"``:
    ``ax.Conflict`` naming it in ``run_id``) or cancels it (``"cancel_in_progress"``)."""

    def register(f: Callable[..., Any]) -> FlowDef:
        if failure not in ("fail_fast", "continue"):
            raise InvalidInput(f"failure must be fail_fast or continue, not {failure!r}", field="failure")
        _check_singleton(singleton, on_collision)
        fd: FlowDef = FlowDef(f, name or f.__name__, failure, singleton, on_collision)
        claim_name(FLOWS, "flow", fd.name, f)
        FLOWS[fd.name] = fd
        return fd

    return register(fn) if fn is not None else register


def _check_singleton(key: Any, on_collision: str) -> None:
    if on_collision not in COLLISIONS:
        raise InvalidInput(f"on_collision must be one of {COLLISIONS}, not {on_collision!r}", field="on_collision")
    if key is None:
        if on_collision != "cancel_new":
            raise InvalidInput("on_collision needs singleton=<key>", field="on_collision")
        return
    if not callable(key) and not (isinstance(key, str) and _BATCH_KEY.match(key)):
        raise InvalidInput("singleton must be 1-64 of A-Z a-z 0-9 _ - . : @, or a function of the run's input, "
                           f"not {key!r}", field="singleton")


def resolve(payload: dict[str, Any], sources: dict[str, Any]) -> dict[str, Any]:
    """The arguments by name of a step's task from its payload (PROTOCOL.md §6): the
    run's input, the parents' outputs (None for a parent that did not succeed), the
    item, constants; ``*args`` as a list of those. ``TaskDef.call_arguments`` makes the
    call of them."""
    out: dict[str, Any] = {}
    for param, spec in sources.items():
        if "list" in spec:
            out[param] = [_resolve(payload, param, s) for s in spec["list"]]
        else:
            out[param] = _resolve(payload, param, spec)
    return out


def _resolve(payload: dict[str, Any], param: str, spec: dict[str, Any]) -> Any:
    if "value" in spec:
        return spec["value"]
    kind = spec.get("from")
    if kind == "input":
        value = payload.get("input")
    elif kind == "step":
        parents: dict[str, Any] = payload.get("parents") or {}
        value = parents.get(spec.get("step") or "")
    elif kind == "item":
        value = payload.get("item")
    else:
        raise InvalidInput(f"argument {param!r}: unknown source {spec!r}", code="bad_payload")
    for key in spec.get("path", ()):
        if value is None:
            break
        try:
            value = value[key]
        except (KeyError, IndexError, TypeError):
            raise InvalidInput(f"argument {param!r}: no {key!r} in {type(value).__name__}",
                               code="bad_payload") from None
    return value
