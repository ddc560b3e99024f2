"""The inbox's in-order commit rule (``PartitionWork``), without a broker or threads."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from bridge.inbox import Outcome, OutcomeKind, PartitionWork, SlotState


@dataclass
class FakeMessage:
    """What ``PartitionWork`` asks of a message: its offset, and its bytes."""

    at: int
    size: int = 10

    def offset(self) -> int:
        return self.at

    def value(self) -> bytes:
        return b"v" * self.size

    def key(self) -> bytes | None:
        return None


DONE = Outcome(OutcomeKind.ADMITTED, status=201)
DEAD = Outcome(OutcomeKind.DEAD_LETTERED, "invalid_json")
RETRY = Outcome(OutcomeKind.RETRY, "http_503", 503)


def work_with(*offsets: int, topic: str = "poimen.acme.dispatch", partition: int = 0
              ) -> PartitionWork:
    work = PartitionWork(topic, partition, "acme")
    for offset in offsets:
        work.append(FakeMessage(offset))
    return work


def test_commit_waits_for_the_oldest_message_when_later_ones_finish_first():
    work = work_with(10, 11, 12)
    first, second, third = (work.take(now=0, window=3) for _ in range(3))
    work.settle(third, DONE, now=0)
    work.settle(second, DEAD, now=0)  # a dead-lettered message is finished with, too
    assert work.commit_offset is None  # offset 10 is still in flight
    work.settle(first, DONE, now=0)
    assert work.commit_offset == 13
    assert not work.slots and work.in_flight == 0 and work.waiting == 0


def test_window_of_one_delivers_strictly_in_order():
    work = work_with(0, 1)
    first = work.take(now=0, window=1)
    assert work.take(now=0, window=1) is None  # one call in flight per partition
    work.settle(first, DONE, now=0)
    second = work.take(now=0, window=1)
    assert second.message.offset() == 1 and work.commit_offset == 1


def test_window_above_one_commits_only_the_done_prefix():
    work = work_with(0, 1, 2, 3)
    a, b = work.take(now=0, window=2), work.take(now=0, window=2)
    assert work.take(now=0, window=2) is None  # the window is full
    work.settle(b, DONE, now=0)
    c = work.take(now=0, window=2)
    work.settle(c, DONE, now=0)
    assert work.commit_offset is None  # 1 and 2 are done, 0 is not
    work.settle(a, DONE, now=0)
    assert work.commit_offset == 3
    d = work.take(now=0, window=2)
    assert d.message.offset() == 3


def test_a_retry_holds_its_partition_until_the_backoff_is_over():
    work = work_with(0, 1)
    slot = work.take(now=100, window=1)
    work.settle(slot, RETRY, now=100, retry_delay=2.0)
    assert slot.state is SlotState.FAILED and work.failing
    assert work.commit_offset is None
    assert work.take(now=101, window=1) is None  # backing off
    again = work.take(now=102, window=1)
    assert again is slot  # the failed message first, never the one behind it
    work.settle(again, DONE, now=102)
    assert not work.failing and work.commit_offset == 1


def test_a_retry_with_a_wider_window_never_commits_past_the_failed_message():
    work = work_with(0, 1, 2)
    a, b = work.take(now=0, window=2), work.take(now=0, window=2)
    work.settle(a, RETRY, now=0, retry_delay=1.0)
    work.settle(b, DONE, now=0)
    assert work.commit_offset is None and work.failing  # 1 is done, 0 is not
    assert work.take(now=0.5, window=2) is None
    retried = work.take(now=1.0, window=2)
    assert retried is a
    work.settle(retried, DONE, now=1.0)
    assert work.commit_offset == 2 and not work.failing


def test_a_retry_pauses_only_its_own_partition():
    failing, healthy = work_with(0, 1, partition=0), work_with(0, 1, partition=1)
    work = failing.take(now=0, window=1)
    failing.settle(work, RETRY, now=0, retry_delay=5.0)
    assert failing.should_pause(max_buffered=1000)
    assert not healthy.should_pause(max_buffered=1000)
    assert healthy.take(now=0, window=1) is not None  # the other partition keeps going
    failing.paused = True
    assert not failing.should_resume(max_buffered=1000)
    failing.settle(failing.take(now=5, window=1), DONE, now=5)
    assert failing.should_resume(max_buffered=1000)


def test_a_full_backlog_pauses_fetching_and_half_empty_resumes_it():
    work = work_with(*range(4))
    assert work.should_pause(max_buffered=4)
    work.paused = True
    for _ in range(2):
        work.settle(work.take(now=0, window=1), DONE, now=0)
    assert work.should_resume(max_buffered=4)


def test_revoke_stops_delivery_and_drops_uncommitted_work():
    work = work_with(0, 1, 2)
    first = work.take(now=0, window=2)
    second = work.take(now=0, window=2)
    work.closing = True  # revoked: take nothing new, let the calls in flight finish
    assert work.take(now=0, window=3) is None
    work.settle(first, DONE, now=0)
    work.settle(second, RETRY, now=0, retry_delay=0.1)
    assert work.take(now=10, window=3) is None  # not even the retry
    # Only the done prefix is committed; 1 and 2 belong to the next owner.
    assert work.commit_offset == 1
    # The next owner starts from the committed offset with nothing held over.
    successor = PartitionWork(work.topic, work.partition, work.tenant)
    successor.append(FakeMessage(1))
    assert successor.take(now=0, window=1).message.offset() == 1


def test_a_refetched_offset_is_held_once():
    work = work_with(0, 1)
    work.append(FakeMessage(1))  # a resume re-fetched from the consumer's position
    work.append(FakeMessage(0))
    assert [s.message.offset() for s in work.slots] == [0, 1] and work.waiting == 2


def test_states_and_outcomes_are_string_enums():
    # They appear in logs and metric labels as plain strings.
    assert SlotState.FAILED == "failed" and OutcomeKind.DEAD_LETTERED == "dead_lettered"
    assert f"{OutcomeKind.RETRY}" == "retry"


def test_held_bytes_follow_appends_and_the_committed_prefix():
    work = PartitionWork("poimen.acme.dispatch", 0, "acme")
    for offset, size in ((0, 100), (1, 200), (2, 300)):
        work.append(FakeMessage(offset, size))
    assert work.buffered_bytes == 600
    oldest = work.take(0.0, 2)
    younger = work.take(0.0, 2)
    work.settle(younger, DONE, 0.0)  # offset 1 done first: nothing leaves yet
    assert work.buffered_bytes == 600
    work.settle(oldest, DONE, 0.0)
    assert work.buffered_bytes == 300 and work.commit_offset == 2


def test_the_byte_budget_pauses_a_partition_and_half_of_it_resumes_it():
    work = work_with(0, 1)
    assert not work.should_pause(1000, over_budget=False)
    assert work.should_pause(1000, over_budget=True)
    work.paused = True
    assert not work.should_resume(1000, under_budget=False)
    assert work.should_resume(1000, under_budget=True)


def test_the_counters_the_relay_schedules_by_are_exact_through_failures():
    """``waiting`` decides whether a drain task is submitted, ``attempts`` is the
    backoff's exponent (consecutive failures), ``failed`` resets it: each exact."""
    work = work_with(0, 1, 2)
    assert (work.waiting, work.in_flight, work.failed, work.attempts) == (3, 0, 0, 0)
    a = work.take(now=0, window=2)
    b = work.take(now=0, window=2)
    assert a.state is SlotState.RUNNING and b.state is SlotState.RUNNING
    assert (work.waiting, work.in_flight) == (1, 2)

    work.settle(a, RETRY, now=0, retry_delay=1.0)
    work.settle(b, RETRY, now=0, retry_delay=1.0)
    assert (work.waiting, work.in_flight, work.failed, work.attempts) == (3, 0, 2, 2)
    retried = work.take(now=1.0, window=1)
    assert retried is a and retried.state is SlotState.RUNNING
    assert (work.waiting, work.in_flight, work.failed) == (2, 1, 1)
    work.settle(retried, RETRY, now=1.0, retry_delay=1.0)
    assert work.attempts == 3  # a third consecutive failure: the backoff grows

    for _ in range(3):
        slot = work.take(now=10.0, window=1)
        work.settle(slot, DONE, now=10.0)
    assert (work.waiting, work.in_flight, work.failed, work.attempts) == (0, 0, 0, 0)
    assert work.commit_offset == 3 and not work.failing


