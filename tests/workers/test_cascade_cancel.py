"""A cancel reaches a run's descendants: deterministic rule tests on real Postgres.

``POST /v1/runs/<id>/cancel`` cancels the run and every descendant not ended (queued,
delayed and waiting ones at once, running ones at their next checkpoint), each with its
event; ``?cascade=false`` cancels the run alone. A child admitted under a parent whose
cascading cancel committed is admitted cancelled; a cancel that meets a fan-out in flight
waits for its commit and then finds the children (the admission locks the parent's row).
Both orders are driven here with two sessions; the processes test is
``test_cascade_cancel_processes.py``.
"""

from __future__ import annotations

import threading

import pytest

from app.state.claims import ClaimOutcome
from tests.processes import wait_until

from .test_claims import claim, events_of, hold_as


@pytest.fixture
def session(app):
    from app.extensions import db

    with app.app_context():
        yield db.session
        db.session.rollback()


def status(pg, run_id) -> tuple:
    return pg.execute("SELECT status, cancel_requested FROM runs WHERE id = %s",
                      [run_id]).fetchone()


def cancel(client, tenant, run_id, query: str = ""):
    return client.post(f"/v1/runs/{run_id}/cancel{query}", headers=tenant.headers)


def test_a_cancel_reaches_every_descendant_not_ended(client, tenant, admit, boot_factory, pg,
                                                     session):
    root = admit("effect", {})
    running = admit("effect", {}, parent_run_id=root)
    queued = admit("effect", {}, parent_run_id=root)
    delayed = admit("effect", {}, parent_run_id=root, delay_seconds=60)
    done = admit("effect", {}, parent_run_id=root)
    holder = admit("keyed", {"customer": "c"}, parent_run_id=running)  # a grandchild
    waiting = admit("keyed", {"customer": "c"}, parent_run_id=running)
    below_done = admit("effect", {}, parent_run_id=done)  # under an ended run: still reached
    boot = boot_factory()
    for run_id in (root, running, holder):
        assert claim(session, run_id, boot.boot_id).outcome == ClaimOutcome.CLAIMED
    assert claim(session, waiting, boot.boot_id).outcome == ClaimOutcome.SLOT_WAIT
    pg.execute("UPDATE runs SET status = 'succeeded', finished_at = now() WHERE id = %s",
               [done])

    answer = cancel(client, tenant, root)
    assert answer.status_code == 202  # the root runs: it stops at its next checkpoint
    assert answer.headers["Poimen-Cancelled-Descendants"] == "6"
    assert status(pg, root) == ("running", True)
    assert status(pg, running) == ("running", True)
    assert status(pg, holder) == ("running", True)
    for run_id in (queued, delayed, waiting, below_done):
        assert status(pg, run_id) == ("cancelled", True)
        assert events_of(pg, run_id)[-1] == "run.cancelled"
    assert status(pg, done) == ("succeeded", False)
    # A second cancel finds nothing more to reach.
    assert cancel(client, tenant, root).headers["Poimen-Cancelled-Descendants"] == "0"


def test_cascade_false_cancels_the_run_alone(client, tenant, admit, pg):
    root = admit("effect", {})
    child = admit("effect", {}, parent_run_id=root)
    answer = cancel(client, tenant, root, "?cascade=false")
    assert answer.status_code == 200 and answer.json["status"] == "cancelled"
    assert answer.headers["Poimen-Cancelled-Descendants"] == "0"
    assert status(pg, child) == ("queued", False)
    # A child admitted afterwards under it is not cancelled either.
    late = admit("effect", {}, parent_run_id=root)
    assert status(pg, late) == ("queued", False)


@pytest.mark.parametrize("query", ["?cascade=maybe", "?cascade=", "?other=1"])
def test_a_bad_cancel_parameter_is_a_400(client, tenant, admit, pg, query):
    root = admit("effect", {})
    answer = cancel(client, tenant, root, query)
    assert answer.status_code == 400
    assert answer.json["error"]["code"] == "invalid_parameter"
    assert status(pg, root) == ("queued", False)  # nothing cancelled


def test_a_child_admitted_after_the_cancel_is_admitted_cancelled_and_never_runs(
        client, tenant, admit, boot_factory, session, pg):
    root = admit("effect", {})
    hold_as(pg, root, boot_factory().boot_id)
    assert cancel(client, tenant, root).status_code == 202
    child = admit("effect", {}, parent_run_id=root)  # the root's fan-out, after the answer
    assert status(pg, child) == ("queued", True)
    assert claim(session, child, boot_factory().boot_id).outcome == ClaimOutcome.FINISHED
    assert status(pg, child) == ("cancelled", True)
    grandchild = admit("effect", {}, parent_run_id=child)  # and below it, the same
    assert status(pg, grandchild) == ("queued", True)


def test_a_cancel_meeting_a_fan_out_in_flight_waits_for_it_then_cancels_its_children(
        app, client, tenant, admit, boot_factory, pg, database_url):
    """The fan-out's transaction has admitted a child and not committed: the cancel waits
    on the parent's row (the admission locked it FOR SHARE), then finds the child."""
    from app.admission import admit_run
    from app.extensions import db
    from app.state.executor import on_session

    root = admit("effect", {})
    hold_as(pg, root, boot_factory().boot_id)
    answers = {}
    with app.app_context():
        fan_out = db.session
        child = admit_run(on_session(fan_out), tenant_id=tenant.id, workflow_ref="effect",
                          input={}, parent_run_id=root).run.id  # uncommitted

        def cancel_in_thread():
            with app.app_context():
                answers["cancel"] = cancel(app.test_client(), tenant, root)

        thread = threading.Thread(target=cancel_in_thread)
        thread.start()
        wait_until(lambda: pg.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND datname = current_database()").fetchone()[0] >= 1, timeout=10,
            what="the cancel to wait on the parent's row")
        assert "cancel" not in answers
        fan_out.commit()
    thread.join(30)
    assert answers["cancel"].headers["Poimen-Cancelled-Descendants"] == "1"
    assert status(pg, child) == ("cancelled", True)


def test_the_consoles_cancel_cascades_and_says_how_far(tenant, admit, pg):
    import re

    from app import create_app

    root = admit("effect", {})
    children = [admit("effect", {}, parent_run_id=root) for _ in range(3)]
    console = create_app({"POIMEN_CONSOLE_SECRET": "s" * 40, "TESTING": True}).test_client()
    page = console.get("/console/sign-in").get_data(as_text=True)
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', page).group(1)
    console.post("/console/sign-in", data={"csrf_token": csrf, "token": tenant.token})
    detail = console.get(f"/console/runs/{root}").get_data(as_text=True)
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', detail).group(1)
    answer = console.post(f"/console/runs/{root}/cancel", data={"csrf_token": csrf},
                          follow_redirects=True)
    assert "3 descendant run(s) cancelled or asked to stop" in answer.get_data(as_text=True)
    for run_id in (root, *children):
        assert status(pg, run_id) == ("cancelled", True)


def test_the_client_cancels_with_or_without_the_cascade(live_api, tenant, admit, pg):
    from poimen_client import Runs

    runs = Runs(live_api, tenant.token, retry_for=5)
    alone, below_alone = admit("effect", {}), None
    below_alone = admit("effect", {}, parent_run_id=alone)
    assert runs.cancel(str(alone), cascade=False).status == "cancelled"
    assert status(pg, below_alone) == ("queued", False)
    tree = admit("effect", {})
    below = admit("effect", {}, parent_run_id=tree)
    assert runs.cancel(str(tree)).status == "cancelled"
    assert status(pg, below) == ("cancelled", True)
