"""Issue: idempotent run admission through ``POST /v1/runs`` and ``admit_run``."""

from __future__ import annotations

import json
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest
import requests

from app.state.executor import on_session
from tests.app import admission_paths

# Each admission test on both HTTP layers: Flask's view, and the fast path.
admission_path = admission_paths.admission_path
client = admission_paths.client
db_session = admission_paths.db_session


def post_run(client, creds, **body):
    return client.post("/v1/runs", json=body, headers=creds.headers)


def count_runs(db, tenant_id=None, dispatch_key=None) -> int:
    """Count runs through ``db``: a psycopg connection, or the test's ``db_session``."""
    sql, params = "SELECT count(*) FROM runs WHERE true", {}
    if tenant_id is not None:
        sql += " AND tenant_id = %(tenant_id)s"
        params["tenant_id"] = tenant_id
    if dispatch_key is not None:
        sql += " AND dispatch_key = %(dispatch_key)s"
        params["dispatch_key"] = dispatch_key
    if isinstance(db, psycopg.Connection):
        return db.execute(sql, params).fetchone()[0]
    from sqlalchemy import text

    return db.execute(text(sql.replace("%(", ":").replace(")s", "")), params).scalar_one()


def queued_task_ids(redis_client, queue_name) -> list[str]:
    """The task ids of the ``runs.execute`` messages waiting in the Celery queue."""
    ids = []
    for raw in redis_client.lrange(queue_name, 0, -1):
        message = json.loads(raw)
        ids.append(message["headers"]["id"])
    return ids


# 1 and 2 -------------------------------------------------------------------------------------

def test_first_spawn_creates_and_replay_returns_the_same_run(client, tx_tenant, db_session):
    tenant, pg = tx_tenant, db_session
    first = post_run(client, tenant, workflow_ref="echo", input={"n": 1}, dispatch_key="K")
    assert first.status_code == 201
    run_id = first.json["id"]
    assert first.headers["Location"] == f"/v1/runs/{run_id}"
    assert "Idempotent-Replayed" not in first.headers
    assert first.json["status"] == "queued"
    assert first.json["workflow"] == {"name": "echo", "version": "1"}

    again = post_run(client, tenant, workflow_ref="echo", input={"n": 1}, dispatch_key="K")
    assert again.status_code == 200
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json["id"] == run_id
    assert count_runs(pg, tenant.id) == 1


# 3 -------------------------------------------------------------------------------------------

RACERS = 20


def test_concurrent_http_spawns_with_one_key_create_one_run(live_api, tenant, pg):
    barrier = threading.Barrier(RACERS, timeout=60)
    body = {"workflow_ref": "echo", "input": {"race": True}, "dispatch_key": "race-http"}

    def spawn(_):
        with requests.Session() as session:
            barrier.wait()
            r = session.post(f"{live_api}/v1/runs", json=body, headers=tenant.headers, timeout=30)
            return r.status_code, r.json()["id"]

    with ThreadPoolExecutor(RACERS) as pool:
        results = list(pool.map(spawn, range(RACERS)))

    statuses = sorted(code for code, _ in results)
    ids = {run_id for _, run_id in results}
    assert statuses == [200] * (RACERS - 1) + [201], statuses
    assert len(ids) == 1
    assert count_runs(pg, tenant.id, "race-http") == 1


def test_concurrent_admission_calls_on_separate_connections_create_one_run(app, tenant, pg,
                                                                          database_url):
    """20 callers of admit_run, each in its own session on its own connection."""
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session
    from sqlalchemy.pool import NullPool

    from app.admission import admit_run

    engine = create_engine(database_url, poolclass=NullPool)  # one new connection per caller
    barrier = threading.Barrier(RACERS, timeout=60)

    def admit(_):
        with app.app_context(), Session(bind=engine) as session:
            session.connection()  # connect before the barrier, so the race is the insert
            barrier.wait()
            admission = admit_run(on_session(session), tenant_id=tenant.id, workflow_ref="echo",
                                  input={"race": "fn"}, dispatch_key="race-fn")
            run_id, created = admission.run.id, admission.created
            session.commit()
            return run_id, created

    with ThreadPoolExecutor(RACERS) as pool:
        results = list(pool.map(admit, range(RACERS)))

    engine.dispose()
    assert len({run_id for run_id, _ in results}) == 1
    assert sum(created for _, created in results) == 1
    assert count_runs(pg, tenant.id, "race-fn") == 1


