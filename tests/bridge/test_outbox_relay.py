"""The outbox relay over real processes: real Postgres, a real Kafka-protocol broker, and
``python -m bridge.outbox`` as a subprocess started from the Procfile's command line (plus
gunicorn and a Celery worker where runs really execute).

Each test has its own tenant and topic prefix, so nothing it reads was written by
another test. Events are written either by real runs or, where a test needs to
control transactions, by plain INSERTs into ``outbox`` as the app's writers do.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import psycopg
import pytest
import requests
from confluent_kafka import Consumer, TopicPartition

from app.state.executor import on_session
from bridge.outbox import OUTBOX_LOCK_KEY, OUTBOX_LOCK_NAMESPACE
from bridge.topics import declare_topics
from poimen_dev import _noida_binary
from poimen_dev.platform import procfile_commands
from poimenconfig import libpq_url, outbox_settings, parse_retention
from tests import kafka_topics
from tests.processes import (
    BIN,
    ROOT,
    Process,
    free_port,
    metric,
    start_web,
    start_worker,
    wait_until,
)

pytestmark = pytest.mark.slow
SCHEMA = json.loads((ROOT / "docs" / "guide" / "events.schema.json").read_text())


# -- helpers -----------------------------------------------------------------------------------


@dataclass
class Relay:
    proc: Process
    metrics_url: str

    def metric(self, name: str, **labels: str) -> float:
        return metric(self.metrics_url, name, **labels)

    @property
    def published(self) -> float:
        return self.metric("poimen_outbox_published_total")

    @property
    def active(self) -> bool:
        return self.metric("poimen_outbox_active") == 1


class TopicReader:
    """Reads one topic from the start, every partition, accumulating messages."""

    def __init__(self, bootstrap: str, topic: str):
        self.topic = topic
        self.messages: list = []
        self.consumer = Consumer({"bootstrap.servers": bootstrap,
                                  "group.id": f"reader-{uuid.uuid4()}",
                                  "auto.offset.reset": "earliest", "enable.auto.commit": False,
                                  "session.timeout.ms": 6000})
        meta = self.consumer.list_topics(topic, timeout=10).topics[topic]
        assert meta.error is None, f"{topic}: {meta.error}"
        self.partitions = sorted(meta.partitions)
        self.consumer.assign([TopicPartition(topic, p, 0) for p in self.partitions])

    def drain(self, seconds: float = 0.2) -> list:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            msg = self.consumer.poll(0.05)
            if msg is not None and not msg.error():
                self.messages.append(msg)
        return self.messages

    def read_to_end(self, timeout: float = 15) -> list:
        """Read until every partition's position reaches its current high watermark."""
        ends = {p: self.consumer.get_watermark_offsets(TopicPartition(self.topic, p),
                                                       timeout=10, cached=False)[1]
                for p in self.partitions}

        def caught_up() -> bool:
            self.drain(0.1)
            positions = {tp.partition: tp.offset
                         for tp in self.consumer.position(
                             [TopicPartition(self.topic, p) for p in self.partitions])}
            return all(ends[p] == 0 or positions[p] >= ends[p] for p in self.partitions)

        wait_until(caught_up, timeout=timeout, what=f"reading {self.topic} to its end")
        return self.messages

    def ce_ids(self) -> list[int]:
        return [int(headers(m)["ce_id"]) for m in self.messages]

    def wait_for_ids(self, ids: set[int], timeout: float = 30) -> list:
        def arrived() -> bool:
            self.drain(0.1)
            return ids <= set(self.ce_ids())

        try:
            wait_until(arrived, timeout=timeout, interval=0.01, what="events on the topic")
        except AssertionError as err:
            raise AssertionError(f"{err}; missing ce_ids {sorted(ids - set(self.ce_ids()))}, "
                                 f"topic has {sorted(set(self.ce_ids()))}") from None
        return self.messages

    def close(self) -> None:
        self.consumer.close()


def headers(msg) -> dict[str, str]:
    return {k: v.decode() for k, v in (msg.headers() or [])}


@dataclass
class World:
    """One test's world: a tenant, a topic prefix, a broker, relays started on demand."""

    database_url: str
    bootstrap: str
    env: dict[str, str]
    log_dir: Path
    tenant: str = ""
    tenant_id: int = 0
    relays: list[Relay] = field(default_factory=list)
    readers: list[TopicReader] = field(default_factory=list)
    others: list[Process] = field(default_factory=list)

    @property
    def prefix(self) -> str:
        return self.env["POIMEN_TOPIC_PREFIX"]

    @property
    def topic(self) -> str:
        return f"{self.prefix}.{self.tenant}.events"  # docs/guide/events.md, not the code

    def connect(self, autocommit: bool = True) -> psycopg.Connection:
        return psycopg.connect(libpq_url(self.database_url), autocommit=autocommit)

    def add_tenant(self, name: str | None = None) -> None:
        self.tenant = name or f"ob{uuid.uuid4().hex[:10]}"
        with self.connect() as conn:
            self.tenant_id = conn.execute("INSERT INTO tenants (name) VALUES (%s) RETURNING id",
                                          [self.tenant]).fetchone()[0]

    def declare(self, partitions: int = 2) -> None:
        declare_topics(self.bootstrap, self.prefix, [self.tenant], partitions)

    def start_relay(self, name: str | None = None, **env: str) -> Relay:
        port = free_port()
        name = name or f"outbox-{len(self.relays)}"
        # The Procfile's own command line, through a shell as honcho and Heroku run it.
        proc = Process(name, ["/bin/sh", "-c", f"exec {procfile_commands()['outbox']}"],
                       {**self.env, "METRICS_PORT": str(port), **env,
                        "PATH": f"{BIN}{os.pathsep}{self.env.get('PATH', '')}"},
                       self.log_dir).start()
        url = f"http://127.0.0.1:{port}/metrics"

        def answering() -> bool:
            if not proc.alive():
                raise AssertionError(f"{name} exited:\n{proc.log()[-3000:]}")
            return requests.get(url, timeout=1).ok

        wait_until(answering, timeout=30, what=f"{name} metrics on {url}")
        relay = Relay(proc, url)
        self.relays.append(relay)
        return relay

    def reader(self) -> TopicReader:
        reader = TopicReader(self.bootstrap, self.topic)
        self.readers.append(reader)
        return reader

    def table_ids(self, published: bool | None = None) -> set[int]:
        where = ("" if published is None
                 else " AND published_at IS NOT NULL" if published else " AND published_at IS NULL")
        with self.connect() as conn:
            return {r[0] for r in conn.execute(
                f"SELECT id FROM outbox WHERE tenant_id = %s{where}", [self.tenant_id])}


