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
from sqlalchemy import func, select

from .extensions import db
from .models import OutboxEvent, Run

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
    for status, count in db.session.execute(
        select(Run.status, func.count()).group_by(Run.status)
    ):
        lines.append(f'poimen_runs{{status="{status}"}} {count}')
    pending, oldest = db.session.execute(
        select(func.count(), func.extract("epoch", func.now() - func.min(OutboxEvent.created_at)))
        .where(OutboxEvent.published_at.is_(None))
    ).one()
    lines += [
        "# HELP poimen_outbox_unpublished Outbox events not yet published.",
        "# TYPE poimen_outbox_unpublished gauge",
        f"poimen_outbox_unpublished {pending}",
        "# HELP poimen_outbox_oldest_age_seconds Age of the oldest unpublished event.",
        "# TYPE poimen_outbox_oldest_age_seconds gauge",
        f"poimen_outbox_oldest_age_seconds {float(oldest or 0)}",
    ]
    db.session.rollback()
    return "\n".join(lines) + "\n"


@bp.get("/metrics")
def metrics():
    body = generate_latest(_registry()).decode() + _run_gauges()
    return Response(body, mimetype=CONTENT_TYPE_LATEST)
