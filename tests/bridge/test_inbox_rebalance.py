"""Consumer-group rebalances over real processes: several inboxes in one group on tansu.

A stream of dispatch messages over four partitions, half with a ``dispatch_key``
and half without, is consumed by inbox processes that come and go: one is killed
with SIGKILL while it consumes, another starts later, and one is stopped (SIGSTOP)
past its session timeout while it holds posts in flight, then continued. Three
workers and two beats (a deploy overlap) execute the runs meanwhile. Every message
must be exactly one run, none dead-lettered, and the group's committed offsets
must reach the end of every partition.

The broker is tansu (``tansu`` fixture): the embedded noida-db never completes a
rebalance after a member dies.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from bridge.topics import declare_topics
from tests.processes import (
    Process,
    metric,
    start_beat,
    start_inbox,
    start_web,
    start_worker,
    wait_until,
)

pytestmark = pytest.mark.slow

PARTITIONS = 4
SESSION_TIMEOUT_MS = 6000  # the broker's minimum: a stalled relay is evicted soonest


@pytest.fixture(scope="module")
def web(test_env, tmp_path_factory):
    proc, url = start_web(test_env, tmp_path_factory.mktemp("rebalance-web"), workers=2,
                          threads=8)
    yield url
    proc.stop()


def committed(bootstrap: str, group: str, topic: str) -> list[int]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        tps = consumer.committed([TopicPartition(topic, p) for p in range(PARTITIONS)],
                                 timeout=10)
        return [tp.offset for tp in tps]
    finally:
        consumer.close()


def ends(bootstrap: str, topic: str, total: int) -> list[int]:
    """The offset after each partition's last message, read from the messages themselves.

    Not ``get_watermark_offsets``: tansu's high watermark lags its log (it answered
    725 for a partition whose last message was at 748).
    """
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"probe-{uuid.uuid4()}",
                         "enable.auto.commit": False})
    last = [0] * PARTITIONS
    seen = 0
    try:
        consumer.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
        deadline = time.monotonic() + 30
        while seen < total and time.monotonic() < deadline:
            for msg in consumer.consume(500, 0.5):
                if not msg.error():
                    seen += 1
                    last[msg.partition()] = max(last[msg.partition()], msg.offset() + 1)
    finally:
        consumer.close()
    assert seen == total, f"read {seen} of {total} messages back from {topic}"
    return last


def dead_letters(bootstrap: str, topic: str) -> int:
    """Messages in the dead-letter topic (read back: see ``ends``)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"probe-{uuid.uuid4()}",
                         "enable.auto.commit": False})
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        return sum(1 for msg in consumer.consume(500, 3) if not msg.error())
    finally:
        consumer.close()


class Stream(threading.Thread):
    """Publish ``total`` run requests over a few seconds; every other one carries a key."""

    def __init__(self, bootstrap: str, topic: str, total: int, seconds: float):
        super().__init__(daemon=True)
        self.bootstrap, self.topic, self.total, self.seconds = bootstrap, topic, total, seconds
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            producer = Producer({"bootstrap.servers": self.bootstrap, "linger.ms": 5})
            batch = 100
            for start in range(0, self.total, batch):
                for i in range(start, min(start + batch, self.total)):
                    body = {"workflow_ref": "echo", "input": {"i": i}}
                    if i % 2 == 0:
                        body["dispatch_key"] = f"k-{i}"
                    # Keys spread the messages over the partitions, as producers do.
                    producer.produce(self.topic, json.dumps(body).encode(),
                                     key=str(i).encode())
                producer.poll(0)
                time.sleep(self.seconds * batch / self.total)
            assert producer.flush(30) == 0, "the broker did not acknowledge the stream"
        except BaseException as err:  # noqa: BLE001 - reported by the test
            self.error = err


def runs_of(pg, tenant_id: int) -> int:
    return pg.execute("SELECT count(*) FROM runs WHERE tenant_id = %s", [tenant_id]).fetchone()[0]


