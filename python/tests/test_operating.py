"""Running the Python runtime as a service (issue 38): its metrics on /metrics, its logs
in Python's ``logging`` with each task's ids, a business id and an OpenTelemetry trace
carried into the task, a queue's capacity set from Python and a ``busy`` refusal that says
how to raise it, and a runtime that starts once."""

from __future__ import annotations

import logging
import subprocess
import sys
import urllib.request

import pytest

import ax_scheduler as ax
from ax_scheduler._embedded import LocalNats, free_port
from conftest import HERE, eventually, python_worker

Q = "py_tasks"


@ax.task(queue=Q, retries=0)
def logs_and_answers(x: int) -> dict[str, object]:
    ctx = ax.context()
    ctx.logger.info("working on %d", x)
    return {"business_id": ctx.business_id, "traceparent": ctx.traceparent}


@ax.task(queue=Q, retries=0)
def fails_for_the_log(x: int) -> None:
    raise ValueError(f"no {x}")


def test_a_python_worker_serves_its_metrics(url, server, client, procs, tmp_path):
    port = free_port()
    procs(python_worker(url, "--concurrency", "2", "--metrics-addr", f"127.0.0.1:{port}"), log=tmp_path / "w.log")
    done = client.submit("count_me", 3, queue="py_shared").result(timeout=30)
    assert done == 3

    def scrape() -> str:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                return r.read().decode()
        except OSError:
            return ""

    text = eventually(lambda: (t := scrape()) and "ax_tasks_succeeded_total" in t and t, 20, "the metrics")
    for name in ("ax_worker_busy_rate", "ax_task_timeout_rate", "ax_tasks_succeeded_total"):
        assert name in text, f"{name} on /metrics"


def test_task_logs_carry_the_attempts_ids_and_the_cores_records_reach_logging(runtime, client, caplog):
    caplog.set_level(logging.INFO)
    runtime(logs_and_answers, fails_for_the_log)
    h = client.submit_request(Q, {"name": "logs_and_answers", "payload": 4, "business_id": "order-7"})
    assert h.result(timeout=20)["business_id"] == "order-7"
    mine = [r for r in caplog.records if r.name == "ax_scheduler.task.logs_and_answers"]
    working = next(r for r in mine if r.getMessage() == "working on 4")
    assert (working.ax_task_id, working.ax_attempt, working.ax_business_id) == (h.id, 1, "order-7")
    assert any("succeeded" in r.getMessage() and r.ax_task_id == h.id for r in mine), "the attempt's end"
    dead = client.submit(fails_for_the_log, 1)
    with pytest.raises(ax.TaskFailed):
        dead.result(timeout=20)

    def core_said_dead() -> bool:
        return any(r.name.startswith("ax_scheduler.core") and getattr(r, "ax_task_id", None) == dead.id
                   and r.levelno == logging.ERROR for r in caplog.records)

    eventually(core_said_dead, 10, "the core's 'task dead' record in logging with the task's id")
    failed = [r for r in caplog.records if r.name == "ax_scheduler.task.fails_for_the_log" and r.levelno == logging.ERROR]
    assert failed and "ValueError" in failed[0].getMessage()


def test_a_submit_inside_a_span_is_traced_into_the_task(runtime, client):
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    runtime(logs_and_answers)
    with trace.get_tracer("test").start_as_current_span("request") as request:
        h = logs_and_answers.submit(5, client=client)
    out = h.result(timeout=20)
    trace_id = format(request.get_span_context().trace_id, "032x")
    assert out["traceparent"] is not None and out["traceparent"].split("-")[1] == trace_id
    spans = {s.name: s for s in exporter.get_finished_spans()}
    task_span = spans["ax.task logs_and_answers"]
    assert task_span.context.trace_id == request.get_span_context().trace_id
    assert task_span.parent is not None and task_span.parent.span_id == request.get_span_context().span_id
    assert task_span.attributes["ax.task.id"] == h.id


