"""The type variables of the package's generics: ``P``, a task's (or flow body's)
parameters, and ``R``, a task's result. The type checkers see them with defaults (PEP
696), so a bare ``TaskDef`` or ``Handle`` is one of any task (``Handle`` is
``Handle[Any]``) and a submit by name gives a ``Handle[Any]``; at run time they are the
plain ones of ``typing`` (Python 3.10 has no defaults)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import ParamSpec, TypeVar

    P = ParamSpec("P", default=...)
    R = TypeVar("R", default=Any)
else:
    from typing import ParamSpec, TypeVar

    P = ParamSpec("P")
    R = TypeVar("R")

T = TypeVar("T")

__all__ = ["P", "R", "T"]
