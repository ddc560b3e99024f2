"""The two pieces many store statements share, and how a transition asks for a send.

* ``with_event`` / ``outbox_rows``: a change of a run writes its event row in the
  same statement, so an event exists exactly when its change committed;
* ``JOIN_RELEASE`` / ``WITH_WOKEN``: every statement that ends a run counts the
  end for its parent's join and re-queues the parent whose last child it was;
* ``slot_release`` / ``with_woken``: every statement that takes a run of a
  limited group (or a capped tenant) out of ``running`` re-queues the oldest run
  waiting for that slot.

Every statement built from these is printed whole, as Postgres receives it, in
``app/state/rendered.sql``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from sqlalchemy import Row, TextClause, text
from sqlalchemy.orm import Session

from app.liveness import held_by_sql
from app.models import RunStatus, WaitReason

# The statuses a run never leaves.
ENDED = "('succeeded', 'failed', 'cancelled', 'poisoned')"

# Where a transition leaves the runs to send once its transaction commits
# (``{run_id: (workflow_ref, traceparent, tracestate, retries, parent_id, root_id)}`` on
# ``session.info``): ``app/enqueue.py`` hands them to the sender after commit and forgets
# them on rollback. The trace context is the run's (its columns), carried as plain values;
# retries, parent_id and root_id are what the message tells Celery (and Flower) of the
# run's attempt and run tree (``tree_of``).
PENDING_SENDS = "poimen_pending_enqueue"


# json.dumps(value, default=str) made once: json.dumps with an argument makes an encoder
# per call, more than half of a small value's CPU.
_ENCODE = json.JSONEncoder(default=str).encode


def to_json(value: Any) -> str | None:
    """A parameter for a ``jsonb`` column: ``value`` as JSON (what it cannot write, as its
    ``str``), None as SQL NULL."""
    return None if value is None else _ENCODE(value)


def send_after_commit(session: Session, run_id: uuid.UUID, workflow_ref: str,
                      traceparent: str | None = None, tracestate: str | None = None,
                      retries: int = 0, parent_id: str | None = None,
                      root_id: str | None = None) -> None:
    """Send ``run_id`` to the workers once ``session``'s transaction commits; its message
    carries the run's W3C Trace Context (``traceparent``, ``tracestate``) as headers, and
    Celery's ``retries``, ``parent_id`` and ``root_id`` (None: the run itself) of the run."""
    session.info.setdefault(PENDING_SENDS, {})[run_id] = (
        workflow_ref, traceparent, tracestate, retries, parent_id, root_id)


def tree_of(row: Any) -> tuple[int, str | None, str | None]:
    """``(retries, parent_id, root_id)`` of a run's next message, from its row: Celery's
    ``retries`` is the executions the run has started (its ``attempt``: 0 until the first),
    ``parent_id`` the run that fanned it out, ``root_id`` its tree's root (None: itself; a
    child admitted before ``root_run_id`` existed names its parent). A row without these
    columns reads as a first, top-level send."""
    parent = getattr(row, "parent_run_id", None)
    root = getattr(row, "root_run_id", None) or parent
    return (getattr(row, "attempt", None) or 0, str(parent) if parent else None,
            str(root) if root else None)


def send_row_after_commit(session: Session, row: Any) -> None:
    """``send_after_commit`` of the run ``row`` (its id, ref, trace context and tree)."""
    send_after_commit(session, row.id, f"{row.workflow_name}@{row.workflow_version}",
                      row.traceparent, row.tracestate, *tree_of(row))


def send_woken(session: Session, row: Row | None) -> None:
    """Send the parents a run's end re-queued (``row.woken``) once ``session`` commits."""
    for parent in (row.woken if row is not None else None) or ():
        send_after_commit(session, uuid.UUID(parent["id"]), parent["ref"],
                          parent.get("traceparent"), parent.get("tracestate"),
                          parent.get("attempt") or 0, parent.get("parent_run_id"),
                          parent.get("root_run_id") or parent.get("parent_run_id"))


