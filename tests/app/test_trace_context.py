"""W3C Trace Context on runs: a ``traceparent`` on ``POST /v1/runs`` is
kept on the run and travels in every Celery message of the run (read here off the real
Redis queue). Events and the Kafka inbox: tests/e2e/test_trace_context.py."""

from __future__ import annotations

import json

import pytest

from app.tracecontext import from_headers, parse_traceparent, parse_tracestate

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
STATE = "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"


# -- the format ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [
    PARENT,
    f"00-{TRACE_ID}-00f067aa0ba902b7-00",   # not sampled
    f" {PARENT}\t",                          # optional whitespace around a header value
])
def test_a_valid_traceparent_is_kept(value):
    assert parse_traceparent(value) == value.strip()


@pytest.mark.parametrize("value", [
    None, "", "garbage", PARENT.upper(), PARENT.replace("4bf9", "4BF9"),
    f"00-{'0' * 32}-00f067aa0ba902b7-01",     # all-zero trace id
    f"00-{TRACE_ID}-{'0' * 16}-01",           # all-zero parent id
    f"ff-{TRACE_ID}-00f067aa0ba902b7-01",     # version ff is invalid
    f"{PARENT}-extra",                        # version 00 has exactly four fields
    f"00-{TRACE_ID[:-1]}-00f067aa0ba902b7-01",
    f"00-{TRACE_ID}-00f067aa0ba902b7-1",
    f"00_{TRACE_ID}_00f067aa0ba902b7_01",
    f"00-{TRACE_ID}-00f067aa0ba902b7-0g",
    f"00-{TRACE_ID}-00f067aa0ba902b7-01\n",   # not a header value
])
def test_an_invalid_traceparent_is_ignored(value):
    assert parse_traceparent(value) is None


def test_a_later_version_is_read_by_its_first_four_fields_and_kept_as_version_00():
    assert parse_traceparent(f"cc-{TRACE_ID}-00f067aa0ba902b7-01-what-comes-next") == PARENT
    assert parse_traceparent(f"cc-{TRACE_ID}-00f067aa0ba902b7-01what") is None


@pytest.mark.parametrize(("value", "kept"), [
    (STATE, STATE),
    ("rojo=1, ,congo=2", "rojo=1,congo=2"),   # empty members and whitespace dropped
    ("tenant@vendor=x", "tenant@vendor=x"),
    ("rojo=1,rojo=2", None),                  # a key twice
    ("Rojo=1", None),                         # keys are lowercase
    ("rojo", None),
    ("rojo=a=b", None),
    (",".join(f"k{n}=v" for n in range(33)), None),  # over 32 members
    ("k=" + "v" * 600, None),
    ("", None),
])
def test_tracestate(value, kept):
    assert parse_tracestate(value) == kept


def test_a_tracestate_without_a_valid_traceparent_is_dropped_with_it():
    assert from_headers({"tracestate": STATE}) is None
    assert from_headers({"traceparent": "nope", "tracestate": STATE}) is None
    trace = from_headers({"traceparent": PARENT, "tracestate": "bad value"})
    assert (trace.traceparent, trace.tracestate) == (PARENT, None)


# -- HTTP -> the run -> the Celery message ------------------------------------------------------


def post(client, creds, headers=None, **body):
    return client.post("/v1/runs", json={"workflow_ref": "echo", "input": {}, **body},
                       headers={**creds.headers, **(headers or {})})


def messages(redis_client, queue_name) -> dict[str, dict]:
    """The ``runs.execute`` messages waiting in the queue: run id -> message headers."""
    return {m["headers"]["id"]: m["headers"]
            for m in map(json.loads, redis_client.lrange(queue_name, 0, -1))}


def stored(pg, run_id) -> tuple:
    return pg.execute("SELECT traceparent, tracestate FROM runs WHERE id = %s",
                      [run_id]).fetchone()


