"""The worker's Redis transport acknowledges in batches and delivers nothing less (workers/broker.py).

Against the real Redis: kombu's own connection, channel and consumer with the
transport the worker uses, and a real worker for the round trips it saves.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid

import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue

from tests.processes import start_worker, wait_until
from tests.workers.test_celery_native import wait_ready
from tests.workers.test_task_events import redis_calls, succeeded
from workers.broker import ACK_PENDING_MAX_AGE, pending_removals


@pytest.fixture
def broker(base_env, redis_client):
    """A kombu connection on the worker's transport, a queue of its own, deliveries in a list."""
    name = f"poimen-test-broker-{uuid.uuid4().hex[:8]}"
    queue = Queue(name, Exchange(name, type="direct"), routing_key=name)
    conn = Connection(base_env["REDIS_URL"], transport="workers.broker:Transport")
    # What registering with Celery's event loop turns on (its turns flush the acks).
    conn.transport.batch_acks = True
    channel = conn.channel()
    channel.basic_qos(0, 1, False)  # prefetch 1: a slot is free only once its message is acked
    delivered: list = []
    recorded: list[bool] = []  # each delivery: in the unacked hash when its callback ran
    fail_on: set[int] = set()  # bodies' "n" whose callback raises (a delivery that fails)

    def received(body, message):
        recorded.append(bool(redis_client.hexists(channel.unacked_key, message.delivery_tag)))
        if body.get("n") in fail_on:
            raise RuntimeError(f"delivery of {body['n']} failed")
        delivered.append(message)

    consumer = Consumer(channel, [queue], callbacks=[received], accept=["json"])
    consumer.declare()

    class Broker:
        taken = 0  # deliveries deliver() has returned
        messages = delivered
        recorded_first = recorded
        failing = fail_on
        queue_name = name

        def read_once(self) -> int:
            """One turn of the event loop's reading: how many messages it delivered."""
            before = len(delivered)
            try:
                conn.drain_events(timeout=2)
            except TimeoutError:
                pass
            return len(delivered) - before

        def publish(self, n: int) -> None:
            producer = Producer(channel, exchange=queue.exchange, routing_key=name)
            for i in range(n):
                producer.publish({"n": i}, serializer="json")

        def deliver(self):
            """The next delivery (one drain of events may bring several: Channel.fetch_more)."""
            deadline = time.monotonic() + 5
            while len(delivered) == self.taken:
                assert time.monotonic() < deadline, "nothing was delivered"
                try:
                    conn.drain_events(timeout=0.5)
                except TimeoutError:
                    pass
            self.taken += 1
            return delivered[self.taken - 1]

        def unacked(self) -> set[str]:
            """This queue's deliveries in kombu's unacked hash (shared by every consumer)."""
            return {tag.decode() for tag, raw in redis_client.hgetall(channel.unacked_key).items()
                    if json.loads(raw)[2] == name}

        def queued(self) -> int:
            return redis_client.llen(name)

    consumer.consume()
    try:
        yield Broker(), channel, conn
    finally:
        try:
            conn.release()
        finally:
            redis_client.delete(name)


def test_an_ack_frees_its_slot_at_once_and_leaves_redis_with_the_next_deliverys_record(broker):
    b, channel, _ = broker
    b.publish(2)
    first = b.deliver()
    assert first.delivery_tag in b.unacked()  # recorded at delivery, as kombu does
    assert not channel.qos.can_consume()      # prefetch 1, taken

    first.ack()
    assert channel.qos.can_consume(), "an ack frees the prefetch slot at once"
    assert first.delivery_tag in b.unacked(), "its removal waits for a batch"

    second = b.deliver()
    assert b.unacked() >= {second.delivery_tag}
    assert first.delivery_tag not in b.unacked(), "the removal rode with the next record"


def test_a_removal_goes_out_on_a_loop_turn_once_it_is_due(broker):
    b, channel, _ = broker
    b.publish(1)
    message = b.deliver()
    message.ack()
    channel.qos.flush_due()
    assert message.delivery_tag in b.unacked(), "not due yet"
    time.sleep(ACK_PENDING_MAX_AGE * 2)
    channel.qos.flush_due()
    assert message.delivery_tag not in b.unacked()


