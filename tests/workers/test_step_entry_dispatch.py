"""The step-entry ledger: one dispatcher, marker claims, the stop rule, fan-out keys, joins.

Real Postgres and Redis throughout. Most tests execute runs in this process
(``execute_run``, exactly what a worker's task does), which keeps the Celery
queue untouched by any consumer: what the runs enqueue is still there to be
counted. Where a worker must die, real ``celery worker`` processes run them.
"""

from __future__ import annotations

import uuid
from collections import Counter

import pytest

import tests.workflows.ledger  # noqa: F401 - registers the ledger's test workflows
from app.state.executor import on_session
from tests.processes import start_beat, start_worker, wait_until
from workers.actions import fanout_key, idempotency_key
from workers.registry import max_takeovers_of

from .conftest import close_for_good, dead_boots_long_gone, long_gone

PARTICIPANTS = ["ana", "bo", "cy"]


# -- helpers -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def app(database_url):
    """The app, with a Celery queue of this module's own.

    These tests count what runs enqueue; a worker some other test left running
    on the session's queue must not be able to take it. The real workers here
    are started on this queue too (``worker_env``).
    """
    import os

    from celery import _state

    from app import create_app
    from app.extensions import db

    previous = _state.default_app
    session_queue = os.environ["POIMEN_QUEUE"]
    os.environ["POIMEN_QUEUE"] = f"{session_queue}-ledger"
    try:
        flask_app = create_app()
    finally:
        os.environ["POIMEN_QUEUE"] = session_queue
    flask_app.config["TESTING"] = True
    yield flask_app
    with flask_app.app_context():
        db.engine.dispose()
    if previous is not None:
        previous.set_default()


@pytest.fixture
def queue_name(app) -> str:
    return app.extensions["celery"].conf.task_default_queue

@pytest.fixture
def run_here(app, fresh_boot):
    """Execute a run in this process, as the worker's task does; return the claim outcome."""
    from workers.execution import execute_run

    def execute(run_id) -> str:
        with app.app_context():
            return execute_run(str(run_id)).outcome.value

    return execute


def run_row(pg, run_id):
    return pg.execute("SELECT status, result, error, attempt FROM runs WHERE id = %s",
                      [run_id]).fetchone()


def children_of(pg, parent) -> list[tuple]:
    """(id, dispatch_key, status, origin, goal_id) of ``parent``'s children, oldest first."""
    return pg.execute("SELECT id, dispatch_key, status, origin, goal_id FROM runs "
                      "WHERE parent_run_id = %s ORDER BY created_at, dispatch_key",
                      [parent]).fetchall()


def entries_of(pg, run_id) -> list[tuple]:
    return pg.execute("SELECT entry_no, step_id, status, id FROM step_entries WHERE run_id = %s "
                      "ORDER BY entry_no", [run_id]).fetchall()


def markers_of(pg, run_id) -> dict[tuple[int, int], tuple]:
    """(entry_no, position) -> (status, claims, claimed_by)."""
    return {(r[0], r[1]): r[2:] for r in pg.execute(
        "SELECT e.entry_no, m.position, m.status, m.claims, m.claimed_by FROM step_markers m "
        "JOIN step_entries e ON e.id = m.entry_id WHERE m.run_id = %s", [run_id])}


def events_of(pg, run_id) -> list[str]:
    return [r[0] for r in pg.execute(
        "SELECT event_type FROM outbox WHERE run_id = %s ORDER BY id", [run_id])]


def expected_keys(run_id, entry_no: int, items, step="review", position=2) -> list[str]:
    return [fanout_key(idempotency_key(run_id, step, entry_no, position), item)
            for item in items]


def drive(run_here, pg, parent, limit: int = 50) -> None:
    """Execute ``parent`` and its descendants in this process until nothing is left to do."""
    for _ in range(limit):
        pending = pg.execute(
            "WITH RECURSIVE tree AS (SELECT id FROM runs WHERE id = %s UNION ALL "
            "SELECT r.id FROM runs r JOIN tree t ON r.parent_run_id = t.id) "
            "SELECT r.id FROM runs r JOIN tree USING (id) WHERE r.status = 'queued' "
            "ORDER BY r.created_at", [parent]).fetchall()
        if not pending:
            return
        for (run_id,) in pending:
            run_here(run_id)
    raise AssertionError("runs still queued after many executions")


# -- one arrival at review enqueues exactly one fan-out --------------------------------------

