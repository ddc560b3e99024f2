"""``POST /v1/runs/batch`` and ``admit_many``, the same rule as one admission."""

from __future__ import annotations

import threading

import pytest

import tests.workflows.reuse  # noqa: F401 - registers the reuse-* workflows
from app.state.executor import on_session
from tests.app.test_idempotent_admission import count_runs, queued_task_ids
from tests.conftest import wait_until_waiting_on_a_lock

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def post_batch(client, creds, runs, headers=None):
    return client.post("/v1/runs/batch", json={"runs": runs},
                       headers={**creds.headers, **(headers or {})})


def events(db, run_id) -> list[str]:
    from sqlalchemy import text

    return list(db.execute(text("SELECT event_type FROM outbox WHERE run_id = :run"),
                           {"run": run_id}).scalars())


# In process, on the test's rolled-back transaction -------------------------------------------

def test_created_replayed_and_in_batch_repeats_answer_in_request_order(client, tx_tenant,
                                                                       db_session):
    first = post_batch(client, tx_tenant, [
        {"workflow_ref": "echo", "input": {"n": 1}, "dispatch_key": "a"}])
    assert first.status_code == 200
    [created] = first.json["results"]
    assert created["status"] == 201 and created["run"]["dispatch_key"] == "a"

    response = post_batch(client, tx_tenant, [
        {"workflow_ref": "echo", "input": {"n": 2}, "dispatch_key": "b"},   # created
        {"workflow_ref": "echo", "input": {"n": 1}, "dispatch_key": "a"},   # replay
        {"workflow_ref": "echo", "input": {"n": 2}, "dispatch_key": "b"},   # in-batch repeat
        {"workflow_ref": "echo", "input": {"n": 3}, "dispatch_key": "b"},   # differs: 409
        {"workflow_ref": "echo", "input": {"n": 9}},                        # no key: new
        {"workflow_ref": "echo", "input": {"n": 9}},                        # no key: new again
    ])
    assert response.status_code == 200
    results = response.json["results"]
    assert [r["status"] for r in results] == [201, 200, 200, 409, 201, 201]
    b_id = results[0]["run"]["id"]
    assert results[1]["run"]["id"] == created["run"]["id"]
    assert results[2]["run"]["id"] == b_id
    conflict = results[3]["error"]
    assert conflict["code"] == "dispatch_key_conflict"
    assert conflict["details"] == {"run_id": b_id, "dispatch_key": "b", "differs": ["input"]}
    assert results[4]["run"]["id"] != results[5]["run"]["id"]
    assert [r["run"]["input"] for r in results if "run" in r] == [
        {"n": 2}, {"n": 1}, {"n": 2}, {"n": 9}, {"n": 9}]
    assert count_runs(db_session, tx_tenant.id) == 4
    # One run.admitted event per created run, none for a replay.
    for r in (results[0], results[4], results[5], created):
        assert events(db_session, r["run"]["id"]) == ["run.admitted"]


def test_a_bad_item_is_refused_alone_as_the_single_endpoint_would(client, tx_tenant, db_session):
    single_unknown = client.post("/v1/runs", json={"workflow_ref": "no-such-flow"},
                                 headers=tx_tenant.headers)
    single_invalid = client.post("/v1/runs", json={"workflow_ref": "echo", "input": [1]},
                                 headers=tx_tenant.headers)
    # Byte for byte: 1e-16384 is a double (0.0) Postgres' numeric cannot hold (a DataError).
    body = ('{"runs": [{"workflow_ref": "no-such-flow"}, {"workflow_ref": "echo", "input": '
            '{"ok": 1}}, {"workflow_ref": "echo", "input": [1]}, "not an object", '
            '{"workflow_ref": "echo", "input": {"n": 1e-16384}}, '
            '{"workflow_ref": "echo", "input": {"ok": 2}, "dispatch_key": "fine"}]}')
    response = client.post("/v1/runs/batch", data=body.encode(),
                           content_type="application/json", headers=tx_tenant.headers)
    assert response.status_code == 200
    results = response.json["results"]
    assert [r["status"] for r in results] == [422, 201, 422, 400, 422, 201]
    assert results[0]["error"] == single_unknown.json["error"]
    assert results[2]["error"] == single_invalid.json["error"]
    assert results[3]["error"]["code"] == "invalid_body"
    assert results[4]["error"]["code"] == "validation_failed"
    assert "input" in results[4]["error"]["details"]["fields"]
    assert count_runs(db_session, tx_tenant.id) == 2
    assert all(events(db_session, r["run"]["id"]) == ["run.admitted"]
               for r in results if "run" in r)


def test_an_oversize_batch_is_413_and_admits_nothing(app, client, tx_tenant, db_session,
                                                     monkeypatch):
    monkeypatch.setitem(app.config, "POIMEN_BATCH_MAX", 3)
    response = post_batch(client, tx_tenant, [{"workflow_ref": "echo"}] * 4)
    assert response.status_code == 413
    assert response.json["error"]["code"] == "batch_too_large"
    assert response.json["error"]["details"] == {"max": 3, "given": 4}
    assert count_runs(db_session, tx_tenant.id) == 0
    assert post_batch(client, tx_tenant, [{"workflow_ref": "echo"}] * 3).status_code == 200