# 4, 5, 6 ------------------------------------------------------------------------------------

def test_no_key_means_every_call_is_a_new_run(client, tx_tenant, db_session):
    tenant, pg = tx_tenant, db_session
    a = post_run(client, tenant, workflow_ref="echo", input={"same": 1})
    b = post_run(client, tenant, workflow_ref="echo", input={"same": 1})
    assert a.status_code == b.status_code == 201
    assert a.json["id"] != b.json["id"]
    assert count_runs(pg, tenant.id) == 2


@pytest.mark.parametrize(
    "change",
    [{"input": {"n": 2}}, {"workflow_ref": "echo@1"}, {"goal_id": "another-goal"}],
    ids=["input", "workflow_ref", "goal_id"],
)
def test_same_key_with_a_different_request_is_a_conflict_naming_the_run(client, tx_tenant,
                                                                       db_session, change):
    tenant, pg = tx_tenant, db_session
    original = {"workflow_ref": "echo", "input": {"n": 1}, "goal_id": "g", "dispatch_key": "K"}
    first = post_run(client, tenant, **original)
    assert first.status_code == 201

    clash = post_run(client, tenant, **{**original, **change})
    assert clash.status_code == 409
    error = clash.json["error"]
    assert error["code"] == "dispatch_key_conflict"
    assert error["details"]["run_id"] == first.json["id"]
    assert first.json["id"] in error["message"]
    assert count_runs(pg, tenant.id) == 1


def test_same_key_under_two_tenants_is_two_runs(client, db_session, make_tenant):
    pg = db_session
    a, b = make_tenant(), make_tenant()
    ra = post_run(client, a, workflow_ref="echo", input={}, dispatch_key="shared")
    rb = post_run(client, b, workflow_ref="echo", input={}, dispatch_key="shared")
    assert ra.status_code == rb.status_code == 201
    assert ra.json["id"] != rb.json["id"]
    # Each tenant's replay finds its own run, never the other tenant's.
    for creds, first in ((a, ra), (b, rb), (b, rb), (a, ra)):
        again = post_run(client, creds, workflow_ref="echo", input={}, dispatch_key="shared")
        assert again.status_code == 200
        assert again.headers["Idempotent-Replayed"] == "true"
        assert again.json["id"] == first.json["id"]
    assert count_runs(pg, dispatch_key="shared") == 2


# 7 -------------------------------------------------------------------------------------------

def test_tenants_are_isolated_and_tokens_required(client, make_tenant, pg):
    owner, other = make_tenant(), make_tenant()
    run_id = post_run(client, owner, workflow_ref="echo", input={}).json["id"]

    assert client.get(f"/v1/runs/{run_id}", headers=owner.headers).status_code == 200
    hidden = client.get(f"/v1/runs/{run_id}", headers=other.headers)
    assert hidden.status_code == 404
    assert hidden.json["error"]["code"] == "run_not_found"
    assert client.get("/v1/runs", headers=other.headers).json["runs"] == []

    for headers in ({}, {"Authorization": "Bearer pmn_not-a-token"}, {"Authorization": "Basic x"}):
        r = client.get(f"/v1/runs/{run_id}", headers=headers)
        assert r.status_code == 401
        assert r.json["error"]["code"] == "unauthorized"
        assert client.post("/v1/runs", json={"workflow_ref": "echo"},
                           headers=headers).status_code == 401
    assert count_runs(pg) == 1


def test_service_token_acts_for_the_named_tenant(client, make_tenant, pg):
    target = make_tenant()
    service = make_tenant(service=True)
    headers = {**service.headers, "X-Poimen-Tenant": target.name}
    r = client.post("/v1/runs", json={"workflow_ref": "echo", "input": {}, "dispatch_key": "s"},
                    headers=headers)
    assert r.status_code == 201
    assert r.json["tenant"] == target.name
    assert count_runs(pg, target.id) == 1
    # The tenant's own token sees it.
    assert client.get(f"/v1/runs/{r.json['id']}", headers=target.headers).status_code == 200

    # A tenant token cannot act for someone else; a service token must name a known tenant.
    assert client.post("/v1/runs", json={"workflow_ref": "echo"},
                       headers={**target.headers, "X-Poimen-Tenant": service.name}
                       ).status_code == 403
    unknown = client.post("/v1/runs", json={"workflow_ref": "echo"},
                          headers={**service.headers, "X-Poimen-Tenant": "nobody"})
    assert unknown.status_code == 404
    assert unknown.json["error"]["code"] == "tenant_not_found"


