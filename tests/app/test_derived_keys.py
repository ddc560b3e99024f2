"""Keys Poimen derives name one run forever: ``key_reuse`` is for the caller's keys only.

A schedule's tick (``schedule:<workflow>:<tick>``), an inbox message's place in its log
(``kafka:<topic>:<partition>:<offset>``, and so every DLQ replay of it) and a fan-out
child's key (admitted with origin ``fanout``) each stand for one intended run. A workflow
declaring ``key_reuse="after_end"`` must not turn a beat's re-admission of its latest tick,
a redelivered message or a resumed fan-out into a second run.

And one admission ends on a run even when the key changes hands between its statements:
on the single-request path each statement commits on its own, so another
request's release of an ended holder can land between this one's insert and its read.
"""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import text

import tests.workflows.reuse  # noqa: F401 - registers the reuse-* workflows
from app.models import AdmissionOrigin
from app.state.executor import on_session
from tests.app import admission_paths

TICK_KEY = "schedule:reuse-after-end:2026-12-05T01:00:00Z"
KAFKA_KEY = "kafka:poimen.acme.dispatch:0:17"

# Each admission test on both HTTP layers: Flask's view, and the fast path.
admission_path = admission_paths.admission_path
client = admission_paths.client
db_session = admission_paths.db_session


def end(db, run_id, status: str = "succeeded") -> None:
    """Make ``run_id`` have ended (as a worker would), a second ago."""
    db.execute(text("UPDATE runs SET status = :status, created_at = created_at - "
                    "interval '2 seconds', finished_at = now() - interval '1 second' "
                    "WHERE id = :run"), {"status": status, "run": run_id})


DERIVED = [
    pytest.param(AdmissionOrigin.SCHEDULE, TICK_KEY, id="schedule-tick"),
    pytest.param(AdmissionOrigin.HTTP, KAFKA_KEY, id="inbox-derived"),
    pytest.param(AdmissionOrigin.INTERNAL, TICK_KEY, id="tick-key-any-origin"),
    pytest.param(AdmissionOrigin.FANOUT, f"{uuid.uuid4()}/main/1/0/a", id="fanout-child"),
]


@pytest.mark.parametrize("status", ["succeeded", "failed"])
@pytest.mark.parametrize("origin, key", DERIVED)
def test_a_derived_key_is_never_released(app, db_session, tx_tenant, origin, key, status):
    from app.admission import admit_run

    with app.app_context():
        first = admit_run(on_session(db_session), tenant_id=tx_tenant.id,
                          workflow_ref="reuse-after-end",
                          input={"n": 1}, dispatch_key=key, origin=origin)
        assert first.created
        end(db_session, first.run.id, status)
        again = admit_run(on_session(db_session), tenant_id=tx_tenant.id,
                          workflow_ref="reuse-after-end",
                          input={"n": 1}, dispatch_key=key, origin=origin)
        count = db_session.execute(text("SELECT count(*) FROM runs WHERE tenant_id = :t"),
                                   {"t": tx_tenant.id}).scalar()
    assert again.created is False and again.run.id == first.run.id
    assert count == 1


def test_a_caller_key_is_still_released_by_its_policy(app, db_session, tx_tenant):
    """The control: the same workflow and statuses with a caller's key make a new run."""
    from app.admission import admit_run

    with app.app_context():
        first = admit_run(on_session(db_session), tenant_id=tx_tenant.id,
                          workflow_ref="reuse-after-end",
                          input={"n": 1}, dispatch_key="order-7", origin=AdmissionOrigin.HTTP)
        end(db_session, first.run.id)
        again = admit_run(on_session(db_session), tenant_id=tx_tenant.id,
                          workflow_ref="reuse-after-end",
                          input={"n": 1}, dispatch_key="order-7", origin=AdmissionOrigin.HTTP)
    assert again.created and again.run.id != first.run.id


@pytest.mark.parametrize("key", [TICK_KEY, KAFKA_KEY])
def test_http_and_batch_replay_an_ended_run_of_a_derived_key(client, db_session, tx_tenant, key):
    """As the inbox posts it (single and batch): a derived key's ended run is replayed."""
    body = {"workflow_ref": "reuse-after-end", "input": {"m": 1}, "dispatch_key": key}
    first = client.post("/v1/runs", json=body, headers=tx_tenant.headers)
    assert first.status_code == 201
    end(db_session, first.json["id"])
    again = client.post("/v1/runs", json=body, headers=tx_tenant.headers)
    assert again.status_code == 200 and again.json["id"] == first.json["id"]
    batch = client.post("/v1/runs/batch", json={"runs": [body]}, headers=tx_tenant.headers)
    assert batch.status_code < 300, batch.json
    [item] = batch.json["results"]
    assert item["status"] == 200 and item["run"]["id"] == first.json["id"], item


def test_a_key_released_between_the_insert_and_the_read_ends_on_a_run(app, tenant, pg):
    """Deterministic: on the single-request path, request A's insert finds the
    key held by a failed run; before A's own release runs, request B releases it (and
    has not inserted yet). A's release then finds nothing and its read finds no holder:
    A must go round (the index decides again), not fail."""
    from app.admission import admit_run
    from app.extensions import db
    from app.state.direct import OBSERVERS, SingleStatements, single_statements

    with app.app_context():
        failed = admit_run(on_session(db.session), tenant_id=tenant.id,
                           workflow_ref="reuse-after-failure",
                           input={}, dispatch_key="between").run.id
        db.session.commit()
        db.session.remove()
    pg.execute("UPDATE runs SET status = 'failed', finished_at = now() - interval '1 second' "
               "WHERE id = %s", [failed])

    cut = []

    def b_releases_first(statement: str) -> None:
        if "released_key = dispatch_key" in statement and not cut:
            cut.append(True)
            pg.execute("UPDATE runs SET released_key = dispatch_key, dispatch_key = NULL "
                       "WHERE id = %s", [failed])

    sent: list[dict] = []
    with app.app_context():
        store = single_statements(db.session, sent.append)
        assert isinstance(store, SingleStatements)
        OBSERVERS.append(b_releases_first)
        try:
            admission = admit_run(store, tenant_id=tenant.id,
                                  workflow_ref="reuse-after-failure", input={"again": True},
                                  dispatch_key="between", origin=AdmissionOrigin.HTTP)
            store.commit()
        finally:
            OBSERVERS.remove(b_releases_first)
            db.session.remove()
    assert cut, "the release never ran: the interleaving was not reached"
    assert admission.created and admission.run.id != failed
    holders = pg.execute("SELECT id FROM runs WHERE tenant_id = %s AND dispatch_key = "
                         "'between'", [tenant.id]).fetchall()
    assert [h[0] for h in holders] == [admission.run.id]
