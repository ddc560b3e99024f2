"""Runs: reading them, and every run transition that is not fenced by a claim.

Admission (``admission.py``) creates runs; a worker's fenced transitions
(claim, release, retry, finish) live in ``workers/claims.py``. Everything else
that changes a run is here, so each transition has one statement and one home:

* cancel: a queued (or waiting) run becomes ``cancelled``; a running one gets
  ``cancel_requested`` and stops at its workflow's next checkpoint;
* repair: re-sending runs whose Celery message may be lost;
* join release: the end of a run's last child re-queues the waiting parent,
  in the statement that ends the child (``JOIN_RELEASE``, used by every
  statement that ends a run, here and in ``workers/claims.py``).

Views and CLI commands call these; they hold no SQL of their own.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Row, and_, func, or_, select, text
from sqlalchemy.orm import Session

from . import metrics
from .enqueue import enqueue_after_commit, queue_of, send_run
from .events import outbox_rows, with_event
from .liveness import LIVE_BOOTS_SQL
from .models import Run, RunStatus, Tenant

log = logging.getLogger(__name__)

_ENDED = "('succeeded', 'failed', 'cancelled')"

# Joins. A join entry's counters live on its step_entries row, and both sides
# of the race lock that row: the parent going ``waiting`` (workers/ledger.py,
# only while children_done < children_total) and each child's end (below,
# children_done + 1). Whichever comes second sees the other's commit, so the
# parent either never waits or is re-queued by exactly one child: the one
# whose increment makes children_done equal children_total while the entry
# waits. No timer polls for it.
#
# The parent's runs row is updated only for that child. Its WHERE must accept
# the snapshot's version ('running' if the parent went waiting while this
# statement waited on the entry row): Postgres re-checks it on the newest
# version, which is 'waiting', or 'cancelled' (then it is left alone).
JOIN_RELEASE = f""",
    joined AS (
        UPDATE step_entries e SET children_done = e.children_done + 1
          FROM step_children c JOIN changed s ON s.id = c.child_run_id
         WHERE e.id = c.entry_id AND s.status IN {_ENDED}
        RETURNING e.id AS entry_id, e.run_id, e.status, e.children_done, e.children_total
    ),
    woken AS (
        UPDATE runs p
           SET status = CASE WHEN p.status = '{RunStatus.WAITING}' THEN '{RunStatus.QUEUED}'
                             ELSE p.status END,
               updated_at = now(), last_sent_at = now()
          FROM joined j
         WHERE p.id = j.run_id AND j.status = 'waiting' AND j.children_done = j.children_total
           AND p.status NOT IN {_ENDED}
        RETURNING p.id, p.tenant_id, p.status, p.workflow_name, p.workflow_version, j.entry_id
    ),
    woken_event AS ({outbox_rows("woken", "'run.joined'",
                                 "jsonb_build_object('entry_id', entry_id)",
                                 f"status = '{RunStatus.QUEUED}'")})
"""

# The select list of a statement with JOIN_RELEASE: its rows, plus the parents it re-queued.
WITH_WOKEN = (
    "changed.*, (SELECT coalesce(jsonb_agg(jsonb_build_object("
    "'id', w.id, 'ref', w.workflow_name || '@' || w.workflow_version)), '[]'::jsonb) "
    f"FROM woken w WHERE w.status = '{RunStatus.QUEUED}') AS woken"
)


def send_woken(session: Session, row: Row | None) -> None:
    """Send the parents a run's end re-queued (``row.woken``) once ``session`` commits."""
    for parent in (row.woken if row is not None else None) or ():
        enqueue_after_commit(session, uuid.UUID(parent["id"]), parent["ref"])

