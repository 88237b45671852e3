"""The test mode's flow runs (``ax.testing.run_flow``): a flow run driven in this process
by the rules of the server's flow engine, each step's tasks run as ``ax.testing.run``
runs a task.

The rules are ported from the server, not re-invented: ``advance`` is
crates/ax-server/src/flow/advance.rs (the engine's pure state machine: trigger rules,
``notify_only``, fail-fast, the run's end and reason), ``_payloads`` is
crates/ax-server/src/flow/input.rs (a step task's payload: input, parents, errors, item,
index, args; ``bad_fan_out``, ``fan_out_too_large``, ``input_too_large``), ``_plan`` the
checks and the order of crates/ax-sdk/src/flow/def.rs. The Python side of each step is
ax's own: ``_attempt.prepare`` rebuilds the call with ``_flow.resolve`` and
``TaskDef.call_arguments``.

Time: attempts take no time on the fake clock. The engine starts every step it can, then
runs the attempts due now one after another (in step order, then item order; in a real
run they run side by side), then looks again; a retry waits its backoff delay on the
fake clock. So a fail-fast cancels exactly the tasks that wait for a retry when a step
fails — what it cancels in a real run, where attempts also take time, can be more.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import random
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Iterable, Mapping, cast

from . import _json, _testing_child as _child, _testing_wait as _wait
from ._options import TaskOptions
from ._task import REGISTRY, TaskDef
from ._testing_task import FakeClock, Policy, Result, Runner, TaskRun, output_value, typed_output
from .errors import FlowDefinitionError, FlowFailed, InvalidInput

log = logging.getLogger("ax_scheduler.testing")

# A sleep step's wait task (crates/ax-sdk/src/flow/def.rs): here a no-op run at the wake
# time on the fake clock, its output null, as the server's dispatcher ends it.
SLEEP_TASK = "ax.sleep"
# The kinds of steps whose task is a wait task ax runs itself.
WAITS = ("sleep", "wait_for_event", "approval", "child_flow")


def _woke(*args: Any, **kwargs: Any) -> None:
    return None


_SLEEP: TaskDef[..., Any] = TaskDef(_woke, SLEEP_TASK, TaskOptions(retries=0))

MAX_STEPS = 1_000
MAX_NEEDS = 64
MAX_FAN_OUT = 10_000
TERMINAL = frozenset({"succeeded", "failed", "upstream_failed", "skipped", "cancelled"})
FAILURE = frozenset({"failed", "upstream_failed"})
TRIGGERS = ("all_success", "all_done", "one_failed")
# Fields of a step's task template (a submit request, PROTOCOL.md §6) the test mode
# applies; the server refuses the second set in a template.
TEMPLATE_FIELDS = frozenset({"name", "queue", "payload", "priority", "max_attempts", "timeout_ms", "backoff",
                             "retry_on", "no_retry_on"})
TEMPLATE_REFUSED = frozenset({"delay_ms", "run_at", "idempotency_key", "payload_base64"})


@dataclass
class StepResult:
    """One step of a flow run: its ``state`` (``succeeded``, ``failed``,
    ``upstream_failed``, ``skipped``, ``cancelled``; ``waiting`` / ``running`` only if the
    run did not end), its ``output`` typed back by the task's return annotation (a list in
    item order for a fan-out step; None unless it succeeded), ``raw_output`` as its children
    get it, ``error`` (``{"class", "message", …}``) when it did not succeed, ``items``
    (its tasks), ``attempts`` (most attempts of any of its tasks) and, in the test mode,
    ``tasks``: each task's ``Result``."""

    name: str
    task: str
    state: str
    output: Any = None
    raw_output: Any = None
    error: dict[str, Any] | None = None
    items: int | None = None
    attempts: int | None = None
    tasks: list[Result] = field(default_factory=list[Result], repr=False)

    @property
    def error_class(self) -> str | None:
        return None if self.error is None else self.error.get("class")

    @property
    def error_message(self) -> str | None:
        return None if self.error is None else self.error.get("message")


