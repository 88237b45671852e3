"""The workflow write-up's order flow, on ax: run `python examples/python/order_flow.py`.

With nothing listening on 127.0.0.1:4222, the runtime starts a local nats-server with
JetStream (data in ./.ax) and an ax server in this process; find the run afterwards with
`ax flow get <run>` or on the console.
"""

import ax_scheduler as ax


class InvoiceApiError(Exception):
    """The invoice service failed; worth retrying."""


class ConfigError(Exception):
    """Misconfiguration; retrying will not help."""


@ax.task(name="parse_payment", timeout=5)
def parse_payment(event: dict) -> dict:
    return {"payment_id": event["payment_id"], "amount": event["amount"], "currency": event.get("currency", "EUR")}


@ax.task(name="create_invoice", retries=3, retry_backoff=10, timeout=60,
         retry_on_exception=(InvoiceApiError, TimeoutError), no_retry_on_exception=(ConfigError,))
def create_invoice(payment: dict) -> dict:
    return {"invoice_id": f"inv_{payment['payment_id']}", "amount": payment["amount"]}


@ax.task(name="send_notification", timeout=5, on_failure="notify_only")
def send_notification(payment: dict, invoice: dict) -> dict:
    return {"sent": True, "text": f"payment {payment['payment_id']}: invoice {invoice['invoice_id']}"}


@ax.flow(name="order_payment_flow")
def order_payment_flow(event: dict):
    payment = parse_payment(event)
    invoice = create_invoice(payment)
    send_notification(payment, invoice)  # a gather: runs after both, gets both outputs


if __name__ == "__main__":
    with ax.Runtime(max_concurrency=10, executor="threadpool"):
        client = ax.Client()
        run_id = client.trigger_flow(order_payment_flow, payload={"payment_id": "pay_001", "amount": 42.0})
        outputs = client.flow_result(run_id, timeout=60)
        print(f"run {run_id} succeeded")
        for step, output in outputs.items():
            print(f"  {step}: {output}")
