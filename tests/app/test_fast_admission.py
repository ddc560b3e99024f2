"""``POST /v1/runs`` in front of Flask (``app/fastpath.py``, issue 25).

A plain request (JSON with a length, a token this process has cached) is answered
without Flask's dispatch; its answer must be the one Flask's view gives, byte for
byte, and every other request must reach Flask untouched. Refusals met on the
fast path are answered by Flask's own handlers without running the statement
again. Real Postgres and Redis throughout; the witness that Flask did or did not
dispatch is a counter around the app's own ``flask_wsgi`` (our code, not a stand-in).
"""

from __future__ import annotations

import json
import uuid

import pytest
from prometheus_client import REGISTRY

from app import fastpath

# Headers that differ between two answers of the same run by design.
PER_REQUEST = {"X-Request-ID"}


@pytest.fixture
def flask_calls(app, monkeypatch):
    """How many requests reached Flask's dispatch (the fast path handed them on)."""
    assert fastpath.installed(app), "the fast path is on by default"
    middleware = app.wsgi_app
    calls = []
    original = middleware.flask_wsgi

    def counted(environ, start_response):
        calls.append(environ.get("PATH_INFO"))
        return original(environ, start_response)

    monkeypatch.setattr(middleware, "flask_wsgi", counted)
    return calls


@pytest.fixture
def flask_only(app, monkeypatch):
    """Serve the next requests through Flask alone (as POIMEN_ADMISSION_FAST_PATH=0)."""
    def use():
        monkeypatch.setattr(app, "wsgi_app", app.wsgi_app.flask_wsgi)
    return use


def _post(client, tenant, body, **headers):
    return client.post("/v1/runs", data=body if isinstance(body, str) else json.dumps(body),
                       headers={**tenant.headers, "Content-Type": "application/json",
                                "User-Agent": "fast-test/1", **headers})


def _call(app, environ):
    """Call the app as gunicorn does; (status, headers, body) and the environ it left."""
    answer = {}

    def start_response(status, headers, exc_info=None):
        answer.update(status=status, headers=dict(headers))

    body = b"".join(app(environ, start_response))
    return answer["status"], answer["headers"], body


def _environ(tenant, body: bytes, **extra):
    from werkzeug.test import EnvironBuilder

    environ = EnvironBuilder(path="/v1/runs", method="POST", data=body, headers={
        **tenant.headers, "Content-Type": "application/json"}).get_environ()
    environ.update(extra)
    return environ


def _sample(name, **labels):
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _headers(response):
    return {k: v for k, v in response.headers.items() if k not in PER_REQUEST}


def test_a_plain_admission_with_a_cached_token_is_answered_in_front_of_flask(
        client, tenant, flask_calls):
    first = _post(client, tenant, {"workflow_ref": "echo", "input": {"n": 1}})
    assert first.status_code == 201 and flask_calls == ["/v1/runs"]  # looked up, cached
    second = _post(client, tenant, {"workflow_ref": "echo", "input": {"n": 2}})
    assert second.status_code == 201
    assert flask_calls == ["/v1/runs"], "the second admission went through Flask"
    assert second.json["input"] == {"n": 2} and second.json["id"] != first.json["id"]


