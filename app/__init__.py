"""The Poimen application: ``create_app()`` and the Celery app wired to it.

Both read their settings from the environment when called, never at import.
``workers/celery.py`` builds the worker's Celery app from here, so the web
process, the workers, beat and Flower share one wiring.

Flask and Celery are imported when the factory is called, not with this
package: a module of it (the store, the models) can be imported without them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from celery import Celery
    from flask import Flask


def migrations_directory() -> Path:
    """The Alembic scripts: ``app/migrations/`` in an installed wheel (its build copies
    them there), else the checkout's ``migrations/`` beside this package."""
    here = Path(__file__).resolve().parent
    shipped = here / "migrations"
    return shipped if shipped.is_dir() else here.parent / "migrations"


def create_app(overrides: Mapping[str, Any] | None = None) -> Flask:
    """Create the Flask app; settings come from the environment, read now."""
    from flask import Flask

    from poimenconfig import load_config, telemetry_settings
    from workers import registry

    from . import api, enqueue, health, logs, metrics  # noqa: F401 - enqueue registers its hooks
    from .cli import register_cli
    from .console import init_console
    from .errors import register_error_handlers
    from .extensions import db, ping_idle_connections

    app = Flask(__name__)
    app.config.update(load_config())
    if overrides:
        app.config.update(overrides)
    if not app.config.get("SQLALCHEMY_DATABASE_URI"):
        raise RuntimeError(
            "DATABASE_URL is not set. Use `make run`, or "
            "`eval \"$(.venv/bin/poimen-dev env)\"` to point at the embedded services."
        )
    app.json.sort_keys = False
    logs.init_app(app)

    db.init_app(app)
    if app.config.get("POIMEN_DB_PING_IDLE_SECONDS") is not None:
        with app.app_context():
            for engine in db.engines.values():
                ping_idle_connections(engine, app.config["POIMEN_DB_PING_IDLE_SECONDS"])
    celery_init_app(app)
    registry.load_modules(app.config["POIMEN_WORKFLOW_MODULES"])

    app.register_blueprint(api.bp)
    app.register_blueprint(health.bp)
    app.register_blueprint(metrics.bp)
    metrics.init_app(app)
    init_console(app)
    register_error_handlers(app)
    register_cli(app)
    # OpenTelemetry's and Sentry's Flask instrumentation see only what Flask serves: configured
    # by their variables, the fast path stays out; enabled otherwise, it steps aside per request.
    telemetry = telemetry_settings()
    if app.config["POIMEN_ADMISSION_FAST_PATH"] and not (
            telemetry.otlp_endpoint or telemetry.otel_variables or telemetry.sentry_dsn):
        from . import fastpath

        fastpath.install(app)
    return app


def celery_init_app(app: Flask) -> Celery:
    """Create the Celery app for ``app`` (pallets/flask ``examples/celery``).

    Every task runs inside an app context. The web process uses this app only
    to send; the worker (``workers/celery.py``) also imports the tasks.
    """
    from celery import Celery, Task

    from celeryconfig import celery_settings

    from .task_names import REPAIR_RUNS

    class FlaskTask(Task):
        def __call__(self, *args, **kwargs):
            with app.app_context():
                return self.run(*args, **kwargs)

    # control: a revoke of a run id is recorded as the API's cancel when it is issued.
    celery_app = Celery(app.name, task_cls=FlaskTask, control="app.celery_control:RunControl")
    celery_app.config_from_object(celery_settings(app.config["CELERY_BROKER_URL"]))
    if app.config.get("CELERY_BROKER_USE_SSL"):  # rediss:// (poimenconfig.py: redis_ssl_options)
        celery_app.conf.broker_use_ssl = app.config["CELERY_BROKER_USE_SSL"]
    celery_app.conf.update(
        include=["workers.tasks"],
        beat_schedule={
            "repair-stranded-runs": {
                "task": REPAIR_RUNS,
                "schedule": app.config["POIMEN_REPAIR_INTERVAL"],
            }
        },
    )
    celery_app.flask_app = app
    celery_app.set_default()
    app.extensions["celery"] = celery_app
    return celery_app
