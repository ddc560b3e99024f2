"""Worker boots: one per worker process lifetime, alive exactly while its lock is held.

A boot registers a row in ``worker_boots`` and takes a session-level advisory
lock ``(LOCK_NAMESPACE, lock_key)`` on a dedicated connection that it keeps for
its whole life. Postgres releases that lock exactly when the process or its
connection dies, so "is boot B alive?" is a question about the lock table, not
about clocks: no heartbeat age, no timeout guess. What "live" means in SQL is
defined once, in ``app/liveness.py``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg

from app.liveness import LOCK_NAMESPACE

log = logging.getLogger(__name__)

@dataclass
class Boot:
    """A registered, live boot and the connection that holds its lock."""

    boot_id: uuid.UUID
    lock_key: int
    pid: int
    conn: psycopg.Connection = field(repr=False)

    @classmethod
    def register(cls, dsn: str) -> Boot:
        """Register a new boot and take its lock on a connection of its own."""
        conn = psycopg.connect(dsn, autocommit=True, application_name="poimen-boot")
        boot_id = uuid.uuid4()
        lock_key = conn.execute(
            "INSERT INTO worker_boots (boot_id, hostname, pid) VALUES (%s, %s, %s) "
            "RETURNING lock_key",
            [boot_id, socket.gethostname()[:255], os.getpid()],
        ).fetchone()[0]
        conn.execute("SELECT pg_advisory_lock(%s, %s)", [LOCK_NAMESPACE, lock_key])
        log.info("boot %s registered (pid %s, lock key %s)", boot_id, os.getpid(), lock_key)
        return cls(boot_id=boot_id, lock_key=lock_key, pid=os.getpid(), conn=conn)

    @property
    def usable(self) -> bool:
        """Whether this process can still act as this boot (same process, lock connection up)."""
        return self.pid == os.getpid() and not self.conn.closed and not self.conn.broken

    def close(self) -> None:
        """End the boot: closing the connection releases the lock (the boot is dead)."""
        try:
            self.conn.close()
        except Exception:  # noqa: BLE001 - closing a broken connection may raise
            pass


_current: Boot | None = None
_current_lock = threading.Lock()


def current_boot(dsn: Callable[[], str]) -> Boot:
    """Return this process's boot, registering a new one after a fork or a lost connection.

    A boot whose lock connection broke is dead to everyone else (its lock is
    gone and its claims may be taken over), so this process must not keep
    acting as it: it starts a new boot, and its fenced writes as the old one
    are refused.
    """
    global _current
    with _current_lock:
        if _current is None or not _current.usable:
            if _current is not None and _current.pid == os.getpid():
                log.warning("boot %s lost its lock connection; starting a new boot",
                            _current.boot_id)
                _current.close()
            _current = Boot.register(dsn())  # the DSN is worked out only when needed
        return _current


def end_current_boot() -> None:
    """Close this process's boot (on shutdown)."""
    global _current
    with _current_lock:
        if _current is not None and _current.pid == os.getpid():
            _current.close()
        _current = None
