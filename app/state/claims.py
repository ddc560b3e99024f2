"""Claims: at most one live worker executes a run at a time.

Celery delivers at least once, so every delivery first tries to claim the run
in Postgres. The outcome is decided by state and by liveness (``boots``), never
by time:

* ``queued`` -> ``running`` under this boot, in one conditional UPDATE: CLAIMED;
* ``running`` under a live boot (this one or another): DUPLICATE, do nothing;
* ``running`` under a dead boot: wreckage, taken over with a compare-and-set
  on the old boot id: TAKEN_OVER (the attempt is counted), once the boot is
  *gone* (``app/liveness.py``: its lock first seen free T_c + kill + margin
  ago, so its body has stopped); before that, DUPLICATE with ``gone_in``: the
  worker sends the run again for then (so does repair);
* terminal: FINISHED, never executed again;
* ``waiting`` (a join step waits for its children, or a run for a slot):
  WAITING, nothing to do; the last child's finish (the slot holder's end)
  re-queues it.

A run of a workflow with a ``concurrency_limit`` (or of a tenant with a cap)
is claimed in a transaction of two statements (``claim_slot``): the group's
advisory locks, then one UPDATE that counts the group's slots held by live
boots and either claims the run (CLAIMED) or parks it ``waiting`` with no
worker (SLOT_WAIT). Every other run keeps the one-statement claim, which
refuses limited runs (``SLOTS``: claim again with ``claim_slot``).

This module holds the fenced transitions, the ones a worker makes under its
claim; unfenced ones (admission, cancel, repair) are in ``runs.py`` beside it.

Every later write for the run (release, retry, finish) is fenced by the claim:
``WHERE claimed_by = <this boot>``. A worker that lost its claim (it was cut
off and taken over) finds its writes refused instead of finishing twice.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Row, text
from sqlalchemy.orm import Session

from app.liveness import boot_alive, claimer_live_sql, gone_in_sql, gone_sql
from app.models import TERMINAL_STATUSES, RunStatus

from .boots import mark_boot_dead
from .compose import (
    ENDED,
    JOIN_RELEASE,
    LIMITED_WAITS,
    WITH_WOKEN,
    due,
    holds_slot,
    outbox_rows,
    same_group,
    same_tenant,
    send_woken,
    slot_release,
    slot_status_is,
    status_is,
    to_json,
    with_event,
    with_woken,
)
from .ledger import CLOSE_EVENT_FIELDS, ENTRY_EVENT_FIELDS, EntryClose
from .runs import LockedStatement, finish_requested_cancel, lock_slots, locked


class ClaimOutcome(enum.StrEnum):
    CLAIMED = "claimed"
    TAKEN_OVER = "taken_over"
    DUPLICATE = "duplicate"
    FINISHED = "finished"
    NOT_DUE = "not_due"
    MISSING = "missing"
    CLAIMER_DEAD = "claimer_dead"  # the claiming boot itself lost its lock
    WAITING = "waiting"  # a join waits for children; the last one's finish re-queues it
    # Concurrency: the run's group is limited, so the one-statement claim refused it:
    # claim it again with ``claim_slot``, in a transaction (never in autocommit).
    SLOTS = "slots"
    # No slot: the run went ``waiting`` (``Claim.wait_reason``), unclaimed; the end of
    # a slot's holder re-queues it (beat is the backstop).
    SLOT_WAIT = "slot_wait"

    @property
    def execute(self) -> bool:
        return self in (ClaimOutcome.CLAIMED, ClaimOutcome.TAKEN_OVER)


@dataclass(frozen=True)
class Claim:
    outcome: ClaimOutcome
    run_id: uuid.UUID
    boot_id: uuid.UUID
    attempt: int | None = None
    holder: uuid.UUID | None = None  # the boot that holds it, for a DUPLICATE
    run: Row | None = None  # the claimed run's row (see _RUN_COLUMNS), when claimed
    # The run is in a limited group: every end of this hold takes the slot locks first.
    slots: bool = False
    wait_reason: str | None = None  # SLOT_WAIT: 'concurrency' or 'tenant_cap'
    # A DUPLICATE whose holder lost its lock but is not gone yet: deliver the run (its
    # workflow ``ref``) again in ``gone_in`` seconds, when it may be taken over.
    gone_in: float | None = None
    ref: str | None = None
    # FINISHED by this delivery's takeover: the run's row as it ended it (status,
    # tenant_id, workflow_name), for the poisoned runs' counter; an observation, not
    # part of what the claim decided (not compared).
    ended: Row | None = field(default=None, compare=False)


# What a claim returns: everything the worker needs to run the workflow, so
# executing a run costs no extra read.
_RUN_COLUMN_NAMES = ("id", "tenant_id", "attempt", "workflow_name", "workflow_version", "input",
                     "failures", "cancel_requested", "concurrency_key", "concurrency_limit")
_RUN_COLUMNS = ", ".join(_RUN_COLUMN_NAMES)
_ATTEMPT = "jsonb_build_object('attempt', attempt)"
# A claim also returns the pinned definition hash and the run's latest step
# entry (the ledger resumes from it), so starting a run costs no extra read.
# created_at and started_at give the queue wait (poimen_run_queue_wait_seconds).
# traceparent and tracestate: the run's trace context, which its fan-out children inherit
# and its re-sends (a retry, a release) carry.
_CLAIMED_NAMES = _RUN_COLUMN_NAMES + ("goal_id", "definition_hash", "created_at", "started_at",
                                       "traceparent", "tracestate")
_CLAIMED_COLUMNS = ", ".join(_CLAIMED_NAMES) + ", " \
    "(SELECT to_jsonb(e) FROM step_entries e " \
    "WHERE e.run_id = runs.id ORDER BY e.entry_no DESC LIMIT 1) AS last_entry"

# Liveness is part of every claim: the claiming boot must hold its lock *in
# the same statement*. A process whose lock vanished (Postgres restarted, its
# connection was cut) may not know yet; Postgres does, and refuses.
_CLAIMER_LIVE = claimer_live_sql(":boot")

# The holder a takeover replaces is gone, not only without its lock: a lock that went
# early (a restart, pg_terminate_backend) leaves its process running the body until
# its fence, T_c + kill after its last confirmation; the server waits that long (and
# the margin) from when it first saw the lock free.
_HOLDER_GONE = gone_sql(":dead")

# The run (found by primary key) is running: ``status_is``, so that no index on status
# can take the lookup from the primary key.
_RUNNING = status_is("runs", RunStatus.RUNNING)

CLAIM_QUEUED = with_event(
    f"""
    UPDATE runs
       SET status = 'running', claimed_by = :boot, attempt = attempt + 1,
           started_at = coalesce(started_at, now()), updated_at = now()
     WHERE id = :run AND {status_is('runs', RunStatus.QUEUED)} AND NOT cancel_requested
       AND (not_before IS NULL OR not_before <= now())
       AND {_CLAIMER_LIVE}
       AND concurrency_limit IS NULL
       AND NOT EXISTS (SELECT 1 FROM tenants t
                        WHERE t.id = runs.tenant_id AND t.max_running IS NOT NULL)
    """,
    _CLAIMED_COLUMNS,
    "'run.started'",
    _ATTEMPT,
)


def _verdict(me: str, *, fifo: bool) -> str:
    """CTE ``verdict``: the slot run ``me`` may not take (``reason``), NULL if it may.

    Its tenant's cap first, then its group's limit. Slots held by live boots
    count; ``fifo``: so do older runs of the group that want one (queued and
    due, or waiting for a slot), so a newcomer never overtakes them.

    Each count is a sum over one status at a time (a run has one status, so the
    parts never overlap): with the status in the slot indexes each part reads only its
    own rows (the slot holders, the older queued runs, the older waiting ones), never
    every queued run of a deep backlog. The scopes (``same_group``, ``same_tenant``)
    and ``slot_status`` are written so that only those indexes can serve the counts
    (migration 0017), whatever the statistics say.
    """
    def counted(scope: str, ahead_waits: str) -> str:
        def part(condition: str) -> str:
            return f"(SELECT count(*) FROM runs r WHERE {scope} AND {condition})"

        older = f"(r.created_at, r.id) < ({me}.created_at, {me}.id)"
        # A takeover's or an adoption's run is not counted against itself: its holder
        # may still hold its slot (an adoption's lost boot is not gone yet).
        parts = [part(holds_slot("r") if fifo else f"{holds_slot('r')} AND r.id <> {me}.id")]
        if fifo:
            parts += [part(f"{due('r', slot=True)} AND {older}"),
                      part(f"{slot_status_is('r', RunStatus.WAITING)} "
                           f"AND r.wait_reason IN {ahead_waits} AND {older}")]
        return "\n                    + ".join(parts)

    tenant = same_tenant("r", me)
    group = same_group("r", me)
    return f"""
    verdict AS (
        SELECT CASE
               WHEN {me}.max_running IS NOT NULL AND (
                    {counted(tenant, "('tenant_cap')")}) >= {me}.max_running
               THEN 'tenant_cap'
               WHEN {me}.concurrency_limit IS NOT NULL AND (
                    {counted(group, LIMITED_WAITS)}) >= {me}.concurrency_limit
               THEN 'concurrency'
               END AS reason
          FROM {me}
    ),"""


# The claim of a run of a limited group, after ``runs.LOCK_SLOTS`` in the same
# transaction (so this statement's snapshot sees every claim and end of the
# group committed before): the count and the claim are one statement. No slot:
# the run waits, unclaimed, holding no worker.
CLAIM_SLOT = with_event(
    f"""
    UPDATE runs
       SET status = CASE WHEN v.reason IS NULL THEN 'running' ELSE 'waiting' END,
           wait_reason = v.reason,
           claimed_by = CASE WHEN v.reason IS NULL THEN CAST(:boot AS uuid) END,
           attempt = attempt + CASE WHEN v.reason IS NULL THEN 1 ELSE 0 END,
           started_at = CASE WHEN v.reason IS NULL THEN coalesce(started_at, now())
                             ELSE started_at END,
           updated_at = now()
      FROM verdict v
     WHERE runs.id = :run AND {status_is('runs', RunStatus.QUEUED)} AND NOT runs.cancel_requested
    """,
    _CLAIMED_COLUMNS + ", status, wait_reason",
    "CASE status WHEN 'running' THEN 'run.started' ELSE 'run.waiting' END",
    f"{_ATTEMPT} || CASE WHEN status = 'waiting' "
    "THEN jsonb_build_object('reason', wait_reason) ELSE '{}' END",
    before=f"""
    me AS (
        SELECT r.id, r.tenant_id, r.workflow_name, r.concurrency_key, r.concurrency_limit,
               r.created_at, t.max_running
          FROM runs r JOIN tenants t ON t.id = r.tenant_id
         WHERE r.id = :run AND {due("r")} AND {_CLAIMER_LIVE}
    ),{_verdict("me", fifo=True)}""",
)


def _of_runs(*names: str) -> list[tuple[str, str]]:
    """Result columns of a locked statement that are columns of ``runs``, typed as such."""
    return [(name, f"runs.{name}%TYPE") for name in names]


# CLAIM_SLOT after its locks, in one call (``runs.locked``): a limited run's claim is
# one round trip, in autocommit, like every other claim.
CLAIM_SLOT_LOCKED = locked(
    "poimen_claim_slot", CLAIM_SLOT,
    _of_runs(*_CLAIMED_NAMES) + [("last_entry", "jsonb")] + _of_runs("status", "wait_reason"))

# Wreckage: the holder is dead. A cancelled run ends cancelled instead of being
# resumed (a cancel wins over the bound); a run that has already outlived
# max_takeovers workers ends ``poisoned``: its executions are what kills them (OOM,
# a segfault, os._exit), so it is not resumed again; else resume it.
# A run of a limited group (after LOCK_SLOTS, like a claim) resumes only if a
# slot is free (another run may have taken the dead holder's): else it waits,
# unclaimed, with the lost worker counted.
# The run a takeover or an adoption is about, and whether its group has a slot for it.
_ME_VERDICT = f"""
    me AS (
        SELECT r.id, r.tenant_id, r.workflow_name, r.concurrency_key, r.concurrency_limit,
               r.created_at, t.max_running
          FROM runs r JOIN tenants t ON t.id = r.tenant_id WHERE r.id = :run
    ),{_verdict("me", fifo=False)}"""


def _take_over(slots: bool):
    park = "\n                         WHEN v.reason IS NOT NULL THEN 'waiting'" if slots else ""
    parked = " OR v.reason IS NOT NULL" if slots else ""
    claimer = ("CASE WHEN v.reason IS NULL OR cancel_requested OR takeovers >= :max_takeovers "
               "THEN CAST(:boot AS uuid) END") if slots else ":boot"
    reason = """
           wait_reason = CASE WHEN cancel_requested OR takeovers >= :max_takeovers THEN NULL
                              ELSE v.reason END,""" if slots else ""
    verdict = """
      FROM verdict v""" if slots else ""
    return with_event(
        f"""
    UPDATE runs
       SET status = CASE WHEN cancel_requested THEN 'cancelled'
                         WHEN takeovers >= :max_takeovers THEN 'poisoned'{park}
                         ELSE 'running' END,
           claimed_by = {claimer},
           attempt = attempt + CASE WHEN cancel_requested OR takeovers >= :max_takeovers{parked}
                                    THEN 0 ELSE 1 END,
           takeovers = takeovers + CASE WHEN cancel_requested OR takeovers >= :max_takeovers
                                        THEN 0 ELSE 1 END,
           error = CASE WHEN NOT cancel_requested AND takeovers >= :max_takeovers
                        THEN jsonb_build_object(
                            'code', 'poisoned', 'type', 'poimen.Poisoned',
                            'message', 'the run killed ' || (takeovers + 1) || ' workers '
                                       || '(max_takeovers ' || :max_takeovers || '): '
                                       || 'poisoned, it is not resumed again',
                            'traceback', '')
                        ELSE error END,
           finished_at = CASE WHEN cancel_requested OR takeovers >= :max_takeovers
                              THEN now() ELSE finished_at END,{reason}
           updated_at = now(){verdict}
     WHERE id = :run AND {_RUNNING} AND claimed_by = :dead AND {_CLAIMER_LIVE}
       AND {_HOLDER_GONE}
    """,
        _CLAIMED_COLUMNS + ", status, takeovers, error" + (", wait_reason" if slots else ""),
        "CASE status WHEN 'running' THEN 'run.resumed' ELSE 'run.' || status END",
        f"{_ATTEMPT} || jsonb_build_object('previous_boot', CAST(:dead AS text)) || "
        "CASE WHEN status = 'poisoned' THEN jsonb_build_object('error', error) ELSE '{}' END"
        + (" || CASE WHEN status = 'waiting' THEN jsonb_build_object('reason', wait_reason) "
           "ELSE '{}' END" if slots else ""),
        before=_ME_VERDICT if slots else "",
        # A child ended poisoned or cancelled counts for its parent's join; an
        # ended run of a limited group wakes the next one.
        then=JOIN_RELEASE + (slot_release(when=f"s.status IN {ENDED}") if slots else ""),
        select=with_woken(join=True) if slots else WITH_WOKEN,
    )


TAKE_OVER = _take_over(slots=False)
TAKE_OVER_SLOT = _take_over(slots=True)

# The process that lost its lock is still executing the run and registered a
# new boot: it moves its own claim over, unless someone took the run over first.
# A run of a limited group (after LOCK_SLOTS) keeps its slot only if it is still
# free: while its boot was dead the slot was free, and another run may have it.
def _adopt(slots: bool):
    verdict = """
      FROM verdict v""" if slots else ""
    has_slot = " AND v.reason IS NULL" if slots else ""
    return with_event(
        f"""
    UPDATE runs SET claimed_by = :boot, updated_at = now(){verdict}
     WHERE id = :run AND {_RUNNING} AND claimed_by = :dead AND {_CLAIMER_LIVE}{has_slot}
    """,
        _RUN_COLUMNS,
        "'run.adopted'",
        "jsonb_build_object('previous_boot', CAST(:dead AS text))",
        before=_ME_VERDICT if slots else "",
    )


ADOPT = _adopt(slots=False)
ADOPT_SLOT = _adopt(slots=True)

# A run's end, its last step entry's close and their events: one statement, so a
# run that ends costs one round trip (in autocommit unless the run holds a slot).
# ``close``: None (no entry to close), "insert" (an entry that needed no row while it
# ran is written now, with its step.entered event) or "update" (the entry's row is
# closed; the run ends only if that entry is still open). Events are one INSERT in
# order: step.entered, step.<status>, run.<status>.
# ``slots``: the run holds a slot of a limited group (after ``LOCK_SLOTS``, in a
# transaction): its end re-queues the next run waiting for the slot. A run claimed
# outside every group leaves slot_release out (its statement costs Postgres a third
# less to plan); a tenant cap set while it ran is woken by beat (``WAKE_WAITING``).
def _finish(close: str | None, slots: bool):
    entry_open = ("\n       AND EXISTS (SELECT 1 FROM step_entries e WHERE e.id = :entry "
                  "AND e.run_id = :run\n                   AND e.status IN ('running', 'waiting'))"
                  if close == "update" else "")
    ctes = [f"""
    WITH changed AS (
    UPDATE runs
       SET status = :status, result = CAST(:result AS jsonb), error = CAST(:error AS jsonb),
           finished_at = now(), updated_at = now(), failures = failures + :failed
     WHERE id = :run AND {_RUNNING} AND claimed_by = ANY(:boots){entry_open}
     RETURNING {_RUN_COLUMNS}, status)"""]
    events = []
    if close == "insert":
        ctes.append("""
    entry AS (
        INSERT INTO step_entries (run_id, entry_no, step_id, status, actions, outputs, error,
                                  next_step, finished_at)
        SELECT id, :entry_no, :step, :entry_status, CAST(:actions AS jsonb),
               CAST(:outputs AS jsonb), CAST(:entry_error AS jsonb), :next_step, now()
          FROM changed
        RETURNING id, run_id, entry_no, step_id, next_step, error)""")
        events.append(f"SELECT 1, 'step.entered', {ENTRY_EVENT_FIELDS} FROM entry "
                      "WHERE CAST(:events AS boolean)")
    elif close == "update":
        ctes.append("""
    entry AS (
        UPDATE step_entries e
           SET status = :entry_status, actions = CAST(:actions AS jsonb),
               outputs = CAST(:outputs AS jsonb), error = CAST(:entry_error AS jsonb),
               next_step = :next_step, finished_at = now()
          FROM changed
         WHERE e.id = :entry AND e.status IN ('running', 'waiting')
        RETURNING e.id, e.run_id, e.entry_no, e.step_id, e.next_step, e.error)""")
    if close is not None:
        events.append(f"SELECT 2, CAST(:entry_event AS text), {CLOSE_EVENT_FIELDS} FROM entry "
                      "WHERE CAST(:events AS boolean)")
    events.append(f"SELECT 3, CAST(:event_type AS text), {_ATTEMPT} || "
                  "coalesce(CAST(:event_extra AS jsonb), '{}'::jsonb) FROM changed")
    union = "\n                 UNION ALL ".join(events)
    ctes.append(f"""
    event AS ({outbox_rows(f"changed c, ({union}) AS e(ord, type, fields)", "e.type",
                           "e.fields", run_id="c.id", tenant_id="c.tenant_id",
                           order_by="e.ord")})""")
    # A child's end counts for its parent's join and may re-queue the parent:
    # decided here, in the finish statement (see app/runs.py); the end of a run of
    # a limited group re-queues the next run waiting for its slot.
    then = JOIN_RELEASE + (slot_release() if slots else "")
    select = with_woken(join=True) if slots else WITH_WOKEN
    return text(",".join(ctes) + then + f"\n    SELECT {select} FROM changed\n")


FINISH = _finish(None, slots=True)
FINISH_INSERTED = _finish("insert", slots=True)
FINISH_CLOSED = _finish("update", slots=True)
FINISH_UNLIMITED = _finish(None, slots=False)
FINISH_INSERTED_UNLIMITED = _finish("insert", slots=False)
FINISH_CLOSED_UNLIMITED = _finish("update", slots=False)
# The end of a run that holds a slot, after its locks, in one call (``runs.locked``):
# one round trip, in autocommit, like the end of every other run.
_FINISHED = _of_runs(*_RUN_COLUMN_NAMES, "status") + [("woken", "jsonb")]
FINISH_LOCKED = locked("poimen_finish_slot", FINISH, _FINISHED)
FINISH_INSERTED_LOCKED = locked("poimen_finish_slot_inserted", FINISH_INSERTED, _FINISHED)
FINISH_CLOSED_LOCKED = locked("poimen_finish_slot_closed", FINISH_CLOSED, _FINISHED)
# Installed by migration 0014 (``CREATE OR REPLACE``): a change to one of these
# statements needs a migration that runs them again (tests/app/test_slot_functions.py).
SLOT_FUNCTIONS: tuple[LockedStatement, ...] = (
    CLAIM_SLOT_LOCKED, FINISH_LOCKED, FINISH_INSERTED_LOCKED, FINISH_CLOSED_LOCKED)

_FINISHES = {(None, True): FINISH_LOCKED.call, ("insert", True): FINISH_INSERTED_LOCKED.call,
             ("update", True): FINISH_CLOSED_LOCKED.call, (None, False): FINISH_UNLIMITED,
             ("insert", False): FINISH_INSERTED_UNLIMITED,
             ("update", False): FINISH_CLOSED_UNLIMITED}

RELEASE = with_event(
    f"""
    UPDATE runs SET status = 'queued', claimed_by = NULL, updated_at = now(),
           attempt = attempt - 1
     WHERE id = :run AND {_RUNNING} AND claimed_by = ANY(:boots)
    """,
    _RUN_COLUMNS,
    "'run.released'",
    then=slot_release(),
    select=with_woken(join=False),
)

RETRY = with_event(
    f"""
    UPDATE runs SET status = 'queued', claimed_by = NULL, failures = failures + 1,
           error = CAST(:error AS jsonb), updated_at = now(),
           not_before = now() + make_interval(secs => :delay)
     WHERE id = :run AND {_RUNNING} AND claimed_by = ANY(:boots)
    """,
    _RUN_COLUMNS,
    "'run.retrying'",
    f"{_ATTEMPT} || jsonb_build_object('delay', CAST(:delay AS float8), "
    "'error', CAST(:error AS jsonb))",
    then=slot_release(),
    select=with_woken(join=False),
)


# A claim that changed nothing reads why: the run's state and the claimer's liveness.
# ``slots``: the run is in a limited group (its workflow's or its tenant's).
CLAIM_STATE = text(
    "SELECT status, claimed_by, cancel_requested, workflow_name, workflow_version, "
    f"{_CLAIMER_LIVE} AS claimer_live, "
    "(not_before IS NULL OR not_before <= now()) AS due, "
    "(concurrency_limit IS NOT NULL OR EXISTS (SELECT 1 FROM tenants t WHERE "
    "t.id = runs.tenant_id AND t.max_running IS NOT NULL)) AS slots "
    "FROM runs WHERE id = :run")
HOLDER = text("SELECT claimed_by, status FROM runs WHERE id = :run")
# A holder seen dead and not gone yet: how long until it is (NULL: not seen dead).
GONE_IN = text(f"SELECT {gone_in_sql('b')} FROM worker_boots b WHERE b.boot_id = :boot "
               "AND b.first_seen_dead_at IS NOT NULL")


def claim_run(session: Session, run_id: uuid.UUID, boot_id: uuid.UUID, *,
              max_takeovers: Callable[[str, str], int], transaction: bool = True) -> Claim:
    """Try to claim ``run_id`` for ``boot_id`` in ``session``'s transaction; caller commits.

    ``max_takeovers(name, version)``: how many dead workers a run of that
    workflow may outlive (``workers.registry.max_takeovers_of``).
    ``transaction``: False when ``session`` runs in autocommit; a run of a
    limited group then comes back as SLOTS, to be claimed with ``claim_slot`` in
    a transaction (its advisory locks last until the transaction ends).
    """
    row = session.execute(CLAIM_QUEUED, {"run": run_id, "boot": boot_id}).one_or_none()
    if row is not None:
        return Claim(ClaimOutcome.CLAIMED, run_id, boot_id, row.attempt, run=row)
    current = session.execute(CLAIM_STATE, {"run": run_id, "boot": boot_id}).one_or_none()
    if current is not None and current.slots and current.claimer_live and (
            (current.status == RunStatus.RUNNING and current.claimed_by != boot_id
             and not boot_alive(session, current.claimed_by))
            or (current.status == RunStatus.QUEUED and current.due
                and not current.cancel_requested)):
        # A queued run to claim, or a dead holder's run to take over: under the locks.
        return claim_slot(session, run_id, boot_id, max_takeovers=max_takeovers,
                          transaction=transaction)
    return _decide(session, run_id, boot_id, current, max_takeovers)


def claim_slot(session: Session, run_id: uuid.UUID, boot_id: uuid.UUID, *,
               max_takeovers: Callable[[str, str], int], transaction: bool = True) -> Claim:
    """Claim ``run_id`` of a limited group, or park it ``waiting`` when it has no slot.

    One call, ``poimen_claim_slot``: the group's advisory locks, then the claim
    that counts the group's slots on a snapshot taken after them (``runs.locked``),
    so it may run in autocommit. A run it did not claim or park (a duplicate, a
    dead holder's, a finished one) is decided under the locks in a transaction:
    with ``transaction`` False it comes back as SLOTS for ``decide_slot``. In a
    transaction the locks last until the caller commits.
    """
    row = session.execute(CLAIM_SLOT_LOCKED.call,
                          {"run": run_id, "boot": boot_id}).one_or_none()
    if row is not None:
        if row.status == RunStatus.WAITING:
            return Claim(ClaimOutcome.SLOT_WAIT, run_id, boot_id, slots=True,
                         wait_reason=row.wait_reason)
        return Claim(ClaimOutcome.CLAIMED, run_id, boot_id, row.attempt, run=row, slots=True)
    if not transaction:
        return Claim(ClaimOutcome.SLOTS, run_id, boot_id)
    return decide_slot(session, run_id, boot_id, max_takeovers=max_takeovers)


def decide_slot(session: Session, run_id: uuid.UUID, boot_id: uuid.UUID, *,
                max_takeovers: Callable[[str, str], int]) -> Claim:
    """What a delivery does with a limited run ``claim_slot`` did not claim, decided
    under the group's locks (a takeover counts the slots like a claim). In
    ``session``'s transaction, never in autocommit; caller commits."""
    lock_slots(session, run_id)
    current = session.execute(CLAIM_STATE, {"run": run_id, "boot": boot_id}).one_or_none()
    return _decide(session, run_id, boot_id, current, max_takeovers, slots=True)


def _decide(session: Session, run_id: uuid.UUID, boot_id: uuid.UUID, current: Row | None,
            max_takeovers: Callable[[str, str], int], *, slots: bool = False) -> Claim:
    """What a delivery does with a run its claim statement did not claim (``current``)."""
    if current is None:
        return Claim(ClaimOutcome.MISSING, run_id, boot_id)
    if current.status in TERMINAL_STATUSES:
        return Claim(ClaimOutcome.FINISHED, run_id, boot_id)
    if current.status == RunStatus.WAITING:
        return Claim(ClaimOutcome.WAITING, run_id, boot_id)
    if not current.claimer_live:
        # This process's boot lost its lock: it may claim nothing more.
        return Claim(ClaimOutcome.CLAIMER_DEAD, run_id, boot_id)
    if current.status == RunStatus.QUEUED:
        if current.cancel_requested:
            finish_requested_cancel(session, run_id)
            return Claim(ClaimOutcome.FINISHED, run_id, boot_id)
        # A retry scheduled for later (its own delayed message will come), or a
        # row another delivery claimed and released between our two statements.
        return Claim(ClaimOutcome.NOT_DUE, run_id, boot_id)

    holder = current.claimed_by
    if holder == boot_id or boot_alive(session, holder):
        return Claim(ClaimOutcome.DUPLICATE, run_id, boot_id, holder=holder)

    # The holder's lock is free (and a dead boot never comes back): the first to see it
    # stamps when. Its process may still run the body until its fence, so the takeover
    # statement takes the run only once the holder is gone (that stamp its bound old);
    # before that this delivery is a duplicate, and repair re-sends the run then.
    mark_boot_dead(session, holder)
    # Take the wreckage over, unless another delivery beat us to it. A run of a
    # limited group is taken over under its slot locks (``claim_slot`` took them).
    row = session.execute(TAKE_OVER_SLOT if slots else TAKE_OVER, {
        "run": run_id, "boot": boot_id, "dead": holder,
        "max_takeovers": max_takeovers(current.workflow_name, current.workflow_version),
    }).one_or_none()
    if row is None:
        # Another rescuer won, or the holder is not gone yet: then its run is to be
        # delivered again when it is (nobody else may be sending it).
        gone_in = session.execute(GONE_IN, {"boot": holder}).scalar()
        if gone_in:
            return Claim(ClaimOutcome.DUPLICATE, run_id, boot_id, holder=holder,
                         gone_in=gone_in,
                         ref=f"{current.workflow_name}@{current.workflow_version}")
        return Claim(ClaimOutcome.DUPLICATE, run_id, boot_id)
    send_woken(session, row)
    if row.status == RunStatus.WAITING:
        return Claim(ClaimOutcome.SLOT_WAIT, run_id, boot_id, holder=holder, slots=True,
                     wait_reason=row.wait_reason)
    if row.status != RunStatus.RUNNING:
        # Cancelled while its worker was lost, or too many workers lost (poisoned): ended,
        # not resumed.
        return Claim(ClaimOutcome.FINISHED, run_id, boot_id, holder=holder, ended=row)
    return Claim(ClaimOutcome.TAKEN_OVER, run_id, boot_id, row.attempt, holder=holder, run=row,
                 slots=slots)


class Adoption(enum.StrEnum):
    ADOPTED = "adopted"
    OURS = "ours"  # already moved, or finished, by one of this process's boots
    LOST = "lost"  # another boot took it over, or it ended elsewhere
    # A run of a limited group whose slot another run took while this boot was dead:
    # it stays with the dead boot (repair's takeover parks it until a slot frees).
    NO_SLOT = "no_slot"


def adopt_run(session: Session, run_id: uuid.UUID, dead: uuid.UUID, boot_id: uuid.UUID,
              ours: Collection[uuid.UUID]) -> Adoption:
    """Move ``run_id`` from this process's lost boot ``dead`` to its new boot ``boot_id``.

    A compare-and-set on the dead boot, like any takeover, and only for a live
    ``boot_id``: if someone else took the run over meanwhile, it is theirs. A
    run of a limited group is adopted under its slot locks, and only into a free
    slot (in ``session``'s transaction, never autocommit).
    """
    slots = lock_slots(session, run_id) > 0
    row = session.execute(ADOPT_SLOT if slots else ADOPT,
                          {"run": run_id, "boot": boot_id, "dead": dead}).one_or_none()
    if row is not None:
        return Adoption.ADOPTED
    held = session.execute(HOLDER, {"run": run_id}).one_or_none()
    if slots and held is not None and held.claimed_by == dead \
            and held.status == RunStatus.RUNNING:
        return Adoption.NO_SLOT
    return Adoption.OURS if held is not None and held.claimed_by in set(ours) \
        else Adoption.LOST


def _fence(boot_id: uuid.UUID | Collection[uuid.UUID]) -> list[uuid.UUID]:
    """The boots whose claim a write accepts: this process's boot(s) for the run."""
    return [boot_id] if isinstance(boot_id, uuid.UUID) else list(boot_id)


def release_claim(session: Session, run_id: uuid.UUID,
                  boot_id: uuid.UUID | Collection[uuid.UUID]) -> bool:
    """Put a run this boot claimed back to ``queued`` (a failure before user code started).

    No user code ran, so the claim's attempt is given back: a rolling deploy that
    bounces a run between workers must not use up its attempts.

    Scoped to the claiming boot: if the claim was taken over meanwhile, this
    changes nothing, so a release can never steal another delivery's claim.
    """
    row = session.execute(RELEASE, {"run": run_id, "boots": _fence(boot_id)}).one_or_none()
    send_woken(session, row)
    return row is not None


def finish_run(
    session: Session,
    run_id: uuid.UUID,
    boot_id: uuid.UUID | Collection[uuid.UUID],
    *,
    status: str,
    result: Any = None,
    error: dict | None = None,
    close: EntryClose | None = None,
    slots: bool = True,
) -> bool:
    """Record a terminal state, fenced by this boot's claim; False if the claim was lost.

    ``close``: the run's last step entry, closed in the same statement (the run
    ends only if that entry is still open). ``slots``: False for a run claimed
    outside every limited group (no slot to hand on).
    """
    assert status in TERMINAL_STATUSES
    params = {
        "run": run_id, "boots": _fence(boot_id), "status": status, "result": to_json(result),
        "error": to_json(error), "failed": int(status == RunStatus.FAILED),
        "event_type": f"run.{status}", "event_extra": to_json({"error": error} if error else None),
    }
    kind = None
    if close is not None:
        kind = "insert" if close.entry_id is None else "update"
        params.update(entry=close.entry_id, entry_no=close.entry_no, step=close.step_id,
                      entry_status=close.status, actions=to_json(close.actions),
                      outputs=to_json(close.outputs), entry_error=to_json(close.error),
                      next_step=close.next_step, events=close.events,
                      entry_event=f"step.{close.status}")
    row = session.execute(_FINISHES[kind, slots], params).one_or_none()
    send_woken(session, row)
    return row is not None


def schedule_retry(session: Session, run_id: uuid.UUID,
                   boot_id: uuid.UUID | Collection[uuid.UUID], *,
                   delay: float, error: dict) -> bool:
    """Return a failed attempt to ``queued`` to run again after ``delay`` seconds (fenced)."""
    row = session.execute(
        RETRY, {"run": run_id, "boots": _fence(boot_id), "delay": delay,
                 "error": to_json(error)},
    ).one_or_none()
    send_woken(session, row)
    return row is not None
