"""Run transitions that no claim fences: admit, cancel, repair's marks, Celery's own ends.

* admit: ``ADMIT`` inserts a run unless its ``(tenant_id, dispatch_key)`` is
  taken, decided by the partial unique index (``ON CONFLICT DO NOTHING``); a
  miss reads the run that holds the key with ``EXISTING``. Never a read first.
  A batch is ``ADMIT_MANY`` (one multi-row insert, its rows ordered by key) and one
  ``HOLDERS`` read for the keys it found taken.
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
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from sqlalchemy import Row, TextClause, text
from sqlalchemy.orm import Session

from app.liveness import LOCK_NAMESPACE, gone_in_sql, gone_sql
from app.models import RunStatus, WaitReason

from .boots import mark_dead_boots
from .compose import (
    JOIN_RELEASE,
    LIMITED_WAITS,
    SLOT_LOCK_NAMESPACE,
    TENANT_LOCK_NAMESPACE,
    WITH_WOKEN,
    due,
    group_lock_key,
    group_scope,
    holds_slot,
    same_group,
    same_tenant,
    send_row_after_commit,
    send_woken,
    slot_release,
    slot_status_is,
    status_is,
    tenant_scope,
    with_event,
    with_woken,
)

# What a statement that may free a slot returns for ``slot_release``.
_SLOT_COLUMNS = "workflow_name, workflow_version, concurrency_key, concurrency_limit"

# -- admit ------------------------------------------------------------------------------------

# A fan-out child's root_run_id: its parent's root, or its parent (a top-level parent has
# none). One lookup of the parent by key, made only for a child: the subquery is an
# InitPlan, run when the CASE first needs it, so a top-level admission pays nothing.
_ROOT_OF_PARENT = ("CASE WHEN CAST(:parent_run_id AS uuid) IS NULL THEN NULL ELSE "
                   "(SELECT coalesce(p.root_run_id, p.id) FROM runs p "
                   "WHERE p.id = CAST(:parent_run_id AS uuid)) END")

ADMIT = with_event(
    f"""
    INSERT INTO runs (id, tenant_id, workflow_ref, workflow_name, workflow_version, input,
                      goal_id, dispatch_key, status, attempt, failures, cancel_requested,
                      origin, origin_detail, parent_run_id, root_run_id, definition_hash,
                      traceparent, tracestate, concurrency_key, concurrency_limit)
    VALUES (:id, :tenant_id, :workflow_ref, :workflow_name, :workflow_version,
            CAST(:input AS jsonb), :goal_id, :dispatch_key, 'queued', 0, 0, false, :origin,
            :origin_detail, :parent_run_id, {_ROOT_OF_PARENT}, :definition_hash,
            :traceparent, :tracestate, :concurrency_key, :concurrency_limit)
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


# A batch (``POST /v1/runs/batch``, a parent's fan-out): ``ADMIT``'s rule for many runs in
# one statement. The requests come as one jsonb array (``:runs``: one object per run, its
# ``ord`` the request's position); each row the index lets in gets its ``run.admitted``
# event in the same statement, and a key already held (or taken by an earlier request of
# the same batch) is skipped, to be read back with ``HOLDERS``. The rows go in ordered by
# key: two batches that share keys take them in one order, so neither can hold a key the
# other waits for while it waits for one the other holds (a deadlock).
ADMIT_MANY = with_event(
    f"""
    INSERT INTO runs (id, tenant_id, workflow_ref, workflow_name, workflow_version, input,
                      goal_id, dispatch_key, status, attempt, failures, cancel_requested,
                      origin, origin_detail, parent_run_id, root_run_id, definition_hash,
                      traceparent, tracestate, concurrency_key, concurrency_limit)
    SELECT r.id, :tenant_id, r.workflow_ref, r.workflow_name, r.workflow_version, r.input,
           r.goal_id, r.dispatch_key, 'queued', 0, 0, false, :origin,
           :origin_detail, :parent_run_id, {_ROOT_OF_PARENT}, r.definition_hash,
           r.traceparent, r.tracestate, r.concurrency_key, r.concurrency_limit
      FROM jsonb_to_recordset(CAST(:runs AS jsonb)) AS r(
           ord int, id uuid, workflow_ref text, workflow_name text, workflow_version text,
           input jsonb, goal_id text, dispatch_key text, definition_hash text,
           traceparent text, tracestate text, concurrency_key text, concurrency_limit int)
     ORDER BY r.dispatch_key, r.ord
    ON CONFLICT (tenant_id, dispatch_key) WHERE dispatch_key IS NOT NULL DO NOTHING
    """,
    "*",
    "'run.admitted'",
    "jsonb_build_object('workflow_ref', workflow_name || '@' || workflow_version, "
    "'goal_id', goal_id, 'dispatch_key', dispatch_key, 'origin', origin)",
)

