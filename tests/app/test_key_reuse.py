"""A key's reuse policy: what a dispatch_key may do once its run ended.

``@workflow(key_reuse=...)``: ``never`` (default: the key names its run forever),
``after_failure`` (a failed or cancelled run's key admits a new run),
``after_end`` (any ended run's), with an optional ``key_ttl``. Decided in the
statement that releases the key (``app/state/runs.py: RELEASE_KEY``) and by the
partial unique index; never by a read first.
"""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

import tests.workflows.reuse  # noqa: F401 - registers the reuse-* workflows
from app.state.executor import on_session
from tests.app import admission_paths
from workers.registry import InvalidDefinition, Step, Workflow, action

# Each admission test on both HTTP layers: Flask's view, and the fast path.
admission_path = admission_paths.admission_path
client = admission_paths.client
db_session = admission_paths.db_session


def post(client, tenant, ref, key, **input):
    return client.post("/v1/runs", json={"workflow_ref": ref, "input": input,
                                         "dispatch_key": key}, headers=tenant.headers)


def end(db, run_id, status, ago: float = 0.0):
    """Make ``run_id`` have ended ``status`` ``ago`` seconds ago (as a worker would)."""
    from sqlalchemy import text

    db.execute(text("UPDATE runs SET status = :status, "
                    "finished_at = now() - make_interval(secs => :ago) WHERE id = :run"),
               {"status": status, "ago": ago, "run": run_id})


def test_the_default_policy_replays_a_failed_run(client, tx_tenant, db_session):
    first = post(client, tx_tenant, "reuse-never", "K", n=1)
    end(db_session, first.json["id"], "failed")
    again = post(client, tx_tenant, "reuse-never", "K", n=1)
    assert again.status_code == 200 and again.json["id"] == first.json["id"]
    assert again.json["status"] == "failed" and again.json["key_released"] is False


def test_after_failure_a_new_request_takes_a_failed_runs_key(client, tx_tenant, db_session):
    first = post(client, tx_tenant, "reuse-after-failure", "K", n=1)
    end(db_session, first.json["id"], "failed")
    # (One transaction here: now() is the same for both runs; make the first older.)
    from sqlalchemy import text

    db_session.execute(text("UPDATE runs SET created_at = created_at - interval '1 second' "
                            "WHERE id = :run"), {"run": first.json["id"]})
    # Any input: a re-admission after a failure is a new request.
    second = post(client, tx_tenant, "reuse-after-failure", "K", n=2)
    assert second.status_code == 201 and second.json["id"] != first.json["id"]
    # The key moved: a replay answers with the new run, once and for all.
    third = post(client, tx_tenant, "reuse-after-failure", "K", n=2)
    assert third.status_code == 200 and third.json["id"] == second.json["id"]
    # Every earlier run stays readable under its key, newest first.
    listed = client.get("/v1/runs?dispatch_key=K", headers=tx_tenant.headers).json["runs"]
    assert [r["id"] for r in listed] == [second.json["id"], first.json["id"]]
    assert [r["key_released"] for r in listed] == [False, True]
    assert {r["dispatch_key"] for r in listed} == {"K"}


@pytest.mark.parametrize("status", ["succeeded", "queued", "running"])
def test_after_failure_keeps_a_key_whose_run_did_not_fail(client, tx_tenant, db_session, status):
    """The witness of the rule in the statement: the holder's status is checked where the
    key is released (a release decided by an earlier read would take a live run's key)."""
    first = post(client, tx_tenant, "reuse-after-failure", "K", n=1)
    if status != "queued":
        end(db_session, first.json["id"], status)
    again = post(client, tx_tenant, "reuse-after-failure", "K", n=1)
    assert again.status_code == 200 and again.json["id"] == first.json["id"]


@pytest.mark.parametrize("ref", ["reuse-after-failure", "reuse-after-end"])
def test_a_poisoned_runs_key_is_reused_like_a_failed_runs(client, tx_tenant, db_session, ref):
    """A poisoned run failed (it killed its workers): after_failure and after_end take its
    key; never (the default) replays it."""
    first = post(client, tx_tenant, ref, "K", n=1)
    end(db_session, first.json["id"], "poisoned")
    from sqlalchemy import text

    db_session.execute(text("UPDATE runs SET created_at = created_at - interval '1 second' "
                            "WHERE id = :run"), {"run": first.json["id"]})
    second = post(client, tx_tenant, ref, "K", n=1)
    assert second.status_code == 201 and second.json["id"] != first.json["id"]
    replay = post(client, tx_tenant, "reuse-never", "P", n=1)
    end(db_session, replay.json["id"], "poisoned")
    again = post(client, tx_tenant, "reuse-never", "P", n=1)
    assert again.status_code == 200 and again.json["status"] == "poisoned"


def test_after_failure_takes_a_cancelled_runs_key(client, tx_tenant, db_session):
    first = post(client, tx_tenant, "reuse-after-failure", "K")
    assert client.post(f"/v1/runs/{first.json['id']}/cancel",
                       headers=tx_tenant.headers).status_code < 300
    assert post(client, tx_tenant, "reuse-after-failure", "K").status_code == 201


def test_after_end_takes_a_succeeded_runs_key(client, tx_tenant, db_session):
    first = post(client, tx_tenant, "reuse-after-end", "K", n=1)
    end(db_session, first.json["id"], "succeeded")
    second = post(client, tx_tenant, "reuse-after-end", "K", n=1)
    assert second.status_code == 201 and second.json["id"] != first.json["id"]


