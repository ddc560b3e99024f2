"""The backlog read (``app/backlog.py``): its states, ages and queues, its plan, its gauges.

In one rolled-back transaction against the real database; the same numbers
through beat and the console, with real processes:
tests/console/test_console_backlog.py.
"""

from __future__ import annotations

import re

import pytest

from app.backlog import BACKLOG, metric_families, read_backlog
from app.state.statements import PARAMETER as _PARAMETER
from tests.ops.promlint import lint, parse_openmetrics

_ROW = ("INSERT INTO runs (id, tenant_id, workflow_ref, workflow_name, workflow_version, "
        "input, status, wait_reason, origin, attempt, cancel_requested, not_before, "
        "created_at, updated_at) "
        "VALUES (gen_random_uuid(), :tenant, :name || '@' || :version, :name, :version, "
        "'{}'::jsonb, :status, :reason, 'http', 0, false, now() + make_interval(secs => :due_in), "
        "now() - make_interval(secs => :age), now())")


def _add(session, tenant: int, status: str, age: float, due_in: float | None = None,
         name: str = "echo", version: str = "1", reason: str | None = None) -> None:
    from sqlalchemy import text

    session.execute(text(_ROW.replace("now() + make_interval(secs => :due_in)",
                                      "NULL" if due_in is None else
                                      "now() + make_interval(secs => :due_in)")),
                    {"tenant": tenant, "status": status, "age": age, "due_in": due_in,
                     "name": name, "version": version, "reason": reason})


def test_states_ages_and_queues_of_the_backlog(app, db_session, tx_tenant, make_tenant):
    from tests.workflows.celery_tasks import SIDE_QUEUE

    celery_app = app.extensions["celery"]
    default = celery_app.conf.task_default_queue
    other = make_tenant()
    t = tx_tenant.id
    _add(db_session, t, "queued", age=30)
    _add(db_session, t, "queued", age=10)
    # A retry whose backoff ended 5 s ago: queued, and due for 5 s only.
    _add(db_session, t, "queued", age=100, due_in=-5)
    # Delayed, queued or waiting: aged since admission.
    _add(db_session, t, "queued", age=40, due_in=60)
    _add(db_session, t, "waiting", age=70, due_in=60, reason="concurrency")
    _add(db_session, t, "waiting", age=20, reason="concurrency")
    _add(db_session, t, "waiting", age=50, reason="tenant_cap")
    _add(db_session, t, "waiting", age=15)  # a join from before wait_reason: join
    # Routed by its workflow; a version this process does not have: the default queue.
    _add(db_session, t, "queued", age=8, name="routed-side")
    _add(db_session, t, "queued", age=9, name="echo", version="999")
    # Not backlog: running and finished runs.
    _add(db_session, t, "running", age=500)
    _add(db_session, t, "succeeded", age=900)
    _add(db_session, other.id, "queued", age=3)

    backlog = read_backlog(db_session, celery_app)
    name = tx_tenant.name
    queued = backlog.cell(name, default, "queued")
    assert queued.runs == 4 and queued.oldest_age == pytest.approx(30, abs=1)
    waiting = backlog.cell(name, default, "waiting")
    assert waiting.runs == 3 and waiting.oldest_age == pytest.approx(50, abs=1)
    assert waiting.reasons == {"concurrency": 1, "tenant_cap": 1, "join": 1}
    delayed = backlog.cell(name, default, "delayed")
    assert delayed.runs == 2 and delayed.oldest_age == pytest.approx(70, abs=1)
    side = backlog.cell(name, SIDE_QUEUE, "queued")
    assert side.runs == 1 and side.oldest_age == pytest.approx(8, abs=1)
    assert backlog.cell(other.name, default, "queued").runs == 1
    assert {default, SIDE_QUEUE} <= set(backlog.queues)
    assert {name, other.name} <= set(backlog.tenants)
    # One tenant's read (the console's) has that tenant's rows only.
    mine = read_backlog(db_session, celery_app, tenant_id=other.id)
    assert {tenant for tenant, _, _ in mine.cells} == {other.name}


