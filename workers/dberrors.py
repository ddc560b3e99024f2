"""Database errors a worker waits out, and the rollback that survives a dead connection."""

from __future__ import annotations

from sqlalchemy.exc import InterfaceError, OperationalError

from app.extensions import db


def retryable(err: Exception) -> bool:
    """A database error that says the connection or server went away, not the statement."""
    return isinstance(err, (OperationalError, InterfaceError)) or bool(
        getattr(err, "connection_invalidated", False))


def rollback() -> None:
    """Roll the session back; a dead connection may refuse even this: then drop it."""
    try:
        db.session.rollback()
    except Exception:  # noqa: BLE001 - a dead connection may refuse even this
        db.session.remove()
