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
transaction of the next delivery's record, or once the oldest pending removal
is ``ack_pending_max_age`` seconds old (a timer on the event loop wakes it for
that), or at once when ``ack_pending_max`` removals are pending (the ack that
reaches the bound sends them all, before the loop takes another message), or
before the channel restores its unacknowledged messages when it closes.
Nothing is delivered less than before. A worker that dies with removals
pending leaves those messages (at most ``ack_pending_max``, none older than
``ack_pending_max_age``) in the unacked index, and Redis' visibility timeout
delivers them once more; the claim answers that the run finished
(docs/internals/execution.md), as it does for any duplicate. Both bounds are
transport options (``POIMEN_ACK_PENDING_MAX``, ``POIMEN_ACK_PENDING_MAX_AGE``,
``celeryconfig.py``); ``poimen_ack_removals_total{how}`` counts the removals
by what sent them and ``poimen_ack_removals_pending`` shows those waiting
(``workers/metrics.py``).

A delivery also fetches more at once. When kombu's BRPOP has delivered a message and the
channel's prefetch leaves room for more, one Lua script (``FETCH``) pops up to that many
more from the same queues and records each in the unacked hash and its index, in one
atomic step (no message is ever popped and not recorded, unlike BRPOP and its record,
which are two round trips apart), and sends the pending removals with them. Those
deliveries then skip their own record. Under load the worker's event loop so makes one
round trip for a handful of messages, where kombu makes two for each; the loop's Redis
round trips were the largest part of the batch worker's main thread (profiles in
bench/RESULTS.md). A message the script cannot read (not JSON, no delivery tag) is pushed
back where it was, for kombu's own path to handle. ``fetch_max`` (``POIMEN_DELIVERY_FETCH_MAX``,
0: off) bounds a fetch; the prefetch always does.

Used by the worker, beat and Flower on a ``redis://`` broker (``workers/celery.py``);
``rediss://``, sentinel and RabbitMQ keep their own transports. Only a consumer
under Celery's event loop (the prefork worker) defers; any other acks at once.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any, cast

from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps, loads

# kombu's QoS and Transport methods are untyped; the config's untyped_calls_exclude does not
# reach a call through super(), so those calls carry `type: ignore[no-untyped-call]  # kombu`.

log = logging.getLogger(__name__)

# The bounds on pending removals, unless the transport options say otherwise
# (celeryconfig.py: POIMEN_ACK_PENDING_MAX, POIMEN_ACK_PENDING_MAX_AGE).
ACK_PENDING_MAX = 64
ACK_PENDING_MAX_AGE = 0.005  # seconds an acknowledgement's removal may wait for a delivery
# At most this many messages fetched at once after a BRPOP (the prefetch bounds it too).
FETCH_MAX = 64
# After a failed removal, the next try waits this long (Redis away: no retry per loop turn).
RETRY_DELAY = 1.0

# Every live QoS of this process: what ``pending_removals`` sums for the gauge.
_live: weakref.WeakSet[BatchedAckQoS] = weakref.WeakSet()


def pending_removals() -> int:
    """Acknowledged messages of this process whose removal from Redis is pending."""
    return sum(len(qos._pending_acks) for qos in list(_live))


def _count(how: str, n: int) -> None:
    from app.metrics import ACK_REMOVALS, labelled

    labelled(ACK_REMOVALS, how).inc(n)