def test_the_gauges_cover_every_tenant_queue_and_state_and_pass_promtools_checks(
        app, db_session, tx_tenant):
    """promtool is not installable here (tests/ops/promlint.py says why): its checks,
    prometheus_client's strict text parser and the OpenMetrics parser stand in."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.openmetrics.exposition import generate_latest as openmetrics

    from app.metrics import GlobalGauges

    _add(db_session, tx_tenant.id, "queued", age=12)
    backlog = read_backlog(db_session, app.extensions["celery"])
    families = {f.name: f for f in metric_families(backlog)}
    series = {tuple(s.labels.values()) for s in families["poimen_runs_backlog"].samples}
    assert len(series) == len(backlog.tenants) * len(backlog.queues) * 3
    registry = CollectorRegistry()
    registry.register(GlobalGauges(app))
    text = generate_latest(registry).decode()
    assert "poimen_runs_backlog{" in text
    assert lint(text) == []
    names = {f.name for f in parse_openmetrics(openmetrics(registry).decode())}
    assert {"poimen_runs_backlog", "poimen_runs_backlog_oldest_age_seconds",
            "poimen_runs_backlog_waiting", "poimen_runs"} <= names


def test_the_linter_reports_what_promtool_reports():
    bad = ("# HELP poimen_things_total Things.\n# TYPE poimen_things_total gauge\n"
           "poimen_things_total 1\n"
           "# HELP poimen_wait_milliseconds Wait.\n# TYPE poimen_wait_milliseconds gauge\n"
           "poimen_wait_milliseconds 1\n"
           "# TYPE poimen_nohelp gauge\npoimen_nohelp{Tenant=\"a\"} 1\n")
    problems = "\n".join(lint(bad))
    assert "reserved suffix" in problems and "base unit" in problems
    assert "no help text" in problems and "snake_case" in problems


def _plan(pg, tenant_ids: list[int]) -> str:
    sql = BACKLOG.text
    assert set(_PARAMETER.findall(sql)) == {"tenant_ids"}
    positional = _PARAMETER.sub("$1::integer[]", sql)
    pg.execute("DEALLOCATE ALL")
    pg.execute(f"PREPARE backlog AS {positional}")
    ids = ",".join(str(t) for t in tenant_ids)
    return "\n".join(row[0] for row in pg.execute(f"EXPLAIN EXECUTE backlog('{{{ids}}}')"))


def test_the_read_is_an_index_only_scan_of_the_backlog_index(pg):
    """20,000 finished runs and 300 in the backlog, vacuumed as autovacuum would: both
    reads are index-only scans of ``ix_runs_backlog`` (migration 0023), a partial index
    whose entries are the backlog's runs only, and the console's is bounded by its tenant.
    Committed for VACUUM; the next test's ``clean_tables`` empties the tables."""
    tenant = pg.execute("INSERT INTO tenants (name) VALUES ('backlog-plan') "
                        "RETURNING id").fetchone()[0]
    for status, count in (("succeeded", 20000), ("queued", 200), ("waiting", 100)):
        pg.execute("INSERT INTO runs (id, tenant_id, workflow_ref, workflow_name, "
                   "workflow_version, input, status, origin, attempt, cancel_requested, "
                   "created_at, updated_at) "
                   "SELECT gen_random_uuid(), %s, 'echo@1', 'echo', '1', '{}'::jsonb, %s, "
                   "'http', 0, false, now() - make_interval(secs => g), now() "
                   "FROM generate_series(1, %s) g", [tenant, status, count])
    pg.execute("VACUUM ANALYZE runs")
    for mode in ("auto", "force_generic_plan"):
        pg.execute(f"SET plan_cache_mode = {mode}")
        # Every tenant's (beat's: many ids) and one tenant's (the console's).
        for tenant_ids in ([*range(1, 50), tenant], [tenant]):
            plan = _plan(pg, tenant_ids)
            assert re.search(r"Index Only Scan using ix_runs_backlog on runs", plan), plan
            assert not re.search(r"Seq Scan on runs\b", plan), plan
            assert re.search(r"Index Cond: \((r\.)?tenant_id = ANY", plan), plan
