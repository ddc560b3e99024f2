"""The outbox relay: ``outbox`` rows become events on ``<prefix>.<tenant>.events``.

Every state change of a run writes its event to the ``outbox`` table in the
transaction of the change. This relay ships those rows to Kafka, in id order,
keyed ``<tenant>:<run_id>`` (one run's events share a partition and stay in
order), with CloudEvents binary-binding headers (``ce_id`` is the row id, for
consumers that dedupe; ``ce_traceparent``/``ce_tracestate``, the distributed-tracing
extension, when the run was admitted with a trace context). A row is marked published only after the broker
acknowledged it, so a crash anywhere repeats events and never loses one.

Which rows: ``published_at IS NULL`` and ``txid`` below the snapshot horizon
(``pg_snapshot_xmin(pg_current_snapshot())``). There is no "last id" cursor:
transactions commit out of id order, and a cursor skips the row of a
transaction that drew a lower id but committed later. The horizon makes each
read a prefix of history that can no longer change: a row is read only once
every transaction older than its own has ended. See docs/internals/outbox.md.

One relay is active at a time: the one holding a session advisory lock on a
dedicated, direct connection (``POIMEN_LOCK_DATABASE_URL``). Others stand by
and take over within ``POIMEN_OUTBOX_STANDBY_INTERVAL`` of the lock's release,
which Postgres does exactly when the holder's process or connection dies. The
active relay checks in ``pg_locks`` that it still holds the lock before every
batch, while waiting for acknowledgements, and before marking a batch, so a
relay that lost it publishes at most the batch in flight.

An event too large to publish is published reduced: its envelope (id, type,
tenant, run, goal, parent, time) with ``data`` cut to its ``run_id`` and
``type``, marked ``"data_dropped": true`` with its size in ``event_bytes``. An
event over the producer's ``message.max.bytes`` or its topic's
``max.message.bytes`` (read once per topic) is reduced before it is produced;
one the producer or the broker refuses for its size anyway (a limit lowered
since) is reduced then, with no backoff. An event whose reduced form is refused
too is marked published without being published, logged and counted
(``poimen_outbox_undeliverable_total``): it is never retried forever and never
holds the others up. See docs/operations/outbox.md.

Run it as ``python -m bridge.outbox`` (the Procfile's ``outbox``). It imports
nothing from ``app`` or ``workers``: its SQL is its own.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from confluent_kafka import KafkaError, KafkaException, Message, Producer
from confluent_kafka.admin import AdminClient
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
)

from lease import bound_lock_session, lock_connect_kwargs, probe_lock
from lease import problems as lease_problems
from poimenconfig import LeaseSettings, OutboxSettings, outbox_settings

from .kafka import SIZE_ERRORS, describe, kafka_headers, max_message_bytes, message_size
from .process import backoff_delay, configure_logging, serve
from .topics import ensure_topics, events_topic, topic_max_message_bytes

log = logging.getLogger("poimen.outbox")

# The relay's advisory lock: pg_advisory_lock(OUTBOX_LOCK_NAMESPACE, OUTBOX_LOCK_KEY).
# Worker boots use (0x504F494D "POIM", lock_key); "POOB" keeps the two apart.
OUTBOX_LOCK_NAMESPACE = 0x504F4F42
OUTBOX_LOCK_KEY = 1
LOCK_APPLICATION = "poimen-outbox-lock"
SPECVERSION = "1.0"
# Room left under the producer's message.max.bytes for a record's framing when an
# event is measured before it is produced (the record batch and record headers).
RECORD_OVERHEAD = 128

# The event, built by Postgres: row_to_json keeps the documented key order
# (docs/guide/events.schema.json) and is compact; the relay passes the text through.
READ_SQL = """
SELECT o.id,
       t.name,
       t.name || ':' || o.run_id::text,
       o.event_type,
       o.run_id::text,
       e.occurred_at,
       row_to_json(e)::text,
       r.traceparent,
       r.tracestate
  FROM outbox o
  JOIN tenants t ON t.id = o.tenant_id
  LEFT JOIN runs r ON r.id = o.run_id
 CROSS JOIN LATERAL (
       SELECT o.id::text AS event_id,
              o.event_type AS type,
              t.name AS tenant,
              o.run_id,
              r.goal_id,
              r.parent_run_id,
              to_char(o.created_at AT TIME ZONE 'UTC',
                      'YYYY-MM-DD"T"HH24:MI:SS.US"Z"') AS occurred_at,
              o.payload AS data) e
 WHERE o.published_at IS NULL
   -- The horizon: every transaction older than this one has ended, so no row
   -- can still appear below it. Rows of younger, open transactions wait.
   AND o.txid < pg_snapshot_xmin(pg_current_snapshot())
 ORDER BY o.id
 LIMIT %s
