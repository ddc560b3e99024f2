"""Prometheus metrics of the ``worker`` process, on ``METRICS_PORT``.

Values are read from Postgres and Redis at scrape time, so they are right no
matter which pool process did the work, and need no multiprocess bookkeeping.
"""

from __future__ import annotations

import logging
import os

from prometheus_client import REGISTRY, start_http_server
from prometheus_client.core import GaugeMetricFamily

from app.extensions import db
from app.liveness import live_boot_count
from app.runs import status_counts

log = logging.getLogger(__name__)


class WorkerCollector:
    """Runs by status, live boots and the Celery queue depth."""

    def __init__(self, flask_app, celery_app):
        self.flask_app = flask_app
        self.celery_app = celery_app

    def collect(self):
        runs = GaugeMetricFamily("poimen_worker_runs", "Runs by status.", labels=["status"])
        boots = GaugeMetricFamily("poimen_worker_live_boots",
                                  "Worker boots holding their liveness lock.")
        depth = GaugeMetricFamily("poimen_worker_queue_depth",
                                  "Messages waiting in the Celery queue.", labels=["queue"])
        try:
            with self.flask_app.app_context():
                for status, count in status_counts(db.session).items():
                    runs.add_metric([status], count)
                boots.add_metric([], live_boot_count(db.session))
                db.session.remove()
            queue = self.celery_app.conf.task_default_queue
            with self.celery_app.connection_for_read() as connection:
                client = connection.default_channel.client
                depth.add_metric([queue], client.llen(queue))
        except Exception:  # noqa: BLE001 - a scrape must not crash the worker
            log.exception("metrics scrape failed")
        yield from (runs, boots, depth)


def serve_metrics(flask_app, celery_app) -> None:
    """Serve metrics on ``METRICS_PORT`` (else ``PORT``) from the worker's main process."""
    port = os.environ.get("METRICS_PORT") or os.environ.get("PORT")
    if not port or port == "0":
        return
    try:
        start_http_server(int(port))
    except OSError as err:
        log.error("worker metrics not served: port %s: %s", port, err)
        return
    REGISTRY.register(WorkerCollector(flask_app, celery_app))
    log.info("worker metrics on :%s/metrics", port)
