"""Built-in example workflows: useful for smoke tests, demos and benchmarks.

``doc-review`` (with its child ``review-participant``) shows a workflow of
steps: a marker-bearing action, a fan-out, a join and a loop back.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from .registry import Step, Workflow, action, register, spawn_each, workflow

if TYPE_CHECKING:  # the web process loads these definitions: nothing of the execution
    from .context import StepContext


@workflow("echo", version="1")
def echo(ctx: StepContext, input: dict[str, Any]) -> dict[str, Any]:
    """Return the input unchanged."""
    return input


@workflow("noop", version="1")
def noop(ctx: StepContext, input: dict[str, Any]) -> None:
    """Do nothing (the benchmark workflow)."""
    return None


@workflow("sleep", version="1")
def sleep(ctx: StepContext, input: dict[str, Any]) -> dict[str, Any]:
    """Sleep ``input["seconds"]`` in small slices, stopping early when cancelled."""
    seconds = float(input.get("seconds", 1))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if ctx.cancelled:
            return {"slept": seconds - (deadline - time.monotonic()), "cancelled": True}
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
    return {"slept": seconds}


class ExampleFailure(RuntimeError):
    pass


@workflow("fail", version="1", max_attempts=1)
def fail(ctx: StepContext, input: dict[str, Any]) -> None:
    """Raise, to show how a failed run looks."""
    raise ExampleFailure(input.get("message", "this workflow always fails"))


# -- doc-review: a workflow of steps, with a fan-out and a join ---------------------------------
#
# draft -> review -> approve. `review` clears the previous round's decisions
# (marker-bearing: in a real system an effect outside the run), makes sure
# every participant has a seat (not marker-bearing: idempotent, may re-run),
# and fans out one `review-participant` child per participant, keyed by the
# participant, then waits for them all (join). Any rejection sends the
# document back to `draft`, and then to `review` again: a new entry, so new
# children with new dispatch keys.
#
# Input: {"participants": ["ana", "bo"], "reject_rounds": 0,
#         "fail": null | "clear_decisions" | "ensure_participant_seat"}
# Participants reject while the review round is <= reject_rounds.


def _draft(ctx: StepContext, input: dict[str, Any]) -> dict[str, Any]:
    return {"revision": ctx.visit}


def _clear_decisions(ctx: StepContext, input: dict[str, Any]) -> dict[str, Any]:
    if input.get("fail") == "clear_decisions":
        raise ExampleFailure("clear_decisions failed (input.fail)")
    # ctx.idempotency_key names this entry's clearing: an external store would
    # key the clearing by it, so a takeover that repeats it changes nothing.
    return {"cleared": ctx.idempotency_key}


def _ensure_participant_seat(ctx: StepContext, input: dict[str, Any]) -> dict[str, Any]:
    if input.get("fail") == "ensure_participant_seat":
        raise ExampleFailure("ensure_participant_seat failed (input.fail)")
    return {"seats": sorted(_participant_key(p) for p in input.get("participants", []))}


def _participant_key(participant: str | dict[str, Any]) -> str:
    return participant if isinstance(participant, str) else str(participant["id"])


def _participant_input(ctx: StepContext, participant: str | dict[str, Any]
                       ) -> dict[str, Any]:
    return {"participant": _participant_key(participant), "round": ctx.visit,
            "reject_rounds": int(ctx.input.get("reject_rounds", 0))}


def _after_review(ctx: StepContext) -> str:
    rejected = [c for c in ctx.children
                if c["status"] != "succeeded" or (c["result"] or {}).get("decision") != "approve"]
    return "draft" if rejected else "approve"


def _approve(ctx: StepContext, input: dict[str, Any]) -> dict[str, Any]:
    rounds = []
    for number, entry in enumerate(ctx.history("review"), start=1):
        rounds.append({"round": number, "decisions": {
            child["key"]: (child["result"] or {}).get("decision", child["status"])
            for child in entry["outputs"].get("children", [])}})
    return {"approved": True, "rounds": rounds}


register(Workflow("doc-review", "1", steps=[
    Step("draft", actions=[action(_draft, position=0, name="draft")], next="review"),
    Step("review", join=True, next=_after_review, actions=[
        action(_clear_decisions, position=0, marker=True, name="clear_decisions"),
        action(_ensure_participant_seat, position=1, name="ensure_participant_seat"),
        spawn_each("review-participant@1", over="input.participants", key=_participant_key,
                   input=_participant_input, position=2),
    ]),
    Step("approve", actions=[action(_approve, position=0, name="approve")]),
]))


@workflow("review-participant", version="1")
def review_participant(ctx: StepContext, input: dict[str, Any]) -> dict[str, Any]:
    """One participant's decision: reject while the round is <= reject_rounds."""
    decision = "reject" if input["round"] <= input.get("reject_rounds", 0) else "approve"
    return {"participant": input["participant"], "round": input["round"], "decision": decision}
