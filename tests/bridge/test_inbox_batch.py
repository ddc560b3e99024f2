"""The inbox's batches, without a broker or an API: what each message of a
``POST /v1/runs/batch`` becomes, for every kind of answer.

The relay is driven through ``Inbox.deliver_batch`` with a scripted API in place of
its ``Transport`` and a recorded dead-letter writer in place of the producer; the
relay tests (``test_inbox_relay.py``, ``test_inbox_hostile.py``) prove the same over
real processes. The rule: each message ends as the single ``POST /v1/runs`` would
have ended it (docs/operations/inbox.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
from poimen_client import TransportError, TransportTimeout
from poimen_client.client import Answer

from bridge.inbox import Inbox, OutcomeKind, Slot
from bridge.inbox.faults import (
    FaultKind,
    batch_body,
    batch_fault,
    batch_item,
)
from poimenconfig import inbox_settings

JSON = "application/json"
TOPIC = "poimen.acme.dispatch"
T0 = 1_796_432_478_134  # a CreateTime in ms (2026-12-04)


def run(status: int = 201) -> dict:
    return {"status": status, "run": {"id": "r", "status": "queued", "workflow_ref": "echo"}}


def item_error(status: int, code: str) -> dict:
    return {"status": status, "error": {"code": code, "message": "m", "details": {}}}


def answer(status: int, document: object = None, content_type: str = JSON,
           raw: bytes | None = None) -> Answer:
    data = raw if raw is not None else json.dumps(document).encode()
    return Answer(status, {"Content-Type": content_type}, data)


# -- the verdict on one answer, as a table -------------------------------------------------------

VERDICTS = [
    # (status, body, items in the batch) -> whole-batch reason | "split" | per-item kinds
    (200, {"results": [run(201), run(200)]}, 2, [None, None]),
    (200, {"results": [run(201), item_error(409, "dispatch_key_conflict")]}, 2,
     [None, FaultKind.MESSAGE]),
    (200, {"results": [item_error(422, "unknown_workflow"), item_error(400, "bad_request")]},
     2, [FaultKind.MESSAGE, FaultKind.MESSAGE]),
    (200, {"results": [item_error(404, "tenant_not_found")]}, 1, [FaultKind.DELIVERY]),
    (200, {"results": [run(201)]}, 2, "not_the_api"),        # the wrong number of results
    (200, {"results": [{"run": {}}]}, 1, "not_the_api"),     # a result without a status
    (200, {"runs": []}, 1, "not_the_api"),                   # not the batch shape
    (200, None, 1, "not_the_api"),
    (201, run(201)["run"], 1, "not_the_api"),                 # a single endpoint's answer
    (503, {"error": {"code": "database_unavailable", "message": "m"}}, 3, "http_503"),
    (500, "oops", 3, "http_500"),
    (401, {"error": {"code": "unauthorized", "message": "m"}}, 3, "http_401"),
    (403, {"error": {"code": "forbidden", "message": "m"}}, 3, "http_403"),
    (404, {"error": {"code": "tenant_not_found", "message": "m"}}, 3, "tenant_not_found"),
    (404, {"error": {"code": "not_found", "message": "m"}}, 3, "http_404"),
    (404, "<html>proxy</html>", 3, "not_the_api"),
    (302, None, 3, "redirect"),
    (413, {"error": {"code": "batch_too_large", "message": "m",
                     "details": {"max": 2, "given": 3}}}, 3, "split"),
    (413, {"error": {"code": "payload_too_large", "message": "m"}}, 3, "split"),
    (413, "<html>too large</html>", 3, "split"),
    (422, {"error": {"code": "invalid_request", "message": "m"}}, 3, "split"),
    (400, {"error": {"code": "bad_request", "message": "m"}}, 3, "split"),
]


@pytest.mark.parametrize(("status", "body", "count", "expected"), VERDICTS)
def test_answers_to_a_batch_are_judged_by_the_table(status, body, count, expected):
    verdict = batch_fault(status, JSON, json.dumps(body).encode(), count)
    if expected == "split":
        assert verdict.split and verdict.whole is None and not verdict.items
    elif isinstance(expected, str):
        assert verdict.whole is not None and not verdict.split and not verdict.items
        assert verdict.whole.kind is FaultKind.DELIVERY and verdict.whole.reason == expected
    else:
        assert verdict.whole is None and not verdict.split
        assert [f.kind if f else None for _, f in verdict.items] == expected


def test_a_batch_too_large_names_the_servers_limit():
    body = {"error": {"code": "batch_too_large", "message": "m", "details": {"max": 7,
                                                                           "given": 9}}}
    assert batch_fault(413, JSON, json.dumps(body).encode(), 9).limit == 7


def test_an_items_error_keeps_the_apis_words_for_the_dead_letter():
    body = {"results": [item_error(409, "dispatch_key_conflict")]}
    [(status, fault)] = batch_fault(200, JSON, json.dumps(body).encode(), 1).items
    assert status == 409 and fault.reason == "http_409" and fault.status == 409
    assert "dispatch_key_conflict" in fault.detail


def test_items_carry_their_trace_context_and_the_body_stays_byte_for_byte():
    body = '{"workflow_ref": "echo", "input": {"s": "😀"}}'.encode()
    item = batch_item(body, {"traceparent": "00-ab-cd-01", "tracestate": "k=v"})
    assert item.startswith(body[:-1])  # nothing re-encoded
    assert json.loads(item) == {"workflow_ref": "echo", "input": {"s": "😀"},
                                "traceparent": "00-ab-cd-01", "tracestate": "k=v"}
    assert batch_item(body, {}) is body
    assert json.loads(batch_item(b"{ }", {"traceparent": "t"})) == {"traceparent": "t"}
    assert json.loads(batch_body([body, b"{}"])) == {"runs": [json.loads(body), {}]}


# -- deliver_batch: each message's outcome ------------------------------------------------------


@dataclass
class FakeMessage:
    at: int
    raw: bytes | None
    trace: list = field(default_factory=list)

    def offset(self) -> int:
        return self.at

    def value(self) -> bytes | None:
        return self.raw

    def key(self) -> bytes | None:
        return None

    def topic(self) -> str:
        return TOPIC

    def partition(self) -> int:
        return 0

    def headers(self) -> list:
        return self.trace

    def timestamp(self) -> tuple[int, int]:
        return 1, T0 + self.at  # CreateTime


class ScriptedAPI:
    """Answers calls from a script; records each call's path, items and headers."""

    def __init__(self, *script):
        self.script = list(script)
        self.calls: list[tuple[str, list | dict, dict]] = []

    def send(self, method, path, body, headers):
        document = json.loads(body)
        self.calls.append((path, document.get("runs", document), dict(headers)))
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        return step(document) if callable(step) else step


