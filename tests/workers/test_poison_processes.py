"""A poisoned run through real processes: a Celery worker whose pool process the run's body
SIGKILLs every time, beat's repair re-sending it, real Postgres and Redis.

The rule itself is tested statement by statement in ``test_poison.py``.
"""

from __future__ import annotations

import requests

from tests.processes import free_port, metric, start_beat, start_worker, wait_until

FAST = {"POIMEN_BOOT_PROBE_INTERVAL": "0.3", "POIMEN_REPAIR_INTERVAL": "1",
        "POIMEN_REPAIR_MIN_AGE": "30"}


def test_a_run_that_kills_its_pool_process_every_time_ends_poisoned_once_and_is_counted(
        admit, side_effects, tenant, test_env, pg, tmp_path, processes):
    """``poison`` (max_takeovers 2) SIGKILLs its pool process: the first execution and two
    takeovers each kill one, the third takeover ends the run poisoned instead of running
    it a fourth time. One terminal event, and the worker's counter says it."""
    import tests.workflows  # noqa: F401 - registers ``poison``

    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    env = {**test_env, **FAST}
    run_id = admit("poison", {})
    # The worker's metrics port is its own: beat would serve its gauges on the same one.
    processes.append(start_worker({**env, "METRICS_PORT": str(port)}, tmp_path, "poisoned"))
    processes.append(start_beat(env, tmp_path))

    def status():
        return pg.execute("SELECT status FROM runs WHERE id = %s", [run_id]).fetchone()[0]

    wait_until(lambda: status() == "poisoned", timeout=180, what="the run to end poisoned")
    attempt, takeovers, error = pg.execute(
        "SELECT attempt, takeovers, error FROM runs WHERE id = %s", [run_id]).fetchone()
    assert (attempt, takeovers) == (3, 2)  # the first execution and two takeovers
    assert side_effects(run_id, "start") == 3  # never executed a fourth time
    assert error["code"] == "poisoned"
    assert error["message"].startswith("the run killed 3 workers (max_takeovers 2)")

    events = [r[0] for r in pg.execute(
        "SELECT event_type FROM outbox WHERE run_id = %s ORDER BY id", [run_id])]
    assert events == ["run.admitted", "run.started", "run.resumed", "run.resumed",
                      "run.poisoned"]
    wait_until(lambda: requests.get(url, timeout=5).ok, timeout=30, what="worker metrics")
    wait_until(lambda: metric(url, "poimen_runs_poisoned_total", tenant=tenant.name,
                              workflow="poison") == 1.0,
               timeout=30, what="the poisoned run counted")
    # Nothing more happens to it: beat keeps repairing, no delivery writes again.
    import time

    time.sleep(3)
    assert [r[0] for r in pg.execute("SELECT event_type FROM outbox WHERE run_id = %s "
                                     "ORDER BY id", [run_id])] == events
    assert side_effects(run_id, "start") == 3
