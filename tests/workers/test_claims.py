"""Deterministic rule tests of claims: no scheduling involved, real Postgres."""

from __future__ import annotations

import time

import psycopg
import pytest

from app.state.claims import ClaimOutcome, claim_run, finish_run, release_claim
from app.state.executor import on_session
from workers.registry import max_takeovers_of

from .conftest import long_gone, wait_backend_gone


@pytest.fixture
def session(app):
    from app.extensions import db

    with app.app_context():
        yield db.session
        db.session.rollback()


def claim(session, run_id, boot_id):
    result = claim_run(on_session(session), run_id, boot_id, max_takeovers=max_takeovers_of)
    session.commit()
    return result


def connect_to(dsn):
    return psycopg.connect(dsn, autocommit=True)


def hold_as(pg, run_id, boot_id, **columns):
    """Put ``run_id`` in the state a claim by ``boot_id`` leaves (attempt 1), plus ``columns``."""
    sets = ", ".join(f"{name} = %({name})s" for name in columns)
    pg.execute("UPDATE runs SET status = 'running', claimed_by = %(boot)s, attempt = 1"
               + (f", {sets}" if sets else "") + " WHERE id = %(run)s",
               {"boot": boot_id, "run": run_id, **columns})


def events_of(pg, run_id):
    return [r[0] for r in pg.execute(
        "SELECT event_type FROM outbox WHERE run_id = %s ORDER BY id", [run_id])]


def status_of(pg, run_id):
    return pg.execute("SELECT status, claimed_by, attempt FROM runs WHERE id = %s",
                      [run_id]).fetchone()


def test_first_delivery_claims_a_queued_run(session, admit, boot_factory, pg):
    run_id, boot = admit(), boot_factory()
    result = claim(session, run_id, boot.boot_id)
    assert result.outcome == ClaimOutcome.CLAIMED
    assert status_of(pg, run_id) == ("running", boot.boot_id, 1)


def test_same_boot_second_delivery_is_a_duplicate_not_wreckage(session, admit, boot_factory,
                                                                pg):
    """1: same-boot claim with no finish yet."""
    run_id, boot = admit(), boot_factory()
    assert claim(session, run_id, boot.boot_id).outcome == ClaimOutcome.CLAIMED
    again = claim(session, run_id, boot.boot_id)
    assert again.outcome == ClaimOutcome.DUPLICATE
    assert status_of(pg, run_id) == ("running", boot.boot_id, 1)


def test_another_live_boots_claim_is_a_duplicate(session, admit, boot_factory, pg):
    """2: another live boot holds it."""
    run_id, holder, other = admit(), boot_factory(), boot_factory()
    assert claim(session, run_id, holder.boot_id).outcome == ClaimOutcome.CLAIMED
    result = claim(session, run_id, other.boot_id)
    assert result.outcome == ClaimOutcome.DUPLICATE
    assert result.holder == holder.boot_id
    assert status_of(pg, run_id) == ("running", holder.boot_id, 1)


def test_a_dead_boots_claim_is_taken_over_and_the_attempt_counted(session, admit, boot_factory,
                                                                   dead_boot, pg):
    """3: the holder's process was killed, its lock is gone."""
    run_id, dead = admit(), dead_boot()
    hold_as(pg, run_id, dead)
    rescuer = boot_factory()
    result = claim(session, run_id, rescuer.boot_id)
    assert result.outcome == ClaimOutcome.TAKEN_OVER
    assert result.holder == dead
    assert status_of(pg, run_id) == ("running", rescuer.boot_id, 2)
    assert events_of(pg, run_id) == ["run.admitted", "run.resumed"]


def test_a_boot_whose_lock_connection_closed_is_gone_only_after_its_bound(session, admit,
                                                                          boot_factory, pg):
    """Its lock went a moment ago: its process may still run the body (until its fence),
    so the run stays its own; the claim that found the lock free stamps when. Once that
    stamp is the boot's bound old, the run is taken over."""
    run_id, holder = admit(), boot_factory()
    assert claim(session, run_id, holder.boot_id).outcome == ClaimOutcome.CLAIMED
    holder.close()  # the connection that held the lock is gone
    rescuer = boot_factory()
    assert claim(session, run_id, rescuer.boot_id).outcome == ClaimOutcome.DUPLICATE
    assert status_of(pg, run_id) == ("running", holder.boot_id, 1)
    seen, bound = pg.execute("SELECT clock_timestamp() - first_seen_dead_at, dead_after_seconds "
                             "FROM worker_boots WHERE boot_id = %s",
                             [holder.boot_id]).fetchone()
    assert 0 <= seen.total_seconds() < 60 and bound == holder.settings.client_seconds + 3
    long_gone(pg, holder.boot_id)
    assert claim(session, run_id, rescuer.boot_id).outcome == ClaimOutcome.TAKEN_OVER


