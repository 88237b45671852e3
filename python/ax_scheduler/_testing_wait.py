"""The test mode's waits for events (``ax.testing.run_flow(..., events=...)``) and
approvals (``approvals=...``): a wait
step meets the first given event of its name whose payload has the values its ``match``
names, as the server's matcher does (crates/ax-server/src/flow/waits.rs resolves the
match; crates/ax-core/src/wire/event.rs compares): ``"$input.a"`` and
``"$parents.<step>.b"`` are read from the step's input document, ``"$$x"`` is ``"$x"``.

Events are published at the run's start, or ``after`` a time from it (seconds or a
``timedelta``) on the fake clock. A wait meets an event published from ``lookback``
before its start until its timeout; none met, it times out: ``fail`` (class
``wait_timed_out``) or ``continue`` (output ``None``).

An approval step is decided by ``approvals[step]``: ``("approve", payload)`` (its output
``{"decision": "approved", "payload": payload}``) or ``("reject", reason)`` (it fails,
class ``approval_rejected``), with an optional third item ``after`` from the step's
start; one not given, or given after its timeout, times out (``approval_timed_out``, or
``None`` with ``continue``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterable, cast

from .errors import InvalidInput, NonRetryable

# A wait for an event's and an approval's wait tasks (crates/ax-sdk/src/flow/def.rs).
WAIT_TASK = "ax.wait_for_event"
APPROVAL_TASK = "ax.approval"
DEFAULT_LOOKBACK_MS = 300_000
MAX_LOOKBACK_MS = 3_600_000
MAX_DELAY_MS = 30 * 24 * 3600 * 1000


@dataclass(frozen=True)
class Published:
    """An event given to ``run_flow``: its name, payload and time on the fake clock."""

    name: str
    payload: Any
    at_ms: int


def published(events: Iterable[Any] | None, start_ms: int) -> list[Published]:
    """``events``: ``(name, payload)`` or ``(name, payload, after)`` items, in the order
    they were published."""
    out: list[Published] = []
    for k, event in enumerate(events or ()):
        if not isinstance(event, tuple) or len(cast(tuple[Any, ...], event)) not in (2, 3):
            raise InvalidInput(f"events[{k}]: give (name, payload) or (name, payload, after), not {event!r}")
        item = cast(tuple[Any, ...], event)
        after = item[2] if len(item) == 3 else 0
        seconds = after.total_seconds() if isinstance(after, timedelta) else float(after)
        if not seconds >= 0:
            raise InvalidInput(f"events[{k}]: after must be 0 s or more, not {after!r}")
        payload = json.loads(json.dumps(item[1]))  # as it travels: JSON
        out.append(Published(str(item[0]), payload, start_ms + round(seconds * 1000)))
    return sorted(out, key=lambda e: e.at_ms)  # stable: the given order within one time


def check(i: int, step: dict[str, Any], bad: Callable[[str, str], Exception]) -> None:
    """A wait for an event as the server checks it."""
    wait: dict[str, Any] = step["wait_for_event"]
    field = f"steps[{i}].wait_for_event"
    if "sleep" in step:
        raise bad(field, "a step sleeps or waits for an event, not both")
    name = wait.get("event")
    tokens = name.split(".") if isinstance(name, str) else [""]
    if len(tokens) > 8 or not all(t and all(c.isalnum() or c in "_-" for c in t) and t.isascii() for t in tokens):
        raise bad(f"{field}.event", "1..=8 dot-separated tokens of A-Z a-z 0-9 _ -")
    for path in cast(dict[str, Any], wait.get("match") or {}):
        if not path or any(not p for p in path.split(".")):
            raise bad(f"{field}.match", f"{path!r} is not a dotted field path")
    timeout = wait.get("timeout_ms")
    if timeout is not None and not (isinstance(timeout, int) and 0 < timeout <= MAX_DELAY_MS):
        raise bad(f"{field}.timeout_ms", f"must be 1..={MAX_DELAY_MS} (the server's max delay)")
    if int(wait.get("lookback_ms", DEFAULT_LOOKBACK_MS)) > MAX_LOOKBACK_MS:
        raise bad(f"{field}.lookback_ms", f"at most {MAX_LOOKBACK_MS} (an hour)")
    if wait.get("on_timeout", "fail") not in ("fail", "continue"):
        raise bad(f"{field}.on_timeout", "fail or continue")
    if "task" in step:
        raise bad(f"steps[{i}].task", "a wait for an event has no task")
    if step.get("for_each") is not None:
        raise bad(f"steps[{i}].for_each", "a wait for an event does not fan out")


class BadMatch(Exception):
    """A match names what the step's input lacks (the step fails, class ``bad_match``)."""


def _field(doc: Any, path: str) -> tuple[bool, Any]:
    for part in path.split("."):
        if not isinstance(doc, dict) or part not in doc:
            return False, None
        doc = cast(dict[str, Any], doc)[part]
    return True, doc


