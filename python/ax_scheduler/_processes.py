"""``executor="process"``: sync tasks run in child processes of their own, for CPU-bound
work and for limits on memory and CPU time.

The children are *spawned* (a fresh interpreter, not a fork of this process: a fork copies
the Rust core's threads' locks in whatever state they were, and a child that used ax then
hung). Each imports the modules the runtime's tasks live in and serves attempts one after
another, so a task pays no process start. A child is killed when the worker gives up on
its attempt (hard timeout, cancel, shutdown) or when it ran past a limit, and a new one
takes its place. A task in a child can use ax (``task.submit``, ``ax.Client()``): the
child opens its own connection on first use.

Per-task limits (``@ax.task(max_memory_mb=..., max_cpu_seconds=...)``) are
``resource.setrlimit`` in the child for the attempt: ``RLIMIT_AS`` (the address space may
grow by at most that much) and ``RLIMIT_CPU`` (whole seconds of CPU). Past one, the
attempt fails with class ``memory_limit`` or ``cpu_limit``, not retried.
"""

from __future__ import annotations

import importlib
import logging
import math
import multiprocessing
import os
import queue
import resource
import signal
import sys
import threading
import time
from typing import Any

from ._attempt import Delivery, encode, failure, prepare
from ._context import _current
from ._otel import attempt_span
from ._task import REGISTRY, TaskDef
from .errors import AxError, InvalidInput

log = logging.getLogger("ax_scheduler")
READY_WAIT = 120.0  # how long a child may take to start and import the task modules
_MAIN = ("__main__", "__mp_main__")


class _Child:
    """One child process and the parent's end of its pipe."""

    def __init__(self, conn: Any, proc: Any):
        self.conn = conn
        self.proc = proc
        self.ready = False
        # Killed once: the attempt's thread (its timeout) and the runtime's stop may both
        # kill a child at the same moment, and a pipe closed twice at once closes a file
        # descriptor that may already belong to something else.
        self._kill_lock = threading.Lock()
        self._killed = False

    @classmethod
    def spawn(cls, ctx: Any, target: Any, args: tuple[Any, ...]) -> _Child:
        conn, child_end = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=target, args=(child_end, *args), daemon=True, name="ax-task-process")
        proc.start()
        child_end.close()
        return cls(conn, proc)

    def wait_ready(self, timeout: float) -> None:
        try:
            if not self.conn.poll(timeout):
                raise AxError(f"the task process {self.proc.pid} did not start within {timeout} s")
            kind, value = self.conn.recv()
        except (EOFError, OSError) as e:
            raise AxError(f"the task process {self.proc.pid} exited while starting ({e!r})") from None
        if kind != "ready":
            raise AxError(f"the task process could not load the tasks: {value}")
        self.ready = True

    def kill(self) -> None:
        """Kills the child and closes its pipe, once: later calls, from any thread, return
        at once."""
        with self._kill_lock:
            if self._killed:
                return
            self._killed = True
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(2)
        self.conn.close()


