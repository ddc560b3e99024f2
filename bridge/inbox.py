"""The Kafka inbox: ``<prefix>.<tenant>.dispatch`` messages become runs via ``POST /v1/runs``.

The relay is an HTTP client of the API, never an in-process caller of
admission, so every run it creates went through the same validation, auth and
``dispatch_key`` dedup as a request made with curl. It keeps no idempotency
state of its own: a redelivered message is replayed at admission (200), not
filtered here, because two dedup layers disagree exactly when things go wrong.

Offsets are committed per partition, in order, and only past messages that
either the API accepted (2xx) or the dead-letter topic acknowledged. A message
the API cannot take *now* (5xx, 429, timeouts, refused connections) is retried
with capped, jittered exponential backoff while its partition is paused; it
is never skipped. A message the API will never take (4xx, malformed) goes to
``<prefix>.<tenant>.dispatch.dlq`` with the reason and its origin in headers.

Run it as ``python -m bridge.inbox`` (the Procfile's ``inbox``). Settings come
from the environment when it starts; see ``InboxConfig.from_env``.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import random
import re
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import requests
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    start_http_server,
)
from requests.adapters import HTTPAdapter

from .kafka import client_settings, describe
from .topics import dead_letter_topic, ensure_topics, topic_prefix

log = logging.getLogger("poimen.inbox")

RUN_FIELDS = ("workflow_ref", "input", "goal_id", "dispatch_key")
# 401/403 mean the relay's own token is wrong or revoked, and 408 is a timeout:
# none says anything about the message, so dead-lettering the whole stream
# while an operator fixes a token would be the wrong failure.
RETRY_STATUSES = frozenset({401, 403, 408, 429})
BODY_EXCERPT = 1000


def _version() -> str:
    try:
        return metadata.version("poimen")
    except metadata.PackageNotFoundError:
        return "0"


USER_AGENT = f"poimen-inbox/{_version()}"


@dataclass(frozen=True)
class InboxConfig:
    """The relay's settings; ``from_env`` documents the variable behind each."""

    api_url: str
    api_token: str
    kafka: Mapping[str, str]
    prefix: str = "poimen"
    group: str = "poimen-inbox"
    concurrency: int = 8
    partition_window: int = 1
    http_timeout: float = 15.0
    backoff_initial: float = 0.5
    backoff_max: float = 30.0
    max_buffered: int = 1000
    metadata_refresh_ms: int = 2000
    session_timeout_ms: int = 10000
    dlq_partitions: int = 1
    metrics_port: int = 9101
    lag_interval: float = 5.0
    progress_interval: float = 30.0
    commit_interval: float = 0.2

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> InboxConfig:
        """Read the relay's settings from ``env`` (default: ``os.environ``)."""
        env = os.environ if env is None else env
        missing = [n for n in ("POIMEN_API_URL", "POIMEN_API_TOKEN") if not env.get(n)]
        if missing:
            raise SystemExit(f"{' and '.join(missing)} must be set: the inbox POSTs runs to the "
                             "API with a service token (flask --app app tokens create --service)")
        metrics_port = env.get("METRICS_PORT") or env.get("PORT") or "9101"
        return cls(
            api_url=env["POIMEN_API_URL"].rstrip("/"),
            api_token=env["POIMEN_API_TOKEN"],
            kafka=client_settings(env),
            prefix=topic_prefix(env),
            group=env.get("POIMEN_INBOX_GROUP") or "poimen-inbox",
            # Parallel partitions, and so HTTP sessions (one per thread).
            concurrency=int(env.get("POIMEN_INBOX_CONCURRENCY", "8")),
            # Calls in flight per partition; 1 admits each partition strictly in order.
            partition_window=int(env.get("POIMEN_INBOX_PARTITION_WINDOW", "1")),
            http_timeout=float(env.get("POIMEN_INBOX_HTTP_TIMEOUT", "15")),
            backoff_initial=float(env.get("POIMEN_INBOX_BACKOFF_INITIAL", "0.5")),
            backoff_max=float(env.get("POIMEN_INBOX_BACKOFF_MAX", "30")),
            max_buffered=int(env.get("POIMEN_INBOX_MAX_BUFFERED", "1000")),
            metadata_refresh_ms=int(env.get("POIMEN_INBOX_METADATA_REFRESH_MS", "2000")),
            session_timeout_ms=int(env.get("POIMEN_INBOX_SESSION_TIMEOUT_MS", "10000")),
            dlq_partitions=int(env.get("POIMEN_INBOX_DLQ_PARTITIONS", "1")),
            metrics_port=int(metrics_port),
            lag_interval=float(env.get("POIMEN_INBOX_LAG_INTERVAL", "5")),
            progress_interval=float(env.get("POIMEN_INBOX_PROGRESS_INTERVAL", "30")),
        )

    @property
    def subscription(self) -> str:
        return rf"^{re.escape(self.prefix)}\..+\.dispatch$"


