"""Run transitions that no claim fences: admit, cancel, repair's marks, Celery's own ends.

* admit: ``ADMIT`` inserts a run unless its ``(tenant_id, dispatch_key)`` is
  taken, decided by the partial unique index (``ON CONFLICT DO NOTHING``); a
  miss reads the run that holds the key with ``EXISTING``. Never a read first.
  A workflow whose ``key_reuse`` policy allows it takes an ended run's key with
  ``RELEASE_KEY`` (conditional on the holder's status, in the statement) and
  inserts again; the index still decides who holds the key.
* cancel: a queued (or waiting) run becomes ``cancelled``; a running one gets
  ``cancel_requested`` and stops at its workflow's next checkpoint.
* repair: re-sending runs whose Celery message may be lost, marked sent in the
  statement that picks them.
* Celery's revoke of a run whose holder died, and its hard time limit.

Every statement that ends a run counts for its parent's join (``JOIN_RELEASE``).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

from sqlalchemy import Row, text
from sqlalchemy.orm import Session

from app.liveness import LIVE_BOOTS_SQL
from app.models import RunStatus

from .compose import JOIN_RELEASE, WITH_WOKEN, send_after_commit, send_woken, with_event

# -- admit ------------------------------------------------------------------------------------

ADMIT = with_event(
    """
    INSERT INTO runs (id, tenant_id, workflow_ref, workflow_name, workflow_version, input,
                      goal_id, dispatch_key, status, attempt, failures, cancel_requested,
                      origin, origin_detail, parent_run_id, definition_hash,
                      traceparent, tracestate)
    VALUES (:id, :tenant_id, :workflow_ref, :workflow_name, :workflow_version,
            CAST(:input AS jsonb), :goal_id, :dispatch_key, 'queued', 0, 0, false, :origin,
            :origin_detail, :parent_run_id, :definition_hash,
            :traceparent, :tracestate)
    ON CONFLICT (tenant_id, dispatch_key) WHERE dispatch_key IS NOT NULL DO NOTHING
    """,
    "*",
    "'run.admitted'",
    "CAST(:event AS jsonb)",
)

# A miss: the row that holds the key, and whether it was admitted with this very
# request, decided by Postgres on the stored values: jsonb equality compares
# numbers as numbers (1e23 = 100000000000000000000000) and never equates true
# with 1, which Python's == does and a float round trip cannot get right.
EXISTING = text(
    """
    SELECT runs.*,
           workflow_ref IS NOT DISTINCT FROM :workflow_ref AS same_workflow_ref,
           input = CAST(:input AS jsonb) AS same_input,
           goal_id IS NOT DISTINCT FROM :goal_id AS same_goal_id
      FROM runs
     WHERE tenant_id = :tenant_id AND dispatch_key = :dispatch_key
    """
)


# Key reuse: move the key off the run that holds it, if that run ended in a status the
# policy names (and, with a ttl, long enough ago), so the next insert can take it. The
# status is checked here, in the statement that takes the row lock, never by an earlier
# read: of N racing re-admissions one releases the ended run and inserts; the others
# find the key held by that new run (not ended) and replay it.
RELEASE_KEY = text(
    """
    UPDATE runs SET released_key = dispatch_key, dispatch_key = NULL, updated_at = now()
     WHERE tenant_id = :tenant_id AND dispatch_key = :dispatch_key
       AND workflow_name = :workflow_name
       AND status = ANY(CAST(:reusable AS text[]))
       AND finished_at <= now() - make_interval(secs => :ttl)
    RETURNING id
    """
)


def release_key(session: Session, *, tenant_id: int, dispatch_key: str, workflow_name: str,
                reusable: tuple[str, ...], ttl: float) -> bool:
    """Free ``dispatch_key`` from its run if that run (of ``workflow_name``) ended in one of
    ``reusable`` at least ``ttl`` seconds ago; True if it did."""
    if not reusable:
        return False
    return session.execute(RELEASE_KEY, {
        "tenant_id": tenant_id, "dispatch_key": dispatch_key, "workflow_name": workflow_name,
        "reusable": list(reusable), "ttl": ttl}).one_or_none() is not None


def admit(session: Session, values: dict, *, input_json: str, event_json: str) -> Row | None:
    """Insert the run ``values`` describe with its ``run.admitted`` event; None if its key
    is taken. The run is sent to the workers once ``session`` commits."""
    row = session.execute(ADMIT, {**values, "input": input_json, "event": event_json}
                          ).one_or_none()
    if row is not None:
        send_after_commit(session, row.id, f"{row.workflow_name}@{row.workflow_version}",
                          row.traceparent, row.tracestate)
    return row


def holder_of_key(session: Session, *, tenant_id: int, dispatch_key: str, workflow_ref: str,
                  input_json: str, goal_id: str | None) -> Row | None:
    """The run that holds ``dispatch_key``, with ``same_*`` columns comparing this request."""
    return session.execute(EXISTING, {
        "tenant_id": tenant_id, "dispatch_key": dispatch_key, "workflow_ref": workflow_ref,
        "input": input_json, "goal_id": goal_id,
    }).one_or_none()


# -- cancel -----------------------------------------------------------------------------------

# One statement, so no interleaving can slip between "cancel if queued" and
# "flag if running": a run that moves running -> queued (a retry, a release)
# while we wait on its row lock is re-checked on its new version by Postgres
# and cancelled outright.
# A waiting run (a join) holds no worker: it is cancelled outright, like a queued one.
CANCEL = with_event(
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
CANCEL_QUEUED = with_event(
    f"""
    UPDATE runs SET status = '{RunStatus.CANCELLED}', finished_at = now(), updated_at = now()
     WHERE id = :run AND status = '{RunStatus.QUEUED}' AND cancel_requested
    """,
    "id, tenant_id, status",
    "'run.cancelled'",
    then=JOIN_RELEASE,
    select=WITH_WOKEN,
)

# Celery's revoke of a run whose cancel was requested and whose holder is dead:
# it ends cancelled, as a takeover would end it (claims.TAKE_OVER). Conditional
# on both, so it races a takeover or the run's own finish safely: one wins.
END_ABANDONED = with_event(
    f"""
    UPDATE runs SET status = 'cancelled', finished_at = now(), updated_at = now()
     WHERE id = :run AND status = 'running' AND cancel_requested
       AND claimed_by NOT IN ({LIVE_BOOTS_SQL})
    """,
    "id, tenant_id, status, attempt",
    "'run.cancelled'",
    "jsonb_build_object('attempt', attempt)",
    then=JOIN_RELEASE,
    select=WITH_WOKEN,
)

# Celery's hard time limit: only the run held by the very pool process Celery
# is about to kill: its boots are this worker's (node: the main process's own
# id) with its pid, and only while it runs there. Another container's process
# with the same hostname and pid is another node.
TIME_LIMIT = with_event(
    """
    UPDATE runs SET status = 'failed', error = CAST(:error AS jsonb),
           failures = failures + 1, finished_at = now(), updated_at = now()
     WHERE id = :run AND status = 'running'
       AND claimed_by IN (SELECT boot_id FROM worker_boots
                           WHERE node = :node AND pid = :pid)
    """,
    "id, tenant_id, status, attempt, error",
    "'run.failed'",
    "jsonb_build_object('attempt', attempt, 'error', error)",
    then=JOIN_RELEASE,
    select=WITH_WOKEN,
)


def cancel_run(session: Session, tenant_id: int, run_id: uuid.UUID) -> Row | None:
    """Cancel ``run_id`` (queued or waiting: at once; running: at its next checkpoint).

    Return the changed row, or None when the run was already finished (then
    there is nothing to cancel). The caller commits; a parent whose join this
    run completes is sent after the commit.
    """
    row = session.execute(CANCEL, {"run": run_id, "tenant": tenant_id}).one_or_none()
    send_woken(session, row)
    return row


def finish_requested_cancel(session: Session, run_id: uuid.UUID) -> bool:
    """End a queued run whose cancellation was requested; True if it was."""
    row = session.execute(CANCEL_QUEUED, {"run": run_id}).one_or_none()
    send_woken(session, row)
    return row is not None


def end_abandoned(session: Session, run_id: uuid.UUID) -> bool:
    """End as cancelled a revoked run whose holder is dead; True if it was."""
    row = session.execute(END_ABANDONED, {"run": run_id}).one_or_none()
    send_woken(session, row)
    return row is not None


def fail_time_limit(session: Session, run_id: uuid.UUID, *, node: uuid.UUID, pid: int,
                    error: str) -> Row | None:
    """Fail ``run_id`` for Celery's hard time limit if pool process (``node``, ``pid``)
    holds it; the changed row, or None."""
    row = session.execute(TIME_LIMIT, {"run": run_id, "node": node, "pid": pid,
                                       "error": error}).one_or_none()
    send_woken(session, row)
    return row


# -- repair -----------------------------------------------------------------------------------

# Repair: two statements, so neither kind of stranded run waits behind the other.
# Each marks what it returns as sent (``last_sent_at = now()``) in the same
# statement; the sends follow the commit. ``FOR UPDATE SKIP LOCKED`` lets two
# repairs (two beats by mistake, beat and an operator) split the work instead
# of sending the same runs twice.
#
# Runs held by a dead boot (its lock is gone): re-sent on the first tick after
# the boot died, i.e. if not re-sent since the claim (a claim or takeover sets
# updated_at), and after that only once the repair age has passed again.
DEAD_BOOT_RUNS = text(
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
    RETURNING id, workflow_name, workflow_version, traceparent, tracestate
    """
)