class ProcessPool:
    """Up to ``size`` children; ``run`` hands an attempt to an idle one (starting one if
    none is idle) and waits for its end on the calling task thread."""

    def __init__(self, size: int, tasks: list[TaskDef], url: str, creds: str | None, token: str | None):
        self.size = size
        self._ctx = multiprocessing.get_context("spawn")
        self._modules = sorted({t.fn.__module__ for t in tasks if t.fn.__module__ not in _MAIN})
        self._args = (url, creds, token, self._modules)
        self._idle: queue.SimpleQueue[_Child] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._children: list[_Child] = []
        self._closing = threading.Event()
        self._warmed = threading.Event()
        self.replaced = 0

    def start(self) -> None:
        """Starts the children in the background, so the first attempts find them ready."""
        threading.Thread(target=self._warm, name="ax-process-pool", daemon=True).start()

    def ready(self) -> bool:
        """True once the first children have started (the runtime is ready then)."""
        return self._warmed.is_set()

    def _warm(self) -> None:
        """Starts every child at once, then waits for each to load the task modules."""
        started = [self._spawn() for _ in range(self.size) if not self._closing.is_set()]
        for child in started:
            try:
                child.wait_ready(READY_WAIT)
            except AxError as e:
                log.error("ax: process executor: %s", e)
                self._drop(child)
                continue
            self._idle.put(child)
        self._warmed.set()

    def _spawn(self) -> _Child:
        with self._lock:
            child = _Child.spawn(self._ctx, _child_main, self._args)
            self._children.append(child)
        return child

    def _new(self) -> _Child:
        child = self._spawn()
        try:
            child.wait_ready(READY_WAIT)
        except BaseException:
            self._drop(child)
            raise
        return child

    def _drop(self, child: _Child) -> None:
        with self._lock:
            if child in self._children:
                self._children.remove(child)
        child.kill()

    def _take(self, core: Any) -> _Child:
        """An idle child, waiting (with heartbeats for the attempt) while the children
        start; one started here if the pool has room."""
        deadline = time.monotonic() + READY_WAIT
        while True:
            try:
                return self._idle.get(timeout=0.2)
            except queue.Empty:
                pass
            core.heartbeat()  # the attempt has not started: its soft timeout must not run out
            with self._lock:
                room = len(self._children) < self.size
            if room and self._warmed.is_set():
                return self._new()
            if time.monotonic() > deadline:
                raise AxError(f"no task process became free within {READY_WAIT} s")

    def stop(self) -> None:
        self._closing.set()
        with self._lock:
            children = list(self._children)
        for child in children:
            self._drop(child)

    def run(self, td: TaskDef, core: Any) -> None:
        """Runs one attempt in a child; ends it through ``core``. The child is killed if
        the worker gives up on the attempt, or dies; either way a new one replaces it."""
        try:
            child = self._take(core)
        except AxError as e:
            core.fail("process_unavailable", f"no task process: {e}", False, None)
            return
        limits = (td.options.max_memory_mb, td.options.max_cpu_seconds)
        try:
            child.conn.send(("run", Delivery.of(core), limits))
        except OSError as e:
            self._replace(child)
            core.fail("process_died", f"the task's process is gone: {e}", False, None)
            return
        kind: str
        value: Any = None
        while True:
            if child.conn.poll(0.1):
                try:
                    kind, value = child.conn.recv()
                except (EOFError, OSError):
                    kind, value = "died", None
                if kind == "beat":
                    core.heartbeat()
                    continue
                break
            if core.cancelled():
                self._replace(child)
                return
            if not child.proc.is_alive():
                kind, value = "died", None
                break
        if kind == "died":
            self._replace(child)
            core.fail("process_died", f"the task's process exited with {child.proc.exitcode}", False, None)
        elif kind == "ok":
            self._idle.put(child)
            data, is_json = value
            if not core.ok(data, is_json):
                log.info("ax: task %s: late result refused", core.id)
        else:
            cls, permanent, message, detail = value
            if cls in ("memory_limit", "cpu_limit"):
                self._replace(child)  # past a limit: its state is not to be trusted
            else:
                self._idle.put(child)
            if not core.fail(cls, message, permanent, detail):
                log.info("ax: task %s: late failure refused", core.id)

    def _replace(self, child: _Child) -> None:
        """Kills ``child`` and starts another in the background."""
        self._drop(child)
        self.replaced += 1
        if not self._closing.is_set():
            threading.Thread(target=self._refill, name="ax-process-pool", daemon=True).start()

    def _refill(self) -> None:
        try:
            self._idle.put(self._new())
        except AxError as e:
            log.error("ax: process executor: %s", e)


# -- in the child ---------------------------------------------------------------------------

