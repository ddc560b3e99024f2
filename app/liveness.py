"""What makes a worker boot live: its advisory lock, held on its own connection.

A boot (one worker process lifetime, see ``workers/boots.py``) registers a row
in ``worker_boots`` and holds the session-level advisory lock
``(LOCK_NAMESPACE, lock_key)`` for as long as it lives. Postgres releases the
lock exactly when the process or its connection dies, so "is boot B alive?"
is a question about the lock table, not about clocks. Claims, repair and
metrics all use this one definition: the boot's lock held *exclusively*
(``pg_advisory_lock``), which only the boot's own lock session ever does.

A claim asks it of one boot, its own, once per run: ``claimer_live_sql``
asks the lock manager for that one key instead of reading ``pg_locks``, which
copies every lock of every backend on each read: several times the server CPU of
the one key's probe (bench/RESULTS.md, "the claim's liveness check").

A lock can vanish *early*: a Postgres restart, a failover or
``pg_terminate_backend`` drops it at once, while the boot's process still runs
the body it claimed until its watchdog's next probe or, at the latest, its
kernel fence (T_c after its last confirmed probe, plus the kill). So what a
boot *holds* (its runs' claims, its concurrency slots) is let go on the
server's clock, not at the lock's loss: the first statement that finds the
lock free stamps ``worker_boots.first_seen_dead_at`` (``clock_timestamp()``,
never earlier than the loss), and the boot is *gone* only once that stamp is
``dead_after_seconds`` old (the boot's own T_c + kill + margin, written when it
registered; ``lease.dead_after``). Until then its runs count as held: their
slots stay taken and nobody takes them over (``held_by_sql``, ``gone_sql``).
A claimer's own liveness is still its lock alone (``claimer_live_sql``): a
boot without its lock claims nothing at once.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, NamedTuple

from sqlalchemy import text
from sqlalchemy.orm import Session

if TYPE_CHECKING:
    from app.state.executor import Executor

# "POIM": the first key of every boot's two-key advisory lock.
LOCK_NAMESPACE = 0x504F494D

# The one definition of a live boot: its row joined to its lock, granted exclusively in
# this database, is the view ``poimen_live_boots`` (``app/state/sql/boots.sql``,
# ``live_boots``): ``boot_id``, ``hostname``, ``pid`` and ``lock_pid`` (the backend holding
# the lock). Every statement and query that lists live boots reads it.
LIVE_BOOTS_VIEW = "poimen_live_boots"
# The live boot ids, as a SQL fragment (``b`` the view's row).
LIVE_BOOTS_SQL = f"SELECT b.boot_id FROM {LIVE_BOOTS_VIEW} b"


def claimer_live_sql(boot_param: str) -> str:
    """A SQL condition: the boot ``boot_param`` (a bind parameter, e.g. ``:boot``) is live.

    The same definition asked of one key: a shared try-lock of the boot's key
    fails exactly while some session holds it exclusively, and only the boot's
    lock session does. When it succeeds (the boot is dead), the asking
    transaction holds the key *shared* until it ends: that never counts as
    liveness (``LIVE_BOOTS_SQL`` counts exclusive holders only), and a dead
    boot's key is not handed to a new boot while its row exists
    (``workers/boots.py``), so it stands in nobody's way.
    """
    return (f"EXISTS (SELECT 1 FROM worker_boots b WHERE b.boot_id = {boot_param} "
            f"AND NOT pg_try_advisory_xact_lock_shared({LOCK_NAMESPACE}, b.lock_key))")



def _dead_long_enough(b: str) -> str:
    """SQL: boot row ``b`` was first seen without its lock at least its bound ago.

    ``now()`` (the transaction's start, never later than the statement) against a
    stamp taken with ``clock_timestamp()`` once the lock was seen free: both the
    server's clock, and any error on the side of holding longer.
    """
    return (f"{b}.first_seen_dead_at <= now() - "
            f"make_interval(secs => {b}.dead_after_seconds)")


def gone_sql(boot_expr: str) -> str:
    """SQL condition: the boot ``boot_expr`` (a column or a bind parameter) is *gone*.

    Its lock was seen free at least its bound (T_c + kill + margin) ago: its
    process has stopped every body it ran, so its runs may be taken over, its
    slots are free, and repair re-sends its runs. A stamp is written only for a
    boot whose lock is free, and a dead boot never comes back, so a gone boot is
    dead. One primary-key lookup of ``worker_boots``: no read of ``pg_locks``.
    """
    return (f"EXISTS (SELECT 1 FROM worker_boots g WHERE g.boot_id = {boot_expr} "
            f"AND {_dead_long_enough('g')})")


# A message for a run whose holder is not gone yet is delivered this much after the
# server's count says it will be: the sender's clock and the worker's (a countdown's) are
# not the server's. Too early costs only a delay: the delivery takes nothing over.
GONE_SLACK = 1.0


def gone_in_sql(b: str) -> str:
    """SQL: seconds until boot row ``b`` (first seen dead) is gone, 0 if it is."""
    return (f"GREATEST(0, CAST(extract(epoch FROM {b}.first_seen_dead_at + "
            f"make_interval(secs => {b}.dead_after_seconds) - now()) AS float8))")


def held_by_sql(boot_expr: str) -> str:
    """SQL condition: the boot ``boot_expr`` still holds what it claimed (not ``gone_sql``):
    its lock is held, or it was lost less than its bound ago, or nobody has seen it free
    yet (beat's repair stamps every such boot within one tick)."""
    return f"NOT {gone_sql(boot_expr)}"


_BOOT_ALIVE = text(f"SELECT EXISTS ({LIVE_BOOTS_SQL} WHERE b.boot_id = :boot_id)")
_LIVE_COUNT = text(f"SELECT count(*) FROM ({LIVE_BOOTS_SQL}) AS live")

# How long ago each live boot's lock session last finished a query, by the
# server's clock. The session runs nothing but the watchdog's probes (in
# autocommit), so its pg_stat_activity.state_change is when the last probe
# ended (or, while one runs, when it began): observed, never written by the
# worker. clock_timestamp(), not now(): the transaction may have started before
# the probe did, which would make the age negative. A role that may not see
# another role's sessions (neither the same role nor pg_read_all_stats) reads
# state_change as NULL: the age is then unknown, and the boot is still listed.
_PROBE_AGES_SQL = f"""
    SELECT b.boot_id, b.hostname, b.pid,
           CAST(extract(epoch FROM clock_timestamp() - a.state_change) AS float8) AS age
      FROM {LIVE_BOOTS_VIEW} b
      LEFT JOIN pg_stat_activity a ON a.pid = b.lock_pid
"""
_PROBE_AGES = text(_PROBE_AGES_SQL + " ORDER BY b.boot_id")
_PROBE_AGE = text(_PROBE_AGES_SQL + " WHERE b.boot_id = :boot_id")


def boot_alive(session: Executor | Session, boot_id: uuid.UUID) -> bool:
    """Return whether ``boot_id``'s process still holds its advisory lock."""
    return bool(session.execute(_BOOT_ALIVE, {"boot_id": boot_id}).scalar_one())


def live_boot_count(session_or_conn) -> int:
    """Return how many boots hold their lock now."""
    return int(session_or_conn.execute(_LIVE_COUNT).scalar_one())


class ProbeAge(NamedTuple):
    """A live boot and the age of its last probe as Postgres saw it (None: not visible)."""

    boot_id: uuid.UUID
    hostname: str
    pid: int
    age_seconds: float | None


def boot_probe_ages(session_or_conn, boot_id: uuid.UUID | None = None) -> list[ProbeAge]:
    """Return every live boot (or only ``boot_id``, if live) with its last probe's age.

    Observability only: a growing age is a worker that cannot reach Postgres,
    but only the lock decides liveness. Postgres reads pg_stat_activity once
    per transaction: call this before anything else in the transaction reads
    it, or the ages run from that earlier view.
    """
    if boot_id is None:
        rows = session_or_conn.execute(_PROBE_AGES)
    else:
        rows = session_or_conn.execute(_PROBE_AGE, {"boot_id": boot_id})
    return [ProbeAge(*row) for row in rows]
