"""The client's operations, each written once as a generator of connection calls (sans
I/O): ``Client`` runs them blocking on a ``_core.Connection``, ``AsyncClient`` awaiting on
a ``_core.AsyncConnection`` (the two take the same calls). Building the requests and
decoding the replies happens here only; an operation yields an ``Io`` (one call), gets
its reply back, or the call's ``AxError`` raised where it yielded."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generator, Generic, Iterable

from . import _core, _json, _options, _settings
from ._handle import Handle
from ._options import TaskOptions
from ._task import REGISTRY, TaskDef
from ._typing import R, T
from .errors import AxError, FlowFailed, NotFound, TaskFailed

if TYPE_CHECKING:
    from ._client import Client


@dataclass(frozen=True)
class Io:
    """One call of the connection: its method's name and arguments."""

    method: str
    args: tuple[Any, ...]


Op = Generator[Io, Any, T]


class Steps(Generic[T]):
    """An operation driven one call at a time: ``next()`` is its next call, None once it
    has ended (its result in ``value``); ``reply`` / ``fail`` hand it what the call gave."""

    def __init__(self, op: Op[T]):
        self._op = op
        self._reply: Any = None
        self._error: AxError | None = None
        self.value: T

    def next(self) -> Io | None:
        error, self._error = self._error, None
        try:
            return self._op.send(self._reply) if error is None else self._op.throw(error)
        except StopIteration as done:
            self.value = done.value
            return None

    def reply(self, value: Any) -> None:
        self._reply = value

    def fail(self, error: AxError) -> None:
        self._error = error


def run(conn: _core.Connection, op: Op[T]) -> T:
    """Runs ``op`` with blocking calls."""
    steps = Steps(op)
    while (io := steps.next()) is not None:
        try:
            steps.reply(getattr(conn, io.method)(*io.args))
        except AxError as e:  # raised in the operation, which handles it or raises it on
            steps.fail(e)
    return steps.value


async def run_async(conn: _core.AsyncConnection, op: Op[T]) -> T:
    """Runs ``op`` awaiting each call (cancelling it cancels the call under way)."""
    steps = Steps(op)
    while (io := steps.next()) is not None:
        try:
            steps.reply(await getattr(conn, io.method)(*io.args))
        except AxError as e:  # raised in the operation, which handles it or raises it on
            steps.fail(e)
    return steps.value


# -- tasks ------------------------------------------------------------------------------

def _target(task: TaskDef[Any, R] | str) -> tuple[str, TaskOptions, TaskDef[Any, R] | None]:
    """A task's name, options (its ``@ax.task``'s when this process has it) and definition."""
    td = task if isinstance(task, TaskDef) else REGISTRY.get(task)
    name = task if isinstance(task, str) else task.name
    return name, td.options if td is not None else TaskOptions(), td


def submit(client: Client, task: TaskDef[Any, R] | str, payload: Any, queue: str | None,
           **options: Any) -> Op[Handle[R]]:
    """A submit of ``task`` (a definition, or a name: its payload is not checked) with
    ``payload``; ``options`` are ``_options.request``'s."""
    name, opts, td = _target(task)
    if isinstance(task, TaskDef):
        task.check_payload(payload)
    request = _options.request(name, opts, payload, **options)
    return (yield from submit_request(client, queue or opts.queue, request, td))


def submit_request(client: Client, queue: str, request: dict[str, Any], task: TaskDef[Any, R] | None) -> Op[Handle[R]]:
    reply = json.loads((yield Io("submit", (queue, _json.dumps(request, "the task's payload")))))
    return Handle(reply["id"], reply["duplicate"], reply["state"], client, task)


def submit_many(client: Client, task: TaskDef[Any, R] | str, payloads: Iterable[Any], queue: str | None,
                priority: str | None) -> Op[list[Handle[R] | AxError]]:
    name, opts, td = _target(task)
    payloads = list(payloads)
    if isinstance(task, TaskDef):
        for p in payloads:
            task.check_payload(p)
    bodies = [_json.dumps(_options.request(name, opts, p, priority=priority), "a task's payload") for p in payloads]
    out: list[Handle[R] | AxError] = []
    for accepted, reply in (yield Io("submit_many", (queue or opts.queue, bodies))):
        r = json.loads(reply)
        if accepted:
            out.append(Handle(r["id"], r["duplicate"], r["state"], client, td))
        else:
            out.append(AxError(r.get("message", "refused"), r.get("code"), r.get("field")))
    return out


def get(task_id: str) -> Op[dict[str, Any] | None]:
    found = yield Io("task", (task_id,))
    return None if found is None else json.loads(found)["record"]


def wait(task_id: str, timeout: float | None) -> Op[dict[str, Any]]:
    record, _, _ = yield Io("wait", (task_id, timeout))
    return json.loads(record)["record"]


def result(task_id: str, timeout: float | None) -> Op[Any]:
    """The task's output once it succeeded (bytes outputs as ``bytes``); ``TaskFailed``
    if it ended otherwise."""
    record, output, is_json = yield Io("wait", (task_id, timeout))
    rec = json.loads(record)["record"]
    if rec["state"] != "succeeded":
        err: dict[str, Any] = rec.get("last_error") or {}
        raise TaskFailed(f"task {task_id} ended {rec['state']}: {err.get('class')}: {err.get('message')}", rec)
    if output is None:
        return None
    return json.loads(output) if is_json else bytes(output)