def test_pending_removals_go_out_when_the_channel_closes_and_nothing_acked_is_restored(broker):
    b, channel, conn = broker
    b.publish(2)
    acked = b.deliver()
    acked.ack()
    assert acked.delivery_tag in b.unacked()
    conn.release()  # the worker's shutdown: kombu restores what is unacknowledged
    assert acked.delivery_tag not in b.unacked()
    assert b.queued() == 1, "only the message never delivered is in the queue"


def test_an_unacked_delivery_is_restored_at_close_as_kombu_does(broker):
    b, channel, conn = broker
    b.publish(1)
    b.deliver()  # never acknowledged: a run the worker was still holding
    conn.release()
    assert b.queued() == 1 and not b.unacked()


def test_without_an_event_loop_an_ack_leaves_redis_at_once(broker):
    b, channel, conn = broker
    conn.transport.batch_acks = False  # no loop registered: nothing would flush a batch
    b.publish(1)
    message = b.deliver()
    message.ack()
    assert message.delivery_tag not in b.unacked()


# alone: it counts the Redis server's EXEC calls, which every worker on the server adds to.
@pytest.mark.alone
def test_a_workers_burst_costs_one_transaction_per_run_and_leaves_nothing_unacked(
        admit, sent, fast_env, pg, tmp_path, processes, redis_client):
    worker = start_worker(fast_env, tmp_path, "acks", concurrency=2)
    processes.append(worker)
    wait_ready(worker)
    before = redis_calls(redis_client, "exec")
    runs = [admit("echo", {"n": n}) for n in range(60)]
    sent()
    wait_until(lambda: succeeded(pg, runs) == len(runs), timeout=90, what="the burst to succeed")
    ids = {str(r) for r in runs}

    def still_unacked() -> set[str]:
        return {(json.loads(raw)[0].get("headers") or {}).get("id")
                for raw in redis_client.hvals("unacked")} & ids

    wait_until(lambda: not still_unacked(), timeout=5, what="every run's message acknowledged")
    # kombu alone: a MULTI/EXEC to record each delivery and one to remove it (120 here).
    transactions = redis_calls(redis_client, "exec") - before
    assert transactions <= len(runs) * 1.3, f"{transactions} transactions for {len(runs)} runs"


def test_the_ack_that_reaches_the_bound_by_count_sends_every_pending_removal(broker):
    b, channel, conn = broker
    channel.ack_pending_max, channel.ack_pending_max_age = 3, 3600.0  # only the count bounds
    channel.basic_qos(0, 5, False)
    b.publish(5)
    messages = [b.deliver() for _ in range(5)]
    for message in messages[:2]:
        message.ack()
    assert {m.delivery_tag for m in messages[:2]} <= b.unacked(), "below the bound: pending"
    assert pending_removals() >= 2
    messages[2].ack()  # the third: the bound
    assert not {m.delivery_tag for m in messages[:3]} & b.unacked(), "all three went out"
    messages[3].ack()
    assert b.unacked() == {messages[3].delivery_tag, messages[4].delivery_tag}


def scrape(port: int, name: str, **labels: str) -> float:
    from tests.processes import metric

    return metric(f"http://127.0.0.1:{port}/metrics", name, **labels)


def finished_in_unacked(redis_client, runs) -> set[str]:
    """The runs whose message is still in kombu's unacked hash (all of them finished)."""
    ids = {str(r) for r in runs}
    return {(json.loads(raw)[0].get("headers") or {}).get("id")
            for raw in redis_client.hvals("unacked")} & ids


