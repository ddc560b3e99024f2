"""Worker boots: registered under their lock, pruned once dead and unreferenced.

A boot's row is written on its own lock connection (``workers/boots.py``,
psycopg), after the lock is taken: a boot row exists only while its lock is
held, so pruning can never take a boot that is still being born. What makes a
boot live is ``app/liveness.py``'s one definition; when a boot that lost its
lock is *gone* (its runs and slots free) is decided on the server's clock from
``first_seen_dead_at``, which the statements here stamp (``sql/boots.sql``).
"""

from __future__ import annotations

import uuid
from typing import Any, Protocol

from .executor import Executor
from .statements import sql, statement


class LockConnection(Protocol):
    """What ``register_boot`` uses of a boot's lock connection (a psycopg ``Connection``)."""

    def execute(self, query: str, params: list[Any]) -> Any: ...

# psycopg placeholders (``%s``): the lock connection runs without SQLAlchemy.
REGISTER_BOOT = sql("register_boot")


def register_boot(conn: LockConnection, *, boot_id: uuid.UUID, lock_key: int, hostname: str, pid: int,
                  node: uuid.UUID, dead_after: float) -> None:
    """Write boot ``boot_id``'s row on ``conn`` (a psycopg connection holding its lock)."""
    conn.execute(REGISTER_BOOT, [boot_id, lock_key, hostname[:255], pid, node, dead_after])


# The view of the live boots (``app/liveness.py``'s definition), installed by migrations.
LIVE_BOOTS = sql("live_boots")
MARK_BOOT_DEAD = statement("mark_boot_dead")
MARK_DEAD_BOOTS = statement("mark_dead_boots")


def mark_boot_dead(session: Executor, boot_id: uuid.UUID) -> bool:
    """Stamp ``boot_id`` first seen dead if its lock is free and it has no stamp yet
    (in ``session``'s transaction); True if this call stamped it."""
    return session.execute(MARK_BOOT_DEAD, {"boot": boot_id}).rowcount > 0


def mark_dead_boots(session: Executor) -> int:
    """Stamp every boot whose lock is free and that has no stamp yet; return how many."""
    return session.execute(MARK_DEAD_BOOTS).rowcount


PRUNE_DEAD_BOOTS = statement("prune_dead_boots")


def prune_dead_boots(session: Executor, limit: int = 10_000) -> int:
    """Delete up to ``limit`` dead boots that no run references; return how many.

    Step markers keep their claimer's id without a foreign key (migration 0008):
    a pruned boot is simply dead to them, as it was.
    """
    return session.execute(PRUNE_DEAD_BOOTS, {"limit": limit}).rowcount
