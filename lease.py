"""The liveness lease: both bounds of a lock session, and the order between them.

A worker boot (``workers/boots.py``) and the active outbox relay
(``bridge/outbox.py``) are alive exactly while Postgres lets their session hold
an advisory lock. A lock alone is not a lease: a client cut off by a silent
network partition (no RST, no FIN) or a hung proxy keeps its lock on the server
for as long as the server's TCP stack takes to notice (hours with stock
settings), and the client, whose queries hang, never learns it has lost it. So
the lock is made a lease with a bound on each side, both set here by Poimen on
its own sessions, never left to the DBA or the OS:

* **T_s, the server's bound** (``POIMEN_LEASE_SERVER_SECONDS``, 20):
  ``idle_session_timeout`` on the lock session (PostgreSQL 14+). Every probe is
  a query, so every probe renews it; a session that sends nothing for T_s is
  ended by the server, and its locks go with it. It does not depend on TCP, so
  it also ends a session behind a hung proxy, whose socket stays open. The
  session's TCP settings (``tcp_keepalives_*``, ``tcp_user_timeout``) are set
  so that TCP never ends it *sooner* than T_s (a DBA's aggressive server
  defaults would otherwise let go early); on PostgreSQL 12-13, which lack
  ``idle_session_timeout``, they are the bound (TCP connections only).
* **T_c, the client's bound** (``POIMEN_LEASE_CLIENT_SECONDS``, 10): a process
  that has not confirmed its lock by a probe *started* within T_c stops the
  user code it runs under it. Probes have a deadline (:func:`probe_lock`), and
  the stop is a kernel timer (:class:`KillFence`: a POSIX timer that delivers
  SIGKILL), so it needs neither the database nor the interpreter: a body stuck
  in C holding the GIL is stopped all the same.

The ordering, checked when a process starts (:func:`check_ordering`)::

    T_c + KILL_SECONDS + MARGIN_SECONDS  <=  T_s

The server's idle timer starts after the probe that renews it, which is after
that probe started on the client, so the server lets go no sooner than T_s
after the client's last confirmation; the cut-off process was killed at T_c
after it. ``POIMEN_TAKEOVER_DELAY`` is not part of it: it only gives a process
whose lock was cut the time to adopt its runs before a rescuer is sent.

A lock can also go *early* (a Postgres restart, a failover,
``pg_terminate_backend``), at any moment, with the process still running its
bodies. The server's side therefore does not treat a boot as dead when its lock
goes but :func:`dead_after` seconds (T_c + kill + margin, the same sum) after a
statement first saw the lock free (``app/liveness.py``): the lock went no
sooner than the process's last confirmation, so by then the process has been
killed, whatever the moment of the loss. Nobody can start the run while the
old body runs. docs/internals/execution.md has the numbers.

This module is shared by ``workers`` and ``bridge`` (which imports nothing from
``app`` but its settings, ``poimenconfig``, nor from ``workers``), like ``logconfig``.
It reads no setting itself: ``poimenconfig.lease_settings`` reads the numbers
(``LeaseSettings``, re-exported here) and the processes pass them in.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import threading
import time

import psycopg
from psycopg import pq

from poimenconfig import LeaseSettings

log = logging.getLogger(__name__)

# SIGKILL's delivery and the process's exit, and (a worker's pool process) its
# guardian's SIGKILL of the body's process group (workers/proctree.py): a bound with
# room to spare (measured in tests/test_lease.py and tests/chaos/test_process_tree.py:
# milliseconds).
KILL_SECONDS = 1.0
# Slack for the timers on both hosts and a probe's flight time.
MARGIN_SECONDS = 2.0


def dead_after(settings: LeaseSettings) -> float:
    """Seconds after its lock was first seen free that a boot of ``settings`` is gone:
    T_c + kill + margin, the longest its process may run a body without its lock.
    Written on the boot's row when it registers (``worker_boots.dead_after_seconds``)."""
    return settings.client_seconds + KILL_SECONDS + MARGIN_SECONDS


class LeaseOrderingError(ValueError):
    """The lease settings would let two processes run one run's body at once."""


