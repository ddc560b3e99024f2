"""The dead-letter record: one codec for the inbox, which writes it, and the replay, which reads it.

A dead letter is the original message (its key, value and the producer's own
headers, byte for byte) plus headers in two namespaces, each value UTF-8 text:

- ``poimen.dlq.*``, written by the inbox: ``reason``, ``http.status`` (empty
  when there was no answer), ``detail``, the origin (``origin.topic``,
  ``origin.partition``, ``origin.offset`` and ``origin.timestamp``, the
  message's stored time), ``traceback`` after the relay's own errors, and
  ``truncated`` with ``original.size`` when the record was cut to fit.
- ``poimen.replay.*``, written by the replay on the copy it publishes to the
  tenant's ``.dispatch`` topic: ``from`` (``<topic>:<partition>:<offset>`` of the
  letter it copies) and ``reason``. A copy that is dead-lettered again keeps them
  among its own headers, so its letter names the letter it copies.

The ``poimen.dlq.*`` namespace is the inbox's alone: a producer's own header in it
is not kept in the letter, so nothing a producer writes can pose as the relay's
verdict (a forged ``poimen.dlq.truncated`` would stop the replay). A header value
that is not UTF-8 is read with replacement characters; the producer's own headers
are never decoded.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from traceback import TracebackException
from typing import NamedTuple

from confluent_kafka import Message

from .kafka import DEFAULT_MAX_MESSAGE_BYTES, Headers, KafkaHeaders, header_list, place

DLQ_HEADER = "poimen.dlq."
REPLAY_HEADER = "poimen.replay."

# The longest ``poimen.dlq.detail``: an excerpt of the API's answer, an error's words.
DETAIL_CHARS = 1000
TRACEBACK_CHARS = 2000
# Room left for the record's framing when a dead letter is fitted under the producer's
# message.max.bytes (DEFAULT_MAX_MESSAGE_BYTES unless KAFKA_MESSAGE_MAX_BYTES is set).
DLQ_RECORD_OVERHEAD = 512

def _text(value: bytes | None) -> str:
    return (value or b"").decode("utf-8", "replace")


@dataclass(frozen=True)
class Record:
    """A Kafka record as it is written, and what was cut to fit it under the size limit."""

    key: bytes | None
    value: bytes | None
    headers: Headers
    truncated: tuple[str, ...] = ()  # "value", "key", "headers"


class Origin(NamedTuple):
    """Where a dead-lettered message was read from, and its stored time (None in a letter
    written before the relay recorded it)."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int | None = None

    @property
    def place(self) -> str:
        """``<topic>:<partition>:<offset>``, as ``poimen.replay.from`` names a letter."""
        return f"{self.topic}:{self.partition}:{self.offset}"


@dataclass
class DeadLetter:
    """One dead-letter record: the original message and the two namespaces of headers.

    ``partition``, ``offset`` and ``timestamp_ms`` say where the record itself sits
    in its dead-letter topic: set by ``from_message`` for a record read back, -1 for
    one not yet written.
    """

    key: bytes | None
    value: bytes | None
    headers: Headers                                       # the producer's own
    dlq: dict[str, str]                                    # poimen.dlq.* without the prefix
    replay: dict[str, str] = field(default_factory=dict)  # poimen.replay.* without the prefix
    partition: int = -1
    offset: int = -1
    timestamp_ms: int = -1

    # -- reading ---------------------------------------------------------------------------------

    @classmethod
    def parse(cls, key: bytes | None, value: bytes | None,
              headers: KafkaHeaders | None) -> DeadLetter:
        """Split a record into the original and its ``poimen.dlq.*``/``poimen.replay.*`` fields.

        A name that occurs twice keeps its last value (the one written last).
        """
        own: Headers = []
        dlq: dict[str, str] = {}
        replay: dict[str, str] = {}
        for name, raw in header_list(headers):
            if name.startswith(DLQ_HEADER):
                dlq[name[len(DLQ_HEADER):]] = _text(raw)
            elif name.startswith(REPLAY_HEADER):
                replay[name[len(REPLAY_HEADER):]] = _text(raw)
            else:
                own.append((name, raw))
        return cls(key, value, own, dlq, replay)

    @classmethod
    def from_message(cls, msg: Message) -> DeadLetter:
        """Parse a record consumed from a dead-letter topic, with its place there."""
        letter = cls.parse(msg.key(), msg.value(), msg.headers())
        _, letter.partition, letter.offset = place(msg)
        letter.timestamp_ms = msg.timestamp()[1]
        return letter

    @property
    def reason(self) -> str:
        return self.dlq.get("reason", "")

    @property
    def status(self) -> int | None:
        """The API's HTTP status, if there was an answer."""
        try:
            return int(self.dlq["http.status"])
        except (KeyError, ValueError):
            return None

    @property
    def detail(self) -> str:
        return self.dlq.get("detail", "")

    @property
    def origin(self) -> Origin | None:
        """Where the message was read from, or None if the letter does not say."""
        try:
            topic, partition, offset = (self.dlq["origin.topic"], int(self.dlq["origin.partition"]),
                                        int(self.dlq["origin.offset"]))
        except (KeyError, ValueError):
            return None
        try:
            return Origin(topic, partition, offset, int(self.dlq["origin.timestamp"]))
        except (KeyError, ValueError):
            return Origin(topic, partition, offset)

    @property
    def truncated(self) -> tuple[str, ...]:
        """What was cut to fit the size limit: ``"value"``, ``"key"``, ``"headers"``."""
        cut = self.dlq.get("truncated", "")
        return tuple(cut.split(",")) if cut else ()

    @property
    def copy_of(self) -> str | None:
        """The dead letter this one is a copy of (``<topic>:<partition>:<offset>``), if a
        replay published it and the inbox dead-lettered it again; else None."""
        return self.replay.get("from") or None

    # -- writing ---------------------------------------------------------------------------------

    def record_headers(self) -> Headers:
        """The headers to write: the producer's own, then ``poimen.replay.*``, then
        ``poimen.dlq.*`` (a reader keeps the last of a name: the relay's)."""
        return [*self.headers,
                *[(REPLAY_HEADER + k, v.encode("utf-8", "replace"))
                  for k, v in self.replay.items()],
                *[(DLQ_HEADER + k, v.encode("utf-8", "replace")) for k, v in self.dlq.items()]]

    def copy_headers(self, source: str) -> Headers:
        """The headers of the copy a replay publishes: the producer's own, and where the
        copy comes from (``source`` is the dead-letter topic)."""
        return [*self.headers,
                (REPLAY_HEADER + "from", f"{source}:{self.partition}:{self.offset}".encode()),
                (REPLAY_HEADER + "reason", self.reason.encode("utf-8", "replace"))]


