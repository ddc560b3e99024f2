"""Send runs to Celery only after the transaction that admitted them commits.

A message sent before commit can reach a worker before the row is visible (or
for a row that is then rolled back); a message sent after a failed commit runs
nothing. So admission only *registers* the run on the session, and these hooks
send on ``after_commit`` and forget on ``after_rollback``. A send that fails
after commit strands nothing: ``beat`` re-sends queued runs, and a replay of
the run's key re-sends it too (workers' claims absorb duplicates).
"""

from __future__ import annotations

import logging
import uuid

from flask import current_app
from sqlalchemy import event
from sqlalchemy.orm import Session

from .task_names import EXECUTE_RUN

log = logging.getLogger(__name__)

_PENDING = "poimen_pending_enqueue"


def enqueue_after_commit(session: Session, run_id: uuid.UUID, workflow_ref: str) -> None:
    """Send ``run_id`` to the workers once ``session``'s transaction commits."""
    session.info.setdefault(_PENDING, {})[run_id] = workflow_ref


def send_run(celery_app, run_id: uuid.UUID, workflow_ref: str, countdown: float | None = None) -> bool:
    """Publish one ``runs.execute`` message; task id = run id so Flower shows the run."""
    try:
        celery_app.send_task(
            EXECUTE_RUN,
            args=[str(run_id)],
            task_id=str(run_id),
            countdown=countdown,
            # Shown by Flower next to the task: which workflow this run is.
            shadow=f"{EXECUTE_RUN}[{workflow_ref}]",
        )
        return True
    except Exception:  # noqa: BLE001 - the broker is down; beat repairs queued runs
        log.exception("could not enqueue run %s; beat will re-send it", run_id)
        return False


@event.listens_for(Session, "after_commit")
def _send_after_commit(session: Session) -> None:
    pending = session.info.pop(_PENDING, None)
    if not pending:
        return
    celery_app = current_app.extensions["celery"]
    for run_id, workflow_ref in pending.items():
        send_run(celery_app, run_id, workflow_ref)


@event.listens_for(Session, "after_rollback")
def _forget_after_rollback(session: Session) -> None:
    # Fires on the real database rollback only, not on a savepoint's.
    session.info.pop(_PENDING, None)
