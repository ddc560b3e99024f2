"""Executing one run: claim, dispatch its step entries (``ledger.py``), finish; all fenced."""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import os
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from celery.exceptions import Retry as CeleryRetry
from flask import current_app
from psycopg import Error as psycopg_errors
from sqlalchemy import text
from sqlalchemy.exc import DataError, InterfaceError, OperationalError
from sqlalchemy.orm import Session

from app.config import libpq_url
from app.enqueue import send_run
from app.extensions import autocommit_next, db
from app.logs import note_tenant
from app.metrics import CLAIMS, QUEUE_WAIT_SECONDS, RUN_DURATION_SECONDS
from app.models import TERMINAL_STATUSES, RunStatus
from logconfig import quiet_traceback

from . import boots, ledger, registry
from .boots import current_boot, end_current_boot
from .claims import (
    Adoption,
    Claim,
    ClaimOutcome,
    adopt_run,
    claim_run,
    finish_run,
    release_claim,
    schedule_retry,
)

log = logging.getLogger(__name__)


class ClaimReleased(RuntimeError):
    """The run failed before its workflow started and went back to ``queued``."""


class RunEnding(enum.StrEnum):
    """How one execution of a claimed run ended (what Celery is told: ``workers/tasks.py``)."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    RETRYING = "retrying"  # queued again; its delayed message is sent
    WAITING = "waiting"  # a join: the last child's finish re-queues it
    RELEASED = "released"  # given back before its workflow started (a version it lacks)
    LOST = "lost"  # the claim was lost: nothing of this execution was recorded


@dataclass(frozen=True)
class Ended:
    status: RunEnding
    code: str | None = None  # FAILED: the error's code (or type); never its message
    delay: float | None = None  # RETRYING: seconds until the next attempt


@dataclass
class RunContext:
    """What a workflow function gets besides its input."""

    run_id: uuid.UUID
    tenant_id: int
    attempt: int
    workflow: registry.Workflow
    boot_id: uuid.UUID
    _cancelled: bool = field(default=False, repr=False)
    # Workflow exceptions recorded before this attempt (a Celery task's self.request.retries).
    failures: int = 0

    @property
    def cancelled(self) -> bool:
        """Whether cancellation was requested (a checkpoint: reads the database).

        While the database is unreachable the answer is the last one known: a
        restart of Postgres must not fail the runs that happen to ask.
        """
        if not self._cancelled:
            try:
                with db.engine.connect() as conn:
                    self._cancelled = bool(conn.execute(
                        text("SELECT cancel_requested FROM runs WHERE id = :run"),
                        {"run": self.run_id},
                    ).scalar())
            except Exception as err:  # noqa: BLE001
                if not _retryable(err):
                    raise
        return self._cancelled

    @property
    def shutting_down(self) -> bool:
        """Whether this worker got SIGTERM (a deploy): a long workflow may checkpoint."""
        try:
            from .shutdown import shutting_down
        except ImportError:
            return False
        return shutting_down()


def boot_dsn() -> str:
    """The database a boot's lock connection uses, in libpq form.

    ``POIMEN_LOCK_DATABASE_URL`` when set (a direct URL when ``DATABASE_URL``
    goes through a pooler), else the app's database.
    """
    return libpq_url(current_app.config.get("POIMEN_LOCK_DATABASE_URL")
                     or current_app.config["SQLALCHEMY_DATABASE_URI"])


def execute_run(run_id: str) -> Claim:
    """Execute run ``run_id`` if this delivery wins its claim; return the claim outcome.

    A claim that was executed carries how the execution ended (``claim.ended``).
    """
    run_uuid = uuid.UUID(run_id)
    _watch_boots()
    claim = _claim(run_uuid)
    observe_claim(claim)
    if not claim.outcome.execute:
        level = logging.INFO if claim.outcome != ClaimOutcome.DUPLICATE else logging.WARNING
        log.log(level, "run %s: %s (holder %s); nothing to do", run_id, claim.outcome.value,
                claim.holder)
        return claim
    if claim.outcome == ClaimOutcome.TAKEN_OVER:
        log.warning("run %s: took over from dead boot %s (attempt %s)", run_id, claim.holder,
                    claim.attempt)

    boots.hold(run_uuid, claim.boot_id)
    started = time.monotonic()
    try:
        ended = _run_claimed(claim)
    except ClaimReleased:
        raise
    except Exception:
        # We hold a claim we could not release or finish (the database stayed
        # away longer than POIMEN_RECORD_RETRY_SECONDS, say). Ending this boot
        # drops its lock, which makes the run wreckage that repair re-sends and
        # the next delivery takes over; keeping the boot would leave the run
        # "running" under a live boot.
        log.exception("run %s: could not record its outcome; ending boot %s", run_id,
                      claim.boot_id)
        _rollback()
        end_current_boot()
        raise
    finally:
        boots.let_go([run_uuid])
    RUN_DURATION_SECONDS.labels(claim.run.workflow_name,
                                getattr(ended, "status", "unknown")).observe(
        time.monotonic() - started)
    return dataclasses.replace(claim, ended=ended)


def observe_claim(claim: Claim) -> None:
    """Count the claim's outcome; a run's first start observes its queue wait."""
    CLAIMS.labels(claim.outcome.value).inc()
    row = claim.run
    if row is None:
        return
    note_tenant(row.tenant_id)
    if claim.outcome == ClaimOutcome.CLAIMED and claim.attempt == 1 \
            and row.started_at is not None and row.created_at is not None:
        QUEUE_WAIT_SECONDS.labels(row.workflow_name).observe(
            max(0.0, (row.started_at - row.created_at).total_seconds()))


def _claim(run_id: uuid.UUID) -> Claim:
    session = db.session
    for _ in range(2):
        boot = current_boot(boot_dsn)
        try:
            # Every path of a claim writes at most one statement (the claim, a
            # takeover, a cancelled run's end), each whole on its own, so the
            # claim runs in autocommit: one round trip instead of BEGIN,
            # statement, COMMIT. Its commit is still inside this try.
            autocommit_next(session)
            claim = claim_run(session, run_id, boot.boot_id)
            session.commit()
        except Exception:
            # The claim's outcome is unknown: its commit may have been applied
            # with the acknowledgement lost. Ending the boot makes any claim it
            # did take wreckage (repair re-sends it, the next delivery takes it
            # over) instead of a run stranded under a live boot that answers
            # "duplicate" forever.
            log.exception("run %s: claim outcome unknown; ending boot %s", run_id, boot.boot_id)
            _rollback()
            end_current_boot()
            raise
        if claim.outcome != ClaimOutcome.CLAIMER_DEAD:
            return claim
        # Postgres says our lock is gone before our watchdog did: start a new boot.
        log.warning("boot %s lost its lock (seen at claim); registering a new boot",
                    boot.boot_id)
        boot.mark_lost()
    return claim


def _rollback() -> None:
    try:
        db.session.rollback()
    except Exception:  # noqa: BLE001 - a dead connection may refuse even this
        db.session.remove()


def _retryable(err: Exception) -> bool:
    """A database error that says the connection or server went away, not the statement."""
    return isinstance(err, (OperationalError, InterfaceError)) or bool(
        getattr(err, "connection_invalidated", False))


def commit_fenced(run_id: uuid.UUID,
                  write: Callable[[Session, list[uuid.UUID], bool], tuple[bool, Any]]) -> Any:
    """Make fenced writes for ``run_id`` in one transaction; return what ``write`` says.

    ``write(session, ours, retrying)`` returns ``(commit, value)``: the
    transaction is committed or rolled back accordingly. The fence ``ours`` is
    every boot of this process that held the run (a lost boot's run adopted
    by our new boot stays ours). While the database is unreachable (a restart,
    a failover) the write is retried for POIMEN_RECORD_RETRY_SECONDS: a
    finished run must not be executed again because a pooled connection was
    stale. ``retrying`` tells ``write`` that an earlier try's commit may have
    applied with its reply lost, so it can recognise its own write.
    """
    deadline = time.monotonic() + current_app.config["POIMEN_RECORD_RETRY_SECONDS"]
    retrying = False
    delay = 0.2
    while True:
        session = db.session
        try:
            commit, value = write(session, boots.holders(run_id), retrying)
            if commit:
                session.commit()
            else:
                session.rollback()
            return value
        except Exception as err:
            _rollback()
            if not _retryable(err) or time.monotonic() > deadline:
                raise
            retrying = True
            log.warning("run %s: database unreachable while recording (%s); retrying",
                        run_id, type(err).__name__)
            time.sleep(delay)
            delay = min(2.0, delay * 2)


def _record(run_id: uuid.UUID, write: Callable[[Session, list[uuid.UUID]], bool],
            already_done: Callable[[Any], bool]) -> bool:
    """Make one fenced write for ``run_id`` and commit it; False if the claim was lost.

    When an earlier try's commit may have applied with its reply lost,
    ``already_done(row)`` recognises our own write.
    """
    def attempt(session: Session, ours: list[uuid.UUID], retrying: bool) -> tuple[bool, bool]:
        if write(session, ours):
            return True, True
        row = session.execute(
            text("SELECT status, claimed_by FROM runs WHERE id = :run"), {"run": run_id}
        ).one_or_none()
        now_ours = boots.holders(run_id)
        if (row is not None and row.status == RunStatus.RUNNING
                and row.claimed_by in now_ours and row.claimed_by not in ours):
            # Our watchdog adopted the run for a new boot while we wrote: write again.
            return (True, True) if write(session, now_ours) else (False, False)
        return False, retrying and row is not None and already_done(row)

    return commit_fenced(run_id, attempt)


def _await_new_boot(run_id: uuid.UUID, dead: uuid.UUID) -> uuid.UUID:
    """Return the live boot that adopted ``run_id`` after this process's boot ``dead`` died.

    The boot watchdog notices the loss and adopts the run (``_adopt_runs``), or
    the process exits because another worker took the run over; wait for that.
    """
    deadline = time.monotonic() + current_app.config["POIMEN_RECORD_RETRY_SECONDS"]
    while True:
        try:
            current = current_boot(boot_dsn)
        except Exception as err:  # noqa: BLE001 - Postgres may still be restarting
            if not _retryable(err) and not isinstance(err, psycopg_errors):
                raise
            current = None
        if current is not None and current.boot_id != dead \
                and current.boot_id in boots.holders(run_id):
            return current.boot_id
        if time.monotonic() > deadline:
            raise RuntimeError(f"run {run_id}: no live boot adopted it after boot {dead} died")
        time.sleep(0.1)


FENCING = ledger.Fencing(
    commit=commit_fenced,
    claimer=lambda: current_boot(boot_dsn).boot_id,
    await_new_boot=_await_new_boot,
)


def _finished_by_us(run_id: uuid.UUID) -> Callable[[Any], bool]:
    return lambda row: row.status in TERMINAL_STATUSES and row.claimed_by in boots.holders(run_id)


def _requeued(row) -> bool:
    return row.status == RunStatus.QUEUED


def _run_claimed(claim: Claim) -> Ended:
    run_id = claim.run_id
    # Between the claim and user code: any failure releases the claim, scoped
    # to this boot, so the run goes back to queued rather than being stranded.
    row = claim.run
    try:
        workflow = registry.get(row.workflow_name, row.workflow_version)
    except registry.UnknownWorkflow:
        # A rolling deploy: the run is pinned to a version this worker does not
        # have (yet, or any more). Give it back, uncounted, and send it again a
        # little later for a worker that has it.
        _rollback()
        ref = f"{row.workflow_name}@{row.workflow_version}"
        if _record(run_id, lambda s, ours: release_claim(s, run_id, ours), _requeued):
            delay = random.uniform(1.0, 3.0)
            log.warning("run %s: pinned to %s, which this worker does not have; released "
                        "and re-sent in %.1fs for a worker that does", run_id, ref, delay)
            send_run(current_app.extensions["celery"], run_id, ref, countdown=delay)
            return Ended(RunEnding.RELEASED, delay=delay)
        return Ended(RunEnding.LOST)
    except Exception as err:
        _rollback()
        released = _record(run_id, lambda s, ours: release_claim(s, run_id, ours), _requeued)
        log.exception("run %s: failed before start; claim released=%s", run_id, released)
        raise ClaimReleased(f"run {run_id} released before start: {err}") from err
    ctx = RunContext(run_id, row.tenant_id, claim.attempt, workflow, claim.boot_id,
                     _cancelled=row.cancel_requested, failures=row.failures)

    # The ledger dispatcher executes the steps; the last entry is closed here,
    # in the transaction that finishes (or retries) the run.
    outcome = ledger.dispatch(ctx, row, FENCING)
    _rollback()
    if outcome.ending == ledger.Ending.WAITING:
        log.info("run %s: waiting for its children (attempt %s)", run_id, claim.attempt)
        return Ended(RunEnding.WAITING)
    if outcome.ending == ledger.Ending.LOST:
        log.warning("run %s: claim lost while executing its steps; stopped", run_id)
        return Ended(RunEnding.LOST)
    close = outcome.close
    if outcome.ending == ledger.Ending.FAILED:
        if outcome.exc is not None:
            return _record_failure(ctx, row.failures, outcome.exc, close, outcome.error)
        return _finish_failed(ctx, outcome.error, close)

    status = RunStatus.CANCELLED if ctx._cancelled else RunStatus.SUCCEEDED
    result = outcome.result
    try:
        finished = _record(run_id, lambda s, ours: _closed(s, ours, close) and finish_run(
            s, run_id, ours, status=status, result=result), _finished_by_us(run_id))
    except DataError as err:
        # The result itself cannot be stored (jsonb refuses it): a workflow bug,
        # recorded as a failure instead of retried forever.
        _rollback()
        error = {
            "type": "poimen.ResultNotStorable",
            "message": f"the workflow's result could not be stored: {err.orig}",
            "traceback": "",
        }
        bare = close.without_outputs(error) if close is not None else None
        finished = _record(run_id, lambda s, ours: _closed(s, ours, bare) and finish_run(
            s, run_id, ours, status=RunStatus.FAILED, error=error), _finished_by_us(run_id))
        status = RunStatus.FAILED
    if not finished:
        log.warning("run %s: claim lost before finishing; result discarded", run_id)
        return Ended(RunEnding.LOST)
    log.info("run %s: %s (attempt %s)", run_id, status, claim.attempt)
    if status == RunStatus.FAILED:
        return Ended(RunEnding.FAILED, code="result_not_storable")
    return Ended(RunEnding(str(status)))


def _closed(session: Session, ours: list[uuid.UUID], close) -> bool:
    """Close the run's last step entry in the caller's transaction (True if none to close)."""
    return close is None or close(session, ours)


def _finish_failed(ctx: RunContext, error: dict, close) -> Ended:
    run_id = ctx.run_id
    code = error.get("code", error.get("type"))
    if _record(run_id, lambda s, ours: _closed(s, ours, close) and finish_run(
            s, run_id, ours, status=RunStatus.FAILED, error=error), _finished_by_us(run_id)):
        # The error's type, not its message: a message may quote the run's input
        # (GET /v1/runs/<id> shows the whole error to the tenant).
        log.error("run %s: failed: %s", run_id, code)
        return Ended(RunEnding.FAILED, code=code)
    log.warning("run %s: claim lost before recording failure", run_id)
    return Ended(RunEnding.LOST)


def _record_failure(ctx: RunContext, failures: int, err: Exception, close=None,
                    error: dict | None = None) -> Ended:
    error = error or ledger.error_info(err)
    workflow = ctx.workflow
    run_id = ctx.run_id
    retryable = isinstance(err, workflow.retry_on) and failures + 1 < workflow.max_attempts
    # One record with the traceback: frames and exception types only, since a
    # message may quote the run's input.
    log.log(logging.WARNING if retryable else logging.ERROR, "run %s: attempt %s raised %s",
            run_id, ctx.attempt, error["type"], extra={"traceback": quiet_traceback(err)})
    if retryable:
        delay = _retry_delay(workflow, failures, err)
        if _record(run_id, lambda s, ours: _closed(s, ours, close) and schedule_retry(
                s, run_id, ours, delay=delay, error=error), _requeued):
            log.warning("run %s: %s; retry %s/%s in %.1fs", run_id, error["type"],
                        failures + 2, workflow.max_attempts, delay)
            send_run(current_app.extensions["celery"], run_id, workflow.ref, countdown=delay)
            return Ended(RunEnding.RETRYING, delay=delay)
        log.warning("run %s: claim lost before recording failure", run_id)
        return Ended(RunEnding.LOST)
    return _finish_failed(ctx, error, close)


def _retry_delay(workflow: registry.Workflow, failures: int, err: Exception) -> float:
    """The delay a Celery task's ``self.retry(countdown=..., eta=...)`` asked for, else
    the workflow's capped exponential backoff."""
    when = err.when if isinstance(err, CeleryRetry) else None
    if isinstance(when, datetime):
        now = datetime.now(when.tzinfo or UTC)
        return max(0.0, (when - now).total_seconds())
    if isinstance(when, (int, float)) and not isinstance(when, bool):
        return max(0.0, float(when))
    return workflow.retry_delay(failures + 1)


