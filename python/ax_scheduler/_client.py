"""``ax.Client``: submit tasks, wait for them, start flows and operate, over the Rust
producer client (one protocol implementation)."""

from __future__ import annotations

import json
import os
import threading
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from . import _core, _json
from ._task import REGISTRY, Handle, TaskDef
from .errors import AxError, FlowFailed, InvalidInput, NotFound, TaskFailed, TimedOut

if TYPE_CHECKING:
    from ._events import Event

DEFAULT_URL = "nats://127.0.0.1:4222"


def _file_words(value: Any) -> Any:
    """Timedeltas as seconds, anywhere in the settings."""
    import datetime

    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, dict):
        return {k: _file_words(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_file_words(v) for v in value]
    return value


def _load_settings(path: "str | os.PathLike") -> Any:
    """A settings file's data: JSON for ``.json``, else YAML (the ``yaml`` extra)."""
    text = open(path, encoding="utf-8").read()
    if str(path).endswith(".json"):
        return json.loads(text)
    try:
        import yaml  # type: ignore[import-untyped]
    except ImportError:
        raise InvalidInput(f"{path}: reading YAML needs PyYAML: pip install 'ax-scheduler[yaml]' "
                           "(or give the settings as JSON)", field="config") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise InvalidInput(f"{path} is not valid YAML: {e}", field="config") from None


class Client:
    """A connection to ax. ``url`` defaults to ``$AX_URL``, else the connection of the
    ``Runtime`` started in this process, else ``nats://127.0.0.1:4222``. ``creds`` and
    ``token`` authenticate to NATS. Thread-safe; share one."""

    _default: "Client | None" = None
    _lock = threading.Lock()

    def __init__(self, url: str | None = None, *, creds: str | None = None, token: str | None = None,
                 connect_timeout: float = 5.0, wait_for_server: float = 30.0, _conn: Any = None):
        if _conn is None:
            from . import _runtime

            running = _runtime.current()
            if url is None and running is not None and creds is None and token is None:
                _conn = running.connection
            else:
                url = url or os.environ.get("AX_URL") or DEFAULT_URL
                _conn = _core.Connection.connect(url, "ax-python", connect_timeout, creds, token, wait_for_server)
        self._conn = _conn
        self._flows_put: set[str] = set()

    @classmethod
    def default(cls) -> "Client":
        """The process's shared client (made on first use)."""
        with cls._lock:
            if cls._default is None:
                cls._default = Client()
            return cls._default

    @property
    def url(self) -> str:
        return self._conn.server()

    # -- tasks --------------------------------------------------------------------------

    def submit(self, task: TaskDef | str, payload: Any = None, *, queue: str | None = None, delay: Any = None,
               run_at: Any = None, key: str | None = None, priority: str | None = None) -> Handle:
        """Submits a task by function or by name with ``payload``: the argument of a
        one-parameter function (a list for ``*args``, an object for ``**kwargs``), else an
        object of arguments by name (the Python guide, "Tasks"); see
        ``TaskDef.submit`` for the options. A payload the function cannot take is refused."""
        td = task if isinstance(task, TaskDef) else REGISTRY.get(task)
        if td is not None and not isinstance(task, str):
            td.check_payload(payload)
            req = td.request(payload, delay=delay, run_at=run_at, key=key, priority=priority)
            return self.submit_request(queue or td.options.queue, req, task=td)
        name = task if isinstance(task, str) else td.name  # type: ignore[union-attr]
        bare = TaskDef(lambda payload=None: None, name, td.options if td else _bare_options())
        req = bare.request(payload, delay=delay, run_at=run_at, key=key, priority=priority)
        return self.submit_request(queue or bare.options.queue, req, task=td)

    def submit_request(self, queue: str, request: dict[str, Any], task: TaskDef | None = None) -> Handle:
        """Submits a raw submit request (PROTOCOL.md §2) to ``queue``."""
        body = _json.dumps(request, "the task's payload")
        reply = json.loads(self._conn.submit(queue, body))
        return Handle(reply["id"], reply["duplicate"], reply["state"], self, task)

    def submit_many(self, task: TaskDef | str, payloads: Iterable[Any], *, queue: str | None = None,
                    priority: str | None = None) -> list[Handle | AxError]:
        """Submits one task per payload in batches; one ``Handle`` (accepted) or
        ``AxError`` (refused) per payload, in order."""
        td = task if isinstance(task, TaskDef) else REGISTRY.get(task)
        name = task if isinstance(task, str) else task.name
        opts = td.options if td else _bare_options()
        bare = TaskDef(lambda payload=None: None, name, opts)
        payloads = list(payloads)
        if isinstance(task, TaskDef):
            for p in payloads:
                task.check_payload(p)
        bodies = [_json.dumps(bare.request(p, priority=priority), "a task's payload") for p in payloads]
        out: list[Handle | AxError] = []
        for accepted, reply in self._conn.submit_many(queue or opts.queue, bodies):
            r = json.loads(reply)
            if accepted:
                out.append(Handle(r["id"], r["duplicate"], r["state"], self, td))
            else:
                out.append(AxError(r.get("message", "refused"), r.get("code"), r.get("field")))
        return out

    def get(self, task_id: str) -> dict[str, Any] | None:
        """The task's current record (PROTOCOL.md §3), or None."""
        found = self._conn.task(task_id)
        return None if found is None else json.loads(found)["record"]

    def wait(self, task_id: str, timeout: float | None = None) -> dict[str, Any]:
        """Waits until the task is finished; its final record (``TimedOut`` after
        ``timeout`` seconds)."""
        record, _, _ = self._conn.wait(task_id, timeout)
        return json.loads(record)["record"]

    def result(self, task_id: str, timeout: float | None = None) -> Any:
        """The output of the task once it succeeded; ``TaskFailed`` if it ended
        otherwise. Bytes outputs come as ``bytes``."""
        record, output, is_json = self._conn.wait(task_id, timeout)
        rec = json.loads(record)["record"]
        if rec["state"] != "succeeded":
            err = rec.get("last_error") or {}
            raise TaskFailed(f"task {task_id} ended {rec['state']}: {err.get('class')}: {err.get('message')}", rec)
        if output is None:
            return None
        return json.loads(output) if is_json else bytes(output)

    def history(self, task_id: str) -> dict[str, Any]:
        """The task's recorded events (``events`` of PROTOCOL.md §8)."""
        return self.call("task", "events", {"id": task_id})

    def cancel(self, task_id: str) -> dict[str, Any]:
        return self.call("task", "cancel", {"id": task_id})

    def retry(self, task_id: str, reset_attempts: bool = False) -> dict[str, Any]:
        return self.call("task", "retry", {"id": task_id, "reset_attempts": reset_attempts})

    def run_now(self, task_id: str) -> dict[str, Any]:
        return self.call("task", "run_now", {"id": task_id})

    def pause(self, queue: str, reason: str | None = None) -> Any:
        body: dict[str, Any] = {"queue": queue}
        if reason:
            body["reason"] = reason
        return self.call("task", "pause", body)

    def resume(self, queue: str) -> Any:
        return self.call("task", "resume", {"queue": queue})

    # -- task settings (kept apart from code, applied live) ------------------------------

    def task_options(self, name: str, queue: str = "default") -> dict[str, Any] | None:
        """The stored settings of task ``name`` (their JSON form: ``max_attempts``,
        ``timeout_ms``, ...), or None."""
        try:
            return self.call("task", "options_get", {"queue": queue, "name": name})["settings"]
        except NotFound:
            return None

    def set_task_options(self, name: str, queue: str = "default", *, replace: bool = False,
                         **values: Any) -> dict[str, Any]:
        """Stores settings of task ``name`` in the settings file's words (``retries``,
        ``timeout``, ``heartbeat_timeout``, ``retry_backoff``, ``retry_backoff_max``,
        ``retry_jitter``, ``retry_on``, ``no_retry_on``, ``concurrency``, ``alert_group``;
        times in seconds, timedeltas or strings like ``"30s"``), merged into what is
        stored unless ``replace``. Every worker of the queue (Python and Rust) applies them
        to its next attempts of that name: stored settings > ``@ax.task`` options >
        server defaults. Returns the settings stored."""
        new = json.loads(_core.settings_of(_json.dumps(_file_words(values), "the settings"), name))
        if not replace:
            new = {**(self.task_options(name, queue) or {}), **new}
        body = {"queue": queue, "name": name, "settings": new}
        return self.call("task", "options_put", body)["settings"]

    def delete_task_options(self, name: str, queue: str = "default") -> bool:
        """Deletes the stored settings of task ``name``: its workers go back to the
        ``@ax.task`` options. True if there were some."""
        return bool(self.call("task", "options_delete", {"queue": queue, "name": name})["deleted"])

    def list_task_options(self, queue: str | None = None) -> list[dict[str, Any]]:
        """Every stored task setting (``{queue, name, settings}``), of one queue if given."""
        return self.call("task", "options_list", {} if queue is None else {"queue": queue})

    def apply_settings(self, source: "str | os.PathLike | dict[str, Any]") -> list[dict[str, Any]]:
        """Stores the ``tasks:`` settings of a settings file (YAML with the ``yaml`` extra,
        or JSON; or the file's data as a dict), as ``ax apply -f`` does but without
        deleting what the file does not name. Checked whole before anything is stored: a
        bad entry raises ``InvalidInput`` naming it (``tasks.<name>.<field>``). Returns
        what was stored."""
        data = _load_settings(source) if not isinstance(source, dict) else source
        tasks = _core.read_settings_file(_json.dumps(_file_words(data), "the settings file"))
        stored = []
        for queue, name, settings in tasks:
            body = {"queue": queue, "name": name, "settings": json.loads(settings)}
            stored.append(self.call("task", "options_put", body))
        return stored

    # -- flows --------------------------------------------------------------------------

    def put_flow(self, flow: Any) -> dict[str, Any]:
        """Stores a flow's definition (an ``@ax.flow`` or a definition dict)."""
        definition = flow.definition() if hasattr(flow, "definition") else flow
        answer = self.call("flow", "put", definition)
        self._flows_put.add(definition["name"])
        return answer

    def trigger_flow(self, flow: Any, payload: Any = None) -> str:
        """Starts a run of ``flow`` (an ``@ax.flow``, stored first if this client has not
        yet, or a flow name) with ``payload`` as its input; returns the run id."""
        if not isinstance(flow, str):
            if flow.name not in self._flows_put:
                self.put_flow(flow)
            flow = flow.name
        return self.call("flow", "run", {"flow": flow, "input": payload})["run"]

    def wait_flow(self, run: str, timeout: float | None = None) -> dict[str, Any]:
        """Waits until the run has ended; the run record."""
        return json.loads(self._conn.wait_flow(run, timeout))

    def flow_result(self, run: str, timeout: float | None = None) -> dict[str, Any]:
        """Waits for the run; ``FlowFailed`` unless it succeeded; its steps' outputs by
        step name."""
        ended = self.wait_flow(run, timeout)
        if ended["state"] != "succeeded":
            raise FlowFailed(f"flow run {run} ended {ended['state']}: {ended.get('reason')}", ended)
        out = {}
        for step in self.flow_run(run)["steps"]:
            if step.get("task_id") and step.get("state") == "succeeded":
                out[step["name"]] = self.result(step["task_id"], timeout=timeout)
        return out

    def flow_run(self, run: str) -> dict[str, Any]:
        """The run with its steps (``get`` of PROTOCOL.md §6)."""
        return self.call("flow", "get", {"run": run})

    def rerun_flow(self, run: str, mode: str = "failed", payload: Any = None) -> Any:
        body: dict[str, Any] = {"run": run, "mode": mode}
        if payload is not None:
            body["input"] = payload
        return self.call("flow", "rerun", body)

    def cancel_flow(self, run: str) -> Any:
        return self.call("flow", "cancel", {"run": run})

    # -- the rest -----------------------------------------------------------------------

    def call(self, api: str, op: str, body: Any = None) -> Any:
        """Calls ``ax.<api>.<op>`` (``task``, ``flow``, ``limit``, ``trigger``) with a JSON
        body; the ``ok`` value. Refusals raise the typed errors of ``ax.errors``."""
        return json.loads(self._conn.call(api, op, _json.dumps({} if body is None else body, "the request")))

    def events(self, subject: str = "ax.events.alert.>", poll: float = 1.0) -> Iterator["Event"]:
        """Follows ax's events (by default the alerts: tasks dead, flow runs failed, one
        per burst); yields each as an ``ax.Event`` (every follower gets each)."""
        from ._events import follow

        return follow(self._conn.subscribe(subject), poll)

    def close(self) -> None:
        self._conn.close()


def _bare_options() -> Any:
    from ._task import TaskOptions

    return TaskOptions()


__all__ = ["Client", "TimedOut"]
