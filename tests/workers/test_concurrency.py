"""Concurrency keys and tenant caps, decided in the claim: deterministic rule tests.

Real Postgres, real boots (advisory locks), explicit order; no worker processes
(those are in ``test_concurrency_processes.py``).
"""

from __future__ import annotations

import threading

import pytest

from app.state.claims import ClaimOutcome, claim_run, finish_run, release_claim, schedule_retry
from app.state.executor import on_session
from tests.conftest import wait_until_waiting_on_a_lock
from workers.registry import max_takeovers_of

from .test_claims import claim, events_of, hold_as


@pytest.fixture
def session(app):
    from app.extensions import db

    with app.app_context():
        yield db.session
        db.session.rollback()


def state(pg, run_id):
    return pg.execute("SELECT status, wait_reason, claimed_by, attempt FROM runs WHERE id = %s",
                      [run_id]).fetchone()


def pending_sends(session) -> set:
    """The runs ``session``'s transaction is to send once it commits."""
    return set(on_session(session).pending)


def keyed(admit, customer="c1", **input):
    return admit("keyed", {"customer": customer, **input})


# -- declaring and admitting -------------------------------------------------------------------

def test_the_key_is_derived_from_the_input_or_given_and_the_limit_pinned(admit, pg):
    derived = keyed(admit, "acme")
    given = admit("keyed", {"customer": "acme"}, concurrency_key="override")
    bare = admit("keyed", {})
    unlimited = admit("echo", {}, concurrency_key="k")
    rows = {r[0]: r[1:] for r in pg.execute(
        "SELECT id, concurrency_key, concurrency_limit FROM runs")}
    assert rows[derived] == ("acme", 1)
    assert rows[given] == ("override", 1)
    assert rows[bare] == (None, 1)  # no key: one group for the tenant and workflow
    assert rows[unlimited] == ("k", None)  # shown, limits nothing


def test_a_concurrency_key_that_cannot_be_stored_is_a_422(client, tenant):
    for bad in ("", "x" * 256, 7):
        r = client.post("/v1/runs", headers=tenant.headers,
                        json={"workflow_ref": "keyed", "concurrency_key": bad})
        assert r.status_code == 422, bad
        assert "concurrency_key" in r.json["error"]["details"]["fields"]


def test_a_key_the_workflow_cannot_derive_is_a_422_naming_no_input(app, tenant, client):
    from workers import registry
    from workers.registry import Workflow, register

    def boom(input):
        raise KeyError("secret-value")

    register(Workflow("keyed-boom", "1", steps=keyed_steps(), concurrency_limit=1,
                      concurrency_key=boom))
    try:
        r = client.post("/v1/runs", headers=tenant.headers,
                        json={"workflow_ref": "keyed-boom", "input": {"a": 1}})
        assert r.status_code == 422
        assert "secret-value" not in r.get_data(as_text=True)
        assert "KeyError" in r.json["error"]["details"]["fields"]["concurrency_key"]
    finally:
        registry._registry.pop("keyed-boom", None)


def keyed_steps():
    from workers.registry import Step, action

    def body(ctx, input):
        return None

    return [Step("main", actions=[action(body, position=0)])]


def test_the_run_json_says_what_a_run_waits_for(client, tenant, admit, boot_factory, session):
    first, second = keyed(admit), keyed(admit)
    boot = boot_factory()
    assert claim(session, first, boot.boot_id).outcome == ClaimOutcome.CLAIMED
    assert claim(session, second, boot.boot_id).outcome == ClaimOutcome.SLOT_WAIT
    body = client.get(f"/v1/runs/{second}", headers=tenant.headers).json
    assert (body["status"], body["wait_reason"], body["concurrency_key"]) == (
        "waiting", "concurrency", "c1")
    assert client.get(f"/v1/runs/{first}", headers=tenant.headers).json["wait_reason"] is None


# -- the claim ---------------------------------------------------------------------------------