def test_a_traceparent_is_kept_on_the_run_and_travels_in_its_celery_message(
        client, tenant, pg, redis_client, queue_name, sent):
    redis_client.delete(queue_name)
    r = post(client, tenant, {"traceparent": PARENT, "tracestate": STATE})
    assert r.status_code == 201, r.json
    run_id = r.json["id"]
    assert r.json["traceparent"] == PARENT
    assert stored(pg, run_id) == (PARENT, STATE)
    assert client.get(f"/v1/runs/{run_id}", headers=tenant.headers).json["traceparent"] == PARENT
    sent()
    headers = messages(redis_client, queue_name)[run_id]
    assert headers["task"] == "runs.execute"
    assert (headers["traceparent"], headers["tracestate"]) == (PARENT, STATE)


@pytest.mark.parametrize("bad", [PARENT.upper(), f"00-{'0' * 32}-00f067aa0ba902b7-01",
                                 "\u00e9t\u00e9", "x" * 2000])
def test_an_invalid_traceparent_is_ignored_never_an_error(client, tenant, pg, redis_client,
                                                          queue_name, sent, bad):
    redis_client.delete(queue_name)
    r = client.post("/v1/runs", json={"workflow_ref": "echo", "input": {}},
                    headers={**tenant.headers, "traceparent": bad, "tracestate": STATE})
    assert r.status_code == 201, r.json
    assert r.json["traceparent"] is None
    assert stored(pg, r.json["id"]) == (None, None)
    sent()
    headers = messages(redis_client, queue_name)[r.json["id"]]
    assert "traceparent" not in headers and "tracestate" not in headers


def test_a_run_without_a_traceparent_has_none(client, tenant, pg, redis_client, queue_name,
                                              sent):
    redis_client.delete(queue_name)
    r = post(client, tenant)
    assert r.status_code == 201 and r.json["traceparent"] is None
    sent()
    assert "traceparent" not in messages(redis_client, queue_name)[r.json["id"]]


def test_a_replay_returns_the_run_unchanged_and_resends_it_with_the_first_traceparent(
        client, tenant, pg, redis_client, queue_name, sent):
    first = post(client, tenant, {"traceparent": PARENT}, dispatch_key="traced")
    assert first.status_code == 201
    sent()
    redis_client.delete(queue_name)
    other = f"00-{'a' * 32}-{'b' * 16}-01"
    replay = post(client, tenant, {"traceparent": other, "tracestate": STATE},
                  dispatch_key="traced")
    # The trace context is not part of the request a replay is compared with.
    assert replay.status_code == 200, replay.json
    assert replay.json["id"] == first.json["id"] and replay.json["traceparent"] == PARENT
    assert stored(pg, first.json["id"]) == (PARENT, None)
    sent()
    # Still queued, so the replay re-sends it: with the run's trace context, not this call's.
    headers = messages(redis_client, queue_name)[first.json["id"]]
    assert headers["traceparent"] == PARENT and "tracestate" not in headers


def test_a_repair_resend_carries_the_runs_traceparent(app, client, tenant, pg, redis_client,
                                                      queue_name, sent):
    from app.extensions import db
    from app.run_service import redrive_stranded_runs

    run_id = post(client, tenant, {"traceparent": PARENT, "tracestate": STATE}).json["id"]
    sent()
    redis_client.delete(queue_name)  # the message was lost
    pg.execute("UPDATE runs SET last_sent_at = now() - interval '1 hour' WHERE id = %s",
               [run_id])
    with app.app_context():
        redrive_stranded_runs(db.session, app.extensions["celery"], min_age=60)
    headers = messages(redis_client, queue_name)[run_id]
    assert (headers["traceparent"], headers["tracestate"]) == (PARENT, STATE)


def test_a_request_with_a_traceparent_logs_its_trace_id(app):
    import logging

    import logconfig

    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(json.loads(logconfig.JsonFormatter().format(record)))

    handler = Keep()
    logger = logging.getLogger("poimen.test.trace")
    logger.addHandler(handler)
    try:
        with app.test_request_context("/v1/runs", headers={"traceparent": PARENT}):
            logger.warning("traced")
        with app.test_request_context("/v1/runs", headers={"traceparent": "bad"}):
            logger.warning("untraced")
    finally:
        logger.removeHandler(handler)
    assert seen[0]["trace_id"] == TRACE_ID
    assert "trace_id" not in seen[1]
