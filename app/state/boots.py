"""Worker boots: registered under their lock, pruned once dead and unreferenced.

A boot's row is written on its own lock connection (``workers/boots.py``,
psycopg), after the lock is taken: a boot row exists only while its lock is
held, so pruning can never take a boot that is still being born. What makes a
boot live is ``app/liveness.py``'s one definition; when a boot that lost its
lock is *gone* (its runs and slots free) is decided on the server's clock from
``first_seen_dead_at``, which the statements here stamp.
"""

from __future__ import annotations

import uuid

from sqlalchemy import text
from sqlalchemy.orm import Session

from app.liveness import LIVE_BOOTS_SQL, LOCK_NAMESPACE

# psycopg placeholders: the lock connection runs without SQLAlchemy.
# ``dead_after_seconds``: the boot's own T_c + kill + margin (``lease.dead_after``), how
# long after its lock is first seen free its runs stay held.
REGISTER_BOOT = (
    "INSERT INTO worker_boots (boot_id, lock_key, hostname, pid, node, dead_after_seconds) "
    "VALUES (%s, %s, %s, %s, %s, %s)"
)


def register_boot(conn, *, boot_id: uuid.UUID, lock_key: int, hostname: str, pid: int,
                  node: uuid.UUID, dead_after: float) -> None:
    """Write boot ``boot_id``'s row on ``conn`` (a psycopg connection holding its lock)."""
    conn.execute(REGISTER_BOOT, [boot_id, lock_key, hostname[:255], pid, node, dead_after])


# A boot's lock seen free for the first time: stamp when, by the server's clock at the
# moment of seeing it (clock_timestamp(): never before the lock went, whenever the
# transaction began). Its runs stay held until the stamp is the boot's bound old
# (``app/liveness.py``). Only the first sight counts: a stamp is never moved.
#
# One boot (a delivery found a run held by a boot whose lock is free): the lock manager
# asked for its one key, like a claimer's own check (``claimer_live_sql``).
MARK_BOOT_DEAD = text(
    f"""
    UPDATE worker_boots b SET first_seen_dead_at = clock_timestamp()
     WHERE b.boot_id = :boot AND b.first_seen_dead_at IS NULL
       AND pg_try_advisory_xact_lock_shared({LOCK_NAMESPACE}, b.lock_key)
    """
)
# Every boot whose lock is free (beat's repair, each tick, and ``flask runs redrive``):
# so a boot nobody asked about is gone within one tick of its bound.
MARK_DEAD_BOOTS = text(
    f"""
    UPDATE worker_boots b SET first_seen_dead_at = clock_timestamp()
     WHERE b.first_seen_dead_at IS NULL
       AND b.boot_id NOT IN ({LIVE_BOOTS_SQL})
    """
)


def mark_boot_dead(session: Session, boot_id: uuid.UUID) -> bool:
    """Stamp ``boot_id`` first seen dead if its lock is free and it has no stamp yet
    (in ``session``'s transaction); True if this call stamped it."""
    return session.execute(MARK_BOOT_DEAD, {"boot": boot_id}).rowcount > 0


def mark_dead_boots(session: Session) -> int:
    """Stamp every boot whose lock is free and that has no stamp yet; return how many."""
    return session.execute(MARK_DEAD_BOOTS).rowcount


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
