"""The outbox's writes: an event written on its own in a transaction.

Statements that change a run append their event inside the same statement
(``compose.with_event``); ``record_event`` is for an event written on its own
in a transaction (the ledger's ``emit``). The one other writer of the table is
the outbox relay (``bridge/outbox.py``), outside the app's lifecycle: it marks
what Kafka acknowledged and prunes what was published long ago, never a run's
state (``tests/test_state_store.py`` names exactly those two statements).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

INSERT_EVENT = text(
    "INSERT INTO outbox (tenant_id, run_id, event_type, payload) "
    "VALUES (:tenant_id, :run_id, :event_type, CAST(:payload AS jsonb))"
)


def event_payload(run_id: uuid.UUID, event_type: str, **fields: Any) -> dict[str, Any]:
    """Return the stored payload of one event (the shape ``app/events.py`` documents)."""
    return {"run_id": str(run_id), "type": event_type, **fields}


def record_event(
    session: Session, *, tenant_id: int, run_id: uuid.UUID, event_type: str, **fields: Any
) -> None:
    """Append ``event_type`` for ``run_id`` to the outbox in ``session``'s transaction."""
    session.execute(INSERT_EVENT, {
        "tenant_id": tenant_id, "run_id": run_id, "event_type": event_type,
        "payload": json.dumps(event_payload(run_id, event_type, **fields), default=str),
    })
