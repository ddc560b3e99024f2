"""Executing one run: claim, dispatch its step entries (``ledger.py``), finish; all fenced."""

from __future__ import annotations

import enum
import functools
import logging
import os
import random
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from celery.exceptions import Retry as CeleryRetry
from flask import Flask, current_app
from sqlalchemy.exc import DataError

from app.enqueue import Tree, send_pending, send_run
from app.extensions import db
from app.liveness import GONE_SLACK
from app.logs import note_tenant, tenant_name
from app.metrics import (
    CLAIMS,
    QUEUE_WAIT_SECONDS,
    RUN_DURATION_SECONDS,
    RUNS_EXPIRED,
    RUNS_POISONED,
    labelled,
)
from app.models import RunStatus
from app.state.claims import (
    Adoption,
    Claim,
    ClaimOutcome,
    adopt_run,
    claim_run,
    claim_slot,
    decide_slot,
)
from app.state.direct import SingleStatements, single_statements
from app.state.executor import on_session
from app.state.ledger import EntryClose
from app.task_names import ref_of_shadow
from app.telemetry import report_exception
from app.tracecontext import of_run
from logconfig import quiet_traceback

from . import batching, boots, ledger, registry
from .actions import bound_error, error_info
from .boots import boot_dsn, current_boot, end_current_boot
from .context import RunContext
from .dberrors import db_session, rollback
from .fence import Fence, record_deadline

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


@dataclass(frozen=True)
class Execution:
    """What one delivery did: its claim, and how executing the run ended (None: it did not
    execute it)."""

    claim: Claim
    ended: Ended | None = None

    @property
    def outcome(self) -> ClaimOutcome:
        return self.claim.outcome

    @property
    def run_id(self) -> uuid.UUID:
        return self.claim.run_id


def limited_workflow(shadow: str | None) -> bool:
    """Whether a message's ``shadow`` (``runs.execute[<ref>]``, what Flower shows) names a
    workflow of this process that declares ``concurrency_limit`` or ``rate_limit``: its
    runs' claims then start with the group's locks (``claim_slot``) instead of a claim
    bound to be refused.

    A hint only: it picks the first statement, the statements decide. A run admitted
    before its workflow declared a limit is claimed by ``claim_slot`` all the same; a
    run of a capped tenant whose workflow declares none takes the refused path.
    """
    ref = ref_of_shadow(shadow)
    if ref is None:
        return False
    try:
        workflow = registry.resolve(ref)
        return workflow.concurrency_limit is not None or workflow.rate_limit is not None
    except registry.UnknownWorkflow:
        return False


def delivered_tree(run_id: uuid.UUID, retries: int | None = None, *,
                  takeover: bool = False) -> Tree:
    """The ``Tree`` of a message this worker sends for ``run_id`` (a retry, a release, a
    holder's takeover): ``retries`` (the run's attempt after this send's write), and the
    run tree's parent and root as the delivery that executes the run here carries them,
    as Celery's own retry copies its request's (a claim does not read them). Not from
    Celery's task: None, a top-level run. ``takeover``: the delivered message's retries
    plus the holder's attempt."""
    from celery._state import get_current_worker_task

    task = get_current_worker_task()
    request = getattr(task, "request", None)
    run = str(run_id)
    if request is None or getattr(request, "id", None) != run:
        return Tree(retries or 0)
    if takeover:
        retries = (getattr(request, "retries", 0) or 0) + 1
    root = getattr(request, "root_id", None)
    return Tree(retries or 0, getattr(request, "parent_id", None),
                root if root and root != run else None)


def execute_run(run_id: str, *, limited: bool = False) -> Execution:
    """Execute run ``run_id`` if this delivery wins its claim; say what it did.

    ``limited``: the run's workflow declares a concurrency limit (``limited_workflow``).
    In batch mode (``workers/batching.py``) its claim and finish go in the store
    batcher's batches, and no other thread of this process handles the run meanwhile.
    """
    run_uuid = uuid.UUID(run_id)
    _watch_boots()
    if not batching.active():
        return _execute(run_uuid, limited)
    if not boots.begin_claim(run_uuid):
        boot = current_boot(boot_dsn)
        claim = Claim(ClaimOutcome.DUPLICATE, run_uuid, boot.boot_id, holder=boot.boot_id)
        observe_claim(claim)
        log.warning("run %s: a delivery while this process handles another; nothing to do",
                    run_id)
        return Execution(claim)
    batcher = batching.batcher()
    batcher.enter()
    try:
        return _execute(run_uuid, limited)
    finally:
        batcher.leave()
        boots.end_claim(run_uuid)