def test_one_arrival_at_review_enqueues_exactly_one_fanout(admit, run_here, queue, pg):
    parent = admit("doc-review", {"participants": PARTICIPANTS})
    assert queue() == [str(parent)]

    assert run_here(parent) == "claimed"
    # draft, then review: two markers and the fan-out, then the join releases the worker.
    assert run_row(pg, parent)[0] == "waiting"
    children = children_of(pg, parent)
    assert len(children) == len(PARTICIPANTS)
    assert [c[1] for c in children] == expected_keys(parent, 2, PARTICIPANTS)
    assert {c[3] for c in children} == {"fanout"}
    assert queue() == [str(parent), *(str(c[0]) for c in children)]

    for child_id, *_ in children[:-1]:
        assert run_here(child_id) == "claimed"
        assert run_row(pg, parent)[0] == "waiting"  # not the last child: nothing re-queued
    assert run_here(children[-1][0]) == "claimed"
    assert run_row(pg, parent)[0] == "queued"  # the last child's finish re-queued it
    assert run_here(parent) == "claimed"

    status, result, error, _ = run_row(pg, parent)
    assert status == "succeeded", error
    assert result == {"approved": True, "rounds": [
        {"round": 1, "decisions": dict.fromkeys(PARTICIPANTS, "approve")}]}
    # Exactly: the parent's admission, one message per child, one re-queue by the join.
    assert Counter(queue()) == Counter([str(parent), str(parent),
                                        *(str(c[0]) for c in children)])
    assert pg.execute("SELECT count(*) FROM runs WHERE status NOT IN "
                      "('succeeded', 'failed', 'cancelled')").fetchone()[0] == 0
    assert len(children_of(pg, parent)) == len(PARTICIPANTS)
    assert markers_of(pg, parent) == {
        (2, 0): ("completed", 1, markers_of(pg, parent)[(2, 0)][2]),
        (2, 2): ("completed", 1, markers_of(pg, parent)[(2, 2)][2]),
    }
    assert [e[:3] for e in entries_of(pg, parent)] == [
        (1, "draft", "completed"), (2, "review", "completed"), (3, "approve", "completed")]
    assert events_of(pg, parent) == [
        "run.admitted", "run.started", "step.entered", "step.completed", "step.entered",
        "action.completed", "action.completed", "run.waiting", "run.joined", "run.started",
        "step.completed", "step.entered", "step.completed", "run.succeeded"]


# -- the stop rule ----------------------------------------------------------------------------

def test_a_failed_marker_at_position_0_leaves_the_fanout_enqueuing_nothing(admit, run_here,
                                                                          queue, pg):
    parent = admit("doc-review", {"participants": PARTICIPANTS, "fail": "clear_decisions"})
    assert run_here(parent) == "claimed"

    # Nothing fanned out: no child row, and nothing but its own admission in the queue.
    assert children_of(pg, parent) == []
    assert queue() == [str(parent)]
    status, _, error, _ = run_row(pg, parent)
    assert status == "failed"
    assert (error["code"], error["step"], error["position"]) == ("action_failed", "review", 0)
    assert set(markers_of(pg, parent)) == {(2, 0)}  # position 2 was never claimed
    review = pg.execute("SELECT status, actions FROM step_entries WHERE run_id = %s AND "
                        "step_id = 'review'", [parent]).fetchone()
    assert review[0] == "failed"
    assert [(a["position"], a["status"]) for a in review[1]] == [
        (0, "failed"), (1, "abandoned"), (2, "abandoned")]


def test_a_failed_plain_action_at_position_1_still_lets_the_fanout_run(admit, run_here, queue,
                                                                       pg):
    parent = admit("doc-review", {"participants": PARTICIPANTS,
                                  "fail": "ensure_participant_seat"})
    drive(run_here, pg, parent)

    assert run_row(pg, parent)[0] == "succeeded"
    children = children_of(pg, parent)
    assert [c[1] for c in children] == expected_keys(parent, 2, PARTICIPANTS)
    assert {str(c[0]) for c in children} <= set(queue())
    review = pg.execute("SELECT status, actions FROM step_entries WHERE run_id = %s AND "
                        "step_id = 'review'", [parent]).fetchone()
    assert [(a["position"], a["status"]) for a in review[1]] == [
        (0, "completed"), (1, "failed"), (2, "completed")]
    assert review[1][1]["error"]["message"] == "ensure_participant_seat failed (input.fail)"


# -- a marker held by a live boot elsewhere is a lost claim ----------------------------------

def hold_marker(app, run_id, boot, position: int, *, complete: bool = False) -> int:
    """As ``boot``: claim ``run_id``, enter its first step, claim the marker at ``position``."""
    from app.extensions import db
    from app.state.claims import ClaimOutcome, claim_run
    from app.state.ledger import MarkerOutcome, claim_marker, enter_step, finish_marker
    from workers import registry

    with app.app_context():
        session = db.session
        claim = claim_run(on_session(session), run_id, boot, max_takeovers=max_takeovers_of)
        assert claim.outcome == ClaimOutcome.CLAIMED
        session.commit()
        wf = registry.get(claim.run.workflow_name, claim.run.workflow_version)
        entry = enter_step(on_session(session), run_id, [boot], wf.first_step, 1)
        assert claim_marker(on_session(session), run_id, [boot], entry.id, position, boot).outcome \
            == MarkerOutcome.CLAIMED
        if complete:
            assert finish_marker(on_session(session), run_id, [boot], entry.id, position,
                                 step_id="work",
                                 entry_no=1, name="x", key="k", result={"done": True})
        session.commit()
        return entry.id


def test_a_marker_held_by_a_live_boot_elsewhere_abandons_the_rest_of_the_entry(
        app, admit, boot_factory, run_here, side_effects, pg):
    from app.extensions import db
    from app.state.claims import release_claim

    run_id, elsewhere = admit("ledger-probe"), boot_factory()
    hold_marker(app, run_id, elsewhere.boot_id, 0)
    with app.app_context():  # the run goes back to the queue; the marker stays claimed
        assert release_claim(on_session(db.session), run_id, elsewhere.boot_id)
        db.session.commit()

    assert run_here(run_id) == "claimed"
    status, _, error, _ = run_row(pg, run_id)
    assert status == "failed"
    assert (error["code"], error["position"]) == ("marker_claim_lost", 0)
    assert side_effects(run_id) == 0  # positions 0, 5 and 9: none executed
    assert markers_of(pg, run_id) == {(1, 0): ("claimed", 1, elsewhere.boot_id)}
    actions = pg.execute("SELECT status, actions FROM step_entries WHERE run_id = %s",
                         [run_id]).fetchone()
    assert actions[0] == "abandoned"
    assert [(a["position"], a["status"]) for a in actions[1]] == [
        (0, "lost"), (5, "abandoned"), (9, "abandoned")]