def insert_events(conn: psycopg.Connection, tenant_id: int, count: int = 1,
                  run_id: uuid.UUID | None = None, event_type: str = "run.test") -> list[int]:
    """Insert ``count`` events as the app's writers do (in ``conn``'s transaction)."""
    run_id = run_id or uuid.uuid4()
    rows = conn.execute(
        "INSERT INTO outbox (tenant_id, run_id, event_type, payload) "
        "SELECT %(t)s, %(r)s, %(e)s::text, jsonb_build_object('run_id', %(r)s::text, 'type', %(e)s::text, "
        "'n', n) FROM generate_series(1, %(c)s) AS n RETURNING id",
        {"t": tenant_id, "r": run_id, "e": event_type, "c": count}).fetchall()
    return sorted(r[0] for r in rows)


@pytest.fixture
def world(test_env, database_url, tmp_path):
    tag = uuid.uuid4().hex[:8]
    env = {
        **test_env,
        "POIMEN_TOPIC_PREFIX": f"ot{tag}",
        "POIMEN_OUTBOX_POLL_INTERVAL": "0.05",
        "POIMEN_OUTBOX_LAG_INTERVAL": "0.3",
        "POIMEN_OUTBOX_PROGRESS_INTERVAL": "5",
        "POIMEN_OUTBOX_TOPIC_PARTITIONS": "2",
    }
    w = World(database_url, test_env["KAFKA_BOOTSTRAP_SERVERS"], env, tmp_path)
    yield w
    for relay in w.relays:
        relay.proc.stop()
        # Shown by pytest when the test failed.
        print(f"--- {relay.proc.name} ---\n{relay.proc.log()[-6000:]}")
    for proc in w.others:
        proc.stop()
    for reader in w.readers:
        reader.close()
    kafka_topics.delete_under(w.bootstrap, w.prefix)


@pytest.fixture(scope="module")
def api(test_env, tmp_path_factory) -> str:
    proc, url = start_web(test_env, tmp_path_factory.mktemp("outbox-web"), workers=1, threads=4)
    yield url
    proc.stop()


def start_broker(data: Path, port: int, log_dir: Path) -> Process:
    """A private Kafka-protocol broker (noida-db) on ``port``, keeping its data in ``data``.

    The broker binary itself, not the ``noida-db`` wrapper script: stopping the
    wrapper's process group SIGKILLs the broker while it saves its data, and it
    then comes back without the messages it had acknowledged.
    """
    proc = Process("kafka-private", [_noida_binary(), "start", "--data-dir", str(data),
                                     "--host", "127.0.0.1", "--only", "kafka",
                                     "--kafka-port", str(port)], os.environ, log_dir).start()

    def listening() -> bool:
        if not proc.alive():
            raise AssertionError(f"the broker exited:\n{proc.log()[-3000:]}")
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True

    wait_until(listening, timeout=30, what=f"the private broker on port {port}")
    return proc


def start_ready_worker(world: World) -> Process:
    # Per test: the tables (worker_boots included) are emptied between tests.
    worker = start_worker(world.env, world.log_dir, name=f"worker-{len(world.others)}")
    world.others.append(worker)
    wait_until(lambda: "ready" in worker.log(), timeout=60, what="the Celery worker")
    return worker


def admit(api: str, token: str, workflow_ref: str = "echo", **fields) -> str:
    response = requests.post(f"{api}/v1/runs", headers={"Authorization": f"Bearer {token}"},
                             json={"workflow_ref": workflow_ref, "input": {}, **fields},
                             timeout=10)
    assert response.status_code == 201, response.text
    return response.json()["id"]


def wait_succeeded(api: str, token: str, run_ids: list[str], timeout: float = 60) -> None:
    def done() -> bool:
        return all(requests.get(f"{api}/v1/runs/{run_id}", timeout=5,
                                headers={"Authorization": f"Bearer {token}"}
                                ).json()["status"] == "succeeded" for run_id in run_ids)

    wait_until(done, timeout=timeout, what=f"runs {run_ids} to succeed")


def run_events(world: World, run_id: str) -> list[tuple[int, str]]:
    with world.connect() as conn:
        return [tuple(r) for r in conn.execute(
            "SELECT id, event_type FROM outbox WHERE run_id = %s ORDER BY id", [run_id])]


def assert_per_run_order(messages: list) -> None:
    """Each run's events, first copies only, appear in id order and on one partition."""
    firsts: dict[str, list[int]] = {}
    partitions: dict[str, set[int]] = {}
    seen: set[int] = set()
    for msg in sorted(messages, key=lambda m: (m.partition(), m.offset())):
        key, ce_id = msg.key().decode(), int(headers(msg)["ce_id"])
        partitions.setdefault(key, set()).add(msg.partition())
        if ce_id not in seen:
            seen.add(ce_id)
            firsts.setdefault(key, []).append(ce_id)
    for key, ids in firsts.items():
        assert ids == sorted(ids), f"{key}: events out of order: {ids}"
        assert len(partitions[key]) == 1, f"{key} spread over partitions {partitions[key]}"


# -- a run's events, in order, keyed, with ce_id -------------------------------------------------