# A batch's misses: for each request (``:requests``, its ``ord``, key and compared fields)
# whose key was taken, the run that holds it, compared by Postgres as ``EXISTING`` does.
HOLDERS = text(
    """
    SELECT q.ord AS request_ord, runs.*,
           runs.workflow_ref IS NOT DISTINCT FROM q.workflow_ref AS same_workflow_ref,
           runs.input = q.input AS same_input,
           runs.goal_id IS NOT DISTINCT FROM q.goal_id AS same_goal_id
      FROM jsonb_to_recordset(CAST(:requests AS jsonb)) AS q(
           ord int, dispatch_key text, workflow_ref text, input jsonb, goal_id text)
      JOIN runs ON runs.tenant_id = :tenant_id AND runs.dispatch_key = q.dispatch_key
               AND runs.dispatch_key IS NOT NULL
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
        send_row_after_commit(session, row)
    return row


def admit_many(session: Session, *, tenant_id: int, runs_json: str, origin: str,
               origin_detail: str | None, parent_run_id: uuid.UUID | None) -> list[Row]:
    """Insert the runs ``runs_json`` describes (a JSON array of objects: ``ord``, ``id``
    and the per-run columns), each with its ``run.admitted`` event; return the rows
    inserted (a request whose key is taken has none). Each is sent once ``session``
    commits."""
    rows = session.execute(ADMIT_MANY, {
        "tenant_id": tenant_id, "runs": runs_json, "origin": origin,
        "origin_detail": origin_detail, "parent_run_id": parent_run_id}).all()
    for row in rows:
        send_row_after_commit(session, row)
    return rows


def holders_of_keys(session: Session, *, tenant_id: int, requests_json: str) -> list[Row]:
    """The runs holding the keys of ``requests_json`` (a JSON array of objects: ``ord``,
    ``dispatch_key``, ``workflow_ref``, ``input``, ``goal_id``), each with ``request_ord``
    and the ``same_*`` columns comparing that request."""
    return session.execute(HOLDERS, {"tenant_id": tenant_id,
                                     "requests": requests_json}).all()

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
           wait_reason = CASE WHEN status = '{RunStatus.WAITING}' THEN NULL
                              ELSE wait_reason END,
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

# Celery's revoke of a run whose cancel was requested and whose holder is gone
# (``app/liveness.py``: its lock first seen free its bound ago, so no body of it
# runs): it ends cancelled, as a takeover would end it (claims.TAKE_OVER), and its
# slot goes to the next run. Conditional on both, so it races a takeover or the
# run's own finish safely: one wins.
END_ABANDONED = with_event(
    f"""
    UPDATE runs SET status = 'cancelled', finished_at = now(), updated_at = now()
     WHERE id = :run AND status = 'running' AND cancel_requested
       AND {gone_sql("runs.claimed_by")}
    """,
    f"id, tenant_id, status, attempt, {_SLOT_COLUMNS}",
    "'run.cancelled'",
    "jsonb_build_object('attempt', attempt)",
    then=JOIN_RELEASE + slot_release(),
    select=with_woken(join=True),
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
    f"id, tenant_id, status, attempt, error, {_SLOT_COLUMNS}",
    "'run.failed'",
    "jsonb_build_object('attempt', attempt, 'error', error)",
    then=JOIN_RELEASE + slot_release(),
    select=with_woken(join=True),
)


# -- concurrency slots ---------------------------------------------------------------------------

# The locks of a run's groups, taken before any statement that claims, ends or
# parks a run of a limited group (compose.py, "Concurrency slots"): its capped
# tenant first, then its (tenant, workflow, key), in that order everywhere, held
# until the transaction ends. Nothing for a run of an unlimited workflow of an
# uncapped tenant. The aggregate consumes the ordered rows one by one.
LOCK_SLOTS = text(
    f"""
    SELECT count(pg_advisory_xact_lock(l.space, l.key)) AS locks FROM (
           SELECT 1 AS ord, {TENANT_LOCK_NAMESPACE} AS space, r.tenant_id AS key
             FROM runs r JOIN tenants t ON t.id = r.tenant_id
            WHERE r.id = :run AND t.max_running IS NOT NULL
           UNION ALL
           SELECT 2, {SLOT_LOCK_NAMESPACE}, {group_lock_key("r")}
             FROM runs r WHERE r.id = :run AND r.concurrency_limit IS NOT NULL
            ORDER BY ord) AS l
    """
)


# -- the group's locks, then a statement: one round trip ---------------------------------------
#
# A statement that must decide after ``LOCK_SLOTS`` used to cost a transaction of
# its own: BEGIN, the locks, the statement, COMMIT (four round trips). The
# decision's rule needs the locks to be taken *before* the deciding statement's
# snapshot, so the two cannot be one SQL statement. They can be one call: a
# VOLATILE plpgsql function takes a new snapshot for each statement it runs
# (READ COMMITTED), so its ``PERFORM`` of the locks comes first and its ``RETURN
# QUERY`` decides on a snapshot that sees every claim and end of the group
# committed before the locks were granted. Called in autocommit the locks last
# until the call's own transaction ends; in a caller's transaction, until its
# commit (a second take of a lock the transaction holds is a no-op). Its plans
# are cached per connection by plpgsql, so a pooled connection keeps them too.
#
# The argument types of every parameter a locked statement names (``:name``).
_ARGUMENT_TYPES = {
    "run": "uuid", "boot": "uuid", "boots": "uuid[]", "status": "text", "result": "text",
    "error": "text", "failed": "integer", "event_type": "text", "event_extra": "text",
    "entry": "bigint", "entry_no": "integer", "step": "text", "entry_status": "text",
    "actions": "text", "outputs": "text", "entry_error": "text", "next_step": "text",
    "events": "boolean", "entry_event": "text",
}
_PARAMETER = re.compile(r"(?<![:\w]):(\w+)")


@dataclass(frozen=True)
class LockedStatement:
    """A store statement run after its run's slot locks, as one database function.

    ``create``: the ``CREATE OR REPLACE FUNCTION`` a migration runs; ``body``: its
    source as installed (``tests/app/test_slot_functions.py`` compares the two);
    ``call``: the statement the store executes, with the original's parameters.
    """

    name: str
    create: str
    body: str
    call: TextClause


def locked(name: str, statement: TextClause, returns: list[tuple[str, str]]) -> LockedStatement:
    """``statement`` preceded by ``LOCK_SLOTS`` of its ``:run``, as the function ``name``.

    ``returns``: the statement's result columns and their types, in order (a
    column of ``runs`` may be typed ``runs.<column>%TYPE``).
    """
    sql = statement.text
    names = list(dict.fromkeys(_PARAMETER.findall(sql)))
    assert "run" in names, f"{name}: a locked statement is about one run (:run)"
    arguments = ", ".join(f"p_{n} {_ARGUMENT_TYPES[n]}" for n in names)

    def to_argument(sql_: str) -> str:  # :name -> the function's argument p_name
        return _PARAMETER.sub(lambda match: f"p_{match.group(1)}", sql_)

    lock = to_argument(LOCK_SLOTS.text).strip()
    assert lock.startswith("SELECT ")
    take_locks = f"    PERFORM {lock[len('SELECT '):]};\n"
    body = (f"\n#variable_conflict use_column\nBEGIN\n{take_locks}"
            f"    RETURN QUERY {to_argument(sql).strip()};\nEND\n")
    result = ", ".join(f"{column} {type_}" for column, type_ in returns)
    create = (f"CREATE OR REPLACE FUNCTION {name}({arguments}) RETURNS TABLE ({result}) "
              f"LANGUAGE plpgsql VOLATILE AS $body${body}$body$")
    call = text(f"SELECT * FROM {name}({', '.join(':' + n for n in names)})")
    return LockedStatement(name, create, body, call)


def lock_slots(session: Session, run_id: uuid.UUID) -> int:
    """Take the slot locks of ``run_id``'s groups until ``session``'s transaction ends.

    Must run in a transaction (not autocommit): the statements after it decide
    with a snapshot that sees every claim and end of the group committed before.
    Return how many locks (0: the run is in no limited group).
    """
    return int(session.execute(LOCK_SLOTS, {"run": run_id}).scalar_one())


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


# The holder of one run seen without its lock: stamped as ``boots.MARK_BOOT_DEAD`` does.
MARK_HOLDER_DEAD = text(
    f"""
    UPDATE worker_boots b SET first_seen_dead_at = clock_timestamp()
      FROM runs r
     WHERE r.id = :run AND b.boot_id = r.claimed_by AND b.first_seen_dead_at IS NULL
       AND pg_try_advisory_xact_lock_shared({LOCK_NAMESPACE}, b.lock_key)
    """
)


def end_abandoned(session: Session, run_id: uuid.UUID) -> bool:
    """End as cancelled a revoked run whose holder is gone; True if it was (in a
    transaction: a run of a limited group wakes the next one under its slot locks).
    A holder whose lock is free is stamped first seen dead (the revoke's caller asks
    again until it is gone)."""
    session.execute(MARK_HOLDER_DEAD, {"run": run_id})
    lock_slots(session, run_id)
    row = session.execute(END_ABANDONED, {"run": run_id}).one_or_none()
    send_woken(session, row)
    return row is not None


def fail_time_limit(session: Session, run_id: uuid.UUID, *, node: uuid.UUID, pid: int,
                    error: str) -> Row | None:
    """Fail ``run_id`` for Celery's hard time limit if pool process (``node``, ``pid``)
    holds it; the changed row, or None (in a transaction, like ``end_abandoned``)."""
    lock_slots(session, run_id)
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
# Runs held by a dead boot, first seen so (``app/liveness.py``: its lock free; the
# repair stamps every such boot just before, ``MARK_DEAD_BOOTS``): re-sent on the
# first tick after the boot was seen dead, i.e. if not re-sent since the claim (a
# claim or takeover sets updated_at), and after that only once the repair age has
# passed again. Each comes with ``gone_in``: the seconds until its boot is gone (its
# stamp T_c + kill + margin old), which the message waits out (``app/runs.py``): a
# boot whose lock went early may run its bodies until then, and a delivery before it
# takes nothing over (the claim decides; this only saves a repair tick).
DEAD_BOOT_RUNS = text(
    f"""
    UPDATE runs SET last_sent_at = now()
      FROM (SELECT r.id, {gone_in_sql("g")} AS gone_in
              FROM runs r JOIN worker_boots g ON g.boot_id = r.claimed_by
             WHERE r.status = '{RunStatus.RUNNING}'
               AND g.first_seen_dead_at IS NOT NULL
               AND (r.last_sent_at <= r.updated_at
                    OR r.last_sent_at <= now() - make_interval(secs => :min_age))
             ORDER BY r.updated_at
             LIMIT :limit
               FOR UPDATE OF r SKIP LOCKED) AS dead
     WHERE runs.id = dead.id
    RETURNING runs.id, workflow_name, workflow_version, traceparent, tracestate, dead.gone_in,
              attempt, parent_run_id, root_run_id
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
    RETURNING id, workflow_name, workflow_version, traceparent, tracestate, attempt,
              parent_run_id, root_run_id
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


