"""Backlog visibility: beat's ``poimen_runs_backlog`` gauges and the console's Backlog page.

Real processes: the console's gunicorn admits the runs, a Celery worker
(three pool processes) claims them, beat exports the gauges. Three tenants
leave runs in every state on two queues:

* queued: ``echo`` runs on the default queue behind three pool processes all
  busy (held by ``backlog-hold``), ``backlog-side`` runs on a queue no worker
  consumes;
* waiting: a second run of a held concurrency key (``concurrency``), a run of a
  tenant at its cap of one (``tenant_cap``);
* delayed: ``backlog-retry`` runs, failed once and retried ten minutes from now.

The counts and the oldest run's age of every (tenant, queue, state) are
computed here from the runs this test made (their ``created_at``), and beat's
scrape and the console page must say the same, ages within a second.
The exposition passes prometheus_client's strict parser, the OpenMetrics parser,
and tests/ops/promlint.py (promtool's checks; promtool itself is not installable
here, see that module).
"""

from __future__ import annotations

import time

import pytest
import requests

from tests.conftest import connect
from tests.ops.promlint import lint, parse_openmetrics
from tests.processes import free_port, start_beat, start_worker, wait_until

pytestmark = pytest.mark.slow

HOLD = 300  # seconds a holding run keeps its pool process: longer than the test


def _created(database_url, ids) -> dict[str, float]:
    with connect(database_url) as pg:
        rows = pg.execute("SELECT CAST(id AS text), extract(epoch FROM created_at) FROM runs "
                          "WHERE id = ANY(CAST(%s AS uuid[]))", [list(ids)]).fetchall()
    return {run_id: float(at) for run_id, at in rows}


def _db_now(database_url) -> float:
    with connect(database_url) as pg:
        return float(pg.execute("SELECT extract(epoch FROM now())").fetchone()[0])