def test_a_run_without_a_slot_waits_unclaimed_and_the_holders_end_wakes_it(
        session, admit, boot_factory, pg):
    first, second = keyed(admit), keyed(admit)
    boot = boot_factory()
    assert claim(session, first, boot.boot_id).outcome == ClaimOutcome.CLAIMED
    waited = claim(session, second, boot.boot_id)
    assert (waited.outcome, waited.wait_reason) == (ClaimOutcome.SLOT_WAIT, "concurrency")
    assert state(pg, second) == ("waiting", "concurrency", None, 0)  # holds no worker
    assert events_of(pg, second) == ["run.admitted", "run.waiting"]
    assert claim(session, second, boot.boot_id).outcome == ClaimOutcome.WAITING

    assert finish_run(on_session(session), first, boot.boot_id, status="succeeded", result=1)
    assert pending_sends(session) == {second}  # sent once the finish commits
    session.commit()
    assert state(pg, second) == ("queued", None, None, 0)
    assert events_of(pg, second) == ["run.admitted", "run.waiting", "run.woken"]
    assert claim(session, second, boot.boot_id).outcome == ClaimOutcome.CLAIMED


def test_a_run_woken_for_a_slot_is_sent_with_its_trace_context(session, admit, boot_factory):
    from app.tracecontext import TraceContext

    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    first = keyed(admit)
    second = admit("keyed", {"customer": "c1"}, trace=TraceContext(traceparent, "k=v"))
    boot = boot_factory()
    claim(session, first, boot.boot_id)
    claim(session, second, boot.boot_id)
    finish_run(on_session(session), first, boot.boot_id, status="succeeded")
    # Its slot wait started no execution: still Celery's retries 0; top-level.
    assert on_session(session).pending.runs[second] == (
        "keyed@1", traceparent, "k=v", 0, None, None)
    session.commit()


@pytest.mark.parametrize("leave", ["retry", "release"])
def test_a_retry_or_a_release_gives_the_slot_up(session, admit, boot_factory, pg, leave):
    first, second = keyed(admit), keyed(admit)
    boot = boot_factory()
    claim(session, first, boot.boot_id)
    claim(session, second, boot.boot_id)
    if leave == "retry":
        assert schedule_retry(on_session(session), first, boot.boot_id, delay=60,
                              error={"type": "x"})
    else:
        assert release_claim(on_session(session), first, boot.boot_id)
    session.commit()
    assert state(pg, second)[:2] == ("queued", None)


def test_other_keys_and_other_workflows_are_not_held_back(session, admit, boot_factory):
    boot = boot_factory()
    assert claim(session, keyed(admit, "a"), boot.boot_id).outcome == ClaimOutcome.CLAIMED
    assert claim(session, keyed(admit, "b"), boot.boot_id).outcome == ClaimOutcome.CLAIMED
    assert claim(session, admit("echo"), boot.boot_id).outcome == ClaimOutcome.CLAIMED


def test_a_limit_of_two_lets_two_run(session, admit, boot_factory):
    boot = boot_factory()
    runs = [admit("pair", {}, concurrency_key="k") for _ in range(3)]
    outcomes = [claim(session, run, boot.boot_id).outcome for run in runs]
    assert outcomes == [ClaimOutcome.CLAIMED, ClaimOutcome.CLAIMED, ClaimOutcome.SLOT_WAIT]


def test_fifo_a_newcomer_does_not_overtake_an_older_run_woken_for_the_slot(
        session, admit, boot_factory, pg):
    boot = boot_factory()
    first, second = keyed(admit), keyed(admit)
    claim(session, first, boot.boot_id)
    claim(session, second, boot.boot_id)  # waits
    finish_run(on_session(session), first, boot.boot_id, status="succeeded")
    session.commit()  # second is queued again, its message on the way
    newcomer = keyed(admit)
    assert claim(session, newcomer, boot.boot_id).outcome == ClaimOutcome.SLOT_WAIT
    assert claim(session, second, boot.boot_id).outcome == ClaimOutcome.CLAIMED


def test_a_slot_held_by_a_dead_boot_is_free(session, admit, boot_factory, dead_boot, pg):
    first, second = keyed(admit), keyed(admit)
    hold_as(pg, first, dead_boot())
    assert claim(session, second, boot_factory().boot_id).outcome == ClaimOutcome.CLAIMED