def test_a_succeeding_run_publishes_its_events_in_order(world, api, make_tenant):
    creds = make_tenant(f"ob{uuid.uuid4().hex[:10]}")
    world.tenant, world.tenant_id = creds.name, creds.id
    world.declare(partitions=3)
    start_ready_worker(world)
    relay = world.start_relay()

    run_id = admit(api, creds.token, input={"hello": "events"}, goal_id="goal-7",
                   dispatch_key="outbox-1")
    wait_succeeded(api, creds.token, [run_id])
    rows = run_events(world, run_id)
    types = [t for _, t in rows]
    assert types[0] == "run.admitted" and types[-1] == "run.succeeded"
    assert "run.started" in types

    messages = world.reader().wait_for_ids({i for i, _ in rows})
    mine = [m for m in messages if m.key() == f"{creds.name}:{run_id}".encode()]
    assert len(mine) == len(messages) == len(rows)
    assert len({m.partition() for m in mine}) == 1
    mine.sort(key=lambda m: m.offset())
    assert [(int(headers(m)["ce_id"]), headers(m)["ce_type"]) for m in mine] == rows

    for msg, (row_id, event_type) in zip(mine, rows, strict=True):
        h = headers(msg)
        value = json.loads(msg.value())
        jsonschema.validate(value, SCHEMA, format_checker=jsonschema.FormatChecker())
        assert h["ce_specversion"] == "1.0" and h["content-type"] == "application/json"
        assert h["ce_source"] == f"/poimen/{creds.name}/runs/{run_id}"
        assert h["ce_time"] == value["occurred_at"] and h["ce_time"].endswith("Z")
        assert value["event_id"] == h["ce_id"] == str(row_id)
        assert value["type"] == event_type
        assert (value["tenant"], value["run_id"]) == (creds.name, run_id)
        assert (value["goal_id"], value["parent_run_id"]) == ("goal-7", None)
        assert value["data"]["run_id"] == run_id and value["data"]["type"] == event_type
    assert json.loads(mine[0].value())["data"]["dispatch_key"] == "outbox-1"

    wait_until(lambda: world.table_ids(published=False) == set(), timeout=10,
               what="every row marked published")
    assert relay.published == len(rows)


# -- broker down, events pile up, none lost ------------------------------------------------------


def test_broker_outage_piles_events_up_and_loses_none(world, api, make_tenant, tmp_path):
    port, data = free_port(), tmp_path / "broker-data"
    data.mkdir()
    broker = start_broker(data, port, tmp_path)
    try:
        world.bootstrap = f"127.0.0.1:{port}"
        world.env["KAFKA_BOOTSTRAP_SERVERS"] = world.bootstrap
        world.env["KAFKA_RECONNECT_BACKOFF_MAX_MS"] = "500"
        creds = make_tenant(f"ob{uuid.uuid4().hex[:10]}")
        world.tenant, world.tenant_id = creds.name, creds.id
        world.declare(partitions=2)
        start_ready_worker(world)
        relay = world.start_relay()

        first = admit(api, creds.token)
        wait_succeeded(api, creds.token, [first])
        wait_until(lambda: world.table_ids(published=False) == set() and world.table_ids(),
                   timeout=30, what="the first run's events published")

        broker.stop()  # SIGTERM, and wait for it to save its data and exit
        during = [admit(api, creds.token, input={"n": i}) for i in range(3)]
        wait_succeeded(api, creds.token, during)
        piled = world.table_ids(published=False)
        assert len(piled) >= 3 * 3, "admitted, started and succeeded of 3 runs"
        wait_until(lambda: relay.metric("poimen_outbox_pending", tenant=creds.name)
                   >= len(piled), timeout=10, what="the lag metric to rise")
        assert relay.metric("poimen_outbox_oldest_age_seconds", tenant=creds.name) > 0
        assert relay.proc.alive()

        broker = start_broker(data, port, tmp_path)
        wait_until(lambda: world.table_ids(published=False) == set(), timeout=60,
                   what="the piled-up events published after the broker came back")
        wait_until(lambda: relay.metric("poimen_outbox_pending", tenant=creds.name) == 0,
                   timeout=10, what="the lag metric to fall")

        messages = world.reader().read_to_end()
        assert {int(headers(m)["ce_id"]) for m in messages} == world.table_ids()
        assert_per_run_order(messages)
        assert relay.published >= len(world.table_ids())

        relay.proc.signal_group(signal.SIGTERM)
        relay.proc.proc.wait(25)
        assert relay.proc.proc.returncode == 0, relay.proc.log()[-3000:]
    finally:
        for relay in world.relays:
            relay.proc.stop()
        broker.stop()


# -- transactions that commit out of id order ----------------------------------------------------


def test_a_lower_id_committed_late_is_still_published(world):
    world.add_tenant()
    world.declare()
    world.start_relay()
    reader = world.reader()
    run_id = uuid.uuid4()
    with world.connect(autocommit=False) as a, world.connect(autocommit=False) as b:
        # B's transaction is the older one (it wrote before A began, as a transaction
        # that first changed a run would have), so the horizon does not hold B back
        # while A is open.
        b.execute("SELECT pg_current_xact_id()")
        a.execute("SELECT pg_current_xact_id()")
        [id_a] = insert_events(a, world.tenant_id, run_id=run_id, event_type="run.a")
        [id_b] = insert_events(b, world.tenant_id, run_id=run_id, event_type="run.b")
        assert id_a < id_b
        b.commit()
        reader.wait_for_ids({id_b}, timeout=30)
        wait_until(lambda: world.table_ids(published=True) == {id_b}, timeout=10,
                   what="B marked published while A is still open")
        a.commit()

    def everything_published() -> bool:
        reader.drain()
        return world.table_ids(published=False) == set() and set(reader.ce_ids()) == {id_a, id_b}

    try:
        wait_until(everything_published, timeout=15, what="A's event published after its commit")
    except AssertionError as err:
        raise AssertionError(f"{err}\n  ids in the table: {sorted(world.table_ids())}"
                             f"\n  ce_ids on the topic: {sorted(set(reader.ce_ids()))}"
                             f"\n  unpublished rows: {sorted(world.table_ids(published=False))}"
                             ) from None
    assert set(reader.ce_ids()) == world.table_ids() == {id_a, id_b}


