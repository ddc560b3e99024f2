"""A rolling deploy: a run pinned to a version only the new workers have."""

from __future__ import annotations

from tests.processes import start_worker, wait_until


def test_a_run_pinned_to_a_version_one_worker_lacks_runs_on_the_other_at_attempt_1(
        admit, test_env, pg, tmp_path, processes):
    import tests.workflows.rollout  # noqa: F401 - the web side knows rollout@2

    run_id = admit("rollout@2", {})
    old = start_worker({**test_env, "POIMEN_WORKFLOW_MODULES": "tests.workflows"}, tmp_path,
                       "old")
    processes.append(old)
    wait_until(lambda: "run.released" in [r[0] for r in pg.execute(
        "SELECT event_type FROM outbox WHERE run_id = %s", [run_id])], timeout=60,
        what="the old worker to give the run back")
    new = start_worker({**test_env,
                        "POIMEN_WORKFLOW_MODULES": "tests.workflows,tests.workflows.rollout"},
                       tmp_path, "new")
    processes.append(new)
    wait_until(lambda: pg.execute("SELECT status FROM runs WHERE id = %s",
                                  [run_id]).fetchone()[0] == "succeeded", timeout=90,
               what="the run to succeed on the new worker")
    attempt, result = pg.execute("SELECT attempt, result FROM runs WHERE id = %s",
                                 [run_id]).fetchone()
    assert attempt == 1  # the old worker's bounces did not count
    assert result["attempt"] == 1
