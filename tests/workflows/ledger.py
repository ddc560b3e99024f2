"""Workflows of steps used by the ledger's tests.

Loaded by the tests that use them (``import tests.workflows.ledger``) and by
their workers through ``POIMEN_WORKFLOW_MODULES=tests.workflows,tests.workflows.ledger``.
"""

from __future__ import annotations

import os

from celery import shared_task

from tests.workflows import record_effect
from workers.registry import Step, Workflow, action, emit, register, spawn_each, task

MODULES = "tests.workflows,tests.workflows.ledger"


def _probe(kind: str):
    """A test action: one side-effect row per execution, of kind ``kind``."""
    def probe(ctx, input):
        record_effect(ctx.run_id, kind)
        return {"kind": kind, "key": ctx.idempotency_key}
    probe.__name__ = probe.__qualname__ = f"probe_{kind}"
    return probe


# Three positions: marker, marker, plain. A lost claim at 0 must leave 5 and 9 unexecuted.
register(Workflow("ledger-probe", "1", steps=[
    Step("work", actions=[
        action(_probe("pos0"), position=0, marker=True, name="first"),
        action(_probe("pos5"), position=5, marker=True, name="second"),
        action(_probe("pos9"), position=9, name="third"),
    ]),
]))


def shifting_definition(moved: bool) -> Workflow:
    """``shifting@1``; ``moved=True`` is the same version with the marker's position moved."""
    return Workflow("shifting", "1", steps=[
        Step("work", actions=[
            action(_probe("marker"), position=1 if moved else 0, marker=True, name="marker"),
            action(_probe("plain"), position=0 if moved else 1, name="plain"),
        ]),
    ])


register(shifting_definition(moved=False))


def crash_once(ctx, kind: str) -> None:
    """Kill this worker process the first time ``kind`` happens for the run (OOM, segfault)."""
    from sqlalchemy import text

    from app.extensions import db

    with db.engine.connect() as conn:
        crashed = conn.execute(text("SELECT count(*) FROM side_effects WHERE run_id = :r "
                                    "AND kind = :k"), {"r": ctx.run_id, "k": kind}).scalar()
    if not crashed:
        record_effect(ctx.run_id, kind)
        os._exit(1)


def _crashy_child_input(ctx, participant):
    # Inside the fan-out: its marker is claimed, its children not yet admitted.
    if ctx.input.get("crash") == "mid_fanout" and participant == ctx.input["participants"][-1]:
        crash_once(ctx, "mid_fanout")
    return {"participant": participant, "round": ctx.visit, "reject_rounds": 0}


def _clear_counted(ctx, input):
    record_effect(ctx.run_id, "clear_decisions")
    return {"cleared": ctx.idempotency_key}


def _after_fanout(ctx, input):
    # After the fan-out's marker completed, before the entry finished.
    if input.get("crash") == "after_fanout":
        crash_once(ctx, "after_fanout")
    return {"seen": sorted(ctx.outputs)}


# doc-review's review step with a worker crash in it: "after_fanout" or "mid_fanout".
register(Workflow("doc-review-crashy", "1", steps=[
    Step("review", join=True, actions=[
        action(_clear_counted, position=0, marker=True, name="clear_decisions"),
        spawn_each("review-participant@1", over="input.participants", key=str,
                   input=_crashy_child_input, position=2),
        action(_after_fanout, position=3, name="after_fanout"),
    ]),
]))


# A Celery task teams already have, reused as an action through its own function.
@shared_task(name="tests.greet")
def greet(name: str, punctuation: str = "!") -> dict:
    return {"greeting": f"hello {name}{punctuation}"}


def _greeting(ctx, input):
    return ctx.history("greet")[0]["outputs"]["tests.greet"]


register(Workflow("greeter", "1", steps=[
    Step("greet", actions=[task("tests.greet", position=0,
                                kwargs=lambda ctx, input: {"name": input["name"]})],
         next="announce"),
    Step("announce", actions=[
        emit("greeting.sent", lambda ctx, input: {"to": input["name"]}, position=0),
        action(_greeting, position=1, name="result"),
    ]),
]))