# Waking runs that wait for a slot: as many as will pass the claim, oldest first. The
# claim (``claims._verdict``) lets a run take a slot of its group (a limited (tenant,
# workflow, key); a capped tenant) while the slots held by live boots, the queued due
# runs older than it and the older runs waiting for that slot number fewer than the
# limit. So the waiter at ``place`` in its group's line (1: the oldest) is woken when
# place + held + older queued <= limit: as many as the slots free, never one that
# would park again behind an older one. A tenant whose cap is gone (NULL) holds no
# run back: every run that waited for its cap is woken. In a group's line, runs that
# wait for the tenant's cap stand too (the claim counts them ahead of the group's
# newer runs). The woken runs go back to ``queued`` (``run.woken``), marked sent; each
# claims again under its group's locks. ``waiting``: the waiting runs (``w``) to wake.
def _wake(waiting: str) -> TextClause:
    def ahead(scope: str) -> str:
        """SQL: how many runs of waiter ``w``'s group (``scope`` over ``r``) take a slot
        before it (a sum over one status at a time, as the claim counts)."""
        older = "(r.created_at, r.id) < (w.created_at, w.id)"
        return (f"(SELECT count(*) FROM runs r WHERE {scope} AND {holds_slot('r')})\n"
                f"                              + (SELECT count(*) FROM runs r WHERE {scope}\n"
                f"                                    AND {due('r', slot=True)} AND {older})")

    return with_event(
        f"""
    UPDATE runs SET status = '{RunStatus.QUEUED}', wait_reason = NULL, updated_at = now(),
           last_sent_at = now()
     WHERE id IN (
           SELECT w.id FROM waiters w JOIN tenants t ON t.id = w.tenant_id
            WHERE CASE WHEN w.wait_reason = '{WaitReason.CONCURRENCY}'
                       THEN w.group_place <= w.concurrency_limit
                            AND w.group_place + {ahead(same_group("r", "w"))}
                                <= w.concurrency_limit
                       WHEN t.max_running IS NULL THEN true
                       ELSE w.tenant_place <= t.max_running
                            AND w.tenant_place + {ahead(same_tenant("r", "w"))}
                                <= t.max_running
                  END
            ORDER BY w.created_at, w.id
            LIMIT :limit)
       AND {status_is("runs", RunStatus.WAITING)} AND wait_reason IN {LIMITED_WAITS}
    """,
        "id, tenant_id, workflow_name, workflow_version, traceparent, tracestate, attempt, "
        "parent_run_id, root_run_id",
        "'run.woken'",
        before=f"""
    waiters AS (
        SELECT w.id, w.tenant_id, w.workflow_name, w.concurrency_key, w.concurrency_limit,
               w.wait_reason, w.created_at,
               row_number() OVER (PARTITION BY {group_scope("w")}, w.concurrency_limit IS NULL
                                  ORDER BY w.created_at, w.id) AS group_place,
               row_number() OVER (PARTITION BY w.tenant_id, w.wait_reason
                                  ORDER BY w.created_at, w.id) AS tenant_place
          FROM runs w
         WHERE {waiting}
    ),""",
    )