def test_a_queues_capacity_is_set_from_python_and_busy_says_how_to_raise_it(procs, tmp_path):
    # Capacities are set when the streams are made: a broker of its own.
    nats = LocalNats(tmp_path / "nats").start()
    try:
        procs([sys.executable, "-m", "ax_scheduler", "server", "--url", nats.url, "--queue", "py_small",
               "--capacity", "2,2,2"], log=tmp_path / "server.log")
        client = ax.Client(nats.url)
        eventually(lambda: any(q["queue"] == "py_small" for q in client.call("task", "queues")["queues"]), 20,
                   "queue py_small declared")
        for i in range(2):
            client.submit("nobody_serves_this", i, queue="py_small")
        with pytest.raises(ax.Unavailable) as busy:
            client.submit("nobody_serves_this", 3, queue="py_small")
        assert busy.value.code == "busy"
        assert "ax streams apply --capacity" in str(busy.value)
        client.close()
    finally:
        nats.stop()


def test_a_runtime_starts_once(runtime):
    rt = runtime(logs_and_answers)
    with pytest.raises(ax.Conflict, match="running already"):
        rt.start()


def test_the_ax_command_comes_with_the_package(url, server):
    out = subprocess.run([sys.executable, "-m", "ax_scheduler._cli", "--url", url, "queue", "list"],
                         capture_output=True, text=True, cwd=HERE, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "py_tasks" in out.stdout


def test_a_task_or_handler_registered_after_start_is_refused_not_ignored(url, server):
    from ax_scheduler import _schedule, _task

    # A runtime serving "every registered task" of this test alone: the suite's other
    # modules registered tasks and flows of queues this server does not declare.
    saved = [(registry, dict(registry)) for registry in (_task.REGISTRY, _schedule.SCHEDULES)]
    for registry, _ in saved:
        registry.clear()
    try:
        rt = ax.Runtime(url, shutdown_grace=1)  # serves every task registered when it starts
        rt.start()
        try:
            with pytest.raises(ax.InvalidInput, match="after Runtime.start"):
                @ax.task(queue=Q)
                def too_late(x: int) -> int:
                    return x
            with pytest.raises(ax.InvalidInput, match="after Runtime.start"):
                @ax.on_event
                def late_handler(event: ax.Event) -> None:
                    pass
        finally:
            rt.stop()

        # Stopped: registering works again (the next runtime takes it).
        @ax.task(queue=Q, name="registered_after_stop")
        def fine(x: int) -> int:
            return x

        assert fine.name == "registered_after_stop"
    finally:
        for registry, before in saved:
            registry.clear()
            registry.update(before)


def test_connection_failures_are_typed_a_refused_login_is_permission_denied(procs, tmp_path):
    """A broker that wants a token refuses a wrong one: `PermissionDenied` (was
    `Unavailable`, which a caller would retry for ever); an unreadable credentials file is
    the caller's `InvalidInput`; nobody listening is `Unavailable`."""
    from ax_scheduler._embedded import binary

    port = free_port()
    procs([binary(), "-a", "127.0.0.1", "-p", str(port), "--auth", "s3cret-token"])
    url = f"nats://127.0.0.1:{port}"

    def listening() -> bool:
        try:
            ax.Client(url, token="s3cret-token", connect_timeout=1.0).close()
            return True
        except ax.Unavailable:
            return False

    eventually(listening, what="the token-protected nats-server")
    with pytest.raises(ax.PermissionDenied):
        ax.Client(url, token="wrong-token", connect_timeout=2.0)
    with pytest.raises(ax.InvalidInput, match="creds"):
        ax.Client(url, creds=str(tmp_path / "missing.creds"), connect_timeout=2.0)
    with pytest.raises(ax.Unavailable):
        ax.Client(f"nats://127.0.0.1:{free_port()}", connect_timeout=1.0)
