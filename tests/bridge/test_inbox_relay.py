"""The Kafka inbox over real processes: a real broker, gunicorn serving the API, and
``python -m bridge.inbox`` as a subprocess.

Each test has its own topic prefix and consumer group, so relays of different
tests (and anything else on the shared broker) never see each other's topics.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from bridge.topics import declare_topics
from tests import kafka_topics
from tests.processes import (
    ROOT,
    Process,
    free_port,
    metric,
    metrics,
    start_inbox,
    start_kafka_broker,
    start_web,
    wait_until,
)

pytestmark = pytest.mark.slow
RELAYS: list[Process] = []  # the running test's relays, to fail fast when one dies


# -- fixtures and helpers ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def web(test_env, tmp_path_factory):
    """gunicorn for this module, whose access log shows who called ``POST /v1/runs``."""
    proc, url = start_web(test_env, tmp_path_factory.mktemp("inbox-web"))
    yield proc, url
    proc.stop()


@dataclass
class Setup:
    """One test's world: a tenant, its topics under a private prefix, a relay environment."""

    tenant: str
    prefix: str
    bootstrap: str
    env: dict[str, str]
    log_dir: Path
    relays: list[Process] = field(default_factory=list)

    # Topic names as docs/operations/inbox.md gives them, not from the code under test.
    @property
    def topic(self) -> str:
        return f"{self.prefix}.{self.tenant}.dispatch"

    @property
    def dlq(self) -> str:
        return f"{self.prefix}.{self.tenant}.dispatch.dlq"

    @property
    def group(self) -> str:
        return self.env["POIMEN_INBOX_GROUP"]

    def declare(self, partitions: int = 1) -> None:
        declare_topics(self.bootstrap, self.prefix, [self.tenant], partitions)

    def publish(self, *values: bytes | dict, key: str | None = None,
                producer: Producer | None = None, flush: bool = True) -> Producer:
        producer = producer or Producer({"bootstrap.servers": self.bootstrap})
        for value in values:
            raw = json.dumps(value).encode() if isinstance(value, dict) else value
            producer.produce(self.topic, raw, key=key.encode() if key else None)
        if flush:
            assert producer.flush(30) == 0, "the broker did not acknowledge the messages"
        return producer

    def committed(self, partitions: int = 1) -> list[int]:
        return committed(self.bootstrap, self.group, self.topic, partitions)

    def wait_committed(self, expected: list[int], partitions: int = 1, timeout: float = 10,
                       what: str = "offsets committed") -> None:
        seen: list[list[int]] = []

        def reached() -> bool:
            seen.append(self.committed(partitions))
            return seen[-1] == expected

        try:
            wait_until(reached, timeout=timeout, what=what)
        except AssertionError as err:
            raise AssertionError(f"{err}; committed {seen[-1:]} != {expected}") from None

    def start_relay(self, **env: str) -> tuple[Process, str]:
        proc, url = start_inbox({**self.env, **env}, self.log_dir,
                                name=f"inbox-{len(self.relays)}")
        self.relays.append(proc)
        RELAYS.append(proc)
        return proc, url


def request(workflow_ref: str = "echo", **fields) -> dict:
    return {"workflow_ref": workflow_ref, "input": fields.pop("input", {}), **fields}


@pytest.fixture
def setup(test_env, make_tenant, web, tmp_path):
    service = make_tenant(service=True)
    tenant = make_tenant()
    tag = uuid.uuid4().hex[:8]
    env = {
        **test_env,
        "POIMEN_API_URL": web[1],
        "POIMEN_API_TOKEN": service.token,
        "POIMEN_TOPIC_PREFIX": f"it{tag}",
        "POIMEN_INBOX_GROUP": f"inbox-test-{tag}",
        "POIMEN_INBOX_LAG_INTERVAL": "0.5",
        "POIMEN_INBOX_BACKOFF_INITIAL": "0.2",
        "POIMEN_INBOX_BACKOFF_MAX": "1.5",
        "POIMEN_INBOX_METADATA_REFRESH_MS": "1000",
        "POIMEN_INBOX_PROGRESS_INTERVAL": "5",
    }
    s = Setup(tenant.name, env["POIMEN_TOPIC_PREFIX"], test_env["KAFKA_BOOTSTRAP_SERVERS"], env,
              tmp_path)
    yield s
    RELAYS.clear()
    for relay in s.relays:
        relay.stop()
        # Shown by pytest when the test failed.
        print(f"--- {relay.name} ---\n{relay.log()[-6000:]}")
    kafka_topics.delete_under(s.bootstrap, s.prefix)


