"""Worker boots: one per worker process lifetime, alive exactly while its lock is held.

A boot registers a row in ``worker_boots`` and takes a session-level advisory
lock ``(LOCK_NAMESPACE, lock_key)`` on a dedicated connection that it keeps for
its whole life. Postgres releases that lock exactly when the process or its
connection dies, so "is boot B alive?" is a question about the lock table, not
about clocks: no heartbeat age, no timeout guess. What "live" means in SQL is
defined once, in ``app/liveness.py``.

The lock can also vanish while the process lives: Postgres restarted, a
failover, ``pg_terminate_backend``, a dropped TCP flow. psycopg only notices
that when the connection is next used, and nothing else uses a lock
connection, so a *watchdog* thread asks Postgres every
``POIMEN_BOOT_PROBE_INTERVAL`` seconds (2) whether this backend still holds
the lock. When it does not, or no answer comes within the probe's deadline,
the boot is *lost*: ``current_boot()`` starts a new one, every claim statement
refuses the old one (liveness is part of the claim), and ``on_lost`` (set by
``workers/execution.py``) decides what happens to runs this process is
executing under it.

The lock is a lease bounded on both sides (``lease.py``): the server ends a
lock session that sent nothing for T_s (``idle_session_timeout``, renewed by
every probe), and this process is SIGKILLed by a kernel timer (the *fence*)
when a run it executes is covered by no boot whose lock was confirmed within
T_c; its guardian then ends the process group the run's body started its
children in (``workers/proctree.py``). T_c + kill + margin <= T_s, so a
cut-off process and its children have stopped before the server lets go of
its lock; and a lock that goes early (a restart, ``pg_terminate_backend``)
frees nothing this boot holds until T_c + kill + margin after the server
first saw it free (``app/liveness.py``), so it has stopped before anyone may
start its run again or take its slot.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, LiteralString

import psycopg
from flask import current_app
from psycopg.abc import Params

from app.liveness import LOCK_NAMESPACE
from app.state.boots import register_boot
from lease import (
    KillFence,
    bound_lock_session,
    check_ordering,
    dead_after,
    lock_connect_kwargs,
    probe_lock,
)
from poimenconfig import LeaseSettings, libpq_url
from poimenconfig import lease_settings as read_lease_settings

log = logging.getLogger(__name__)

# Does *this* backend hold the boot's lock? Asked on the lock connection itself, as
# text for the deadline probe (our own integers, no parameters).
_PROBE_TEXT = (
    "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' "
    "AND classid = CAST(%(ns)d AS oid) AND objid = CAST(%(key)d AS oid) AND objsubid = 2 "
    "AND granted AND pid = pg_backend_pid())"
)
# Advisory locks are per database: another database's boot may hold the same key.
_HOLDER = (
    "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND classid = CAST(%(ns)s AS oid) "
    "AND objid = CAST(%(key)s AS oid) AND objsubid = 2 AND granted "
    "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)


# This worker's identity: drawn once in the main process when this module is
# imported, inherited by every pool process it forks, stored with each of their
# boots. The main process names its own pool process's run by it
# (celery_native's hard time limit): hostname and pid do not, across containers.
NODE = uuid.uuid4()


class LockKeyTaken(RuntimeError):
    """The boot's advisory lock key is held by a connection that is not ours."""


class PooledLockConnection(RuntimeError):
    """The lock connection goes through a transaction pooler: liveness would mean nothing."""


def lease_settings() -> LeaseSettings:
    """The lease's numbers, read from the environment when a boot registers."""
    return read_lease_settings()


def probe_interval() -> float:
    return lease_settings().probe_interval