"""

# How the read is planned, for its transaction only (``is_local``: a transaction-mode
# pooler hands the server connection on with nothing changed). A published event
# leaves the unpublished index only at the next vacuum; until then its entry is
# dead. A plain index scan walks the index in id order, stops at LIMIT and marks
# the dead entries it passes, so the next read skips them; a bitmap scan, which
# the planner picks whenever its statistics say few rows are unpublished, marks
# nothing and reads every dead entry and its heap page again on every read (and a
# sequential scan, its pick for a small table, reads every row). In a
# burst of 5,000 runs that was 27,000 dead entries and 5-7 ms per read, the
# relay's read the largest single cost in Postgres (docs/internals/outbox.md).
READ_PLAN = ("SELECT set_config('enable_bitmapscan', 'off', true), "
             "set_config('enable_seqscan', 'off', true)")


def _scalar(cursor: psycopg.Cursor[tuple[Any, ...]]) -> Any:
    """The first column of the statement's one row."""
    row = cursor.fetchone()
    if row is None:
        raise RuntimeError("the statement returned no row")
    return row[0]


def read_batch(conn: psycopg.Connection, limit: int,
               prefix: str = "") -> list[tuple[Any, ...]]:
    """The next ``limit`` unpublished events, oldest first, read on ``conn`` (in
    autocommit) by walking the unpublished index in order (``READ_PLAN``), in one
    round trip. ``prefix`` is for tests: ``EXPLAIN ...`` shows the plan the relay gets."""
    with conn.pipeline(), conn.transaction():
        conn.execute(READ_PLAN)
        cursor = conn.execute(prefix + READ_SQL, [limit])
    return cursor.fetchall()


@dataclass(frozen=True)
class Event:
    """One outbox row as ``READ_SQL`` reads it: what the relay produces."""

    id: int
    tenant: str
    key: str
    type: str
    run_id: str
    occurred_at: str
    value: str  # the event's JSON (events.schema.json), built by Postgres
    traceparent: str | None
    tracestate: str | None

    def headers(self) -> list[tuple[str, str]]:
        """The CloudEvents Kafka binary binding's headers of this event."""
        headers = [
            ("ce_id", str(self.id)), ("ce_type", self.type),
            ("ce_source", f"/poimen/{self.tenant}/runs/{self.run_id}"),
            ("ce_specversion", SPECVERSION), ("ce_time", self.occurred_at),
            ("content-type", "application/json"),
        ]
        # The CloudEvents distributed-tracing extension: the run's W3C Trace
        # Context (validated at admission), as attributes, not in the data.
        if self.traceparent:
            headers.append(("ce_traceparent", self.traceparent))
            if self.tracestate:
                headers.append(("ce_tracestate", self.tracestate))
        return headers


def reduced_value(value: str, size: int) -> bytes:
    """``value``'s envelope without its data (but for ``run_id`` and ``type``), marked
    ``"data_dropped": true`` with the event's size in bytes (``event_bytes``)."""
    event = json.loads(value)
    data = event.get("data") or {}
    event["data"] = {"run_id": data.get("run_id", event.get("run_id")),
                     "type": data.get("type", event.get("type"))}
    event["data_dropped"] = True
    event["event_bytes"] = size
    return json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode()


# The relay's two writes are the run-state store's (app/state/outbox.py), installed
# in the database as functions, so this process imports nothing of app/.
# Events Kafka acknowledged, by id.
MARK_PUBLISHED = "SELECT poimen_outbox_mark_published(%s::bigint[])"

# Published events older than the retention, a batch at a time: how many went.
PRUNE_PUBLISHED = "SELECT poimen_outbox_prune(%s::float8, %s::integer)"


# The probe runs on the lock connection itself and asks the server, not the
# client library: psycopg only notices a dead connection when a query fails,
# and a lock can be gone while the client still looks connected.
LOCK_HELD_SQL = f"""
SELECT EXISTS (
    SELECT 1 FROM pg_locks
     WHERE locktype = 'advisory'
       AND classid = CAST({OUTBOX_LOCK_NAMESPACE} AS oid)
       AND objid = CAST({OUTBOX_LOCK_KEY} AS oid)
       AND objsubid = 2
       AND granted
       AND pid = pg_backend_pid()
       AND database = (SELECT oid FROM pg_database WHERE datname = current_database()))
"""