def test_revoked_token_is_refused(app, client, tenant):
    from app.extensions import db
    from app.models import ApiToken

    with app.app_context():
        db.session.query(ApiToken).update({"revoked_at": db.func.now()})
        db.session.commit()
    assert client.get("/v1/runs", headers=tenant.headers).status_code == 401


# 8 -------------------------------------------------------------------------------------------

BAD_BODIES = [
    ("not json", b"{nope", "application/json", 400, "malformed_json"),
    ("json array", b"[1, 2]", "application/json", 400, "invalid_body"),
    ("json string", b'"echo"', "application/json", 400, "invalid_body"),
    ("NaN is not JSON", b'{"workflow_ref": "echo", "input": {"x": NaN}}', "application/json", 400,
     "malformed_json"),
    ("deeply nested", b"[" * 100_000 + b"]" * 100_000, "application/json", 400,
     "malformed_json"),
    ("NUL in input", b'{"workflow_ref": "echo", "input": {"x": "a\\u0000"}}', "application/json",
     422, "validation_failed"),
    ("lone surrogate in key", b'{"workflow_ref": "echo", "dispatch_key": "\\ud800"}',
     "application/json", 422, "validation_failed"),
    ("not json content type", b"workflow_ref=echo", "application/x-www-form-urlencoded", 415,
     "unsupported_media_type"),
    ("missing workflow_ref", {"input": {}}, None, 422, "validation_failed"),
    ("empty workflow_ref", {"workflow_ref": ""}, None, 422, "validation_failed"),
    ("blank workflow_ref", {"workflow_ref": "   "}, None, 422, "validation_failed"),
    ("numeric workflow_ref", {"workflow_ref": 7}, None, 422, "validation_failed"),
    ("over-long workflow_ref", {"workflow_ref": "e" * 201}, None, 422, "validation_failed"),
    ("unknown workflow", {"workflow_ref": "no-such-flow"}, None, 422, "unknown_workflow"),
    ("unknown version", {"workflow_ref": "echo@99"}, None, 422, "unknown_workflow"),
    ("malformed ref", {"workflow_ref": "echo@@1"}, None, 422, "unknown_workflow"),
    ("input is a list", {"workflow_ref": "echo", "input": [1]}, None, 422, "validation_failed"),
    ("input is a string", {"workflow_ref": "echo", "input": "x"}, None, 422, "validation_failed"),
    ("empty dispatch_key", {"workflow_ref": "echo", "dispatch_key": ""}, None, 422,
     "validation_failed"),
    ("numeric dispatch_key", {"workflow_ref": "echo", "dispatch_key": 5}, None, 422,
     "validation_failed"),
    ("over-long dispatch_key", {"workflow_ref": "echo", "dispatch_key": "k" * 256}, None, 422,
     "validation_failed"),
    ("numeric goal_id", {"workflow_ref": "echo", "goal_id": 5}, None, 422, "validation_failed"),
    ("unknown field", {"workflow_ref": "echo", "priority": 1}, None, 422, "validation_failed"),
    ("body over 1 MiB", {"workflow_ref": "echo", "input": {"x": "a" * (1024 * 1024)}}, None, 413,
     "payload_too_large"),
]


@pytest.mark.parametrize("label,body,content_type,status,code", BAD_BODIES,
                         ids=[b[0] for b in BAD_BODIES])
def test_bad_input_gets_a_json_error_and_creates_nothing(client, tenant, pg, label, body,
                                                          content_type, status, code):
    if isinstance(body, dict):
        r = client.post("/v1/runs", json=body, headers=tenant.headers)
    else:
        r = client.post("/v1/runs", data=body, content_type=content_type, headers=tenant.headers)
    assert r.status_code == status, r.data[:300]
    assert r.is_json
    error = r.json["error"]
    assert error["code"] == code
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["details"], dict)
    assert count_runs(pg) == 0


