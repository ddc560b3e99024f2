"""The worker's Redis transport: kombu's, with acknowledgements sent in batches.

kombu emulates acknowledgements on Redis: a delivered message is recorded in
the ``unacked`` hash and its index (``QoS.append``, one MULTI/EXEC round trip)
and removed from them when it is acknowledged (``QoS.ack``, a second one).
Both block the worker's event loop. Under ``bench/execution.py`` the two were
47 % of the main process's samples (py-spy, bench/RESULTS.md; after task events were
batched), while the pool processes waited for their next run.

This transport records a delivery exactly as kombu does, at once. It defers
only the removal: an acknowledgement frees the message's prefetch slot at once
(kombu's in-memory state), and its removal from Redis goes out in the
transaction of the next delivery's record, or on the event loop's next turn
once it is ``ACK_DELAY`` old, or before the channel restores its unacknowledged
messages when it closes. Nothing is delivered less than before. A worker that
dies with removals pending leaves those messages in the unacked index, and
Redis' visibility timeout delivers them once more; the claim answers that the
run finished (docs/internals/execution.md), as it does for any duplicate.

Used by the worker, beat and Flower on a ``redis://`` broker (``workers/celery.py``);
``rediss://``, sentinel and RabbitMQ keep their own transports. Only a consumer
under Celery's event loop (the prefork worker) defers; any other acks at once.
"""

from __future__ import annotations

import logging
import threading
import time

from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.json import dumps

log = logging.getLogger(__name__)

# Seconds an acknowledgement's removal may wait for a delivery to ride with.
ACK_DELAY = 0.005
# After a failed removal, the next try waits this long (Redis away: no retry per loop turn).
RETRY_DELAY = 1.0


class BatchedAckQoS(kombu_redis.QoS):
    """kombu's Redis QoS, removing acknowledged messages from Redis in batches."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pending_acks: list[str] = []
        self._due = 0.0  # monotonic time the pending removals should go out by
        self._lock = threading.Lock()  # acks may come from threads (a thread pool)

    def append(self, message, delivery_tag) -> None:
        # kombu's record of the delivery (QoS.append), with the pending removals in
        # its transaction: one round trip instead of two under load.
        delivery = message.delivery_info
        with self._lock:
            removals = list(self._pending_acks)
        with self.pipe_or_acquire() as pipe:
            pipe.zadd(self.unacked_index_key, {delivery_tag: time.time()}) \
                .hset(self.unacked_key, delivery_tag,
                      dumps([message._raw, delivery["exchange"], delivery["routing_key"]]))
            self._remove(pipe, removals)
            pipe.execute()
        self._forget(removals)
        virtual.QoS.append(self, message, delivery_tag)

    def ack(self, delivery_tag) -> None:
        if not self.channel.connection.batch_acks:
            super().ack(delivery_tag)  # no event loop to flush on: kombu's own, at once
            return
        with self._lock:
            if not self._pending_acks:
                self._due = time.monotonic() + ACK_DELAY
            self._pending_acks.append(delivery_tag)
        virtual.QoS.ack(self, delivery_tag)  # the prefetch slot is free now

    def flush_acks(self, *, when_due: bool = False) -> None:
        """Remove the acknowledged messages from Redis (``when_due``: only once they waited
        ``ACK_DELAY``)."""
        with self._lock:
            if not self._pending_acks or (when_due and time.monotonic() < self._due):
                return
            removals = list(self._pending_acks)
        with self.pipe_or_acquire() as pipe:
            self._remove(pipe, removals)
            pipe.execute()
        self._forget(removals)

    def flush_due(self) -> None:
        """On the event loop's turn: the due removals; a failure waits ``RETRY_DELAY``."""
        try:
            self.flush_acks(when_due=True)
        except Exception as err:  # noqa: BLE001 - the connection's own error handling reconnects
            with self._lock:
                self._due = time.monotonic() + RETRY_DELAY
            log.warning("could not remove %d acknowledged message(s) from Redis (%s); "
                        "retrying in %.0fs", len(self._pending_acks), type(err).__name__,
                        RETRY_DELAY)

    def restore_unacked(self, client=None):
        self._flush_before_restore()
        return super().restore_unacked(client)

    def restore_unacked_once(self, stderr=None):
        # At close. kombu skips restore_unacked when every delivery was acknowledged,
        # so the pending removals go out here: otherwise the visibility timeout would
        # deliver those messages again.
        self._flush_before_restore()
        return super().restore_unacked_once(stderr)

    def _flush_before_restore(self) -> None:
        try:
            self.flush_acks()
        except Exception as err:  # noqa: BLE001 - restoring must go on; duplicates are absorbed
            log.warning("could not remove %d acknowledged message(s) from Redis before "
                        "restoring (%s)", len(self._pending_acks), type(err).__name__)

    def _remove(self, pipe, tags: list[str]) -> None:
        for tag in tags:
            pipe.zrem(self.unacked_index_key, tag).hdel(self.unacked_key, tag)

    def _forget(self, removed: list[str]) -> None:
        if removed:
            with self._lock:
                del self._pending_acks[:len(removed)]


class Channel(kombu_redis.Channel):
    QoS = BatchedAckQoS


class Transport(kombu_redis.Transport):
    """kombu's Redis transport with :class:`BatchedAckQoS`."""

    Channel = Channel
    # Acknowledgements are deferred only where an event loop flushes them on its turns
    # (Celery's prefork worker); a worker without one (threads, gevent) acks at once.
    batch_acks = False

    def register_with_event_loop(self, connection, loop):
        super().register_with_event_loop(connection, loop)
        loop.on_tick.add(self._flush_due_acks)  # a set: a reconnect adds it once
        self.batch_acks = True

    def _flush_due_acks(self) -> None:
        for channel in tuple(self.cycle._channels):
            qos = getattr(channel, "_qos", None)
            if qos is not None:
                qos.flush_due()
