"""The relay: one consumer, a bounded pool of HTTP sessions, one dead-letter producer.

``Inbox`` owns the threads and the one lock: the consumer loop (fetch, dispatch,
commit), the drain tasks that post a partition's batches, the rebalance callbacks,
and the shutdown within the grace. What it decides per partition is
``PartitionWork``'s (``partitions.py``), per answer ``faults.py``'s, and what a dead
letter holds ``bridge.deadletter``'s.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from poimen_client import Transport, TransportError, TransportTimeout

import logconfig
from poimenconfig import MAX_BODY_BYTES, InboxSettings, inbox_settings

from ..deadletter import Record, dead_letter_record, traceback_summary
from ..kafka import DEFAULT_MAX_MESSAGE_BYTES, SIZE_ERRORS, describe, kafka_headers, place
from ..process import backoff_delay, configure_logging, serve
from ..topics import dead_letter_topic, ensure_topics
from .faults import (
    BATCH_PATH,
    TENANT_NOT_FOUND,
    Fault,
    FaultKind,
    MessageFault,
    batch_body,
    batch_fault,
    batch_item,
    message_timestamp,
    response_fault,
    run_request_body,
)
from .messages import BatchEntry, trace_headers, where
from .metrics import InboxMetrics
from .outcomes import Outcome, OutcomeKind
from .partitions import PartitionWork, Slot, batch_size, expected_bytes, message_bytes

log = logging.getLogger("poimen.inbox")

# Our own code raising on one message this many times in a row makes it a message
# fault: a bug then costs one dead-lettered message, not a stalled partition.
INTERNAL_ERROR_TRIES = 3
# Dead-letter writes refused for size are retried this many times, at half the size each.
DLQ_SIZE_TRIES = 4
# A batch's body stays under the API's limit (its 1 MiB MAX_CONTENT_LENGTH), less the
# wrapper; a message too large to share a body goes alone.
BATCH_MAX_BYTES = MAX_BODY_BYTES - 1024
# Incremental rebalances: a relay joining or leaving moves only the partitions that
# change hands, so the others keep posting (eager revokes every partition of every
# relay, and each one waits for its in-flight calls). KAFKA_PARTITION_ASSIGNMENT_STRATEGY
# overrides it; the relay works with either protocol (docs/operations/inbox.md).
DEFAULT_ASSIGNMENT_STRATEGY = "cooperative-sticky"


def _version() -> str:
    try:
        return metadata.version("poimen")
    except metadata.PackageNotFoundError:
        return "0"


USER_AGENT = f"poimen-inbox/{_version()}"


class Inbox:
    """The relay: one consumer, a bounded pool of HTTP sessions, one DLQ producer."""

    # The Kafka clients, made by ``run``.
    _consumer: Consumer
    _producer: Producer
    _admin: AdminClient

    def __init__(self, config: InboxSettings, metrics: InboxMetrics | None = None):
        self.config = config
        self.metrics = metrics or InboxMetrics()
        self._message_size = 1024.0  # bytes a message is expected to take (expected_bytes)
        # Items per POST /v1/runs/batch the API accepts, once a 413 batch_too_large said.
        self._server_batch_max = config.batch_max
        self._topic = re.compile(rf"^{re.escape(config.prefix)}\.(.+)\.dispatch$")
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._stop = threading.Event()    # stop consuming; set by SIGTERM
        self._closed = threading.Event()  # in-flight work is over: stop the helper threads
        self._deadline: float | None = None  # monotonic: when shutdown must be complete
        self._works: dict[tuple[str, int], PartitionWork] = {}
        # One keep-alive connection per delivery thread, shared thread-safely (urllib3:
        # a fraction of requests' CPU per call).
        self._api = Transport(config.api_url, config.api_token, user_agent=USER_AGENT,
                              connect_timeout=5.0, read_timeout=config.http_timeout,
                              maxsize=config.concurrency)
        self._pool = ThreadPoolExecutor(config.concurrency, thread_name_prefix="inbox-http")
        self._dlq_ready: set[str] = set()
        self._dlq_lock = threading.Lock()
        self._counts = {"admitted": 0, "replayed": 0, "dead_lettered": 0, "retries": 0}
        self._lags: dict[tuple[str, int], int] = {}
        self._incremental = False  # set from the assignment strategy in run()
        self._dlq_ack_timeout = 60.0
        self._dlq_max_bytes = DEFAULT_MAX_MESSAGE_BYTES
        self.abandoned = 0  # calls still in flight when the shutdown grace ran out

    # -- lifecycle ---------------------------------------------------------------------------

    def stop(self, *_: Any) -> None:
        """Ask the relay to finish in-flight calls, commit and leave the group, within the grace."""
        if self._deadline is None:
            self._deadline = time.monotonic() + self.config.shutdown_grace
        self._stop.set()

    @property
    def _reserve(self) -> float:
        """Seconds of the shutdown grace kept for flushing, committing and leaving the group."""
        return min(5.0, self.config.shutdown_grace / 4)

    def run(self) -> None:
        """Consume until ``stop``; then finish in-flight calls, commit and close."""
        cfg = self.config
        kafka = dict(cfg.kafka)
        strategy = str(kafka.get("partition.assignment.strategy", DEFAULT_ASSIGNMENT_STRATEGY))
        consumer_settings: dict[str, Any] = {
            # librdkafka's own prefetch queue counts against the same memory: a
            # quarter of the budget (its default is 64 MiB), unless set explicitly.
            "queued.max.messages.kbytes": max(1024, cfg.buffer_bytes // 4096),
            **kafka,
            "partition.assignment.strategy": strategy,
            "group.id": cfg.group,
            "client.id": "poimen-inbox",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            # A tenant topic created before the relay saw it must be read from
            # its first message, or the spawn requests published so far are lost.
            "auto.offset.reset": "earliest",
            "session.timeout.ms": cfg.session_timeout_ms,
            "topic.metadata.refresh.interval.ms": cfg.metadata_refresh_ms,
            "on_commit": self._on_commit,
            # librdkafka's own lines (broker down, ...) through our logging: LOG_FORMAT.
            "logger": logging.getLogger("rdkafka"),
        }
        # librdkafka refuses to mix protocols in one list: any cooperative assignor means
        # incremental assignment (and confluent-kafka unassigns the same way after on_revoke).
        self._incremental = "cooperative" in strategy
        self._consumer = Consumer(consumer_settings)
        # A dead-letter write that cannot be acknowledged within message.timeout.ms
        # fails and is retried like an API outage; the default (5 min) would hold a
        # worker through a whole broker restart.
        producer_settings: dict[str, Any] = {"message.timeout.ms": 30000, "linger.ms": 5, **kafka,
                                             "client.id": "poimen-inbox-dlq", "acks": "all",
                                             "logger": logging.getLogger("rdkafka")}
        self._producer = Producer(producer_settings)
        admin_settings: dict[str, Any] = {**kafka, "logger": logging.getLogger("rdkafka")}
        self._admin = AdminClient(admin_settings)
        self._dlq_ack_timeout = int(kafka.get("message.timeout.ms", 30000)) / 1000 + 10
        self._dlq_max_bytes = int(kafka.get("message.max.bytes", DEFAULT_MAX_MESSAGE_BYTES))
        log.info("inbox %s: group %s (%s), topics %s, API %s, %d sessions; kafka %s", USER_AGENT,
                 cfg.group, strategy,
                 cfg.subscription, cfg.api_url, cfg.concurrency, describe(kafka))
        helpers = [threading.Thread(target=self._serve_producer, name="inbox-dlq", daemon=True),
                   threading.Thread(target=self._watch_lag, name="inbox-lag", daemon=True)]
        for thread in helpers:
            thread.start()
        self._consumer.subscribe([cfg.subscription], on_assign=self._on_assign,
                                 on_revoke=self._on_revoke, on_lost=self._on_lost)
        try:
            self._consume()
        finally:
            self._shutdown(helpers)

    def _consume(self) -> None:
        last_commit = last_progress = time.monotonic()
        while not self._stop.is_set():
            messages = self._consumer.consume(num_messages=self._batch_size(),
                                              timeout=self._poll_timeout())
            with self._changed:
                now = time.monotonic()
                if messages:
                    self._changed.notify_all()  # a lingering batch may be full now
                for msg in messages:
                    error = msg.error()
                    if error is not None:
                        self._log_consumer_error(error)
                        continue
                    topic, partition, _ = place(msg)
                    work = self._works.get((topic, partition))
                    if work is None or work.closing:
                        # Fetched before a rebalance took the partition away: it is
                        # another relay's now, which reads it from the committed offset.
                        # Holding it here would post it twice, and commit for a
                        # partition this relay no longer owns.
                        continue
                    work.append(msg, now)
                    self._message_size = expected_bytes(self._message_size, message_bytes(msg))
            self._dispatch()
            now = time.monotonic()
            if now - last_commit >= self.config.commit_interval:
                self._commit(asynchronous=True)
                last_commit = now
            if now - last_progress >= self.config.progress_interval:
                self._log_progress()
                last_progress = now

    def _batch_size(self) -> int:
        """How many messages to take from the consumer now: up to 500, but never so
        many that one batch (messages of the usual size) overshoots the byte budget."""
        with self._lock:
            room = self.config.buffer_bytes - sum(w.buffered_bytes for w in self._works.values())
        return batch_size(room, self._message_size)

    def _shutdown(self, helpers: list[threading.Thread]) -> None:
        """Stop within the grace: finish in-flight calls, flush, commit, leave the group.

        The order matters. The producer's poll thread keeps serving acknowledgements
        until every in-flight call is over: a dead-letter write waiting for its ack
        while nothing polls would wait out its whole timeout and overrun the grace
        (and be written twice after the restart, its offset never committed).
        """
        self.stop()  # sets the deadline if the loop ended on its own (a fatal error)
        log.info("stopping: finishing in-flight calls, then committing and leaving the group "
                 "(%.0fs grace)", self.config.shutdown_grace)
        with self._changed:
            for work in self._works.values():
                work.close()
            self._changed.wait_for(lambda: all(w.tasks == 0 for w in self._works.values()),
                                   timeout=self._left(self._reserve))
            busy = sum(w.tasks for w in self._works.values())
        if busy:
            log.warning("shutdown grace running out: %d call(s) still in flight are abandoned; "
                        "their messages are not committed and will be redelivered", busy)
        self.abandoned = busy
        unsent = self._producer.flush(self._left(self._reserve / 2))
        if unsent:
            log.warning("%d dead-letter write(s) not acknowledged before shutdown", unsent)
        self._commit(asynchronous=False, again=True)
        self._closed.set()
        for thread in helpers:
            thread.join(self._left(1.0))
        self._consumer.close()  # leaves the group, so its partitions move at once
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._log_progress()
        log.info("stopped")

    def _left(self, reserve: float = 0.0) -> float:
        """Seconds until the shutdown deadline less ``reserve``, at least 0; inf if none."""
        if self._deadline is None:
            return float("inf")
        return max(0.0, self._deadline - reserve - time.monotonic())

    def _wait(self, event: threading.Event, timeout: float) -> bool:
        """Wait for ``event`` up to ``timeout``, but never past the shutdown reserve."""
        end = time.monotonic() + timeout
        while not event.is_set():
            left = min(end - time.monotonic(), self._left(self._reserve))
            if left <= 0:
                break
            event.wait(min(left, 0.2))
        return event.is_set()

    # -- rebalancing -------------------------------------------------------------------------

    def _work_for(self, topic: str, partition: int) -> PartitionWork:
        key = (topic, partition)
        work = self._works.get(key)
        if work is None:
            match = self._topic.match(topic)
            work = PartitionWork(topic, partition, match.group(1) if match else "")
            self._works[key] = work
        return work

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        with self._lock:
            for tp in partitions:
                # A fresh buffer: a partition that comes back resumes from the
                # committed offset, never from what this relay held before.
                self._works.pop((tp.topic, tp.partition), None)
                self._work_for(tp.topic, tp.partition)
            self.metrics.assigned.set(len(self._works))
        # Assign explicitly so the partitions can be resumed: a pause from before a
        # rebalance must not outlive it, since the new state starts unpaused. The
        # offsets are unset, so each partition starts at the group's committed offset.
        if self._incremental:
            consumer.incremental_assign(partitions)
        else:
            consumer.assign(partitions)
        consumer.resume(partitions)
        log.info("assigned %s", ", ".join(f"{tp.topic}[{tp.partition}]" for tp in partitions)
                 or "nothing new")

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Still the owner: finish what is in flight, commit what is done, let go.
        self._release(partitions, commit=True)

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Another member may own them already (this one was stalled past its session
        # timeout): committing now could move its offsets back. Calls in flight end on
        # their own; a message they post again after the new owner did is a replay.
        self._release(partitions, commit=False)

    def _release(self, partitions: list[TopicPartition], commit: bool) -> None:
        """Stop posting for ``partitions``; commit their done prefix if still owned; drop them."""
        keys = {(tp.topic, tp.partition) for tp in partitions}
        with self._changed:
            works = [w for k, w in self._works.items() if k in keys]
            for work in works:
                work.close()
            if commit:
                # A call or a dead-letter write in flight ends within its own timeout;
                # during shutdown, within the grace. Its outcome may move the offset.
                self._changed.wait_for(lambda: all(w.tasks == 0 for w in works),
                                       timeout=min(self.config.http_timeout + 35,
                                                   self._left(self._reserve / 2)))
            offsets = [TopicPartition(w.topic, w.partition, at) for w in works
                       if (at := w.revoke_offset()) is not None]
            left = sum(len(w.slots) for w in works)
            for key in keys:
                self._works.pop(key, None)
                self._lags.pop(key, None)
                try:
                    self.metrics.lag.remove(key[0], str(key[1]))
                except KeyError:
                    pass
            self.metrics.assigned.set(len(self._works))
        if commit and offsets:
            try:
                self._consumer.commit(offsets=offsets, asynchronous=False)
            except KafkaException as err:
                log.warning("commit on revoke failed (the messages will be redelivered and "
                            "replayed): %s", err)
        if partitions:
            log.info("%s %s; %d uncommitted message(s) dropped, for the next owner to read",
                     "revoked" if commit else "lost",
                     ", ".join(f"{tp.topic}[{tp.partition}]" for tp in partitions), left)

    # -- scheduling --------------------------------------------------------------------------

    def _poll_timeout(self) -> float:
        now = time.monotonic()
        with self._lock:
            waits = [w.retry_at - now for w in self._works.values() if w.waiting and w.failing]
        return max(0.01, min([0.1, *waits]))

    def _dispatch(self) -> None:
        """Start drain tasks where messages wait, and pause or resume partitions."""
        now = time.monotonic()
        pause, resume = [], []
        window = self.config.partition_window
        limit = self._batch_limit()
        with self._lock:
            # Memory is bounded in bytes, not only in messages: a thousand 1 MB
            # messages per partition against a slow API would be gigabytes.
            held = sum(w.buffered_bytes for w in self._works.values())
            self.metrics.buffered_bytes.set(held)
            over_budget = held >= self.config.buffer_bytes
            under_budget = held <= self.config.buffer_bytes // 2
            for work in self._works.values():
                if not work.closing and now >= work.retry_at:
                    # Tasks not yet holding a batch will take up to a batch of the
                    # waiting messages each.
                    unclaimed = work.tasks - work.calls
                    while work.tasks < window and work.waiting > unclaimed * limit:
                        work.tasks += 1
                        unclaimed += 1
                        # Its records carry the tenant (LOG_FORMAT=json: a field).
                        self._pool.submit(logconfig.run_with, self._drain, work,
                                          tenant=work.tenant)
                if work.should_pause(self.config.max_buffered, over_budget):
                    work.paused = True
                    pause.append(work.tp)
                elif work.should_resume(self.config.max_buffered, under_budget):
                    work.paused = False
                    resume.append(work.tp)
        if pause:
            self._consumer.pause(pause)
        if resume:
            self._consumer.resume(resume)

    def _batch_limit(self) -> int:
        """Messages per call: the setting, or less if the server said its limit is lower."""
        return max(1, min(self.config.batch_max, self._server_batch_max))

    def _drain(self, work: PartitionWork) -> None:
        """Deliver the partition's messages, a batch at a time, until none is ready."""
        cfg = self.config
        linger = cfg.batch_linger_ms / 1000
        try:
            while True:
                with self._changed:
                    while True:
                        now = time.monotonic()
                        limit = self._batch_limit()
                        slots = work.take_many(now, cfg.partition_window, limit, linger,
                                               BATCH_MAX_BYTES)
                        if slots:
                            break
                        wait = work.linger_left(now, limit, linger)
                        if (wait <= 0 or work.closing or now < work.retry_at
                                or work.calls >= cfg.partition_window):
                            work.tasks -= 1
                            self._changed.notify_all()
                            return
                        # Not full yet: the consumer thread notifies as it appends.
                        self._changed.wait(wait)
                outcomes = self.deliver_batch(slots, work.tenant)
                delay = 0.0
                with self._lock:
                    if not all(outcome.done for outcome in outcomes):
                        delay = backoff_delay(work.attempts + 1, cfg.backoff_initial,
                                              cfg.backoff_max)
                    work.settle_many(zip(slots, outcomes, strict=True), time.monotonic(), delay)
                    attempt = work.attempts
                self._record(slots, work.tenant, outcomes, delay, attempt)
        except BaseException:
            with self._lock:
                work.tasks -= 1
                self._changed.notify_all()
            raise

    def _internal_error(self, slot: Slot, tenant: str, err: Exception) -> Outcome:
        """Retry a message our own code raised on; dead-letter it on the third try in a row."""
        msg = slot.message
        slot.internal_errors += 1
        self.metrics.internal_errors.inc()
        summary = traceback_summary(err)
        log.error("our own error on %s (try %d of %d)", where(msg), slot.internal_errors,
                  INTERNAL_ERROR_TRIES, exc_info=err)
        if slot.internal_errors < INTERNAL_ERROR_TRIES:
            return Outcome(OutcomeKind.RETRY, "internal_error", detail=repr(err))
        try:
            return self.dead_letter(msg, tenant, "internal_error", detail=repr(err),
                                    traceback=summary)
        except Exception:  # noqa: BLE001 - the dead-letter path itself is broken: keep the message
            log.exception("could not dead-letter %s after our own errors", where(msg))
            return Outcome(OutcomeKind.RETRY, "internal_error", detail=repr(err))

    def _record(self, slots: list[Slot], tenant: str, outcomes: list[Outcome], delay: float,
                attempt: int) -> None:
        m = self.metrics
        retries = [(slot.message, o) for slot, o in zip(slots, outcomes, strict=True)
                   if o.kind is OutcomeKind.RETRY]
        with self._lock:
            for outcome in outcomes:
                kind = outcome.kind
                self._counts["retries" if kind is OutcomeKind.RETRY else kind.value] += 1
        for slot, outcome in zip(slots, outcomes, strict=True):
            msg, kind = slot.message, outcome.kind
            if kind is OutcomeKind.ADMITTED:
                m.admitted.inc()
            elif kind is OutcomeKind.REPLAYED:
                m.replayed.inc()
            elif kind is OutcomeKind.DEAD_LETTERED:
                m.dead_lettered.labels(outcome.reason).inc()
                m.dlq.labels(outcome.reason).inc()
                log.warning("dead-lettered %s (message fault): reason=%s status=%s %s",
                            where(msg), outcome.reason, outcome.status or "-", outcome.detail)
            else:
                m.retries.labels(outcome.reason).inc()
            if outcome.derived_key and kind in (OutcomeKind.ADMITTED, OutcomeKind.REPLAYED):
                m.derived_keys.inc()
        if not retries:
            return
        # One line per call, not per message: a batch of 100 against a stopped API.
        msg, outcome = retries[0]
        more = f" (and {len(retries) - 1} more of its batch)" if len(retries) > 1 else ""
        if outcome.reason == TENANT_NOT_FOUND:
            log.warning("tenant %r does not exist (yet): %s%s waits for it, retrying in %.1fs "
                        "(attempt %d, partition paused); create the tenant, or delete %s",
                        tenant, where(msg), more, delay, attempt, msg.topic())
        else:
            log.warning("retrying %s%s in %.1fs (attempt %d, partition paused): %s %s %s",
                        where(msg), more, delay, attempt, outcome.reason,
                        outcome.status or "", outcome.detail)

    # -- delivery ----------------------------------------------------------------------------

    def deliver_batch(self, slots: list[Slot], tenant: str) -> list[Outcome]:
        """POST a partition's messages as one batch; return each message's outcome.

        A message that cannot be parsed is dead-lettered on its own and never joins
        the batch. The rest go in one ``POST /v1/runs/batch``, each item judged by
        the single request's table. Nothing is raised for a fault of a message or
        of the delivery: the outcomes say which. An exception from our own code on
        one message is that message's (``_internal_error``); one while posting is
        every posted message's.
        """
        outcomes: dict[int, Outcome] = {}  # by the slot's index: each slot gets one
        entries: list[tuple[int, BatchEntry]] = []
        for index, slot in enumerate(slots):
            msg = slot.message
            try:
                value = msg.value()
                if self.config.test_raise_on and self.config.test_raise_on in (value or b""):
                    raise RuntimeError("injected by POIMEN_INBOX_TEST_RAISE_ON (a test-only "
                                       "setting)")
                try:
                    body, derived = run_request_body(value, *place(msg),
                                                     message_timestamp(*msg.timestamp()))
                except MessageFault as bad:
                    outcomes[index] = self._fault(msg, tenant, bad.fault)
                    continue
                entries.append((index, BatchEntry(msg, body, trace_headers(msg), derived)))
            except Exception as err:  # noqa: BLE001 - a bug must not strand the partition
                outcomes[index] = self._internal_error(slot, tenant, err)
        if entries:
            try:
                posted = self._post_batch([entry for _, entry in entries], tenant)
            except Exception as err:  # noqa: BLE001 - a bug must not strand the partition
                posted = [self._internal_error(slots[index], tenant, err) for index, _ in entries]
            for (index, _), outcome in zip(entries, posted, strict=True):
                outcomes[index] = outcome
        judged = [outcomes[index] for index in range(len(slots))]
        for slot, outcome in zip(slots, judged, strict=True):
            if outcome.reason != "internal_error":
                slot.internal_errors = 0
        return judged

    def _post_batch(self, entries: list[BatchEntry], tenant: str) -> list[Outcome]:
        """POST ``entries`` as ``POST /v1/runs/batch`` and judge the answer per item."""
        limit = self._batch_limit()
        if len(entries) > limit:  # the server's limit was learned after they were taken
            return [o for at in range(0, len(entries), limit)
                    for o in self._post_batch(entries[at:at + limit], tenant)]
        count = len(entries)
        body = batch_body([batch_item(e.body, e.trace) for e in entries])
        self.metrics.batch_size.observe(count)
        started = time.monotonic()
        try:
            # Never a followed redirect (Transport follows none): a 301/302 turned the
            # POST into a GET of /v1/runs, whose 200 looked like a replay, and the
            # message was committed and lost.
            answer = self._api.send("POST", BATCH_PATH, body, {"X-Poimen-Tenant": tenant})
        except TransportTimeout as err:
            return [Outcome(OutcomeKind.RETRY, "timeout", detail=str(err))] * count
        except TransportError as err:
            return [Outcome(OutcomeKind.RETRY, "connection", detail=str(err))] * count
        finally:
            self.metrics.api_latency.observe(time.monotonic() - started)
        verdict = batch_fault(answer.status, answer.header("Content-Type"), answer.data, count,
                              answer.headers.get("Location"))
        if verdict.split:
            # The server refused the batch as such (413: too many items or bytes for
            # it; a whole-batch 400/422): never a message's fault. Halves, until a
            # lone message goes through POST /v1/runs and is judged as it always was.
            if count == 1:
                return [self._post_run(entries[0], tenant)]
            if verdict.limit is not None and verdict.limit < count:
                log.warning("the API takes at most %d runs per batch (%d sent): batches of %d "
                            "from now on", verdict.limit, count, verdict.limit)
                self._server_batch_max = verdict.limit
                return self._post_batch(entries, tenant)
            half = count // 2
            return self._post_batch(entries[:half], tenant) + self._post_batch(entries[half:],
                                                                             tenant)
        if verdict.whole is not None:
            whole = verdict.whole  # a delivery fault: split takes the others
            return [Outcome(OutcomeKind.RETRY, whole.reason, whole.status, whole.detail)] * count
        outcomes: list[Outcome] = []
        for entry, (status, fault) in zip(entries, verdict.items, strict=True):
            if fault is None:
                kind = OutcomeKind.ADMITTED if status == 201 else OutcomeKind.REPLAYED
                outcomes.append(Outcome(kind, status=status, derived_key=entry.derived))
            else:
                outcomes.append(self._fault(entry.message, tenant, fault))
        return outcomes

    def _post_run(self, entry: BatchEntry, tenant: str) -> Outcome:
        """POST one message as ``POST /v1/runs``, judged by the single request's table."""
        started = time.monotonic()
        try:
            answer = self._api.send("POST", "/v1/runs", entry.body,
                                    {"X-Poimen-Tenant": tenant, **entry.trace})
        except TransportTimeout as err:
            return Outcome(OutcomeKind.RETRY, "timeout", detail=str(err))
        except TransportError as err:
            return Outcome(OutcomeKind.RETRY, "connection", detail=str(err))
        finally:
            self.metrics.api_latency.observe(time.monotonic() - started)
        status = answer.status
        fault = response_fault(status, answer.header("Content-Type"), answer.data,
                               answer.headers.get("Location"))
        if fault is None:
            kind = OutcomeKind.ADMITTED if status == 201 else OutcomeKind.REPLAYED
            return Outcome(kind, status=status, derived_key=entry.derived)
        return self._fault(entry.message, tenant, fault)

    def _fault(self, msg: Message, tenant: str, fault: Fault) -> Outcome:
        if fault.kind is FaultKind.MESSAGE:
            return self.dead_letter(msg, tenant, fault.reason, fault.status, fault.detail)
        return Outcome(OutcomeKind.RETRY, fault.reason, fault.status, fault.detail)

    def dead_letter(self, msg: Message, tenant: str, reason: str, status: int | None = None,
                    detail: str = "",
                    traceback: str | None = None) -> Outcome:
        """Write ``msg`` to its tenant's DLQ (key, value, headers kept) and wait for the ack.

        A record over the producer's size limit is cut to fit (``dead_letter_record``);
        if the broker still refuses it as too large, it is cut to half and sent again.
        A write that fails otherwise is a delivery fault: the message is retried.
        """
        topic = dead_letter_topic(self.config.prefix, tenant)
        self._ensure_dead_letter_topic(topic)
        limit = self._dlq_max_bytes
        error: KafkaError | str = ""
        with self.metrics.dlq_in_flight.track_inprogress():
            for _ in range(DLQ_SIZE_TRIES):
                topic_of, partition, offset = place(msg)
                record = dead_letter_record(
                    key=msg.key(), value=msg.value(), headers=msg.headers(), topic=topic_of,
                    partition=partition, offset=offset,
                    timestamp_ms=message_timestamp(*msg.timestamp()), reason=reason, status=status,
                    detail=detail, traceback=traceback, limit=limit)
                error = self._produce(topic, record)
                if not error:
                    if record.truncated:
                        self.metrics.dlq_truncated.inc()
                        detail = f"{detail} (dead letter cut to fit: {', '.join(record.truncated)})"
                    return Outcome(OutcomeKind.DEAD_LETTERED, reason, status, detail)
                if not (isinstance(error, KafkaError) and error.code() in SIZE_ERRORS):
                    break
                limit //= 2
        return Outcome(OutcomeKind.RETRY, "dlq_write_failed", detail=f"{topic}: {error}")

    def _produce(self, topic: str, record: Record) -> KafkaError | str:
        """Send one record and wait for the broker's acknowledgement; return the error, if any."""
        acked = threading.Event()
        failure: list[KafkaError] = []

        def delivered(err: KafkaError | None, _: Message) -> None:
            if err is not None:
                failure.append(err)
            acked.set()

        end = time.monotonic() + self._dlq_ack_timeout
        while True:
            try:
                self._producer.produce(topic, value=record.value, key=record.key,
                                       headers=kafka_headers(record.headers),
                                       on_delivery=delivered)
                break
            except BufferError:  # the producer's queue is full: wait for room
                if time.monotonic() > end or self._left(self._reserve) == 0:
                    return "the producer's queue stayed full"
                time.sleep(0.05)
            except KafkaException as err:  # refused before sending, e.g. too large
                refused = err.args[0]
                return refused if isinstance(refused, KafkaError) else str(refused)
        # The producer's message.timeout.ms bounds the wait; this is a backstop.
        if not self._wait(acked, self._dlq_ack_timeout):
            return "no acknowledgement"
        return failure[0] if failure else ""

    def _ensure_dead_letter_topic(self, topic: str) -> None:
        with self._dlq_lock:
            if topic in self._dlq_ready:
                return
            try:
                ensure_topics(self._admin, [topic], self.config.dlq_partitions, timeout=10)
            except KafkaException as err:
                # Perhaps the relay may not create topics but the topic exists, or the
                # broker auto-creates: the produce below decides, and retries if not.
                log.warning("could not create %s: %s", topic, err)
                return
            self._dlq_ready.add(topic)

    def _serve_producer(self) -> None:
        # Until in-flight work is over, not merely until SIGTERM: see ``_shutdown``.
        while not self._closed.is_set():
            self._producer.poll(0.2)

    # -- offsets, lag, logs ------------------------------------------------------------------

    def _commit(self, asynchronous: bool, only: set[tuple[str, int]] | None = None,
                again: bool = False) -> None:
        """Commit each partition's done prefix; ``again`` re-sends offsets already sent.

        The final, synchronous commits (revoke, shutdown) use ``again``: an
        asynchronous commit lost around a broker restart is then made good.
        """
        with self._lock:
            works = [w for k, w in self._works.items() if only is None or k in only]
            due = [w for w in works if w.commit_offset is not None
                   and (again or w.commit_offset != w.committed_offset)]
            offsets = [TopicPartition(w.topic, w.partition, w.commit_offset) for w in due
                       if w.commit_offset is not None]
            for work in due:
                work.committed_offset = work.commit_offset
        if not offsets:
            return
        try:
            if asynchronous:
                self._consumer.commit(offsets=offsets, asynchronous=True)
            else:
                self._consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as err:
            log.warning("commit failed (the messages will be redelivered and replayed): %s", err)
            self._forget_commits(offsets)

    def _on_commit(self, err: KafkaError | None, partitions: list[TopicPartition]) -> None:
        if err is not None:
            log.warning("commit failed, will retry: %s", err)
            self._forget_commits(partitions)

    def _forget_commits(self, partitions: list[TopicPartition]) -> None:
        with self._lock:
            for tp in partitions:
                work = self._works.get((tp.topic, tp.partition))
                if work is not None and work.committed_offset == tp.offset:
                    work.committed_offset = None

    def _watch_lag(self) -> None:
        """Publish lag as the broker sees it: high watermark minus the group's committed offset.

        A second client of the same group, never subscribed, does the asking: the
        consuming client stays on the main thread, and the numbers are the ones any
        operator tool (kafka-consumer-groups) would show.
        """
        settings: dict[str, Any] = {**self.config.kafka, "group.id": self.config.group,
                                    "client.id": "poimen-inbox-lag", "enable.auto.commit": False,
                                    "logger": logging.getLogger("rdkafka")}
        observer = Consumer(settings)
        try:
            while not self._closed.wait(self.config.lag_interval):
                # The clients nothing else polls: their librdkafka log lines are served here.
                observer.poll(0)
                self._admin.poll(0)
                self._measure_lag(observer)
        finally:
            observer.close()

    def _measure_lag(self, observer: Consumer) -> None:
        with self._lock:
            tps = [w.tp for w in self._works.values()]
        if tps:
            try:
                lags: dict[tuple[str, int], int] = {}
                for tp in observer.committed(tps, timeout=5):
                    low, high = observer.get_watermark_offsets(
                        TopicPartition(tp.topic, tp.partition), timeout=5, cached=False)
                    base = tp.offset if tp.offset >= 0 else low
                    lags[(tp.topic, tp.partition)] = max(high - base, 0)
            except KafkaException as err:
                log.warning("lag not measured: %s", err)
                return
            with self._lock:
                for key, lag in lags.items():
                    if key in self._works:
                        self._lags[key] = lag
                        self.metrics.lag.labels(key[0], str(key[1])).set(lag)

    def _log_consumer_error(self, error: KafkaError) -> None:
        if error.code() == KafkaError._PARTITION_EOF:
            return
        if error.fatal():
            raise KafkaException(error)
        log.warning("consumer: %s", error)

    def _log_progress(self) -> None:
        with self._lock:
            counts = dict(self._counts)
            partitions = len(self._works)
            lag = sum(self._lags.values())
            failing = sum(1 for w in self._works.values() if w.failing)
        log.info("progress: %d partitions (%d retrying), lag %d; admitted %d, replayed %d, "
                 "dead-lettered %d, retries %d", partitions, failing, lag, counts["admitted"],
                 counts["replayed"], counts["dead_lettered"], counts["retries"])


def main() -> int:
    """Run the inbox until SIGTERM or SIGINT."""
    configure_logging()
    config = inbox_settings()
    inbox = Inbox(config)
    serve(inbox, inbox.metrics.registry, config.metrics_port)
    if inbox.abandoned:
        # Calls that outlived the grace would hold the interpreter's exit (it joins the
        # HTTP threads) past Heroku's SIGKILL; their messages were not committed.
        logging.shutdown()
        os._exit(0)
    return 0