def metric_sum(url: str, name: str) -> float:
    return sum(v for (n, _), v in metrics(url).items() if n == name)


def runs(pg, tenant: str) -> list[dict]:
    rows = pg.execute(
        "SELECT r.dispatch_key, r.input, r.origin, r.origin_detail, r.workflow_ref "
        "FROM runs r JOIN tenants t ON t.id = r.tenant_id WHERE t.name = %s "
        "ORDER BY r.created_at", (tenant,)).fetchall()
    return [dict(zip(("dispatch_key", "input", "origin", "origin_detail", "workflow_ref"), r,
                         strict=True))
            for r in rows]


def wait_runs(pg, tenant: str, count: int, timeout: float = 30) -> list[dict]:
    def enough() -> bool:
        for relay in RELAYS:
            if relay.proc.returncode is None and not relay.alive():
                raise AssertionError(f"{relay.name} died:\n{relay.log()[-3000:]}")
        return len(runs(pg, tenant)) >= count

    wait_until(enough, timeout=timeout, what=f"{count} run(s) of {tenant}")
    return runs(pg, tenant)


def committed(bootstrap: str, group: str, topic: str, partitions: int = 1) -> list[int]:
    """The group's committed offsets as the broker has them (-1001: none yet)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group,
                         "session.timeout.ms": 6000})
    try:
        tps = consumer.committed([TopicPartition(topic, p) for p in range(partitions)],
                                 timeout=10)
        return [tp.offset for tp in tps]
    finally:
        consumer.close()


def read_topic(bootstrap: str, topic: str, expect: int, timeout: float = 10) -> list:
    """Read every message of ``topic`` from the start, waiting until ``expect`` are there."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"reader-{uuid.uuid4()}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False,
                         "session.timeout.ms": 6000})
    try:
        metadata = consumer.list_topics(topic, timeout=10).topics[topic]
        if metadata.error is not None:  # the topic does not exist: nothing was written
            return []
        consumer.assign([TopicPartition(topic, p, 0) for p in metadata.partitions])
        got, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline and len(got) < expect:
            msg = consumer.poll(0.2)
            if msg is not None and not msg.error():
                got.append(msg)
        return got
    finally:
        consumer.close()


def topic_size(bootstrap: str, topic: str) -> int:
    """How many messages ``topic`` holds, from the broker's watermarks (0: no topic).

    Deterministic where a read with a timeout is not: a dead-letter write the relay
    waited for before committing is counted here, however slow the reader would be.
    """
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"size-{uuid.uuid4()}",
                         "session.timeout.ms": 6000})
    try:
        metadata = consumer.list_topics(topic, timeout=10).topics[topic]
        if metadata.error is not None:
            return 0
        return sum(high - low for low, high in (
            consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            for p in metadata.partitions))
    finally:
        consumer.close()


def topic_end(bootstrap: str, topic: str, partitions: int = 1) -> list[int]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "watermarks",
                         "session.timeout.ms": 6000})
    try:
        return [consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                for p in range(partitions)]
    finally:
        consumer.close()


def inbox_posts(web_proc: Process) -> int:
    """Calls to admission (``POST /v1/runs/batch``, or ``POST /v1/runs`` for a lone message
    the batch endpoint refused) in the API's access log made with the relay's User-Agent."""
    return sum(1 for line in web_proc.log().splitlines()
               if ('"POST /v1/runs/batch HTTP' in line or '"POST /v1/runs HTTP' in line)
               and '"poimen-inbox/' in line)


def headers(msg) -> dict[str, str]:
    return {k: v.decode() for k, v in (msg.headers() or [])}


# -- one message, one run, through HTTP -------------------------------------------------------