def test_the_bound_by_count_holds_under_a_stream_and_a_kill_9_leaves_no_more(
        admit, sent, fast_env, pg, tmp_path, processes, redis_client, side_effects):
    """Runs finishing together with nothing left to deliver leave their removals pending
    (the age bound is an hour here); the ack reaching POIMEN_ACK_PENDING_MAX sends them.
    A kill -9 of the worker's main process then leaves at most the bound's worth."""
    from tests.processes import free_port

    bound = 3
    port = free_port()
    env = {**fast_env, "POIMEN_ACK_PENDING_MAX": str(bound),
           "POIMEN_ACK_PENDING_MAX_AGE": "3600", "METRICS_PORT": str(port)}
    worker = start_worker(env, tmp_path, "ack-bound", concurrency=4)
    processes.append(worker)
    wait_ready(worker)
    runs = [admit("effect", {"seconds": 0.5}) for _ in range(8)]  # two waves of four
    sent()
    pending: list[float] = []

    def done() -> bool:
        pending.append(scrape(port, "poimen_ack_removals_pending"))
        return succeeded(pg, runs) == len(runs)

    wait_until(done, timeout=90, what="the stream to succeed")
    wait_until(lambda: scrape(port, "poimen_ack_removals_total", how="count") >= bound,
               timeout=10, what="the count bound to send a batch")
    # The ack that makes ``bound`` pending sends them; a scrape during that round trip
    # may read ``bound`` itself, never more.
    assert max(pending) <= bound, pending
    left = finished_in_unacked(redis_client, runs)
    assert 0 < len(left) < bound, left
    assert scrape(port, "poimen_ack_removals_pending") == len(left)
    assert scrape(port, "poimen_ack_removals_total", how="delivery") >= 1

    os.kill(worker.pid, signal.SIGKILL)  # the main process only: a crash in the window
    worker.proc.wait(10)
    assert len(finished_in_unacked(redis_client, runs)) <= bound
    # The test's own leftovers: not for a later test's worker to be delivered.
    ids = {str(r) for r in runs}
    for tag, raw in redis_client.hgetall("unacked").items():
        if (json.loads(raw)[0].get("headers") or {}).get("id") in ids:
            redis_client.hdel("unacked", tag)
            redis_client.zrem("unacked_index", tag)


def test_the_bound_by_age_holds_when_no_delivery_comes(admit, sent, fast_env, pg, tmp_path,
                                                       processes, redis_client):
    """One run, nothing after it: its removal waits POIMEN_ACK_PENDING_MAX_AGE (2 s here),
    then goes out without a delivery to ride with (a timer turns the event loop)."""
    from tests.processes import free_port

    port = free_port()
    env = {**fast_env, "POIMEN_ACK_PENDING_MAX_AGE": "2", "METRICS_PORT": str(port)}
    worker = start_worker(env, tmp_path, "ack-age")
    processes.append(worker)
    wait_ready(worker)
    run = admit("echo", {"n": 1})
    sent()
    wait_until(lambda: succeeded(pg, [run]) == 1, timeout=60, what="the run to succeed")
    wait_until(lambda: scrape(port, "poimen_ack_removals_pending") == 1, timeout=5,
               what="the removal pending")
    acked_at = time.monotonic()
    assert finished_in_unacked(redis_client, [run]) == {str(run)}
    wait_until(lambda: not finished_in_unacked(redis_client, [run]), timeout=5,
               what="the removal to go out once due")
    waited = time.monotonic() - acked_at
    assert 1.0 < waited < 3.5, waited
    assert scrape(port, "poimen_ack_removals_total", how="age") == 1
    assert scrape(port, "poimen_ack_removals_pending") == 0


# -- one fetch for several messages after a BRPOP (Channel.fetch_more) ----------------------------


def test_one_fetch_takes_what_the_prefetch_has_room_for_each_recorded_before_its_delivery(broker):
    b, channel, _ = broker
    channel.basic_qos(0, 5, False)
    b.publish(8)
    assert b.read_once() == 5, "one BRPOP, then one fetch of the four the prefetch allows"
    assert all(b.recorded_first), "every message recorded as unacked before its callback"
    assert [m.payload["n"] for m in b.messages] == [0, 1, 2, 3, 4], "in the queue's order"
    assert b.unacked() == {m.delivery_tag for m in b.messages}
    assert b.queued() == 3 and not channel.qos.can_consume()
    for message in b.messages:
        message.ack()
    assert b.read_once() == 3 and all(b.recorded_first)
    assert b.unacked() == {m.delivery_tag for m in b.messages[5:]}, \
        "the acknowledged ones' removals went out with the fetch"


def test_with_fetch_max_0_a_brpop_delivers_one_message_as_kombu_does(broker):
    b, channel, _ = broker
    channel.basic_qos(0, 5, False)
    channel.fetch_max = 0
    b.publish(3)
    assert b.read_once() == 1
    assert b.queued() == 2


