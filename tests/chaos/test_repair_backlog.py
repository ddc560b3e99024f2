"""Beat's repair under a backlog of 5,000 queued runs and no workers.

The repair function (what beat's ``runs.repair`` task and ``flask runs
redrive`` call) runs in-process, one call per tick, against the private
Postgres and a Celery queue of its own in the shared Redis; the queue is read
directly (``LLEN``/``LRANGE`` of the list named by ``POIMEN_QUEUE``). No
workers run, so nothing but repair changes the queue between ticks.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from datetime import timedelta

import pytest

from app.state.executor import on_session

pytestmark = pytest.mark.slow

BACKLOG = 5000
PAGE = 1000  # beat's page (redrive_stranded_runs' default limit)
REPAIR_AGE = 60.0  # seconds; no run admitted or re-sent during the test gets this old
TICKS = 5


def admit_backlog(app, tenant_id: int, n: int, batch: int = 500) -> list[uuid.UUID]:
    """Admit ``n`` runs through the admission function; return once all are sent."""
    from app.admission import admit_run
    from app.enqueue import sender
    from app.extensions import db

    ids = []
    with app.app_context():
        for start in range(0, n, batch):
            for _ in range(min(batch, n - start)):
                ids.append(admit_run(on_session(db.session), tenant_id=tenant_id,
                                     workflow_ref="noop",
                                     input={}).run.id)
            db.session.commit()
        # Admission hands runs to this process's sender thread after commit.
        assert sender(app.extensions["celery"]).wait_idle(120), "admission's sends never went out"
    return ids


def tick(app) -> tuple[int, int, float]:
    """One repair tick, as beat's task runs it; return (sent, found, seconds)."""
    from app.extensions import db
    from app.run_service import redrive_stranded_runs

    with app.app_context():
        t0 = time.monotonic()
        sent, found = redrive_stranded_runs(db.session, app.extensions["celery"],
                                            min_age=REPAIR_AGE, limit=PAGE)
        return sent, found, time.monotonic() - t0


def queued_ids(redis_client, queue: str) -> Counter:
    """How many messages the queue holds for each run (task id = run id)."""
    return Counter(json.loads(m)["headers"]["id"] for m in redis_client.lrange(queue, 0, -1))


def age_backlog(pg, hours: float = 1.0) -> None:
    """The backlog has sat for an hour: its sends (and updates) are an hour old."""
    pg.execute("UPDATE runs SET last_sent_at = last_sent_at - %(age)s, "
               "updated_at = updated_at - %(age)s, created_at = created_at - %(age)s",
               {"age": timedelta(hours=hours)})


def strand_under_dead_boot(pg, run_id: uuid.UUID) -> uuid.UUID:
    """Make ``run_id`` running under a boot whose lock nobody holds (its worker died).

    Its message was taken by that worker, so it is not in the queue.
    """
    boot = uuid.uuid4()
    pg.execute("INSERT INTO worker_boots (boot_id, hostname, pid) VALUES (%s, 'gone', 1)",
               [boot])
    pg.execute("UPDATE runs SET status = 'running', claimed_by = %s, attempt = 1, "
               "started_at = now(), updated_at = now() WHERE id = %s", [boot, run_id])
    return boot


@pytest.fixture
def queue(chaos_env, chaos_redis) -> str:
    return chaos_env["POIMEN_QUEUE"]


def test_backlog_in_the_queue_is_not_re_sent_and_a_dead_boot_run_goes_first(
        chaos_app, chaos_tenant, chaos_pg, chaos_redis, queue):
    [dead_run] = admit_backlog(chaos_app, chaos_tenant.id, 1)
    chaos_redis.delete(queue)  # the worker that died had taken its message
    backlog = admit_backlog(chaos_app, chaos_tenant.id, BACKLOG)
    assert chaos_redis.llen(queue) == BACKLOG
    age_backlog(chaos_pg)
    strand_under_dead_boot(chaos_pg, dead_run)

    depths = []
    for n in range(1, TICKS + 1):
        sent, found, took = tick(chaos_app)
        depth = chaos_redis.llen(queue)
        depths.append(depth)
        print(f"\ntick {n}: sent {sent} (found {found}) in {took:.2f}s; queue {depth}")
        if n == 1:
            messages = queued_ids(chaos_redis, queue)
            assert messages[str(dead_run)] == 1, "the dead boot's run was not re-sent first"
    messages = queued_ids(chaos_redis, queue)
    assert depths[-1] <= BACKLOG + PAGE, depths
    assert messages[str(dead_run)] == 1  # re-sent once, not every tick
    assert set(messages) == {str(r) for r in backlog} | {str(dead_run)}
    print(f"after {TICKS} ticks: {depths[-1]} messages for {BACKLOG} queued runs + 1 dead-boot "
          f"run (most copies of one run: {max(messages.values())})")


def test_lost_backlog_is_re_sent_a_page_per_tick_without_repeats(
        chaos_app, chaos_tenant, chaos_pg, chaos_redis, queue):
    backlog = admit_backlog(chaos_app, chaos_tenant.id, BACKLOG)
    age_backlog(chaos_pg)
    chaos_redis.delete(queue)  # every message lost (a Redis restart without persistence)

    re_sent: Counter = Counter()
    for n in range(1, TICKS + 1):
        sent, found, took = tick(chaos_app)
        page = queued_ids(chaos_redis, queue)
        print(f"\ntick {n}: sent {sent} in {took:.2f}s")
        assert sent == found == PAGE, (n, sent, found)
        assert len(page) == PAGE and max(page.values()) == 1
        re_sent.update(page)
        # While those wait in the queue, the next tick adds nothing ...
        assert tick(chaos_app)[:2] == (0, 0)
        assert chaos_redis.llen(queue) == PAGE
        chaos_redis.delete(queue)  # ... until workers take them (and lose them again)
    # Five ticks went through the whole backlog, each run once: a page at a time,
    # never the same first page again.
    assert set(re_sent) == {str(r) for r in backlog}
    assert max(re_sent.values()) == 1
    # Everything was re-sent within the repair age: the next tick has nothing to do.
    assert tick(chaos_app)[:2] == (0, 0)
