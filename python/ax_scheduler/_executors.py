"""Where attempts run: the runtime's task threads, its event loop for ``async def``
tasks, and child processes for ``executor="process"``. The Rust worker puts each attempt
in the inbox; a task thread takes it out and runs it here."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import os
import pickle
import threading
import traceback
from typing import Any

from . import _json
from ._context import TaskContext, _current
from ._flow import resolve
from ._task import TaskDef
from .errors import AxError, InvalidInput

log = logging.getLogger("ax_scheduler")


class Executors:
    """The runtime's ``max_concurrency`` task threads over ``inbox``, and its event loop."""

    def __init__(self, inbox: Any, tasks: dict[str, TaskDef], executor: str, max_concurrency: int):
        self._inbox = inbox
        self._tasks = tasks
        self.executor = executor
        self.max_concurrency = max_concurrency
        self._threads: list[threading.Thread] = []
        self._closing = threading.Event()
        self.thread_failures = 0  # attempts a task thread failed outside the task (a runtime bug)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None

    def start(self) -> "Executors":
        for i in range(self.max_concurrency):
            thread = threading.Thread(target=self._serve, name=f"ax-task-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="ax-asyncio", daemon=True)
        self._loop_thread.start()
        return self

    def stop(self) -> None:
        """Ends the threads (the inbox is closed first) and the loop."""
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
