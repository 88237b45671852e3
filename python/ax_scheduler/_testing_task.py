"""The test mode's task runs (``ax.testing.run``): one task's attempts in this process,
with no broker, as ax's worker would make them.

What is ax's own code here and what is a stand-in:

- ax's: the payload of a call (``TaskDef.payload``, JSON-encoded as a submit sends it),
  the arguments of a payload and the ``ax.context()`` of an attempt (``_attempt.prepare``),
  the stored form of a result (``_attempt.encode``: ``bad_output``), the class and
  permanence of a failure (``_attempt.failure``), the option defaults a worker declares
  (``TaskOptions.worker_options``).
- Stand-ins, written after the Rust worker (crates/ax-sdk/src/worker, backoff.rs): the
  retry decision and the backoff delays (``Policy``), the hard and soft timeouts and the
  operator's cancel (``FakeCore``), a fake clock that the backoff delays move instead of
  sleeping.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Generator, cast

from . import _json
from ._attempt import Delivery, encode, failure, prepare
from ._context import TaskContext, _current
from ._task import TaskDef
from .errors import InvalidInput, TaskFailed

log = logging.getLogger("ax_scheduler.testing")

# The server's defaults (PROTOCOL.md §2) for what neither the submit nor the task sets.
DEFAULT_MAX_ATTEMPTS = 5
DEFAULT_TIMEOUT_MS = 30_000
DEFAULT_BACKOFF: dict[str, Any] = {"base_ms": 1000, "max_ms": 600_000, "jitter": 0.2}
MAX_PAYLOAD_BYTES = 256 * 1024  # the server's default payload limit
MAX_OUTPUT_BYTES = 512 * 1024  # PROTOCOL.md §3 "Outputs"
# 2026-01-01T00:00:00Z: where a fake clock starts unless told otherwise.
EPOCH_MS = 1_767_225_600_000
_POLL = 0.02  # how often an async attempt's watcher looks at the cancel flag


class FakeClock:
    """The test mode's clock, in milliseconds since the Unix epoch. It moves only when told
    to: by the backoff delays between attempts (which are never slept) and by
    ``advance``. ``created_at_ms`` and the attempts' ``started_at_ms`` are read from it."""

    def __init__(self, start_ms: int = EPOCH_MS) -> None:
        self._ms = int(start_ms)

    def now_ms(self) -> int:
        return self._ms

    def advance(self, seconds: float) -> None:
        self.advance_ms(round(seconds * 1000))

    def advance_ms(self, ms: int) -> None:
        if ms < 0:
            raise InvalidInput(f"a clock does not go back ({ms} ms)")
        self._ms += int(ms)

    def set_ms(self, ms: int) -> None:
        """Moves the clock to ``ms`` (not back)."""
        self.advance_ms(int(ms) - self._ms)

    def __repr__(self) -> str:
        return f"<FakeClock {self._ms} ms>"


@dataclass(frozen=True)
class Policy:
    """How ax retries one task: the options a submit or a flow step's template gave, else
    those the task declares (``@ax.task``), else the server's defaults. Error classes of
    ``retry_on`` / ``no_retry_on`` are names, as a submit carries them (the decorator's
    exception classes are applied in Python, by ``TaskDef.classify``)."""

    max_attempts: int
    timeout_ms: int
    heartbeat_timeout_ms: int | None
    base_ms: int
    max_ms: int
    jitter: float
    retry_on: tuple[str, ...] = ()
    no_retry_on: tuple[str, ...] = ()

    @classmethod
    def of(cls, td: TaskDef[..., Any], request: dict[str, Any] | None = None) -> "Policy":
        declared: dict[str, Any] = td.options.worker_options()
        req: dict[str, Any] = request or {}
        backoff: dict[str, Any] = {**DEFAULT_BACKOFF, **declared.get("backoff", {}), **(req.get("backoff") or {})}
        return cls(
            max_attempts=int(req.get("max_attempts") or declared.get("max_attempts") or DEFAULT_MAX_ATTEMPTS),
            timeout_ms=int(req.get("timeout_ms") or declared.get("timeout_ms") or DEFAULT_TIMEOUT_MS),
            heartbeat_timeout_ms=declared.get("heartbeat_timeout_ms"),
            base_ms=int(backoff["base_ms"]), max_ms=int(max(backoff["max_ms"], backoff["base_ms"])),
            jitter=float(backoff["jitter"]),
            retry_on=tuple(req.get("retry_on") or ()), no_retry_on=tuple(req.get("no_retry_on") or ()))

    def nominal_ms(self, retry: int) -> int:
        """The un-jittered delay before retry ``retry`` (1 after the first failed
        attempt): ``min(max, base × 2^(retry−1))``."""
        factor: int = 2 ** min(max(retry - 1, 0), 31)
        return min(self.max_ms, self.base_ms * factor)

    def delay_ms(self, retry: int, rng: random.Random | None) -> int:
        """The delay before retry ``retry``, shortened by a random fraction below
        ``jitter`` drawn from ``rng``; without one, the un-jittered delay (the longest
        ax would wait), so a test's delays do not change from run to run."""
        nominal = self.nominal_ms(retry)
        if self.jitter <= 0 or rng is None:
            return nominal
        return int(nominal * (1.0 - rng.uniform(0.0, self.jitter)))

    def retryable(self, error_class: str) -> bool:
        return error_class not in self.no_retry_on and (not self.retry_on or error_class in self.retry_on)


