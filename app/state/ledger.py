"""The step ledger's writes: entries, marker claims, fan-out links, joins.

Every write is fenced by the run's claim (``FENCE``: ``runs.claimed_by`` is one
of this process's boots, locked ``FOR SHARE`` in the statement), like every
other write a worker makes for a run it holds; a marker claim also requires
the claimer's boot to be live in the same statement (``LIVE``). Which actions
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

from sqlalchemy import Row, text
from sqlalchemy.orm import Session

from app.liveness import LIVE_BOOTS_SQL, claimer_live_sql

from .compose import ENDED, outbox_rows, send_woken, slot_release, to_json


class DeclaredAction(Protocol):
    position: int
    name: str
    marker: bool


class DeclaredStep(Protocol):
    """What the ledger needs of a step (``workers.registry.Step``)."""

    id: str
    actions: Sequence[DeclaredAction]


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
    error: dict | None
    next_step: str | None
    events: bool

    def without_outputs(self, error: dict) -> EntryClose:
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
    error: dict | None = None


# The fence of every ledger write: the run is held by one of this process's
# boots. FOR SHARE makes a takeover (an UPDATE of this row) wait for this
# transaction, or this statement see the takeover and write nothing.
FENCE = """
    run AS (SELECT id, tenant_id, cancel_requested FROM runs
             WHERE id = :run AND status = 'running' AND claimed_by = ANY(:boots) FOR SHARE)
"""
# The claimer's liveness, evaluated in the claim statement itself.
LIVE = f"live AS (SELECT {claimer_live_sql(':claimer')} AS ok)"

ENTRY_EVENT_FIELDS = ("jsonb_build_object('step', entry.step_id, 'entry', entry.entry_no, "
                 "'entry_id', entry.id)")

ENTER = text(f"""
    WITH {FENCE},
    entry AS (
        INSERT INTO step_entries (run_id, entry_no, step_id, status, actions)
        SELECT id, :entry_no, :step, 'running', CAST(:actions AS jsonb) FROM run
        RETURNING id, run_id, entry_no, step_id, children_total, children_done
    ),
    event AS ({outbox_rows("entry JOIN run ON run.id = entry.run_id", "'step.entered'",
                           ENTRY_EVENT_FIELDS, "CAST(:events AS boolean)", run_id="entry.run_id",
                           tenant_id="run.tenant_id")})
    SELECT entry.id, run.cancel_requested FROM entry JOIN run ON run.id = entry.run_id
""")

CLAIM_MARKER = text(f"""
    WITH {FENCE}, {LIVE},
    claimed AS (
        INSERT INTO step_markers (entry_id, position, run_id, claimed_by, status)
        SELECT :entry, :position, run.id, :claimer, 'claimed' FROM run, live WHERE live.ok
        ON CONFLICT (entry_id, position) DO NOTHING
        RETURNING claims
    )
    SELECT EXISTS (SELECT 1 FROM run) AS held, (SELECT ok FROM live) AS claimer_live,
           (SELECT claims FROM claimed) AS claims
""")

MARKER_STATE = text(f"""
    SELECT m.status, m.claimed_by, m.claims, m.result, m.error,
           EXISTS ({LIVE_BOOTS_SQL} WHERE b.boot_id = m.claimed_by) AS holder_live
      FROM step_markers m WHERE m.entry_id = :entry AND m.position = :position
""")

# Wreckage: the holder is dead (its lock is gone, and a dead boot never comes
# back). A compare-and-set on its id, so of two rescuers exactly one wins.
TAKE_OVER_MARKER = text(f"""
    WITH {FENCE}, {LIVE}
    UPDATE step_markers m SET claimed_by = :claimer, claims = m.claims + 1, claimed_at = now()
      FROM run, live
     WHERE m.entry_id = :entry AND m.position = :position AND m.status = 'claimed'
       AND m.claimed_by = :dead AND live.ok
    RETURNING m.claims