@dataclass
class Boot:
    """A registered boot and the connection that holds its lock."""

    boot_id: uuid.UUID
    lock_key: int
    pid: int
    backend_pid: int
    conn: psycopg.Connection = field(repr=False)
    lost: threading.Event = field(default_factory=threading.Event, repr=False)
    settings: LeaseSettings = field(default_factory=LeaseSettings, repr=False)
    # time.monotonic() at the start of the last probe that found the lock held:
    # the server's idle timer started no sooner, so the lease runs from here.
    confirmed_at: float = field(default_factory=time.monotonic)
    server_bound: str = ""

    @classmethod
    def register(cls, dsn: str, settings: LeaseSettings | None = None) -> Boot:
        """Register a new boot and take its lock on a connection of its own.

        Fails loudly (never blocks) when the lock key is held elsewhere, and
        refuses a connection that does not keep its session (a transaction
        pooler such as PgBouncer in transaction mode). The session gets the
        server's bound T_s before it takes the lock.
        """
        settings = settings or lease_settings()
        started = time.monotonic()
        conn = psycopg.connect(dsn, application_name="poimen-boot",
                               **lock_connect_kwargs(settings))
        try:
            server_bound = bound_lock_session(conn, settings)
            boot_id = uuid.uuid4()
            # The lock first, then the row: a boot row exists only while its lock
            # is held, so repair's pruning of dead boots can never take a boot
            # that is still being born.
            lock_key, params = _take_free_key(conn, boot_id)
            register_boot(conn, boot_id=boot_id, lock_key=lock_key,
                          hostname=socket.gethostname(), pid=os.getpid(), node=NODE,
                          dead_after=dead_after(settings))
            backend_pid = _value(conn, "SELECT pg_backend_pid()")
            _check_session_kept(dsn, conn, backend_pid, params)
        except BaseException:
            conn.close()
            raise
        log.info("boot %s registered (pid %s, lock key %s, backend %s; lease: %s, client "
                 "bound %gs)", boot_id, os.getpid(), lock_key, backend_pid, server_bound,
                 settings.client_seconds)
        return cls(boot_id=boot_id, lock_key=lock_key, pid=os.getpid(),
                   backend_pid=backend_pid, conn=conn, settings=settings,
                   confirmed_at=started, server_bound=server_bound)

    def probe(self) -> bool:
        """Ask Postgres, within the probe's deadline, whether this boot still holds its lock.

        True renews the lease (``confirmed_at``); False means lost *or* not
        confirmed in time: a silent path looks exactly like a lost lock from here.
        """
        started = time.monotonic()
        held = probe_lock(self.conn, _PROBE_TEXT % {"ns": LOCK_NAMESPACE, "key": self.lock_key},
                          self.settings.probe_timeout)
        if held:
            self.confirmed_at = started
        return bool(held)

    def fresh(self, now: float | None = None) -> bool:
        """Whether the lock was confirmed recently enough to start a run under it."""
        now = time.monotonic() if now is None else now
        return now < self.confirmed_at + self.settings.client_seconds \
            - self.settings.probe_timeout

    @property
    def usable(self) -> bool:
        """Whether this process can still act as this boot."""
        return (self.pid == os.getpid() and not self.lost.is_set() and not self.conn.closed
                and not self.conn.broken and self.fresh())

    def mark_lost(self) -> None:
        self.lost.set()
        self.close()

    def close(self) -> None:
        """End the boot: closing the connection releases the lock (the boot is dead)."""
        try:
            self.conn.close()
        except Exception:  # noqa: BLE001 - closing a broken connection may raise
            pass


def _value(conn: psycopg.Connection[Any], query: LiteralString,
           params: Params | None = None) -> Any:
    """The first column of the one row ``query`` returns (a ``SELECT`` without ``FROM``)."""
    row = conn.execute(query, params).fetchone()
    if row is None:
        raise psycopg.ProgrammingError(f"no row from {query!r}")
    return row[0]


