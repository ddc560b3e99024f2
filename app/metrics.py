"""Prometheus metrics of the web process, served at ``/metrics`` to its scraper only.

Counters are per process; with several gunicorn workers set
``PROMETHEUS_MULTIPROC_DIR`` so they are aggregated (prometheus_client's
multiprocess mode). Run-state gauges are read from the database at scrape time
(at most once per ``POIMEN_METRICS_CACHE_SECONDS`` per process), so they are
right whichever process answers.

``/metrics`` shares the public web port with the API and shows every tenant's
counts, so it answers only ``Authorization: Bearer $POIMEN_METRICS_TOKEN``
(401 without a bearer token, 403 with another one). Without that setting the
web process does not serve it at all: 404.
"""

from __future__ import annotations

import hmac
import math
import os
import threading
import time

from flask import Blueprint, Response, current_app, request
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    generate_latest,
)

from . import runs
from .errors import ApiError
from .events import outbox_lag
from .extensions import db

ADMISSIONS = Counter(
    "poimen_admissions_total",
    "Admission calls by origin and outcome (created, replayed, conflict).",
    ["origin", "outcome"],
)

bp = Blueprint("metrics", __name__)


class GaugeCache:
    """The database gauges' text, re-read at most once per ``ttl`` seconds.

    A scrape used to count the runs table and the outbox every time; anyone
    polling ``/metrics`` could make the database do that in a loop. The lock
    makes concurrent scrapes wait for one read instead of each doing their own.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._read_at = -math.inf
        self._text = ""

    def get(self, ttl: float, read) -> str:
        with self._lock:
            if time.monotonic() - self._read_at >= ttl:
                self._text = read()
                self._read_at = time.monotonic()
            return self._text


@bp.record_once
def _settings(state) -> None:
    # Read from the environment when the factory runs, like every other setting.
    config = state.app.config
    config.setdefault("POIMEN_METRICS_TOKEN", os.environ.get("POIMEN_METRICS_TOKEN") or None)
    config.setdefault("POIMEN_METRICS_CACHE_SECONDS",
                      float(os.environ.get("POIMEN_METRICS_CACHE_SECONDS", "5")))
    state.app.extensions["poimen_metrics_gauges"] = GaugeCache()


def _registry() -> CollectorRegistry:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return registry
    from prometheus_client import REGISTRY

    return REGISTRY


def _read_run_gauges() -> str:
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


def _require_metrics_token() -> None:
    expected = current_app.config["POIMEN_METRICS_TOKEN"]
    if not expected:
        raise ApiError(404, "not_found", "/metrics is served only when POIMEN_METRICS_TOKEN is set")
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "unauthorized", "missing bearer token",
                       headers={"WWW-Authenticate": 'Bearer realm="poimen-metrics"'})
    if not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise ApiError(403, "forbidden", "this token may not read /metrics")


@bp.get("/metrics")
def metrics():
    _require_metrics_token()
    gauges = current_app.extensions["poimen_metrics_gauges"].get(
        current_app.config["POIMEN_METRICS_CACHE_SECONDS"], _read_run_gauges)
    body = generate_latest(_registry()).decode() + gauges
    return Response(body, mimetype=CONTENT_TYPE_LATEST)
