"""Liveness and readiness probes."""

from flask import Blueprint, jsonify
from sqlalchemy import text

from .errors import database_unavailable_response
from .extensions import db

bp = Blueprint("health", __name__)


@bp.get("/healthz")
def healthz():
    return jsonify({"status": "ok"})


@bp.get("/readyz")
def readyz():
    try:
        db.session.execute(text("SELECT 1"))
        db.session.rollback()
    except Exception as err:  # noqa: BLE001 - any failure means not ready
        return database_unavailable_response(err)
    return jsonify({"status": "ready"})
