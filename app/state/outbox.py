"""The outbox's writes: an event written on its own in a transaction.

Statements that change a run append their event inside the same statement (their
``event`` part, ``sql/README.md``); ``record_event`` is for an event written on its own
in a transaction (the ledger's ``emit``).

The outbox relay (``bridge/outbox.py``) runs outside the app's lifecycle and
imports nothing of ``app/``, yet its two writes (mark what Kafka acknowledged,
prune what was published long ago) belong here with every other write of the
table. They are database functions written whole in ``sql/outbox.sql``:
migration 0013 installs them (``RELAY_FUNCTIONS``) and the relay calls them by
name (``SELECT poimen_outbox_mark_published(...)``). ``tests/app/test_relay_functions.py``
fails when an installed body drifts from the file; a change to one needs
a migration that runs ``RELAY_FUNCTIONS`` again.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from .executor import Executor
from .statements import function, statement

INSERT_EVENT = statement("insert_event")

# The relay's entry points, installed by migration 0013 from their blocks in
# ``sql/outbox.sql``: name -> the statement that installs it, and its body.
_RELAY = tuple(function(name) for name in ("poimen_outbox_mark_published",
                                           "poimen_outbox_prune"))
RELAY_FUNCTIONS = tuple(f.create for f in _RELAY)
RELAY_FUNCTION_BODIES = {f.name: f.body for f in _RELAY}
# Events Kafka acknowledged, by id (the function's argument ``ids``).
MARK_PUBLISHED = RELAY_FUNCTION_BODIES["poimen_outbox_mark_published"]
# Published events older than ``retention`` seconds, ``batch`` at a time.
PRUNE_PUBLISHED = RELAY_FUNCTION_BODIES["poimen_outbox_prune"]


def event_payload(run_id: uuid.UUID, event_type: str, **fields: Any) -> dict[str, Any]:
    """Return the stored payload of one event (the shape ``app/events.py`` documents)."""
    return {"run_id": str(run_id), "type": event_type, **fields}


def record_event(
    session: Executor, *, tenant_id: int, run_id: uuid.UUID, event_type: str, **fields: Any
) -> None:
    """Append ``event_type`` for ``run_id`` to the outbox in ``session``'s transaction."""
    session.execute(INSERT_EVENT, {
        "tenant_id": tenant_id, "run_id": run_id, "event_type": event_type,
        "payload": json.dumps(event_payload(run_id, event_type, **fields), default=str),
    })