""")

_ACTION_FIELDS = ("jsonb_build_object('step', CAST(:step AS text), 'entry', CAST(:entry_no AS int), "
                  "'position', done.position, 'action', CAST(:name AS text), "
                  "'idempotency_key', CAST(:key AS text)) || "
                  "CASE WHEN done.error IS NULL THEN '{}'::jsonb "
                  "ELSE jsonb_build_object('error', done.error - 'traceback') END")


def _complete_marker_sql(spawned: bool) -> str:
    # A fan-out links its children to the entry (for the join) in the statement
    # that completes its marker, in the transaction that admitted them.
    link = f""",
    linked AS (
        INSERT INTO step_children (child_run_id, entry_id, position, ordinal, item_key)
        SELECT c.child, :entry, :position, c.ordinal, c.item_key
          FROM done, unnest(CAST(:children AS uuid[]), CAST(:ordinals AS int[]),
                            CAST(:item_keys AS text[])) AS c(child, ordinal, item_key)
        ON CONFLICT (child_run_id) DO NOTHING
        RETURNING child_run_id
    ),
    counted AS (
        UPDATE step_entries e
           SET children_total = e.children_total + (SELECT count(*) FROM linked),
               children_done = e.children_done + (
                   SELECT count(*) FROM linked l JOIN runs r ON r.id = l.child_run_id
                    WHERE r.status IN {ENDED})
         WHERE e.id = :entry AND EXISTS (SELECT 1 FROM done)
    )""" if spawned else ""
    return f"""
    WITH {FENCE},
    done AS (
        UPDATE step_markers m
           SET status = :status, result = CAST(:result AS jsonb), error = CAST(:error AS jsonb),
               finished_at = now()
          FROM run
         WHERE m.entry_id = :entry AND m.position = :position AND m.status = 'claimed'
           AND m.claimed_by = ANY(:boots)
        RETURNING m.position, m.error, run.id AS run_id, run.tenant_id
    ){link},
    event AS ({outbox_rows("done", "CAST(:event_type AS text)", _ACTION_FIELDS,
                           run_id="done.run_id")})
    SELECT count(*) AS completed FROM done
    """


COMPLETE_MARKER = text(_complete_marker_sql(spawned=False))
COMPLETE_SPAWN = text(_complete_marker_sql(spawned=True))

CLOSE_EVENT_FIELDS = (f"{ENTRY_EVENT_FIELDS} || jsonb_build_object('next_step', entry.next_step) || "
                 "CASE WHEN entry.error IS NULL THEN '{}'::jsonb "
                 "ELSE jsonb_build_object('error', entry.error - 'traceback') END")

CLOSE_ENTRY = text(f"""
    WITH {FENCE},
    entry AS (
        UPDATE step_entries e
           SET status = :status, actions = CAST(:actions AS jsonb),
               outputs = CAST(:outputs AS jsonb), error = CAST(:error AS jsonb),
               next_step = :next_step, finished_at = now()
          FROM run
         WHERE e.id = :entry AND e.status IN ('running', 'waiting')
        RETURNING e.id, e.run_id, e.entry_no, e.step_id, e.next_step, e.error, run.tenant_id,
                  run.cancel_requested
    ),
    event AS ({outbox_rows("entry", "CAST(:event_type AS text)", CLOSE_EVENT_FIELDS,
                           "CAST(:events AS boolean)", run_id="entry.run_id",
                           tenant_id="entry.tenant_id")})
    SELECT id, cancel_requested FROM entry
