"""How a task's arguments travel as JSON: the payload of a call, and the call of a payload.

A function of one parameter (of any kind) takes its argument as the payload: a list for
``*args``, an object for ``**kwargs``. Any other function takes an object of arguments by
name — what a Rust or Go producer sends: each named parameter (positional-only ones
too) under its name, ``*args`` under its own name as a list, each ``**kwargs`` entry as a
key of its own (a key that names no parameter goes to ``**kwargs``). Missing arguments
take their defaults. A ``**kwargs`` entry named like a positional-only parameter or like
``*args`` would read back as that parameter: such a call is refused at submit.
"""

from __future__ import annotations

import inspect
from typing import Any, cast

from . import _json
from .errors import InvalidInput

P = inspect.Parameter
_POSITIONAL = (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)


class Arguments:
    """The mapping between calls of task ``task`` and its payloads."""

    def __init__(self, task: str, signature: inspect.Signature, hints: dict[str, Any]):
        self.task = task
        self.signature = signature
        self.hints = hints
        self.params = list(signature.parameters.values())
        self.var_kwargs = next((p.name for p in self.params if p.kind is P.VAR_KEYWORD), None)
        # Keys a **kwargs entry cannot have: they read back as these parameters.
        self.reserved = {p.name for p in self.params if p.kind in (P.POSITIONAL_ONLY, P.VAR_POSITIONAL)}

    def _bad(self, what: str, code: str) -> InvalidInput:
        return InvalidInput(f"task {self.task}: {what}", code=code)

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> inspect.BoundArguments:
        try:
            return self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise self._bad(str(e), "bad_request") from None

    def by_name(self, bound: inspect.BoundArguments) -> dict[str, Any]:
        """A call's arguments as the object of arguments by name."""
        out: dict[str, Any] = {}
        for name, value in bound.arguments.items():
            kind = self.signature.parameters[name].kind
            if kind is P.VAR_POSITIONAL:
                out[name] = list(value)
            elif kind is not P.VAR_KEYWORD:
                out[name] = value
            else:
                for key, item in value.items():
                    if key in self.reserved:
                        raise InvalidInput(
                            f"task {self.task}: the keyword argument {key!r} (for **{name}) has the name of the "
                            f"parameter {key!r}, and the payload, an object of arguments by name, would give it "
                            "to that parameter: pass it under another key, or rename the parameter",
                            code="bad_request", field=key)
                    out[key] = item
        return out

    def payload(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The JSON payload of a call (not yet encoded)."""
        bound = self.bind(args, kwargs)
        if len(self.params) != 1:
            return self.by_name(bound)
        bound.apply_defaults()
        (value,) = bound.arguments.values()
        return list(value) if self.params[0].kind is P.VAR_POSITIONAL else value

    def call(self, payload: Any, typed: bool = True, code: str = "bad_payload") -> tuple[list[Any], dict[str, Any]]:
        """The call of a payload (the inverse of ``payload``), its values typed back by the
        annotations when ``typed``; ``InvalidInput`` with ``code`` when it does not fit."""
        if len(self.params) == 1:
            p = self.params[0]
            if p.kind is P.VAR_POSITIONAL:
                if not isinstance(payload, list):
                    raise self._bad(f"takes *{p.name}: its payload must be a list of them, not "
                                    f"{type(payload).__name__}", code)
                return [self._typed(p.name, v, typed) for v in cast(list[Any], payload)], {}
            if p.kind is P.VAR_KEYWORD:
                if not isinstance(payload, dict):
                    raise self._bad(f"takes **{p.name}: its payload must be an object of them, not "
                                    f"{type(payload).__name__}", code)
                return [], {k: self._typed(p.name, v, typed) for k, v in cast(dict[str, Any], payload).items()}
            value = self._typed(p.name, payload, typed)
            return ([], {p.name: value}) if p.kind is P.KEYWORD_ONLY else ([value], {})
        if not self.params:
            return [], {}
        if not isinstance(payload, dict):
            raise self._bad(f"takes {len(self.params)} parameters: its payload must be an object of "
                            f"arguments by name, not {type(payload).__name__}", code)
        return self.call_by_name(cast(dict[str, Any], payload), typed, code)

    def call_by_name(self, named: dict[str, Any], typed: bool = True,
                     code: str = "bad_payload") -> tuple[list[Any], dict[str, Any]]:
        """The call of an object of arguments by name (a payload, or a flow step's
        resolved arguments)."""
        rest = dict(named)
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        for p in self.params:
            if p.kind in _POSITIONAL:
                if p.name in rest:
                    args.append(self._typed(p.name, rest.pop(p.name), typed))
                elif p.default is not P.empty:
                    args.append(p.default)  # a later positional argument may follow
                else:
                    raise self._bad(f"the payload has no argument {p.name!r}", code)
            elif p.kind is P.VAR_POSITIONAL:
                extra = rest.pop(p.name, [])
                if not isinstance(extra, list):
                    raise self._bad(f"*{p.name} must be a list, not {type(extra).__name__}", code)
                args.extend(self._typed(p.name, v, typed) for v in cast(list[Any], extra))
            elif p.kind is P.KEYWORD_ONLY and p.name in rest:
                kwargs[p.name] = self._typed(p.name, rest.pop(p.name), typed)
        if rest and self.var_kwargs is None:
            raise self._bad(f"the payload has arguments it does not take: {', '.join(map(repr, rest))}", code)
        kwargs.update((k, self._typed(self.var_kwargs or k, v, typed)) for k, v in rest.items())
        try:
            self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise self._bad(f"payload {e}", code) from None
        return args, kwargs

    def _typed(self, param: str, value: Any, typed: bool) -> Any:
        return _json.typed(value, self.hints.get(param)) if typed else value