# -- a boot that lost its lock while this process executes runs under it --------------------

EXIT_CLAIM_LOST = 75
_watching: int | None = None


def _watch_boots() -> None:
    """Install the handler the boot watchdog calls when this process's boot dies."""
    global _watching
    if _watching != os.getpid():
        _watching = os.getpid()
        boots.on_lost = functools.partial(_adopt_runs, current_app._get_current_object())


def _adopt_runs(flask_app, lost: boots.Boot) -> None:
    """Keep executing our runs under a new boot, or stop executing them at once.

    The lost boot is dead to everyone: its runs belong to repair, and another
    worker may take them over. The one thing this process may do is what any
    rescuer does: a compare-and-set from the dead boot to a live one (its new
    boot). If it wins, nobody else is executing the run and it carries on; if
    someone took the run over first, this execution is now a duplicate and the
    process exits (Celery replaces it; the message is redelivered and finds the
    run held by a live boot).
    """
    runs = boots.runs_held_by(lost.boot_id)
    if not runs:
        return
    deadline = time.monotonic() + flask_app.config["POIMEN_RECORD_RETRY_SECONDS"]
    with flask_app.app_context():
        while True:
            try:
                new = current_boot(boot_dsn)
                for run_id in runs:
                    # Before the adoption commits: a fenced write racing it must
                    # already accept the new boot (it is ours either way).
                    boots.hold_if_held(run_id, new.boot_id)
                # The lost boot is ours whatever happened since: a run this process
                # finished under it meanwhile is ours too, not lost.
                outcomes = {run_id: adopt_run(db.session, run_id, lost.boot_id, new.boot_id,
                                              {lost.boot_id, *boots.holders(run_id)})
                            for run_id in runs}
                db.session.commit()
                break
            except Exception as err:  # noqa: BLE001 - Postgres may still be restarting
                _rollback()
                if time.monotonic() > deadline and boots.still_held(runs):
                    log.error("runs %s: no new boot within the retry window (%s); stopping",
                              [str(r) for r in runs], err)
                    os._exit(EXIT_CLAIM_LOST)
                if not boots.still_held(runs):
                    return  # every one of them ended here meanwhile: nothing to adopt
                time.sleep(0.5)
        db.session.remove()
    for run_id, outcome in outcomes.items():
        if outcome in (Adoption.ADOPTED, Adoption.OURS):
            # Committed: the new boot's lease covers the run, and the fence moves
            # with it. Until now it ran on the lost boot's last confirmation.
            boots.cover(run_id, new)
        if outcome == Adoption.ADOPTED:
            log.warning("run %s: adopted by new boot %s after boot %s lost its lock", run_id,
                        new.boot_id, lost.boot_id)
        elif outcome == Adoption.LOST and boots.still_held([run_id]):
            # Only a run this process is still executing needs stopping.
            log.error("run %s was taken over while boot %s was cut off; stopping this "
                      "execution (exit %s)", run_id, lost.boot_id, EXIT_CLAIM_LOST)
            os._exit(EXIT_CLAIM_LOST)
