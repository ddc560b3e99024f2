"""Least privilege.

An ``admit``-scoped token (the Kafka inbox's) can create runs and nothing else;
``/metrics`` on the web port is not reachable without its token.
"""

from __future__ import annotations

import json
import uuid

import pytest
import requests

METRICS_TOKEN = "metrics-" + uuid.uuid4().hex


@pytest.fixture
def admit_only(app, db_session, tx_tenant):
    """An admit-scoped service token (as the inbox's) and tenant token, in ``db_session``."""
    from app.tenant_service import create_token, find_tenant

    with app.app_context():
        tenant = find_tenant(tx_tenant.name)
        service = create_token(None, True, "inbox", scope="admit")
        own = create_token(tenant, False, "admit only", scope="admit")
    return {
        "service": {"Authorization": f"Bearer {service}", "X-Poimen-Tenant": tx_tenant.name},
        "tenant": {"Authorization": f"Bearer {own}"},
    }


def assert_forbidden(response):
    assert response.status_code == 403, response.data[:300]
    error = response.json["error"]
    assert set(error) == {"code", "message", "details"}
    assert error["code"] == "forbidden"
    assert error["details"] == {"scope": "admit", "action": error["details"]["action"]}


@pytest.mark.parametrize("kind", ["service", "tenant"])
def test_an_admit_scoped_token_admits_and_does_nothing_else(client, tx_tenant, admit_only, kind):
    headers = admit_only[kind]
    created = client.post("/v1/runs", json={"workflow_ref": "echo", "dispatch_key": "k"},
                          headers=headers)
    assert created.status_code == 201, created.data
    assert created.json["tenant"] == tx_tenant.name
    run_id = created.json["id"]
    replay = client.post("/v1/runs", json={"workflow_ref": "echo", "dispatch_key": "k"},
                         headers=headers)
    assert replay.status_code == 200  # what the inbox sees on a redelivery

    # Twice each: the second answer comes from the auth cache, which keeps the scope.
    for _ in range(2):
        assert_forbidden(client.get(f"/v1/runs/{run_id}", headers=headers))
        assert_forbidden(client.get("/v1/runs", headers=headers))
        assert_forbidden(client.get("/v1/runs?dispatch_key=k", headers=headers))
        assert_forbidden(client.post(f"/v1/runs/{run_id}/cancel", headers=headers))
    # Nothing was cancelled; the tenant's own unscoped token still does everything.
    shown = client.get(f"/v1/runs/{run_id}", headers=tx_tenant.headers)
    assert shown.status_code == 200 and shown.json["status"] == "queued"
    assert client.post(f"/v1/runs/{run_id}/cancel", headers=tx_tenant.headers).status_code == 200


def test_an_unscoped_service_token_is_unchanged(client, tx_tenant, make_tenant):
    service = make_tenant(service=True)
    headers = {**service.headers, "X-Poimen-Tenant": tx_tenant.name}
    run_id = client.post("/v1/runs", json={"workflow_ref": "echo"}, headers=headers).json["id"]
    assert client.get(f"/v1/runs/{run_id}", headers=headers).status_code == 200
    assert client.get("/v1/runs", headers=headers).status_code == 200


def test_cli_creates_an_admit_scoped_token(app, client, db_session, tx_tenant):
    from sqlalchemy import text

    cli = app.test_cli_runner()
    out = cli.invoke(args=["tokens", "create", "--service", "--scope", "admit",
                           "--label", "inbox"])
    assert out.exit_code == 0, out.output
    token = out.output.strip()
    assert db_session.execute(text("SELECT scope FROM api_tokens WHERE prefix = :p"),
                              {"p": token[:12]}).scalar_one() == "admit"
    headers = {"Authorization": f"Bearer {token}", "X-Poimen-Tenant": tx_tenant.name}
    assert client.post("/v1/runs", json={"workflow_ref": "echo"}, headers=headers
                       ).status_code == 201
    assert_forbidden(client.get("/v1/runs", headers=headers))

    bad = cli.invoke(args=["tokens", "create", "--service", "--scope", "everything"])
    assert bad.exit_code != 0 and "everything" in bad.output


def test_create_token_refuses_an_unknown_scope(app, db_session):
    from app.tenant_service import InvalidScope, create_token

    with app.app_context(), pytest.raises(InvalidScope):
        create_token(None, True, scope="read")


def test_make_run_gives_the_inbox_an_admit_scoped_token(app, db_session, tmp_path):
    """``make run``'s bootstrap: the inbox's token is admit-scoped, and one from before
    scopes is replaced (and revoked) rather than kept."""
    from app.tenant_service import create_token, token_scope
    from poimen_dev.platform import _ensure_token

    with app.app_context():
        path = tmp_path / "service-token"
        old = create_token(None, True, "make run inbox")  # unscoped, as tokens made before scopes are
        path.write_text(old + "\n")
        token = _ensure_token(path, None, True, "make run inbox", scope="admit")
        assert token != old and path.read_text().strip() == token
        assert token_scope(token) == "admit"
        assert _ensure_token(path, None, True, "make run inbox", scope="admit") == token
    from sqlalchemy import text

    revoked = db_session.execute(text("SELECT revoked_at IS NOT NULL FROM api_tokens "
                                      "WHERE prefix = :p"), {"p": old[:12]}).scalar_one()
    assert revoked


# /metrics --------------------------------------------------------------------------------------

@pytest.fixture
def metrics_token(app, monkeypatch):
    monkeypatch.setitem(app.config, "POIMEN_METRICS_TOKEN", METRICS_TOKEN)
    return {"Authorization": f"Bearer {METRICS_TOKEN}"}