def test_the_fast_answer_is_flasks_answer(client, tenant, flask_calls, flask_only):
    key = f"k-{uuid.uuid4().hex}"

    def body(k):  # numbers as written: 1.10 must come back as 1.10
        return ('{"workflow_ref": "echo", "input": {"n": 1.10, "big": 12345678901234567890},'
                f' "dispatch_key": "{k}"}}')

    created = _post(client, tenant, body(key))  # Flask (the token's first use)
    fast = _post(client, tenant, body(key), **{"X-Request-ID": "fast-1"})
    fast_new = _post(client, tenant, body(key + "-2"))
    assert len(flask_calls) == 1
    flask_only()
    slow = _post(client, tenant, body(key), **{"X-Request-ID": "flask-1"})
    slow_new = _post(client, tenant, body(key + "-3"))

    # A replay: the same status, headers and bytes, whichever answered.
    assert fast.status_code == slow.status_code == 200
    assert _headers(fast) == _headers(slow)
    assert fast.headers["Idempotent-Replayed"] == "true"
    assert fast.headers["Location"] == f"/v1/runs/{created.json['id']}"
    assert fast.get_data() == slow.get_data() == created.get_data()
    assert (fast.headers["X-Request-ID"], slow.headers["X-Request-ID"]) == ("fast-1", "flask-1")
    assert b'"n":1.10' in fast.get_data()
    # A new run: the same status and header names; the bodies differ only in the run.
    assert fast_new.status_code == slow_new.status_code == 201
    assert sorted(_headers(fast_new)) == sorted(_headers(slow_new))
    assert "Idempotent-Replayed" not in fast_new.headers
    same = {"id", "dispatch_key", "created_at", "updated_at"}
    assert ({k: v for k, v in fast_new.json.items() if k not in same}
            == {k: v for k, v in slow_new.json.items() if k not in same})
    assert list(fast_new.json) == list(slow_new.json)


def test_the_fast_path_counts_and_logs_as_the_view(client, tenant, flask_calls):
    _post(client, tenant, {"workflow_ref": "echo"})  # caches the token
    before = {status: _sample("poimen_http_requests_total", method="POST", route="/v1/runs",
                              status=status) for status in ("201", "200")}
    created_before = _sample("poimen_admissions_total", origin="http", outcome="created")
    seconds_before = _sample("poimen_http_request_seconds_count", method="POST",
                             route="/v1/runs")
    r = _post(client, tenant, {"workflow_ref": "echo", "dispatch_key": "counted"})
    environ = _environ(tenant, b'{"workflow_ref": "echo", "dispatch_key": "counted"}')
    status, headers, _ = _call(client.application, environ)
    assert (r.status_code, status) == (201, "200 OK") and len(flask_calls) == 1
    assert _sample("poimen_http_requests_total", method="POST", route="/v1/runs",
                   status="201") == before["201"] + 1
    assert _sample("poimen_http_requests_total", method="POST", route="/v1/runs",
                   status="200") == before["200"] + 1
    assert _sample("poimen_admissions_total", origin="http",
                   outcome="created") == created_before + 1
    assert _sample("poimen_http_request_seconds_count", method="POST",
                   route="/v1/runs") == seconds_before + 2
    # What gunicorn's access line names (gunicorn.conf.py reads these environ keys).
    assert environ["poimen.run_id"] == r.json["id"]
    assert environ["poimen.tenant"] == tenant.name
    assert environ["poimen.request_id"] == headers["X-Request-ID"]


@pytest.mark.parametrize("body, status, code", [
    ({"workflow_ref": "no-such-workflow"}, 422, "unknown_workflow"),
    ({"workflow_ref": "echo", "input": []}, 422, "validation_failed"),
    ({"workflow_ref": "echo", "surprise": 1}, 422, "validation_failed"),
    ([1, 2], 400, "invalid_body"),
    ("not json", 400, "malformed_json"),
])
def test_a_refusal_on_the_fast_path_is_answered_by_flasks_handlers(
        client, tenant, flask_calls, body, status, code):
    _post(client, tenant, {"workflow_ref": "echo"})  # caches the token
    flask_calls.clear()
    data = body if isinstance(body, str) else json.dumps(body)
    before = _sample("poimen_http_requests_total", method="POST", route="/v1/runs",
                     status=str(status))
    r = client.post("/v1/runs", data=data, headers={
        **tenant.headers, "Content-Type": "application/json", "X-Request-ID": "refused-1"})
    assert r.status_code == status, r.get_data()
    assert r.json["error"]["code"] == code and set(r.json["error"]) == {
        "code", "message", "details"}
    assert r.headers["X-Request-ID"] == "refused-1"
    assert flask_calls == [], "the request was dispatched again by Flask"
    assert _sample("poimen_http_requests_total", method="POST", route="/v1/runs",
                   status=str(status)) == before + 1


