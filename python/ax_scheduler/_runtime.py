"""``ax.Runtime``: workers for every registered task, and the embedded local runtime."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
from typing import Any, Iterable

from . import _core, _events, _json, _logs, _options, _schedule
from ._client import Client
from ._embedded import LocalNats, listening, local_port, reclaim, storage_target
from ._executors import Executors
from ._processes import ProcessPool
from ._flow import FLOWS
from ._task import REGISTRY, RUNNING, SERVING_EVERY_TASK, TaskDef
from .errors import AxError, Conflict, InvalidInput

log = logging.getLogger("ax_scheduler")
_EXECUTORS = ("threadpool", "process", "asyncio")
_running: "Runtime | None" = None


_metrics_at: str | None = None


def _serve_metrics(addr: str) -> None:
    """Serves ``/metrics`` on ``addr`` (once per process: the exporter is process-wide)."""
    global _metrics_at
    if _metrics_at is not None:
        if _metrics_at != addr:
            log.warning("ax: metrics are served on %s already (one exporter per process); not on %s",
                        _metrics_at, addr)
        return
    _metrics_at = _core.serve_metrics(addr)
    log.info("ax: Prometheus metrics on http://%s/metrics", _metrics_at)


def _count(value: object, top: int) -> bool:
    """An integer 1..top (not a bool: a caller without types may pass anything)."""
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= top


def current() -> "Runtime | None":
    """The runtime started in this process, if any."""
    return _running


class Runtime:
    """Runs workers for the registered tasks (all of them, or ``tasks``), on
    ``max_concurrency`` attempts at once.

    ``executor``: where sync functions run — ``threadpool`` (a dedicated pool of
    ``max_concurrency`` threads), ``process`` (a child process per attempt, killed on
    timeout or cancel) or ``asyncio`` (sync functions on the same pool; for runtimes of
    mostly ``async def`` tasks). ``async def`` tasks always run on the runtime's one
    event loop.

    ``url``: NATS. None: ``$AX_URL``; else, if something listens on 127.0.0.1:4222
    (``$AX_LOCAL_PORT``), that; else the **embedded local runtime** — a nats-server with
    JetStream on ``data_dir`` (default ``.ax``) and an ax server in this process.
    ``server``: run an ax server in this process (default: only in the embedded case).
    ``storage``: instead of ``url`` / ``data_dir``, a NATS URL or a directory (a path,
    ``file:///path`` or ``sqlite:///path``: a directory holding JetStream's store).

    ``capacity``: ``(high, normal, low)`` tasks each queue holds ready, for the queues the
    in-process server creates (default 1,000 / 5,000 / 10,000; a submit beyond it is
    refused ``busy``; ``ax streams apply --capacity`` changes existing queues).
    ``aging``: priority aging, seconds (default off): a priority whose oldest waiting task
    has waited this long is picked as the one above it (``low`` as ``normal``; twice as
    long: as ``high``), so old low-priority work is served sooner under a high-priority
    load (guides/limits.md, "Priority aging").
    ``metrics_addr``: serve Prometheus metrics on ``HOST:PORT`` (``/metrics``: the
    worker's ``ax_worker_busy_rate``, ``ax_task_timeout_rate``, … and the runtime's
    ``ax_python_*``; once per process). ``log_level``: the Rust core's records that reach
    ``logging`` (logger ``ax_scheduler.core``; default ``$AX_LOG`` or ``warn``).

    ``config``: a settings file (``runtime.yaml``: retries, timeouts, concurrency, alert
    group per task, in the decorator's words) stored when the runtime starts, before its
    workers take tasks; every worker of those queues, Python or Rust, applies it, and
    ``ax tasks options set`` or ``ax apply -f`` change it live. Precedence: stored settings
    > ``@ax.task`` options > server defaults (a submit's own values above all).
    """

    def __init__(self, url: str | None = None, *, max_concurrency: int = 10, executor: str = "threadpool",
                 tasks: Iterable[TaskDef] | None = None, data_dir: str | os.PathLike[str] | None = None,
                 server: bool | None = None, queues: Iterable[str] = (), console: str | None = None,
                 console_token: str | None = None, shutdown_grace: float = 30.0, creds: str | None = None,
                 token: str | None = None, log_level: str | None = None, worker_id: str | None = None,
                 ack_wait: float | None = None, config: "str | os.PathLike[str] | dict[str, Any] | None" = None,
                 storage: str | os.PathLike[str] | None = None, capacity: tuple[int, int, int] | None = None,
                 metrics_addr: str | None = None, aging: float | None = None):
        if executor not in _EXECUTORS:
            raise InvalidInput(f"executor must be one of {_EXECUTORS}, not {executor!r}", field="executor")
        if not _count(max_concurrency, 10_000):
            raise InvalidInput(f"max_concurrency must be an integer 1..10000, not {max_concurrency!r}",
                               field="max_concurrency")
        if storage is not None:
            if url is not None or data_dir is not None:
                raise InvalidInput("give storage=, or url= / data_dir=, not both", field="storage")
            url, data_dir = storage_target(storage)
            if data_dir is not None:
                log.warning("ax: storage=%r: ax keeps its state in NATS JetStream, not a SQLite file: the embedded "
                            "local runtime stores it in the directory %s", os.fspath(storage), data_dir.resolve())
        self.url = url or os.environ.get("AX_URL") or None
        self.max_concurrency = max_concurrency
        self.executor = executor
        self.data_dir: str | os.PathLike[str] = data_dir if data_dir is not None else ".ax"
        self.server = server
        self.extra_queues = list(queues)
        self.console = console
        self.console_token = console_token
        self.shutdown_grace = shutdown_grace
        self.creds, self.token = creds, token
        self.log_level = log_level or os.environ.get("AX_LOG", "warn")
        self.worker_id = worker_id
        self.ack_wait = ack_wait
        self.config = config
        self.capacity = capacity
        self.metrics_addr = metrics_addr
        self.aging = _options.seconds(aging, "aging")
        if self.aging is not None and not 0 < self.aging <= 7 * 86_400:
            raise InvalidInput(f"aging must be more than 0 seconds and at most 7 days, not {aging!r}", field="aging")
        self._only = list(tasks) if tasks is not None else None
        self.connection: Any = None
        self._nats: LocalNats | None = None
        self._server: Any = None
        self._workers: list[Any] = []
        self._tasks: dict[str, TaskDef] = {}
        self._inbox: Any = None
        self._executors: Executors | None = None
        self._stop = threading.Event()
        self._events: _events.Dispatcher | None = None
        self._event_failures = 0  # of dispatchers stopped

    # -- start and stop -----------------------------------------------------------------

    def start(self) -> "Runtime":
        """Connects (or starts the embedded broker and server), stores the flows and
        schedules of its tasks, and starts the workers. On failure, stops what it started.
        A runtime starts once (``Conflict`` after that; make another)."""
        if self.connection is not None or self._executors is not None:
            raise Conflict("this runtime is running already: stop() it first, or make another Runtime")
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> "Runtime":
        global _running
        _logs.relay_core_logs(self.log_level)
        # A process that exits with the runtime still running stops it first: its threads
        # wait in the core with the GIL released, and must not be there when the
        # interpreter finalizes (see _logs._stop_relay).
        atexit.register(self.stop)
        if self.metrics_addr is not None:
            _serve_metrics(self.metrics_addr)
        tasks = self._only if self._only is not None else list(REGISTRY.values())
        RUNNING.add(id(self))
        if self._only is None:
            SERVING_EVERY_TASK.add(id(self))
        self._tasks = {t.name: t for t in tasks}
        queues = sorted({t.options.queue for t in tasks} | set(self.extra_queues) | {"default"})
        url, embedded = self.url, False
        if url is None:
            port = local_port()
            reclaim(self.data_dir)  # a broker this directory's dead runtime left would pass for a NATS
            if listening("127.0.0.1", port):
                url = f"nats://127.0.0.1:{port}"
                log.warning("ax: using %s, a NATS this runtime did not start (not the broker of %s)%s", url,
                            os.path.abspath(self.data_dir), "" if self.server else
                            "; waiting up to 30 s for an ax server there: start one (python -m ax_scheduler "
                            "server, or Runtime(server=True)), or stop that NATS, or pass url=")
            else:
                self._nats = LocalNats(self.data_dir, port=port).start()
                url, embedded = self._nats.url, True
        self.connection = _core.Connection.connect(url, "ax-python-runtime", 5.0, self.creds, self.token, 30.0)
        if self.server or (self.server is None and embedded):
            self._server = _core.serve(self.connection, queues, self.console, self.console_token, self.ack_wait,
                                       True, self.capacity)
        if embedded:
            log.warning("ax: embedded local runtime: nats-server with JetStream on %s (data in %s) and an ax "
                        "server in this process", url, os.path.abspath(self.data_dir))
        self._inbox = _core.Inbox()
        processes = None
        if self.executor == "process":
            processes = ProcessPool(self.max_concurrency, [t for t in tasks if not t.is_async], url, self.creds,
                                    self.token)
        self._executors = Executors(self._inbox, self._tasks, self.executor, self.max_concurrency,
                                    processes).start()
        _running = self
        client = Client(_conn=self.connection)
        if self.config is not None:
            for stored in client.apply_settings(self.config):
                log.info("ax: settings of task %s on %s stored from %s", stored["name"], stored["queue"],
                         "the config" if isinstance(self.config, dict) else self.config)
        self._register(client, tasks)
        by_queue: dict[str, list[TaskDef]] = {}
        for t in tasks:
            by_queue.setdefault(t.options.queue, []).append(t)
        if _events.HANDLERS:
            self._events = _events.Dispatcher(self.connection, _events.HANDLERS)
        for queue, defs in sorted(by_queue.items()):
            declared = [(t.name, _json.dumps(t.options.worker_options())) for t in defs]
            self._workers.append(_core.start_worker(
                self.connection, queue, declared, self._inbox, self.max_concurrency, self.shutdown_grace,
                self.worker_id, self.aging))
        return self

    def _register(self, client: Client, tasks: list[TaskDef]) -> None:
        """Stores the flows whose tasks this runtime serves, the schedules its tasks declare
        (``cron`` / ``every``) and ``ax.schedule`` made, as triggers, and ``rate_limit``s as
        limits (named ``task-<name>``)."""
        names = {t.name for t in tasks}
        for fd in FLOWS.values():
            steps = fd.definition()["steps"]
            if any(s.get("task", {}).get("name") in names for s in steps):
                client.put_flow(fd)
        for t in tasks:
            o = t.options
            if o.cron is not None or o.every is not None:
                client.call("trigger", "put", _schedule.trigger(
                    t.name, cron=o.cron, tz=o.tz, every=o.every,
                    tasks=[{"name": t.name, "queue": o.queue, "payload": o.schedule_payload}],
                    overlap=o.overlap))
            if o.rate_limit is not None:
                client.call("limit", "put", {"name": f"task-{t.name}", "queue": o.queue, "task": t.name,
                                             "rate": o.rate_limit})
        for definition in _schedule.SCHEDULES.values():
            for started in definition["flows"]:
                if started["flow"] in FLOWS:
                    client.put_flow(FLOWS[started["flow"]])
            client.call("trigger", "put", definition)

    @property
    def event_handler_failures(self) -> int:
        """Exceptions ``@ax.on_event`` handlers raised in this runtime (each logged)."""
        return self._event_failures + (self._events.failures if self._events is not None else 0)

    def ready(self) -> bool:
        """True once every worker found its queue (and, with ``executor="process"``, its
        task processes have started)."""
        return (bool(self._workers) and all(w.ready() for w in self._workers)
                and self._executors is not None and self._executors.ready())

    def stop(self) -> None:
        """Stops pulling; running attempts get ``shutdown_grace`` seconds to finish, then
        are handed back; then the embedded server and broker stop."""
        global _running
        atexit.unregister(self.stop)
        SERVING_EVERY_TASK.discard(id(self))
        RUNNING.discard(id(self))
        errors: list[AxError] = []
        for w in self._workers:
            w.request_stop()  # every grace runs at once
        for w in self._workers:
            try:
                w.stop()
            except AxError as e:
                errors.append(e)
        self._workers.clear()
        if self._events is not None:
            self._events.stop()
            self._event_failures += self._events.failures
            self._events = None
        if self._inbox is not None:
            self._inbox.close()  # waiting threads return at once
        if self._executors is not None:
            self._executors.stop()
            self._executors = None
        if self._server is not None:
            self._server.stop()
            self._server = None
        with Client._lock:
            # The shared client borrowed this connection: the next use makes its own.
            if Client._default is not None and Client._default._conn is self.connection:
                Client._default = None
        if self.connection is not None:
            self.connection.close()
            self.connection = None
        if self._nats is not None:
            self._nats.stop()
            self._nats = None
        if _running is self:
            _running = None
        if errors:
            raise errors[0]

    def run(self) -> None:
        """Starts (if not started) and serves until SIGTERM or ctrl-c, then stops
        gracefully."""
        if self.connection is None:
            self.start()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._on_signal)
        log.warning("ax: serving %s", ", ".join(sorted(self._tasks)) or "no tasks")
        try:
            while not self._stop.wait(0.2):
                pass
        finally:
            log.warning("ax: stopping: running tasks finish (grace %s s)", self.shutdown_grace)
            self.stop()

    def _on_signal(self, signum: int, frame: object) -> None:
        self._stop.set()

    def __enter__(self) -> "Runtime":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