def problems(settings: LeaseSettings) -> list[str]:
    """Say what, if anything, breaks the ordering of ``settings`` (empty: they are safe)."""
    found = []
    lhs = dead_after(settings)
    # T_s alone: the takeover delay is a courtesy to a process adopting its runs, never
    # part of the order (a re-drive or a restored message comes without it).
    if lhs > settings.server_seconds:
        found.append(
            f"POIMEN_LEASE_CLIENT_SECONDS ({settings.client_seconds:g}) + kill "
            f"({KILL_SECONDS:g}) + margin ({MARGIN_SECONDS:g}) = {lhs:g} exceeds "
            f"POIMEN_LEASE_SERVER_SECONDS ({settings.server_seconds:g}): a cut-off worker "
            "could still run a body after the server let go of its lock "
            "(POIMEN_TAKEOVER_DELAY does not count toward this order)")
    if settings.probe_interval * 2 + settings.probe_timeout > settings.client_seconds:
        found.append(
            f"POIMEN_BOOT_PROBE_INTERVAL ({settings.probe_interval:g}) leaves fewer than two "
            f"probes (deadline {settings.probe_timeout:g}) per POIMEN_LEASE_CLIENT_SECONDS "
            f"({settings.client_seconds:g}): one slow probe would stop healthy runs")
    if settings.probe_interval + settings.probe_timeout + MARGIN_SECONDS > settings.server_seconds:
        found.append(
            f"POIMEN_BOOT_PROBE_INTERVAL ({settings.probe_interval:g}) is too close to "
            f"POIMEN_LEASE_SERVER_SECONDS ({settings.server_seconds:g}): the server would end "
            "healthy lock sessions between probes")
    if settings.client_seconds <= 0 or settings.server_seconds <= 0 or settings.takeover_delay < 0:
        found.append("lease bounds must be positive (POIMEN_LEASE_CLIENT_SECONDS, "
                     "POIMEN_LEASE_SERVER_SECONDS) and POIMEN_TAKEOVER_DELAY not negative")
    return found


def check_ordering(settings: LeaseSettings) -> None:
    """Raise ``LeaseOrderingError`` naming the settings if the ordering is broken."""
    found = problems(settings)
    if found:
        raise LeaseOrderingError("; ".join(found))


# -- the server's bound -----------------------------------------------------------------------