@pytest.fixture
def inbox(monkeypatch):
    config = inbox_settings({"POIMEN_API_URL": "http://api", "POIMEN_API_TOKEN": "t",
                             "KAFKA_BOOTSTRAP_SERVERS": "k"})
    relay = Inbox(config)
    relay.dead_letters = []

    def dead_letter(msg, tenant, reason, status=None, detail="", traceback=None):
        relay.dead_letters.append((msg.offset(), reason))
        return relay_outcome(OutcomeKind.DEAD_LETTERED, reason, status, detail)

    from bridge.inbox import Outcome as relay_outcome
    monkeypatch.setattr(relay, "dead_letter", dead_letter)
    yield relay
    relay._pool.shutdown(wait=False)


def slots(*values) -> list[Slot]:
    return [Slot(FakeMessage(at, v if isinstance(v, bytes) else json.dumps(v).encode()))
            for at, v in enumerate(values)]


def kinds(outcomes) -> list[str]:
    return [f"{o.kind}:{o.reason}" if o.reason else str(o.kind) for o in outcomes]


GOOD = {"workflow_ref": "echo", "dispatch_key": "k"}


def test_each_item_ends_as_its_own_answer_says(inbox):
    api = inbox._api = ScriptedAPI(answer(200, {"results": [
        run(201), item_error(409, "dispatch_key_conflict"), run(200),
        item_error(404, "tenant_not_found")]}))
    batch = slots(GOOD, {**GOOD, "input": {"x": 1}}, GOOD, {"workflow_ref": "echo"})
    outcomes = inbox.deliver_batch(batch, "acme")
    assert kinds(outcomes) == ["admitted", "dead_lettered:http_409", "replayed",
                               "retry:tenant_not_found"]
    assert inbox.dead_letters == [(1, "http_409")]
    [(path, items, headers)] = api.calls
    assert path == "/v1/runs/batch" and headers["X-Poimen-Tenant"] == "acme" and len(items) == 4
    # The keyless message went with its derived key, the same as alone.
    assert items[3]["dispatch_key"] == f"kafka:{TOPIC}:0:3:{T0 + 3}" and outcomes[3].derived_key is False


