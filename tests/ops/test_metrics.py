"""Metrics that prove the promise, over the Procfile's processes.

web runs gunicorn with two workers (app/gunicorn_conf.py: multiprocess mode), the
Celery worker two pool processes; both must report sums, not one process's
share. A run whose message is lost is re-sent by repair, and the counters say
so. The global gauges come from beat and from no other process.
"""

from __future__ import annotations

import json

import pytest
import requests

from tests.ops.platform import METRICS_TOKEN, Platform, platform_env
from tests.processes import metrics, wait_until

pytestmark = pytest.mark.processes


GLOBAL_GAUGES = ("poimen_runs", "poimen_live_boots", "poimen_boot_probe_age_seconds",
                 "poimen_boot_probe_age_max_seconds", "poimen_outbox_unpublished",
                 "poimen_outbox_unpublished_age_seconds", "poimen_queue_depth")
AUTH = {"Authorization": f"Bearer {METRICS_TOKEN}"}


def web_metrics(platform: Platform) -> dict:
    """One scrape of web's /metrics (whichever gunicorn worker answers)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{platform.api}/metrics", headers=AUTH, timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def families(url: str, headers: dict | None = None) -> set[str]:
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(url, headers=headers or {}, timeout=10).text
    return {f.name for f in text_string_to_metric_families(text)}


def access_pids(platform: Platform) -> set[int]:
    """The gunicorn worker pids that served POST /v1/runs (from web's JSON access log)."""
    pids = set()
    for line in platform.procs["web"].log().splitlines():
        record = json.loads(line)
        if record["logger"] == "gunicorn.access" and "POST /v1/runs" in record["message"]:
            pids.add(record["pid"])
    return pids


def test_counters_sum_over_processes_histograms_move_and_global_gauges_come_from_beat(
        test_env, make_tenant, redis_client, queue_name, tmp_path):
    service, tenant = make_tenant(service=True), make_tenant()
    env, prefix = platform_env(test_env, service.token, tmp_path, LOG_FORMAT="json",
                               POIMEN_REPAIR_MIN_AGE="1", POIMEN_METRICS_CACHE_SECONDS="0")
    platform = Platform(env, tmp_path, tenant.name, prefix, creds=tenant)
    try:
        platform.start("web")
        platform.env["POIMEN_API_URL"] = platform.api
        for name in ("beat", "inbox", "outbox"):
            platform.start(name)
        platform.wait_ready()
        # Series exist from the start, at 0: a rate() over a fresh web is not "no data".
        early = web_metrics(platform)
        for outcome in ("created", "replayed", "conflict"):
            assert ("poimen_admissions_total",
                    (("origin", "http"), ("outcome", outcome))) in early, outcome
        assert value(early, "poimen_admissions_total", origin="http", outcome="created") == 0

        def post(key: str, note: str = "x") -> requests.Response:
            # A new connection each time, so both gunicorn workers get some.
            return requests.post(f"{platform.api}/v1/runs", headers=tenant.headers, timeout=10,
                                 json={"workflow_ref": "echo", "input": {"note": note},
                                       "dispatch_key": key})

        # A run whose Celery message is lost before any worker runs: repair re-sends it.
        lost = post("lost-1")
        assert lost.status_code == 201
        # Its own message, not one of beat's repair tasks (they wait in the same queue).
        wait_until(lambda: any(lost.json()["id"].encode() in message
                               for message in redis_client.lrange(queue_name, 0, -1)),
                   what="the run's message queued")
        redis_client.delete(queue_name)
        platform.start("worker")
        platform.wait_ready()

        created, replayed, conflicts = 1, 0, 0
        while len(access_pids(platform)) < 2 or created < 8:
            assert created < 200, "one gunicorn worker served every request"
            assert post(f"run-{created}").status_code == 201
            created += 1
        for key in ("run-1", "run-2", "run-3"):
            assert post(key).status_code == 200  # a replay
            replayed += 1
        assert post("run-1", note="other").status_code == 409
        conflicts += 1

        # web: the sum over both gunicorn workers, whichever one answers the scrape.
        for _ in range(6):
            samples = web_metrics(platform)
            assert value(samples, "poimen_admissions_total", origin="http",
                         outcome="created") == created
            assert value(samples, "poimen_admissions_total", origin="http",
                         outcome="replayed") == replayed
            assert value(samples, "poimen_admissions_total", origin="http",
                         outcome="conflict") == conflicts
            assert value(samples, "poimen_admission_seconds_count",
                         origin="http") == created + replayed
            assert value(samples, "poimen_admission_seconds_sum", origin="http") > 0
            # Every answer by route and status (the URL rule, never a run id).
            for status, count in (("201", created), ("200", replayed), ("409", conflicts)):
                assert value(samples, "poimen_http_requests_total", method="POST",
                             route="/v1/runs", status=status) == count, status

        # worker: every run claimed exactly once, the lost one after repair re-sent it.
        worker = platform.metrics_url("worker")
        wait_until(lambda: metrics(worker).get(
            ("poimen_claims_total", (("outcome", "claimed"),))) == created,
            timeout=120, what=f"{created} claims")
        wait_until(lambda: metrics(worker).get(
            ("poimen_run_duration_seconds_count",
             (("outcome", "succeeded"), ("workflow", "echo")))) == created,
            timeout=60, what="every run's duration observed")
        samples = metrics(worker)
        assert samples[("poimen_run_queue_wait_seconds_count", (("workflow", "echo"),))] == created
        # The lost run waited for repair: at least POIMEN_REPAIR_MIN_AGE in the queue.
        assert samples[("poimen_run_queue_wait_seconds_sum", (("workflow", "echo"),))] >= 1.0
        assert samples[("poimen_repairs_total", (("reason", "queued"),))] >= 1

        # A duplicate delivery of a finished run is counted, and does nothing.
        from app import create_app
        from app.enqueue import send_run

        celery_app = create_app().extensions["celery"]
        send_run(celery_app, lost.json()["id"], "echo@1")
        wait_until(lambda: metrics(worker).get(
            ("poimen_claims_total", (("outcome", "finished"),)), 0) >= 1,
            timeout=60, what="the duplicate delivery counted as finished")
        assert metrics(worker)[("poimen_claims_total", (("outcome", "claimed"),))] == created

        # The global gauges: beat has them, right; no other process exports them.
        beat = platform.metrics_url("beat")
        wait_until(lambda: metrics(beat).get(
            ("poimen_runs", (("status", "succeeded"),))) == created,
            timeout=60, what="beat's runs gauge")
        beat_samples = metrics(beat)
        assert beat_samples[("poimen_live_boots", ())] == 2  # two pool processes
        # Each probes every 2 s; a live boot past T_c (10 s) unprobed would be fenced.
        probe_ages = [v for (name, _), v in beat_samples.items()
                      if name == "poimen_boot_probe_age_seconds"]
        assert len(probe_ages) == 2 and max(probe_ages) < 10
        assert beat_samples[("poimen_boot_probe_age_max_seconds", ())] == max(probe_ages)
        assert (("poimen_queue_depth", (("queue", queue_name),))) in beat_samples
        assert set(GLOBAL_GAUGES) <= families(beat)
        from app.models import RunStatus

        for status in RunStatus:  # every status, those with no run at 0
            assert ("poimen_runs", (("status", str(status)),)) in beat_samples, status
        scrapes = {"web": web_metrics(platform), "worker": metrics(worker), "beat": beat_samples,
                   "inbox": metrics(platform.metrics_url("inbox")),
                   "outbox": metrics(platform.metrics_url("outbox"))}
        for name, samples in scrapes.items():
            noise = [n for n, _ in samples if n.endswith("_created")]
            assert not noise, f"{name} exports _created series: {noise[:3]}"
        others = {"web": families(f"{platform.api}/metrics", AUTH),
                  "worker": families(worker),
                  "inbox": families(platform.metrics_url("inbox")),
                  "outbox": families(platform.metrics_url("outbox"))}
        for name, found in others.items():
            assert not set(GLOBAL_GAUGES) & found, f"{name} exports a global gauge"

        # /healthz next to every process's metrics.
        for name in ("worker", "beat", "inbox", "outbox"):
            health = requests.get(f"http://127.0.0.1:{platform.ports[name]}/healthz", timeout=5)
            assert health.status_code == 200 and health.json() == {"status": "ok"}, name
        assert requests.get(f"{platform.api}/healthz", timeout=5).ok
    finally:
        platform.stop()