def test_rows_of_younger_transactions_wait_for_an_older_open_one(world):
    world.add_tenant()
    world.declare()
    relay = world.start_relay()
    reader = world.reader()
    run_id = uuid.uuid4()
    with world.connect(autocommit=False) as a, world.connect() as b:
        [id_a] = insert_events(a, world.tenant_id, run_id=run_id, event_type="run.a")
        [id_b] = insert_events(b, world.tenant_id, run_id=run_id, event_type="run.b")  # commits
        # Two complete reads by the relay after B committed, while A is open...
        reads = relay.metric("poimen_outbox_reads_total")
        wait_until(lambda: relay.metric("poimen_outbox_reads_total") >= reads + 2,
                   timeout=10, what="the relay to read twice")
        # ...left B alone: publishing it now would put it ahead of A's lower id.
        assert world.table_ids(published=True) == set()
        assert reader.drain(0.3) == []
        a.commit()
    reader.wait_for_ids({id_a, id_b})
    assert [int(headers(m)["ce_id"]) for m in reader.messages] == [id_a, id_b]


# -- kill -9 between produce and mark ------------------------------------------------------------


def test_kill_between_produce_and_mark_repeats_events_but_loses_none(world):
    world.add_tenant()
    world.declare()
    with world.connect() as conn:
        ids = {*insert_events(conn, world.tenant_id, 10), *insert_events(conn, world.tenant_id, 10)}
    reader = world.reader()
    with world.connect(autocommit=False) as locker, world.connect() as observer:
        # Row locks let the relay read and produce, and block its mark.
        locker.execute("SELECT id FROM outbox WHERE tenant_id = %s FOR UPDATE", [world.tenant_id])
        relay = world.start_relay()
        reader.wait_for_ids(ids)

        def mark_blocked() -> int | None:
            row = observer.execute(
                "SELECT pid FROM pg_stat_activity WHERE application_name = %s "
                "AND wait_event_type = 'Lock' AND query LIKE 'SELECT poimen_outbox_mark_published%%'",
                [f"poimen-outbox/{relay.proc.pid}"]).fetchone()
            return row and row[0]

        backend = wait_until(mark_blocked, timeout=10, what="the relay blocked in its mark")
        relay.proc.kill()
        # The dead relay's backend would otherwise finish the UPDATE once unblocked.
        observer.execute("SELECT pg_terminate_backend(%s)", [backend])
        locker.rollback()
    assert world.table_ids(published=False) == ids, "nothing was marked"

    world.start_relay()
    wait_until(lambda: world.table_ids(published=False) == set(), timeout=30,
               what="the restarted relay to publish and mark")
    messages = reader.read_to_end()
    assert set(reader.ce_ids()) == ids == world.table_ids()
    assert len(messages) == 2 * len(ids), "each event twice: at least once, not exactly once"
    assert_per_run_order(messages)


# -- batches: a trickle of events is read a linger apart -----------------------------------------


def _reads_during_a_trickle(world: World, relay: Relay, seconds: float = 3.0,
                            every: float = 0.02) -> tuple[float, set[int]]:
    """Insert one event every ``every`` s for ``seconds`` (a transaction each, as runs
    write them); return the relay's reads meanwhile and the ids inserted."""
    ids: set[int] = set()
    with world.connect() as conn:
        before = relay.metric("poimen_outbox_reads_total")
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            ids |= set(insert_events(conn, world.tenant_id))
            time.sleep(every)
        reads = relay.metric("poimen_outbox_reads_total") - before
    wait_until(lambda: world.table_ids(published=False) == set(), timeout=20,
               what="the trickle published")
    return reads, ids


def test_a_trickle_is_published_in_batches_a_linger_apart(world):
    world.add_tenant()
    world.declare()
    reader = world.reader()
    # After a batch that was not full the relay waits the linger before it reads again.
    lingering = world.start_relay("outbox-lingering", POIMEN_OUTBOX_BATCH_LINGER_MS="400")
    wait_until(lambda: lingering.active, timeout=10, what="the lingering relay active")
    reads, ids = _reads_during_a_trickle(world, lingering)
    assert reads <= 3.0 / 0.4 + 3, f"{reads} reads in 3 s with a 400 ms linger"
    lingering.proc.stop()

    # The same trickle without the linger: a read after every few events (the contrast
    # shows the count above is the linger's doing, not the trickle's).
    eager = world.start_relay("outbox-eager", POIMEN_OUTBOX_BATCH_LINGER_MS="0")
    wait_until(lambda: eager.active, timeout=15, what="the eager relay active")
    eager_reads, more = _reads_during_a_trickle(world, eager)
    print(f"reads in 3 s: {reads} with a 400 ms linger, {eager_reads} without")
    assert eager_reads >= 30, f"{eager_reads} reads in 3 s without a linger"

    # Nothing lost, each event on the topic.
    reader.wait_for_ids(ids | more)
    assert set(reader.ce_ids()) == ids | more == world.table_ids()


# -- one active relay ----------------------------------------------------------------------------


def test_two_relays_one_publishes_and_the_standby_takes_over(world):
    world.add_tenant()
    world.declare()
    first = world.start_relay("outbox-first")
    wait_until(lambda: first.active, timeout=10, what="the first relay active")
    second = world.start_relay("outbox-second")
    wait_until(lambda: "standby" in second.proc.log(), timeout=10, what="the second on standby")
    with world.connect() as conn:
        ids = set(insert_events(conn, world.tenant_id, 10))
    wait_until(lambda: world.table_ids(published=False) == set(), timeout=20,
               what="events published")
    assert (first.published, second.published) == (10, 0)
    assert not second.active

    first.proc.kill()
    killed = time.monotonic()
    with world.connect() as conn:
        ids |= set(insert_events(conn, world.tenant_id, 5))
    wait_until(lambda: world.table_ids(published=False) == set(), timeout=5, interval=0.05,
               what="the standby to publish within 5 s of the kill")
    took_over = time.monotonic() - killed
    assert second.active and second.published == 5, took_over
    reader = world.reader()
    reader.wait_for_ids(ids)
    assert set(reader.ce_ids()) == ids


