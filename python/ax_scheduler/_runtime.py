"""``ax.Runtime``: workers for every registered task, and the embedded local runtime."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import traceback
from typing import Any, Iterable

from . import _core, _events, _json, _schedule
from ._client import DEFAULT_URL, Client
from ._context import TaskContext, _current
from ._embedded import LocalNats, listening
from ._flow import FLOWS, resolve
from ._task import REGISTRY, TaskDef
from .errors import AxError, InvalidInput

log = logging.getLogger("ax_scheduler")
_EXECUTORS = ("threadpool", "process", "asyncio")
_running: "Runtime | None" = None


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

    ``url``: NATS. None: ``$AX_URL``; else, if something listens on 127.0.0.1:4222,
    that; else the **embedded local runtime** — a nats-server with JetStream on
    ``data_dir`` and an ax server in this process. ``server``: run an ax server in this
    process (default: only in the embedded case).

    ``config``: a settings file (``runtime.yaml``: retries, timeouts, concurrency, alert
    group per task, in the decorator's words) stored when the runtime starts, before its
    workers take tasks; every worker of those queues, Python or Rust, applies it, and
    ``ax tasks options set`` or ``ax apply -f`` change it live. Precedence: stored settings
    > ``@ax.task`` options > server defaults (a submit's own values above all).
    """

    def __init__(self, url: str | None = None, *, max_concurrency: int = 10, executor: str = "threadpool",
                 tasks: Iterable[TaskDef] | None = None, data_dir: str | os.PathLike = ".ax",
                 server: bool | None = None, queues: Iterable[str] = (), console: str | None = None,
                 console_token: str | None = None, shutdown_grace: float = 30.0, creds: str | None = None,
                 token: str | None = None, log_level: str | None = None, worker_id: str | None = None,
                 ack_wait: float | None = None, config: "str | os.PathLike | dict[str, Any] | None" = None):
        if executor not in _EXECUTORS:
            raise InvalidInput(f"executor must be one of {_EXECUTORS}, not {executor!r}", field="executor")
        if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or not 1 <= max_concurrency <= 10_000:
            raise InvalidInput(f"max_concurrency must be an integer 1..10000, not {max_concurrency!r}",
                               field="max_concurrency")
        self.url = url or os.environ.get("AX_URL") or None
        self.max_concurrency = max_concurrency
        self.executor = executor
        self.data_dir = data_dir
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
        self._only = list(tasks) if tasks is not None else None
        self.connection: Any = None
        self._nats: LocalNats | None = None
        self._server: Any = None
        self._workers: list[Any] = []
        self._tasks: dict[str, TaskDef] = {}
        self._inbox: Any = None
        self._threads: list[threading.Thread] = []
        self._closing = threading.Event()
        self.thread_failures = 0  # attempts a task thread failed outside the task (a runtime bug)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._events: _events.Dispatcher | None = None

    # -- start and stop -----------------------------------------------------------------

    def start(self) -> "Runtime":
        """Connects (or starts the embedded broker and server), stores the flows and
        schedules of its tasks, and starts the workers. On failure, stops what it started."""
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> "Runtime":
        global _running
        _core.init_logging(self.log_level)
        tasks = self._only if self._only is not None else list(REGISTRY.values())
        self._tasks = {t.name: t for t in tasks}
        queues = sorted({t.options.queue for t in tasks} | set(self.extra_queues) | {"default"})
        url, embedded = self.url, False
        if url is None:
            if listening("127.0.0.1", 4222):
                url = DEFAULT_URL
            else:
                self._nats = LocalNats(self.data_dir, port=4222).start()
                url, embedded = self._nats.url, True
        self.connection = _core.Connection.connect(url, "ax-python-runtime", 5.0, self.creds, self.token, 30.0)
        if self.server or (self.server is None and embedded):
            self._server = _core.serve(self.connection, queues, self.console, self.console_token, self.ack_wait)
        if embedded:
            log.warning("ax: embedded local runtime: nats-server with JetStream on %s (data in %s) and an ax "
                        "server in this process", url, os.path.abspath(self.data_dir))
        self._inbox = _core.Inbox()
        self._closing.clear()
        for i in range(self.max_concurrency):
            thread = threading.Thread(target=self._serve, name=f"ax-task-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="ax-asyncio", daemon=True)
        self._loop_thread.start()
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
                self.worker_id))
        return self

    def _register(self, client: Client, tasks: list[TaskDef]) -> None:
        """Stores the flows whose tasks this runtime serves, the schedules its tasks declare
        (``cron`` / ``every``) and ``ax.schedule`` made, as triggers, and ``rate_limit``s as
        limits (named ``task-<name>``)."""
        names = {t.name for t in tasks}
        for fd in FLOWS.values():
            steps = fd.definition()["steps"]
            if any(s["task"]["name"] in names for s in steps):
                client.put_flow(fd)
        for t in tasks:
            o = t.options
            if o.cron is not None or o.every is not None:
                client.call("trigger", "put", _schedule.trigger(
                    t.name, cron=o.cron, tz=o.tz, every=o.every,
                    tasks=[{"name": t.name, "queue": o.queue, "payload": o.schedule_payload}]))
            if o.rate_limit is not None:
                client.call("limit", "put", {"name": f"task-{t.name}", "queue": o.queue, "task": t.name,
                                             "rate": o.rate_limit})
        for definition in _schedule.SCHEDULES.values():
            for started in definition["flows"]:
                if started["flow"] in FLOWS:
                    client.put_flow(FLOWS[started["flow"]])
            client.call("trigger", "put", definition)

    def ready(self) -> bool:
        """True once every worker found its queue."""
        return bool(self._workers) and all(w.ready() for w in self._workers)

    def stop(self) -> None:
        """Stops pulling; running attempts get ``shutdown_grace`` seconds to finish, then
        are handed back; then the embedded server and broker stop."""
        global _running
        errors: list[AxError] = []
        for w in self._workers:
            try:
                w.stop()
            except AxError as e:
                errors.append(e)
        self._workers.clear()
        if self._events is not None:
            self._events.stop()
            self._events = None
        if self._inbox is not None:
            self._inbox.close()  # waiting threads return at once and see _closing
        self._closing.set()
        for thread in self._threads:
            thread.join(5)
        self._threads.clear()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._loop_thread is not None:
                self._loop_thread.join(5)
            if not self._loop.is_running():
                self._loop.close()
            self._loop = None
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
                signal.signal(sig, lambda *_: self._stop.set())
        log.warning("ax: serving %s", ", ".join(sorted(self._tasks)) or "no tasks")
        try:
            while not self._stop.wait(0.2):
                pass
        finally:
            log.warning("ax: stopping: running tasks finish (grace %s s)", self.shutdown_grace)
            self.stop()

    def __enter__(self) -> "Runtime":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- attempts -----------------------------------------------------------------------

    def _serve(self) -> None:
        """One of the runtime's ``max_concurrency`` threads: takes attempts from the inbox
        (waiting with the GIL released) and runs them."""
        while not self._closing.is_set():
            core = self._inbox.next(0.5)
            if core is None:
                continue
            try:
                self._handle(core)
            except Exception as e:  # a bug of the runtime: the thread goes on serving
                self.thread_failures += 1
                log.exception("ax: task thread: %s (task %s; failure %d, the thread goes on)",
                              e, core.id, self.thread_failures)
                core.fail("runtime_error", f"the Python runtime failed: {e}", False, None)

    def _handle(self, core: Any) -> None:
        td = self._tasks.get(core.name)
        if td is None:
            core.fail("unserved", f"no task {core.name!r} in this runtime", False, None)
        elif core.cancelled():
            return  # the worker gave up on it while it waited: its end is already written
        elif td.is_async:
            asyncio.run_coroutine_threadsafe(self._run_async(td, core), self._loop)  # type: ignore[arg-type]
        elif self.executor == "process":
            self._run_process(td, core)
        else:
            self._run_sync(td, core)

    def _prepare(self, td: TaskDef, core: Any) -> tuple[list, dict, TaskContext]:
        payload = _json.loads(core.payload) if core.is_json else bytes(core.payload)
        flow = run = step = index = None
        args_spec = payload.get("args") if isinstance(payload, dict) else None
        if isinstance(args_spec, dict) and "ax_args" in args_spec and "run" in payload:
            flow, run, step, index = payload.get("flow"), payload.get("run"), payload.get("step"), payload.get("index")
            resolved = resolve(payload, args_spec["ax_args"])
            args, kwargs = [], {k: _json.typed(v, td.hints.get(k)) for k, v in resolved.items()}
        else:
            args, kwargs = td.arguments(payload)
        ctx = TaskContext(core.id, core.name, core.queue, core.priority, core.attempt, core.max_attempts,
                          core.idempotency_key, core.created_at_ms, core.run_at_ms, core.traceparent,
                          flow, run, step, index, core)
        return args, kwargs, ctx

    def _ok(self, td: TaskDef, core: Any, result: Any) -> None:
        try:
            data, is_json = _encode(td, result)
        except InvalidInput as e:
            core.fail("bad_output", str(e), True, None)
            return
        if not core.ok(data, is_json):
            log.info("ax: task %s: late result refused (the attempt had timed out or was cancelled)", core.id)

    def _fail(self, td: TaskDef, core: Any, error: BaseException) -> None:
        cls, permanent = td.classify(error)
        if isinstance(error, InvalidInput) and error.code == "bad_payload":
            cls, permanent = "bad_payload", True
        detail = "".join(traceback.format_exception(error))[-8000:]
        if not core.fail(cls, str(error) or cls, permanent, detail):
            log.info("ax: task %s: late failure refused", core.id)

    def _run_sync(self, td: TaskDef, core: Any) -> None:
        try:
            args, kwargs, ctx = self._prepare(td, core)
            token = _current.set(ctx)
            try:
                result = td.fn(*args, **kwargs)
            finally:
                _current.reset(token)
        except Exception as e:
            self._fail(td, core, e)
            return
        self._ok(td, core, result)

    async def _run_async(self, td: TaskDef, core: Any) -> None:
        try:
            args, kwargs, ctx = self._prepare(td, core)
            _current.set(ctx)
            job = asyncio.ensure_future(td.fn(*args, **kwargs))
            while not job.done():
                await asyncio.wait({job}, timeout=0.1)
                if not job.done() and core.cancelled():
                    job.cancel()
                    return
            result = job.result()
        except asyncio.CancelledError:
            return
        except Exception as e:
            self._fail(td, core, e)
            return
        self._ok(td, core, result)

    def _run_process(self, td: TaskDef, core: Any) -> None:
        """A child process per attempt (forked: it shares the parent's code), killed when
        the worker gives up on the attempt (hard timeout, cancel, shutdown)."""
        try:
            args, kwargs, ctx = self._prepare(td, core)
        except Exception as e:
            self._fail(td, core, e)
            return
        mp = multiprocessing.get_context("fork")
        receive, send = mp.Pipe(duplex=False)
        child = mp.Process(target=_child, args=(td, args, kwargs, ctx, send), daemon=True)
        child.start()
        send.close()
        try:
            while True:
                if receive.poll(0.1):
                    kind, value = pickle.loads(receive.recv_bytes())
                    if kind == "beat":
                        core.heartbeat()
                        continue
                    break
                if core.cancelled():
                    child.kill()
                    return
                if not child.is_alive() and not receive.poll(0):
                    core.fail("process_died", f"the task's process exited with {child.exitcode}", False, None)
                    return
        finally:
            receive.close()
            child.join(1)
        if kind == "ok":
            data, is_json = value
            if not core.ok(data, is_json):
                log.info("ax: task %s: late result refused", core.id)
        else:
            cls, permanent, message, detail = value
            core.fail(cls, message, permanent, detail)