def outbox_rows(source: str, event_type: str, fields: str = "'{}'::jsonb",
                only_if: str = "true", *, run_id: str = "id",
                tenant_id: str = "tenant_id", order_by: str = "") -> str:
    """SQL that appends one event per row of ``source`` (a CTE name) to the outbox.

    For statements that compose several changes in one round trip (the step
    ledger's): put it in a ``WITH`` as ``name AS (<this>)``. ``run_id`` and
    ``tenant_id`` are SQL expressions over ``source``'s columns; ``event_type``
    and ``fields`` as in ``with_event``; ``order_by`` orders several events of
    one statement (their ids follow it).
    """
    return f"""
        INSERT INTO outbox (tenant_id, run_id, event_type, payload)
        SELECT {tenant_id}, {run_id}, {event_type},
               jsonb_build_object('run_id', ({run_id})::text, 'type', {event_type}) || {fields}
          FROM {source}
         WHERE {only_if}
         {f"ORDER BY {order_by}" if order_by else ""}
    """


def with_event(change: str, returning: str, event_type: str, fields: str = "'{}'::jsonb",
               only_if: str = "true", *, before: str = "", then: str = "",
               select: str = "*") -> TextClause:
    """Wrap ``change`` (an INSERT or UPDATE of ``runs``) so it writes its event too.

    ``returning`` is the change's RETURNING list and must include ``id`` and
    ``tenant_id``; ``event_type`` and ``fields`` are SQL expressions over those
    rows (``fields`` a jsonb object); ``only_if`` selects the rows that get an
    event. One statement, one round trip: the event exists iff the change does.
    ``before`` and ``then`` are further CTEs (each ending in a comma / starting
    with one) around ``changed``; ``select`` is the final select list over it.
    """
    return text(
        f"""
        WITH {before} changed AS ({change} RETURNING {returning}),
        event AS ({outbox_rows("changed", event_type, fields, only_if)})
        {then}
        SELECT {select} FROM changed
        """
    )


# Joins. A join entry's counters live on its step_entries row, and both sides
# of the race lock that row: the parent going ``waiting`` (ledger.WAIT, only
# while children_done < children_total) and each child's end (below,
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
         WHERE e.id = c.entry_id AND s.status IN {ENDED}
        RETURNING e.id AS entry_id, e.run_id, e.status, e.children_done, e.children_total
    ),
    woken AS (
        UPDATE runs p
           SET status = CASE WHEN p.status = '{RunStatus.WAITING}' THEN '{RunStatus.QUEUED}'
                             ELSE p.status END,
               wait_reason = CASE WHEN p.status = '{RunStatus.WAITING}' THEN NULL
                                  ELSE p.wait_reason END,
               updated_at = now(), last_sent_at = now()
          FROM joined j
         WHERE p.id = j.run_id AND j.status = 'waiting' AND j.children_done = j.children_total
           AND p.status NOT IN {ENDED}
        RETURNING p.id, p.tenant_id, p.status, p.workflow_name, p.workflow_version, j.entry_id,
                  p.traceparent, p.tracestate, p.attempt, p.parent_run_id, p.root_run_id
    ),
    woken_event AS ({outbox_rows("woken", "'run.joined'",
                                 "jsonb_build_object('entry_id', entry_id)",
                                 f"status = '{RunStatus.QUEUED}'")})
