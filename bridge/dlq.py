"""Replay dead letters: ``flask --app app topics replay-dlq`` (or ``python -m bridge.dlq replay``).

The inbox writes a message it cannot admit to ``<prefix>.<tenant>.dispatch.dlq``
with its original key, value and headers, plus ``poimen.dlq.*`` headers saying
why (``reason``) and where it came from (``origin.topic``, ``origin.partition``,
``origin.offset``, ``origin.timestamp``). Once the cause is fixed (the workflow
is registered, the relay's bug deployed away), replay publishes each selected
dead letter to the tenant's ``.dispatch`` topic again, and the inbox admits it
like any message.

Each dead letter is replayed once. After the broker acknowledged every copy,
replay commits the replay group's offsets on the dead-letter topic past what it
handled, and the next replay starts there: it reads only letters written since.
A copy that fails again is dead-lettered again, carrying ``poimen.replay.from``
(the letter it copies); a plain replay publishes neither such a *dead-lettered
copy* nor the letter it names (its message was replayed once already), so
replaying N letters that keep failing leaves at most 2N in the topic however
often it runs. A letter a filter left out (``--reason``) stops the commit in its
partition, so a later replay still gets it; the letters after it are read
again, and those replayed before are published again only if they did not fail
(no copy names them), which admission answers with the same run. Two replays
of one tenant at the same time may both publish a letter (the same run, too).

To replay again on purpose (the first replay failed again and the cause is now
fixed): ``--from-start`` reads the whole topic, ``--since`` what was
dead-lettered since a time; either ignores the commits and replays dead-lettered
copies too, but never publishes the same request twice in one replay (a copy
and its original are one message).

Replaying is safe to repeat: a message keeps its ``dispatch_key``, so a second
publication of it is admission's replay (the same run), never a second run. A
message written without one was admitted under the key derived from its place
and time in the log (``kafka:<topic>:<partition>:<offset>:<timestamp>``, see
``docs/operations/inbox.md``); a re-published copy sits at a new place, so
replay writes the key derived from its *origin* into the copy. A letter written
by a relay older than ``poimen.dlq.origin.timestamp`` derives the key of its
place alone (``kafka:<topic>:<partition>:<offset>``), the key that relay used.
A replay that fails (the broker did not acknowledge a copy) commits nothing:
running it again publishes them again, and admission makes that the same run.

Not replayed, and counted: dead letters cut to fit the broker's size limit
(``poimen.dlq.truncated``: the value is no longer the producer's) and values
that can never become a run (not UTF-8, not JSON, not an object, no value).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from poimenconfig import REPLAY_GROUP, consumer_group, kafka_client_settings, topic_prefix

from .deadletter import DeadLetter
from .inbox.faults import MessageFault, run_request_body
from .kafka import kafka_headers, place
from .topics import dead_letter_topic, dispatch_topic

log = logging.getLogger("poimen.dlq")

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
        raise ValueError(f"--since {value!r}: give an ISO 8601 time (YYYY-MM-DDTHH:MM:SSZ) "
                         "or an age (30m, 2h, 7d)") from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


@dataclass
class ReplayReport:
    """What a replay read, re-published and left, by reason."""

    topic: str
    target: str
    read: int = 0
    selected: int = 0
    replayed: int = 0
    skipped: Counter[str] = field(default_factory=Counter)    # why a selected letter was not replayed
    by_reason: Counter[str] = field(default_factory=Counter)  # selected letters by poimen.dlq.reason
    committed: dict[int, int] = field(default_factory=dict)  # partition -> where the next starts

    def summary(self, dry_run: bool) -> str:
        verb = "would replay" if dry_run else "replayed"
        text = (f"{verb} {self.replayed} of {self.selected} selected dead letter(s) "
                f"({self.read} read) from {self.topic} to {self.target}")
        if self.skipped:
            text += "; not replayed: " + ", ".join(f"{n} {why}" for why, n in
                                                   sorted(self.skipped.items()))
        return text


class DeadLetterTopic:
    """One dead-letter topic as replay sees it: each partition's bounds as of opening,
    and the replay group's committed offsets (where the next replay starts)."""

    def __init__(self, settings: Mapping[str, str], topic: str, group: str,
                 timeout: float = 30.0):
        self.topic, self.timeout = topic, timeout
        self.low: dict[int, int] = {}
        self.high: dict[int, int] = {}
        self.committed: dict[int, int] = {}  # partitions with a commit only
        self._consumer = Consumer({**settings, "group.id": group, "enable.auto.commit": False,
                                   "enable.partition.eof": True,
                                   "auto.offset.reset": "earliest"})
        try:
            metadata = self._consumer.list_topics(topic, timeout=timeout).topics.get(topic)
            self.exists = metadata is not None and metadata.error is None
            if not self.exists:
                return
            for p in sorted(metadata.partitions):
                self.low[p], self.high[p] = self._consumer.get_watermark_offsets(
                    TopicPartition(topic, p), timeout=timeout, cached=False)
            for tp in self._consumer.committed([TopicPartition(topic, p) for p in self.low],
                                               timeout=timeout):
                if tp.error is None and tp.offset >= 0:
                    self.committed[tp.partition] = tp.offset
        except BaseException:
            self._consumer.close()
            raise

    def __enter__(self) -> DeadLetterTopic:
        return self

    def __exit__(self, *_exc: object) -> None:
        self._consumer.close()

    def resume_offsets(self) -> dict[int, int]:
        """Where a plain replay starts: the group's commit, else the partition's start.

        A commit below the start (retention deleted letters) starts at the start; one
        past the end can only be a deleted and re-created topic's (an end never moves
        back otherwise), so its letters are all new: the start too.
        """
        starts = {}
        for p, low in self.low.items():
            at = self.committed.get(p, low)
            starts[p] = at if low <= at <= self.high[p] else low
        return starts

    def offsets_since(self, since: datetime) -> dict[int, int]:
        """The first offset of each partition written at or after ``since``."""
        ms = int(since.timestamp() * 1000)
        found = self._consumer.offsets_for_times(
            [TopicPartition(self.topic, p, ms) for p in self.low], timeout=self.timeout)
        # -1: no record at or after the time in this partition.
        return {tp.partition: tp.offset if tp.offset >= 0 else self.high[tp.partition]
                for tp in found}

    def read(self, starts: Mapping[int, int]) -> Iterator[DeadLetter]:
        """Yield the records from ``starts`` to each partition's end as of opening.

        The end is fixed when the topic is opened, so what is written meanwhile (a
        replayed message dead-lettered again) is not read.
        """
        topic, ends = self.topic, self.high
        todo = {p for p in ends if starts.get(p, ends[p]) < ends[p]}
        if not todo:
            return
        self._consumer.assign([TopicPartition(topic, p, starts[p]) for p in sorted(todo)])
        idle_since = time.monotonic()
        while todo:
            msg = self._consumer.poll(0.5)
            if msg is None:
                if time.monotonic() - idle_since > self.timeout:
                    raise TimeoutError(f"{topic}: nothing read for {self.timeout:.0f}s with "
                                       f"partitions {sorted(todo)} not read to their end")
                continue
            idle_since = time.monotonic()
            error = msg.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    todo.discard(msg.partition() or 0)
                    continue
                raise KafkaException(error)
            _, partition, offset = place(msg)
            if partition not in todo or offset >= ends[partition]:
                continue
            if offset >= ends[partition] - 1:
                todo.discard(partition)
            yield DeadLetter.from_message(msg)

    def commit(self, offsets: Mapping[int, int]) -> None:
        """Record ``offsets`` as the replay group's: the next plain replay starts there."""
        if offsets:
            self._consumer.commit(offsets=[TopicPartition(self.topic, p, o)
                                           for p, o in sorted(offsets.items())],
                                  asynchronous=False)


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
            body, derived = run_request_body(letter.value, "", 0, 0, None)
            if derived:
                return None, "keyless_without_origin"
            return body, ""
        body, _ = run_request_body(letter.value, origin.topic, origin.partition, origin.offset,
                                   origin.timestamp_ms)
    except MessageFault as fault:
        return None, f"never_a_run:{fault.fault.reason}"
    return body, ""