def test_a_takeover_respects_the_limit_and_waits_when_the_slot_was_taken(
        session, admit, boot_factory, dead_boot, pg):
    first, second = keyed(admit), keyed(admit)
    dead = dead_boot()
    hold_as(pg, first, dead)
    boot = boot_factory()
    assert claim(session, second, boot.boot_id).outcome == ClaimOutcome.CLAIMED
    taken = claim(session, first, boot.boot_id)  # the dead holder's run, re-sent by repair
    assert (taken.outcome, taken.wait_reason) == (ClaimOutcome.SLOT_WAIT, "concurrency")
    assert state(pg, first) == ("waiting", "concurrency", None, 1)
    assert pg.execute("SELECT takeovers FROM runs WHERE id = %s", [first]).fetchone() == (1,)
    assert events_of(pg, first) == ["run.admitted", "run.waiting"]

    finish_run(on_session(session), second, boot.boot_id, status="succeeded")
    session.commit()
    resumed = claim(session, first, boot.boot_id)
    assert (resumed.outcome, resumed.attempt) == (ClaimOutcome.CLAIMED, 2)


def test_a_takeover_with_a_free_slot_resumes(session, admit, boot_factory, dead_boot, pg):
    run_id = keyed(admit)
    hold_as(pg, run_id, dead_boot())
    assert claim(session, run_id, boot_factory().boot_id).outcome == ClaimOutcome.TAKEN_OVER


def test_an_unlimited_run_of_an_uncapped_tenant_is_claimed_in_one_statement(
        app, admit, pg, fresh_boot, statements):
    """No cost for runs without a limit: no lock, no transaction (the claim's mutant
    ``claim_in_a_transaction`` covers the autocommit itself)."""
    from workers.execution import execute_run

    run_id = admit("echo", {})
    statements.clear()
    with app.app_context():
        assert execute_run(str(run_id)).outcome == ClaimOutcome.CLAIMED
    assert not [sql for sql, _ in statements if "pg_advisory_xact_lock" in sql]


def test_a_limited_run_is_claimed_and_ended_by_calls_that_take_its_locks_first(
        app, admit, pg, fresh_boot, statements, side_effects):
    """Without the message's hint, the one-statement claim refuses a limited run; it is then
    claimed and later ended by the store's locked functions (the locks, then the statement
    on a fresh snapshot: tests/app/test_slot_functions.py), each one call in autocommit."""
    from workers.execution import execute_run

    run_id = keyed(admit)
    statements.clear()
    with app.app_context():
        assert execute_run(str(run_id)).outcome == ClaimOutcome.CLAIMED
    calls = [sql.split("(")[0] for sql, autocommit in statements if "poimen_" in sql and autocommit]
    assert calls == ["SELECT * FROM poimen_claim_slot",
                     "SELECT * FROM poimen_finish"], statements
    assert state(pg, run_id)[0] == "succeeded"


# -- the deterministic witness: two sessions, explicit order ------------------------------------

def _claim_in_thread(app, run_id, boot_id, pg, name="test-slot-claimer"):
    """Start ``claim_run`` on its own session in a thread; return once it waits on a lock."""
    from app.extensions import db

    outcome = {}

    def deliver():
        with app.app_context():
            db.session.execute(db.text(f"SET application_name = '{name}'"))
            outcome["claim"] = claim_run(on_session(db.session), run_id, boot_id,
                                         max_takeovers=max_takeovers_of)
            db.session.commit()
            db.session.remove()

    thread = threading.Thread(target=deliver, daemon=True)
    thread.start()
    try:
        wait_until_waiting_on_a_lock(pg, name)
    except AssertionError:
        thread.join(10)
        raise AssertionError(f"the second claim did not wait for the slot lock; it ended "
                             f"{outcome.get('claim')}") from None
    return thread, outcome


def _b_claims_while_a_holds_the_lock(app, pg, a_run, a, b_run, b):
    """A's claim of ``a_run``, left uncommitted (A holds the group's lock); B's claim of
    ``b_run`` on its own session, started then, waits on the lock; A commits. Return
    both claims."""
    from app.extensions import db

    with app.app_context():
        first = claim_run(on_session(db.session), a_run, a.boot_id, max_takeovers=max_takeovers_of)
        thread, outcome = _claim_in_thread(app, b_run, b.boot_id, pg)
        db.session.commit()
    thread.join(10)
    return first, outcome["claim"]


