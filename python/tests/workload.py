"""Tasks the worker processes of the tests serve (`python -m ax_scheduler worker
workload.py`). Each run start is appended to $AX_TEST_RECORD as one JSON line."""

import json
import os
import time

import ax_scheduler as ax


def record(**fields):
    path = os.environ.get("AX_TEST_RECORD")
    if not path:
        return
    line = json.dumps({"pid": os.getpid(), "at": time.time(), **fields}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


@ax.task(queue="py_shared")
def count_me(n: int) -> int:
    ctx = ax.context()
    record(id=ctx.id, attempt=ctx.attempt, worker="python")
    return n


@ax.task(queue="py_faults", timeout=30)
def slow(seconds: float) -> str:
    ctx = ax.context()
    record(id=ctx.id, attempt=ctx.attempt, event="start")
    time.sleep(seconds)
    record(id=ctx.id, attempt=ctx.attempt, event="end")
    return f"slept {seconds}"
