"""Claims: at most one live worker executes a run at a time.

Celery delivers at least once, so every delivery first tries to claim the run
in Postgres. The outcome is decided by state and by liveness (``boots``), never
by time:

* ``queued`` -> ``running`` under this boot, in one conditional UPDATE: CLAIMED;
* ``running`` under a live boot (this one or another): DUPLICATE, do nothing;
* ``running`` under a dead boot: wreckage, taken over with a compare-and-set
  on the old boot id: TAKEN_OVER (the attempt is counted);
* terminal: FINISHED, never executed again.

This module holds only the fenced transitions, the ones a worker makes under
its claim; unfenced ones (cancel, repair) are in ``app/runs.py``.

Every later write for the run (release, retry, finish) is fenced by the claim:
``WHERE claimed_by = <this boot>``. A worker that lost its claim (it was cut
off and taken over) finds its writes refused instead of finishing twice.
"""

from __future__ import annotations

import enum
import json
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Row, text
from sqlalchemy.orm import Session

from app.events import with_event
from app.liveness import boot_alive
from app.models import TERMINAL_STATUSES, RunStatus
from app.runs import finish_requested_cancel


class ClaimOutcome(enum.StrEnum):
    CLAIMED = "claimed"
    TAKEN_OVER = "taken_over"
    DUPLICATE = "duplicate"
    FINISHED = "finished"
    NOT_DUE = "not_due"
    MISSING = "missing"

    @property
    def execute(self) -> bool:
        return self in (ClaimOutcome.CLAIMED, ClaimOutcome.TAKEN_OVER)


@dataclass(frozen=True)
class Claim:
    outcome: ClaimOutcome
    run_id: uuid.UUID
    boot_id: uuid.UUID
    attempt: int | None = None
    holder: uuid.UUID | None = None  # the boot that holds it, for a DUPLICATE
    run: Row | None = None  # the claimed run's row (see _RUN_COLUMNS), when claimed


# What a claim returns: everything the worker needs to run the workflow, so
# executing a run costs no extra read.
_RUN_COLUMNS = "id, tenant_id, attempt, workflow_name, workflow_version, input, failures, " \
    "cancel_requested"
_ATTEMPT = "jsonb_build_object('attempt', attempt)"


_CLAIM_QUEUED = with_event(
    """
    UPDATE runs
       SET status = 'running', claimed_by = :boot, attempt = attempt + 1,
           started_at = coalesce(started_at, now()), updated_at = now()
     WHERE id = :run AND status = 'queued' AND NOT cancel_requested
       AND (not_before IS NULL OR not_before <= now())
    """,
    _RUN_COLUMNS,
    "'run.started'",
    _ATTEMPT,
)

_TAKE_OVER = with_event(
    """
    UPDATE runs
       SET claimed_by = :boot, attempt = attempt + 1, updated_at = now()
     WHERE id = :run AND status = 'running' AND claimed_by = :dead
    """,
    _RUN_COLUMNS,
    "'run.resumed'",
    f"{_ATTEMPT} || jsonb_build_object('previous_boot', CAST(:dead AS text))",
)

_FINISH = with_event(
    """
    UPDATE runs
       SET status = :status, result = CAST(:result AS jsonb), error = CAST(:error AS jsonb),
           finished_at = now(), updated_at = now(), failures = failures + :failed
     WHERE id = :run AND status = 'running' AND claimed_by = :boot
    """,
    _RUN_COLUMNS,
    "CAST(:event_type AS text)",
    f"{_ATTEMPT} || coalesce(CAST(:event_extra AS jsonb), '{{}}'::jsonb)",
)

_RELEASE = with_event(
    """
    UPDATE runs SET status = 'queued', claimed_by = NULL, updated_at = now()
     WHERE id = :run AND status = 'running' AND claimed_by = :boot
    """,
    _RUN_COLUMNS,
    "'run.released'",
)

