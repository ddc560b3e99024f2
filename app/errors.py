"""JSON errors with one stable shape: ``{"error": {"code", "message", "details"}}``."""

from __future__ import annotations

import logging
import traceback
from typing import Any

from flask import Flask, jsonify
from sqlalchemy import exc as sa_exc
from werkzeug.exceptions import HTTPException

from .apierror import ApiError  # the error value itself needs no Flask

log = logging.getLogger(__name__)


def error_response(status: int, code: str, message: str, details: Any = None, headers=None):
    # apierror.error_body writes the same bytes for plain JSON details (the admission
    # handler's refusals); jsonify here also takes dates and UUIDs.
    body = {"error": {"code": code, "message": message, "details": details or {}}}
    response = jsonify(body)
    response.status_code = status
    for name, value in (headers or {}).items():
        response.headers[name] = value
    return response


_HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    415: "unsupported_media_type",
    429: "too_many_requests",
}


# Seconds a client should wait before retrying while the database is away.
DATABASE_RETRY_AFTER = 1


def database_unavailable(err: BaseException) -> bool:
    """Whether ``err`` means the database cannot be reached (not that a statement was wrong).

    OperationalError and InterfaceError are what the driver raises for a
    refused, dropped or shutting-down connection (and for other transient
    conditions a retry may clear); a pool checkout timeout means every
    connection is stuck. Constraint violations, bad SQL and the like stay 500s.
    """
    if isinstance(err, (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError)):
        return True
    return isinstance(err, sa_exc.DBAPIError) and err.connection_invalidated


def database_unavailable_response(err: BaseException):
    """503 ``database_unavailable``, the answer of every endpoint while the database is down."""
    reason = type(getattr(err, "orig", None) or err).__name__
    return error_response(503, "database_unavailable", "the database is not reachable; retry",
                          {"reason": reason},
                          headers={"Retry-After": str(DATABASE_RETRY_AFTER)})


def register_error_handlers(app: Flask) -> None:
    @app.errorhandler(ApiError)
    def _api_error(err: ApiError):
        return error_response(err.status, err.code, err.message, err.details, err.headers)

    @app.errorhandler(HTTPException)
    def _http_error(err: HTTPException):
        status = err.code or 500
        message = err.description or err.name
        if status == 413:
            message = f"request body exceeds {app.config['MAX_CONTENT_LENGTH']} bytes"
        headers = None
        if status == 405 and getattr(err, "valid_methods", None):
            # RFC 9110: a 405 says which methods the resource does allow.
            headers = {"Allow": ", ".join(sorted(err.valid_methods))}
        return error_response(status, _HTTP_CODES.get(status, "http_error"), message,
                              headers=headers)

    @app.teardown_appcontext
    def _end_session_despite_a_dead_connection(exc):
        # Runs before Flask-SQLAlchemy's own teardown (registered earlier). If
        # the database went away after the view did its work, the teardown's
        # ROLLBACK fails; the answer the view computed is still right (what was
        # committed is committed, an open transaction dies with the connection),
        # so that failure must not become an HTML 500 from gunicorn.
        from .extensions import db

        try:
            db.session.remove()
        except sa_exc.SQLAlchemyError as err:
            if not database_unavailable(err):
                raise
            log.warning("database connection lost while ending the request's session")
            try:
                db.session.remove()  # its connection is invalidated now: nothing to roll back
            except sa_exc.SQLAlchemyError:
                db.session.registry.clear()

    @app.errorhandler(sa_exc.SQLAlchemyError)
    def _database_error(err: sa_exc.SQLAlchemyError):
        # A database restart, failover or outage is the service being
        # unavailable, not a bug: 503 with the usual shape, so clients (the
        # inbox among them) retry instead of treating it as a server fault.
        if database_unavailable(err):
            orig = getattr(err, "orig", None)
            log.warning("database unavailable: %s (SQLSTATE %s)", type(orig or err).__name__,
                        getattr(orig, "sqlstate", None))
            return database_unavailable_response(err)
        return _unexpected(err)

    @app.errorhandler(Exception)
    def _unexpected(err: Exception):
        # Types and stack only: exception messages quote data (Postgres repeats the
        # value it refused), and run inputs must never reach the log.
        # The stack goes in the record's own fields (``exc_type``, ``traceback``: one
        # JSON object under LOG_FORMAT=json, appended in text), not in its message.
        exc_type = f"{type(err).__module__}.{type(err).__qualname__}"
        log.error("unhandled error (%s)", exc_type,
                  extra={"exc_type": exc_type, "traceback": _stack_without_messages(err)})
        return error_response(500, "internal_error", "internal server error")


def _stack_without_messages(err: BaseException | None) -> str:
    """Format ``err`` and its causes as a traceback without the exceptions' messages."""
    parts = []
    while err is not None and len(parts) < 10:
        code = getattr(getattr(err, "orig", None), "sqlstate", None)
        parts.append("".join(traceback.format_tb(err.__traceback__))
                     + f"{type(err).__module__}.{type(err).__qualname__}"
                     + (f" (SQLSTATE {code})" if code else ""))
        err = err.__cause__ or err.__context__
    return "\ncaused by:\n".join(parts)