"""

# The select list of a statement with JOIN_RELEASE: its rows, plus the parents it re-queued.
WITH_WOKEN = (
    "changed.*, (SELECT coalesce(jsonb_agg(jsonb_build_object("
    "'id', w.id, 'ref', w.workflow_name || '@' || w.workflow_version, "
    "'traceparent', w.traceparent, 'tracestate', w.tracestate, 'attempt', w.attempt, "
    "'parent_run_id', w.parent_run_id, 'root_run_id', w.root_run_id)), '[]'::jsonb) "
    f"FROM woken w WHERE w.status = '{RunStatus.QUEUED}') AS woken"
)


# Concurrency slots (docs/internals/execution.md#concurrency-limits-and-tenant-caps).
#
# A run's *group* is (tenant, workflow name, concurrency_key) when its workflow
# declares a limit (``concurrency_limit`` pinned on the run at admission); its
# tenant is a group too when ``tenants.max_running`` is set. Every statement that
# puts a run of a group into ``running`` or takes it out, or makes one wait for a
# slot, runs after ``pg_advisory_xact_lock`` of the group (tenant first, then the
# key: ``runs.LOCK_SLOTS``), in the same transaction: its snapshot, taken after
# the lock, sees every earlier claim and end of the group, so a claim's count is
# never stale and a wake-up never misses a run that just went waiting.
SLOT_LOCK_NAMESPACE = 0x504F4943  # "POIC": a (tenant, workflow, key) group's lock
TENANT_LOCK_NAMESPACE = 0x504F4954  # "POIT": a capped tenant's lock
LIMITED_WAITS = f"('{WaitReason.CONCURRENCY}', '{WaitReason.TENANT_CAP}')"


UNFINISHED = f"('{RunStatus.QUEUED}', '{RunStatus.RUNNING}', '{RunStatus.WAITING}')"


def group_scope(r: str) -> str:
    """SQL: run ``r``'s concurrency group as one text value, the leading column of
    ``ix_runs_slot_group`` (migration 0017). A workflow name has no ``|``
    (``workers.registry.REF_PATTERN``) and the key comes last, so two groups never
    share a value."""
    return (f"(CAST({r}.tenant_id AS text) || '|' || {r}.workflow_name || '|' "
            f"|| coalesce({r}.concurrency_key, ''))")


def tenant_scope(r: str) -> str:
    """SQL: run ``r``'s tenant, the leading column of ``ix_runs_tenant_slots``."""
    return f"CAST({r}.tenant_id AS text)"


def same_group(r: str, s: str) -> str:
    """SQL: run ``r`` is an unfinished run of the concurrency group of run ``s`` (both
    limited), in the terms of ``ix_runs_slot_group`` only: with ``slot_status`` for the
    status, no other index of ``runs`` can serve the statement (docs/internals/
    execution.md, "Plans that statistics cannot turn")."""
    return (f"{group_scope(r)} = {group_scope(s)} AND {r}.concurrency_limit IS NOT NULL "
            f"AND {slot_status(r)} IN {UNFINISHED}")


def same_tenant(r: str, s: str) -> str:
    """SQL: run ``r`` is an unfinished run of run ``s``'s tenant, in the terms of
    ``ix_runs_tenant_slots`` only (see ``same_group``)."""
    return f"{tenant_scope(r)} = {tenant_scope(s)} AND {slot_status(r)} IN {UNFINISHED}"


def group_lock_key(r: str) -> str:
    """SQL: the second key of run ``r``'s group lock (a collision only serializes more)."""
    return f"hashtext({group_scope(r)})"


def status_is(r: str, status: str) -> str:
    """SQL: run ``r`` has ``status``, in a form no index can serve: for a statement about
    one run, found by its primary key.

    ``r.status = 'queued'`` would let the planner read any index whose predicate or
    leading column it matches (``ix_runs_queued_last_sent`` holds every queued run;
    ``ix_runs_status_updated`` every run by status) and filter it by id, whenever the
    statistics say that index is small, as they do after a quiet spell; under a burst
    that read grows with the backlog (seen in bench/execution.py: generic plans made on
    such statistics). ``|| ''`` keeps the condition, re-checked on the newest row
    version like any other, and no index is built on it, so the primary key is the only
    index that applies. The slot indexes are built on another expression
    (``slot_status``) for the same reason: a lookup by id must not imply their
    predicates either.
    """
    return f"({r}.status || '') = '{status}'"


def slot_status(r: str) -> str:
    """SQL: run ``r``'s status as the slot indexes hold it (migration 0017).

    The slot counts and wake-ups read runs by group or tenant and status (``same_group``,
    ``same_tenant``, ``slot_status_is``); written so, only ``ix_runs_slot_group`` and
    ``ix_runs_tenant_slots`` can serve them, whatever the statistics say. Not
    ``status_is``'s expression: an index on that one would serve (badly, by a scan of
    the whole index) every lookup by id."""
    return f"('' || {r}.status)"