class InboxMetrics:
    """The relay's Prometheus metrics, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        r = self.registry
        self.lag = Gauge("poimen_inbox_lag",
                         "Inbox lag: high watermark minus the group's committed offset.",
                         ["topic", "partition"], registry=r)
        self.admitted = Counter("poimen_inbox_admitted_total",
                                "Messages the API admitted as new runs (201).", registry=r)
        self.replayed = Counter("poimen_inbox_replayed_total",
                                "Messages admission recognised as a replay (200).", registry=r)
        self.dead_lettered = Counter("poimen_inbox_dead_lettered_total",
                                     "Messages written to the dead-letter topic, by reason.",
                                     ["reason"], registry=r)
        self.retries = Counter("poimen_inbox_retries_total",
                               "Deliveries to retry (API down, 5xx, 429, timeouts), by reason.",
                               ["reason"], registry=r)
        self.api_latency = Histogram("poimen_inbox_api_latency_seconds",
                                     "Latency of POST /v1/runs as seen by the inbox.",
                                     registry=r)
        self.assigned = Gauge("poimen_inbox_assigned_partitions",
                              "Dispatch partitions assigned to this relay.", registry=r)


@dataclass
class Outcome:
    """What became of one message: admitted, replayed, dead_lettered, or retry."""

    kind: str
    reason: str = ""
    status: int | None = None
    detail: str = ""


class BadMessage(ValueError):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def run_request(value: bytes | None) -> dict[str, Any]:
    """Return the ``POST /v1/runs`` body for a dispatch message, or raise ``BadMessage``.

    Only the fields of a run request are copied, verbatim; the API validates the
    rest (``input`` type, lengths, the workflow's existence).
    """
    if value is None:
        raise BadMessage("invalid_json", "the message has no value")
    try:
        body = json.loads(value)
    except (UnicodeDecodeError, ValueError) as err:
        raise BadMessage("invalid_json", f"not JSON: {err}") from None
    if not isinstance(body, dict):
        raise BadMessage("not_an_object", f"a JSON {type(body).__name__}, not an object")
    if "workflow_ref" not in body:
        raise BadMessage("missing_workflow_ref", "no workflow_ref")
    if not isinstance(body["workflow_ref"], str):
        raise BadMessage("invalid_workflow_ref", "workflow_ref is not a string")
    if "dispatch_key" in body and not isinstance(body["dispatch_key"], str):
        raise BadMessage("invalid_dispatch_key", "dispatch_key is not a string")
    return {name: body[name] for name in RUN_FIELDS if name in body}


def backoff_delay(attempt: int, initial: float, cap: float) -> float:
    """Return the wait before retry ``attempt`` (1-based): capped exponential, jittered.

    Half the delay is fixed and half random, so relays that lost the API together
    do not come back together, yet none retries much sooner than planned.
    """
    ceiling = min(cap, initial * 2 ** min(attempt - 1, 30))
    return ceiling / 2 + random.uniform(0, ceiling / 2)


def _where(msg: Message) -> str:
    return f"{msg.topic()}[{msg.partition()}]@{msg.offset()}"


@dataclass
class Slot:
    message: Message
    state: str = "queued"  # queued -> running -> done, or -> failed -> running ...


@dataclass
class PartitionWork:
    """The fetched, not yet committed messages of one partition, in offset order."""

    topic: str
    partition: int
    tenant: str
    slots: deque[Slot] = field(default_factory=deque)
    waiting: int = 0          # slots queued or failed
    in_flight: int = 0        # slots being delivered
    failed: int = 0           # slots whose last delivery is to be retried
    tasks: int = 0            # drain tasks submitted and not finished
    attempts: int = 0         # consecutive retriable failures
    retry_at: float = 0.0     # no delivery before this (monotonic)
    next_offset: int = -1     # the offset after the last message appended
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

    def append(self, msg: Message) -> None:
        # A resume after a pause may re-fetch from the consumer's position;
        # never hold an offset twice.
        if msg.offset() < self.next_offset:
            return
        self.next_offset = msg.offset() + 1
        self.slots.append(Slot(msg))
        self.waiting += 1

    def take(self, now: float, window: int) -> Slot | None:
        if self.closing or now < self.retry_at or self.in_flight >= window:
            return None
        for slot in self.slots:
            if slot.state in ("queued", "failed"):
                if slot.state == "failed":
                    self.failed -= 1
                slot.state = "running"
                self.waiting -= 1
                self.in_flight += 1
                return slot
        return None

    def settle(self, slot: Slot, outcome: Outcome, retry_delay: float) -> None:
        self.in_flight -= 1
        if outcome.kind == "retry":
            slot.state = "failed"
            self.failed += 1
            self.waiting += 1
            self.attempts += 1
            self.retry_at = time.monotonic() + retry_delay
            return
        slot.state = "done"
        if self.in_flight == 0 and self.failed == 0:
            self.attempts = 0
        # In-order commit: only the prefix of done messages moves the offset.
        while self.slots and self.slots[0].state == "done":
            self.commit_offset = self.slots.popleft().message.offset() + 1


class Inbox:
    """The relay: one consumer, a bounded pool of HTTP sessions, one DLQ producer."""

    def __init__(self, config: InboxConfig, metrics: InboxMetrics | None = None):
        self.config = config
        self.metrics = metrics or InboxMetrics()
        self._topic = re.compile(rf"^{re.escape(config.prefix)}\.(.+)\.dispatch$")
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._works: dict[tuple[str, int], PartitionWork] = {}
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(config.concurrency, thread_name_prefix="inbox-http")
        self._dlq_ready: set[str] = set()
        self._dlq_lock = threading.Lock()
        self._counts = {"admitted": 0, "replayed": 0, "dead_lettered": 0, "retries": 0}
        self._lags: dict[tuple[str, int], int] = {}
        self._consumer: Consumer | None = None
        self._producer: Producer | None = None
        self._admin: AdminClient | None = None
        self._dlq_ack_timeout = 60.0

    # -- lifecycle ---------------------------------------------------------------------------

    def stop(self, *_: Any) -> None:
        """Ask the relay to finish in-flight calls, commit and leave the group."""
        self._stop.set()

    def run(self) -> None:
        """Consume until ``stop``; then finish in-flight calls, commit and close."""
        cfg = self.config
        kafka = dict(cfg.kafka)
        self._consumer = Consumer({
            **kafka,
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
        })
        # A dead-letter write that cannot be acknowledged within message.timeout.ms
        # fails and is retried like an API outage; the default (5 min) would hold a
        # worker through a whole broker restart.
        self._producer = Producer({"message.timeout.ms": 30000, **kafka,
                                   "client.id": "poimen-inbox-dlq", "acks": "all",
                                   "linger.ms": 5})
        self._admin = AdminClient(kafka)
        self._dlq_ack_timeout = int(kafka.get("message.timeout.ms", 30000)) / 1000 + 10
        log.info("inbox %s: group %s, topics %s, API %s, %d sessions; kafka %s", USER_AGENT,
                 cfg.group, cfg.subscription, cfg.api_url, cfg.concurrency, describe(kafka))
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
            messages = self._consumer.consume(num_messages=500, timeout=self._poll_timeout())
            with self._lock:
                for msg in messages:
                    if msg.error():
                        self._log_consumer_error(msg.error())
                        continue
                    self._work_for(msg.topic(), msg.partition()).append(msg)
            self._dispatch()
            now = time.monotonic()
            if now - last_commit >= self.config.commit_interval:
                self._commit(asynchronous=True)
                last_commit = now
            if now - last_progress >= self.config.progress_interval:
                self._log_progress()
                last_progress = now

    def _shutdown(self, helpers: list[threading.Thread]) -> None:
        log.info("stopping: finishing in-flight calls, then committing and leaving the group")
        with self._changed:
            for work in self._works.values():
                work.closing = True
            self._changed.wait_for(lambda: all(w.tasks == 0 for w in self._works.values()),
                                   timeout=self.config.http_timeout + 35)
        self._commit(asynchronous=False, again=True)
        self._stop.set()
        for thread in helpers:
            thread.join(10)
        self._consumer.close()  # leaves the group, so its partitions move at once
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._producer.flush(10)
        self._log_progress()
        log.info("stopped")

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
                self._work_for(tp.topic, tp.partition)
            self.metrics.assigned.set(len(self._works))
        # Assign explicitly so the partitions can be resumed: a pause from before a
        # rebalance must not outlive it, since the new state starts unpaused.
        if "cooperative" in self.config.kafka.get("partition.assignment.strategy", ""):
            consumer.incremental_assign(partitions)
        else:
            consumer.assign(partitions)
        consumer.resume(partitions)
        log.info("assigned %s", ", ".join(f"{tp.topic}[{tp.partition}]" for tp in partitions))

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._release(partitions, commit=True)

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Another member may own them already: committing now could move its offsets back.
        self._release(partitions, commit=False)

    def _release(self, partitions: list[TopicPartition], commit: bool) -> None:
        keys = {(tp.topic, tp.partition) for tp in partitions}
        with self._changed:
            works = [w for k, w in self._works.items() if k in keys]
            for work in works:
                work.closing = True
            self._changed.wait_for(lambda: all(w.tasks == 0 for w in works),
                                   timeout=self.config.http_timeout + 35)
        if commit:
            self._commit(asynchronous=False, only=keys, again=True)
        with self._lock:
            for key in keys:
                self._works.pop(key, None)
                self._lags.pop(key, None)
                try:
                    self.metrics.lag.remove(key[0], str(key[1]))
                except KeyError:
                    pass
            self.metrics.assigned.set(len(self._works))
        if partitions:
            log.info("released %s", ", ".join(f"{tp.topic}[{tp.partition}]" for tp in partitions))

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
        with self._lock:
            for work in self._works.values():
                if not work.closing and now >= work.retry_at:
                    # Tasks not yet holding a slot will take one of the waiting messages.
                    unclaimed = work.tasks - work.in_flight
                    while work.tasks < window and work.waiting > unclaimed:
                        work.tasks += 1
                        unclaimed += 1
                        self._pool.submit(self._drain, work)
                # Pause while a message fails (fetching more would only pile up
                # work that cannot go anywhere) or while the backlog is full.
                buffered = len(work.slots)
                if not work.paused and (work.failing or buffered >= self.config.max_buffered):
                    work.paused = True
                    pause.append(work.tp)
                elif work.paused and not work.failing and buffered <= self.config.max_buffered // 2:
                    work.paused = False
                    resume.append(work.tp)
        if pause:
            self._consumer.pause(pause)
        if resume:
            self._consumer.resume(resume)

    def _drain(self, work: PartitionWork) -> None:
        """Deliver the partition's messages one after another until none is ready."""
        try:
            while True:
                with self._lock:
                    slot = work.take(time.monotonic(), self.config.partition_window)
                    if slot is None:
                        work.tasks -= 1
                        self._changed.notify_all()
                        return
                try:
                    outcome = self.deliver(slot.message, work.tenant)
                except Exception as err:  # noqa: BLE001 - a bug must not strand the partition
                    log.exception("unexpected error delivering %s", _where(slot.message))
                    outcome = Outcome("retry", "internal_error", detail=repr(err))
                delay = 0.0
                with self._lock:
                    if outcome.kind == "retry":
                        delay = backoff_delay(work.attempts + 1, self.config.backoff_initial,
                                              self.config.backoff_max)
                    work.settle(slot, outcome, delay)
                    attempt = work.attempts
                self._record(slot.message, outcome, delay, attempt)
        except BaseException:
            with self._lock:
                work.tasks -= 1
                self._changed.notify_all()
            raise

    def _record(self, msg: Message, outcome: Outcome, delay: float, attempt: int) -> None:
        m = self.metrics
        with self._lock:
            if outcome.kind in self._counts:
                self._counts[outcome.kind] += 1
            elif outcome.kind == "retry":
                self._counts["retries"] += 1
        if outcome.kind == "admitted":
            m.admitted.inc()
        elif outcome.kind == "replayed":
            m.replayed.inc()
        elif outcome.kind == "dead_lettered":
            m.dead_lettered.labels(outcome.reason).inc()
            log.warning("dead-lettered %s: reason=%s status=%s %s", _where(msg), outcome.reason,
                        outcome.status or "-", outcome.detail)
        elif outcome.kind == "retry":
            m.retries.labels(outcome.reason).inc()
            log.warning("retrying %s in %.1fs (attempt %d, partition paused): %s %s",
                        _where(msg), delay, attempt, outcome.reason, outcome.detail)

    # -- delivery ----------------------------------------------------------------------------

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = requests.Session()
            adapter = HTTPAdapter(pool_connections=1, pool_maxsize=1, max_retries=0)
            session.mount("http://", adapter)
            session.mount("https://", adapter)
            session.headers.update({
                "Authorization": f"Bearer {self.config.api_token}",
                "Content-Type": "application/json",
                "User-Agent": USER_AGENT,
            })
            self._local.session = session
        return session

    def deliver(self, msg: Message, tenant: str) -> Outcome:
        """POST one message as a run request; dead-letter it if it can never be admitted."""
        try:
            body = run_request(msg.value())
        except BadMessage as bad:
            return self.dead_letter(msg, tenant, bad.reason, detail=str(bad))
        started = time.monotonic()
        try:
            response = self._session().post(
                f"{self.config.api_url}/v1/runs",
                data=json.dumps(body, separators=(",", ":")).encode(),
                headers={"X-Poimen-Tenant": tenant},
                timeout=(5.0, self.config.http_timeout),
            )
        except requests.Timeout as err:
            return Outcome("retry", "timeout", detail=str(err))
        except requests.RequestException as err:
            return Outcome("retry", "connection", detail=str(err))
        finally:
            self.metrics.api_latency.observe(time.monotonic() - started)
        status = response.status_code
        if status == 201:
            return Outcome("admitted", status=status)
        if 200 <= status < 300:
            return Outcome("replayed", status=status)
        excerpt = response.text[:BODY_EXCERPT]
        if status >= 500 or status in RETRY_STATUSES:
            return Outcome("retry", f"http_{status}", status, excerpt)
        return self.dead_letter(msg, tenant, f"http_{status}", status=status, detail=excerpt)

    def dead_letter(self, msg: Message, tenant: str, reason: str, status: int | None = None,
                    detail: str = "") -> Outcome:
        """Write ``msg`` (key, value, headers kept) to its tenant's DLQ and wait for the ack."""
        topic = dead_letter_topic(self.config.prefix, tenant)
        self._ensure_dead_letter_topic(topic)
        headers = list(msg.headers() or []) + [
            ("poimen.dlq.reason", reason.encode()),
            ("poimen.dlq.http.status", str(status or "").encode()),
            ("poimen.dlq.detail", detail[:BODY_EXCERPT].encode("utf-8", "replace")),
            ("poimen.dlq.origin.topic", msg.topic().encode()),
            ("poimen.dlq.origin.partition", str(msg.partition()).encode()),
            ("poimen.dlq.origin.offset", str(msg.offset()).encode()),
        ]
        acked = threading.Event()
        failure: list[KafkaError] = []

        def delivered(err: KafkaError | None, _: Message) -> None:
            if err is not None:
                failure.append(err)
            acked.set()

        while True:
            try:
                self._producer.produce(topic, value=msg.value(), key=msg.key(), headers=headers,
                                       on_delivery=delivered)
                break
            except BufferError:
                time.sleep(0.05)
        # The producer's message.timeout.ms bounds the wait; this is a backstop.
        if not acked.wait(self._dlq_ack_timeout) or failure:
            error = failure[0] if failure else "no acknowledgement"
            return Outcome("retry", "dlq_write_failed", detail=f"{topic}: {error}")
        return Outcome("dead_lettered", reason, status, detail)

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
        while not self._stop.is_set():
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
            offsets = [TopicPartition(w.topic, w.partition, w.commit_offset) for w in due]
            for work in due:
                work.committed_offset = work.commit_offset
        if not offsets:
            return
        try:
            self._consumer.commit(offsets=offsets, asynchronous=asynchronous)
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
        observer = Consumer({**self.config.kafka, "group.id": self.config.group,
                             "client.id": "poimen-inbox-lag", "enable.auto.commit": False})
        try:
            while not self._stop.wait(self.config.lag_interval):
                self._measure_lag(observer)
        finally:
            observer.close()

    def _measure_lag(self, observer: Consumer) -> None:
        with self._lock:
            tps = [w.tp for w in self._works.values()]
        if tps:
            try:
                lags = {}
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
    logging.basicConfig(level=os.environ.get("LOG_LEVEL", "INFO").upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = InboxConfig.from_env()
    inbox = Inbox(config)
    if config.metrics_port:
        start_http_server(config.metrics_port, registry=inbox.metrics.registry)
        log.info("metrics on :%d/metrics", config.metrics_port)
    # `kill -USR1 <pid>` prints every thread's stack: where a stuck relay is stuck.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    signal.signal(signal.SIGTERM, inbox.stop)
    signal.signal(signal.SIGINT, inbox.stop)
    inbox.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
