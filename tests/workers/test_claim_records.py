"""What the claim statements record and return, exactly (in-process, real Postgres).

tests/workers/test_claims.py witnesses who may claim, take over and write; these
witness what each path leaves behind — the Claim a worker acts on, the row and
the event — in process, so that a change to what a claim records (app/state/claims.py,
app/state/sql/claims.sql) fails a fast test, not only a process test.
"""

from __future__ import annotations

import uuid

import pytest

from app.state.claims import (
    Adoption,
    Claim,
    ClaimOutcome,
    adopt_run,
    claim_run,
    finish_run,
    schedule_retry,
)
from app.state.executor import on_session
from workers.registry import max_takeovers_of, workflow


@workflow("fragile", version="1", max_takeovers=1)
def fragile(ctx, input):
    return {}


@pytest.fixture
def session(app):
    from app.extensions import db

    with app.app_context():
        yield db.session
        db.session.rollback()


def claim(session, run_id, boot_id) -> Claim:
    result = claim_run(on_session(session), run_id, boot_id, max_takeovers=max_takeovers_of)
    session.commit()
    return result


def row_of(pg, run_id) -> dict:
    cur = pg.execute("SELECT status, claimed_by, attempt, failures, error, takeovers, "
                     "not_before > now() + interval '20 seconds' AS later, "
                     "not_before < now() + interval '40 seconds' AS soon "
                     "FROM runs WHERE id = %s", [run_id])
    names = [c.name for c in cur.description]
    return dict(zip(names, cur.fetchone(), strict=True))


def events_of(pg, run_id) -> list[tuple[str, dict]]:
    return [(t, p) for t, p in pg.execute(
        "SELECT event_type, payload FROM outbox WHERE run_id = %s ORDER BY id", [run_id])]


def test_each_claim_names_its_outcome_run_boot_and_attempt(session, admit, boot_factory,
                                                           dead_boot, pg):
    boot = boot_factory()
    run_id = admit()
    claimed = claim(session, run_id, boot.boot_id)
    assert (claimed.outcome, claimed.run_id, claimed.boot_id, claimed.attempt) == (
        ClaimOutcome.CLAIMED, run_id, boot.boot_id, 1)
    assert claimed.run is not None and claimed.run.id == run_id

    assert finish_run(on_session(session), run_id, boot.boot_id, status="succeeded")
    session.commit()
    assert claim(session, run_id, boot.boot_id) == Claim(ClaimOutcome.FINISHED, run_id,
                                                         boot.boot_id)
    nowhere = uuid.uuid4()
    assert claim(session, nowhere, boot.boot_id) == Claim(ClaimOutcome.MISSING, nowhere,
                                                          boot.boot_id)
    joining = admit()
    pg.execute("UPDATE runs SET status = 'waiting' WHERE id = %s", [joining])
    assert claim(session, joining, boot.boot_id) == Claim(ClaimOutcome.WAITING, joining,
                                                          boot.boot_id)

    wreck, dead = admit(), dead_boot()
    pg.execute("UPDATE runs SET status = 'running', claimed_by = %s, attempt = 1 "
               "WHERE id = %s", [dead, wreck])
    taken = claim(session, wreck, boot.boot_id)
    assert (taken.outcome, taken.run_id, taken.boot_id, taken.attempt, taken.holder) == (
        ClaimOutcome.TAKEN_OVER, wreck, boot.boot_id, 2, dead)

    cut_off = boot_factory()
    cut_off.close()
    queued = admit()
    assert claim(session, queued, cut_off.boot_id) == Claim(ClaimOutcome.CLAIMER_DEAD, queued,
                                                            cut_off.boot_id)


def test_a_delivery_of_a_queued_run_with_a_cancel_request_ends_it_cancelled(
        session, admit, boot_factory, pg):
    """The request came while the run was between attempts (a retry, a release)."""
    run_id, boot = admit(), boot_factory()
    pg.execute("UPDATE runs SET cancel_requested = true WHERE id = %s", [run_id])
    assert claim(session, run_id, boot.boot_id) == Claim(ClaimOutcome.FINISHED, run_id,
                                                         boot.boot_id)
    assert row_of(pg, run_id)["status"] == "cancelled"
    assert [t for t, _ in events_of(pg, run_id)] == ["run.admitted", "run.cancelled"]


def test_a_retry_requeues_the_run_after_its_delay_with_its_error(session, admit, boot_factory,
                                                                 pg):
    run_id, boot = admit(), boot_factory()
    assert claim(session, run_id, boot.boot_id).outcome == ClaimOutcome.CLAIMED
    error = {"code": "ValueError", "message": "boom"}
    assert schedule_retry(on_session(session), run_id, boot.boot_id, delay=30, error=error)
    session.commit()
    row = row_of(pg, run_id)
    assert (row["status"], row["claimed_by"], row["failures"], row["error"]) == (
        "queued", None, 1, error)
    assert row["later"] and row["soon"], "not_before is not now + 30 s"
    kind, payload = events_of(pg, run_id)[-1]
    assert kind == "run.retrying"
    assert (payload["delay"], payload["error"], payload["attempt"]) == (30, error, 1)
    # The delay holds: a delivery now finds it not due.
    assert claim(session, run_id, boot.boot_id).outcome == ClaimOutcome.NOT_DUE