def test_one_message_becomes_one_run_via_post(setup, pg, web):
    setup.declare()
    posts_before = inbox_posts(web[0])
    setup.publish(request(input={"n": 1}, dispatch_key="order-1"), key=f"{setup.tenant}:order-1")
    _, url = setup.start_relay()

    [run] = wait_runs(pg, setup.tenant, 1)
    assert run["dispatch_key"] == "order-1" and run["input"] == {"n": 1}
    # The run came in over HTTP, sent by the relay: the API recorded its User-Agent...
    assert run["origin"] == "http" and run["origin_detail"].startswith("poimen-inbox/")
    # ...and its access log shows exactly one such POST.
    wait_until(lambda: inbox_posts(web[0]) == posts_before + 1, timeout=5,
               what="the relay's POST in the access log")
    wait_until(lambda: metric(url, "poimen_inbox_admitted_total") == 1, timeout=5,
               what="admitted counter")
    # The offset is committed only after the POST's answer: nothing more can come of it.
    setup.wait_committed([1], timeout=10, what="offset committed after the 201")
    assert len(runs(pg, setup.tenant)) == 1


# -- redelivery is absorbed by admission ---------------------------------------------------------


def test_redelivered_message_is_replayed_not_duplicated(setup, pg):
    setup.declare()
    message = request(input={"n": 2}, dispatch_key="order-2")
    setup.publish(message, message)  # the producer retried: the same message twice
    relay, url = setup.start_relay()
    wait_until(lambda: metric(url, "poimen_inbox_replayed_total") == 1, timeout=30,
               what="the second copy replayed")
    assert metric(url, "poimen_inbox_admitted_total") == 1
    assert len(runs(pg, setup.tenant)) == 1

    # Graceful stop commits everything handled, then reset the group to the start
    # and restart: both messages come again, and admission replays them.
    relay.stop()
    assert relay.proc.returncode == 0, relay.log()[-2000:]
    assert setup.committed() == [2]
    reset = Consumer({"bootstrap.servers": setup.bootstrap, "group.id": setup.group,
                      "session.timeout.ms": 6000})
    reset.commit(offsets=[TopicPartition(setup.topic, 0, 0)], asynchronous=False)
    reset.close()
    assert setup.committed() == [0]

    _, url = setup.start_relay()
    wait_until(lambda: metric(url, "poimen_inbox_replayed_total") == 2, timeout=30,
               what="both redelivered messages replayed")
    assert metric(url, "poimen_inbox_admitted_total") == 0
    assert len(runs(pg, setup.tenant)) == 1
    setup.wait_committed([2], timeout=10, what="offsets committed again")


# -- broker down and back, no message lost -------------------------------------------------------


def test_broker_outage_loses_no_message(setup, pg, tmp_path):
    port = free_port()
    data = tmp_path / "broker-data"
    data.mkdir()
    broker = start_kafka_broker(data, port, tmp_path, name="kafka-private")
    try:
        setup.bootstrap = f"127.0.0.1:{port}"
        setup.env["KAFKA_BOOTSTRAP_SERVERS"] = setup.bootstrap
        setup.declare()
        setup.start_relay()
        setup.publish(request(dispatch_key="before-outage"))
        wait_runs(pg, setup.tenant, 1)

        broker.kill()
        # The producer buffers while the broker is away; nothing is acknowledged yet.
        producer = Producer({"bootstrap.servers": setup.bootstrap,
                             "message.timeout.ms": 120000})
        setup.publish(request(dispatch_key="during-outage"), producer=producer, flush=False)
        assert producer.flush(2) == 1, "the message should still be waiting for the broker"
        time.sleep(2)  # an outage of a chosen length, not a wait for a condition
        broker = start_kafka_broker(data, port, tmp_path, name="kafka-private")
        assert producer.flush(60) == 0, "the buffered message was not delivered"

        # Both messages became their runs (two keys, two runs): neither was dead-lettered.
        got = wait_runs(pg, setup.tenant, 2, timeout=60)
        assert sorted(r["dispatch_key"] for r in got) == ["before-outage", "during-outage"]
        assert topic_size(setup.bootstrap, setup.dlq) == 0
        assert setup.relays[0].alive()
        # Committed offsets are not asserted here: after a restart the embedded broker
        # sometimes answers a fresh client's OffsetFetch with the pre-restart offset
        # although the relay's commit succeeded. A stale offset only means a replay.
    finally:
        for relay in setup.relays:  # before the broker, so they can leave the group
            relay.stop()
        broker.stop()


# -- malformed messages are dead-lettered, the rest still flows ----------------------------------


