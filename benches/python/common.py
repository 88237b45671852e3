"""What the three systems' handlers share: one Redis connection for the completion
counter and the delay lags, so every system is timed by the same clock and the same
extra write per task (an INCR, a RPUSH for delayed tasks)."""

import os
import time

import redis

R = redis.Redis.from_url(os.environ.get("BENCH_REDIS", "redis://127.0.0.1:6379/0"))
DONE = "bench:done"
LAGS = "bench:lags"


def done() -> None:
    R.incr(DONE)


def due(due_ms: float) -> None:
    """A delayed task ran: its lag (now - due, ms) and one done."""
    lag = time.time() * 1000 - due_ms
    pipe = R.pipeline(transaction=False)
    pipe.rpush(LAGS, f"{lag:.1f}")
    pipe.incr(DONE)
    pipe.execute()