def _take_free_key(conn: psycopg.Connection[Any], boot_id: uuid.UUID
                   ) -> tuple[int, dict[str, int]]:
    """Take the advisory lock of the next free key of the (cycling) key sequence.

    A key whose boot row still exists (a live boot, or a dead one some run still
    refers to) is skipped. A key held by a connection that is no boot of ours
    means another application uses our lock keys: fail loudly, naming it.
    """
    for _ in range(1000):
        lock_key = _value(conn, "SELECT nextval('worker_boot_lock_key')")
        if _value(conn, "SELECT EXISTS (SELECT 1 FROM worker_boots WHERE lock_key = %s)",
                  [lock_key]):
            continue  # reused after a wrap-around: still some boot's key
        params = {"ns": LOCK_NAMESPACE, "key": lock_key}
        if _value(conn, "SELECT pg_try_advisory_lock(%(ns)s, %(key)s)", params):
            return lock_key, params
        holder = conn.execute(_HOLDER, params).fetchone()
        raise LockKeyTaken(
            f"advisory lock ({LOCK_NAMESPACE}, {lock_key}) for boot {boot_id} is held "
            f"by backend pid {holder[0] if holder else '?'}: another application or "
            "deployment uses this database's advisory lock keys"
        )
    raise LockKeyTaken("no free boot lock key in 1000 tries: prune dead boots (beat's repair)")


def _check_session_kept(dsn: str, conn: psycopg.Connection[Any], backend_pid: int,
                        params: dict[str, int]) -> None:
    """Refuse a lock connection whose session is not its own (a transaction pooler).

    Behind PgBouncer in transaction mode a session lock sits on a pooled server
    connection: it outlives the worker, or is released under a live one. Two
    signs, checked from a second connection holding a transaction open (which
    pins its own server connection): it must not share our backend, and our
    next statement must still run on the backend that took the lock.
    """
    with psycopg.connect(dsn, connect_timeout=10, application_name="poimen-boot-check") as check:
        other_pid = _value(check, "SELECT pg_backend_pid()")
        again = _value(conn, "SELECT pg_backend_pid()")
        held = check.execute(_HOLDER, params).fetchone()
        if other_pid == backend_pid or again != backend_pid or not held or held[0] != backend_pid:
            raise PooledLockConnection(
                "the boot's lock connection does not keep its own Postgres session (is it a "
                "transaction-mode pooler such as PgBouncer?). Liveness locks need a direct "
                "connection: set POIMEN_LOCK_DATABASE_URL to the database's direct URL."
            )


def check_lease_settings() -> LeaseSettings:
    """Refuse lease settings that break the ordering (``lease.LeaseOrderingError``)."""
    settings = lease_settings()
    check_ordering(settings)
    return settings


def check_lock_database(dsn: str) -> None:
    """Check, before a worker starts, that ``dsn`` can hold liveness locks.

    Takes a fresh key's lock on a connection of its own and runs the session
    check of ``Boot.register``; raises ``PooledLockConnection`` or
    ``LockKeyTaken`` with a message for the operator.
    """
    with psycopg.connect(dsn, autocommit=True, connect_timeout=10,
                         application_name="poimen-boot-check") as conn:
        key = _value(conn, "SELECT nextval('worker_boot_lock_key')")
        params = {"ns": LOCK_NAMESPACE, "key": key}
        if not _value(conn, "SELECT pg_try_advisory_lock(%(ns)s, %(key)s)", params):
            raise LockKeyTaken(f"advisory lock ({LOCK_NAMESPACE}, {key}) is held elsewhere: "
                               "another application uses this database's advisory lock keys")
        _check_session_kept(dsn, conn, _value(conn, "SELECT pg_backend_pid()"), params)


_current: Boot | None = None
_current_lock = threading.Lock()
# Boots of this process that lost their lock outside the watchdog (found stale
# by current_boot): the watchdog hands them to on_lost like the ones it finds.
_lost_elsewhere: list[Boot] = []

# Runs this process is executing, and every boot of this process that held each
# one (a run adopted by a new boot keeps its old holder too: both are ours).
_holding: dict[uuid.UUID, set[uuid.UUID]] = {}
# The boot whose lease covers each run this process executes: the claimer, then
# the boot that adopted it. The fence kills the process when one of them has
# not been confirmed within T_c.
_cover: dict[uuid.UUID, Boot] = {}
_known: dict[uuid.UUID, Boot] = {}
_holding_lock = threading.Lock()
_fence: KillFence | None = None

