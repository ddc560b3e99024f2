"""Admission under hostile input.

A replay is "the same request" when it is the same as what was stored, decided
by Postgres (jsonb equality), not by Python's ``==`` on a float round trip;
numbers are stored and read back with the digits they were sent with; what
Postgres or a double cannot hold is a 422, and an absurd cursor a 400, never a 500.
"""

from __future__ import annotations

import base64
import json

import requests

from app.state.executor import on_session
from tests.app import admission_paths
from tests.app.test_idempotent_admission import count_runs

# Each admission test on both HTTP layers: Flask's view, and the fast path.
admission_path = admission_paths.admission_path
client = admission_paths.client
db_session = admission_paths.db_session

LONG_DECIMAL = "0.1000000000000000055511151231257827"


def post_raw(client, creds, body: str):
    """POST ``body`` byte for byte: the number literals are the point of these tests."""
    return client.post("/v1/runs", data=body.encode(), content_type="application/json",
                       headers=creds.headers)


def run_body(input_json: str, key: str | None = "K") -> str:
    key_part = f', "dispatch_key": "{key}"' if key else ""
    return f'{{"workflow_ref": "echo", "input": {input_json}{key_part}}}'


def assert_error(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.data[:300]
    error = response.json["error"]
    assert set(error) == {"code", "message", "details"} and error["code"] == code, error
    return error


# Replays are compared as stored ---------------------------------------------------------------

def test_a_big_float_sent_twice_is_created_then_replayed(client, tx_tenant, db_session):
    body = run_body('{"n": 1e23}')
    first = post_raw(client, tx_tenant, body)
    assert first.status_code == 201, first.data
    # jsonb keeps 1e23 as the numeric 100000000000000000000000; Python's float
    # 1e23 is 99999999999999991611392, so a comparison in Python called this a conflict.
    again = post_raw(client, tx_tenant, body)
    assert again.status_code == 200, again.data
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json["id"] == first.json["id"]
    assert count_runs(db_session, tx_tenant.id) == 1


def test_true_and_1_under_one_key_are_a_conflict(client, tx_tenant, db_session):
    first = post_raw(client, tx_tenant, run_body('{"b": true}'))
    assert first.status_code == 201
    # Python says True == 1; they are different requests.
    clash = post_raw(client, tx_tenant, run_body('{"b": 1}'))
    error = assert_error(clash, 409, "dispatch_key_conflict")
    assert error["details"]["run_id"] == first.json["id"]
    assert error["details"]["differs"] == ["input"]
    assert count_runs(db_session, tx_tenant.id) == 1


def test_equal_numbers_written_differently_are_a_replay(client, tx_tenant):
    first = post_raw(client, tx_tenant, run_body('{"n": 1.0, "m": 2.50}'))
    assert first.status_code == 201
    assert post_raw(client, tx_tenant, run_body('{"m": 2.5, "n": 1}')).status_code == 200


def test_goal_id_null_and_absent_are_the_same_and_a_goal_differs(client, tx_tenant):
    base = {"workflow_ref": "echo", "input": {}, "dispatch_key": "G"}
    assert client.post("/v1/runs", json=base, headers=tx_tenant.headers).status_code == 201
    assert client.post("/v1/runs", json={**base, "goal_id": None},
                       headers=tx_tenant.headers).status_code == 200
    clash = client.post("/v1/runs", json={**base, "goal_id": "g"}, headers=tx_tenant.headers)
    assert assert_error(clash, 409, "dispatch_key_conflict")["details"]["differs"] == ["goal_id"]


# Numbers survive admission exactly -----------------------------------------------------------

def test_a_long_decimal_reads_back_as_sent(client, tx_tenant, db_session):
    from sqlalchemy import text

    created = post_raw(client, tx_tenant, run_body(f'{{"x": {LONG_DECIMAL}, "y": [1.50, 1e-7]}}'))
    assert created.status_code == 201, created.data
    run_id = created.json["id"]
    stored = db_session.execute(text("SELECT input->>'x' FROM runs WHERE id = :id"),
                                {"id": run_id}).scalar_one()
    assert stored == LONG_DECIMAL

    shown = client.get(f"/v1/runs/{run_id}", headers=tx_tenant.headers)
    listed = client.get("/v1/runs?dispatch_key=K", headers=tx_tenant.headers)
    replay = post_raw(client, tx_tenant, run_body(f'{{"x": {LONG_DECIMAL}, "y": [1.5, 1e-7]}}'))
    assert replay.status_code == 200
    for response in (created, shown, listed, replay):
        assert f'"x":{LONG_DECIMAL}' in response.get_data(as_text=True)
    # Postgres writes numeric without an exponent; the value is the one sent.
    assert '"y":[1.50,0.0000001]' in shown.get_data(as_text=True)


def test_a_long_decimal_reads_back_as_sent_over_gunicorn(live_api, tenant):
    body = run_body(f'{{"x": {LONG_DECIMAL}}}', key=None)
    created = requests.post(f"{live_api}/v1/runs", data=body, timeout=10,
                            headers={**tenant.headers, "Content-Type": "application/json"})
    assert created.status_code == 201, created.text
    shown = requests.get(f"{live_api}/v1/runs/{created.json()['id']}", headers=tenant.headers,
                         timeout=10)
    for response in (created, shown):
        assert f'"x":{LONG_DECIMAL}' in response.text


def test_workflows_still_read_floats(app, tx_tenant, db_session):
    """The exact reading is for echoing numbers back; code computing with them sees floats."""
    from app.admission import admit_run
    from app.models import Run

    run = admit_run(on_session(db_session), tenant_id=tx_tenant.id, workflow_ref="echo",
                    input={"x": 0.25, "n": 3}).run
    db_session.expire_all()
    loaded = db_session.get(Run, run.id).input
    assert isinstance(loaded["x"], float) and loaded["x"] * 2 == 0.5
    assert type(loaded["n"]) is int


# What cannot be stored is a 422 --------------------------------------------------------------

def test_numbers_beyond_a_double_are_422(client, tx_tenant, db_session):
    for literal in ("1e400", "-1e400", "[1, {\"deep\": 1e309}]"):
        response = post_raw(client, tx_tenant, run_body(f'{{"n": {literal}}}', key=None))
        error = assert_error(response, 422, "validation_failed")
        assert "input" in error["details"]["fields"], error
    assert count_runs(db_session, tx_tenant.id) == 0


def test_a_number_beyond_numeric_is_422_not_500(client, tx_tenant, db_session):
    # A double (0.0), but more decimal places than Postgres' numeric holds: the
    # database refuses it, and that is the request's fault.
    response = post_raw(client, tx_tenant, run_body('{"n": 1e-16384}', key=None))
    error = assert_error(response, 422, "validation_failed")
    assert "input" in error["details"]["fields"]
    assert count_runs(db_session, tx_tenant.id) == 0


def test_nan_and_infinity_are_not_json(client, tx_tenant):
    for literal in ("NaN", "Infinity", "-Infinity"):
        assert_error(post_raw(client, tx_tenant, run_body(f'{{"n": {literal}}}')), 400,
                     "malformed_json")


# Cursors --------------------------------------------------------------------------------------

def test_a_3kb_cursor_is_400(client, tx_tenant):
    nested = base64.urlsafe_b64encode(b"[" * 2300).decode()  # once a RecursionError (500)
    for cursor in ("A" * 3000, nested[:3000], nested[:512]):
        response = client.get(f"/v1/runs?cursor={cursor}", headers=tx_tenant.headers)
        assert_error(response, 400, "invalid_cursor")


def test_a_cursor_this_api_issued_still_pages(client, tx_tenant):
    for _ in range(3):
        assert post_raw(client, tx_tenant, run_body("{}", key=None)).status_code == 201
    page = client.get("/v1/runs?limit=2", headers=tx_tenant.headers).json
    assert len(page["next_cursor"]) < 512
    rest = client.get(f"/v1/runs?limit=2&cursor={page['next_cursor']}",
                      headers=tx_tenant.headers)
    assert rest.status_code == 200 and len(rest.json["runs"]) == 1


def test_the_stored_input_is_the_json_that_was_sent(client, tx_tenant, db_session):
    """Unicode and nesting survive too: the body is stored as parsed, not re-encoded lossy."""
    from sqlalchemy import text

    sent = {"emoji": "\U0001F600", "nested": {"a": [None, False, "x\"y"]}, "big": 10 ** 40}
    run_id = client.post("/v1/runs", json={"workflow_ref": "echo", "input": sent},
                         headers=tx_tenant.headers).json["id"]
    stored = db_session.execute(text("SELECT input::text FROM runs WHERE id = :id"),
                                {"id": run_id}).scalar_one()
    assert json.loads(stored) == sent
