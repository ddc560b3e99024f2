"""Celery's own tools keep their meaning for runs (``docs/guide/celery.md``).

* **States.** ``runs.execute`` ends its Celery task the way the run's
  execution ended (:func:`report`): a run that succeeded is SUCCESS, one that
  failed is FAILURE (after the failure is recorded; ``acks_late`` still acks),
  a retry or a join's wait is RETRY (the run will be delivered again), a
  cancelled run is REVOKED. A delivery that did no work (a duplicate, a run
  already finished, not due yet) is ``Ignore``d: no SUCCESS for work not done.
* **Controls.** ``celery control revoke <run id>`` cancels the run through the
  API's cancel path (``app/state/runs.py: cancel_run``); ``--terminate`` records the
  cancel first, then kills the pool process (SIGKILL for SIGTERM: a pool
  process reads SIGTERM as a deploy's and protects its run), and the run ends
  ``cancelled`` once its boot is dead, never resumed.
* **Time limits.** A run past its workflow's hard ``time_limit`` is recorded
  ``failed`` (``error.code = "time_limit"``) by the worker's main process
  before Celery kills the pool process, so no takeover resumes it.
* **Existing tasks as workflows.** :func:`workflow_from_task` (and the
  :func:`task_workflow` decorator) register a Celery task as a one-step
  workflow whose body runs under the run's claim with ``self.request.id`` =
  the run id and ``self.retry`` mapped to the workflow's retry.

The web process imports this module only through workflow modules that call
:func:`workflow_from_task`, so its top level imports nothing of the execution.
"""

from __future__ import annotations

import importlib
import logging
import signal as signals_module
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from celery import signals
from celery.exceptions import Ignore, Retry
from celery.platforms import signals as platform_signals
from celery.worker import state as worker_state
from celery.worker.request import Request
from sqlalchemy import text

from app.state import runs
from app.state.executor import on_session
from app.task_names import EXECUTE_RUN

from . import boots
from .registry import (
    REF_PATTERN,
    Action,
    InvalidDefinition,
    Step,
    Workflow,
    default_max_takeovers,
    register,
)

if TYPE_CHECKING:
    from flask import Flask

    from app.state.claims import Claim

    from .context import StepContext
    from .execution import Execution

log = logging.getLogger(__name__)


class RunFailed(Exception):
    """The run ended ``failed`` (its task ends in FAILURE); the message names the error code.

    Only the code or type: an error's message may quote the run's input, and
    Celery logs and broadcasts this exception.
    """


class RunRetrying(Exception):
    """The run goes back to ``queued`` and will be delivered again (its task ends in RETRY)."""


# -- what Celery is told -------------------------------------------------------------------------

def report(task: Any, execution: Execution) -> str:
    """End ``runs.execute`` the way this delivery's execution of the run ended.

    Return (SUCCESS) only for a run this delivery finished ``succeeded``; raise
    for the rest (see the module's docstring).
    """
    from .execution import RunEnding

    ended, claim = execution.ended, execution.claim
    if ended is None:
        return _not_executed(task, claim)
    if ended.status == RunEnding.SUCCEEDED:
        return "succeeded"
    if ended.status == RunEnding.FAILED:
        raise RunFailed(f"run {claim.run_id} failed: {ended.code}")
    if ended.status == RunEnding.CANCELLED:
        _announce_cancelled(task)
        raise Ignore()
    if ended.status in (RunEnding.RETRYING, RunEnding.RELEASED, RunEnding.WAITING):
        what = {RunEnding.RETRYING: "retrying", RunEnding.RELEASED: "released to another worker",
                RunEnding.WAITING: "waiting for its children"}[ended.status]
        raise Retry(f"run {claim.run_id} {what}", exc=RunRetrying(what), when=ended.delay)
    raise Ignore()  # LOST: another worker holds the run; nothing of ours was recorded