def test_the_default_batch_max_is_1000(app):
    assert app.config["POIMEN_BATCH_MAX"] == 1000


def test_an_empty_batch_answers_no_results(client, tx_tenant):
    response = post_batch(client, tx_tenant, [])
    assert response.status_code == 200 and response.json == {"results": []}


@pytest.mark.parametrize("body, status", [
    ([], 400), ({}, 422), ({"runs": {}}, 422), ({"runs": "x"}, 422), ({"runs": [], "x": 1}, 422)],
    ids=["array", "no runs", "runs an object", "runs a string", "unknown field"])
def test_a_body_without_a_runs_array_is_a_json_error(client, tx_tenant, db_session, body, status):
    response = client.post("/v1/runs/batch", json=body, headers=tx_tenant.headers)
    assert response.status_code == status
    assert set(response.json["error"]) == {"code", "message", "details"}


def test_an_idempotency_key_header_on_a_batch_is_refused(client, tx_tenant, db_session):
    response = post_batch(client, tx_tenant, [{"workflow_ref": "echo", "dispatch_key": "k"}],
                          headers={"Idempotency-Key": "k"})
    assert response.status_code == 422
    error = response.json["error"]
    assert error["code"] == "validation_failed"
    assert "Idempotency-Key" in error["details"]["fields"]
    assert count_runs(db_session, tx_tenant.id) == 0


def test_each_item_keeps_its_own_trace_context(client, tx_tenant, db_session):
    from sqlalchemy import text

    response = post_batch(client, tx_tenant, [
        {"workflow_ref": "echo", "traceparent": TRACEPARENT, "tracestate": "vendor=1"},
        {"workflow_ref": "echo", "traceparent": "not-a-traceparent"},
        {"workflow_ref": "echo", "traceparent": 7},
        {"workflow_ref": "echo"},
    ])
    results = response.json["results"]
    assert [r["status"] for r in results] == [201] * 4
    assert [r["run"]["traceparent"] for r in results] == [TRACEPARENT, None, None, None]
    state = db_session.execute(text("SELECT tracestate FROM runs WHERE id = :id"),
                               {"id": results[0]["run"]["id"]}).scalar_one()
    assert state == "vendor=1"


def test_the_admit_scope_and_the_tenant_header_work_as_for_one_run(client, db_session,
                                                                    make_tenant):
    target, service = make_tenant(), make_tenant(service=True)
    response = post_batch(client, service, [{"workflow_ref": "echo"}],
                          headers={"X-Poimen-Tenant": target.name})
    assert response.status_code == 200
    assert response.json["results"][0]["run"]["tenant"] == target.name
    assert client.post("/v1/runs/batch", json={"runs": []}).status_code == 401


def test_key_reuse_works_per_item(client, tx_tenant, db_session):
    from sqlalchemy import text

    first = post_batch(client, tx_tenant, [{"workflow_ref": "reuse-after-end",
                                            "dispatch_key": "r"}]).json["results"][0]
    db_session.execute(text("UPDATE runs SET status = 'succeeded', finished_at = now() "
                            "WHERE id = :id"), {"id": first["run"]["id"]})
    again = post_batch(client, tx_tenant, [
        {"workflow_ref": "reuse-after-end", "dispatch_key": "r"},
        {"workflow_ref": "reuse-after-end", "dispatch_key": "r"},
    ]).json["results"]
    assert [r["status"] for r in again] == [201, 200]
    assert again[0]["run"]["id"] == again[1]["run"]["id"] != first["run"]["id"]


# Sends: only after commit, a replay of a queued run re-sent ----------------------------------

def test_every_created_run_is_sent_after_commit_and_a_queued_replay_again(
        client, tenant, redis_client, queue_name, sent):
    redis_client.delete(queue_name)
    first = post_batch(client, tenant, [{"workflow_ref": "echo", "dispatch_key": "s1"},
                                        {"workflow_ref": "echo"}]).json["results"]
    sent()
    ids = [r["run"]["id"] for r in first]
    assert sorted(queued_task_ids(redis_client, queue_name)) == sorted(ids)
    replay = post_batch(client, tenant, [{"workflow_ref": "echo", "dispatch_key": "s1"}])
    assert replay.json["results"][0]["status"] == 200
    sent()
    assert sorted(queued_task_ids(redis_client, queue_name)) == sorted(ids + [ids[0]])


# The rule with two real connections -----------------------------------------------------------

def _engine(database_url, name):
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    return create_engine(database_url, poolclass=NullPool, isolation_level="READ COMMITTED",
                         connect_args={"application_name": name})


def _batch(app, engine, tenant_id, keys, outcome, *, before_commit=None):
    from sqlalchemy.orm import Session

    from app.admission import Admission, RunRequest, admit_many

    with app.app_context(), Session(bind=engine) as session:
        try:
            results = admit_many(on_session(session), [RunRequest("echo", {"k": k}, dispatch_key=k)
                                           for k in keys], tenant_id=tenant_id)
            outcome["results"] = [(r.run.id, r.created) if isinstance(r, Admission) else r
                                  for r in results]
            if before_commit is not None:
                before_commit()
            session.commit()
        except Exception as err:  # noqa: BLE001 - reported by the test
            outcome["error"] = err


