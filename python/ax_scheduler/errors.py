"""Errors of ax_scheduler, one class per kind of failure.

The native core raises these by the error's kind, never by its text: catch
``ax.NotFound`` or ``ax.Unavailable``, not a message. ``code`` is the wire error code
(PROTOCOL.md §2, e.g. ``invalid_field``) when the server refused a request,
``field`` the request field at fault, ``task_id`` the task that caused a ``running``
refusal (the one holding a submit's singleton key), ``run_id`` the flow run that caused
one (the one holding a run's singleton key), and ``retry_after`` the seconds until
a ``rate_limited`` submit may pass (a rate limit that drops its excess).
"""

from __future__ import annotations

from typing import Any


class AxError(Exception):
    """Base of every ax_scheduler error."""

    def __init__(self, message: str, code: str | None = None, field: str | None = None,
                 task_id: str | None = None, retry_after: float | None = None, run_id: str | None = None):
        super().__init__(message)
        self.message = message
        self.code = code
        self.field = field
        self.task_id = task_id
        self.retry_after = retry_after
        self.run_id = run_id

    def __str__(self) -> str:
        where = f" (field {self.field})" if self.field else ""
        return f"{self.message}{where}"


class InvalidInput(AxError, ValueError):
    """The input is not valid: a bad option, payload or request (nothing was stored)."""


class NotFound(AxError, LookupError):
    """The task, run, flow, trigger or queue does not exist."""


class Conflict(AxError):
    """Another writer changed the thing first, or this attempt was overtaken."""


class Unavailable(AxError, ConnectionError):
    """Nobody could serve it now (no NATS, no ax server, busy): retrying later may work."""


class TimedOut(AxError, TimeoutError):
    """No answer in time, or a wait ran out."""


class PermissionDenied(AxError, PermissionError):
    """Credentials or permissions refused."""


class FlowDefinitionError(InvalidInput):
    """A flow body did something a flow cannot express (see the Python guide, "Flows")."""


class TaskFailed(AxError):
    """The task ended without success (``dead`` or ``cancelled``); ``record`` is its record."""

    def __init__(self, message: str, record: dict[str, Any] | None = None):
        error: dict[str, Any] = (record or {}).get("last_error") or {}
        super().__init__(message, code=error.get("class"))
        self.record = record or {}
        self.error_class: str | None = error.get("class")


class FlowFailed(AxError):
    """The flow run ended ``failed`` or ``cancelled``; ``run`` is the run record."""

    def __init__(self, message: str, run: dict[str, Any] | None = None):
        super().__init__(message)
        self.run = run or {}


class NonRetryable(Exception):
    """Raise (or raise from) this inside a task to fail it at once, whatever its retry
    options say. ``error_class`` names the failure in the record (default: the class
    of the exception it was raised from, else ``NonRetryable``)."""

    def __init__(self, message: str = "", error_class: str | None = None):
        super().__init__(message)
        self.error_class = error_class
