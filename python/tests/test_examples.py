"""The FastAPI example (examples/python/fastapi_app.py) against a real ax."""

from __future__ import annotations

import importlib
import sys

import pytest

import ax_scheduler as ax

from conftest import REPO


@pytest.fixture
def app_module(url, server, monkeypatch):
    monkeypatch.setenv("AX_URL", url)
    monkeypatch.syspath_prepend(str(REPO / "examples" / "python"))
    for name in ("fastapi_app", "order_flow"):
        sys.modules.pop(name, None)
    return importlib.import_module("fastapi_app")


def test_the_async_fastapi_example_starts_a_flow_and_submits_idempotently(app_module, runtime, client):
    """The app's handlers are async and await ax; its client connects in the lifespan
    (entering the TestClient), not at import."""
    from fastapi.testclient import TestClient

    import order_flow

    assert not hasattr(app_module.app.state, "ax"), "no client before the app starts"
    runtime(order_flow.parse_payment, order_flow.create_invoice, order_flow.send_notification)
    with TestClient(app_module.app) as http:
        assert isinstance(app_module.app.state.ax, ax.AsyncClient)
        answer = http.post("/orders", json={"payment_id": "pay_web", "amount": 3.5})
        assert answer.status_code == 202, answer.text
        run = answer.json()["run"]
        assert client.wait_flow(run, timeout=30)["state"] == "succeeded"
        status = http.get(f"/runs/{run}").json()
        assert status == {"state": "succeeded", "steps": {"parse_payment": "succeeded", "create_invoice": "succeeded",
                                                          "send_notification": "succeeded"}}
        assert client.flow_result(run, timeout=30)["create_invoice"] == {"invoice_id": "inv_pay_web", "amount": 3.5}
        first = http.post("/invoices", json={"payment_id": "pay_web", "amount": 3.5}).json()
        again = http.post("/invoices", json={"payment_id": "pay_web", "amount": 3.5}).json()
        assert (first["duplicate"], again["duplicate"], again["task"]) == (False, True, first["task"])
        assert http.get("/runs/no-such-run").status_code == 404
        task = http.get(f"/tasks/{first['task']}")
        assert task.status_code == 200 and task.json()["state"] in ("pending", "running", "succeeded")
    assert client.get(first["task"]) is not None, "the test's client still works after the app closed its own"
