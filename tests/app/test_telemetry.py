"""Optional OpenTelemetry and Sentry (app/telemetry.py): off and not imported unless
configured, one clear line when configured without the package, and what may reach
Sentry. The real processes sending to stand-in receivers: tests/e2e/test_telemetry.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import logconfig
from app.telemetry import SCRUBBED, scrub_event
from poimenconfig import telemetry_settings
from tests.processes import ROOT

TELEMETRY_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                       "OTEL_SERVICE_NAME", "SENTRY_DSN",
                       "SENTRY_ENVIRONMENT", "SENTRY_RELEASE")


def test_each_is_off_unless_its_variable_is_set():
    assert telemetry_settings({}).otlp_endpoint is None
    assert telemetry_settings({"SENTRY_DSN": "  "}).sentry_dsn is None
    on = telemetry_settings({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/",
                             "SENTRY_DSN": "https://k@o1.ingest.sentry.io/2"})
    assert on.otlp_traces_url == "http://collector:4318/v1/traces"
    assert on.sentry_dsn == "https://k@o1.ingest.sentry.io/2"


def test_the_traces_endpoint_alone_turns_tracing_on_and_is_used_as_it_is():
    traces = telemetry_settings({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/spans"})
    assert traces.tracing and traces.otlp_endpoint is None
    assert traces.otlp_traces_url == "http://c:4318/spans"
    both = telemetry_settings({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://base:4318",
                               "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/spans"})
    assert both.otlp_traces_url == "http://c:4318/spans"
    assert not telemetry_settings({}).tracing


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.processes  # a fresh interpreter: what importing and starting load
def test_neither_package_is_imported_when_their_variables_are_unset(test_env):
    env = {k: v for k, v in test_env.items() if k not in TELEMETRY_VARIABLES}
    code = (
        "import sys\n"
        "import app, app.telemetry\n"
        "import workers.celery\n"  # the worker's, beat's and Flower's wiring
        "from app import telemetry\n"
        "telemetry.init_web(workers.celery.app.flask_app)\n"  # what gunicorn's worker does
        "telemetry.init_celery_process()\n"                   # what worker_init does
        "loaded = sorted(m for m in sys.modules\n"
        "                if m.split('.')[0] in ('sentry_sdk', 'opentelemetry'))\n"
        "assert not loaded, loaded\n"
        "print('clean')\n"
    )
    proc = _run(code, env)
    assert proc.returncode == 0 and "clean" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.processes  # a fresh interpreter without the packages
def test_a_variable_set_without_its_package_is_one_log_line_and_the_process_runs_on(test_env):
    env = {**test_env, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
           "SENTRY_DSN": "http://key@127.0.0.1:9/1", "LOG_FORMAT": "json"}
    code = (
        "import importlib.abc, logging, sys\n"
        "class Missing(importlib.abc.MetaPathFinder):\n"  # as if the extras were not installed
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in ('sentry_sdk', 'opentelemetry'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Missing())\n"
        "import logconfig\n"
        "logconfig.configure()\n"
        "from flask import Flask\n"
        "from app import telemetry\n"
        "telemetry.init_web(Flask('web'))\n"
        "print('ran on')\n"
    )
    proc = _run(code, env)
    assert proc.returncode == 0 and "ran on" in proc.stdout, proc.stderr[-3000:]
    lines = [json.loads(line) for line in (proc.stdout + proc.stderr).splitlines()
             if line.startswith("{")]
    warnings = [r["message"] for r in lines if r.get("level") == "WARNING"]
    assert len(warnings) == 2, warnings
    assert sum("OTEL_EXPORTER_OTLP_ENDPOINT is set" in w and "poimen[otel]" in w
               for w in warnings) == 1, warnings
    assert sum("SENTRY_DSN is set" in w and "poimen[sentry]" in w for w in warnings) == 1


SECRET = "s3cret-hunter2"


def test_a_sentry_event_keeps_ids_and_frames_and_loses_everything_else():
    event = {
        "event_id": "e1", "level": "error", "platform": "python", "environment": "prod",
        "exception": {"values": [{
            "type": "LoginRefused", "module": "flows", "value": f"password {SECRET!r}",
            "stacktrace": {"frames": [{"function": "login", "lineno": 3, "filename": "f.py",
                                       "vars": {"password": SECRET}}]}}]},
        "threads": {"values": [{"id": 1, "stacktrace": {"frames": [
            {"function": "run", "vars": {"input": {"password": SECRET}}}]}}]},
        "request": {"method": "POST", "url": "https://poimen/v1/runs?token=" + SECRET,
                    "query_string": "token=" + SECRET, "data": {"input": {"p": SECRET}},
                    "cookies": {"session": SECRET}, "env": {"REMOTE_ADDR": "10.0.0.1"},
                    "headers": {"Authorization": f"Bearer {SECRET}", "X-Request-ID": "r1",
                                "Content-Type": "application/json"}},
        "logentry": {"message": "run %s: failed: %s", "params": ["r1", SECRET],
                     "formatted": f"run r1: failed: {SECRET}"},
        "message": SECRET,
        "extra": {"celery-job": {"args": [SECRET]}, "sys.argv": ["celery"]},
        "user": {"ip_address": "10.0.0.1"},
        "contexts": {"trace": {"trace_id": "t"}, "celery": {"args": [SECRET]}},
        "breadcrumbs": {"values": [
            {"type": "log", "category": "workers.execution", "message": "run r1: started",
             "data": {"input": SECRET}},
            {"category": "query", "message": "UPDATE runs SET x = %(x)s",
             "data": {"db.params": [SECRET]}},
            {"category": "redis", "message": f"LPUSH poimen {SECRET}"},
        ]},
        "tags": {"celery_task_id": "r1"},
    }
    with logconfig.log_context(run_id="r1", tenant="acme", input=SECRET):
        out = scrub_event(event, {})
    assert SECRET not in json.dumps(out)
    assert out["tags"] == {"celery_task_id": "r1", "run_id": "r1", "tenant": "acme"}
    value = out["exception"]["values"][0]
    assert (value["type"], value["value"]) == ("LoginRefused", SCRUBBED)
    assert value["stacktrace"]["frames"] == [{"function": "login", "lineno": 3,
                                              "filename": "f.py"}]
    assert out["request"] == {"method": "POST", "url": "https://poimen/v1/runs",
                              "headers": {"X-Request-ID": "r1",
                                          "Content-Type": "application/json"}}
    assert out["logentry"] == {"message": "run %s: failed: %s"}
    assert out["contexts"] == {"trace": {"trace_id": "t"}}
    assert [c.get("message") for c in out["breadcrumbs"]["values"]] == [
        "run r1: started", "UPDATE runs SET x = %(x)s", None]
    assert "extra" not in out and "user" not in out and "message" not in out


def test_the_installed_sentry_sdk_takes_the_privacy_options_and_collects_nothing_of_a_request():
    """sentry-sdk 3 refuses 2.x's ``send_default_pii`` and ``include_local_variables`` (a web
    worker that passed them failed to boot): the options follow the installed major."""
    sentry_sdk = pytest.importorskip("sentry_sdk")
    from app.telemetry import sentry_privacy

    client = sentry_sdk.Client(dsn="http://public@127.0.0.1:9/1", release="test",  # no git
                               max_request_body_size="never",
                               **sentry_privacy(sentry_sdk.VERSION))
    try:
        options = client.options
        if int(sentry_sdk.VERSION.split(".")[0]) < 3:
            assert options["send_default_pii"] is False
            assert options["include_local_variables"] is False
            return
        collected = options["data_collection"]
        assert collected["user_info"] is False and collected["http_bodies"] == []
        assert collected["stack_frame_variables"] is False and collected["queues"] is False
        assert collected["database_query_data"] is False
        for kind in ("cookies", "url_query_params"):
            assert collected[kind]["mode"] == "off", kind
        assert collected["http_headers"]["request"]["mode"] == "off"
        assert not any(collected["gen_ai"].values()) and not any(collected["mcp"].values())
        assert not any(collected["graphql"].values())
    finally:
        client.close()


def test_sentry_sdk_2_gets_its_own_names_for_the_privacy_options():
    from app.telemetry import sentry_privacy

    assert sentry_privacy("2.75.0") == {"send_default_pii": False,
                                        "include_local_variables": False}
    assert set(sentry_privacy("3.0.0")) == {"data_collection"}