def test_racing_claims_cannot_both_take_the_last_slot(app, admit, boot_factory, pg):
    """A claims the last slot and has not committed; B's claim waits on the group's lock;
    A commits; B, whose statement's snapshot is taken after the lock, sees A's claim
    and waits. A count read before the claim, or a claim without the lock, lets B run too."""
    a_run, b_run = keyed(admit), keyed(admit)
    a, b = boot_factory(), boot_factory()
    first, second = _b_claims_while_a_holds_the_lock(app, pg, a_run, a, b_run, b)
    assert first.outcome == ClaimOutcome.CLAIMED
    assert second.outcome == ClaimOutcome.SLOT_WAIT
    assert state(pg, a_run)[:3] == ("running", None, a.boot_id)
    assert state(pg, b_run) == ("waiting", "concurrency", None, 0)


def test_a_claim_racing_a_takeover_counts_after_the_lock(app, admit, boot_factory, dead_boot,
                                                        pg):
    """The count's snapshot comes after the group's lock. A takes over the slot of a dead
    holder (not committed: A holds the lock); B, a newer queued run of the group, waits on
    the lock, then counts on a snapshot taken after A's commit: the run is held by a live
    boot, so B parks. A count taken before the lock still sees the dead holder (a free
    slot; a running run is not ahead of B in the queue) and lets B run beside A. (In the
    race above, B parks either way: the queued older run counts as ahead of it.)"""
    held, newer = keyed(admit), keyed(admit)
    hold_as(pg, held, dead_boot())
    a, b = boot_factory(), boot_factory()
    first, second = _b_claims_while_a_holds_the_lock(app, pg, held, a, newer, b)
    assert first.outcome == ClaimOutcome.TAKEN_OVER
    assert second.outcome == ClaimOutcome.SLOT_WAIT
    assert state(pg, held)[:3] == ("running", None, a.boot_id)
    assert state(pg, newer) == ("waiting", "concurrency", None, 0)


def test_an_end_racing_a_claim_that_parks_still_wakes_it(app, admit, boot_factory, pg):
    """B's claim holds the lock and parks B (uncommitted); A's finish waits for the lock,
    then its wake-up sees B waiting: no lost wake-up."""
    from app.extensions import db
    from workers.fence import Fence

    a_run, b_run = keyed(admit), keyed(admit)
    a, b = boot_factory(), boot_factory()
    with app.app_context():
        assert claim(db.session, a_run, a.boot_id).outcome == ClaimOutcome.CLAIMED
        parked = claim_run(on_session(db.session), b_run, b.boot_id, max_takeovers=max_takeovers_of)
        assert parked.outcome == ClaimOutcome.SLOT_WAIT  # not committed: B holds the lock

        done = {}

        def finish():
            from workers import boots

            with app.app_context():
                db.session.execute(db.text("SET application_name = 'test-slot-ender'"))
                boots.hold(a_run, a.boot_id)
                try:
                    done["ok"] = Fence(a_run, 0, slots=True).finish(None, status="succeeded")
                finally:
                    boots.let_go([a_run])
                    db.session.remove()

        thread = threading.Thread(target=finish, daemon=True)
        thread.start()
        wait_until_waiting_on_a_lock(pg, "test-slot-ender")
        db.session.commit()
    thread.join(10)
    assert done == {"ok": True}
    assert state(pg, b_run)[:2] == ("queued", None)
    assert events_of(pg, b_run) == ["run.admitted", "run.waiting", "run.woken"]


# -- tenant caps -------------------------------------------------------------------------------

def set_cap(app, name, cap):
    from app.tenant_service import set_max_running

    with app.app_context():
        set_max_running(name, cap)


def test_a_tenant_cap_parks_the_tenants_runs_but_not_another_tenants(
        app, session, admit, make_tenant, tenant, boot_factory, pg):
    from app.admission import admit_run

    set_cap(app, tenant.name, 2)
    boot = boot_factory()
    runs = [admit("echo") for _ in range(3)]
    outcomes = [claim(session, run, boot.boot_id) for run in runs]
    assert [o.outcome for o in outcomes] == [ClaimOutcome.CLAIMED] * 2 + [ClaimOutcome.SLOT_WAIT]
    assert outcomes[2].wait_reason == "tenant_cap"

    other = make_tenant()
    with app.app_context():
        from app.extensions import db

        theirs = admit_run(on_session(db.session), tenant_id=other.id, workflow_ref="echo",
                           input={}).run.id
        db.session.commit()
    assert claim(session, theirs, boot.boot_id).outcome == ClaimOutcome.CLAIMED

    finish_run(on_session(session), runs[0], boot.boot_id, status="succeeded")
    session.commit()
    assert state(pg, runs[2])[:2] == ("queued", None)
    assert claim(session, runs[2], boot.boot_id).outcome == ClaimOutcome.CLAIMED


