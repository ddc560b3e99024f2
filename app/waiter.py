"""Waiting on the server: ``GET /v1/runs/<id>?wait=N`` answers once the run has ended.

A waiting request holds a gunicorn thread but no database connection: it registers its
run with this process's ``RunWaiter`` and blocks on an event. One thread per process
polls for every waited run at once, with one indexed statement (``ENDED_AMONG``: the
primary key) every ``POIMEN_WAIT_POLL_SECONDS`` (0.05), and only while someone waits; it
sets the events of the runs that ended. So an answer follows a run's end by at most
the poll interval plus a read, however many requests wait, at one statement per interval
per process.

Why not LISTEN/NOTIFY: a notification would have to be sent by every statement that ends
a run (and ``NOTIFY`` serialises the commits that send one, on the hot path of every
finish), and a listening connection per process is a connection held for good. Polling
the few waited ids costs nothing when nobody waits.

Waiting requests are bounded per process (``POIMEN_WAIT_MAX``; the Procfile's gunicorn
threads, ``WEB_THREADS``, leave room for them): a request beyond the bound answers at
once with the run as it is and ``Poimen-Wait: full``, so waits can never take every
thread from admissions. The client then polls.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

from sqlalchemy import text
from sqlalchemy.engine import Engine

from .models import TERMINAL_STATUSES

log = logging.getLogger(__name__)

# The waited runs that have ended: in a status they never leave (TERMINAL_STATUSES).
ENDED_AMONG = text(
    "SELECT id FROM runs WHERE id = ANY(CAST(:ids AS uuid[])) AND status IN ("
    + ", ".join(f"'{status.value}'" for status in sorted(TERMINAL_STATUSES)) + ")")


class RunWaiter:
    """This process's waiters: ``wait(run_id, seconds)`` blocks until the run ended (True)
    or the time is up (False); None at once when ``max_waiters`` already wait."""

    def __init__(self, engine: Callable[[], Engine], *, interval: float, max_waiters: int):
        self._engine = engine
        self.interval = interval
        self.max_waiters = max_waiters
        self._lock = threading.Lock()
        self._waiting: dict[uuid.UUID, list[threading.Event]] = {}
        self._count = 0
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def waiting(self) -> int:
        return self._count

    def wait(self, run_id: uuid.UUID, seconds: float) -> bool | None:
        """Block until ``run_id`` ended (True) or ``seconds`` passed (False); None at once
        when this process already has ``max_waiters`` waiting (the caller answers as is)."""
        event = threading.Event()
        with self._lock:
            if self._count >= self.max_waiters:
                return None
            self._count += 1
            self._waiting.setdefault(run_id, []).append(event)
            self._start()
        self._wake.set()
        try:
            return event.wait(seconds)
        finally:
            with self._lock:
                self._count -= 1
                events = self._waiting.get(run_id, [])
                if event in events:
                    events.remove(event)
                if not events:
                    self._waiting.pop(run_id, None)

    def _start(self) -> None:
        # Under the lock. Started in the process that waits (after gunicorn's fork).
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="poimen-run-waiter",
                                            daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                ids = list(self._waiting)
            if not ids:
                self._wake.wait()  # nobody waits: no statement at all
                self._wake.clear()
                continue
            started = time.monotonic()
            try:
                with self._engine().connect() as conn:
                    ended = {row.id for row in conn.execute(ENDED_AMONG, {"ids": ids})}
            except Exception:  # noqa: BLE001 - the database away: the waits time out or retry
                log.warning("run waiter: could not read the waited runs; trying again",
                            exc_info=True)
                ended = set()
            with self._lock:
                for run_id in ended:
                    for event in self._waiting.get(run_id, ()):
                        event.set()
            time.sleep(max(0.0, self.interval - (time.monotonic() - started)))


_WAITERS: dict[Engine, RunWaiter] = {}
_WAITERS_LOCK = threading.Lock()


def waiter(engine: Engine, *, interval: float, max_waiters: int) -> RunWaiter:
    """This process's ``RunWaiter`` of ``engine``'s database (made on first use, in the
    process that serves: after gunicorn's fork)."""
    with _WAITERS_LOCK:
        found = _WAITERS.get(engine)
        if found is None:
            found = _WAITERS[engine] = RunWaiter(lambda: engine, interval=interval,
                                                 max_waiters=max_waiters)
        return found


def waiting() -> int:
    """How many requests of this process wait on a run now."""
    with _WAITERS_LOCK:
        return sum(w.waiting for w in _WAITERS.values())
