"""Run events: the one payload shape, and the relay's lag.

Every state change of a run writes one event row in the transaction of the
change, so an event exists exactly when its change committed. The ``outbox``
relay (``bridge/outbox.py``) ships the rows to Kafka.

One payload shape for every event, stored in ``outbox.payload``::

    {"run_id": "<uuid>", "type": "run.<what>", ...fields of that event}

``run_id`` and ``type`` are always present; the other fields depend on the type
(``attempt`` on claims and finishes, ``error`` on failures, ``workflow_ref`` /
``dispatch_key`` / ``origin`` on admission). The run-state store writes them
(``app/state/``: the ``event`` part of the statement of a change, ``app/state/sql/``,
``outbox.record_event`` on its own).
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from .models import OutboxEvent


def outbox_lag(session: Session) -> tuple[int, float]:
    """Return (unpublished events, age in seconds of the oldest one)."""
    pending, oldest = session.execute(
        select(func.count(), func.extract("epoch", func.now() - func.min(OutboxEvent.created_at)))
        .where(OutboxEvent.published_at.is_(None))
    ).one()
    return int(pending), float(oldest or 0)
