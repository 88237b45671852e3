"""JSON in and out of tasks: dataclasses and pydantic models out, typed back in by the
function's annotations."""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any

from .errors import InvalidInput


def _default(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    dump = getattr(value, "model_dump", None)  # pydantic v2
    if callable(dump):
        return dump(mode="json")
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def dumps(value: Any, what: str = "value") -> bytes:
    """JSON text of ``value`` (dataclasses and pydantic models included); ``InvalidInput``
    naming ``what`` if it cannot be (an object JSON has no form for, NaN, infinity)."""
    try:
        return json.dumps(value, default=_default, allow_nan=False, separators=(",", ":")).encode()
    except (TypeError, ValueError) as e:
        raise InvalidInput(f"{what} is not JSON: {e}", code="bad_request") from None


def loads(data: bytes | None) -> Any:
    if not data:
        return None
    return json.loads(data)


def typed(value: Any, hint: Any) -> Any:
    """``value`` as ``hint`` when the hint is a dataclass or a pydantic model (and
    ``Optional`` of one); anything else as decoded."""
    if value is None or hint is None or hint is Any:
        return value
    origin = typing.get_origin(hint)
    if origin is typing.Union or str(origin) == "types.UnionType":
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return typed(value, args[0]) if len(args) == 1 else value
    if origin in (list, typing.List) and isinstance(value, list):
        (item,) = typing.get_args(hint) or (None,)
        return [typed(v, item) for v in value]
    if isinstance(hint, type) and isinstance(value, dict):
        if dataclasses.is_dataclass(hint):
            return hint(**value)
        validate = getattr(hint, "model_validate", None)
        if callable(validate):
            return validate(value)
    return value