@pytest.mark.parametrize("final", ["succeeded", "failed", "cancelled"])
def test_a_finished_run_is_never_executed_again(session, admit, boot_factory, dead_boot, pg,
                                                final):
    """4: terminal runs ignore every delivery, from live and fresh boots alike."""
    run_id, boot = admit(), boot_factory()
    claim(session, run_id, boot.boot_id)
    assert finish_run(on_session(session), run_id, boot.boot_id, status=final, result={"ok": True})
    session.commit()
    for deliverer in (boot.boot_id, boot_factory().boot_id):
        assert claim(session, run_id, deliverer).outcome == ClaimOutcome.FINISHED
    assert status_of(pg, run_id)[0] == final


def test_release_is_scoped_to_the_claiming_boot(session, admit, boot_factory, pg):
    """5: a boot releasing after its claim was taken over changes nothing."""
    run_id, first = admit(), boot_factory()
    assert claim(session, run_id, first.boot_id).outcome == ClaimOutcome.CLAIMED
    first.close()  # first is cut off: dead to everyone else
    long_gone(pg, first.boot_id)
    second = boot_factory()
    assert claim(session, run_id, second.boot_id).outcome == ClaimOutcome.TAKEN_OVER

    assert release_claim(on_session(session), run_id, first.boot_id) is False
    session.commit()
    assert status_of(pg, run_id) == ("running", second.boot_id, 2)

    assert release_claim(on_session(session), run_id, second.boot_id) is True
    session.commit()
    assert status_of(pg, run_id) == ("queued", None, 1)  # a release gives its attempt back


def test_finish_is_fenced_by_the_claim(session, admit, boot_factory, pg):
    """A worker cut off and taken over cannot finish the run afterwards."""
    run_id, first = admit(), boot_factory()
    claim(session, run_id, first.boot_id)
    first.close()
    long_gone(pg, first.boot_id)
    second = boot_factory()
    claim(session, run_id, second.boot_id)
    assert finish_run(on_session(session), run_id, first.boot_id, status="succeeded",
                      result=1) is False
    session.commit()
    assert status_of(pg, run_id)[0] == "running"
    assert finish_run(on_session(session), run_id, second.boot_id, status="succeeded",
                      result=2) is True
    session.commit()
    row = pg.execute("SELECT status, result FROM runs WHERE id = %s", [run_id]).fetchone()
    assert row == ("succeeded", 2)


def test_cancelled_before_start_is_never_claimed(session, admit, boot_factory, client, tenant,
                                                  pg):
    run_id = admit()
    r = client.post(f"/v1/runs/{run_id}/cancel", headers=tenant.headers)
    assert r.status_code == 200 and r.json["status"] == "cancelled"
    assert claim(session, run_id, boot_factory().boot_id).outcome == ClaimOutcome.FINISHED
    assert status_of(pg, run_id)[0] == "cancelled"


def test_a_retry_that_is_not_due_is_not_claimed(session, admit, boot_factory, pg):
    run_id = admit()
    pg.execute("UPDATE runs SET not_before = now() + interval '1 hour' WHERE id = %s", [run_id])
    assert claim(session, run_id, boot_factory().boot_id).outcome == ClaimOutcome.NOT_DUE
    assert status_of(pg, run_id)[0] == "queued"


def test_a_result_postgres_refuses_fails_the_run_instead_of_stranding_it(app, admit, pg,
                                                                          fresh_boot):
    from workers.execution import execute_run

    run_id = admit("unstorable")
    with app.app_context():
        assert execute_run(str(run_id)).outcome == ClaimOutcome.CLAIMED
    status, error = pg.execute("SELECT status, error FROM runs WHERE id = %s",
                               [run_id]).fetchone()
    assert status == "failed"
    assert error["type"] == "poimen.ResultNotStorable"


