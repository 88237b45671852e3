"""Every kind of parameter through a real submit: ``**kwargs``, ``*args``, keyword-only,
positional-only, defaults and mixtures map the way Python calls them, from
``TaskDef.submit`` and from ``Client.submit`` with the payload a Rust producer sends."""

from __future__ import annotations

from typing import Any

import pytest

import ax_scheduler as ax
from ax_scheduler._flow import resolve

Q = "py_tasks"


@ax.task(queue=Q)
def only_kwargs(**fields: Any) -> dict[str, Any]:
    return fields


@ax.task(queue=Q)
def only_args(*numbers: int) -> list[int]:
    return list(numbers)


@ax.task(queue=Q)
def mixture(a: int, /, b: int, *rest: int, c: int = 3, **extra: Any) -> dict[str, Any]:
    return {"a": a, "b": b, "rest": list(rest), "c": c, "extra": extra}


@ax.task(queue=Q)
def keyword_only(*, x: int, y: int = 2) -> list[int]:
    return [x, y]


@ax.task(queue=Q)
def positional_only(a: int, b: int = 10, /) -> list[int]:
    return [a, b]


@ax.task(queue=Q)
def one_default(n: int = 1) -> int:
    return n


@ax.task(queue=Q)
def lone_keyword(*, token: str) -> str:
    return token


ALL = (only_kwargs, only_args, mixture, keyword_only, positional_only, one_default, lone_keyword)


def test_kwargs_and_args_reach_the_function(runtime, client):
    runtime(*ALL)
    assert only_kwargs.submit(a=1, b="x", client=client).result(timeout=20) == {"a": 1, "b": "x"}
    assert client.submit(only_kwargs, {"a": 1}).result(timeout=20) == {"a": 1}
    assert client.submit("only_kwargs", {"z": [1]}, queue=Q).result(timeout=20) == {"z": [1]}
    assert only_args.submit(1, 2, 3, client=client).result(timeout=20) == [1, 2, 3]
    assert client.submit(only_args, [4, 5]).result(timeout=20) == [4, 5]


def test_keyword_only_positional_only_and_defaults(runtime, client):
    runtime(*ALL)
    assert keyword_only.submit(x=1, client=client).result(timeout=20) == [1, 2]
    assert client.submit(keyword_only, {"x": 5, "y": 6}).result(timeout=20) == [5, 6]
    assert positional_only.submit(1, client=client).result(timeout=20) == [1, 10]
    assert positional_only.submit(1, 2, client=client).result(timeout=20) == [1, 2]
    assert client.submit("positional_only", {"a": 3}, queue=Q).result(timeout=20) == [3, 10]
    assert one_default.submit(client=client).result(timeout=20) == 1
    assert lone_keyword.submit(token="k", client=client).result(timeout=20) == "k"


def test_a_mixture_of_every_kind_round_trips(runtime, client):
    runtime(*ALL)
    full = mixture.submit(1, 2, 4, 5, c=6, d=7, client=client).result(timeout=20)
    assert full == {"a": 1, "b": 2, "rest": [4, 5], "c": 6, "extra": {"d": 7}}
    assert mixture.submit(1, b=2, client=client).result(timeout=20) == {"a": 1, "b": 2, "rest": [], "c": 3,
                                                                         "extra": {}}
    # What a Rust or Go producer sends: the object of arguments by name.
    sent = client.submit("mixture", {"a": 1, "b": 2, "rest": [9], "z": 0}, queue=Q).result(timeout=20)
    assert sent == {"a": 1, "b": 2, "rest": [9], "c": 3, "extra": {"z": 0}}


def test_calls_the_payload_cannot_carry_are_refused_at_submit(client):
    with pytest.raises(ax.InvalidInput, match="'a'"):
        mixture.submit(1, 2, a=5, client=client)  # **extra's "a" and the positional-only a
    with pytest.raises(ax.InvalidInput, match="'rest'"):
        mixture.submit(1, 2, rest=5, client=client)  # **extra's "rest" and *rest
    with pytest.raises(ax.InvalidInput, match="object"):
        client.submit(mixture, [1, 2])
    with pytest.raises(ax.InvalidInput, match="list"):
        client.submit(only_args, {"numbers": [1]})


def test_flow_steps_name_every_kind_of_argument(client):
    """A flow step's arguments, resolved from its payload, give the same call."""
    @ax.flow(name="py_signature_flow")
    def signatures(event: Any) -> None:
        mixture(event["a"], 2, event["r"], 8, d=event["d"])
        only_kwargs(k=event["a"])

    try:
        steps = {s["name"]: s["task"]["payload"]["ax_args"] for s in signatures.definition()["steps"]}
        payload = {"input": {"a": 1, "r": 7, "d": "dee"}}
        args, kwargs = mixture.call_arguments(resolve(payload, steps["mixture"]))
        assert mixture.fn(*args, **kwargs) == {"a": 1, "b": 2, "rest": [7, 8], "c": 3, "extra": {"d": "dee"}}
        args, kwargs = only_kwargs.call_arguments(resolve(payload, steps["only_kwargs"]))
        assert only_kwargs.fn(*args, **kwargs) == {"k": 1}
    finally:
        from ax_scheduler._flow import FLOWS

        FLOWS.pop("py_signature_flow", None)


def test_a_flow_of_such_tasks_runs_end_to_end(runtime, client):
    @ax.flow(name="py_signature_run")
    def signatures_run(event: Any) -> None:
        mixture(event["a"], 2, event["r"], 8, d=event["d"])
        only_kwargs(k=event["a"])

    try:
        runtime(*ALL)
        run = client.trigger_flow(signatures_run, {"a": 1, "r": 7, "d": "dee"})
        out = client.flow_result(run, timeout=30)
        assert out["mixture"] == {"a": 1, "b": 2, "rest": [7, 8], "c": 3, "extra": {"d": "dee"}}
        assert out["only_kwargs"] == {"k": 1}
    finally:
        from ax_scheduler._flow import FLOWS

        FLOWS.pop("py_signature_run", None)