def _same(a: Any, b: Any) -> bool:
    """JSON equality as the server compares (``1`` is not ``1.0``, ``true`` is not ``1``)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def resolve(match: dict[str, Any], doc: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, want in match.items():
        if isinstance(want, str) and want.startswith("$$"):
            want = want[1:]
        elif isinstance(want, str) and want.startswith("$"):
            found, want = _field(doc, want[1:])
            if not found:
                raise BadMatch(f"match {path!r}: {match[path]!r} names nothing in the step's input")
        out[path] = want
    return out


def meet(wait: dict[str, Any], doc: dict[str, Any], events: list[Published],
         started_ms: int) -> tuple[int, Callable[..., Any]]:
    """When wait step's task ends and what it does then: return the event's payload, or
    time out by the policy."""
    want = resolve(cast(dict[str, Any], wait.get("match") or {}), doc)
    since = started_ms - int(wait.get("lookback_ms", DEFAULT_LOOKBACK_MS))
    until = started_ms + int(wait.get("timeout_ms", MAX_DELAY_MS))
    for e in events:
        if e.name != wait["event"] or not since <= e.at_ms <= until:
            continue
        if all(_field(e.payload, p)[0] and _same(_field(e.payload, p)[1], v) for p, v in want.items()):
            payload = e.payload
            return max(e.at_ms, started_ms), lambda *args, **kwargs: payload  # pyright: ignore[reportUnknownLambdaType]
    if wait.get("on_timeout", "fail") == "continue":
        return until, lambda *args, **kwargs: None  # pyright: ignore[reportUnknownLambdaType]

    def timed_out(*args: Any, **kwargs: Any) -> Any:
        raise NonRetryable("no matching event came before the wait's timeout", error_class="wait_timed_out")

    return until, timed_out


def check_approval(i: int, step: dict[str, Any], bad: Callable[[str, str], Exception]) -> None:
    """An approval as the server checks it."""
    approval: dict[str, Any] = step["approval"]
    field = f"steps[{i}].approval"
    if "sleep" in step or "wait_for_event" in step:
        raise bad(field, "a step sleeps, waits for an event or waits for an approval: one of them")
    message = approval.get("message")
    if message is not None and len(str(message).encode()) > 1000:
        raise bad(f"{field}.message", "at most 1,000 bytes")
    timeout = approval.get("timeout_ms")
    if timeout is not None and not (isinstance(timeout, int) and 0 < timeout <= MAX_DELAY_MS):
        raise bad(f"{field}.timeout_ms", f"must be 1..={MAX_DELAY_MS} (the server's max delay)")
    if approval.get("on_timeout", "fail") not in ("fail", "continue"):
        raise bad(f"{field}.on_timeout", "fail or continue")
    if "task" in step:
        raise bad(f"steps[{i}].task", "an approval step has no task")
    if step.get("for_each") is not None:
        raise bad(f"steps[{i}].for_each", "an approval step does not fan out")


def decide(approval: dict[str, Any], given: Any, started_ms: int) -> tuple[int, Callable[..., Any]]:
    """When an approval step's task ends and what it does then, by ``given`` (an item of
    ``run_flow``'s ``approvals``, or None)."""
    until = started_ms + int(approval.get("timeout_ms", MAX_DELAY_MS))
    if given is not None:
        if not isinstance(given, tuple) or len(cast(tuple[Any, ...], given)) not in (2, 3) \
                or cast(tuple[Any, ...], given)[0] not in ("approve", "reject"):
            raise InvalidInput(f"approvals: give ('approve', payload) or ('reject', reason), with an optional "
                               f"after, not {given!r}")
        item = cast(tuple[Any, ...], given)
        after = item[2] if len(item) == 3 else 0
        seconds = after.total_seconds() if isinstance(after, timedelta) else float(after)
        if not seconds >= 0:
            raise InvalidInput(f"approvals: after must be 0 s or more, not {after!r}")
        at = started_ms + round(seconds * 1000)
        if at <= until:
            if item[0] == "approve":
                output = {"decision": "approved", "payload": json.loads(json.dumps(item[1]))}
                return at, lambda *args, **kwargs: output  # pyright: ignore[reportUnknownLambdaType]
            reason = "rejected" if item[1] is None else str(item[1])

            def rejected(*args: Any, **kwargs: Any) -> Any:
                raise NonRetryable(reason, error_class="approval_rejected")

            return at, rejected
    if approval.get("on_timeout", "fail") == "continue":
        return until, lambda *args, **kwargs: None  # pyright: ignore[reportUnknownLambdaType]

    def timed_out(*args: Any, **kwargs: Any) -> Any:
        raise NonRetryable("no one approved or rejected before the approval's timeout",
                           error_class="approval_timed_out")

    return until, timed_out