# One statement, so no interleaving can slip between "cancel if queued" and
# "flag if running": a run that moves running -> queued (a retry, a release)
# while we wait on its row lock is re-checked on its new version by Postgres
# and cancelled outright.
# A waiting run (a join) holds no worker: it is cancelled outright, like a queued one.
_CANCEL = with_event(
    f"""
    UPDATE runs
       SET status = CASE WHEN status IN ('{RunStatus.QUEUED}', '{RunStatus.WAITING}')
                         THEN '{RunStatus.CANCELLED}' ELSE status END,
           finished_at = CASE WHEN status IN ('{RunStatus.QUEUED}', '{RunStatus.WAITING}')
                              THEN now() ELSE finished_at END,
           cancel_requested = true, updated_at = now()
     WHERE id = :run AND tenant_id = :tenant
       AND status IN ('{RunStatus.QUEUED}', '{RunStatus.RUNNING}', '{RunStatus.WAITING}')
    """,
    "*",
    "'run.cancelled'",
    only_if=f"status = '{RunStatus.CANCELLED}'",
    then=JOIN_RELEASE,
    select=WITH_WOKEN,
)

# A delivery found a queued run whose cancellation was requested.
_CANCEL_QUEUED = with_event(
    f"""
    UPDATE runs SET status = '{RunStatus.CANCELLED}', finished_at = now(), updated_at = now()
     WHERE id = :run AND status = '{RunStatus.QUEUED}' AND cancel_requested
    """,
    "id, tenant_id, status",
    "'run.cancelled'",
    then=JOIN_RELEASE,
    select=WITH_WOKEN,
)


def tenant_of(session: Session, run_id: uuid.UUID) -> int | None:
    """Return the tenant id of any tenant's run ``run_id`` (None if there is no such run)."""
    return session.execute(_TENANT_OF, {"run": run_id}).scalar_one_or_none()


_TENANT_OF = text("SELECT tenant_id FROM runs WHERE id = :run")


def cancel_run(session: Session, tenant_id: int, run_id: uuid.UUID) -> Row | None:
    """Cancel ``run_id`` (queued or waiting: at once; running: at its next checkpoint).

    Return the changed row, or None when the run was already finished (then
    there is nothing to cancel). The caller commits; a parent whose join this
    run completes is sent after the commit.
    """
    row = session.execute(_CANCEL, {"run": run_id, "tenant": tenant_id}).one_or_none()
    send_woken(session, row)
    return row


def finish_requested_cancel(session: Session, run_id: uuid.UUID) -> bool:
    """End a queued run whose cancellation was requested; True if it was."""
    row = session.execute(_CANCEL_QUEUED, {"run": run_id}).one_or_none()
    send_woken(session, row)
    return row is not None


def get_run(session: Session, tenant_id: int, run_id: str) -> Run | None:
    """Return ``tenant_id``'s run ``run_id`` (None for a malformed id or another tenant's)."""
    try:
        parsed = uuid.UUID(run_id)
    except ValueError:
        return None
    run = session.get(Run, parsed)
    return run if run is not None and run.tenant_id == tenant_id else None


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
    for name in ("goal_id", "workflow_ref", "dispatch_key", "parent_run_id"):
        value = getattr(where, name)
        if value is not None:
            query = query.where(getattr(Run, name) == value)
    if where.before is not None:
        created, run_id = where.before
        query = query.where(
            or_(Run.created_at < created, and_(Run.created_at == created, Run.id < run_id))
        )
    return list(session.scalars(
        query.order_by(Run.created_at.desc(), Run.id.desc()).limit(limit)
    ))


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


def status_counts(session: Session) -> dict[str, int]:
    """Return how many runs are in each status (all tenants)."""
    return dict(session.execute(select(Run.status, func.count()).group_by(Run.status)).all())


# Repair: two statements, so neither kind of stranded run waits behind the other.
# Each marks what it returns as sent (``last_sent_at = now()``) in the same
# statement; the sends follow the commit. ``FOR UPDATE SKIP LOCKED`` lets two
# repairs (two beats by mistake, beat and an operator) split the work instead
# of sending the same runs twice.
#
# Runs held by a dead boot (its lock is gone): re-sent on the first tick after
# the boot died, i.e. if not re-sent since the claim (a claim or takeover sets
# updated_at), and after that only once the repair age has passed again.
_DEAD_BOOT_RUNS = text(
    f"""
    UPDATE runs SET last_sent_at = now()
     WHERE id IN (
           SELECT r.id FROM runs r
            WHERE r.status = '{RunStatus.RUNNING}'
              AND r.claimed_by NOT IN ({LIVE_BOOTS_SQL})
              AND (r.last_sent_at <= r.updated_at
                   OR r.last_sent_at <= now() - make_interval(secs => :min_age))
            ORDER BY r.updated_at
            LIMIT :limit
              FOR UPDATE OF r SKIP LOCKED)
    RETURNING id, workflow_name, workflow_version
    """
)

