"""How a transition asks for a send, and the values its statements take and return.

The statements themselves are in ``app/state/sql/*.sql``; ``sql/README.md`` describes
the parts many of them share (the event, the join release, the slot release). A
statement that re-queues runs returns them (``woken``): ``send_woken`` asks for their
sends, which go once the transaction commits (``Executor.pending``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .executor import Executor, PendingSends, Send

# json.dumps(value, default=str) made once: json.dumps with an argument makes an encoder
# per call, more than half of a small value's CPU.
_ENCODE = json.JSONEncoder(default=str).encode


def to_json(value: Any) -> str | None:
    """A parameter for a ``jsonb`` column: ``value`` as JSON (what it cannot write, as its
    ``str``), None as SQL NULL."""
    return None if value is None else _ENCODE(value)


@dataclass(frozen=True)
class RunToSend:
    """A run a statement marked sent (repair), or re-queued: what its message needs."""

    id: uuid.UUID
    workflow_name: str
    workflow_version: str
    traceparent: str | None
    tracestate: str | None
    attempt: int
    parent_run_id: uuid.UUID | None
    root_run_id: uuid.UUID | None


# A woken parent or slot waiter as a statement's ``woken`` column lists it (jsonb objects:
# ``id``, ``ref``, the trace context, ``attempt``, ``parent_run_id``, ``root_run_id``).
Woken = Sequence[Mapping[str, Any]]


def send_after_commit(executor: Executor, run_id: uuid.UUID, workflow_ref: str,
                      traceparent: str | None = None, tracestate: str | None = None,
                      retries: int = 0, parent_id: str | None = None,
                      root_id: str | None = None) -> None:
    """Send ``run_id`` to the workers once ``executor``'s work commits; its message
    carries the run's W3C Trace Context (``traceparent``, ``tracestate``) as headers, and
    Celery's ``retries``, ``parent_id`` and ``root_id`` (None: the run itself) of the run."""
    executor.pending.add(run_id, Send(workflow_ref, traceparent, tracestate, retries,
                                      parent_id, root_id))


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


def send_row_after_commit(executor: Executor, row: Any) -> None:
    """``send_after_commit`` of the run ``row`` (its id, ref, trace context and tree)."""
    send_after_commit(executor, row.id, f"{row.workflow_name}@{row.workflow_version}",
                      row.traceparent, row.tracestate, *tree_of(row))


def send_woken(executor: Executor, woken: Woken | None) -> None:
    """Send the parents a run's end re-queued (a statement's ``woken`` column) once
    ``executor``'s work commits."""
    add_woken(executor.pending, woken)


def add_woken(pending: PendingSends, woken: Woken | None) -> None:
    """Add the runs of a statement's ``woken`` column to ``pending``."""
    for parent in woken or ():
        pending.add(uuid.UUID(parent["id"]), Send(
            parent["ref"], parent.get("traceparent"), parent.get("tracestate"),
            parent.get("attempt") or 0, parent.get("parent_run_id"),
            parent.get("root_run_id") or parent.get("parent_run_id")))


def woken_of(row: Any) -> Woken | None:
    """The ``woken`` column of ``row`` (None: no row)."""
    return None if row is None else row.woken
