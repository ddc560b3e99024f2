"""The step-entry ledger and its dispatcher: the only code that executes a workflow's actions.

A run executes a workflow of steps. Entering a step appends a *step entry*
(``step_entries``: run, entry number, step); re-entering it later (a loop, a
retry, ``on_failure``) appends a new one; resuming a run after its worker died
re-uses its unfinished entry. The dispatcher executes an entry's actions in
declared-position order:

* a marker-bearing action (``marker=True``, ``spawn_each``, ``emit``) first
  *claims its marker* ``(entry, position)`` in ``step_markers``: one
  ``INSERT ... ON CONFLICT DO NOTHING`` that also requires the claimer's boot
  to be live and the run to be held by this process, in the same statement.
  A completed marker is skipped on resume (its recorded result is used). A
  marker claimed by this very boot is a duplicate, by a live boot elsewhere a
  *lost claim*; a marker claimed by a dead boot and never completed is taken
  over with a compare-and-set on the dead boot id, and executed again: so
  every marker-bearing action gets ``ctx.idempotency_key`` (run, step, entry,
  position) to make its effect idempotent. The built-ins go further: their
  effect (child admissions, the event) commits in the very transaction that
  completes the marker.
* **the stop rule**: a marker-bearing action that fails or loses its claim
  abandons the remainder of the entry; the run fails with that reason, or
  enters the step's ``on_failure``. A failing non-marker action is recorded
  and the sequence continues.

Every ledger write is fenced by the run's claim (``runs.claimed_by`` is one of
this process's boots, locked ``FOR SHARE`` in the statement), like every other
write a worker makes for a run it holds.

Entries of steps without marker-bearing actions or a join are written when
they end (nothing in them needs a row before: a crash re-runs them from the
top), so a one-function workflow costs one more statement in its finish.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import traceback
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flask import current_app
from sqlalchemy import Row
from sqlalchemy.exc import DataError
from sqlalchemy.orm import Session

from app.admission import AdmissionConflict, admit_run
from app.models import AdmissionOrigin
from app.state import ledger as store
from app.state.ledger import (
    MarkerClaim,
    MarkerOutcome,
    claim_marker,
    enter_step,
    finish_marker,
    marker_state,
)
from app.state.outbox import record_event

from . import registry
from .registry import Action, Step, Workflow

if TYPE_CHECKING:
    from .execution import RunContext

log = logging.getLogger(__name__)

TRACEBACK_LIMIT = 4000
MAX_DISPATCH_KEY = 255


class EntryStatus(enum.StrEnum):
    RUNNING = "running"
    WAITING = "waiting"  # a join entry whose actions are done, waiting for its children
    COMPLETED = "completed"
    FAILED = "failed"  # a marker-bearing action failed, or (the last entry) a non-marker one
    ABANDONED = "abandoned"  # a marker claim was lost: the remainder never ran


# -- keys ------------------------------------------------------------------------------------

def idempotency_key(run_id: uuid.UUID, step_id: str, entry_no: int, position: int) -> str:
    """The key of one marker-bearing action's effect: (run, step, entry, position).

    Its inputs come from the declaration (step id, declared position) and the
    entry's number, never from whether a ledger row happens to exist, so a
    resumed entry derives the same key and another entry a different one.
    """
    return f"{run_id}/{step_id}/{entry_no}/{position}"


def item_key(item: Any, index: int, key: str | Callable[[Any], Any] | None) -> str:
    """The key of one fan-out item: ``item[key]``, ``key(item)``, or the item's index."""
    if key is None:
        value: Any = index
    elif callable(key):
        value = key(item)
    else:
        value = item[key]
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return str(value)


def fanout_key(idem_key: str, item: str) -> str:
    """The ``dispatch_key`` of one child: the action's idempotency key and the item key.

    The item key comes last, so no item can make two keys collide; a key too
    long for the column ends in the item key's SHA-256 instead.
    """
    key = f"{idem_key}/{item}"
    if len(key) > MAX_DISPATCH_KEY:
        key = f"{idem_key}/sha256:{hashlib.sha256(item.encode()).hexdigest()}"
    return key


def error_info(err: BaseException, **extra: Any) -> dict[str, Any]:
    """An exception as stored in ``runs.error`` and the ledger (type, message, traceback)."""
    tb = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    return {**extra, "type": f"{type(err).__module__}.{type(err).__qualname__}",
            "message": str(err), "traceback": tb[-TRACEBACK_LIMIT:]}