def _encode(td: TaskDef, result: Any) -> tuple[bytes | None, bool]:
    """A task's result as stored: bytes as bytes, None as no output, else JSON."""
    if isinstance(result, (bytes, bytearray)):
        return bytes(result), False
    if result is None:
        return None, True
    return _json.dumps(result, f"the result of task {td.name}"), True


class _ChildCore:
    """What a process-executor child's ``ax.context()`` reaches: heartbeats go to the
    parent over the pipe (the parent passes them on to the Rust worker)."""

    def __init__(self, send: Any):
        self._send = send
        self._lock = threading.Lock()

    def put(self, kind: str, value: Any) -> None:
        with self._lock:
            self._send.send_bytes(pickle.dumps((kind, value)))

    def heartbeat(self) -> None:
        self.put("beat", None)

    def cancelled(self) -> bool:
        return False  # the parent kills the child instead

    def fencing_token(self) -> int:
        raise AxError("fencing_token() is not available in a process-executor child")


def _child(td: TaskDef, args: list, kwargs: dict, ctx: TaskContext, send: Any) -> None:
    core = _ChildCore(send)
    token = _current.set(dataclasses.replace(ctx, _core=core))
    try:
        result = td.fn(*args, **kwargs)
        try:
            out: tuple[str, Any] = ("ok", _encode(td, result))
        except InvalidInput as e:
            out = ("fail", ("bad_output", True, str(e), None))
    except Exception as e:
        cls, permanent = td.classify(e)
        out = ("fail", (cls, permanent, str(e) or cls, "".join(traceback.format_exception(e))[-8000:]))
    finally:
        _current.reset(token)
    core.put(*out)
    send.close()
    os._exit(0)
