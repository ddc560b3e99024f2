"""A worker that cannot reach Postgres takes no runs: it stops consuming until it can.

Without this, a worker cut off from the database (a silent partition, a hung
proxy) still pulls run messages from the broker, which it can reach: each
delivery fails to register a boot, and Redis hands a waiting worker messages
in the order its consumers blocked, so an idle cut-off worker can be served
every re-send while a healthy one waits (seen in tests/chaos/test_partition.py
before this step existed: four re-sends in a row went to the cut-off worker).

The worker's main process checks the path it would use for liveness locks
every ``POIMEN_BOOT_PROBE_INTERVAL`` seconds, with the lease's probe deadline
(``lease.probe_lock``), on a thread of its own; the consumer's timer (the
event loop's thread, where Celery allows it) cancels the task queues when the
check fails and adds them back when it succeeds, and logs each change only once
it is made. Messages already reserved stay with the worker (Celery gives them
back at shutdown); the pool processes' own boots and the kernel fence
(``workers/boots.py``) still decide who may execute.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import psycopg
from celery import bootsteps

from lease import lock_connect_kwargs, probe_lock
from poimenconfig import LeaseSettings, lease_settings

log = logging.getLogger(__name__)


class DatabaseGate(bootsteps.StartStopStep):  # type: ignore[misc]  # celery: untyped
    """Consume task queues only while this worker reaches Postgres."""

    requires = {"celery.worker.consumer.tasks:Tasks"}

    # parent, c: Celery's worker consumer (untyped).
    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.reachable = True
        self.closed: list[str] = []
        self.waited = 0.0
        self._stop = threading.Event()
        self._timer: Any = None  # kombu's timer entry

    def start(self, c: Any) -> None:
        from .boots import boot_dsn

        with c.app.flask_app.app_context():
            dsn = boot_dsn()
        settings = lease_settings()
        self._stop.clear()
        threading.Thread(target=self._check, args=(dsn, settings), name="poimen-db-gate",
                         daemon=True).start()
        self._timer = c.timer.call_repeatedly(0.5, self._apply, (c,))

    def stop(self, c: Any) -> None:
        self._stop.set()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    shutdown = stop

    def _check(self, dsn: str, settings: LeaseSettings) -> None:
        conn: psycopg.Connection | None = None
        while not self._stop.wait(settings.probe_interval):
            started = time.monotonic()
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(dsn, application_name="poimen-worker-gate",
                                           **lock_connect_kwargs(settings))
                ok = probe_lock(conn, "SELECT true", settings.probe_timeout) is True
            except psycopg.Error:
                ok = False
            if not ok and conn is not None:
                conn.close()
                conn = None
            if not ok and self.reachable:
                self.waited = time.monotonic() - started
            self.reachable = ok
        if conn is not None:
            conn.close()

    def _apply(self, c: Any) -> None:
        consumer = c.task_consumer
        if consumer is None:
            return
        # The lines are logged here, after the queues change, so that a reader of the log
        # (an operator, tests/workers/test_gate.py) never sees a state the consumer is not in.
        if not self.reachable and not self.closed:
            self.closed = [queue.name for queue in consumer.queues]
            for name in self.closed:
                c.cancel_task_queue(name)
            log.error("Postgres did not answer within %.1fs: taking no runs until it does",
                      self.waited)
        elif self.reachable and self.closed:
            for name in self.closed:
                c.add_task_queue(name)
            self.closed = []
            log.warning("Postgres answers again: taking runs")