def test_a_frozen_active_relay_is_replaced_after_t_s_and_stands_by_when_it_wakes(world):
    """SIGSTOP (a stuck VM): the frozen relay renews nothing, the server ends its lock session
    after T_s, the standby publishes; woken, the old relay finds its lease stale and stands by
    (docs/operations/outbox.md). Short lease settings keep the test fast; the ordering still holds."""
    lease = {"POIMEN_BOOT_PROBE_INTERVAL": "0.5", "POIMEN_LEASE_CLIENT_SECONDS": "3",
             "POIMEN_LEASE_SERVER_SECONDS": "6", "POIMEN_TAKEOVER_DELAY": "0"}
    world.add_tenant()
    world.declare()
    first = world.start_relay("outbox-first", **lease)
    wait_until(lambda: first.active, timeout=10, what="the first relay active")
    second = world.start_relay("outbox-second", **lease)
    wait_until(lambda: "standby" in second.proc.log(), timeout=10, what="the second on standby")
    with world.connect() as conn:
        ids = set(insert_events(conn, world.tenant_id, 10))
    wait_until(lambda: world.table_ids(published=False) == set(), timeout=20,
               what="events published")

    first.proc.signal_group(signal.SIGSTOP)
    frozen = time.monotonic()
    try:
        with world.connect() as conn:
            ids |= set(insert_events(conn, world.tenant_id, 5))
        wait_until(lambda: world.table_ids(published=False) == set(), timeout=30,
                   interval=0.1, what="the standby to publish")
        took_over = time.monotonic() - frozen
        assert second.active
        # Not before the server's bound (T_s 6 s after the last probe, at most 0.5 s before
        # the freeze), and soon after it.
        assert 5 <= took_over < 12, took_over
    finally:
        first.proc.signal_group(signal.SIGCONT)
    wait_until(lambda: not first.active, timeout=15, what="the woken relay to stand by")
    with world.connect() as conn:
        ids |= set(insert_events(conn, world.tenant_id, 5))
    wait_until(lambda: world.table_ids(published=False) == set(), timeout=20,
               what="events published after the wake")
    assert first.published == 10 and not first.active
    reader = world.reader()
    reader.wait_for_ids(ids)


def test_a_relay_whose_lock_connection_is_cut_stops_within_one_batch(world):
    world.add_tenant()
    world.declare()
    batch = 5
    relay = world.start_relay(POIMEN_OUTBOX_BATCH_SIZE=str(batch))
    wait_until(lambda: relay.active, timeout=10, what="the relay active")
    stop_feeding = threading.Event()
    fed: list[int] = []

    def feed() -> None:  # a steady stream of events, so the relay is mid-stream when cut
        with world.connect() as conn:
            while not stop_feeding.wait(0.01):
                fed.extend(insert_events(conn, world.tenant_id, 1))

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    try:
        wait_until(lambda: relay.published >= 20, timeout=20, what="the relay publishing")
        with world.connect() as holder:
            [lock_backend] = holder.execute(
                "SELECT pid FROM pg_stat_activity WHERE application_name = %s",
                [f"poimen-outbox-lock/{relay.proc.pid}"]).fetchone()
            holder.execute("SELECT pg_terminate_backend(%s)", [lock_backend])
            # The test now holds the relay lock, as another relay would after a takeover.
            holder.execute("SELECT pg_advisory_lock(%s, %s)",
                           [OUTBOX_LOCK_NAMESPACE, OUTBOX_LOCK_KEY])
            wait_until(lambda: not relay.active, timeout=5, what="the relay to step down")
            wait_until(lambda: relay.proc.log().count("standby: another relay holds") >= 1,
                       timeout=5, what="the relay to find the lock taken")
            stop_feeding.set()
            feeder.join(5)
            published_after = relay.published
            unmarked = world.table_ids(published=False)
            assert unmarked, "the feeder's later events wait for a relay"
            messages = world.reader().read_to_end()
            # Produced but never marked: the batch in flight when the lock went.
            extra = {int(headers(m)["ce_id"]) for m in messages} & unmarked
            assert len(extra) <= batch, sorted(extra)
            # A standby tries for the lock every second: watch it try twice, and fail.
            attempts: set = set()

            def tried_twice() -> bool:
                row = holder.execute(
                    "SELECT state_change FROM pg_stat_activity WHERE application_name = %s",
                    [f"poimen-outbox-lock/{relay.proc.pid}"]).fetchone()
                if row:
                    attempts.add(row[0])
                return len(attempts) >= 3

            wait_until(tried_twice, timeout=10, interval=0.05, what="two more tries for the lock")
            assert relay.published == published_after
            assert world.table_ids(published=False) == unmarked
            holder.execute("SELECT pg_advisory_unlock(%s, %s)",
                           [OUTBOX_LOCK_NAMESPACE, OUTBOX_LOCK_KEY])
        wait_until(lambda: world.table_ids(published=False) == set(), timeout=10,
                   what="the relay to take the lock back and publish the rest")
        assert relay.active
    finally:
        stop_feeding.set()
    reader = world.readers[-1]
    reader.read_to_end()
    assert set(reader.ce_ids()) == set(fed) == world.table_ids()


# -- the bridge stands alone ---------------------------------------------------------------------


