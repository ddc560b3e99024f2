"""A run's page says which worker boot holds it, and whether that boot is alive.

Its own module: the worker here is the only one consuming the session's queue
(test_console.py's worker is stopped when that module ends), so the run it
claims is the one it is killed holding.
"""

from __future__ import annotations

from selenium.webdriver.common.by import By

from tests.console.conftest import RUN_DEADLINE
from tests.processes import start_worker, wait_until


def test_the_page_shows_the_boot_holding_a_run_live_then_dead_after_kill_9(
        console, api, run_until, make_tenant, pg, test_env, tmp_path):
    creds = make_tenant()
    worker = start_worker(test_env, tmp_path, name="doomed-worker")
    run_id = None
    try:
        response = api("POST", "/v1/runs", creds,
                       json={"workflow_ref": "sleep", "input": {"seconds": 600}})
        run_id = response.json()["id"]
        run_until(creds, run_id, "running", timeout=RUN_DEADLINE)
        boot = str(pg.execute("SELECT claimed_by FROM runs WHERE id = %s", [run_id]).fetchone()[0])

        console.sign_in(creds.token)
        console.open(f"/console/runs/{run_id}")
        holder = console.driver.find_element(By.ID, "holder").text
        assert boot in holder and "live" in holder.split() and "dead" not in holder.split()

        worker.kill()  # SIGKILL to the whole group: its lock connection dies with it
        # The page refreshes itself (the run is still 'running': nobody took it over).
        wait_until(lambda: "dead" in console.driver.find_element(By.ID, "holder").text.split(),
                   timeout=60, interval=0.5, what="the page to show the boot dead")
        holder = console.driver.find_element(By.ID, "holder").text
        assert boot in holder and "live" not in holder.split()
        assert console.driver.find_element(By.ID, "run-status").text == "running"
    finally:
        worker.kill()
        if run_id:
            api("POST", f"/v1/runs/{run_id}/cancel", creds)
