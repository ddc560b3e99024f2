"""A worker publishes its Celery task events in batches, and loses none (workers/task_events.py).

Real workers, the real Redis broker and a real event receiver (what ``celery
events`` and Flower use). Publishes are counted by Redis itself (``INFO
commandstats``), so the batching is measured where it costs, not inferred.
"""

from __future__ import annotations

import time

import pytest

from tests.processes import start_worker, wait_until
from tests.workers.test_celery_native import EventLog, wait_ready

TASK_EVENTS = ("task-received", "task-started", "task-succeeded")


@pytest.fixture
def task_events(app):
    log = EventLog(app.extensions["celery"])
    yield log
    log.stop()


def redis_calls(redis_client, command: str) -> int:
    """How many times the Redis server has run ``command`` (its ``INFO commandstats``)."""
    return int(redis_client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def succeeded(pg, run_ids) -> int:
    return pg.execute("SELECT count(*) FROM runs WHERE id = ANY(%s) AND status = 'succeeded'",
                      [list(run_ids)]).fetchone()[0]


# alone: it counts the Redis server's PUBLISH calls, which every worker on the server adds to.
@pytest.mark.alone
def test_a_burst_of_runs_publishes_its_task_events_in_batches_and_every_one_arrives(
        admit, sent, fast_env, pg, tmp_path, processes, task_events, redis_client):
    worker = start_worker(fast_env, tmp_path, "evbatch", concurrency=2)
    processes.append(worker)
    wait_ready(worker)

    before = redis_calls(redis_client, "publish")  # task events on Redis
    runs = [admit("echo", {"n": n}) for n in range(60)]
    sent()
    wait_until(lambda: succeeded(pg, runs) == len(runs), timeout=90, what="the burst to succeed")
    wait_until(lambda: all(set(TASK_EVENTS) <= set(task_events.of(r)) for r in runs),
               timeout=10, what="every run's received, started and succeeded events")
    published = redis_calls(redis_client, "publish") - before

    # Celery's own flush publishes about once per event (180 here); a batch per interval
    # (or per 24 events) is a few dozen at most, worker heartbeats included.
    events = len(runs) * len(TASK_EVENTS)
    assert published <= events // 3, f"{published} publishes for {events} task events"
    for run_id in runs:
        seen = task_events.of(run_id)
        assert [seen.count(kind) for kind in TASK_EVENTS] == [1, 1, 1], (run_id, seen)


def test_events_still_buffered_at_a_warm_shutdown_are_published_before_the_worker_exits(
        admit, sent, fast_env, pg, tmp_path, processes, task_events, redis_client, queue_name):
    """An interval longer than the test: the events wait in the buffer until SIGTERM."""
    # The session's queue may hold an earlier test's messages (beat's repair sends, runs of
    # a test's examples): their events would fill Celery's buffer (24) and flush it early.
    for key in redis_client.scan_iter(match=f"{queue_name}*"):
        if redis_client.type(key) == b"list":
            redis_client.delete(key)
    worker = start_worker({**fast_env, "POIMEN_EVENT_FLUSH_INTERVAL": "600"}, tmp_path,
                          "evshutdown", concurrency=1)
    worker.graceful = True
    processes.append(worker)
    wait_ready(worker)

    runs = [admit("echo", {"n": n}) for n in range(3)]  # 9 events: under Celery's limit of 24
    sent()
    wait_until(lambda: succeeded(pg, runs) == len(runs), timeout=60, what="the runs to succeed")
    time.sleep(1.0)
    assert not any(task_events.of(r) for r in runs), "events left the buffer before the interval"

    worker.stop()  # SIGTERM: Celery's warm shutdown
    assert worker.proc.returncode == 0, worker.log()[-3000:]
    wait_until(lambda: all(set(TASK_EVENTS) <= set(task_events.of(r)) for r in runs),
               timeout=10, what="the buffered events, published at shutdown")
