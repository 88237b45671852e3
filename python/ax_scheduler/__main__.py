"""``python -m ax_scheduler``: the Python runtime's pieces from the command line.

    python -m ax_scheduler worker  MODULE... [--url URL] [--concurrency N] [--executor E] [--config F]
                                   [--metrics-addr HOST:PORT]
    python -m ax_scheduler server  [--url URL] [--queue Q]... [--capacity H,N,L] [--console HOST:PORT]
                                   [--metrics-addr HOST:PORT]
    python -m ax_scheduler local   [MODULE...]   # embedded: nats-server + ax server (+ workers)

The rest of ax's command line (``ax task get``, ``ax flow get``, ``ax streams apply``, …)
is the ``ax`` command the package installs.

MODULE is an importable module (``myapp.tasks``) or a file (``tasks.py``) whose
``@ax.task`` / ``@ax.flow`` functions are served. SIGTERM or ctrl-c stops gracefully.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from . import _core, _logs
from ._runtime import Runtime


def _load(spec: str) -> None:
    if spec.endswith(".py") or os.sep in spec:
        path = Path(spec).resolve()
        sys.path.insert(0, str(path.parent))
        importlib.import_module(path.stem)
    else:
        sys.path.insert(0, os.getcwd())
        importlib.import_module(spec)


def _capacity(text: str) -> tuple[int, int, int]:
    """``--capacity high,normal,low``."""
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: three numbers of at least 1, high,normal,low")
    high, normal, low = (int(p) for p in parts)
    return high, normal, low


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ax_scheduler", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker", help="run workers for the tasks of MODULE(s)")
    w.add_argument("modules", nargs="+")
    s = sub.add_parser("server", help="run an ax server")
    s.add_argument("--queue", action="append", default=[], dest="queues")
    s.add_argument("--console", help="serve the console on HOST:PORT")
    s.add_argument("--console-token", default=os.environ.get("AX_CONSOLE_TOKEN"))
    s.add_argument("--ack-wait", type=float, help="seconds (default 30)")
    for sp in (s,):
        sp.add_argument("--capacity", type=_capacity, metavar="H,N,L",
                        help="tasks each new queue holds ready: high,normal,low (default 1000,5000,10000; "
                             "existing queues: ax streams apply --capacity)")
    loc = sub.add_parser("local", help="the embedded runtime: nats-server, ax server and workers")
    loc.add_argument("modules", nargs="*")
    loc.add_argument("--data-dir", default=".ax")
    loc.add_argument("--console", help="serve the console on HOST:PORT")
    for sp in (w, s):
        sp.add_argument("--url", default=os.environ.get("AX_URL", "nats://127.0.0.1:4222"))
        sp.add_argument("--creds", default=os.environ.get("AX_CREDS"))
    loc.add_argument("--capacity", type=_capacity, metavar="H,N,L",
                     help="tasks each new queue holds ready: high,normal,low (default 1000,5000,10000)")
    for sp in (w, s, loc):
        sp.add_argument("--metrics-addr", metavar="HOST:PORT", help="serve Prometheus metrics at /metrics")
    for sp in (w, loc):
        sp.add_argument("--concurrency", type=int, default=10)
        sp.add_argument("--executor", default="threadpool", choices=["threadpool", "process", "asyncio"])
        sp.add_argument("--shutdown-grace", type=float, default=30.0)
        sp.add_argument("--id", help="worker id stored in task records")
        sp.add_argument("--config", default=os.environ.get("AX_CONFIG"),
                        help="a settings file (runtime.yaml) stored at start: retries, timeouts, ... per task")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if a.cmd == "server":
        _logs.relay_core_logs(os.environ.get("AX_LOG", "info"))
        if a.metrics_addr:
            _core.serve_metrics(a.metrics_addr)
        conn = _core.Connection.connect(a.url, "ax-python-server", 5.0, a.creds, None, 30.0)
        server = _core.serve(conn, a.queues or ["default"], a.console, a.console_token, a.ack_wait, True,
                             a.capacity)
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())  # pyright: ignore[reportUnknownLambdaType, reportUnknownArgumentType]
        while not stop.wait(0.2) and not server.finished():
            pass
        server.stop()
        return 0
    for m in a.modules:
        _load(m)
    if a.cmd == "worker":
        rt = Runtime(a.url, max_concurrency=a.concurrency, executor=a.executor, creds=a.creds,
                     shutdown_grace=a.shutdown_grace, worker_id=a.id, config=a.config, metrics_addr=a.metrics_addr)
    else:
        rt = Runtime(None, max_concurrency=a.concurrency, executor=a.executor, data_dir=a.data_dir,
                     console=a.console, shutdown_grace=a.shutdown_grace, worker_id=a.id, config=a.config,
                     capacity=a.capacity, metrics_addr=a.metrics_addr)
    rt.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
