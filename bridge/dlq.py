"""Replay dead letters: ``flask --app app topics replay-dlq`` (or ``python -m bridge.dlq replay``).

The inbox writes a message it cannot admit to ``<prefix>.<tenant>.dispatch.dlq``
with its original key, value and headers, plus ``poimen.dlq.*`` headers saying
why (``reason``) and where it came from (``origin.topic``, ``origin.partition``,
``origin.offset``). Once the cause is fixed (the workflow is registered, the
relay's bug deployed away), replay publishes each selected dead letter to the
tenant's ``.dispatch`` topic again, and the inbox admits it like any message.

Replaying is safe to repeat: a message keeps its ``dispatch_key``, so a second
replay of it is admission's replay (the same run), never a second run. A
message written without one was admitted under the key derived from its place
in the log (``kafka:<topic>:<partition>:<offset>``, see ``docs/operations/inbox.md``); a
re-published copy would sit at a new offset and derive a new key, so replay
writes the key derived from its *origin* into the copy. Nothing is committed
and no state is kept: each replay reads the dead-letter topic from the start
(or from ``--since``) up to its end as it was when the replay began, so copies
dead-lettered again during a replay are not read again by it.

Not replayed, and counted: dead letters cut to fit the broker's size limit
(``poimen.dlq.truncated``: the value is no longer the producer's) and values
that can never become a run (not UTF-8, not JSON, not an object, no value).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from poimenconfig import consumer_group, kafka_client_settings, topic_prefix

from .inbox_faults import MessageFault, run_request_body
from .topics import dead_letter_topic, dispatch_topic

log = logging.getLogger("poimen.dlq")

DLQ_HEADER = "poimen.dlq."
REPLAY_HEADER = "poimen.replay."
REPLAY_GROUP = "poimen-dlq-replay"
PROGRESS_SECONDS = 5.0
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd])\s*$", re.IGNORECASE)
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(value: str, now: datetime | None = None) -> datetime:
    """Return the instant ``value`` names: ISO 8601 (UTC if no zone) or an age (``30m``, ``2h``, ``7d``)."""
    now = now or datetime.now(UTC)
    match = _DURATION.match(value)
    if match:
        return now - timedelta(seconds=float(match.group(1)) * _UNIT[match.group(2).lower()])
    try:
        when = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"--since {value!r}: give an ISO 8601 time (2026-11-29T10:00:00Z) "
                         "or an age (30m, 2h, 7d)") from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


@dataclass
class DeadLetter:
    """One record of a dead-letter topic, split into the original and the inbox's headers."""

    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]       # the producer's own headers
    dlq: dict[str, str]                    # poimen.dlq.* without the prefix

    @property
    def reason(self) -> str:
        return self.dlq.get("reason", "")

    @property
    def origin(self) -> tuple[str, int, int] | None:
        try:
            return (self.dlq["origin.topic"], int(self.dlq["origin.partition"]),
                    int(self.dlq["origin.offset"]))
        except (KeyError, ValueError):
            return None


@dataclass
class ReplayReport:
    """What a replay read, re-published and left, by reason."""

    topic: str
    target: str
    read: int = 0
    selected: int = 0
    replayed: int = 0
    skipped: Counter = field(default_factory=Counter)    # why a selected letter was not replayed
    by_reason: Counter = field(default_factory=Counter)  # selected letters by poimen.dlq.reason

    def summary(self, dry_run: bool) -> str:
        verb = "would replay" if dry_run else "replayed"
        text = (f"{verb} {self.replayed} of {self.selected} selected dead letter(s) "
                f"({self.read} read) from {self.topic} to {self.target}")
        if self.skipped:
            text += "; not replayed: " + ", ".join(f"{n} {why}" for why, n in
                                                   sorted(self.skipped.items()))
        return text


def _split(msg) -> DeadLetter:
    own, dlq = [], {}
    for name, raw in msg.headers() or []:
        if name.startswith(DLQ_HEADER):
            dlq[name[len(DLQ_HEADER):]] = (raw or b"").decode("utf-8", "replace")
        elif not name.startswith(REPLAY_HEADER):
            own.append((name, raw or b""))
    return DeadLetter(msg.partition(), msg.offset(), msg.timestamp()[1], msg.key(), msg.value(),
                      own, dlq)


def read_dead_letters(settings: Mapping[str, str], topic: str, group: str,
                      since: datetime | None = None, timeout: float = 30.0
                      ) -> Iterator[DeadLetter]:
    """Yield the records of ``topic`` from ``since`` (else the start) to its end as of now.

    The end is fixed when reading starts, so what is written meanwhile (a
    replayed message dead-lettered again) is not read. Nothing is committed.
    """
    consumer = Consumer({**settings, "group.id": group, "enable.auto.commit": False,
                         "enable.partition.eof": True, "auto.offset.reset": "earliest"})
    try:
        metadata = consumer.list_topics(topic, timeout=timeout).topics.get(topic)
        if metadata is None or metadata.error is not None:
            log.info("%s does not exist: nothing was dead-lettered", topic)
            return
        partitions = sorted(metadata.partitions)
        ends, starts = {}, {}
        for p in partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout,
                                                       cached=False)
            ends[p], starts[p] = high, low
        if since is not None:
            ms = int(since.timestamp() * 1000)
            found = consumer.offsets_for_times([TopicPartition(topic, p, ms) for p in partitions],
                                               timeout=timeout)
            for tp in found:
                # -1: no record at or after the time in this partition.
                starts[tp.partition] = tp.offset if tp.offset >= 0 else ends[tp.partition]
        todo = {p for p in partitions if starts[p] < ends[p]}
        if not todo:
            return
        consumer.assign([TopicPartition(topic, p, starts[p]) for p in sorted(todo)])
        idle_since = time.monotonic()
        while todo:
            msg = consumer.poll(0.5)
            if msg is None:
                if time.monotonic() - idle_since > timeout:
                    raise TimeoutError(f"{topic}: nothing read for {timeout:.0f}s with partitions "
                                       f"{sorted(todo)} not read to their end")
                continue
            idle_since = time.monotonic()
            if msg.error():
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    todo.discard(msg.partition())
                    continue
                raise KafkaException(msg.error())
            if msg.partition() not in todo or msg.offset() >= ends[msg.partition()]:
                continue
            if msg.offset() >= ends[msg.partition()] - 1:
                todo.discard(msg.partition())
            yield _split(msg)
    finally:
        consumer.close()


