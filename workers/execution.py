"""Executing one run: claim, run the workflow, finish, all fenced by the claim."""

from __future__ import annotations

import logging
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Any

from flask import current_app
from sqlalchemy import text
from sqlalchemy.exc import DataError

from app.config import libpq_url
from app.enqueue import send_run
from app.extensions import db
from app.models import RunStatus

from . import registry
from .boots import current_boot, end_current_boot
from .claims import (
    Claim,
    ClaimOutcome,
    claim_run,
    finish_run,
    release_claim,
    schedule_retry,
)

log = logging.getLogger(__name__)

TRACEBACK_LIMIT = 4000


class ClaimReleased(RuntimeError):
    """The run failed before its workflow started and went back to ``queued``."""


@dataclass
class RunContext:
    """What a workflow function gets besides its input."""

    run_id: uuid.UUID
    tenant_id: int
    attempt: int
    workflow: registry.Workflow
    boot_id: uuid.UUID
    _cancelled: bool = field(default=False, repr=False)

    @property
    def cancelled(self) -> bool:
        """Whether cancellation was requested (a checkpoint: reads the database)."""
        if not self._cancelled:
            with db.engine.connect() as conn:
                self._cancelled = bool(conn.execute(
                    text("SELECT cancel_requested FROM runs WHERE id = :run"),
                    {"run": self.run_id},
                ).scalar())
        return self._cancelled


def _error_info(err: BaseException) -> dict[str, Any]:
    tb = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    return {"type": f"{type(err).__module__}.{type(err).__qualname__}", "message": str(err),
            "traceback": tb[-TRACEBACK_LIMIT:]}


def boot_dsn() -> str:
    """The database a boot's lock connection uses: the app's, in libpq form."""
    return libpq_url(current_app.config["SQLALCHEMY_DATABASE_URI"])


def execute_run(run_id: str) -> Claim:
    """Execute run ``run_id`` if this delivery wins its claim; return the claim outcome."""
    run_uuid = uuid.UUID(run_id)
    boot = current_boot(boot_dsn)
    session = db.session
    claim = claim_run(session, run_uuid, boot.boot_id)
    session.commit()
    if not claim.outcome.execute:
        level = logging.INFO if claim.outcome != ClaimOutcome.DUPLICATE else logging.WARNING
        log.log(level, "run %s: %s (holder %s); nothing to do", run_id, claim.outcome.value,
                claim.holder)
        return claim
    if claim.outcome == ClaimOutcome.TAKEN_OVER:
        log.warning("run %s: took over from dead boot %s (attempt %s)", run_id, claim.holder,
                    claim.attempt)

    try:
        _run_claimed(claim, boot.boot_id)
    except ClaimReleased:
        raise
    except Exception:
        # We hold a claim we could not release or finish (the database went
        # away mid-run, say). Ending this boot drops its lock, which makes the
        # run wreckage that repair re-sends and the next delivery takes over;
        # keeping the boot would leave the run "running" under a live boot.
        log.exception("run %s: could not record its outcome; ending boot %s", run_id,
                      boot.boot_id)
        db.session.rollback()
        end_current_boot()
        raise
    return claim


def _run_claimed(claim: Claim, boot_id: uuid.UUID) -> None:
    session = db.session
    run_id = claim.run_id
    # Between the claim and user code: any failure releases the claim, scoped
    # to this boot, so the run goes back to queued rather than being stranded.
    row = claim.run
    try:
        workflow = registry.get(row.workflow_name, row.workflow_version)
    except Exception as err:
        session.rollback()
        released = release_claim(session, run_id, boot_id)
        session.commit()
        log.exception("run %s: failed before start; claim released=%s", run_id, released)
        raise ClaimReleased(f"run {run_id} released before start: {err}") from err
    ctx = RunContext(run_id, row.tenant_id, claim.attempt, workflow, boot_id,
                     _cancelled=row.cancel_requested)

    try:
        result = workflow.fn(ctx, row.input)
    except Exception as err:  # noqa: BLE001 - a workflow failure is recorded, not raised
        session.rollback()
        _record_failure(ctx, row.failures, err)
        return

    status = RunStatus.CANCELLED if ctx._cancelled else RunStatus.SUCCEEDED
    try:
        finished = finish_run(session, run_id, boot_id, status=status, result=result)
    except DataError as err:
        # The result itself cannot be stored (jsonb refuses it): a workflow bug,
        # recorded as a failure instead of retried forever.
        session.rollback()
        finished = finish_run(session, run_id, boot_id, status=RunStatus.FAILED, error={
            "type": "poimen.ResultNotStorable",
            "message": f"the workflow's result could not be stored: {err.orig}",
            "traceback": "",
        })
        status = RunStatus.FAILED
    if finished:
        session.commit()
        log.info("run %s: %s (attempt %s)", run_id, status, claim.attempt)
    else:
        session.rollback()
        log.warning("run %s: claim lost before finishing; result discarded", run_id)


def _record_failure(ctx: RunContext, failures: int, err: Exception) -> None:
    session = db.session
    error = _error_info(err)
    workflow = ctx.workflow
    retryable = isinstance(err, workflow.retry_on) and failures + 1 < workflow.max_attempts
    if retryable:
        delay = workflow.retry_delay(failures + 1)
        if schedule_retry(session, ctx.run_id, ctx.boot_id, delay=delay, error=error):
            session.commit()
            log.warning("run %s: %s; retry %s/%s in %.1fs", ctx.run_id, error["type"],
                        failures + 2, workflow.max_attempts, delay)
            send_run(current_app.extensions["celery"], ctx.run_id, workflow.ref,
                     countdown=delay)
            return
    elif finish_run(session, ctx.run_id, ctx.boot_id, status=RunStatus.FAILED, error=error):
        session.commit()
        log.error("run %s: failed: %s: %s", ctx.run_id, error["type"], error["message"])
        return
    session.rollback()
    log.warning("run %s: claim lost before recording failure", ctx.run_id)