def _execute(run_uuid: uuid.UUID, limited: bool) -> Execution:
    run_id = str(run_uuid)
    claim = _claim(run_uuid, limited)
    observe_claim(claim)
    if not claim.outcome.execute:
        if claim.outcome == ClaimOutcome.SLOT_WAIT:
            log.info("run %s: waiting for a slot (%s); no worker held", run_id,
                     claim.wait_reason)
            return Execution(claim)
        if claim.outcome == ClaimOutcome.RATE_WAIT:
            send_for_start(claim)
            return Execution(claim)
        if claim.gone_in and claim.ref is not None:
            # Its holder lost its lock a moment ago and may still run the body (until
            # its fence): deliver it again once the holder is gone (app/liveness.py),
            # rather than leave it to beat's repair (this copy carries no trace context:
            # the claim does not read it; repair's re-send carries the run's).
            delay = claim.gone_in + GONE_SLACK
            log.warning("run %s: its holder %s lost its lock; it may be taken over in %.1fs, "
                        "sent again for then", run_id, claim.holder, delay)
            send_run(current_app.extensions["celery"], run_uuid, claim.ref, countdown=delay,
                     tree=delivered_tree(run_uuid, takeover=True))
            return Execution(claim)
        level = logging.INFO if claim.outcome != ClaimOutcome.DUPLICATE else logging.WARNING
        log.log(level, "run %s: %s (holder %s); nothing to do", run_id, claim.outcome.value,
                claim.holder)
        return Execution(claim)
    if claim.outcome == ClaimOutcome.TAKEN_OVER:
        log.warning("run %s: took over from dead boot %s (attempt %s)", run_id, claim.holder,
                    claim.attempt)

    row = claim.run
    assert row is not None  # a claim that executes returns the run's row
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
        rollback()
        end_current_boot()
        raise
    finally:
        boots.let_go([run_uuid])
    labelled(RUN_DURATION_SECONDS, row.workflow_name,
             str(getattr(ended, "status", "unknown"))).observe(time.monotonic() - started)
    return Execution(claim, ended)


def send_for_start(claim: Claim) -> None:
    """A run whose start its rate limits reserved for later: the claim counted a start less
    than 2 s away as sent by this worker, which sends it for then (a later one is beat's
    ``release_due``, by then). Nothing is held meanwhile: a lost send is repair's."""
    assert claim.not_before is not None and claim.ref is not None  # a RATE_WAIT has both
    wait = max(0.0, (claim.not_before - datetime.now(UTC)).total_seconds())
    log.info("run %s: rate limited; its start is reserved in %.3fs, no worker held",
             claim.run_id, wait)
    if claim.send_for_start:
        send_run(current_app.extensions["celery"], claim.run_id, claim.ref,
                 countdown=wait or None,
                 trace=None if claim.run is None else of_run(claim.run),
                 tree=delivered_tree(claim.run_id))


def observe_claim(claim: Claim) -> None:
    """Count the claim's outcome; a run's first start observes its queue wait."""
    labelled(CLAIMS, claim.outcome.value).inc()
    if claim.outcome == ClaimOutcome.EXPIRED:
        RUNS_EXPIRED.labels("claim").inc()
    count_poisoned(claim)
    row = claim.run
    if row is None:
        return
    note_tenant(row.tenant_id)
    if claim.outcome == ClaimOutcome.CLAIMED and claim.attempt == 1 \
            and row.started_at is not None and row.created_at is not None:
        labelled(QUEUE_WAIT_SECONDS, row.workflow_name).observe(
            max(0.0, (row.started_at - row.created_at).total_seconds()))


def count_poisoned(claim: Claim) -> None:
    """Count a run this delivery's takeover ended poisoned (poimen_runs_poisoned_total)."""
    row = claim.ended
    if row is None or row.status != RunStatus.POISONED:
        return
    try:
        tenant = tenant_name(row.tenant_id) or str(row.tenant_id)
    except Exception:  # noqa: BLE001 - a label must not fail the delivery; the id names it too
        tenant = str(row.tenant_id)
    RUNS_POISONED.labels(tenant, row.workflow_name).inc()
    log.error("run %s: poisoned: its executions killed %s workers (max_takeovers); not "
              "resumed again", claim.run_id, row.takeovers + 1)