# Every tenant, those with nothing pending at 0: a restarted relay's lag series
# exist from its first scrape, not from a tenant's next event.
PENDING_SQL = """
SELECT t.name, count(o.id), coalesce(extract(epoch FROM now() - min(o.created_at)), 0)
  FROM tenants t LEFT JOIN outbox o ON o.tenant_id = t.id AND o.published_at IS NULL
 GROUP BY t.name
"""



class OutboxMetrics:
    """The relay's Prometheus metrics, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)
        self.pending = Gauge("poimen_outbox_pending",
                             "Outbox lag: unpublished events, by tenant.", ["tenant"], registry=r)
        self.oldest_age = Gauge("poimen_outbox_oldest_age_seconds",
                                "Outbox lag: age of the oldest unpublished event, by tenant.",
                                ["tenant"], registry=r)
        self.published = Counter("poimen_outbox_published_total",
                                 "Events the broker acknowledged and this relay marked published.",
                                 registry=r)
        self.errors = Counter("poimen_outbox_publish_errors_total",
                              "Events whose produce failed (they are sent again, or reduced "
                              "when refused for size), by error.",
                              ["error"], registry=r)
        self.reduced = Counter("poimen_outbox_reduced_total",
                               "Events published reduced to their envelope for their size, by "
                               "reason: limit (over the producer's message.max.bytes or the "
                               "topic's max.message.bytes), refused (refused by the producer "
                               "or the broker for its size).",
                               ["reason"], registry=r)
        self.undeliverable = Counter("poimen_outbox_undeliverable_total",
                                     "Events refused for their size even reduced: marked "
                                     "published without being published (logged).",
                                     registry=r)
        self.active = Gauge("poimen_outbox_active",
                            "1 while this relay holds the outbox lock and publishes, else 0.",
                            registry=r)
        self.in_flight = Gauge("poimen_outbox_in_flight",
                               "Events produced and not yet acknowledged by the broker.",
                               registry=r)
        self.reads = Counter("poimen_outbox_reads_total",
                             "Reads of the outbox by the active relay (empty ones included).",
                             registry=r)
        self.pruned = Counter("poimen_outbox_pruned_total",
                              "Published events deleted after POIMEN_OUTBOX_RETENTION.",
                              registry=r)
        self.batch_seconds = Histogram("poimen_outbox_batch_seconds",
                                       "Read, produce, acknowledgement and mark of one batch.",
                                       registry=r)


class RelayLock:
    """The advisory lock that makes one relay active, on a dedicated direct connection.

    A lease like a worker boot's (``lease.py``): the session gets the server's
    bound T_s (``idle_session_timeout``), a thread renews it with a probe every
    ``POIMEN_BOOT_PROBE_INTERVAL`` (each with a deadline), and the relay treats
    the lock as gone once no probe started within T_c confirmed it, so a relay
    cut off from Postgres stops publishing before the standby can take over.
    """

    def __init__(self, dsn: str, name: str, settings: LeaseSettings | None = None):
        self.dsn = dsn
        self.name = name
        self.settings = settings or LeaseSettings()
        self.conn: psycopg.Connection | None = None
        self.backend_pid: int | None = None
        self.confirmed_at = 0.0  # time.monotonic() at the start of the last confirming probe
        self.server_bound = ""
        self._mutex = threading.Lock()
        self._renewing: threading.Event | None = None

    def try_acquire(self) -> bool:
        """Take the lock if it is free; connect first if needed. Raise on a database error."""
        with self._mutex:
            started = time.monotonic()
            if self.conn is None or self.conn.closed:
                self.conn = psycopg.connect(self.dsn, application_name=self.name,
                                            **lock_connect_kwargs(self.settings))
                self.server_bound = bound_lock_session(self.conn, self.settings)
                self.backend_pid = self.conn.info.backend_pid
            got = _scalar(self.conn.execute("SELECT pg_try_advisory_lock(%s, %s)",
                                            [OUTBOX_LOCK_NAMESPACE, OUTBOX_LOCK_KEY]))
            if got:
                self.confirmed_at = started
                self._start_renewing()
            return bool(got)

    def held(self) -> bool:
        """Ask Postgres, within the probe's deadline, whether this connection holds the lock."""
        with self._mutex:
            if self.conn is None or self.conn.closed:
                return False
            started = time.monotonic()
            held = probe_lock(self.conn, LOCK_HELD_SQL, self.settings.probe_timeout)
            if held:
                self.confirmed_at = started
                return True
            log.warning("outbox lock %s", "not held" if held is False else
                        f"not confirmed within {self.settings.probe_timeout:g}s")
            return False

    def confirmed(self) -> bool:
        """Whether a probe started within T_c found the lock held (no round trip)."""
        return self.conn is not None and \
            time.monotonic() < self.confirmed_at + self.settings.client_seconds

    def _start_renewing(self) -> None:
        if self._renewing is not None:
            return
        stop = self._renewing = threading.Event()
        threading.Thread(target=self._renew, args=(stop,), name="outbox-lease",
                         daemon=True).start()

    def _renew(self, stop: threading.Event) -> None:
        # Every probe is a statement, so every probe renews idle_session_timeout.
        while not stop.wait(self.settings.probe_interval):
            if not self.held():
                return  # the relay sees the lease lapse (confirmed() turns false) and steps down

    def release(self) -> None:
        """Close the connection, which releases the lock if it is still held."""
        if self._renewing is not None:
            self._renewing.set()
            self._renewing = None
        with self._mutex:
            if self.conn is not None:
                try:
                    self.conn.close()
                except Exception:  # noqa: BLE001 - closing a broken connection may raise
                    pass
            self.conn = None
            self.backend_pid = None
            self.confirmed_at = 0.0