@dataclass
class FlowResult:
    """A flow run: its ``state`` (``succeeded``, ``failed``) and ``reason`` as the server
    writes them, and each step's ``StepResult`` by step name, in definition order."""

    flow: str
    run: str
    state: str
    reason: str | None
    input: Any
    steps: dict[str, StepResult]
    clock: FakeClock | None = field(default=None, repr=False)

    @property
    def succeeded(self) -> bool:
        return self.state == "succeeded"

    @property
    def states(self) -> dict[str, str]:
        """Each step's state by name."""
        return {name: s.state for name, s in self.steps.items()}

    @property
    def outputs(self) -> dict[str, Any]:
        """The outputs of the steps that succeeded, by step name (a fan-out step's as the
        list of its tasks' outputs)."""
        return {name: s.output for name, s in self.steps.items() if s.state == "succeeded"}

    def result(self) -> dict[str, Any]:
        """``outputs`` once the run succeeded; ``ax.FlowFailed`` otherwise (as
        ``Client.flow_result``)."""
        if self.state != "succeeded":
            raise FlowFailed(f"flow run {self.run} ended {self.state}: {self.reason}",
                             {"run": self.run, "flow": self.flow, "state": self.state, "reason": self.reason})
        return self.outputs


# -- the definition -----------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    parents: list[list[int]]
    order: list[int]


def _bad(field_name: str, message: str) -> FlowDefinitionError:
    return FlowDefinitionError(message, code="invalid_field", field=field_name)


def plan(definition: dict[str, Any]) -> Plan:
    """The checks of a definition that the server makes before it stores it, and its
    steps' order, parents first (crates/ax-sdk/src/flow/def.rs)."""
    failure = definition.get("failure", "fail_fast")
    if failure not in ("fail_fast", "continue"):
        raise _bad("failure", f"failure must be fail_fast or continue, not {failure!r}")
    steps: list[dict[str, Any]] = definition.get("steps") or []
    if not 1 <= len(steps) <= MAX_STEPS:
        raise _bad("steps", f"give 1..={MAX_STEPS} steps")
    index: dict[str, int] = {}
    for i, step in enumerate(steps):
        if step["name"] in index:
            raise _bad(f"steps[{i}].name", f"step {step['name']!r} is defined twice")
        index[step["name"]] = i
    parents: list[list[int]] = []
    for i, step in enumerate(steps):
        needs: list[str] = step.get("needs") or []
        if len(needs) > MAX_NEEDS:
            raise _bad(f"steps[{i}].needs", f"at most {MAX_NEEDS} parents")
        mine: list[int] = []
        for need in needs:
            if need not in index:
                raise _bad(f"steps[{i}].needs", f"unknown step {need!r}")
            if index[need] in mine:
                raise _bad(f"steps[{i}].needs", f"step {need!r} is listed twice")
            mine.append(index[need])
        over: str | None = step.get("for_each")
        if over is not None and over not in needs:
            raise _bad(f"steps[{i}].for_each", f"{over!r} must be one of the step's needs")
        trigger: str = step.get("trigger", "all_success")
        if trigger not in TRIGGERS:
            raise _bad(f"steps[{i}].trigger", f"trigger must be one of {TRIGGERS}, not {trigger!r}")
        if trigger == "one_failed" and not needs:
            raise _bad(f"steps[{i}].trigger", "one_failed needs at least one parent")
        if step.get("on_failure", "fail") not in ("fail", "notify_only"):
            raise _bad(f"steps[{i}].on_failure", f"on_failure must be fail or notify_only, not "
                                                 f"{step.get('on_failure')!r}")
        if "wait_for_event" in step:
            _wait.check(i, step, _bad)
            parents.append(mine)
            continue
        if "approval" in step:
            _wait.check_approval(i, step, _bad)
            parents.append(mine)
            continue
        if "child_flow" in step:
            _child.check(i, step, _bad)
            parents.append(mine)
            continue
        if "sleep" in step:
            _check_sleep(i, step)
            parents.append(mine)
            continue
        template: dict[str, Any] = step.get("task") or {}
        for key in template:
            if key in TEMPLATE_REFUSED:
                raise _bad(f"steps[{i}].task.{key}", f"a step's task cannot have {key} (PROTOCOL.md §6)")
            if key not in TEMPLATE_FIELDS:
                raise NotImplementedError(f"ax.testing.run_flow: steps[{i}].task.{key} is not modelled by the test "
                                          "mode (run the flow through a broker: the ax_local fixture)")
        if not template.get("queue"):
            raise _bad(f"steps[{i}].task.queue", "a valid queue is required")
        parents.append(mine)
    return Plan(parents, _topological(steps, parents))