def _claim(run_id: uuid.UUID, limited: bool = False) -> Claim:
    session = db_session()
    for _ in range(2):
        boot = current_boot(boot_dsn)
        try:
            # Every claim is one statement, whole on its own, so it runs in autocommit:
            # one round trip instead of BEGIN, statement, COMMIT. A message that names
            # a limited workflow starts with the slot-counting claim (the group's locks,
            # then the claim, in one call), without the refused claim and the state read.
            # Its commit is still inside this try.
            # On psycopg without the session's machinery (app/state/direct.py).
            claimed = (batching.batcher().claim(run_id, boot.boot_id)
                       if batching.active() and not limited else None)
            if claimed is not None:
                # Committed in the store batcher's batch (workers/batching.py).
                claim = Claim(ClaimOutcome.CLAIMED, run_id, boot.boot_id, claimed.attempt,
                              run=claimed)
            else:
                store = single_statements(session, send_pending)
                in_transaction = not isinstance(store, SingleStatements)
                claim = (claim_slot if limited else claim_run)(
                    store, run_id, boot.boot_id, max_takeovers=registry.max_takeovers_of,
                    transaction=in_transaction)
                store.commit()
            if claim.outcome == ClaimOutcome.SLOTS:
                # A limited run the claim did not take (a dead holder's, a duplicate):
                # decided under its group's locks, which last until this commit.
                claim = decide_slot(on_session(session), run_id, boot.boot_id,
                                    max_takeovers=registry.max_takeovers_of)
                session.commit()
        except Exception:
            # The claim's outcome is unknown: its commit may have been applied
            # with the acknowledgement lost. Ending the boot makes any claim it
            # did take wreckage (repair re-sends it, the next delivery takes it
            # over) instead of a run stranded under a live boot that answers
            # "duplicate" forever.
            log.exception("run %s: claim outcome unknown; ending boot %s", run_id, boot.boot_id)
            rollback()
            end_current_boot()
            raise
        if claim.outcome != ClaimOutcome.CLAIMER_DEAD:
            return claim
        # Postgres says our lock is gone before our watchdog did: start a new boot.
        log.warning("boot %s lost its lock (seen at claim); registering a new boot",
                    boot.boot_id)
        boot.mark_lost()
    return claim


def _run_claimed(claim: Claim) -> Ended:
    run_id = claim.run_id
    # Between the claim and user code: any failure releases the claim, scoped
    # to this boot, so the run goes back to queued rather than being stranded.
    row, attempt = claim.run, claim.attempt
    assert row is not None and attempt is not None  # a claim that executes returns both
    try:
        workflow = registry.get(row.workflow_name, row.workflow_version)
    except registry.UnknownWorkflow:
        # A rolling deploy: the run is pinned to a version this worker does not
        # have (yet, or any more). Give it back, uncounted, and send it again a
        # little later for a worker that has it.
        rollback()
        ref = f"{row.workflow_name}@{row.workflow_version}"
        if Fence(run_id, row.tenant_id, slots=claim.slots).release():
            delay = random.uniform(1.0, 3.0)
            log.warning("run %s: pinned to %s, which this worker does not have; released "
                        "and re-sent in %.1fs for a worker that does", run_id, ref, delay)
            send_run(current_app.extensions["celery"], run_id, ref, countdown=delay,
                     trace=of_run(row), tree=delivered_tree(run_id, attempt - 1))
            return Ended(RunEnding.RELEASED, delay=delay)
        return Ended(RunEnding.LOST)
    except Exception as err:
        rollback()
        released = Fence(run_id, row.tenant_id, slots=claim.slots).release()
        log.exception("run %s: failed before start; claim released=%s", run_id, released)
        raise ClaimReleased(f"run {run_id} released before start: {err}") from err
    ctx = RunContext(run_id, row.tenant_id, attempt, workflow, claim.boot_id,
                     cancel_requested=row.cancel_requested, failures=row.failures)
    fence = Fence(run_id, row.tenant_id, row.goal_id, of_run(row), slots=claim.slots)

    # The ledger dispatcher executes the steps; the last entry is closed here,
    # in the transaction that finishes (or retries) the run.
    outcome = ledger.dispatch(ctx, row, fence)
    rollback()
    if outcome.ending == ledger.Ending.WAITING:
        log.info("run %s: waiting for its children (attempt %s)", run_id, claim.attempt)
        return Ended(RunEnding.WAITING)
    if outcome.ending == ledger.Ending.LOST:
        log.warning("run %s: claim lost while executing its steps; stopped", run_id)
        return Ended(RunEnding.LOST)
    close = outcome.close
    if outcome.ending == ledger.Ending.FAILED:
        if outcome.exc is not None:
            return _record_failure(ctx, fence, row.failures, outcome.exc, close, outcome.error)
        assert outcome.error is not None  # a failed dispatch says why (ledger.Outcome)
        return _finish_failed(ctx, fence, outcome.error, close)

    status = RunStatus.CANCELLED if ctx.cancel_requested else RunStatus.SUCCEEDED
    try:
        finished = fence.finish(close, status=status, result=outcome.result)
    except DataError as err:
        # The result itself cannot be stored (jsonb refuses it): a workflow bug,
        # recorded as a failure instead of retried forever.
        rollback()
        # Postgres' message may quote the value: bounded like any error text.
        error = bound_error({
            "type": "poimen.ResultNotStorable",
            "message": f"the workflow's result could not be stored: {err.orig}",
            "traceback": "",
        })
        bare = close.without_outputs(error) if close is not None else None
        finished = fence.finish(bare, status=RunStatus.FAILED, error=error)
        status = RunStatus.FAILED
    if not finished:
        log.warning("run %s: claim lost before finishing; result discarded", run_id)
        return Ended(RunEnding.LOST)
    # A success is Celery's own line already ("Task runs.execute[<run id>] succeeded"):
    # ours is DEBUG then, INFO for the rest (a line per run cost a busy worker 5 % of its CPU).
    log.log(logging.DEBUG if status == RunStatus.SUCCEEDED else logging.INFO,
            "run %s: %s (attempt %s)", run_id, status, claim.attempt)
    if status == RunStatus.FAILED:
        return Ended(RunEnding.FAILED, code="result_not_storable")
    return Ended(RunEnding(str(status)))