# Queued runs whose last send is older than the repair age (a retry's delayed
# message counts as sent at not_before), oldest send first: each tick takes
# the next page instead of the same oldest runs again.
QUEUED_RUNS = text(
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
    RETURNING id, workflow_name, workflow_version, traceparent, tracestate
    """
)

# The workflows (name, version) that have queued runs due for a re-send: repair
# budgets each Celery queue by its own depth, and a workflow's queue is its
# definition's (``@workflow(queue=...)``), known to the registry, not the row.
QUEUED_WORKFLOWS = text(
    f"""
    SELECT DISTINCT r.workflow_name, r.workflow_version FROM runs r
     WHERE r.status = '{RunStatus.QUEUED}'
       AND r.last_sent_at <= now() - make_interval(secs => :min_age)
       AND (r.not_before IS NULL
            OR r.not_before <= now() - make_interval(secs => :min_age))
    """
)


# One repair at a time: two beats (a deploy overlap) would each read a queue's depth and
# each re-send up to a page below it, twice the bound between them. A transaction-scoped
# advisory lock, held on a connection of its own from before the marks until after the
# sends (a lock released at the marks' commit would let a second repair read the depth
# before the first one's sends land). Transaction-scoped: safe behind a transaction-mode
# pooler, which pins a server connection for a transaction.
REPAIR_LOCK_NAMESPACE = 0x52455052  # "REPR", apart from the boots' and the outbox's locks
TRY_REPAIR_LOCK = text("SELECT pg_try_advisory_xact_lock(:namespace, 0)")
WAIT_REPAIR_LOCK = text("SELECT true FROM (SELECT pg_advisory_xact_lock(:namespace, 0)) AS held")


@contextlib.contextmanager
def repair_lock(session: Session, *, wait: bool) -> Iterator[bool]:
    """Hold the repair lock for the ``with`` block; yield whether it is held (``wait``: block
    until it is)."""
    conn = session.get_bind().connect()
    try:
        with conn.begin():
            statement = WAIT_REPAIR_LOCK if wait else TRY_REPAIR_LOCK
            yield bool(conn.execute(statement, {"namespace": REPAIR_LOCK_NAMESPACE}).scalar())
    finally:
        conn.close()


def mark_dead_boot_runs_sent(session: Session, *, min_age: float, limit: int | None) -> list[Row]:
    """Pick (and mark sent) up to ``limit`` runs held by dead boots, due for a re-send."""
    return session.execute(DEAD_BOOT_RUNS, {"min_age": min_age, "limit": limit}).all()


def queued_workflows_due(session: Session, *, min_age: float) -> list[Row]:
    """The (workflow_name, workflow_version) pairs with queued runs due for a re-send."""
    return session.execute(QUEUED_WORKFLOWS, {"min_age": min_age}).all()


def mark_queued_runs_sent(session: Session, *, min_age: float, limit: int | None,
                          names: list[str], versions: list[str]) -> list[Row]:
    """Pick (and mark sent) up to ``limit`` queued runs of these workflows, due for a re-send."""
    return session.execute(QUEUED_RUNS, {"min_age": min_age, "limit": limit, "names": names,
                                         "versions": versions}).all()
