"""The benchmark's tasks for the ax Python worker (python -m ax_scheduler worker ax_tasks.py)."""

import ax_scheduler as ax

import common

Q = "bench"


@ax.task(queue=Q)
def noop(i: int) -> None:
    common.done()


@ax.task(queue=Q, retries=2, retry_backoff=0.1, retry_backoff_max=0.1, retry_jitter=0.0)
def flaky(i: int) -> None:
    common.attempt()
    if ax.context().attempt < 3:
        raise RuntimeError("fails twice")
    common.done()


@ax.task(queue=Q)
def delayed(due_ms: float) -> None:
    common.due(due_ms)


@ax.task(queue=Q)
def bare(i: int) -> None:
    """No Redis: for the Python worker against the Rust worker (completion from ax's index)."""
