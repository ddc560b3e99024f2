"""The sender's messages stay what Celery's ``send_task`` writes under a team's settings.

A workflow module may change the Celery app (``tests/workflows/team_settings.py``): a
serializer, compression, routes (a map or a router function), annotations, a default
priority, a publish-signal receiver, message signing. The sender's wire
(``app/enqueue.py``: ``RedisWire``) writes a message itself only where ``send_task`` under
the live configuration writes the same one; elsewhere ``send_task`` sends it and the
process says why once. Here each setting runs in a Celery app of its own (the web's
settings plus the team's) on the real Redis: the sender's admission of a run is compared,
field by field, with the message ``send_task`` writes for the same run. The process tests
at the end start the web process and a worker with each setting (no beat: nothing repairs)
and every run succeeds at once.
"""

from __future__ import annotations

import base64
import json
import logging
import time
import uuid

import pytest
import requests
from celery import Celery, signals

from app.enqueue import RedisWire, Sender, _publish
from tests.processes import start_web, start_worker, wait_until
from tests.workflows import team_settings


@pytest.fixture
def signing_dir(tmp_path):
    team_settings.make_signing_files(tmp_path / "signing")
    return tmp_path / "signing"


@pytest.fixture
def team_celery(app, signing_dir):
    """``make(setting)``: a Celery app with the web's settings and the team's ``setting``
    (None: the web's alone)."""
    from celeryconfig import celery_settings

    made = []

    def make(setting: str | None) -> Celery:
        celery_app = Celery("team", set_as_current=False)
        celery_app.config_from_object(celery_settings(app.config["CELERY_BROKER_URL"]))
        if setting == "signed":
            # setup_security's process-wide parts (the kombu registry's default serializer,
            # refusing every other content type) would outlive this test: the auth
            # serializer alone, as setup_security registers it (the process test runs
            # setup_security itself).
            from celery.security.serialization import register_auth

            celery_app.conf.update(task_serializer="auth", accept_content=["auth"])
            register_auth((signing_dir / "signer.key").read_text(), None,
                          (signing_dir / "signer.pem").read_text(),
                          str(signing_dir / "store"), "sha256", "json")
        elif setting is not None:
            team_settings.SETTINGS[setting](celery_app, None)
        made.append(celery_app)
        return celery_app

    yield make
    signals.before_task_publish.disconnect(team_settings._seen)
    for celery_app in made:
        celery_app.close()


def _taken(redis_client, run_id: uuid.UUID) -> list[tuple[str, dict]]:
    """Every message of ``run_id`` in the run's possible lists, removed, oldest first."""
    found = []
    keys = [k.decode() for k in redis_client.keys("*") if redis_client.type(k) == b"list"]
    for key in keys:
        for raw in reversed(redis_client.lrange(key, 0, -1)):
            message = json.loads(raw)
            if message.get("headers", {}).get("id") == str(run_id):
                redis_client.lrem(key, 1, raw)
                found.append((key, message))
    return found


def _comparable(message: dict, celery_app: Celery) -> dict:
    """The message without its per-message ids (the delivery tag; reply-to, the sending
    thread's); a signed body as what it signs (a signature is made afresh for each
    message: RSA-PSS)."""
    message = json.loads(json.dumps(message))
    message["properties"].pop("delivery_tag")
    message["properties"].pop("reply_to")
    if message["content-type"] == "application/data":  # celery.security's signed body
        from kombu.serialization import loads

        raw = base64.b64decode(message["body"])
        message["body"] = loads(raw, message["content-type"], message["content-encoding"],
                                accept=["auth"])
    return message


@pytest.mark.parametrize("setting", sorted(team_settings.SETTINGS))
def test_an_admission_is_the_message_send_task_writes(app, team_celery, redis_client, setting,
                                                      caplog, monkeypatch):
    from app import enqueue

    monkeypatch.setattr(enqueue, "_told", set())  # as in a fresh process
    celery_app = team_celery(setting)
    run_id = uuid.uuid4()
    with app.app_context(), caplog.at_level(logging.INFO, logger="app.enqueue"):
        out = Sender(celery_app)
        out.put(run_id, "echo")  # the web's admission
        assert out.wait_idle(10)
        _publish(celery_app, run_id, "echo", None)  # send_task, as a retry or repair sends
        with celery_app.producer_or_acquire() as producer:
            wire = RedisWire(celery_app, producer.channel)
            by_wire = (wire.message(uuid.uuid4(), "echo", None)
                       if RedisWire.usable(celery_app, producer.channel) else None)
    (admission_key, admission), (celery_key, by_celery) = _taken(redis_client, run_id)
    assert admission_key == celery_key
    assert _comparable(admission, celery_app) == _comparable(by_celery, celery_app)
    # Each of these settings changes the message: the wire steps aside and says so once,
    # naming no run.
    said = [r.getMessage() for r in caplog.records if "with send_task" in r.getMessage()]
    assert by_wire is None
    assert said, "the fallback is logged"
    assert str(run_id) not in " ".join(said)


@pytest.mark.parametrize("setting, hint", [
    ("msgpack", "task_serializer"), ("gzip", "task_compression"), ("routes", "list key"),
    ("router", "router function"), ("publish-signal", "before_task_publish"),
    ("signed", "body"), ("annotations", "task_annotations"),
    ("default-priority", "task_default_priority"),
])
def test_the_fallback_is_logged_once_with_the_setting(app, team_celery, caplog, monkeypatch,
                                                      setting, hint):
    from app import enqueue

    monkeypatch.setattr(enqueue, "_told", set())  # as in a fresh process
    celery_app = team_celery(setting)
    with app.app_context(), caplog.at_level(logging.INFO, logger="app.enqueue"), \
            celery_app.producer_or_acquire() as producer:
        for _ in range(3):
            if RedisWire.usable(celery_app, producer.channel):
                wire = RedisWire(celery_app, producer.channel)  # a new channel's wire too
                assert wire.message(uuid.uuid4(), "echo", None) is None
    said = [r.getMessage() for r in caplog.records if "with send_task" in r.getMessage()]
    assert len(said) == 1 and hint in said[0], said