def _check_sleep(i: int, step: dict[str, Any]) -> None:
    """A sleep step as the server checks it: one of ``for_ms`` and ``until``, no task of its
    own, no fan-out."""
    sleep: dict[str, Any] = step["sleep"]
    if ("for_ms" in sleep) == ("until" in sleep):
        raise _bad(f"steps[{i}].sleep", "give for_ms or until, one of them")
    if "for_ms" in sleep and not (isinstance(sleep["for_ms"], int) and sleep["for_ms"] > 0):
        raise _bad(f"steps[{i}].sleep.for_ms", f"must be a positive number of ms, not {sleep['for_ms']!r}")
    if "task" in step:
        raise _bad(f"steps[{i}].task", "a sleep step has no task")
    if step.get("for_each") is not None:
        raise _bad(f"steps[{i}].for_each", "a sleep step does not fan out")


def _topological(steps: list[dict[str, Any]], parents: list[list[int]]) -> list[int]:
    """Parents first, depth-first over parents from each step in definition order (the
    server's order); a cycle is refused naming its steps."""
    new, open_, done = 0, 1, 2
    mark = [new] * len(steps)
    order: list[int] = []
    for start in range(len(steps)):
        if mark[start] != new:
            continue
        stack: list[list[int]] = [[start, 0]]
        mark[start] = open_
        while stack:
            step, nxt = stack[-1]
            if nxt < len(parents[step]):
                stack[-1][1] += 1
                p = parents[step][nxt]
                if mark[p] == new:
                    mark[p] = open_
                    stack.append([p, 0])
                elif mark[p] == open_:
                    at = next(k for k, s in enumerate(stack) if s[0] == p)
                    cycle = [steps[s[0]]["name"] for s in reversed(stack[at:])] + [steps[step]["name"]]
                    raise _bad(f"steps[{step}].needs", "cycle: " + " → ".join(cycle))
            else:
                mark[step] = done
                order.append(step)
                stack.pop()
    return order


# -- the engine's state machine (advance.rs) ---------------------------------------------


@dataclass
class StepRecord:
    state: str = "waiting"
    error: dict[str, Any] | None = None
    items: int | None = None
    attempts: int | None = None
    started_at_ms: int | None = None
    finished_at_ms: int | None = None


@dataclass
class Progress:
    """How the tasks of one running step have ended so far."""

    total: int | None = None
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0
    first_error: tuple[int, dict[str, Any]] | None = None  # (item, error)
    attempts: int = 0

    def finished(self) -> bool:
        return self.total is not None and self.succeeded + self.failed + self.cancelled >= self.total


@dataclass
class Advance:
    changed: list[int] = field(default_factory=list[int])
    start: list[int] = field(default_factory=list[int])
    cancel_queued: list[int] = field(default_factory=list[int])
    end: tuple[str, str] | None = None


def _why(cls: str, message: str) -> dict[str, Any]:
    return {"class": cls, "message": message}


