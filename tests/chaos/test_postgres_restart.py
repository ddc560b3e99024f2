"""Restart Postgres under a steady stream of runs.

A worker (two prefork pool processes, or a batch worker's four threads) executes 3-second runs admitted one every second; Postgres
(a private server: ``tests/chaos/conftest.py``) is restarted in the middle.
Every run must succeed, none twice: each run records 'start' and 'finish' in a
side-effect table, so two executions of one run would show.
"""

from __future__ import annotations

import time

import pytest

from app.state.executor import on_session
from tests.processes import start_beat, start_worker, wait_until

RUNS = 16
RUN_SECONDS = 3


def _admit(chaos_app, tenant_id: int, n: int, mode: str):
    """Admit one run, waiting out the restart (a caller retrying with its dispatch key)."""
    from app.admission import admit_run
    from app.extensions import db

    deadline = time.monotonic() + 60
    while True:
        try:
            with chaos_app.app_context():
                admission = admit_run(on_session(db.session), tenant_id=tenant_id,
                                      workflow_ref="blind",
                                      input={"seconds": RUN_SECONDS},
                                      dispatch_key=f"stream-{n}-{mode}")
                db.session.commit()
                return admission.run.id
        except Exception:  # noqa: BLE001 - the database is restarting
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.mark.parametrize("mode", ["prefork", "batch"])
def test_postgres_restart_under_a_stream_of_runs_loses_and_repeats_nothing(
        mode, private_postgres, chaos_env, chaos_app, chaos_tenant, chaos_redis, processes,
        tmp_path):
    with private_postgres.connect() as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS side_effects (id bigserial PRIMARY KEY, "
                     "run_id uuid NOT NULL, kind text NOT NULL, pid int NOT NULL, "
                     "at timestamptz NOT NULL DEFAULT now())")
        conn.execute("TRUNCATE side_effects")
        # Each mode's stream on its own: the runs of the one before are gone.
        conn.execute("TRUNCATE runs, outbox CASCADE")
    env = {**chaos_env, "POIMEN_BOOT_PROBE_INTERVAL": "0.5", "POIMEN_REPAIR_INTERVAL": "5",
           "POIMEN_REPAIR_MIN_AGE": "10", "POIMEN_WORKER_MODE": mode}
    # A batch worker's threads share its claim and finish batches, which the restart cuts.
    processes.append(start_worker(env, tmp_path, "worker", concurrency=2 if mode == "prefork"
                                  else 4))
    processes.append(start_beat(env, tmp_path))

    run_ids = []
    restarted_at = None
    for n in range(RUNS):
        run_ids.append(_admit(chaos_app, chaos_tenant.id, n, mode))
        if n == RUNS // 3:
            # Mid-stream, with runs executing: every connection and every lock goes.
            private_postgres.restart(down_for=2)
            restarted_at = n
        time.sleep(1)
    assert restarted_at is not None

    def settled():
        with private_postgres.connect() as conn:
            return conn.execute("SELECT count(*) FROM runs WHERE status IN "
                                "('queued', 'running')").fetchone()[0] == 0

    wait_until(settled, timeout=240, interval=0.5, what="every run to finish")
    with private_postgres.connect() as conn:
        statuses = dict(conn.execute("SELECT status, count(*) FROM runs GROUP BY status"))
        per_run = conn.execute(
            "SELECT r.id, count(*) FILTER (WHERE e.kind = 'start'), "
            "count(*) FILTER (WHERE e.kind = 'finish') FROM runs r "
            "LEFT JOIN side_effects e ON e.run_id = r.id GROUP BY r.id").fetchall()
        events = dict(conn.execute("SELECT event_type, count(*) FROM outbox GROUP BY 1"))
    print(f"statuses {statuses}; events {events}")
    assert statuses == {"succeeded": RUNS}
    assert [r for r in per_run if r[2] != 1] == []  # every run finished exactly once
    assert [r for r in per_run if r[1] != 1] == []  # ... and was started exactly once
    assert events.get("run.succeeded") == RUNS