class FakeCore:
    """The stand-in for the Rust worker's side of one attempt, as ``ax.context()._core``:
    ``heartbeat()`` counts, ``cancelled()`` turns true once the attempt's hard timeout or
    soft (heartbeat) timeout has passed or ``cancel()`` was called — as ax's does when the
    worker gives up on the attempt or an operator cancels the task — and
    ``fencing_token()`` grows with each attempt."""

    def __init__(self, token: int, timeout_ms: int, heartbeat_timeout_ms: int | None,
                 cancel_after_heartbeats: int | None = None) -> None:
        self._token = token
        self._timeout = timeout_ms / 1000
        self._soft = heartbeat_timeout_ms / 1000 if heartbeat_timeout_ms is not None else None
        self._cancel_after = cancel_after_heartbeats
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self._last_beat = self.started
        self._stalled: tuple[float, int, int] | None = None  # (when, gap ms, heartbeats before)
        self._cancelled_at: float | None = None
        self.heartbeats = 0

    def heartbeat(self) -> None:
        now = time.monotonic()
        with self._lock:
            self._note_gap(now)
            self._last_beat = now
            self.heartbeats += 1
            if self._cancel_after is not None and self.heartbeats >= self._cancel_after \
                    and self._cancelled_at is None:
                self._cancelled_at = now

    def _note_gap(self, now: float) -> None:
        if self._soft is not None and self._stalled is None and now - self._last_beat > self._soft:
            self._stalled = (self._last_beat + self._soft, round(self._soft * 1000), self.heartbeats)

    def cancel(self) -> None:
        """An operator's cancel of the task while this attempt runs."""
        with self._lock:
            if self._cancelled_at is None:
                self._cancelled_at = time.monotonic()

    def cancelled(self) -> bool:
        return self.end_cause(time.monotonic()) is not None

    def abandoned(self) -> bool:
        return self.cancelled()

    def fencing_token(self) -> int:
        return self._token

    def next_deadline(self) -> float:
        """The monotonic time at which the attempt would be stopped if nothing changes."""
        with self._lock:
            soft = self._last_beat + self._soft if self._soft is not None else float("inf")
            return min(self.started + self._timeout, soft)

    def end_cause(self, now: float) -> tuple[str, str] | None:
        """What ended the attempt by ``now`` (the earliest), as ``(class, message)``:
        ``cancelled``, ``timeout`` or ``heartbeat_timeout``; None if nothing did."""
        with self._lock:
            self._note_gap(now)
            causes: list[tuple[float, str, str]] = []
            if self._cancelled_at is not None:
                causes.append((self._cancelled_at, "cancelled", "cancelled by an operator while running"))
            hard = self.started + self._timeout
            if now > hard:
                causes.append((hard, "timeout", f"attempt exceeded its {round(self._timeout * 1000)} ms timeout"))
            if self._stalled is not None:
                at, ms, before = self._stalled
                causes.append((at, "heartbeat_timeout",
                               f"no heartbeat for {ms} ms (its heartbeat_timeout); {before} heartbeats before"))
        if not causes:
            return None
        _, cls, message = min(causes)
        return cls, message


