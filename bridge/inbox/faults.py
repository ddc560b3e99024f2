"""What can go wrong with a dispatch message, and whose fault it is.

Every failure of the inbox is one of two kinds, and the kind alone decides
what the relay does:

- A **message fault** means the message can never become a run as written:
  it cannot be parsed, or the API answered, in its own JSON error shape, a
  4xx that describes the request (400, 409, 413, 415, 422). Retrying cannot
  help, and waiting would stall every later message of the partition, so the
  message is dead-lettered at once and the partition keeps draining.
- A **delivery fault** means the message may be fine but did not reach
  admission: a refused connection, a timeout, a 5xx, 429, 401/403/408, any
  3xx, or an answer that is not the API's (a 2xx without a run, a 4xx without
  the API's error shape: a proxy, a wrong URL). Dead-lettering would throw
  away good messages while an operator fixes a token or a load balancer, so
  the message is retried with backoff and never dead-lettered; nothing is
  committed past it.

Reading the answer strictly is what keeps the two apart: a redirect that a
client follows turns ``POST /v1/runs`` into a ``GET`` whose 200 looks like
success, and a 404 from a proxy looks like a bad message. Nothing here does
I/O, so the whole table is tested without a broker or an API.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from ..deadletter import DETAIL_CHARS

# The API's 4xx that describe the request itself: the same request can never succeed.
MESSAGE_FAULT_STATUSES = frozenset({400, 409, 413, 415, 422})
# Error codes in those statuses that describe the relay's own set-up, not the message.
RELAY_ERROR_CODES = frozenset({"tenant_required"})
# A tenant whose topics were declared before the tenant was created: the message
# is fine and becomes a run once the tenant exists (issue: declare, publish, create).
TENANT_NOT_FOUND = "tenant_not_found"
# The whitespace JSON allows around a value (RFC 8259).
JSON_WHITESPACE = b" \t\r\n"


class FaultKind(StrEnum):
    """Whose fault a failure is, which decides between dead-lettering and retrying."""

    MESSAGE = "message"    # the message as written can never be admitted: dead-letter it
    DELIVERY = "delivery"  # the message did not reach admission: retry, never dead-letter


@dataclass(frozen=True)
class Fault:
    """One failure to admit a message: its kind, a short reason, and what was seen."""

    kind: FaultKind
    reason: str
    status: int | None = None
    detail: str = ""


class MessageFault(ValueError):
    """Raised for a message that cannot be parsed into a run request."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason

    @property
    def fault(self) -> Fault:
        return Fault(FaultKind.MESSAGE, self.reason, detail=str(self))


def derived_dispatch_key(topic: str, partition: int, offset: int,
                         timestamp_ms: int | None) -> str:
    """Return the ``dispatch_key`` of a message that has none: its place and its time.

    The place (topic, partition, offset) names one message only for the life of
    the topic: a topic deleted and re-created starts its offsets at 0 again, and
    a keyless message there would replay (or conflict with) a run of the old
    topic's message at that offset. The message's timestamp (``CreateTime``,
    or ``LogAppendTime`` on a topic so configured) is stored with it in the log,
    so every redelivery of the same message derives the same key, while the
    message at the same offset of a re-created topic carries its own time.
    ``timestamp_ms`` None (a broker of the 0.9 message format, which keeps no
    time; a dead letter written before the time was recorded) derives the key
    of the place alone, ``kafka:<topic>:<partition>:<offset>``, as before.
    """
    if timestamp_ms is None:
        return f"kafka:{topic}:{partition}:{offset}"
    return f"kafka:{topic}:{partition}:{offset}:{timestamp_ms}"


def message_timestamp(kind: int, timestamp_ms: int) -> int | None:
    """Return a message's stored time in ms from ``Message.timestamp()``, None if it has none."""
    # confluent_kafka.TIMESTAMP_NOT_AVAILABLE is 0; an old-format message reads (0, -1).
    return timestamp_ms if kind != 0 and timestamp_ms >= 0 else None