def advance(definition: dict[str, Any], p: Plan, cancel: bool, steps: list[StepRecord], progress: list[Progress],
            now_ms: int) -> Advance:
    """Moves the run on as far as the facts allow (advance.rs ``advance``)."""
    defs = definition["steps"]
    out = Advance()
    for i, step in enumerate(steps):
        pr = progress[i]
        if step.state != "running" or not pr.finished():
            continue
        if pr.failed > 0:
            step.state = "failed"
            step.error = pr.first_error[1] if pr.first_error else None
        elif pr.cancelled > 0:
            step.state, step.error = "cancelled", _why("cancelled", f"{pr.cancelled} task(s) cancelled")
        else:
            step.state, step.error = "succeeded", None
        step.attempts = pr.attempts
        step.finished_at_ms = now_ms
        out.changed.append(i)
    if cancel:
        for i, step in enumerate(steps):
            if step.state in TERMINAL:
                continue
            if step.state == "running":
                out.cancel_queued.append(i)
            step.state, step.error = "cancelled", _why("cancelled", "the run was cancelled")
            step.finished_at_ms = now_ms
            out.changed.append(i)
    fail_fast = definition.get("failure", "fail_fast") == "fail_fast"

    def tolerated(k: int) -> bool:
        return steps[k].state == "failed" and defs[k].get("on_failure") == "notify_only"

    def counts_failed(k: int) -> bool:
        return steps[k].state == "failed" and not tolerated(k)

    first_failed = next((k for k in range(len(steps)) if counts_failed(k)), None)
    for i in p.order:
        if steps[i].state != "waiting":
            continue
        mine = p.parents[i]
        all_done = all(steps[k].state in TERMINAL for k in mine)

        def ok(k: int) -> bool:
            return steps[k].state == "succeeded" or tolerated(k)

        failed_parent = next((k for k in mine if steps[k].state in FAILURE and not tolerated(k)), None)
        all_ok = all(ok(k) for k in mine)
        trigger = defs[i].get("trigger", "all_success")
        nxt: str | None = None
        error: dict[str, Any] | None = None
        if trigger == "all_success":
            if failed_parent is not None:
                nxt = "upstream_failed"
                error = _why("upstream_failed", f"parent {json.dumps(defs[failed_parent]['name'])} "
                                                f"{steps[failed_parent].state}")
            elif fail_fast and first_failed is not None:
                nxt = "cancelled"
                error = _why("fail_fast", f"step {json.dumps(defs[first_failed]['name'])} failed and the flow "
                                          "fails fast")
            elif all_ok:
                nxt = "running"
            elif all_done:
                k = next(k for k in mine if not ok(k))
                nxt = "cancelled" if steps[k].state == "cancelled" else "skipped"
                error = _why("upstream_not_succeeded", f"parent {json.dumps(defs[k]['name'])} {steps[k].state}")
        elif trigger == "all_done":
            nxt = "running" if all_done else None
        elif trigger == "one_failed":
            if failed_parent is not None:
                nxt = "running"
            elif all_done:
                nxt, error = "skipped", _why("skipped", "no parent failed (trigger one_failed)")
        else:
            raise NotImplementedError(f"ax.testing.run_flow: trigger {trigger!r}")
        if nxt is None:
            continue
        step = steps[i]
        step.state, step.error = nxt, error
        if nxt == "running":
            step.items, step.started_at_ms, step.finished_at_ms, step.attempts = None, now_ms, None, None
            out.start.append(i)
        else:
            step.finished_at_ms = now_ms
        out.changed.append(i)
    if fail_fast and first_failed is not None:
        for i, step in enumerate(steps):
            if step.state == "running" and defs[i].get("trigger", "all_success") == "all_success" \
                    and i not in out.start:
                out.cancel_queued.append(i)
    if all(s.state in TERMINAL for s in steps):
        if cancel:
            out.end = ("cancelled", "cancelled on request")
        elif (f := next((k for k in range(len(steps)) if counts_failed(k)), None)) is not None:
            e = steps[f].error
            detail = f": {e['class']}: {e['message']}" if e else ""
            out.end = ("failed", f"step {json.dumps(defs[f]['name'])} failed{detail}")
        else:
            n = len([s for s in steps if s.state != "succeeded"])
            out.end = ("succeeded", "every step succeeded" if n == 0 else f"no step failed ({n} skipped or cancelled)")
    return out


# -- the run ------------------------------------------------------------------------------


class StepBuildError(Exception):
    """A step that cannot start (its error fails the step, never the run's driver)."""

    def __init__(self, cls: str, message: str) -> None:
        super().__init__(message)
        self.error = _why(cls, message)


@dataclass
class _Job:
    step: int
    item: int
    run: TaskRun


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an object" if isinstance(value, dict) else "an array"


@dataclass
class _ChildEnd:
    """How a child run ended, as its parent step sees it."""

    state: str
    reason: str | None
    leaf_outputs: dict[str, Any]
    ended_ms: int