# Queued runs whose last send is older than the repair age (a retry's delayed
# message counts as sent at not_before), oldest send first: each tick takes
# the next page instead of the same oldest runs again.
_QUEUED_RUNS = text(
    f"""
    UPDATE runs SET last_sent_at = now()
     WHERE id IN (
           SELECT r.id FROM runs r
            WHERE r.status = '{RunStatus.QUEUED}'
              AND r.last_sent_at <= now() - make_interval(secs => :min_age)
              AND (r.not_before IS NULL
                   OR r.not_before <= now() - make_interval(secs => :min_age))
              AND (r.workflow_name, r.workflow_version) IN (
                   SELECT unnest(CAST(:names AS text[])), unnest(CAST(:versions AS text[])))
            ORDER BY r.last_sent_at
            LIMIT :limit
              FOR UPDATE OF r SKIP LOCKED)
    RETURNING id, workflow_name, workflow_version
    """
)

# The workflows (name, version) that have queued runs due for a re-send: repair
# budgets each Celery queue by its own depth, and a workflow's queue is its
# definition's (``@workflow(queue=...)``), known to the registry, not the row.
_QUEUED_WORKFLOWS = text(
    f"""
    SELECT DISTINCT r.workflow_name, r.workflow_version FROM runs r
     WHERE r.status = '{RunStatus.QUEUED}'
       AND r.last_sent_at <= now() - make_interval(secs => :min_age)
       AND (r.not_before IS NULL
            OR r.not_before <= now() - make_interval(secs => :min_age))
    """
)


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
    """Re-send runs held by dead boots, and queued runs last sent over ``min_age`` s ago.

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

    A dead boot's run is delivered ``takeover_delay`` seconds after it is sent:
    a worker cut off by a Postgres restart may still be executing it and adopts
    it as soon as it has a new boot; the delay lets it, rather than a rescuer
    that would start the run over.

    ``limit=None`` (``flask runs redrive``) re-sends every such run at once,
    whatever the queue holds. Commits the marks, then sends. Return
    ``(sent, found)``.
    """
    params = {"min_age": min_age, "limit": limit}
    dead = session.execute(_DEAD_BOOT_RUNS, params).all()
    queued, depths = [], {}
    # Each queue is budgeted by its own depth: a backlog on one (a queue no worker
    # consumes, say) neither grows without bound nor stops re-sends on another.
    for queue, (names, versions) in _queues_of(
            celery_app, session.execute(_QUEUED_WORKFLOWS, params).all()).items():
        room = limit
        if limit is not None:
            depths[queue] = _queue_depth(celery_app, queue)
            room = max(0, limit - (depths[queue] or 0))
        if room != 0:
            queued += session.execute(_QUEUED_RUNS, {**params, "limit": room, "names": names,
                                                     "versions": versions}).all()
    session.commit()
    sent = 0
    for row in dead:
        sent += send_run(celery_app, row.id, f"{row.workflow_name}@{row.workflow_version}",
                         countdown=takeover_delay or None)
    for row in queued:
        sent += send_run(celery_app, row.id, f"{row.workflow_name}@{row.workflow_version}")
    metrics.REPAIRS.labels("dead_boot").inc(len(dead))
    metrics.REPAIRS.labels("queued").inc(len(queued))
    if dead or queued:
        log.info("repair: re-sent %s run(s) (%s queued, %s held by dead boots; queue depths %s)",
                 sent, len(queued), len(dead), depths)
    elif depths:
        log.info("repair: queues full (%s); no queued run re-sent", depths)
    return sent, len(dead) + len(queued)
