"""X-Request-ID (issue 29, item 2): echoed or made on every answer, on every log line of
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
