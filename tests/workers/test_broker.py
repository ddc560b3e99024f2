"""The worker's Redis transport acknowledges in batches and delivers nothing less (workers/broker.py).

Against the real Redis: kombu's own connection, channel and consumer with the
transport the worker uses, and a real worker for the round trips it saves.
"""

from __future__ import annotations

import json
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
    consumer = Consumer(channel, [queue], callbacks=[lambda body, message: delivered.append(message)],
                        accept=["json"])
    consumer.declare()

    class Broker:
        def publish(self, n: int) -> None:
            producer = Producer(channel, exchange=queue.exchange, routing_key=name)
            for i in range(n):
                producer.publish({"n": i}, serializer="json")

        def deliver(self):
            before = len(delivered)
            deadline = time.monotonic() + 5
            while len(delivered) == before:
                assert time.monotonic() < deadline, "nothing was delivered"
                try:
                    conn.drain_events(timeout=0.5)
                except TimeoutError:
                    pass
            return delivered[-1]

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
