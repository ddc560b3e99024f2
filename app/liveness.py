"""What makes a worker boot live: its advisory lock, held on its own connection.

A boot (one worker process lifetime, see ``workers/boots.py``) registers a row
in ``worker_boots`` and holds the session-level advisory lock
``(LOCK_NAMESPACE, lock_key)`` for as long as it lives. Postgres releases the
lock exactly when the process or its connection dies, so "is boot B alive?"
is a question about the lock table, not about clocks. Claims, repair and
metrics all use this one definition.
"""

from __future__ import annotations

import uuid

from sqlalchemy import text
from sqlalchemy.orm import Session

# "POIM": the first key of every boot's two-key advisory lock.
LOCK_NAMESPACE = 0x504F494D

# The one definition of a live boot: its row joined to its granted advisory
# lock in this database, as a SQL fragment that yields live boot ids.
LIVE_BOOTS_SQL = f"""
    SELECT b.boot_id
      FROM worker_boots b
      JOIN pg_locks l
        ON l.locktype = 'advisory'
       AND l.classid = CAST({LOCK_NAMESPACE} AS oid)
       AND l.objid = CAST(b.lock_key AS oid)
       AND l.objsubid = 2
       AND l.granted
       AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
"""

_BOOT_ALIVE = text(f"SELECT EXISTS ({LIVE_BOOTS_SQL} WHERE b.boot_id = :boot_id)")
_LIVE_COUNT = text(f"SELECT count(*) FROM ({LIVE_BOOTS_SQL}) AS live")


def boot_alive(session: Session, boot_id: uuid.UUID) -> bool:
    """Return whether ``boot_id``'s process still holds its advisory lock."""
    return bool(session.execute(_BOOT_ALIVE, {"boot_id": boot_id}).scalar_one())


def live_boot_count(session_or_conn) -> int:
    """Return how many boots hold their lock now."""
    return int(session_or_conn.execute(_LIVE_COUNT).scalar_one())


# A dead boot that no run points at any more is history: without pruning, the
# table (and the join every liveness check makes) grows by one row per worker
# process lifetime, forever (think --max-tasks-per-child at high throughput).
_PRUNE = text(
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
    return session.execute(_PRUNE, {"limit": limit}).rowcount
