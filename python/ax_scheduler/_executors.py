"""Where attempts run: the runtime's task threads, its event loop for ``async def``
tasks, and child processes for ``executor="process"`` (``_processes``). The Rust worker
puts each attempt in the inbox only when it has a free slot; a task thread takes it out
and runs it.

A sync function cannot be interrupted. When the worker gives up on an attempt (hard
timeout, cancel) its slot is free at once and it may hand out another attempt, while the
thread still runs the old function. The keeper marks such a thread stuck and starts a
new one in its place, so free slots always find a free thread and no attempt spends its
timeout waiting for one; the stuck thread ends when its function returns. Each is logged
and counted (``ax_python_stuck_threads``, ``ax_python_threads_replaced_total``).

Nothing a task raises ends a thread or the loop: a ``BaseException`` (``SystemExit``,
``KeyboardInterrupt``) is that attempt's failure. A thread or the loop that ends anyway
(a runtime bug) is logged, counted (``ax_python_restarts_total``) and started again.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Callable, Coroutine

from . import _core
from ._attempt import encode, failure, prepare
from ._context import TaskContext, _current
from ._otel import attempt_span
from ._processes import ProcessPool
from ._task import TaskDef
from .errors import InvalidInput

log = logging.getLogger("ax_scheduler")
KEEPER_TICK = 0.05  # how often the keeper looks for threads stuck in abandoned attempts


def _metric(kind: str, name: str, value: float, queue: str | None = None) -> None:
    labels = [("queue", queue)] if queue is not None else [("executor", "python")]
    try:
        if kind == "gauge":
            _core.gauge_set(name, value, labels)
        else:
            _core.counter_add(name, int(value), labels)
    except Exception:  # metrics never stop a task; the failure is logged
        log.exception("ax: metric %s", name)


class Executors:
    """The runtime's task threads over ``inbox`` (``max_concurrency`` free ones at any
    time), its event loop, and its process pool when ``executor="process"``."""

    def __init__(self, inbox: Any, tasks: dict[str, TaskDef], executor: str, max_concurrency: int,
                 processes: ProcessPool | None = None):
        self._inbox = inbox
        self._tasks = tasks
        self.executor = executor
        self.max_concurrency = max_concurrency
        self._processes = processes
        self._lock = threading.Lock()
        self._threads: dict[int, threading.Thread] = {}
        self._busy: dict[int, Any] = {}  # thread id -> the attempt it runs in the thread
        self._stuck: dict[int, str] = {}  # thread id -> queue: running an abandoned attempt
        self._named = 0
        self._closing = threading.Event()
        self.thread_failures = 0  # attempts a task thread failed outside the task (a runtime bug)
        self.threads_replaced = 0
        self.restarts = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._keeper: threading.Thread | None = None

    @property
    def stuck_threads(self) -> int:
        """Threads still running an attempt the worker gave up on (each replaced)."""
        with self._lock:
            return len(self._stuck)

    def start(self) -> "Executors":
        for _ in range(self.max_concurrency):
            self._spawn_thread()
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._run_loop, name="ax-asyncio", daemon=True)
        self._loop_thread.start()
        self._keeper = threading.Thread(target=self._keep, name="ax-task-keeper", daemon=True)
        self._keeper.start()
        if self._processes is not None:
            self._processes.start()
        return self

    def ready(self) -> bool:
        """True once the process executor's children have started (at once otherwise)."""
        return self._processes is None or self._processes.ready()

    def stop(self) -> None:
        """Ends the threads (the inbox is closed first), the loop and the children, each
        joined at once against one deadline."""
        self._closing.set()
        with self._lock:
            threads = list(self._threads.values())
        deadline = time.monotonic() + 5  # one deadline for all: they end together
        for thread in [*threads, self._keeper]:
            if thread is not None:
                thread.join(max(0.0, deadline - time.monotonic()))
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._loop_thread is not None:
                self._loop_thread.join(5)
            if not self._loop.is_running():
                self._loop.close()
            self._loop = None
        if self._processes is not None:
            self._processes.stop()

    # -- threads --------------------------------------------------------------------------

    def _spawn_thread(self) -> None:
        with self._lock:
            self._named += 1
            thread = threading.Thread(target=self._serve, name=f"ax-task-{self._named}", daemon=True)
            self._threads[id(thread)] = thread
        thread.start()

    def _serve(self) -> None:
        """A task thread: takes attempts from the inbox (waiting with the GIL released) and
        runs them, until the runtime closes or it was replaced while stuck."""
        me = id(threading.current_thread())
        try:
            while not self._closing.is_set():
                core = self._inbox.next(0.5)
                if core is None:
                    continue
                try:
                    self._handle(core)
                except BaseException as e:  # a bug of the runtime: the thread goes on serving
                    self.thread_failures += 1
                    log.exception("ax: task thread: %s (task %s; failure %d, the thread goes on)",
                                  e, core.id, self.thread_failures)
                    core.fail("runtime_error", f"the Python runtime failed: {e}", False, None)
                finally:
                    if self._leave(me):
                        return
        finally:
            with self._lock:
                self._threads.pop(me, None)

    def _leave(self, me: int) -> bool:
        """After an attempt: True if this thread had been replaced (it ends now)."""
        with self._lock:
            self._busy.pop(me, None)
            queue = self._stuck.pop(me, None)
            stuck = len([q for q in self._stuck.values() if q == queue])
        if queue is None:
            return False
        log.warning("ax: a stuck task thread's function returned; the thread ends (%d still stuck on %s)",
                    stuck, queue)
        _metric("gauge", "ax_python_stuck_threads", stuck, queue)
        return True

    def _keep(self) -> None:
        """Replaces each thread whose attempt the worker gave up on while its function still
        runs (a sync function cannot be interrupted)."""
        while not self._closing.wait(KEEPER_TICK):
            with self._lock:
                abandoned = [(t, core) for t, core in self._busy.items()
                             if t not in self._stuck and core.abandoned()]
                for t, core in abandoned:
                    self._stuck[t] = core.queue
            for t, core in abandoned:
                self.threads_replaced += 1
                with self._lock:
                    stuck = len([q for q in self._stuck.values() if q == core.queue])
                log.warning(
                    "ax: task %s (%s, attempt %d) is still running past the end of its attempt (hard timeout "
                    "or cancel) and cannot be interrupted; its thread is replaced by a new one (%d stuck on %s). "
                    "Check ax.context().cancelled in long loops.", core.name, core.id, core.attempt, stuck,
                    core.queue)
                _metric("counter", "ax_python_threads_replaced_total", 1, core.queue)
                _metric("gauge", "ax_python_stuck_threads", stuck, core.queue)
                self._spawn_thread()

    # -- attempts -------------------------------------------------------------------------

    def _handle(self, core: Any) -> None:
        td = self._tasks.get(core.name)
        if td is None:
            core.fail("unserved", f"no task {core.name!r} in this runtime", False, None)
        elif core.cancelled():
            return  # the worker gave up on it while it waited: its end is already written
        elif td.is_async:
            assert self._loop is not None
            asyncio.run_coroutine_threadsafe(self._run_async(td, core), self._loop)
        elif self._processes is not None:
            self._processes.run(td, core)
        else:
            with self._lock:
                self._busy[id(threading.current_thread())] = core
            self._run_sync(td, core)

    def _ok(self, td: TaskDef, core: Any, result: Any, ctx: TaskContext | None, started: float) -> None:
        try:
            data, is_json = encode(td, result)
        except InvalidInput as e:
            self._fail(td, core, e, ctx, started, ("bad_output", True, str(e), None))
            return
        if not core.ok(data, is_json):
            log.info("ax: task %s: late result refused (the attempt had timed out or was cancelled)", core.id)
        elif ctx is not None:
            ctx.logger.info("task %s %s succeeded in %.0f ms (attempt %d)", td.name, core.id,
                            (time.monotonic() - started) * 1000, core.attempt)

    def _fail(self, td: TaskDef, core: Any, error: BaseException | None, ctx: TaskContext | None, started: float,
              known: tuple[str, bool, str, str | None] | None = None) -> None:
        cls, permanent, message, detail = known if known is not None else failure(td, error)  # type: ignore[arg-type]
        if not core.fail(cls, message, permanent, detail):
            log.info("ax: task %s: late failure refused", core.id)
            return
        if ctx is None:
            return
        took = (time.monotonic() - started) * 1000
        if permanent or core.attempt >= core.max_attempts:
            ctx.logger.error("task %s %s failed for good (%s: %s) after %.0f ms, attempt %d of %d", td.name,
                             core.id, cls, message, took, core.attempt, core.max_attempts)
        else:
            ctx.logger.warning("task %s %s failed (%s: %s) after %.0f ms, attempt %d of %d: it will be retried",
                               td.name, core.id, cls, message, took, core.attempt, core.max_attempts)

    def _run_sync(self, td: TaskDef, core: Any) -> None:
        started, ctx = time.monotonic(), None
        try:
            args, kwargs, ctx = prepare(td, core, core)
            token = _current.set(ctx)
            try:
                with attempt_span(ctx):
                    result = td.fn(*args, **kwargs)
            finally:
                _current.reset(token)
        except BaseException as e:  # the attempt's failure, SystemExit included
            self._fail(td, core, e, ctx, started)
            return
        self._ok(td, core, result, ctx, started)

    async def _run_async(self, td: TaskDef, core: Any) -> None:
        started, ctx = time.monotonic(), None
        try:
            args, kwargs, ctx = prepare(td, core, core)
            _current.set(ctx)
            job = asyncio.ensure_future(_guarded(td.fn, args, kwargs, ctx))
            while not job.done():
                await asyncio.wait({job}, timeout=0.1)
                if not job.done() and core.cancelled():
                    job.cancel()
                    return
            ok, value = job.result()
        except asyncio.CancelledError:
            return
        except BaseException as e:
            self._fail(td, core, e, ctx, started)
            return
        if ok:
            self._ok(td, core, value, ctx, started)
        else:
            self._fail(td, core, value, ctx, started)

    # -- the event loop -------------------------------------------------------------------

    def _run_loop(self) -> None:
        """Runs the loop until the runtime stops it; an exception out of it (a callback's
        ``SystemExit``) is logged and counted, and the loop runs again."""
        loop = self._loop
        assert loop is not None
        while not self._closing.is_set():
            try:
                loop.run_forever()
            except BaseException as e:
                self.restarts += 1
                log.exception("ax: the event loop stopped on %r; it runs again (restart %d)", e, self.restarts)
                _metric("counter", "ax_python_restarts_total", 1)
                continue
            return  # stopped by stop()


async def _guarded(fn: Callable[..., Coroutine[Any, Any, Any]], args: list[Any], kwargs: dict[str, Any],
                   ctx: TaskContext) -> tuple[bool, Any]:
    """Runs the task's coroutine in its attempt's span and hands back ``(True, result)`` or
    ``(False, error)``: an exception never leaves the coroutine, so a ``SystemExit`` cannot
    stop the loop. A cancel (the attempt's hard timeout) still cancels it."""
    try:
        with attempt_span(ctx):
            return True, await fn(*args, **kwargs)
    except asyncio.CancelledError:
        raise
    except BaseException as e:
        return False, e