def test_a_conflict_is_answered_once_and_admits_nothing(client, tenant, flask_calls, pg):
    _post(client, tenant, {"workflow_ref": "echo", "input": {"n": 1}, "dispatch_key": "c"})
    conflicts = _sample("poimen_admissions_total", origin="http", outcome="conflict")
    r = _post(client, tenant, {"workflow_ref": "echo", "input": {"n": 2}, "dispatch_key": "c"})
    assert r.status_code == 409 and r.json["error"]["code"] == "dispatch_key_conflict"
    assert len(flask_calls) == 1  # the first request only
    # Counted once: the statement ran once, not again by a Flask re-dispatch.
    assert _sample("poimen_admissions_total", origin="http", outcome="conflict") == conflicts + 1
    assert pg.execute("SELECT count(*) FROM runs").fetchone()[0] == 1


def test_a_header_key_differing_from_the_body_is_refused_as_by_the_view(client, tenant):
    _post(client, tenant, {"workflow_ref": "echo"})
    r = _post(client, tenant, {"workflow_ref": "echo", "dispatch_key": "a"},
              **{"Idempotency-Key": '"b"'})
    assert r.status_code == 422
    assert "Idempotency-Key" in r.json["error"]["details"]["fields"]


@pytest.mark.parametrize("case", ["other_type", "too_large", "unknown_token", "no_token",
                                  "chunked"])
def test_anything_not_plain_reaches_flask_untouched(app, client, tenant, flask_calls, case):
    _post(client, tenant, {"workflow_ref": "echo"})  # caches the token
    flask_calls.clear()
    body = json.dumps({"workflow_ref": "echo"})
    headers = {**tenant.headers, "Content-Type": "application/json"}
    expected = 201
    if case == "other_type":
        headers["Content-Type"] = "text/plain"
        expected = 415
    elif case == "too_large":
        body = json.dumps({"workflow_ref": "echo",
                           "input": {"x": "y" * app.config["MAX_CONTENT_LENGTH"]}})
        expected = 413
    elif case == "unknown_token":
        headers["Authorization"] = "Bearer pmn_not-a-token"
        expected = 401
    elif case == "no_token":
        del headers["Authorization"]
        expected = 401
    if case == "chunked":
        # As gunicorn hands on a chunked body: no length, the stream ends by itself.
        environ = _environ(tenant, body.encode())
        del environ["CONTENT_LENGTH"]
        environ.update({"HTTP_TRANSFER_ENCODING": "chunked", "wsgi.input_terminated": True})
        status, _, data = _call(app, environ)
        assert status.startswith("201"), data
        assert json.loads(data)["workflow_ref"] == "echo"
    else:
        r = client.post("/v1/runs", data=body, headers=headers)
        assert r.status_code == expected, r.get_data()
        if expected == 201:
            assert r.json["workflow_ref"] == "echo"  # Flask read the body given back
    assert flask_calls == ["/v1/runs"]


def test_other_routes_never_touch_the_fast_path(client, tenant, flask_calls):
    client.get("/v1/runs", headers=tenant.headers)
    client.post("/v1/runs/batch", json={"runs": []}, headers=tenant.headers)
    assert flask_calls == ["/v1/runs", "/v1/runs/batch"]


@pytest.mark.parametrize("variable, value", [
    ("SENTRY_DSN", "https://k@sentry.invalid/1"),
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9/")])
def test_telemetry_keeps_every_request_on_flask(monkeypatch, variable, value):
    from app import create_app

    assert fastpath.installed(create_app())
    monkeypatch.setenv(variable, value)
    assert not fastpath.installed(create_app())


def test_the_switch_turns_it_off(monkeypatch):
    from app import create_app

    monkeypatch.setenv("POIMEN_ADMISSION_FAST_PATH", "0")
    assert not fastpath.installed(create_app())
