"""``ax.testing.LocalAx``: a real ax for integration tests — the pinned nats-server with
JetStream on a free port and a temporary directory, an ax server in this process, and
runtimes started for given tasks — and runs through it read back as the test mode's
``Result`` / ``FlowResult``, so one test can compare both."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable

from . import _core
from ._client import Client
from ._embedded import LocalNats
from ._flow import FLOWS, FlowDef
from ._runtime import Runtime
from ._schedule import SCHEDULES
from ._task import REGISTRY, TaskDef
from ._testing_flow import FlowResult, StepResult
from ._testing_task import Attempt, Result, output_value, resolve_task
from . import _json
from .errors import AxError, FlowDefinitionError, InvalidInput, TimedOut, Unavailable

log = logging.getLogger("ax_scheduler.testing")
_ENDED = ("retrying", "succeeded", "dead", "cancelled")


class LocalAx:
    """A nats-server (``LocalNats``, on a free port, storing in ``data_dir`` or a
    temporary directory) and an ax server in this process (``_core.serve``) declaring
    ``queues``, with ready consumers' ``ack_wait`` seconds (short: a task whose worker
    died comes back within it). ``url``; ``client`` (an ``ax.Client``); ``runtime(*tasks)``;
    ``run`` / ``run_flow``; ``close()`` stops all of it. Also a context manager.

    **Queues.** A worker only finds a queue an ax server has declared. The server declares
    ``queues`` when it starts; ``declare(*queues)`` declares more while it runs (as ``ax
    streams apply --queue``, from this process), and ``runtime()`` and ``run_flow()`` do
    so for every queue the tasks, flows and schedules registered in this process use, so
    a test never lists queues by hand."""

    def __init__(self, data_dir: str | os.PathLike[str] | None = None, *, queues: Iterable[str] = ("default",),
                 ack_wait: float = 2.0, log_level: str | None = None) -> None:
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir) if data_dir is not None else Path(tempfile.mkdtemp(prefix="ax-local-"))
        self.ack_wait = ack_wait
        self.log_level = log_level or os.environ.get("AX_LOG", "warn")
        self._queues = sorted(set(queues) | {"default"})
        self.declared: set[str] = set()
        self.nats: LocalNats | None = None
        self._conn: Any = None
        self._server: Any = None
        self._client: Client | None = None
        self._runtimes: list[Runtime] = []

    # -- start and stop ---------------------------------------------------------------------

    def start(self) -> "LocalAx":
        """Starts the broker and the server and waits until the server answers; on
        failure, stops what it started."""
        try:
            _core.init_logging(self.log_level)
            self.nats = LocalNats(self.data_dir).start()
            self._conn = _core.Connection.connect(self.nats.url, "ax-testing-server", 5.0, None, None, 30.0)
            self._server = _core.serve(self._conn, self._queues, None, None, self.ack_wait)
            self._client = Client(self.nats.url)
            self._client.call("task", "queues")  # waits until the server answers
            self.declared.update(self._queues)
            log.info("ax.testing: local ax on %s (data in %s), queues %s", self.url, self.data_dir, self._queues)
            return self
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stops the runtimes, the server and the broker (and removes a temporary data
        directory); errors are logged, and the first is raised once all is stopped."""
        errors: list[BaseException] = []
        self.stop_runtimes()
        for what, stop in (("client", self._client.close if self._client else None),
                           ("server", self._server.stop if self._server else None),
                           ("connection", self._conn.close if self._conn else None),
                           ("nats-server", self.nats.stop if self.nats else None)):
            if stop is None:
                continue
            try:
                stop()
            except Exception as e:  # the rest is stopped all the same
                log.exception("ax.testing: stopping the %s", what)
                errors.append(e)
        self._client = self._server = self._conn = self.nats = None
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        if errors:
            raise errors[0]

    def __enter__(self) -> "LocalAx":
        return self.start() if self.nats is None else self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def url(self) -> str:
        if self.nats is None:
            raise Unavailable("this LocalAx is not started")
        return self.nats.url

    @property
    def client(self) -> Client:
        if self._client is None:
            raise Unavailable("this LocalAx is not started")
        return self._client

    # -- queues and runtimes ----------------------------------------------------------------

    def declare(self, *queues: str) -> None:
        """Declares these queues (their ready consumers), as ``ax streams apply --queue``
        does, unless declared already."""
        missing = sorted(set(queues) - self.declared)
        if not missing:
            return
        argv = ["ax", "streams", "apply", "--url", self.url, "--ack-wait", f"{round(self.ack_wait * 1000)}ms"]
        for q in missing:
            argv += ["--queue", q]
        code = _core.cli(argv)
        if code != 0:
            raise AxError(f"declaring queues {missing} failed (ax streams apply exited {code})")
        self.declared.update(missing)

    def queues_in_use(self, tasks: Iterable[TaskDef[..., Any]] = ()) -> set[str]:
        """The queues of ``tasks`` and of every task, flow and schedule registered in this
        process (a runtime stores the flows and schedules, whose queues the server checks)."""
        queues = {t.options.queue for t in tasks} | {t.options.queue for t in REGISTRY.values()}
        for fd in list(FLOWS.values()):
            try:
                steps = fd.definition()["steps"]
            except FlowDefinitionError as e:  # a runtime refuses it when it stores it; not here
                log.warning("ax.testing: flow %s has no definition (%s): its queues are not declared", fd.name, e)
                continue
            queues |= {s["task"]["queue"] for s in steps if "task" in s}  # a sleep step has none
            queues |= {s["sleep"]["queue"] for s in steps if "queue" in s.get("sleep", {})}
        for definition in SCHEDULES.values():
            queues |= {t.get("queue", "default") for t in definition.get("tasks", [])}
        return queues

    def runtime(self, *tasks: TaskDef[..., Any], ready_timeout: float = 15.0, **kwargs: Any) -> Runtime:
        """Starts an ``ax.Runtime`` on this broker for ``tasks`` (``kwargs`` as
        ``ax.Runtime``'s; ``shutdown_grace`` 5 s unless given) and waits until its workers
        found their queues. Stopped by ``stop_runtimes()`` — after each test, with the
        pytest fixture — or ``close()``."""
        if not tasks:
            raise InvalidInput("runtime() takes the @ax.task functions it serves")
        self.declare(*self.queues_in_use(tasks))
        kwargs.setdefault("shutdown_grace", 5.0)
        rt = Runtime(self.url, tasks=list(tasks), **kwargs).start()
        self._runtimes.append(rt)
        deadline = time.monotonic() + ready_timeout
        while not rt.ready():
            if time.monotonic() > deadline:
                raise TimedOut(f"the runtime's workers for {[t.name for t in tasks]} did not find their queues "
                               f"within {ready_timeout} s")
            time.sleep(0.05)
        return rt

    def stop_runtimes(self) -> None:
        """Stops the runtimes ``runtime()`` started (each, whatever the others do)."""
        runtimes, self._runtimes = self._runtimes, []
        for rt in runtimes:
            try:
                rt.stop()
            except AxError:  # one that fails to stop does not keep the others running
                log.exception("ax.testing: stopping a runtime")

    # -- runs through the broker ------------------------------------------------------------

    def run(self, task: Any, *args: Any, ax_timeout: float = 60.0, **kwargs: Any) -> Result:
        """Submits ``task(*args, **kwargs)`` through the broker (a runtime must serve it:
        ``runtime(task)``), waits until it ends, and reads it back as a ``Result``: state,
        typed output, and each attempt from the record's history (its last 16 writes)."""
        td = resolve_task(task)
        payload = td.payload(args, kwargs)
        key = str(td.options.idempotency_key(*args, **kwargs)) if td.options.idempotency_key is not None else None
        handle = self.client.submit_request(td.options.queue, td.request(payload, key=key), td)
        record = self.client.wait(handle.id, timeout=ax_timeout)
        return self.result_of(handle.id, record, td)

    def result_of(self, task_id: str, record: dict[str, Any] | None = None,
                  td: TaskDef[..., Any] | None = None) -> Result:
        """The ``Result`` of a finished task ``task_id`` (its record read back)."""
        got: dict[str, Any] = self.client.call("task", "get", {"id": task_id})
        final: dict[str, Any] = record or got["record"]
        td = td or REGISTRY.get(final["name"])
        history: list[dict[str, Any]] = got.get("history") or []
        by_attempt: dict[int, dict[str, Any]] = {}
        for entry in sorted(history, key=lambda h: int(h["revision"])):
            rec: dict[str, Any] = entry["record"]
            if rec.get("state") in _ENDED and rec.get("attempt", 0) > 0:
                by_attempt[rec["attempt"]] = rec
        if final.get("attempt", 0) > 0:
            by_attempt[final["attempt"]] = final
        attempts: list[Attempt] = []
        for n in sorted(by_attempt):
            rec = by_attempt[n]
            state = {"succeeded": "succeeded", "cancelled": "cancelled"}.get(rec["state"], "failed")
            a = Attempt(n, state, started_at_ms=rec.get("started_at_ms"))
            error: dict[str, Any] | None = rec.get("last_error") if state != "succeeded" else None
            if error:
                a.error_class, a.error_message, a.error_detail = error.get("class"), error.get("message"), \
                    error.get("detail")
            if rec["state"] == "retrying" and rec.get("next_retry_at_ms") is not None:
                a.retry_delay = (rec["next_retry_at_ms"] - rec["updated_at_ms"]) / 1000
            attempts.append(a)
        output = raw = None
        if final["state"] == "succeeded":
            raw = self.client.result(task_id)
            output = _json.typed(raw, td.output_type()) if td is not None and not isinstance(raw, bytes) else raw
        return Result(id=task_id, task=final["name"], queue=final["queue"], state=final["state"],
                      attempts=attempts, output=output, raw_output=raw, max_attempts=final.get("max_attempts", 0),
                      created_at_ms=final.get("created_at_ms", 0))

    def run_flow(self, flow: FlowDef, input: Any = None, *, timeout: float = 60.0) -> FlowResult:
        """Starts a run of ``flow`` through the broker (runtimes must serve its tasks),
        waits until it ends, and reads it back as a ``FlowResult``: the run's state and
        reason, each step's state, error, attempts and outputs (every item's)."""
        self.declare(*{s["task"]["queue"] for s in flow.definition()["steps"]})
        run = self.client.trigger_flow(flow, input)
        self.client.wait_flow(run, timeout)
        return self.flow_result_of(run)

    def flow_result_of(self, run: str) -> FlowResult:
        """The ``FlowResult`` of run ``run`` (read back)."""
        got: dict[str, Any] = self.client.flow_run(run)
        fd = FLOWS.get(got["flow"])
        defined: list[dict[str, Any]] = fd.definition()["steps"] if fd else []
        fan_out: dict[str, bool] = {d["name"]: d.get("for_each") is not None for d in defined}
        steps: dict[str, StepResult] = {}
        recorded: list[dict[str, Any]] = got["steps"]
        for s in recorded:
            step = StepResult(s["name"], s["task"], s["state"], error=s.get("error"), items=s.get("items"),
                              attempts=s.get("attempts"))
            if s["state"] == "succeeded" and s.get("task_id"):
                prefix = s["task_id"].rsplit(".", 1)[0]
                results = [self.result_of(f"{prefix}.{k}") for k in range(s.get("items") or 0)]
                step.tasks = results
                typed = [r.output for r in results]
                raws = [output_value(r.raw_output, False) if isinstance(r.raw_output, bytes) else r.raw_output
                        for r in results]
                if fan_out.get(s["name"], False):
                    step.output, step.raw_output = typed, raws
                else:
                    step.output, step.raw_output = (typed[-1], raws[-1]) if results else (None, None)
            steps[s["name"]] = step
        return FlowResult(got["flow"], run, got["state"], got.get("reason"), got.get("input"), steps)


def local(data_dir: str | os.PathLike[str] | None = None, **kwargs: Any) -> LocalAx:
    """A started ``LocalAx`` (``with ax.testing.local() as env: ...``)."""
    return LocalAx(data_dir, **kwargs).start()
