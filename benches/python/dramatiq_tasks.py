"""The benchmark's tasks for Dramatiq 2 (its broker: the Redis of $BENCH_BROKER)."""

import os

import dramatiq
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import CurrentMessage

import common

broker = RedisBroker(url=os.environ.get("BENCH_BROKER", "redis://127.0.0.1:6379/0"))
broker.add_middleware(CurrentMessage())
dramatiq.set_broker(broker)


@dramatiq.actor(max_retries=0)
def noop(i):
    common.done()


@dramatiq.actor(max_retries=2, min_backoff=100, max_backoff=100)
def flaky(i):
    common.attempt()
    if CurrentMessage.get_current_message().options.get("retries", 0) < 2:
        raise RuntimeError("fails twice")
    common.done()


@dramatiq.actor(max_retries=0)
def delayed(due_ms):
    common.due(due_ms)
