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

Every statement that ends a run counts for its parent's join (its ``joined`` and
``woken`` parts), and one that frees a slot wakes the next run waiting for it
(``slot_woken``): ``sql/README.md``. The statements are in ``sql/runs.sql``.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy.engine import Engine

from .boots import mark_dead_boots
from .compose import RunToSend, send_row_after_commit, send_woken, woken_of
from .executor import Executor, build
from .statements import function, sql, statement


@dataclass(frozen=True)
class AdmittedRun:
    """A run as admission inserted it (or found it under its key): every column."""

    id: uuid.UUID
    tenant_id: int
    workflow_ref: str
    workflow_name: str
    workflow_version: str
    input: Any
    goal_id: str | None
    dispatch_key: str | None
    released_key: str | None
    status: str
    attempt: int
    failures: int
    takeovers: int
    claimed_by: uuid.UUID | None
    cancel_requested: bool
    result: Any
    error: dict[str, Any] | None
    origin: str
    origin_detail: str | None
    parent_run_id: uuid.UUID | None
    root_run_id: uuid.UUID | None
    definition_hash: str | None
    traceparent: str | None
    tracestate: str | None
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    not_before: datetime | None
    last_sent_at: datetime
    concurrency_key: str | None
    concurrency_limit: int | None
    wait_reason: str | None
    admitted_not_before: datetime | None
    expires_at: datetime | None
    due: bool  # not delayed, or its not_before passed: it may be sent now


@dataclass(frozen=True)
class KeyHolder(AdmittedRun):
    """The run that holds a requested key, compared with the request by Postgres
    (``same_*``: the stored value equals the request's)."""

    same_workflow_ref: bool
    same_input: bool
    same_goal_id: bool
    same_not_before: bool
    same_expires_at: bool


@dataclass(frozen=True)
class BatchKeyHolder(KeyHolder):
    """A ``KeyHolder`` of a batch's request ``request_ord``."""

    request_ord: int


@dataclass(frozen=True)
class Cancel:
    """What a cancel did to a run that had not ended: ``status`` ``cancelled`` (it was
    queued or waiting), or still ``running`` with ``cancel_requested``."""

    id: uuid.UUID
    tenant_id: int
    status: str
    cancel_requested: bool


@dataclass(frozen=True)
class WokenRun(RunToSend):
    """A waiting run re-queued for a slot (marked sent): the caller sends it."""

    tenant_id: int


@dataclass(frozen=True)
class StrandedRun(RunToSend):
    """A run held by a boot seen dead, marked sent: ``gone_in``, the seconds until its
    boot is gone (a delivery before then takes nothing over)."""

    gone_in: float


@dataclass(frozen=True)
class Timing:
    """When a run may start and until when (admission's ``not_before``/``delay_seconds``,
    ``expires_at``/``expires_in_seconds``): an instant, or seconds counted by Postgres from
    the admission. Nothing set: due now, never expires."""

    not_before: datetime | None = None
    delay: float | None = None
    expires_at: datetime | None = None
    expires_in: float | None = None

    def insert(self) -> dict[str, Any]:
        """The parameters ``admit`` (and an ``admit_many`` row) takes."""
        return {"not_before": _iso(self.not_before), "delay": self.delay,
                "expires_at": _iso(self.expires_at), "expires_in": self.expires_in}

    def compared(self) -> dict[str, Any]:
        """The parameters ``existing`` (and a ``holders`` request) compares a holder with."""
        return {"not_before": _iso(self.not_before),
                "delayed": self.not_before is not None or self.delay is not None,
                "expires_at": _iso(self.expires_at),
                "expiring": self.expires_at is not None or self.expires_in is not None}


NO_TIMING = Timing()


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


class WorkflowVersion(NamedTuple):
    workflow_name: str
    workflow_version: str

# -- admit ------------------------------------------------------------------------------------

# The statements of ``sql/runs.sql``, in its order.
ADMIT = statement("admit")
EXISTING = statement("existing")
ADMIT_MANY = statement("admit_many")
HOLDERS = statement("holders")
RELEASE_KEY = statement("release_key")


