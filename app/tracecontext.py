"""W3C Trace Context on runs: the ``traceparent`` (and ``tracestate``) a run was admitted with.

A caller that traces its own work sends ``traceparent`` with ``POST /v1/runs``
(or as a Kafka header of a dispatch message, which the inbox passes on as the
HTTP header). Admission keeps it on the run; every Celery message of the run
carries it as a message header, and every event of the run carries it as the
CloudEvents distributed-tracing extension (``ce_traceparent``). A fan-out child
inherits its parent's.

A malformed value is ignored, never an error: tracing is the caller's concern,
and a run must not be refused for a header a proxy mangled. The rules are the
W3C Recommendation's (https://www.w3.org/TR/trace-context/): lowercase hex,
no all-zero trace or parent id, version ``ff`` invalid, and a later version
read by its first four fields (kept as version ``00``, the one this writes).
A ``tracestate`` is kept only beside a valid ``traceparent`` and only when it
is well formed (at most 32 members, unique keys, 512 characters).

Standard library only: the web process, the workers and the tests share it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
HEADERS = (TRACEPARENT, TRACESTATE)
MAX_TRACESTATE = 512
MAX_TRACESTATE_MEMBERS = 32

_TRACEPARENT = re.compile(
    r"(?P<version>[0-9a-f]{2})-(?P<trace_id>[0-9a-f]{32})-(?P<parent_id>[0-9a-f]{16})"
    r"-(?P<flags>[0-9a-f]{2})(?P<rest>.*)", re.DOTALL)
_ZERO_TRACE, _ZERO_PARENT = "0" * 32, "0" * 16
# tracestate list members: key = simple-key / tenant@system; value = 0-255 printable
# ASCII chars except ',' and '=', not ending in a space.
_KEY = re.compile(r"[a-z][_0-9a-z\-*/]{0,255}|[a-z0-9][_0-9a-z\-*/]{0,240}@[a-z][_0-9a-z\-*/]{0,13}")
_VALUE = re.compile(r"[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]")


@dataclass(frozen=True)
class TraceContext:
    """A valid ``traceparent`` and, if one came with it and is well formed, its ``tracestate``."""

    traceparent: str
    tracestate: str | None = None

    @property
    def trace_id(self) -> str:
        return self.traceparent[3:35]

    def headers(self) -> dict[str, str]:
        """The W3C headers (``traceparent``, ``tracestate``) that carry this context."""
        out = {TRACEPARENT: self.traceparent}
        if self.tracestate:
            out[TRACESTATE] = self.tracestate
        return out


def parse_traceparent(value: str | None) -> str | None:
    """Return ``value`` as a version-00 ``traceparent`` if it is a valid one, else None."""
    if not value or len(value) > 512:
        return None
    match = _TRACEPARENT.fullmatch(value.strip(" \t"))
    if match is None:
        return None
    version, trace_id, parent_id, flags, rest = match.group(
        "version", "trace_id", "parent_id", "flags", "rest")
    if version == "ff" or trace_id == _ZERO_TRACE or parent_id == _ZERO_PARENT:
        return None
    # Version 00 has exactly four fields; a later version may add fields after a '-'.
    if rest and (version == "00" or not rest.startswith("-")):
        return None
    return f"00-{trace_id}-{parent_id}-{flags}"


def parse_tracestate(value: str | None) -> str | None:
    """Return ``value`` as a ``tracestate`` (empty members dropped) if well formed, else None."""
    if not value or len(value) > MAX_TRACESTATE:
        return None
    members, keys = [], set()
    for raw in value.split(","):
        member = raw.strip(" \t")
        if not member:
            continue
        key, sep, val = member.partition("=")
        if not sep or not _KEY.fullmatch(key) or not _VALUE.fullmatch(val) or key in keys:
            return None
        keys.add(key)
        members.append(member)
    if not members or len(members) > MAX_TRACESTATE_MEMBERS:
        return None
    return ",".join(members)


def from_headers(headers: Mapping[str, str] | None) -> TraceContext | None:
    """The trace context of a request's (or a Celery message's) headers; None if it has none."""
    if headers is None:  # not ``not headers``: werkzeug's headers count themselves by iterating
        return None
    traceparent = parse_traceparent(headers.get(TRACEPARENT))
    if traceparent is None:
        return None
    return TraceContext(traceparent, parse_tracestate(headers.get(TRACESTATE)))


def of_run(row) -> TraceContext | None:
    """The trace context stored on a run's row (any object with the two columns)."""
    traceparent = getattr(row, TRACEPARENT, None)
    if traceparent is None:
        return None
    return TraceContext(traceparent, getattr(row, TRACESTATE, None))
