"""``ax.AsyncClient``: every call of ``ax.Client`` as an awaitable, for ``asyncio`` code (a
FastAPI handler). The calls run on the native core's own runtime, not on a thread of the
event loop's: thousands can be in flight at once, and cancelling an await cancels its
call. It wraps a ``Client`` (``sync``) and shares its connection; its handles are the
same ``ax.Handle`` objects (``await handle.result_async()``)."""

from __future__ import annotations

import asyncio
import os
from datetime import datetime, timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterable

from . import _core, _ops, _settings
from ._client import Client
from ._handle import Handle
from ._task import TaskDef
from ._typing import R, T
from .errors import AxError

if TYPE_CHECKING:
    from ._events import Event
    from ._flow import FlowDef


class AsyncClient:
    """The awaitable calls of ``client`` (default: the process's shared client). Make one
    with ``await ax.AsyncClient.connect(...)`` (connecting does not block the event loop),
    or take ``client.aio``. Each method is ``Client``'s of the same name; close it with
    ``await client.close()`` or ``async with``."""

    def __init__(self, client: Client | None = None):
        self.sync: Client = client or Client.default()
        self._conn = _core.AsyncConnection(self.sync.connection)

    @classmethod
    async def connect(cls, url: str | None = None, *, creds: str | None = None, token: str | None = None,
                      connect_timeout: float = 5.0, wait_for_server: float = 30.0,
                      direct_submits: bool = False) -> AsyncClient:
        """Connects as ``ax.Client(...)`` does (same arguments), on a thread: the event
        loop goes on meanwhile."""
        client = await asyncio.to_thread(Client, url, creds=creds, token=token, connect_timeout=connect_timeout,
                                         wait_for_server=wait_for_server, direct_submits=direct_submits)
        return client.aio

    @classmethod
    async def of(cls, client: Client | AsyncClient | None = None) -> AsyncClient:
        """The async client of ``client``; without one, of the process's shared client
        (connected on a thread the first time)."""
        if isinstance(client, AsyncClient):
            return client
        if client is None:
            client = await Client.default_async()
        return client.aio

    @property
    def url(self) -> str:
        return self.sync.url

    async def _run(self, op: _ops.Op[T]) -> T:
        return await _ops.run_async(self._conn, op)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        trace: TracebackType | None) -> None:
        await self.close()

    # -- tasks --------------------------------------------------------------------------

    async def submit(self, task: TaskDef[Any, R] | str, payload: Any = None, *, queue: str | None = None,
                     delay: float | timedelta | None = None, run_at: datetime | str | None = None,
                     key: str | None = None, priority: str | None = None) -> Handle[R]:
        return await self._run(_ops.submit(self.sync, task, payload, queue, delay=delay, run_at=run_at, key=key,
                                           priority=priority))

    async def submit_request(self, queue: str, request: dict[str, Any],
                             task: TaskDef[Any, R] | None = None) -> Handle[R]:
        return await self._run(_ops.submit_request(self.sync, queue, request, task))

    async def submit_many(self, task: TaskDef[Any, R] | str, payloads: Iterable[Any], *, queue: str | None = None,
                          priority: str | None = None) -> list[Handle[R] | AxError]:
        return await self._run(_ops.submit_many(self.sync, task, payloads, queue, priority))

    async def get(self, task_id: str) -> dict[str, Any] | None:
        return await self._run(_ops.get(task_id))

    async def wait(self, task_id: str, timeout: float | None = None) -> dict[str, Any]:
        return await self._run(_ops.wait(task_id, timeout))

    async def result(self, task_id: str, timeout: float | None = None) -> Any:
        return await self._run(_ops.result(task_id, timeout))

    async def history(self, task_id: str) -> dict[str, Any]:
        return await self._run(_ops.task_call("events", task_id))

    async def cancel(self, task_id: str) -> dict[str, Any]:
        return await self._run(_ops.task_call("cancel", task_id))

    async def retry(self, task_id: str, reset_attempts: bool = False) -> dict[str, Any]:
        return await self._run(_ops.task_call("retry", task_id, reset_attempts=reset_attempts))

    async def run_now(self, task_id: str) -> dict[str, Any]:
        return await self._run(_ops.task_call("run_now", task_id))

    async def pause(self, queue: str, reason: str | None = None) -> Any:
        return await self._run(_ops.pause(queue, reason))

    async def resume(self, queue: str) -> Any:
        return await self._run(_ops.resume(queue))

    # -- task settings ------------------------------------------------------------------

    async def task_options(self, name: str, queue: str = "default") -> dict[str, Any] | None:
        return await self._run(_ops.task_options(name, queue))

    async def set_task_options(self, name: str, queue: str = "default", *, replace: bool = False,
                               **values: Any) -> dict[str, Any]:
        return await self._run(_ops.set_task_options(name, queue, replace, values))

    async def delete_task_options(self, name: str, queue: str = "default") -> bool:
        return await self._run(_ops.delete_task_options(name, queue))

    async def list_task_options(self, queue: str | None = None) -> list[dict[str, Any]]:
        return await self._run(_ops.list_task_options(queue))

    async def apply_settings(self, source: str | os.PathLike[str] | dict[str, Any]) -> list[dict[str, Any]]:
        """``Client.apply_settings`` (a settings file is read on a thread)."""
        data = source if isinstance(source, dict) else await asyncio.to_thread(_settings.load, source)
        return await self._run(_ops.apply_settings(data))

    # -- flows --------------------------------------------------------------------------

    async def put_flow(self, flow: FlowDef | dict[str, Any]) -> dict[str, Any]:
        return await self._run(_ops.put_flow(self.sync.stored_flows, flow))

    async def trigger_flow(self, flow: FlowDef | str, payload: Any = None) -> str:
        return await self._run(_ops.trigger_flow(self.sync.stored_flows, flow, payload))

    async def wait_flow(self, run: str, timeout: float | None = None) -> dict[str, Any]:
        return await self._run(_ops.wait_flow(run, timeout))

    async def flow_result(self, run: str, timeout: float | None = None) -> dict[str, Any]:
        return await self._run(_ops.flow_result(run, timeout))

    async def flow_run(self, run: str) -> dict[str, Any]:
        return await self._run(_ops.run_call("get", run))

    async def rerun_flow(self, run: str, mode: str = "failed", payload: Any = None) -> Any:
        return await self._run(_ops.rerun_flow(run, mode, payload))

    async def cancel_flow(self, run: str) -> Any:
        return await self._run(_ops.run_call("cancel", run))

    async def approve(self, token: str, payload: Any = None) -> dict[str, Any]:
        """``Client.approve`` from a coroutine."""
        return await self._run(_ops.complete_approval(token, "approve", payload=payload))

    async def reject(self, token: str, reason: str | None = None) -> dict[str, Any]:
        """``Client.reject`` from a coroutine."""
        return await self._run(_ops.complete_approval(token, "reject", reason=reason))

    async def approvals(self) -> list[dict[str, Any]]:
        """``Client.approvals`` from a coroutine."""
        return await self._run(_ops.call("flow", "approvals"))

    # -- the rest -----------------------------------------------------------------------

    async def publish_event(self, name: str, payload: Any = None, *, id: str | None = None) -> int:
        """``Client.publish_event`` from a coroutine."""
        return await self._run(_ops.publish_event(name, {} if payload is None else payload, id))

    async def call(self, api: str, op: str, body: Any = None) -> Any:
        return await self._run(_ops.call(api, op, body))

    def events(self, subject: str = "ax.events.alert.>") -> AsyncIterator[Event]:
        """ax's events as an async iterator (``ax.events``)."""
        from ._events import events

        return events(subject, client=self.sync)

    async def close(self) -> None:
        """Closes the connection (the ``Client``'s too), on a thread."""
        await asyncio.to_thread(self.sync.close)
