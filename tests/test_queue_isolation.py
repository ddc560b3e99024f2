"""Each committing test starts on empty queues of its session (``clean_tables``)."""

from __future__ import annotations

from tests.conftest import empty_queues


def test_a_sessions_queues_are_emptied_and_no_other_sessions(redis_client, queue_name):
    ours = [queue_name, f"{queue_name}\x06\x166", f"{queue_name}.routed"]
    theirs = "poimen-test-another"
    for key in [*ours, theirs]:
        redis_client.lpush(key, b"a message of an earlier test")
    try:
        empty_queues(queue_name)
        assert [redis_client.llen(key) for key in ours] == [0, 0, 0]
        assert redis_client.llen(theirs) == 1
    finally:
        redis_client.delete(*ours, theirs)
