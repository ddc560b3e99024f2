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

The dispatcher decides; it records nothing itself. Every write goes through
the run's ``Fence`` (``workers/fence.py``), fenced by the run's claim
(``runs.claimed_by`` is one of this process's boots, locked ``FOR SHARE`` in
the statement: ``app/state/ledger.py``), like every other write a worker makes
for a run it holds. The kinds of action and their effects are
``workers/actions.py``; what an action's ``ctx`` is, ``workers/context.py``.

Entries of steps without marker-bearing actions or a join are written when
they end (nothing in them needs a row before: a crash re-runs them from the
top), so a one-function workflow costs one more statement in its finish.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.exc import DataError

from app.admission import AdmissionConflict
from app.state.claims import ClaimedRun
from app.state.ledger import EntryClose, EntryStatus, MarkerClaim, MarkerOutcome

from . import actions, registry
from .actions import error_info, idempotency_key
from .context import RunContext, StepContext
from .fence import ClaimLost, Fence
from .registry import Action, Step, Workflow

log = logging.getLogger(__name__)


class Ending(enum.StrEnum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    WAITING = "waiting"  # recorded already: the run waits for its children
    LOST = "lost"  # the run's claim is not ours any more: nothing was or may be recorded


@dataclass(frozen=True)
class Outcome:
    """How a dispatch ended, and how its last entry ends (``close``).

    The caller writes ``close`` in the transaction that finishes (or retries)
    the run, so the ledger and the run never disagree. ``exc``: the workflow
    exception of a failed non-marker action (the workflow's retry policy
    applies to it); None for ledger failures.
    """

    ending: Ending
    result: Any = None
    error: dict[str, Any] | None = None
    exc: Exception | None = None
    close: EntryClose | None = None


@dataclass
class Entry:
    step: Step
    entry_no: int
    id: int | None = None  # None until written (entries without markers or a join)
    outputs: dict[str, Any] = field(default_factory=dict)
    outcomes: dict[int, dict[str, Any]] = field(default_factory=dict)
    children: list[dict[str, Any]] | None = None
    waking: bool = False  # a join entry whose actions ran before the run waited

    @property
    def row_id(self) -> int:
        """The id of this entry's row: an entry with a marker-bearing action or a join is
        written before its actions run (``Dispatcher._enter``), or resumed with its row."""
        if self.id is None:
            raise RuntimeError(f"entry {self.entry_no} ({self.step.id}) has no row")
        return self.id

    def actions_record(self) -> list[dict[str, Any]]:
        return [{"position": a.position, "name": a.name, "marker": a.marker,
                 **self.outcomes.get(a.position, {"status": "pending"})}
                for a in self.step.actions]

    def outputs_record(self) -> dict[str, Any]:
        if self.children is None:
            return self.outputs
        return {**self.outputs, "children": self.children}

    def close(self, status: str, error: dict[str, Any] | None, next_step: str | None, *,
              events: bool) -> EntryClose:
        """This entry's end, as the store writes it."""
        return EntryClose(entry_id=self.id, entry_no=self.entry_no, step_id=self.step.id,
                          status=status, actions=self.actions_record(),
                          outputs=self.outputs_record(), error=error, next_step=next_step,
                          events=events)


class _Cancelled(Exception):
    def __init__(self, entry: Entry):
        self.entry = entry


class Dispatcher:
    """Executes one claimed run's entries, from where its ledger says it is."""

    def __init__(self, run: RunContext, row: ClaimedRun, fence: Fence):
        self.run = run
        self.row = row
        self.workflow: Workflow = run.workflow
        self.fence = fence
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
        except _Cancelled as cancelled:
            # Cancellation was requested: no further entry; the one just entered
            # (if written) is closed as abandoned with the run.
            entry = cancelled.entry
            for act in entry.step.actions:
                entry.outcomes[act.position] = {"status": "abandoned"}
            close = self._close(entry, EntryStatus.ABANDONED, None, None) \
                if entry.id is not None else None
            return Outcome(Ending.CANCELLED, result=None, close=close)

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
        stop: dict[str, Any] | None = None
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
                    output = actions.call(ctx, act, self.input)
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
                               close=self._close(entry, stop_status, stop, None))
            return self._advance(entry, stop_status, stop, target)

        ctx.position, ctx.idempotency_key = None, None
        try:
            target = self._next_of(ctx, step)
        except Exception as err:  # noqa: BLE001 - a bug in `next` fails the run
            error = error_info(err, code="next_failed")
            return Outcome(Ending.FAILED, error=error, exc=err,
                           close=self._close(entry, EntryStatus.FAILED, error, None))
        failures = [o["error"] for _, o in sorted(entry.outcomes.items())
                    if o["status"] == "failed"]
        status = EntryStatus.FAILED if failures else EntryStatus.COMPLETED
        if target is not None:
            return self._advance(entry, status, None, target)
        if failures:
            # The last entry recorded a failed action: the run fails with it (and
            # the workflow's retry policy applies to the exception, if it is ours).
            return Outcome(Ending.FAILED, error=failures[0], exc=first_failure,
                           close=self._close(entry, status, failures[0], None))
        try:
            result = (self.workflow.result(ctx) if self.workflow.result is not None
                      else self._result_of(step, entry.outputs))
        except Exception as err:  # noqa: BLE001 - a bug in `result` fails the run
            error = error_info(err, code="result_failed")
            return Outcome(Ending.FAILED, error=error, exc=err,
                           close=self._close(entry, EntryStatus.FAILED, error, None))
        return Outcome(Ending.SUCCEEDED, result=result,
                       close=self._close(entry, status, None, None))

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
                ) -> tuple[dict[str, Any] | None, EntryStatus]:
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
            effect = actions.prepare(ctx, act, key, self.input)
        except Exception as err:  # noqa: BLE001 - the stop rule
            return self._fail_marker(entry, act, key, error_info(err, **where)), \
                EntryStatus.FAILED
        try:
            output = self.fence.complete_marker(
                entry.row_id, act.position, step_id=entry.step.id, entry_no=entry.entry_no,
                name=act.name, key=key, effect=effect)
        except (AdmissionConflict, registry.UnknownWorkflow, DataError) as err:
            return self._fail_marker(entry, act, key, error_info(err, **where)), \
                EntryStatus.FAILED
        entry.outcomes[act.position] = {"status": "completed", "output": output}
        entry.outputs[act.name] = output
        return None, EntryStatus.COMPLETED

    def _claim(self, entry: Entry, act: Action) -> MarkerClaim:
        run_id = self.run.run_id
        claimer = self.fence.claimer()
        for _ in range(3):
            claim = self.fence.claim_marker(entry.row_id, act.position, claimer)
            if claim.outcome == MarkerOutcome.FENCED:
                raise ClaimLost("marker claim refused: the run is not held by this process")
            if claim.outcome != MarkerOutcome.CLAIMER_DEAD:
                return claim
            # Our boot lost its lock (Postgres restarted, the connection was cut):
            # it may claim nothing. The process adopts the run under a new boot, or
            # exits if another worker took the run over.
            log.warning("run %s: boot %s lost its lock at a marker claim; waiting for the run "
                        "to be adopted", run_id, claimer)
            claimer = self.fence.await_new_boot(claimer)
        raise ClaimLost("no live boot to claim markers with")

    def _fail_marker(self, entry: Entry, act: Action, key: str, error: dict[str, Any]
                     ) -> dict[str, Any]:
        log.warning("run %s: marker-bearing action %s/%s failed: %s; abandoning the rest of "
                    "entry %s", self.run.run_id, entry.step.id, act.name, error.get("message"),
                    entry.entry_no)
        self.fence.fail_marker(entry.row_id, act.position, step_id=entry.step.id,
                               entry_no=entry.entry_no, name=act.name, key=key, error=error)
        entry.outcomes[act.position] = {"status": "failed", "error": error}
        return {**error, "code": "action_failed"}

    # -- entries ------------------------------------------------------------------------------

    def _enter(self, entry: Entry) -> None:
        row = self.fence.enter(entry.step, entry.entry_no, events=self.events)
        entry.id = row.id
        if row.cancel_requested:
            self.run.note_cancel_requested()

    def _close(self, entry: Entry, status: str, error: dict[str, Any] | None,
               next_step: str | None) -> EntryClose:
        return entry.close(status, error, next_step, events=self.events)

    def _advance(self, entry: Entry, status: str, error: dict[str, Any] | None, target: str
                 ) -> Entry:
        """Close ``entry`` and enter ``target`` in one transaction; return the new entry."""
        nxt = Entry(self.workflow.step(target), entry.entry_no + 1)
        cancel_requested, nxt.id = self.fence.advance(
            self._close(entry, status, error, target), nxt.step, nxt.entry_no,
            enter=nxt.step.has_marker or nxt.step.join)
        self._history = None
        if cancel_requested or self.run.cancel_requested:
            self.run.note_cancel_requested()
            raise _Cancelled(nxt)
        return nxt

    def _wait(self, entry: Entry) -> bool:
        """Release the worker until the entry's children have finished; False if they have."""
        waited = self.fence.wait(entry.row_id, entry.entry_no, actions=entry.actions_record(),
                                 outputs=entry.outputs)
        if waited:
            log.info("run %s: entry %s (%s) waits for its children; worker released",
                     self.run.run_id, entry.entry_no, entry.step.id)
        return waited

    def _children(self, entry_id: int) -> list[dict[str, Any]]:
        return [{"run_id": str(r.child_run_id), "key": r.item_key, "position": r.position,
                 "status": r.status, "result": r.result, "error": r.error,
                 "dispatch_key": r.dispatch_key} for r in self.fence.children(entry_id)]

    def history(self, before_entry: int) -> list[dict[str, Any]]:
        if self._history is None:
            self._history = [{"entry": r.entry_no, "step": r.step_id, "status": r.status,
                              "outputs": r.outputs, "next_step": r.next_step}
                             for r in self.fence.history()]
        return [e for e in self._history if e["entry"] < before_entry]


def dispatch(run: RunContext, row: ClaimedRun, fence: Fence) -> Outcome:
    """Execute the claimed run ``row`` from where its ledger says it is."""
    return Dispatcher(run, row, fence).dispatch()