def test_the_cli_sets_and_removes_a_tenants_cap(app, tenant, pg):
    runner = app.test_cli_runner()
    result = runner.invoke(args=["tenants", "set", tenant.name, "--max-running", "20"])
    assert result.exit_code == 0, result.output
    assert "max running 20" in result.output
    assert pg.execute("SELECT max_running FROM tenants WHERE id = %s",
                      [tenant.id]).fetchone() == (20,)
    assert runner.invoke(args=["tenants", "set", tenant.name, "--max-running", "0"]
                         ).exit_code != 0
    assert runner.invoke(args=["tenants", "set", tenant.name]).exit_code != 0
    assert runner.invoke(args=["tenants", "set", tenant.name, "--no-max-running"]
                         ).exit_code == 0
    assert pg.execute("SELECT max_running FROM tenants WHERE id = %s",
                      [tenant.id]).fetchone() == (None,)


# -- beat's backstop ---------------------------------------------------------------------------

def test_repair_wakes_the_oldest_run_waiting_for_a_slot_whose_holder_died(
        app, session, admit, boot_factory, dead_boot, pg):
    from app.run_service import redrive_stranded_runs

    first, second, third = keyed(admit), keyed(admit), keyed(admit)
    boot = boot_factory()
    claim(session, first, boot.boot_id)
    claim(session, second, boot.boot_id)
    claim(session, third, boot.boot_id)
    assert [state(pg, r)[0] for r in (second, third)] == ["waiting", "waiting"]
    # The holder's worker dies (its lock goes with it): nothing ends the run, so only
    # repair can see that its slot is free.
    pg.execute("UPDATE runs SET claimed_by = %s WHERE id = %s", [dead_boot(), first])
    with app.app_context():
        redrive_stranded_runs(session, app.extensions["celery"], min_age=3600)
    assert state(pg, second)[:2] == ("queued", None)
    assert state(pg, third)[:2] == ("waiting", "concurrency")  # one slot, one run: FIFO


def test_repair_leaves_waiting_runs_alone_while_their_group_is_full(
        app, session, admit, boot_factory, pg):
    from app.run_service import redrive_stranded_runs

    first, second = keyed(admit), keyed(admit)
    boot = boot_factory()
    claim(session, first, boot.boot_id)
    claim(session, second, boot.boot_id)
    with app.app_context():
        redrive_stranded_runs(session, app.extensions["celery"], min_age=3600)
    assert state(pg, second)[:2] == ("waiting", "concurrency")


def test_the_waiting_gauge_counts_by_reason(app, session, admit, boot_factory, pg):
    from app.state.runs import waiting_by_reason

    boot = boot_factory()
    for _ in range(3):
        claim(session, keyed(admit), boot.boot_id)
    assert waiting_by_reason(on_session(session)) == {"concurrency": 2}


def test_the_console_says_what_a_waiting_run_waits_for(database_url, tenant, admit,
                                                       boot_factory, session):
    import re

    from app import create_app

    first, second = keyed(admit, "acme"), keyed(admit, "acme")
    boot = boot_factory()
    claim(session, first, boot.boot_id)
    claim(session, second, boot.boot_id)
    client = create_app({"POIMEN_CONSOLE_SECRET": "s" * 40, "TESTING": True}).test_client()
    page = client.get("/console/sign-in").get_data(as_text=True)
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', page).group(1)
    client.post("/console/sign-in", data={"csrf_token": csrf, "token": tenant.token})
    waiting = client.get(f"/console/runs/{second}").get_data(as_text=True)
    assert 'data-reason="concurrency"' in waiting
    assert "waits for a slot of its concurrency key" in waiting
    assert "at most 1 of this key at once" in waiting
    assert 'id="wait-reason"' not in client.get(f"/console/runs/{first}").get_data(as_text=True)


