"""Claims: at most one live worker executes a run at a time.

Celery delivers at least once, so every delivery first tries to claim the run
in Postgres. The outcome is decided by state and by liveness (``boots``), never
by time:

* ``queued`` -> ``running`` under this boot, in one conditional UPDATE: CLAIMED;
* ``running`` under a live boot (this one or another): DUPLICATE, do nothing;
* ``running`` under a dead boot: wreckage, taken over with a compare-and-set
  on the old boot id: TAKEN_OVER (the attempt is counted);
* terminal: FINISHED, never executed again;
* ``waiting`` (a join step waits for its children): WAITING, nothing to do;
  the last child's finish re-queues it.

This module holds the fenced transitions, the ones a worker makes under its
claim; unfenced ones (admission, cancel, repair) are in ``runs.py`` beside it.

Every later write for the run (release, retry, finish) is fenced by the claim:
``WHERE claimed_by = <this boot>``. A worker that lost its claim (it was cut
off and taken over) finds its writes refused instead of finishing twice.
"""

from __future__ import annotations

import enum
import json
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Row, text
from sqlalchemy.orm import Session

from app.liveness import LIVE_BOOTS_SQL, boot_alive
from app.models import TERMINAL_STATUSES, RunStatus

from .compose import JOIN_RELEASE, WITH_WOKEN, send_woken, with_event
from .runs import finish_requested_cancel


class ClaimOutcome(enum.StrEnum):
    CLAIMED = "claimed"
    TAKEN_OVER = "taken_over"
    DUPLICATE = "duplicate"
    FINISHED = "finished"
    NOT_DUE = "not_due"
    MISSING = "missing"
    CLAIMER_DEAD = "claimer_dead"  # the claiming boot itself lost its lock
    WAITING = "waiting"  # a join waits for children; the last one's finish re-queues it

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
# A claim also returns the pinned definition hash and the run's latest step
# entry (the ledger resumes from it), so starting a run costs no extra read.
# created_at and started_at give the queue wait (poimen_run_queue_wait_seconds).
# traceparent and tracestate: the run's trace context, which its fan-out children inherit
# and its re-sends (a retry, a release) carry.
_CLAIMED_COLUMNS = _RUN_COLUMNS + ", goal_id, definition_hash, created_at, started_at, " \
    "traceparent, tracestate, " \
    "(SELECT to_jsonb(e) FROM step_entries e " \
    "WHERE e.run_id = runs.id ORDER BY e.entry_no DESC LIMIT 1) AS last_entry"

# Liveness is part of every claim: the claiming boot must hold its lock *in
# the same statement*. A process whose lock vanished (Postgres restarted, its
# connection was cut) may not know yet; Postgres does, and refuses.
_CLAIMER_LIVE = f"EXISTS ({LIVE_BOOTS_SQL} WHERE b.boot_id = :boot)"

CLAIM_QUEUED = with_event(
    f"""
    UPDATE runs
       SET status = 'running', claimed_by = :boot, attempt = attempt + 1,
           started_at = coalesce(started_at, now()), updated_at = now()
     WHERE id = :run AND status = 'queued' AND NOT cancel_requested
       AND (not_before IS NULL OR not_before <= now())
       AND {_CLAIMER_LIVE}
    """,
    _CLAIMED_COLUMNS,
    "'run.started'",
    _ATTEMPT,
)

