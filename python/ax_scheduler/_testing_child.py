"""The test mode's child flow steps (``ax.testing.run_flow`` of a flow whose body calls
another ``@ax.flow``): each child runs to its end when its step starts, on a fake clock of
its own that starts at the parent's time (so a fan-out's children run side by side), by
the same rules as its parent. The step then ends when the child ended, or at its timeout
if that came first: succeeded with the child's leaf outputs by step name, failed (class
``child_failed``), or as ``on_timeout`` says (``child_timed_out``, or ``None`` with
``continue``). The child's waits meet no events or approvals: give those to a run of the
child itself. As the server does (crates/ax-server/src/flow/child_runs.rs): at most
1,000 children per step, 8 levels deep (``too_deep``), an unknown flow fails the step
(``unknown_flow``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, cast

from . import _flow
from ._testing_wait import MAX_DELAY_MS
from .errors import NonRetryable

CHILD_TASK = "ax.child_flow"
MAX_CHILD_RUNS = 1_000
MAX_FLOW_DEPTH = 8


class Ended(Protocol):
    """What a child run's result gives its step."""

    state: str
    reason: str | None

    @property
    def leaf_outputs(self) -> dict[str, Any]: ...

    @property
    def ended_ms(self) -> int: ...


class BadInput(Exception):
    """A child's input names what the step's input lacks (the step fails, ``bad_input``)."""


def check(i: int, step: dict[str, Any], bad: Callable[[str, str], Exception]) -> None:
    """A child flow step as the server checks it."""
    child: dict[str, Any] = step["child_flow"]
    field = f"steps[{i}].child_flow"
    if any(k in step for k in ("sleep", "wait_for_event", "approval")):
        raise bad(field, "a step sleeps, waits for an event, for an approval or for a child flow: one of them")
    name = child.get("flow")
    if not isinstance(name, str) or not 0 < len(name) <= 64 or not all(c.isalnum() or c in "_-" for c in name) \
            or not name.isascii():
        raise bad(f"{field}.flow", "must be 1..=64 of A-Z a-z 0-9 _ -")
    timeout = child.get("timeout_ms")
    if timeout is not None and not (isinstance(timeout, int) and 0 < timeout <= MAX_DELAY_MS):
        raise bad(f"{field}.timeout_ms", f"must be 1..={MAX_DELAY_MS} (the server's max delay)")
    if child.get("on_timeout", "fail") not in ("fail", "continue"):
        raise bad(f"{field}.on_timeout", "fail or continue")
    if "task" in step:
        raise bad(f"steps[{i}].task", "a child flow step has no task")


def resolve_input(template: Any, doc: dict[str, Any]) -> Any:
    """``template`` with each ``"$…"`` string read from the step's input document
    (``"$$…"`` is the literal ``"$…"``), in dicts and lists too."""
    if isinstance(template, str) and template.startswith("$$"):
        return template[1:]
    if isinstance(template, str) and template.startswith("$"):
        value: Any = doc
        for part in template[1:].split("."):
            if not isinstance(value, dict) or part not in value:
                raise BadInput(f"child_flow.input: {template!r} names nothing in the step's input")
            value = cast(dict[str, Any], value)[part]
        return value
    if isinstance(template, dict):
        return {k: resolve_input(v, doc) for k, v in cast(dict[str, Any], template).items()}
    if isinstance(template, list):
        return [resolve_input(v, doc) for v in cast(list[Any], template)]
    return template


def template_of(step: dict[str, Any]) -> Any:
    child: dict[str, Any] = step["child_flow"]
    if child.get("input") is not None:
        return child["input"]
    return "$item" if step.get("for_each") is not None else "$input"


@dataclass(frozen=True)
class Outcome:
    """When a child step's item ends, and the function its wait task runs then."""

    due_ms: int
    end: Callable[..., Any]


def outcome(step: dict[str, Any], doc: dict[str, Any], started_ms: int, depth: int,
            run: Callable[[dict[str, Any], Any], Ended]) -> Outcome:
    """Runs the child of one item of child flow step ``step`` (input document ``doc``;
    ``run(definition, input)`` runs a child one level deeper) and says how its item ends."""
    child: dict[str, Any] = step["child_flow"]
    until = started_ms + int(child.get("timeout_ms", MAX_DELAY_MS))

    def failing(cls: str, message: str) -> Outcome:
        def fail(*args: Any, **kwargs: Any) -> Any:
            raise NonRetryable(message, error_class=cls)
        return Outcome(started_ms, fail)

    if depth + 1 > MAX_FLOW_DEPTH:
        return failing("too_deep", f"child flows nest at most {MAX_FLOW_DEPTH} levels deep")
    fd = _flow.FLOWS.get(child["flow"])
    if fd is None:
        return failing("unknown_flow", f"no flow {child['flow']!r} is defined")
    ended = run(fd.definition(), resolve_input(template_of(step), doc))
    if ended.ended_ms > until:
        if child.get("on_timeout", "fail") == "continue":
            return Outcome(until, lambda *args, **kwargs: None)  # pyright: ignore[reportUnknownLambdaType]

        def timed_out(*args: Any, **kwargs: Any) -> Any:
            raise NonRetryable("the child flow run did not end before the step's timeout",
                               error_class="child_timed_out")
        return Outcome(until, timed_out)
    if ended.state == "succeeded":
        out = ended.leaf_outputs
        return Outcome(ended.ended_ms, lambda *args, **kwargs: out)  # pyright: ignore[reportUnknownLambdaType]
    reason = f"child run of flow {child['flow']!r} failed: {ended.reason}"

    def failed(*args: Any, **kwargs: Any) -> Any:
        raise NonRetryable(reason, error_class="child_failed")
    return Outcome(ended.ended_ms, failed)