def slot_status_is(r: str, status: str) -> str:
    """SQL: run ``r`` has ``status``, for a slot count or wake-up (``slot_status``)."""
    return f"{slot_status(r)} = '{status}'"


def holds_slot(r: str) -> str:
    """SQL: run ``r`` holds a slot: running under a boot that still holds its runs
    (``held_by_sql``: a boot whose lock went early keeps its slots until the server first
    saw it free T_c + kill + margin ago, since its body may run until then; a gone boot's
    slot is free). For a slot count (``slot_status``)."""
    return f"{slot_status_is(r, RunStatus.RUNNING)} AND {held_by_sql(f'{r}.claimed_by')}"


def due(r: str, *, slot: bool = False) -> str:
    """SQL: run ``r`` is queued and may be claimed now (not cancelled, its retry due).

    ``slot``: in a slot count (``slot_status``); else ``r`` is one run found by id."""
    queued = slot_status_is(r, RunStatus.QUEUED) if slot else status_is(r, RunStatus.QUEUED)
    return (f"{queued} AND NOT {r}.cancel_requested "
            f"AND ({r}.not_before IS NULL OR {r}.not_before <= now())")


def slot_release(source: str = "changed", when: str = "true") -> str:
    """CTEs (``slot_woken``, its events) that re-queue, for each row of ``source`` that
    left a slot (``when``), the oldest run waiting for a slot of its group and of its
    capped tenant. ``source`` needs id, tenant_id, workflow_name, concurrency_key and
    concurrency_limit. The woken runs are sent after commit (``with_woken``)."""
    return f""",
    slot_woken AS (
        UPDATE runs w
           SET status = '{RunStatus.QUEUED}', wait_reason = NULL, updated_at = now(),
               last_sent_at = now()
         WHERE w.id IN (
               SELECT (SELECT r.id FROM runs r
                        WHERE {same_group("r", "s")} AND {slot_status_is("r", RunStatus.WAITING)}
                          AND r.wait_reason = '{WaitReason.CONCURRENCY}'
                        ORDER BY r.created_at, r.id LIMIT 1)
                 FROM {source} s WHERE s.concurrency_limit IS NOT NULL AND {when}
               UNION
               SELECT (SELECT r.id FROM runs r
                        WHERE {same_tenant("r", "s")} AND {slot_status_is("r", RunStatus.WAITING)}
                          AND r.wait_reason = '{WaitReason.TENANT_CAP}'
                        ORDER BY r.created_at, r.id LIMIT 1)
                 FROM {source} s JOIN tenants t ON t.id = s.tenant_id
                WHERE t.max_running IS NOT NULL AND {when})
           AND {status_is('w', RunStatus.WAITING)} AND w.wait_reason IN {LIMITED_WAITS}
        RETURNING w.id, w.tenant_id, w.workflow_name, w.workflow_version, w.traceparent,
                  w.tracestate, w.attempt, w.parent_run_id, w.root_run_id
    ),
    slot_woken_event AS ({outbox_rows("slot_woken", "'run.woken'")})
"""


def with_woken(*, join: bool) -> str:
    """The select list of a statement with ``slot_release`` (and ``JOIN_RELEASE`` if
    ``join``): its rows, plus every run it re-queued (``woken``: id, ref, trace context)."""
    columns = ("w.id, w.workflow_name, w.workflow_version, w.traceparent, w.tracestate, "
               "w.attempt, w.parent_run_id, w.root_run_id")
    woken = (f"SELECT {columns} FROM woken w WHERE w.status = '{RunStatus.QUEUED}' UNION ALL "
             if join else "")
    return (
        "changed.*, (SELECT coalesce(jsonb_agg(jsonb_build_object("
        "'id', w.id, 'ref', w.workflow_name || '@' || w.workflow_version, "
        "'traceparent', w.traceparent, 'tracestate', w.tracestate, 'attempt', w.attempt, "
        "'parent_run_id', w.parent_run_id, 'root_run_id', w.root_run_id)), '[]'::jsonb) "
        f"FROM ({woken}SELECT {columns} FROM slot_woken w) w) AS woken"
    )
