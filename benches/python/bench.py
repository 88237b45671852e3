"""The Python benchmark: ax's Python worker against Dramatiq 2 and Celery 5 (Redis
brokers), on the same machine in one run (docs/PERFORMANCE.md, "Python").

Run it through run.sh (it installs the pinned peers, starts the peers' broker Redis, the
counter Redis, nats-server and an ax server). Producer (this process), brokers, ax server
and workers are separate processes. Every figure is printed, none is asserted.

Each system: 2 worker processes x 8 threads (--threads; ax: `python -m ax_scheduler worker
--concurrency 8`), sync handlers that each do one INCR on the counter Redis (private to
the bench, no persistence; not the peers' broker), so all three pay the same and are timed
by the same counter. Workloads (--workloads, default all but bare):
  drain     20,000 no-op tasks queued first (ax: submit_many; the peers one by one), then the
            workers start and drain them: tasks/s from the first task done to the last. CPU
            per task from /proc, between both workers ready and the last task done: the
            worker processes (and their children) and the broker processes (ax: nats-server
            + ax server; the peers: their broker redis-server; each one's share too); ax:
            JetStream messages stored (per stream) and JetStream API calls per task
            (nats-server's /jsz; also printed for ax's other workloads)
  one       20,000 no-op tasks, one producer thread submitting one by one while the workers
            run: tasks/s from the first submit until the workers ran the last. ax twice:
            `submit` (waits for each stored reply) and `submit_nowait` (up to --window in
            flight from the one thread, `.handle()` of each taken); the submit call's
            latency p50 / p99
  threads8  the same from 8 producer threads (one client shared; ax: `submit`)
  retries   2,000 tasks failing twice, 100 ms backoff (3 attempts each), submitted while
            the workers run (ax: submit_many; the peers one by one): seconds from the first
            submit until the last is done; attempts counted (must be 3 x 2,000)
  delayed   2,000 tasks due over 10 s, all stored before the first is due (ax:
            `submit_nowait` with run_at): lag from the due time to the handler's start,
            p50 / p99 / max; the lags in the order the handlers ran beside the log
            (<system>-delayed.lags.json), and where in the 10 s those over 50 ms were
  bare      (ax only; not by default) 20,000 tasks drained by the Python worker and by the
            Rust worker (no Redis; the rate from the tasks' records), CPU of the workers
After each run a task counter that passes the number submitted (a task run twice) is
reported (`extra_runs`), and so are the log lines that speak of errors, warnings,
tracebacks, refusals or stuck threads (their count and the first), and submits refused.
Logs: --logs/<UTC time of the run>/, one per system and workload, and results.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

import redis

HERE = Path(__file__).resolve().parent
R: redis.Redis  # the counter Redis
BROKER: redis.Redis  # the peers' broker Redis
PEERS = ("dramatiq", "celery")


def utc() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- /proc -------------------------------------------------------------------------------


def descendants(pid: int) -> list[int]:
    out: list[int] = []
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for t in threads:
        try:
            kids = [int(c) for c in Path(f"/proc/{pid}/task/{t}/children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
        for k in kids:
            out += [k, *descendants(k)]
    return out


def cpu_seconds(pids: list[int], with_children: bool = True) -> float:
    """CPU (user + system) of these processes (and their descendants) so far."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    seen: set[int] = set()
    for pid in pids:
        for p in [pid, *(descendants(pid) if with_children else [])]:
            if p in seen:
                continue
            seen.add(p)
            try:
                fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tick
            except (FileNotFoundError, IndexError, ProcessLookupError):
                pass
    return total


def jetstream(args: argparse.Namespace) -> dict[str, int]:
    """Per stream, the messages it ever stored (its last sequence), and "api": the
    JetStream API calls, from nats-server's monitoring port."""
    if not args.nats_monitor:
        return {}
    with urllib.request.urlopen(f"{args.nats_monitor}/jsz?accounts=true&streams=true", timeout=10) as r:
        j = json.load(r)
    out = {"api": int((j.get("api") or {}).get("total", 0))}
    for acc in j.get("account_details") or []:
        for s in acc.get("stream_detail") or []:
            out[s["name"]] = int(s["state"]["last_seq"])
    return out