def call(api: str, op: str, body: Any = None) -> Op[Any]:
    """``ax.<api>.<op>`` with a JSON body; the ``ok`` value (refusals raise typed)."""
    reply = yield Io("call", (api, op, _json.dumps({} if body is None else body, "the request")))
    return json.loads(reply)


def publish_event(name: str, payload: Any, id: str | None) -> Op[int]:
    """Event ``name`` published with ``payload`` (JSON); its ``AX_EVENTS`` sequence."""
    seq: int = yield Io("publish_event", (name, _json.dumps(payload, "the event's payload"), id))
    return seq


def task_call(op: str, task_id: str, **more: Any) -> Op[Any]:
    """A task request by id: ``events`` (its history), ``cancel``, ``retry``, ``run_now``."""
    return call("task", op, {"id": task_id, **more})


def pause(queue: str, reason: str | None) -> Op[Any]:
    return call("task", "pause", {"queue": queue, **({"reason": reason} if reason else {})})


def resume(queue: str) -> Op[Any]:
    return call("task", "resume", {"queue": queue})


# -- task settings ----------------------------------------------------------------------

def task_options(name: str, queue: str) -> Op[dict[str, Any] | None]:
    try:
        return (yield from call("task", "options_get", {"queue": queue, "name": name}))["settings"]
    except NotFound:
        return None


def set_task_options(name: str, queue: str, replace: bool, values: dict[str, Any]) -> Op[dict[str, Any]]:
    new = json.loads(_core.settings_of(_json.dumps(_settings.file_words(values), "the settings"), name))
    if not replace:
        new = {**((yield from task_options(name, queue)) or {}), **new}
    return (yield from call("task", "options_put", {"queue": queue, "name": name, "settings": new}))["settings"]


def delete_task_options(name: str, queue: str) -> Op[bool]:
    return bool((yield from call("task", "options_delete", {"queue": queue, "name": name}))["deleted"])


def list_task_options(queue: str | None) -> Op[list[dict[str, Any]]]:
    return call("task", "options_list", {} if queue is None else {"queue": queue})


def apply_settings(source: str | os.PathLike[str] | dict[str, Any]) -> Op[list[dict[str, Any]]]:
    data = source if isinstance(source, dict) else _settings.load(source)
    tasks = _core.read_settings_file(_json.dumps(_settings.file_words(data), "the settings file"))
    stored: list[dict[str, Any]] = []
    for queue, name, settings in tasks:
        body = {"queue": queue, "name": name, "settings": json.loads(settings)}
        stored.append((yield from call("task", "options_put", body)))
    return stored


# -- flows ------------------------------------------------------------------------------

def put_flow(stored: set[str], flow: Any, putting: frozenset[str] = frozenset()) -> Op[dict[str, Any]]:
    """Stores a flow's definition, after the flows its child flow steps run that are not
    in ``stored`` (``putting``: those being stored up the chain, as a flow may run
    itself); its name joins ``stored``."""
    definition = flow.definition() if hasattr(flow, "definition") else flow
    putting = putting | {definition["name"]}
    children: list[Any] = flow.child_flows() if hasattr(flow, "child_flows") else []
    for child in children:
        name: str = child.name
        if name not in stored and name not in putting:
            yield from put_flow(stored, child, putting)
    answer = yield from call("flow", "put", definition)
    stored.add(definition["name"])
    return answer


def trigger_flow(stored: set[str], flow: Any, payload: Any) -> Op[str]:
    """Starts a run of ``flow`` (stored first unless in ``stored``, or a name)."""
    start: dict[str, Any] = {}
    if not isinstance(flow, str):
        start = flow.start_options(payload)
        if flow.name not in stored:
            yield from put_flow(stored, flow)
        flow = flow.name
    return (yield from call("flow", "run", {"flow": flow, "input": payload, **start}))["run"]


def wait_flow(run: str, timeout: float | None) -> Op[dict[str, Any]]:
    return json.loads((yield Io("wait_flow", (run, timeout))))


def flow_result(run: str, timeout: float | None) -> Op[dict[str, Any]]:
    ended = yield from wait_flow(run, timeout)
    if ended["state"] != "succeeded":
        raise FlowFailed(f"flow run {run} ended {ended['state']}: {ended.get('reason')}", ended)
    out: dict[str, Any] = {}
    for step in (yield from run_call("get", run))["steps"]:
        if not step.get("task_id") or step.get("state") != "succeeded":
            continue
        if step.get("for_each") is None:
            out[step["name"]] = yield from result(step["task_id"], timeout)
            continue
        # A fan-out: its items' outputs in item order (the ids differ by the last part).
        stem = step["task_id"].rsplit(".", 1)[0]
        items: list[Any] = []
        for i in range(step.get("items") or 0):
            items.append((yield from result(f"{stem}.{i}", timeout)))
        out[step["name"]] = items
    return out


def run_call(op: str, run: str) -> Op[Any]:
    """A flow run request by id: ``get`` (the run with its steps), ``cancel``."""
    return call("flow", op, {"run": run})


def complete_approval(token: str, decision: str, payload: Any = None, reason: str | None = None) -> Op[Any]:
    """``ax.flow.approve``: approve (with ``payload``) or reject (with ``reason``) by token."""
    body: dict[str, Any] = {"token": token, "decision": decision}
    if payload is not None:
        body["payload"] = payload
    if reason is not None:
        body["reason"] = reason
    return call("flow", "approve", body)


def rerun_flow(run: str, mode: str, payload: Any) -> Op[Any]:
    return call("flow", "rerun", {"run": run, "mode": mode, **({} if payload is None else {"input": payload})})
