"""Celery tasks, declared with the stable names of ``app.task_names``."""

from __future__ import annotations

import logging
from typing import Any

from celery import current_app as current_celery_app
from celery import shared_task
from celery.exceptions import Retry
from celery.signals import (
    beat_init,
    task_postrun,
    task_prerun,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_shutting_down,
)
from flask import current_app

from app.extensions import db, prepare_if_direct
from app.run_service import redrive_stranded_runs
from app.state.boots import prune_dead_boots
from app.state.executor import on_session
from app.task_names import EXECUTE_RUN, REPAIR_RUNS
from lease import LeaseOrderingError

from . import celery_native, proctree, shutdown
from .boots import (
    LockKeyTaken,
    PooledLockConnection,
    boot_dsn,
    check_lease_settings,
    check_lock_database,
    current_boot,
    end_current_boot,
)
from .dberrors import db_session
from .execution import ClaimReleased, execute_run, limited_workflow

log = logging.getLogger(__name__)


# Request: revoke/terminate cancel the run, a hard time limit fails it (celery_native).
# throws: a failed run is FAILURE without a traceback in the log (it is the workflow's).
@shared_task(name=EXECUTE_RUN, bind=True, Request="workers.celery_native:RunRequest",
             throws=(celery_native.RunFailed,))
def execute(self: Any, run_id: str) -> str:
    """Execute run ``run_id`` (claims make duplicate deliveries do nothing).

    The task's state is the execution's (``celery_native.report``): SUCCESS
    only for a run this delivery finished ``succeeded``.
    """
    try:
        execution = execute_run(run_id, limited=limited_workflow(self.request.shadow))
    except ClaimReleased:
        # Back to queued before its workflow started; beat re-sends it.
        raise Retry(f"run {run_id} released before start",
                    exc=celery_native.RunRetrying("released before start")) from None
    return celery_native.report(self, execution)


@shared_task(name=REPAIR_RUNS)
def repair() -> int:
    """Re-send queued runs whose message may be lost and runs held by dead boots."""
    sent, _ = redrive_stranded_runs(db_session(), current_app.extensions["celery"],
                                    min_age=current_app.config["POIMEN_REPAIR_MIN_AGE"],
                                    takeover_delay=current_app.config["POIMEN_TAKEOVER_DELAY"])
    pruned = prune_dead_boots(on_session(db.session))
    db.session.commit()
    if pruned:
        log.info("repair: pruned %d dead worker boot(s) no run refers to", pruned)
    return sent


@worker_init.connect
def _check_lock_database(sender: Any = None, **_: Any) -> None:
    # Liveness locks behind a transaction pooler mean nothing, and a lease whose
    # bounds are out of order lets two workers run one body: refuse to start
    # rather than let dead workers look alive (or live ones dead).
    with sender.app.flask_app.app_context():
        try:
            check_lease_settings()
            check_lock_database(boot_dsn())
        except (PooledLockConnection, LockKeyTaken, LeaseOrderingError) as err:
            # One record (JSON under LOG_FORMAT=json), then a bare exit status: a
            # SystemExit message would be printed as a plain line after it.
            log.critical("poimen worker refuses to start: %s", err)
            raise SystemExit(1) from None
        # The check above proved the lock database keeps a session: when it is the
        # app's own database too, prepared statements are safe (app/extensions.py).
        prepare_if_direct(sender.app.flask_app, session_checked=True)


@worker_init.connect
def _check_batch_mode(sender: Any = None, **_: Any) -> None:
    # POIMEN_WORKER_MODE=batch runs Celery's threads pool, which has no time limits: a
    # workflow that sets one is refused here rather than silently not limited.
    flask_app = sender.app.flask_app
    if flask_app.config.get("POIMEN_WORKER_MODE") != "batch":
        return
    from . import batching

    # The pool's size: the batcher stops waiting for more once every thread waits on it.
    batching.pool_threads = sender.concurrency
    refused = batching.refused_workflows()
    if refused:
        log.critical("poimen worker refuses to start: POIMEN_WORKER_MODE=batch runs Celery's "
                     "threads pool, which cannot enforce time limits, and these workflows "
                     "set one: %s (run them on a prefork worker: its own queue)",
                     ", ".join(refused))
        raise SystemExit(1)
    log.info("poimen worker: batch mode (threads pool, %s threads; claims and finishes "
             "batched within %gms, %gms under load, at most %d per statement)",
             sender.concurrency, flask_app.config["POIMEN_WORKER_BATCH_WINDOW_MS"],
             flask_app.config["POIMEN_WORKER_BATCH_LINGER_MS"],
             flask_app.config["POIMEN_WORKER_BATCH_MAX"])