def test_execute_in_process_runs_the_workflow_once(app, admit, pg, fresh_boot):
    from workers.execution import execute_run

    run_id = admit("echo", {"x": 1})
    with app.app_context():
        assert execute_run(str(run_id)).outcome == ClaimOutcome.CLAIMED
        assert execute_run(str(run_id)).outcome == ClaimOutcome.FINISHED
    assert pg.execute("SELECT status, result FROM runs WHERE id = %s",
                      [run_id]).fetchone() == ("succeeded", {"x": 1})


def test_a_claim_is_one_statement_in_autocommit(app, admit, pg, fresh_boot, statements):
    """The claim (and its event) is one round trip: no BEGIN and COMMIT around it."""
    from workers.execution import execute_run

    run_id = admit("echo", {"x": 1})
    statements.clear()
    with app.app_context():
        assert execute_run(str(run_id)).outcome == ClaimOutcome.CLAIMED
    claims = [autocommit for sql, autocommit in statements if "SET status = 'running'" in sql]
    assert claims == [True], statements
    assert pg.execute("SELECT status FROM runs WHERE id = %s", [run_id]).fetchone() == (
        "succeeded",)


def test_a_run_ends_in_one_statement_in_autocommit(app, admit, pg, fresh_boot, statements):
    """A run outside every limited group ends (its last entry closed, the run
    finished, their events) in one statement, in autocommit: a run costs two round trips."""
    from workers.execution import execute_run

    warm, run_id = admit("echo", {"x": 0}), admit("echo", {"x": 1})
    with app.app_context():
        execute_run(str(warm))  # this process's boot is registered by its first claim
    statements.clear()
    with app.app_context():
        assert execute_run(str(run_id)).outcome == ClaimOutcome.CLAIMED
    assert len(statements) == 2, [sql for sql, _ in statements]
    (claim, claim_autocommit), (finish, finish_autocommit) = statements
    assert "SET status = 'running'" in claim and claim_autocommit
    assert finish.startswith("SELECT * FROM poimen_finish(") and "%(entry_mode)s" in finish
    assert finish_autocommit, "the finish ran inside a transaction (BEGIN ... COMMIT)"
    events = [r[0] for r in pg.execute(
        "SELECT event_type FROM outbox WHERE run_id = %s ORDER BY id", [run_id])]
    assert events == ["run.admitted", "run.started", "run.succeeded"]  # a bare function: no
    # step events (a workflow of steps gets step.entered, step.<status>, run.<status> in
    # that order from the same statement: tests/workers/test_step_entry_dispatch.py)


def test_a_limited_workflows_message_claims_under_the_slot_locks_first(app, admit, pg,
                                                                         fresh_boot, statements):
    """A limited run's cost: a message whose shadow names a workflow with a concurrency limit
    claims with one call that takes the group's locks and then counts the slots
    (``poimen_claim_slot``), not after a refused one-statement claim and a state read, and
    ends with one call that takes the locks and then ends it (``poimen_finish``):
    one statement each, in autocommit, like an unlimited run. The hint picks the path; the
    statements decide: a duplicate delivery of the claimed run does nothing."""
    from workers.execution import execute_run, limited_workflow

    assert limited_workflow("runs.execute[keyed@1]") and limited_workflow("runs.execute[pair]")
    assert not limited_workflow("runs.execute[echo@1]")
    assert not limited_workflow("runs.execute[no-such-workflow@1]")
    assert not limited_workflow(None) and not limited_workflow("runs.execute")

    warm, run_id = admit("echo", {"x": 0}), admit("pair", {"key": "hint"})
    with app.app_context():
        execute_run(str(warm))  # this process's boot is registered by its first claim
    statements.clear()
    with app.app_context():
        assert execute_run(str(run_id), limited=True).outcome == ClaimOutcome.CLAIMED
    assert len(statements) == 2, statements
    (claim_sql, claim_autocommit), (end_sql, end_autocommit) = statements
    assert claim_sql.startswith("SELECT * FROM poimen_claim_slot(") and claim_autocommit
    assert end_sql.startswith("SELECT * FROM poimen_finish(") and end_autocommit
    assert status_of(pg, run_id)[0] == "succeeded"
    with app.app_context():
        assert execute_run(str(run_id), limited=True).outcome == ClaimOutcome.FINISHED
    # A wrong hint (the run is of no limited group) still claims it, through the same rule.
    other = admit("echo", {"x": 2})
    with app.app_context():
        assert execute_run(str(other), limited=True).outcome == ClaimOutcome.CLAIMED
    assert status_of(pg, other)[0] == "succeeded"