# Wreckage: the holder is dead. A cancelled run ends cancelled instead of being
# resumed; a run that has already outlived max_takeovers workers fails with
# worker_lost (it is probably what kills them: OOM, a segfault); else resume it.
TAKE_OVER = with_event(
    f"""
    UPDATE runs
       SET status = CASE WHEN cancel_requested THEN 'cancelled'
                         WHEN takeovers >= :max_takeovers THEN 'failed'
                         ELSE 'running' END,
           claimed_by = :boot,
           attempt = attempt + CASE WHEN cancel_requested OR takeovers >= :max_takeovers
                                    THEN 0 ELSE 1 END,
           takeovers = takeovers + CASE WHEN cancel_requested OR takeovers >= :max_takeovers
                                        THEN 0 ELSE 1 END,
           error = CASE WHEN NOT cancel_requested AND takeovers >= :max_takeovers
                        THEN jsonb_build_object(
                            'code', 'worker_lost', 'type', 'poimen.WorkerLost',
                            'message', 'the run outlived ' || takeovers || ' lost workers '
                                       || '(max_takeovers); it is not resumed again',
                            'traceback', '')
                        ELSE error END,
           finished_at = CASE WHEN cancel_requested OR takeovers >= :max_takeovers
                              THEN now() ELSE finished_at END,
           updated_at = now()
     WHERE id = :run AND status = 'running' AND claimed_by = :dead AND {_CLAIMER_LIVE}
    """,
    _CLAIMED_COLUMNS + ", status, takeovers, error",
    "CASE status WHEN 'running' THEN 'run.resumed' ELSE 'run.' || status END",
    f"{_ATTEMPT} || jsonb_build_object('previous_boot', CAST(:dead AS text)) || "
    "CASE WHEN status = 'failed' THEN jsonb_build_object('error', error) ELSE '{}' END",
    then=JOIN_RELEASE,  # a child ended worker_lost or cancelled counts for its parent's join
    select=WITH_WOKEN,
)

# The process that lost its lock is still executing the run and registered a
# new boot: it moves its own claim over, unless someone took the run over first.
ADOPT = with_event(
    f"""
    UPDATE runs SET claimed_by = :boot, updated_at = now()
     WHERE id = :run AND status = 'running' AND claimed_by = :dead AND {_CLAIMER_LIVE}
    """,
    _RUN_COLUMNS,
    "'run.adopted'",
    "jsonb_build_object('previous_boot', CAST(:dead AS text))",
)

FINISH = with_event(
    """
    UPDATE runs
       SET status = :status, result = CAST(:result AS jsonb), error = CAST(:error AS jsonb),
           finished_at = now(), updated_at = now(), failures = failures + :failed
     WHERE id = :run AND status = 'running' AND claimed_by = ANY(:boots)
    """,
    _RUN_COLUMNS + ", status",
    "CAST(:event_type AS text)",
    f"{_ATTEMPT} || coalesce(CAST(:event_extra AS jsonb), '{{}}'::jsonb)",
    # A child's finish counts for its parent's join and may re-queue the parent:
    # decided here, in the finish statement (see app/runs.py).
    then=JOIN_RELEASE,
    select=WITH_WOKEN,
)

RELEASE = with_event(
    """
    UPDATE runs SET status = 'queued', claimed_by = NULL, updated_at = now(),
           attempt = attempt - 1
     WHERE id = :run AND status = 'running' AND claimed_by = ANY(:boots)
    """,
    _RUN_COLUMNS,
    "'run.released'",
)

RETRY = with_event(
    """
    UPDATE runs SET status = 'queued', claimed_by = NULL, failures = failures + 1,
           error = CAST(:error AS jsonb), updated_at = now(),
           not_before = now() + make_interval(secs => :delay)
     WHERE id = :run AND status = 'running' AND claimed_by = ANY(:boots)
    """,
    _RUN_COLUMNS,
    "'run.retrying'",
    f"{_ATTEMPT} || jsonb_build_object('delay', CAST(:delay AS float8), "
    "'error', CAST(:error AS jsonb))",
)


# A claim that changed nothing reads why: the run's state and the claimer's liveness.
CLAIM_STATE = text(
    "SELECT status, claimed_by, cancel_requested, workflow_name, workflow_version, "
    f"{_CLAIMER_LIVE} AS claimer_live FROM runs WHERE id = :run")
HOLDER = text("SELECT claimed_by FROM runs WHERE id = :run")