@pytest.mark.parametrize("ago, reused", [(59, False), (61, True)])
def test_key_ttl_holds_the_key_until_it_passed(client, tx_tenant, db_session, ago, reused):
    first = post(client, tx_tenant, "reuse-after-end-ttl", "K")
    end(db_session, first.json["id"], "succeeded", ago=ago)
    again = post(client, tx_tenant, "reuse-after-end-ttl", "K")
    assert (again.status_code, again.json["id"] != first.json["id"]) == \
        ((201, True) if reused else (200, False))


def test_another_workflows_ended_run_keeps_its_key(client, tx_tenant, db_session):
    """The policy is the requesting workflow's, and only over its own runs: a key held by
    another workflow's failed run is a conflict, as it always was."""
    first = post(client, tx_tenant, "reuse-never", "K")
    end(db_session, first.json["id"], "failed")
    clash = post(client, tx_tenant, "reuse-after-failure", "K")
    assert clash.status_code == 409
    assert clash.json["error"]["details"]["run_id"] == first.json["id"]


RACERS = 10


def test_racing_readmissions_after_a_failure_make_exactly_one_new_run(app, tenant, pg,
                                                                     database_url):
    """10 callers of admit_run on their own connections, after the key's run failed."""
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session
    from sqlalchemy.pool import NullPool

    from app.admission import admit_run
    from app.extensions import db

    with app.app_context():
        failed = admit_run(on_session(db.session), tenant_id=tenant.id,
                           workflow_ref="reuse-after-failure",
                           input={}, dispatch_key="race").run.id
        db.session.commit()
    pg.execute("UPDATE runs SET status = 'failed', finished_at = now() WHERE id = %s", [failed])

    engine = create_engine(database_url, poolclass=NullPool)
    barrier = threading.Barrier(RACERS, timeout=60)

    def readmit(_):
        with app.app_context(), Session(bind=engine) as session:
            session.connection()
            barrier.wait()
            admission = admit_run(on_session(session), tenant_id=tenant.id,
                                  workflow_ref="reuse-after-failure", input={"retry": True},
                                  dispatch_key="race")
            session.commit()
            return admission.run.id, admission.created

    with ThreadPoolExecutor(RACERS) as pool:
        results = list(pool.map(readmit, range(RACERS)))
    engine.dispose()
    ids = {run_id for run_id, _ in results}
    assert len(ids) == 1 and failed not in ids
    assert sum(created for _, created in results) == 1
    holders = pg.execute("SELECT count(*) FROM runs WHERE tenant_id = %s AND dispatch_key = "
                         "'race'", [tenant.id]).fetchone()[0]
    released = pg.execute("SELECT count(*) FROM runs WHERE tenant_id = %s AND released_key = "
                          "'race'", [tenant.id]).fetchone()[0]
    assert (holders, released) == (1, 1)


def test_a_readmission_waiting_on_an_uncommitted_one_replays_it(app, tenant, pg, database_url):
    """Deterministic: A releases the failed run's key and inserts (not committed); B
    re-admits and waits on A's row; A commits; B answers with A's run, created once."""
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session
    from sqlalchemy.pool import NullPool

    from app.admission import admit_run
    from tests.conftest import wait_until_waiting_on_a_lock

    with app.app_context():
        from app.extensions import db

        failed = admit_run(on_session(db.session), tenant_id=tenant.id,
                           workflow_ref="reuse-after-failure",
                           input={}, dispatch_key="order").run.id
        db.session.commit()
    pg.execute("UPDATE runs SET status = 'failed', finished_at = now() WHERE id = %s", [failed])
    engine_a = create_engine(database_url, poolclass=NullPool)
    engine = create_engine(database_url, poolclass=NullPool,
                           connect_args={"application_name": "reuse-b"})
    with app.app_context(), Session(bind=engine_a) as a, Session(bind=engine) as b:
        first = admit_run(on_session(a), tenant_id=tenant.id, workflow_ref="reuse-after-failure",
                          input={"retry": True}, dispatch_key="order")
        assert first.created
        outcome = {}
        waiter = threading.Thread(target=lambda: outcome.update(second=admit_run(
            on_session(b), tenant_id=tenant.id, workflow_ref="reuse-after-failure",
            input={"retry": True},
            dispatch_key="order")))
        waiter.start()
        wait_until_waiting_on_a_lock(pg, "reuse-b")
        a.commit()
        waiter.join(30)
        b.commit()
    engine.dispose()
    engine_a.dispose()
    assert outcome["second"].created is False
    assert outcome["second"].run.id == first.run.id


def test_policies_are_checked_when_a_workflow_is_declared():
    steps = [Step("main", actions=[action(lambda ctx, input: None, position=0)])]
    with pytest.raises(InvalidDefinition, match="key_reuse"):
        Workflow(f"w{uuid.uuid4().hex[:6]}", "1", steps, key_reuse="sometimes")
    with pytest.raises(InvalidDefinition, match="key_ttl"):
        Workflow(f"w{uuid.uuid4().hex[:6]}", "1", steps, key_ttl=10)
    with pytest.raises(InvalidDefinition, match="key_ttl"):
        Workflow(f"w{uuid.uuid4().hex[:6]}", "1", steps, key_reuse="after_end", key_ttl=-1)