def _not_executed(task: Any, claim: Claim) -> str:
    from app.extensions import db
    from app.state.claims import ClaimOutcome

    if claim.outcome == ClaimOutcome.SLOT_WAIT:
        # Like a join's wait: the run waits, holding no worker; the end of a run
        # holding its slot re-queues it and sends it again.
        what = f"waiting for a slot ({claim.wait_reason})"
        raise Retry(f"run {claim.run_id} {what}", exc=RunRetrying(what))
    if claim.outcome == ClaimOutcome.RATE_WAIT:
        # Its start under its rate limits is reserved for later (execute_run sent it for
        # then, or beat will): Flower shows it retrying at that time.
        what = "waiting for its rate limit"
        raise Retry(f"run {claim.run_id} {what}", exc=RunRetrying(what), when=claim.not_before)
    if claim.outcome == ClaimOutcome.EXPIRED:
        # Celery's own expiry announces a revoke with expired=True; so does this one.
        _announce_cancelled(task, expired=True)
        raise Ignore()
    if claim.outcome == ClaimOutcome.FINISHED:
        status, error = db.session.execute(
            text("SELECT status, error FROM runs WHERE id = :run"), {"run": claim.run_id}
        ).one()
        db.session.rollback()
        if status == "cancelled":
            _announce_cancelled(task)
        elif status == "poisoned" and claim.holder is not None:
            # This delivery took over a dead worker's run and ended it: it killed max_takeovers
            # + 1 workers (poisoned), a failure of its task.
            raise RunFailed(f"run {claim.run_id} failed: {(error or {}).get('code')}")
    raise Ignore()


def _announce_cancelled(task: Any, *, expired: bool = False) -> None:
    # Celery's own revoke announces REVOKED; a run cancelled through the API
    # says the same, so Flower shows cancelled runs as REVOKED (and expired ones too,
    # with expired=True, as Celery's ``expires`` does).
    try:
        task.send_event("task-revoked", terminated=False, signum=None, expired=expired)
    except Exception:  # noqa: BLE001 - an event is a courtesy; the run is recorded
        log.warning("could not send task-revoked for %s", task.request.id, exc_info=True)


# -- revoke, terminate, hard time limits: in the worker's main process ---------------------------

class RunRequest(Request):  # type: ignore[misc]  # celery: untyped
    """``runs.execute``'s request in the worker's main process (``Request=`` on the task)."""

    def terminate(self, pool: Any, signal: Any = None) -> Any:
        signum = platform_signals.signum(signal or "TERM")
        if self.time_start and self.task.app.flask_app.config.get("POIMEN_WORKER_MODE") \
                == "batch":
            # Threads share the process: none can be killed alone. The run is cancelled;
            # it stops at its next checkpoint (docs/internals/batching.md).
            _cancel(self.task.app.flask_app, self.id, "terminated through Celery")
            log.warning("run %s: terminate in a batch worker cancels the run; it stops at "
                        "its next checkpoint (a thread cannot be killed alone)", self.id)
            return None
        if self.time_start:
            # Cancel first: once the pool process is dead its boot is too, and a
            # takeover must find cancel_requested and end the run, not resume it.
            _cancel(self.task.app.flask_app, self.id, "terminated through Celery")
            if signum == signals_module.SIGTERM:
                # A pool process protects its run from SIGTERM for the shutdown
                # grace (a deploy, workers/shutdown.py) and would then die with
                # whatever it runs next. --terminate means stop this run now.
                log.warning("run %s: terminate with SIGTERM; killing pool process %s with "
                            "SIGKILL (pool processes hold SIGTERM for deploys)", self.id,
                            self.worker_pid)
                signum = signals_module.SIGKILL
        return super().terminate(pool, signum)

    def cancel(self, pool: Any, signal: Any = None, **kwargs: Any) -> Any:
        # A cold shutdown (SIGQUIT, a second Ctrl-C) cancels every running task with
        # SIGTERM, which a pool process reads as a deploy's and outlives for the grace.
        # Cold means now: SIGKILL, and the pool process's guardian ends the body's
        # process group with it (workers/proctree.py). The run is not cancelled: its
        # boot dies with the process, and another worker takes it over.
        signum = platform_signals.signum(signal or "TERM")
        if signum == signals_module.SIGTERM and self.time_start:
            log.warning("run %s: cold shutdown; killing pool process %s and its process "
                        "group", self.id, self.worker_pid)
            signum = signals_module.SIGKILL
        return super().cancel(pool, signum, **kwargs)

    def on_timeout(self, soft: bool, timeout: float) -> Any:
        if not soft and self.worker_pid and not worker_state.should_terminate:
            # Before Celery kills the pool process: a dead boot's run would be taken
            # over and resumed; a failed one never is. (Not in a cold shutdown,
            # which Celery also handles here: its runs are left to repair.)
            _record_time_limit(self.task.app.flask_app, self.id, self.worker_pid, timeout)
        return super().on_timeout(soft, timeout)