# -- the dispatcher ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Fencing:
    """What the dispatcher needs from the execution of the run (``workers/execution.py``).

    ``commit(run_id, write)``: run ``write(session, ours, retrying) -> (commit, value)``
    and commit it (or roll back), retrying while the database is unreachable;
    return ``value``. ``claimer()``: this process's live boot. ``await_new_boot(
    run_id, dead)``: once the boot ``dead`` lost its lock, the boot that adopted
    the run (the process exits if another worker took it over).
    """

    commit: Callable[[uuid.UUID, Callable[[Session, list[uuid.UUID], bool], tuple[bool, Any]]],
                     Any]
    claimer: Callable[[], uuid.UUID]
    await_new_boot: Callable[[uuid.UUID, uuid.UUID], uuid.UUID]


class Ending(enum.StrEnum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    WAITING = "waiting"  # recorded already: the run waits for its children
    LOST = "lost"  # the run's claim is not ours any more: nothing was or may be recorded


@dataclass
class Outcome:
    """How a dispatch ended, and the write that closes the last entry.

    ``close(session, ours)`` is made by the caller in the transaction that
    finishes (or retries) the run, so the ledger and the run never disagree.
    ``exc``: the workflow exception of a failed non-marker action (the
    workflow's retry policy applies to it); None for ledger failures.
    """

    ending: Ending
    result: Any = None
    error: dict | None = None
    exc: Exception | None = None
    close: EntryClose | None = None


class ClaimLost(RuntimeError):
    """A fenced ledger write was refused: another worker holds the run now."""


@dataclass
class Entry:
    step: Step
    entry_no: int
    id: int | None = None  # None until written (entries without markers or a join)
    outputs: dict[str, Any] = field(default_factory=dict)
    outcomes: dict[int, dict[str, Any]] = field(default_factory=dict)
    children: list[dict[str, Any]] | None = None
    waking: bool = False  # a join entry whose actions ran before the run waited

    def actions_record(self) -> list[dict[str, Any]]:
        return [{"position": a.position, "name": a.name, "marker": a.marker,
                 **self.outcomes.get(a.position, {"status": "pending"})}
                for a in self.step.actions]

    def outputs_record(self) -> dict[str, Any]:
        if self.children is None:
            return self.outputs
        return {**self.outputs, "children": self.children}


@dataclass
class EntryClose:
    """The write that ends an entry (made in the caller's transaction); False if refused."""

    dispatcher: Dispatcher
    entry: Entry
    status: str
    error: dict | None
    next_step: str | None

    def __call__(self, session: Session, ours: list[uuid.UUID]) -> bool:
        return self.dispatcher._close(session, ours, self.entry, self.status, self.error,
                                      self.next_step) is not None

    def without_outputs(self, error: dict) -> EntryClose:
        """The same end, failed with ``error`` and no outputs (Postgres refused them)."""
        bare = Entry(self.entry.step, self.entry.entry_no, id=self.entry.id, outcomes={
            p: {"status": o["status"]} for p, o in self.entry.outcomes.items()})
        return EntryClose(self.dispatcher, bare, EntryStatus.FAILED, error, self.next_step)


class StepContext:
    """What an action (and a step's ``next``) gets besides the run's input.

    Everything a one-function workflow's ``ctx`` had (``run_id``, ``tenant_id``,
    ``attempt``, ``cancelled``, ``shutting_down``), plus the step, the entry
    and the action being executed.
    """

    def __init__(self, run: RunContext, dispatcher: Dispatcher, entry: Entry):
        self._run = run
        self._dispatcher = dispatcher
        self._entry = entry
        self.position: int | None = None
        # Set for marker-bearing actions only: (run, step, entry, position).
        self.idempotency_key: str | None = None

    run_id = property(lambda self: self._run.run_id)
    tenant_id = property(lambda self: self._run.tenant_id)
    attempt = property(lambda self: self._run.attempt)
    workflow = property(lambda self: self._run.workflow)
    boot_id = property(lambda self: self._run.boot_id)
    cancelled = property(lambda self: self._run.cancelled)
    shutting_down = property(lambda self: self._run.shutting_down)

    @property
    def input(self) -> dict[str, Any]:
        return self._dispatcher.input

    @property
    def step(self) -> str:
        return self._entry.step.id

    @property
    def entry(self) -> int:
        """This entry's number in the run (1, 2, ...)."""
        return self._entry.entry_no

    @property
    def outputs(self) -> dict[str, Any]:
        """The outputs of this entry's completed actions so far, by action name."""
        return self._entry.outputs

    @property
    def children(self) -> list[dict[str, Any]]:
        """A join entry's children once they all finished: run_id, key, status, result, error."""
        return self._entry.children or []

    @property
    def visit(self) -> int:
        """How many times the run has entered this step, this entry included."""
        return 1 + sum(1 for e in self.history() if e["step"] == self.step)

    def history(self, step: str | None = None) -> list[dict[str, Any]]:
        """Earlier entries of the run (of ``step`` only, if given), oldest first."""
        return [e for e in self._dispatcher.history(self._entry.entry_no)
                if step is None or e["step"] == step]


class Dispatcher:
    """Executes one claimed run's entries, from where its ledger says it is."""

    def __init__(self, run: RunContext, row: Row, fencing: Fencing):
        self.run = run
        self.row = row
        self.workflow: Workflow = run.workflow
        self.fencing = fencing
        self.input: dict[str, Any] = row.input
        self.events = len(self.workflow.steps) > 1
        self._history: list[dict[str, Any]] | None = None

    # -- entry points ----------------------------------------------------------------------

    def dispatch(self) -> Outcome:
        try:
            return self._dispatch()
        except ClaimLost as lost:
            log.warning("run %s: %s; stopping", self.run.run_id, lost)
            return Outcome(Ending.LOST)

    def _dispatch(self) -> Outcome:
        wf = self.workflow
        pinned = getattr(self.row, "definition_hash", None)
        if pinned and pinned != wf.definition_hash:
            # Markers are addressed by declared position: under another definition
            # a completed marker could be taken for a different action's. Refuse
            # before any action runs.
            return Outcome(Ending.FAILED, error={
                "code": "definition_changed", "type": "poimen.DefinitionChanged",
                "message": f"{wf.ref} resolves to a definition ({wf.definition_hash[:12]}) "
                           f"other than the one pinned at admission ({pinned[:12]}); the run "
                           "is refused before any action", "traceback": ""})
        entry = self._resume_point(getattr(self.row, "last_entry", None))
        if isinstance(entry, Outcome):
            return entry
        while True:
            if entry.entry_no > wf.max_entries:
                return Outcome(Ending.FAILED, error={
                    "code": "too_many_entries", "type": "poimen.TooManyEntries",
                    "message": f"the run entered steps {wf.max_entries} times (max_entries)",
                    "traceback": ""})
            outcome = self._run_entry(entry)
            if isinstance(outcome, Outcome):
                return outcome
            entry = outcome

    def _resume_point(self, last: Mapping[str, Any] | None) -> Entry | Outcome:
        wf = self.workflow
        if last is None:
            return Entry(wf.first_step, 1)
        try:
            step = wf.step(last["step_id"])
        except KeyError:
            return Outcome(Ending.FAILED, error={
                "code": "definition_changed", "type": "poimen.DefinitionChanged",
                "message": f"the run's ledger names step {last['step_id']!r}, which {wf.ref} "
                           "does not have", "traceback": ""})
        status = last["status"]
        if status in (EntryStatus.RUNNING, EntryStatus.WAITING):
            # Resuming re-uses the unfinished entry: its completed markers are skipped.
            outcomes = {a["position"]: {k: v for k, v in a.items()
                                        if k not in ("position", "name", "marker")}
                        for a in last.get("actions") or [] if a.get("status") != "pending"}
            return Entry(step, last["entry_no"], id=last["id"],
                         outputs=dict(last.get("outputs") or {}), outcomes=outcomes,
                         waking=status == EntryStatus.WAITING)
        if last.get("next_step"):
            return Entry(wf.step(last["next_step"]), last["entry_no"] + 1)
        if status == EntryStatus.COMPLETED:
            # Its run finish is in the entry's own transaction: not reached in practice.
            return Outcome(Ending.SUCCEEDED, result=self._result_of(step, last["outputs"]))
        # The last entry failed and the run was sent back for a retry: a new entry.
        return Entry(step, last["entry_no"] + 1)

    # -- one entry ----------------------------------------------------------------------------

    def _run_entry(self, entry: Entry) -> Entry | Outcome:
        step = entry.step
        ctx = StepContext(self.run, self, entry)
        stop: dict | None = None
        stop_status = EntryStatus.FAILED
        first_failure: Exception | None = None
        if not entry.waking:
            if entry.id is None and (step.has_marker or step.join):
                self._enter(entry)
            for act in step.actions:
                if stop is not None:
                    entry.outcomes[act.position] = {"status": "abandoned"}
                    continue
                if act.marker:
                    stop, stop_status = self._marker(ctx, entry, act)
                    continue
                ctx.position, ctx.idempotency_key = act.position, None
                try:
                    output = self._call(ctx, act)
                except Exception as err:  # noqa: BLE001 - recorded; the sequence continues
                    log.info("run %s: action %s/%s failed (not marker-bearing; continuing): %s",
                             self.run.run_id, step.id, act.name, type(err).__name__)
                    entry.outcomes[act.position] = {"status": "failed",
                                                    "error": error_info(err)}
                    first_failure = first_failure or err
                else:
                    entry.outcomes[act.position] = {"status": "completed", "output": output}
                    entry.outputs[act.name] = output
            if stop is None and step.join and entry.id is not None:
                if self._wait(entry):
                    return Outcome(Ending.WAITING)
        if step.join and entry.id is not None and stop is None:
            entry.children = self._children(entry.id)

        if stop is not None:
            # The stop rule: the remainder was abandoned above.
            target = step.on_failure
            if target is None:
                return Outcome(Ending.FAILED, error=stop,
                               close=self._closer(entry, stop_status, stop, None))
            return self._advance(entry, stop_status, stop, target)

        ctx.position, ctx.idempotency_key = None, None
        try:
            target = self._next_of(ctx, step)
        except Exception as err:  # noqa: BLE001 - a bug in `next` fails the run
            error = error_info(err, code="next_failed")
            return Outcome(Ending.FAILED, error=error, exc=err,
                           close=self._closer(entry, EntryStatus.FAILED, error, None))
        failures = [o["error"] for _, o in sorted(entry.outcomes.items())
                    if o["status"] == "failed"]
        status = EntryStatus.FAILED if failures else EntryStatus.COMPLETED
        if target is not None:
            return self._advance(entry, status, None, target)
        if failures:
            # The last entry recorded a failed action: the run fails with it (and
            # the workflow's retry policy applies to the exception, if it is ours).
            return Outcome(Ending.FAILED, error=failures[0], exc=first_failure,
                           close=self._closer(entry, status, failures[0], None))
        try:
            result = (self.workflow.result(ctx) if self.workflow.result is not None
                      else self._result_of(step, entry.outputs))
        except Exception as err:  # noqa: BLE001 - a bug in `result` fails the run
            error = error_info(err, code="result_failed")
            return Outcome(Ending.FAILED, error=error, exc=err,
                           close=self._closer(entry, EntryStatus.FAILED, error, None))
        return Outcome(Ending.SUCCEEDED, result=result,
                       close=self._closer(entry, status, None, None))

    def _call(self, ctx: StepContext, act: Action) -> Any:
        if act.kind == "call":
            return act.fn(ctx, self.input)
        if act.kind == "task":
            celery_task = current_app.extensions["celery"].tasks[act.params["task"]]
            kwargs = act.params["kwargs"]
            # The task's own function, in this worker: no message, no second queue.
            return celery_task.run(**(kwargs(ctx, self.input) if kwargs else self.input))
        raise registry.InvalidDefinition(f"action kind {act.kind!r} is not callable directly")

    def _next_of(self, ctx: StepContext, step: Step) -> str | None:
        target = step.next(ctx) if callable(step.next) else step.next
        if target is not None and not self.workflow.has_step(target):
            raise registry.InvalidDefinition(f"step {step.id!r}: next returned unknown step "
                                             f"{target!r}")
        return target

    @staticmethod
    def _result_of(step: Step, outputs: Mapping[str, Any]) -> Any:
        return outputs.get(step.actions[-1].name)

    # -- markers ------------------------------------------------------------------------------

    def _marker(self, ctx: StepContext, entry: Entry, act: Action
                ) -> tuple[dict | None, EntryStatus]:
        """Claim, execute and complete one marker-bearing action; return (stop, status)."""
        run_id = self.run.run_id
        key = idempotency_key(run_id, entry.step.id, entry.entry_no, act.position)
        claim = self._claim(entry, act)
        where = {"step": entry.step.id, "entry": entry.entry_no, "position": act.position,
                 "action": act.name}
        if claim.outcome == MarkerOutcome.COMPLETED:
            entry.outcomes[act.position] = {"status": "completed", "output": claim.result}
            entry.outputs[act.name] = claim.result
            return None, EntryStatus.COMPLETED
        if claim.outcome == MarkerOutcome.FAILED:
            entry.outcomes[act.position] = {"status": "failed", "error": claim.error}
            return {**(claim.error or {}), "code": "action_failed", **where}, EntryStatus.FAILED
        if not claim.outcome.execute:
            error = {"code": "marker_claim_lost", "type": "poimen.MarkerClaimLost",
                     "message": f"marker ({entry.step.id} entry {entry.entry_no}, position "
                                f"{act.position}) is {claim.outcome.value}: held by boot "
                                f"{claim.holder}; the rest of the entry is abandoned",
                     "traceback": "", **where}
            entry.outcomes[act.position] = {"status": "lost", "error": error}
            log.warning("run %s: %s", run_id, error["message"])
            return error, EntryStatus.ABANDONED
        if claim.outcome == MarkerOutcome.TAKEN_OVER:
            log.warning("run %s: marker %s/%s/%s taken over from dead boot %s; executing it "
                        "again under idempotency key %s", run_id, entry.step.id,
                        entry.entry_no, act.position, claim.holder, key)

        ctx.position, ctx.idempotency_key = act.position, key
        try:
            effect = self._prepare(ctx, act, key)
        except Exception as err:  # noqa: BLE001 - the stop rule
            return self._fail_marker(entry, act, key, error_info(err, **where)), \
                EntryStatus.FAILED
        try:
            output = self.fencing.commit(run_id, lambda s, ours, retrying: self._complete(
                s, ours, retrying, entry, act, key, effect))
        except (AdmissionConflict, registry.UnknownWorkflow, DataError) as err:
            return self._fail_marker(entry, act, key, error_info(err, **where)), \
                EntryStatus.FAILED
        entry.outcomes[act.position] = {"status": "completed", "output": output}
        entry.outputs[act.name] = output
        return None, EntryStatus.COMPLETED

    def _claim(self, entry: Entry, act: Action) -> MarkerClaim:
        run_id = self.run.run_id
        claimer = self.fencing.claimer()
        for _ in range(3):
            claim = self.fencing.commit(run_id, lambda s, ours, retrying, boot=claimer: (
                True, claim_marker(s, run_id, ours, entry.id, act.position, boot,
                                   retrying=retrying)))
            if claim.outcome == MarkerOutcome.FENCED:
                raise ClaimLost("marker claim refused: the run is not held by this process")
            if claim.outcome != MarkerOutcome.CLAIMER_DEAD:
                return claim
            # Our boot lost its lock (Postgres restarted, the connection was cut):
            # it may claim nothing. The process adopts the run under a new boot, or
            # exits if another worker took the run over.
            log.warning("run %s: boot %s lost its lock at a marker claim; waiting for the run "
                        "to be adopted", run_id, claimer)
            claimer = self.fencing.await_new_boot(run_id, claimer)
        raise ClaimLost("no live boot to claim markers with")

    def _prepare(self, ctx: StepContext, act: Action, key: str) -> Any:
        """Run the action's own code; for a built-in, compute what it will write."""
        if act.kind in ("call", "task"):
            return ("output", self._call(ctx, act))
        if act.kind == "emit":
            data = act.params["data"]
            data = data(ctx, self.input) if callable(data) else dict(data or {})
            return ("emit", act.params["type"], data)
        if act.kind == "spawn_each":
            return ("spawn", self._fanout(ctx, act, key))
        raise registry.InvalidDefinition(f"unknown action kind {act.kind!r}")

    def _fanout(self, ctx: StepContext, act: Action, key: str
                ) -> list[tuple[str, str, dict[str, Any]]]:
        over, make_input = act.params["over"], act.params["input"]
        items = list(over(ctx, self.input) if callable(over) else _path(ctx, over))
        children, seen = [], set()
        for index, item in enumerate(items):
            ikey = item_key(item, index, act.params["key"])
            if ikey in seen:
                raise ValueError(f"spawn_each: two items have the key {ikey!r}")
            seen.add(ikey)
            child_input = (make_input(ctx, item) if make_input is not None
                           else item if isinstance(item, Mapping) else {"item": item})
            children.append((ikey, fanout_key(key, ikey), dict(child_input)))
        return children

    def _complete(self, session: Session, ours: list[uuid.UUID], retrying: bool, entry: Entry,
                  act: Action, key: str, effect: tuple) -> tuple[bool, Any]:
        run_id = self.run.run_id
        common = dict(step_id=entry.step.id, entry_no=entry.entry_no, name=act.name, key=key)
        kind = effect[0]
        children = None
        if kind == "output":
            output = effect[1]
        elif kind == "emit":
            _, event_type, data = effect
            record_event(session, tenant_id=self.run.tenant_id, run_id=run_id,
                         event_type=event_type, idempotency_key=key, step=entry.step.id,
                         entry=entry.entry_no, data=data)
            output = {"event": event_type}
        else:
            children, admitted, replayed = [], [], 0
            for ordinal, (ikey, dispatch_key, child_input) in enumerate(effect[1]):
                admission = admit_run(
                    session, tenant_id=self.run.tenant_id,
                    workflow_ref=act.params["workflow_ref"], input=child_input,
                    goal_id=self.row.goal_id, dispatch_key=dispatch_key,
                    origin=AdmissionOrigin.FANOUT, origin_detail=f"spawn_each {key}"[:255],
                    parent_run_id=run_id)
                children.append((admission.run.id, ordinal, ikey))
                admitted.append(str(admission.run.id))
                replayed += not admission.created
            output = {"children": admitted, "replayed": replayed}
        if finish_marker(session, run_id, ours, entry.id, act.position, result=output,
                         children=children, **common):
            return True, output
        # Refused. After an uncertain commit the marker may be completed already by us.
        if retrying:
            state = marker_state(session, entry.id, act.position)
            if state is not None and state.status == "completed" and state.claimed_by in ours:
                return False, state.result
        raise ClaimLost(f"completing marker {entry.step.id}/{entry.entry_no}/{act.position} "
                        "was refused: the run or the marker is not ours any more")

    def _fail_marker(self, entry: Entry, act: Action, key: str, error: dict) -> dict:
        run_id = self.run.run_id
        log.warning("run %s: marker-bearing action %s/%s failed: %s; abandoning the rest of "
                    "entry %s", run_id, entry.step.id, act.name, error.get("message"),
                    entry.entry_no)

        def write(session: Session, ours: list[uuid.UUID], retrying: bool) -> tuple[bool, bool]:
            if finish_marker(session, run_id, ours, entry.id, act.position, error=error,
                             step_id=entry.step.id, entry_no=entry.entry_no, name=act.name,
                             key=key):
                return True, True
            state = marker_state(session, entry.id, act.position) if retrying else None
            return False, state is not None and state.status == "failed"

        if not self.fencing.commit(run_id, write):
            raise ClaimLost("recording a failed marker was refused")
        entry.outcomes[act.position] = {"status": "failed", "error": error}
        return {**error, "code": "action_failed"}

    # -- entries ------------------------------------------------------------------------------

    def _enter(self, entry: Entry) -> None:
        run_id = self.run.run_id

        def write(session: Session, ours: list[uuid.UUID], retrying: bool):
            row = enter_step(session, run_id, ours, entry.step, entry.entry_no,
                             events=self.events)
            return row is not None, row

        row = self.fencing.commit(run_id, write)
        if row is None:
            raise ClaimLost(f"entering step {entry.step.id} was refused")
        entry.id = row.id
        if row.cancel_requested:
            self.run._cancelled = True

    def _close(self, session: Session, ours: list[uuid.UUID], entry: Entry, status: str,
               error: dict | None, next_step: str | None) -> Row | None:
        return store.close_entry(
            session, self.run.run_id, ours, entry_id=entry.id, entry_no=entry.entry_no,
            step_id=entry.step.id, status=status, actions=entry.actions_record(),
            outputs=entry.outputs_record(), error=error, next_step=next_step,
            events=self.events)

    def _closer(self, entry: Entry, status: str, error: dict | None,
                next_step: str | None) -> EntryClose:
        return EntryClose(self, entry, status, error, next_step)

    def _advance(self, entry: Entry, status: str, error: dict | None, target: str) -> Entry:
        """Close ``entry`` and enter ``target`` in one transaction; return the new entry."""
        run_id = self.run.run_id
        nxt = Entry(self.workflow.step(target), entry.entry_no + 1)

        def write(session: Session, ours: list[uuid.UUID], retrying: bool):
            closed = self._close(session, ours, entry, status, error, target)
            if closed is None:
                return False, None
            if nxt.step.has_marker or nxt.step.join:
                entered = enter_step(session, run_id, ours, nxt.step, nxt.entry_no,
                                     events=self.events)
                if entered is None:
                    return False, None
                return True, (closed.cancel_requested, entered.id)
            return True, (closed.cancel_requested, None)

        done = self.fencing.commit(run_id, write)
        if done is None:
            raise ClaimLost(f"closing entry {entry.entry_no} ({entry.step.id}) was refused")
        self._history = None
        cancel_requested, nxt.id = done
        if cancel_requested or self.run._cancelled:
            self.run._cancelled = True
            raise _Cancelled(nxt)
        return nxt

    def _wait(self, entry: Entry) -> bool:
        """Release the worker until the entry's children have finished; False if they have."""
        run_id = self.run.run_id

        def write(session: Session, ours: list[uuid.UUID], retrying: bool):
            row = store.wait_for_children(session, run_id, ours, entry_id=entry.id,
                                          actions=entry.actions_record(),
                                          outputs=entry.outputs)
            if row.entry_waits and not row.run_waits:
                return False, None  # the entry would wait for a run that is not ours
            return True, bool(row.run_waits)

        waited = self.fencing.commit(run_id, write)
        if waited is None:
            raise ClaimLost(f"waiting for the children of entry {entry.entry_no} was refused")
        if waited:
            log.info("run %s: entry %s (%s) waits for its children; worker released", run_id,
                     entry.entry_no, entry.step.id)
        return waited

    def _children(self, entry_id: int) -> list[dict[str, Any]]:
        rows = self._read(lambda s: store.children(s, entry_id))
        return [{"run_id": str(r.child_run_id), "key": r.item_key, "position": r.position,
                 "status": r.status, "result": r.result, "error": r.error,
                 "dispatch_key": r.dispatch_key} for r in rows]

    def history(self, before_entry: int) -> list[dict[str, Any]]:
        if self._history is None:
            rows = self._read(lambda s: store.history(s, self.run.run_id, 1 << 30))
            self._history = [{"entry": r.entry_no, "step": r.step_id, "status": r.status,
                              "outputs": r.outputs, "next_step": r.next_step} for r in rows]
        return [e for e in self._history if e["entry"] < before_entry]

    def _read(self, read: Callable[[Session], list[Row]]) -> list[Row]:
        return self.fencing.commit(self.run.run_id, lambda s, ours, retrying: (False, read(s)))


class _Cancelled(Exception):
    def __init__(self, entry: Entry):
        self.entry = entry


def _path(ctx: StepContext, path: str) -> Any:
    head, *rest = path.split(".")
    if head == "input":
        value: Any = ctx.input
    elif head == "outputs":
        value = ctx.outputs
    else:
        raise registry.InvalidDefinition(f"path {path!r} must start with 'input.' or 'outputs.'")
    for part in rest:
        value = value[int(part)] if isinstance(value, list) else value[part]
    return value


def dispatch(run: RunContext, row: Row, fencing: Fencing) -> Outcome:
    """Execute the claimed run ``row`` from where its ledger says it is."""
    dispatcher = Dispatcher(run, row, fencing)
    try:
        return dispatcher.dispatch()
    except _Cancelled as cancelled:
        # Cancellation was requested: no further entry; the one just entered
        # (if written) is closed as abandoned with the run.
        entry = cancelled.entry
        for act in entry.step.actions:
            entry.outcomes[act.position] = {"status": "abandoned"}
        close = dispatcher._closer(entry, EntryStatus.ABANDONED, None, None) \
            if entry.id is not None else None
        return Outcome(Ending.CANCELLED, result=None, close=close)
