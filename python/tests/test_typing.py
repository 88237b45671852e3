"""Typed tasks (issue 38: "``@ax.task`` returns ``Any``: pyright and mypy see nothing"):
nested dataclasses and pydantic models round-trip through a real runtime, typed back by
the annotations; ``submit``'s keywords; and what pyright sees of a typed task (when
.ci/pyright has installed it)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pydantic
import pytest

import ax_scheduler as ax
from conftest import REPO

Q = "py_tasks"


class Address(pydantic.BaseModel):
    city: str
    lines: list[str]


class Customer(pydantic.BaseModel):
    name: str
    address: Address


@dataclass
class Line:
    sku: str
    qty: int


@dataclass
class Order:
    id: str
    lines: list[Line]
    by_sku: dict[str, Line]
    customer: Customer
    gift: Optional[Line] = None
    tags: tuple[str, ...] = ()
    count: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.count = len(self.lines)


@dataclass
class Receipt:
    order: Order
    total: int
    biggest: Line | None


def kinds(order: Order) -> list[type]:
    return [type(order.lines[0]), type(order.by_sku["a"]), type(order.customer.address), type(order.gift),
            type(order.tags)]


@ax.task(queue=Q)
def receive(order: Order) -> Receipt:
    assert kinds(order) == [Line, Line, Address, Line, tuple], kinds(order)  # typed back on the way in
    return Receipt(order, sum(line.qty for line in order.lines), max(order.lines, key=lambda line: line.qty))


@ax.task(queue=Q)
async def by_id(orders: list[Order]) -> dict[str, Receipt]:
    return {o.id: Receipt(o, len(o.lines), None) for o in orders}


@ax.task(queue=Q)
def echo_key(key: str, priority: int = 0) -> list[Any]:
    return [key, priority]


@ax.task(queue=Q)
def fields_of(**values: Any) -> dict[str, Any]:
    return values


def an_order(n: int) -> Order:
    lines = [Line("a", n), Line("b", n + 1)]
    customer = Customer(name="Ada", address=Address(city="Paris", lines=["1 rue X"]))
    return Order(f"o{n}", lines, {line.sku: line for line in lines}, customer, Line("gift", 1), ("x", "y"))


def test_nested_dataclasses_and_models_round_trip_typed(runtime, client):
    runtime(receive, by_id)
    order = an_order(2)
    receipt = receive.submit(order, client=client).result(timeout=30)
    assert receipt == Receipt(order, 5, Line("b", 3))
    assert kinds(receipt.order) == [Line, Line, Address, Line, tuple] and receipt.order.count == 2
    receipts = asyncio.run(by_id.submit(orders=[an_order(1), an_order(3)], client=client).result_async(timeout=30))
    assert receipts == {"o1": Receipt(an_order(1), 2, None), "o3": Receipt(an_order(3), 2, None)}
    assert kinds(receipts["o3"].order) == [Line, Line, Address, Line, tuple]


def test_submit_keywords_go_to_the_function_when_it_has_them(runtime, client):
    """``submit(..., key=...)`` reads ``key`` as the idempotency key (the older spelling)
    only when the function has no parameter so named; ``with_options(...).submit`` gives
    every keyword to the function."""
    runtime(echo_key, fields_of)
    assert echo_key.submit(key="k", priority=2, client=client).result(timeout=30) == ["k", 2]
    handle = fields_of.with_options(client=client).submit(delay=5, key="not an option")
    assert handle.result(timeout=30) == {"delay": 5, "key": "not an option"}
    first = fields_of.submit(a=1, key="py-typing-once", client=client)
    assert fields_of.submit(a=2, key="py-typing-once", client=client).id == first.id
    keyed = fields_of.with_options(client=client, key="py-typing-once-2")
    assert keyed.submit(a=1).id == keyed.submit(a=2).id


def pyright() -> Path | None:
    path = REPO / ".tools" / "node" / "node_modules" / ".bin" / "pyright"
    return path if path.exists() else None


TYPED = '''
import ax_scheduler as ax
from dataclasses import dataclass


@dataclass
class Invoice:
    id: str


@ax.task(retries=3)
def create_invoice(payment_id: str, amount: float) -> Invoice:
    return Invoice(payment_id)


@ax.task
async def fetch(url: str) -> bytes:
    return url.encode()


async def main(client: ax.AsyncClient) -> None:
    handle = create_invoice.submit("p", 1.0)
    reveal_type(handle)
    reveal_type(handle.result())
    reveal_type(await handle.result_async())
    reveal_type(await fetch.submit_async("u"))
    reveal_type(await client.submit("create_invoice", {}))
    create_invoice.with_options(key="k", delay=5, client=client).submit("p", amount=2.0)
    create_invoice.submit("p", "not a float")  # error
    create_invoice.submit("p")  # error
    fetch.with_options(priority="high").submit(url=1)  # error
'''


@pytest.mark.skipif(pyright() is None, reason="pyright is not installed: .ci/pyright installs it")
def test_pyright_checks_submit_against_the_signature_and_types_results(tmp_path):
    (tmp_path / "typed.py").write_text(TYPED)
    (tmp_path / "pyrightconfig.json").write_text(json.dumps({
        "typeCheckingMode": "strict", "pythonVersion": "3.10", "extraPaths": [str(REPO / "python")]}))
    out = subprocess.run([str(pyright()), "--outputjson", "--pythonpath", sys.executable, "typed.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=240, env={**os.environ})
    found = json.loads(out.stdout)["generalDiagnostics"]
    revealed = [d["message"].split('"')[-2] for d in found if d["severity"] == "information"]
    assert revealed == ["Handle[Invoice]", "Invoice", "Invoice", "Handle[bytes]", "Handle[Any]"], found
    lines = TYPED.splitlines()
    errors = sorted({d["range"]["start"]["line"] for d in found if d["severity"] == "error"})
    assert errors == [i for i, line in enumerate(lines) if line.endswith("# error")], found