@signals.task_revoked.connect
def _cancel_revoked_run(sender: Any = None, request: Any = None, terminated: bool = False,
                        expired: bool = False, **_: Any) -> None:
    """``celery control revoke <run id>``: cancel the run (the API's cancel path)."""
    if sender is None or getattr(sender, "name", None) != EXECUTE_RUN or request is None:
        return
    if expired:
        return  # runs' messages carry no expiry; not an operator's revoke
    flask_app = sender.app.flask_app
    run_id = request.id
    if _cancel(flask_app, run_id) == "running" and terminated:
        threading.Thread(target=_end_when_holder_dead, args=(flask_app, run_id),
                         name=f"poimen-revoke-{run_id}", daemon=True).start()


def _cancel(flask_app: Flask, run_id: str, why: str = "revoked through Celery") -> str | None:
    """Cancel ``run_id``; end it at once if its holder is dead. Return its status after."""
    from app.extensions import db
    from app.run_service import tenant_of
    from app.state.runs import cancel_run

    from .dberrors import db_session

    try:
        run_uuid = uuid.UUID(run_id)
    except (TypeError, ValueError):
        return None
    with flask_app.app_context():
        try:
            tenant_id = tenant_of(db_session(), run_uuid)
            if tenant_id is None:
                db.session.rollback()
                return None
            store = on_session(db.session)
            row = cancel_run(store, tenant_id, run_uuid)
            ended = runs.end_abandoned(store, run_uuid)
            db.session.commit()
        except Exception:  # noqa: BLE001 - the revoke stands; repair and the API remain
            db.session.rollback()
            log.exception("run %s: revoked, but its cancel could not be recorded", run_id)
            return None
        finally:
            db.session.remove()
    status = "cancelled" if ended else (row.status if row is not None else None)
    log.info("run %s: %s; %s", run_id, why,
             "cancel requested" if status == "running" else status or "already finished")
    return status


def _end_when_holder_dead(flask_app: Flask, run_id: str, timeout: float = 60.0) -> None:
    """After a terminate: end the run ``cancelled`` as soon as its pool process's boot is dead.

    Every message of a revoked id is dropped by the workers that got the
    revoke, so no takeover may ever come; this is its stand-in.
    """
    from app.extensions import db


    run_uuid = uuid.UUID(run_id)
    deadline = time.monotonic() + timeout
    with flask_app.app_context():
        while time.monotonic() < deadline:
            try:
                if runs.end_abandoned(on_session(db.session), run_uuid):
                    db.session.commit()
                    log.info("run %s: cancelled (its terminated process is gone)", run_id)
                    return
                status = db.session.execute(_STATUS, {"run": run_uuid}).scalar_one_or_none()
                # Committed, not rolled back: the stamp of a holder first seen dead
                # (end_abandoned) is when its bound starts.
                db.session.commit()
                if status != "running":
                    return  # it ended where it ran (a checkpoint saw the cancel)
            except Exception:  # noqa: BLE001 - keep trying until the deadline
                db.session.rollback()
            finally:
                db.session.remove()
            time.sleep(0.2)
    log.warning("run %s: still running %ss after terminate; left to repair", run_id, timeout)


def _record_time_limit(flask_app: Flask, run_id: str, pid: int, timeout: float) -> None:
    import json

    from app.extensions import db


    error = {"code": "time_limit", "type": "poimen.TimeLimitExceeded",
             "message": f"the run exceeded its hard time limit ({timeout:g}s); its worker "
                        "process was killed and the run is not resumed",
             "traceback": ""}
    try:
        run_uuid = uuid.UUID(run_id)
        with flask_app.app_context():
            try:
                failed = runs.fail_time_limit(on_session(db.session), run_uuid,
                                                    node=boots.NODE, pid=pid,
                                                    error=json.dumps(error))
                db.session.commit()
            finally:
                db.session.remove()
    except Exception:  # noqa: BLE001 - the process is killed anyway; takeover would resume it
        log.exception("run %s: hard time limit; could not record its failure", run_id)
        return
    if failed:
        log.error("run %s: failed: time_limit (%gs)", run_id, timeout)


_STATUS = text("SELECT status FROM runs WHERE id = :run")


# -- existing Celery tasks as workflows ----------------------------------------------------------