# -- a definition changed under an in-flight run ----------------------------------------------

def test_a_definition_changed_under_an_inflight_run_is_refused_before_any_effect(
        app, admit, boot_factory, run_here, side_effects, pg):
    from tests.workflows.ledger import shifting_definition
    from workers import registry

    run_id, first = admit("shifting@1"), boot_factory()
    pinned = pg.execute("SELECT definition_hash FROM runs WHERE id = %s", [run_id]).fetchone()[0]
    assert pinned == registry.get("shifting", "1").definition_hash
    hold_marker(app, run_id, first.boot_id, 0, complete=True)  # in flight: marker 0 done
    first.close()  # ... and its worker dies, long ago
    long_gone(pg, first.boot_id)

    registry.register(shifting_definition(moved=True))  # same version, marker moved to 1
    try:
        assert registry.get("shifting", "1").definition_hash != pinned
        assert run_here(run_id) == "taken_over"
    finally:
        registry.register(shifting_definition(moved=False))

    status, _, error, _ = run_row(pg, run_id)
    assert status == "failed" and error["code"] == "definition_changed"
    assert side_effects(run_id) == 0
    assert markers_of(pg, run_id) == {(1, 0): ("completed", 1, first.boot_id)}


# -- deterministic witnesses of the marker rules -----------------------------------------------

@pytest.fixture
def two_sessions(app):
    """Two independent sessions on their own connections (no workers, no scheduling)."""
    from sqlalchemy.orm import Session

    from app.extensions import db

    with app.app_context():
        first, second = Session(db.engine), Session(db.engine)
        yield first, second
        first.close()
        second.close()


@pytest.fixture
def entry_held_by(app, admit):
    """A ledger-probe run held by a boot, with its entry written; return (run id, entry id)."""
    from app.extensions import db
    from app.state.claims import claim_run
    from app.state.ledger import enter_step
    from workers import registry

    def make(boot) -> tuple[uuid.UUID, int]:
        run_id = admit("ledger-probe")
        with app.app_context():
            claim_run(on_session(db.session), run_id, boot, max_takeovers=max_takeovers_of)
            entry = enter_step(on_session(db.session), run_id, [boot],
                               registry.get("ledger-probe", "1").first_step, 1)
            db.session.commit()
            return run_id, entry.id

    return make


def claim(session, run_id, ours, entry_id, position, claimer, **kwargs):
    from app.state.ledger import claim_marker

    result = claim_marker(on_session(session), run_id, ours, entry_id, position, claimer, **kwargs)
    session.commit()
    return result


def test_witness_a_same_boot_marker_claim_is_a_duplicate(two_sessions, boot_factory,
                                                        entry_held_by, pg):
    from app.state.ledger import MarkerOutcome

    first, second = two_sessions
    boot = boot_factory().boot_id
    run_id, entry = entry_held_by(boot)
    assert claim(first, run_id, [boot], entry, 0, boot).outcome == MarkerOutcome.CLAIMED
    again = claim(second, run_id, [boot], entry, 0, boot)
    assert again.outcome == MarkerOutcome.DUPLICATE and not again.outcome.execute
    assert markers_of(pg, run_id) == {(1, 0): ("claimed", 1, boot)}
    # ... unless the claimer is retrying its own claim whose commit reply was lost.
    assert claim(second, run_id, [boot], entry, 0, boot, retrying=True).outcome \
        == MarkerOutcome.CLAIMED


def test_witness_a_marker_held_by_another_live_boot_is_held(two_sessions, boot_factory,
                                                            entry_held_by, pg):
    from app.state.ledger import MarkerOutcome

    first, second = two_sessions
    holder, other = boot_factory().boot_id, boot_factory().boot_id
    run_id, entry = entry_held_by(holder)
    assert claim(first, run_id, [holder], entry, 0, holder).outcome == MarkerOutcome.CLAIMED
    lost = claim(second, run_id, [holder, other], entry, 0, other)
    assert lost.outcome == MarkerOutcome.HELD and lost.holder == holder
    assert markers_of(pg, run_id) == {(1, 0): ("claimed", 1, holder)}


def test_witness_a_dead_boots_marker_is_taken_over_by_compare_and_set(
        two_sessions, boot_factory, entry_held_by, pg):
    from app.state.ledger import TAKE_OVER_MARKER, MarkerOutcome

    first, second = two_sessions
    dead = boot_factory()
    run_id, entry = entry_held_by(dead.boot_id)
    assert claim(first, run_id, [dead.boot_id], entry, 0, dead.boot_id).outcome \
        == MarkerOutcome.CLAIMED
    close_for_good(pg, dead)  # its lock is gone: the claim is wreckage
    rescuer, late = boot_factory().boot_id, boot_factory().boot_id
    pg.execute("UPDATE runs SET claimed_by = %s WHERE id = %s", [rescuer, run_id])  # took run

    taken = claim(first, run_id, [rescuer], entry, 0, rescuer)
    assert (taken.outcome, taken.claims, taken.holder) == (MarkerOutcome.TAKEN_OVER, 2,
                                                           dead.boot_id)
    # A second rescuer that also saw the dead holder: its compare-and-set on the
    # dead id changes nothing now.
    stale = second.execute(TAKE_OVER_MARKER, {
        "run": run_id, "boots": [rescuer, late], "entry": entry, "position": 0,
        "claimer": late, "dead": dead.boot_id}).all()
    second.commit()
    assert stale == []
    assert markers_of(pg, run_id) == {(1, 0): ("claimed", 2, rescuer)}