def test_the_bridge_imports_nothing_from_app_or_workers():
    """The relays stay outside the app's lifecycle: their settings come from poimenconfig."""
    code = ("import sys, bridge.outbox, bridge.inbox, bridge.topics, bridge.kafka; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('app', 'workers')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


# -- shutdown, retention -------------------------------------------------------------------------


def test_sigterm_with_the_broker_down_exits_within_the_grace(world):
    world.add_tenant()
    world.env["KAFKA_BOOTSTRAP_SERVERS"] = f"127.0.0.1:{free_port()}"  # nothing listens
    relay = world.start_relay(POIMEN_SHUTDOWN_GRACE="8")
    with world.connect() as conn:
        ids = set(insert_events(conn, world.tenant_id, 3))
    wait_until(lambda: relay.metric("poimen_outbox_reads_total") >= 1 and
               relay.metric("poimen_outbox_pending", tenant=world.tenant) == 3,
               timeout=10, what="the relay holding an unacknowledgeable batch")
    started = time.monotonic()
    relay.proc.signal_group(signal.SIGTERM)
    relay.proc.proc.wait(15)
    took = time.monotonic() - started
    assert relay.proc.proc.returncode == 0, relay.proc.log()[-3000:]
    assert took < 8, took
    assert world.table_ids(published=False) == ids


def test_sigterm_finishes_and_marks_the_batch_in_flight(world, tmp_path):
    port, data = free_port(), tmp_path / "broker-data"
    data.mkdir()
    broker = start_broker(data, port, tmp_path)
    try:
        world.bootstrap = f"127.0.0.1:{port}"
        world.env["KAFKA_BOOTSTRAP_SERVERS"] = world.bootstrap
        world.env["KAFKA_RECONNECT_BACKOFF_MAX_MS"] = "500"
        world.add_tenant()
        world.declare()
        relay = world.start_relay(POIMEN_SHUTDOWN_GRACE="25")
        wait_until(lambda: relay.active, timeout=10, what="the relay active")
        broker.stop()
        with world.connect() as conn:
            ids = set(insert_events(conn, world.tenant_id, 5))
        wait_until(lambda: relay.metric("poimen_outbox_in_flight") == 5, timeout=10,
                   what="the batch waiting for the broker")

        relay.proc.signal_group(signal.SIGTERM)
        broker = start_broker(data, port, tmp_path)
        relay.proc.proc.wait(25)
        assert relay.proc.proc.returncode == 0, relay.proc.log()[-3000:]
        assert world.table_ids(published=False) == set(), "the batch in flight was marked"
        reader = world.reader()
        reader.wait_for_ids(ids)
        assert set(reader.ce_ids()) == ids
    finally:
        for relay in world.relays:
            relay.proc.stop()
        broker.stop()


def test_published_events_are_pruned_after_the_retention(world):
    world.add_tenant()
    world.declare()
    with world.connect() as conn:
        old = set(insert_events(conn, world.tenant_id, 7))
        recent = set(insert_events(conn, world.tenant_id, 2))
        pending_old = set(insert_events(conn, world.tenant_id, 2))
        conn.execute("UPDATE outbox SET published_at = now() - interval '8 days' "
                     "WHERE id = ANY(%s)", [sorted(old)])
        conn.execute("UPDATE outbox SET published_at = now() - interval '6 days' "
                     "WHERE id = ANY(%s)", [sorted(recent)])
        conn.execute("UPDATE outbox SET created_at = now() - interval '30 days' "
                     "WHERE id = ANY(%s)", [sorted(pending_old)])
    relay = world.start_relay(POIMEN_OUTBOX_RETENTION="7d", POIMEN_OUTBOX_PRUNE_INTERVAL="0.2",
                              POIMEN_OUTBOX_PRUNE_BATCH="3")
    wait_until(lambda: world.table_ids() == recent | pending_old, timeout=15,
               what="old published events pruned")
    wait_until(lambda: world.table_ids(published=False) == set(), timeout=10,
               what="the unpublished old events published, not pruned")
    assert relay.metric("poimen_outbox_pruned_total") == len(old)


def test_retention_is_read_in_seconds_or_with_a_unit():
    assert parse_retention(None) == 7 * 86400
    assert parse_retention("3600") == parse_retention("60m") == parse_retention("1h") == 3600
    assert parse_retention("7d") == parse_retention("7D") == 7 * 86400
    assert parse_retention("never") is None and parse_retention("0") is None
    with pytest.raises(SystemExit):
        parse_retention("a week")


def test_heroku_database_urls_are_accepted():
    assert libpq_url("postgres://u:p@h:5432/d") == "postgresql://u:p@h:5432/d"
    assert libpq_url("postgresql+psycopg://u@h/d") == "postgresql://u@h/d"
    assert libpq_url("postgresql://u@h/d") == "postgresql://u@h/d"


def test_the_linger_is_read_in_milliseconds_and_never_negative():
    env = {"DATABASE_URL": "postgres://u@h/d", "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:9"}
    assert outbox_settings(env).batch_linger_ms == 20
    assert outbox_settings({**env, "POIMEN_OUTBOX_BATCH_LINGER_MS": "0"}).batch_linger_ms == 0
    with pytest.raises(SystemExit, match="must not be negative"):
        outbox_settings({**env, "POIMEN_OUTBOX_BATCH_LINGER_MS": "-5"})


# -- oversized events ----------------------------------------------------------------------------
#
# Unbounded, a 1.2 MB error makes a run.failed event the producer refuses (MSG_SIZE_TOO_LARGE) on
# every try: never published, never dead-lettered, and every try puts the relay into its backoff.


def utf8_size(text: str) -> int:
    return len(text.encode())


def test_a_run_failing_with_a_huge_error_publishes_its_run_failed_event_truncated(
        world, api, make_tenant):
    creds = make_tenant(f"ob{uuid.uuid4().hex[:10]}")
    world.tenant, world.tenant_id = creds.name, creds.id
    world.declare(partitions=2)
    start_ready_worker(world)
    world.start_relay()
    reader = world.reader()

    message = "invalid input: " + "x" * 1_200_000  # what tests.workflows.invalid_input raises
    run_id = admit(api, creds.token, "invalid-input", input={"bytes": 1_200_000})

    def failed():
        return [i for i, t in run_events(world, run_id) if t == "run.failed"]

    [failed_id] = wait_until(failed, timeout=60, what="the run to fail")
    [msg] = [m for m in reader.wait_for_ids({failed_id}, timeout=20)
             if int(headers(m)["ce_id"]) == failed_id]
    value = json.loads(msg.value())
    jsonschema.validate(value, SCHEMA, format_checker=jsonschema.FormatChecker())
    error = value["data"]["error"]
    # The error itself, cut to POIMEN_ERROR_TEXT_MAX_BYTES (8 KiB), its size noted: not an
    # event whose data was dropped.
    assert "data_dropped" not in value
    assert error["type"] == "builtins.ValueError"
    assert error["error_truncated"] is True and error["error_bytes"] == utf8_size(message)
    assert utf8_size(error["message"]) <= 8192 and message.startswith(error["message"])
    assert utf8_size(error["traceback"]) <= 8192
    assert len(msg.value()) < 32 * 1024
    # The run shows the same bounded error.
    run = requests.get(f"{api}/v1/runs/{run_id}", timeout=10,
                       headers={"Authorization": f"Bearer {creds.token}"}).json()
    assert run["status"] == "failed"
    assert run["error"]["error_bytes"] == utf8_size(message)
    assert run["error"]["message"] == error["message"]
    wait_until(lambda: world.table_ids(published=False) == set(), timeout=10,
               what="every row marked published")


def record_big_event(world: World, run_id: uuid.UUID, size: int,
                     event_type: str = "order.rejected") -> int:
    """Write an event of ``size`` bytes with the store's own statement (an ``emit``)."""
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    from app.state.outbox import record_event

    engine = create_engine(world.database_url)
    try:
        with Session(engine) as session:
            record_event(on_session(session), tenant_id=world.tenant_id, run_id=run_id,
                         event_type=event_type, detail="y" * size)
            session.commit()
    finally:
        engine.dispose()
    with world.connect() as conn:
        return conn.execute("SELECT max(id) FROM outbox WHERE run_id = %s", [run_id]).fetchone()[0]


def by_id(messages: list) -> dict[int, list]:
    found: dict[int, list] = {}
    for m in messages:
        found.setdefault(int(headers(m)["ce_id"]), []).append(m)
    return found


def assert_reduced(msg, world: World, run_id: uuid.UUID, event_type: str, at_least: int) -> None:
    """``msg`` is the reduced form: the envelope, no data but its run and type, the size noted."""
    value = json.loads(msg.value())
    jsonschema.validate(value, SCHEMA, format_checker=jsonschema.FormatChecker())
    assert value["data_dropped"] is True and value["event_bytes"] >= at_least
    assert value["data"] == {"run_id": str(run_id), "type": event_type}
    assert (value["type"], value["tenant"], value["run_id"]) == (event_type, world.tenant,
                                                                str(run_id))
    assert value["event_id"] == headers(msg)["ce_id"]
    assert headers(msg)["ce_type"] == event_type
    assert msg.key() == f"{world.tenant}:{run_id}".encode()


def test_an_event_over_the_producers_limit_goes_out_reduced_and_holds_no_one_up(world):
    world.add_tenant()
    world.declare(partitions=2)
    run_a, run_b = uuid.uuid4(), uuid.uuid4()
    with world.connect() as conn:
        [first] = insert_events(conn, world.tenant_id, run_id=run_a, event_type="run.started")
    big = record_big_event(world, run_a, 1_200_000)
    with world.connect() as conn:
        [after] = insert_events(conn, world.tenant_id, run_id=run_a, event_type="run.failed")
    relay = world.start_relay()
    reader = world.reader()

    # Another run's events meanwhile, one every 0.3 s: none waits for a backoff.
    latencies = []
    with world.connect() as conn:
        for _ in range(12):
            [other] = insert_events(conn, world.tenant_id, run_id=run_b)
            written = time.monotonic()
            reader.wait_for_ids({other}, timeout=30)
            latencies.append(time.monotonic() - written)
            time.sleep(0.3)
    print(f"another run's events arrived after {[round(x, 2) for x in latencies]} s")
    assert max(latencies) < 2.0, latencies

    messages = reader.wait_for_ids({first, big, after}, timeout=10)
    found = by_id(messages)
    assert_reduced(found[big][0], world, run_a, "order.rejected", 1_200_000)
    # Run A's events in order on their partition.
    mine = sorted((m for m in messages if m.key() == f"{world.tenant}:{run_a}".encode()),
                  key=lambda m: m.offset())
    assert [int(headers(m)["ce_id"]) for m in mine] == [first, big, after]
    assert_per_run_order(messages)
    wait_until(lambda: world.table_ids(published=False) == set(), timeout=10,
               what="every row marked published")
    assert relay.metric("poimen_outbox_reduced_total", reason="limit") == 1
    assert relay.metric("poimen_outbox_undeliverable_total") == 0


def create_topic(world: World, max_message_bytes: int | None = None) -> None:
    """The tenant's events topic, one partition, with a ``max.message.bytes`` of its own."""
    from confluent_kafka.admin import AdminClient, NewTopic

    config = {} if max_message_bytes is None else {"max.message.bytes": str(max_message_bytes)}
    admin = AdminClient({"bootstrap.servers": world.bootstrap})
    for future in admin.create_topics([NewTopic(world.topic, 1, 1, config=config)]).values():
        future.result(15)


def lower_topic_limit(world: World, max_message_bytes: int) -> None:
    from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource

    admin = AdminClient({"bootstrap.servers": world.bootstrap})
    entry = ConfigEntry("max.message.bytes", str(max_message_bytes),
                        incremental_operation=AlterConfigOpType.SET)
    for future in admin.incremental_alter_configs([ConfigResource(
            ConfigResource.Type.TOPIC, world.topic, incremental_configs=[entry])]).values():
        future.result(15)


def last_copies(messages: list, key: str) -> list[int]:
    """The ce_ids of ``key``'s messages in partition order, each at its last copy: what a
    consumer that keeps the latest copy of each event sees."""
    ordered = sorted((m for m in messages if m.key() == key.encode()), key=lambda m: m.offset())
    ids = [int(headers(m)["ce_id"]) for m in ordered]
    return [i for n, i in enumerate(ids) if i not in ids[n + 1:]]


def test_an_event_over_its_topics_limit_goes_out_reduced_in_its_place(world):
    """The topic's max.message.bytes under the producer's: the relay reads it and reduces the
    event before producing it, so the run's events go out once each, in order."""
    world.add_tenant()
    create_topic(world, 20_000)
    run_a, run_b = uuid.uuid4(), uuid.uuid4()
    with world.connect() as conn:
        a_before = insert_events(conn, world.tenant_id, 2, run_id=run_a, event_type="run.started")
        b_before = insert_events(conn, world.tenant_id, 3, run_id=run_b)
    big = record_big_event(world, run_a, 50_000)
    with world.connect() as conn:
        a_after = insert_events(conn, world.tenant_id, 2, run_id=run_a, event_type="run.failed")
        b_after = insert_events(conn, world.tenant_id, 3, run_id=run_b)
    relay = world.start_relay()
    reader = world.reader()
    everything = {*a_before, *b_before, big, *a_after, *b_after}
    reader.wait_for_ids(everything, timeout=20)
    wait_until(lambda: world.table_ids(published=False) == set(), timeout=10,
               what="every row marked published")
    messages = reader.read_to_end()
    assert sorted(reader.ce_ids()) == sorted(everything), "each event once"
    assert_reduced(by_id(messages)[big][0], world, run_a, "order.rejected", 50_000)
    assert_per_run_order(messages)
    mine = sorted((m for m in messages if m.key() == f"{world.tenant}:{run_a}".encode()),
                  key=lambda m: m.offset())
    assert [int(headers(m)["ce_id"]) for m in mine] == [*a_before, big, *a_after]
    assert relay.metric("poimen_outbox_reduced_total", reason="limit") == 1
    assert relay.metric("poimen_outbox_undeliverable_total") == 0


def test_an_event_the_broker_refuses_for_size_goes_out_reduced(world):
    """The topic's limit lowered after the relay read it: the broker refuses the event (and
    every event in the same request). It goes out reduced at once, and its run's events that
    the broker took after it go out again after it: the run's last copies stay in order."""
    world.add_tenant()
    create_topic(world)
    run_a, run_b = uuid.uuid4(), uuid.uuid4()
    # Small producer batches: the run's events after the refused one travel in requests of
    # their own, which the broker accepts.
    relay = world.start_relay(KAFKA_BATCH_SIZE="1000")
    reader = world.reader()
    with world.connect() as conn:
        [warm] = insert_events(conn, world.tenant_id, run_id=run_b)
    reader.wait_for_ids({warm}, timeout=20)  # the relay has read the topic's limit
    lower_topic_limit(world, 20_000)
    # One batch: the relay reads none of these rows until the older transaction ends.
    with world.connect(autocommit=False) as older:
        older.execute("SELECT pg_current_xact_id()")
        with world.connect() as conn:
            a_before = insert_events(conn, world.tenant_id, 2, run_id=run_a,
                                     event_type="run.started")
            b_before = insert_events(conn, world.tenant_id, 3, run_id=run_b)
        big = record_big_event(world, run_a, 50_000)
        with world.connect() as conn:
            a_after = insert_events(conn, world.tenant_id, 2, run_id=run_a,
                                    event_type="run.failed")
            b_after = insert_events(conn, world.tenant_id, 3, run_id=run_b)
        older.commit()
    everything = {*a_before, *b_before, big, *a_after, *b_after}
    reader.wait_for_ids(everything, timeout=20)
    wait_until(lambda: world.table_ids(published=False) == set(), timeout=10,
               what="every row marked published")
    messages = reader.read_to_end()
    copies = by_id(messages)
    assert_reduced(copies[big][-1], world, run_a, "order.rejected", 50_000)
    assert len(copies[big]) == 1
    assert last_copies(messages, f"{world.tenant}:{run_a}") == [*a_before, big, *a_after]
    assert last_copies(messages, f"{world.tenant}:{run_b}") == [warm, *b_before, *b_after]
    assert relay.metric("poimen_outbox_reduced_total", reason="refused") == 1
    assert relay.metric("poimen_outbox_undeliverable_total") == 0

    # Later events go out at once: no backoff was left behind.
    with world.connect() as conn:
        [later] = insert_events(conn, world.tenant_id, run_id=run_b)
    written = time.monotonic()
    reader.wait_for_ids({later}, timeout=10)
    assert time.monotonic() - written < 2.0


# Bytes the embedded broker allows a record batch on a topic: one small event of
# ``insert_events`` fits (about 500 bytes of value, key and headers, and the relay's 128 for
# the framing), the reduced form of an event with a 64-character type does not (about 700,
# and the framing).
SMALL_TOPIC_LIMIT = 700


def test_an_event_refused_even_reduced_is_marked_counted_and_never_retried(world):
    world.add_tenant()
    # Room for a small event of run B alone, not for the reduced form of an event whose
    # type (in the value twice, and in ce_type) is as long as a type may be (64).
    create_topic(world, SMALL_TOPIC_LIMIT)
    run_a, run_b = uuid.uuid4(), uuid.uuid4()
    long_type = "order." + "r" * 58
    with world.connect() as conn:
        b_before = insert_events(conn, world.tenant_id, 2, run_id=run_b)
    big = record_big_event(world, run_a, 50_000, event_type=long_type)
    with world.connect() as conn:
        b_after = insert_events(conn, world.tenant_id, 2, run_id=run_b)
    relay = world.start_relay()
    reader = world.reader()
    messages = reader.wait_for_ids({*b_before, *b_after}, timeout=20)
    wait_until(lambda: world.table_ids(published=False) == set(), timeout=10,
               what="every row marked, the undeliverable one too")
    assert relay.metric("poimen_outbox_undeliverable_total") == 1
    assert big not in by_id(reader.drain(0.5))
    assert f"event {big} " in relay.proc.log()
    # And the relay is not stuck on it: the next event goes out at once.
    with world.connect() as conn:
        [later] = insert_events(conn, world.tenant_id, run_id=run_b)
    written = time.monotonic()
    reader.wait_for_ids({later}, timeout=10)
    assert time.monotonic() - written < 2.0
    assert_per_run_order(messages)