def test_validation_error_names_each_bad_field(client, tenant):
    r = client.post("/v1/runs", json={"input": [], "dispatch_key": "", "extra": 1},
                    headers=tenant.headers)
    assert r.status_code == 422
    assert set(r.json["error"]["details"]["fields"]) == {"workflow_ref", "input", "dispatch_key",
                                                         "extra"}


def test_over_long_body_over_real_http_is_413(live_api, tenant, pg):
    body = json.dumps({"workflow_ref": "echo", "input": {"x": "a" * (1024 * 1024 + 10)}})
    r = requests.post(f"{live_api}/v1/runs", data=body, timeout=30,
                      headers={**tenant.headers, "Content-Type": "application/json"})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "payload_too_large"
    assert count_runs(pg) == 0


# 9 -------------------------------------------------------------------------------------------

def test_a_run_whose_transaction_fails_is_not_enqueued(app, tenant, redis_client, queue_name,
                                                        pg, sent):
    from app.admission import admit_run
    from app.extensions import db

    redis_client.delete(queue_name)
    with app.app_context():
        admission = admit_run(on_session(db.session), tenant_id=tenant.id, workflow_ref="echo",
                              input={},
                              dispatch_key="doomed")
        doomed = str(admission.run.id)
        db.session.rollback()  # the admitting transaction fails

        kept = admit_run(on_session(db.session), tenant_id=tenant.id, workflow_ref="echo", input={},
                         dispatch_key="kept")
        sent()
        assert queued_task_ids(redis_client, queue_name) == []  # nothing before commit
        db.session.commit()
        kept_id = str(kept.run.id)

    sent()  # the sender publishes in order: the doomed run would be there by now
    assert queued_task_ids(redis_client, queue_name) == [kept_id]
    assert doomed not in queued_task_ids(redis_client, queue_name)
    assert count_runs(pg, tenant.id) == 1


def test_replay_of_a_queued_run_sends_it_again(client, tenant, redis_client, queue_name, sent):
    redis_client.delete(queue_name)
    first = post_run(client, tenant, workflow_ref="echo", input={}, dispatch_key="resend")
    run_id = first.json["id"]
    sent()
    assert queued_task_ids(redis_client, queue_name) == [run_id]
    post_run(client, tenant, workflow_ref="echo", input={}, dispatch_key="resend")
    sent()
    assert queued_task_ids(redis_client, queue_name) == [run_id, run_id]


def test_replay_of_a_finished_run_sends_nothing(client, tenant, redis_client, queue_name, pg,
                                                sent):
    first = post_run(client, tenant, workflow_ref="echo", input={}, dispatch_key="done")
    sent()
    pg.execute("UPDATE runs SET status = 'succeeded' WHERE id = %s", [first.json["id"]])
    redis_client.delete(queue_name)
    replay = post_run(client, tenant, workflow_ref="echo", input={}, dispatch_key="done")
    assert replay.status_code == 200
    sent()
    assert queued_task_ids(redis_client, queue_name) == []


def test_the_message_names_the_run_and_workflow(client, tenant, redis_client, queue_name, sent):
    redis_client.delete(queue_name)
    run_id = post_run(client, tenant, workflow_ref="echo", input={}).json["id"]
    sent()
    message = json.loads(redis_client.lrange(queue_name, 0, -1)[0])
    assert message["headers"]["task"] == "runs.execute"
    assert message["headers"]["id"] == run_id
    assert message["headers"]["shadow"] == "runs.execute[echo@1]"