def test_backlog_by_tenant_queue_and_state_in_beats_gauges_and_on_the_console(
        console_env, console_url, console, api, run_until, make_tenant, app, database_url,
        queue_name, tmp_path):
    from app.tenant_service import set_max_running
    from tests.workflows.backlog import UNCONSUMED_QUEUE

    a, b, c = make_tenant(), make_tenant(), make_tenant()
    with app.app_context():
        set_max_running(b.name, 1)
    beat_port = free_port()
    env = {**console_env, "METRICS_PORT": str(beat_port), "POIMEN_METRICS_CACHE_SECONDS": "0"}
    worker = start_worker({k: v for k, v in env.items() if k != "METRICS_PORT"}, tmp_path,
                          name="backlog-worker", concurrency=3)
    beat = start_beat(env, tmp_path, name="backlog-beat")
    expected: dict[tuple[str, str, str], list[str]] = {}  # (tenant, queue, state) -> run ids

    def admit(creds, ref: str, **input) -> str:
        response = api("POST", "/v1/runs", creds, json={"workflow_ref": ref, "input": input})
        assert response.status_code == 201, response.text
        return response.json()["id"]

    def delayed(run_id: str) -> bool:
        with connect(database_url) as pg:
            return pg.execute("SELECT status = 'queued' AND not_before > now() FROM runs "
                              "WHERE id = %s", [run_id]).fetchone()[0]

    try:
        wait_until(lambda: requests.get(f"http://127.0.0.1:{beat_port}/healthz", timeout=2).ok,
                   timeout=60, what="beat's metrics")
        # A holds customer x's one slot; its second run of x waits for it.
        run_until(a, admit(a, "backlog-hold", customer="x", seconds=HOLD), "running")
        second = admit(a, "backlog-hold", customer="x")
        run_until(a, second, "waiting")
        expected[(a.name, queue_name, "waiting")] = [second]
        # A and B each have a run that failed once and is retried in ten minutes.
        for creds in (a, b):
            retry = admit(creds, "backlog-retry")
            wait_until(lambda retry=retry: delayed(retry), timeout=120,
                       what="the retry's backoff")
            expected[(creds.name, queue_name, "delayed")] = [retry]
        # B, capped at one running run: its second (another key) waits for the tenant's slot.
        run_until(b, admit(b, "backlog-hold", customer="y", seconds=HOLD), "running")
        capped = admit(b, "backlog-hold", customer="z")
        run_until(b, capped, "waiting")
        expected[(b.name, queue_name, "waiting")] = [capped]
        # C takes the third pool process: from now on nothing on the default queue is claimed.
        run_until(c, admit(c, "backlog-hold", customer="w", seconds=HOLD), "running")
        expected[(a.name, queue_name, "queued")] = [admit(a, "echo"), admit(a, "echo")]
        expected[(b.name, queue_name, "queued")] = [admit(b, "echo")]
        expected[(a.name, UNCONSUMED_QUEUE, "queued")] = [admit(a, "backlog-side"),
                                                          admit(a, "backlog-side")]
        expected[(c.name, UNCONSUMED_QUEUE, "queued")] = [admit(c, "backlog-side")]
        time.sleep(1.5)  # ages far enough apart that "the oldest" is the oldest
        with connect(database_url) as pg:
            reasons = dict(pg.execute(
                "SELECT CAST(id AS text), wait_reason FROM runs WHERE id = ANY(CAST(%s AS uuid[]))",
                [[second, capped]]).fetchall())
        assert reasons == {second: "concurrency", capped: "tenant_cap"}
        created = _created(database_url, [i for ids in expected.values() for i in ids])

        def want(tenant: str, queue: str, state: str, at: float) -> tuple[int, float]:
            ids = expected.get((tenant, queue, state), [])
            return len(ids), max((at - created[i] for i in ids), default=0.0)

        # beat's gauges: every (tenant, queue, state) of these tenants, the empty ones at 0.
        from prometheus_client.parser import text_string_to_metric_families

        url = f"http://127.0.0.1:{beat_port}/metrics"
        before = _db_now(database_url)
        text = requests.get(url, timeout=30).text
        after = _db_now(database_url)
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(text) for s in f.samples}
        for tenant in (a.name, b.name, c.name):
            for queue in (queue_name, UNCONSUMED_QUEUE):
                for state in ("queued", "waiting", "delayed"):
                    labels = (("queue", queue), ("state", state), ("tenant", tenant))
                    runs, oldest = want(tenant, queue, state, after)
                    where = (tenant, queue, state)
                    assert samples[("poimen_runs_backlog", labels)] == runs, where
                    age = samples[("poimen_runs_backlog_oldest_age_seconds", labels)]
                    assert oldest - (after - before) - 1 <= age <= oldest + 1, (where, age, oldest)
        reason = "poimen_runs_backlog_waiting"
        assert samples[(reason, (("queue", queue_name), ("reason", "concurrency"),
                                 ("tenant", a.name)))] == 1
        assert samples[(reason, (("queue", queue_name), ("reason", "tenant_cap"),
                                 ("tenant", b.name)))] == 1
        assert samples[(reason, (("queue", queue_name), ("reason", "tenant_cap"),
                                 ("tenant", a.name)))] == 0
        # What promtool check metrics would say, and the OpenMetrics form parses too.
        assert lint(text) == []
        openmetrics = requests.get(url, timeout=30,
                                   headers={"Accept": "application/openmetrics-text"}).text
        names = {f.name for f in parse_openmetrics(openmetrics)}
        assert {"poimen_runs_backlog", "poimen_runs_backlog_oldest_age_seconds",
                "poimen_runs_backlog_waiting"} <= names

        # The console: tenant A's page shows the same numbers, ages as of the page's read.
        console.sign_in(a.token)
        console.open("/console/backlog")
        read_at = float(console.attrs("#backlog-read-at", "data-read-at")[0])
        assert console.attrs("#backlog tr.queue", "data-queue") == sorted(
            [queue_name, UNCONSUMED_QUEUE])
        for queue in (queue_name, UNCONSUMED_QUEUE):
            row = f'#backlog tr.queue[data-queue="{queue}"]'
            for state in ("queued", "waiting", "delayed"):
                runs, oldest = want(a.name, queue, state, read_at)
                shown = console.attrs(f'{row} td.runs-count[data-state="{state}"]', "data-runs")
                assert shown == [str(runs)], (queue, state)
                age = float(console.attrs(f'{row} td.oldest-age[data-state="{state}"]',
                                          "data-age")[0])
                assert abs(age - oldest) <= 1, (queue, state, age, oldest)
        assert console.texts(f'#backlog tr.queue[data-queue="{queue_name}"] .reason') == [
            "concurrency 1"]
        assert console.texts("#backlog-totals .badge") == ["queued 4", "waiting 1", "delayed 1"]
        # Another tenant's page shows only its own backlog.
        console.sign_in(c.token)
        console.open("/console/backlog")
        assert console.attrs("#backlog tr.queue", "data-queue") == [UNCONSUMED_QUEUE]
    finally:
        beat.teardown()
        worker.teardown()