class BatchedAckQoS(kombu_redis.QoS):
    """kombu's Redis QoS, removing acknowledged messages from Redis in batches."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]  # kombu
        self._pending_acks: list[str] = []
        self._due = 0.0  # monotonic time the pending removals should go out by
        self._lock = threading.Lock()  # acks may come from threads (a thread pool)
        self._retry_at = 0.0  # after a failed removal, no count-bound try before this
        self._recorded: set[str] = set()  # fetched by Channel.fetch_more: recorded already
        _live.add(self)

    @property
    def max_pending(self) -> int:
        return max(1, int(self.channel.ack_pending_max))

    @property
    def max_age(self) -> float:
        return max(0.0, float(self.channel.ack_pending_max_age))

    def append(self, message: Any, delivery_tag: str) -> None:
        # kombu's record of the delivery (QoS.append), with the pending removals in
        # its transaction: one round trip instead of two under load.
        if delivery_tag in self._recorded:
            # Fetched by Channel.fetch_more, whose script recorded it as it popped it.
            self._recorded.discard(delivery_tag)
            virtual.QoS.append(self, message, delivery_tag)
            return
        delivery = message.delivery_info
        with self._lock:
            removals = list(self._pending_acks)
        with self.pipe_or_acquire() as pipe:
            pipe.zadd(self.unacked_index_key, {delivery_tag: time.time()}) \
                .hset(self.unacked_key, delivery_tag,
                      dumps([message._raw, delivery["exchange"], delivery["routing_key"]]))
            self._remove(pipe, removals)
            pipe.execute()
        self._forget(removals, "delivery")
        virtual.QoS.append(self, message, delivery_tag)

    def ack(self, delivery_tag: str) -> None:
        if not self.channel.connection.batch_acks:
            # No event loop to flush on: kombu's own, at once.
            super().ack(delivery_tag)  # type: ignore[no-untyped-call]  # kombu
            return
        with self._lock:
            first = not self._pending_acks
            if first:
                self._due = time.monotonic() + self.max_age
            self._pending_acks.append(delivery_tag)
            full = len(self._pending_acks) >= self.max_pending
        virtual.QoS.ack(self, delivery_tag)  # the prefetch slot is free now
        if full and time.monotonic() >= self._retry_at:
            # The bound by count: out now, before the event loop takes another message
            # (unless the last try failed: Redis gets RETRY_DELAY before the next one).
            self._flush_or_retry("count")
        elif first:
            # The bound by age, even if no delivery and no other loop turn comes.
            self.channel.connection.wake_after(self.max_age)

    def flush_acks(self, *, when_due: bool = False, how: str = "age") -> None:
        """Remove the acknowledged messages from Redis (``when_due``: only once the oldest
        waited ``ack_pending_max_age``)."""
        with self._lock:
            if not self._pending_acks or (when_due and time.monotonic() < self._due):
                return
            removals = list(self._pending_acks)
        with self.pipe_or_acquire() as pipe:
            self._remove(pipe, removals)
            pipe.execute()
        self._forget(removals, how)

    def flush_due(self) -> float | None:
        """On the event loop's turn: the due removals; a failure waits ``RETRY_DELAY``.
        Returns the seconds until the pending removals are due, None if none are pending."""
        self._flush_or_retry("age", when_due=True)
        with self._lock:
            if not self._pending_acks:
                return None
            return max(0.0, self._due - time.monotonic())

    def _flush_or_retry(self, how: str, *, when_due: bool = False) -> None:
        try:
            self.flush_acks(when_due=when_due, how=how)
        except Exception as err:  # noqa: BLE001 - the connection's own error handling reconnects
            with self._lock:
                self._due = self._retry_at = time.monotonic() + RETRY_DELAY
            log.warning("could not remove %d acknowledged message(s) from Redis (%s); "
                        "retrying in %.0fs", len(self._pending_acks), type(err).__name__,
                        RETRY_DELAY)
            self.channel.connection.wake_after(RETRY_DELAY)

    def restore_unacked(self, client: Any = None) -> Any:
        self._flush_before_restore()
        return super().restore_unacked(client)  # type: ignore[no-untyped-call]  # kombu

    def restore_unacked_once(self, stderr: Any = None) -> Any:
        # At close. kombu skips restore_unacked when every delivery was acknowledged,
        # so the pending removals go out here: otherwise the visibility timeout would
        # deliver those messages again.
        self._flush_before_restore()
        return super().restore_unacked_once(stderr)  # type: ignore[no-untyped-call]  # kombu

    def _flush_before_restore(self) -> None:
        try:
            self.flush_acks(how="close")
        except Exception as err:  # noqa: BLE001 - restoring must go on; duplicates are absorbed
            log.warning("could not remove %d acknowledged message(s) from Redis before "
                        "restoring (%s)", len(self._pending_acks), type(err).__name__)

    def _remove(self, pipe: Any, tags: list[str]) -> None:
        for tag in tags:
            pipe.zrem(self.unacked_index_key, tag).hdel(self.unacked_key, tag)

    def _forget(self, removed: list[str], how: str) -> None:
        if removed:
            with self._lock:
                del self._pending_acks[:len(removed)]
            _count(how, len(removed))


# KEYS: the unacked index, the unacked hash, then the queues' keys in BRPOP's order.
# ARGV: how many to pop, the time to record, how many removals, the removals' tags.
# Pops one message at a time from the first non-empty queue key, as BRPOP would, and
# records it (kombu's QoS.append: the index by time, the hash [message, exchange,
# routing key]) before the next; what it cannot read goes back where it was, and ends
# the fetch. Returns [key, message, key, message, ...].
FETCH = """
local removals = tonumber(ARGV[3])
for i = 1, removals do
  redis.call('ZREM', KEYS[1], ARGV[3 + i])
  redis.call('HDEL', KEYS[2], ARGV[3 + i])
