"""A submitted task (``Handle[R]``) and submits with options (``Submitter[P, R]``), in
both forms: blocking calls, and the same with ``_async`` as awaitables."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Generic, cast

from . import _json
from ._typing import P, R
from .errors import InvalidInput

if TYPE_CHECKING:
    from ._aio import AsyncClient
    from ._client import Client
    from ._task import TaskDef


@dataclass
class Handle(Generic[R]):
    """A submitted task: ``id``, and ``wait`` / ``result`` / ``get`` / ``cancel``, each
    also awaitable (``await handle.result_async()``). ``result`` is an ``R``: the
    function's return annotation types the output back."""

    id: str
    duplicate: bool
    state: str
    client: Client = field(repr=False)
    task: TaskDef[..., R] | None = field(default=None, repr=False)

    def get(self) -> dict[str, Any] | None:
        """The task's current state as a record (PROTOCOL.md §4): its stored record, or,
        before a worker has claimed it, the record its message stands for (``scheduled``
        or ``pending``); None if no task has this id."""
        return self.client.get(self.id)

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        """Waits until the task is finished and returns its final record (``TimedOut``
        after ``timeout`` seconds)."""
        return self.client.wait(self.id, timeout=timeout)

    def result(self, timeout: float | None = None) -> R:
        """The task's output once it succeeded, typed by the function's return
        annotation; ``TaskFailed`` if it ended otherwise."""
        return self._typed(self.client.result(self.id, timeout=timeout))

    def cancel(self) -> dict[str, Any]:
        return self.client.cancel(self.id)

    async def get_async(self) -> dict[str, Any] | None:
        return await self.client.aio.get(self.id)

    async def wait_async(self, timeout: float | None = None) -> dict[str, Any]:
        return await self.client.aio.wait(self.id, timeout=timeout)

    async def result_async(self, timeout: float | None = None) -> R:
        return self._typed(await self.client.aio.result(self.id, timeout=timeout))

    async def cancel_async(self) -> dict[str, Any]:
        return await self.client.aio.cancel(self.id)

    def _typed(self, output: Any) -> R:
        return cast(R, _json.typed(output, self.task.output_type() if self.task else None))


class Submitting(Generic[R]):
    """A submit sent and not yet known to be stored: ``submit_nowait`` returns at once, so
    one thread keeps many submits in flight (a producer's pipeline). ``handle()`` waits for
    ax's answer and is the task's ``Handle`` only once ax has stored it; a refusal raises
    there, typed as ``submit`` raises it. Until then the task may not exist."""

    def __init__(self, pending: Any, client: Client, task: TaskDef[..., R] | None):
        self._pending = pending
        self._client = client
        self._task = task
        self._handle: Handle[R] | None = None

    def done(self) -> bool:
        """True once ax has answered (``handle()`` then returns or raises at once)."""
        return self._handle is not None or bool(self._pending.done())

    def handle(self, timeout: float | None = None) -> Handle[R]:
        """The task's handle once ax has stored it (``TimedOut`` after ``timeout``
        seconds without an answer; the answer may still come: call again)."""
        if self._handle is None:
            reply = json.loads(self._pending.result(timeout))
            self._handle = Handle(reply["id"], reply["duplicate"], reply["state"], self._client, self._task)
        return self._handle


@dataclass(frozen=True)
class Submitter(Generic[P, R]):
    """``task.with_options(...)``: submits of ``task`` with these options. ``submit``
    takes the function's arguments, every keyword included (none is read as an option)."""

    task: TaskDef[P, R]
    delay: float | timedelta | None = None
    run_at: datetime | str | None = None
    key: str | None = None
    priority: str | None = None
    client: Client | AsyncClient | None = field(default=None, repr=False)

    def submit(self, *args: P.args, **kwargs: P.kwargs) -> Handle[R]:
        """Submits one run of the task with these arguments; its handle once ax has
        stored it."""
        from ._client import Client

        return Client.of(self.client).submit_request(self.task.options.queue, self._request(args, kwargs), self.task)

    def submit_nowait(self, *args: P.args, **kwargs: P.kwargs) -> Submitting[R]:
        """``submit`` without waiting for ax's answer: see ``Submitting``."""
        from ._client import Client

        client = Client.of(self.client)
        return client.submit_request_nowait(self.task.options.queue, self._request(args, kwargs), self.task)

    async def submit_async(self, *args: P.args, **kwargs: P.kwargs) -> Handle[R]:
        """``submit`` as an awaitable."""
        from ._aio import AsyncClient

        request = self._request(args, kwargs)
        client = await AsyncClient.of(self.client)
        return await client.submit_request(self.task.options.queue, request, self.task)

    def _request(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        td = self.task
        payload = td.payload(args, kwargs)
        if td.options.batch is not None:
            # A batched task takes its items as *items (checked at @ax.task): a submit adds one.
            if len(payload) != 1:
                raise InvalidInput(f"task {td.name} is batched: a submit adds one item, not {len(payload)}",
                                   field="batch")
            payload = payload[0]
        key = self.key
        if key is None and td.options.idempotency_key is not None:
            key = str(td.options.idempotency_key(*args, **kwargs))
        req = td.request(payload, delay=self.delay, run_at=self.run_at, key=key, priority=self.priority)
        batch = td.options.batch_request(td.name, args[0] if args else None)
        if batch is not None:
            req["batch"] = batch  # checked by the server: no delay or run_at beside it; a key is the item's
        fair = td.options.fair_request(args, kwargs)
        if fair is not None:
            req["fair_key"] = fair
        singleton = td.options.singleton_request(args, kwargs)
        if singleton is not None:
            req["singleton"] = singleton
        debounce = td.options.debounce_request(args, kwargs)
        if debounce is not None:
            req["debounce"] = debounce  # checked by the server: no delay, run_at or key beside it
        return req