# Called from the watchdog thread with a boot that lost its lock.
on_lost: Callable[[Boot], None] | None = None


def boot_dsn() -> str:
    """The database a boot's lock connection uses, in libpq form.

    ``POIMEN_LOCK_DATABASE_URL`` when set (a direct URL when ``DATABASE_URL``
    goes through a pooler), else the app's database.
    """
    return libpq_url(current_app.config.get("POIMEN_LOCK_DATABASE_URL")
                     or current_app.config["SQLALCHEMY_DATABASE_URI"])


def current_boot(dsn: Callable[[], str]) -> Boot:
    """Return this process's boot, registering a new one after a fork or a lost lock.

    A boot whose lock is gone is dead to everyone else (its claims may be taken
    over), so this process must not keep acting as it: it starts a new boot,
    and claims under the old one are refused by Postgres. A boot whose lock
    was not confirmed lately (a silent path: the watchdog's probes go
    unanswered) is treated the same: nothing new starts under it.
    """
    global _current
    with _current_lock:
        if _current is None or not _current.usable:
            if _current is not None and _current.pid == os.getpid():
                log.warning("boot %s lost its lock (or could not confirm it within %gs); "
                            "starting a new boot", _current.boot_id,
                            _current.settings.client_seconds)
                if not _current.lost.is_set():
                    _lost_elsewhere.append(_current)
                _current.mark_lost()
            _current = Boot.register(dsn())  # the DSN is worked out only when needed
            with _holding_lock:
                _known[_current.boot_id] = _current
            _start_watchdog()
        return _current


def end_current_boot() -> None:
    """Close this process's boot (on shutdown, or when its claims cannot be trusted)."""
    global _current
    with _current_lock:
        if _current is not None and _current.pid == os.getpid():
            _current.close()
        _current = None


def hold(run_id: uuid.UUID, boot_id: uuid.UUID) -> None:
    """Record that this process executes ``run_id`` under ``boot_id``; arm the fence."""
    with _holding_lock:
        _holding.setdefault(run_id, set()).add(boot_id)
        boot = _known.get(boot_id)
        if boot is not None:
            _cover[run_id] = boot
        _refresh_fence()


def cover(run_id: uuid.UUID, boot: Boot) -> None:
    """Let ``boot``'s lease cover ``run_id`` from now on (it adopted the run)."""
    with _holding_lock:
        if run_id in _holding:
            _holding[run_id].add(boot.boot_id)
            _cover[run_id] = boot
            _refresh_fence()


def holders(run_id: uuid.UUID) -> list[uuid.UUID]:
    """Return the boots of this process that held ``run_id`` (the fence of its writes)."""
    with _holding_lock:
        return list(_holding.get(run_id, ()))


def hold_if_held(run_id: uuid.UUID, boot_id: uuid.UUID) -> None:
    """Add ``boot_id`` to ``run_id``'s holders if this process still executes it."""
    with _holding_lock:
        if run_id in _holding:
            _holding[run_id].add(boot_id)


def still_held(run_ids: Iterable[uuid.UUID]) -> bool:
    """Whether this process still executes any of ``run_ids``."""
    with _holding_lock:
        return any(run_id in _holding for run_id in run_ids)


def runs_held_by(boot_id: uuid.UUID) -> list[uuid.UUID]:
    with _holding_lock:
        return [run for run, boots in _holding.items() if boot_id in boots]


# The runs a thread of this process is handling (the batching worker: its claim, its
# execution, its finish): a second delivery of one meanwhile is a duplicate, decided here.
_claiming: set[uuid.UUID] = set()


def begin_claim(run_id: uuid.UUID) -> bool:
    """Start handling a delivery of ``run_id``; False if another thread of this process is
    handling one (claiming, executing or finishing it). ``end_claim`` when done."""
    with _holding_lock:
        if run_id in _claiming or run_id in _holding:
            return False
        _claiming.add(run_id)
        return True