def test_a_failure_settled_without_a_delay_can_be_retried_at_once():
    work = work_with(0)
    slot = work.take(now=5.0, window=1)
    work.settle(slot, RETRY, now=5.0)
    assert work.take(now=5.0, window=1) is slot


# -- the revoke rule: what a relay commits as a partition leaves it ---------------------------
#
# Each row: the fate of the fetched messages at offsets 10, 11, 12 ... when the
# partition is revoked, and the offset the relay must commit (None: nothing). A
# message still in flight, failed (to be retried) or not yet taken stops the
# commit, whatever is done after it: its new owner reads it again from there, and
# admission absorbs it if the old owner's post landed after all.
REVOKE_TABLE = [
    # fates (in offset order)                            committed on revoke
    ((),                                                  None),
    (("admitted", "admitted", "admitted"),                13),
    (("admitted", "dead_lettered", "admitted"),           13),
    (("dead_lettered",),                                  11),
    (("in_flight", "admitted", "admitted"),               None),
    (("admitted", "in_flight", "admitted"),               11),
    (("admitted", "admitted", "in_flight"),               12),
    (("admitted", "failed", "admitted"),                  11),
    (("admitted", "queued", "queued"),                    11),
    (("in_flight", "dead_lettered", "failed", "admitted"), None),
    (("admitted", "dead_lettered", "in_flight", "queued"), 12),
]


