"""The workflow write-up's order flow, on ax: run `python examples/python/order_flow.py`.

With nothing listening on 127.0.0.1:4222, the runtime starts a local nats-server with
JetStream (data in ./.ax) and an ax server in this process; find the run afterwards with
`ax flow get <run>` or on the console.

The tasks take and return dataclasses: they travel as JSON objects and come back typed by
the annotations (`parse_payment.submit(...)` is checked against its signature, and its
handle's `result()` is a `Payment`).
"""

from dataclasses import dataclass

import ax_scheduler as ax


class InvoiceApiError(Exception):
    """The invoice service failed; worth retrying."""


class ConfigError(Exception):
    """Misconfiguration; retrying will not help."""


@dataclass
class PaymentEvent:
    """The run's input."""

    payment_id: str
    amount: float
    currency: str = "EUR"


@dataclass
class Payment:
    payment_id: str
    amount: float
    currency: str


@dataclass
class Invoice:
    invoice_id: str
    amount: float


@dataclass
class Notification:
    sent: bool
    text: str


@ax.task(name="parse_payment", timeout=5)
def parse_payment(event: PaymentEvent) -> Payment:
    return Payment(event.payment_id, event.amount, event.currency)


@ax.task(name="create_invoice", retries=3, retry_backoff=10, timeout=60,
         retry_on_exception=(InvoiceApiError, TimeoutError), no_retry_on_exception=(ConfigError,))
def create_invoice(payment: Payment) -> Invoice:
    return Invoice(f"inv_{payment.payment_id}", payment.amount)


@ax.task(name="send_notification", timeout=5, on_failure="notify_only")
def send_notification(payment: Payment, invoice: Invoice) -> Notification:
    return Notification(True, f"payment {payment.payment_id}: invoice {invoice.invoice_id}")


@ax.flow(name="order_payment_flow")
def order_payment_flow(event: PaymentEvent) -> None:
    payment = parse_payment(event)
    invoice = create_invoice(payment)
    send_notification(payment, invoice)  # a gather: runs after both, gets both outputs


if __name__ == "__main__":
    with ax.Runtime(max_concurrency=10, executor="threadpool"):
        client = ax.Client()
        run_id = order_payment_flow.with_options(client=client).trigger(PaymentEvent("pay_001", 42.0))
        outputs = client.flow_result(run_id, timeout=60)
        print(f"run {run_id} succeeded")
        for step, output in outputs.items():
            print(f"  {step}: {output}")