def end_claim(run_id: uuid.UUID) -> None:
    with _holding_lock:
        _claiming.discard(run_id)


def boot_is_live(boot_id: uuid.UUID) -> bool:
    """Whether ``boot_id`` is this process's boot, its lock held and confirmed in time."""
    with _current_lock:
        boot = _current
    return boot is not None and boot.boot_id == boot_id and boot.pid == os.getpid() \
        and boot.usable


def let_go(run_ids: Iterable[uuid.UUID]) -> None:
    with _holding_lock:
        for run_id in run_ids:
            _holding.pop(run_id, None)
            _cover.pop(run_id, None)
        covering = {boot.boot_id for boot in _cover.values()}
        for boot_id in [b for b, boot in _known.items() if boot is not _current
                        and b not in covering]:
            del _known[boot_id]
        _refresh_fence()


def _fence_deadline() -> float | None:
    if not _cover:
        return None
    return min(boot.confirmed_at + boot.settings.client_seconds for boot in _cover.values())


def _refresh_fence() -> None:
    """Arm the fence at the earliest lease end among the runs held (call with _holding_lock).

    The kernel delivers the kill (``lease.KillFence``): a body that cannot be
    interrupted politely, or holds the GIL in C, stops all the same.
    """
    global _fence
    deadline = _fence_deadline()
    if deadline is None:
        if _fence is not None:
            _fence.disarm()
        return
    if _fence is None:
        _fence = KillFence()
    _fence.arm(deadline)


def _forget_boot_in_child() -> None:
    """In a process forked from this one (a workflow using multiprocessing), drop the
    lock connection's socket.

    Liveness is tied to the socket: if a forked grandchild kept its copy, the
    lock would outlive the worker process that owns it, and a run of a dead
    worker would look held by a live boot forever. Closing the connection
    would send a Terminate on the shared socket and end the parent's session,
    so the child points the descriptor at /dev/null instead and forgets the
    boot.
    """
    global _current, _watchdog_pid, _fence
    boot = _current
    _current = None
    _watchdog_pid = None
    # POSIX timers are not inherited by fork; neither are the runs we execute.
    _fence = None
    _holding.clear()
    _cover.clear()
    _known.clear()
    _lost_elsewhere.clear()
    if boot is None or boot.conn.closed:
        return
    try:
        devnull = os.open(os.devnull, os.O_RDWR)
        try:
            os.dup2(devnull, boot.conn.fileno())
        finally:
            os.close(devnull)
    except (OSError, psycopg.Error):
        pass
    _orphaned.append(boot)  # never finalised here: its socket is the parent's


_orphaned: list[Boot] = []
os.register_at_fork(after_in_child=_forget_boot_in_child)

_watchdog_pid: int | None = None


def _start_watchdog() -> None:
    """Start this process's watchdog thread once (per process: threads do not survive fork)."""
    global _watchdog_pid
    if _watchdog_pid == os.getpid():
        return
    _watchdog_pid = os.getpid()
    threading.Thread(target=_watch, name="poimen-boot-watchdog", daemon=True).start()


def _watch() -> None:
    interval = probe_interval()
    while True:
        time.sleep(interval)
        while _lost_elsewhere:
            _handle_lost(_lost_elsewhere.pop())
        boot = _current
        if boot is None or boot.pid != os.getpid() or boot.lost.is_set():
            continue
        if boot.probe():
            with _holding_lock:
                _refresh_fence()  # the lease of every run it covers moves on
            continue
        log.error("boot %s could not confirm its liveness lock within %.1fs (Postgres "
                  "restarted, its connection was cut, or the path to it went silent); it is "
                  "dead and claims nothing more", boot.boot_id, boot.settings.probe_timeout)
        boot.mark_lost()
        _handle_lost(boot)


def _handle_lost(boot: Boot) -> None:
    if on_lost is not None:
        try:
            on_lost(boot)
        except Exception:  # noqa: BLE001 - the watchdog must keep watching
            log.exception("handling the loss of boot %s failed", boot.boot_id)
