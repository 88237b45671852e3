"""``@ax.on_event`` and ``ax.events()``: ax's alerts (PROTOCOL.md §8) in Python — a task
ended ``dead``, a flow run ended ``failed`` — one per (queue, task, error class) per alert
window, as the servers deduplicate them."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Any, AsyncIterator, Callable, Iterator

log = logging.getLogger("ax_scheduler")
HANDLERS: list[Callable[[dict], Any]] = []
ALERTS = "ax.events.alert.>"


def on_event(fn: Callable[[dict], Any]) -> Callable[[dict], Any]:
    """Registers a handler the runtime calls with each alert (a dict: ``kind``
    ``task_dead`` / ``flow_failed``, ``queue``, ``name`` or ``flow``, ``task`` or ``run``,
    ``error_class``, ``error_message``, ``attempts``, ``suppressed_since_last``, ``link``).
    A handler's own exception is logged and never affects tasks."""
    HANDLERS.append(fn)
    return fn


async def events(subject: str = ALERTS, client: Any = None) -> AsyncIterator[dict]:
    """The alerts as an async iterator (core NATS: those published while it listens)."""
    from ._client import Client

    sub = (client or Client.default())._conn.subscribe(subject)
    while True:
        event = _decode(await asyncio.to_thread(sub.next, 0.5))
        if event is not None:
            yield event


def follow(sub: Any, poll: float, stop: Callable[[], bool] = lambda: False) -> Iterator[dict]:
    """The JSON messages of a subscription (others skipped), until ``stop()``."""
    while not stop():
        event = _decode(sub.next(poll))
        if event is not None:
            yield event


def _decode(msg: tuple[str, bytes] | None) -> dict | None:
    """A message's JSON object; None for no message or one that is not JSON."""
    if msg is None:
        return None
    try:
        return json.loads(msg[1])
    except ValueError:
        return None


class Dispatcher:
    """Follows the alerts on a thread and calls every registered handler."""

    def __init__(self, conn: Any, handlers: list[Callable[[dict], Any]]):
        self._sub = conn.subscribe(ALERTS)
        self._handlers = list(handlers)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ax-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for event in follow(self._sub, 0.2, self._stop.is_set):
                for handler in self._handlers:
                    try:
                        handler(event)
                    except Exception:
                        log.exception("ax: event handler %s failed", getattr(handler, "__name__", handler))
        except Exception as e:  # the connection closed
            log.info("ax: events: %s", e)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)
