"""A FastAPI service that submits ax tasks and reports on them (the admission write-up's
Python 3.10 + FastAPI services). Run it beside a worker:

    pip install fastapi uvicorn ./python
    python -m ax_scheduler local examples/python/order_flow.py &    # broker, ax server, workers
    uvicorn fastapi_app:app --app-dir examples/python

    curl -X POST localhost:8000/orders -H 'content-type: application/json' \\
         -d '{"payment_id": "pay_002", "amount": 9.5}'
    curl localhost:8000/runs/<run>

The client is made once and shared: it is thread-safe, and its calls release the GIL, so
FastAPI's sync endpoints (run on its thread pool) do not block each other.
"""

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel

import ax_scheduler as ax
from order_flow import create_invoice, order_payment_flow

app = FastAPI(title="orders")
client = ax.Client()  # $AX_URL, else nats://127.0.0.1:4222


class Order(BaseModel):
    payment_id: str
    amount: float


@app.post("/orders", status_code=202)
def start_order(order: Order) -> dict:
    """Starts the order flow; the run id is stored in JetStream before this answers."""
    try:
        run = client.trigger_flow(order_payment_flow, order.model_dump())
    except ax.Unavailable as e:  # no NATS or no ax server: the caller may retry
        raise HTTPException(503, str(e)) from None
    return {"run": run}


@app.post("/invoices", status_code=202)
def invoice_only(order: Order) -> dict:
    """Submits one task, idempotently: the same payment twice is one task."""
    handle = create_invoice.submit(order.model_dump(), key=f"invoice:{order.payment_id}", client=client)
    return {"task": handle.id, "duplicate": handle.duplicate}


@app.get("/runs/{run}")
def run_status(run: str) -> dict:
    try:
        found = client.flow_run(run)
    except (ax.NotFound, ax.InvalidInput):  # no such run, or not a run id at all
        raise HTTPException(404, f"no run {run}") from None
    return {"state": found["state"], "steps": {s["name"]: s["state"] for s in found["steps"]}}


@app.get("/tasks/{task_id}")
def task_status(task_id: str) -> dict:
    record = client.get(task_id)
    if record is None:
        raise HTTPException(404, f"no task {task_id}")
    return {"state": record["state"], "attempt": record["attempt"], "error": record.get("last_error")}
