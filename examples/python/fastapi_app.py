"""An async FastAPI service that submits ax tasks and reports on them (the admission
write-up's Python 3.10 + FastAPI services). Run it beside a worker:

    pip install fastapi uvicorn ./python
    python -m ax_scheduler local examples/python/order_flow.py &    # broker, ax server, workers
    uvicorn fastapi_app:app --app-dir examples/python

    curl -X POST localhost:8000/orders -H 'content-type: application/json' \\
         -d '{"payment_id": "pay_002", "amount": 9.5}'
    curl localhost:8000/runs/<run>

The handlers are `async def` and await ax (`ax.AsyncClient`): a call in flight holds no
thread, and the event loop serves other requests meanwhile. The client connects in the
app's lifespan (without blocking the loop), not at import, and closes with the app.
"""

from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Request
from pydantic import BaseModel

import ax_scheduler as ax
from order_flow import Payment, PaymentEvent, create_invoice, order_payment_flow


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncGenerator[None, None]:
    """One client for the app's life: $AX_URL, else nats://127.0.0.1:4222."""
    async with await ax.AsyncClient.connect() as client:
        app.state.ax = client
        yield


app = FastAPI(title="orders", lifespan=lifespan)


def ax_client(request: Request) -> ax.AsyncClient:
    client: ax.AsyncClient = request.app.state.ax
    return client


Ax = Annotated[ax.AsyncClient, Depends(ax_client)]


class Order(BaseModel):
    payment_id: str
    amount: float


@app.post("/orders", status_code=202)
async def start_order(order: Order, client: Ax) -> dict[str, str]:
    """Starts the order flow; the run id is stored in JetStream before this answers."""
    try:
        run = await order_payment_flow.with_options(client=client).trigger_async(
            PaymentEvent(order.payment_id, order.amount))
    except ax.Unavailable as e:  # no NATS or no ax server: the caller may retry
        raise HTTPException(503, str(e)) from None
    return {"run": run}


@app.post("/invoices", status_code=202)
async def invoice_only(order: Order, client: Ax) -> dict[str, Any]:
    """Submits one task, idempotently: the same payment twice is one task."""
    invoices = create_invoice.with_options(key=f"invoice:{order.payment_id}", client=client)
    handle = await invoices.submit_async(Payment(order.payment_id, order.amount, "EUR"))
    return {"task": handle.id, "duplicate": handle.duplicate}


@app.get("/runs/{run}")
async def run_status(run: str, client: Ax) -> dict[str, Any]:
    try:
        found = await client.flow_run(run)
    except (ax.NotFound, ax.InvalidInput):  # no such run, or not a run id at all
        raise HTTPException(404, f"no run {run}") from None
    return {"state": found["state"], "steps": {s["name"]: s["state"] for s in found["steps"]}}


@app.get("/tasks/{task_id}")
async def task_status(task_id: str, client: Ax) -> dict[str, Any]:
    record = await client.get(task_id)
    if record is None:
        raise HTTPException(404, f"no task {task_id}")
    return {"state": record["state"], "attempt": record["attempt"], "error": record.get("last_error")}
