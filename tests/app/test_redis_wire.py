"""The sender's wire messages are the messages Celery's ``send_task`` writes (app/enqueue.py).

``RedisWire`` writes a ``runs.execute`` message to Redis without ``send_task``; a worker,
Flower and ``celery inspect`` must not be able to tell. Each case publishes one run both
ways on the real Redis and compares what landed in the list, field by field (only the
``delivery_tag``, a fresh id per message, differs); the cases ``send_task`` must keep
(a priority, a publish-signal receiver) are refused by the wire and still land where
kombu puts them.
"""

from __future__ import annotations

import json
import select
import uuid

import pytest
from celery import signals
from redis.exceptions import ResponseError

from app.enqueue import TOP, RedisWire, Tree, _publish, _Template, sender
from app.tracecontext import TraceContext

TRACE = TraceContext("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "vendor=1")


@pytest.fixture
def celery_app(app):
    return app.extensions["celery"]


@pytest.fixture
def celery_tasks(app):
    """The test workflows that declare a queue, a priority and time limits."""
    import tests.workflows.celery_tasks as module

    return module


def _take(redis_client, key: str, run_id: uuid.UUID) -> dict:
    """The message of ``run_id`` in ``key``, removed; other tests' messages stay where they are."""
    for raw in redis_client.lrange(key, 0, -1):
        message = json.loads(raw)
        if message["headers"]["id"] == str(run_id):
            redis_client.lrem(key, 1, raw)
            message["properties"].pop("delivery_tag")
            return message
    raise AssertionError(f"no message of {run_id} in {key}")


def _both_ways(app, celery_app, redis_client, workflow_ref, trace=None, tree=TOP):
    run_id = uuid.uuid4()
    with app.app_context(), celery_app.producer_or_acquire() as producer:
        _publish(celery_app, run_id, workflow_ref, None, producer, trace, tree=tree)
        wire = RedisWire(celery_app, producer.channel)
        assert RedisWire.usable(celery_app, producer.channel)
        # The wire's first message of a workflow makes its template; the one compared is
        # written from it, as every later message of the workflow is.
        assert wire.message(uuid.uuid4(), workflow_ref, trace) is not None
        written = wire.message(run_id, workflow_ref, trace, tree)
        names = tuple(trace.headers()) if trace is not None else ()
        assert isinstance(wire._templates[(workflow_ref, names)], _Template)
    assert written is not None
    key, payload = written
    celery_message = _take(redis_client, key, run_id)
    redis_client.lpush(key, payload)
    return celery_message, _take(redis_client, key, run_id)


PARENT, ROOT = str(uuid.uuid4()), str(uuid.uuid4())


@pytest.mark.parametrize("workflow_ref, trace, tree", [
    ("echo", None, TOP),           # the default queue
    ("echo", TRACE, TOP),          # a run admitted with W3C Trace Context
    ("echo", TraceContext(TRACE.traceparent, None), TOP),  # a traceparent alone
    ("soft-time", None, TOP),      # a workflow's time limits travel in the message
    ("echo", None, Tree(2)),       # a retry: its third execution
    ("echo", TRACE, Tree(1, PARENT, ROOT)),  # a retried fan-out child of a child
    ("echo", None, Tree(0, PARENT, PARENT)),  # a child of a top-level run
])
def test_a_wire_message_is_send_tasks_message(app, celery_app, celery_tasks, redis_client,
                                              workflow_ref, trace, tree):
    by_celery, by_wire = _both_ways(app, celery_app, redis_client, workflow_ref, trace, tree)
    assert by_wire == by_celery
    headers = by_wire["headers"]
    assert headers["retries"] == tree.retries
    assert headers["parent_id"] == tree.parent_id
    assert headers["root_id"] == (tree.root_id or headers["id"])
    assert by_wire["headers"]["task"] == "runs.execute"
    if workflow_ref == "soft-time":
        assert by_wire["headers"]["timelimit"] == [60, 2]
    if trace is not None:
        assert by_wire["headers"]["traceparent"] == trace.traceparent


def test_a_wire_message_executes_as_its_run(app, celery_app, redis_client):
    """The consumer's view: the decoded body is the task's arguments, the id the run's."""
    import base64

    run_id = uuid.uuid4()
    with app.app_context(), celery_app.producer_or_acquire() as producer:
        key, payload = RedisWire(celery_app, producer.channel).message(run_id, "echo", None)
    message = json.loads(payload)
    args, kwargs, _embed = json.loads(base64.b64decode(message["body"]))
    assert (args, kwargs) == ([str(run_id)], {})
    assert message["headers"]["id"] == message["properties"]["correlation_id"] == str(run_id)
    assert key == celery_app.conf.task_default_queue


def test_a_priority_is_left_to_send_task(app, celery_app, celery_tasks):
    with app.app_context(), celery_app.producer_or_acquire() as producer:
        wire = RedisWire(celery_app, producer.channel)
        assert wire.message(uuid.uuid4(), "routed-slow", None) is None


def test_a_publish_signal_receiver_gets_send_task(app, celery_app):
    """OpenTelemetry's Celery instrumentation hooks before_task_publish: the wire steps aside."""
    def receiver(**_):
        pass

    signals.before_task_publish.connect(receiver, weak=False)
    try:
        with app.app_context(), celery_app.producer_or_acquire() as producer:
            assert not RedisWire.usable(celery_app, producer.channel)
    finally:
        signals.before_task_publish.disconnect(receiver)


def test_the_sender_writes_wire_and_send_task_messages_in_one_batch(
        app, celery_app, celery_tasks, redis_client, queue_name):
    """A batch mixing a wire-able run with one send_task must send: both arrive."""
    from kombu.transport.redis import Channel

    plain, routed = uuid.uuid4(), uuid.uuid4()
    with app.app_context():
        out = sender(celery_app)
        out.put(plain, "echo")
        out.put(routed, "routed-slow")
        assert out.wait_idle(10)
    seen = {json.loads(m)["headers"]["id"] for m in redis_client.lrange(queue_name, 0, -1)}
    assert str(plain) in seen
    # kombu's priority list for priority 3 (Channel.sep, the default steps).
    priority_key = f"{celery_tasks.SLOW_QUEUE}{Channel.sep}3"
    routed_seen = {json.loads(m)["headers"]["id"] for m in redis_client.lrange(priority_key, 0, -1)}
    assert str(routed) in routed_seen
    redis_client.delete(priority_key)


@pytest.mark.parametrize("direct", [False, True], ids=["with-producer", "direct"])
@pytest.mark.parametrize("queues", [1, 2])
def test_a_batch_lands_in_each_queue_in_the_order_it_was_handed_over(
        app, celery_app, celery_tasks, redis_client, queue_name, queues, direct):
    """One LPUSH per queue per batch: a worker's BRPOP still takes the runs in send order."""
    runs = [(uuid.uuid4(), "echo" if queues == 1 or i % 3 else "routed-side", None)
            for i in range(12)]
    redis_client.delete(queue_name, celery_tasks.SIDE_QUEUE)
    try:
        with app.app_context():
            out = sender(celery_app)
            assert out.wait_idle(10)
            if direct:  # as the sender writes a batch once its queues are declared
                with celery_app.producer_or_acquire() as producer:
                    out._send(producer, [(uuid.uuid4(), ref, None) for _, ref, _ in runs])
                redis_client.delete(queue_name, celery_tasks.SIDE_QUEUE)
                assert out._write_direct(runs)
            else:
                with celery_app.producer_or_acquire() as producer:
                    out._send(producer, runs)  # one batch, as the sender thread takes it

        def taken(key):  # in a worker's order: BRPOP takes from the right
            order = []
            while (raw := redis_client.rpop(key)) is not None:
                order.append(json.loads(raw)["headers"]["id"])
            return order

        assert taken(queue_name) == [str(r) for r, ref, _ in runs if ref == "echo"]
        assert taken(celery_tasks.SIDE_QUEUE) == [str(r) for r, ref, _ in runs
                                                  if ref == "routed-side"]
    finally:
        redis_client.delete(celery_tasks.SIDE_QUEUE)


def test_a_batch_the_wire_cannot_write_whole_is_not_written_directly(
        app, celery_app, celery_tasks, redis_client, queue_name):
    """A run that needs send_task (a priority), or a queue not declared since the last
    error, sends the batch through a producer: the direct write writes nothing."""
    with app.app_context():
        out = sender(celery_app)
        with celery_app.producer_or_acquire() as producer:
            out._send(producer, [(uuid.uuid4(), "echo", None)])
        before = redis_client.llen(queue_name)
        assert not out._write_direct([(uuid.uuid4(), "echo", None),
                                      (uuid.uuid4(), "routed-slow", None)])
        out.declared.discard(queue_name)
        assert not out._write_direct([(uuid.uuid4(), "echo", None)])
        assert redis_client.llen(queue_name) == before


def _wire(celery_app, producer) -> RedisWire:
    wire = RedisWire(celery_app, producer.channel)
    wire.write([("PING",)])
    return wire


def test_a_write_with_an_error_reply_leaves_the_connection_in_step(app, celery_app,
                                                                   redis_client):
    """Every reply of a write is read before its first error is raised: the next write
    reads its own replies, not the rest of the last one's."""
    wrong, good = f"zz-wire-{uuid.uuid4().hex}", f"zz-wire-{uuid.uuid4().hex}"
    redis_client.set(wrong, "a string, not a list")
    try:
        with app.app_context(), celery_app.producer_or_acquire() as producer:
            wire = _wire(celery_app, producer)
            with pytest.raises(ResponseError):
                wire.write([("LPUSH", wrong, "x"), ("LPUSH", good, "y")])
            wire.write([("LPUSH", good, "z")])
            wire.write([("RPUSH", good, "last")])
        assert redis_client.lrange(good, 0, -1) == [b"z", b"y", b"last"]
    finally:
        redis_client.delete(wrong, good)


def test_a_write_on_a_connection_the_server_closed_is_made_on_a_new_one(
        app, celery_app, redis_client):
    """The wire keeps its connection between batches: one Redis closed (a restart, a
    CLIENT KILL, an idle timeout) is connected again and the write lands once."""
    key = f"zz-wire-{uuid.uuid4().hex}"
    try:
        with app.app_context(), celery_app.producer_or_acquire() as producer:
            wire = _wire(celery_app, producer)
            host, port = wire._connection._sock.getsockname()[:2]
            assert redis_client.client_kill(f"{host}:{port}")
            # Redis closes a killed client on its next turn: wait until it did.
            assert select.select([wire._connection._sock], [], [], 5)[0]
            wire.write([("LPUSH", key, "after the kill")])
        assert redis_client.lrange(key, 0, -1) == [b"after the kill"]
    finally:
        redis_client.delete(key)