def stored_per_task(js0: dict[str, int], js1: dict[str, int], n: int) -> dict:
    """Messages stored per task, in all and per stream (those that stored any), and the
    JetStream API calls per task, between two `jetstream` readings."""
    per = {k: round((v - js0.get(k, 0)) / n, 3) for k, v in js1.items() if k != "api" and v != js0.get(k, 0)}
    return {"js_stored_per_task": round(sum(per.values()), 2), "js_streams": per,
            "js_api_per_task": round((js1.get("api", 0) - js0.get("api", 0)) / n, 2)}


# -- workers -----------------------------------------------------------------------------


class Workers:
    """Two worker processes of a system, stopped on exit."""

    def __init__(self, system: str, args: argparse.Namespace, log: Path):
        # The workers log as their commands do by default (ax: one line a task at INFO from
        # Python, the Rust core's records from `warn`, or from --ax-log).
        env = {**os.environ, "BENCH_REDIS": args.redis, "BENCH_BROKER": args.broker, "PYTHONPATH": str(HERE)}
        env.pop("AX_LOG", None)
        if args.ax_log:
            env["AX_LOG"] = args.ax_log
        py = sys.executable
        if system == "ax":
            cmds = [[py, "-m", "ax_scheduler", "worker", str(HERE / "ax_tasks.py"), "--url", args.nats,
                     "--concurrency", str(args.threads), "--shutdown-grace", "1"] for _ in range(2)]
            ready = "ax: serving"  # logged once its workers are started
        elif system == "ax-rust":
            cmds = [[args.ax_bin, "worker", "--url", args.nats, "--queue", "bench", "--example", "--fail-rate", "0",
                     "--sleep", "0ms", "--concurrency", str(args.threads), "--metrics-addr", "off"] for _ in range(2)]
            ready = "worker started"
            env["AX_LOG"] = "info"
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
        self.ready = ready.encode()
        self._seen = 0
        self._offset = 0
        self._tail = b""

    def ready_count(self) -> int:
        """How many worker processes said they are ready (the log read from where it was left)."""
        with open(self.log, "rb") as f:
            f.seek(self._offset)
            new = f.read()
        self._offset += len(new)
        text = self._tail + new
        self._seen += text.count(self.ready)
        self._tail = text[-len(self.ready) + 1:] if len(self.ready) > 1 else b""
        if self.ready in self._tail:
            self._tail = b""
        return self._seen

    def check(self) -> None:
        if any(p.poll() is not None for p in self.procs):
            raise SystemExit(f"a worker process ended: see {self.log}")

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.ready_count() < self.expected:
            self.check()
            if time.monotonic() > deadline:
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


# -- producers ---------------------------------------------------------------------------