def replay_request(letter: DeadLetter) -> tuple[bytes | None, str]:
    """Return the value to re-publish for ``letter``, or ``(None, why not)``.

    A keyless message gets the key derived from its origin, so each replay of it
    is the same run (``docs/operations/inbox.md``: the derived key).
    """
    if "truncated" in letter.dlq:
        return None, "truncated"
    origin = letter.origin
    try:
        if origin is None:
            body, derived = run_request_body(letter.value, "", 0, 0)
            if derived:
                return None, "keyless_without_origin"
            return body, ""
        body, _ = run_request_body(letter.value, *origin)
    except MessageFault as fault:
        return None, f"never_a_run:{fault.fault.reason}"
    return body, ""


def replay_dead_letters(settings: Mapping[str, str], prefix: str, tenant: str, *,
                        group: str, reason: str | None = None, since: datetime | None = None,
                        dry_run: bool = False,
                        show: Callable[[str], None] = lambda _line: None,
                        timeout: float = 30.0) -> ReplayReport:
    """Re-publish ``tenant``'s dead letters to its dispatch topic; return what was done.

    ``reason`` selects letters by their ``poimen.dlq.reason``; ``since`` by the
    time they were dead-lettered. ``dry_run`` publishes nothing and ``show``s a
    line per selected letter (its reason, origin and dispatch key, never its input).
    """
    source, target = dead_letter_topic(prefix, tenant), dispatch_topic(prefix, tenant)
    report = ReplayReport(source, target)
    producer = None if dry_run else Producer({**settings, "acks": "all",
                                              "enable.idempotence": True})
    failures: list[KafkaError] = []

    def delivered(err, _msg) -> None:
        if err is not None:
            failures.append(err)

    since_ms = int(since.timestamp() * 1000) if since else None
    last_progress = time.monotonic()
    for letter in read_dead_letters(settings, source, group, since, timeout):
        report.read += 1
        if reason and letter.reason != reason:
            continue
        if since_ms is not None and 0 < letter.timestamp_ms < since_ms:
            continue
        report.selected += 1
        report.by_reason[letter.reason or "-"] += 1
        value, why = replay_request(letter)
        if dry_run:
            show(_describe(letter, value, why))
        if value is None:
            report.skipped[why] += 1
            continue
        report.replayed += 1
        if producer is not None:
            headers = [*letter.headers,
                       ("poimen.replay.from", f"{source}:{letter.partition}:{letter.offset}"
                        .encode()),
                       ("poimen.replay.reason", letter.reason.encode())]
            while True:
                try:
                    producer.produce(target, value, key=letter.key, headers=headers,
                                     on_delivery=delivered)
                    break
                except BufferError:  # the producer's queue is full: let it drain
                    producer.poll(0.5)
            producer.poll(0)
        if time.monotonic() - last_progress >= PROGRESS_SECONDS:
            last_progress = time.monotonic()
            log.info("replay of %s: %d read, %d replayed so far", source, report.read,
                     report.replayed)
    if producer is not None:
        left = producer.flush(timeout)
        if left or failures:
            problem = failures[0] if failures else f"{left} not acknowledged in {timeout:.0f}s"
            raise RuntimeError(f"replay to {target} failed: {problem} "
                               "(running it again is safe: the same message is the same run)")
    return report


def _describe(letter: DeadLetter, value: bytes | None, why: str) -> str:
    origin = letter.origin
    where = f"{origin[0]}[{origin[1]}]@{origin[2]}" if origin else "-"
    key = ref = "-"
    try:
        body = json.loads(value) if value is not None else {}
        key, ref = str(body.get("dispatch_key", "-")), str(body.get("workflow_ref", "-"))
    except ValueError:
        pass
    verdict = f"skip ({why})" if value is None else "replay"
    return (f"{letter.partition}:{letter.offset}  reason={letter.reason or '-'}  origin={where}  "
            f"workflow_ref={ref}  dispatch_key={key}  -> {verdict}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bridge.dlq", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    replay = sub.add_parser("replay", help="re-publish a tenant's dead letters to its dispatch")
    replay.add_argument("--tenant", required=True)
    replay.add_argument("--reason", help="only dead letters with this poimen.dlq.reason")
    replay.add_argument("--since", help="only those dead-lettered since: ISO 8601 time or age")
    replay.add_argument("--dry-run", action="store_true", help="list, publish nothing")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s", stream=sys.stderr)
    try:
        since = parse_since(args.since) if args.since else None
    except ValueError as err:
        parser.error(str(err))
    report = replay_dead_letters(kafka_client_settings(), topic_prefix(), args.tenant,
                                 group=consumer_group(REPLAY_GROUP), reason=args.reason,
                                 since=since, dry_run=args.dry_run, show=print)
    print(report.summary(args.dry_run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