@pytest.mark.parametrize("setting", ["annotations", "default-priority"])
def test_the_web_sends_the_task_options_a_worker_sends(app, team_celery, setting):
    """send_task adds runs.execute's own options (task_annotations, task_default_priority,
    task_time_limit, ...) only where the task is registered: a worker, whose retries and
    repairs carry them. The web process has no task; its sends pass the same options."""
    import workers.tasks  # noqa: F401 - registers runs.execute with every app finalized after
    from app.enqueue import _task_options
    from app.task_names import EXECUTE_RUN

    web, worker = team_celery(setting), team_celery(setting)
    worker.finalize()
    assert EXECUTE_RUN in worker._tasks and EXECUTE_RUN not in web._tasks
    by_worker = {key: value for key, value in
                 worker._tasks[EXECUTE_RUN]._get_exec_options().items() if value is not None}
    assert _task_options(web) == by_worker
    assert by_worker["priority"] == (5 if setting == "annotations" else 4)


@pytest.mark.parametrize("name", ["before_task_publish", "after_task_publish", "task_sent"])
def test_a_publish_signal_receiver_gets_send_task(app, caplog, monkeypatch, name):
    """A receiver of any of Celery's publish signals runs only where send_task sends."""
    from app import enqueue

    monkeypatch.setattr(enqueue, "_told", set())
    signal = getattr(signals, name)
    signal.connect(team_settings._seen, weak=False)
    celery_app = app.extensions["celery"]
    try:
        with caplog.at_level(logging.INFO, logger="app.enqueue"), \
                celery_app.producer_or_acquire() as producer:
            assert not RedisWire.usable(celery_app, producer.channel)
            assert not RedisWire.usable(celery_app, producer.channel)
    finally:
        signal.disconnect(team_settings._seen)
    said = [r.getMessage() for r in caplog.records if "with send_task" in r.getMessage()]
    assert len(said) == 1 and name in said[0], said


def test_the_same_settings_keep_the_wire(app, team_celery, caplog, monkeypatch):
    """The web's own settings, or a team's that leave the message as it is (a route to the
    default queue): the check finds send_task's message equal, the wire writes, nothing
    is logged."""
    from app import enqueue

    monkeypatch.setattr(enqueue, "_told", set())
    same_route = team_celery(None)
    same_route.conf.update(task_routes={
        "runs.execute": {"queue": same_route.conf.task_default_queue}})
    with app.app_context(), caplog.at_level(logging.INFO, logger="app.enqueue"):
        for celery_app in (app.extensions["celery"], same_route):
            with celery_app.producer_or_acquire() as producer:
                wire = RedisWire(celery_app, producer.channel)
                assert wire._unlike_send_task("echo", ()) is None
                assert wire._unlike_send_task("echo", ("traceparent", "tracestate")) is None
                assert wire._unlike_send_task("soft-time", ()) is None
                assert wire.message(uuid.uuid4(), "echo", None) is not None
    assert not [r for r in caplog.records if "with send_task" in r.getMessage()]


# -- real processes: the web admits, a worker runs; no beat, so nothing is repaired -----------

@pytest.mark.slow
@pytest.mark.parametrize("setting", sorted(team_settings.SETTINGS))
def test_every_run_succeeds_at_once_under_a_teams_settings(test_env, tmp_path, tenant, processes,
                                                          setting, signing_dir):
    """The web process admits with the team's module loaded, a worker with it runs: no beat
    runs, so a message the worker dropped (signing refuses an unsigned one, msgpack's
    accept_content a JSON one) would leave its run queued."""
    queue = test_env["POIMEN_QUEUE"]
    env = {**test_env, "POIMEN_WORKFLOW_MODULES": "tests.workflows,tests.workflows.team_settings",
           "POIMEN_TEST_TEAM_SETTING": setting, "POIMEN_TEST_SIGNING_DIR": str(signing_dir)}
    worker = start_worker(env, tmp_path, extra=(
        "-Q", f"{queue},{team_settings.routed_queue(queue)}"))
    processes.append(worker)
    web, url = start_web(env, tmp_path, workers=1, threads=4)
    processes.append(web)
    wait_until(lambda: "ready" in worker.log(), timeout=60, what="the worker")
    started = time.monotonic()
    runs = []
    for i in range(5):
        created = requests.post(f"{url}/v1/runs", headers=tenant.headers, timeout=10, json={
            "workflow_ref": "echo", "input": {"i": i},
            "dispatch_key": f"team-{setting}-{uuid.uuid4()}"})
        assert created.status_code == 201, created.text
        runs.append(created.json()["id"])

    def all_succeeded():
        statuses = [requests.get(f"{url}/v1/runs/{run}", headers=tenant.headers,
                                 timeout=5).json()["status"] for run in runs]
        assert "failed" not in statuses, statuses
        return all(status == "succeeded" for status in statuses)

    wait_until(all_succeeded, timeout=15, what=f"the runs under {setting}")
    assert time.monotonic() - started < 15
    # The web process said once why send_task sends, naming no run.
    told = [line for line in web.log().splitlines() if "with send_task" in line]
    assert len(told) == 1, told
    assert not any(run in told[0] for run in runs)
