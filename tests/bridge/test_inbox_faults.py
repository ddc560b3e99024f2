"""Message fault or delivery fault: the inbox's rules, without a broker or an API.

The relay tests (``test_inbox_relay.py``, ``test_inbox_hostile.py``) prove the
same rules over real processes; these pin every row of the table in
``docs/operations/inbox.md`` cheaply, including rows a real API never produces.
"""

from __future__ import annotations

import json
import re
from dataclasses import fields

import pytest

from bridge.inbox import dead_letter_record, traceback_summary
from bridge.inbox.faults import (
    FaultKind,
    MessageFault,
    derived_dispatch_key,
    message_timestamp,
    response_fault,
    run_request_body,
)
from poimenconfig import INBOX_VARIABLES, InboxSettings, inbox_settings
from tests.processes import ROOT

JSON = "application/json"
RUN = json.dumps({"id": "4b7e…", "status": "queued", "workflow_ref": "echo"}).encode()
T0 = 1_796_432_478_134  # a CreateTime in ms (2026-12-04)


def api_error(code: str) -> bytes:
    return json.dumps({"error": {"code": code, "message": "m", "details": {}}}).encode()


# -- parsing: message faults before any call ---------------------------------------------------


@pytest.mark.parametrize(("value", "reason"), [
    (b"[" * 100_000 + b"]" * 100_000, "too_deep"),
    (b"[" * 2048, "too_deep"),
    (b'{"workflow_ref": "echo", "input": {"s": "\xff"}}', "invalid_utf8"),
    (b"\xef\xbb\xbf{}", "invalid_json"),  # a byte-order mark is not JSON
    (b"null", "not_an_object"),
    (b"[1, 2]", "not_an_object"),
    (b'"echo"', "not_an_object"),
    (b"x" * 1_040_000, "invalid_json"),
    (b"not json {", "invalid_json"),
    (None, "no_value"),
])
def test_unparsable_messages_are_message_faults(value, reason):
    with pytest.raises(MessageFault) as err:
        run_request_body(value, "poimen.acme.dispatch", 0, 7, T0)
    assert err.value.reason == reason
    assert err.value.fault.kind is FaultKind.MESSAGE


def test_the_body_is_forwarded_byte_for_byte():
    # Unknown fields, odd spacing, numbers beyond a float's digits and non-ASCII text
    # all reach the API as written: it validates, the relay does not.
    value = ('{"workflow_ref": "echo",  "dispatchKey": "typo", "dispatch_key": "k",\n'
             '"input": {"n": 0.1000000000000000055511151231257827, "big": 1e23, '
             '"s": "\U0001F600\u00e9"}}').encode()
    body, derived = run_request_body(value, "poimen.acme.dispatch", 0, 7, T0)
    assert body == value and not derived


def test_an_emoji_message_is_not_inflated_by_escaping():
    value = json.dumps({"workflow_ref": "echo", "input": {"s": "\U0001F600" * 100_000}},
                       ensure_ascii=False).encode()
    body, derived = run_request_body(value, "poimen.acme.dispatch", 2, 40, T0)
    assert derived and len(body) < len(value) + 100  # not 3x, as \ud83d\ude00 escapes were


@pytest.mark.parametrize("value", [
    b'{"workflow_ref": "echo", "input": {"a": 1}}',
    b'  {"workflow_ref": "echo"} \n',
    b'{"workflow_ref": "echo", "dispatch_key": null}',
    b"{}",
    b" { } ",
])
def test_a_message_without_a_key_gets_the_key_of_its_place_and_time_in_the_log(value):
    body, derived = run_request_body(value, "poimen.acme.dispatch", 3, 41, T0)
    assert derived
    parsed = json.loads(body)
    assert parsed["dispatch_key"] == f"kafka:poimen.acme.dispatch:3:41:{T0}"
    # Everything else is as the producer wrote it.
    original = json.loads(value)
    original.pop("dispatch_key", None)
    assert {k: v for k, v in parsed.items() if k != "dispatch_key"} == original
    if original:  # the original bytes, then the key
        assert body.startswith(value.rstrip()[:-1].rstrip())


def test_the_derived_key_is_stable_and_fits_the_api():
    topic = "poimen." + "t" * 63 + ".dispatch"
    key = derived_dispatch_key(topic, 2**31 - 1, 2**63 - 1, 2**63 - 1)
    assert key == derived_dispatch_key(topic, 2**31 - 1, 2**63 - 1, 2**63 - 1)
    assert len(key) <= 255  # the API's dispatch_key limit


