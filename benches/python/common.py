"""What the three systems' handlers share: one connection to the counter Redis (private to
the bench, not the peers' broker) for the completion counter, the attempts of the retried
tasks and the delay lags, so every system is timed by the same clock and pays the same
extra write per task (an INCR; an INCR per attempt of a retried task, a RPUSH for delayed
tasks)."""

import os
import time

import redis

R = redis.Redis.from_url(os.environ.get("BENCH_REDIS", "redis://127.0.0.1:6379/0"))
DONE = "bench:done"
LAGS = "bench:lags"
ATTEMPTS = "bench:attempts"


def done() -> None:
    R.incr(DONE)


def attempt() -> None:
    """An attempt of a retried task started."""
    R.incr(ATTEMPTS)


def due(due_ms: float) -> None:
    """A delayed task ran: its lag (now - due, ms) and one done."""
    lag = time.time() * 1000 - due_ms
    pipe = R.pipeline(transaction=False)
    pipe.rpush(LAGS, f"{lag:.1f}")
    pipe.incr(DONE)
    pipe.execute()