class Producer:
    """Submits tasks the way each system's users do."""

    def __init__(self, system: str, args: argparse.Namespace):
        self.system = system
        self.refused = 0
        if system.startswith("ax"):
            import ax_scheduler as ax

            sys.path.insert(0, str(HERE))
            import ax_tasks

            self.axm, self.ax, self.tasks = ax, ax.Client(args.nats), ax_tasks
        elif system == "celery":
            import celery_tasks

            self.tasks = celery_tasks
        else:
            import dramatiq_tasks

            self.tasks = dramatiq_tasks

    def close(self) -> None:
        if self.system.startswith("ax"):
            self.ax.close()

    def one_by_one(self, name: str, items: list, lat: list[float] | None = None) -> None:
        """One submit after the other, each waiting for what the system's submit waits for
        (ax: the stored reply; Dramatiq and Celery: Redis's reply to the push)."""
        task = getattr(self.tasks, name)
        if self.system.startswith("ax"):
            def send(i):
                while True:
                    try:
                        return task.submit(i, client=self.ax)
                    except self.axm.Unavailable:  # `busy`: the queue at capacity; sent again
                        self.refused += 1
                        time.sleep(0.05)
        elif self.system == "celery":
            send = task.delay
        else:
            send = task.send
        if lat is None:
            for i in items:
                send(i)
            return
        clock = time.perf_counter
        for i in items:
            t = clock()
            send(i)
            lat.append(clock() - t)

    def pipelined(self, name: str, items: list, window: int) -> None:
        """ax: `submit_nowait` from one thread, up to `window` in flight; each one's
        `.handle()` taken (it raises a refusal: counted and submitted again)."""
        task = getattr(self.tasks, name)
        inflight: collections.deque = collections.deque()

        def take() -> None:
            i, s = inflight.popleft()
            try:
                s.handle(timeout=60)
            except self.axm.Unavailable:
                self.refused += 1
                time.sleep(0.05)
                inflight.append((i, task.submit_nowait(i, client=self.ax)))

        for i in items:
            if len(inflight) >= window:
                take()
            inflight.append((i, task.submit_nowait(i, client=self.ax)))
        while inflight:
            take()

    def batch(self, name: str, items: list) -> None:
        """ax: submit_many in batches of 1,000; the peers have no batch submit: one by one."""
        if not self.system.startswith("ax"):
            return self.one_by_one(name, items)
        for start in range(0, len(items), 1000):
            chunk = items[start:start + 1000]
            while chunk:  # a `busy` refusal (the queue at capacity) is sent again, as a producer would
                answers = self.ax.submit_many(name, chunk, queue="bench")
                chunk = [item for item, a in zip(chunk, answers) if not hasattr(a, "id")]
                if chunk:
                    self.refused += len(chunk)
                    time.sleep(0.05)

    def delayed(self, dues_ms: list[float], window: int) -> None:
        if self.system.startswith("ax"):
            task = self.tasks.delayed
            inflight: collections.deque = collections.deque()
            for d in dues_ms:
                if len(inflight) >= window:
                    inflight.popleft().handle(timeout=60)
                at = datetime.fromtimestamp(d / 1000, timezone.utc)
                inflight.append(task.with_options(run_at=at, client=self.ax).submit_nowait(d))
            while inflight:
                inflight.popleft().handle(timeout=60)
        elif self.system == "celery":
            for d in dues_ms:
                self.tasks.delayed.apply_async((d,), eta=datetime.fromtimestamp(d / 1000, timezone.utc))
        else:
            for d in dues_ms:
                self.tasks.delayed.send_with_options(args=(d,), delay=max(0, int(d - time.time() * 1000)))


# -- measuring ---------------------------------------------------------------------------


def done() -> int:
    return int(R.get("bench:done") or 0)


def wait_done(n: int, timeout: float, workers: Workers | None = None) -> float:
    deadline = time.monotonic() + timeout
    while done() < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{done()} of {n} done in {timeout} s")
        if workers:
            workers.check()
        time.sleep(0.005)
    return time.monotonic()


def extra_runs(n: int, out: dict) -> None:
    """A task run more than once shows as a counter past n (looked at after a pause)."""
    time.sleep(1.0)
    if done() != n:
        out["extra_runs"] = done() - n


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[int(q * (len(xs) - 1))]


def reset() -> None:
    R.flushdb()  # counters and lags
    BROKER.flushdb()  # the peers' queues (ax's live in JetStream)


ISSUE = re.compile(rb"error|warn|traceback|exception|refus|panick|stuck|lost", re.I)


def log_issues(log: Path) -> dict:
    """Lines of a worker log that speak of errors, warnings, tracebacks or refusals: how
    many, and the first."""
    if not log.exists():
        return {}
    lines = [ln for ln in log.read_bytes().splitlines() if ISSUE.search(ln)]
    if not lines:
        return {}
    return {"log_issue_lines": len(lines), "first": lines[0][:200].decode(errors="replace")}


