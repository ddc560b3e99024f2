"""The console's wiring, without a browser: its secret, and the API left as it was."""

from __future__ import annotations

import re

import pytest

SECRET = "s" * 40


@pytest.fixture
def console_app(database_url):
    from app import create_app

    return create_app({"POIMEN_CONSOLE_SECRET": SECRET, "TESTING": True})


def test_without_a_secret_the_console_answers_503_and_the_api_is_unaffected(database_url,
                                                                           make_tenant):
    from app import create_app

    for secret in ("", "too-short-for-a-key"):
        client = create_app({"POIMEN_CONSOLE_SECRET": secret, "TESTING": True}).test_client()
        for path in ("/console/runs", "/console/sign-in"):
            response = client.get(path)
            assert response.status_code == 503, (secret, path)
            assert "POIMEN_CONSOLE_SECRET" in response.get_data(as_text=True)
        assert client.get("/v1/runs", headers=make_tenant().headers).status_code == 200


def test_the_console_cookie_is_no_api_credential_and_the_api_sets_no_cookie(console_app,
                                                                            make_tenant):
    creds = make_tenant()
    client = console_app.test_client()
    page = client.get("/console/sign-in").get_data(as_text=True)
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', page).group(1)
    signed_in = client.post("/console/sign-in", data={"csrf_token": csrf, "token": creds.token})
    assert signed_in.status_code == 302 and client.get("/console/runs").status_code == 200
    # The browser would not even send it to /v1 (Path=/console); sent anyway, it is ignored.
    client.set_cookie("poimen_console", client.get_cookie("poimen_console", path="/console").value,
                      path="/")
    response = client.get("/v1/runs")
    assert response.status_code == 401 and response.json["error"]["code"] == "unauthorized"
    api = client.get("/v1/runs", headers=creds.headers)
    assert api.status_code == 200 and "Set-Cookie" not in api.headers