def release_key(session: Executor, *, tenant_id: int, dispatch_key: str, workflow_name: str,
                reusable: tuple[str, ...], ttl: float) -> bool:
    """Free ``dispatch_key`` from its run if that run (of ``workflow_name``) ended in one of
    ``reusable`` at least ``ttl`` seconds ago; True if it did."""
    if not reusable:
        return False
    return session.execute(RELEASE_KEY, {
        "tenant_id": tenant_id, "dispatch_key": dispatch_key, "workflow_name": workflow_name,
        "reusable": list(reusable), "ttl": ttl}).one_or_none() is not None


def admit(session: Executor, values: dict[str, Any], *, input_json: str,
          event_json: str) -> AdmittedRun | None:
    """Insert the run ``values`` describe with its ``run.admitted`` event; None if its key
    is taken. The run is sent to the workers once ``session`` commits."""
    row = session.execute(ADMIT, {**values, "input": input_json, "event": event_json}
                          ).one_or_none()
    if row is None:
        return None
    if row.due:  # a delayed run is sent when due, by beat (``release_due_runs``)
        send_row_after_commit(session, row)
    return build(AdmittedRun, row)


def admit_many(session: Executor, *, tenant_id: int, runs_json: str, origin: str,
               origin_detail: str | None, parent_run_id: uuid.UUID | None
               ) -> list[AdmittedRun]:
    """Insert the runs ``runs_json`` describes (a JSON array of objects: ``ord``, ``id``
    and the per-run columns), each with its ``run.admitted`` event; return the rows
    inserted (a request whose key is taken has none). Each is sent once ``session``
    commits."""
    rows = session.execute(ADMIT_MANY, {
        "tenant_id": tenant_id, "runs": runs_json, "origin": origin,
        "origin_detail": origin_detail, "parent_run_id": parent_run_id}).all()
    for row in rows:
        if row.due:  # a delayed run is sent when due, by beat (``release_due_runs``)
            send_row_after_commit(session, row)
    return [build(AdmittedRun, row) for row in rows]


def holders_of_keys(session: Executor, *, tenant_id: int, requests_json: str
                    ) -> list[BatchKeyHolder]:
    """The runs holding the keys of ``requests_json`` (a JSON array of objects: ``ord``,
    ``dispatch_key``, ``workflow_ref``, ``input``, ``goal_id`` and ``Timing.compared()``'s
    fields), each with ``request_ord``
    and the ``same_*`` columns comparing that request."""
    return [build(BatchKeyHolder, row) for row in session.execute(
        HOLDERS, {"tenant_id": tenant_id, "requests": requests_json}).all()]


def holder_of_key(session: Executor, *, tenant_id: int, dispatch_key: str, workflow_ref: str,
                  input_json: str, goal_id: str | None,
                  timing: Timing = NO_TIMING) -> KeyHolder | None:
    """The run that holds ``dispatch_key``, with ``same_*`` columns comparing this request."""
    row = session.execute(EXISTING, {
        "tenant_id": tenant_id, "dispatch_key": dispatch_key, "workflow_ref": workflow_ref,
        "input": input_json, "goal_id": goal_id, **timing.compared(),
    }).one_or_none()
    return None if row is None else build(KeyHolder, row)


# -- cancel -----------------------------------------------------------------------------------

CANCEL = function("poimen_cancel")
CANCEL_QUEUED = function("poimen_cancel_queued")
END_ABANDONED = function("poimen_end_abandoned")
TIME_LIMIT = function("poimen_time_limit")
EXPIRE = function("poimen_expire")


# -- concurrency slots ---------------------------------------------------------------------------

LOCK_SLOTS = function("poimen_lock_slots")
# What follows runs' ends (their parents' joins counted, their slots handed on), called by
# the functions that end runs or take them out of ``running``.
ENDED = function("poimen_ended")
# A one-run change's event and what it sets off: the tail of the functions that end a run
# or take it out of ``running`` (all but ``poimen_finish`` and ``poimen_take_over``).
EVENT_ENDED = function("poimen_event_ended")


def lock_slots(session: Executor, run_id: uuid.UUID) -> int:
    """Take the slot locks of ``run_id``'s groups until ``session``'s transaction ends.

    Must run in a transaction (not autocommit): the statements after it decide
    with a snapshot that sees every claim and end of the group committed before.
    Return how many locks (0: the run is in no limited group).
    """
    return int(session.execute(LOCK_SLOTS.call, {"run": run_id}).scalar_one())