def test_admission_writes_its_event_in_the_same_transaction(client, tenant, pg):
    def events(run_id):
        return pg.execute("SELECT event_type, tenant_id FROM outbox WHERE run_id = %s",
                          [run_id]).fetchall()

    first = post_run(client, tenant, workflow_ref="echo", input={}, dispatch_key="evt")
    run_id = first.json["id"]
    assert events(run_id) == [("run.admitted", tenant.id)]
    # A replay is not an admission: it writes no second event.
    again = post_run(client, tenant, workflow_ref="echo", input={}, dispatch_key="evt")
    assert again.status_code == 200 and again.json["id"] == run_id
    assert events(run_id) == [("run.admitted", tenant.id)]

    # The same transaction: when the event cannot be written, the run is not admitted
    # either (a run committed on its own would exist here without its event).
    pg.execute("CREATE FUNCTION test_refuse_outbox() RETURNS trigger LANGUAGE plpgsql AS "
               "$$ BEGIN RAISE EXCEPTION 'the test refuses outbox writes'; END $$")
    pg.execute("CREATE TRIGGER test_refuse_outbox BEFORE INSERT ON outbox "
               "FOR EACH ROW EXECUTE FUNCTION test_refuse_outbox()")
    try:
        refused = post_run(client, tenant, workflow_ref="echo", input={},
                           dispatch_key="no-event")
        assert refused.status_code == 500
        assert refused.json["error"]["code"] == "internal_error"
    finally:
        pg.execute("DROP TRIGGER test_refuse_outbox ON outbox")
        pg.execute("DROP FUNCTION test_refuse_outbox()")
    assert count_runs(pg, tenant.id, dispatch_key="no-event") == 0
    assert count_runs(pg, tenant.id) == 1


def test_a_new_run_stores_the_request_and_its_admitted_event_says_what_was_admitted(
        client, tenant, pg):
    body = {"workflow_ref": "echo", "input": {"k": [1, "two"]}, "goal_id": "goal-7",
            "dispatch_key": "stored-1"}
    created = client.post("/v1/runs", json=body,
                          headers={**tenant.headers, "User-Agent": "poimen-test/1"})
    assert created.status_code == 201
    run_id = created.json["id"]
    row = pg.execute("SELECT input, goal_id, dispatch_key, origin, origin_detail, workflow_ref "
                     "FROM runs WHERE id = %s", [run_id]).fetchone()
    assert row == ({"k": [1, "two"]}, "goal-7", "stored-1", "http", "poimen-test/1", "echo")
    [(payload,)] = pg.execute("SELECT payload FROM outbox WHERE run_id = %s",
                              [run_id]).fetchall()
    # The documented shape (app/events.py): run_id and type, then this event's fields.
    assert payload == {"run_id": run_id, "type": "run.admitted", "workflow_ref": "echo@1",
                       "goal_id": "goal-7", "dispatch_key": "stored-1", "origin": "http"}


def test_origin_records_the_http_layer(client, tenant, pg):
    run_id = post_run(client, tenant, workflow_ref="echo", input={}).json["id"]
    assert pg.execute("SELECT origin FROM runs WHERE id = %s", [run_id]).fetchone()[0] == "http"


def test_pinned_version_is_the_newest_at_admission(client, tx_tenant):
    tenant = tx_tenant
    r = post_run(client, tenant, workflow_ref="versioned", input={})
    assert r.json["workflow"] == {"name": "versioned", "version": "10"}
    r = post_run(client, tenant, workflow_ref="versioned@2", input={})
    assert r.json["workflow"] == {"name": "versioned", "version": "2"}


def test_uuid_run_ids_that_do_not_exist_are_404(client, tx_tenant):
    tenant = tx_tenant
    for run_id in (str(uuid.uuid4()), "not-a-uuid"):
        r = client.get(f"/v1/runs/{run_id}", headers=tenant.headers)
        assert r.status_code == 404
        assert r.json["error"]["code"] == "run_not_found"


