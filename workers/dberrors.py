"""Database errors a worker waits out, the rollback that survives a dead connection, and
the session the store's functions are given."""

from __future__ import annotations

from typing import cast

from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.orm import Session

from app.extensions import db


def retryable(err: Exception) -> bool:
    """A database error that says the connection or server went away, not the statement."""
    return isinstance(err, (OperationalError, InterfaceError)) or bool(
        getattr(err, "connection_invalidated", False))


def rollback() -> None:
    """Roll the session back; a dead connection may refuse even this: then drop it.
    Without a session in this app context there is nothing to roll back (a batch worker's
    run often has none: its claim and finish went in the batcher's statements)."""
    try:
        if db.session.registry.has():
            db.session.rollback()
    except Exception:  # noqa: BLE001 - a dead connection may refuse even this
        db.session.remove()


def db_session() -> Session:
    """``db.session`` itself, typed as the store's functions (``app/state/``) take it.

    It is the ``scoped_session``, not the ``Session`` it stands for: it answers every
    ``Session`` method for this app context's session, and ``single_statements`` calls it
    to find that session.
    """
    return cast(Session, db.session)