class _ChildCore:
    """What ``ax.context()`` reaches in a child: heartbeats go to the parent, which passes
    them on to the Rust worker."""

    def __init__(self, conn: Any, lock: threading.Lock):
        self._conn = conn
        self._lock = lock

    def heartbeat(self) -> None:
        with self._lock:
            self._conn.send(("beat", None))

    def cancelled(self) -> bool:
        return False  # the parent kills the child instead

    def abandoned(self) -> bool:
        return False

    def fencing_token(self) -> int:
        raise AxError("fencing_token() is not available in a process-executor child")


class CpuLimit(Exception):
    """Raised in a child when its attempt used up its CPU seconds."""


def _on_xcpu(_sig: int, _frame: Any) -> None:
    raise CpuLimit("the attempt used up its CPU seconds (max_cpu_seconds)")


def _child_main(conn: Any, url: str, creds: str | None, token: str | None, modules: list[str]) -> None:
    """A child: loads the task modules, says ready, then serves attempts until the pipe
    closes (the parent is gone) or it is killed."""
    os.environ["AX_URL"] = url
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # ctrl-c is the parent's to handle
    signal.signal(signal.SIGXCPU, _on_xcpu)
    try:
        for name in modules:
            importlib.import_module(name)
        if creds or token:
            from ._client import Client

            Client._default = Client(url, creds=creds, token=token)
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", os.getpid()))
    lock = threading.Lock()
    while True:
        try:
            kind, attempt, limits = conn.recv()
        except (EOFError, OSError):
            return
        if kind != "run":
            continue
        out = _child_attempt(attempt, limits, _ChildCore(conn, lock))
        with lock:
            conn.send(out)


def _child_attempt(attempt: Delivery, limits: tuple[int | None, float | None], core: _ChildCore) -> tuple[str, Any]:
    td = REGISTRY.get(attempt.name)
    if td is None:
        loaded = ", ".join(sorted(REGISTRY)) or "none"
        return "fail", ("process_unavailable", True,
                        f"task {attempt.name} is not defined in the task process (tasks there: {loaded}); "
                        "define it in an importable module or in the script run as __main__", None)
    restore = _limit(*limits)
    try:
        args, kwargs, ctx = prepare(td, attempt, core)
        token = _current.set(ctx)
        try:
            with attempt_span(ctx):
                result = td.fn(*args, **kwargs)
        finally:
            _current.reset(token)
            restore()
        try:
            return "ok", encode(td, result)
        except InvalidInput as e:
            return "fail", ("bad_output", True, str(e), None)
    except MemoryError as e:
        restore()
        if limits[0] is not None:
            return "fail", ("memory_limit", True, f"the attempt's memory passed max_memory_mb={limits[0]}: {e!r}",
                            None)
        return "fail", failure(td, e)
    except CpuLimit as e:
        restore()
        return "fail", ("cpu_limit", True, f"{e} ({limits[1]} s)", None)
    except BaseException as e:
        restore()
        cls, permanent, message, detail = failure(td, e)
        return "fail", (cls, permanent, message, detail)


def _address_space() -> int:
    """This process's address space in bytes (VmSize)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


def _limit(memory_mb: int | None, cpu_seconds: float | None) -> Any:
    """Sets the attempt's limits; returns what puts the previous ones back."""
    saved: list[tuple[int, tuple[int, int]]] = []
    if memory_mb is not None and sys.platform.startswith("linux"):
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        want = _address_space() + memory_mb * 1024 * 1024
        if hard != resource.RLIM_INFINITY:
            want = min(want, hard)
        saved.append((resource.RLIMIT_AS, (soft, hard)))
        resource.setrlimit(resource.RLIMIT_AS, (want, hard))
    if cpu_seconds is not None:
        soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        want = math.ceil(usage.ru_utime + usage.ru_stime + cpu_seconds)
        if hard != resource.RLIM_INFINITY:
            want = min(want, hard)
        saved.append((resource.RLIMIT_CPU, (soft, hard)))
        resource.setrlimit(resource.RLIMIT_CPU, (want, hard))
    done = False

    def restore() -> None:
        nonlocal done
        if done:
            return
        done = True
        for which, previous in saved:
            resource.setrlimit(which, previous)

    return restore