def test_adoption_keeps_the_slot_only_if_no_run_took_it_while_the_boot_was_dead(
        session, admit, boot_factory, dead_boot, pg):
    """A process cut off by a Postgres restart adopts its run under a new boot. While
    its boot was dead the slot was free: if another run took it, adopting would run
    one more than the limit, so the adoption is refused (the process stops the run;
    repair's takeover parks it until a slot frees)."""
    from app.state.claims import Adoption, adopt_run

    mine, other, alone = keyed(admit), keyed(admit), keyed(admit, "c2")
    lost = dead_boot()
    hold_as(pg, mine, lost)
    hold_as(pg, alone, lost)
    rival, new = boot_factory(), boot_factory()
    assert claim(session, other, rival.boot_id).outcome == ClaimOutcome.CLAIMED
    assert adopt_run(on_session(session), mine, lost, new.boot_id, [lost]) == Adoption.NO_SLOT
    assert adopt_run(on_session(session), alone, lost, new.boot_id, [lost]) == Adoption.ADOPTED
    session.commit()
    assert state(pg, mine)[:3] == ("running", None, lost)
    assert state(pg, alone)[:3] == ("running", None, new.boot_id)


# -- a cap change wakes the runs it frees ---------------------------------------------------------
#
# On the savepoint fixture (``db_session``): the runs, claims and the cap change live in one
# transaction the test rolls back; the boots are real (their locks on their own
# connections), so the slot counts see live holders.

@pytest.fixture
def tx_admit(db_session, tx_tenant):
    """Admit a run of ``tx_tenant`` in ``db_session`` and return its id."""
    from sqlalchemy import text

    from app.admission import admit_run

    def make(workflow_ref: str = "echo", input: dict | None = None, **kwargs):
        run_id = admit_run(on_session(db_session), tenant_id=tx_tenant.id,
                           workflow_ref=workflow_ref,
                           input=input or {}, **kwargs).run.id
        # created_at is now(), the transaction's start: one instant for every run of the
        # test. Admitted in their own transactions, runs line up in admission order.
        db_session.execute(text("UPDATE runs SET created_at = clock_timestamp() "
                                "WHERE id = :run"), {"run": run_id})
        db_session.commit()
        return run_id

    return make


def tx_state(session, run_id):
    from sqlalchemy import text

    return tuple(session.execute(text("SELECT status, wait_reason FROM runs WHERE id = :run"),
                                 {"run": run_id}).one())


def tx_events(session, run_id):
    from sqlalchemy import text

    return list(session.execute(text("SELECT event_type FROM outbox WHERE run_id = :run "
                                     "ORDER BY id"), {"run": run_id}).scalars())


def tx_set_cap(db_session, name, cap):
    """``set_max_running`` as the CLI calls it (its commit releases a savepoint here)."""
    from app.tenant_service import set_max_running

    set_max_running(name, cap)
    db_session.commit()


def parked_behind_a_cap(db_session, tx_admit, tx_tenant, boot, cap, count,
                        workflow_ref="echo", input=None):
    """Cap ``tx_tenant`` at ``cap`` and claim ``count`` runs: ``cap`` run, the rest wait."""
    tx_set_cap(db_session, tx_tenant.name, cap)
    runs = [tx_admit(workflow_ref, input) for _ in range(count)]
    outcomes = [claim(db_session, run, boot.boot_id) for run in runs]
    assert [o.outcome for o in outcomes] == ([ClaimOutcome.CLAIMED] * cap
                                             + [ClaimOutcome.SLOT_WAIT] * (count - cap))
    assert {o.wait_reason for o in outcomes[cap:]} <= {"tenant_cap"}
    return runs


def test_lifting_a_cap_wakes_every_run_waiting_for_it(db_session, tx_admit, tx_tenant,
                                                      boot_factory):
    """The runs waiting for the cap go back to queued in the cap change's own transaction
    (``WAKE_TENANT``), each with a ``run.woken`` event, and pass the claim. A wake statement
    that required a cap would leave them waiting for good."""
    boot = boot_factory()
    first, *waiting = parked_behind_a_cap(db_session, tx_admit, tx_tenant, boot, 1, 4)
    tx_set_cap(db_session, tx_tenant.name, None)
    assert [tx_state(db_session, r) for r in waiting] == [("queued", None)] * 3
    assert tx_events(db_session, waiting[0]) == ["run.admitted", "run.waiting", "run.woken"]
    assert [claim(db_session, r, boot.boot_id).outcome for r in waiting] == [
        ClaimOutcome.CLAIMED] * 3


