"""Runs: reading them, cancelling them, and repair's re-sends.

Every statement that changes a run is in the run-state store (``app/state/``);
this module reads runs for the API, the console and the CLI, and orchestrates
repair (which runs to re-send, within each Celery queue's room). Views and CLI
commands call these; they hold no SQL of their own.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Row, and_, or_, select, text
from sqlalchemy.orm import Session

from . import metrics
from .enqueue import queue_of, send_run, tree_of
from .liveness import GONE_SLACK
from .models import Run, Tenant
from .state import runs
from .state.executor import on_session
from .tracecontext import of_run

log = logging.getLogger(__name__)

# A cascading cancel's page of descendants; each is cancelled in a transaction of its own.
CASCADE_PAGE = 100


def cancel_run(session: Session, tenant_id: int, run_id: uuid.UUID, *,
               cascade: bool = True) -> runs.Cancel | None:
    """Cancel ``run_id`` (queued, delayed or waiting: at once; running: at its next
    checkpoint), committed; with ``cascade``, recorded so that a child admitted under it
    from now on is admitted cancelled (a fan-out in flight: the admission locks its
    parent's row, so the two are ordered; ``sql/runs.sql``, ``admit``). None when it had
    already finished. Then ``cancel_descendants`` reaches the children there are."""
    changed = runs.cancel_run(on_session(session), tenant_id, run_id, cascade=cascade)
    session.commit()
    return changed


def cancel_descendants(session: Session, tenant_id: int, run_id: uuid.UUID) -> int:
    """After ``cancel_run(..., cascade=True)``: cancel every descendant of ``run_id`` not
    ended, a page at a time (``runs.descendants``: the ones waiting first, the running ones
    last, so no worker is freed while siblings wait to be cancelled), each in its own
    transaction, with its event. A finished run's descendants are still walked (a tree can
    outlive its root's end). Return how many it cancelled or asked to stop; the parents
    their ends complete are sent after each commit."""
    store = on_session(session)
    count = 0
    while ids := runs.descendants(store, run_id, limit=CASCADE_PAGE):
        session.commit()
        for child in ids:
            count += runs.cancel_run(store, tenant_id, child, cascade=True) is not None
            session.commit()
    session.commit()
    if count:
        log.info("cancel of run %s reached %d descendant(s)", run_id, count)
    return count


def tenant_of(session: Session, run_id: uuid.UUID) -> int | None:
    """Return the tenant id of any tenant's run ``run_id`` (None if there is no such run)."""
    return session.execute(_TENANT_OF, {"run": run_id}).scalar_one_or_none()


_TENANT_OF = text("SELECT tenant_id FROM runs WHERE id = :run")


def get_run(session: Session, tenant_id: int, run_id: str) -> Run | None:
    """Return ``tenant_id``'s run ``run_id`` (None for a malformed id or another tenant's)."""
    try:
        parsed = uuid.UUID(run_id)
    except ValueError:
        return None
    run = session.get(Run, parsed)
    return run if run is not None and run.tenant_id == tenant_id else None


def load_run(session: Session, tenant_id: int, run_id: str, error: type[Exception]) -> Run:
    """``get_run``, or ``error(404, "run_not_found", ...)`` (the API's ``ApiError``, the
    console's ``ConsoleError``): another tenant's run is indistinguishable from none."""
    run = get_run(session, tenant_id, run_id)
    if run is None:
        raise error(404, "run_not_found", f"no run {run_id}", {"run_id": run_id})
    return run


def find_run(session: Session, run_id: uuid.UUID) -> tuple[Run, str] | None:
    """Return any tenant's run ``run_id`` and its tenant's name (for operators)."""
    row = session.execute(
        select(Run, Tenant.name).join(Tenant, Tenant.id == Run.tenant_id).where(Run.id == run_id)
    ).one_or_none()
    return (row[0], row[1]) if row else None


@dataclass(frozen=True)
class RunFilter:
    statuses: list[str] | None = None
    goal_id: str | None = None
    workflow_ref: str | None = None
    dispatch_key: str | None = None
    parent_run_id: uuid.UUID | None = None
    before: tuple[datetime, uuid.UUID] | None = None  # cursor: strictly older than this


def list_runs(session: Session, tenant_id: int, where: RunFilter, limit: int) -> list[Run]:
    """Return up to ``limit`` of ``tenant_id``'s runs matching ``where``, newest first."""
    query = select(Run).where(Run.tenant_id == tenant_id)
    if where.statuses is not None:
        query = query.where(Run.status.in_(where.statuses))
    for name in ("goal_id", "workflow_ref", "parent_run_id"):
        value = getattr(where, name)
        if value is not None:
            query = query.where(getattr(Run, name) == value)
    if where.dispatch_key is not None:
        # The run that holds the key, and every earlier run a newer one took it from.
        query = query.where(or_(Run.dispatch_key == where.dispatch_key,
                                Run.released_key == where.dispatch_key))
    if where.before is not None:
        created, run_id = where.before
        query = query.where(
            or_(Run.created_at < created, and_(Run.created_at == created, Run.id < run_id))
        )
    return list(session.scalars(
        query.order_by(Run.created_at.desc(), Run.id.desc()).limit(limit)
    ))


def last_run_keyed(session: Session, tenant_name: str, key_prefix: str) -> Run | None:
    """The newest run of tenant ``tenant_name`` whose dispatch key starts with ``key_prefix``
    (a schedule's last run)."""
    return session.scalars(
        select(Run).join(Tenant, Tenant.id == Run.tenant_id)
        .where(Tenant.name == tenant_name,
               Run.dispatch_key.startswith(key_prefix, autoescape=True))
        .order_by(Run.created_at.desc()).limit(1)
    ).one_or_none()


_ENTRIES = text(
    """
    SELECT id, entry_no, step_id, status, actions, outputs, error, next_step, children_total,
           children_done, started_at, finished_at
      FROM step_entries WHERE run_id = :run ORDER BY entry_no
    """
)
_MARKERS = text(
    "SELECT entry_id, position, status, claims, result, error, claimed_at, finished_at "
    "FROM step_markers WHERE run_id = :run"
)


def run_steps(session: Session, run_id: uuid.UUID) -> list[dict[str, Any]]:
    """Return ``run_id``'s step entries, oldest first, each with its actions' outcomes.

    An action's status is the marker's (claimed, completed, failed) for a
    marker-bearing position, else what the entry recorded (pending until the
    entry ends; completed, failed, or abandoned by the stop rule).
    """
    markers: dict[tuple[int, int], Row] = {
        (m.entry_id, m.position): m for m in session.execute(_MARKERS, {"run": run_id})}
    steps = []
    for entry in session.execute(_ENTRIES, {"run": run_id}):
        actions = []
        for declared in entry.actions:
            out = {"position": declared["position"], "name": declared["name"],
                   "marker": declared["marker"], "status": declared.get("status", "pending"),
                   "outcome": declared.get("error", declared.get("output"))}
            marker = markers.get((entry.id, declared["position"]))
            if marker is not None:
                out["status"] = marker.status
                out["outcome"] = marker.error if marker.status == "failed" else marker.result
                out["claims"] = marker.claims
            actions.append(out)
        steps.append({
            "entry": entry.entry_no,
            "step": entry.step_id,
            "status": entry.status,
            "next_step": entry.next_step,
            "error": entry.error,
            "children": {"total": entry.children_total, "done": entry.children_done},
            "started_at": entry.started_at,
            "finished_at": entry.finished_at,
            "actions": actions,
        })
    return steps


def _queue_depth(celery_app, queue: str | None = None) -> int | None:
    """Messages waiting in Celery queue ``queue`` (default: the runs' default queue), or
    None if the broker cannot say."""
    from kombu.exceptions import ChannelError

    queue = queue or celery_app.conf.task_default_queue
    try:
        with celery_app.connection_for_read() as conn:
            conn.ensure_connection(max_retries=1)
            try:
                return conn.default_channel.queue_declare(queue=queue,
                                                          passive=True).message_count
            except ChannelError:
                return 0  # Redis drops an empty list: no queue is an empty queue
    except Exception:  # noqa: BLE001 - the broker is away; sending will say so too
        log.warning("repair: could not read the depth of queue %s", queue, exc_info=True)
        return None


def _queues_of(celery_app, refs) -> dict[str, tuple[list[str], list[str]]]:
    """Group (workflow name, version) pairs by the Celery queue their runs are sent to."""
    queues: dict[str, tuple[list[str], list[str]]] = {}
    for name, version in refs:
        names, versions = queues.setdefault(queue_of(celery_app, f"{name}@{version}"), ([], []))
        names.append(name)
        versions.append(version)
    return queues


def redrive_stranded_runs(session: Session, celery_app, *, min_age: float,
                          limit: int | None = 1000, takeover_delay: float = 0.0
                          ) -> tuple[int, int]:
    """Re-send runs held by dead boots, queued runs last sent over ``min_age`` s ago, and
    re-queue the oldest waiting run of each group with a free slot.

    Re-sending is always safe (claims absorb duplicates), but every needless
    copy inflates the queue, Redis memory and Flower's counts, so:

    * a run is marked sent (``last_sent_at``) and not re-sent within ``min_age``;
    * runs held by dead boots come first, in a statement of their own, and are
      re-sent on the first tick after their boot died, whatever the backlog;
    * queued runs go a page (``limit``) at a time per Celery queue, oldest send
      first, and only as many as *their* queue has room for below one page: a
      message still waiting in the queue is not lost, and a copy would only wait
      behind it. Under a backlog of a page or more on a queue, none of its
      queued runs is re-sent until workers drain it; other queues go on.

    A dead boot's run is re-sent once the boot is first seen dead (its lock free),
    delivered when the boot is gone (``app/liveness.py``: that sight T_c + kill +
    margin old; before it, its process may still run the body, and a delivery
    takes nothing over) and at least ``takeover_delay`` seconds after it is sent:
    a worker cut off by a Postgres restart may still be executing it and adopts
    it as soon as it has a new boot; the delay lets it, rather than a rescuer
    that would start the run over. Neither is needed for safety: the takeover
    statement itself waits for the boot to be gone.

    One repair at a time: a second one (two beats in a deploy overlap) finds
    the repair lock held and does nothing this tick; ``flask runs redrive``
    waits for it instead.

    ``limit=None`` (``flask runs redrive``) re-sends every such run at once,
    whatever the queue holds. Commits the marks, then sends. Return
    ``(sent, found)``.
    """
    with runs.repair_lock(session.get_bind(), wait=limit is None) as held:
        if not held:
            log.info("repair: another repair is running; this one does nothing")
            return 0, 0
        return _redrive(session, celery_app, min_age=min_age, limit=limit,
                        takeover_delay=takeover_delay)


def _redrive(session: Session, celery_app, *, min_age: float, limit: int | None,
             takeover_delay: float) -> tuple[int, int]:
    store = on_session(session)
    dead = runs.mark_dead_boot_runs_sent(store, min_age=min_age, limit=limit)
    queued, depths = [], {}
    # Each queue is budgeted by its own depth: a backlog on one (a queue no worker
    # consumes, say) neither grows without bound nor stops re-sends on another.
    for queue, (names, versions) in _queues_of(
            celery_app, runs.queued_workflows_due(store, min_age=min_age)).items():
        room = limit
        if limit is not None:
            depths[queue] = _queue_depth(celery_app, queue)
            room = max(0, limit - (depths[queue] or 0))
        if room != 0:
            queued += runs.mark_queued_runs_sent(store, min_age=min_age, limit=room,
                                                       names=names, versions=versions)
    # Runs waiting for a slot that is free (its holder's boot died, a run ahead
    # of them was cancelled): the oldest of each group. The end of a slot's
    # holder wakes the next run itself; this is the backstop.
    woken = runs.wake_waiting_runs(store, limit=limit)
    session.commit()
    sent = 0
    for row in woken:
        sent += send_run(celery_app, row.id, f"{row.workflow_name}@{row.workflow_version}",
                         trace=of_run(row), tree=tree_of(row))
    for row in dead:
        # Not before the boot is gone (a delivery then would take nothing over), and not
        # before the takeover delay (the cut-off process may adopt its run first).
        countdown = max(takeover_delay, row.gone_in + GONE_SLACK if row.gone_in else 0.0)
        sent += send_run(celery_app, row.id, f"{row.workflow_name}@{row.workflow_version}",
                         countdown=countdown or None, trace=of_run(row), tree=tree_of(row))
    for row in queued:
        sent += send_run(celery_app, row.id, f"{row.workflow_name}@{row.workflow_version}",
                         trace=of_run(row), tree=tree_of(row))
    metrics.REPAIRS.labels("dead_boot").inc(len(dead))
    metrics.REPAIRS.labels("queued").inc(len(queued))
    metrics.REPAIRS.labels("slot_free").inc(len(woken))
    if dead or queued or woken:
        log.info("repair: re-sent %s run(s) (%s queued, %s held by dead boots, %s waiting for "
                 "a free slot; queue depths %s)", sent, len(queued), len(dead), len(woken),
                 depths)
    elif depths:
        log.info("repair: queues full (%s); no queued run re-sent", depths)
    return sent, len(dead) + len(queued) + len(woken)