def test_the_index_decides_a_key_held_by_an_uncommitted_batch(app, tenant, pg, database_url):
    """Deterministic witness: batch A holds keys k1, k2 uncommitted; batch B (k2, k3) must
    wait for A's k2 and then replay it, never read "no k2" and insert (check-then-act)."""
    engine_a, engine_b = _engine(database_url, "batch-a"), _engine(database_url, "batch-b")
    a, b = {}, {}
    a_may_commit, a_admitted = threading.Event(), threading.Event()

    def hold():
        a_admitted.set()
        assert a_may_commit.wait(30)

    a_thread = threading.Thread(target=_batch, args=(app, engine_a, tenant.id, ["k1", "k2"], a),
                                kwargs={"before_commit": hold})
    a_thread.start()
    assert a_admitted.wait(30), a
    b_thread = threading.Thread(target=_batch, args=(app, engine_b, tenant.id, ["k2", "k3"], b))
    b_thread.start()
    wait_until_waiting_on_a_lock(pg, "batch-b")
    assert b_thread.is_alive()
    a_may_commit.set()
    a_thread.join(30)
    b_thread.join(30)
    engine_a.dispose()
    engine_b.dispose()
    assert "error" not in a and "error" not in b, (a, b)
    (a1, a1_created), (a2, a2_created) = a["results"]
    (b2, b2_created), (b3, b3_created) = b["results"]
    assert a1_created and a2_created and b3_created
    assert b2 == a2 and not b2_created
    for key in ("k1", "k2", "k3"):
        assert count_runs(pg, tenant.id, key) == 1


def test_batches_with_overlapping_keys_in_reverse_order_do_not_deadlock(app, tenant, pg,
                                                                       database_url):
    """Two batches share every key, one in the other's reverse order. A third caller holds
    the middle key, so both batches are inside their insert at once, whatever the
    scheduling: inserting in request order, A would hold the keys below it and B the keys
    above, each then waiting for the other (Postgres aborts one: a deadlock). In key order
    both start at the bottom and one simply waits for the other."""
    from sqlalchemy.orm import Session

    from app.admission import admit_run

    keys = [f"d{i:02}" for i in range(20)]
    middle = keys[10]
    engines = {name: _engine(database_url, name) for name in ("holder", "rev-a", "rev-b")}
    a, b = {}, {}
    with app.app_context(), Session(bind=engines["holder"]) as holder:
        admit_run(on_session(holder), tenant_id=tenant.id, workflow_ref="echo", input={"k": middle},
                  dispatch_key=middle)
        a_thread = threading.Thread(target=_batch,
                                    args=(app, engines["rev-a"], tenant.id, keys, a))
        b_thread = threading.Thread(target=_batch,
                                    args=(app, engines["rev-b"], tenant.id, keys[::-1], b))
        a_thread.start()
        wait_until_waiting_on_a_lock(pg, "rev-a")
        b_thread.start()
        wait_until_waiting_on_a_lock(pg, "rev-b")
        holder.rollback()  # the middle key is free: both batches go on
    a_thread.join(60)
    b_thread.join(60)
    for engine in engines.values():
        engine.dispose()
    assert "error" not in a and "error" not in b, (a.get("error"), b.get("error"))
    for key in keys:
        assert count_runs(pg, tenant.id, key) == 1
    created = sum(c for _, c in a["results"]) + sum(c for _, c in b["results"])
    assert created == len(keys)
    a_ids = [run for run, _ in a["results"]]
    assert [run for run, _ in b["results"]] == a_ids[::-1]


def test_over_real_http_a_refused_value_fails_only_its_item(live_api, tenant, pg):
    """Through gunicorn, where the batch runs in autocommit: Postgres refusing one item's
    value fails the whole insert, and the items are then admitted each alone."""
    import requests

    body = ('{"runs": [{"workflow_ref": "echo", "input": {"n": 1e-16384}}, '
            '{"workflow_ref": "echo", "dispatch_key": "x"}, '
            '{"workflow_ref": "echo", "dispatch_key": "x"}]}')
    first = requests.post(f"{live_api}/v1/runs/batch", data=body, timeout=30,
                          headers={**tenant.headers, "Content-Type": "application/json"})
    assert first.status_code == 200, first.text
    assert [r["status"] for r in first.json()["results"]] == [422, 201, 200]
    again = requests.post(f"{live_api}/v1/runs/batch", timeout=30, headers=tenant.headers,
                          json={"runs": [{"workflow_ref": "echo", "dispatch_key": "x"},
                                         {"workflow_ref": "echo"}]})
    assert [r["status"] for r in again.json()["results"]] == [200, 201]
    assert pg.execute("SELECT count(*) FROM runs").fetchone()[0] == 2
    assert pg.execute("SELECT count(*) FROM outbox").fetchone()[0] == 2
