"""``POST /v1/runs`` in front of Flask (``app/fastpath.py``).

A plain request (JSON with a length, a token this process has cached) is answered
without Flask's dispatch; its answer must be the one Flask's view gives, byte for
byte, and every other request must reach Flask untouched. A refusal is the one
handler's answer (``app/admission_handler.py``), written by the fast path itself,
the statement run once. The admission test modules run every claim on both paths
(``tests/app/admission_paths.py``). Real Postgres and Redis throughout; the witness that Flask did or did not
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
    # What gunicorn's access line names (app/gunicorn_conf.py reads these environ keys).
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
def test_a_refusal_on_the_fast_path_is_answered_there_as_flask_answers_it(
        client, tenant, flask_calls, flask_only, body, status, code):
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
    flask_only()
    slow = client.post("/v1/runs", data=data, headers={
        **tenant.headers, "Content-Type": "application/json", "X-Request-ID": "refused-1"})
    assert (slow.status_code, slow.get_data()) == (r.status_code, r.get_data())
    assert _headers(slow) == _headers(r)


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


# -- nothing but the app's own hooks ------------------------------------------------------------


@pytest.fixture
def own_app(app):
    """A new app of ``create_app`` (the session's ``app`` must stay unhooked), with a
    counter of the requests that reached its Flask dispatch. Tokens live in Postgres,
    so the session's tenants work on it."""
    from app import create_app

    fresh = create_app()
    fresh.config["TESTING"] = True
    assert fastpath.serving(fresh), "the fast path serves an app nothing else hooks"
    middleware = fresh.wsgi_app
    original = middleware.flask_wsgi
    fresh.flask_calls = []

    def counted(environ, start_response):
        fresh.flask_calls.append(environ.get("PATH_INFO"))
        return original(environ, start_response)

    middleware.flask_wsgi = counted
    return fresh


def _admit_three(client, tenant):
    """Three admissions: the first looks the token up, the next two are plain."""
    for n in range(3):
        r = _post(client, tenant, {"workflow_ref": "echo", "input": {"n": n}})
        assert r.status_code == 201, r.get_data()


@pytest.mark.parametrize("scope", [None, "v1"])
def test_hooks_added_after_create_app_see_every_admission(own_app, tenant, scope):
    """An allow-list's ``before_request`` and a CORS ``after_request`` registered on the app
    (or on the API's blueprint) after ``create_app`` run for every ``POST /v1/runs``."""
    from flask import request

    seen = []

    def allow_list():
        seen.append(("before", request.path))

    def cors(response):
        seen.append(("after", request.path))
        response.headers["Access-Control-Allow-Origin"] = "https://example.test"
        return response

    if scope is None:
        own_app.before_request(allow_list)
        own_app.after_request(cors)
    else:  # a blueprint's hooks, once it is registered, are the app's under its name
        own_app.before_request_funcs.setdefault(scope, []).append(allow_list)
        own_app.after_request_funcs.setdefault(scope, []).append(cors)
    assert not fastpath.serving(own_app)
    client = own_app.test_client()
    _admit_three(client, tenant)
    assert seen == [("before", "/v1/runs"), ("after", "/v1/runs")] * 3
    assert own_app.flask_calls == ["/v1/runs"] * 3
    r = _post(client, tenant, {"workflow_ref": "echo"})
    assert r.headers["Access-Control-Allow-Origin"] == "https://example.test"


def test_a_hook_appended_after_the_first_request_sees_the_next_admissions(own_app, tenant):
    """Flask refuses ``app.before_request`` once it served a request; a list appended to
    directly (an extension's way around that) is seen too, from the next request on."""
    client = own_app.test_client()
    _admit_three(client, tenant)
    assert own_app.flask_calls == ["/v1/runs"]  # the fast path served the plain two
    seen = []
    own_app.teardown_request_funcs.setdefault(None, []).append(lambda err: seen.append(err))
    _admit_three(client, tenant)
    assert seen == [None] * 3 and own_app.flask_calls == ["/v1/runs"] * 4


def test_a_request_started_receiver_sees_every_admission(own_app, tenant):
    from flask import request_started

    seen = []

    def started(sender, **_):
        seen.append(sender)

    client = own_app.test_client()
    _post(client, tenant, {"workflow_ref": "echo"})  # the token is cached now
    with request_started.connected_to(started):
        assert not fastpath.serving(own_app)
        _admit_three(client, tenant)
    assert seen == [own_app] * 3
    assert fastpath.serving(own_app), "its receiver gone, the fast path serves again"


def test_a_receiver_connected_before_create_app_keeps_every_request_on_flask(app, tenant):
    """A workflow module (loaded by ``create_app``) or a library imported before it
    connecting to Flask's signals: foreign from the start, never the app's own."""
    from flask import request_finished

    from app import create_app

    seen = []

    def finished(sender, response, **_):
        seen.append(response.status_code)

    with request_finished.connected_to(finished):
        hooked = create_app()
        assert fastpath.installed(hooked) and not fastpath.serving(hooked)
        _admit_three(hooked.test_client(), tenant)
    assert seen == [201] * 3


@pytest.mark.parametrize("how", ["wsgi_app", "Flask.__call__"])
def test_a_middleware_around_the_app_gets_flask_for_every_admission(
        own_app, tenant, monkeypatch, how):
    """Sentry's Flask integration wraps ``Flask.__call__`` in its WSGI middleware (and
    expects Flask's signals inside it); others wrap ``app.wsgi_app``. Either way every
    request inside them is Flask's."""
    from flask import Flask

    outer = []
    if how == "wsgi_app":
        inner = own_app.wsgi_app

        def middleware(environ, start_response):
            outer.append(environ["PATH_INFO"])
            return inner(environ, start_response)

        own_app.wsgi_app = middleware
    else:
        flask_call = Flask.__call__

        def sentry_patched_wsgi_app(self, environ, start_response):
            outer.append(environ["PATH_INFO"])
            return flask_call(self, environ, start_response)

        monkeypatch.setattr(Flask, "__call__", sentry_patched_wsgi_app)
        assert not fastpath.serving(own_app)
    _admit_three(own_app.test_client(), tenant)
    assert outer == own_app.flask_calls == ["/v1/runs"] * 3


def _tracing():
    """OpenTelemetry's SDK with in-memory readers (not the global providers): the
    spans and ``http.server.*`` metrics an instrumentation records."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    spans, reader = InMemorySpanExporter(), InMemoryMetricReader()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    return tracer_provider, MeterProvider(metric_readers=[reader]), spans, reader


def _server_record(spans, reader):
    """(server spans of POST /v1/runs, requests counted by the http.server duration)."""
    from opentelemetry.trace import SpanKind

    served = [s for s in spans.get_finished_spans()
              if s.kind is SpanKind.SERVER and s.attributes.get("http.route") == "/v1/runs"]
    counted = 0
    for resource in reader.get_metrics_data().resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name.startswith("http.server") and "duration" in metric.name:
                    counted += sum(p.count for p in metric.data.data_points
                                   if "/v1/runs" in (p.attributes.get("http.route"),
                                                     p.attributes.get("http.target")))
    return served, counted


def test_flask_instrumented_after_create_app_traces_every_admission(own_app, client, tenant):
    """Programmatic: ``FlaskInstrumentor().instrument_app(app)`` on the app as built (as
    ``app/telemetry.py`` does), before it serves: Flask refuses new hooks after that."""
    from opentelemetry.instrumentation.flask import FlaskInstrumentor

    tracer_provider, meter_provider, spans, reader = _tracing()
    _post(client, tenant, {"workflow_ref": "echo"})  # the process caches the token now
    FlaskInstrumentor().instrument_app(own_app, tracer_provider=tracer_provider,
                                       meter_provider=meter_provider)
    try:
        assert not fastpath.serving(own_app)
        _admit_three(own_app.test_client(), tenant)
    finally:
        FlaskInstrumentor().uninstrument_app(own_app)
    served, counted = _server_record(spans, reader)
    assert len(served) == 3 and counted == 3


def test_flask_auto_instrumented_before_create_app_traces_every_admission(app, tenant):
    """As ``opentelemetry-instrument`` does: Flask itself instrumented before the app exists."""
    from opentelemetry.instrumentation.flask import FlaskInstrumentor

    from app import create_app

    tracer_provider, meter_provider, spans, reader = _tracing()
    FlaskInstrumentor().instrument(tracer_provider=tracer_provider,
                                   meter_provider=meter_provider)
    try:
        instrumented = create_app()
        assert fastpath.installed(instrumented) and not fastpath.serving(instrumented)
        _admit_three(instrumented.test_client(), tenant)
    finally:
        FlaskInstrumentor().uninstrument()
    served, counted = _server_record(spans, reader)
    assert len(served) == 3 and counted == 3


@pytest.mark.parametrize("variable, value", [
    ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9/v1/traces"),
    ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "http://127.0.0.1:9/v1/metrics"),
    ("OTEL_TRACES_EXPORTER", "console"),
    ("OTEL_METRICS_EXPORTER", "otlp")])
def test_opentelemetry_configured_by_any_variable_keeps_it_out(monkeypatch, variable, value):
    from app import create_app

    monkeypatch.setenv(variable, "none" if variable.endswith("EXPORTER") else "")
    assert fastpath.installed(create_app()), "unset or none is no configuration"
    monkeypatch.setenv(variable, value)
    assert not fastpath.installed(create_app())


# -- its records --------------------------------------------------------------------------------


@pytest.fixture
def logged_key_workflow():
    """A workflow whose ``concurrency_key`` logs a record: one logged while admission works."""
    import logging

    from workers import registry

    logger = logging.getLogger("tests.fast_admission")

    def key(input):
        logger.warning("deriving the concurrency key")
        return "one"

    registry.workflow("logged-key", concurrency_key=key)(lambda ctx, input: input)
    yield logger
    registry._registry.pop("logged-key", None)


def test_the_fast_paths_records_carry_the_views_fields(app, client, tenant, flask_calls,
                                                        flask_only, logged_key_workflow):
    """The records logged while an admission works carry the same fields whichever path
    answers (``request_id``, ``tenant``, ``trace_id``, ``dispatch_key``), and so do the
    access line's (``run_id`` among them)."""
    import logging

    import logconfig

    records = []

    class Capture(logging.Handler):
        def emit(self, record):
            records.append(json.loads(logconfig.JsonFormatter().format(record)))

    handler = Capture()
    logged_key_workflow.addHandler(handler)
    trace_id = uuid.uuid4().hex

    def admit(path):
        body = json.dumps({"workflow_ref": "logged-key", "dispatch_key": f"{path}-k"}).encode()
        environ = _environ(tenant, body, HTTP_X_REQUEST_ID=f"{path}-1",
                           HTTP_TRACEPARENT=f"00-{trace_id}-00f067aa0ba902b7-01")
        records.clear()
        status, _, data = _call(app, environ)
        assert status.startswith("201"), data
        (record,) = records
        access = {k: v for k, v in environ.items() if k.startswith("poimen.")}
        return record, access, json.loads(data)["id"]

    try:
        _post(client, tenant, {"workflow_ref": "echo"})  # the token is cached now
        fast, fast_access, fast_run = admit("fast")
        assert flask_calls == ["/v1/runs"], "the second admission went through Flask"
        flask_only()
        view, view_access, view_run = admit("view")
    finally:
        logged_key_workflow.removeHandler(handler)
    fields = ("request_id", "tenant", "trace_id", "dispatch_key")
    assert {k: view.get(k) for k in fields} == {
        "request_id": "view-1", "tenant": tenant.name, "trace_id": trace_id,
        "dispatch_key": "view-k"}
    assert {k: fast.get(k) for k in fields} == {
        "request_id": "fast-1", "tenant": tenant.name, "trace_id": trace_id,
        "dispatch_key": "fast-k"}
    per_request = {"time", "pid", "request_id", "dispatch_key"}
    assert ({k: v for k, v in fast.items() if k not in per_request}
            == {k: v for k, v in view.items() if k not in per_request})
    assert fast_access == {"poimen.request_id": "fast-1", "poimen.tenant": tenant.name,
                           "poimen.run_id": fast_run}
    assert view_access == {"poimen.request_id": "view-1", "poimen.tenant": tenant.name,
                           "poimen.run_id": view_run}