def cancel_run(session: Executor, tenant_id: int, run_id: uuid.UUID, *,
               cascade: bool = False) -> Cancel | None:
    """Cancel ``run_id`` (queued or waiting: at once; running: at its next checkpoint).

    Return what changed, or None when the run was already finished (then
    there is nothing to cancel). The caller commits; a parent whose join this
    run completes is sent after the commit. ``cascade``: the cancel is to reach the
    run's descendants, those admitted from now on among them (they are admitted
    cancelled); the caller cancels the ones there are with ``descendants``.
    """
    row = session.execute(CANCEL.call, {"run": run_id, "tenant": tenant_id,
                                        "cascade": cascade}).one_or_none()
    send_woken(session, woken_of(row))
    return None if row is None else build(Cancel, row)


DESCENDANTS = statement("descendants")


def descendants(session: Executor, run_id: uuid.UUID, *, limit: int) -> list[uuid.UUID]:
    """Up to ``limit`` runs below ``run_id`` (at any depth) not ended and not yet cancelled
    with the cascade: a cascading cancel's next page."""
    return [row.id for row in session.execute(DESCENDANTS, {"run": run_id, "limit": limit}).all()]


def finish_requested_cancel(session: Executor, run_id: uuid.UUID) -> bool:
    """End a queued run whose cancellation was requested; True if it was."""
    row = session.execute(CANCEL_QUEUED.call, {"run": run_id}).one_or_none()
    send_woken(session, woken_of(row))
    return row is not None


def expire_run(session: Executor, run_id: uuid.UUID) -> bool:
    """End ``run_id`` ``expired`` if it was never started and its ``expires_at`` passed;
    True if it was. A parent whose join it completes is sent after the commit."""
    row = session.execute(EXPIRE.call, {"run": run_id}).one_or_none()
    send_woken(session, woken_of(row))
    return row is not None


# -- delayed runs and expiry (beat: ``workers/timers.py``) -------------------------------------

RELEASE_DUE = statement("release_due")
EXPIRE_DUE = statement("expire_due")
NEXT_DUE = statement("next_due")


def release_due_runs(session: Executor, *, limit: int) -> list[RunToSend]:
    """Mark sent (and return, to send after the caller's commit) up to ``limit`` delayed
    runs now due that were never sent since they were admitted, earliest due first."""
    return [build(RunToSend, row)
            for row in session.execute(RELEASE_DUE, {"limit": limit}).all()]


def next_due_in(session: Executor) -> float | None:
    """The seconds until the earliest run ``release_due_runs`` would send comes due (a
    delayed admission, a reserved start; at most 0 when one is due now), None if none."""
    value = session.execute(NEXT_DUE).scalar()
    return None if value is None else float(value)


def expire_due_runs(session: Executor, *, limit: int) -> int:
    """End ``expired`` up to ``limit`` runs never started whose ``expires_at`` passed,
    earliest first (each counts for its parent's join; woken parents are sent after the
    caller's commit). Return how many."""
    rows = session.execute(EXPIRE_DUE, {"limit": limit}).all()
    for row in rows:
        send_woken(session, row.woken)
    return len(rows)


MARK_HOLDER_DEAD = statement("mark_holder_dead")


def end_abandoned(session: Executor, run_id: uuid.UUID) -> bool:
    """End as cancelled a revoked run whose holder is gone; True if it was (in a
    transaction: a run of a limited group wakes the next one under its slot locks).
    A holder whose lock is free is stamped first seen dead (the revoke's caller asks
    again until it is gone)."""
    session.execute(MARK_HOLDER_DEAD, {"run": run_id})
    lock_slots(session, run_id)
    row = session.execute(END_ABANDONED.call, {"run": run_id}).one_or_none()
    send_woken(session, woken_of(row))
    return row is not None


def fail_time_limit(session: Executor, run_id: uuid.UUID, *, node: uuid.UUID, pid: int,
                    error: str) -> bool:
    """Fail ``run_id`` for Celery's hard time limit if pool process (``node``, ``pid``)
    holds it; True if it did (in a transaction, like ``end_abandoned``)."""
    lock_slots(session, run_id)
    row = session.execute(TIME_LIMIT.call, {"run": run_id, "node": node, "pid": pid,
                                       "error": error}).one_or_none()
    send_woken(session, woken_of(row))
    return row is not None


# -- repair -----------------------------------------------------------------------------------

DEAD_BOOT_RUNS = statement("dead_boot_runs")
QUEUED_RUNS = statement("queued_runs")
QUEUED_WORKFLOWS = statement("queued_workflows")