def server_bound_statements(settings: LeaseSettings, *, idle_session_timeout: bool
                            ) -> list[str]:
    """The ``SET`` statements that give a lock session the server's bound T_s.

    TCP must not end the session sooner than T_s (keepalives start only after T_s
    of silence, and unacknowledged data may wait T_s), whatever the server's
    defaults; ``idle_session_timeout`` ends it at T_s where the server has it.
    """
    t_s = max(1, int(settings.server_seconds))
    interval = max(1, t_s // 4)
    statements = [
        f"SET tcp_keepalives_idle = {t_s}",
        f"SET tcp_keepalives_interval = {interval}",
        "SET tcp_keepalives_count = 3",
        f"SET tcp_user_timeout = {t_s * 1000}",
        # A probe is one short statement: never let a default cut it, never make it wait.
        "SET statement_timeout = 0",
        "SET idle_in_transaction_session_timeout = 0",
    ]
    if idle_session_timeout:
        statements.append(f"SET idle_session_timeout = {int(settings.server_seconds * 1000)}")
    return statements


def bound_lock_session(conn: psycopg.Connection, settings: LeaseSettings) -> str:
    """Set T_s on ``conn``'s session (autocommit); return how it is enforced.

    ``idle_session_timeout`` on PostgreSQL 14+; before that, only TCP keepalives
    and ``tcp_user_timeout`` on a TCP connection, which a hung proxy defeats (the
    returned text says so, and the process logs it).
    """
    modern = conn.info.server_version >= 140000
    for statement in server_bound_statements(settings, idle_session_timeout=modern):
        conn.execute(statement)
    if modern:
        return f"idle_session_timeout {settings.server_seconds:g}s"
    return (f"TCP keepalives only (PostgreSQL {conn.info.server_version // 10000} has no "
            "idle_session_timeout): a hung proxy can hold the lock")


def lock_connect_kwargs(settings: LeaseSettings) -> dict:
    """Client-side socket settings of a lock connection: a dead path fails, not hangs."""
    return {
        "autocommit": True,
        "connect_timeout": max(2, int(settings.client_seconds / 2)),
        "keepalives": 1, "keepalives_idle": 2, "keepalives_interval": 1,
        "keepalives_count": 3,
        "tcp_user_timeout": int(settings.probe_timeout * 1000),
    }


# -- the client's bound: a probe with a deadline ------------------------------------------------

def probe_lock(conn: psycopg.Connection, sql: str, timeout: float) -> bool | None:
    """Run ``sql`` (a query of one boolean, no parameters) with a deadline.

    Return its value, or None when no answer came within ``timeout`` seconds or
    the connection failed: the lock is then *not confirmed*, which is all a
    client may conclude about a path that went silent, and the connection is
    closed (its query is still in flight). A query through
    psycopg's own ``execute`` would wait for TCP to give up (about 15 minutes
    into a black hole, forever behind a hung proxy).
    """
    deadline = time.monotonic() + timeout
    if not conn.lock.acquire(timeout=timeout):
        return None  # someone else is using the lock connection and hangs
    answered = False
    try:
        pgconn = conn.pgconn
        if pgconn.status != pq.ConnStatus.OK:
            return None
        pgconn.nonblocking = 1
        pgconn.send_query(sql.encode())
        fileno = pgconn.socket
        while pgconn.flush() != 0:
            if not _wait(fileno, deadline, write=True):
                return None
        while True:
            pgconn.consume_input()
            if not pgconn.is_busy():
                break
            if not _wait(fileno, deadline):
                return None
        value = None
        while (result := pgconn.get_result()) is not None:
            if result.status == pq.ExecStatus.TUPLES_OK and result.ntuples == 1:
                value = result.get_value(0, 0) == b"t"
        answered = True
        return value
    except (psycopg.Error, OSError):
        return None
    finally:
        conn.lock.release()
        if not answered:
            # A query is still in flight on a path that went silent: the session's
            # state is unknown, so the connection is of no further use.
            try:
                conn.close()
            except Exception:  # noqa: BLE001, S110 - closing a dead connection may raise
                pass


def _wait(fileno: int, deadline: float, write: bool = False) -> bool:
    left = deadline - time.monotonic()
    if left <= 0:
        return False
    ready = select.select([], [fileno], [], left) if write else \
        select.select([fileno], [], [], left)
    return bool(ready[1] if write else ready[0])


# -- the client's bound: a kill the kernel delivers ---------------------------------------------

class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class _Sigevent(ctypes.Structure):
    # struct sigevent on Linux (64 bytes on every architecture glibc supports).
    _fields_ = [("sigev_value", ctypes.c_void_p), ("sigev_signo", ctypes.c_int),
                ("sigev_notify", ctypes.c_int), ("_pad", ctypes.c_int * 12)]


_CLOCK_MONOTONIC = 1  # what time.monotonic() reads on Linux
_SIGEV_SIGNAL = 0
_TIMER_ABSTIME = 1


class KillFence:
    """SIGKILL this process at a deadline on the monotonic clock, unless moved.

    A POSIX timer (``timer_create``) whose expiry the kernel turns into SIGKILL:
    no handler to override, no GIL or thread to wait for, no database to reach.
    Where POSIX timers are unavailable, a daemon thread calls ``os._exit``
    instead (it needs the GIL; said once in the log).
    """

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._timer = ctypes.c_void_p()
        self._libc = None
        self._deadline: float | None = None
        self._cond = threading.Condition()
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            event = _Sigevent(None, signal.SIGKILL, _SIGEV_SIGNAL)
            if libc.timer_create(_CLOCK_MONOTONIC, ctypes.byref(event),
                                 ctypes.byref(self._timer)) != 0:
                raise OSError(ctypes.get_errno(), "timer_create")
            self._libc = libc
        except (OSError, AttributeError) as err:
            log.warning("no POSIX timer (%s): the lease's kill is a thread's os._exit", err)
            threading.Thread(target=self._thread, name="poimen-fence", daemon=True).start()

    @property
    def deadline(self) -> float | None:
        return self._deadline

    def arm(self, deadline: float) -> None:
        """Kill this process at ``deadline`` (``time.monotonic()`` seconds)."""
        self._set(deadline)

    def disarm(self) -> None:
        self._set(None)

    def _set(self, deadline: float | None) -> None:
        if os.getpid() != self._pid:
            return  # timers do not survive fork: the child makes its own
        with self._cond:
            if deadline == self._deadline:
                # Armed at this very deadline already (the runs of one boot share it): a
                # batch worker's threads arm it twice a run, and the timer is not moved.
                return
            self._deadline = deadline
            if self._libc is not None:
                when = _Itimerspec()
                if deadline is not None:
                    # 0 would disarm: a deadline already past fires at once.
                    at = max(deadline, 1e-6)
                    when.it_value = _Timespec(int(at), int((at % 1) * 1e9) or 1)
                if self._libc.timer_settime(self._timer, _TIMER_ABSTIME, ctypes.byref(when),
                                            None) != 0:
                    raise OSError(ctypes.get_errno(), "timer_settime")
            self._cond.notify_all()

    def _thread(self) -> None:
        with self._cond:
            while True:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left <= 0:
                    os._exit(137)
                self._cond.wait(left)