def scenario(pg, test_env, make_tenant, web, tansu, tmp_path, processes, strategy: str,
             total: int, executors: bool = True, stall: bool = True) -> None:
    service, tenant = make_tenant(service=True), make_tenant()
    tag = uuid.uuid4().hex[:8]
    prefix, group = f"rb{tag}", f"inbox-rebalance-{tag}"
    topic = f"{prefix}.{tenant.name}.dispatch"
    declare_topics(tansu, prefix, [tenant.name], PARTITIONS)
    env = {
        **test_env,
        "KAFKA_BOOTSTRAP_SERVERS": tansu,
        "KAFKA_PARTITION_ASSIGNMENT_STRATEGY": strategy,
        "POIMEN_API_URL": web,
        "POIMEN_API_TOKEN": service.token,
        "POIMEN_TOPIC_PREFIX": prefix,
        "POIMEN_INBOX_GROUP": group,
        "POIMEN_INBOX_SESSION_TIMEOUT_MS": str(SESSION_TIMEOUT_MS),
        "POIMEN_INBOX_CONCURRENCY": "4",
        "POIMEN_INBOX_METADATA_REFRESH_MS": "1000",
        "POIMEN_INBOX_BACKOFF_INITIAL": "0.2",
        "POIMEN_INBOX_BACKOFF_MAX": "1",
        "POIMEN_INBOX_PROGRESS_INTERVAL": "5",
        "POIMEN_SHUTDOWN_GRACE": "10",
    }
    relays: list[Process] = []

    def relay(name: str) -> Process:
        # Each with its own METRICS_PORT (start_inbox picks a free one): two inboxes on
        # one host with the same port, the second exits on "Address already in use".
        proc, _ = start_inbox(env, tmp_path, name=name)
        processes.append(proc)
        relays.append(proc)
        return proc

    # Executors: three workers and two beats at once (a deploy overlap), fast repair.
    exec_env = {**test_env, "POIMEN_REPAIR_INTERVAL": "1", "POIMEN_REPAIR_MIN_AGE": "5"}
    for n in range(3 if executors else 0):
        processes.append(start_worker(exec_env, tmp_path, f"worker{n}", concurrency=2))
    for n in range(2 if executors else 0):
        processes.append(start_beat(exec_env, tmp_path, f"beat{n}"))

    first, second = relay("inbox-a"), relay("inbox-b")
    stream = Stream(tansu, topic, total, seconds=12)
    stream.start()

    def admitted_at_least(n: int):
        def check() -> bool:
            assert stream.error is None, f"the stream failed: {stream.error!r}"
            return runs_of(pg, tenant.id) >= n
        return check

    # 1. A relay dies while it consumes: its partitions move, nothing it posted is lost.
    wait_until(admitted_at_least(total // 5), timeout=60, what="a fifth of the runs")
    first.kill()
    # 2. A new relay joins later and takes partitions from the survivor.
    wait_until(admitted_at_least(2 * total // 5), timeout=60, what="two fifths of the runs")
    third = relay("inbox-c")
    # 3. The survivor stalls past its session timeout with posts in flight, then resumes:
    #    its partitions went to the others meanwhile, and its late posts are replays.
    if stall:
        wait_until(admitted_at_least(3 * total // 5), timeout=60, what="three fifths of the runs")
        second.signal_group(signal.SIGSTOP)
        time.sleep(SESSION_TIMEOUT_MS / 1000 + 4)
        second.signal_group(signal.SIGCONT)

    stream.join(60)
    assert stream.error is None, f"the stream failed: {stream.error!r}"
    assert not stream.is_alive(), "the stream did not finish"
    end = ends(tansu, topic, total)
    wait_until(admitted_at_least(total), timeout=90, what="every message admitted")
    wait_until(lambda: committed(tansu, group, topic) == end, timeout=60,
               what=f"committed offsets at the end {end}")

    # Exactly one run per message: keyed ones under their key, keyless ones under
    # the key derived from their place in the log (the same whoever read them).
    rows = pg.execute("SELECT (input->>'i')::int, dispatch_key FROM runs WHERE tenant_id = %s",
                      [tenant.id]).fetchall()
    assert len(rows) == total
    assert sorted(i for i, _ in rows) == list(range(total))
    for i, key in rows:
        assert key == f"k-{i}" if i % 2 == 0 else key.startswith(f"kafka:{topic}:")
    assert dead_letters(tansu, f"{topic}.dlq") == 0, "a rebalance dead-lettered a message"
    for proc in (second, third):
        assert proc.alive(), f"{proc.name} died:\n{proc.log()[-3000:]}"
        assert "(message fault)" not in proc.log()
    assert "(message fault)" not in first.log()

    if not executors:
        return
    # Every run executed once by the three workers under the two beats.
    wait_until(lambda: pg.execute(
        "SELECT count(*) FROM runs WHERE tenant_id = %s AND status = 'succeeded'",
        [tenant.id]).fetchone()[0] == total, timeout=120, what="every run succeeded")
    for proc in relays[1:]:
        assert metric_url_ok(proc)


def metric_url_ok(proc: Process) -> bool:
    port = proc.env["METRICS_PORT"]
    return metric(f"http://127.0.0.1:{port}/metrics", "poimen_inbox_dead_lettered_total") == 0


def test_relays_that_die_join_and_stall_admit_every_message_once(
        pg, test_env, make_tenant, web, tansu, tmp_path, processes):
    scenario(pg, test_env, make_tenant, web, tansu, tmp_path, processes,
             strategy="cooperative-sticky", total=3000)


def test_the_eager_protocol_loses_nothing_either(pg, test_env, make_tenant, web, tansu,
                                                 tmp_path, processes):
    # A group configured with KAFKA_PARTITION_ASSIGNMENT_STRATEGY=range,roundrobin
    # (librdkafka's default): every rebalance revokes every partition of every relay.
    scenario(pg, test_env, make_tenant, web, tansu, tmp_path, processes,
             strategy="range,roundrobin", total=1200, executors=False, stall=False)
