"""The Python benchmark: ax's Python worker against Celery 5 and Dramatiq 2 (Redis
brokers), and against ax's Rust worker, on the same machine in one run.

Run it through run.sh (it installs the pinned peers and starts Redis, nats-server and an
ax server). Every figure is printed, none is asserted (docs/PERFORMANCE.md, "Python").

Workloads (each system: 2 worker processes x 8 threads (--threads), sync handlers):
  noop-single  20,000 no-op tasks, one producer submitting one by one while the workers run
  noop-batch   the same, submitted in batches (ax's submit_many; the peers have no batch submit)
  drain        20,000 no-op tasks enqueued first, then the workers drain them
  retries      5,000 tasks failing twice, 100 ms backoff (3 attempts each)
  delayed      50,000 tasks due over 10 s (5,000 a second: more than any of them runs here, so
               the lag grows with the backlog): lag from due time to handler start, p50 / p99
  delayed-light 5,000 tasks due over 10 s (500 a second, within every system's pace): precision
  bare         (ax only) 20,000 tasks drained by the Python worker and by the Rust worker
               (no Redis; the rate from the tasks' records), CPU-seconds of the worker processes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import redis

HERE = Path(__file__).resolve().parent
R: redis.Redis


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        for p in [pid, *children(pid)]:
            try:
                fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tick
            except (FileNotFoundError, IndexError):
                pass
    return total


def children(pid: int) -> list[int]:
    try:
        out = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except FileNotFoundError:
        return []
    return [int(c) for c in out]


class Workers:
    """Two worker processes of a system, stopped on exit."""

    def __init__(self, system: str, args: argparse.Namespace, log: Path):
        env = {**os.environ, "BENCH_REDIS": args.redis, "AX_LOG": "info", "PYTHONPATH": str(HERE)}
        py = sys.executable
        if system == "ax":
            cmds = [[py, "-m", "ax_scheduler", "worker", str(HERE / "ax_tasks.py"), "--url", args.nats,
                     "--concurrency", str(args.threads), "--shutdown-grace", "1"] for _ in range(2)]
            ready = "worker started"
        elif system == "ax-rust":
            cmds = [[args.ax_bin, "worker", "--url", args.nats, "--queue", "bench", "--example", "--fail-rate", "0",
                     "--sleep", "0ms", "--concurrency", str(args.threads), "--metrics-addr", "off"] for _ in range(2)]
            ready = "worker started"
        elif system == "celery":
            cmds = [[py, "-m", "celery", "-A", "celery_tasks", "worker", "--pool", "threads", "-c", str(args.threads),
                     "--loglevel", "INFO", "-n", f"w{i}@%h", "--without-gossip", "--without-mingle",
                     "--without-heartbeat"] for i in range(2)]
            ready = "ready."
        elif system == "dramatiq":
            cmds = [[py, "-m", "dramatiq", "dramatiq_tasks", "--processes", "2", "--threads", str(args.threads)]]
            ready = "Worker process is ready"
        else:
            raise SystemExit(f"unknown system {system}")
        self.log = log
        self.procs = []
        for cmd in cmds:
            out = open(log, "ab")
            self.procs.append(subprocess.Popen(cmd, cwd=HERE, env=env, stdout=out, stderr=subprocess.STDOUT))
            out.close()
        self.expected = 2
        self.ready = ready

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.log.read_text(errors="replace").count(self.ready) < self.expected:
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                raise SystemExit(f"workers not ready: see {self.log}")
            time.sleep(0.05)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class Producer:
    """Submits tasks the way each system's users do."""

    def __init__(self, system: str, args: argparse.Namespace):
        self.system = system
        if system.startswith("ax"):
            import ax_scheduler as ax

            sys.path.insert(0, str(HERE))
            import ax_tasks

            self.ax, self.tasks = ax.Client(args.nats), ax_tasks
        elif system == "celery":
            import celery_tasks

            self.tasks = celery_tasks
        else:
            import dramatiq_tasks

            self.tasks = dramatiq_tasks

    def one_by_one(self, name: str, items: list) -> None:
        task = getattr(self.tasks, name)
        if self.system.startswith("ax"):
            for i in items:
                task.submit(i, client=self.ax)
        elif self.system == "celery":
            for i in items:
                task.delay(i)
        else:
            for i in items:
                task.send(i)

    def batch(self, name: str, items: list) -> None:
        if not self.system.startswith("ax"):
            return self.one_by_one(name, items)
        for start in range(0, len(items), 1000):
            chunk = items[start:start + 1000]
            while chunk:  # a `busy` refusal (the queue at capacity) is sent again, as a producer would
                answers = self.ax.submit_many(name, chunk, queue="bench")
                chunk = [item for item, a in zip(chunk, answers) if not hasattr(a, "id")]
                if chunk:
                    time.sleep(0.05)

    def delayed(self, dues_ms: list[float]) -> None:
        now_ms = time.time() * 1000
        if self.system.startswith("ax"):
            conn = self.ax._conn
            for start in range(0, len(dues_ms), 1000):
                chunk = dues_ms[start:start + 1000]
                bodies = [json.dumps({"name": "delayed", "payload": d, "delay_ms": max(0, round(d - time.time() * 1000))}
                                     ).encode() for d in chunk]
                answers = conn.submit_many("bench", bodies)
                assert all(ok for ok, _ in answers)
        elif self.system == "celery":
            from datetime import datetime, timezone

            for d in dues_ms:
                self.tasks.delayed.apply_async((d,), eta=datetime.fromtimestamp(d / 1000, timezone.utc))
        else:
            for d in dues_ms:
                self.tasks.delayed.send_with_options(args=(d,), delay=max(0, int(d - now_ms)))


