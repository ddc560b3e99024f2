"""The plain-Celery baseline of ``bench/execution.py``: one no-op task, nothing else.

``celery -A bench.plain_celery_app worker`` (started by the benchmark, with
``PYTHONPATH`` at the repository root). It uses Poimen's own Celery settings
(``celeryconfig.celery_settings``: the same broker, ``acks_late``,
``reject_on_worker_lost``, prefetch multiplier, task events, JSON) on a queue of
its own, ``BENCH_PLAIN_QUEUE``, so the only difference from a Poimen worker is
what the task does.

The task's one side effect is ``INCR BENCH_COUNTER_KEY`` in Redis: that is how
the benchmark counts completions (by polling the counter, as it polls
``SELECT count(*) ... 'succeeded'`` for Poimen). A plain no-op writes nothing
anywhere, so some completion marker is needed; one Redis round trip on the
broker's server is the cheapest one that still says "this task ran".

Like ``workers``, the Celery app is built lazily on first access of ``app``,
so importing (or running) this module reads no settings.
"""

from __future__ import annotations

import os

TASK_NAME = "bench.noop"

_celery = None
_redis = None


def _counter():
    global _redis
    if _redis is None:
        import redis

        _redis = redis.Redis.from_url(os.environ["REDIS_URL"])
    return _redis


def create(env: dict[str, str] | None = None):
    """Build the baseline's Celery app from ``env`` (default: ``os.environ``)."""
    from celery import Celery

    from celeryconfig import celery_settings
    from poimenconfig import broker_url

    env = dict(os.environ if env is None else env)
    env["POIMEN_QUEUE"] = env["BENCH_PLAIN_QUEUE"]
    celery_app = Celery("bench_plain")
    celery_app.config_from_object(celery_settings(broker_url(env), env))
    counter_key = env["BENCH_COUNTER_KEY"]

    @celery_app.task(name=TASK_NAME, shared=False)
    def noop(*args, **kwargs) -> None:  # bench/e2e.py's naive bridge passes the request
        _counter().incr(counter_key)

    return celery_app


def __getattr__(name: str):
    global _celery
    if name in ("app", "celery"):
        if _celery is None:
            _celery = create()
        return _celery
    raise AttributeError(name)


if __name__ == "__main__":  # `make bench` runs every bench/*.py; this one is not a benchmark
    print("bench/plain_celery_app.py: the Celery app of bench/execution.py's baseline")
