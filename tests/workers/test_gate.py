"""A worker that cannot reach Postgres takes no runs (``workers/gate.py``), deterministically.

A real worker reaches the test database only through a proxy that can stop
forwarding with its sockets open (``tests/proxy.py``). While it is stalled the
worker must leave run messages in the broker for workers that can reach the
database; when it answers again, the worker consumes and runs them.
"""

from __future__ import annotations

import time

import pytest

from tests.conftest import libpq_url
from tests.processes import free_port, start_worker, wait_until
from tests.proxy import StallingProxy

pytestmark = pytest.mark.slow


def test_a_worker_cut_off_from_postgres_leaves_runs_in_the_queue_until_it_answers(
        admit, database_url, test_env, redis_client, queue_name, pg, sent, processes,
        tmp_path):
    redis_client.delete(queue_name)  # earlier tests' messages would be taken first
    proxy = StallingProxy.to_postgres(libpq_url(database_url))
    try:
        worker = start_worker({**test_env, "DATABASE_URL": proxy.url(libpq_url(database_url)),
                               "POIMEN_BOOT_PROBE_INTERVAL": "0.5",
                               "POIMEN_LEASE_CLIENT_SECONDS": "3",
                               "METRICS_PORT": str(free_port())}, tmp_path)
        processes.append(worker)
        wait_until(lambda: "ready." in worker.log(), timeout=60, what="the worker")
        proxy.stall()
        wait_until(lambda: "taking no runs" in worker.log(), timeout=10,
                   what="the worker to stop consuming")
        run_id = admit("echo", {"n": 1})
        sent()
        time.sleep(4)  # several gate checks: it stays closed
        assert redis_client.llen(queue_name) == 1, "a cut-off worker took the run's message"
        assert pg.execute("SELECT status FROM runs WHERE id = %s", [run_id]).fetchone()[0] \
            == "queued"

        proxy.resume()
        wait_until(lambda: pg.execute("SELECT status FROM runs WHERE id = %s",
                                      [run_id]).fetchone()[0] == "succeeded",
                   timeout=60, interval=0.2, what="the run to succeed once Postgres answers")
        assert "Postgres answers again: taking runs" in worker.log()
    finally:
        proxy.close()
