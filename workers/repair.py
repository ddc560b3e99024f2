"""Repair: re-send runs whose Celery message may be lost.

Re-sending is always safe (claims absorb duplicates), so repair only has to
find runs that might be stranded: queued runs that nobody picked up, and
running runs whose boot is dead (decided by its lock, never by time).
"""

from __future__ import annotations

import logging

from sqlalchemy import text
from sqlalchemy.orm import Session

from app.enqueue import send_run

from .boots import LIVE_BOOTS_SQL

log = logging.getLogger(__name__)

_STRANDED = text(
    f"""
    SELECT r.id, r.workflow_name, r.workflow_version, r.status
      FROM runs r
     WHERE (r.status = 'queued'
            AND r.updated_at <= now() - make_interval(secs => :min_age)
            AND (r.not_before IS NULL OR r.not_before <= now()))
        OR (r.status = 'running'
            AND r.claimed_by NOT IN ({LIVE_BOOTS_SQL}))
     ORDER BY r.updated_at
     LIMIT :limit
    """
)


def repair_stranded_runs(session: Session, celery_app, *, min_age: float,
                         limit: int | None = 1000) -> tuple[int, int]:
    """Re-send queued runs older than ``min_age`` s and runs held by dead boots.

    Return ``(sent, found)``; ``limit=None`` means every stranded run.
    """
    rows = session.execute(
        _STRANDED, {"min_age": min_age, "limit": limit}
    ).all()
    session.rollback()
    sent = 0
    for row in rows:
        sent += send_run(celery_app, row.id, f"{row.workflow_name}@{row.workflow_version}")
    if rows:
        dead = sum(1 for r in rows if r.status == "running")
        log.info("repair: re-sent %s run(s) (%s queued, %s held by dead boots)", sent,
                 len(rows) - dead, dead)
    return sent, len(rows)