# One repair at a time: two beats (a deploy overlap) would each read a queue's depth and
# each re-send up to a page below it, twice the bound between them. A transaction-scoped
# advisory lock, held on a connection of its own from before the marks until after the
# sends (a lock released at the marks' commit would let a second repair read the depth
# before the first one's sends land). Transaction-scoped: safe behind a transaction-mode
# pooler, which pins a server connection for a transaction.
REPAIR_LOCK_NAMESPACE = 0x52455052  # "REPR", apart from the boots' and the outbox's locks
TRY_REPAIR_LOCK = statement("try_repair_lock")
WAIT_REPAIR_LOCK = statement("wait_repair_lock")


@contextlib.contextmanager
def repair_lock(engine: Engine, *, wait: bool) -> Iterator[bool]:
    """Hold the repair lock for the ``with`` block, on a connection of ``engine``'s of its
    own; yield whether it is held (``wait``: block until it is)."""
    conn = engine.connect()
    try:
        with conn.begin():
            statement = WAIT_REPAIR_LOCK if wait else TRY_REPAIR_LOCK
            yield bool(conn.execute(statement, {"namespace": REPAIR_LOCK_NAMESPACE}).scalar())
    finally:
        conn.close()


# The runs waiting for their tenant's cap that it lets go: a view, installed by migrations,
# that both wake-ups read.
CAP_WAKES = sql("cap_wakes")
WAKE_WAITING = statement("wake_waiting")
LOCK_TENANT = statement("lock_tenant")
SET_TENANT_CAP = statement("set_tenant_cap")
WAKE_TENANT = statement("wake_tenant")
WAITING_BY_REASON = statement("waiting_by_reason")


def wake_waiting_runs(session: Executor, *, limit: int | None) -> list[WokenRun]:
    """Re-queue (and mark sent) the waiting runs each group has free slots for, oldest
    first, and every run waiting for a cap that was lifted; at most ``limit``. The caller
    sends them after its commit."""
    return [build(WokenRun, row)
            for row in session.execute(WAKE_WAITING, {"limit": limit}).all()]


def change_tenant_cap(session: Executor, tenant_id: int, max_running: int | None
                      ) -> list[WokenRun]:
    """Set tenant ``tenant_id``'s cap to ``max_running`` (None: no cap) in ``session``'s
    transaction, and re-queue the runs waiting for its slots that the new cap frees:
    every one if it was lifted, oldest first. They are sent once the caller commits;
    return them."""
    session.execute(LOCK_TENANT, {"tenant": tenant_id})
    session.execute(SET_TENANT_CAP, {"tenant": tenant_id, "max_running": max_running})
    woken = [build(WokenRun, row) for row in session.execute(
        WAKE_TENANT, {"tenant": tenant_id, "limit": None}).all()]
    for run in woken:
        send_row_after_commit(session, run)
    return woken


def waiting_by_reason(session: Executor) -> dict[str, int]:
    """How many runs wait, by what they wait for."""
    return {row.reason: int(row.runs) for row in session.execute(WAITING_BY_REASON).all()}


def mark_dead_boot_runs_sent(session: Executor, *, min_age: float, limit: int | None
                             ) -> list[StrandedRun]:
    """Stamp the boots whose lock is free, then pick (and mark sent) up to ``limit`` runs
    held by boots seen dead, due for a re-send; each with ``gone_in``, the seconds until
    its boot is gone (a delivery before then takes nothing over)."""
    mark_dead_boots(session)
    return [build(StrandedRun, row) for row in session.execute(
        DEAD_BOOT_RUNS, {"min_age": min_age, "limit": limit}).all()]


def queued_workflows_due(session: Executor, *, min_age: float) -> list[WorkflowVersion]:
    """The (workflow_name, workflow_version) pairs with queued runs due for a re-send."""
    return [WorkflowVersion(row.workflow_name, row.workflow_version)
            for row in session.execute(QUEUED_WORKFLOWS, {"min_age": min_age}).all()]


def mark_queued_runs_sent(session: Executor, *, min_age: float, limit: int | None,
                          names: list[str], versions: list[str]) -> list[RunToSend]:
    """Pick (and mark sent) up to ``limit`` queued runs of these workflows, due for a re-send."""
    return [build(RunToSend, row) for row in session.execute(QUEUED_RUNS, {
        "min_age": min_age, "limit": limit, "names": names, "versions": versions}).all()]
