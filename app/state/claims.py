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
worker (SLOT_WAIT). A run under a rate limit (its workflow's ``rate_limit``,
its tenant's) is claimed there too: given a slot, it starts now (CLAIMED) or
gets its start reserved, ``queued`` until then with no worker (RATE_WAIT).
Every other run keeps the one-statement claim, which refuses those runs
(``SLOTS``: claim again with ``claim_slot``).

This module holds the fenced transitions, the ones a worker makes under its
claim; unfenced ones (admission, cancel, repair) are in ``runs.py`` beside it.

Every later write for the run (release, retry, finish) is fenced by the claim:
``WHERE claimed_by = <this boot>``. A worker that lost its claim (it was cut
off and taken over) finds its writes refused instead of finishing twice.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import TextClause

from app.liveness import boot_alive
from app.models import TERMINAL_STATUSES, RunStatus

from . import ledger, runs
from .boots import mark_boot_dead
from .compose import send_woken, to_json, woken_of
from .executor import Executor, build
from .ledger import EntryClose
from .runs import expire_run, finish_requested_cancel, lock_slots
from .statements import Function, function, statement


class ClaimOutcome(enum.StrEnum):
    CLAIMED = "claimed"
    TAKEN_OVER = "taken_over"
    DUPLICATE = "duplicate"
    FINISHED = "finished"
    NOT_DUE = "not_due"
    EXPIRED = "expired"  # never started by its expires_at: this delivery ended it expired
    MISSING = "missing"
    CLAIMER_DEAD = "claimer_dead"  # the claiming boot itself lost its lock
    WAITING = "waiting"  # a join waits for children; the last one's finish re-queues it
    # Concurrency: the run's group is limited, so the one-statement claim refused it:
    # claim it again with ``claim_slot``, in a transaction (never in autocommit).
    SLOTS = "slots"
    # No slot: the run went ``waiting`` (``Claim.wait_reason``), unclaimed; the end of
    # a slot's holder re-queues it (beat is the backstop).
    SLOT_WAIT = "slot_wait"
    # Rate limits: the run's start is still to come; it stays ``queued`` with its reserved
    # start (``Claim.not_before``), holding no worker (``poimen_rate_start``).
    RATE_WAIT = "rate_wait"

    @property
    def execute(self) -> bool:
        return self in (ClaimOutcome.CLAIMED, ClaimOutcome.TAKEN_OVER)


@dataclass(frozen=True)
class ClaimedRun:
    """A run as its claim (or takeover) returns it: everything the worker needs to run
    the workflow, so executing it costs no extra read. ``last_entry``: its latest step
    entry (a ``step_entries`` row as JSON), None before the first."""

    id: uuid.UUID
    tenant_id: int
    attempt: int
    workflow_name: str
    workflow_version: str
    input: Any
    failures: int
    cancel_requested: bool
    concurrency_key: str | None
    concurrency_limit: int | None
    goal_id: str | None
    definition_hash: str | None
    created_at: datetime
    started_at: datetime | None
    traceparent: str | None
    tracestate: str | None
    last_entry: Mapping[str, Any] | None


@dataclass(frozen=True)
class EndedRun:
    """A run a takeover ended instead of resuming it (cancelled while its worker was
    lost, or poisoned), for the poisoned runs' counter."""

    status: str
    tenant_id: int
    workflow_name: str
    takeovers: int


@dataclass(frozen=True)
class _State:
    """Why a claim changed nothing: the run's state and the claimer's liveness."""

    status: str
    claimed_by: uuid.UUID | None
    cancel_requested: bool
    workflow_name: str
    workflow_version: str
    claimer_live: bool
    due: bool
    expired: bool  # never started, and its expires_at passed
    slots: bool


@dataclass(frozen=True)
class Claim:
    outcome: ClaimOutcome
    run_id: uuid.UUID
    boot_id: uuid.UUID
    attempt: int | None = None
    holder: uuid.UUID | None = None  # the boot that holds it, for a DUPLICATE
    run: ClaimedRun | None = None  # the claimed run, when claimed
    # The run is in a limited group: every end of this hold takes the slot locks first.
    slots: bool = False
    wait_reason: str | None = None  # SLOT_WAIT: 'concurrency' or 'tenant_cap'
    # RATE_WAIT: the start reserved for the run, and whether this delivery's worker sends
    # it for then (a start less than 2 s away; beat's ``release_due`` sends a later one).
    not_before: datetime | None = None
    send_for_start: bool = False
    # A DUPLICATE whose holder lost its lock but is not gone yet: deliver the run (its
    # workflow ``ref``) again in ``gone_in`` seconds, when it may be taken over.
    gone_in: float | None = None
    ref: str | None = None
    # FINISHED by this delivery's takeover: the run as it ended it, for the poisoned
    # runs' counter; an observation, not part of what the claim decided (not compared).
    ended: EndedRun | None = field(default=None, compare=False)


# The statements of ``sql/claims.sql``, in its order. What a claim returns is everything
# the worker needs to run the workflow (the run's columns, its pinned definition hash,
# its latest step entry, its trace context), so executing a run costs no extra read.
CLAIM_QUEUED = statement("claim_queued")
# The batching worker's claim of many runs of one boot in one statement (the same rule).
CLAIM_QUEUED_BATCH = statement("claim_queued_batch")
# A limited run's claim after its group's locks, in one call: one round trip, in
# autocommit, like every other claim (``sql/README.md``, "Store functions").
CLAIM_SLOT_LOCKED = function("poimen_claim_slot")
# A first start under rate limits, under its scopes' row locks (``poimen_claim_slot`` calls it).
RATE_START = function("poimen_rate_start")
CLAIM_SLOT = CLAIM_SLOT_LOCKED.query
# A takeover, in one call: the run's slot locks, and for a run of a limited group the
# slot it may not keep (``SLOT_VERDICT``), then the compare-and-set and what an end sets off.
TAKE_OVER = function("poimen_take_over")
SLOT_VERDICT = function("poimen_slot_verdict")
ADOPT = statement("adopt")
# A run's end, in one call: its slot locks if it holds a slot, the fenced end, its last
# entry (``entry_mode``: none, insert, close), their events, then what the end sets off.
# One round trip, in autocommit, limited or not (``sql/README.md``, "Store functions").
FINISH = function("poimen_finish")
# The batching worker's end of many runs in one call: set-wise when no run of it sets
# anything off (no slot, no join), else ``poimen_finish`` for each.
FINISH_BATCH = function("poimen_finish_batch")
# Its call, each array typed; after an unknown batch claim, the runs the batch claimed.
FINISH_BATCH_CALL = statement("finish_batch_call")
CLAIMED_IN_BATCH = statement("claimed_in_batch")
END_BACKEND = statement("end_backend")
BACKEND_GONE = statement("backend_gone")
RELEASE = function("poimen_release")
RETRY = function("poimen_retry")
# Every function of the store, installed by migrations (``CREATE OR REPLACE``) from their
# blocks: a change to one needs a migration that runs them again
# (tests/app/test_slot_functions.py fails while an installed body differs).
# In this order, a function before the ones that call it.
FUNCTIONS: tuple[Function, ...] = (
    runs.LOCK_SLOTS, runs.ENDED, runs.EVENT_ENDED, runs.CANCEL, runs.CANCEL_QUEUED,
    runs.END_ABANDONED, runs.TIME_LIMIT, runs.EXPIRE, ledger.WAIT, RATE_START, CLAIM_SLOT_LOCKED,
    SLOT_VERDICT,
    TAKE_OVER, FINISH, FINISH_BATCH, RELEASE, RETRY)
CLAIM_STATE = statement("claim_state")
HOLDER = statement("holder")
GONE_IN = statement("gone_in")


def claim_run(session: Executor, run_id: uuid.UUID, boot_id: uuid.UUID, *,
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
        return Claim(ClaimOutcome.CLAIMED, run_id, boot_id, row.attempt,
                     run=build(ClaimedRun, row))
    current = _state(session, run_id, boot_id)
    if current is not None and current.slots and current.claimer_live and (
            (current.status == RunStatus.RUNNING and current.claimed_by != boot_id
             and current.claimed_by is not None and not boot_alive(session, current.claimed_by))
            or (current.status == RunStatus.QUEUED and current.due
                and not current.cancel_requested and not current.expired)):
        # A queued run to claim, or a dead holder's run to take over: under the locks.
        return claim_slot(session, run_id, boot_id, max_takeovers=max_takeovers,
                          transaction=transaction)
    return _decide(session, run_id, boot_id, current, max_takeovers)


def claim_slot(session: Executor, run_id: uuid.UUID, boot_id: uuid.UUID, *,
               max_takeovers: Callable[[str, str], int], transaction: bool = True) -> Claim:
    """Claim ``run_id`` of a limited group, or park it ``waiting`` when it has no slot.

    One call, ``poimen_claim_slot``: the group's advisory locks, then the claim
    that counts the group's slots on a snapshot taken after them (``sql/claims.sql``),
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
        if row.status == RunStatus.QUEUED:
            return Claim(ClaimOutcome.RATE_WAIT, run_id, boot_id, slots=True,
                         wait_reason=row.wait_reason, not_before=row.not_before,
                         send_for_start=row.last_sent_at >= row.not_before,
                         ref=f"{row.workflow_name}@{row.workflow_version}",
                         run=build(ClaimedRun, row))
        return Claim(ClaimOutcome.CLAIMED, run_id, boot_id, row.attempt,
                     run=build(ClaimedRun, row), slots=True)
    if not transaction:
        return Claim(ClaimOutcome.SLOTS, run_id, boot_id)
    return decide_slot(session, run_id, boot_id, max_takeovers=max_takeovers)


def decide_slot(session: Executor, run_id: uuid.UUID, boot_id: uuid.UUID, *,
                max_takeovers: Callable[[str, str], int]) -> Claim:
    """What a delivery does with a limited run ``claim_slot`` did not claim, decided
    under the group's locks (a takeover counts the slots like a claim). In
    ``session``'s transaction, never in autocommit; caller commits."""
    lock_slots(session, run_id)
    current = _state(session, run_id, boot_id)
    return _decide(session, run_id, boot_id, current, max_takeovers, slots=True)


def _state(session: Executor, run_id: uuid.UUID, boot_id: uuid.UUID) -> _State | None:
    row = session.execute(CLAIM_STATE, {"run": run_id, "boot": boot_id}).one_or_none()
    return None if row is None else build(_State, row)


def _decide(session: Executor, run_id: uuid.UUID, boot_id: uuid.UUID, current: _State | None,
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
        if current.expired:
            # Nobody started it by its expires_at: it ends expired, never runs late.
            expire_run(session, run_id)
            return Claim(ClaimOutcome.EXPIRED, run_id, boot_id)
        # A retry scheduled for later (its own delayed message will come), or a
        # row another delivery claimed and released between our two statements.
        return Claim(ClaimOutcome.NOT_DUE, run_id, boot_id)

    holder = current.claimed_by
    assert holder is not None  # a running run is held
    if holder == boot_id or boot_alive(session, holder):
        return Claim(ClaimOutcome.DUPLICATE, run_id, boot_id, holder=holder)

    # The holder's lock is free (and a dead boot never comes back): the first to see it
    # stamps when. Its process may still run the body until its fence, so the takeover
    # statement takes the run only once the holder is gone (that stamp its bound old);
    # before that this delivery is a duplicate, and repair re-sends the run then.
    mark_boot_dead(session, holder)
    # Take the wreckage over, unless another delivery beat us to it. A run of a
    # limited group is taken over under its slot locks (the call takes them).
    row = session.execute(TAKE_OVER.call, {
        "run": run_id, "boot": boot_id, "dead": holder,
        "max_takeovers": max_takeovers(current.workflow_name, current.workflow_version),
    }).one_or_none()
    if row is None:
        # Another rescuer won, or the holder is not gone yet: then its run is to be
        # delivered again when it is (nobody else may be sending it).
        gone_in: float | None = session.execute(GONE_IN, {"boot": holder}).scalar()
        if gone_in:
            return Claim(ClaimOutcome.DUPLICATE, run_id, boot_id, holder=holder,
                         gone_in=gone_in,
                         ref=f"{current.workflow_name}@{current.workflow_version}")
        return Claim(ClaimOutcome.DUPLICATE, run_id, boot_id)
    send_woken(session, row.woken)
    if row.status == RunStatus.WAITING:
        return Claim(ClaimOutcome.SLOT_WAIT, run_id, boot_id, holder=holder, slots=True,
                     wait_reason=row.wait_reason)
    if row.status != RunStatus.RUNNING:
        # Cancelled while its worker was lost, or too many workers lost (poisoned): ended,
        # not resumed.
        return Claim(ClaimOutcome.FINISHED, run_id, boot_id, holder=holder,
                     ended=build(EndedRun, row))
    return Claim(ClaimOutcome.TAKEN_OVER, run_id, boot_id, row.attempt, holder=holder,
                 run=build(ClaimedRun, row), slots=slots)


class Adoption(enum.StrEnum):
    ADOPTED = "adopted"
    OURS = "ours"  # already moved, or finished, by one of this process's boots
    LOST = "lost"  # another boot took it over, or it ended elsewhere
    # A run of a limited group whose slot another run took while this boot was dead:
    # it stays with the dead boot (repair's takeover parks it until a slot frees).
    NO_SLOT = "no_slot"


def adopt_run(session: Executor, run_id: uuid.UUID, dead: uuid.UUID, boot_id: uuid.UUID,
              ours: Collection[uuid.UUID]) -> Adoption:
    """Move ``run_id`` from this process's lost boot ``dead`` to its new boot ``boot_id``.

    A compare-and-set on the dead boot, like any takeover, and only for a live
    ``boot_id``: if someone else took the run over meanwhile, it is theirs. A
    run of a limited group is adopted under its slot locks, and only into a free
    slot (in ``session``'s transaction, never autocommit).
    """
    slots = lock_slots(session, run_id) > 0
    row = session.execute(ADOPT,
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


def release_claim(session: Executor, run_id: uuid.UUID,
                  boot_id: uuid.UUID | Collection[uuid.UUID]) -> bool:
    """Put a run this boot claimed back to ``queued`` (a failure before user code started).

    No user code ran, so the claim's attempt is given back: a rolling deploy that
    bounces a run between workers must not use up its attempts.

    Scoped to the claiming boot: if the claim was taken over meanwhile, this
    changes nothing, so a release can never steal another delivery's claim.
    """
    row = session.execute(RELEASE.call, {"run": run_id, "boots": _fence(boot_id)}).one_or_none()
    send_woken(session, woken_of(row))
    return row is not None


def finish_params(
    run_id: uuid.UUID,
    *,
    status: str,
    result: Any = None,
    error: dict[str, Any] | None = None,
    close: EntryClose | None = None,
) -> dict[str, Any]:
    """``poimen_finish``'s arguments for a run's end but its fence (``boots``)."""
    assert status in TERMINAL_STATUSES
    params: dict[str, Any] = {
        "run": run_id, "status": status, "result": to_json(result),
        "error": to_json(error), "failed": int(status == RunStatus.FAILED),
        "event_type": f"run.{status}", "event_extra": to_json({"error": error} if error else None),
        "entry_mode": "none", "entry": None, "entry_no": None, "step": None,
        "entry_status": None, "actions": None, "outputs": None, "entry_error": None,
        "next_step": None, "events": False, "entry_event": None,
    }
    if close is not None:
        params.update(entry_mode="insert" if close.entry_id is None else "close",
                      entry=close.entry_id, entry_no=close.entry_no, step=close.step_id,
                      entry_status=close.status, actions=to_json(close.actions),
                      outputs=to_json(close.outputs), entry_error=to_json(close.error),
                      next_step=close.next_step, events=close.events,
                      entry_event=f"step.{close.status}")
    return params


def finish_run(
    session: Executor,
    run_id: uuid.UUID,
    boot_id: uuid.UUID | Collection[uuid.UUID],
    *,
    status: str,
    result: Any = None,
    error: dict[str, Any] | None = None,
    close: EntryClose | None = None,
) -> bool:
    """Record a terminal state, fenced by this boot's claim; False if the claim was lost.

    ``close``: the run's last step entry, written or closed in the same call (the run
    ends only if that entry is still open). A run of a limited group hands its slot on
    under its slot locks, which the call takes itself.
    """
    params = finish_params(run_id, status=status, result=result, error=error, close=close)
    params["boots"] = _fence(boot_id)
    row = session.execute(FINISH.call, params).one_or_none()
    send_woken(session, woken_of(row))
    return row is not None


def claim_batch(session: Executor, run_ids: Collection[uuid.UUID], boot_id: uuid.UUID
                ) -> dict[uuid.UUID, ClaimedRun]:
    """Claim each of ``run_ids`` for ``boot_id`` in one statement (``claim_queued_batch``):
    the runs it claimed, by id. A run it did not claim is missing: its delivery asks why
    with ``claim_run``. In autocommit, one commit for all."""
    return claimed_by_batch(session.execute(*claim_batch_call(run_ids, boot_id)))


def claim_batch_call(run_ids: Collection[uuid.UUID], boot_id: uuid.UUID
                     ) -> tuple[TextClause, dict[str, Any]]:
    """``claim_batch``'s statement and parameters, to send with others
    (``OwnConnection.together``); its result is read by ``claimed_by_batch``."""
    return CLAIM_QUEUED_BATCH, {"runs": sorted(run_ids), "boot": boot_id}


def claimed_by_batch(result: Any) -> dict[uuid.UUID, ClaimedRun]:
    """The runs a ``claim_batch_call`` claimed, by id."""
    return {row.id: build(ClaimedRun, row) for row in result.all()}


def claimed_in_batch(session: Executor, run_ids: Collection[uuid.UUID], boot_id: uuid.UUID
                     ) -> dict[uuid.UUID, ClaimedRun]:
    """After a batch claim of unknown outcome whose backend is gone: the runs of
    ``run_ids`` ``boot_id`` holds (the ones that batch claimed), by id."""
    rows = session.execute(CLAIMED_IN_BATCH, {"runs": sorted(run_ids), "boot": boot_id}).all()
    return {row.id: build(ClaimedRun, row) for row in rows}


def end_backend(session: Executor, pid: int) -> None:
    """End backend ``pid`` (a batch's whose outcome is unknown)."""
    session.execute(END_BACKEND, {"pid": pid})


def backend_gone(session: Executor, pid: int) -> bool:
    """Whether backend ``pid`` has ended."""
    return bool(session.execute(BACKEND_GONE, {"pid": pid}).scalar())


@dataclass(frozen=True)
class FinishedInBatch:
    """A run ``finish_batch`` ended: its status and the runs its end re-queued."""

    id: uuid.UUID
    status: str
    woken: Any


def finish_batch(session: Executor, ends: list[dict[str, Any]],
                 boots: Collection[uuid.UUID]) -> dict[uuid.UUID, FinishedInBatch]:
    """End each run of ``ends`` (``finish_params``' values, each run once) in one call,
    ``poimen_finish_batch``, fenced by ``boots`` (this process's boots holding any of
    them): the runs it ended, by id. A run missing was refused (its claim was lost). The
    runs are ended in id order. Their woken runs are the caller's to send."""
    return finished_by_batch(session.execute(*finish_batch_call(ends, boots)))


def finish_batch_call(ends: list[dict[str, Any]], boots: Collection[uuid.UUID]
                      ) -> tuple[TextClause, dict[str, Any]]:
    """``finish_batch``'s statement and parameters, to send with others
    (``OwnConnection.together``); its result is read by ``finished_by_batch``."""
    ends = sorted(ends, key=lambda end: end["run"])
    columns: dict[str, list[Any]] = {name.removeprefix("p_"): []
                                     for name in FINISH_BATCH.arguments}
    del columns["boots"]
    for end in ends:
        for name, values in columns.items():
            values.append(end[name])
    return FINISH_BATCH_CALL, {**columns, "boots": list(boots)}


def finished_by_batch(result: Any) -> dict[uuid.UUID, FinishedInBatch]:
    """The runs a ``finish_batch_call`` ended, by id."""
    return {row.id: FinishedInBatch(row.id, row.status, row.woken) for row in result.all()}


def schedule_retry(session: Executor, run_id: uuid.UUID,
                   boot_id: uuid.UUID | Collection[uuid.UUID], *,
                   delay: float, error: dict[str, Any]) -> bool:
    """Return a failed attempt to ``queued`` to run again after ``delay`` seconds (fenced)."""
    row = session.execute(
        RETRY.call, {"run": run_id, "boots": _fence(boot_id), "delay": delay,
                 "error": to_json(error)},
    ).one_or_none()
    send_woken(session, woken_of(row))
    return row is not None