def test_witness_a_completed_marker_is_skipped_and_a_failed_one_stops(
        two_sessions, boot_factory, entry_held_by, pg):
    from app.state.ledger import MarkerOutcome, finish_marker

    first, second = two_sessions
    boot = boot_factory().boot_id
    run_id, entry = entry_held_by(boot)
    for position, result, error in ((0, {"n": 1}, None), (5, None, {"message": "boom"})):
        assert claim(first, run_id, [boot], entry, position, boot).outcome \
            == MarkerOutcome.CLAIMED
        assert finish_marker(on_session(first), run_id, [boot], entry, position, step_id="work",
                             entry_no=1, name="x", key="k", result=result, error=error)
        first.commit()
    later = boot_factory().boot_id  # a later execution, after a takeover
    pg.execute("UPDATE runs SET claimed_by = %s WHERE id = %s", [later, run_id])
    done = claim(second, run_id, [later], entry, 0, later)
    assert (done.outcome, done.result) == (MarkerOutcome.COMPLETED, {"n": 1})
    assert not done.outcome.execute
    failed = claim(second, run_id, [later], entry, 5, later)
    assert (failed.outcome, failed.error) == (MarkerOutcome.FAILED, {"message": "boom"})
    assert {k: v[:2] for k, v in markers_of(pg, run_id).items()} == {
        (1, 0): ("completed", 1), (1, 5): ("failed", 1)}


def test_witness_a_marker_claim_requires_a_live_claimer(two_sessions, boot_factory,
                                                       entry_held_by, pg):
    """The claimer's lock is cut server-side; the process has not noticed. Postgres refuses."""
    from app.state.ledger import MarkerOutcome
    from tests.workers.test_claims import terminate_lock_backend

    first, _ = two_sessions
    boot = boot_factory()
    run_id, entry = entry_held_by(boot.boot_id)
    terminate_lock_backend(pg, boot)
    assert claim(first, run_id, [boot.boot_id], entry, 0, boot.boot_id).outcome \
        == MarkerOutcome.CLAIMER_DEAD
    assert markers_of(pg, run_id) == {}


def test_witness_a_marker_claim_is_fenced_by_the_run_claim(two_sessions, boot_factory,
                                                           entry_held_by, pg):
    from app.state.ledger import MarkerOutcome, finish_marker

    first, second = two_sessions
    holder, stranger = boot_factory().boot_id, boot_factory().boot_id
    run_id, entry = entry_held_by(holder)
    assert claim(first, run_id, [stranger], entry, 0, stranger).outcome == MarkerOutcome.FENCED
    assert markers_of(pg, run_id) == {}
    # A holder taken over mid-action cannot complete its marker afterwards.
    assert claim(first, run_id, [holder], entry, 0, holder).outcome == MarkerOutcome.CLAIMED
    pg.execute("UPDATE runs SET claimed_by = %s WHERE id = %s", [stranger, run_id])
    assert not finish_marker(on_session(second), run_id, [holder], entry, 0, step_id="work",
                             entry_no=1,
                             name="x", key="k", result=1)
    second.commit()
    assert markers_of(pg, run_id)[(1, 0)][0] == "claimed"


# -- key derivation, by property, over random definitions and crash points -------------------

class Crash(BaseException):
    """The worker process dies here (not an Exception: nothing in the worker catches it)."""


class CrashPoint:
    """Raise ``Crash`` at the ``at``-th action execution (0: never)."""

    def __init__(self):
        self.at, self.count = 0, 0

    def tick(self) -> None:
        self.count += 1
        if self.count == self.at:
            raise Crash(f"crash at execution {self.count}")


CRASH = CrashPoint()


def _plain(ctx, input):
    CRASH.tick()
    return {"step": ctx.step, "position": ctx.position}


def _marked(ctx, input):
    CRASH.tick()  # after the marker's claim, before its completion
    return {"key": ctx.idempotency_key}


def _child_input(ctx, item):
    CRASH.tick()  # inside the fan-out: after its claim, before its admissions commit
    return {"item": item}


def _loop(rounds: int, first: str, following: str | None):
    def next_step(ctx):
        if following is not None:
            return following
        return first if ctx.visit < rounds else None
    return next_step


def random_definition(data, name: str):
    """A workflow of 1-3 steps, 1-4 actions each at random positions, looping back 1-2 times."""
    from hypothesis import strategies as st

    from workers.registry import Step, Workflow, action, spawn_each

    step_count = data.draw(st.integers(1, 3), label="steps")
    rounds = data.draw(st.integers(1, 2), label="rounds")
    ids = [f"s{i}" for i in range(step_count)]
    steps, spawns = [], {}
    for index, step_id in enumerate(ids):
        kinds = data.draw(st.lists(st.sampled_from(["plain", "marker", "spawn"]), min_size=1,
                                   max_size=4), label=f"{step_id} kinds")
        positions = data.draw(st.lists(st.integers(0, 40), min_size=len(kinds),
                                       max_size=len(kinds), unique=True),
                              label=f"{step_id} positions")
        actions = []
        for n, (kind, position) in enumerate(zip(kinds, positions, strict=True)):
            if kind == "spawn":
                items = data.draw(st.lists(st.sampled_from("abcdef"), max_size=3, unique=True),
                                  label=f"{step_id}@{position} items")
                keyed = data.draw(st.booleans(), label=f"{step_id}@{position} keyed")
                spawns[(step_id, position)] = (items, keyed)
                actions.append(spawn_each("noop@1", over=lambda ctx, input, i=items: i,
                                          key=str if keyed else None, input=_child_input,
                                          position=position, name=f"spawn{n}"))
            else:
                actions.append(action(_marked if kind == "marker" else _plain,
                                      position=position, marker=kind == "marker",
                                      name=f"a{n}"))
        following = ids[index + 1] if index + 1 < step_count else None
        steps.append(Step(step_id, actions=actions, next=_loop(rounds, ids[0], following)))
    return Workflow(name, "1", steps=steps), spawns


