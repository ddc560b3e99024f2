"""What the console reads beyond ``app/run_service.py``: each query scoped to one tenant.

Runs themselves, their step entries and their children come from
``app/run_service.py`` (the API's reads); these are the few views only a person
needs: counts by status, a run's events, the worker boot holding a run.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ..liveness import boot_probe_ages
from ..models import OutboxEvent, Run, RunStatus, WorkerBoot

# A run's events shown on its page; a run with more shows the first ones and says so.
MAX_EVENTS = 500


def status_counts(session: Session, tenant_id: int) -> dict[str, int]:
    """Return ``tenant_id``'s runs per status, every status present (zero included)."""
    counts = dict(session.execute(
        select(Run.status, func.count()).where(Run.tenant_id == tenant_id).group_by(Run.status)
    ).all())
    return {status.value: counts.get(status.value, 0) for status in RunStatus}


def run_events(session: Session, tenant_id: int, run_id: uuid.UUID,
               limit: int = MAX_EVENTS) -> list[OutboxEvent]:
    """Return ``run_id``'s events in the order they were written (the outbox id order).

    Published rows older than the outbox retention are gone from the table
    (``POIMEN_OUTBOX_RETENTION``); Kafka still has them.
    """
    return list(session.scalars(
        select(OutboxEvent)
        .where(OutboxEvent.tenant_id == tenant_id, OutboxEvent.run_id == run_id)
        .order_by(OutboxEvent.id).limit(limit)
    ))


@dataclass(frozen=True)
class Holder:
    """The worker boot a run is claimed by, and whether it is alive now.

    ``probe_age`` is the seconds since a live holder's last probe ended, as
    Postgres saw it (None for a dead holder, or when this role cannot see it).
    """

    boot_id: uuid.UUID
    alive: bool
    hostname: str | None = None
    pid: int | None = None
    started_at: datetime | None = None
    probe_age: float | None = None


def run_holder(session: Session, run: Run) -> Holder | None:
    """Return the boot holding ``run`` (None if unclaimed), live or dead by its lock."""
    if run.claimed_by is None:
        return None
    # Listed only while its lock is held: the liveness check and the age in one read,
    # before anything else in this transaction reads pg_stat_activity.
    probes = boot_probe_ages(session, run.claimed_by)
    alive = bool(probes)
    probe_age = probes[0].age_seconds if probes else None
    boot = session.get(WorkerBoot, run.claimed_by)
    if boot is None:
        return Holder(run.claimed_by, alive, probe_age=probe_age)
    return Holder(boot.boot_id, alive, boot.hostname, boot.pid, boot.started_at, probe_age)
