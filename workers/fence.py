"""The fence: every write a worker makes for a run it holds, in one object.

The dispatcher (``workers/ledger.py``) and the execution of a run
(``workers/execution.py``) decide *what* to record; a ``Fence`` records it
through the run-state store (``app/state/``), and nothing else writes for a
held run. Each write is fenced by the run's claim: the store's statements
accept it only while ``runs.claimed_by`` is one of this process's boots (a
lost boot's run adopted by our new boot stays ours). A refused write raises
``ClaimLost`` (ledger writes) or returns False (the run's own end).

While the database is unreachable (a restart, a failover) a write is retried
for ``POIMEN_RECORD_RETRY_SECONDS``: a finished run must not be executed again
because a pooled connection was stale. A retry knows an earlier try's commit
may have applied with its reply lost, and recognises its own write.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from flask import current_app
from psycopg import Error as PsycopgError
from sqlalchemy import Row, text

from app.admission import Admission, RunRequest, admit_many
from app.enqueue import send_pending
from app.extensions import db
from app.models import TERMINAL_STATUSES, AdmissionOrigin, RunStatus
from app.state import ledger
from app.state.claims import finish_params, finish_run, release_claim, schedule_retry
from app.state.compose import add_woken
from app.state.direct import single_statements
from app.state.executor import Executor, PendingSends, on_session
from app.state.ledger import Child, Entered, EntryClose, MarkerClaim, PastEntry
from app.state.outbox import record_event
from app.state.runs import lock_slots
from app.tracecontext import TraceContext

from . import batching, boots
from .actions import Effect, Emit, Output, bound_error
from .boots import boot_dsn, current_boot
from .dberrors import retryable, rollback
from .registry import Step

log = logging.getLogger(__name__)

_RUN_HOLDER = text("SELECT status, claimed_by FROM runs WHERE id = :run")

# write(store, ours, retrying) -> (commit, value): one transaction's worth of fenced writes.
T = TypeVar("T")
# write(store, ours, retrying) -> (commit, value), generic in the value.
Write = Callable[[Executor, list[uuid.UUID], bool], tuple[bool, T]]
# A row of a plain read (its columns by name).
StoreRow = Row[Any]


class ClaimLost(RuntimeError):
    """A fenced ledger write was refused: another worker holds the run now."""


def record_deadline() -> float:
    """When a write that keeps meeting an unreachable database gives up (monotonic)."""
    retry_for: float = current_app.config["POIMEN_RECORD_RETRY_SECONDS"]
    return time.monotonic() + retry_for


class Fence:
    """Records what one held run's execution decided, fenced by this process's boots."""

    def __init__(self, run_id: uuid.UUID, tenant_id: int, goal_id: str | None = None,
                 trace: TraceContext | None = None, *, slots: bool = False):
        self.run_id = run_id
        self.tenant_id = tenant_id
        self.goal_id = goal_id  # its fan-out's children inherit it
        self.trace = trace  # ... and its W3C Trace Context
        # The run holds a slot of a limited group: every write that ends the hold
        # (finish, retry, release, a join's wait) takes the group's locks first,
        # so the run it wakes is seen (app/state/sql/README.md, "An end frees a slot").
        self.slots = slots

    def _lock_slots(self, session: Executor) -> None:
        if self.slots:
            lock_slots(session, self.run_id)

    # -- the transaction -------------------------------------------------------------------

    def _commit(self, write: Write[T], *, autocommit: bool = False,
                retrying: bool = False) -> T:
        """Run ``write`` in one transaction, committed or rolled back as it says; retried
        while the database is unreachable. Return its value.

        ``autocommit``: each statement of ``write`` is whole on its own (one round
        trip each, no BEGIN and COMMIT); what it "rolls back" is only reads.
        """
        deadline = record_deadline()
        delay = 0.2
        while True:
            try:
                # Each statement on its own, on psycopg (app/state/direct.py), or the
                # session's transaction.
                session = (single_statements(db.session, send_pending) if autocommit
                           else on_session(db.session))
                commit, value = write(session, boots.holders(self.run_id), retrying)
                if commit:
                    session.commit()
                else:
                    session.rollback()
                return value
            except Exception as err:
                rollback()
                if not retryable(err) or time.monotonic() > deadline:
                    raise
                retrying = True
                log.warning("run %s: database unreachable while recording (%s); retrying",
                            self.run_id, type(err).__name__)
                time.sleep(delay)
                delay = min(2.0, delay * 2)

    def _end(self, write: Callable[[Executor, list[uuid.UUID]], bool],
             already_done: Callable[[StoreRow], bool], *, single: bool = False,
             retrying: bool = False) -> bool:
        """One fenced write that ends the run's hold; False if the claim was lost.

        When an earlier try's commit may have applied with its reply lost,
        ``already_done(row)`` recognises our own write. ``single``: ``write`` is one
        statement that takes the slot locks it needs itself (a slot holder's end is
        ``poimen_finish``: the locks, then the end, in one call), so the run
        ends in autocommit, one round trip. Otherwise the locks come first here.
        """
        def attempt(session: Executor, ours: list[uuid.UUID], retrying: bool
                    ) -> tuple[bool, bool]:
            if not single:
                self._lock_slots(session)
            if write(session, ours):
                return True, True
            row = session.execute(_RUN_HOLDER, {"run": self.run_id}).one_or_none()
            now_ours = boots.holders(self.run_id)
            if (row is not None and row.status == RunStatus.RUNNING
                    and row.claimed_by in now_ours and row.claimed_by not in ours):
                # Our watchdog adopted the run for a new boot while we wrote: write again.
                return (True, True) if write(session, now_ours) else (False, False)
            return False, retrying and row is not None and already_done(row)

        return self._commit(attempt, autocommit=single, retrying=retrying)

    def _finished_by_us(self, row: StoreRow) -> bool:
        return row.status in TERMINAL_STATUSES and row.claimed_by in boots.holders(self.run_id)

    @staticmethod
    def _requeued(row: StoreRow) -> bool:
        return bool(row.status == RunStatus.QUEUED)

    # -- boots ------------------------------------------------------------------------------

    @staticmethod
    def claimer() -> uuid.UUID:
        """This process's live boot (a marker's claimer)."""
        return current_boot(boot_dsn).boot_id

    def await_new_boot(self, dead: uuid.UUID) -> uuid.UUID:
        """Return the live boot that adopted the run after this process's boot ``dead`` died.

        The boot watchdog notices the loss and adopts the run
        (``execution._adopt_runs``), or the process exits because another worker
        took the run over; wait for that.
        """
        deadline = record_deadline()
        while True:
            try:
                current = current_boot(boot_dsn)
            except Exception as err:  # noqa: BLE001 - Postgres may still be restarting
                if not retryable(err) and not isinstance(err, PsycopgError):
                    raise
                current = None
            if current is not None and current.boot_id != dead \
                    and current.boot_id in boots.holders(self.run_id):
                return current.boot_id
            if time.monotonic() > deadline:
                raise RuntimeError(f"run {self.run_id}: no live boot adopted it after boot "
                                   f"{dead} died")
            time.sleep(0.1)

    # -- the ledger ---------------------------------------------------------------------------

    def enter(self, step: Step, entry_no: int, *, events: bool) -> Entered:
        """Append entry ``entry_no`` into ``step``; its row (``id``, ``cancel_requested``)."""
        def write(session: Executor, ours: list[uuid.UUID], retrying: bool
                  ) -> tuple[bool, Entered | None]:
            row = ledger.enter_step(session, self.run_id, ours, step, entry_no,
                                          events=events)
            return row is not None, row

        row = self._commit(write)
        if row is None:
            raise ClaimLost(f"entering step {step.id} was refused")
        return row

    def claim_marker(self, entry_id: int, position: int, claimer: uuid.UUID) -> MarkerClaim:
        """Claim marker ``(entry_id, position)`` for boot ``claimer``."""
        return self._commit(lambda session, ours, retrying: (True, ledger.claim_marker(
            session, self.run_id, ours, entry_id, position, claimer, retrying=retrying)))

    def complete_marker(self, entry_id: int, position: int, *, step_id: str, entry_no: int,
                        name: str, key: str, effect: Effect) -> Any:
        """Complete a marker this process holds, writing a built-in's effect in the same
        transaction; return the action's recorded output.

        Raises what admission raises for a child it refuses (``AdmissionConflict``,
        ``UnknownWorkflow``) and ``DataError`` for an output Postgres refuses.
        """
        def write(session: Executor, ours: list[uuid.UUID], retrying: bool
                  ) -> tuple[bool, Any]:
            output, children = self._write_effect(session, effect, key, step_id, entry_no)
            if ledger.finish_marker(session, self.run_id, ours, entry_id, position,
                                          result=output, children=children, step_id=step_id,
                                          entry_no=entry_no, name=name, key=key):
                return True, output
            # Refused. After an uncertain commit the marker may be completed already by us.
            if retrying:
                state = ledger.marker_state(session, entry_id, position)
                if state is not None and state.status == "completed" \
                        and state.claimed_by in ours:
                    return False, state.result
            raise ClaimLost(f"completing marker {step_id}/{entry_no}/{position} was refused: "
                            "the run or the marker is not ours any more")

        return self._commit(write)

    def _write_effect(self, session: Executor, effect: Effect, key: str, step_id: str,
                      entry_no: int) -> tuple[Any, list[tuple[uuid.UUID, int, str]] | None]:
        if isinstance(effect, Output):
            return effect.value, None
        if isinstance(effect, Emit):
            record_event(session, tenant_id=self.tenant_id, run_id=self.run_id,
                         event_type=effect.event_type, idempotency_key=key, step=step_id,
                         entry=entry_no, data=effect.data)
            return {"event": effect.event_type}, None
        # Every child in one statement (ADMIT_MANY) and one read of the keys taken already
        # (a resumed entry re-derives its keys: those children are replays).
        outcomes = admit_many(
            session,
            [RunRequest(workflow_ref=effect.workflow_ref, input=child_input,
                        goal_id=self.goal_id, dispatch_key=dispatch_key, trace=self.trace)
             for _, dispatch_key, child_input in effect.children],
            tenant_id=self.tenant_id, origin=AdmissionOrigin.FANOUT,
            origin_detail=f"spawn_each {key}"[:255], parent_run_id=self.run_id)
        children: list[tuple[uuid.UUID, int, str]] = []
        admitted: list[str] = []
        replayed = 0
        for ordinal, ((ikey, _, _), admission) in enumerate(zip(effect.children, outcomes, strict=True)):
            if not isinstance(admission, Admission):
                raise admission  # a child admission refuses: the marker fails, as before
            children.append((admission.run.id, ordinal, ikey))
            admitted.append(str(admission.run.id))
            replayed += not admission.created
        return {"children": admitted, "replayed": replayed}, children

    def fail_marker(self, entry_id: int, position: int, *, step_id: str, entry_no: int,
                    name: str, key: str, error: dict[str, Any]) -> None:
        """Record a marker-bearing action's failure (the stop rule follows)."""
        error = bound_error(error)

        def write(session: Executor, ours: list[uuid.UUID], retrying: bool
                  ) -> tuple[bool, bool]:
            if ledger.finish_marker(session, self.run_id, ours, entry_id, position,
                                          error=error, step_id=step_id, entry_no=entry_no,
                                          name=name, key=key):
                return True, True
            state = ledger.marker_state(session, entry_id, position) if retrying else None
            return False, state is not None and state.status == "failed"

        if not self._commit(write):
            raise ClaimLost("recording a failed marker was refused")

    def advance(self, close: EntryClose, step: Step, entry_no: int, *, enter: bool
                ) -> tuple[bool, int | None]:
        """Close an entry and (``enter``) write the next one in one transaction.

        Return (cancel requested, the new entry's id or None).
        """
        def write(session: Executor, ours: list[uuid.UUID], retrying: bool
                  ) -> tuple[bool, tuple[bool, int | None] | None]:
            closed = ledger.close_entry(session, self.run_id, ours, close)
            if closed is None:
                return False, None
            if enter:
                entered = ledger.enter_step(session, self.run_id, ours, step, entry_no,
                                                  events=close.events)
                if entered is None:
                    return False, None
                return True, (closed.cancel_requested, entered.id)
            return True, (closed.cancel_requested, None)

        done = self._commit(write)
        if done is None:
            raise ClaimLost(f"closing entry {close.entry_no} ({close.step_id}) was refused")
        return done

    def wait(self, entry_id: int, entry_no: int, *, actions: list[dict[str, Any]],
             outputs: Any) -> bool:
        """Release the worker until the entry's children have finished; False if they have."""
        def write(session: Executor, ours: list[uuid.UUID], retrying: bool
                  ) -> tuple[bool, bool | None]:
            self._lock_slots(session)
            row = ledger.wait_for_children(session, self.run_id, ours, entry_id=entry_id,
                                                 actions=actions, outputs=outputs)
            if row.entry_waits and not row.run_waits:
                return False, None  # the entry would wait for a run that is not ours
            return True, bool(row.run_waits)

        waited = self._commit(write)
        if waited is None:
            raise ClaimLost(f"waiting for the children of entry {entry_no} was refused")
        return waited

    def children(self, entry_id: int) -> list[Child]:
        return self._commit(lambda session, ours, retrying: (
            False, ledger.children(session, entry_id)))

    def history(self) -> list[PastEntry]:
        return self._commit(lambda session, ours, retrying: (
            False, ledger.history(session, self.run_id, 1 << 30)))

    # -- the run's own end --------------------------------------------------------------------

    def release(self) -> bool:
        """Give the run back to ``queued`` before its workflow started; False if not ours."""
        return self._end(lambda session, ours: release_claim(session, self.run_id, ours),
                         self._requeued)

    def finish(self, close: EntryClose | None, *, status: str, result: Any = None,
               error: dict[str, Any] | None = None) -> bool:
        """Close the last entry and end the run in one statement; False if not ours."""
        # Every error text reaches the run and its event bounded (error_info bounds its
        # own; this also catches one built by hand).
        error = bound_error(error) if error is not None else None
        uncertain = False
        if not self.slots and batching.active():
            # In the store batcher's next batch (workers/batching.py): reported only once
            # that batch's statement returned, committed.
            params = finish_params(self.run_id, status=status, result=result, error=error,
                                   close=close)
            try:
                done = batching.batcher().finish(self.run_id, boots.holders(self.run_id),
                                                 params)
            except batching.BatchFailed:
                # Sent alone now: only a bad value fails, and only its own run; an end the
                # batch did apply is refused by the fence and recognised as ours.
                uncertain = True
            else:
                if done is not None:
                    woken = PendingSends()
                    add_woken(woken, done.woken)
                    if woken:
                        send_pending(woken.take())
                    return True
                # Refused: decided alone (an adoption may have moved the claim meanwhile).
        return self._end(lambda session, ours: finish_run(
            session, self.run_id, ours, status=status, result=result, error=error, close=close),
            self._finished_by_us, single=True, retrying=uncertain)

    def retry(self, close: EntryClose | None, *, delay: float, error: dict[str, Any]) -> bool:
        """Close the last entry and queue the run again after ``delay`` s; False if not ours."""
        error = bound_error(error)
        return self._end(lambda session, ours: self._closed(session, ours, close)
                         and schedule_retry(session, self.run_id, ours, delay=delay,
                                            error=error),
                         self._requeued)

    def _closed(self, session: Executor, ours: list[uuid.UUID], close: EntryClose | None) -> bool:
        """Close the run's last step entry in this transaction (True if none to close)."""
        return close is None or ledger.close_entry(
            session, self.run_id, ours, close) is not None
