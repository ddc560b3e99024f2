"""Prometheus metrics: what each process counts, and the global gauges beat alone exports.

Every metric and the process that exports it: ``docs/operations/metrics.md``.

* Counters and histograms are per process and add up across processes:
  ``web`` runs gunicorn in prometheus_client's multiprocess mode
  (``app/gunicorn_conf.py`` prepares ``PROMETHEUS_MULTIPROC_DIR``), so
  ``/metrics`` sums every gunicorn worker; the Celery worker does the same for
  its pool processes (``workers/metrics.py``).
* Global gauges (runs by status, waiting runs by reason, live worker boots and their probes' age,
  outbox lag, queue depth, the backlog by tenant and queue) are facts of the
  database and the broker, not of a process: only ``beat`` exports them (there is
  exactly one beat), so each is counted once, not once per web and worker instance,
  read at scrape time at most once per ``POIMEN_METRICS_CACHE_SECONDS``.

``/metrics`` shares the public web port with the API and shows every tenant's
counts, so it answers only ``Authorization: Bearer $POIMEN_METRICS_TOKEN``
(401 without a bearer token, 403 with another one). Without that setting the
web process does not serve it at all: 404.

All metrics here are labelled, so their values are created on first use: a
process that switches to multiprocess mode after importing this module (the
Celery worker, see ``workers/metrics.py``) still counts in shared files.
"""

from __future__ import annotations

import hmac
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from flask import Blueprint, Flask, Response, current_app, g, request
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric

from poimenconfig import prometheus_multiproc_dir

from .errors import ApiError

# Admission takes milliseconds; a run's queue wait and duration span seconds to hours.
FAST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
RUN_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0,
               3600.0, 14400.0)

# No `_created` series: a timestamp per counter that Prometheus does not use.
disable_created_metrics()

HTTP_REQUESTS = Counter(
    "poimen_http_requests_total",
    "HTTP requests web answered, by method, route (the URL rule, not the path) and status.",
    ["method", "route", "status"],
)
HTTP_SECONDS = Histogram(
    "poimen_http_request_seconds",
    "Time web took to answer, by method and route.",
    ["method", "route"], buckets=FAST_BUCKETS,
)
ADMISSIONS = Counter(
    "poimen_admissions_total",
    "Admission calls by origin and outcome (created, replayed, conflict).",
    ["origin", "outcome"],
)
ADMISSION_SECONDS = Histogram(
    "poimen_admission_seconds",
    "Time to admit a run (insert or replay, its event, the commit), by origin "
    "(batch: one whole POST /v1/runs/batch).",
    ["origin"], buckets=FAST_BUCKETS,
)
QUEUE_WAIT_SECONDS = Histogram(
    "poimen_run_queue_wait_seconds",
    "From a run's admission to its first start (database clock), by workflow.",
    ["workflow"], buckets=RUN_BUCKETS,
)
RUN_DURATION_SECONDS = Histogram(
    "poimen_run_duration_seconds",
    "One execution of a run: from a worker's claim to its recorded outcome, by workflow "
    "and how it ended (succeeded, failed, cancelled, retrying, waiting, released, lost).",
    ["workflow", "outcome"], buckets=RUN_BUCKETS,
)
WORKER_BATCH_SIZE = Histogram(
    "poimen_worker_batch_size",
    "Runs per statement of a batch worker's store batcher (POIMEN_WORKER_MODE=batch), by "
    "kind (claim, finish); a claim batch and a finish batch sent together share one "
    "commit.",
    ["kind"], buckets=(1, 2, 4, 8, 16, 32, 64, 128),
)
CLAIMS = Counter(
    "poimen_claims_total",
    "Deliveries of runs to workers by claim outcome (claimed, taken_over, duplicate, "
    "finished, waiting, slot_wait, not_due, expired, missing, claimer_dead).",
    ["outcome"],
)
RUNS_POISONED = Counter(
    "poimen_runs_poisoned_total",
    "Runs ended poisoned: their executions killed max_takeovers + 1 workers (a segfault, "
    "os._exit, OOM), so the last takeover ended them instead of resuming them; by tenant "
    "(its name) and workflow.",
    ["tenant", "workflow"],
)
RUNS_EXPIRED = Counter(
    "poimen_runs_expired_total",
    "Runs ended expired: no worker started them by their expires_at; by what ended them "
    "(beat: its timer tick; claim: a delivery that found the run expired).",
    ["by"],
)
RELEASES = Counter(
    "poimen_delayed_releases_total",
    "Delayed runs beat sent to Celery once due (admitted with not_before or delay_seconds).",
)
REPAIRS = Counter(
    "poimen_repairs_total",
    "Runs repair re-sent, by reason (dead_boot: held by a dead worker; queued: "
    "queued and last sent over POIMEN_REPAIR_MIN_AGE ago; slot_free: waiting for a slot "
    "that is free).",
    ["reason"],
)
ACK_REMOVALS = Counter(
    "poimen_ack_removals_total",
    "Acknowledged messages the worker's Redis transport removed from the unacked hash, "
    "by what sent the removal (delivery: with the next delivery's record; age: "
    "POIMEN_ACK_PENDING_MAX_AGE reached; count: POIMEN_ACK_PENDING_MAX reached; close: "
    "the channel closing).",
    ["how"],
)

