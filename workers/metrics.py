"""Prometheus metrics of the ``worker`` and ``beat`` processes, on ``METRICS_PORT``.

* ``worker``: what its pool processes count (claims, repairs, admissions of
  fanned-out children, queue wait and run duration histograms). Pool processes
  are forked children, so the worker runs prometheus_client's multiprocess
  mode in a private directory made when it starts (``PROMETHEUS_MULTIPROC_DIR``
  is not needed and, if set for gunicorn, not shared with it) and its main
  process serves the sum.
  The main process also exports ``poimen_ack_removals_pending``, read at
  scrape time from its Redis transport (``workers/broker.py``).
* ``beat``: the global gauges (``app.metrics.GlobalGauges``: runs by status, the backlog,
  live boots, outbox lag, queue depth), read from Postgres and the broker at
  scrape time. Only beat exports them: one beat runs, so each is counted once.

Both serve ``/healthz`` next to ``/metrics``.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from bridge.process import start_metrics_server

if TYPE_CHECKING:
    from celery import Celery
    from flask import Flask
    from prometheus_client.core import Metric

log = logging.getLogger(__name__)

_private_dir: str | None = None


def queue_depths(celery_app: Celery) -> dict[str, int]:
    """Messages waiting in the Celery queue, on Redis or RabbitMQ.

    A passive ``queue_declare`` asks the broker and creates nothing: kombu answers
    it from the list's length on Redis, RabbitMQ from the queue itself (an ``llen``
    fails on every scrape over amqp). A queue that does not exist holds nothing:
    Redis drops an empty list, RabbitMQ has none until a worker declared it.
    """
    from kombu.exceptions import ChannelError

    queue = celery_app.conf.task_default_queue
    with celery_app.connection_for_read() as connection:
        connection.ensure_connection(max_retries=1)
        # A channel of its own: RabbitMQ closes the channel a passive declare missed on.
        channel = connection.channel()
        try:
            return {queue: channel.queue_declare(queue=queue, passive=True).message_count}
        except ChannelError:
            return {queue: 0}
        finally:
            try:
                channel.close()
            except Exception:  # noqa: BLE001 - already closed by the broker
                pass


def _count_in_shared_files() -> str:
    """Make this process and the pool processes it forks count in one private directory.

    The ``celery`` command imported prometheus_client before our code ran (Flower's
    plugin does), so its value class is already chosen: switch it here, in the
    main process before the pool forks. Every poimen metric is labelled, so its
    values are created later, in the new class.
    """
    global _private_dir
    from prometheus_client import values

    _private_dir = tempfile.mkdtemp(prefix="poimen-metrics-worker-")
    # A write, for prometheus_client (and app.metrics, which reads it through
    # poimenconfig.prometheus_multiproc_dir at scrape time).
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = _private_dir
    values.ValueClass = values.MultiProcessValue()
    return _private_dir


def _pool_process_exited(**_: Any) -> None:
    from prometheus_client import multiprocess

    if _private_dir:
        multiprocess.mark_process_dead(os.getpid(), _private_dir)


def _remove_private_dir(**_: Any) -> None:
    if _private_dir:
        shutil.rmtree(_private_dir, ignore_errors=True)


class PendingRemovals:
    """``poimen_ack_removals_pending``: the main process's acknowledged messages whose
    removal from Redis' unacked hash is pending, read at scrape time."""

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import GaugeMetricFamily

        from .broker import pending_removals

        yield GaugeMetricFamily(
            "poimen_ack_removals_pending",
            "Acknowledged messages whose removal from Redis' unacked hash this worker has "
            "deferred and not sent yet (at most POIMEN_ACK_PENDING_MAX).",
            value=pending_removals())


def serve_metrics(flask_app: Flask, celery_app: Celery) -> None:
    """Serve the pool's counters and histograms on ``METRICS_PORT`` (else ``PORT``)."""
    from celery import signals

    from app.metrics import multiprocess_registry

    port = flask_app.config["METRICS_PORT"]  # poimenconfig.metrics_port
    if port is None:
        return
    path = _count_in_shared_files()
    signals.worker_process_shutdown.connect(_pool_process_exited, weak=False)
    signals.worker_shutdown.connect(_remove_private_dir, weak=False)
    registry = multiprocess_registry(path)
    registry.register(PendingRemovals())
    try:
        start_metrics_server(port, registry)
    except OSError as err:
        log.error("worker metrics not served: port %s: %s", port, err)
        return
    log.info("worker metrics on :%s/metrics, health on :%s/healthz", port, port)


def serve_global_metrics(flask_app: Flask, celery_app: Celery) -> None:
    """Serve the global gauges from ``beat`` on ``METRICS_PORT`` (else ``PORT``)."""
    from prometheus_client import CollectorRegistry

    from app.metrics import RELEASES, RUNS_EXPIRED, GlobalGauges

    port = flask_app.config["METRICS_PORT"]  # poimenconfig.metrics_port
    if port is None:
        return
    registry = CollectorRegistry()

    def depths() -> dict[str, int]:
        try:
            return queue_depths(celery_app)
        except Exception:  # noqa: BLE001 - a scrape must not fail over the broker
            log.warning("queue depth not measured", exc_info=True)
            return {}

    registry.register(GlobalGauges(flask_app, depths))
    # What beat's own timer tick counts (workers/timers.py): delayed runs sent, runs expired.
    registry.register(RELEASES)
    registry.register(RUNS_EXPIRED)
    try:
        start_metrics_server(port, registry)
    except OSError as err:
        log.error("beat metrics not served: port %s: %s", port, err)
        return
    log.info("beat metrics (global gauges) on :%s/metrics, health on :%s/healthz", port, port)


def connect_beat(celery_app: Celery) -> None:
    """Serve the global gauges when this process turns out to be ``beat``."""
    from celery import signals

    def started(sender: Any = None, **_: Any) -> None:
        serve_global_metrics(celery_app.flask_app, celery_app)

    signals.beat_init.connect(started, weak=False)