def revoked(*fates: str) -> PartitionWork:
    """A partition whose messages at 10, 11, ... met ``fates``, then closed by a revoke."""
    work = work_with(*range(10, 10 + len(fates)))
    taken = [work.take(now=0, window=len(fates)) if fate != "queued" else None
             for fate in fates]
    for fate, slot in zip(fates, taken, strict=True):
        if fate == "admitted":
            work.settle(slot, DONE, now=0)
        elif fate == "dead_lettered":
            work.settle(slot, DEAD, now=0)
        elif fate == "failed":
            work.settle(slot, RETRY, now=0, retry_delay=1.0)
    work.close()
    return work


@pytest.mark.parametrize(("fates", "expected"), REVOKE_TABLE,
                         ids=["-".join(f) or "nothing" for f, _ in REVOKE_TABLE])
def test_revoke_commits_only_what_is_admitted_or_dead_lettered_in_order(fates, expected):
    work = revoked(*fates)
    assert work.revoke_offset() == expected
    assert work.take(now=10, window=8) is None  # a closed partition posts nothing more


def test_a_settle_after_the_revoke_never_moves_the_offset_past_a_gap():
    # A call that ends after its partition was revoked (the wait ran out) settles on
    # the dropped buffer: it may complete the prefix, never jump a message in flight.
    work = work_with(10, 11, 12)
    first, second, third = (work.take(now=0, window=3) for _ in range(3))
    work.settle(third, DONE, now=0)
    work.close()
    assert work.revoke_offset() is None
    work.settle(first, DONE, now=0)
    assert work.revoke_offset() == 11  # 11 is still in flight


# -- batches: several slots per call, each settled on its own ---------------------------------
#
# Each row: the outcome of each message of one batch of offsets 10, 11, ... and the
# offset then committed (None: nothing), and which offsets the next batch holds. A
# retriable item holds the partition and stops the commit, whatever came after it.
BATCH_TABLE = [
    # outcomes in offset order                      committed  next batch (after the backoff)
    (("admitted", "replayed", "admitted"),          13,        ()),
    (("admitted", "dead_lettered", "admitted"),     13,        ()),
    (("retry", "admitted", "admitted"),             None,      (10,)),
    (("admitted", "retry", "admitted"),             11,        (11,)),
    (("admitted", "admitted", "retry"),             12,        (12,)),
    (("dead_lettered", "retry", "retry"),           11,        (11, 12)),
    (("retry", "retry", "retry"),                   None,      (10, 11, 12)),
]
OUTCOMES = {"admitted": DONE, "replayed": Outcome(OutcomeKind.REPLAYED, status=200),
            "dead_lettered": DEAD, "retry": RETRY}


@pytest.mark.parametrize(("outcomes", "expected", "retried"), BATCH_TABLE,
                         ids=["-".join(o) for o, _, _ in BATCH_TABLE])
def test_a_batch_commits_only_past_items_admitted_or_dead_lettered_in_order(
        outcomes, expected, retried):
    work = work_with(*range(10, 10 + len(outcomes)))
    batch = work.take_many(now=0, window=1, limit=100)
    assert [s.message.offset() for s in batch] == list(range(10, 10 + len(outcomes)))
    assert (work.calls, work.in_flight, work.waiting) == (1, len(outcomes), 0)
    work.settle_many(zip(batch, (OUTCOMES[o] for o in outcomes), strict=True), now=0, retry_delay=2.0)
    assert work.commit_offset == expected
    assert work.calls == 0 and work.in_flight == 0
    if retried:
        assert work.failing and work.attempts == 1  # one call failed: one step of backoff
        assert work.take_many(now=1.9, window=1, limit=100) == []  # the partition waits
    again = work.take_many(now=2.0, window=1, limit=100)
    assert tuple(s.message.offset() for s in again) == retried