def test_the_derived_key_names_the_message_not_only_its_place():
    # The same offset of a re-created topic holds another message, written at another time.
    assert (derived_dispatch_key("poimen.acme.dispatch", 0, 0, T0)
            != derived_dispatch_key("poimen.acme.dispatch", 0, 0, T0 + 1))
    # No stored time (the 0.9 message format; a dead letter of an older relay): the place alone.
    assert derived_dispatch_key("poimen.acme.dispatch", 0, 5, None) == "kafka:poimen.acme.dispatch:0:5"
    assert message_timestamp(1, T0) == T0 and message_timestamp(2, T0) == T0
    assert message_timestamp(0, -1) is None


# -- the API's answer -------------------------------------------------------------------------


@pytest.mark.parametrize(("status", "content_type", "body", "kind", "reason"), [
    # success: only a 200/201 whose body is a run
    (201, JSON, RUN, None, None),
    (200, JSON, RUN, None, None),
    # message faults: the API's own 4xx about the request
    (400, JSON, api_error("malformed_json"), FaultKind.MESSAGE, "http_400"),
    (409, JSON, api_error("dispatch_key_conflict"), FaultKind.MESSAGE, "http_409"),
    (413, JSON, api_error("payload_too_large"), FaultKind.MESSAGE, "http_413"),
    (415, JSON, api_error("unsupported_media_type"), FaultKind.MESSAGE, "http_415"),
    (422, JSON, api_error("validation_failed"), FaultKind.MESSAGE, "http_422"),
    (422, JSON, api_error("unknown_workflow"), FaultKind.MESSAGE, "http_422"),
    # delivery faults: the API is away, overloaded, or it is not the API answering
    (500, JSON, api_error("internal_error"), FaultKind.DELIVERY, "http_500"),
    (502, "text/html", b"<html>Bad Gateway</html>", FaultKind.DELIVERY, "http_502"),
    (503, "", b"", FaultKind.DELIVERY, "http_503"),
    (429, JSON, api_error("too_many_requests"), FaultKind.DELIVERY, "http_429"),
    (401, JSON, api_error("unauthorized"), FaultKind.DELIVERY, "http_401"),
    (403, JSON, api_error("forbidden"), FaultKind.DELIVERY, "http_403"),
    (408, "text/plain", b"timeout", FaultKind.DELIVERY, "http_408"),
    (301, "text/html", b"moved", FaultKind.DELIVERY, "redirect"),
    (302, "", b"", FaultKind.DELIVERY, "redirect"),
    (307, "", b"", FaultKind.DELIVERY, "redirect"),
    (308, "", b"", FaultKind.DELIVERY, "redirect"),
    (200, JSON, json.dumps({"runs": [], "next": None}).encode(), FaultKind.DELIVERY,
     "not_the_api"),  # what a followed redirect's GET /v1/runs answers
    (200, "text/html", b"<html>Welcome to nginx</html>", FaultKind.DELIVERY, "not_the_api"),
    (202, JSON, RUN, FaultKind.DELIVERY, "not_the_api"),
    (204, "", b"", FaultKind.DELIVERY, "not_the_api"),
    (404, "text/html", b"<html>Not Found</html>", FaultKind.DELIVERY, "not_the_api"),
    (413, "text/html", b"<html>413 Request Entity Too Large</html>", FaultKind.DELIVERY,
     "not_the_api"),  # a proxy's limit, not the API's
    (400, JSON, b'{"message": "bad request"}', FaultKind.DELIVERY, "not_the_api"),
    (404, JSON, api_error("tenant_not_found"), FaultKind.DELIVERY, "tenant_not_found"),
    (404, JSON, api_error("not_found"), FaultKind.DELIVERY, "http_404"),  # wrong API path
    (405, JSON, api_error("method_not_allowed"), FaultKind.DELIVERY, "http_405"),
    (400, JSON, api_error("tenant_required"), FaultKind.DELIVERY, "http_400"),
])
def test_answers_are_judged_by_the_table(status, content_type, body, kind, reason):
    fault = response_fault(status, content_type, body, location="http://elsewhere/v1/runs")
    if kind is None:
        assert fault is None
    else:
        assert (fault.kind, fault.reason, fault.status) == (kind, reason, status)


def test_a_redirect_names_where_it_pointed():
    fault = response_fault(302, "", b"", location="https://other.example/v1/runs")
    assert "https://other.example/v1/runs" in fault.detail and "not followed" in fault.detail


# -- dead letters fit the producer's limit ------------------------------------------------------


def dead_letter(value: bytes | None, key: bytes | None = b"k", headers=None, limit=1_000_000):
    return dead_letter_record(key=key, value=value, headers=headers,
                              topic="poimen.acme.dispatch", partition=0, offset=9,
                              timestamp_ms=T0,
                              reason="invalid_json", detail="not JSON", limit=limit)