class TaskBody:
    """The action of a task workflow: the task's own function, called under the run's claim.

    ``self.request`` (for ``bind=True`` tasks) is a request whose ``id`` is the
    run id, ``retries`` the run's recorded failures and ``parent_id``/``root_id`` the
    run's place in its run tree (its message's); ``self.retry(...)``
    raises Celery's ``Retry`` without sending anything, and the run is retried
    by Poimen (``workers/execution.py``) after the countdown it asked for.
    The run's input (a JSON object) is the task's keyword arguments.
    """

    def __init__(self, task_name: str):
        self.task_name = task_name
        # The definition hash names the task (workers/registry.py: _callable_name).
        self.__module__ = "celery.task"
        self.__qualname__ = task_name
        self.__name__ = task_name

    def __call__(self, ctx: StepContext, input: dict[str, Any]) -> Any:
        from flask import current_app

        from .execution import delivered_tree

        task = current_app.extensions["celery"].tasks[self.task_name]
        # The run tree as the run's message carries it: a fan-out child's parent and root.
        tree = delivered_tree(ctx.run_id)
        task.push_request(
            id=str(ctx.run_id), task=task.name, retries=ctx.failures,
            args=[], kwargs=dict(input), called_directly=False,
            # "eager": self.retry() raises Retry instead of publishing a message;
            # the run's retry is Poimen's, with the run's claim and backoff.
            is_eager=True, delivery_info={"is_eager": True}, hostname=socket.gethostname(),
            root_id=tree.root_id or str(ctx.run_id), parent_id=tree.parent_id, group=None, chord=None, callbacks=None,
            errbacks=None, chain=None, ignore_result=True,
        )
        try:
            return task.run(**input)
        finally:
            task.pop_request()


def workflow_from_task(task: Any, version: str = "1", *, name: str | None = None,
                       max_takeovers: int | None = None, queue: str | None = None,
                       time_limit: float | None = None, soft_time_limit: float | None = None,
                       priority: int | None = None, rate_limit: str | None = None,
                       rate_key: Callable[[Any], Any] | None = None) -> Workflow:
    """Register the Celery task ``task`` (a task, or its name) as a one-step workflow.

    The workflow is named after the task (``name`` to choose another) and
    executes the task's own function in the run's worker, under the run's
    claim; the run's input is its keyword arguments. Retries are the task's:
    ``self.retry(countdown=..., max_retries=...)`` and ``autoretry_for`` retry
    the run (Celery's ``max_retries`` decides when to stop); any other
    exception fails it. ``time_limit``, ``soft_time_limit`` and ``rate_limit`` default to
    the task's own; the rate limit then holds across every worker (Celery's is per worker
    process), per ``rate_key(input)``. See docs/guide/celery.md for what does not carry over.
    """
    celery_task = _resolve_task(task) if isinstance(task, str) else task
    task_name = celery_task.name
    return register(Workflow(
        name=name or task_name,
        version=version,
        steps=[Step("main", actions=[Action(position=0, name="task", kind="call",
                                            fn=TaskBody(task_name))])],
        # Celery's retry() enforces max_retries itself (it raises the task's
        # exception once they are used up), so the workflow does not count.
        max_attempts=2**31 - 1,
        max_takeovers=max(0, default_max_takeovers() if max_takeovers is None
                          else max_takeovers),
        retry_on=(Retry,),
        queue=queue,
        time_limit=time_limit if time_limit is not None else getattr(celery_task, "time_limit",
                                                                     None),
        soft_time_limit=(soft_time_limit if soft_time_limit is not None
                         else getattr(celery_task, "soft_time_limit", None)),
        priority=priority,
        rate_limit=rate_limit if rate_limit is not None else _task_rate_limit(celery_task),
        rate_key=rate_key,
    ))


def _task_rate_limit(celery_task: Any) -> str | None:
    """A Celery task's own ``rate_limit`` in a workflow's spelling (Celery takes a number
    too: so many a second)."""
    limit = getattr(celery_task, "rate_limit", None)
    return None if limit is None else str(limit)


def task_workflow(version: str = "1", **options: Any) -> Callable[[Any], Any]:
    """Decorator form of :func:`workflow_from_task`, above ``@shared_task`` / ``@app.task``."""

    def decorate(task: Any) -> Any:
        workflow_from_task(task, version, **options)
        return task

    return decorate


def _resolve_task(ref: str) -> Any:
    """The task named ``ref`` (a registered task name, or ``module.attribute``)."""
    from celery import current_app as celery_app

    if not REF_PATTERN.match(ref):
        raise InvalidDefinition(f"malformed task name {ref!r}")
    tasks = celery_app.tasks
    if ref in tasks:
        return tasks[ref]
    module_name, _, attribute = ref.rpartition(".")
    if not module_name:
        raise InvalidDefinition(f"no Celery task named {ref!r}")
    found = getattr(importlib.import_module(module_name), attribute, None)
    if found is None or not hasattr(found, "run"):
        raise InvalidDefinition(f"no Celery task named {ref!r}")
    return found