@beat_init.connect
def _check_lease_at_beat(sender: Any = None, **_: Any) -> None:
    # Beat owns POIMEN_TAKEOVER_DELAY, one side of the ordering.
    try:
        check_lease_settings()
    except LeaseOrderingError as err:
        log.critical("poimen beat refuses to start: %s", err)
        raise SystemExit(1) from None


@beat_init.connect
def _start_schedules(sender: Any = None, **_: Any) -> None:
    # Workflows that declare a schedule: this beat admits one run per tick (any number
    # of beats give one run per tick: the tick's dispatch key decides).
    from . import schedules

    schedules.start(sender.app.flask_app)


@beat_init.connect
def _start_timers(sender: Any = None, **_: Any) -> None:
    # Delayed runs are sent when due and unstarted runs expire, from Postgres, once a
    # second (workers/timers.py): never a Celery ETA.
    from . import timers

    timers.start(sender.app.flask_app)


@worker_init.connect
def _check_queue_arguments(sender: Any = None, **_: Any) -> None:
    # RabbitMQ: a queue's arguments (x-max-priority) must match the existing queue's.
    from .queues import QueueArgumentsRefused, check_queue_arguments

    try:
        check_queue_arguments(sender.app)
    except QueueArgumentsRefused as err:
        log.critical("poimen worker refuses to start: %s", err)
        raise SystemExit(1) from None


@worker_init.connect
def _serve_metrics(sender: Any = None, **_: Any) -> None:
    from .metrics import serve_metrics

    serve_metrics(sender.app.flask_app, sender.app)


@worker_process_init.connect
def _lead_own_group(**_: Any) -> None:
    # First, before any task: the body's children join this pool process's group,
    # and its guardian ends that group when the process dies (workers/proctree.py).
    proctree.lead_own_group()


@worker_process_init.connect
def _register_boot(**_: Any) -> None:
    # Each pool process is its own boot: if the process dies, so does its lock.
    flask_app = current_celery_app.flask_app
    with flask_app.app_context():
        # Connections inherited across fork must not be shared with the parent.
        db.engine.dispose(close=False)
        current_boot(boot_dsn)


@worker_process_shutdown.connect
def _end_boot(**_: Any) -> None:
    end_current_boot()


# SIGTERM (docs/internals/reliability.md): pool processes outlive the dyno-wide signal
# and finish their run within POIMEN_SHUTDOWN_GRACE; see workers/shutdown.py.
@worker_process_init.connect
def _shutdown_grace(**_: Any) -> None:
    shutdown.init_pool_process(current_celery_app.flask_app.config["POIMEN_SHUTDOWN_GRACE"])


@task_prerun.connect
def _protect_task_from_sigterm(**_: Any) -> None:
    shutdown.task_starting()


@task_postrun.connect
def _task_done(**_: Any) -> None:
    shutdown.task_finished()


@worker_shutting_down.connect
def _note_sigterm(sig: str | None = None, how: str | None = None, **_: Any) -> None:
    shutdown.mark_received()
    if current_celery_app.flask_app.config.get("POIMEN_WORKER_MODE") == "batch":
        # One process, its runs in threads: Celery's warm shutdown waits for them, and
        # the grace bounds that wait (workers/shutdown.py).
        shutdown.abandon_after(current_celery_app.flask_app.config["POIMEN_SHUTDOWN_GRACE"])
    # Pool processes lead groups of their own: a SIGTERM to the worker's group
    # reaches them only through the main process (workers/proctree.py).
    proctree.tell_pool(sig, how)
