"""Optional OpenTelemetry and Sentry over real processes: gunicorn and a
Celery worker on real Postgres and Redis, configured only by their environment variables.

The receivers here are stand-ins, in the test's own process, for services we do not own
and cannot run in a test: an OpenTelemetry collector (a tiny HTTP server accepting
OTLP/HTTP protobuf on ``POST /v1/traces``, decoded with ``opentelemetry-proto``, the
exporter's own message definitions) and Sentry's SaaS (a tiny HTTP server accepting
envelopes on the DSN's ``/api/<project>/envelope/``). Everything on the sending side
is the real SDKs in the real processes.
"""

from __future__ import annotations

import gzip
import json
import threading
import uuid
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from tests.processes import BIN, free_port, start_web, start_worker, wait_until

pytestmark = pytest.mark.slow

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
WORKFLOW_MODULES = "tests.workflows,tests.workflows.telemetry"


@dataclass
class Receiver:
    """What an in-process HTTP stand-in received: ``(path, headers, decompressed body)``."""

    port: int
    received: list[tuple[str, dict, bytes]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def bodies(self, path_part: str) -> list[bytes]:
        with self.lock:
            return [body for path, _, body in self.received if path_part in path]


def _decode(body: bytes, encoding: str) -> bytes:
    if encoding == "gzip":
        return gzip.decompress(body)
    if encoding == "deflate":
        return zlib.decompress(body)
    assert not encoding, f"unexpected Content-Encoding {encoding}"
    return body


@pytest.fixture
def receiver():
    """An HTTP server in this process recording every POST; answers 200 (an empty body)."""
    port = free_port()
    state = Receiver(port)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            body = _decode(body, self.headers.get("Content-Encoding", "").strip().lower())
            with state.lock:
                state.received.append((self.path, dict(self.headers), body))
            self.send_response(200)
            self.send_header("Content-Type", self.headers.get("Content-Type", "text/plain"))
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


@dataclass
class Platform:
    api: str
    token: str

    def post(self, body: dict, **headers: str) -> requests.Response:
        return requests.post(f"{self.api}/v1/runs", json=body, timeout=10,
                             headers={"Authorization": f"Bearer {self.token}", **headers})

    def finished(self, run_id: str) -> dict:
        def done():
            run = requests.get(f"{self.api}/v1/runs/{run_id}", timeout=10,
                               headers={"Authorization": f"Bearer {self.token}"}).json()
            return run if run["status"] in ("succeeded", "failed", "cancelled") else None

        return wait_until(done, timeout=60, what=f"run {run_id} to finish")

    def children(self, run_id: str) -> list[dict]:
        return requests.get(f"{self.api}/v1/runs?parent_run_id={run_id}", timeout=10,
                            headers={"Authorization": f"Bearer {self.token}"}).json()["runs"]


def start_platform(env: dict, token: str, tmp_path, processes) -> Platform:
    web, api = start_web(env, tmp_path, workers=1, threads=4)
    processes.append(web)
    worker = start_worker(env, tmp_path, concurrency=2)
    processes.append(worker)
    wait_until(lambda: "ready" in worker.log(), timeout=60, what="the Celery worker")
    return Platform(api, token)


# -- OpenTelemetry -----------------------------------------------------------------------------


def _value(any_value) -> str:
    """An OTLP ``AnyValue`` as text (a list or map as its protobuf text)."""
    kind = any_value.WhichOneof("value")
    return "" if kind is None else str(getattr(any_value, kind))


def spans(receiver: Receiver) -> list[dict]:
    """Every span received, with its process's ``service.name``, decoded from OTLP protobuf."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    found = []
    for body in receiver.bodies("/v1/traces"):
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for resource_spans in request.resource_spans:
            resource = {a.key: a.value.string_value
                        for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    found.append({
                        "service": resource.get("service.name"),
                        "name": span.name,
                        "kind": span.kind,
                        "trace_id": span.trace_id.hex(),
                        "attributes": {a.key: _value(a.value) for a in span.attributes},
                    })
    return found


def test_web_and_worker_spans_continue_the_runs_trace_without_its_input(
        fast_env, make_tenant, tmp_path, processes, receiver):
    secret = f"input-{uuid.uuid4().hex}"
    env = {**fast_env, "POIMEN_WORKFLOW_MODULES": WORKFLOW_MODULES,
           "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
           "OTEL_BSP_SCHEDULE_DELAY": "200"}  # the SDK's own: export every 0.2 s
    platform = start_platform(env, make_tenant().token, tmp_path, processes)

    # doc-review fans out: its children are admitted, and their messages sent, by the
    # worker itself, where the Celery instrumentation rewrites each message's traceparent.
    created = platform.post({"workflow_ref": "doc-review",
                             "input": {"participants": ["ana", secret]}}, traceparent=PARENT)
    assert created.status_code == 201, created.text
    run_id = created.json()["id"]
    assert platform.finished(run_id)["status"] == "succeeded"
    children = platform.children(run_id)
    assert len(children) == 2 and {c["traceparent"] for c in children} == {PARENT}
    runs = {run_id} | {c["id"] for c in children}

    def executed_in_the_trace():
        found = {s["attributes"].get("messaging.message.id") for s in spans(receiver)
                 if s["trace_id"] == TRACE_ID and s["service"] == "poimen-worker"
                 and s["name"] == "run/runs.execute"}
        return runs <= found

    wait_until(executed_in_the_trace, timeout=30,
               what="a run/runs.execute span in the run's trace for the run and each child")
    received = spans(receiver)
    web = [s for s in received if s["service"] == "poimen-web" and s["trace_id"] == TRACE_ID]
    assert any(s["attributes"].get("http.route") == "/v1/runs" for s in web), web
    # Every execute span of these runs is in the run's trace, whoever sent its message.
    executes = [s for s in received if s["name"] == "run/runs.execute"
                and s["attributes"].get("messaging.message.id") in runs]
    assert {s["trace_id"] for s in executes} == {TRACE_ID}
    # The worker's sends (the children's messages) are in it too.
    assert any(s["name"] == "apply_async/runs.execute" and s["trace_id"] == TRACE_ID
               for s in received if s["service"] == "poimen-worker")
    # No span of any process carries the run's input (nor does a span name).
    for span in received:
        assert secret not in json.dumps(span), span
    # The health probes are not traced.
    assert not any("/healthz" in json.dumps(s) for s in received)


SERVER = 2  # opentelemetry.proto.trace.v1.Span.SpanKind.SPAN_KIND_SERVER


def test_opentelemetry_instrument_traces_every_admission(
        fast_env, make_tenant, tmp_path, processes, receiver):
    """``opentelemetry-instrument gunicorn ...`` (its distro's SDK set-up, its Flask
    auto-instrumentation) with only the traces' own endpoint variable: every
    ``POST /v1/runs`` gets a server span, the plain admissions the fast path would
    answer (a cached token, JSON with a length) included, replays too."""
    env = {name: value for name, value in fast_env.items() if not name.startswith("OTEL_")}
    env.update({
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{receiver.port}/v1/traces",
        # The distro's exporter "otlp" over HTTP (its default protocol is gRPC), no metrics
        # or logs exporter: nothing else of OpenTelemetry is configured.
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none",
        "OTEL_SERVICE_NAME": "poimen-web-auto", "OTEL_BSP_SCHEDULE_DELAY": "200"})
    web, api = start_web(env, tmp_path, workers=1, threads=4,
                         wrapper=[str(BIN / "opentelemetry-instrument")])
    processes.append(web)
    platform = Platform(api, make_tenant().token)

    traces = [uuid.uuid4().hex for _ in range(6)]
    for n, trace_id in enumerate(traces):
        # The first looks the token up (Flask in any case); the rest are plain admissions,
        # two of them replays of one key.
        body = {"workflow_ref": "echo", "input": {"n": n}}
        if n >= 4:
            body = {"workflow_ref": "echo", "input": {}, "dispatch_key": "otel-replayed"}
        r = platform.post(body, traceparent=f"00-{trace_id}-00f067aa0ba902b7-01")
        assert r.status_code == (200 if n == 5 else 201), r.text

    def server_spans():
        found = {s["trace_id"]: s for s in spans(receiver)
                 if s["service"] == "poimen-web-auto" and s["kind"] == SERVER
                 and s["attributes"].get("http.route") == "/v1/runs"}
        return found if set(traces) <= set(found) else None

    found = wait_until(server_spans, timeout=30,
                       what="a server span of POST /v1/runs for each of the 6 requests")
    assert {found[t]["attributes"].get("http.response.status_code",
                                       found[t]["attributes"].get("http.status_code"))
            for t in traces} == {"201", "200"}


# -- Sentry ------------------------------------------------------------------------------------


def envelope_items(body: bytes) -> list[tuple[dict, bytes]]:
    """The items of one Sentry envelope (https://develop.sentry.dev/sdk/envelopes/)."""
    header_end = body.index(b"\n")
    rest, items = body[header_end + 1:], []
    while rest.strip():
        line_end = rest.find(b"\n")
        item_header = json.loads(rest[:line_end] if line_end >= 0 else rest)
        rest = rest[line_end + 1:] if line_end >= 0 else b""
        length = item_header.get("length")
        if length is None:
            line_end = rest.find(b"\n")
            payload, rest = (rest, b"") if line_end < 0 else (rest[:line_end], rest[line_end + 1:])
        else:
            payload, rest = rest[:length], rest[length + 1:]
        items.append((item_header, payload))
    return items


def sentry_events(receiver: Receiver) -> tuple[list[dict], list[bytes]]:
    """The events received, and every raw envelope body (all of it is checked)."""
    bodies = receiver.bodies("/api/1/envelope/")
    events = [json.loads(payload) for body in bodies for header, payload in envelope_items(body)
              if header.get("type") == "event"]
    return events, bodies


def test_a_failing_runs_exception_reaches_sentry_tagged_without_its_input(
        fast_env, make_tenant, tmp_path, processes, receiver):
    secret = f"hunter2-{uuid.uuid4().hex}"
    tenant = make_tenant()
    env = {**fast_env, "POIMEN_WORKFLOW_MODULES": WORKFLOW_MODULES,
           "SENTRY_DSN": f"http://public@127.0.0.1:{receiver.port}/1",
           "SENTRY_ENVIRONMENT": "test"}
    platform = start_platform(env, tenant.token, tmp_path, processes)

    created = platform.post({"workflow_ref": "leaky-failure",
                             "input": {"password": secret, "user": "ana"}})
    assert created.status_code == 201, created.text
    run_id = created.json()["id"]
    run = platform.finished(run_id)
    assert run["status"] == "failed"
    assert secret in json.dumps(run["error"])  # the tenant's own API shows its own error

    def exception_event():
        events, _ = sentry_events(receiver)
        return [e for e in events if any(v.get("type") == "LoginRefused" for v in
                                         (e.get("exception") or {}).get("values", []))]

    event = wait_until(exception_event, timeout=30, what="the run's exception in Sentry")[0]
    assert event["tags"]["run_id"] == run_id
    assert event["tags"]["tenant"] == tenant.name
    assert event["environment"] == "test"
    frames = event["exception"]["values"][-1]["stacktrace"]["frames"]
    assert any(f.get("function") == "leaky_failure" for f in frames)
    assert all("vars" not in f for f in frames)
    # Nothing received, in any envelope (events, breadcrumbs, sessions), holds the input.
    _, bodies = sentry_events(receiver)
    for body in bodies:
        assert secret.encode() not in body
        assert b"hunter2" not in body
