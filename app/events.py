"""Run events: the only writer of the ``outbox`` table.

Every state change of a run writes one event row in the transaction of the
change, so an event exists exactly when its change committed. The ``outbox``
relay (``bridge/outbox.py``) ships the rows to Kafka.

One payload shape for every event, stored in ``outbox.payload``::

    {"run_id": "<uuid>", "type": "run.<what>", ...fields of that event}

``run_id`` and ``type`` are always present; the other fields depend on the type
(``attempt`` on claims and finishes, ``error`` on failures, ``workflow_ref`` /
``dispatch_key`` / ``origin`` on admission). Two ways to write one, both here:
``record_event`` in Python, and ``with_event`` which wraps a SQL statement
that changes a run so its event is inserted by the same statement.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from sqlalchemy import TextClause, func, select, text
from sqlalchemy.orm import Session

from .models import OutboxEvent

_INSERT = text(
    "INSERT INTO outbox (tenant_id, run_id, event_type, payload) "
    "VALUES (:tenant_id, :run_id, :event_type, CAST(:payload AS jsonb))"
)


def event_payload(run_id: uuid.UUID, event_type: str, **fields: Any) -> dict[str, Any]:
    """Return the stored payload of one event (the documented shape above)."""
    return {"run_id": str(run_id), "type": event_type, **fields}


def record_event(
    session: Session, *, tenant_id: int, run_id: uuid.UUID, event_type: str, **fields: Any
) -> None:
    """Append ``event_type`` for ``run_id`` to the outbox in ``session``'s transaction."""
    session.execute(_INSERT, {
        "tenant_id": tenant_id, "run_id": run_id, "event_type": event_type,
        "payload": json.dumps(event_payload(run_id, event_type, **fields), default=str),
    })


def with_event(change: str, returning: str, event_type: str, fields: str = "'{}'::jsonb",
               only_if: str = "true") -> TextClause:
    """Wrap ``change`` (an INSERT or UPDATE of ``runs``) so it writes its event too.

    ``returning`` is the change's RETURNING list and must include ``id`` and
    ``tenant_id``; ``event_type`` and ``fields`` are SQL expressions over those
    rows (``fields`` a jsonb object); ``only_if`` selects the rows that get an
    event. One statement, one round trip: the event exists iff the change does.
    """
    return text(
        f"""
        WITH changed AS ({change} RETURNING {returning}),
        event AS (
            INSERT INTO outbox (tenant_id, run_id, event_type, payload)
            SELECT tenant_id, id, {event_type},
                   jsonb_build_object('run_id', id::text, 'type', {event_type}) || {fields}
              FROM changed
             WHERE {only_if}
        )
        SELECT * FROM changed
        """
    )


def outbox_lag(session: Session) -> tuple[int, float]:
    """Return (unpublished events, age in seconds of the oldest one)."""
    pending, oldest = session.execute(
        select(func.count(), func.extract("epoch", func.now() - func.min(OutboxEvent.created_at)))
        .where(OutboxEvent.published_at.is_(None))
    ).one()
    return int(pending), float(oldest or 0)