def test_malformed_messages_are_dead_lettered_and_draining_continues(setup, pg):
    setup.declare()
    bad = [  # the relay parses; the API validates the fields (its 422s)
        (b"not json {", "invalid_json"),
        (b"[1, 2]", "not_an_object"),
        (b'{"input": {}}', "http_422"),
        (b'{"workflow_ref": "echo", "dispatch_key": 5}', "http_422"),
        (b'{"workflow_ref": "no-such-workflow"}', "http_422"),
    ]
    for value, _ in bad:
        setup.publish(value, key="bad")
    setup.publish(*(request(dispatch_key=f"good-{i}") for i in range(3)))
    _, url = setup.start_relay()

    got = wait_runs(pg, setup.tenant, 3)
    assert sorted(r["dispatch_key"] for r in got) == ["good-0", "good-1", "good-2"]
    dead = read_topic(setup.bootstrap, setup.dlq, expect=len(bad))
    assert len(dead) == len(bad)
    dead.sort(key=lambda m: int(headers(m)["poimen.dlq.origin.offset"]))
    for offset, (msg, (value, reason)) in enumerate(zip(dead, bad, strict=True)):
        h = headers(msg)
        assert msg.value() == value and msg.key() == b"bad"  # the original, untouched
        assert h["poimen.dlq.reason"] == reason
        assert h["poimen.dlq.origin.topic"] == setup.topic
        assert h["poimen.dlq.origin.partition"] == "0"
        assert h["poimen.dlq.origin.offset"] == str(offset)
    h = headers(dead[-1])
    assert h["poimen.dlq.http.status"] == "422" and "unknown_workflow" in h["poimen.dlq.detail"]
    # The counters move after the broker's ack, which makes the record readable: wait for them.
    wait_until(lambda: metric(url, "poimen_inbox_dead_lettered_total", reason="invalid_json") == 1,
               timeout=10, what="the dead-letter counter")
    setup.wait_committed([8], timeout=10,
                         what="offsets committed past the dead-lettered messages")


# -- no bypass of the HTTP layer -----------------------------------------------------------------


def test_relay_only_admits_through_http(setup, pg):
    setup.declare(partitions=2)
    for i in range(4):
        setup.publish(request(dispatch_key=f"k{i}"), key=f"{setup.tenant}:k{i}")
    _, url = setup.start_relay()
    wait_runs(pg, setup.tenant, 4)
    rows = pg.execute("SELECT origin, origin_detail FROM runs").fetchall()
    assert rows and all(o == "http" and d.startswith("poimen-inbox/") for o, d in rows), rows
    # The row commits before the API answers the relay, which then counts it: wait for it.
    wait_until(lambda: metric(url, "poimen_inbox_admitted_total") == 4, timeout=10,
               what="the admitted counter")