@pytest.mark.parametrize("status, error, failures", [
    ("succeeded", None, 0),
    ("cancelled", None, 0),
    ("failed", {"code": "KeyError", "message": "k"}, 1),
])
def test_a_finish_counts_a_failure_only_when_it_failed_and_its_event_carries_the_error(
        session, admit, boot_factory, pg, status, error, failures):
    run_id, boot = admit(), boot_factory()
    claim(session, run_id, boot.boot_id)
    assert finish_run(on_session(session), run_id, boot.boot_id, status=status, result={"r": 1},
                      error=error)
    session.commit()
    row = row_of(pg, run_id)
    assert (row["status"], row["failures"], row["error"]) == (status, failures, error)
    kind, payload = events_of(pg, run_id)[-1]
    assert kind == f"run.{status}"
    assert payload.get("error") == error
    assert ("error" in payload) is (error is not None)


def test_adopting_a_run_one_of_our_boots_already_holds_is_ours(session, admit, boot_factory,
                                                                dead_boot, pg):
    run_id, lost = admit(), dead_boot()
    pg.execute("UPDATE runs SET status = 'running', claimed_by = %s, attempt = 1 "
               "WHERE id = %s", [lost, run_id])
    new = boot_factory()
    assert adopt_run(on_session(session), run_id, lost, new.boot_id, [lost]) == Adoption.ADOPTED
    session.commit()
    # A second adoption (a retried write) finds it already under this process's boot.
    assert adopt_run(on_session(session), run_id, lost, new.boot_id,
                     [lost, new.boot_id]) == Adoption.OURS
    session.commit()
    assert row_of(pg, run_id)["claimed_by"] == new.boot_id


def test_a_workflows_own_max_takeovers_decides_when_a_lost_run_is_poisoned(session, admit,
                                                                           boot_factory,
                                                                           dead_boot, pg):
    """``fragile`` allows one takeover (the default is 5): the second loss poisons it."""
    run_id, dead = admit("fragile"), dead_boot()
    pg.execute("UPDATE runs SET status = 'running', claimed_by = %s, attempt = 2, "
               "takeovers = 1 WHERE id = %s", [dead, run_id])
    assert claim(session, run_id, boot_factory().boot_id).outcome == ClaimOutcome.FINISHED
    row = row_of(pg, run_id)
    assert row["status"] == "poisoned" and row["error"]["code"] == "poisoned"


def test_claims_that_do_nothing_still_name_run_boot_and_holder(session, admit, boot_factory,
                                                                dead_boot, pg):
    """DUPLICATE, NOT_DUE and an ended takeover: what the worker logs and reports."""
    holder, other = boot_factory(), boot_factory()
    run_id = admit()
    claim(session, run_id, holder.boot_id)
    assert claim(session, run_id, holder.boot_id) == Claim(
        ClaimOutcome.DUPLICATE, run_id, holder.boot_id, holder=holder.boot_id)
    assert claim(session, run_id, other.boot_id) == Claim(
        ClaimOutcome.DUPLICATE, run_id, other.boot_id, holder=holder.boot_id)

    assert schedule_retry(on_session(session), run_id, holder.boot_id, delay=30,
                          error={"code": "x"})
    session.commit()
    assert claim(session, run_id, other.boot_id) == Claim(ClaimOutcome.NOT_DUE, run_id,
                                                          other.boot_id)

    cancelled, dead = admit(), dead_boot()
    pg.execute("UPDATE runs SET status = 'running', claimed_by = %s, attempt = 1, "
               "cancel_requested = true WHERE id = %s", [dead, cancelled])
    assert claim(session, cancelled, other.boot_id) == Claim(
        ClaimOutcome.FINISHED, cancelled, other.boot_id, holder=dead)


def test_a_result_with_values_json_lacks_is_stored_as_their_text(session, admit, boot_factory,
                                                                 pg):
    """``_json`` writes what JSON has no type for (a datetime, a UUID) as its ``str``."""
    import datetime

    run_id, boot = admit(), boot_factory()
    claim(session, run_id, boot.boot_id)
    at = datetime.datetime(2026, 11, 29, 12, 0, tzinfo=datetime.UTC)
    assert finish_run(on_session(session), run_id, boot.boot_id, status="succeeded",
                      result={"at": at, "id": run_id})
    session.commit()
    stored = pg.execute("SELECT result FROM runs WHERE id = %s", [run_id]).fetchone()[0]
    assert stored == {"at": str(at), "id": str(run_id)}
