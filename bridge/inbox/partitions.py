"""The partition state machine: one partition's fetched, not yet committed messages.

Each message is a ``Slot`` (queued -> running -> done, or -> failed -> running ...);
a ``PartitionWork`` takes them in batches, settles each by its own outcome, commits
only the done prefix, and says when to pause and resume fetching. Nothing here takes
a lock, reads a clock or does I/O: the rules are tested without threads or a broker
(tests/bridge/test_partition_work.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from confluent_kafka import Message, TopicPartition

from ..kafka import offset_of
from .outcomes import Outcome


class SlotState(StrEnum):
    """Where one fetched message is: queued -> running -> done, or -> failed -> running ..."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"  # its last delivery is to be retried


# What one batch item adds to a message's bytes: the derived key, trace context, commas.
BATCH_ITEM_OVERHEAD = 256


def message_bytes(msg: Message) -> int:
    """What a fetched message costs the relay's memory (value and key)."""
    return len(msg.value() or b"") + len(msg.key() or b"")


def expected_bytes(estimate: float, size: int) -> float:
    """The next estimate of a message's bytes after one of ``size``: up at once to a larger
    message, down slowly (a running average), so a run of large messages cannot overshoot
    the byte budget while an average catches up with it."""
    return max(float(size), 0.9 * estimate + 0.1 * size)


