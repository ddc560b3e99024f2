"""The Poimen web application."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from flask import Flask

from .config import load_config


def create_app(overrides: Mapping[str, Any] | None = None) -> Flask:
    """Create the Flask app; settings come from the environment, read now."""
    from workers import registry
    from workers.celery_app import celery_init_app

    from . import api, enqueue, health, metrics  # noqa: F401 - enqueue registers its hooks
    from .cli import register_cli
    from .errors import register_error_handlers
    from .extensions import db, migrate

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
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    db.init_app(app)
    migrate.init_app(app, db, directory=_migrations_dir())
    celery_init_app(app)
    registry.load_modules(app.config["POIMEN_WORKFLOW_MODULES"])

    app.register_blueprint(api.bp)
    app.register_blueprint(health.bp)
    app.register_blueprint(metrics.bp)
    register_error_handlers(app)
    register_cli(app)
    return app


def _migrations_dir() -> str:
    from pathlib import Path

    return str(Path(__file__).resolve().parent.parent / "migrations")