def test_metrics_are_not_served_without_a_metrics_token_set(client, app, monkeypatch):
    monkeypatch.setitem(app.config, "POIMEN_METRICS_TOKEN", None)
    for headers in ({}, {"Authorization": "Bearer anything"}):
        response = client.get("/metrics", headers=headers)
        assert response.status_code == 404
        assert response.json["error"]["code"] == "not_found"


def test_metrics_need_their_own_token(client, db_session, tx_tenant, admit_only, metrics_token):
    missing = client.get("/metrics")
    assert missing.status_code == 401 and missing.json["error"]["code"] == "unauthorized"
    assert missing.headers["WWW-Authenticate"].startswith("Bearer")
    # Neither another bearer token nor an API token (of any scope) opens it.
    for headers in ({"Authorization": "Bearer not-it"}, {"Authorization": "Basic eDp5"},
                    tx_tenant.headers, admit_only["service"]):
        response = client.get("/metrics", headers=headers)
        assert response.status_code in (401, 403), headers
        assert response.json["error"]["code"] in ("unauthorized", "forbidden")
    served = client.get("/metrics", headers=metrics_token)
    assert served.status_code == 200
    assert "# TYPE poimen_admissions_total counter" in served.get_data(as_text=True)


def test_global_gauges_are_read_at_most_once_per_cache_period(
        app, client, db_session, tx_tenant, monkeypatch):
    # beat serves them (workers/metrics.py); the web's /metrics does not.
    from app.metrics import GlobalGauges

    gauges = GlobalGauges(app)

    def queued() -> float:
        runs = next(m for m in gauges.collect() if m.name == "poimen_runs")
        return next((s.value for s in runs.samples if s.labels == {"status": "queued"}), 0.0)

    monkeypatch.setitem(app.config, "POIMEN_METRICS_CACHE_SECONDS", 0)
    before = queued()
    monkeypatch.setitem(app.config, "POIMEN_METRICS_CACHE_SECONDS", 3600)
    assert queued() == before
    client.post("/v1/runs", json={"workflow_ref": "echo"}, headers=tx_tenant.headers)
    assert queued() == before  # cached: the new run is not counted yet
    monkeypatch.setitem(app.config, "POIMEN_METRICS_CACHE_SECONDS", 0)
    assert queued() == before + 1


def test_metrics_over_gunicorn_without_a_token_are_not_found(live_api):
    response = requests.get(f"{live_api}/metrics", timeout=10)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"


# Replaying the inbox's dead letters from the console: the admin scope only ---------------------

CONSOLE_SECRET = "c" * 40


def console_client(token: str):
    """A test client of a console-enabled app (Kafka from the environment), signed in."""
    import re

    from app import create_app

    client = create_app({"POIMEN_CONSOLE_SECRET": CONSOLE_SECRET, "TESTING": True}).test_client()
    page = client.get("/console/sign-in").get_data(as_text=True)
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', page).group(1)
    assert client.post("/console/sign-in",
                       data={"csrf_token": csrf, "token": token}).status_code == 302
    # Sign-in starts a fresh session, with a CSRF token of its own (every page's sign-out form).
    page = client.get("/console/runs").get_data(as_text=True)
    return client, re.search(r'name="csrf_token" value="([^"]+)"', page).group(1)


def test_only_an_admin_scoped_token_replays_dead_letters_from_the_console(app, make_tenant,
                                                                           test_env):
    """A replay of a tenant's whole DLQ is an operator's action: a token with the admin
    scope starts it; any other tenant token gets a 403."""
    from confluent_kafka import Producer

    from app.tenant_service import create_token, find_tenant
    from bridge.topics import dead_letter_topic, declare_topics, dispatch_topic
    from poimenconfig import topic_prefix
    from tests.bridge.test_inbox_relay import topic_size

    tenant = make_tenant()
    with app.app_context():
        admin = create_token(find_tenant(tenant.name), False, "ops", scope="admin")
    bootstrap, prefix = test_env["KAFKA_BOOTSTRAP_SERVERS"], topic_prefix()
    declare_topics(bootstrap, prefix, [tenant.name], 1)
    source = dispatch_topic(prefix, tenant.name)
    producer = Producer({"bootstrap.servers": bootstrap})
    producer.produce(dead_letter_topic(prefix, tenant.name),
                     json.dumps({"workflow_ref": "echo", "dispatch_key": "k1"}).encode(),
                     headers=[("poimen.dlq.reason", b"http_422"),
                              ("poimen.dlq.origin.topic", source.encode()),
                              ("poimen.dlq.origin.partition", b"0"),
                              ("poimen.dlq.origin.offset", b"0")])
    assert producer.flush(30) == 0

    # The tenant's own unscoped token sees the page, not the button, and its POST is refused.
    client, csrf = console_client(tenant.token)
    refused = client.post("/console/inbox/replay", data={"csrf_token": csrf},
                          headers={"Accept": "application/json"})
    assert refused.status_code == 403, refused.data[:300]
    error = refused.json["error"]
    assert set(error) == {"code", "message", "details"} and error["code"] == "forbidden"
    assert error["details"] == {"scope": None, "action": "replay_dlq"}
    assert topic_size(bootstrap, source) == 0  # nothing was published
    page = client.get("/console/inbox").get_data(as_text=True)
    assert 'id="replay-needs-admin"' in page and 'id="replay"' not in page

    # An admin-scoped token replays; a second replay from the page publishes nothing more.
    client, csrf = console_client(admin)
    assert 'id="replay"' in client.get("/console/inbox").get_data(as_text=True)
    for _ in range(2):
        done = client.post("/console/inbox/replay", data={"csrf_token": csrf})
        assert done.status_code == 303, done.data[:300]
        assert topic_size(bootstrap, source) == 1