@pytest.mark.parametrize("hostile", [b"\xff\xfe not json", b'{"properties": {"x": 1}}',
                                     b"[" * 5000 + b"]" * 5000, b'"a string"'],
                         ids=["bytes", "no-delivery-tag", "nested-5000", "not-an-object"])
def test_a_message_the_fetch_cannot_read_goes_back_where_it_was_for_kombu(
        broker, redis_client, hostile):
    b, channel, _ = broker
    channel.basic_qos(0, 5, False)
    b.publish(1)
    redis_client.lpush(b.queue_name, hostile)  # behind the first message, in front of the next
    b.publish(1)
    assert b.read_once() == 1, "the fetch stops at what it cannot read"
    assert b.queued() == 2
    assert redis_client.lindex(b.queue_name, -1) == hostile, "next in line, unchanged"
    assert b.unacked() == {b.messages[0].delivery_tag}, "nothing recorded for it"
    redis_client.rpop(b.queue_name)  # kombu's own path would meet it next; not this test's


def test_a_delivery_that_fails_in_a_fetch_sends_the_rest_back_and_loses_nothing(broker):
    b, channel, conn = broker
    channel.basic_qos(0, 5, False)
    b.failing.add(2)
    b.publish(5)
    with pytest.raises(RuntimeError, match="delivery of 2 failed"):
        conn.drain_events(timeout=2)
    assert [m.payload["n"] for m in b.messages] == [0, 1]
    # 2 was delivered (its callback failed, as on kombu's own path): unacked until the close
    # restores it; 3 and 4 never were: back in the queue at once.
    assert len(b.unacked()) == 3 and b.queued() == 2
    conn.release()
    assert b.queued() == 5 and not b.unacked(), "every message is in the queue again"


CONSUMER_KILLED_MID_FETCH = """
import os, signal, sys
from kombu import Connection, Consumer, Exchange, Queue

url, name = sys.argv[1], sys.argv[2]
queue = Queue(name, Exchange(name, type="direct"), routing_key=name)
with Connection(url, transport="workers.broker:Transport") as conn:
    channel = conn.channel()
    channel.basic_qos(0, 5, False)
    seen = []

    def received(body, message):
        seen.append(body["n"])
        if len(seen) == 3:  # mid-fetch: two of its messages delivered, two not yet
            os.kill(os.getpid(), signal.SIGKILL)

    Consumer(channel, [queue], callbacks=[received], accept=["json"]).consume()
    while True:
        conn.drain_events(timeout=10)
"""


@pytest.mark.processes
def test_a_consumer_killed_in_the_middle_of_a_fetch_leaves_every_message_queued_or_unacked(
        base_env, redis_client, tmp_path):
    """A real process, SIGKILLed while delivering the messages of one fetch: each message is
    still in the queue or in the unacked hash (which the visibility timeout restores)."""
    import subprocess
    import sys

    name = f"poimen-test-kill-{uuid.uuid4().hex[:8]}"
    queue = Queue(name, Exchange(name, type="direct"), routing_key=name)
    with Connection(base_env["REDIS_URL"]) as conn:
        producer = Producer(conn.channel(), exchange=queue.exchange, routing_key=name)
        queue(producer.channel).declare()
        for n in range(8):
            producer.publish({"n": n}, serializer="json")
    script = tmp_path / "consumer.py"
    script.write_text(CONSUMER_KILLED_MID_FETCH)
    try:
        proc = subprocess.run([sys.executable, str(script), base_env["REDIS_URL"], name],
                              cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": os.getcwd()},
                              capture_output=True, timeout=60)
        assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
        unacked = [json.loads(raw) for raw in redis_client.hvals("unacked")]
        mine = sorted(m[0]["body"] for m in unacked if m[2] == name)
        assert len(mine) == 5, "the BRPOP's message and the four fetched with it, recorded"
        assert redis_client.llen(name) == 3, "the rest never left the queue"
    finally:
        for tag, raw in redis_client.hgetall("unacked").items():
            if json.loads(raw)[2] == name:
                redis_client.hdel("unacked", tag)
                redis_client.zrem("unacked_index", tag)
        redis_client.delete(name)