def run_request_body(value: bytes | None, topic: str, partition: int,
                     offset: int, timestamp_ms: int | None) -> tuple[bytes, bool]:
    """Return the ``POST /v1/runs`` body for a message, and whether its key was derived.

    The body is the message's value exactly as the producer wrote it: the API
    validates every field (an unknown field is its 422, not silently dropped
    here), and nothing is re-encoded, so numbers keep their digits and text is
    not inflated by escaping. The one change is for a message whose
    ``dispatch_key`` is absent or null: its derived key
    (``derived_dispatch_key``) is appended as the last member (a duplicate name
    resolves to the last one in the API's parser and in Postgres ``jsonb``).

    Raise ``MessageFault`` if the value is not a UTF-8 JSON object.
    """
    if value is None:
        raise MessageFault("no_value", "the message has no value (a tombstone)")
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError as err:
        raise MessageFault("invalid_utf8", f"not UTF-8: {err}") from None
    try:
        body = json.loads(text)
    except RecursionError:
        raise MessageFault("too_deep", "JSON nested deeper than the parser allows") from None
    except ValueError as err:
        raise MessageFault("invalid_json", f"not JSON: {str(err)[:200]}") from None
    if not isinstance(body, dict):
        kind = "null" if body is None else type(body).__name__
        raise MessageFault("not_an_object", f"a JSON {kind}, not an object")
    if body.get("dispatch_key") is not None:
        return value, False
    key = json.dumps(derived_dispatch_key(topic, partition, offset, timestamp_ms)).encode()
    inner = value.rstrip(JSON_WHITESPACE)[:-1].rstrip(JSON_WHITESPACE)  # without the final }
    if not body:  # {} has no member to follow
        return b'{"dispatch_key":' + key + b"}", True
    return inner + b',"dispatch_key":' + key + b"}", True


def _json(content_type: str, text: bytes) -> Any:
    if "json" not in content_type.lower():
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def is_run(document: Any) -> bool:
    """Whether ``document`` is a run as the API serialises it."""
    return (isinstance(document, dict) and isinstance(document.get("id"), str)
            and isinstance(document.get("status"), str) and "workflow_ref" in document)


def api_error_code(document: Any) -> str | None:
    """Return the code of the API's own error shape ``{"error": {"code", "message", ...}}``."""
    if not isinstance(document, dict):
        return None
    error = document.get("error")
    code = error.get("code") if isinstance(error, dict) and "message" in error else None
    return code if isinstance(code, str) else None


def _excerpt(text: bytes) -> str:
    return text[:DETAIL_CHARS * 4].decode("utf-8", "replace")[:DETAIL_CHARS]


def response_fault(status: int, content_type: str, text: bytes,
                   location: str | None = None) -> Fault | None:
    """Judge the API's answer to ``POST /v1/runs``: ``None`` for a run, else the fault.

    Only a 200 (replay) or 201 (new run) whose body is a run is success. The
    relay never follows redirects, so a 3xx arrives here as itself.
    """
    detail = _excerpt(text)
    if 300 <= status < 400:
        return Fault(FaultKind.DELIVERY, "redirect", status,
                     f"{status} to {location or '(no Location)'}: not followed")
    document = _json(content_type, text)
    if 200 <= status < 300:
        if status in (200, 201) and is_run(document):
            return None
        return Fault(FaultKind.DELIVERY, "not_the_api", status,
                     f"a {status} without a run ({content_type or 'no content type'}): {detail}")
    if status >= 500 or status in (401, 403, 408, 429):
        return Fault(FaultKind.DELIVERY, f"http_{status}", status, detail)
    code = api_error_code(document)
    if code is None:
        # A proxy's, a load balancer's or another server's 4xx: nothing about the message.
        return Fault(FaultKind.DELIVERY, "not_the_api", status,
                     f"a {status} not in the API's error shape: {detail}")
    if code == TENANT_NOT_FOUND:
        return Fault(FaultKind.DELIVERY, TENANT_NOT_FOUND, status, detail)
    if status in MESSAGE_FAULT_STATUSES and code not in RELAY_ERROR_CODES:
        return Fault(FaultKind.MESSAGE, f"http_{status}", status, detail)
    # The API's own 404 not_found (a wrong POIMEN_API_URL path), 405, tenant_required...:
    # the relay's set-up is wrong, not the message.
    return Fault(FaultKind.DELIVERY, f"http_{status}", status, detail)


# -- batches: POST /v1/runs/batch -----------------------------------------------------------------

