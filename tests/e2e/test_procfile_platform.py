"""The platform as deployed: processes started from the Procfile's own command lines."""

from __future__ import annotations

import pytest
import requests

from tests.processes import free_port, start_procfile_process, wait_until

pytestmark = pytest.mark.processes


def test_curl_created_echo_run_succeeds_and_shows_in_flower(test_env, tenant, tmp_path):
    web_port, flower_port = free_port(), free_port()
    env = {**test_env, "WEB_CONCURRENCY": "1", "WORKER_CONCURRENCY": "1",
           "FLOWER_UNAUTHENTICATED_API": "true", "POIMEN_METRICS_TOKEN": "e2e-metrics",
           "CELERY_BEAT_SCHEDULE": str(tmp_path / "beat-schedule")}
    procs = [
        start_procfile_process("release", env, tmp_path),
    ]
    try:
        procs[0].proc.wait(60)
        assert procs[0].proc.returncode == 0, procs[0].log()
        procs.append(start_procfile_process("web", {**env, "PORT": str(web_port)}, tmp_path))
        procs.append(start_procfile_process("flower", {**env, "PORT": str(flower_port)},
                                            tmp_path))
        metrics_port = free_port()
        procs.append(start_procfile_process("worker", {**env, "METRICS_PORT": str(metrics_port)},
                                            tmp_path))
        beat_metrics_port = free_port()
        procs.append(start_procfile_process("beat", {**env, "METRICS_PORT": str(beat_metrics_port)},
                                            tmp_path))
        api, flower = f"http://127.0.0.1:{web_port}", f"http://127.0.0.1:{flower_port}"
        wait_until(lambda: requests.get(f"{api}/readyz", timeout=2).ok, what="web")
        wait_until(lambda: requests.get(f"{flower}/api/workers", timeout=2).ok, what="flower")
        wait_until(lambda: "ready" in procs[3].log(), what="worker")

        created = requests.post(f"{api}/v1/runs", headers=tenant.headers, timeout=10, json={
            "workflow_ref": "echo", "input": {"hello": "flower"}, "dispatch_key": "e2e-1"})
        assert created.status_code == 201
        run_id = created.json()["id"]
        run = wait_until(
            lambda: (body := requests.get(f"{api}/v1/runs/{run_id}", headers=tenant.headers,
                                          timeout=5).json())["status"] == "succeeded" and body,
            timeout=60, what="the echo run to succeed")
        assert run["result"] == {"hello": "flower"}

        task = wait_until(
            lambda: (info := requests.get(f"{flower}/api/task/info/{run_id}", timeout=5)).ok
            and info.json().get("state") == "SUCCESS" and info.json(),
            timeout=30, what="flower to show the run's task")
        assert task["uuid"] == run_id
        assert task["name"] == "runs.execute[echo@1]"
        assert task["args"] == repr([run_id])

        assert requests.get(f"{api}/metrics", timeout=5).status_code == 401
        metrics = requests.get(f"{api}/metrics", timeout=5,
                               headers={"Authorization": "Bearer e2e-metrics"}).text
        assert 'poimen_admissions_total{origin="http",outcome="created"} 1.0' in metrics
        worker_metrics = requests.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
        assert 'poimen_claims_total{outcome="claimed"} 1.0' in worker_metrics
        # The global gauges come from beat alone (docs/operations/metrics.md).
        assert "poimen_runs{" not in metrics + worker_metrics
        beat_metrics = f"http://127.0.0.1:{beat_metrics_port}/metrics"
        wait_until(lambda: 'poimen_runs{status="succeeded"} 1.0'
                   in requests.get(beat_metrics, timeout=5).text, what="beat's gauges")
        beat_text = requests.get(beat_metrics, timeout=5).text
        assert "poimen_live_boots 1.0" in beat_text
        assert "poimen_queue_depth{" in beat_text
    finally:
        for proc in reversed(procs):
            proc.stop()