def test_a_malformed_message_is_dead_lettered_alone_and_never_joins_the_batch(inbox):
    api = inbox._api = ScriptedAPI(answer(200, {"results": [run(201), run(201)]}))
    outcomes = inbox.deliver_batch(slots(GOOD, b"not json {", b"null", GOOD), "acme")
    assert kinds(outcomes) == ["admitted", "dead_lettered:invalid_json",
                               "dead_lettered:not_an_object", "admitted"]
    assert [len(items) for _, items, _ in api.calls] == [2]


def test_trace_headers_become_the_items_traceparent(inbox):
    api = inbox._api = ScriptedAPI(answer(200, {"results": [run(201)]}))
    batch = [Slot(FakeMessage(0, json.dumps(GOOD).encode(),
                              [("traceparent", b"00-" + b"a" * 32 + b"-" + b"b" * 16 + b"-01")]))]
    inbox.deliver_batch(batch, "acme")
    [(_, [item], headers)] = api.calls
    assert item["traceparent"].startswith("00-aaa") and "traceparent" not in headers


@pytest.mark.parametrize(("script", "reason"), [
    (TransportTimeout("read timed out"), "timeout"),
    (TransportError("refused"), "connection"),
    (answer(503, {"error": {"code": "database_unavailable", "message": "m"}}), "http_503"),
    (answer(401, {"error": {"code": "unauthorized", "message": "m"}}), "http_401"),
    (answer(404, {"error": {"code": "tenant_not_found", "message": "m"}}), "tenant_not_found"),
    (answer(200, {"results": [run(201)]}), "not_the_api"),  # 1 result for 3 items
    (answer(200, raw=b"<html>", content_type="text/html"), "not_the_api"),
])
def test_a_whole_batch_fault_is_every_items_retry_never_a_dead_letter(inbox, script, reason):
    inbox._api = ScriptedAPI(script)
    outcomes = inbox.deliver_batch(slots(GOOD, GOOD, GOOD), "acme")
    assert kinds(outcomes) == [f"retry:{reason}"] * 3 and inbox.dead_letters == []


def test_a_413_splits_the_batch_and_learns_the_servers_limit(inbox):
    too_many = answer(413, {"error": {"code": "batch_too_large", "message": "m",
                                      "details": {"max": 2, "given": 5}}})
    api = inbox._api = ScriptedAPI(
        too_many,
        lambda d: answer(200, {"results": [run(201)] * len(d["runs"])}),
        lambda d: answer(200, {"results": [run(201)] * len(d["runs"])}),
        lambda d: answer(200, {"results": [run(201)] * len(d["runs"])}))
    outcomes = inbox.deliver_batch(slots(*[GOOD] * 5), "acme")
    assert kinds(outcomes) == ["admitted"] * 5 and inbox.dead_letters == []
    assert [len(items) for _, items, _ in api.calls] == [5, 2, 2, 1]
    assert inbox._batch_limit() == 2  # later batches are taken at the server's size


def test_a_413_without_a_limit_halves_until_a_lone_message_goes_alone(inbox):
    too_large = answer(413, {"error": {"code": "payload_too_large", "message": "m"}})
    api = inbox._api = ScriptedAPI(
        too_large,                                         # [0, 1]
        answer(200, {"results": [run(201)]}),               # [0]
        too_large,                                         # [1]
        answer(413, {"error": {"code": "payload_too_large", "message": "m"}}))  # POST /v1/runs
    outcomes = inbox.deliver_batch(slots(GOOD, GOOD), "acme")
    # The lone message is judged by POST /v1/runs, as it always was: its own 413.
    assert kinds(outcomes) == ["admitted", "dead_lettered:http_413"]
    assert [path for path, _, _ in api.calls] == ["/v1/runs/batch"] * 3 + ["/v1/runs"]


def test_our_own_error_on_one_message_is_that_messages(inbox):
    inbox.config = inbox_settings({"POIMEN_API_URL": "http://api", "POIMEN_API_TOKEN": "t",
                                   "KAFKA_BOOTSTRAP_SERVERS": "k",
                                   "POIMEN_INBOX_TEST_RAISE_ON": "boom"})
    inbox._api = ScriptedAPI(*[lambda d: answer(200, {"results": [run(201)]})] * 3)
    batch = slots({**GOOD, "input": {"s": "boom"}}, GOOD)
    for attempt in (1, 2):
        outcomes = inbox.deliver_batch(batch[:1] + (batch[1:] if attempt == 1 else []), "acme")
        assert kinds(outcomes)[0] == "retry:internal_error"
    assert kinds(outcomes) == ["retry:internal_error"]
    assert kinds(inbox.deliver_batch(batch[:1], "acme")) == ["dead_lettered:internal_error"]
