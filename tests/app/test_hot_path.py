"""The round trips an admission and a claim cost, and when a pooled connection is pinged.

Deterministic witnesses of the lean hot path (the benchmarks measure its speed):

* ``POST /v1/runs`` with a cached token is one statement, run in autocommit:
  no BEGIN and COMMIT around it, and it is committed when it returns (a
  second connection sees the run before the response is read);
* a pooled connection is pinged at checkout only when its socket has
  something to read (the server cut it) or it sat idle for
  ``POIMEN_DB_PING_IDLE_SECONDS``; one that fails its ping is replaced
  before the request uses it.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest
from sqlalchemy import text

from tests.conftest import connect


def _post(client, creds, **body):
    body = {"workflow_ref": "echo", "input": {"n": 1}, **body}
    return client.post("/v1/runs", data=json.dumps(body), content_type="application/json",
                       headers=creds.headers)


@pytest.fixture(params=["fast_path", "flask"])
def served_by(request, app, monkeypatch):
    """Who answers a plain admission: app/fastpath.py, or Flask's view (fast path off)."""
    if request.param == "flask":
        monkeypatch.setattr(app, "wsgi_app", app.wsgi_app.flask_wsgi)
    return request.param


def test_an_admission_is_one_statement_in_autocommit(app, client, tenant, statements,
                                                     database_url, served_by):
    assert _post(client, tenant).status_code == 201  # the token is now cached
    statements.clear()
    response = _post(client, tenant, dispatch_key=f"k-{uuid.uuid4().hex}")
    assert response.status_code == 201, response.data
    assert len(statements) == 1, [s for s, _ in statements]
    sql, autocommit = statements[0]
    assert "INSERT INTO runs" in sql and "INSERT INTO outbox" in sql
    assert autocommit, "the admission statement ran inside a transaction (BEGIN ... COMMIT)"
    with connect(database_url) as pg:
        assert pg.execute("SELECT count(*) FROM outbox WHERE run_id = %s",
                          (response.json["id"],)).fetchone()[0] == 1


def test_a_replay_reads_the_winner_in_autocommit_too(app, client, tenant, statements,
                                                     served_by):
    key = f"k-{uuid.uuid4().hex}"
    first = _post(client, tenant, dispatch_key=key)
    statements.clear()
    again = _post(client, tenant, dispatch_key=key)
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json["id"] == first.json["id"]
    assert [autocommit for _, autocommit in statements] == [True, True]  # insert, then the read


def test_a_token_lookup_that_misses_the_cache_admits_in_its_transaction(app, client,
                                                                        make_tenant, statements):
    fresh = make_tenant()
    statements.clear()
    response = _post(client, fresh)
    assert response.status_code == 201, response.data
    # The lookup opened the request's transaction; admission joined it and was committed.
    assert [autocommit for _, autocommit in statements] == [False, False]


def test_a_pooled_connection_is_pinged_only_after_sitting_idle(app, client, tenant,
                                                               monkeypatch):
    from app.extensions import db

    with app.app_context():
        engine = db.engine
    idle = app.config["POIMEN_DB_PING_IDLE_SECONDS"]
    assert idle == 1.0  # the default
    pings: list[object] = []
    real_ping = engine.dialect.do_ping
    monkeypatch.setattr(engine.dialect, "do_ping",
                        lambda dbapi_conn: pings.append(dbapi_conn) or real_ping(dbapi_conn))

    assert _post(client, tenant).status_code == 201
    pings.clear()
    for _ in range(5):  # back to back: each checkout finds a connection used a moment ago
        assert _post(client, tenant).status_code == 201
    assert pings == []
    time.sleep(idle + 0.2)
    assert _post(client, tenant).status_code == 201
    assert len(pings) == 1


def test_a_connection_cut_server_side_a_moment_ago_is_replaced_before_the_request_uses_it(
        app, client, tenant, database_url):
    from app.extensions import db

    assert _post(client, tenant).status_code == 201
    with app.app_context():
        engine = db.engine
    # Every connection in the pool, checked out at once to read its backend's pid.
    held = [engine.connect() for _ in range(engine.pool.checkedin())]
    pids = [conn.execute(text("SELECT pg_backend_pid()")).scalar() for conn in held]
    for conn in held:
        conn.close()
    assert pids
    # Cut them server-side, as a restart does, and use them again at once: well
    # within POIMEN_DB_PING_IDLE_SECONDS, so only what the server said on each
    # socket when it cut it can tell they are dead. Like a restart (pg_ctl stop
    # waits for its backends), wait until each backend has exited: without the
    # timeout pg_terminate_backend returns once it has signalled.
    with connect(database_url, autocommit=True) as pg:
        for pid in pids:
            assert pg.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,)).fetchone()[0]
    for _ in range(3):
        response = _post(client, tenant)
        assert response.status_code == 201, response.data