end
local want, out = tonumber(ARGV[1]), {}
while #out < 2 * want do
  local key, m = nil, nil
  for k = 3, #KEYS do
    m = redis.call('RPOP', KEYS[k])
    if m then key = KEYS[k]; break end
  end
  if not m then break end
  local ok, message = pcall(cjson.decode, m)
  local props = ok and type(message) == 'table' and message['properties']
  local tag = type(props) == 'table' and props['delivery_tag']
  local info = type(props) == 'table' and props['delivery_info']
  if type(tag) ~= 'string' or type(info) ~= 'table' then
    redis.call('RPUSH', key, m)
    break
  end
  redis.call('ZADD', KEYS[1], ARGV[2], tag)
  redis.call('HSET', KEYS[2], tag, '[' .. m .. ',' .. cjson.encode(info['exchange']) .. ','
             .. cjson.encode(info['routing_key']) .. ']')
  out[#out + 1] = key
  out[#out + 1] = m
end
return out
"""


class Channel(kombu_redis.Channel):
    QoS = BatchedAckQoS
    ack_pending_max = ACK_PENDING_MAX
    ack_pending_max_age = ACK_PENDING_MAX_AGE
    fetch_max = FETCH_MAX
    _fetch: Any = None  # FETCH, registered with redis-py on first use
    from_transport_options = (  # type: ignore[assignment]  # kombu types its length
        *kombu_redis.Channel.from_transport_options, "ack_pending_max", "ack_pending_max_age",
        "fetch_max")

    def _brpop_read(self, **options: Any) -> Any:
        delivered = super()._brpop_read(**options)  # type: ignore[no-untyped-call]  # kombu
        if delivered:
            self.fetch_more()
        return delivered

    def room(self) -> int:
        """How many more messages the prefetch lets this channel take now, at most
        ``fetch_max``."""
        limit = max(0, int(self.fetch_max))
        qos = self.qos
        if qos.prefetch_count:
            limit = min(limit, qos.prefetch_count - (len(qos._delivered) - len(qos._dirty)))
        return max(0, limit)

    def fetch_more(self) -> int:
        """Fetch and deliver up to ``room()`` more messages, recorded as unacked in the
        same atomic step as their pop (``FETCH``). Returns how many were delivered."""
        want = self.room()
        if want <= 0 or self.global_keyprefix or not self.active_queues:
            return 0
        qos = cast(BatchedAckQoS, self.qos)
        queues = self._queue_cycle.consume(len(self.active_queues))
        keys = [self._q_for_pri(queue, pri)  # type: ignore[no-untyped-call]  # kombu
                for pri in self.priority_steps for queue in queues]
        with qos._lock:
            removals = list(qos._pending_acks)
        with self.conn_or_acquire() as client:
            script = self._fetch_script(client)
            popped = script(keys=[qos.unacked_index_key, qos.unacked_key, *keys],
                            args=[want, f"{time.time():.6f}", len(removals), *removals],
                            client=client)
        qos._forget(removals, "delivery")
        fetched = [(bytes_to_str(popped[i]).rsplit(self.sep, 1)[0], loads(bytes_to_str(popped[i + 1])))
                   for i in range(0, len(popped), 2)]
        for at, (queue, payload) in enumerate(fetched):
            tag = payload["properties"]["delivery_tag"]
            qos._recorded.add(tag)
            try:
                self._queue_cycle.rotate(queue)
                self.connection._deliver(payload, queue)
            except BaseException:
                # Not delivered (nor the ones after it): back in their queue now, rather
                # than after the visibility timeout.
                for _, rest in fetched[at:]:
                    left = rest["properties"]["delivery_tag"]
                    qos._recorded.discard(left)
                    if left not in qos._delivered:
                        qos.restore_by_tag(left)  # type: ignore[no-untyped-call]  # kombu
                raise
        return len(fetched)

    def _fetch_script(self, client: Any) -> Any:
        if self._fetch is None:
            self._fetch = client.register_script(FETCH)
        return self._fetch


class Transport(kombu_redis.Transport):
    """kombu's Redis transport with :class:`BatchedAckQoS`."""

    Channel = Channel
    # Acknowledgements are deferred only where an event loop flushes them on its turns
    # (Celery's prefork worker); a worker without one (threads, gevent) acks at once.
    batch_acks = False
    _loop: Any = None  # kombu's event loop (Hub), once registered
    _wake_at: float | None = None  # monotonic time of the timer armed on the loop, if any

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        super().register_with_event_loop(connection, loop)  # type: ignore[no-untyped-call]  # kombu
        loop.on_tick.add(self._flush_due_acks)  # a set: a reconnect adds it once
        self._loop = loop
        self.batch_acks = True

    def wake_after(self, seconds: float) -> None:
        """Turn the event loop in ``seconds`` to send the removals then due (one timer
        armed at a time: an earlier one already armed serves)."""
        if self._loop is None:
            return
        at = time.monotonic() + seconds
        if self._wake_at is not None and self._wake_at <= at:
            return
        self._wake_at = at
        self._loop.call_later(seconds, self._on_timer, at)

    def _on_timer(self, at: float) -> None:
        if self._wake_at == at:
            self._wake_at = None
        self._flush_due_acks()

    def _flush_due_acks(self) -> None:
        # The Redis transport's cycle is its poller (kombu types the base class's).
        poller = cast(kombu_redis.MultiChannelPoller, self.cycle)
        for channel in tuple(poller._channels):
            qos = getattr(channel, "_qos", None)
            if qos is not None:
                left = qos.flush_due()
                if left is not None:
                    self.wake_after(max(left, 0.001))