def replay_dead_letters(settings: Mapping[str, str], prefix: str, tenant: str, *,
                        group: str, reason: str | None = None, since: datetime | None = None,
                        from_start: bool = False, dry_run: bool = False,
                        show: Callable[[str], None] = lambda _line: None,
                        timeout: float = 30.0) -> ReplayReport:
    """Re-publish ``tenant``'s dead letters to its dispatch topic; return what was done.

    A plain replay reads from where the last one committed and skips dead-lettered
    copies of an earlier replay; ``from_start`` (the whole topic) and ``since``
    (what was dead-lettered since then) read again on purpose. ``reason`` selects
    letters by their ``poimen.dlq.reason``. ``dry_run`` publishes and commits
    nothing and ``show``s a line per selected letter (its reason, origin and
    dispatch key, never its input).
    """
    source, target = dead_letter_topic(prefix, tenant), dispatch_topic(prefix, tenant)
    report = ReplayReport(source, target)
    with DeadLetterTopic(settings, source, group, timeout) as dlq:
        if not dlq.exists:
            log.info("%s does not exist: nothing was dead-lettered", source)
            return report
        resume = dlq.resume_offsets()
        rereading = from_start or since is not None
        if since is not None:
            starts = dlq.offsets_since(since)
        else:
            starts = dict(dlq.low) if from_start else resume
        # Per partition, the offset before which every letter read was handled (replayed,
        # or never to be); it stops at the first letter a filter left out.
        reach, left_out = dict(starts), set()
        publish = _CopyPublisher(settings, target, dry_run, timeout)
        # The letters an earlier replay published and the inbox dead-lettered again: their
        # copies (written after them, so in the range read) name them. A plain replay skips
        # them even where no commit covers them (a filtered replay left a letter out).
        copied = set() if rereading else {
            letter.copy_of for letter in dlq.read(starts) if letter.copy_of}
        seen: set[bytes] = set()  # what this replay published: a request goes out once
        since_ms = int(since.timestamp() * 1000) if since else None
        last_progress = time.monotonic()
        for letter in dlq.read(starts):
            report.read += 1
            if (reason and letter.reason != reason) or (
                    since_ms is not None and 0 < letter.timestamp_ms < since_ms):
                left_out.add(letter.partition)
                continue
            report.selected += 1
            report.by_reason[letter.reason or "-"] += 1
            value, why = replay_request(letter)
            if value is not None and not rereading:
                # Its message was replayed once and failed again: a plain replay never
                # publishes it a second time (that is how a DLQ doubled on every replay).
                if letter.copy_of:
                    value, why = None, "copy_of_a_replayed_letter"
                elif f"{source}:{letter.partition}:{letter.offset}" in copied:
                    value, why = None, "replayed_and_dead_lettered_again"
            if value is not None:
                digest = hashlib.sha256(b"%d:" % len(letter.key or b"") + (letter.key or b"")
                                        + value).digest()
                if digest in seen:
                    value, why = None, "published_once_already"
                seen.add(digest)
            if dry_run:
                show(_describe(letter, value, why))
            if letter.partition not in left_out:
                reach[letter.partition] = letter.offset + 1
            if value is None:
                report.skipped[why] += 1
                continue
            report.replayed += 1
            publish(letter, source, value)
            if time.monotonic() - last_progress >= PROGRESS_SECONDS:
                last_progress = time.monotonic()
                log.info("replay of %s: %d read, %d replayed so far", source, report.read,
                         report.replayed)
        if dry_run:
            return report
        publish.flush()  # raises unless the broker acknowledged every copy
        # Only now: a replay that died before the acknowledgements committed nothing,
        # and running it again publishes them again (admission: the same run).
        for p, at in reach.items():
            if p not in left_out:
                at = dlq.high[p]  # read to its end as of opening, gaps included
            # A commit moves forward only, from a start no later than the last commit:
            # a --since replay that began after it must not skip what lies between.
            if starts[p] <= resume[p] < at:
                report.committed[p] = at
        try:
            dlq.commit(report.committed)
        except KafkaException as err:
            log.warning("replay of %s: the copies are published, but recording it failed "
                        "(%s): the next replay publishes them again (admission: the same "
                        "run)", source, err)
            report.committed = {}
    return report