def claim_run(session: Session, run_id: uuid.UUID, boot_id: uuid.UUID, *,
              max_takeovers: Callable[[str, str], int]) -> Claim:
    """Try to claim ``run_id`` for ``boot_id`` in ``session``'s transaction; caller commits.

    ``max_takeovers(name, version)``: how many dead workers a run of that
    workflow may outlive (``workers.registry.max_takeovers_of``).
    """
    row = session.execute(CLAIM_QUEUED, {"run": run_id, "boot": boot_id}).one_or_none()
    if row is not None:
        return Claim(ClaimOutcome.CLAIMED, run_id, boot_id, row.attempt, run=row)

    current = session.execute(CLAIM_STATE, {"run": run_id, "boot": boot_id}).one_or_none()
    if current is None:
        return Claim(ClaimOutcome.MISSING, run_id, boot_id)
    if current.status in TERMINAL_STATUSES:
        return Claim(ClaimOutcome.FINISHED, run_id, boot_id)
    if current.status == RunStatus.WAITING:
        return Claim(ClaimOutcome.WAITING, run_id, boot_id)
    if not current.claimer_live:
        # This process's boot lost its lock: it may claim nothing more.
        return Claim(ClaimOutcome.CLAIMER_DEAD, run_id, boot_id)
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
    row = session.execute(TAKE_OVER, {
        "run": run_id, "boot": boot_id, "dead": holder,
        "max_takeovers": max_takeovers(current.workflow_name, current.workflow_version),
    }).one_or_none()
    if row is None:
        return Claim(ClaimOutcome.DUPLICATE, run_id, boot_id)
    send_woken(session, row)
    if row.status != RunStatus.RUNNING:
        # Cancelled while its worker was lost, or too many workers lost: ended, not resumed.
        return Claim(ClaimOutcome.FINISHED, run_id, boot_id, holder=holder)
    return Claim(ClaimOutcome.TAKEN_OVER, run_id, boot_id, row.attempt, holder=holder, run=row)


class Adoption(enum.StrEnum):
    ADOPTED = "adopted"
    OURS = "ours"  # already moved, or finished, by one of this process's boots
    LOST = "lost"  # another boot took it over, or it ended elsewhere


def adopt_run(session: Session, run_id: uuid.UUID, dead: uuid.UUID, boot_id: uuid.UUID,
              ours: Collection[uuid.UUID]) -> Adoption:
    """Move ``run_id`` from this process's lost boot ``dead`` to its new boot ``boot_id``.

    A compare-and-set on the dead boot, like any takeover, and only for a live
    ``boot_id``: if someone else took the run over meanwhile, it is theirs.
    """
    row = session.execute(ADOPT, {"run": run_id, "boot": boot_id, "dead": dead}).one_or_none()
    if row is not None:
        return Adoption.ADOPTED
    holder = session.execute(HOLDER, {"run": run_id}).scalar_one_or_none()
    return Adoption.OURS if holder in set(ours) else Adoption.LOST


def _fence(boot_id: uuid.UUID | Collection[uuid.UUID]) -> list[uuid.UUID]:
    """The boots whose claim a write accepts: this process's boot(s) for the run."""
    return [boot_id] if isinstance(boot_id, uuid.UUID) else list(boot_id)


def release_claim(session: Session, run_id: uuid.UUID,
                  boot_id: uuid.UUID | Collection[uuid.UUID]) -> bool:
    """Put a run this boot claimed back to ``queued`` (a failure before user code started).

    No user code ran, so the claim's attempt is given back: a rolling deploy that
    bounces a run between workers must not use up its attempts.

    Scoped to the claiming boot: if the claim was taken over meanwhile, this
    changes nothing, so a release can never steal another delivery's claim.
    """
    return session.execute(RELEASE, {"run": run_id, "boots": _fence(boot_id)}
                           ).one_or_none() is not None


def finish_run(
    session: Session,
    run_id: uuid.UUID,
    boot_id: uuid.UUID | Collection[uuid.UUID],
    *,
    status: str,
    result: Any = None,
    error: dict | None = None,
) -> bool:
    """Record a terminal state, fenced by this boot's claim; False if the claim was lost."""
    assert status in TERMINAL_STATUSES
    row = session.execute(FINISH, {
        "run": run_id, "boots": _fence(boot_id), "status": status, "result": _json(result),
        "error": _json(error), "failed": int(status == RunStatus.FAILED),
        "event_type": f"run.{status}", "event_extra": _json({"error": error} if error else None),
    }).one_or_none()
    send_woken(session, row)
    return row is not None


def schedule_retry(session: Session, run_id: uuid.UUID,
                   boot_id: uuid.UUID | Collection[uuid.UUID], *,
                   delay: float, error: dict) -> bool:
    """Return a failed attempt to ``queued`` to run again after ``delay`` seconds (fenced)."""
    row = session.execute(
        RETRY, {"run": run_id, "boots": _fence(boot_id), "delay": delay,
                 "error": _json(error)},
    ).one_or_none()
    return row is not None


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, default=str)
