"""The outbox's writes: an event written on its own in a transaction.

Statements that change a run append their event inside the same statement
(``compose.with_event``); ``record_event`` is for an event written on its own
in a transaction (the ledger's ``emit``).

The outbox relay (``bridge/outbox.py``) runs outside the app's lifecycle and
imports nothing of ``app/``, yet its two writes (mark what Kafka acknowledged,
prune what was published long ago) belong here with every other write of the
table. They are database functions whose bodies are the statements below:
migration 0013 installs them (``RELAY_FUNCTIONS``) and the relay calls them by
name (``SELECT poimen_outbox_mark_published(...)``). ``tests/app/test_relay_functions.py``
fails when an installed body drifts from these constants; a change to one needs
a migration that runs ``RELAY_FUNCTIONS`` again.
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


# Events Kafka acknowledged, by id (the function's argument ``ids``).
MARK_PUBLISHED = "UPDATE outbox SET published_at = now() WHERE id = ANY(ids)"

# Published events older than ``retention`` seconds, ``batch`` at a time; answers
# how many went. Rows another pruner holds are skipped, not waited for.
PRUNE_PUBLISHED = """
WITH gone AS (
    DELETE FROM outbox WHERE id IN (
        SELECT id FROM outbox
         WHERE published_at < now() - make_interval(secs => retention)
         ORDER BY published_at
         LIMIT batch
           FOR UPDATE SKIP LOCKED)
    RETURNING 1)
SELECT count(*) FROM gone
"""

# The relay's entry points: name -> (arguments, result, body), installed by migration 0013.
_RELAY = {
    "poimen_outbox_mark_published": ("ids bigint[]", "void", MARK_PUBLISHED),
    "poimen_outbox_prune": ("retention double precision, batch integer", "bigint",
                            PRUNE_PUBLISHED),
}
RELAY_FUNCTION_BODIES = {name: body for name, (_, _, body) in _RELAY.items()}
RELAY_FUNCTIONS = tuple(
    f"CREATE OR REPLACE FUNCTION {name}({arguments}) RETURNS {result} "
    f"LANGUAGE sql AS $body${body}$body$"
    for name, (arguments, result, body) in _RELAY.items())


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