def batch_size(room: int, estimate: float, most: int = 500) -> int:
    """How many messages to take with ``room`` bytes of budget left: at least one."""
    return int(max(1, min(most, room // max(1.0, estimate))))


@dataclass
class Slot:
    message: Message
    state: SlotState = SlotState.QUEUED
    # Consecutive exceptions from our own code on this offset. Only the drain task
    # holding the slot (state RUNNING) touches it.
    internal_errors: int = 0
    queued_at: float = 0.0  # when it was fetched (monotonic): the batch linger counts from it


@dataclass
class PartitionWork:
    """The fetched, not yet committed messages of one partition, in offset order.

    Every field is guarded by ``Inbox._lock`` (the relay's one lock; ``Inbox._changed``
    is a condition on it): the consumer thread appends and pauses, drain tasks take
    and settle, rebalance callbacks close. The class takes no lock of its own and
    reads no clock, so its rules are tested without threads or a broker.

    Messages are delivered in batches (one ``POST /v1/runs/batch`` each): ``take_many``
    takes several slots as one call, ``settle_many`` records each slot's own outcome.
    The window counts calls in flight, not messages.
    """

    topic: str
    partition: int
    tenant: str
    slots: deque[Slot] = field(default_factory=deque)
    waiting: int = 0          # slots queued or failed
    in_flight: int = 0        # slots being delivered
    calls: int = 0            # batches being delivered (each holds one or more slots)
    failed: int = 0           # slots whose last delivery is to be retried
    tasks: int = 0            # drain tasks submitted and not finished
    attempts: int = 0         # consecutive retriable failures (calls with a retry in them)
    retry_at: float = 0.0     # no delivery before this (monotonic)
    next_offset: int = -1     # the offset after the last message appended
    buffered_bytes: int = 0   # bytes of the messages held in ``slots``
    commit_offset: int | None = None     # next offset to commit: all below are done
    committed_offset: int | None = None  # what was last sent to the group coordinator
    paused: bool = False
    closing: bool = False     # revoked or stopping: take no new message

    @property
    def tp(self) -> TopicPartition:
        return TopicPartition(self.topic, self.partition)

    @property
    def failing(self) -> bool:
        return self.attempts > 0

    def append(self, msg: Message, now: float = 0.0) -> None:
        # A resume after a pause may re-fetch from the consumer's position;
        # never hold an offset twice.
        offset = offset_of(msg)
        if offset < self.next_offset:
            return
        self.next_offset = offset + 1
        self.slots.append(Slot(msg, queued_at=now))
        self.buffered_bytes += message_bytes(msg)
        self.waiting += 1

    def linger_left(self, now: float, limit: int, linger: float) -> float:
        """Seconds to wait for more messages before posting what waits (0: post now).

        A batch goes at once when it is full, when a message is to be retried (its
        backoff was the wait), or when the oldest waiting message is ``linger`` old:
        a lone message waits at most ``linger`` for company.
        """
        if linger <= 0 or self.waiting >= limit or self.failed:
            return 0.0
        for slot in self.slots:
            if slot.state is SlotState.QUEUED:
                return max(0.0, slot.queued_at + linger - now)
        return 0.0

    def take_many(self, now: float, window: int, limit: int, linger: float = 0.0,
                  max_bytes: int | None = None) -> list[Slot]:
        """Return the next messages to deliver as one call, marked running, or [].

        Up to ``limit`` messages (and ``max_bytes``, but at least one), in offset
        order, failed ones included: nothing once ``window`` calls are in flight,
        during a retry's backoff, while the batch lingers, or once closing.
        """
        if (self.closing or now < self.retry_at or self.calls >= window
                or self.linger_left(now, limit, linger) > 0):
            return []
        taken: list[Slot] = []
        size = 0
        for slot in self.slots:
            if len(taken) >= limit:
                break
            if slot.state not in (SlotState.QUEUED, SlotState.FAILED):
                continue
            cost = message_bytes(slot.message) + BATCH_ITEM_OVERHEAD
            if taken and max_bytes is not None and size + cost > max_bytes:
                break
            size += cost
            if slot.state is SlotState.FAILED:
                self.failed -= 1
            slot.state = SlotState.RUNNING
            taken.append(slot)
        if taken:
            self.waiting -= len(taken)
            self.in_flight += len(taken)
            self.calls += 1
        return taken

    def take(self, now: float, window: int) -> Slot | None:
        """Return the first message to deliver now, alone, marked running, or None."""
        taken = self.take_many(now, window, 1)
        return taken[0] if taken else None

    def settle_many(self, settled: Iterable[tuple[Slot, Outcome]], now: float,
                    retry_delay: float = 0.0) -> None:
        """Record one call's outcomes, each slot its own; a retry in it holds the whole
        partition for ``retry_delay``.
        """
        settled = list(settled)
        self.calls -= 1
        retried = False
        for slot, outcome in settled:
            self.in_flight -= 1
            if outcome.done:
                slot.state = SlotState.DONE
                continue
            slot.state = SlotState.FAILED
            self.failed += 1
            self.waiting += 1
            retried = True
        if retried:
            self.attempts += 1
            self.retry_at = now + retry_delay
        elif self.in_flight == 0 and self.failed == 0:
            self.attempts = 0
        # In-order commit: only the prefix of done messages moves the offset.
        while self.slots and self.slots[0].state is SlotState.DONE:
            done = self.slots.popleft().message
            self.buffered_bytes -= message_bytes(done)
            self.commit_offset = offset_of(done) + 1

    def settle(self, slot: Slot, outcome: Outcome, now: float, retry_delay: float = 0.0) -> None:
        """Record a lone delivery's outcome (``settle_many`` of one)."""
        self.settle_many([(slot, outcome)], now, retry_delay)

    def close(self) -> None:
        """Take no new message: the partition is revoked or lost, or the relay stops."""
        self.closing = True

    def revoke_offset(self) -> int | None:
        """Return the offset to commit as the partition leaves this relay, or None.

        Only the end of the done prefix (admitted or dead-lettered): never past a
        message still in flight, failed or not yet taken, whatever came after it.
        The new owner reads from there, and admission absorbs a message the old
        owner had posted (its dispatch_key, or the same derived key: the topic,
        partition and offset do not depend on who reads them). Committing past
        it would lose the message; committing less only replays.
        """
        return self.commit_offset

    def should_pause(self, max_buffered: int, over_budget: bool = False) -> bool:
        """Whether to stop fetching: a message is failing, the backlog is full, or the
        relay holds its byte budget (``over_budget``, across partitions).

        Fetching more while a message fails would only pile up work that cannot go
        anywhere; other partitions are not affected.
        """
        return not self.paused and (self.failing or len(self.slots) >= max_buffered
                                    or over_budget)

    def should_resume(self, max_buffered: int, under_budget: bool = True) -> bool:
        return (self.paused and not self.failing and len(self.slots) <= max_buffered // 2
                and under_budget)