def test_a_run_pinned_to_a_version_this_worker_lacks_is_given_back_uncounted(app, admit, pg,
                                                                             fresh_boot):
    """The worker cannot load the run's workflow (a rolling deploy): back to queued, the
    attempt given back, the boot kept."""
    from workers.boots import boot_dsn, current_boot
    from workers.execution import execute_run

    run_id = admit("echo")
    pg.execute("UPDATE runs SET workflow_version = '999' WHERE id = %s", [run_id])
    with app.app_context():
        boot_before = current_boot(boot_dsn).boot_id
        execute_run(str(run_id))
        assert current_boot(boot_dsn).boot_id == boot_before  # a clean release keeps it
    assert status_of(pg, run_id) == ("queued", None, 0)
    events = [r[0] for r in pg.execute(
        "SELECT event_type FROM outbox WHERE run_id = %s ORDER BY id", [run_id])]
    assert events == ["run.admitted", "run.started", "run.released"]


# Liveness is part of the claim -------------------------------------------------------------

def terminate_lock_backend(pg, boot) -> None:
    """Cut the boot's lock connection server-side, as a restart or a failover would."""
    assert pg.execute("SELECT pg_terminate_backend(%s)", [boot.backend_pid]).fetchone()[0]
    wait_backend_gone(pg, boot.backend_pid)


def test_a_boot_cut_off_server_side_claims_nothing(session, admit, boot_factory, pg):
    """The process lives and psycopg still says the connection is fine; Postgres refuses."""
    run_id, boot = admit(), boot_factory()
    terminate_lock_backend(pg, boot)
    assert not boot.conn.closed and not boot.conn.broken  # the client has not noticed
    assert claim(session, run_id, boot.boot_id).outcome == ClaimOutcome.CLAIMER_DEAD
    assert status_of(pg, run_id) == ("queued", None, 0)
    assert events_of(pg, run_id) == ["run.admitted"]


