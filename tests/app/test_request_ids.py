"""X-Request-ID: echoed or made on every answer, on every log line of
the request, and on gunicorn's access line."""

from __future__ import annotations

import json
import logging
import re

import pytest
import requests

from tests.processes import start_web


def test_a_callers_request_id_is_echoed(client, tenant):
    r = client.get("/v1/runs", headers={**tenant.headers, "X-Request-ID": "caller-42.a:b"})
    assert r.headers["X-Request-ID"] == "caller-42.a:b"


@pytest.mark.parametrize("given", [None, "", "has spaces", "x" * 129, "nl\x01"])
def test_a_missing_or_unfit_request_id_is_replaced_by_a_new_one(client, tenant, given):
    headers = dict(tenant.headers)
    if given is not None:
        headers["X-Request-ID"] = given
    r = client.get("/v1/runs", headers=headers)
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["X-Request-ID"])


def test_errors_carry_the_request_id_too(client):
    r = client.get("/v1/runs", headers={"X-Request-ID": "unauthorised-1"})
    assert r.status_code == 401 and r.headers["X-Request-ID"] == "unauthorised-1"


def test_a_record_logged_while_serving_a_request_carries_its_id(app):
    import logconfig

    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(json.loads(logconfig.JsonFormatter().format(record)))

    handler = Keep()
    logger = logging.getLogger("poimen.test.request")
    logger.addHandler(handler)
    try:
        with app.test_request_context("/v1/runs", headers={"X-Request-ID": "rid-7"}):
            logger.warning("inside the request")
    finally:
        logger.removeHandler(handler)
    assert seen and seen[0]["request_id"] == "rid-7"


@pytest.mark.processes
def test_gunicorns_access_line_names_the_request_id(test_env, tenant, tmp_path):
    web, url = start_web({**test_env, "LOG_FORMAT": "json"}, tmp_path, workers=1, threads=2)
    try:
        answer = requests.get(f"{url}/v1/runs", headers={**tenant.headers,
                                                         "X-Request-ID": "access-9"}, timeout=10)
        assert answer.headers["X-Request-ID"] == "access-9"
    finally:
        web.stop()
    access = [json.loads(line) for line in web.log().splitlines()
              if line.startswith("{") and '"gunicorn.access"' in line]
    assert any("request_id=access-9" in r["message"] for r in access), access[-3:]


@pytest.mark.processes  # a real gunicorn writes the access line
@pytest.mark.parametrize("log_format", ["text", "json"])
def test_an_admissions_access_line_names_its_tenant_run_and_request(test_env, tenant, tmp_path,
                                                                       log_format):
    env = {k: v for k, v in test_env.items() if k != "LOG_FORMAT"}
    if log_format == "json":
        env["LOG_FORMAT"] = "json"
    web, url = start_web(env, tmp_path, workers=1, threads=2)
    secret = f"input-{log_format}-s3cr3t"
    try:
        admitted = requests.post(
            f"{url}/v1/runs", json={"workflow_ref": "echo", "input": {"secret": secret}},
            headers={**tenant.headers, "X-Request-ID": f"admit-{log_format}"}, timeout=10)
        assert admitted.status_code == 201, admitted.text
        run_id = admitted.json()["id"]
        # A request naming a run by its URL, and one naming none (not even a tenant).
        assert requests.get(f"{url}/v1/runs/{run_id}", headers={
            **tenant.headers, "X-Request-ID": f"get-{log_format}"}, timeout=10).ok
        assert requests.get(f"{url}/v1/runs", headers={"X-Request-ID": f"anon-{log_format}"},
                            timeout=10).status_code == 401
    finally:
        web.stop()
    log = web.log()
    assert secret not in log and tenant.token not in log

    if log_format == "json":
        access = {r["request_id"]: r for r in map(json.loads, filter(
            lambda line: line.startswith("{") and '"gunicorn.access"' in line,
            log.splitlines())) if "request_id" in r}
        admit, get, anon = (access.get(f"{what}-json") for what in ("admit", "get", "anon"))
        assert admit and "POST /v1/runs" in admit["message"], log[-3000:]
        assert (admit["tenant"], admit["run_id"]) == (tenant.name, run_id)
        assert (get["tenant"], get["run_id"]) == (tenant.name, run_id)
        assert "tenant" not in anon and "run_id" not in anon
        # The text of the line says the same, for a drain that keeps only the message.
        assert f"tenant={tenant.name} run_id={run_id}" in admit["message"]
    else:
        lines = [line for line in log.splitlines() if "gunicorn.access" in line]
        admit = [line for line in lines if "request_id=admit-text " in line]
        assert admit and '"POST /v1/runs HTTP/1.1" 201' in admit[0], lines[-3:]
        assert admit[0].endswith(f"request_id=admit-text tenant={tenant.name} run_id={run_id}")
        assert any(line.endswith(f"request_id=get-text tenant={tenant.name} run_id={run_id}")
                   for line in lines), lines[-3:]
        assert any(line.endswith("request_id=anon-text tenant=- run_id=-") for line in lines)