# Beat's backstop: runs waiting for a slot that is free (a slot's holder died: its
# boot's lock is gone; a queued run ahead of them was cancelled; a cap was raised or
# lifted, or set while runs ran, behind a claim's back), in every group and tenant.
# The statement that ends a slot's holder wakes the next run itself, and a cap change
# wakes its tenant's runs itself (``WAKE_TENANT``).
WAKE_WAITING = _wake(f"w.status = '{RunStatus.WAITING}' AND w.wait_reason IN {LIMITED_WAITS}")

# A tenant's cap change: its lock, the cap, then the runs waiting for the tenant's
# slots that the new cap frees (every one, if the cap was lifted), in one transaction
# (``change_tenant_cap``). The lock is the one every claim of the capped tenant's runs
# takes first (``LOCK_SLOTS``): a claim that read the old cap and is parking a run
# commits before the wake's snapshot (which sees the run and wakes it), and a claim
# that comes after reads the new cap. No run is left waiting for a cap that is gone.
LOCK_TENANT = text(
    f"SELECT pg_advisory_xact_lock({TENANT_LOCK_NAMESPACE}, CAST(:tenant AS integer))")
SET_TENANT_CAP = text("UPDATE tenants SET max_running = :max_running WHERE id = :tenant")
WAKE_TENANT = _wake(
    f"{tenant_scope('w')} = CAST(CAST(:tenant AS integer) AS text) "
    f"AND {slot_status_is('w', RunStatus.WAITING)} AND w.wait_reason = '{WaitReason.TENANT_CAP}'")

