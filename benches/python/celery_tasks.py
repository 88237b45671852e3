"""The benchmark's tasks for Celery 5 (its broker: the Redis of $BENCH_BROKER; no result backend)."""

import os

from celery import Celery

import common

app = Celery("bench", broker=os.environ.get("BENCH_BROKER", "redis://127.0.0.1:6379/0"))
app.conf.update(task_ignore_result=True, worker_prefetch_multiplier=4, broker_connection_retry_on_startup=True,
                worker_hijack_root_logger=False)


@app.task
def noop(i):
    common.done()


@app.task(bind=True, max_retries=2)
def flaky(self, i):
    common.attempt()
    if self.request.retries < 2:
        raise self.retry(countdown=0.1)
    common.done()


@app.task
def delayed(due_ms):
    common.due(due_ms)