@dataclass
class Outcome:
    """How one attempt ended, as the worker would write it."""

    state: str  # succeeded | failed | cancelled
    output: bytes | None = None
    is_json: bool = True
    error_class: str | None = None
    error_message: str | None = None
    error_detail: str | None = None
    permanent: bool = False
    heartbeats: int = 0
    duration: float = 0.0


@dataclass
class Attempt:
    """One attempt of a task. ``state`` is ``succeeded``, ``failed`` or ``cancelled``;
    ``retry_delay`` the seconds ax waits before the next attempt (None when there is
    none); ``heartbeats`` and ``duration`` (real seconds) are None for a run through a
    broker (``LocalAx.run``); ``started_at_ms`` is on the fake clock in the test mode."""

    number: int
    state: str
    error_class: str | None = None
    error_message: str | None = None
    error_detail: str | None = field(default=None, repr=False)
    permanent: bool = False
    retry_delay: float | None = None
    heartbeats: int | None = None
    duration: float | None = None
    started_at_ms: int | None = None


@dataclass
class Result:
    """A task's run: its final ``state`` (``succeeded``, ``dead``, or ``cancelled``), its
    ``output`` typed back by the function's return annotation (None unless it succeeded;
    ``raw_output`` is the JSON value as stored, or bytes), every attempt, the backoff
    delays, the heartbeats. ``result()`` is ``Handle.result()``: the output, or
    ``ax.TaskFailed``."""

    id: str
    task: str
    queue: str
    state: str
    attempts: list[Attempt]
    output: Any = None
    raw_output: Any = None
    max_attempts: int = 0
    created_at_ms: int = 0
    cancel_reason: str | None = None
    clock: FakeClock | None = field(default=None, repr=False)

    @property
    def succeeded(self) -> bool:
        return self.state == "succeeded"

    @property
    def last_error(self) -> dict[str, Any] | None:
        """``{"class", "message", "detail"}`` of the last failed attempt (or of the cancel
        of a task waiting for its next attempt), as the record's."""
        if self.cancel_reason is not None:
            return {"class": "cancelled", "message": self.cancel_reason, "detail": None}
        for a in reversed(self.attempts):
            if a.error_class is not None:
                return {"class": a.error_class, "message": a.error_message, "detail": a.error_detail}
        return None

    @property
    def error_class(self) -> str | None:
        error = self.last_error
        return None if error is None else error["class"]

    @property
    def error_message(self) -> str | None:
        error = self.last_error
        return None if error is None else error["message"]

    @property
    def error_classes(self) -> list[str | None]:
        """The error class of each attempt, in order (None for one that succeeded)."""
        return [a.error_class for a in self.attempts]

    @property
    def delays(self) -> list[float]:
        """The backoff delays between attempts, seconds."""
        return [a.retry_delay for a in self.attempts if a.retry_delay is not None]

    @property
    def heartbeats(self) -> int:
        return sum(a.heartbeats or 0 for a in self.attempts)

    def record(self) -> dict[str, Any]:
        """The fields of ax's task record (PROTOCOL.md §3) this run fills."""
        rec: dict[str, Any] = {"id": self.id, "name": self.task, "queue": self.queue, "state": self.state,
                               "attempt": len(self.attempts),
                               "max_attempts": self.max_attempts, "created_at_ms": self.created_at_ms}
        if self.last_error is not None:
            rec["last_error"] = self.last_error
        return rec

    def result(self) -> Any:
        """The typed output once the task succeeded; ``ax.TaskFailed`` otherwise."""
        if self.state != "succeeded":
            raise TaskFailed(f"task {self.id} ended {self.state}: {self.error_class}: {self.error_message}",
                             self.record())
        return self.output


def output_value(data: bytes | None, is_json: bool) -> Any:
    """A stored output as a flow step's children get it (PROTOCOL.md §6): the JSON value,
    None for no output, bytes as ``{"content_type", "base64"}``."""
    if data is None:
        return None
    if is_json:
        return _json.loads(data)
    return {"content_type": "application/octet-stream", "base64": base64.b64encode(data).decode()}


def stored_value(data: bytes | None, is_json: bool) -> Any:
    """A stored output as ``Client.result`` gives it: the JSON value, or bytes."""
    if data is None:
        return None
    return _json.loads(data) if is_json else bytes(data)


