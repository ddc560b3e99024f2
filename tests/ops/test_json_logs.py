"""LOG_FORMAT=json: every line of every process is one JSON object.

The platform runs from the Procfile (web under gunicorn with app/gunicorn_conf.py,
worker, beat, inbox, outbox). A run comes in over Kafka, one over HTTP fails
(its workflow raises with the input in its message), one Kafka message names
a workflow that does not exist (dead-lettered). Every run's input holds a
secret that must appear in no log line. Then every process is stopped, so
start-up and shutdown lines are in the logs too.
"""

from __future__ import annotations

import json
import uuid

import pytest
import requests

from tests.ops.platform import start_platform
from tests.processes import metric, wait_until


def records(text: str, name: str) -> list[dict]:
    """Every line of ``text`` as a JSON object; fails naming the first line that is not one."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    assert lines, f"{name} wrote nothing"
    parsed = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError:
            raise AssertionError(f"{name} line {number} is not JSON: {line[:300]!r}") from None
        assert isinstance(record, dict), f"{name} line {number} is not an object: {line[:300]!r}"
        parsed.append(record)
    return parsed


@pytest.mark.processes
def test_every_line_of_every_process_is_json_with_run_fields_and_no_input(
        test_env, make_tenant, pg, tmp_path):
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    platform = start_platform(test_env, make_tenant, tmp_path, LOG_FORMAT="json",
                              LOG_LEVEL="INFO")
    headers = platform.creds.headers
    try:
        # Over Kafka: one run that succeeds (echo: its result is its input), and one
        # message naming a workflow that does not exist (the API's 422: dead-lettered).
        platform.publish(
            {"workflow_ref": "echo", "input": {"note": secret}, "dispatch_key": "ops-kafka-1"},
            {"workflow_ref": "no-such-workflow", "input": {"note": secret},
             "dispatch_key": "ops-kafka-2"})
        # Over HTTP: a run whose workflow raises with the input in its message.
        failing = requests.post(f"{platform.api}/v1/runs", headers=headers, timeout=10, json={
            "workflow_ref": "fail", "input": {"message": secret}, "dispatch_key": "ops-http-1"})
        assert failing.status_code == 201, failing.text
        failed_id = failing.json()["id"]

        def run(dispatch_key: str) -> dict | None:
            found = requests.get(f"{platform.api}/v1/runs", headers=headers, timeout=10,
                                 params={"dispatch_key": dispatch_key}).json()["runs"]
            return found[0] if found else None

        wait_until(lambda: (r := run("ops-kafka-1")) and r["status"] == "succeeded",
                   timeout=90, what="the Kafka run to succeed")
        wait_until(lambda: (r := run("ops-http-1")) and r["status"] == "failed",
                   timeout=90, what="the failing run to fail")
        assert run("ops-http-1")["error"]["message"] == secret  # the tenant sees it; logs do not
        inbox = platform.procs["inbox"]
        wait_until(lambda: "dead-lettered" in inbox.log(), timeout=60,
                   what="the unknown workflow's message to be dead-lettered")
        assert metric(platform.metrics_url("inbox"), "poimen_dlq_total", reason="http_422") == 1
        # The outbox shipped every event; beat sent its repair task at least twice.
        wait_until(lambda: pg.execute("SELECT count(*) FROM outbox WHERE published_at IS NULL")
                   .fetchone()[0] == 0, timeout=60, what="the outbox to publish every event")
        wait_until(lambda: platform.procs["beat"].log().count("runs.repair") >= 2, timeout=60,
                   what="beat to send its repair task")
    finally:
        platform.stop()

    logs = {name: records(proc.log(), name) for name, proc in platform.procs.items()}
    for name, proc in platform.procs.items():
        assert secret not in proc.log(), f"{name} logged a run's input"

    # The failed run's traceback is inside one record that carries its run id.
    worker = logs["worker"]
    with_traceback = [r for r in worker
                      if r.get("run_id") == failed_id and "ExampleFailure" in r.get("traceback", "")]
    assert with_traceback, "no worker record carries the failed run's traceback and run_id"
    record = with_traceback[0]
    assert record["traceback"].startswith("Traceback (most recent call last):")
    assert "workers/examples.py" in record["traceback"]  # its frames, not only its type
    assert record["tenant"] == platform.tenant
    assert record["task_id"] == failed_id  # the Celery task id is the run id
    assert record["level"] == "ERROR"

    # Each process wrote records of its own, at INFO.
    assert any(r["logger"] == "gunicorn.access" and "POST /v1/runs" in r["message"]
               for r in logs["web"])
    assert any("ready" in r["message"] for r in worker)
    assert any("runs.repair" in r["message"] for r in logs["beat"])
    dead_lettered = [r for r in logs["inbox"] if "dead-lettered" in r["message"]]
    assert dead_lettered and dead_lettered[0]["tenant"] == platform.tenant
    assert any("stopped" in r["message"] for r in logs["inbox"])
    assert logs["outbox"]
    for name, parsed in logs.items():
        assert {"time", "level", "logger", "message"} <= set(parsed[0]), name


@pytest.mark.processes
def test_log_level_is_honoured_by_every_process(test_env, make_tenant, tmp_path):
    platform = start_platform(test_env, make_tenant, tmp_path, LOG_FORMAT="json",
                              LOG_LEVEL="WARNING")
    try:
        created = requests.post(f"{platform.api}/v1/runs", headers=platform.creds.headers,
                                timeout=10, json={"workflow_ref": "fail", "input": {}})
        assert created.status_code == 201
        run_id = created.json()["id"]
        wait_until(lambda: requests.get(f"{platform.api}/v1/runs/{run_id}", timeout=10,
                                        headers=platform.creds.headers).json()["status"]
                   == "failed", timeout=90, what="the run to fail")
        wait_until(lambda: run_id in platform.procs["worker"].log(), timeout=30,
                   what="the worker to log the failure (an ERROR)")
    finally:
        platform.stop()
    for name, proc in platform.procs.items():
        levels = {r["level"] for r in records(proc.log(), name)} if proc.log() else set()
        assert levels <= {"WARNING", "ERROR", "CRITICAL"}, (name, levels)
    # The level filters, it does not silence: the failure is there.
    assert any(r.get("run_id") == run_id and r["level"] == "ERROR"
               for r in records(platform.procs["worker"].log(), "worker"))


@pytest.mark.processes
def test_librdkafka_lines_are_json_too_when_the_broker_is_down(test_env, tmp_path):
    import sys

    from tests.processes import Process, free_port, start_inbox

    # Nothing listens there: librdkafka logs connection failures on its own threads.
    env = {**test_env, "LOG_FORMAT": "json", "POIMEN_API_URL": "http://127.0.0.1:9",
           "POIMEN_API_TOKEN": "unused", "KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{free_port()}",
           "POIMEN_INBOX_GROUP": f"ops-down-{uuid.uuid4().hex[:8]}",
           "POIMEN_INBOX_LAG_INTERVAL": "0.5", "POIMEN_OUTBOX_LAG_INTERVAL": "0.5"}
    relay, _ = start_inbox(env, tmp_path, name="inbox-broker-down")
    outbox = Process("outbox-broker-down", [sys.executable, "-m", "bridge.outbox"],
                     {**env, "METRICS_PORT": str(free_port())}, tmp_path).start()
    try:
        for proc in (relay, outbox):
            wait_until(lambda p=proc: '"logger": "rdkafka"' in p.log(), timeout=60,
                       what=f"librdkafka to log the refused connection in {proc.name}")
        # Let the clients only the lag threads serve (admin, lag observer) log too.
        wait_until(lambda: relay.log().count("rdkafka#producer") >= 1, timeout=30,
                   what="the inbox's admin client to log")
    finally:
        relay.stop()
        outbox.stop()
    for proc in (relay, outbox):
        parsed = records(proc.log(), proc.name)
        assert any(r["logger"] == "rdkafka" and "Connection refused" in r["message"]
                   for r in parsed), proc.name


def test_a_request_adds_its_tenant_run_and_dispatch_key_to_records(app, monkeypatch):
    import logging
    from types import SimpleNamespace

    from flask import g

    import logconfig
    from app import logs

    monkeypatch.setenv("LOG_FORMAT", "json")
    run_id = str(uuid.uuid4())
    with app.test_request_context(f"/v1/runs/{run_id}"):
        g.principal = SimpleNamespace(tenant_name="acme")
        logs.note(dispatch_key="order-42")
        record = logging.LogRecord("app.api", logging.ERROR, __file__, 1, "boom", None, None)
        entry = json.loads(logconfig.JsonFormatter().format(record))
    assert (entry["tenant"], entry["run_id"], entry["dispatch_key"]) == ("acme", run_id,
                                                                         "order-42")
    # Outside the request, none of it sticks.
    entry = json.loads(logconfig.JsonFormatter().format(record))
    assert not {"tenant", "run_id", "dispatch_key"} & set(entry)


def test_tracebacks_keep_frames_and_types_but_never_messages():
    import logging

    import logconfig

    def fail(secret: str) -> None:
        try:
            raise KeyError(secret)
        except KeyError as err:
            raise ValueError(f"bad input {secret}") from err

    secret = f"s3cr3t-{uuid.uuid4().hex}"
    try:
        fail(secret)
    except ValueError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", None,
                                   __import__("sys").exc_info())
    for formatter in (logconfig.JsonFormatter(), logconfig.TextFormatter()):
        text = formatter.format(record)
        assert secret not in text
        if isinstance(formatter, logconfig.JsonFormatter):
            text = json.loads(text)["traceback"]
        # Python's order: the cause first, the exception raised from it last.
        assert text.index("builtins.KeyError") < text.index("direct cause") \
            < text.index("builtins.ValueError")
        assert "in fail" in text  # the frames are kept
    line = logconfig.JsonFormatter().format(record)
    assert "\n" not in line  # one line, the traceback inside the object
    assert json.loads(line)["exc_type"] == "builtins.ValueError"


@pytest.mark.processes
def test_the_release_phase_logs_json_too(test_env, tmp_path):
    from tests.processes import start_procfile_process

    release = start_procfile_process("release", {**test_env, "LOG_FORMAT": "json"}, tmp_path)
    assert release.proc.wait(120) == 0, release.log()[-3000:]
    parsed = records(release.log(), "release")
    assert any(r["logger"].startswith("alembic") for r in parsed)