# A statement into a silent path fails within seconds instead of hanging until TCP
# gives up (~15 min); libpq ignores these on unix sockets.
_WORK_SOCKET: dict[str, Any] = {"connect_timeout": 10, "keepalives": 1, "keepalives_idle": 5,
                "keepalives_interval": 2, "keepalives_count": 3, "tcp_user_timeout": 10000}


class LockLost(Exception):
    """This relay no longer holds the outbox lock: stop publishing."""


@dataclass
class Deliveries:
    """Delivery reports of one batch."""

    outstanding: int = 0
    acked: list[int] = field(default_factory=list)
    failed: dict[int, KafkaError] = field(default_factory=dict)
    events: dict[int, Event] = field(default_factory=dict)  # what was produced, by row id
    reduced: dict[int, str] = field(default_factory=dict)  # row id -> why it went reduced
    undeliverable: list[int] = field(default_factory=list)  # refused even reduced

    def report(self, row_id: int, err: KafkaError | None, _msg: Message) -> None:
        self.outstanding -= 1
        if err is None:
            self.acked.append(row_id)
        else:
            self.failed[row_id] = err

    def to_mark(self) -> tuple[list[int], list[int]]:
        """The acknowledged events to mark published, and the undeliverable ones.

        Not an acknowledged event of a run after one of its events that failed: it
        goes out again after that one, so the run's last copies stay in order.
        """
        first_failed: dict[str, int] = {}
        for row_id in self.failed:
            key = self.events[row_id].key
            first_failed[key] = min(row_id, first_failed.get(key, row_id))
        acked = [row_id for row_id in self.acked
                 if row_id < first_failed.get(self.events[row_id].key, row_id + 1)]
        return acked, list(self.undeliverable)


