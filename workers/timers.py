"""Delayed runs and expiry: what a beat process does once a second besides schedules.

A run admitted with ``not_before`` or ``delay_seconds`` waits in Postgres, ``queued``
with its time, and is sent to Celery only when due: this thread picks the delayed runs
now due that were never sent (``release_due``: marked sent in the statement that picks
them, so any number of beats send each once), commits, then sends them. No Celery ETA
is used, so a Redis visibility timeout has no message in a worker's memory to deliver
again, and a Redis ``FLUSHALL`` loses nothing: a run is in Postgres until it is
claimed, and a send lost after its mark is repair's, like any queued run's.

The same tick ends ``expired`` the runs never started whose ``expires_at`` passed
(``expire_due``), whether they were in Redis, waiting for a slot, or delayed; a claim
refuses an expired run too, so none runs late whichever comes first.

Each statement takes a bounded page (``POIMEN_RELEASE_PAGE``); a page that comes back
full is followed at once by the next, so a burst due together is not spread a page per
second.

Between two ticks the thread sleeps only until the earliest run still to send comes due
(``next_due``), and then sends what is due: a start that a run's rate limits reserved
(``poimen_rate_start``) goes out at its time, not up to a tick late, so starts keep the
spacing the limit gave them. A reserved start less than 2 s away is sent by the worker
that reserved it (``workers/execution.py``, ``send_for_start``), so a reservation made
while this thread sleeps a whole interval is never one it wakes too late for.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from app import metrics

if TYPE_CHECKING:
    from flask import Flask

log = logging.getLogger(__name__)

# Pages one tick may take of each kind before it yields to the next tick.
_MAX_PAGES = 20
# The pause before looking again at a run due that the last pass did not send.
_BUSY_RETRY = 0.05


def tick(flask_app: Flask, *, page: int, expire: bool = True) -> tuple[int, int]:
    """Send the delayed runs now due and end the expired ones (unless ``expire`` is False),
    a page at a time; return ``(released, expired)``."""
    from app.enqueue import send_run, tree_of
    from app.extensions import db
    from app.state import runs
    from app.state.executor import on_session
    from app.tracecontext import of_run

    celery_app = flask_app.extensions["celery"]
    released = expired = 0
    with flask_app.app_context():
        try:
            for _ in range(_MAX_PAGES if expire else 0):
                store = on_session(db.session)
                ended = runs.expire_due_runs(store, limit=page)
                # The commit hands a parent its join completed to the sender.
                db.session.commit()
                metrics.RUNS_EXPIRED.labels("beat").inc(ended)
                expired += ended
                if ended < page:
                    break
            for _ in range(_MAX_PAGES):
                due = runs.release_due_runs(on_session(db.session), limit=page)
                db.session.commit()
                for row in due:
                    send_run(celery_app, row.id, f"{row.workflow_name}@{row.workflow_version}",
                             trace=of_run(row), tree=tree_of(row))
                metrics.RELEASES.inc(len(due))
                released += len(due)
                if len(due) < page:
                    break
        except Exception:
            db.session.rollback()
            raise
        finally:
            db.session.remove()
    if released or expired:
        log.info("timers: sent %d delayed run(s) now due, ended %d expired run(s)",
                 released, expired)
    return released, expired


def next_due(flask_app: Flask) -> float | None:
    """The seconds until the earliest run still to send comes due (None: none is)."""
    from app.extensions import db
    from app.state import runs
    from app.state.executor import on_session

    with flask_app.app_context():
        try:
            return runs.next_due_in(on_session(db.session))
        finally:
            db.session.rollback()
            db.session.remove()


def start(flask_app: Flask) -> threading.Thread:
    """Start the beat's timer thread: ``tick`` every ``POIMEN_RELEASE_INTERVAL`` seconds, and
    between ticks the sends of runs as they come due."""
    interval = flask_app.config["POIMEN_RELEASE_INTERVAL"]
    page = flask_app.config["POIMEN_RELEASE_PAGE"]

    def run() -> None:
        log.info("timers: delayed runs and expiry every %.1f s, pages of %d", interval, page)
        next_tick = time.monotonic()
        while True:
            due_in: float | None = None
            try:
                if time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + interval
                    tick(flask_app, page=page)
                else:
                    tick(flask_app, page=page, expire=False)
                due_in = next_due(flask_app)
            except Exception:  # noqa: BLE001 - Postgres or Redis away: the next tick tries again
                log.exception("timers: tick failed; trying again in %.1f s", interval)
            if due_in is not None and due_in <= 0:
                # Due yet not sent by this pass (a page's row locked by a claim): soon again.
                due_in = _BUSY_RETRY
            until_tick = next_tick - time.monotonic()
            time.sleep(max(0.0, until_tick if due_in is None else min(until_tick, due_in)))

    thread = threading.Thread(target=run, name="poimen-timers", daemon=True)
    thread.start()
    return thread