def keys_in_ledger(pg, run_id, spawns) -> list[str]:
    """The dispatch keys the ledger's entries derive for their fan-outs, entry by entry."""
    keys = []
    for entry_no, step_id, _, _ in entries_of(pg, run_id):
        for (spawn_step, position), (items, keyed) in sorted(spawns.items()):
            if spawn_step == step_id:
                idem = idempotency_key(run_id, step_id, entry_no, position)
                keys += [fanout_key(idem, item if keyed else str(i))
                         for i, item in enumerate(items)]
    return keys


def test_fanout_keys_are_identical_on_resume_and_distinct_across_entries(app, admit, pg,
                                                                         run_here):
    """Property: for random definitions and a crash at a random action execution, a run
    resumed by a new boot admits exactly the children its ledger derives, once each, with
    keys byte-identical (but for the run id) to an uncrashed run of the same definition."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from app.extensions import db
    from workers import registry
    from workers.boots import end_current_boot

    def run_to_the_end(run_id, crash_at: int) -> int:
        CRASH.at, CRASH.count, crashes = crash_at, 0, 0
        for _ in range(20):  # crash_at counts executions across resumptions: it fires once
            # A crashed boot died long ago: its runs are free to take over (its lock may
            # take a moment to go after the close: asked again on the next round).
            dead_boots_long_gone(pg)
            try:
                run_here(run_id)
            except Crash:
                crashes += 1
                with app.app_context():  # the process is gone: its transaction and its lock
                    db.session.remove()
                end_current_boot()
            if run_row(pg, run_id)[0] in ("succeeded", "failed"):
                return crashes
        raise AssertionError("the run never finished")

    @settings(max_examples=25, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def check(data):
        wf, spawns = random_definition(data, f"prop-{uuid.uuid4().hex[:10]}")
        registry.register(wf)
        crash_at = data.draw(st.integers(1, 12), label="crash at")

        clean = admit(wf.ref)
        assert run_to_the_end(clean, 0) == 0
        crashed = admit(wf.ref)
        run_to_the_end(crashed, crash_at)
        for run_id in (clean, crashed):
            assert run_row(pg, run_id)[0] == "succeeded"

        def children(run_id) -> list[str]:
            return sorted(c[1] for c in children_of(pg, run_id))

        got = children(crashed)
        assert len(got) == len(set(got))  # no child admitted twice
        assert got == sorted(keys_in_ledger(pg, crashed, spawns))  # what the ledger derives
        # Byte-identical to the uncrashed run's, but for the run id.
        assert [k.replace(str(crashed), "RUN") for k in got] == \
            [k.replace(str(clean), "RUN") for k in children(clean)]
        # Distinct across entries: each entry's keys carry its own entry number.
        per_entry = Counter(k.split("/")[2] for k in got)
        entries_with_spawns = {k.split("/")[2] for k in got}
        assert sum(per_entry.values()) == len(got) and len(entries_with_spawns) == len(per_entry)
        # Every marker completed exactly once, whatever was taken over.
        markers = markers_of(pg, crashed)
        assert all(status == "completed" for status, _, _ in markers.values())
        completions = Counter((p["entry"], p["position"]) for (p,) in pg.execute(
            "SELECT payload FROM outbox WHERE run_id = %s AND event_type = 'action.completed'",
            [crashed]))
        assert set(completions) == set(markers) and set(completions.values()) <= {1}
        seen["crashed"] += run_row(pg, crashed)[3] > 1
        seen["taken over"] += any(claims > 1 for _, claims, _ in markers.values())

    seen = Counter()
    check()
    # The examples did exercise resumption, and marker takeovers among them.
    assert seen["crashed"] >= 5 and seen["taken over"] >= 1, seen


def test_fanout_key_derivation_is_a_pure_function_of_its_inputs():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    run = uuid.UUID(int=7)

    @settings(max_examples=300, deadline=None, derandomize=True, database=None)
    @given(st.from_regex(r"[A-Za-z0-9_.:-]{1,100}", fullmatch=True), st.integers(1, 10**6),
           st.integers(0, 10**6), st.text(max_size=300), st.integers(1, 10**6))
    def check(step, entry, position, item, other_entry):
        key = fanout_key(idempotency_key(run, step, entry, position), item)
        assert key == fanout_key(idempotency_key(run, step, entry, position), item)
        assert len(key) <= 255
        if other_entry != entry:
            assert key != fanout_key(idempotency_key(run, step, other_entry, position), item)

    check()


# -- real workers --------------------------------------------------------------------------------

@pytest.fixture
def worker_env(fast_env, queue_name):
    from tests.workflows.ledger import MODULES

    return {**fast_env, "POIMEN_QUEUE": queue_name, "POIMEN_WORKFLOW_MODULES": MODULES,
            "POIMEN_REPAIR_MIN_AGE": "5"}


def wait_terminal(pg, run_id, timeout=120):
    return wait_until(lambda: run_row(pg, run_id)[0] in ("succeeded", "failed", "cancelled")
                      and run_row(pg, run_id), timeout=timeout,
                      what=f"run {run_id} to finish")


# -- a second entry into review derives different keys ----------------------------------------

def test_a_second_entry_into_review_spawns_children_with_different_keys(
        admit, worker_env, pg, tmp_path, processes, queue):
    participants = ["ana", "bo"]
    parent = admit("doc-review", {"participants": participants, "reject_rounds": 1})
    processes.append(start_worker(worker_env, tmp_path, concurrency=2))
    status, result, error, _ = wait_terminal(pg, parent)
    assert status == "succeeded", error

    entries = entries_of(pg, parent)
    assert [e[1] for e in entries] == ["draft", "review", "draft", "review", "approve"]
    reviews = [e for e in entries if e[1] == "review"]
    keys = {entry_no: sorted(r[0] for r in pg.execute(
        "SELECT r.dispatch_key FROM step_children c JOIN runs r ON r.id = c.child_run_id "
        "WHERE c.entry_id = %s", [entry_id])) for entry_no, _, _, entry_id in reviews}
    first, second = keys[2], keys[4]
    assert first == sorted(expected_keys(parent, 2, participants))
    assert second == sorted(expected_keys(parent, 4, participants))
    assert not set(first) & set(second)
    assert result["rounds"] == [
        {"round": 1, "decisions": dict.fromkeys(participants, "reject")},
        {"round": 2, "decisions": dict.fromkeys(participants, "approve")}]


# -- a worker killed mid-entry ------------------------------------------------------------------

@pytest.mark.parametrize("crash", ["after_fanout", "mid_fanout"])
def test_a_worker_killed_mid_entry_resumes_it_without_duplicating_children(
        admit, worker_env, pg, tmp_path, processes, side_effects, queue, crash):
    """after_fanout: killed after the fan-out marker completed, before the entry finished.
    mid_fanout: killed inside the fan-out, its marker claimed and its children not committed.
    Either way the resumed run re-uses the entry and no child is admitted twice."""
    participants = ["ana", "bo", "cy"]
    parent = admit("doc-review-crashy", {"participants": participants, "crash": crash})
    processes.append(start_worker(worker_env, tmp_path, concurrency=1))
    processes.append(start_beat(worker_env, tmp_path))
    status, _, error, attempt = wait_terminal(pg, parent)
    assert status == "succeeded", error

    assert side_effects(parent, crash) == 1  # the worker did die there, once
    assert [e[:3] for e in entries_of(pg, parent)] == [(1, "review", "completed")]  # re-used
    children = children_of(pg, parent)
    assert sorted(c[1] for c in children) == sorted(expected_keys(parent, 1, participants,
                                                                  position=2))
    assert {c[2] for c in children} == {"succeeded"}
    events = events_of(pg, parent)
    assert "run.resumed" in events
    markers = markers_of(pg, parent)
    completions = Counter(p["position"] for (p,) in pg.execute(
        "SELECT payload FROM outbox WHERE run_id = %s AND event_type = 'action.completed'",
        [parent]))
    assert completions == {0: 1, 2: 1}
    # A completed marker is not executed again: clear_decisions ran once.
    assert side_effects(parent, "clear_decisions") == 1
    assert markers[(1, 0)][:2] == ("completed", 1)
    # The fan-out's marker: skipped when it had completed; taken over (claimed
    # twice, executed again under the same keys) when its worker died inside it.
    assert markers[(1, 2)][:2] == ("completed", 1 if crash == "after_fanout" else 2)


# -- joins: decided in Postgres by the last child's finish statement ---------------------------

@pytest.fixture
def join_world(app, admit, boot_factory, pg):
    """A doc-review parent in its review entry with two linked children, the parent held by
    one boot and each child claimed by another; the parent has not started waiting yet."""
    from app.extensions import db
    from app.state.claims import claim_run
    from app.state.ledger import claim_marker, enter_step, finish_marker
    from workers import registry

    parent_boot, child_boot = boot_factory().boot_id, boot_factory().boot_id
    parent = admit("doc-review", {"participants": ["ana", "bo"]})
    with app.app_context():
        s = db.session
        claim_run(on_session(s), parent, parent_boot, max_takeovers=max_takeovers_of)
        s.commit()
        review = registry.get("doc-review", "1").step("review")
        entry = enter_step(on_session(s), parent, [parent_boot], review, 1).id
        claim_marker(on_session(s), parent, [parent_boot], entry, 2, parent_boot)
        s.commit()
        children = [admit("review-participant", {"participant": p, "round": 1},
                          parent_run_id=parent) for p in ("ana", "bo")]
        assert finish_marker(on_session(s), parent, [parent_boot], entry, 2, step_id="review",
                             entry_no=1,
                             name="spawn_each", key="k", result={},
                             children=[(c, n, str(n)) for n, c in enumerate(children)])
        s.commit()
        for child in children:
            claim_run(on_session(s), child, child_boot, max_takeovers=max_takeovers_of)
        s.commit()
    return parent, parent_boot, entry, children, child_boot


def _finish_child(session, child, boot):
    from app.state.claims import finish_run

    assert finish_run(on_session(session), child, [boot], status="succeeded",
                      result={"decision": "approve"})


def _wait(session, parent, boot, entry):
    from app.state.ledger import WAIT

    row = session.execute(WAIT.call, {"run": parent, "boots": [boot], "entry": entry,
                                       "actions": "[]", "outputs": "{}"}).one()
    return row.entry_waits, row.run_waits


def _blocked(pg, timeout=10) -> None:
    wait_until(lambda: pg.execute("SELECT count(*) FROM pg_stat_activity WHERE "
                                  "wait_event_type = 'Lock' AND datname = current_database()"
                                  ).fetchone()[0] >= 1, timeout=timeout,
               what="the second statement to wait on the entry's row lock")


def test_join_the_last_child_finishing_while_the_parent_goes_waiting_requeues_it_once(
        app, two_sessions, join_world, pg, queue):
    import threading

    parent, parent_boot, entry, (first, last), child_boot = join_world
    parent_tx, child_tx = two_sessions
    _finish_child(child_tx, first, child_boot)
    child_tx.commit()
    assert pg.execute("SELECT status FROM runs WHERE id = %s", [parent]).fetchone()[0] \
        == "running"  # one child left: the parent had not waited yet, and nothing woke it

    # The parent goes waiting (uncommitted: it holds the entry's row); the last child's
    # finish waits for it, then sees the parent waiting and re-queues it.
    assert tuple(_wait(parent_tx, parent, parent_boot, entry)) == (1, 1)
    finished = threading.Event()

    def finish_last():
        with app.app_context():  # its commit sends the re-queued parent
            _finish_child(child_tx, last, child_boot)
            child_tx.commit()
        finished.set()

    thread = threading.Thread(target=finish_last)
    thread.start()
    _blocked(pg)
    assert not finished.is_set()
    parent_tx.commit()
    thread.join(30)
    assert finished.is_set()
    assert pg.execute("SELECT status FROM runs WHERE id = %s", [parent]).fetchone()[0] \
        == "queued"
    assert events_of(pg, parent).count("run.joined") == 1
    assert queue() == [str(parent)]  # (emptied after the setup) the join's one re-queue


def test_join_a_limited_childs_end_counts_for_the_join_and_hands_its_slot_on(
        app, join_world, pg, queue):
    """A child of a limited group ends in two parts (``poimen_ended``): it frees a slot and
    it counts for its parent's join; the one never stands in for the other."""
    from app.extensions import db

    parent, parent_boot, entry, (first, last), child_boot = join_world
    # The tenant is capped while its runs run: each end takes the tenant's slot lock and
    # hands a slot on, and a run parked behind the cap is the next to take one.
    tenant = pg.execute("SELECT tenant_id FROM runs WHERE id = %s", [parent]).fetchone()[0]
    pg.execute("UPDATE tenants SET max_running = 3 WHERE id = %s", [tenant])
    parked = pg.execute("INSERT INTO runs (id, tenant_id, workflow_ref, workflow_name, "
                        "workflow_version, input, status, wait_reason, attempt, failures, "
                        "cancel_requested, origin, created_at, updated_at) "
                        "SELECT gen_random_uuid(), tenant_id, 'noop@1', 'noop', '1', '{}', "
                        "'waiting', 'tenant_cap', 0, 0, false, 'http', now(), now() "
                        "FROM runs WHERE id = %s RETURNING id", [parent]).fetchone()[0]
    with app.app_context():
        session = db.session
        assert tuple(_wait(session, parent, parent_boot, entry)) == (1, 1)
        session.commit()
        _finish_child(session, first, child_boot)
        session.commit()
        assert run_row(pg, parent)[0] == "waiting"  # one child left
        _finish_child(session, last, child_boot)
        session.commit()
    assert run_row(pg, parent)[0] == "queued"
    assert events_of(pg, parent).count("run.joined") == 1
    assert run_row(pg, parked)[0] == "queued"  # a freed slot went to the parked run
    assert events_of(pg, parked).count("run.woken") == 1


