"""Parameters apart from code: a settings file loaded by the runtime, changed live through
the client, applied by the Rust worker under the Python tasks; and the soft timeout
(``heartbeat_timeout`` / ``ax.heartbeat()``). Attempts are counted by the tasks."""

from __future__ import annotations

import time
from collections import Counter

import pytest

import ax_scheduler as ax

Q = "py_tasks"
ATTEMPTS: Counter = Counter()


@ax.task(queue=Q, retries=0, retry_backoff=0.01)
def flaky_settings(n: int) -> None:
    ATTEMPTS[ax.context().id] += 1
    raise ConnectionError("the invoice API is down")


def attempts_until_dead(task: ax.TaskDef, client: ax.Client) -> int:
    handle = task.submit(0)
    deadline = time.monotonic() + 15
    while client.get(handle.id)["state"] != "dead":
        assert time.monotonic() < deadline, "never dead"
        time.sleep(0.02)
    return ATTEMPTS[handle.id]


def test_a_settings_file_and_live_changes_override_the_decorator(runtime, client, tmp_path):
    config = tmp_path / "runtime.yaml"
    config.write_text(f"tasks:\n  flaky_settings:\n    queue: {Q}\n    retries: 2\n    timeout: 30s\n")
    try:
        runtime(flaky_settings, config=str(config))
        stored = client.task_options("flaky_settings", queue=Q)
        assert stored == {"max_attempts": 3, "timeout_ms": 30_000}
        # Stored before the workers started: the first task already follows the file.
        assert attempts_until_dead(flaky_settings, client) == 3

        # Changed live (merged into what is stored); the running worker applies it to a
        # next attempt, without a restart.
        now = client.set_task_options("flaky_settings", queue=Q, retries=1)
        assert now == {"max_attempts": 2, "timeout_ms": 30_000}
        deadline = time.monotonic() + 10
        while attempts_until_dead(flaky_settings, client) != 2:
            assert time.monotonic() < deadline, "the change never reached the worker"

        # Deleted: back to the decorator's retries=0.
        assert client.delete_task_options("flaky_settings", queue=Q)
        deadline = time.monotonic() + 10
        while attempts_until_dead(flaky_settings, client) != 1:
            assert time.monotonic() < deadline, "the delete never reached the worker"
    finally:
        client.delete_task_options("flaky_settings", queue=Q)


def test_the_examples_settings_file_is_valid(client):
    from conftest import REPO

    stored = client.apply_settings(REPO / "examples" / "python" / "runtime.yaml")
    try:
        names = {s["name"]: s["settings"] for s in stored}
        assert names["create_invoice"]["max_attempts"] == 4
        assert names["create_invoice"]["alert_group"] == "billing"
        assert names["send_notification"] == {"timeout_ms": 5000, "alert_group": "notifications"}
    finally:
        for s in stored:
            client.delete_task_options(s["name"], queue=s["queue"])


def test_bad_settings_are_refused_naming_the_field_and_store_nothing(url, server, client, tmp_path):
    with pytest.raises(ax.InvalidInput) as e:
        client.apply_settings({"tasks": {"good": {"queue": Q, "retries": 1}, "bad": {"queue": Q, "timeout": "soon"}}})
    assert e.value.field == "tasks.bad.timeout"
    assert client.task_options("good", queue=Q) is None, "a bad file stores nothing"
    with pytest.raises(ax.InvalidInput) as e:
        client.set_task_options("flaky_settings", queue=Q, retrys=3)
    assert "retrys" in str(e.value)
    with pytest.raises(ax.InvalidInput) as e:
        client.set_task_options("flaky_settings", queue=Q, concurrency=0)
    assert e.value.field == "flaky_settings.concurrency"
    with pytest.raises(ax.InvalidInput) as e:
        client.set_task_options("flaky_settings", queue=Q, retry_jitter=2.0)
    assert e.value.field == "flaky_settings.retry_jitter"
    with pytest.raises(ax.InvalidInput):  # not JSON
        client.set_task_options("flaky_settings", queue=Q, timeout=float("nan"))
    assert client.task_options("flaky_settings", queue=Q) is None
    config = tmp_path / "bad.yaml"
    config.write_text("tasks:\n  flaky_settings:\n    retries: -1\n")
    with pytest.raises(ax.InvalidInput) as e:
        ax.Runtime(url, tasks=[flaky_settings], config=str(config)).start()
    assert e.value.field == "tasks.flaky_settings"
    assert client.task_options("flaky_settings", queue=Q) is None


BEATS: Counter = Counter()


@ax.task(queue=Q, retries=0, timeout=60, heartbeat_timeout=0.5)
def long_job(stall: bool) -> str:
    # 1.5 s of work, a beat every 0.1 s: three times the soft timeout.
    for _ in range(15):
        time.sleep(0.1)
        ax.heartbeat()
        BEATS[ax.context().id] += 1
    if stall:
        time.sleep(8)
    return "done"


@ax.task(queue=Q, retries=0, timeout=60, heartbeat_timeout=0.5)
def long_job_in_a_process(n: int) -> int:
    for _ in range(15):
        time.sleep(0.1)
        ax.heartbeat()
    return n


@pytest.mark.timeout(60)
def test_the_soft_timeout_stops_a_task_that_stops_heartbeating(runtime, client):
    runtime(long_job, max_concurrency=4)
    started = time.monotonic()
    beating, stalling = long_job.submit(False), long_job.submit(True)
    assert beating.result(timeout=20) == "done"
    with pytest.raises(ax.TaskFailed) as e:
        stalling.result(timeout=20)
    took = time.monotonic() - started
    record = client.get(stalling.id)
    assert record["last_error"]["class"] == "heartbeat_timeout"
    assert "15 heartbeats" in record["last_error"]["message"]
    assert took < 6, f"stopped by the soft timeout, not after the stall: {took:.1f} s"
    assert "heartbeat" in str(e.value)


@pytest.mark.timeout(60)
def test_heartbeats_of_a_process_executor_child_reach_the_worker(runtime):
    runtime(long_job_in_a_process, executor="process")
    assert long_job_in_a_process.submit(7).result(timeout=20) == 7