def size(record) -> int:
    return (len(record.value or b"") + len(record.key or b"")
            + sum(len(k) + len(v) for k, v in record.headers))


def test_a_small_dead_letter_is_the_original_plus_reason_and_origin():
    record = dead_letter(b"not json", headers=[("trace", b"abc")])
    h = dict(record.headers)
    assert record.value == b"not json" and record.key == b"k" and not record.truncated
    assert h["trace"] == b"abc" and h["poimen.dlq.reason"] == b"invalid_json"
    assert (h["poimen.dlq.origin.topic"], h["poimen.dlq.origin.partition"],
            h["poimen.dlq.origin.offset"]) == (b"poimen.acme.dispatch", b"0", b"9")
    # The origin's stored time: what replay derives a keyless message's key from.
    assert h["poimen.dlq.origin.timestamp"] == str(T0).encode()
    assert "poimen.dlq.truncated" not in h


def test_an_oversized_dead_letter_is_cut_to_fit_and_says_so():
    value = b"x" * 1_040_000
    record = dead_letter(value, headers=[("trace", b"abc")])
    h = dict(record.headers)
    assert size(record) < 1_000_000 - 256
    assert record.truncated == ("value",) and value.startswith(record.value)
    assert h["poimen.dlq.truncated"] == b"value"
    assert h["poimen.dlq.original.size"] == b"1040000"
    assert h["poimen.dlq.origin.offset"] == b"9" and h["trace"] == b"abc" and record.key == b"k"


def test_a_huge_key_and_headers_are_cut_after_the_value():
    record = dead_letter(b"v" * 500, key=b"k" * 20_000, headers=[("h", b"x" * 20_000)],
                         limit=10_000)
    h = dict(record.headers)
    assert size(record) < 10_000 and record.truncated == ("value", "key", "headers")
    assert h["poimen.dlq.reason"] == b"invalid_json" and h["poimen.dlq.origin.offset"] == b"9"


def test_a_traceback_summary_names_the_innermost_frame():
    def inner():
        raise RuntimeError("boom")

    try:
        inner()
    except RuntimeError as err:
        summary = traceback_summary(err)
    assert "in inner" in summary and summary.endswith("RuntimeError: boom")


# -- settings -----------------------------------------------------------------------------------


def test_every_setting_has_one_default_and_is_documented():
    config = inbox_settings({"POIMEN_API_URL": "http://api/", "POIMEN_API_TOKEN": "t",
                                   "KAFKA_BOOTSTRAP_SERVERS": "k:9092"})
    defaults = {f.name: f.default for f in fields(InboxSettings)}
    for name in INBOX_VARIABLES:
        assert getattr(config, name) == defaults[name], name
    assert config.api_url == "http://api" and config.shutdown_grace == 25
    docs = (ROOT / "docs" / "operations" / "configuration.md").read_text()  # the one settings table
    for variable in INBOX_VARIABLES.values():
        assert re.search(rf"`{variable}`", docs), f"{variable} is not in docs/operations/configuration.md"


def test_settings_are_read_from_the_environment():
    config = inbox_settings({
        "POIMEN_API_URL": "http://api", "POIMEN_API_TOKEN": "t", "KAFKA_BOOTSTRAP_SERVERS": "k",
        "POIMEN_INBOX_CONCURRENCY": "3", "POIMEN_INBOX_HTTP_TIMEOUT": "2.5",
        "POIMEN_SHUTDOWN_GRACE": "10", "PORT": "5000"})
    assert (config.concurrency, config.http_timeout, config.shutdown_grace,
            config.metrics_port) == (3, 2.5, 10.0, 5000)
    with pytest.raises(SystemExit, match="POIMEN_INBOX_CONCURRENCY"):
        inbox_settings({"POIMEN_API_URL": "a", "POIMEN_API_TOKEN": "t",
                              "KAFKA_BOOTSTRAP_SERVERS": "k", "POIMEN_INBOX_CONCURRENCY": "x"})


def test_a_session_timeout_brokers_would_refuse_is_refused_at_start():
    env = {"POIMEN_API_URL": "a", "POIMEN_API_TOKEN": "t", "KAFKA_BOOTSTRAP_SERVERS": "k"}
    with pytest.raises(SystemExit, match="POIMEN_INBOX_SESSION_TIMEOUT_MS must be at least 6000"):
        inbox_settings({**env, "POIMEN_INBOX_SESSION_TIMEOUT_MS": "3000"})
    assert inbox_settings({**env, "POIMEN_INBOX_SESSION_TIMEOUT_MS": "6000"}
                          ).session_timeout_ms == 6000
