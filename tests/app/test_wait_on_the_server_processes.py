"""100 requests waiting on one web dyno (gunicorn as the Procfile starts it), while
admissions go on: every wait is served (none ``full``), none answers before its run
ends, each answers soon after, and admissions are answered meanwhile. Throughput
beside the waiters is measured by ``bench/wait.py``, not here."""

from __future__ import annotations

import threading
import time

import pytest
import requests

from tests.processes import start_web

pytestmark = pytest.mark.processes

WAITERS = 100


def test_100_waiting_requests_are_served_beside_admissions(admit, tenant, test_env, pg,
                                                           tmp_path, processes):
    web, url = start_web(test_env, tmp_path, workers=2, threads=128)  # the Procfile's shape
    processes.append(web)
    runs = [admit("effect", {}) for _ in range(WAITERS)]
    answers: dict = {}

    def wait(run_id) -> None:
        answer = requests.get(f"{url}/v1/runs/{run_id}?wait=30", headers=tenant.headers,
                              timeout=45)
        answers[run_id] = (time.monotonic(), answer.json()["status"],
                           answer.headers.get("Poimen-Wait"))

    threads = [threading.Thread(target=wait, args=(r,), daemon=True) for r in runs]
    for thread in threads:
        thread.start()
    time.sleep(2)
    assert answers == {}, "a wait answered before its run ended"

    # Admissions are answered while every waiter holds its thread.
    started = time.monotonic()
    for n in range(50):
        answer = requests.post(f"{url}/v1/runs", json={"workflow_ref": "noop",
                                                       "dispatch_key": f"beside-{n}"},
                               headers=tenant.headers, timeout=10)
        assert answer.status_code == 201
    assert time.monotonic() - started < 20
    assert answers == {}

    ended = {}
    for run_id in runs:
        pg.execute("UPDATE runs SET status = 'succeeded', finished_at = now() WHERE id = %s",
                   [run_id])
        ended[run_id] = time.monotonic()
    for thread in threads:
        thread.join(30)
    assert len(answers) == WAITERS
    assert {status for _, status, _ in answers.values()} == {"succeeded"}
    assert {full for _, _, full in answers.values()} == {None}  # every wait was served
    lags = sorted(answers[r][0] - ended[r] for r in runs)
    assert lags[len(lags) // 2] < 1.0, lags  # the median; the poll is every 50 ms