def _finish_failed(ctx: RunContext, fence: Fence, error: dict[str, Any],
                   close: EntryClose | None) -> Ended:
    run_id = ctx.run_id
    code = error.get("code", error.get("type"))
    if fence.finish(close, status=RunStatus.FAILED, error=error):
        # The error's type, not its message: a message may quote the run's input
        # (GET /v1/runs/<id> shows the whole error to the tenant).
        log.error("run %s: failed: %s", run_id, code)
        return Ended(RunEnding.FAILED, code=code)
    log.warning("run %s: claim lost before recording failure", run_id)
    return Ended(RunEnding.LOST)


def _record_failure(ctx: RunContext, fence: Fence, failures: int, err: Exception,
                    close: EntryClose | None = None, error: dict[str, Any] | None = None
                    ) -> Ended:
    error = error or error_info(err)
    workflow = ctx.workflow
    run_id = ctx.run_id
    retryable = isinstance(err, workflow.retry_on) and failures + 1 < workflow.max_attempts
    # One record with the traceback: frames and exception types only, since a
    # message may quote the run's input.
    log.log(logging.WARNING if retryable else logging.ERROR, "run %s: attempt %s raised %s",
            run_id, ctx.attempt, error["type"], extra={"traceback": quiet_traceback(err)})
    if retryable:
        delay = _retry_delay(workflow, failures, err)
        if fence.retry(close, delay=delay, error=error):
            log.warning("run %s: %s; retry %s/%s in %.1fs", run_id, error["type"],
                        failures + 2, workflow.max_attempts, delay)
            send_run(current_app.extensions["celery"], run_id, workflow.ref, countdown=delay,
                     trace=fence.trace, tree=delivered_tree(run_id, ctx.attempt))
            return Ended(RunEnding.RETRYING, delay=delay)
        log.warning("run %s: claim lost before recording failure", run_id)
        return Ended(RunEnding.LOST)
    # To Sentry when it is on: the exception's type and frames, tagged with the run.
    report_exception(err)
    return _finish_failed(ctx, fence, error, close)


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
        # ignore: current_app is a LocalProxy, typed as the Flask app it stands for.
        flask_app = current_app._get_current_object()  # type: ignore[attr-defined]
        boots.on_lost = functools.partial(_adopt_runs, flask_app)


def _adopt_runs(flask_app: Flask, lost: boots.Boot) -> None:
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
    with flask_app.app_context():
        deadline = record_deadline()
        while True:
            try:
                new = current_boot(boot_dsn)
                for run_id in runs:
                    # Before the adoption commits: a fenced write racing it must
                    # already accept the new boot (it is ours either way).
                    boots.hold_if_held(run_id, new.boot_id)
                # The lost boot is ours whatever happened since: a run this process
                # finished under it meanwhile is ours too, not lost.
                store = on_session(db.session)
                outcomes = {run_id: adopt_run(store, run_id, lost.boot_id, new.boot_id,
                                              {lost.boot_id, *boots.holders(run_id)})
                            for run_id in runs}
                db.session.commit()
                break
            except Exception as err:  # noqa: BLE001 - Postgres may still be restarting
                rollback()
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
        elif outcome == Adoption.NO_SLOT and boots.still_held([run_id]):
            # Its concurrency slot was free while the boot was dead, and another run
            # has it now: running on would exceed the limit. Repair's takeover parks
            # the run until a slot frees; it resumes from its ledger.
            log.error("run %s lost its concurrency slot while boot %s was cut off; stopping "
                      "this execution (exit %s)", run_id, lost.boot_id, EXIT_CLAIM_LOST)
            os._exit(EXIT_CLAIM_LOST)
