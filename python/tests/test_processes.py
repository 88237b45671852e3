"""Python worker processes for real: shared with a Rust worker, killed with SIGKILL,
stopped with SIGTERM; and the embedded runtime from an empty directory."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time

import ax_scheduler as ax
from ax_scheduler._embedded import listening
from conftest import REPO, ax_binary, eventually, python_worker, runs


def test_two_python_workers_and_a_rust_worker_run_each_task_once(url, server, client, procs, tmp_path):
    record = tmp_path / "runs.jsonl"
    rust_record = tmp_path / "rust.jsonl"
    env = {"AX_TEST_RECORD": str(record), "AX_LOG": "info"}
    workers = [procs(python_worker(url, "--concurrency", "16", "--id", f"py{i}"), env, tmp_path / f"py{i}.log")
               for i in range(2)]
    workers.append(procs([ax_binary(), "worker", "--url", url, "--queue", "py_shared", "--example", "--fail-rate",
                          "0", "--sleep", "1ms", "--journal", str(rust_record), "--metrics-addr", "off", "--id",
                          "rust"], log=tmp_path / "rust.log"))
    for w in workers:  # all three pull before the first task is sent
        eventually(lambda: "worker started" in w.output() or w.p.poll() is not None, 30, "a worker started")
        assert w.p.poll() is None, w.output()
    n = 2000
    handles = client.submit_many("count_me", range(n), queue="py_shared")
    ids = [h.id for h in handles]
    assert all(isinstance(h, ax.Handle) for h in handles)

    def finished():
        states = collections.Counter(client.get(i)["state"] for i in ids)
        return states == {"succeeded": n}

    eventually(finished, 120, "every task succeeded")
    python_runs = [r["id"] for r in runs(record)]
    rust_runs = [r["id"] for r in runs(rust_record) if r.get("event") == "start"]
    per_task = collections.Counter(python_runs + rust_runs)
    assert set(per_task) == set(ids)
    assert max(per_task.values()) == 1, [i for i, c in per_task.items() if c > 1][:5]
    pids = collections.Counter(r["pid"] for r in runs(record))
    assert len(pids) == 2 and rust_runs, f"each worker ran some: python {dict(pids)}, rust {len(rust_runs)}"


def test_a_python_worker_killed_mid_task_has_it_redelivered_and_recorded_once(url, server, client, procs, tmp_path):
    record = tmp_path / "runs.jsonl"
    env = {"AX_TEST_RECORD": str(record)}
    first = procs(python_worker(url, "--id", "doomed"), env, tmp_path / "w1.log")
    handle = client.submit("slow", 3.0, queue="py_faults")
    eventually(lambda: any(r["id"] == handle.id for r in runs(record)), 30, "the task started")
    # Killed once its attempt is recorded `running` (written after its first second: a
    # first attempt lost sooner is not counted, docs/PROTOCOL.md §3 "Unrecorded tasks").
    eventually(lambda: (client.get(handle.id) or {}).get("state") == "running", 30, "running recorded")
    first.p.send_signal(signal.SIGKILL)
    first.p.wait()
    procs(python_worker(url, "--id", "heir"), env, tmp_path / "w2.log")
    final = client.wait(handle.id, timeout=60)
    assert final["state"] == "succeeded" and final["attempt"] == 2, final
    assert final["worker"] == "heir"
    starts = [r for r in runs(record) if r["id"] == handle.id and r.get("event") == "start"]
    assert len(starts) == 2, starts
    terminal = [e for e in client.history(handle.id)["events"] if e.get("state") in ("succeeded", "dead")]
    assert len(terminal) == 1, terminal


def test_sigterm_lets_the_running_task_finish_then_exits(url, server, client, procs, tmp_path):
    record = tmp_path / "runs.jsonl"
    worker = procs(python_worker(url, "--id", "draining", "--shutdown-grace", "20"),
                   {"AX_TEST_RECORD": str(record)}, tmp_path / "w.log")
    handle = client.submit("slow", 2.0, queue="py_faults")
    eventually(lambda: any(r["id"] == handle.id for r in runs(record)), 30, "the task started")
    worker.p.send_signal(signal.SIGTERM)
    assert worker.p.wait(30) == 0, worker.output()
    final = client.get(handle.id)
    assert final["state"] == "succeeded" and final["attempt"] == 1 and final["worker"] == "draining", final
    events = [r.get("event") for r in runs(record) if r["id"] == handle.id]
    assert events == ["start", "end"]


def test_the_embedded_runtime_runs_the_order_flow_from_an_empty_directory(tmp_path):
    assert not listening("127.0.0.1", 4222), "port 4222 is taken: the embedded runtime would use it"
    started = time.monotonic()
    out = subprocess.run([sys.executable, str(REPO / "examples" / "python" / "order_flow.py")], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, env={k: v for k, v in os.environ.items() if k != "AX_URL"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "embedded local runtime" in out.stderr
    assert "succeeded" in out.stdout and "inv_pay_001" in out.stdout, out.stdout
    assert (tmp_path / ".ax" / "jetstream").is_dir()
    assert not listening("127.0.0.1", 4222), "the embedded nats-server was stopped"
    print(f"embedded order flow from an empty directory: {time.monotonic() - started:.1f} s")


def test_the_local_command_serves_the_console_and_ax_flow_get_finds_the_run(tmp_path, procs):
    """`python -m ax_scheduler local`: the embedded runtime as a process, with the console;
    a run it drives is found by the `ax` command and the console's health check answers."""
    import urllib.request

    from ax_scheduler._embedded import free_port

    assert not listening("127.0.0.1", 4222), "port 4222 is taken: the embedded runtime would use it"
    console = f"127.0.0.1:{free_port()}"
    local = procs([sys.executable, "-m", "ax_scheduler", "local", str(REPO / "examples" / "python" / "order_flow.py"),
                   "--data-dir", str(tmp_path / "data"), "--console", console],
                  {"AX_LOG": "info"}, tmp_path / "local.log")
    eventually(lambda: "worker started" in local.output() or local.p.poll() is not None, 60, "the local runtime")
    assert local.p.poll() is None, local.output()
    client = ax.Client("nats://127.0.0.1:4222")
    run = client.call("flow", "run", {"flow": "order_payment_flow", "input": {"payment_id": "p9", "amount": 1}})["run"]
    assert client.wait_flow(run, timeout=30)["state"] == "succeeded"
    shown = subprocess.run([ax_binary(), "--url", "nats://127.0.0.1:4222", "flow", "get", run],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "succeeded" in shown.stdout and "send_notification" in shown.stdout, shown
    with urllib.request.urlopen(f"http://{console}/healthz", timeout=10) as answer:
        assert answer.status == 200
    client.close()
    local.p.send_signal(signal.SIGTERM)
    assert local.p.wait(30) == 0, local.output()
    assert not listening("127.0.0.1", 4222), "the local runtime stopped its nats-server"


def test_the_embedded_broker_runs_with_the_shipped_memory_limit(tmp_path):
    """GOMEMLIMIT, the memory setting ax ships for nats-server (docs/PERFORMANCE.md, W4),
    unless the environment sets one."""
    import pytest

    from ax_scheduler._embedded import LocalNats

    if "GOMEMLIMIT" in os.environ:
        pytest.skip("the environment's GOMEMLIMIT wins")
    broker = LocalNats(tmp_path).start()
    try:
        environ = open(f"/proc/{broker.proc.pid}/environ", "rb").read().split(b"\0")
        assert b"GOMEMLIMIT=512MiB" in environ
    finally:
        broker.stop()
