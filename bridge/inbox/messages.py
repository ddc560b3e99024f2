"""What the relay reads from one dispatch message on its way to the API: its trace
context and its entry in a batch."""

from __future__ import annotations

import re
from dataclasses import dataclass

from confluent_kafka import Message

from ..kafka import header_list

# The W3C Trace Context headers a dispatch message may carry, posted on as the HTTP
# headers of the same name. The API decides validity (a malformed one is ignored
# there); here a value is only required to be one an HTTP header can carry.
TRACE_HEADERS = ("traceparent", "tracestate")
_HEADER_VALUE = re.compile(r"[\x20-\x7e]{1,512}")


def trace_headers(msg: Message) -> dict[str, str]:
    """The message's ``traceparent`` and ``tracestate`` Kafka headers, fit for HTTP."""
    found: dict[str, str] = {}
    for name, value in header_list(msg.headers()):
        if name in TRACE_HEADERS and name not in found and value:
            text = value.decode("ascii", "replace")
            if _HEADER_VALUE.fullmatch(text):
                found[name] = text
    return found


def where(msg: Message) -> str:
    """``<topic>[<partition>]@<offset>``, for a log line."""
    return f"{msg.topic()}[{msg.partition()}]@{msg.offset()}"


@dataclass(frozen=True)
class BatchEntry:
    """One parsed message on its way into a batch: its run request and trace context."""

    message: Message
    body: bytes
    trace: dict[str, str]
    derived: bool  # admitted under a derived kafka:... key