def _headers_size(headers: Iterable[tuple[str, bytes | None]]) -> int:
    # Name, value and generous varint framing per header.
    return sum(len(k.encode()) + len(v or b"") + 10 for k, v in headers)


def dead_letter_record(*, key: bytes | None, value: bytes | None,
                       headers: KafkaHeaders | None, topic: str, partition: int, offset: int,
                       timestamp_ms: int | None, reason: str, status: int | None = None,
                       detail: str = "", traceback: str | None = None,
                       limit: int = DEFAULT_MAX_MESSAGE_BYTES) -> Record:
    """Return the dead letter of a message: the original plus ``poimen.dlq.*`` headers.

    It always fits under ``limit`` bytes: a message that is malformed *because*
    it is large must still be dead-lettered, or it stalls its partition. The
    value is cut first, then the key, then the producer's own headers; the
    ``poimen.dlq.*`` headers (reason, origin) are always kept, and a cut record
    says so in ``poimen.dlq.truncated`` and ``poimen.dlq.original.size``.
    ``DeadLetter.parse`` reads the record back.
    """
    fields = {
        "reason": reason,
        "http.status": str(status or ""),
        "detail": detail[:DETAIL_CHARS],
        "origin.topic": topic,
        "origin.partition": str(partition),
        "origin.offset": str(offset),
        # The origin's stored time: replay derives a keyless message's key from it
        # (bridge/dlq.py), and the copy it publishes sits at a new place and time.
        **({"origin.timestamp": str(timestamp_ms)} if timestamp_ms is not None else {}),
        **({"traceback": traceback[-TRACEBACK_CHARS:]} if traceback is not None else {}),
    }
    kept = [(name, raw) for name, raw in header_list(headers) if not name.startswith(DLQ_HEADER)]
    original_size = len(value or b"")
    # Reserve room for the two headers a cut record gets.
    room = (limit - DLQ_RECORD_OVERHEAD - _headers_size(DeadLetter(key, value, [], fields)
                                                        .record_headers()) - 80)
    over = len(value or b"") + len(key or b"") + _headers_size(kept) - room
    cut: list[str] = []
    if over > 0 and value:
        keep = max(len(value) - over, 0)
        over -= len(value) - keep
        value, cut = value[:keep], [*cut, "value"]
    if over > 0 and key:
        keep = max(len(key) - over, 0)
        over -= len(key) - keep
        key, cut = key[:keep], [*cut, "key"]
    if over > 0 and kept:
        kept, cut = [], [*cut, "headers"]
    if cut:
        fields["truncated"] = ",".join(cut)
        fields["original.size"] = str(original_size)
    return Record(key, value, DeadLetter(key, value, kept, fields).record_headers(), tuple(cut))


def traceback_summary(err: BaseException, frames: int = 5) -> str:
    """Return the exception and its innermost frames on a few lines, for ``poimen.dlq.traceback``."""
    tb = TracebackException.from_exception(err)
    lines = [f"{f.filename}:{f.lineno} in {f.name}" for f in list(tb.stack)[-frames:]]
    lines.append("".join(tb.format_exception_only()).strip())
    return "\n".join(lines)[-TRACEBACK_CHARS:]
