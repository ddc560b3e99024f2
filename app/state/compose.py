"""How a transition asks for a send, and the values its statements take and return.

The statements themselves are in ``app/state/sql/*.sql``; ``sql/README.md`` describes
the parts many of them share (the event, the join release, the slot release). A
statement that re-queues runs returns them (``woken``): ``send_woken`` sends them once
the transaction commits.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from sqlalchemy import Row
from sqlalchemy.orm import Session

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
