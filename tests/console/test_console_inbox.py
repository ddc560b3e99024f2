"""The console's inbox page: a tenant's dead letters by reason, and their replay.

A real broker, the console's gunicorn and ``python -m bridge.inbox``. Two
messages are dead-lettered for reasons an operator can fix (a workflow nobody
registered: the API's 422; a bug in the relay, ``POIMEN_INBOX_TEST_RAISE_ON``:
``internal_error`` after three tries). The page lists them; the relay is fixed;
replaying the ``internal_error`` ones from the page admits one run, and
replaying again admits none (the message kept its dispatch key). The replay is
``bridge/dlq.py``'s, the one ``flask topics replay-dlq`` runs.
"""

from __future__ import annotations

import json
import uuid

import pytest
from confluent_kafka import Producer
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from bridge.topics import declare_topics, dispatch_topic
from tests.processes import metric, start_inbox, wait_until

pytestmark = pytest.mark.slow

TAG = uuid.uuid4().hex[:8]
PREFIX = f"console{TAG}"
BUG = "trips-the-relay-bug"


@pytest.fixture(scope="module")
def console_env(console_env):
    """This module's console reads topics under a prefix of its own."""
    return {**console_env, "POIMEN_TOPIC_PREFIX": PREFIX}


def _detached(element) -> bool:
    """The page was replaced under ``element``. Selenium's ``staleness_of`` knows only
    StaleElementReferenceException; chromedriver 156 sometimes answers a node of the old
    document with "unknown error: ... Node with given id does not belong to the
    document" instead, which means the same."""
    try:
        element.is_enabled()
        return False
    except WebDriverException:  # StaleElementReferenceException is one
        return True


def _letters(console) -> list[tuple[str, str, str]]:
    return [(r.get_attribute("data-reason"), r.get_attribute("data-dispatch-key"),
             r.get_attribute("data-replayable"))
            for r in console.driver.find_elements(By.CSS_SELECTOR, "#letters tr.letter")]


def test_the_inbox_page_lists_dead_letters_by_reason_and_replays_them_once(
        console, console_env, console_url, api, make_tenant, tmp_path, app):
    from app.tenant_service import create_token, find_tenant

    tenant, service = make_tenant(), make_tenant(service=True)
    with app.app_context():  # replaying is an operator's action: the admin scope
        admin = create_token(find_tenant(tenant.name), False, "ops", scope="admin")
    bootstrap = console_env["KAFKA_BOOTSTRAP_SERVERS"]
    declare_topics(bootstrap, PREFIX, [tenant.name], 1)
    env = {**console_env, "POIMEN_API_URL": console_url, "POIMEN_API_TOKEN": service.token,
           "POIMEN_INBOX_GROUP": f"inbox-console-{TAG}", "POIMEN_INBOX_BACKOFF_INITIAL": "0.2",
           "POIMEN_INBOX_BACKOFF_MAX": "1", "POIMEN_INBOX_METADATA_REFRESH_MS": "1000"}
    started = []
    try:
        relay, relay_metrics = start_inbox({**env, "POIMEN_INBOX_TEST_RAISE_ON": BUG}, tmp_path,
                                           name="inbox-with-a-bug")
        started.append(relay)
        producer = Producer({"bootstrap.servers": bootstrap})
        for value in ({"workflow_ref": f"unknown-{TAG}", "input": {}, "dispatch_key": "late-1"},
                      {"workflow_ref": "echo", "input": {"why": BUG}, "dispatch_key": "bug-1"}):
            producer.produce(dispatch_topic(PREFIX, tenant.name), json.dumps(value).encode())
        assert producer.flush(30) == 0
        wait_until(lambda: sum(metric(relay_metrics, "poimen_inbox_dead_lettered_total",
                                      reason=r) for r in ("http_422", "internal_error")) == 2,
                   timeout=120, what="two messages dead-lettered")
        relay.stop()

        console.sign_in(admin)
        console.open("/console/inbox")
        assert sorted(_letters(console)) == [("http_422", "late-1", "yes"),
                                             ("internal_error", "bug-1", "yes")]
        counts = {a.get_attribute("data-reason"): a.find_element(By.TAG_NAME, "span").text
                  for a in console.driver.find_elements(By.CSS_SELECTOR, "#reasons a[data-reason]")}
        assert counts == {"http_422": "1", "internal_error": "1"}
        assert "why" not in console.driver.find_element(By.ID, "letters").text  # no input shown

        # The fix is deployed: a relay without the bug. Replay only the internal errors.
        relay, relay_metrics = start_inbox(env, tmp_path, name="inbox-fixed")
        started.append(relay)
        console.driver.find_element(By.CSS_SELECTOR, '#reasons a[data-reason="internal_error"]').click()
        wait_until(lambda: "reason=internal_error" in console.driver.current_url, timeout=30,
                   what="the internal_error filter")
        assert _letters(console) == [("internal_error", "bug-1", "yes")]
        console.driver.find_element(By.ID, "replay").click()
        wait_until(lambda: "replayed 1 of 1" in console.driver.find_element(
            By.CSS_SELECTOR, ".flash").text, timeout=60, what="the replay's summary")

        def runs_with_key():
            return api("GET", "/v1/runs?dispatch_key=bug-1", tenant).json()["runs"]

        first = wait_until(runs_with_key, timeout=120, what="the replayed message admitted")
        assert metric(relay_metrics, "poimen_inbox_admitted_total") == 1

        # Replayed again: admission's replay, the same run.
        shown = console.driver.find_element(By.CSS_SELECTOR, ".flash")
        console.driver.find_element(By.ID, "replay").click()
        WebDriverWait(console.driver, 60).until(lambda _: _detached(shown))
        wait_until(lambda: "replayed 1 of 1" in console.driver.find_element(
            By.CSS_SELECTOR, ".flash").text, timeout=60, what="the second replay's summary")
        wait_until(lambda: metric(relay_metrics, "poimen_inbox_replayed_total") == 1,
                   timeout=120, what="the second replay answered as admission's replay")
        assert [r["id"] for r in runs_with_key()] == [first[0]["id"]]
        assert metric(relay_metrics, "poimen_inbox_admitted_total") == 1
        # The 422 was not replayed: nothing under its key.
        assert api("GET", "/v1/runs?dispatch_key=late-1", tenant).json()["runs"] == []
    finally:
        for proc in reversed(started):
            proc.stop()
