"""The worker's Celery app: ``celery -A workers`` finds ``workers.celery.app``.

Importing this module creates the Flask app, reading the environment: only
the worker, beat and Flower import it.
"""

from app import create_app
from app.logs import init_celery
from app.telemetry import connect_celery
from celeryconfig import broker_scheme

from .gate import DatabaseGate
from .metrics import connect_beat
from .task_events import TaskEventBatches

init_celery()  # LOG_FORMAT / LOG_LEVEL for the worker, beat and Flower, before anything logs
app = create_app().extensions["celery"]
if broker_scheme(app.conf.broker_url) == "redis":
    # kombu's Redis transport, acknowledging in batches (workers/broker.py).
    app.conf.broker_transport = "workers.broker:Transport"
connect_beat(app)  # beat, and only beat, exports the global gauges (workers/metrics.py)
connect_celery(app)  # OpenTelemetry and Sentry, if configured, when the worker or beat starts
app.steps["consumer"].add(DatabaseGate)  # no runs taken while Postgres does not answer
app.steps["consumer"].add(TaskEventBatches)  # task events published in batches, not one by one
