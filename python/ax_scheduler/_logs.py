"""Logging: the Rust core's log lines in Python's ``logging``, and a logger per task.

The core's records (a claim that failed, a task dead-lettered, the worker waiting for its
queue) reach the logger ``ax_scheduler.core`` (children by Rust module, e.g.
``ax_scheduler.core.ax_sdk.worker.attempt.finish``), with their fields — a task's id,
name, queue, attempt, business id — in ``extra`` (``record.ax`` holds them all). A thread
of this module takes them from the core's bounded queue: no Rust thread waits for the GIL.

Inside a task, ``ax.context().logger`` is the logger ``ax_scheduler.task.<name>`` with the
attempt's ids in ``extra`` (``ax_task_id``, ``ax_task_name``, ``ax_attempt``,
``ax_flow``, ``ax_run``, ``ax_step``, ``ax_business_id``), and the runtime logs each
attempt's end there (``info`` succeeded, ``warning`` failed and retried, ``error`` failed
for good).
"""

from __future__ import annotations

import atexit
import logging
import threading
from typing import Any

from . import _core

log = logging.getLogger("ax_scheduler")
CORE = "ax_scheduler.core"
# The fields of the core's records copied into `extra` under these names.
_FIELDS = {"task_id": "ax_task_id", "name": "ax_task_name", "queue": "ax_queue", "attempt": "ax_attempt",
           "business_id": "ax_business_id", "trace_id": "ax_trace_id", "class": "ax_error_class"}
_started = threading.Lock()
_relay: threading.Thread | None = None
_stopping = threading.Event()


def relay_core_logs(level: str) -> None:
    """Sends the core's records at ``level`` (``warn``, ``info``, or a filter like
    ``info,ax_sdk=debug``) to ``logging`` from now on; once per process (the core's log
    setup is process-wide: the first call decides)."""
    global _relay
    with _started:
        if _relay is not None:
            return
        if not _core.init_logging(level, True):
            log.info("ax: the core's logging was set up before; its records are not relayed")
            return
        _relay = threading.Thread(target=_drain, args=(_core.LogRelay(),), name="ax-logs", daemon=True)
        _relay.start()
        atexit.register(_stop_relay)


def _stop_relay() -> None:
    """At exit, before the interpreter finalizes: the relay thread waits in the core with
    the GIL released, and a thread that comes back for the GIL during finalization is
    ended by CPython in a way the Rust frames under it cannot unwind through (the
    process aborts: "exception not rethrown"). So it is stopped and joined first."""
    _stopping.set()
    if _relay is not None:
        _relay.join(2)


def _drain(relay: Any) -> None:
    dropped = 0
    while not _stopping.is_set():
        record = relay.next(0.2)
        if record is None:
            now = relay.dropped()
            if now > dropped:
                log.warning("ax: %d log records of the core were dropped (logging did not keep up)", now - dropped)
                dropped = now
            continue
        level, target, message, fields = record
        logger = logging.getLogger(f"{CORE}.{target.replace('::', '.')}")
        if not logger.isEnabledFor(level):
            continue
        extra: dict[str, Any] = {name: fields[key] for key, name in _FIELDS.items() if key in fields}
        extra["ax"] = fields
        text = " ".join([message, *(f"{k}={v}" for k, v in fields.items())])
        logger.log(level, "%s", text, extra=extra)


def task_logger(ctx: Any) -> logging.LoggerAdapter[logging.Logger]:
    """The logger of an attempt: ``ax_scheduler.task.<name>`` with its ids in ``extra``."""
    extra = {"ax_task_id": ctx.id, "ax_task_name": ctx.name, "ax_attempt": ctx.attempt, "ax_flow": ctx.flow,
             "ax_run": ctx.run, "ax_step": ctx.step, "ax_business_id": ctx.business_id}
    return logging.LoggerAdapter(logging.getLogger(f"ax_scheduler.task.{ctx.name}"), extra)
