"""Prometheus metrics of the web process, served at ``/metrics``.

Counters are per process; with several gunicorn workers set
``PROMETHEUS_MULTIPROC_DIR`` so they are aggregated (prometheus_client's
multiprocess mode). Run-state gauges are read from the database at scrape time,
so they are right whichever process answers.
"""

from __future__ import annotations

import os

from flask import Blueprint, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    generate_latest,
)

from . import runs
from .events import outbox_lag
from .extensions import db

ADMISSIONS = Counter(
    "poimen_admissions_total",
    "Admission calls by origin and outcome (created, replayed, conflict).",
    ["origin", "outcome"],
)

bp = Blueprint("metrics", __name__)


def _registry() -> CollectorRegistry:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return registry
    from prometheus_client import REGISTRY

    return REGISTRY


def _run_gauges() -> str:
    lines = [
        "# HELP poimen_runs Runs by status.",
        "# TYPE poimen_runs gauge",
    ]
    for status, count in runs.status_counts(db.session).items():
        lines.append(f'poimen_runs{{status="{status}"}} {count}')
    pending, oldest = outbox_lag(db.session)
    lines += [
        "# HELP poimen_outbox_unpublished Outbox events not yet published.",
        "# TYPE poimen_outbox_unpublished gauge",
        f"poimen_outbox_unpublished {pending}",
        "# HELP poimen_outbox_oldest_age_seconds Age of the oldest unpublished event.",
        "# TYPE poimen_outbox_oldest_age_seconds gauge",
        f"poimen_outbox_oldest_age_seconds {oldest}",
    ]
    db.session.rollback()
    return "\n".join(lines) + "\n"


@bp.get("/metrics")
def metrics():
    body = generate_latest(_registry()).decode() + _run_gauges()
    return Response(body, mimetype=CONTENT_TYPE_LATEST)