# What waiting runs wait for, for the poimen_runs_waiting{reason} gauge.
WAITING_BY_REASON = text(
    f"""
    SELECT coalesce(wait_reason, '{WaitReason.JOIN}') AS reason, count(*) AS runs
      FROM runs WHERE status = '{RunStatus.WAITING}' GROUP BY 1
    """
)


def wake_waiting_runs(session: Session, *, limit: int | None) -> list[Row]:
    """Re-queue (and mark sent) the waiting runs each group has free slots for, oldest
    first, and every run waiting for a cap that was lifted; at most ``limit``."""
    return session.execute(WAKE_WAITING, {"limit": limit}).all()


def change_tenant_cap(session: Session, tenant_id: int, max_running: int | None) -> list[Row]:
    """Set tenant ``tenant_id``'s cap to ``max_running`` (None: no cap) in ``session``'s
    transaction, and re-queue the runs waiting for its slots that the new cap frees:
    every one if it was lifted, oldest first. They are sent once the caller commits;
    return them."""
    session.execute(LOCK_TENANT, {"tenant": tenant_id})
    session.execute(SET_TENANT_CAP, {"tenant": tenant_id, "max_running": max_running})
    woken = session.execute(WAKE_TENANT, {"tenant": tenant_id, "limit": None}).all()
    for row in woken:
        send_row_after_commit(session, row)
    return woken