def test_join_a_parent_going_waiting_after_its_last_child_finished_does_not_wait(
        two_sessions, join_world, pg):
    import threading

    parent, parent_boot, entry, (first, last), child_boot = join_world
    parent_tx, child_tx = two_sessions
    _finish_child(child_tx, first, child_boot)
    child_tx.commit()
    _finish_child(child_tx, last, child_boot)  # uncommitted: holds the entry's row
    result = {}
    thread = threading.Thread(target=lambda: result.update(
        row=tuple(_wait(parent_tx, parent, parent_boot, entry))))
    thread.start()
    _blocked(pg)
    child_tx.commit()
    thread.join(30)
    parent_tx.commit()
    assert result["row"] == (0, 0)  # every child done: no wait, the worker carries on
    assert pg.execute("SELECT status FROM runs WHERE id = %s", [parent]).fetchone()[0] \
        == "running"
    assert "run.joined" not in events_of(pg, parent)


def test_join_a_cancelled_child_counts_and_a_cancelled_waiting_parent_stays_cancelled(
        app, admit, run_here, tenant, pg, queue):
    from app.extensions import db
    from app.state.runs import cancel_run

    parent = admit("doc-review", {"participants": ["ana", "bo"]})
    run_here(parent)
    assert run_row(pg, parent)[0] == "waiting"
    (ana, *_), (bo, *_) = children_of(pg, parent)
    with app.app_context():
        assert cancel_run(on_session(db.session), tenant.id,
                          ana) is not None  # queued: cancelled at once
        db.session.commit()
    assert run_row(pg, parent)[0] == "waiting"
    run_here(bo)
    assert run_row(pg, parent)[0] == "queued"  # the cancelled child counted
    run_here(parent)
    # A cancelled child is no approval: the document goes back to draft, then review again.
    assert [e[1] for e in entries_of(pg, parent)] == ["draft", "review", "draft", "review"]
    drive(run_here, pg, parent)
    assert run_row(pg, parent)[0] == "succeeded"

    other = admit("doc-review", {"participants": ["cy"]})
    run_here(other)
    with app.app_context():
        assert cancel_run(on_session(db.session), tenant.id,
                          other).status == "cancelled"  # waiting: at once
        db.session.commit()
    (cy, *_), = children_of(pg, other)
    run_here(cy)
    assert run_row(pg, other)[0] == "cancelled"
    assert "run.joined" not in events_of(pg, other)


