"""The runs console, verified in a real browser against real processes.

One test (or group) per promise of the console:

1. sign in with a tenant token; the list shows a run created through the API;
   the status filter works;
2. a ``doc-review`` run's page shows its step entries in order with marker
   flags, and its children; a screenshot is saved;
3. cancel from the page: the run ends ``cancelled`` through the API's cancel;
4. another tenant's run -> 404 page; a POST without the CSRF token -> 403; no
   session -> redirect to sign-in;
5. the pages load nothing from outside the app.

Plus re-drive: a failed run re-driven twice at once is one new run.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import threading
import uuid
import zlib

import requests
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

from tests.console.conftest import RUN_DEADLINE, SCHEDULE_TENANT
from tests.processes import wait_until

PARTICIPANTS = ["ana", "bo"]


def _admit(api, creds, workflow_ref: str, input: dict, **fields) -> str:
    response = api("POST", "/v1/runs", creds,
                   json={"workflow_ref": workflow_ref, "input": input, **fields})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def _listed(console) -> set[str]:
    return set(console.attrs("tr.run", "data-run-id"))


# -- 1. sign in, the list, the status filter --------------------------------------------------

def test_sign_in_lists_a_run_created_through_the_api_and_filters_by_status(
        console, api, run_until, make_tenant, worker):
    creds, other = make_tenant(), make_tenant()
    echo = _admit(api, creds, "echo", {"hello": "console"}, dispatch_key="console-1")
    failed = _admit(api, creds, "fail", {"message": "on purpose"})
    foreign = _admit(api, other, "echo", {})
    run_until(creds, echo, "succeeded")
    run_until(creds, failed, "failed")

    console.sign_in(creds.token)
    assert _listed(console) == {echo, failed}  # and never the other tenant's run
    assert foreign not in console.driver.page_source
    row = console.driver.find_element(By.CSS_SELECTOR, f'tr.run[data-run-id="{echo}"]')
    assert "console-1" in row.text and "echo@1" in row.text and "succeeded" in row.text
    counts = {a.get_attribute("data-status"): a.find_element(By.TAG_NAME, "span").text
              for a in console.driver.find_elements(By.CSS_SELECTOR, "#counts a[data-status]")}
    assert counts["succeeded"] == "1" and counts["failed"] == "1" and counts["queued"] == "0"

    # The filter form: status = failed.
    Select(console.driver.find_element(By.ID, "filter-status")).select_by_value("failed")
    console.driver.find_element(By.ID, "apply-filters").click()
    wait_until(lambda: "status=failed" in console.driver.current_url, timeout=30,
               what="the filtered list")
    assert _listed(console) == {failed}
    # A count is a link to its filter.
    console.driver.find_element(By.CSS_SELECTOR, '#counts a[data-status="succeeded"]').click()
    wait_until(lambda: "status=succeeded" in console.driver.current_url, timeout=30,
               what="the succeeded list")
    assert _listed(console) == {echo}
    console.open("/console/runs?status=cancelled")
    assert _listed(console) == set() and console.driver.find_element(By.ID, "no-runs")
    # A status that does not exist is a 400 page, not an empty list.
    assert console.http().get(f"{console.url}/console/runs?status=bogus",
                              timeout=30).status_code == 400


# -- 2. a doc-review run's page ---------------------------------------------------------------

def test_a_doc_review_runs_page_shows_its_entries_in_order_with_markers_and_its_children(
        console, api, run_until, make_tenant, worker, pg, tmp_path):
    creds = make_tenant()
    run_id = _admit(api, creds, "doc-review", {"participants": PARTICIPANTS, "reject_rounds": 1},
                    dispatch_key="review-42")
    run_until(creds, run_id, "succeeded", "failed", "cancelled")
    assert run_until(creds, run_id, "succeeded")["status"] == "succeeded"

    console.sign_in(creds.token)
    console.open(f"/console/runs/{run_id}")
    driver = console.driver
    assert driver.find_element(By.ID, "run-status").text == "succeeded"
    # No auto-refresh for a finished run.
    assert driver.find_element(By.TAG_NAME, "body").get_attribute("data-refresh") is None

    entries = driver.find_elements(By.CSS_SELECTOR, "#steps li.entry")
    assert [(e.get_attribute("data-entry"), e.get_attribute("data-step"))
            for e in entries] == [("1", "draft"), ("2", "review"), ("3", "draft"),
                                  ("4", "review"), ("5", "approve")]
    assert {e.get_attribute("data-status") for e in entries} == {"completed"}
    for entry in entries:
        actions = [(a.get_attribute("data-position"), a.get_attribute("data-name"),
                    a.get_attribute("data-marker"), a.get_attribute("data-status"))
                   for a in entry.find_elements(By.CSS_SELECTOR, "tr.action")]
        if entry.get_attribute("data-step") == "review":
            assert [(p, m) for p, _, m, _ in actions] == [("0", "yes"), ("1", "no"), ("2", "yes")]
            assert actions[0][1] == "clear_decisions"
            assert actions[1][1] == "ensure_participant_seat"
            assert {s for *_, s in actions} == {"completed"}
            assert "children 2/2 done" in entry.text
        else:
            assert [(p, m) for p, _, m, _ in actions] == [("0", "no")]

    # Children: two rounds of two, every one finished, the same set the API lists.
    children = {c.get_attribute("data-run-id"): c.get_attribute("data-status")
                for c in driver.find_elements(By.CSS_SELECTOR, "#children tr.child")}
    listed = api("GET", f"/v1/runs?parent_run_id={run_id}", creds).json()["runs"]
    assert children == {r["id"]: "succeeded" for r in listed} and len(children) == 4
    keys = set(console.texts("#children tr.child td.mono"))
    assert {f"{run_id}/review/{entry}/2/{p}" for entry in (2, 4) for p in PARTICIPANTS} <= keys
    # Each child's page links back to its parent.
    console.open(f"/console/runs/{next(iter(children))}")
    assert driver.find_element(By.ID, "parent").get_attribute("href").endswith(
        f"/console/runs/{run_id}")

    # Events: the outbox rows of this run, in the order they were written.
    console.open(f"/console/runs/{run_id}")
    shown = [(int(i), t) for i, t in zip(console.attrs("#events tr.event", "data-event-id"),
                                         console.attrs("#events tr.event", "data-type"), strict=True)]
    stored = [tuple(r) for r in pg.execute(
        "SELECT id, event_type FROM outbox WHERE run_id = %s ORDER BY id", [run_id])]
    assert shown == stored
    assert shown[0][1] == "run.admitted" and shown[-1][1] == "run.succeeded"

    path = tmp_path / "console-run.png"
    assert driver.save_screenshot(str(path))
    assert path.stat().st_size > 10_000
    print(f"\nscreenshot: {path}")
    # The README's picture: POIMEN_CONSOLE_SCREENSHOT=docs/img/console-run.png (docs/guide/console.md).
    if target := os.environ.get("POIMEN_CONSOLE_SCREENSHOT"):
        shutil.copy(path, target)


# -- 3. cancel from the page ------------------------------------------------------------------

def test_cancel_from_the_page_ends_the_run_cancelled_through_the_apis_cancel(
        console, api, run_until, make_tenant, worker, pg):
    creds = make_tenant()
    run_id = _admit(api, creds, "sleep", {"seconds": 300})
    run_until(creds, run_id, "running")
    boot = pg.execute("SELECT claimed_by FROM runs WHERE id = %s", [run_id]).fetchone()[0]

    console.sign_in(creds.token)
    console.open(f"/console/runs/{run_id}")
    driver = console.driver
    assert driver.find_element(By.ID, "run-status").text == "running"
    holder = driver.find_element(By.ID, "holder").text
    assert str(boot) in holder and "live" in holder.split()
    assert driver.find_element(By.TAG_NAME, "body").get_attribute("data-refresh") == "2000"

    driver.find_element(By.ID, "cancel").click()
    wait_until(lambda: driver.find_elements(By.CSS_SELECTOR, ".flash"), timeout=30,
               what="the page after cancel")
    # From here the page is not reloaded: only its 2 s fetch can show the outcome.
    driver.execute_script("window.__notReloaded = true;")
    wait_until(lambda: driver.find_element(By.ID, "run-status").text == "cancelled",
               timeout=RUN_DEADLINE, interval=0.5, what="the page to show the run cancelled")
    assert driver.execute_script("return window.__notReloaded === true;")
    assert driver.find_element(By.TAG_NAME, "body").get_attribute("data-refresh") is None
    assert driver.find_elements(By.ID, "cancel") == []

    # The API's cancel: the flag, the run.cancelled event its statement writes, the
    # workflow stopping at its checkpoint; and the API reads the same outcome.
    status, requested = pg.execute(
        "SELECT status, cancel_requested FROM runs WHERE id = %s", [run_id]).fetchone()
    assert (status, requested) == ("cancelled", True)
    events = [t for (t,) in pg.execute(
        "SELECT event_type FROM outbox WHERE run_id = %s ORDER BY id", [run_id])]
    assert events.count("run.cancelled") == 1
    body = api("GET", f"/v1/runs/{run_id}", creds).json()
    assert body["status"] == "cancelled" and body["cancel_requested"] is True


# -- re-drive ---------------------------------------------------------------------------------

def test_redrive_of_a_failed_run_clicked_twice_at_once_is_one_new_run(
        console, api, run_until, make_tenant, worker, pg):
    creds = make_tenant()
    failed = _admit(api, creds, "fail", {"message": "redrive me"}, goal_id="g-redrive")
    run_until(creds, failed, "failed")

    console.sign_in(creds.token)
    console.open(f"/console/runs/{failed}")
    csrf = console.csrf()
    http = console.http()
    url = f"{console.url}/console/runs/{failed}/redrive"
    barrier = threading.Barrier(2)
    landed: list[str] = []

    def click():
        barrier.wait()
        response = http.post(url, data={"csrf_token": csrf}, allow_redirects=False, timeout=60)
        landed.append(f"{response.status_code} {response.headers.get('Location')}")

    clicks = [threading.Thread(target=click) for _ in range(2)]
    for t in clicks:
        t.start()
    for t in clicks:
        t.join(90)
    assert len(landed) == 2 and landed[0] == landed[1], landed
    new_id = landed[0].rsplit("/", 1)[1]
    assert landed[0].startswith("303 ")

    rows = pg.execute("SELECT id, workflow_ref, input, goal_id, dispatch_key FROM runs "
                      "WHERE tenant_id = %s ORDER BY created_at", [creds.id]).fetchall()
    assert len(rows) == 2, rows  # the failed run and exactly one re-drive
    assert str(rows[1][0]) == new_id
    assert rows[1][1:] == ("fail", {"message": "redrive me"}, "g-redrive", f"redrive:{failed}")

    # The failed run's page links to its re-drive and offers no second one.
    console.open(f"/console/runs/{failed}")
    assert console.driver.find_element(By.ID, "redriven-as").text == new_id
    assert console.driver.find_elements(By.ID, "redrive") == []
    # Only a failed run can be re-driven.
    ok = _admit(api, creds, "echo", {})
    run_until(creds, ok, "succeeded")
    response = http.post(f"{console.url}/console/runs/{ok}/redrive", data={"csrf_token": csrf},
                         allow_redirects=False, timeout=30)
    assert response.status_code == 409


# -- 4. tenants, CSRF, sign-in ----------------------------------------------------------------

def test_another_tenants_run_is_a_404_page(console, api, make_tenant):
    mine, theirs = make_tenant(), make_tenant()
    their_run = _admit(api, theirs, "echo", {}, dispatch_key="secret-key")
    console.sign_in(mine.token)

    console.open(f"/console/runs/{their_run}")
    page = console.driver.find_element(By.CSS_SELECTOR, ".error-page")
    assert page.get_attribute("data-code") == "run_not_found"
    assert "404" in console.driver.find_element(By.TAG_NAME, "h1").text
    assert "secret-key" not in console.driver.page_source

    http = console.http()
    missing = http.get(f"{console.url}/console/runs/{uuid.uuid4()}", timeout=30)
    theirs_page = http.get(f"{console.url}/console/runs/{their_run}", timeout=30)
    assert theirs_page.status_code == missing.status_code == 404
    assert "secret-key" not in theirs_page.text
    # Indistinguishable from a run that does not exist (only the id differs).
    assert theirs_page.text.replace(their_run, "X") == missing.text.replace(
        missing.url.rsplit("/", 1)[1], "X")
    # Their run cannot be cancelled either, CSRF token or not.
    console.open("/console/runs")
    response = http.post(f"{console.url}/console/runs/{their_run}/cancel",
                         data={"csrf_token": console.csrf()}, allow_redirects=False, timeout=30)
    assert response.status_code == 404
    assert api("GET", f"/v1/runs/{their_run}", theirs).json()["cancel_requested"] is False
    # A client asking for JSON gets the API's error shape.
    as_json = http.get(f"{console.url}/console/runs/{their_run}",
                       headers={"Accept": "application/json"}, timeout=30)
    assert as_json.status_code == 404
    assert as_json.json()["error"]["code"] == "run_not_found"
    assert set(as_json.json()["error"]) == {"code", "message", "details"}


def test_a_post_without_the_csrf_token_is_refused_and_changes_nothing(
        console, api, run_until, make_tenant, worker, pg):
    creds = make_tenant()
    run_id = _admit(api, creds, "sleep", {"seconds": 300})
    console.sign_in(creds.token)
    console.open(f"/console/runs/{run_id}")
    http = console.http()
    url = f"{console.url}/console/runs/{run_id}/cancel"
    try:
        for form in ({}, {"csrf_token": ""}, {"csrf_token": "not-this-sessions-token"}):
            response = http.post(url, data=form, allow_redirects=False, timeout=30)
            assert response.status_code == 403, form
            assert 'data-code="csrf_failed"' in response.text
        # Another session's valid token is not this session's.
        other = requests.Session()
        other.get(f"{console.url}/console/sign-in", timeout=30)
        response = other.post(url, data={"csrf_token": console.csrf()}, allow_redirects=False,
                              timeout=30)
        assert response.status_code == 403
        assert pg.execute("SELECT cancel_requested FROM runs WHERE id = %s",
                          [run_id]).fetchone()[0] is False
        # Sign-in and sign-out are POSTs too.
        assert requests.post(f"{console.url}/console/sign-in", data={"token": creds.token},
                             allow_redirects=False, timeout=30).status_code == 403
        assert http.post(f"{console.url}/console/sign-out", allow_redirects=False,
                         timeout=30).status_code == 403
        # With the token, the same POST cancels.
        response = http.post(url, data={"csrf_token": console.csrf()}, allow_redirects=False,
                             timeout=30)
        assert response.status_code == 303
        assert pg.execute("SELECT cancel_requested FROM runs WHERE id = %s",
                          [run_id]).fetchone()[0] is True
    finally:
        api("POST", f"/v1/runs/{run_id}/cancel", creds)


def test_without_a_session_every_page_redirects_to_sign_in_and_back(console, api, make_tenant):
    creds = make_tenant()
    run_id = _admit(api, creds, "echo", {})
    for path in ("/console/", "/console/runs", f"/console/runs/{run_id}",
                 "/console/runs?status=failed", "/console/inbox", "/console/schedules"):
        response = requests.get(console.url + path, allow_redirects=True, timeout=30)
        assert response.url.startswith(f"{console.url}/console/sign-in"), path
        assert 'id="token"' in response.text
        assert "data-run-id" not in response.text and "echo@1" not in response.text
    response = requests.get(f"{console.url}/console/runs/{run_id}", allow_redirects=False,
                            timeout=30)
    assert response.status_code == 302
    assert response.headers["Location"].startswith("/console/sign-in?next=")

    # In the browser: the sign-in page, then back to the page asked for.
    console.driver.delete_all_cookies()
    console.open(f"/console/runs/{run_id}")
    assert "/console/sign-in" in console.driver.current_url
    console.driver.find_element(By.ID, "token").send_keys(creds.token)
    console.driver.find_element(By.ID, "sign-in").click()
    wait_until(lambda: console.driver.current_url.endswith(f"/console/runs/{run_id}"),
               timeout=30, what="the run's page after sign-in")
    # next= never leaves the console.
    http = requests.Session()
    page = http.get(f"{console.url}/console/sign-in?next=https://evil.example/", timeout=30)
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)
    response = http.post(f"{console.url}/console/sign-in", allow_redirects=False, timeout=30,
                         data={"csrf_token": csrf, "token": creds.token,
                               "next": "//evil.example/"})
    assert response.status_code == 302 and response.headers["Location"] == "/console/runs"


def test_the_session_cookie_is_httponly_strict_and_holds_no_token(console, make_tenant, app):
    from app.tenant_service import create_token, revoke_token

    creds = make_tenant()
    console.sign_in(creds.token)
    cookie = next(c for c in console.driver.get_cookies() if c["name"] == "poimen_console")
    assert cookie["httpOnly"] is True and cookie["sameSite"] == "Strict"
    assert cookie["path"] == "/console"
    payload = cookie["value"].lstrip(".").split(".")[0]
    raw = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
    if cookie["value"].startswith("."):
        raw = zlib.decompress(raw)
    assert creds.token not in raw.decode() and set(json.loads(raw)) == {"token_hash", "at", "csrf"}

    # Tokens the console does not take: unknown, a service token, an admit-only token.
    with app.app_context():
        from app.tenant_service import create_tenant

        service = create_token(None, True)
        admit_only = create_token(create_tenant(creds.name, exist_ok=True), False, scope="admit")
    for token, status in (("pmn_nope", 401), (service, 403), (admit_only, 403)):
        http = requests.Session()
        page = http.get(f"{console.url}/console/sign-in", timeout=30)
        csrf = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)
        response = http.post(f"{console.url}/console/sign-in", allow_redirects=False,
                             timeout=30, data={"csrf_token": csrf, "token": token})
        assert response.status_code == status, token[:8]
        assert token not in response.text
        assert http.get(f"{console.url}/console/runs", allow_redirects=False,
                        timeout=30).status_code == 302

    # Revoking the token ends its sessions (within the token cache's 1 s here).
    with app.app_context():
        revoke_token(creds.token)
    http = console.http()
    wait_until(lambda: http.get(f"{console.url}/console/runs", allow_redirects=False,
                                timeout=30).status_code == 302,
               timeout=30, what="the revoked token's session to end")


# -- 5. nothing from outside the app ----------------------------------------------------------

_REFERENCE = re.compile(r"""(?:src|href|action)\s*=\s*["']([^"']*)["']|url\(\s*["']?([^"')]*)""",
                        re.IGNORECASE)


def _references(text: str) -> list[str]:
    return [a or b for a, b in _REFERENCE.findall(text)]


def test_the_pages_load_nothing_from_outside_the_app(console, api, run_until, make_tenant,
                                                     worker):
    creds = make_tenant()
    failed = _admit(api, creds, "fail", {})
    run_until(creds, failed, "failed")
    console.driver.get_log("performance")  # drop what earlier tests logged
    console.driver.get_log("browser")

    console.sign_in(creds.token)
    pages = ["/console/runs", f"/console/runs/{failed}", "/console/runs?status=failed",
             f"/console/runs/{uuid.uuid4()}", "/console/no-such-page", "/console/inbox"]
    for path in pages:
        console.open(path)
        # The stylesheet was served and applied: the header has its colour.
        header = console.driver.find_element(By.CSS_SELECTOR, "header.top")
        assert header.value_of_css_property("background-color") == "rgba(45, 90, 136, 1)", path

    requested = []
    for entry in console.driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            requested.append(message["params"]["request"]["url"])
    assert any(u.endswith("/console/static/console.css") for u in requested)
    assert any(u.endswith("/console/static/console.js") for u in requested)
    outside = [u for u in requested if not u.startswith(console.url + "/")]
    assert outside == [], outside
    # No page broke a rule of its Content-Security-Policy (default-src 'none', self only).
    violations = [e["message"] for e in console.driver.get_log("browser")
                  if "Content Security Policy" in e["message"]]
    assert violations == []

    # The HTML and CSS themselves reference only the app's own paths.
    http = console.http()
    for path in [*pages, "/console/sign-in", "/console/static/console.css"]:
        response = http.get(console.url + path, timeout=30)
        refs = _references(response.text)
        assert refs or path.endswith(".css"), path
        assert [r for r in refs if not (r.startswith("/") and not r.startswith("//"))] == [], path
        if not path.endswith(".css"):
            policy = response.headers["Content-Security-Policy"]
            assert "default-src 'none'" in policy and "http" not in policy


def test_the_schedules_page_lists_the_tenants_schedules_and_their_last_run(console, api,
                                                                         make_tenant):
    owner, other = make_tenant(name=SCHEDULE_TENANT), make_tenant()
    key = "schedule:every-few-seconds:2026-12-01T10:00:00Z"
    run_id = _admit(api, owner, "every-few-seconds", {"tick": "2026-12-01T10:00:00+00:00"},
                    dispatch_key=key)
    console.sign_in(owner.token)
    console.open("/console/schedules")
    row = console.driver.find_element(By.CSS_SELECTOR, 'tr.schedule[data-workflow="every-few-seconds"]')
    assert "every 5s" in row.text and "last" in row.text and key in row.text
    link = row.find_element(By.CSS_SELECTOR, "a.mono").get_attribute("href")
    assert link.endswith(f"/console/runs/{run_id}")
    # Another tenant sees none of them.
    console.sign_in(other.token)
    console.open("/console/schedules")
    assert console.driver.find_elements(By.ID, "no-schedules")
    assert "every-few-seconds" not in console.driver.page_source