_RETRY = with_event(
    """
    UPDATE runs SET status = 'queued', claimed_by = NULL, failures = failures + 1,
           error = CAST(:error AS jsonb), updated_at = now(),
           not_before = now() + make_interval(secs => :delay)
     WHERE id = :run AND status = 'running' AND claimed_by = :boot
    """,
    _RUN_COLUMNS,
    "'run.retrying'",
    f"{_ATTEMPT} || jsonb_build_object('delay', CAST(:delay AS float8), "
    "'error', CAST(:error AS jsonb))",
)


def claim_run(session: Session, run_id: uuid.UUID, boot_id: uuid.UUID) -> Claim:
    """Try to claim ``run_id`` for ``boot_id`` in ``session``'s transaction; caller commits."""
    row = session.execute(_CLAIM_QUEUED, {"run": run_id, "boot": boot_id}).one_or_none()
    if row is not None:
        return Claim(ClaimOutcome.CLAIMED, run_id, boot_id, row.attempt, run=row)

    current = session.execute(
        text("SELECT status, claimed_by, cancel_requested, not_before > now() AS early "
             "FROM runs WHERE id = :run"),
        {"run": run_id},
    ).one_or_none()
    if current is None:
        return Claim(ClaimOutcome.MISSING, run_id, boot_id)
    if current.status in TERMINAL_STATUSES:
        return Claim(ClaimOutcome.FINISHED, run_id, boot_id)
    if current.status == RunStatus.QUEUED:
        if current.cancel_requested:
            finish_requested_cancel(session, run_id)
            return Claim(ClaimOutcome.FINISHED, run_id, boot_id)
        # A retry scheduled for later (its own delayed message will come), or a
        # row another delivery claimed and released between our two statements.
        return Claim(ClaimOutcome.NOT_DUE, run_id, boot_id)

    holder = current.claimed_by
    if holder == boot_id or boot_alive(session, holder):
        return Claim(ClaimOutcome.DUPLICATE, run_id, boot_id, holder=holder)

    # The holder is dead (its lock is gone, and a dead boot never comes back):
    # take the wreckage over, unless another delivery beat us to it.
    row = session.execute(_TAKE_OVER, {"run": run_id, "boot": boot_id, "dead": holder}
                          ).one_or_none()
    if row is None:
        return Claim(ClaimOutcome.DUPLICATE, run_id, boot_id)
    return Claim(ClaimOutcome.TAKEN_OVER, run_id, boot_id, row.attempt, holder=holder, run=row)


def release_claim(session: Session, run_id: uuid.UUID, boot_id: uuid.UUID) -> bool:
    """Put a run this boot claimed back to ``queued`` (a failure before user code started).

    Scoped to the claiming boot: if the claim was taken over meanwhile, this
    changes nothing, so a release can never steal another delivery's claim.
    """
    return session.execute(_RELEASE, {"run": run_id, "boot": boot_id}).one_or_none() is not None


def finish_run(
    session: Session,
    run_id: uuid.UUID,
    boot_id: uuid.UUID,
    *,
    status: str,
    result: Any = None,
    error: dict | None = None,
) -> bool:
    """Record a terminal state, fenced by this boot's claim; False if the claim was lost."""
    assert status in TERMINAL_STATUSES
    row = session.execute(_FINISH, {
        "run": run_id, "boot": boot_id, "status": status, "result": _json(result),
        "error": _json(error), "failed": int(status == RunStatus.FAILED),
        "event_type": f"run.{status}", "event_extra": _json({"error": error} if error else None),
    }).one_or_none()
    return row is not None


def schedule_retry(session: Session, run_id: uuid.UUID, boot_id: uuid.UUID, *,
                   delay: float, error: dict) -> bool:
    """Return a failed attempt to ``queued`` to run again after ``delay`` seconds (fenced)."""
    row = session.execute(
        _RETRY, {"run": run_id, "boot": boot_id, "delay": delay, "error": _json(error)},
    ).one_or_none()
    return row is not None


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, default=str)
