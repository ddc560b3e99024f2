"""Run events, written to the outbox table in the transaction of the change."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import insert
from sqlalchemy.orm import Session

from .models import OutboxEvent


def record_event(
    session: Session, *, tenant_id: int, run_id: uuid.UUID, event_type: str, **payload: Any
) -> None:
    """Append ``event_type`` for ``run_id`` to the outbox in ``session``'s transaction."""
    session.execute(
        insert(OutboxEvent).values(
            tenant_id=tenant_id,
            run_id=run_id,
            event_type=event_type,
            payload={"run_id": str(run_id), "type": event_type, **payload},
        )
    )
