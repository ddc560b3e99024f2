"""Admission: the one function that creates runs.

The HTTP view, a parent run's fan-out and the tests all call ``admit_run``;
nothing else inserts into ``runs``. Exactly-once is decided by the partial
unique index on ``(tenant_id, dispatch_key)``: the insert is ``ON CONFLICT DO
NOTHING RETURNING id`` and a miss reads the row that won. There is no
check-then-insert, so concurrent callers with one key cannot both create.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Row, text
from sqlalchemy.orm import Session

from workers import registry

from .enqueue import enqueue_after_commit
from .events import with_event
from .models import AdmissionOrigin, RunStatus

_ADMIT = with_event(
    """
    INSERT INTO runs (id, tenant_id, workflow_ref, workflow_name, workflow_version, input,
                      goal_id, dispatch_key, status, attempt, failures, cancel_requested,
                      origin, origin_detail, parent_run_id)
    VALUES (:id, :tenant_id, :workflow_ref, :workflow_name, :workflow_version,
            CAST(:input AS jsonb), :goal_id, :dispatch_key, 'queued', 0, 0, false, :origin,
            :origin_detail, :parent_run_id)
    ON CONFLICT (tenant_id, dispatch_key) WHERE dispatch_key IS NOT NULL DO NOTHING
    """,
    "*",
    "'run.admitted'",
    "CAST(:event AS jsonb)",
)


@dataclass(frozen=True)
class Admission:
    """The outcome: the run's row (every column of ``runs``), and whether this call
    created it (else a replay)."""

    run: Row
    created: bool


class AdmissionConflict(Exception):
    """``dispatch_key`` is taken by a run admitted with a different request."""

    def __init__(self, existing: Row, fields: list[str]):
        self.existing = existing
        self.fields = fields
        super().__init__(
            f"dispatch_key {existing.dispatch_key!r} already admitted run {existing.id} "
            f"with a different {', '.join(fields)}"
        )


def _differences(run: Row, workflow_ref: str, input: dict, goal_id: str | None) -> list[str]:
    diffs = []
    if run.workflow_ref != workflow_ref:
        diffs.append("workflow_ref")
    if run.input != input:
        diffs.append("input")
    if run.goal_id != goal_id:
        diffs.append("goal_id")
    return diffs


def admit_run(
    session: Session,
    *,
    tenant_id: int,
    workflow_ref: str,
    input: dict[str, Any],
    goal_id: str | None = None,
    dispatch_key: str | None = None,
    origin: AdmissionOrigin = AdmissionOrigin.INTERNAL,
    origin_detail: str | None = None,
    parent_run_id: uuid.UUID | None = None,
) -> Admission:
    """Admit one run in ``session``'s transaction; the caller commits.

    Without ``dispatch_key`` every call creates a run. With one, the first call
    creates and later identical calls return the same run (re-sending it to
    the workers if it is still queued); a call that differs raises
    ``AdmissionConflict``. Raises ``registry.UnknownWorkflow`` for a bad ref.
    The run is sent to Celery only after the caller's commit succeeds.
    """
    workflow = registry.resolve(workflow_ref)
    run_id = uuid.uuid4()
    origin_value = AdmissionOrigin(origin).value
    values = dict(
        id=run_id,
        tenant_id=tenant_id,
        workflow_ref=workflow_ref,
        workflow_name=workflow.name,
        workflow_version=workflow.version,
        input=input,
        goal_id=goal_id,
        dispatch_key=dispatch_key,
        origin=origin_value,
        origin_detail=origin_detail,
        parent_run_id=parent_run_id,
    )
    event_fields = {
        "workflow_ref": workflow.ref, "goal_id": goal_id, "dispatch_key": dispatch_key,
        "origin": origin_value,
    }
    # One statement, one round trip: the insert that the index may refuse, and
    # the run.admitted outbox event only for a row that was really inserted.
    # (Plain SQL: building this through the ORM cost more CPU than the database.)
    inserted = session.execute(_ADMIT, {
        **values,
        "input": json.dumps(input),
        "event": json.dumps(event_fields),
    }).one_or_none()

    if inserted is not None:
        enqueue_after_commit(session, run_id, workflow.ref)
        return Admission(run=inserted, created=True)

    # The key is taken. Under READ COMMITTED this statement sees the row the
    # conflicting transaction committed (ON CONFLICT waited for it).
    existing = session.execute(
        text("SELECT * FROM runs WHERE tenant_id = :tenant_id AND dispatch_key = :dispatch_key"),
        {"tenant_id": tenant_id, "dispatch_key": dispatch_key},
    ).one()
    diffs = _differences(existing, workflow_ref, input, goal_id)
    if diffs:
        raise AdmissionConflict(existing, diffs)
    if existing.status == RunStatus.QUEUED:
        # Its first message may have been lost; a duplicate is absorbed by claims.
        enqueue_after_commit(
            session, existing.id, f"{existing.workflow_name}@{existing.workflow_version}"
        )
    return Admission(run=existing, created=False)