def test_lifting_a_cap_leaves_a_woken_run_to_its_groups_limit(db_session, tx_admit, tx_tenant,
                                                             boot_factory):
    """Woken, a run still passes its own group's limit: two runs of one key waited for the
    cap; lifted, one starts and the other waits for the key's slot."""
    boot = boot_factory()
    tx_set_cap(db_session, tx_tenant.name, 1)
    blocker = tx_admit("echo")
    assert claim(db_session, blocker, boot.boot_id).outcome == ClaimOutcome.CLAIMED
    a, b = tx_admit("keyed", {"customer": "k"}), tx_admit("keyed", {"customer": "k"})
    assert [claim(db_session, r, boot.boot_id).wait_reason for r in (a, b)] == [
        "tenant_cap", "tenant_cap"]
    tx_set_cap(db_session, tx_tenant.name, None)
    assert claim(db_session, a, boot.boot_id).outcome == ClaimOutcome.CLAIMED
    parked = claim(db_session, b, boot.boot_id)
    assert (parked.outcome, parked.wait_reason) == (ClaimOutcome.SLOT_WAIT, "concurrency")


def test_raising_a_cap_wakes_as_many_runs_as_it_freed_oldest_first(db_session, tx_admit,
                                                                   tx_tenant, boot_factory):
    """Cap 1 -> 5 with 6 waiting: the 4 oldest are woken at once (not one per repair
    tick), and all 4 pass the claim; the 2 newest still wait. A newer queued run (its
    message not yet taken) stands behind them, so it does not take one of the slots."""
    boot = boot_factory()
    first, *waiting = parked_behind_a_cap(db_session, tx_admit, tx_tenant, boot, 1, 7)
    newcomer = tx_admit("echo")  # queued and due, younger than every waiter
    tx_set_cap(db_session, tx_tenant.name, 5)
    assert [tx_state(db_session, r)[0] for r in waiting] == ["queued"] * 4 + ["waiting"] * 2
    assert [claim(db_session, r, boot.boot_id).outcome for r in waiting[:4]] == [
        ClaimOutcome.CLAIMED] * 4
    assert claim(db_session, newcomer, boot.boot_id).wait_reason == "tenant_cap"


def test_a_cap_raised_counts_older_queued_runs_and_a_cap_lowered_wakes_none(
        db_session, tx_admit, tx_tenant, boot_factory):
    """An older queued run takes a slot first: cap 1 -> 3 with one running, one older run
    queued (not yet claimed) and two waiting wakes one. Lowering the cap frees nothing."""
    from sqlalchemy import text

    boot = boot_factory()
    first, *waiting = parked_behind_a_cap(db_session, tx_admit, tx_tenant, boot, 1, 4)
    # waiting[0] was woken (a holder's end, say) and its message is on the way.
    db_session.execute(text("UPDATE runs SET status = 'queued', wait_reason = NULL "
                            "WHERE id = :run"), {"run": waiting[0]})
    tx_set_cap(db_session, tx_tenant.name, 3)
    assert [tx_state(db_session, r)[0] for r in waiting] == ["queued", "queued", "waiting"]
    tx_set_cap(db_session, tx_tenant.name, 1)
    assert tx_state(db_session, waiting[2]) == ("waiting", "tenant_cap")


def test_repair_wakes_runs_left_waiting_for_a_cap_that_is_gone(db_session, tx_admit, tx_tenant,
                                                              boot_factory):
    """A cap lifted without its wake-up (by SQL, or before this rule): beat's repair wakes
    every run still waiting for it, in one tick."""
    from sqlalchemy import text

    from app.state.runs import wake_waiting_runs

    boot = boot_factory()
    first, *waiting = parked_behind_a_cap(db_session, tx_admit, tx_tenant, boot, 1, 4)
    db_session.execute(text("UPDATE tenants SET max_running = NULL WHERE id = :id"),
                       {"id": tx_tenant.id})
    woken = {row.id for row in wake_waiting_runs(on_session(db_session), limit=None)}
    assert set(waiting) <= woken
    assert [tx_state(db_session, r) for r in waiting] == [("queued", None)] * 3


