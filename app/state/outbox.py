"""The outbox's writes: an event appended in a change's transaction, and the relay's marks.

Statements that change a run append their event inside the same statement
(``compose.with_event``); ``record_event`` is for an event written on its own
in a transaction (the ledger's ``emit``). The relay (``bridge/outbox.py``)
marks what Kafka acknowledged and prunes what was published long ago; its
statements are psycopg's (``%s`` placeholders), since the relay runs without
SQLAlchemy (this module imports no SQLAlchemy at import time, so the relay
stays light).
"""

from __future__ import annotations

import functools
import json
import uuid
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sqlalchemy import TextClause
    from sqlalchemy.orm import Session

INSERT_EVENT = (
    "INSERT INTO outbox (tenant_id, run_id, event_type, payload) "
    "VALUES (:tenant_id, :run_id, :event_type, CAST(:payload AS jsonb))"
)

# The relay: events Kafka acknowledged, by id.
MARK_PUBLISHED = "UPDATE outbox SET published_at = now() WHERE id = ANY(%s::bigint[])"

# The relay: published events older than the retention, a batch at a time.
PRUNE_PUBLISHED = """
DELETE FROM outbox WHERE id IN (
    SELECT id FROM outbox
     WHERE published_at < now() - make_interval(secs => %s)
     ORDER BY published_at
     LIMIT %s
       FOR UPDATE SKIP LOCKED)
"""


def event_payload(run_id: uuid.UUID, event_type: str, **fields: Any) -> dict[str, Any]:
    """Return the stored payload of one event (the shape ``app/events.py`` documents)."""
    return {"run_id": str(run_id), "type": event_type, **fields}


def record_event(
    session: Session, *, tenant_id: int, run_id: uuid.UUID, event_type: str, **fields: Any
) -> None:
    """Append ``event_type`` for ``run_id`` to the outbox in ``session``'s transaction."""
    session.execute(_insert_event(), {
        "tenant_id": tenant_id, "run_id": run_id, "event_type": event_type,
        "payload": json.dumps(event_payload(run_id, event_type, **fields), default=str),
    })


@functools.cache
def _insert_event() -> TextClause:
    from sqlalchemy import text

    return text(INSERT_EVENT)