def drain(system: str, args: argparse.Namespace, log: Path) -> dict:
    n = args.n
    out: dict = {"system": system, "workload": "drain", "tasks": n, "at": utc()}
    producer = Producer(system, args)
    js0 = jetstream(args) if system == "ax" else None
    started = time.monotonic()
    producer.batch("noop", list(range(n)))
    out["enqueue_per_s"] = round(n / (time.monotonic() - started))
    brokers = args.ax_broker_pids if system == "ax" else args.peer_broker_pids
    workers = Workers(system, args, log)
    try:
        first = None
        cpu0 = None
        each0: list[float] = []
        while True:
            d = done()
            now = time.monotonic()
            if first is None and d >= 1:
                first = now
            if cpu0 is None and workers.ready_count() >= workers.expected:
                d0, t0 = d, now
                cpu0 = (cpu_seconds(workers.pids()), cpu_seconds(brokers, False), cpu_seconds([args.counter_pid], False))
                each0 = [cpu_seconds([b], False) for b in brokers]
            if d >= n:
                if cpu0 is None:
                    raise SystemExit(f"drained before the workers said they were ready: see {log}")
                last = now
                break
            workers.check()
            time.sleep(0.002)
        cpu1 = (cpu_seconds(workers.pids()), cpu_seconds(brokers, False), cpu_seconds([args.counter_pid], False))
        each1 = [cpu_seconds([b], False) for b in brokers]
        js1 = jetstream(args) if system == "ax" else None
        out["per_s"] = round((n - 1) / (last - first))
        m = n - d0
        out["cpu_window_tasks"] = m
        out["per_s_both_ready"] = round(m / (last - t0)) if last > t0 else None
        out["cpu_us_workers"] = round((cpu1[0] - cpu0[0]) / m * 1e6)
        out["cpu_us_brokers"] = round((cpu1[1] - cpu0[1]) / m * 1e6)
        names = ["nats-server", "ax server"] if system == "ax" else ["redis-server"]
        out["cpu_us_each_broker"] = {name: round((c1 - c0) / m * 1e6) for name, c0, c1 in zip(names, each0, each1)}
        out["cpu_us_per_task"] = out["cpu_us_workers"] + out["cpu_us_brokers"]
        out["cpu_us_counter_redis"] = round((cpu1[2] - cpu0[2]) / m * 1e6)
        if js0 and js1:  # from before the first submit to the last task done: all a task stored
            out.update(stored_per_task(js0, js1, n))
        extra_runs(n, out)
    finally:
        workers.stop()
        producer.close()
    if producer.refused:
        out["refused"] = producer.refused
    return out


