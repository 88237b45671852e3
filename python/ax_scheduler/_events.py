"""``@ax.on_event`` and ``ax.events()``: ax's alerts (PROTOCOL.md §8) as ``ax.Event``
objects — a task ended ``dead``, a flow run ended ``failed`` — one per (queue, task,
error class) per alert window, as the servers deduplicate them.

A service runs several replicas, and an alert must page once: each runtime subscribes a
handler in a NATS queue group named after it (``ax-python-events.<module>.<qualname>``,
or ``group=``), so one replica gets each alert. ``every_replica=True`` subscribes without
a group: every runtime calls it. Alerts are core NATS messages: one raised while no
runtime listens reaches no handler.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterator, NoReturn, cast

from .errors import InvalidInput

log = logging.getLogger("ax_scheduler")
ALERTS = "ax.events.alert.>"
GROUP_PREFIX = "ax-python-events"
_NAMES = {"task_dead": "task_failed", "flow_failed": "flow_failed"}


@dataclass(frozen=True)
class Event:
    """One alert. ``kind`` is ax's (``task_dead``, ``flow_failed``), ``name`` the
    event's name (``task_failed``, ``flow_failed``); ``task_name`` / ``task_id`` for a
    task, ``flow`` / ``run`` for a flow run; ``payload`` is the alert as published (a
    dict to pass on). Not a dict: ``event["name"]`` raises, since it would be ambiguous."""

    kind: str | None
    queue: str | None = None
    task_name: str | None = None
    task_id: str | None = None
    flow: str | None = None
    run: str | None = None
    error_class: str | None = None
    error_message: str | None = None
    attempts: int | None = None
    suppressed_since_last: int = 0
    link: str | None = None
    group: str | None = None
    at_ms: int | None = None
    raw: dict[str, Any] = field(default_factory=dict[str, Any], repr=False, compare=False, hash=False)

    @classmethod
    def from_alert(cls, alert: dict[str, Any]) -> "Event":
        return cls(
            kind=alert.get("kind"), queue=alert.get("queue"), task_name=alert.get("name"),
            task_id=alert.get("task"), flow=alert.get("flow"), run=alert.get("run"),
            error_class=alert.get("error_class"), error_message=alert.get("error_message"),
            attempts=alert.get("attempts"), suppressed_since_last=alert.get("suppressed_since_last") or 0,
            link=alert.get("link"), group=alert.get("group"), at_ms=alert.get("at_ms"), raw=dict(alert))

    @property
    def name(self) -> str | None:
        """``task_failed`` (a task ended dead), ``flow_failed``; another kind as it is."""
        return _NAMES.get(self.kind or "", self.kind)

    @property
    def payload(self) -> dict[str, Any]:
        """The alert as ax published it (PROTOCOL.md §8)."""
        return dict(self.raw)

    def __getitem__(self, key: object) -> NoReturn:
        raise TypeError(
            f"ax.Event is not a dict (event[{key!r}]): use its attributes — event.task_name is the "
            "task's name, event.name the event's ('task_failed', 'flow_failed'), event.payload the "
            "alert as a dict")


@dataclass(frozen=True)
class Handler:
    """A registered handler: ``group`` is its queue group, None for every replica."""

    fn: Callable[[Event], Any]
    group: str | None


HANDLERS: list[Handler] = []


def default_group(fn: Callable[..., Any]) -> str:
    from ._task import definition_of

    return f"{GROUP_PREFIX}.{re.sub(r'[^A-Za-z0-9_.-]', '_', definition_of(fn))}"


def on_event(fn: Callable[[Event], Any] | None = None, *, every_replica: bool = False,
             group: str | None = None) -> Any:
    """Registers a handler the runtime calls with each alert, as an ``ax.Event``: once per
    alert across the replicas that register it (``group`` names the queue group they
    share), or in every runtime with ``every_replica=True``. A handler's exception is
    logged with its traceback and counted (``Runtime.event_handler_failures``); it never
    affects tasks."""
    if every_replica and group is not None:
        raise InvalidInput("every_replica handlers have no group: give one or the other", field="group")

    def register(f: Callable[[Event], Any]) -> Callable[[Event], Any]:
        from ._task import definition_of

        if not callable(f):
            raise InvalidInput(f"@ax.on_event needs a function, not {f!r}")
        # The same function again (a re-import, importlib.reload) replaces itself.
        HANDLERS[:] = [h for h in HANDLERS if definition_of(h.fn) != definition_of(f)]
        from ._task import refuse_late

        refuse_late(f"event handler {getattr(f, '__qualname__', f)!r}", every=False)
        HANDLERS.append(Handler(f, None if every_replica else group or default_group(f)))
        return f

    return register(fn) if fn is not None else register


async def events(subject: str = ALERTS, client: Any = None) -> AsyncIterator[Event]:
    """The alerts as an async iterator (core NATS: those published while it listens;
    every follower gets each)."""
    from ._client import Client

    sub = (client or Client.default())._conn.subscribe(subject)
    while True:
        event = _decode(await asyncio.to_thread(sub.next, 0.5))
        if event is not None:
            yield event


def follow(sub: Any, poll: float, stop: Callable[[], bool] = lambda: False) -> Iterator[Event]:
    """The events of a subscription (messages that are not JSON objects skipped), until
    ``stop()``."""
    while not stop():
        event = _decode(sub.next(poll))
        if event is not None:
            yield event


def _decode(msg: tuple[str, bytes] | None) -> Event | None:
    """A message's event; None for no message or one that is not a JSON object."""
    if msg is None:
        return None
    try:
        alert = json.loads(msg[1])
    except ValueError:
        log.warning("ax: events: a message on %s is not JSON: skipped", msg[0])
        return None
    return Event.from_alert(cast(dict[str, Any], alert)) if isinstance(alert, dict) else None


class Dispatcher:
    """Follows the alerts for each handler on a thread of its own and calls it;
    ``failures`` counts the handlers' exceptions."""

    def __init__(self, conn: Any, handlers: list[Handler]):
        self.failures = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        for handler in handlers:
            sub = conn.subscribe(ALERTS, queue=handler.group)
            thread = threading.Thread(target=self._run, args=(handler, sub), daemon=True,
                                      name=f"ax-events-{getattr(handler.fn, '__name__', 'handler')}")
            thread.start()
            self._threads.append(thread)

    def _run(self, handler: Handler, sub: Any) -> None:
        try:
            for event in follow(sub, 0.2, self._stop.is_set):
                self._call(handler, event)
        except Exception as e:  # the subscription ended: the connection closed
            level = logging.INFO if self._stop.is_set() else logging.ERROR
            log.log(level, "ax: events for handler %s ended: %s", getattr(handler.fn, "__name__", handler.fn), e)

    def _call(self, handler: Handler, event: Event) -> None:
        try:
            handler.fn(event)
        except Exception:
            with self._lock:
                self.failures += 1
                failures = self.failures
            log.exception("ax: event handler %s failed on %s (%s); handler failures: %d, the runtime goes on",
                          getattr(handler.fn, "__name__", handler.fn), event.name, event.task_id or event.run,
                          failures)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(2)
