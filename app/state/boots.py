"""Worker boots: registered under their lock, pruned once dead and unreferenced.

A boot's row is written on its own lock connection (``workers/boots.py``,
psycopg), after the lock is taken: a boot row exists only while its lock is
held, so pruning can never take a boot that is still being born. What makes a
boot live is ``app/liveness.py``'s one definition.
"""

from __future__ import annotations

import uuid

from sqlalchemy import text
from sqlalchemy.orm import Session

from app.liveness import LIVE_BOOTS_SQL

# psycopg placeholders: the lock connection runs without SQLAlchemy.
REGISTER_BOOT = (
    "INSERT INTO worker_boots (boot_id, lock_key, hostname, pid, node) "
    "VALUES (%s, %s, %s, %s, %s)"
)


def register_boot(conn, *, boot_id: uuid.UUID, lock_key: int, hostname: str, pid: int,
                  node: uuid.UUID) -> None:
    """Write boot ``boot_id``'s row on ``conn`` (a psycopg connection holding its lock)."""
    conn.execute(REGISTER_BOOT, [boot_id, lock_key, hostname[:255], pid, node])


# A dead boot that no run points at any more is history: without pruning, the
# table (and the join every liveness check makes) grows by one row per worker
# process lifetime, forever (think --max-tasks-per-child at high throughput).
PRUNE_DEAD_BOOTS = text(
    f"""
    DELETE FROM worker_boots b
     WHERE b.boot_id IN (
            SELECT d.boot_id FROM worker_boots d
             WHERE d.boot_id NOT IN ({LIVE_BOOTS_SQL})
               AND NOT EXISTS (SELECT 1 FROM runs r WHERE r.claimed_by = d.boot_id)
             LIMIT :limit)
    """
)


def prune_dead_boots(session: Session, limit: int = 10_000) -> int:
    """Delete up to ``limit`` dead boots that no run references; return how many.

    Step markers keep their claimer's id without a foreign key (migration 0008):
    a pruned boot is simply dead to them, as it was.
    """
    return session.execute(PRUNE_DEAD_BOOTS, {"limit": limit}).rowcount