def waiting_by_reason(session_or_conn) -> dict[str, int]:
    """How many runs wait, by what they wait for."""
    return {row.reason: int(row.runs) for row in session_or_conn.execute(WAITING_BY_REASON)}


def mark_dead_boot_runs_sent(session: Session, *, min_age: float, limit: int | None) -> list[Row]:
    """Stamp the boots whose lock is free, then pick (and mark sent) up to ``limit`` runs
    held by boots seen dead, due for a re-send; each with ``gone_in``, the seconds until
    its boot is gone (a delivery before then takes nothing over)."""
    mark_dead_boots(session)
    return session.execute(DEAD_BOOT_RUNS, {"min_age": min_age, "limit": limit}).all()


def queued_workflows_due(session: Session, *, min_age: float) -> list[Row]:
    """The (workflow_name, workflow_version) pairs with queued runs due for a re-send."""
    return session.execute(QUEUED_WORKFLOWS, {"min_age": min_age}).all()


def mark_queued_runs_sent(session: Session, *, min_age: float, limit: int | None,
                          names: list[str], versions: list[str]) -> list[Row]:
    """Pick (and mark sent) up to ``limit`` queued runs of these workflows, due for a re-send."""
    return session.execute(QUEUED_RUNS, {"min_age": min_age, "limit": limit, "names": names,
                                         "versions": versions}).all()
