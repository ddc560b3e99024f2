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


def outbox_rows(source: str, event_type: str, fields: str = "'{}'::jsonb",
                only_if: str = "true", *, run_id: str = "id",
                tenant_id: str = "tenant_id", order_by: str = "") -> str:
    """SQL that appends one event per row of ``source`` (a CTE name) to the outbox.

    For statements that compose several changes in one round trip (the step
    ledger's): put it in a ``WITH`` as ``name AS (<this>)``. ``run_id`` and
    ``tenant_id`` are SQL expressions over ``source``'s columns; ``event_type``
    and ``fields`` as in ``with_event``; ``order_by`` orders several events of
    one statement (their ids follow it).
    """
    return f"""
        INSERT INTO outbox (tenant_id, run_id, event_type, payload)
        SELECT {tenant_id}, {run_id}, {event_type},
               jsonb_build_object('run_id', ({run_id})::text, 'type', {event_type}) || {fields}
          FROM {source}
         WHERE {only_if}
         {f"ORDER BY {order_by}" if order_by else ""}
    """


def with_event(change: str, returning: str, event_type: str, fields: str = "'{}'::jsonb",
               only_if: str = "true", *, before: str = "", then: str = "",
               select: str = "*") -> TextClause:
    """Wrap ``change`` (an INSERT or UPDATE of ``runs``) so it writes its event too.

    ``returning`` is the change's RETURNING list and must include ``id`` and
    ``tenant_id``; ``event_type`` and ``fields`` are SQL expressions over those
    rows (``fields`` a jsonb object); ``only_if`` selects the rows that get an
    event. One statement, one round trip: the event exists iff the change does.
    ``before`` and ``then`` are further CTEs (each ending in a comma / starting
    with one) around ``changed``; ``select`` is the final select list over it.
    """
    return text(
        f"""
        WITH {before} changed AS ({change} RETURNING {returning}),
        event AS ({outbox_rows("changed", event_type, fields, only_if)})
        {then}
        SELECT {select} FROM changed
        """
    )


def outbox_lag(session: Session) -> tuple[int, float]:
    """Return (unpublished events, age in seconds of the oldest one)."""
    pending, oldest = session.execute(
        select(func.count(), func.extract("epoch", func.now() - func.min(OutboxEvent.created_at)))
        .where(OutboxEvent.published_at.is_(None))
    ).one()
    return int(pending), float(oldest or 0)