@pytest.mark.parametrize("database_default", ["read committed", "repeatable read"])
def test_the_index_decides_a_key_held_by_an_uncommitted_admission(app, tenant, pg,
                                                                    database_url,
                                                                    database_default):
    """Deterministic witness of the rule (no scheduling luck involved).

    Caller A has admitted key K but not committed. Caller B admits K: a
    check-then-insert would see no row and then fail or duplicate; the index
    must instead make B wait for A and then hand B A's run as a replay.
    """
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session
    from sqlalchemy.pool import NullPool

    from app.admission import admit_run
    from poimenconfig import load_config

    # The app's own engine settings, on a database whose default isolation may be
    # another one (default_transaction_isolation set by a DBA or a provider).
    pinned = {k: v for k, v in load_config()["SQLALCHEMY_ENGINE_OPTIONS"].items()
              if k == "isolation_level"}
    default = database_default.replace(" ", r"\ ")
    engine = create_engine(database_url, poolclass=NullPool, **pinned,
                           connect_args={"options": f"-c default_transaction_isolation={default}"})
    args = dict(tenant_id=tenant.id, workflow_ref="echo", input={"d": 1}, dispatch_key="held")
    with app.app_context(), Session(bind=engine) as a_session:
        a = admit_run(on_session(a_session), **args)
        assert a.created

        outcome = {}

        def caller_b():
            with app.app_context(), Session(bind=engine) as b_session:
                try:
                    b = admit_run(on_session(b_session), **args)
                    outcome["run"], outcome["created"] = b.run.id, b.created
                    b_session.commit()
                except Exception as err:  # noqa: BLE001 - reported below
                    outcome["error"] = err

        b_thread = threading.Thread(target=caller_b)
        b_thread.start()
        # B must be blocked on A's uncommitted index entry, not finished.
        deadline = threading.Event()
        for _ in range(100):
            if pg.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND datname = current_database()"
            ).fetchone()[0] == 1:
                break
            deadline.wait(0.05)
        else:
            b_thread.join(10)
            pytest.fail(f"caller B was not waiting on caller A's key: {outcome}")
        assert b_thread.is_alive()
        a_session.commit()
        a_id = a.run.id
    b_thread.join(30)
    engine.dispose()
    assert "error" not in outcome, outcome.get("error")
    assert outcome == {"run": a_id, "created": False}
    assert count_runs(pg, tenant.id, "held") == 1


def test_a_replay_after_its_version_left_the_registry_is_still_a_replay(client, tx_tenant):
    """Rolling deploy: the web process no longer knows the pinned version; the key decides."""
    from workers import registry

    @registry.workflow("retiring", version="1")
    def retiring(ctx, input):
        return input

    body = {"workflow_ref": "retiring@1", "input": {"n": 1}, "dispatch_key": "retire-1"}
    try:
        first = post_run(client, tx_tenant, **body)
        assert first.status_code == 201
    finally:
        registry._registry.pop("retiring", None)  # the version leaves the registry
    again = post_run(client, tx_tenant, **body)
    assert again.status_code == 200, again.json
    assert again.json["id"] == first.json["id"]
    # A different request under that key is still a conflict, not "unknown workflow".
    clash = post_run(client, tx_tenant, **{**body, "input": {"n": 2}})
    assert clash.status_code == 409
    # And without a key, or with a fresh one, an unknown version is refused as before.
    assert post_run(client, tx_tenant, **{**body, "dispatch_key": "retire-2"}).status_code == 422


# The Idempotency-Key header (IETF draft) is the dispatch key ---------------------------------

def test_the_idempotency_key_header_is_the_dispatch_key(client, tx_tenant, db_session):
    tenant = tx_tenant
    headers = {**tenant.headers, "Idempotency-Key": "hdr-1"}
    body = {"workflow_ref": "echo", "input": {"n": 1}}
    first = client.post("/v1/runs", json=body, headers=headers)
    assert first.status_code == 201 and first.json["dispatch_key"] == "hdr-1"
    again = client.post("/v1/runs", json=body, headers=headers)
    assert again.status_code == 200 and again.headers["Idempotent-Replayed"] == "true"
    assert again.json["id"] == first.json["id"]
    # The same key in the body is the same request; a quoted header value is unquoted.
    same = client.post("/v1/runs", json={**body, "dispatch_key": "hdr-1"},
                       headers={**tenant.headers, "Idempotency-Key": '"hdr-1"'})
    assert same.status_code == 200 and same.json["id"] == first.json["id"]
    assert count_runs(db_session, tenant.id) == 1


@pytest.mark.parametrize("header, key", [("hdr-a", "body-b"), ("", None), ("x" * 256, None)],
                         ids=["differs", "empty", "too-long"])
def test_a_bad_idempotency_key_is_a_422_and_admits_nothing(client, tx_tenant, db_session,
                                                            header, key):
    body = {"workflow_ref": "echo", "input": {}}
    if key is not None:
        body["dispatch_key"] = key
    r = client.post("/v1/runs", json=body,
                    headers={**tx_tenant.headers, "Idempotency-Key": header})
    assert r.status_code == 422
    assert "Idempotency-Key" in r.json["error"]["details"]["fields"]
    assert count_runs(db_session, tx_tenant.id) == 0
