"""Schedules and rate limits declared in Python, stored as ax triggers (PROTOCOL.md §5)
and limits (§7) when the runtime starts."""

from __future__ import annotations

import re
from typing import Any

from .errors import InvalidInput

SCHEDULES: dict[str, dict[str, Any]] = {}
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*/\s*(s|sec|second|m|min|minute|h|hour)\s*$")
_PER = {"s": 1, "sec": 1, "second": 1, "m": 60, "min": 60, "minute": 60, "h": 3600, "hour": 3600}


def rate(value: Any) -> float:
    """Starts per second from ``"100/s"``, ``"30/m"``, ``"5/h"`` or a number per second."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        per_second = float(value)
    elif isinstance(value, str) and (m := _RATE.match(value)):
        per_second = float(m.group(1)) / _PER[m.group(2)]
    else:
        raise InvalidInput(f"rate_limit must be like '100/s', '30/m', '5/h' or a number per second, not {value!r}",
                           field="rate_limit")
    if not 0.000001 <= per_second <= 100_000:
        raise InvalidInput(f"rate_limit must be within 0.000001..100000 per second, not {per_second}",
                           field="rate_limit")
    return per_second


def trigger(name: str, *, cron: str | None, tz: str | None, every: float | None,
            tasks: list[dict[str, Any]] | None = None, flows: list[dict[str, Any]] | None = None,
            overlap: str | None = None) -> dict[str, Any]:
    """A trigger definition firing ``tasks`` and ``flows`` on ``cron`` (in ``tz``) or
    ``every`` seconds; ``overlap`` says what a fire does while the previous one runs
    (``buffer_one``, the server's default; ``skip``; ``allow``; ``cancel_in_progress``)."""
    from ._options import OVERLAPS

    if (cron is None) == (every is None):
        raise InvalidInput("give cron or every (not both)", field="cron")
    if overlap is not None and overlap not in OVERLAPS:
        raise InvalidInput(f"overlap must be one of {OVERLAPS}, not {overlap!r}", field="overlap")
    t: dict[str, Any] = {"name": name, "tasks": tasks or [], "flows": flows or []}
    if overlap is not None:
        t["overlap"] = overlap
    if cron is not None:
        t.update(kind="cron", expr=cron)
        if tz:
            t["tz"] = tz
    else:
        t.update(kind="interval", every_ms=round(every * 1000))  # type: ignore[operator]
    return t


def schedule(target: Any, *, cron: str | None = None, tz: str | None = None, every: Any = None,
             payload: Any = None, name: str | None = None, overlap: str | None = None) -> dict[str, Any]:
    """Runs ``target`` (an ``@ax.flow`` or ``@ax.task``) on a schedule: a trigger stored
    when the runtime starts (or now, through ``ax.register``). ``every`` in seconds or a
    timedelta; ``payload`` is the flow's input or the task's payload; ``overlap`` what a
    fire does while the previous run still goes (``cancel_in_progress``: cancel it)."""
    from ._flow import FlowDef
    from ._options import seconds
    from ._task import TaskDef

    secs = seconds(every, "every")
    if isinstance(target, FlowDef):
        t = trigger(name or f"{target.name}-schedule", cron=cron, tz=tz, every=secs,
                    flows=[{"flow": target.name, "input": payload}], overlap=overlap)
    elif isinstance(target, TaskDef):
        t = trigger(name or f"{target.name}-schedule", cron=cron, tz=tz, every=secs,
                    tasks=[{"name": target.name, "queue": target.options.queue, "payload": payload}],
                    overlap=overlap)
    else:
        raise InvalidInput(f"schedule() takes an @ax.flow or an @ax.task, not {target!r}")
    SCHEDULES[t["name"]] = t
    return t