class FlowSim:
    """One flow run in this process (see the module's doc)."""

    def __init__(self, definition: dict[str, Any], input: Any, *, run_id: str, clock: FakeClock,
                 rng: random.Random | None, replace: Mapping[str, Any] | None, runner: Runner,
                 business_id: str | None = None, events: Iterable[Any] | None = None,
                 approvals: Mapping[str, Any] | None = None, depth: int = 0) -> None:
        self.business_id = business_id
        self.depth = depth  # how deep a child run this is
        self.replace = replace
        self.events = _wait.published(events, clock.now_ms())
        self.approvals = dict(approvals or {})
        self._wait_due: dict[int, int] = {}
        self._child_due: dict[tuple[int, int], int] = {}
        self.definition = json.loads(json.dumps(definition))  # a copy, as the run keeps it
        self.plan = plan(self.definition)
        # The run's input travels as JSON (the `run` request), dataclasses and models included.
        self.input = _json.loads(_json.dumps(input, f"the input of a run of flow {definition.get('name')}"))
        self.run_id = run_id
        self.clock = clock
        self.rng = rng
        self.runner = runner
        self.defs: list[dict[str, Any]] = self.definition["steps"]
        self.tasks: list[TaskDef[..., Any]] = [self._task_of(i, self._template(i), replace or {})
                                               for i in range(len(self.defs))]
        n = len(self.defs)
        self.steps = [StepRecord() for _ in range(n)]
        self.progress = [Progress() for _ in range(n)]
        self.jobs: list[list[_Job]] = [[] for _ in range(n)]
        self.queued_cancelled = [False] * n
        self._due: list[tuple[int, int, int, int]] = []  # (due ms, step order, item, seq)
        self._seq = itertools.count()
        self._rank = {step: k for k, step in enumerate(self.plan.order)}
        self._pending: dict[tuple[int, int], _Job] = {}

    def _template(self, i: int) -> dict[str, Any]:
        """Step ``i``'s task: its own, or a sleep's wait task (which the server fills in,
        on the sleep's queue or the flow's first task's)."""
        step = self.defs[i]
        if "task" in step or not any(k in step for k in WAITS):
            return step["task"]
        first = next((s["task"]["queue"] for s in self.defs if "task" in s), "default")
        if "child_flow" in step:
            return {"name": _child.CHILD_TASK, "queue": step["child_flow"].get("queue", first)}
        if "approval" in step:
            return {"name": _wait.APPROVAL_TASK, "queue": step["approval"].get("queue", first)}
        if "wait_for_event" in step:
            return {"name": _wait.WAIT_TASK, "queue": step["wait_for_event"].get("queue", first)}
        return {"name": SLEEP_TASK, "queue": step["sleep"].get("queue", first)}

    def _wake_ms(self, i: int, started_ms: int) -> int:
        """When sleep step ``i``, started at ``started_ms``, ends (ms on the fake clock)."""
        sleep: dict[str, Any] = self.defs[i]["sleep"]
        if "until" in sleep:
            text = str(sleep["until"]).replace("Z", "+00:00")
            return int(datetime.fromisoformat(text).timestamp() * 1000)
        return started_ms + int(sleep["for_ms"])

    def _task_of(self, i: int, template: dict[str, Any], replace: Mapping[str, Any]) -> TaskDef[..., Any]:
        if any(k in self.defs[i] for k in WAITS):
            return _SLEEP  # a wait's own task is made when it starts (``_build``)
        name = template.get("name")
        if not isinstance(name, str):
            raise _bad(f"steps[{i}].task.name", f"a step's task needs a name, not {name!r}")
        original = REGISTRY.get(name)
        stand_in = replace.get(name)
        if stand_in is not None:
            if isinstance(stand_in, TaskDef):
                return cast("TaskDef[..., Any]", stand_in)
            if not callable(stand_in):
                raise InvalidInput(f"replace[{name!r}] must be a function or an @ax.task, not {stand_in!r}")
            if original is not None:
                return TaskDef(stand_in, name, original.options)

            return TaskDef(stand_in, name, TaskOptions(queue=template["queue"]))
        if original is None:
            raise NotImplementedError(f"ax.testing.run_flow: step {self.defs[i]['name']!r} runs task {name!r}, which "
                                      "is no @ax.task of this process: pass replace={" + repr(name) + ": function}")
        return original

    # -- building a step's tasks (input.rs) ------------------------------------------------

    def _output_of(self, p: int) -> Any:
        outputs = [output_value(j.run.outcome.output, j.run.outcome.is_json)
                   if j.run.state == "succeeded" and j.run.outcome else None for j in self.jobs[p]]
        if self.defs[p].get("for_each") is not None:
            return outputs
        return outputs[-1] if outputs else None

    def _payloads(self, i: int) -> list[dict[str, Any]]:
        step = self.defs[i]
        parents: dict[str, Any] = {}
        errors: dict[str, Any] = {}
        fan_out: tuple[bool, Any] | None = None  # (succeeded, output or state)
        for p in self.plan.parents[i]:
            name = self.defs[p]["name"]
            rec = self.steps[p]
            if rec.state == "succeeded":
                ended: tuple[bool, Any] = (True, self._output_of(p))
            else:
                ended = (False, rec.state)
            if step.get("for_each") == name:
                fan_out = ended
            elif ended[0]:
                parents[name] = ended[1]
            else:
                e: dict[str, Any] = {"state": rec.state}
                if rec.error is not None:
                    e["class"], e["message"] = rec.error.get("class"), rec.error.get("message")
                errors[name] = e
        base: dict[str, Any] = {"flow": self.definition["name"], "run": self.run_id, "step": step["name"],
                                "input": self.input, "parents": parents}
        if errors:
            base["errors"] = errors
        args = self._template(i).get("payload")

        def payload(item: tuple[int, Any] | None) -> dict[str, Any]:
            body = dict(base)
            if item is not None:
                body["item"], body["index"] = item[1], item[0]
            if args is not None:
                body["args"] = args
            return body

        if fan_out is None:
            return [payload(None)]
        over = step["for_each"]
        if not fan_out[0]:
            raise StepBuildError("bad_fan_out", f"for_each {json.dumps(over)}: it ended {fan_out[1]}, with no output")
        if not isinstance(fan_out[1], list):
            raise StepBuildError("bad_fan_out", f"for_each {json.dumps(over)}: its output is not a JSON array but "
                                                f"{_kind(fan_out[1])}")
        items = list(cast("Iterable[Any]", fan_out[1]))
        if len(items) > MAX_FAN_OUT:
            raise StepBuildError("fan_out_too_large",
                                 f"for_each {json.dumps(over)}: {len(items)} items, at most {MAX_FAN_OUT}")
        return [payload((k, v)) for k, v in enumerate(items)]

    def _build(self, i: int) -> list[_Job]:
        template = self._template(i)
        td = self.tasks[i]
        jobs: list[_Job] = []
        bodies = self._payloads(i)
        wait = self.defs[i].get("wait_for_event")
        if wait is not None:
            try:
                due, met = _wait.meet(wait, bodies[0], self.events, self.clock.now_ms())
            except _wait.BadMatch as e:
                raise StepBuildError("bad_match", str(e)) from None
            td = TaskDef(met, _wait.WAIT_TASK, TaskOptions(retries=0))
            self._wait_due[i] = due
        approval = self.defs[i].get("approval")
        if approval is not None:
            given = self.approvals.get(self.defs[i]["name"])
            due, decided = _wait.decide(approval, given, self.clock.now_ms())
            td = TaskDef(decided, _wait.APPROVAL_TASK, TaskOptions(retries=0))
            self._wait_due[i] = due
        child = self.defs[i].get("child_flow")
        if child is not None and len(bodies) > _child.MAX_CHILD_RUNS:
            raise StepBuildError("fan_out_too_large",
                                 f"{len(bodies)} child runs, at most {_child.MAX_CHILD_RUNS} per step")
        for k, body in enumerate(bodies):
            task_id = f"{template['queue']}.fl.{self.run_id}.{self.defs[i]['name']}.0.{k}"
            if child is not None:
                def run_child(d: dict[str, Any], x: Any, t: str = task_id) -> _ChildEnd:
                    return self._run_child(d, x, t)
                try:
                    out = _child.outcome(self.defs[i], body, self.clock.now_ms(), self.depth, run_child)
                except _child.BadInput as e:
                    raise StepBuildError("bad_input", str(e)) from None
                td = TaskDef(out.end, _child.CHILD_TASK, TaskOptions(retries=0))
                self._child_due[(i, k)] = out.due_ms
            try:
                run = TaskRun(td, body, task_id=task_id, clock=self.clock, policy=Policy.of(td, template),
                              rng=self.rng, priority=template.get("priority"), queue=template["queue"],
                              business_id=self.business_id)
            except InvalidInput as e:
                cls = "input_too_large" if e.code == "payload_too_large" or e.field == "payload" \
                    else "invalid_step_task"
                raise StepBuildError(cls, e.message) from None
            jobs.append(_Job(i, k, run))
        return jobs

    # -- driving --------------------------------------------------------------------------

    def _settle(self) -> tuple[str, str] | None:
        """Advances until nothing changes (the actor's ``step``); the run's end, once
        every step has ended."""
        while True:
            now = self.clock.now_ms()
            adv = advance(self.definition, self.plan, False, self.steps, self.progress, now)
            cancel = [i for i in adv.cancel_queued if not self.queued_cancelled[i]]
            if not adv.changed and not cancel:
                return adv.end
            for i in adv.start:
                try:
                    jobs = self._build(i)
                except StepBuildError as e:
                    log.info("ax.testing: flow %s step %s cannot start: %s: %s", self.definition["name"],
                             self.defs[i]["name"], e.error["class"], e.error["message"])
                    rec = self.steps[i]
                    rec.state, rec.error, rec.finished_at_ms, rec.items = "failed", e.error, now, 0
                    self.progress[i] = Progress(total=0)
                    continue
                self.jobs[i] = jobs
                self.steps[i].items = len(jobs)
                self.progress[i] = Progress(total=len(jobs))
                due = self._wake_ms(i, now) if "sleep" in self.defs[i] else self._wait_due.pop(i, now)
                for job in jobs:
                    self._schedule(job, self._child_due.pop((i, job.item), due))
            for i in cancel:
                self.queued_cancelled[i] = True
                for job in self.jobs[i]:
                    if not job.run.done:
                        job.run.cancel_unstarted("a step failed and the flow fails fast")
                        self._tally(job)

    def _run_child(self, definition: dict[str, Any], input: Any, task_id: str) -> "_ChildEnd":
        """Runs a child of this run to its end on a clock of its own from now."""
        clock = FakeClock(self.clock.now_ms())
        sim = FlowSim(definition, input, run_id=f"child-of-{task_id}", clock=clock, rng=self.rng,
                      replace=self.replace, runner=self.runner, business_id=self.business_id, depth=self.depth + 1)
        result = sim.run()
        leaves = [d["name"] for d in sim.defs if not any(d["name"] in (s.get("needs") or []) for s in sim.defs)]
        outputs = {name: result.steps[name].raw_output for name in leaves if result.steps[name].state == "succeeded"}
        return _ChildEnd(result.state, result.reason, outputs, clock.now_ms())

    def _schedule(self, job: _Job, due_ms: int) -> None:
        heapq.heappush(self._due, (due_ms, self._rank[job.step], job.item, next(self._seq)))
        self._pending[(job.step, job.item)] = job

    def _tally(self, job: _Job) -> None:
        pr = self.progress[job.step]
        run = job.run
        if run.state == "succeeded":
            pr.succeeded += 1
        elif run.state == "cancelled":
            pr.cancelled += 1
        else:
            pr.failed += 1
            error = run.result().last_error or _why("dead", "")
            if pr.first_error is None or job.item < pr.first_error[0]:
                pr.first_error = (job.item, {k: v for k, v in error.items() if v is not None})
        if run.cancel_reason is None:
            pr.attempts = max(pr.attempts, len(run.attempts))

    def _job_at(self, entry: tuple[int, int, int, int]) -> _Job:
        return self._pending[(self.plan.order[entry[1]], entry[2])]

    def run(self) -> FlowResult:
        while True:
            end = self._settle()
            if end is not None:
                return self._result(*end)
            while self._due and self._job_at(self._due[0]).run.done:
                heapq.heappop(self._due)  # cancelled while it waited for a retry
            if not self._due:
                raise RuntimeError(f"ax.testing.run_flow: flow {self.definition['name']} has no task to run and has "
                                   f"not ended (steps: {[s.state for s in self.steps]}): a bug of the test mode")
            due_ms = self._due[0][0]
            self.clock.set_ms(max(due_ms, self.clock.now_ms()))
            while self._due and self._due[0][0] <= self.clock.now_ms():
                job = self._job_at(heapq.heappop(self._due))
                if job.run.done:
                    continue  # cancelled while it waited
                begun = job.run.begin()
                assert begun is not None
                delay = job.run.end(self.runner.attempt(job.run.td, *begun))
                if delay is None:
                    self._tally(job)
                else:
                    self._schedule(job, self.clock.now_ms() + delay)

    def _result(self, state: str, reason: str) -> FlowResult:
        steps: dict[str, StepResult] = {}
        for i, d in enumerate(self.defs):
            rec = self.steps[i]
            td = self.tasks[i]
            results = [j.run.result() for j in self.jobs[i]]
            output = raw = None
            if rec.state == "succeeded":
                raw = self._output_of(i)
                typed = [typed_output(td, j.run.outcome.output, j.run.outcome.is_json) if j.run.outcome else None
                         for j in self.jobs[i]]
                output = typed if d.get("for_each") is not None else (typed[-1] if typed else None)
            steps[d["name"]] = StepResult(d["name"], self._template(i)["name"], rec.state, output, raw, rec.error,
                                          rec.items, rec.attempts, results)
        return FlowResult(self.definition["name"], self.run_id, state, reason, self.input, steps, self.clock)

