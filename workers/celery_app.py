"""Celery wired to the Flask app (pallets/flask ``examples/celery``)."""

from __future__ import annotations

from celery import Celery, Task
from flask import Flask

from celeryconfig import celery_settings


def celery_init_app(app: Flask) -> Celery:
    """Create the Celery app for ``app``: every task runs inside an app context."""

    class FlaskTask(Task):
        def __call__(self, *args, **kwargs):
            with app.app_context():
                return self.run(*args, **kwargs)

    celery_app = Celery(app.name, task_cls=FlaskTask)
    celery_app.config_from_object(celery_settings(app.config["CELERY_BROKER_URL"]))
    celery_app.conf.update(
        include=["workers.tasks"],
        beat_schedule={
            "repair-queued-runs": {
                "task": "runs.repair",
                "schedule": app.config["POIMEN_REPAIR_INTERVAL"],
            }
        },
    )
    celery_app.flask_app = app
    celery_app.set_default()
    app.extensions["celery"] = celery_app
    return celery_app