bp = Blueprint("metrics", __name__)
log = logging.getLogger(__name__)

_children: dict[tuple[int, tuple[str, ...]], Any] = {}


def labelled(metric: Counter | Histogram, *values: str) -> Any:
    """``metric.labels(*values)``, looked up once per process: the same child
    prometheus_client keeps, without its lock and checks on every call (a batch worker's
    runs count several per run). For labels of a bounded set only (outcomes, workflows)."""
    key = (id(metric), values)
    child = _children.get(key)
    if child is None:
        child = _children.setdefault(key, metric.labels(*values))
    return child


class GaugeCache:
    """A value re-read at most once per ``ttl`` seconds.

    Without it a scrape would count the runs table and the outbox every time, and
    anyone polling could make the database do that in a loop. The lock makes
    concurrent scrapes wait for one read instead of each doing their own.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._read_at = -math.inf
        self._value = None

    def get(self, ttl: float, read):
        with self._lock:
            if time.monotonic() - self._read_at >= ttl:
                self._value = read()
                self._read_at = time.monotonic()
            return self._value


class GlobalGauges:
    """The global gauges, read from the database (and the broker) at scrape time.

    A prometheus_client collector for the one process that exports them
    (``beat``). ``queue_depths()`` returns ``{queue: messages waiting}``.
    """

    def __init__(self, flask_app: Flask,
                 queue_depths: Callable[[], Mapping[str, int]] | None = None) -> None:
        self.flask_app = flask_app
        self.queue_depths = queue_depths
        self.cache = GaugeCache()

    def collect(self) -> Iterable[Metric]:
        ttl = self.flask_app.config.get("POIMEN_METRICS_CACHE_SECONDS", 5.0)
        try:
            yield from self.cache.get(ttl, self.read)
        except Exception:  # noqa: BLE001 - the database is away: scrape says so by absence
            log.warning("global gauges not read", exc_info=True)

    def read(self) -> list[Metric]:
        from sqlalchemy import func, select

        from .events import outbox_lag
        from .extensions import db
        from .liveness import boot_probe_ages, live_boot_count
        from .models import Run, RunStatus, WaitReason
        from .state.executor import on_session
        from .state.runs import waiting_by_reason

        runs = GaugeMetricFamily("poimen_runs", "Runs by status (all tenants).",
                                 labels=["status"])
        waiting = GaugeMetricFamily(
            "poimen_runs_waiting", "Waiting runs (holding no worker) by what they wait for: "
            "join (children), concurrency (a slot of their key), tenant_cap.",
            labels=["reason"])
        boots = GaugeMetricFamily("poimen_live_boots",
                                  "Worker boots (pool processes) holding their liveness lock.")
        # Labelled by boot id, and only live boots: at most one series per pool
        # process at any time (hostname and pid are in worker_boots).
        probe_age = GaugeMetricFamily(
            "poimen_boot_probe_age_seconds",
            "Seconds since a live boot's lock session last finished a probe "
            "(pg_stat_activity.state_change, the server's view).", labels=["boot"])
        probe_age_max = GaugeMetricFamily(
            "poimen_boot_probe_age_max_seconds",
            "The largest poimen_boot_probe_age_seconds (0 with no live boot).")
        pending = GaugeMetricFamily("poimen_outbox_unpublished",
                                    "Outbox events not yet published (all tenants).")
        oldest = GaugeMetricFamily("poimen_outbox_unpublished_age_seconds",
                                   "Age of the oldest unpublished outbox event.")
        depth = GaugeMetricFamily("poimen_queue_depth", "Messages waiting in the Celery queue.",
                                  labels=["queue"])
        with self.flask_app.app_context():
            try:
                counts = dict(db.session.execute(
                    select(Run.status, func.count()).group_by(Run.status)).all())
                for status in RunStatus:  # every status, at 0 too: no series appears late
                    runs.add_metric([str(status)], counts.get(status, 0))
                reasons = waiting_by_reason(on_session(db.session))
                for reason in WaitReason:
                    waiting.add_metric([str(reason)], reasons.get(reason, 0))
                boots.add_metric([], live_boot_count(db.session))
                slowest = 0.0
                for probe in boot_probe_ages(db.session):
                    if probe.age_seconds is not None:  # None: the role cannot see it
                        probe_age.add_metric([str(probe.boot_id)], probe.age_seconds)
                        slowest = max(slowest, probe.age_seconds)
                probe_age_max.add_metric([], slowest)
                unpublished, age = outbox_lag(db.session)
                pending.add_metric([], unpublished)
                oldest.add_metric([], age)
            finally:
                db.session.remove()
        if self.queue_depths is not None:
            for queue, count in self.queue_depths().items():
                depth.add_metric([queue], count)
        return [runs, waiting, boots, probe_age, probe_age_max, pending, oldest, depth,
                *self.backlog()]

    def backlog(self) -> list[Metric]:
        """The backlog by tenant, queue and state (``app/backlog.py``)."""
        from .backlog import metric_families, read_backlog
        from .extensions import db

        with self.flask_app.app_context():
            try:
                return metric_families(read_backlog(
                    db.session, self.flask_app.extensions["celery"]))
            finally:
                db.session.remove()


def init_app(app: Flask) -> None:
    """Count every answer by route and status; create web's series at 0 before any request."""
    for origin in ("http", "batch"):  # batch: the runs POST /v1/runs/batch admitted
        for outcome in ("created", "replayed", "conflict"):
            ADMISSIONS.labels(origin, outcome)
        ADMISSION_SECONDS.labels(origin)

    @app.before_request
    def _start_clock():
        g.poimen_started = time.perf_counter()

    @app.after_request
    def _count(response):
        rule = request.url_rule.rule if request.url_rule is not None else "unmatched"
        HTTP_REQUESTS.labels(request.method, rule, str(response.status_code)).inc()
        started = g.get("poimen_started")
        if started is not None:
            HTTP_SECONDS.labels(request.method, rule).observe(time.perf_counter() - started)
        return response


def multiprocess_registry(path: str | None = None) -> CollectorRegistry:
    """A registry that sums the values every process wrote under ``path``."""
    from prometheus_client import multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=path)
    return registry


def _registry() -> CollectorRegistry:
    if prometheus_multiproc_dir():
        return multiprocess_registry()
    from prometheus_client import REGISTRY

    return REGISTRY


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
    return Response(generate_latest(_registry()), mimetype=CONTENT_TYPE_LATEST)