def typed_output(td: TaskDef[..., Any], data: bytes | None, is_json: bool) -> Any:
    """A stored output as ``Handle.result()`` gives it: typed by the return annotation,
    bytes as bytes."""
    if data is None:
        return None
    if not is_json:
        return bytes(data)
    return _json.typed(_json.loads(data), td.output_type())


# -- one attempt ------------------------------------------------------------------------


def _ended(td: TaskDef[..., Any], core: FakeCore, started: float, result: Any = None,
           error: BaseException | None = None) -> Outcome:
    """The attempt's outcome as the worker writes it: a cancel, timeout or stall that came
    first wins over what the function did (its late result is refused)."""
    now = time.monotonic()
    out = Outcome(state="failed", heartbeats=core.heartbeats, duration=now - started)
    cause = core.end_cause(now)
    if cause is not None:
        out.error_class, out.error_message = cause
        if cause[0] == "cancelled":
            out.state, out.permanent = "cancelled", True
        if result is not None or error is not None:
            log.info("ax.testing: task %s: its %s came after the attempt ended (%s): refused", td.name,
                     "failure" if error is not None else "result", cause[0])
        return out
    if error is not None:
        out.error_class, out.permanent, out.error_message, out.error_detail = failure(td, error)
        return out
    try:
        data, is_json = encode(td, result)
    except InvalidInput as e:
        out.error_class, out.error_message, out.permanent = "bad_output", str(e), True
        return out
    if data is not None and len(data) > MAX_OUTPUT_BYTES:
        out.error_class, out.permanent = "output_too_large", True
        out.error_message = f"the output is {len(data)} bytes; at most {MAX_OUTPUT_BYTES} are stored"
        return out
    out.state, out.output, out.is_json = "succeeded", data, is_json
    return out


def attempt_sync(td: TaskDef[..., Any], delivered: Delivery, core: FakeCore) -> Outcome:
    """One attempt of a sync function, on this thread. It cannot be interrupted (as in a
    runtime): a timeout or stall is found when it returns and fails the attempt."""
    started = time.monotonic()
    try:
        args, kwargs, ctx = prepare(td, delivered, core)
        token = _current.set(ctx)
        try:
            result = td.fn(*args, **kwargs)
        finally:
            _current.reset(token)
    except KeyboardInterrupt:
        raise  # ctrl-c stops the test (a runtime would fail the attempt)
    except BaseException as e:  # the attempt's failure, SystemExit included, as in a runtime
        return _ended(td, core, started, error=e)
    return _ended(td, core, started, result=result)


async def attempt_async(td: TaskDef[..., Any], delivered: Delivery, core: FakeCore) -> Outcome:
    """One attempt of an ``async def`` function on the running loop: cancelled at its hard
    timeout, its heartbeat timeout, or a cancel, as the runtime's event loop does."""
    started = time.monotonic()
    try:
        args, kwargs, ctx = prepare(td, delivered, core)
    except BaseException as e:  # a payload the function cannot take: the attempt's failure
        return _ended(td, core, started, error=e)

    async def body() -> tuple[bool, Any]:
        """``(True, result)`` or ``(False, error)``: as the runtime's ``_guarded``, no
        exception leaves the coroutine (a ``SystemExit`` would stop the loop); a cancel
        and ctrl-c still do."""
        _current.set(ctx)
        try:
            return True, await td.fn(*args, **kwargs)
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except BaseException as e:  # the attempt's failure, SystemExit included
            return False, e

    job = asyncio.ensure_future(body())
    while not job.done():
        wait = max(0.0, min(core.next_deadline() - time.monotonic(), _POLL)) + 0.001
        await asyncio.wait({job}, timeout=wait)
        if not job.done() and core.cancelled():
            job.cancel()
            done, _ = await asyncio.wait({job}, timeout=1.0)
            if not done:
                log.warning("ax.testing: task %s did not end within 1 s of its cancel; left running", td.name)
            return _ended(td, core, started)
    if job.cancelled():
        # Cancelled from inside: the runtime writes nothing, and ax fails the attempt at its
        # hard timeout.
        log.warning("ax.testing: task %s was cancelled from inside (asyncio.CancelledError): ax fails "
                    "such an attempt at its hard timeout", td.name)
        return Outcome(state="failed", error_class="timeout", heartbeats=core.heartbeats,
                       error_message=f"attempt exceeded its {round(core._timeout * 1000)} ms timeout",
                       duration=time.monotonic() - started)
    ok, value = job.result()
    if ok:
        return _ended(td, core, started, result=value)
    return _ended(td, core, started, error=value)