def end_to_end(system: str, workload: str, args: argparse.Namespace, log: Path, mode: str = "") -> dict:
    """one / threads8 / retries / delayed: the workers run (ready) before the first submit."""
    n = {"one": args.n, "threads8": args.n, "retries": args.retries, "delayed": args.delayed}[workload]
    out: dict = {"system": system, "workload": workload, "tasks": n, "at": utc()}
    if mode:
        out["producer"] = mode
    producer = Producer(system, args)
    workers = Workers(system, args, log)
    js0: dict = {}
    try:
        workers.wait_ready()
        if system == "ax":
            js0 = jetstream(args)
        if workload == "delayed":
            lead = 3.0 + n / args.enqueue_rate[system] * 1.5
            base = time.time() * 1000 + lead * 1000
            dues = [base + 10_000 * i / n for i in range(n)]
            started = time.monotonic()
            producer.delayed(dues, args.window)
            out["enqueue_s"] = round(time.monotonic() - started, 2)
            out["lead_s"] = round(lead, 1)
            if out["enqueue_s"] > lead:
                out["warning"] = "enqueue took longer than the lead: early tasks were stored late"
            wait_done(n, lead + 10 + 300, workers)
            lags = [float(x) for x in R.lrange("bench:lags", 0, -1)]
            out["lag_p50_ms"] = round(statistics.median(lags), 1)
            out["lag_p99_ms"] = round(pct(lags, 0.99), 1)
            out["lag_max_ms"] = round(max(lags), 1)
            # in the order the handlers ran (~ the due order): where in the 10 s the late ones were
            log.with_suffix(".lags.json").write_text(json.dumps(lags))
            late = [round(10 * k / n, 1) for k, x in enumerate(lags) if x > 50]
            if late:
                out["over_50ms"] = len(late)
                out["over_50ms_at_s"] = sorted(set(late))[:20]
            extra_runs(n, out)
            if js0:
                out.update(stored_per_task(js0, jetstream(args), n))
            return out
        items = list(range(n))
        lat: list[float] = []
        started = time.monotonic()
        if workload == "retries":
            producer.batch("flaky", items)
        elif workload == "one" and mode == "submit_nowait":
            producer.pipelined("noop", items, args.window)
        elif workload == "one":
            producer.one_by_one("noop", items, lat)
        else:  # threads8: each thread its share, one by one
            shares = [items[k::args.producers] for k in range(args.producers)]
            lats: list[list[float]] = [[] for _ in shares]
            threads = [threading.Thread(target=producer.one_by_one, args=("noop", s, l)) for s, l in zip(shares, lats)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            lat = [x for l in lats for x in l]
        enqueued = time.monotonic()
        last = wait_done(n, 900, workers)
        out["enqueue_s"] = round(enqueued - started, 2)
        out["submits_per_s"] = round(n / (enqueued - started))
        if workload == "retries":
            out["s_to_finish"] = round(last - started, 2)
            out["s_after_enqueue"] = round(last - enqueued, 2)
        else:
            out["per_s"] = round(n / (last - started))
        if lat:
            out["submit_p50_ms"] = round(pct(lat, 0.5) * 1000, 2)
            out["submit_p99_ms"] = round(pct(lat, 0.99) * 1000, 2)
        extra_runs(n, out)
        if workload == "retries":
            out["attempts"] = int(R.get("bench:attempts") or 0)
            if out["attempts"] != 3 * n:
                out["warning"] = f"{out['attempts']} attempts, not {3 * n}"
        if js0:
            out.update(stored_per_task(js0, jetstream(args), n))
        return out
    finally:
        workers.stop()
        producer.close()
        if producer.refused:
            out["refused"] = producer.refused


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
        client.close()
    first = min(r["started_at_ms"] or r["updated_at_ms"] for r in records)
    last = max(r["finished_at_ms"] or r["updated_at_ms"] for r in records)
    return {"system": system, "workload": "bare", "tasks": n, "at": utc(), "per_s": round(n / ((last - first) / 1000)),
            "worker_cpu_s_per_10k": round(cpu / n * 10_000, 2)}


# -- the run's table -----------------------------------------------------------------------


def summary(results: list[dict], args: argparse.Namespace) -> str:
    """This run's figures as the doc's table: ax, Dramatiq, Celery, ax ÷ the better peer
    (higher is better for rates, lower for seconds, lags and CPU)."""
    def get(system, workload, key, producer=None):
        for r in results:
            if r["system"] == system and r["workload"] == workload and r.get("producer") == producer and key in r:
                return r[key]
        return None

    rows = [(f"{args.n:,} queued, then drained (tasks/s)", "drain", "per_s", None, True),
            ("one producer thread, one by one: `submit` (tasks/s)", "one", "per_s", "submit", True),
            (f"one producer thread: `submit_nowait`, {args.window} in flight (tasks/s)", "one", "per_s",
             "submit_nowait", True),
            (f"{args.producers} producer threads, one by one (tasks/s)", "threads8", "per_s", None, True),
            (f"{args.retries:,} tasks x 3 attempts, 100 ms backoff (s to finish all)", "retries", "s_to_finish", None,
             False),
            (f"{args.delayed:,} delayed over 10 s: lag p99 (ms)", "delayed", "lag_p99_ms", None, False),
            (f"{args.delayed:,} delayed over 10 s: lag p50 (ms)", "delayed", "lag_p50_ms", None, False),
            ("CPU per task, workers + brokers, drain (us)", "drain", "cpu_us_per_task", None, False)]
    lines = ["| workload | ax | Dramatiq | Celery | ax / the better peer |", "|---|---|---|---|---|"]
    for label, w, key, mode, higher in rows:
        ax = get("ax", w, key, mode)
        peers = [get(p, w, key, None if w != "one" else "submit") for p in PEERS]
        known = [p for p in peers if p is not None]
        ratio = ""
        if ax is not None and known:
            best = max(known) if higher else min(known)
            ratio = f"{ax / best:.2f}" if best else ""
        cells = ["" if v is None else f"{v:,}" for v in [ax, *peers]]
        lines.append(f"| {label} | {' | '.join(cells)} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    global R, BROKER
    p = argparse.ArgumentParser()
    p.add_argument("--nats", required=True)
    p.add_argument("--nats-monitor", default="", help="nats-server's monitoring URL (JetStream counts)")
    p.add_argument("--redis", required=True, help="the counter Redis (the handlers' INCR)")
    p.add_argument("--broker", required=True, help="the peers' broker Redis")
    p.add_argument("--ax-bin", required=True)
    p.add_argument("--ax-broker-pids", default="", help="nats-server,ax server (CPU per task)")
    p.add_argument("--peer-broker-pids", default="", help="the broker redis-server (CPU per task)")
    p.add_argument("--counter-pid", type=int, default=0)
    p.add_argument("--systems", default="ax,dramatiq,celery")
    p.add_argument("--workloads", default="drain,one,threads8,retries,delayed")
    p.add_argument("--threads", type=int, default=8, help="threads (ax: concurrency) per worker process")
    p.add_argument("--producers", type=int, default=8, help="producer threads of threads8")
    p.add_argument("--window", type=int, default=256, help="ax submit_nowait: submits in flight")
    p.add_argument("-n", type=int, default=20_000)
    p.add_argument("--retries", type=int, default=2_000)
    p.add_argument("--delayed", type=int, default=2_000)
    p.add_argument("--logs", default="/tmp/ax-pybench")
    p.add_argument("--ax-log", default="", help="AX_LOG of the ax Python workers (default: theirs, warn)")
    args = p.parse_args()
    args.ax_broker_pids = [int(x) for x in args.ax_broker_pids.split(",") if x]
    args.peer_broker_pids = [int(x) for x in args.peer_broker_pids.split(",") if x]
    # Submits per second a producer reaches with idle workers (this machine): how far ahead
    # the delayed workload's due times start, so that every task is stored before it is due.
    args.enqueue_rate = {"ax": 5_000, "celery": 500, "dramatiq": 1_000}
    os.environ["BENCH_REDIS"] = args.redis  # the producers import the peers' task modules too
    os.environ["BENCH_BROKER"] = args.broker
    R = redis.Redis.from_url(args.redis)
    BROKER = redis.Redis.from_url(args.broker)
    logs = Path(args.logs) / datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    logs.mkdir(parents=True, exist_ok=True)
    print(f"logs in {logs}", flush=True)
    results = []
    for workload in args.workloads.split(","):
        for system in args.systems.split(","):
            log = logs / f"{system}-{workload}.log"
            if workload == "bare":
                if system != "ax":
                    continue
                for s in ("ax", "ax-rust"):
                    results.append(bare(s, args, logs / f"{s}-bare.log"))
                    print(json.dumps(results[-1]), flush=True)
                continue
            modes = ["submit", "submit_nowait"] if workload == "one" and system == "ax" else \
                ["submit"] if workload == "one" else [""]
            for mode in modes:
                reset()
                log = logs / f"{system}-{workload}{'-' + mode if mode else ''}.log"
                if workload == "drain":
                    r = drain(system, args, log)
                else:
                    r = end_to_end(system, workload, args, log, mode)
                r.update(log_issues(log))
                results.append(r)
                print(json.dumps(r), flush=True)
                time.sleep(1)
    (logs / "results.json").write_text(json.dumps(results, indent=1))
    print(summary(results, args), flush=True)


if __name__ == "__main__":
    main()