class _CopyPublisher:
    """The replay's producer: a call ``(letter, source, value)`` sends a copy; ``flush``
    waits for the broker's acknowledgement of every copy and raises if one failed."""

    def __init__(self, settings: Mapping[str, str], target: str, dry_run: bool,
                 timeout: float):
        self.target, self.timeout = target, timeout
        self.producer = None if dry_run else Producer({**settings, "acks": "all",
                                                       "enable.idempotence": True})
        self.failures: list[KafkaError] = []

    def _delivered(self, err: KafkaError | None, _msg: Message) -> None:
        if err is not None:
            self.failures.append(err)

    def __call__(self, letter: DeadLetter, source: str, value: bytes) -> None:
        if self.producer is None:
            return
        headers = letter.copy_headers(source)
        while True:
            try:
                self.producer.produce(self.target, value, key=letter.key,
                                      headers=kafka_headers(headers),
                                      on_delivery=self._delivered)
                break
            except BufferError:  # the producer's queue is full: let it drain
                self.producer.poll(0.5)
        self.producer.poll(0)

    def flush(self) -> None:
        if self.producer is None:
            return
        left = self.producer.flush(self.timeout)
        if left or self.failures:
            problem = (self.failures[0] if self.failures
                       else f"{left} not acknowledged in {self.timeout:.0f}s")
            raise RuntimeError(f"replay to {self.target} failed: {problem} "
                               "(nothing was recorded as replayed; running it again is safe: "
                               "the same message is the same run)")


def _describe(letter: DeadLetter, value: bytes | None, why: str) -> str:
    origin = letter.origin
    where = f"{origin.topic}[{origin.partition}]@{origin.offset}" if origin else "-"
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
    start = replay.add_mutually_exclusive_group()
    start.add_argument("--since", help="again, those dead-lettered since: ISO 8601 time or age")
    start.add_argument("--from-start", action="store_true",
                       help="again, the whole topic (replayed letters and copies included)")
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
                                 since=since, from_start=args.from_start,
                                 dry_run=args.dry_run, show=print)
    print(report.summary(args.dry_run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
