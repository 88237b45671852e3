"""What a decorator declares beyond the task: rate limits, schedules, event handlers."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest

import ax_scheduler as ax
from ax_scheduler import _events, _schedule

Q = "py_tasks"
STARTS: list[float] = []


@ax.task(queue=Q, rate_limit="2/s")
def throttled(i: int) -> int:
    STARTS.append(time.monotonic())
    return i


def test_a_rate_limit_is_stored_as_an_ax_limit_every_worker_applies(runtime, client):
    runtime(throttled)
    stored = client.call("limit", "get", {"queue": Q, "name": "task-throttled"})
    assert (stored["task"], stored["rate"]) == ("throttled", 2.0)
    STARTS.clear()
    handles = client.submit_many(throttled, range(6), queue=Q)
    for h in handles:
        h.wait(timeout=30)
    span = max(STARTS) - min(STARTS)
    # burst 2 (the rate rounded up), then 2 a second: six starts need two seconds.
    assert span >= 1.9, f"6 starts in {span:.2f} s under 2/s"
    with pytest.raises(ax.InvalidInput) as e:
        ax.task(name="too_fast", rate_limit="1e9/s")(lambda x: x)
    assert e.value.field == "rate_limit"


RUNS: list[str] = []


@ax.task(queue=Q)
def every_second(payload: dict) -> None:
    RUNS.append(payload["from"])


@ax.task(queue=Q, cron="0 2 * * *", tz="Asia/Shanghai", schedule_payload={"day": "yesterday"})
def nightly(payload: dict) -> None:
    pass


@ax.task(queue=Q, every=3600, overlap="cancel_in_progress")
def hourly_latest(payload: dict) -> None:
    pass


def test_schedules_become_triggers_when_the_runtime_starts(runtime, client):
    ax.schedule(every_second, every=1, payload={"from": "schedule"}, name="py-every-second", overlap="allow")
    try:
        runtime(every_second, nightly, hourly_latest)
        stored = client.call("trigger", "get", {"name": "nightly"})
        definition = stored["definition"]
        assert (definition["kind"], definition["expr"], definition["tz"]) == ("cron", "0 2 * * *", "Asia/Shanghai")
        assert definition["overlap"] == "buffer_one", "the server's default"
        latest = client.call("trigger", "get", {"name": "hourly_latest"})["definition"]
        assert (latest["every_ms"], latest["overlap"]) == (3_600_000, "cancel_in_progress")
        every = client.call("trigger", "get", {"name": "py-every-second"})["definition"]
        assert every["overlap"] == "allow"
        RUNS.clear()
        deadline = time.monotonic() + 10
        while len(RUNS) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert RUNS[:2] == ["schedule", "schedule"], RUNS
    finally:
        del _schedule.SCHEDULES["py-every-second"]
        client.call("trigger", "delete", {"name": "py-every-second"})
        client.call("trigger", "delete", {"name": "hourly_latest"})


def test_an_overlap_is_one_the_server_knows_and_only_for_a_schedule():
    with pytest.raises(ax.InvalidInput) as e:
        ax.task(name="bad_overlap", every=1, overlap="newest")(lambda x: x)
    assert e.value.field == "overlap"
    with pytest.raises(ax.InvalidInput) as e:
        ax.task(name="unscheduled", overlap="skip")(lambda x: x)
    assert e.value.field == "overlap"
    with pytest.raises(ax.InvalidInput) as e:
        ax.schedule(every_second, every=1, overlap="newest")
    assert e.value.field == "overlap"


SYNCED: list[tuple[str, int]] = []


@ax.task(queue=Q, debounce=0.4, debounce_key=lambda user, version: f"user:{user}")
def sync_profile(user: str, version: int) -> int:
    SYNCED.append((user, version))
    return version


def test_a_debounced_task_runs_once_per_quiet_key_with_the_last_arguments(runtime, client):
    runtime(sync_profile)
    SYNCED.clear()
    handles = []
    for version in range(1, 8):
        handles.append(sync_profile.submit("ann", version))
        handles.append(sync_profile.submit("bob", version * 10))
        time.sleep(0.05)
    ann = {h.id for h in handles[0::2]}
    bob = {h.id for h in handles[1::2]}
    assert len(ann) == 1 and len(bob) == 1 and ann != bob, (ann, bob)
    assert handles[0].result(timeout=30) == 7
    assert handles[1].result(timeout=30) == 70
    time.sleep(0.6)
    assert sorted(SYNCED) == [("ann", 7), ("bob", 70)], SYNCED
    for bad in ({"debounce": 0}, {"debounce": 1, "debounce_key": "user"}, {"debounce_key": lambda u: u},
                {"debounce": 1, "debounce_key": lambda u: u, "debounce_keep": "middle"},
                {"debounce": 2, "debounce_key": lambda u: u, "debounce_max_wait": 1},
                {"debounce": 1, "debounce_key": lambda u: u, "every": 60}):
        with pytest.raises(ax.InvalidInput):
            ax.task(name="bad_debounce", **bad)(lambda u: u)


@dataclasses.dataclass
class Order:
    id: str
    amount: float


INVOICED: list[list[str]] = []


@ax.task(queue=Q, batch=3, batch_timeout=0.5, batch_key=lambda order: f"shop:{order.id[0]}")
def invoice(*orders: Order) -> int:
    assert all(isinstance(o, Order) for o in orders), orders
    INVOICED.append([o.id for o in orders])
    return len(orders)


def test_a_batched_task_runs_its_items_as_lists_of_its_size_or_after_its_timeout(runtime, client):
    runtime(invoice)
    INVOICED.clear()
    handles = [invoice.submit(Order(f"a{i}", 1.0)) for i in range(5)]
    other = invoice.submit(Order("b1", 2.0))
    ids = [h.id for h in handles]
    assert ids[0] == ids[1] == ids[2] != ids[3] == ids[4] != other.id, ids
    assert handles[0].result(timeout=30) == 3
    assert handles[3].result(timeout=30) == 2  # not full: after its 0.5 s timeout
    assert other.result(timeout=30) == 1
    assert sorted(INVOICED) == [["a0", "a1", "a2"], ["a3", "a4"], ["b1"]], INVOICED
    with pytest.raises(ax.InvalidInput) as e:
        invoice.submit(Order("a5", 1.0), Order("a6", 1.0))
    assert e.value.field == "batch"
    for bad in ({"batch": 0}, {"batch": 10_001}, {"batch_key": "k"}, {"batch": 2, "batch_timeout": 0},
                {"batch": 2, "batch_key": "a b"}, {"batch": 2, "every": 60}):
        with pytest.raises(ax.InvalidInput):
            ax.task(name="bad_batch", **bad)(lambda *items: items)
    with pytest.raises(ax.InvalidInput) as e:
        ax.task(name="bad_batch", batch=2)(lambda order: order)
    assert e.value.field == "batch"


KEYED_INVOICED: list[list[str]] = []


@ax.task(queue=Q, batch=3, batch_timeout=0.5, batch_key="keyed", idempotency_key=lambda order: order.id)
def keyed_invoice(*orders: Order) -> int:
    KEYED_INVOICED.append([o.id for o in orders])
    return len(orders)


def test_a_batched_item_sent_again_with_its_key_is_held_once(runtime, client):
    runtime(keyed_invoice)
    KEYED_INVOICED.clear()
    first = keyed_invoice.submit(Order("k1", 1.0))
    again = keyed_invoice.submit(Order("k1", 1.0))  # the producer lost the answer, say
    assert again.id == first.id
    assert first.result(timeout=30) == 1  # after its 0.5 s timeout, with one item
    after = keyed_invoice.submit(Order("k1", 1.0))  # once the batch ran: still that one
    assert after.id == first.id
    assert KEYED_INVOICED == [["k1"]], KEYED_INVOICED


@ax.task(queue=Q, fair_key=lambda tenant, n: tenant)
def per_tenant(tenant: str, n: int) -> str:
    return f"{tenant}:{n}"


def test_a_task_with_a_fair_key_is_held_for_its_tenant_and_runs(runtime, client):
    # Depth 1: with no worker running, one task waits on the ready subject, the rest are
    # held for their tenant, as the fair dispatcher reports.
    client.call("limit", "fair_put", {"queue": Q, "depth": 1})
    try:
        handles = [per_tenant.with_options(client=client).submit("acme", n) for n in range(3)]
        deadline = time.monotonic() + 15
        while True:
            tenants = (client.call("limit", "fair_get", {"queue": Q})["status"] or {}).get("tenants", [])
            if [(t["key"], t["held"]) for t in tenants] == [("acme", 2)]:
                break
            assert time.monotonic() < deadline, tenants
            time.sleep(0.1)
        record = handles[2].get()
        assert record is not None and record["state"] == "pending", record
        runtime(per_tenant)
        assert [h.result(timeout=30) for h in handles] == ["acme:0", "acme:1", "acme:2"]
    finally:
        client.call("limit", "fair_put", {"queue": Q})
    for bad in ("a b", "", "x" * 65, 7):
        with pytest.raises(ax.InvalidInput) as e:
            ax.task(name="bad_fair", fair_key=bad)(lambda: None)
        assert e.value.field == "fair_key"


@ax.task(queue=Q, singleton=lambda account: account)
def sync_account(account: str) -> str:
    return account


def test_a_singleton_task_is_refused_while_its_key_is_held(runtime, client):
    # No worker yet: the first waits and holds its key; a second of the key is refused
    # naming it, another key is not.
    first = sync_account.with_options(client=client).submit("acme")
    with pytest.raises(ax.Conflict) as e:
        sync_account.with_options(client=client).submit("acme")
    assert (e.value.code, e.value.task_id) == ("running", first.id), e.value
    other = sync_account.with_options(client=client).submit("globex")
    runtime(sync_account)
    assert (first.result(timeout=30), other.result(timeout=30)) == ("acme", "globex")
    # Its task ended: the key is free.
    assert sync_account.with_options(client=client).submit("acme").result(timeout=30) == "acme"
    for bad in ({"singleton": "a b"}, {"singleton": 7}, {"singleton": "k", "on_collision": "queue"},
                {"on_collision": "cancel_in_progress"}, {"singleton": "k", "every": 60}):
        with pytest.raises(ax.InvalidInput) as e:
            ax.task(name="bad_singleton", **bad)(lambda: None)
        assert e.value.field in ("singleton", "on_collision"), e.value


@ax.task(queue=Q)
def quota_call(n: int) -> int:
    return n


def test_a_submit_over_a_dropping_limit_is_refused_with_when_to_retry(client):
    client.call("limit", "put", {"name": "quota", "queue": Q, "task": "quota_call", "rate": 0.01,
                                 "burst": 1, "excess": "drop"})
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                quota_call.with_options(client=client).submit(1)
            except ax.Unavailable as e:
                assert e.code == "rate_limited" and e.retry_after is not None, e
                assert 0 < e.retry_after <= 100, e.retry_after
                break
            assert time.monotonic() < deadline, "never refused"
            time.sleep(0.02)
    finally:
        client.call("limit", "delete", {"queue": Q, "name": "quota"})


def test_aging_is_a_positive_time():
    for bad in (0, -1, float("nan"), 8 * 86_400):
        with pytest.raises(ax.InvalidInput) as e:
            ax.Runtime(url="nats://127.0.0.1:1", aging=bad)
        assert e.value.field == "aging"
    assert ax.Runtime(url="nats://127.0.0.1:1", aging=30).aging == 30


@ax.task(queue=Q, retries=0)
def always_fails(x: int) -> None:
    raise LookupError(f"no record {x}")


def test_event_handlers_get_the_alerts_and_their_own_failures_touch_nothing(runtime, client):
    seen: list[ax.Event] = []

    def broken(event):
        raise RuntimeError("a handler bug")

    def keep(event):
        seen.append(event)

    async def first_alert():
        async for event in ax.events(client=client):
            return event

    streamed: list[ax.Event] = []
    listener = threading.Thread(target=lambda: streamed.append(asyncio.run(first_alert())), daemon=True)
    _events.HANDLERS.clear()
    ax.on_event(broken)
    ax.on_event(keep)
    try:
        runtime(always_fails)
        listener.start()
        time.sleep(0.5)  # the async iterator subscribes on its first step
        handle = always_fails.submit(7, client=client)
        with pytest.raises(ax.TaskFailed):
            handle.result(timeout=20)
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.05)
        assert seen and seen[0].kind == "task_dead" and seen[0].task_id == handle.id, seen
        assert seen[0].error_class == "LookupError"
        listener.join(10)
        assert streamed and streamed[0].task_id == handle.id, "ax.events() yields the same alert"
        assert always_fails.submit(8, client=client).wait(timeout=20)["state"] == "dead", "tasks go on"
    finally:
        _events.HANDLERS.clear()