def test_bridge_imports_nothing_from_app_or_workers():
    # The inbox is an HTTP client of the API: nothing of app/ or workers/, and no Flask,
    # Celery or SQLAlchemy (its settings come from poimenconfig, standard library only).
    code = ("import sys, bridge.inbox, bridge.topics, bridge.kafka; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('app', 'workers', 'flask', 'celery', 'sqlalchemy')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "[]"
    # What every module of bridge/ may import of app/: tests/test_wiring.py.


# -- lag is a metric, and drains to zero ---------------------------------------------------------


def test_lag_metric_reports_backlog_and_drains_to_zero(setup, pg, test_env, tmp_path):
    setup.declare(partitions=2)
    api_port = free_port()  # nothing listens yet: the backlog cannot drain
    _, url = setup.start_relay(POIMEN_API_URL=f"http://127.0.0.1:{api_port}")
    for i in range(6):
        setup.publish(request(dispatch_key=f"lag-{i}"), key=f"{setup.tenant}:lag-{i}")
    wait_until(lambda: metric_sum(url, "poimen_inbox_lag") == 6, timeout=20,
               what="lag of 6 while the API is away")
    labels = {dict(k[1])["partition"] for k in metrics(url) if k[0] == "poimen_inbox_lag"}
    assert labels == {"0", "1"}

    web_proc, _ = start_web(test_env, tmp_path, port=api_port, name="late-web")
    try:
        wait_runs(pg, setup.tenant, 6, timeout=30)
        end = topic_end(setup.bootstrap, setup.topic, 2)
        setup.wait_committed(end, partitions=2, timeout=10, what="offsets committed")
        wait_until(lambda: metric_sum(url, "poimen_inbox_lag") == 0, timeout=20,
                   what="lag back to zero")
        assert metric(url, "poimen_inbox_lag", topic=setup.topic, partition="0") == 0
        assert metric(url, "poimen_inbox_lag", topic=setup.topic, partition="1") == 0
    finally:
        web_proc.stop()


# -- aPI down: nothing committed or dead-lettered, nothing lost ----------------------------------


def test_api_down_commits_nothing_and_loses_nothing(setup, pg, test_env, tmp_path):
    setup.declare(partitions=2)
    api_port = free_port()
    web_proc, api_url = start_web(test_env, tmp_path, port=api_port, name="own-web")
    setup.env["POIMEN_API_URL"] = api_url
    try:
        relay, url = setup.start_relay()
        setup.publish(request(dispatch_key="up"), key="up")
        wait_runs(pg, setup.tenant, 1)
        wait_until(lambda: max(setup.committed(2)) > 0,
                   timeout=10, what="first commit")
        before = setup.committed(2)

        web_proc.stop()
        keys = [f"down-{i}" for i in range(6)]
        for key in keys:
            setup.publish(request(dispatch_key=key), key=key)
        # Several rounds of retries, each a chance to commit wrongly: none did.
        wait_until(lambda: metric_sum(url, "poimen_inbox_retries_total") >= 4, timeout=30,
                   what="the relay retrying against the stopped API")
        # Nothing listens: refused connections, counted as such (not as timeouts).
        assert metric(url, "poimen_inbox_retries_total", reason="connection") >= 4
        assert metric(url, "poimen_inbox_retries_total", reason="timeout") == 0
        assert setup.committed(2) == before
        assert metric_sum(url, "poimen_inbox_dead_lettered_total") == 0

        # A crash while the API is away: whatever the relay had fetched must come again.
        # The embedded broker never expires a SIGKILLed member's session, so its group
        # stays blocked; the successor takes over the group's committed offsets under
        # a new group id instead, which is all a restarted relay would start from.
        relay.kill()
        successor = f"{setup.group}-after-crash"
        offsets = [TopicPartition(setup.topic, p, o) for p, o in enumerate(before) if o >= 0]
        handover = Consumer({"bootstrap.servers": setup.bootstrap, "group.id": successor,
                             "session.timeout.ms": 6000})
        handover.commit(offsets=offsets, asynchronous=False)
        handover.close()
        setup.env["POIMEN_INBOX_GROUP"] = successor
        relay, url = setup.start_relay()
        wait_until(lambda: metric_sum(url, "poimen_inbox_retries_total") >= 2, timeout=30,
                   what="the new relay retrying")
        assert setup.committed(2) == before

        web_proc, _ = start_web(test_env, tmp_path, port=api_port, name="own-web-again")
        got = wait_runs(pg, setup.tenant, 7, timeout=30)
        assert sorted(r["dispatch_key"] for r in got) == sorted(["up", *keys])
        end = topic_end(setup.bootstrap, setup.topic, 2)
        setup.wait_committed(end, partitions=2, timeout=10,
                             what="offsets committed once the API is back")
        assert topic_size(setup.bootstrap, setup.dlq) == 0
        assert len(runs(pg, setup.tenant)) == 7
    finally:
        web_proc.stop()


def test_api_5xx_is_retried_not_dead_lettered(setup, pg, make_tenant):
    """A real 500 from the API (admission's INSERT fails) is retried until it succeeds."""
    setup.declare()
    tenant_id = pg.execute("SELECT id FROM tenants WHERE name = %s",
                           (setup.tenant,)).fetchone()[0]
    fn = f"fail_runs_{setup.tenant.replace('-', '_')}"
    pg.execute(f"CREATE FUNCTION {fn}() RETURNS trigger LANGUAGE plpgsql AS "
               "$$ BEGIN RAISE EXCEPTION 'database trouble'; END $$")
    pg.execute(f"CREATE TRIGGER {fn} BEFORE INSERT ON runs FOR EACH ROW "
               f"WHEN (NEW.tenant_id = {tenant_id}) EXECUTE FUNCTION {fn}()")
    try:
        _, url = setup.start_relay()
        setup.publish(request(dispatch_key="through-500"))
        wait_until(lambda: metric(url, "poimen_inbox_retries_total", reason="http_500") >= 2,
                   timeout=20, what="retries on 500")
        assert setup.committed() == [-1001]
        assert metric_sum(url, "poimen_inbox_dead_lettered_total") == 0
    finally:
        pg.execute(f"DROP TRIGGER IF EXISTS {fn} ON runs")
        pg.execute(f"DROP FUNCTION IF EXISTS {fn}()")
    [run] = wait_runs(pg, setup.tenant, 1, timeout=20)
    assert run["dispatch_key"] == "through-500"
    assert topic_size(setup.bootstrap, setup.dlq) == 0


# -- a key conflict is dead-lettered with its 409 ------------------------------------------------


def test_conflicting_dispatch_key_is_dead_lettered_with_409(setup, pg):
    setup.declare()
    setup.publish(request(input={"v": 1}, dispatch_key="same"),
                  request(input={"v": 2}, dispatch_key="same"),  # another intent, same key
                  request(input={"v": 3}, dispatch_key="after"))
    _, url = setup.start_relay()
    got = wait_runs(pg, setup.tenant, 2)
    assert sorted((r["dispatch_key"], r["input"]["v"]) for r in got) == [("after", 3), ("same", 1)]
    [dead] = read_topic(setup.bootstrap, setup.dlq, expect=1)
    h = headers(dead)
    assert h["poimen.dlq.reason"] == "http_409" and h["poimen.dlq.http.status"] == "409"
    assert "dispatch_key_conflict" in h["poimen.dlq.detail"]
    assert json.loads(dead.value())["input"] == {"v": 2}
    # The counter moves after the broker's ack, which makes the record readable: wait for it.
    wait_until(lambda: metric(url, "poimen_inbox_dead_lettered_total", reason="http_409") == 1,
               timeout=10, what="the dead-letter counter")
    assert metric_sum(url, "poimen_inbox_retries_total") == 0
    setup.wait_committed([3], timeout=10, what="offsets committed past the conflict")


# -- wiring --------------------------------------------------------------------------------------


def test_new_tenant_topic_is_picked_up_without_restart(setup, pg, make_tenant):
    setup.declare()
    _, url = setup.start_relay()
    setup.publish(request(dispatch_key="first"))
    wait_runs(pg, setup.tenant, 1)

    newcomer = make_tenant()
    declare_topics(setup.bootstrap, setup.prefix, [newcomer.name], 2)
    producer = Producer({"bootstrap.servers": setup.bootstrap})
    producer.produce(f"{setup.prefix}.{newcomer.name}.dispatch",
                     json.dumps(request(dispatch_key="new")).encode())
    assert producer.flush(10) == 0
    [run] = wait_runs(pg, newcomer.name, 1, timeout=30)
    assert run["dispatch_key"] == "new"


def test_procfile_runs_the_inbox():
    lines = (ROOT / "Procfile").read_text().splitlines()
    assert "inbox: python -m bridge.inbox" in lines


def test_a_delayed_expiring_message_is_admitted_delayed_and_its_redelivery_replays(setup, pg):
    """A dispatch message may carry delay_seconds and expires_in_seconds (the API's fields):
    the run is admitted delayed, under the message's derived key when it has none, and
    the message read again (the group reset, as a DLQ replay or a rebalance would) is
    the same run: a relative time compares by presence, not by when it is read."""
    setup.declare()
    setup.publish(request(delay_seconds=600, expires_in_seconds=900))  # no key: derived
    setup.publish(request(delay_seconds=600, dispatch_key="later-1"))
    relay, url = setup.start_relay()
    wait_until(lambda: metric(url, "poimen_inbox_admitted_total") == 2, timeout=30,
               what="both messages admitted")
    relay.stop()
    rows = pg.execute(
        "SELECT r.dispatch_key, r.admitted_not_before - r.created_at, "
        "r.expires_at - r.created_at, r.status FROM runs r JOIN tenants t "
        "ON t.id = r.tenant_id WHERE t.name = %s ORDER BY r.created_at",
        (setup.tenant,)).fetchall()
    assert [(str(delay), status) for _, delay, _, status in rows] == [
        ("0:10:00", "queued"), ("0:10:00", "queued")]
    assert rows[0][0].startswith("kafka:") and str(rows[0][2]) == "0:15:00"
    reset = Consumer({"bootstrap.servers": setup.bootstrap, "group.id": setup.group,
                      "session.timeout.ms": 6000})
    reset.commit(offsets=[TopicPartition(setup.topic, 0, 0)], asynchronous=False)
    reset.close()
    _, url = setup.start_relay()
    wait_until(lambda: metric(url, "poimen_inbox_replayed_total") == 2, timeout=30,
               what="both messages replayed")
    assert len(runs(pg, setup.tenant)) == 2