class OutboxRelay:
    """Ship outbox rows to Kafka while holding the outbox lock; stand by otherwise."""

    def __init__(self, config: OutboxSettings, metrics: OutboxMetrics | None = None):
        self.config = config
        self.metrics = metrics or OutboxMetrics()
        self.lock = RelayLock(config.lock_database_url, f"{LOCK_APPLICATION}/{os.getpid()}",
                              config.lease)
        self._stop = threading.Event()
        self._stop_at: float | None = None
        self._conn: psycopg.Connection | None = None
        self._producer: Producer | None = None
        self._fatal: KafkaError | None = None
        self._admin: AdminClient | None = None
        self._topics: dict[str, str] = {}  # tenant -> events topic known to exist
        # topic -> the largest event (value, key and headers) produced to it whole: the
        # producer's message.max.bytes or the topic's max.message.bytes, less the framing.
        self._limits: dict[str, int] = {}
        self._active = False
        self._standing_by = False
        self._last_probe = 0.0
        self._next_prune = 0.0
        self._failures = 0
        self._published = 0
        self._tenants_seen: set[str] = set()
        # The producer's own limit (value, key and headers), less the record's framing.
        self._max_message_bytes = max_message_bytes(config.kafka) - RECORD_OVERHEAD
        # Events the broker refused for size in a request shared with others (it refuses
        # the whole request): each goes in a request of its own next time, so the
        # refusal names the event too large and spares its neighbours.
        self._alone: set[int] = set()
        self._unread: set[str] = set()  # tenants whose topic the broker did not answer for

    # -- lifecycle ---------------------------------------------------------------------------

    def stop(self, *_: Any) -> None:
        """Ask the relay to finish (and mark) the batch in flight, then exit."""
        if self._stop_at is None:
            self._stop_at = time.monotonic()
        self._stop.set()

    @property
    def _shutdown_deadline(self) -> float | None:
        # Leave time to mark the batch and close within the grace period.
        if self._stop_at is None:
            return None
        return self._stop_at + max(self.config.shutdown_grace - 5.0, 1.0)

    def run(self) -> None:
        """Publish (or stand by) until ``stop``."""
        cfg = self.config
        log.info("outbox relay: topics %s.<tenant>.events, batch %d, retention %s; kafka %s",
                 cfg.prefix, cfg.batch_size,
                 "never" if cfg.retention is None else f"{cfg.retention:.0f}s",
                 describe(cfg.kafka))
        helpers = [threading.Thread(target=self._watch_lag, name="outbox-lag", daemon=True)]
        for thread in helpers:
            thread.start()
        last_progress = time.monotonic()
        attempt = 0
        try:
            while not self._stop.is_set():
                try:
                    if not self._active and not self._elect():
                        self._stop.wait(cfg.standby_interval)
                        continue
                    shipped = self._ship_batch()
                    attempt = 0
                    if shipped < cfg.batch_size:
                        self._prune_if_due()
                        if shipped == 0:
                            self._stop.wait(cfg.poll_interval)
                        elif cfg.batch_linger_ms > 0:
                            # Not full: the events come a few at a time. Each batch pays a
                            # read, a round trip to the broker and a marking commit, so
                            # let the next one gather (a full batch goes on at once).
                            self._stop.wait(cfg.batch_linger_ms / 1000)
                except LockLost as lost:
                    log.warning("lost the outbox lock (%s): standing by", lost)
                    self._step_down()
                except psycopg.Error as err:
                    attempt += 1
                    delay = backoff_delay(attempt, 0.5, cfg.backoff_max)
                    log.warning("database error, retrying in %.1fs: %s", delay, err)
                    self._close_work_connection()
                    self._stop.wait(delay)
                except Exception:  # noqa: BLE001 - a bug must not end the relay's duty
                    attempt += 1
                    delay = backoff_delay(attempt, 0.5, cfg.backoff_max)
                    log.exception("unexpected error, retrying in %.1fs", delay)
                    self._step_down()
                    self._close_work_connection()
                    self._stop.wait(delay)
                now = time.monotonic()
                if now - last_progress >= cfg.progress_interval:
                    last_progress = now
                    log.info("progress: %s, published %d",
                             "active" if self._active else "standby", self._published)
        finally:
            self._step_down(quiet=True)
            self._close_work_connection()
            log.info("outbox relay stopped (published %d)", self._published)

    def _elect(self) -> bool:
        """Try to become the active relay."""
        try:
            got = self.lock.try_acquire()
        except psycopg.Error as err:
            log.warning("cannot reach the lock database: %s", err)
            self.lock.release()
            return False
        if got:
            self._active, self._standing_by = True, False
            self._last_probe = time.monotonic()
            self.metrics.active.set(1)
            log.info("active: holding the outbox lock (lock backend pid %s)",
                     self.lock.backend_pid)
            self._make_producer()  # connects in the background, ready for the first batch
        elif not self._standing_by:
            self._standing_by = True
            self.metrics.active.set(0)
            log.info("standby: another relay holds the outbox lock")
        return got

    def _step_down(self, quiet: bool = False) -> None:
        """Stop publishing: drop what the producer still holds and let the lock go."""
        if self._producer is not None:
            # Nothing more of this relay's reaches the broker: at most the batch in
            # flight was published by a relay that had lost the lock.
            self._producer.purge(in_queue=True, in_flight=True)
            self._producer.poll(0)
            self._producer = None
        if self._active and not quiet:
            log.info("standby")
        self._active = False
        self._alone.clear()
        self.metrics.active.set(0)
        self.metrics.in_flight.set(0)
        self.lock.release()

    # -- one batch ---------------------------------------------------------------------------

    def _work_connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            # No prepared statements: DATABASE_URL may be a transaction-mode pooler.
            self._conn = psycopg.connect(self.config.database_url, autocommit=True,
                                         application_name=f"poimen-outbox/{os.getpid()}",
                                         prepare_threshold=None, **_WORK_SOCKET)
        return self._conn

    def _close_work_connection(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:  # noqa: BLE001
                pass
        self._conn = None

    def _confirm_lock(self, always: bool = False) -> None:
        """Raise ``LockLost`` unless the lease is confirmed (``always``: by a probe now).

        Between probes the lease thread's last confirmation counts, for at most
        T_c: a relay whose probes go unanswered stops publishing before the
        server lets the standby in (T_s).
        """
        if not self.lock.confirmed():
            raise LockLost(f"not confirmed within {self.config.lease.client_seconds:g}s")
        now = time.monotonic()
        if always or now - self._last_probe >= self.config.lock_check_interval:
            if not self.lock.held():
                raise LockLost("pg_locks no longer shows it for the lock connection")
            self._last_probe = now

    def _make_producer(self) -> Producer:
        if self._producer is None:
            self._fatal = None
            settings: dict[str, Any] = {
                # Unbounded: during a broker outage the batch waits in the producer
                # and goes out in order when the broker is back. A finite timeout
                # would fail part of a batch and let later events of a run overtake
                # its earlier ones when re-sent.
                "message.timeout.ms": 0,
                "linger.ms": 5,
                **self.config.kafka,
                "client.id": "poimen-outbox",
                "enable.idempotence": True,
                "acks": "all",
                "error_cb": self._on_error,
                # librdkafka's own lines through our logging (LOG_FORMAT); served by poll().
                "logger": logging.getLogger("rdkafka"),
            }
            self._producer = Producer(settings)
            admin_settings: dict[str, Any] = {**self.config.kafka,
                                              "logger": logging.getLogger("rdkafka")}
            self._admin = AdminClient(admin_settings)
        return self._producer

    @property
    def _admin_client(self) -> AdminClient:
        if self._admin is None:
            raise RuntimeError("no admin client: it is made with the producer")
        return self._admin

    def _on_error(self, err: KafkaError) -> None:
        if err.fatal():
            self._fatal = err
            log.error("producer fatal error (it will be recreated): %s", err)
        elif err.code() not in (KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN):
            log.warning("producer: %s", err)

    def _topic(self, tenant: str) -> str:
        topic = self._topics.get(tenant)
        if topic is None:
            topic = self._topics[tenant] = events_topic(self.config.prefix, tenant)
            # Declared by `flask --app app topics declare`; created here if missing
            # rather than left to broker auto-creation (often off, wrong partitions).
            # One attempt per tenant and process: during a broker outage this
            # must not cost every batch a timeout.
            try:
                ensure_topics(self._admin_client, [topic], self.config.topic_partitions, timeout=5)
            except Exception as err:  # noqa: BLE001 - KafkaException or a timeout
                log.warning("could not make sure %s exists (%s); producing to it anyway",
                            topic, str(err) or type(err).__name__)
                # Its limit is read once the broker acknowledges a batch again.
                self._unread.add(tenant)
            # The topic's own limit, when it is below the producer's: an event over it is
            # reduced before it is produced, in its place, rather than refused by the
            # broker after the run's later events were acknowledged. Unknown (no
            # DescribeConfigs), the broker's refusal still reduces it (_publish).
            limit = self._max_message_bytes
            if tenant not in self._unread:
                try:
                    limit = min(limit,
                                topic_max_message_bytes(self._admin_client, topic) - RECORD_OVERHEAD)
                except Exception as err:  # noqa: BLE001 - KafkaException or a timeout
                    log.warning("could not read %s's max.message.bytes (%s); events over the "
                                "producer's limit are reduced, others if the broker refuses "
                                "them", topic, str(err) or type(err).__name__)
            self._limits[topic] = limit
            log.info("%s: events over %d bytes are published reduced", topic, limit)
        return topic

    def _ship_batch(self) -> int:
        """Publish one batch and mark what the broker acknowledged; return the rows read."""
        cfg = self.config
        self._confirm_lock()
        started = time.monotonic()
        rows = read_batch(self._work_connection(), cfg.batch_size)
        self.metrics.reads.inc()
        if not rows:
            return 0
        producer = self._make_producer()
        deliveries = Deliveries()
        for row in rows:
            if not self._publish(producer, deliveries, Event(*row)):
                break  # a fatal producer error or the end of the shutdown's grace
        self.metrics.in_flight.set(deliveries.outstanding)
        self._await(producer, deliveries)
        self.metrics.in_flight.set(0)
        # Only a relay that still holds the lock marks; a relay that lost it has
        # published this batch once more, which consumers dedupe on ce_id.
        self._confirm_lock(always=True)
        acked, undeliverable = deliveries.to_mark()
        if acked or undeliverable:
            self._work_connection().execute(MARK_PUBLISHED, [acked + undeliverable])
            self._published += len(acked)
            self.metrics.published.inc(len(acked))
            for row_id in acked:
                if row_id in deliveries.reduced:
                    self.metrics.reduced.labels(deliveries.reduced[row_id]).inc()
            self.metrics.undeliverable.inc(len(undeliverable))
            self._alone.difference_update(acked, undeliverable)
            if acked and self._unread:  # the broker answers again: make sure of those topics
                for tenant in self._unread:
                    self._topics.pop(tenant, None)
                self._unread.clear()
        self.metrics.batch_seconds.observe(time.monotonic() - started)
        # Refused for size beside others: each goes alone next time, at once (a
        # backoff would not make it fit, and would hold every other event up).
        too_large = {row_id for row_id, err in deliveries.failed.items()
                     if err.code() in SIZE_ERRORS}
        self._alone |= too_large
        for row_id in too_large:
            # The topic's limit may have been lowered since it was read: read it again.
            self._topics.pop(deliveries.events[row_id].tenant, None)
        failed = {row_id: err for row_id, err in deliveries.failed.items()
                  if row_id not in too_large}
        if too_large:
            self._count_errors(deliveries.failed[row_id] for row_id in too_large)
        if failed and not self._stop.is_set():
            self._failed(failed)
        elif not failed:
            self._failures = 0
        return len(rows)

    def _publish(self, producer: Producer, deliveries: Deliveries, event: Event) -> bool:
        """Produce ``event``, reduced if it is too large; False: stop the batch here.

        An event over its topic's limit is reduced before it is produced. One the
        broker refused in a request shared with others (``_alone``) is sent whole in a
        request of its own, after what went before it is acknowledged, so that the
        broker judges it alone. A refusal certain to be the event's own (the
        producer's, at ``produce``, or the broker's of a request of its own) has it
        sent reduced in its place; the reduced form refused too makes it undeliverable.
        """
        alone = event.id in self._alone
        deliveries.events[event.id] = event
        topic = self._topic(event.tenant)
        limit = self._limits.get(topic, self._max_message_bytes)
        headers = event.headers()
        key = event.key.encode()
        value = event.value.encode()
        size, reason = len(value), None
        if not alone and message_size(value, key, headers) > limit:
            value, reason = reduced_value(event.value, size), "limit"
        while True:
            if alone and not self._await(producer, deliveries):
                return False
            error = self._produce(producer, deliveries, topic, event.id, key, value, headers)
            if error is None and alone:
                if not self._await(producer, deliveries):
                    return False
                error = deliveries.failed.pop(event.id, None)
            if error is None:
                if reason is not None:
                    deliveries.reduced[event.id] = reason
                    log.warning("event %d (%s of run %s, tenant %s): %d bytes, %s; sent "
                                "reduced to its envelope", event.id, event.type, event.run_id,
                                event.tenant, size,
                                f"over the limit ({limit} bytes with room for the record: the "
                                "producer's message.max.bytes or the topic's "
                                "max.message.bytes)" if reason == "limit"
                                else "refused for its size")
                return True
            if error.code() not in SIZE_ERRORS:
                deliveries.failed[event.id] = error
                return True
            self._count_errors([error])
            self._topics.pop(event.tenant, None)  # its limit is read again for the next one
            if reason is not None:
                deliveries.undeliverable.append(event.id)
                log.error("event %d (%s of run %s, tenant %s): %d bytes, refused for its size "
                          "even reduced to its envelope (%d bytes): %s; marked published "
                          "without being published", event.id, event.type, event.run_id,
                          event.tenant, size, len(value), error)
                return True
            value, reason = reduced_value(event.value, size), "refused"

    def _produce(self, producer: Producer, deliveries: Deliveries, topic: str, row_id: int,
                 key: bytes, value: bytes, headers: list[tuple[str, str]]) -> KafkaError | None:
        """Hand one message to the producer; the error if it refused it at once."""
        while True:
            try:
                producer.produce(topic, value, key, headers=kafka_headers(headers),
                                 on_delivery=functools.partial(deliveries.report, row_id))
                deliveries.outstanding += 1
                return None
            except BufferError:
                producer.poll(0.05)
            except KafkaException as err:
                refused = err.args[0]
                return refused if isinstance(refused, KafkaError) else KafkaError(
                    KafkaError._FAIL, str(refused))

    def _await(self, producer: Producer, deliveries: Deliveries) -> bool:
        """Wait until every message produced so far is acknowledged or failed.

        Returns False early (purging what is left) on a fatal producer error or when
        a shutdown's grace runs out; raises ``LockLost`` if the lock goes meanwhile.
        """
        while deliveries.outstanding > 0:
            try:
                producer.poll(0.05)
            except KafkaException as err:  # raised by poll once the producer is fatally broken
                if not err.args[0].fatal():
                    raise
                self._fatal = err.args[0]
            if self._fatal is not None:
                log.warning("producer failed fatally (%s): %d events go out again with a new "
                            "producer", self._fatal, deliveries.outstanding)
                break
            deadline = self._shutdown_deadline
            if deadline is not None and time.monotonic() >= deadline:
                log.warning("shutting down with %d events unacknowledged; they stay "
                            "unpublished and go out again", deliveries.outstanding)
                break
            self._confirm_lock()
        finished = deliveries.outstanding == 0
        if not finished:
            producer.purge(in_queue=True, in_flight=True)
            producer.poll(0)  # serves the purged messages' reports
        if self._fatal is not None:
            self._producer = None  # an idempotent producer cannot continue after a fatal error
            return False
        return finished

    def _count_errors(self, errors: Iterable[object]) -> None:
        for err in errors:
            name = err.name() if isinstance(err, KafkaError) else type(err).__name__
            self.metrics.errors.labels(name).inc()

    def _failed(self, failed: dict[int, KafkaError]) -> None:
        """Count the batch's failures and back off before the next batch."""
        self._count_errors(failed.values())
        for err in failed.values():
            if isinstance(err, KafkaError) and err.code() in (
                    KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC):
                self._topics.clear()  # try creating the topics again
        self._failures += 1
        first_id, first = min(failed.items())
        delay = backoff_delay(self._failures, 0.5, self.config.backoff_max)
        log.warning("%d events not published (first: id %d, %s); retrying in %.1fs",
                    len(failed), first_id, first, delay)
        self._stop.wait(delay)

    # -- retention ---------------------------------------------------------------------------

    def _prune_if_due(self) -> None:
        cfg = self.config
        now = time.monotonic()
        if cfg.retention is None or now < self._next_prune:
            return
        self._next_prune = now + cfg.prune_interval
        total, budget = 0, now + 1.0
        # Small deletes, each its own transaction, so pruning never holds locks on
        # many rows nor delays the next batch for long.
        while time.monotonic() < budget and not self._stop.is_set():
            deleted = _scalar(self._work_connection().execute(
                PRUNE_PUBLISHED, [cfg.retention, cfg.prune_batch]))
            total += deleted
            if deleted < cfg.prune_batch:
                break
        if total:
            self.metrics.pruned.inc(total)
            log.info("pruned %d published events older than %.0fs", total, cfg.retention)

    # -- lag ---------------------------------------------------------------------------------

    def _watch_lag(self) -> None:
        """Publish pending rows and the oldest one's age per tenant, active or standby.

        A standby reports it too: if the active relay is frozen, the standby's
        numbers are the ones that show the stall.
        """
        conn: psycopg.Connection | None = None
        while True:
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(self.config.database_url, autocommit=True,
                                           application_name=f"poimen-outbox-lag/{os.getpid()}",
                                           prepare_threshold=None, **_WORK_SOCKET)
                rows = conn.execute(PENDING_SQL).fetchall()
                seen = set()
                for tenant, count, age in rows:
                    seen.add(tenant)
                    self.metrics.pending.labels(tenant).set(count)
                    self.metrics.oldest_age.labels(tenant).set(float(age or 0))
                for tenant in self._tenants_seen - seen:
                    self.metrics.pending.labels(tenant).set(0)
                    self.metrics.oldest_age.labels(tenant).set(0)
                self._tenants_seen |= seen
            except psycopg.Error as err:
                log.warning("outbox lag not measured: %s", err)
                if conn is not None:
                    conn.close()
                conn = None
            admin = self._admin
            if admin is not None:
                admin.poll(0)  # serves its librdkafka log lines (nothing else polls it)
            if self._stop.wait(self.config.lag_interval):
                break
        if conn is not None:
            conn.close()


def main() -> int:
    """Run the outbox relay until SIGTERM or SIGINT."""
    configure_logging()
    config = outbox_settings()
    problems = lease_problems(config.lease)
    if problems:
        log.critical("poimen outbox refuses to start: %s", "; ".join(problems))
        raise SystemExit(1)
    relay = OutboxRelay(config)
    serve(relay, relay.metrics.registry, config.metrics_port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