def test_batch_commits_past_failed_item_never():
    """The named rule of mutant ``batch_commits_past_failed_item``."""
    work = work_with(10, 11, 12)
    batch = work.take_many(now=0, window=1, limit=3)
    work.settle_many(zip(batch, (DONE, RETRY, DONE), strict=True), now=0, retry_delay=1.0)
    assert work.commit_offset == 11 and work.revoke_offset() == 11
    assert [s.state for s in work.slots] == [SlotState.FAILED, SlotState.DONE]


def test_take_many_honours_the_limit_the_bytes_and_the_window():
    work = work_with(*range(5))
    first = work.take_many(now=0, window=2, limit=2)
    assert [s.message.offset() for s in first] == [0, 1]
    second = work.take_many(now=0, window=2, limit=2)
    assert [s.message.offset() for s in second] == [2, 3]
    assert work.take_many(now=0, window=2, limit=2) == []  # two calls in flight
    work.settle_many(zip(second, (DONE, DONE), strict=True), now=0)
    assert work.commit_offset is None  # 0 and 1 are still in flight
    work.settle_many(zip(first, (DONE, DONE), strict=True), now=0)
    assert work.commit_offset == 4
    # Bytes: each message costs its bytes plus the item's overhead; at least one goes.
    big = PartitionWork("poimen.acme.dispatch", 0, "acme")
    for offset in range(3):
        big.append(FakeMessage(offset, size=600))
    assert len(big.take_many(now=0, window=3, limit=10, max_bytes=1000)) == 1
    assert len(big.take_many(now=0, window=3, limit=10, max_bytes=2000)) == 2


def test_a_batch_that_is_not_full_lingers_from_its_oldest_message():
    work = PartitionWork("poimen.acme.dispatch", 0, "acme")
    work.append(FakeMessage(0), now=10.0)
    assert work.linger_left(now=10.002, limit=100, linger=0.005) == pytest.approx(0.003)
    assert work.take_many(now=10.002, window=1, limit=100, linger=0.005) == []
    work.append(FakeMessage(1), now=10.004)
    batch = work.take_many(now=10.005, window=1, limit=100, linger=0.005)
    assert [s.message.offset() for s in batch] == [0, 1]  # the lone message waited 5 ms
    # A full batch goes at once; so does a retry (its backoff was the wait); 0 is off.
    full = work_with(0, 1)
    assert full.linger_left(now=0, limit=2, linger=10) == 0
    assert len(full.take_many(now=0, window=1, limit=2, linger=10)) == 2
    failed = work_with(0)
    failed.settle(failed.take(now=0, window=1), RETRY, now=0, retry_delay=1.0)
    failed.append(FakeMessage(1), now=1.0)
    assert len(failed.take_many(now=1.0, window=1, limit=10, linger=5.0)) == 2
    assert work_with(0).linger_left(now=0, limit=10, linger=0) == 0


def test_revoke_during_a_batch_commits_exactly_the_done_prefix():
    work = work_with(10, 11, 12, 13)
    first = work.take_many(now=0, window=2, limit=2)   # 10, 11
    second = work.take_many(now=0, window=2, limit=2)  # 12, 13
    work.settle_many(zip(second, (DONE, DONE), strict=True), now=0)
    work.close()
    assert work.revoke_offset() is None  # 10 and 11 are in flight
    assert work.take_many(now=10, window=8, limit=8) == []
    work.settle_many(zip(first, (DONE, RETRY), strict=True), now=0, retry_delay=1.0)
    assert work.revoke_offset() == 11


def test_a_run_of_large_messages_never_batches_past_the_byte_budget():
    """The relay's estimate of a message's bytes rises at once to a larger message: after
    one 900 KB message it takes no more messages than 900 KB ones fit in the budget
    (a running average alone still expected ~90 KB and took ten times too many)."""
    from bridge.inbox.partitions import batch_size, expected_bytes

    budget, big = 16 * 1024 * 1024, 900 * 1024
    estimate = expected_bytes(1024.0, big)
    assert estimate == big
    assert batch_size(budget, estimate) * big <= budget
    assert batch_size(budget - 17 * big, estimate) == 1  # over budget: one at a time
    # Small messages afterwards bring it down, slowly.
    for _ in range(50):
        estimate = expected_bytes(estimate, 1024)
    assert 1024 < estimate < big / 100
    assert batch_size(budget, 1024.0) == 500