""")

# An entry that needed no row while it ran is written when it ends (its
# step.entered and step.<status> events in that order, in one INSERT).
INSERT_CLOSED = text(f"""
    WITH {FENCE},
    entry AS (
        INSERT INTO step_entries (run_id, entry_no, step_id, status, actions, outputs, error,
                                  next_step, finished_at)
        SELECT id, :entry_no, :step, :status, CAST(:actions AS jsonb), CAST(:outputs AS jsonb),
               CAST(:error AS jsonb), :next_step, now()
          FROM run
        RETURNING id, run_id, entry_no, step_id, next_step, error
    ),
    event AS ({outbox_rows(
        "entry JOIN run ON run.id = entry.run_id, (VALUES (1, 'step.entered'), "
        "(2, CAST(:event_type AS text))) AS t(ord, type)", "t.type",
        f"CASE t.ord WHEN 1 THEN {ENTRY_EVENT_FIELDS} ELSE {CLOSE_EVENT_FIELDS} END",
        "CAST(:events AS boolean)", run_id="entry.run_id", tenant_id="run.tenant_id",
        order_by="t.ord")})
    SELECT entry.id, run.cancel_requested FROM entry JOIN run ON run.id = entry.run_id
""")

# A join releases its worker: the entry waits (only while some child is still
# running: its counters are on this row, which every child's end locks too,
# see compose.JOIN_RELEASE) and the run becomes 'waiting', unclaimed.
WAIT = text(f"""
    WITH entry AS (
        UPDATE step_entries e
           SET status = 'waiting', actions = CAST(:actions AS jsonb),
               outputs = CAST(:outputs AS jsonb)
         WHERE e.id = :entry AND e.status = 'running' AND e.children_done < e.children_total
           AND EXISTS (SELECT 1 FROM runs WHERE id = :run AND claimed_by = ANY(:boots))
        RETURNING e.id, e.run_id, e.entry_no, e.step_id, e.children_total, e.children_done
    ),
    waited AS (
        UPDATE runs r SET status = 'waiting', wait_reason = 'join', claimed_by = NULL,
               updated_at = now()
          FROM entry
         WHERE r.id = entry.run_id AND r.status = 'running' AND r.claimed_by = ANY(:boots)
        RETURNING r.id, r.tenant_id, r.attempt, r.workflow_name, r.concurrency_key,
                  r.concurrency_limit, entry.step_id, entry.entry_no, entry.children_total,
                  entry.children_done
    ),
    event AS ({outbox_rows("waited", "'run.waiting'",
                           "jsonb_build_object('attempt', attempt, 'reason', 'join', "
                           "'step', step_id, 'entry', entry_no, 'children', children_total, "
                           "'children_done', children_done)")}){slot_release("waited")}
    SELECT (SELECT count(*) FROM entry) AS entry_waits, (SELECT count(*) FROM waited) AS run_waits,
           (SELECT coalesce(jsonb_agg(jsonb_build_object(
                   'id', w.id, 'ref', w.workflow_name || '@' || w.workflow_version,
                   'traceparent', w.traceparent, 'tracestate', w.tracestate)), '[]'::jsonb)
              FROM slot_woken w) AS woken
""")

CHILDREN = text("""
    SELECT c.child_run_id, c.position, c.item_key, r.status, r.result, r.error, r.dispatch_key
      FROM step_children c JOIN runs r ON r.id = c.child_run_id
     WHERE c.entry_id = :entry
     ORDER BY c.position, c.ordinal
""")

HISTORY = text("""
    SELECT id, entry_no, step_id, status, outputs, next_step
      FROM step_entries WHERE run_id = :run AND entry_no < :entry_no ORDER BY entry_no