BATCH_PATH = "/v1/runs/batch"
# The whole-batch 413 that names the server's item limit in its details ({"max", "given"}).
BATCH_TOO_LARGE = "batch_too_large"


def batch_item(body: bytes, trace: dict[str, str]) -> bytes:
    """Return one ``runs`` item: the run request body plus the message's trace context.

    Like ``run_request_body``, nothing is re-encoded: the trace members are appended
    as the last members of the object (a duplicate name resolves to the last one).
    """
    if not trace:
        return body
    extra = b"".join(b"," + json.dumps(name).encode() + b":" + json.dumps(value).encode()
                     for name, value in trace.items())
    inner = body.rstrip(JSON_WHITESPACE)[:-1].rstrip(JSON_WHITESPACE)  # without the final }
    if inner.rstrip(JSON_WHITESPACE).endswith(b"{"):  # {} has no member to follow
        return inner + extra[1:] + b"}"
    return inner + extra + b"}"


def batch_body(items: list[bytes]) -> bytes:
    """Return the ``POST /v1/runs/batch`` body for ``items`` (each a JSON object)."""
    return b'{"runs":[' + b",".join(items) + b"]}"


@dataclass(frozen=True)
class BatchVerdict:
    """The API's answer to one ``POST /v1/runs/batch`` of ``count`` items, judged.

    Exactly one of: ``items`` (the batch was answered: one ``(status, fault)`` per
    item, in request order, ``fault`` None for a run), ``whole`` (a fault of the
    whole batch: every item's outcome, as the single path would have it), or
    ``split`` (the server refused the batch as such: post it in halves, a lone item
    through ``POST /v1/runs``); ``limit`` is the server's item limit when it said so.
    """

    items: tuple[tuple[int, Fault | None], ...] = ()
    whole: Fault | None = None
    split: bool = False
    limit: int | None = None


def _not_the_api(status: int, why: str, text: bytes) -> BatchVerdict:
    return BatchVerdict(whole=Fault(FaultKind.DELIVERY, "not_the_api", status,
                                    f"{why}: {_excerpt(text)}"))


def batch_fault(status: int, content_type: str, text: bytes, count: int,
                location: str | None = None) -> BatchVerdict:
    """Judge the API's answer to a ``POST /v1/runs/batch`` of ``count`` items.

    A 200 ``{"results": [...]}`` with one result per item is judged item by item
    with the single request's table (``response_fault``): ``{"status": 201|200,
    "run": ...}`` is a run, ``{"status": 4xx, "error": ...}`` the item's own fault.
    A 200 of any other shape or count is not the API's answer: every item is
    retried. A 413 (too many items, too many bytes) and a whole-batch 4xx the
    single table calls a message fault are the server refusing the batch, not any
    one message: ``split`` isolates the items until each is judged on its own.
    Any other whole answer (3xx, 401/403, 404, 5xx, ...) is every item's.
    """
    if status == 200:
        document = _json(content_type, text)
        results = document.get("results") if isinstance(document, dict) else None
        if not isinstance(results, list):
            return _not_the_api(status, "a 200 without results", text)
        if len(results) != count:
            return _not_the_api(status, f"{len(results)} results for {count} items", text)
        judged: list[tuple[int, Fault | None]] = []
        for result in results:
            item_status = result.get("status") if isinstance(result, dict) else None
            if not isinstance(item_status, int) or isinstance(item_status, bool):
                return _not_the_api(status, "a result without a status", text)
            answer = result.get("run") if 200 <= item_status < 300 else {
                "error": result.get("error")}
            judged.append((item_status, response_fault(
                item_status, "application/json", json.dumps(answer).encode())))
        return BatchVerdict(items=tuple(judged))
    if status == 413:
        document = _json(content_type, text)
        limit = None
        if api_error_code(document) == BATCH_TOO_LARGE:
            given = (document["error"].get("details") or {}).get("max")
            if isinstance(given, int) and not isinstance(given, bool) and given > 0:
                limit = given
        return BatchVerdict(split=True, limit=limit)
    fault = response_fault(status, content_type, text, location)
    if fault is None:  # a 201 with a run: a single endpoint's answer, not a batch's
        return _not_the_api(status, "a run, not results", text)
    if fault.kind is FaultKind.MESSAGE:
        return BatchVerdict(split=True)
    return BatchVerdict(whole=fault)