def test_join_a_poisoned_child_counts_as_a_failed_one(admit, run_here, dead_boot, pg):
    """A child whose executions killed max_takeovers + 1 workers ends poisoned by the
    takeover statement, whose join release counts it like any ended child: the last child's
    end re-queues the parent, which sees the child's status (not an approval)."""
    from workers.registry import max_takeovers_of

    parent = admit("doc-review", {"participants": ["ana", "bo"]})
    run_here(parent)
    assert run_row(pg, parent)[0] == "waiting"
    (ana, *_), (bo, *_) = children_of(pg, parent)
    # ana's worker died, as often as a review-participant may outlive.
    pg.execute("UPDATE runs SET status = 'running', claimed_by = %s, attempt = 1, "
               "takeovers = %s WHERE id = %s",
               [dead_boot(), max_takeovers_of("review-participant", "1"), ana])
    assert run_here(ana) == "finished"
    assert run_row(pg, ana)[0] == "poisoned"
    assert events_of(pg, ana)[-1] == "run.poisoned"
    assert run_row(pg, parent)[0] == "waiting"  # bo is still out
    run_here(bo)
    assert run_row(pg, parent)[0] == "queued"  # the poisoned child counted
    assert events_of(pg, parent).count("run.joined") == 1
    run_here(parent)
    # A poisoned child is no approval: the document goes back to draft, then review again.
    assert [e[1] for e in entries_of(pg, parent)] == ["draft", "review", "draft", "review"]
    drive(run_here, pg, parent)
    status, result, *_ = run_row(pg, parent)
    assert status == "succeeded"
    assert result["rounds"][0]["decisions"]["ana"] == "poisoned"