""")


# -- ledger writes (each in the caller's transaction) -------------------------------------------

def declared_actions(step: DeclaredStep) -> list[dict[str, Any]]:
    """The actions record of an entry just entered: each declared action, pending."""
    return [{"position": a.position, "name": a.name, "marker": a.marker, "status": "pending"}
            for a in step.actions]


def enter_step(session: Session, run_id: uuid.UUID, ours: list[uuid.UUID], step: DeclaredStep,
               entry_no: int, *, events: bool = True) -> Row | None:
    """Append entry ``entry_no`` into ``step`` (fenced); None if the run is not ours."""
    return session.execute(ENTER, {
        "run": run_id, "boots": ours, "entry_no": entry_no, "step": step.id,
        "actions": to_json(declared_actions(step)), "events": events,
    }).one_or_none()


def claim_marker(session: Session, run_id: uuid.UUID, ours: list[uuid.UUID], entry_id: int,
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


def finish_marker(session: Session, run_id: uuid.UUID, ours: list[uuid.UUID], entry_id: int,
                  position: int, *, step_id: str, entry_no: int, name: str, key: str,
                  result: Any = None, error: dict | None = None,
                  children: list[tuple[uuid.UUID, int, str]] | None = None) -> bool:
    """Complete (or, with ``error``, fail) a marker this process holds; False if it does not.

    ``children``: (child run id, ordinal, item key) a fan-out admitted in this
    transaction, linked to the entry in the same statement.
    """
    status = "failed" if error is not None else "completed"
    params = {"run": run_id, "boots": ours, "entry": entry_id, "position": position,
              "status": status, "result": to_json(result), "error": to_json(error),
              "event_type": f"action.{status}", "step": step_id, "entry_no": entry_no,
              "name": name, "key": key}
    statement = COMPLETE_MARKER
    if children is not None:
        statement = COMPLETE_SPAWN
        params.update(children=[c[0] for c in children], ordinals=[c[1] for c in children],
                      item_keys=[c[2] for c in children])
    return session.execute(statement, params).scalar_one() == 1


def marker_state(session: Session, entry_id: int, position: int) -> Row | None:
    return session.execute(MARKER_STATE, {"entry": entry_id, "position": position}
                           ).one_or_none()


def close_entry(session: Session, run_id: uuid.UUID, ours: list[uuid.UUID],
                close: EntryClose) -> Row | None:
    """End an entry (fenced) with its actions' outcomes; None if the run is not ours.

    An entry that needed no row while it ran (``entry_id`` None) is written now,
    with its ``step.entered`` and ``step.<status>`` events in that order.
    """
    params = {"run": run_id, "boots": ours, "status": close.status,
              "actions": to_json(close.actions), "outputs": to_json(close.outputs),
              "error": to_json(close.error), "next_step": close.next_step,
              "events": close.events, "event_type": f"step.{close.status}"}
    if close.entry_id is None:
        return session.execute(INSERT_CLOSED, {**params, "entry_no": close.entry_no,
                                               "step": close.step_id}).one_or_none()
    return session.execute(CLOSE_ENTRY, {**params, "entry": close.entry_id}).one_or_none()


def wait_for_children(session: Session, run_id: uuid.UUID, ours: list[uuid.UUID], *,
                      entry_id: int, actions: list[dict[str, Any]], outputs: Any) -> Row:
    """Let the run wait for entry ``entry_id``'s children, releasing its worker (fenced).

    In a transaction after ``runs.lock_slots`` when the run holds a slot (the
    fence does it). Returns ``entry_waits`` / ``run_waits`` counts: both 0 when every child has
    already ended (nothing to wait for); an entry that would wait for a run that
    is not ours has ``entry_waits`` without ``run_waits`` (the caller rolls back).
    """
    row = session.execute(WAIT, {"run": run_id, "boots": ours, "entry": entry_id,
                                 "actions": to_json(actions), "outputs": to_json(outputs)}).one()
    # A run of a limited group that waits for its children gives its slot up:
    # the next run waiting for it is sent once this commits.
    send_woken(session, row)
    return row


def children(session: Session, entry_id: int) -> list[Row]:
    """The child runs entry ``entry_id`` spawned, in position and item order."""
    return session.execute(CHILDREN, {"entry": entry_id}).all()


def history(session: Session, run_id: uuid.UUID, before_entry: int) -> list[Row]:
    """The run's entries numbered below ``before_entry``, oldest first."""
    return session.execute(HISTORY, {"run": run_id, "entry_no": before_entry}).all()
