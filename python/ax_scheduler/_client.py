"""``ax.Client``: submit tasks, wait for them, start flows and operate, over the Rust
producer client (one protocol implementation). Each call is an operation of ``_ops``
run blocking; ``client.aio`` (an ``ax.AsyncClient``) runs the same ones awaiting."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from . import _core, _json, _ops
from ._handle import Handle, Submitting
from ._task import TaskDef
from ._typing import R, T
from .errors import AxError, TimedOut

if TYPE_CHECKING:
    from ._aio import AsyncClient
    from ._events import Event
    from ._flow import FlowDef

log = logging.getLogger("ax_scheduler")
DEFAULT_URL = "nats://127.0.0.1:4222"


class Client:
    """A connection to ax. ``url`` defaults to ``$AX_URL``, else the connection of the
    ``Runtime`` started in this process, else ``nats://127.0.0.1:4222``. ``creds`` and
    ``token`` authenticate to NATS. ``direct_submits=True`` publishes a task without an
    idempotency key straight to JetStream, with no ax server on its path (docs/PROTOCOL.md
    §2, "Direct submits"; the producer needs publish permission on its queues' subjects).
    Thread-safe; share one. Every call has an awaitable form on ``client.aio`` (or ``await
    ax.AsyncClient.connect()``)."""

    _default: Client | None = None
    _lock = threading.Lock()

    def __init__(self, url: str | None = None, *, creds: str | None = None, token: str | None = None,
                 connect_timeout: float = 5.0, wait_for_server: float = 30.0, direct_submits: bool = False,
                 _conn: Any = None):
        self._owned = _conn is None  # a connection this client made: close() closes it
        if _conn is None:
            from . import _runtime

            running = _runtime.current()
            if url is None and running is not None and creds is None and token is None and not direct_submits:
                _conn = running.connection
                self._owned = False
            else:
                url = url or os.environ.get("AX_URL") or DEFAULT_URL
                _conn = _core.Connection.connect(url, "ax-python", connect_timeout, creds, token, wait_for_server,
                                                 direct_submits)
        self._conn: _core.Connection = _conn
        self.stored_flows: set[str] = set()  # the flows this client has stored (put)
        self._aio: AsyncClient | None = None

    @classmethod
    def default(cls) -> Client:
        """The process's shared client (made on first use)."""
        with cls._lock:
            if cls._default is None:
                cls._default = Client()
            return cls._default

    @classmethod
    def of(cls, client: Client | AsyncClient | None = None) -> Client:
        """The blocking client of ``client`` (an ``AsyncClient``'s ``sync``); without one,
        the shared client."""
        if client is None:
            return cls.default()
        return client if isinstance(client, Client) else client.sync

    @classmethod
    async def default_async(cls) -> Client:
        """``default()`` from async code: the first connects on a thread."""
        return cls._default or await asyncio.to_thread(cls.default)

    @property
    def url(self) -> str:
        return self._conn.server()

    @property
    def connection(self) -> _core.Connection:
        """The native connection (``_core.Connection``) the calls go over."""
        return self._conn

    @property
    def aio(self) -> AsyncClient:
        """This client's calls as awaitables, on the same connection."""
        if self._aio is None:
            from ._aio import AsyncClient

            self._aio = AsyncClient(self)
        return self._aio

    def _run(self, op: _ops.Op[T]) -> T:
        return _ops.run(self._conn, op)

    # -- tasks --------------------------------------------------------------------------

    def submit(self, task: TaskDef[Any, R] | str, payload: Any = None, *, queue: str | None = None,
               delay: float | timedelta | None = None, run_at: datetime | str | None = None,
               key: str | None = None, priority: str | None = None) -> Handle[R]:
        """Submits a task by function or by name with ``payload``: the argument of a
        one-parameter function (a list for ``*args``, an object for ``**kwargs``), else an
        object of arguments by name (the Python guide, "Tasks"); see
        ``TaskDef.with_options`` for the options. A payload the function cannot take is
        refused."""
        return self._run(_ops.submit(self, task, payload, queue, delay=delay, run_at=run_at, key=key,
                                     priority=priority))

    def submit_request_nowait(self, queue: str, request: dict[str, Any],
                              task: TaskDef[Any, R] | None = None) -> Submitting[R]:
        """Sends a raw submit request (PROTOCOL.md §2) to ``queue`` without waiting for
        its answer: ``.handle()`` gives the ``Handle`` once stored."""
        pending = self._conn.submit_nowait(queue, _json.dumps(request, "the task's payload"))
        return Submitting(pending, self, task)

    def submit_request(self, queue: str, request: dict[str, Any], task: TaskDef[Any, R] | None = None) -> Handle[R]:
        """Submits a raw submit request (PROTOCOL.md §2) to ``queue``."""
        return self._run(_ops.submit_request(self, queue, request, task))

    def submit_many(self, task: TaskDef[Any, R] | str, payloads: Iterable[Any], *, queue: str | None = None,
                    priority: str | None = None) -> list[Handle[R] | AxError]:
        """Submits one task per payload in batches; one ``Handle`` (accepted) or
        ``AxError`` (refused) per payload, in order."""
        return self._run(_ops.submit_many(self, task, payloads, queue, priority))

    def get(self, task_id: str) -> dict[str, Any] | None:
        """The task's current state as a record (PROTOCOL.md §4): its stored record, or,
        before a worker has claimed it, the record its message stands for; None if no task
        has this id."""
        return self._run(_ops.get(task_id))

    def wait(self, task_id: str, timeout: float | None = None) -> dict[str, Any]:
        """Waits until the task is finished; its final record (``TimedOut`` after
        ``timeout`` seconds)."""
        return self._run(_ops.wait(task_id, timeout))

    def result(self, task_id: str, timeout: float | None = None) -> Any:
        """The output of the task once it succeeded; ``TaskFailed`` if it ended
        otherwise. Bytes outputs come as ``bytes``."""
        return self._run(_ops.result(task_id, timeout))

    def history(self, task_id: str) -> dict[str, Any]:
        """The task's recorded events (``events`` of PROTOCOL.md §8)."""
        return self._run(_ops.task_call("events", task_id))

    def cancel(self, task_id: str) -> dict[str, Any]:
        return self._run(_ops.task_call("cancel", task_id))

    def retry(self, task_id: str, reset_attempts: bool = False) -> dict[str, Any]:
        return self._run(_ops.task_call("retry", task_id, reset_attempts=reset_attempts))

    def run_now(self, task_id: str) -> dict[str, Any]:
        return self._run(_ops.task_call("run_now", task_id))

    def pause(self, queue: str, reason: str | None = None) -> Any:
        return self._run(_ops.pause(queue, reason))

    def resume(self, queue: str) -> Any:
        return self._run(_ops.resume(queue))

    # -- task settings (kept apart from code, applied live) ------------------------------

    def task_options(self, name: str, queue: str = "default") -> dict[str, Any] | None:
        """The stored settings of task ``name`` (their JSON form: ``max_attempts``,
        ``timeout_ms``, ...), or None."""
        return self._run(_ops.task_options(name, queue))

    def set_task_options(self, name: str, queue: str = "default", *, replace: bool = False,
                         **values: Any) -> dict[str, Any]:
        """Stores settings of task ``name`` in the settings file's words (``retries``,
        ``timeout``, ``heartbeat_timeout``, ``retry_backoff``, ``retry_backoff_max``,
        ``retry_jitter``, ``retry_on``, ``no_retry_on``, ``concurrency``, ``alert_group``;
        times in seconds, timedeltas or strings like ``"30s"``), merged into what is
        stored unless ``replace``. Every worker of the queue (Python and Rust) applies them
        to its next attempts of that name: stored settings > ``@ax.task`` options >
        server defaults. Returns the settings stored."""
        return self._run(_ops.set_task_options(name, queue, replace, values))

    def delete_task_options(self, name: str, queue: str = "default") -> bool:
        """Deletes the stored settings of task ``name``: its workers go back to the
        ``@ax.task`` options. True if there were some."""
        return self._run(_ops.delete_task_options(name, queue))

    def list_task_options(self, queue: str | None = None) -> list[dict[str, Any]]:
        """Every stored task setting (``{queue, name, settings}``), of one queue if given."""
        return self._run(_ops.list_task_options(queue))

    def apply_settings(self, source: str | os.PathLike[str] | dict[str, Any]) -> list[dict[str, Any]]:
        """Stores the ``tasks:`` settings of a settings file (YAML with the ``yaml`` extra,
        or JSON; or the file's data as a dict), as ``ax apply -f`` does but without
        deleting what the file does not name. Checked whole before anything is stored: a
        bad entry raises ``InvalidInput`` naming it (``tasks.<name>.<field>``). Returns
        what was stored."""
        return self._run(_ops.apply_settings(source))

    # -- flows --------------------------------------------------------------------------

    def put_flow(self, flow: FlowDef | dict[str, Any]) -> dict[str, Any]:
        """Stores a flow's definition (an ``@ax.flow`` or a definition dict)."""
        return self._run(_ops.put_flow(self.stored_flows, flow))

    def trigger_flow(self, flow: FlowDef | str, payload: Any = None) -> str:
        """Starts a run of ``flow`` (an ``@ax.flow``, stored first if this client has not
        yet, or a flow name) with ``payload`` as its input; returns the run id."""
        return self._run(_ops.trigger_flow(self.stored_flows, flow, payload))

    def wait_flow(self, run: str, timeout: float | None = None) -> dict[str, Any]:
        """Waits until the run has ended; the run record."""
        return self._run(_ops.wait_flow(run, timeout))

    def flow_result(self, run: str, timeout: float | None = None) -> dict[str, Any]:
        """Waits for the run; ``FlowFailed`` unless it succeeded; its steps' outputs by
        step name."""
        return self._run(_ops.flow_result(run, timeout))

    def flow_run(self, run: str) -> dict[str, Any]:
        """The run with its steps (``get`` of PROTOCOL.md §6)."""
        return self._run(_ops.run_call("get", run))

    def rerun_flow(self, run: str, mode: str = "failed", payload: Any = None) -> Any:
        return self._run(_ops.rerun_flow(run, mode, payload))

    def cancel_flow(self, run: str) -> Any:
        return self._run(_ops.run_call("cancel", run))

    def approve(self, token: str, payload: Any = None) -> dict[str, Any]:
        """Approves the approval whose announcement gave ``token`` (PROTOCOL.md §6,
        "Approvals"): its step succeeds with ``{"decision": "approved", "payload"}``.
        Again answers the same; after a rejection or a timeout raises ``Conflict``; an
        unknown or wrong token raises ``NotFound``."""
        return self._run(_ops.complete_approval(token, "approve", payload=payload))

    def reject(self, token: str, reason: str | None = None) -> dict[str, Any]:
        """Rejects it: its step fails, class ``approval_rejected``, ``reason`` its message."""
        return self._run(_ops.complete_approval(token, "reject", reason=reason))

    def approvals(self) -> list[dict[str, Any]]:
        """The approvals waiting, oldest first (``task``, ``flow``, ``run``, ``step``,
        ``message``, ``since_ms``, ``until_ms``; no tokens)."""
        return self._run(_ops.call("flow", "approvals"))

    # -- the rest -----------------------------------------------------------------------

    def publish_event(self, name: str, payload: Any = None, *, id: str | None = None) -> int:
        """Publishes event ``name`` (``ax.events.<name>``, kept in ``AX_EVENTS``) with a JSON
        ``payload``: the flows' waits for it (``ax.wait_for_event``) whose match it meets end
        with it. With ``id``, a publish retried within two minutes is one event. Returns its
        sequence; a bad name raises ``InvalidInput``, no broker ``Unavailable``."""
        return self._run(_ops.publish_event(name, {} if payload is None else payload, id))

    def call(self, api: str, op: str, body: Any = None) -> Any:
        """Calls ``ax.<api>.<op>`` (``task``, ``flow``, ``limit``, ``trigger``) with a JSON
        body; the ``ok`` value. Refusals raise the typed errors of ``ax.errors``."""
        return self._run(_ops.call(api, op, body))

    def events(self, subject: str = "ax.events.alert.>", poll: float = 1.0) -> Iterator[Event]:
        """Follows ax's events (by default the alerts: tasks dead, flow runs failed, one
        per burst); yields each as an ``ax.Event`` (every follower gets each)."""
        from ._events import follow

        return follow(self._conn.subscribe(subject), poll)

    def close(self) -> None:
        """Closes the connection, unless this client borrows the ``Runtime``'s (that one
        closes with its runtime)."""
        if self._owned:
            self._conn.close()
        else:
            log.debug("ax: Client.close(): the connection is the runtime's, left open")


__all__ = ["Client", "TimedOut"]