def wait_done(n: int, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while int(R.get("bench:done") or 0) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{int(R.get('bench:done') or 0)} of {n} done in {timeout} s")
        time.sleep(0.005)
    return time.monotonic()


def reset(system: str) -> None:
    R.flushdb()  # counters, and the peers' queues (ax's live in JetStream)


def run(system: str, workload: str, args: argparse.Namespace, log: Path) -> dict:
    reset(system)
    producer = Producer(system, args)
    n = {"noop-single": args.n, "noop-batch": args.n, "drain": args.n, "retries": args.retries,
         "delayed": args.delayed, "delayed-light": args.delayed // 10}[workload]
    out: dict = {"system": system, "workload": workload, "tasks": n}
    if workload == "drain":
        started = time.monotonic()
        producer.batch("noop", list(range(n)))
        out["enqueue_per_s"] = round(n / (time.monotonic() - started))
        workers = Workers(system, args, log)
        try:
            while int(R.get("bench:done") or 0) < 1:
                time.sleep(0.001)
            first = time.monotonic()
            last = wait_done(n, 600)
            out["per_s"] = round((n - 1) / (last - first))
        finally:
            workers.stop()
        return out
    workers = Workers(system, args, log)
    try:
        workers.wait_ready()
        if workload.startswith("delayed"):
            lead = 3.0 + n / args.enqueue_rate[system] * 1.5
            base = time.time() * 1000 + lead * 1000
            dues = [base + 10_000 * i / n for i in range(n)]
            started = time.monotonic()
            producer.delayed(dues)
            out["enqueue_s"] = round(time.monotonic() - started, 1)
            out["lead_s"] = round(lead, 1)
            if out["enqueue_s"] > lead:
                out["warning"] = "enqueue took longer than the lead: early tasks were stored late"
            wait_done(n, lead + 10 + 300)
            lags = sorted(float(x) for x in R.lrange("bench:lags", 0, -1))
            out["lag_p50_ms"] = round(statistics.median(lags), 1)
            out["lag_p99_ms"] = round(lags[int(0.99 * (len(lags) - 1))], 1)
            out["lag_max_ms"] = round(lags[-1], 1)
            return out
        started = time.monotonic()
        name = "flaky" if workload == "retries" else "noop"
        if workload == "noop-single":
            producer.one_by_one(name, list(range(n)))
        else:
            producer.batch(name, list(range(n)))
        enqueued = time.monotonic()
        last = wait_done(n, 600)
        out["enqueue_per_s"] = round(n / (enqueued - started))
        out["per_s"] = round(n / (last - started))
        return out
    finally:
        workers.stop()


def bare(system: str, args: argparse.Namespace, log: Path) -> dict:
    """ax's Python worker against its Rust worker: 20,000 tasks enqueued, then drained.
    The rate is from the tasks' own records (first start to last finish), the CPU of the
    worker processes from /proc."""
    import ax_scheduler as ax

    client = ax.Client(args.nats)
    n = args.n
    ids: list[str] = []
    for start in range(0, n, 1000):
        ids += [h.id for h in client.submit_many("bare", list(range(start, min(n, start + 1000))), queue="bench")]
    workers = Workers(system, args, log)
    try:
        cpu0 = cpu_seconds(workers.pids())
        client.wait(ids[-1], timeout=600)
        while True:  # the last submitted is not always the last to finish
            records = [client.get(i) for i in ids]
            if all(r and r["state"] == "succeeded" for r in records):
                break
            time.sleep(0.5)
        cpu = cpu_seconds(workers.pids()) - cpu0
    finally:
        workers.stop()
    first = min(r["started_at_ms"] or r["updated_at_ms"] for r in records)
    last = max(r["finished_at_ms"] or r["updated_at_ms"] for r in records)
    return {"system": system, "workload": "bare", "tasks": n, "per_s": round(n / ((last - first) / 1000)),
            "worker_cpu_s_per_10k": round(cpu / n * 10_000, 2)}


def main() -> None:
    global R
    p = argparse.ArgumentParser()
    p.add_argument("--nats", required=True)
    p.add_argument("--redis", required=True)
    p.add_argument("--ax-bin", required=True)
    p.add_argument("--systems", default="ax,dramatiq,celery")
    p.add_argument("--workloads", default="noop-single,noop-batch,drain,retries,delayed-light,delayed,bare")
    p.add_argument("--threads", type=int, default=8, help="threads (ax: concurrency) per worker process")
    p.add_argument("-n", type=int, default=20_000)
    p.add_argument("--retries", type=int, default=5_000)
    p.add_argument("--delayed", type=int, default=50_000)
    p.add_argument("--logs", default="/tmp/ax-pybench")
    args = p.parse_args()
    # Submits per second a producer reaches with idle workers (this machine): how far ahead
    # the delayed workload's due times start, so that every task is stored before it is due.
    args.enqueue_rate = {"ax": 10_000, "celery": 500, "dramatiq": 1_000}
    os.environ["BENCH_REDIS"] = args.redis  # the producers import the peers' task modules too
    R = redis.Redis.from_url(args.redis)
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    results = []
    for workload in args.workloads.split(","):
        for system in args.systems.split(","):
            if workload == "bare":
                if system != "ax":
                    continue
                for s in ("ax", "ax-rust"):
                    results.append(bare(s, args, logs / f"{s}-bare.log"))
                    print(json.dumps(results[-1]), flush=True)
                continue
            results.append(run(system, workload, args, logs / f"{system}-{workload}.log"))
            print(json.dumps(results[-1]), flush=True)
    (logs / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