# -- Celery tasks as actions, and emit --------------------------------------------------------

def test_an_existing_celery_task_runs_as_an_action_and_emit_writes_one_event(admit, run_here,
                                                                            pg):
    run_id = admit("greeter", {"name": "ana"})
    assert run_here(run_id) == "claimed"
    status, result, error, _ = run_row(pg, run_id)
    assert status == "succeeded", error
    assert result == {"greeting": "hello ana!"}
    [(payload,)] = pg.execute("SELECT payload FROM outbox WHERE run_id = %s AND event_type = "
                              "'greeting.sent'", [run_id]).fetchall()
    assert payload["data"] == {"to": "ana"}
    assert payload["idempotency_key"] == idempotency_key(run_id, "announce", 2, 0)


# -- API: a run's steps, and its children -----------------------------------------------------

def test_the_api_shows_steps_and_lists_children(admit, run_here, client, tenant, pg, make_tenant):
    parent = admit("doc-review", {"participants": ["ana", "bo"], "fail": "ensure_participant_seat"})
    run_here(parent)
    body = client.get(f"/v1/runs/{parent}", headers=tenant.headers).get_json()
    assert body["status"] == "waiting"
    draft, review = body["steps"]
    assert (draft["entry"], draft["step"], draft["status"]) == (1, "draft", "completed")
    assert (review["entry"], review["step"], review["status"]) == (2, "review", "waiting")
    assert review["children"] == {"total": 2, "done": 0}
    assert [(a["position"], a["name"], a["marker"], a["status"]) for a in review["actions"]] == [
        (0, "clear_decisions", True, "completed"),
        (1, "ensure_participant_seat", False, "failed"),
        (2, "spawn_each", True, "completed")]
    assert review["actions"][1]["outcome"]["message"] == \
        "ensure_participant_seat failed (input.fail)"
    assert review["actions"][0]["claims"] == 1

    listed = client.get(f"/v1/runs?parent_run_id={parent}", headers=tenant.headers).get_json()
    children = children_of(pg, parent)
    assert sorted(r["id"] for r in listed["runs"]) == sorted(str(c[0]) for c in children)
    assert {r["parent_run_id"] for r in listed["runs"]} == {str(parent)}
    assert {r["origin"] for r in listed["runs"]} == {"fanout"}
    assert "steps" not in listed["runs"][0]  # the list stays light; GET one run for steps
    # Another tenant sees none of them; a malformed id is a 400.
    other = make_tenant()
    assert client.get(f"/v1/runs?parent_run_id={parent}",
                      headers=other.headers).get_json()["runs"] == []
    bad = client.get("/v1/runs?parent_run_id=nope", headers=tenant.headers)
    assert bad.status_code == 400 and bad.get_json()["error"]["code"] == "invalid_parameter"
    assert client.get("/v1/runs?status=waiting", headers=tenant.headers).get_json()["runs"][0][
        "id"] == str(parent)
