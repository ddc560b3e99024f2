"""The step ledger's writes: entries, marker claims, fan-out links, joins.

Every write is fenced by the run's claim (its ``run`` part: ``runs.claimed_by`` is
one of this process's boots, locked ``FOR SHARE`` in the statement), like every
other write a worker makes for a run it holds; a marker claim also requires
the claimer's boot to be live in the same statement (its ``live`` part). Which actions
run, in what order, and what a claim's outcome means for the entry (the stop
rule) is the dispatcher's (``workers/ledger.py``); this module records.
"""

from __future__ import annotations

import dataclasses
import enum
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .compose import Woken, send_woken, to_json
from .executor import Executor, build
from .statements import function, statement


class DeclaredAction(Protocol):
    @property
    def position(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def marker(self) -> bool: ...


class DeclaredStep(Protocol):
    """What the ledger needs of a step (``workers.registry.Step``), read only."""

    @property
    def id(self) -> str: ...
    @property
    def actions(self) -> Sequence[DeclaredAction]: ...


class EntryStatus(enum.StrEnum):
    RUNNING = "running"
    WAITING = "waiting"  # a join entry whose actions are done, waiting for its children
    COMPLETED = "completed"
    FAILED = "failed"  # a marker-bearing action failed, or (the last entry) a non-marker one
    ABANDONED = "abandoned"  # a marker claim was lost: the remainder never ran


@dataclass(frozen=True)
class EntryClose:
    """How an entry ends: the values ``close_entry`` writes.

    The dispatcher returns one with a run's last entry; the worker writes it in
    the transaction that finishes (or retries) the run, so the ledger and the
    run never disagree. ``entry_id`` None: the entry had no row yet.
    """

    entry_id: int | None
    entry_no: int
    step_id: str
    status: str
    actions: list[dict[str, Any]]
    outputs: Any
    error: dict[str, Any] | None
    next_step: str | None
    events: bool

    def without_outputs(self, error: dict[str, Any]) -> EntryClose:
        """The same end, failed with ``error`` and no outputs (Postgres refused them)."""
        return dataclasses.replace(
            self, status=EntryStatus.FAILED, error=error, outputs={},
            actions=[{k: v for k, v in a.items() if k not in ("output", "error")}
                     for a in self.actions])


class MarkerOutcome(enum.StrEnum):
    CLAIMED = "claimed"  # ours: execute it
    TAKEN_OVER = "taken_over"  # a dead boot's unfinished claim is ours now: execute it again
    COMPLETED = "completed"  # done before: skip it, use the recorded result
    FAILED = "failed"  # failed before: the stop rule applies
    DUPLICATE = "duplicate"  # claimed by this very boot: never executed twice
    HELD = "held"  # claimed by a live boot elsewhere: a lost claim
    CLAIMER_DEAD = "claimer_dead"  # the claiming boot lost its lock: it claims nothing
    FENCED = "fenced"  # the run is not held by this process: nothing may be written

    @property
    def execute(self) -> bool:
        return self in (MarkerOutcome.CLAIMED, MarkerOutcome.TAKEN_OVER)


@dataclass(frozen=True)
class MarkerClaim:
    outcome: MarkerOutcome
    claims: int = 0
    holder: uuid.UUID | None = None
    result: Any = None
    error: dict[str, Any] | None = None


@dataclass(frozen=True)
class Entered:
    """An entry written (``enter_step``, ``close_entry``): its id, and whether the run's
    cancellation was requested (read in the same statement)."""

    id: int
    cancel_requested: bool


@dataclass(frozen=True)
class MarkerState:
    """A marker as it stands, and whether the boot that claimed it is live."""

    status: str
    claimed_by: uuid.UUID
    claims: int
    result: Any
    error: dict[str, Any] | None
    holder_live: bool


@dataclass(frozen=True)
class Wait:
    """What ``wait_for_children`` did: ``entry_waits`` (1: the entry waits for children),
    ``run_waits`` (1: the run released its worker to wait); ``woken``, the runs its freed
    slot re-queued (sent after the commit)."""

    entry_waits: int
    run_waits: int
    woken: Woken


@dataclass(frozen=True)
class Child:
    """A child run an entry spawned, as the join reads it."""

    child_run_id: uuid.UUID
    position: int
    item_key: str
    status: str
    result: Any
    error: dict[str, Any] | None
    dispatch_key: str | None


@dataclass(frozen=True)
class PastEntry:
    """An entry of a run's history (``ctx.history``)."""

    id: int
    entry_no: int
    step_id: str
    status: str
    outputs: Any
    next_step: str | None


# The statements of ``sql/ledger.sql``. Every write's first part is the fence:
# ``run AS (SELECT ... FROM runs WHERE id = :run AND status = 'running' AND claimed_by =
# ANY(:boots) FOR SHARE)``; FOR SHARE makes a takeover (an UPDATE of that row) wait for
# the write's transaction, or the write see the takeover and write nothing.
ENTER = statement("enter")
CLAIM_MARKER = statement("claim_marker")
MARKER_STATE = statement("marker_state")
TAKE_OVER_MARKER = statement("take_over_marker")
COMPLETE_MARKER = statement("complete_marker")
CLOSE_ENTRY = statement("close_entry")
INSERT_CLOSED = statement("insert_closed")
WAIT = function("poimen_wait")
CHILDREN = statement("children")
HISTORY = statement("history")


# -- ledger writes (each in the caller's transaction) -------------------------------------------

def declared_actions(step: DeclaredStep) -> list[dict[str, Any]]:
    """The actions record of an entry just entered: each declared action, pending."""
    return [{"position": a.position, "name": a.name, "marker": a.marker, "status": "pending"}
            for a in step.actions]


def enter_step(session: Executor, run_id: uuid.UUID, ours: list[uuid.UUID],
               step: DeclaredStep, entry_no: int, *, events: bool = True) -> Entered | None:
    """Append entry ``entry_no`` into ``step`` (fenced); None if the run is not ours."""
    row = session.execute(ENTER, {
        "run": run_id, "boots": ours, "entry_no": entry_no, "step": step.id,
        "actions": to_json(declared_actions(step)), "events": events,
    }).one_or_none()
    return None if row is None else build(Entered, row)


def claim_marker(session: Executor, run_id: uuid.UUID, ours: list[uuid.UUID], entry_id: int,
                 position: int, claimer: uuid.UUID, *, retrying: bool = False) -> MarkerClaim:
    """Claim marker ``(entry_id, position)`` for boot ``claimer`` (which must be live).

    ``retrying``: an earlier try of this very claim may have committed with its
    acknowledgement lost, so a marker held by ``claimer`` is this claim's own.
    """
    params = {"run": run_id, "boots": ours, "entry": entry_id, "position": position,
              "claimer": claimer}
    row = session.execute(CLAIM_MARKER, params).one()
    if row.claims is not None:
        return MarkerClaim(MarkerOutcome.CLAIMED, claims=row.claims, holder=claimer)
    if not row.held:
        return MarkerClaim(MarkerOutcome.FENCED)
    if not row.claimer_live:
        return MarkerClaim(MarkerOutcome.CLAIMER_DEAD)
    state = session.execute(MARKER_STATE, params).one()
    if state.status == "completed":
        return MarkerClaim(MarkerOutcome.COMPLETED, state.claims, state.claimed_by, state.result)
    if state.status == "failed":
        return MarkerClaim(MarkerOutcome.FAILED, state.claims, state.claimed_by,
                           error=state.error)
    if state.claimed_by == claimer:
        outcome = MarkerOutcome.CLAIMED if retrying else MarkerOutcome.DUPLICATE
        return MarkerClaim(outcome, state.claims, claimer)
    if state.holder_live:
        return MarkerClaim(MarkerOutcome.HELD, state.claims, state.claimed_by)
    taken = session.execute(TAKE_OVER_MARKER, {**params, "dead": state.claimed_by}
                            ).one_or_none()
    if taken is None:
        # Another rescuer won the compare-and-set (or our fence went): not ours.
        return MarkerClaim(MarkerOutcome.HELD, state.claims, state.claimed_by)
    return MarkerClaim(MarkerOutcome.TAKEN_OVER, taken.claims, state.claimed_by)


def finish_marker(session: Executor, run_id: uuid.UUID, ours: list[uuid.UUID], entry_id: int,
                  position: int, *, step_id: str, entry_no: int, name: str, key: str,
                  result: Any = None, error: dict[str, Any] | None = None,
                  children: list[tuple[uuid.UUID, int, str]] | None = None) -> bool:
    """Complete (or, with ``error``, fail) a marker this process holds; False if it does not.

    ``children``: (child run id, ordinal, item key) a fan-out admitted in this
    transaction, linked to the entry in the same statement.
    """
    status = "failed" if error is not None else "completed"
    linked = children or []
    return int(session.execute(COMPLETE_MARKER, {
        "run": run_id, "boots": ours, "entry": entry_id, "position": position,
        "status": status, "result": to_json(result), "error": to_json(error),
        "event_type": f"action.{status}", "step": step_id, "entry_no": entry_no,
        "name": name, "key": key, "children": [c[0] for c in linked],
        "ordinals": [c[1] for c in linked], "item_keys": [c[2] for c in linked],
    }).scalar_one()) == 1


def marker_state(session: Executor, entry_id: int, position: int) -> MarkerState | None:
    """Marker ``(entry_id, position)`` as it stands; None if it has no row."""
    row = session.execute(MARKER_STATE, {"entry": entry_id, "position": position}
                          ).one_or_none()
    return None if row is None else build(MarkerState, row)


def close_entry(session: Executor, run_id: uuid.UUID, ours: list[uuid.UUID],
                close: EntryClose) -> Entered | None:
    """End an entry (fenced) with its actions' outcomes; None if the run is not ours.

    An entry that needed no row while it ran (``entry_id`` None) is written now,
    with its ``step.entered`` and ``step.<status>`` events in that order.
    """
    params = {"run": run_id, "boots": ours, "status": close.status,
              "actions": to_json(close.actions), "outputs": to_json(close.outputs),
              "error": to_json(close.error), "next_step": close.next_step,
              "events": close.events, "event_type": f"step.{close.status}"}
    if close.entry_id is None:
        row = session.execute(INSERT_CLOSED, {**params, "entry_no": close.entry_no,
                                              "step": close.step_id}).one_or_none()
    else:
        row = session.execute(CLOSE_ENTRY, {**params, "entry": close.entry_id}).one_or_none()
    return None if row is None else build(Entered, row)


def wait_for_children(session: Executor, run_id: uuid.UUID, ours: list[uuid.UUID], *,
                      entry_id: int, actions: list[dict[str, Any]], outputs: Any) -> Wait:
    """Let the run wait for entry ``entry_id``'s children, releasing its worker (fenced).

    In a transaction after ``runs.lock_slots`` when the run holds a slot (the
    fence does it). Returns ``entry_waits`` / ``run_waits`` counts: both 0 when every child has
    already ended (nothing to wait for); an entry that would wait for a run that
    is not ours has ``entry_waits`` without ``run_waits`` (the caller rolls back).
    """
    wait = build(Wait, session.execute(WAIT.call, {
        "run": run_id, "boots": ours, "entry": entry_id, "actions": to_json(actions),
        "outputs": to_json(outputs)}).one())
    # A run of a limited group that waits for its children gives its slot up:
    # the next run waiting for it is sent once this commits.
    send_woken(session, wait.woken)
    return wait


def children(session: Executor, entry_id: int) -> list[Child]:
    """The child runs entry ``entry_id`` spawned, in position and item order."""
    return [build(Child, row) for row in session.execute(CHILDREN, {"entry": entry_id}).all()]


def history(session: Executor, run_id: uuid.UUID, before_entry: int) -> list[PastEntry]:
    """The run's entries numbered below ``before_entry``, oldest first."""
    return [build(PastEntry, row) for row in session.execute(
        HISTORY, {"run": run_id, "entry_no": before_entry}).all()]