# -- a task's attempts ------------------------------------------------------------------


class TaskRun:
    """The attempts of one task, one at a time: ``begin`` gives the next attempt's
    delivery (None once the task has ended), ``end`` takes its outcome and answers the
    backoff delay before the next one (ms), or None when the task has ended."""

    def __init__(self, td: TaskDef[..., Any], payload: Any, *, task_id: str, clock: FakeClock, policy: Policy,
                 key: str | None = None, rng: random.Random | None = None,
                 cancel_after_heartbeats: int | None = None, priority: str | None = None,
                 queue: str | None = None, business_id: str | None = None) -> None:
        self.td = td
        self.business_id = business_id
        self.id = task_id
        self.queue = queue or td.options.queue
        self.policy = policy
        self.clock = clock
        self.rng = rng
        self.key = key
        self.priority = priority or td.options.priority
        self.cancel_after = cancel_after_heartbeats
        self.payload = _json.dumps(payload, f"the payload of task {td.name}")
        if len(self.payload) > MAX_PAYLOAD_BYTES:
            raise InvalidInput(f"task {td.name}: the payload is {len(self.payload)} bytes; the server takes at most "
                               f"{MAX_PAYLOAD_BYTES}", code="payload_too_large", field="payload")
        self.created_at_ms = clock.now_ms()
        self.attempts: list[Attempt] = []
        self.state = "pending"
        self.outcome: Outcome | None = None
        self.cancel_reason: str | None = None
        self._core: FakeCore | None = None

    @property
    def done(self) -> bool:
        return self.state in ("succeeded", "dead", "cancelled")

    def begin(self) -> tuple[Delivery, FakeCore] | None:
        if self.done:
            return None
        number = len(self.attempts) + 1
        self._core = FakeCore(number, self.policy.timeout_ms, self.policy.heartbeat_timeout_ms, self.cancel_after)
        delivered = Delivery(self.id, self.td.name, self.queue, self.priority, number,
                              self.policy.max_attempts, self.payload, True, self.key, self.created_at_ms, None, None,
                              self.business_id)
        self.attempts.append(Attempt(number, "running", started_at_ms=self.clock.now_ms()))
        self.state = "running"
        return delivered, self._core

    def end(self, out: Outcome) -> int | None:
        a = self.attempts[-1]
        a.state, a.heartbeats, a.duration = out.state, out.heartbeats, out.duration
        a.error_class, a.error_message, a.error_detail = out.error_class, out.error_message, out.error_detail
        a.permanent = out.permanent
        self.outcome = out
        if out.state == "succeeded":
            self.state = "succeeded"
            return None
        if out.state == "cancelled":
            self.state = "cancelled"
            return None
        assert out.error_class is not None
        if out.permanent or not self.policy.retryable(out.error_class) or a.number >= self.policy.max_attempts:
            self.state = "dead"
            return None
        delay = self.policy.delay_ms(a.number, self.rng)
        a.retry_delay = delay / 1000
        self.state = "retrying"
        return delay

    def cancel_unstarted(self, reason: str) -> None:
        """A fail-fast (or a run's cancel) cancels the task while it waits for its next
        attempt: it ends ``cancelled`` without running again."""
        self.state = "cancelled"
        self.cancel_reason = reason

    def result(self) -> Result:
        out = self.outcome
        succeeded = self.state == "succeeded" and out is not None
        return Result(
            id=self.id, task=self.td.name, queue=self.queue, state=self.state,
            attempts=list(self.attempts),
            output=typed_output(self.td, out.output, out.is_json) if succeeded and out else None,
            raw_output=stored_value(out.output, out.is_json) if succeeded and out else None,
            max_attempts=self.policy.max_attempts, created_at_ms=self.created_at_ms,
            cancel_reason=self.cancel_reason, clock=self.clock)


# -- running attempts in or out of an event loop ----------------------------------------