def test_a_claimers_check_of_a_dead_boot_never_makes_it_look_live(session, boot_factory,
                                                                  dead_boot, dsn, pg):
    """A claim asks its own boot's liveness with a shared try-lock of the boot's key
    (``claimer_live_sql``). For a dead boot the try-lock succeeds, and the asking
    transaction holds the key, shared, until it ends: rescuers, repair and metrics must
    still see the boot dead (only an exclusive holder is live), or its runs would
    wait for a takeover that never comes while such a transaction lasts."""
    from app.liveness import boot_alive, claimer_live_sql, live_boot_count

    dead, live = dead_boot(), boot_factory()
    ask = f"SELECT {claimer_live_sql('%s')}"
    with psycopg.connect(dsn) as checker:  # one transaction, open until the end
        assert checker.execute(ask, [dead]).fetchone()[0] is False
        assert checker.execute(ask, [live.boot_id]).fetchone()[0] is True
        held = pg.execute(
            "SELECT l.mode FROM pg_locks l JOIN worker_boots b "
            "ON l.locktype = 'advisory' AND l.objid = CAST(b.lock_key AS oid) "
            "AND l.objsubid = 2 WHERE b.boot_id = %s AND l.granted "
            "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            [dead]).fetchall()
        assert held == [("ShareLock",)]  # the asking transaction's, on the dead key
        live_now = live_boot_count(session)
        assert not boot_alive(session, dead)
        assert boot_alive(session, live.boot_id)
        checker.rollback()
    assert live_boot_count(session) == live_now


def test_a_cut_off_boot_cannot_take_over_wreckage(session, admit, boot_factory, dead_boot, pg):
    run_id, dead = admit(), dead_boot()
    hold_as(pg, run_id, dead)
    rescuer = boot_factory()
    terminate_lock_backend(pg, rescuer)
    assert claim(session, run_id, rescuer.boot_id).outcome == ClaimOutcome.CLAIMER_DEAD
    assert status_of(pg, run_id) == ("running", dead, 1)


def test_the_takeover_statement_itself_requires_the_claimers_lock(session, admit, boot_factory,
                                                                   dead_boot, pg):
    """``claim_run`` checks liveness before it tries a takeover, but the lock can go
    between that read and the UPDATE: the UPDATE must refuse on its own."""
    from app.state.claims import TAKE_OVER

    run_id, dead = admit(), dead_boot()
    hold_as(pg, run_id, dead)
    rescuer = boot_factory()
    terminate_lock_backend(pg, rescuer)  # ... after claim_run's read saw it live
    row = session.execute(TAKE_OVER.call, {"run": run_id, "boot": rescuer.boot_id, "dead": dead,
                                            "max_takeovers": 5}).one_or_none()
    session.commit()
    assert row is None
    assert status_of(pg, run_id) == ("running", dead, 1)


def test_the_watchdog_notices_a_lock_cut_server_side_and_a_new_boot_claims(
        app, admit, pg, dsn, monkeypatch):
    from workers import boots

    monkeypatch.setenv("POIMEN_BOOT_PROBE_INTERVAL", "0.1")
    boots.end_current_boot()
    boots._watchdog_pid = None
    try:
        first = boots.current_boot(lambda: dsn)
        terminate_lock_backend(pg, first)
        deadline = time.monotonic() + 10
        while not first.lost.is_set():
            assert time.monotonic() < deadline, "the watchdog never noticed"
            time.sleep(0.05)
        second = boots.current_boot(lambda: dsn)
        assert second.boot_id != first.boot_id and second.probe()
        run_id = admit()
        with app.app_context():
            from app.extensions import db

            assert claim(db.session, run_id, second.boot_id).outcome == ClaimOutcome.CLAIMED
    finally:
        boots.end_current_boot()


def test_a_lock_key_held_elsewhere_fails_loudly_naming_the_holder(dsn, pg):
    from app.liveness import LOCK_NAMESPACE
    from workers.boots import Boot, LockKeyTaken

    next_key = pg.execute("SELECT last_value + 1 FROM worker_boot_lock_key").fetchone()[0]
    with connect_to(dsn) as squatter:
        squatter.execute("SELECT pg_advisory_lock(%s, %s)", [LOCK_NAMESPACE, next_key])
        squatter_pid = squatter.execute("SELECT pg_backend_pid()").fetchone()[0]
        started = time.monotonic()
        with pytest.raises(LockKeyTaken, match=f"backend pid {squatter_pid}"):
            Boot.register(dsn)
        assert time.monotonic() - started < 5


# Takeover limits and cancellation --------------------------------------------------------

def test_a_run_that_outlived_max_takeovers_workers_ends_poisoned(session, admit, boot_factory,
                                                                 dead_boot, pg):
    run_id, dead = admit(), dead_boot()
    hold_as(pg, run_id, dead, takeovers=5)  # the default max_takeovers
    outcome = claim(session, run_id, boot_factory().boot_id)
    assert outcome.outcome == ClaimOutcome.FINISHED
    status, error = pg.execute("SELECT status, error FROM runs WHERE id = %s",
                               [run_id]).fetchone()
    assert status == "poisoned" and error["code"] == "poisoned"
    assert events_of(pg, run_id) == ["run.admitted", "run.poisoned"]


def test_takeovers_below_the_limit_resume_and_count(session, admit, boot_factory, dead_boot, pg):
    run_id, dead = admit(), dead_boot()
    hold_as(pg, run_id, dead, takeovers=4)
    assert claim(session, run_id, boot_factory().boot_id).outcome == ClaimOutcome.TAKEN_OVER
    assert pg.execute("SELECT takeovers, attempt FROM runs WHERE id = %s",
                      [run_id]).fetchone() == (5, 2)


def test_taking_over_a_cancelled_run_ends_it_cancelled(session, admit, boot_factory, dead_boot,
                                                        pg):
    run_id, dead = admit(), dead_boot()
    hold_as(pg, run_id, dead, cancel_requested=True)
    assert claim(session, run_id, boot_factory().boot_id).outcome == ClaimOutcome.FINISHED
    assert status_of(pg, run_id)[0] == "cancelled"
    assert events_of(pg, run_id) == ["run.admitted", "run.cancelled"]


# Adoption: the process that lost its lock keeps its run only by a compare-and-set ---------

def test_adoption_moves_the_claim_to_the_new_boot(session, admit, boot_factory, dead_boot, pg):
    from app.state.claims import Adoption, adopt_run

    run_id, lost = admit(), dead_boot()
    hold_as(pg, run_id, lost)
    new = boot_factory()
    assert adopt_run(on_session(session), run_id, lost, new.boot_id, [lost]) == Adoption.ADOPTED
    session.commit()
    assert status_of(pg, run_id) == ("running", new.boot_id, 1)  # not a new attempt
    assert finish_run(on_session(session), run_id, [lost, new.boot_id], status="succeeded")
    session.commit()


def test_adoption_after_a_takeover_is_refused(session, admit, boot_factory, dead_boot, pg):
    from app.state.claims import Adoption, adopt_run

    run_id, lost = admit(), dead_boot()
    hold_as(pg, run_id, lost)
    rescuer = boot_factory()
    assert claim(session, run_id, rescuer.boot_id).outcome == ClaimOutcome.TAKEN_OVER
    new = boot_factory()
    assert adopt_run(on_session(session), run_id, lost, new.boot_id, [lost]) == Adoption.LOST
    session.commit()
    assert status_of(pg, run_id)[1] == rescuer.boot_id
    # ... and the lost boot's late finish is refused by the fence.
    assert not finish_run(on_session(session), run_id, [lost, new.boot_id], status="succeeded")
    session.rollback()


# Deterministic witnesses of the claim statements' atomicity: two sessions, explicit order --

def _blocked_claim(app, run_id, boot_id, pg):
    """Start ``claim_run`` in a thread on its own session; return once it waits on a row lock."""
    import threading

    from app.extensions import db
    from tests.conftest import wait_until_waiting_on_a_lock

    outcome = {}

    def deliver():
        with app.app_context():
            db.session.execute(db.text("SET application_name = 'test-second-claimer'"))
            outcome["claim"] = claim_run(on_session(db.session), run_id, boot_id,
                                         max_takeovers=max_takeovers_of)
            db.session.commit()

    thread = threading.Thread(target=deliver)
    thread.start()
    wait_until_waiting_on_a_lock(pg, "test-second-claimer")
    return thread, outcome


def test_a_claim_waiting_on_an_uncommitted_claim_does_not_claim_again(app, admit, boot_factory,
                                                                      pg, dsn):
    """Delivery A has claimed but not committed; delivery B reads 'queued' and tries.

    A conditional UPDATE re-checks the row Postgres hands it after A commits
    and finds it running: B is a duplicate. A check-then-update would claim
    it a second time.
    """
    from app.extensions import db

    run_id, a, b = admit(), boot_factory(), boot_factory()
    with app.app_context():
        first = claim_run(on_session(db.session), run_id, a.boot_id,
                          max_takeovers=max_takeovers_of)  # not committed yet
        assert first.outcome == ClaimOutcome.CLAIMED
        thread, outcome = _blocked_claim(app, run_id, b.boot_id, pg)
        db.session.commit()
    thread.join(10)
    assert outcome["claim"].outcome == ClaimOutcome.DUPLICATE
    assert status_of(pg, run_id) == ("running", a.boot_id, 1)
    assert events_of(pg, run_id) == ["run.admitted", "run.started"]


def test_two_rescuers_of_one_dead_boots_run_take_it_over_once(app, admit, boot_factory,
                                                              dead_boot, pg):
    """Rescuer A is taking the wreckage over (uncommitted) when B, which also saw the
    holder dead, tries: the compare-and-set on the dead boot id leaves B nothing."""
    from app.extensions import db

    run_id, dead = admit(), dead_boot()
    hold_as(pg, run_id, dead)
    a, b = boot_factory(), boot_factory()
    with app.app_context():
        assert claim_run(on_session(db.session), run_id, a.boot_id,
                         max_takeovers=max_takeovers_of).outcome == ClaimOutcome.TAKEN_OVER
        thread, outcome = _blocked_claim(app, run_id, b.boot_id, pg)
        db.session.commit()
    thread.join(10)
    assert outcome["claim"].outcome == ClaimOutcome.DUPLICATE
    assert pg.execute("SELECT claimed_by, attempt, takeovers FROM runs WHERE id = %s",
                      [run_id]).fetchone() == (a.boot_id, 2, 1)


@pytest.mark.parametrize("write", ["retry", "release", "finish"])
def test_every_fenced_write_of_a_boot_that_lost_its_claim_is_refused(session, admit,
                                                                     boot_factory, pg, write):
    from app.state.claims import schedule_retry

    run_id, first, second = admit(), boot_factory(), boot_factory()
    hold_as(pg, run_id, second.boot_id)  # taken over by ``second`` while ``first`` was cut off
    refused = {
        "retry": lambda: schedule_retry(on_session(session), run_id, first.boot_id, delay=1,
                                        error={"type": "x"}),
        "release": lambda: release_claim(on_session(session), run_id, first.boot_id),
        "finish": lambda: finish_run(on_session(session), run_id, first.boot_id,
                                     status="succeeded"),
    }[write]()
    session.commit()
    assert refused is False
    assert status_of(pg, run_id) == ("running", second.boot_id, 1)
    assert events_of(pg, run_id) == ["run.admitted"]


def test_a_run_whose_outcome_cannot_be_recorded_ends_the_boot(app, admit, pg, dsn, monkeypatch):
    """Recording fails for good (not a passing outage): the boot ends, so its run becomes
    wreckage that repair re-sends and a live boot takes over, instead of staying
    'running' under a live boot forever."""
    from sqlalchemy.exc import ProgrammingError

    from workers import boots, execution, fence

    def broken_finish(*args, **kwargs):
        raise ProgrammingError("UPDATE runs ...", {}, Exception("permission denied"))

    monkeypatch.setattr(fence, "finish_run", broken_finish)
    boots.end_current_boot()
    run_id = admit("echo", {})
    try:
        with app.app_context(), pytest.raises(ProgrammingError):
            execution.execute_run(str(run_id))
        status, holder, _ = status_of(pg, run_id)
        assert status == "running"
        from app.liveness import LIVE_BOOTS_SQL

        assert pg.execute(f"SELECT count(*) FROM ({LIVE_BOOTS_SQL} WHERE b.boot_id = %s) AS x",
                          [holder]).fetchone()[0] == 0  # its holder is dead: wreckage
    finally:
        boots.end_current_boot()


def test_repair_prunes_dead_boots_that_no_run_refers_to(session, admit, boot_factory,
                                                        dead_boot, pg):
    from app.state.boots import prune_dead_boots

    pg.execute("INSERT INTO worker_boots (boot_id, hostname, pid) "
               "SELECT gen_random_uuid(), 'gone', 1 FROM generate_series(1, 1000)")
    referenced = dead_boot()
    run_id = admit()
    hold_as(pg, run_id, referenced)
    live = boot_factory()
    assert prune_dead_boots(on_session(session)) == 1000
    session.commit()
    left = {r[0] for r in pg.execute("SELECT boot_id FROM worker_boots")}
    assert left == {referenced, live.boot_id}


def test_boot_lock_keys_wrap_around_and_skip_keys_still_in_use(boot_factory, dead_boot, pg):
    held = dead_boot()  # its row stays: some run could still refer to it
    # The sequence is at its end: the next key wraps to 1, then 2...
    pg.execute("SELECT setval('worker_boot_lock_key', 2147483647)")
    pg.execute("UPDATE worker_boots SET lock_key = 1 WHERE boot_id = %s", [held])
    boot = boot_factory()
    assert boot.lock_key == 2  # 1 is skipped: its boot row still exists


def test_a_finish_racing_its_own_adoption_is_recorded_under_the_new_boot(app, admit, pg,
                                                                         boot_factory,
                                                                         dead_boot):
    """The watchdog adopts the run for a new boot between the finish's read of the fence
    and its UPDATE: the finish must not report the claim lost (the run would stay
    running, though it completed); it writes again under the adopted boot."""
    from app.state.claims import adopt_run
    from workers import boots
    from workers.fence import Fence

    run_id, lost = admit(), dead_boot()
    hold_as(pg, run_id, lost)
    new = boot_factory()
    boots.hold(run_id, lost)
    adopted = []

    def finish_while_adopted(session, ours):
        if not adopted:  # the watchdog thread's adoption lands right now
            boots.hold_if_held(run_id, new.boot_id)
            with app.app_context():
                from app.extensions import db as other

                with other.engine.begin() as conn:
                    from sqlalchemy.orm import Session

                    assert adopt_run(on_session(Session(bind=conn)), run_id, lost,
                                     new.boot_id, ours)
            adopted.append(True)
        # ``session``: the fence's executor.
        return finish_run(session, run_id, ours, status="succeeded")

    try:
        with app.app_context():
            fence = Fence(run_id, tenant_id=0)
            assert fence._end(finish_while_adopted, fence._finished_by_us) is True
    finally:
        boots.let_go([run_id])
    assert status_of(pg, run_id)[:2] == ("succeeded", new.boot_id)
