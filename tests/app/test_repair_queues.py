"""Repair is bounded on every Celery queue.

Beat's repair re-sends queued runs only as far as *their* queue has room below
one page. A workflow may name its own queue (``@workflow(queue=...)``); were the
room read off the default queue only, 50 runs on a queue no worker consumes would
grow it by 50 messages a tick without bound, and a backlog on the default queue
would stop every re-send elsewhere. In-process ticks against
the real Postgres and Redis; no worker runs, so only repair moves the queues.
"""

from __future__ import annotations

import pytest

PAGE = 100


@pytest.fixture
def queues(app, celery_tasks, redis_client, queue_name):
    from app.run_service import _queue_depth

    celery_app = app.extensions["celery"]
    names = [queue_name, celery_tasks.SLOW_QUEUE]

    def purge() -> None:
        with celery_app.connection_for_write() as conn:
            for name in names:
                conn.default_channel.queue_purge(name)

    purge()
    yield lambda name: _queue_depth(celery_app, name)
    purge()


@pytest.fixture
def celery_tasks(app):
    import tests.workflows.celery_tasks as module

    return module


def make_due(pg) -> None:
    """As if every queued run's last send were older than the repair age."""
    pg.execute("UPDATE runs SET last_sent_at = now() - interval '1 hour' WHERE status = 'queued'")


def tick(app) -> int:
    from app.extensions import db
    from app.run_service import redrive_stranded_runs

    with app.app_context():
        sent, _ = redrive_stranded_runs(db.session, app.extensions["celery"], min_age=60,
                                        limit=PAGE)
        return sent


def test_repair_of_a_queue_no_worker_consumes_stays_within_a_page(app, admit, pg, sent, queues,
                                                                  celery_tasks):
    slow = celery_tasks.SLOW_QUEUE
    for n in range(50):
        admit("routed-slow", {"n": n})
    sent()
    assert queues(slow) == 50
    depths = []
    for _ in range(5):
        make_due(pg)
        tick(app)
        depths.append(queues(slow))
    # Tick 1 fills the queue's room below a page (50 more); then there is none.
    assert depths == [100, 100, 100, 100, 100], depths


def test_a_backlog_on_one_queue_does_not_stop_re_sends_on_another(app, admit, pg, sent, queues,
                                                                  queue_name, celery_tasks):
    slow = celery_tasks.SLOW_QUEUE
    for n in range(PAGE):
        admit("noop", {"n": n})  # a backlog of a page on the default queue
    lost = admit("routed-slow", {"n": "lost"})
    sent()
    with app.extensions["celery"].connection_for_write() as conn:
        conn.default_channel.queue_purge(slow)  # the slow run's message is gone
    assert (queues(queue_name), queues(slow)) == (PAGE, 0)
    make_due(pg)
    tick(app)
    assert queues(slow) == 1, "the lost run on the other queue was not re-sent"
    assert queues(queue_name) == PAGE  # the full queue got nothing more
    assert pg.execute("SELECT last_sent_at > now() - interval '1 minute' FROM runs "
                      "WHERE id = %s", [lost]).fetchone()[0]


def test_a_second_repair_while_one_runs_re_sends_nothing(app, admit, pg, sent, queues,
                                                         queue_name, database_url):
    """Two beats (a deploy overlap): each would read the queue's depth and re-send up to a
    page below it, twice the bound together. While one repair holds the repair lock (here: a
    session of the test, as a repair between its marks and its sends), the other does
    nothing; once it is free, repair goes on."""
    import psycopg

    from app.state.runs import REPAIR_LOCK_NAMESPACE
    from poimenconfig import libpq_url

    for n in range(10):
        admit("noop", {"n": n})
    sent()
    with app.extensions["celery"].connection_for_write() as conn:
        conn.default_channel.queue_purge(queue_name)  # every message lost
    make_due(pg)
    with psycopg.connect(libpq_url(database_url)) as first:
        first.execute("SELECT pg_advisory_xact_lock(%s, 0)", [REPAIR_LOCK_NAMESPACE])
        assert tick(app) == 0
        assert queues(queue_name) == 0
    # The first repair ended (its transaction, and the lock, with it): the next tick re-sends.
    assert tick(app) == 10
    assert queues(queue_name) == 10