class Runner:
    """Runs attempts: sync functions on the calling thread, ``async def`` ones on ``loop``
    (another thread's running loop) or, without one, on a loop of its own."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop
        self._own: asyncio.AbstractEventLoop | None = None

    def attempt(self, td: TaskDef[..., Any], delivered: Delivery, core: FakeCore) -> Outcome:
        if not td.is_async:
            return attempt_sync(td, delivered, core)
        if self._loop is not None:
            return asyncio.run_coroutine_threadsafe(attempt_async(td, delivered, core), self._loop).result()
        if self._own is None:
            running = _running_loop()
            if running is not None:
                raise RuntimeError(f"task {td.name} is an async def and an event loop runs in this thread: "
                                   "use `await ax.testing.run_async(...)` / `await ax.testing.run_flow_async(...)`")
            self._own = asyncio.new_event_loop()
        return self._own.run_until_complete(attempt_async(td, delivered, core))

    def close(self) -> None:
        if self._own is not None:
            self._own.run_until_complete(self._own.shutdown_asyncgens())
            self._own.close()
            self._own = None

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # none runs in this thread: the one answer that says so
        return None


def drive(run: TaskRun, runner: Runner) -> Result:
    """Runs every attempt of ``run``, moving its clock by each backoff delay."""
    while (begun := run.begin()) is not None:
        delay = run.end(runner.attempt(run.td, *begun))
        if delay is not None:
            run.clock.advance_ms(delay)
    return run.result()


async def drive_async(run: TaskRun) -> Result:
    """``drive`` from a coroutine: ``async def`` attempts on this loop, sync ones on a
    thread (as a runtime runs them), so the loop is never blocked."""
    while (begun := run.begin()) is not None:
        if run.td.is_async:
            out = await attempt_async(run.td, *begun)
        else:
            out = await asyncio.to_thread(attempt_sync, run.td, *begun)
        delay = run.end(out)
        if delay is not None:
            run.clock.advance_ms(delay)
    return run.result()


@contextlib.contextmanager
def task_context(td: TaskDef[..., Any] | None = None, *, attempt: int = 1, max_attempts: int | None = None,
                 task_id: str | None = None, flow: str | None = None, run: str | None = None,
                 step: str | None = None, item_index: int | None = None, key: str | None = None,
                 business_id: str | None = None, clock: FakeClock | None = None,
                 core: FakeCore | None = None) -> Generator[TaskContext, None, None]:
    """Sets ``ax.context()`` (and so ``ax.heartbeat()``) for the code inside, as if it ran
    as attempt ``attempt`` of ``td`` (or of a task named ``test``): to call a task's
    function directly in a unit test. Yields the context; ``ctx._core`` is a ``FakeCore``."""
    name = td.name if td is not None else "test"
    queue = td.options.queue if td is not None else "default"
    policy = Policy.of(td) if td is not None else None
    core = core or FakeCore(attempt, policy.timeout_ms if policy else DEFAULT_TIMEOUT_MS,
                            policy.heartbeat_timeout_ms if policy else None)
    now = (clock or FakeClock()).now_ms()
    ctx = TaskContext(task_id or f"{queue}.test-{name}", name, queue, td.options.priority if td else "normal",
                      attempt, max_attempts or (policy.max_attempts if policy else DEFAULT_MAX_ATTEMPTS), key, now,
                      None, None, flow, run, step, item_index, core, business_id=business_id)
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)


def resolve_task(task: Any) -> TaskDef[..., Any]:
    if isinstance(task, TaskDef):
        return cast("TaskDef[..., Any]", task)
    from ._task import REGISTRY

    if isinstance(task, str) and task in REGISTRY:
        return REGISTRY[task]
    raise InvalidInput(f"ax.testing runs @ax.task functions (or their names), not {task!r}")


def new_run(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, task_id: str | None,
            key: str | None, clock: FakeClock | None, rng: random.Random | None,
            cancel_after_heartbeats: int | None, business_id: str | None = None) -> TaskRun:
    """The run of a direct call ``task(*args, **kwargs)`` as ``task.submit(...)`` would
    send it: its payload and idempotency key made by ax's own code."""
    td = resolve_task(task)
    payload = td.payload(args, kwargs)
    if key is None and td.options.idempotency_key is not None:
        key = str(td.options.idempotency_key(*args, **kwargs))
    td.request(payload, key=key)  # the submit request's own checks
    return TaskRun(td, payload, task_id=task_id or f"{td.options.queue}.test-{td.name}", clock=clock or FakeClock(),
                   policy=Policy.of(td), key=key, rng=rng, cancel_after_heartbeats=cancel_after_heartbeats,
                   business_id=business_id)

