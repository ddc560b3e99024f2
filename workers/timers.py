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


def tick(flask_app: Flask, *, page: int) -> tuple[int, int]:
    """Send the delayed runs now due and end the expired ones, a page at a time; return
    ``(released, expired)``."""
    from app.enqueue import send_run, tree_of
    from app.extensions import db
    from app.state import runs
    from app.state.executor import on_session
    from app.tracecontext import of_run

    celery_app = flask_app.extensions["celery"]
    released = expired = 0
    with flask_app.app_context():
        try:
            for _ in range(_MAX_PAGES):
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


def start(flask_app: Flask) -> threading.Thread:
    """Start the beat's timer thread: ``tick`` every ``POIMEN_RELEASE_INTERVAL`` seconds."""
    interval = flask_app.config["POIMEN_RELEASE_INTERVAL"]
    page = flask_app.config["POIMEN_RELEASE_PAGE"]

    def run() -> None:
        log.info("timers: delayed runs and expiry every %.1f s, pages of %d", interval, page)
        while True:
            started = time.monotonic()
            try:
                tick(flask_app, page=page)
            except Exception:  # noqa: BLE001 - Postgres or Redis away: the next tick tries again
                log.exception("timers: tick failed; trying again in %.1f s", interval)
            time.sleep(max(0.0, interval - (time.monotonic() - started)))

    thread = threading.Thread(target=run, name="poimen-timers", daemon=True)
    thread.start()
    return thread