def test_repair_wakes_as_many_as_a_raised_cap_frees(db_session, tx_admit, tx_tenant,
                                                    boot_factory):
    """A cap raised behind the claims' back (1 -> 5, by SQL): one repair tick wakes the 4
    oldest of 6 waiting, not one per tick."""
    from sqlalchemy import text

    from app.state.runs import wake_waiting_runs

    boot = boot_factory()
    first, *waiting = parked_behind_a_cap(db_session, tx_admit, tx_tenant, boot, 1, 7)
    db_session.execute(text("UPDATE tenants SET max_running = 5 WHERE id = :id"),
                       {"id": tx_tenant.id})
    wake_waiting_runs(on_session(db_session), limit=None)
    assert [tx_state(db_session, r)[0] for r in waiting] == ["queued"] * 4 + ["waiting"] * 2


def test_a_run_left_waiting_for_a_gone_cap_does_not_block_its_group(db_session, tx_admit,
                                                                   tx_tenant, boot_factory):
    """A run of key k left waiting for a cap that is gone counts ahead of k's newer runs
    (FIFO), which then wait for k's slot. One repair wakes the stranded run; it runs, and its
    end hands k's slot on (waking the newer run instead would park it again behind the
    stranded one every tick, forever)."""
    from sqlalchemy import text

    from app.state.claims import finish_run
    from app.state.runs import wake_waiting_runs

    boot = boot_factory()
    tx_set_cap(db_session, tx_tenant.name, 1)
    blocker = tx_admit("echo")
    assert claim(db_session, blocker, boot.boot_id).outcome == ClaimOutcome.CLAIMED
    stranded = tx_admit("keyed", {"customer": "k"})
    assert claim(db_session, stranded, boot.boot_id).wait_reason == "tenant_cap"
    db_session.execute(text("UPDATE tenants SET max_running = NULL WHERE id = :id"),
                       {"id": tx_tenant.id})
    newer = tx_admit("keyed", {"customer": "k"})
    assert claim(db_session, newer, boot.boot_id).wait_reason == "concurrency"

    woken = {row.id for row in wake_waiting_runs(on_session(db_session), limit=None)}
    assert stranded in woken and newer not in woken  # newer stands behind it in k's line
    assert claim(db_session, stranded, boot.boot_id).outcome == ClaimOutcome.CLAIMED
    assert finish_run(on_session(db_session), stranded, boot.boot_id, status="succeeded")
    db_session.commit()
    assert claim(db_session, newer, boot.boot_id).outcome == ClaimOutcome.CLAIMED


def test_a_cap_lift_racing_a_claim_that_parks_still_wakes_it(app, admit, tenant, boot_factory,
                                                            pg):
    """B's claim read the cap, holds the tenant's lock and parks B (uncommitted); the cap
    lift waits for that lock, then its wake-up sees B waiting: no run left waiting for a
    cap that is gone. Without the lock, the lift's snapshot misses B, which then waits."""
    from app.extensions import db

    set_cap(app, tenant.name, 1)
    a_run, b_run = admit("echo"), admit("echo")
    a, b = boot_factory(), boot_factory()
    with app.app_context():
        assert claim(db.session, a_run, a.boot_id).outcome == ClaimOutcome.CLAIMED
        parked = claim_run(on_session(db.session), b_run, b.boot_id, max_takeovers=max_takeovers_of)
        assert parked.outcome == ClaimOutcome.SLOT_WAIT  # not committed: B holds the lock

        done = {}

        def lift():
            from app.tenant_service import set_max_running

            with app.app_context():
                db.session.execute(db.text("SET application_name = 'test-cap-lifter'"))
                try:
                    set_max_running(tenant.name, None)
                    done["ok"] = True
                finally:
                    db.session.remove()

        thread = threading.Thread(target=lift, daemon=True)
        thread.start()
        try:
            wait_until_waiting_on_a_lock(pg, "test-cap-lifter")
        finally:
            db.session.commit()
            thread.join(10)
    assert done == {"ok": True}
    assert state(pg, b_run)[:2] == ("queued", None)
    assert events_of(pg, b_run) == ["run.admitted", "run.waiting", "run.woken"]
