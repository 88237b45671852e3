"""JSON in and out of tasks: dataclasses and pydantic models out, typed back in by the
function's annotations."""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import json
import logging
import types
import typing
from typing import Any, Callable, Iterable, cast

from .errors import InvalidInput

log = logging.getLogger("ax_scheduler")


def _default(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    dump = getattr(value, "model_dump", None)  # pydantic v2
    if callable(dump):
        return dump(mode="json")
    if isinstance(value, (set, frozenset, tuple)):
        return list(cast(Iterable[Any], value))
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
    """``value`` (decoded JSON) as ``hint`` says: a dataclass, its fields typed back in
    turn (nested dataclasses, lists, tuples, sets and dicts of them, ``Optional``); a
    pydantic model by its own validation (nested models included); anything else as
    decoded."""
    if value is None or hint is None or hint is Any:
        return value
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Annotated:
        return typed(value, args[0])
    if origin is typing.Union or origin is types.UnionType:
        some = [a for a in args if a is not type(None)]
        return typed(value, some[0]) if len(some) == 1 else value
    if isinstance(value, list):
        return _items(cast(list[Any], value), origin, args)
    if isinstance(value, dict):
        return _object(cast(dict[str, Any], value), hint, origin, args)
    return value


def _items(value: list[Any], origin: Any, args: tuple[Any, ...]) -> Any:
    """A JSON array as ``list[X]`` / ``set[X]`` / ``tuple[X, ...]`` / ``tuple[X, Y]``."""
    if origin in (list, set, frozenset, collections.abc.Sequence, collections.abc.Iterable):
        items = [typed(v, args[0] if args else None) for v in value]
        return set(items) if origin is set else frozenset(items) if origin is frozenset else items
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(typed(v, args[0]) for v in value)
        if len(args) == len(value):
            return tuple(typed(v, a) for v, a in zip(value, args))
    return value


def _object(value: dict[str, Any], hint: Any, origin: Any, args: tuple[Any, ...]) -> Any:
    """A JSON object as ``dict[K, V]`` (the values typed), a dataclass or a pydantic model."""
    if origin in (dict, collections.abc.Mapping) and len(args) == 2:
        return {k: typed(v, args[1]) for k, v in value.items()}
    if not isinstance(hint, type):
        return value
    make: Callable[..., Any] = hint
    if dataclasses.is_dataclass(hint):
        hints, computed = _fields(hint)
        return make(**{k: typed(v, hints.get(k)) for k, v in value.items() if k not in computed})
    validate = getattr(make, "model_validate", None)  # pydantic v2
    return validate(value) if callable(validate) else value


@functools.lru_cache(maxsize=256)
def _fields(cls: type) -> tuple[dict[str, Any], frozenset[str]]:
    """The resolved annotations of a dataclass's fields (none where they cannot be
    resolved: logged once), and the names of its ``init=False`` fields (``asdict`` gives
    them; the class computes them)."""
    computed = frozenset(f.name for f in dataclasses.fields(cls) if not f.init)
    try:
        return typing.get_type_hints(cls), computed
    except Exception as e:  # an unresolvable forward reference
        log.warning("ax: the fields of %s are not typed back: its annotations cannot be resolved (%s)",
                    cls.__qualname__, e)
        return {}, computed
