"""The dead-letter codec (``bridge/deadletter.py``): what the inbox writes, the replay reads
back, field for field, through the real broker, hostile header bytes included."""

from __future__ import annotations

import uuid

from confluent_kafka import Producer

from bridge.deadletter import DLQ_HEADER, DeadLetter, Origin, dead_letter_record
from bridge.dlq import DeadLetterTopic
from bridge.kafka import kafka_headers
from bridge.topics import declare_topics

T0 = 1_796_432_478_134  # a CreateTime in ms (2026-12-04)

# What a producer may put on a dispatch message: bytes that are no UTF-8, a null value,
# a name twice, an empty name, and headers posing as the relay's own verdict.
HOSTILE_HEADERS = [
    ("trace", b"\xff\xfe\x00\x80not utf-8"),
    ("null", None),
    ("twice", b"1"),
    ("twice", b"2"),
    ("", b"empty name"),
    ("poimen.dlq.reason", b"forged"),
    ("poimen.dlq.truncated", b"value"),
    ("poimen.dlq.origin.offset", b"999"),
]
HOSTILE_KEY = b"\x00\xff key \xc3\x28"
HOSTILE_VALUE = b'{"workflow_ref": "echo", "input": "\xff"}'
# A detail from the API's answer: any text, newlines, a lone surrogate, longer than kept.
DETAIL = "line one\nline two \u2603 \ud800 " + "x" * 2000


def write(**overrides: object):
    fields = {"key": HOSTILE_KEY, "value": HOSTILE_VALUE, "headers": HOSTILE_HEADERS,
              "topic": "poimen.acme.dispatch", "partition": 3, "offset": 41,
              "timestamp_ms": T0, "reason": "http_422", "status": 422, "detail": DETAIL,
              "traceback": "File x.py:1 in f\nValueError: \udcff"}
    return dead_letter_record(**{**fields, **overrides})


def check(letter: DeadLetter) -> None:
    """``letter`` is what ``write()`` wrote: the original kept, the verdict the relay's."""
    assert letter.key == HOSTILE_KEY and letter.value == HOSTILE_VALUE
    # The producer's own headers, byte for byte and in order, none of them posing as ours.
    assert letter.headers == [h for h in HOSTILE_HEADERS if not h[0].startswith(DLQ_HEADER)]
    assert letter.reason == "http_422" and letter.status == 422
    assert letter.origin == Origin("poimen.acme.dispatch", 3, 41, T0)
    assert letter.detail == DETAIL[:1000].replace("\ud800", "?")
    assert letter.dlq["traceback"] == "File x.py:1 in f\nValueError: ?"
    assert letter.truncated == () and letter.copy_of is None and letter.replay == {}


def test_what_the_inbox_writes_the_replay_reads_back():
    record = write()
    check(DeadLetter.parse(record.key, record.value, record.headers))
    # Without an answer or a stored time: no status, an origin without its time.
    bare = write(status=None, timestamp_ms=None, traceback=None)
    letter = DeadLetter.parse(bare.key, bare.value, bare.headers)
    assert letter.status is None and letter.origin == Origin("poimen.acme.dispatch", 3, 41)
    assert "traceback" not in letter.dlq and "origin.timestamp" not in letter.dlq


def test_a_copy_dead_lettered_again_names_the_letter_it_copies():
    record = write()
    first = DeadLetter.parse(record.key, record.value, record.headers)
    first.partition, first.offset = 0, 7
    copy = first.copy_headers("poimen.acme.dispatch.dlq")
    again = write(headers=copy, offset=50)
    letter = DeadLetter.parse(again.key, again.value, again.headers)
    assert letter.copy_of == "poimen.acme.dispatch.dlq:0:7"
    assert letter.replay == {"from": "poimen.acme.dispatch.dlq:0:7", "reason": "http_422"}
    assert letter.origin is not None and letter.origin.offset == 50
    assert letter.headers == first.headers


def test_a_cut_letter_says_what_was_cut():
    record = write(value=b"v" * 5000, limit=4000)
    letter = DeadLetter.parse(record.key, record.value, record.headers)
    assert record.truncated == letter.truncated == ("value",)
    assert letter.dlq["original.size"] == "5000" and letter.reason == "http_422"


def test_dead_letters_round_trip_through_the_broker(test_env):
    bootstrap = test_env["KAFKA_BOOTSTRAP_SERVERS"]
    topic = f"codec{uuid.uuid4().hex[:8]}.t.dispatch.dlq"
    declare_topics(bootstrap, topic.removesuffix(".t.dispatch.dlq"), ["t"], 1)
    records = [write(), write(value=b"v" * 5000, limit=4000)]
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all"})
    for record in records:
        producer.produce(topic, value=record.value, key=record.key,
                         headers=kafka_headers(record.headers))
    assert producer.flush(30) == 0

    with DeadLetterTopic({"bootstrap.servers": bootstrap}, topic,
                         f"codec-{uuid.uuid4().hex[:8]}") as dlq:
        letters = list(dlq.read(dlq.resume_offsets()))
    assert [(letter.partition, letter.offset) for letter in letters] == [(0, 0), (0, 1)]
    check(letters[0])
    assert letters[0].timestamp_ms > 0
    assert letters[1].truncated == ("value",) and letters[1].value == records[1].value
    assert letters[1].headers == letters[0].headers
