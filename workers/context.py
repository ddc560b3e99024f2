"""What workflow code sees: the run's context, and a step action's.

``RunContext`` is the run's; ``StepContext``, what every action gets as ``ctx``
(a one-function workflow's function too), adds the step, the entry and the
action being executed (``workers/ledger.py`` makes one per entry).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from sqlalchemy import text

from app.extensions import db

from . import registry
from .dberrors import retryable

_CANCEL_REQUESTED = text("SELECT cancel_requested FROM runs WHERE id = :run")


@dataclass
class RunContext:
    """What a workflow function gets besides its input."""

    run_id: uuid.UUID
    tenant_id: int
    attempt: int
    workflow: registry.Workflow
    boot_id: uuid.UUID
    # Whether a cancel request has been seen (at the claim, or in a ledger write's reply).
    cancel_requested: bool = field(default=False, repr=False)
    # Workflow exceptions recorded before this attempt (a Celery task's self.request.retries).
    failures: int = 0

    def note_cancel_requested(self) -> None:
        """A ledger write saw the run's cancel request: its next checkpoint stops it."""
        self.cancel_requested = True

    @property
    def cancelled(self) -> bool:
        """Whether cancellation was requested (a checkpoint: reads the database).

        While the database is unreachable the answer is the last one known: a
        restart of Postgres must not fail the runs that happen to ask.
        """
        if not self.cancel_requested:
            try:
                with db.engine.connect() as conn:
                    self.cancel_requested = bool(conn.execute(
                        _CANCEL_REQUESTED, {"run": self.run_id}).scalar())
            except Exception as err:  # noqa: BLE001
                if not retryable(err):
                    raise
        return self.cancel_requested

    @property
    def shutting_down(self) -> bool:
        """Whether this worker got SIGTERM (a deploy): a long workflow may checkpoint."""
        try:
            from .shutdown import shutting_down
        except ImportError:
            return False
        return shutting_down()


class LedgerView(Protocol):
    """What a step's context reads from the dispatcher executing it."""

    input: dict[str, Any]

    def history(self, before_entry: int) -> list[dict[str, Any]]: ...


class _StepView(Protocol):
    @property
    def id(self) -> str: ...


class EntryView(Protocol):
    """What a step's context reads of the entry being executed."""

    @property
    def step(self) -> _StepView: ...

    @property
    def entry_no(self) -> int: ...

    @property
    def outputs(self) -> dict[str, Any]: ...

    @property
    def children(self) -> list[dict[str, Any]] | None: ...


class StepContext:
    """What an action (and a step's ``next``) gets besides the run's input.

    Everything a one-function workflow's ``ctx`` had (``run_id``, ``tenant_id``,
    ``attempt``, ``cancelled``, ``shutting_down``), plus the step, the entry
    and the action being executed.
    """

    def __init__(self, run: RunContext, ledger: LedgerView, entry: EntryView):
        self._run = run
        self._ledger = ledger
        self._entry = entry
        self.position: int | None = None
        # Set for marker-bearing actions only: (run, step, entry, position).
        self.idempotency_key: str | None = None

    @property
    def run_id(self) -> uuid.UUID:
        return self._run.run_id

    @property
    def tenant_id(self) -> int:
        return self._run.tenant_id

    @property
    def attempt(self) -> int:
        return self._run.attempt

    @property
    def failures(self) -> int:
        return self._run.failures

    @property
    def workflow(self) -> registry.Workflow:
        return self._run.workflow

    @property
    def boot_id(self) -> uuid.UUID:
        return self._run.boot_id

    @property
    def cancelled(self) -> bool:
        return self._run.cancelled

    @property
    def shutting_down(self) -> bool:
        return self._run.shutting_down

    @property
    def input(self) -> dict[str, Any]:
        return self._ledger.input

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
        return [e for e in self._ledger.history(self._entry.entry_no)
                if step is None or e["step"] == step]
