"""The Kafka inbox under hostile input, over real processes: a real broker, gunicorn
serving the API, and ``python -m bridge.inbox`` as a subprocess.

Each test asserts outcomes (runs in the database, the dead-letter topic, the
group's committed offsets), never which calls were made. See docs/operations/inbox.md for
the message-fault / delivery-fault table these tests hold the relay to.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from tests.bridge import test_inbox_relay
from tests.bridge.test_inbox_relay import (
    Setup,
    committed,
    headers,
    metric,
    metric_sum,
    read_topic,
    request,
    runs,
    topic_end,
    topic_size,
    wait_runs,
)
from tests.processes import ROOT, wait_until

# The relay tests' fixtures: gunicorn for the module; one test's tenant, topics and relays.
web = test_inbox_relay.web
setup = test_inbox_relay.setup

pytestmark = pytest.mark.slow

RAISE_MARKER = "__poimen_test_raise__"


# -- helpers -------------------------------------------------------------------------------------


def produce(bootstrap: str, topic: str, value: bytes | dict, key: bytes | None = None) -> int:
    """Publish one message to partition 0 and return its offset once acknowledged."""
    return produce_timed(bootstrap, topic, value, key)[0]


def produce_timed(bootstrap: str, topic: str, value: bytes | dict,
                  key: bytes | None = None) -> tuple[int, int]:
    """Publish one message to partition 0; return its offset and stored time (ms)."""
    raw = json.dumps(value).encode() if isinstance(value, dict) else value
    reports: list = []
    # Above librdkafka's 1,000,000-byte default: the hostile values include a larger one.
    producer = Producer({"bootstrap.servers": bootstrap, "message.max.bytes": 2_000_000})
    producer.produce(topic, raw, key=key, partition=0,
                     on_delivery=lambda err, msg: reports.append(
                         (err, msg.offset(), msg.timestamp()[1])))
    assert producer.flush(30) == 0, "the broker did not acknowledge the message"
    [(err, offset, timestamp)] = reports
    assert err is None, err
    return offset, timestamp


def dead_letters(bootstrap: str, topic: str, expect: int, timeout: float = 2) -> dict[int, list]:
    """The dead letters of ``topic`` by origin offset (a list: a duplicate would show)."""
    found: dict[int, list] = {}
    for msg in read_topic(bootstrap, topic, expect=expect, timeout=timeout):
        found.setdefault(int(headers(msg)["poimen.dlq.origin.offset"]), []).append(msg)
    return found


def run_with_key(pg, tenant: str, key: str) -> list[dict]:
    return [r for r in runs(pg, tenant) if r["dispatch_key"] == key]


def reset_offsets(world: Setup, offset: int) -> None:
    """Move the group's committed offset of partition 0 back, as an operator would."""
    consumer = Consumer({"bootstrap.servers": world.bootstrap, "group.id": world.group,
                         "session.timeout.ms": 6000})
    consumer.commit(offsets=[TopicPartition(world.topic, 0, offset)], asynchronous=False)
    consumer.close()
    assert world.committed() == [offset]


# -- hostile values: each is dead-lettered, and the next message still becomes a run -------------


HOSTILE = [
    # (name, value, reason, what the dead letter's detail mentions)
    ("100,000-deep array", b"[" * 100_000 + b"]" * 100_000, "too_deep", "deeper"),
    ("2 KB of [", b"[" * 2048, "too_deep", "deeper"),
    ("invalid UTF-8", b'{"workflow_ref": "echo", "input": {"s": "caf\xe9"}}', "invalid_utf8",
     "utf-8"),
    ("JSON null", b"null", "not_an_object", "null"),
    ("workflow_ref not a string", b'{"workflow_ref": 42, "dispatch_key": "h1"}', "http_422",
     "workflow_ref"),
    ("unknown workflow", b'{"workflow_ref": "no-such-workflow", "dispatch_key": "h2"}',
     "http_422", "unknown_workflow"),
    ("unknown field dispatchKey", b'{"workflow_ref": "echo", "dispatchKey": "h3"}', "http_422",
     "dispatchKey"),
    ("1,040,000-byte non-JSON value", b"x" * 1_040_000, "invalid_json", "not JSON"),
    ("our own code raises", json.dumps({"workflow_ref": "echo", "dispatch_key": "h4",
                                        "input": {"s": RAISE_MARKER}}).encode(),
     "internal_error", "RuntimeError"),
]


def test_each_hostile_message_is_dead_lettered_and_the_next_one_runs_within_10s(setup, pg):
    setup.declare()
    _, url = setup.start_relay(POIMEN_INBOX_TEST_RAISE_ON=RAISE_MARKER)
    for count, (name, value, reason, mention) in enumerate(HOSTILE, start=1):
        published = time.monotonic()
        bad = produce(setup.bootstrap, setup.topic, value, key=b"hostile")
        good_key = f"after-{count}"
        good = produce(setup.bootstrap, setup.topic, request(dispatch_key=good_key))
        assert (bad, good) == (2 * count - 2, 2 * count - 1)  # both on partition 0, in order

        wait_until(lambda key=good_key: run_with_key(pg, setup.tenant, key),
                   timeout=10 - (time.monotonic() - published),
                   what=f"the message after the {name} to become a run")
        found = wait_until(lambda n=count, b=bad: (d := dead_letters(setup.bootstrap, setup.dlq,
                                                                     expect=n)).get(b) and d,
                           timeout=10, what=f"the {name} in the DLQ")
        [dead] = found[bad]
        h = headers(dead)
        assert h["poimen.dlq.reason"] == reason, name
        assert mention.lower() in h["poimen.dlq.detail"].lower(), (name, h["poimen.dlq.detail"])
        assert (h["poimen.dlq.origin.topic"], h["poimen.dlq.origin.partition"]) == (
            setup.topic, "0")
        assert dead.key() == b"hostile"
        if len(value) > 1_000_000:
            # Cut to fit the producer's limit, and saying so; the origin is kept.
            assert h["poimen.dlq.truncated"] == "value"
            assert h["poimen.dlq.original.size"] == str(len(value))
            assert value.startswith(dead.value()) and len(dead.value()) < 1_000_000
        else:
            assert dead.value() == value and "poimen.dlq.truncated" not in h
        if reason == "internal_error":
            assert "RuntimeError" in h["poimen.dlq.traceback"]
            assert "in deliver" in h["poimen.dlq.traceback"]

    # Nothing stalled, nothing was admitted that should not have been, all committed.
    assert sorted(r["dispatch_key"] for r in runs(pg, setup.tenant)) == sorted(
        f"after-{i}" for i in range(1, len(HOSTILE) + 1))
    assert sum(map(len, dead_letters(setup.bootstrap, setup.dlq, len(HOSTILE)).values())) == len(
        HOSTILE)
    setup.wait_committed([2 * len(HOSTILE)], timeout=10, what="every offset committed")
    assert metric(url, "poimen_inbox_dlq_truncated_total") == 1
    assert metric(url, "poimen_inbox_retries_total", reason="internal_error") == 2
    assert metric(url, "poimen_inbox_dead_lettered_total", reason="internal_error") == 1


# -- redirects are never followed ----------------------------------------------------------------


class RedirectingProxy:
    """A tiny local server in front of the API that answers every POST with a 302.

    The redirect points at its own ``/v1/runs/``, and it forwards GETs to the API,
    so a client that follows the redirect (turning the POST into a GET, keeping
    its token on the same host) gets the API's 200 list of runs: what a relay
    that followed redirects once took for a successful replay. ``forward()``
    removes the redirect: POSTs then pass through to the API.
    """

    def __init__(self, api_url: str):
        self.api_url = api_url
        self.redirecting = True
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if proxy.redirecting:
                    self.send_response(302)
                    self.send_header("Location", "/v1/runs/")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                else:
                    self._forward("POST", body)

            def do_GET(self) -> None:
                self._forward("GET", b"")

            def _forward(self, method: str, body: bytes) -> None:
                passed = {k: v for k, v in self.headers.items()
                          if k.lower() in ("authorization", "x-poimen-tenant", "content-type",
                                           "user-agent")}
                answer = requests.request(method, proxy.api_url + self.path.rstrip("/"),
                                          data=body, headers=passed, allow_redirects=False,
                                          timeout=15)
                self.send_response(answer.status_code)
                self.send_header("Content-Type", answer.headers.get("Content-Type", ""))
                self.send_header("Content-Length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def forward(self) -> None:
        self.redirecting = False

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_redirect_is_retried_never_followed_committed_or_dead_lettered(setup, pg, web):
    setup.declare()
    proxy = RedirectingProxy(web[1])
    try:
        # The proxy really does make a followed redirect look like success.
        followed = requests.post(f"{proxy.url}/v1/runs", data=b"{}", timeout=10,
                                 headers={"Authorization": f"Bearer {setup.env['POIMEN_API_TOKEN']}",
                                          "X-Poimen-Tenant": setup.tenant,
                                          "Content-Type": "application/json"})
        assert followed.status_code == 200 and "runs" in followed.json()

        _, url = setup.start_relay(POIMEN_API_URL=proxy.url)
        setup.publish(request(dispatch_key="behind-proxy"))
        wait_until(lambda: metric(url, "poimen_inbox_retries_total", reason="redirect") >= 3,
                   timeout=20, what="the relay retrying the redirect")
        assert runs(pg, setup.tenant) == []
        assert setup.committed() == [-1001]
        assert topic_size(setup.bootstrap, setup.dlq) == 0
        assert metric(url, "poimen_inbox_replayed_total") == 0

        proxy.forward()  # the redirect is gone: the API answers through the proxy
        [run] = wait_runs(pg, setup.tenant, 1, timeout=20)
        assert run["dispatch_key"] == "behind-proxy"
        setup.wait_committed([1], timeout=10, what="the offset committed after the 201")
        assert topic_size(setup.bootstrap, setup.dlq) == 0
        assert len(runs(pg, setup.tenant)) == 1
    finally:
        proxy.close()


# -- keyless messages: one run each under any redelivery -----------------------------------------


def test_keyless_messages_stay_one_run_each_after_redelivery(setup, pg):
    setup.declare()
    small = {"workflow_ref": "echo", "input": {"n": 1}}
    # 400 KB of emoji: ASCII escaping would make it a 1.2 MB POST, over the API's 1 MiB.
    emoji = json.dumps({"workflow_ref": "echo", "input": {"s": "\U0001F600" * 100_000}},
                       ensure_ascii=False).encode()
    assert len(emoji) < 500_000
    placed = [produce_timed(setup.bootstrap, setup.topic, small),
              produce_timed(setup.bootstrap, setup.topic, emoji)]
    relay, url = setup.start_relay()
    got = wait_runs(pg, setup.tenant, 2)
    # The documented derived key: the message's place and its stored time.
    keys = [f"kafka:{setup.topic}:0:{offset}:{timestamp}" for offset, timestamp in placed]
    assert sorted(r["dispatch_key"] for r in got) == sorted(keys)
    assert run_with_key(pg, setup.tenant, keys[1])[0]["input"] == {"s": "\U0001F600" * 100_000}
    # The runs are in Postgres once the API commits; the relay counts them when the
    # answer reaches it, a moment later (a read in between can see 0).
    wait_until(lambda: metric(url, "poimen_inbox_derived_keys_total") == 2, timeout=10,
               what="both derived keys counted")
    setup.wait_committed([2], timeout=10, what="both offsets committed")

    # Redeliver both: reset the group's committed offset to before them and restart.
    relay.stop()
    assert relay.proc.returncode == 0, relay.log()[-2000:]
    reset_offsets(setup, 0)
    _, url = setup.start_relay()
    wait_until(lambda: metric(url, "poimen_inbox_replayed_total") == 2, timeout=30,
               what="both redelivered messages replayed")
    assert metric(url, "poimen_inbox_admitted_total") == 0
    assert sorted(r["dispatch_key"] for r in runs(pg, setup.tenant)) == sorted(keys)
    assert topic_size(setup.bootstrap, setup.dlq) == 0


def recreate_topic(bootstrap: str, topic: str, partitions: int = 1) -> None:
    """Delete ``topic`` and create it again, empty, as an operator's AdminClient would."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.delete_topics([topic], operation_timeout=10).values():
        future.result()

    def created() -> bool:
        try:
            for future in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
                future.result()
        except KafkaException as err:  # the deletion may take a moment to settle
            if err.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS:
                return False
            raise
        return True

    wait_until(created, timeout=20, what=f"{topic} created again")
    wait_until(lambda: topic_end(bootstrap, topic) == [0], timeout=10,
               what=f"{topic} empty after re-creation")


def test_keyless_messages_of_a_recreated_topic_are_new_runs(setup, pg):
    """A re-created topic starts its offsets at 0 again; its keyless
    messages are new messages, never a replay of (or a conflict with) the old topic's."""
    setup.declare()
    same = request(input={"n": "same"})
    produce(setup.bootstrap, setup.topic, same)
    produce(setup.bootstrap, setup.topic, request(input={"n": "old"}))
    relay, url = setup.start_relay()
    wait_runs(pg, setup.tenant, 2)
    setup.wait_committed([2], what="both offsets of the old topic committed")
    relay.stop()

    recreate_topic(setup.bootstrap, setup.topic)
    # At offsets 0 and 1 again: the same value as before, then a different one.
    assert produce(setup.bootstrap, setup.topic, same) == 0
    assert produce(setup.bootstrap, setup.topic, request(input={"n": "new"})) == 1
    # The old topic's commit (2) is past the new topic's end: the group starts over
    # from the first message, as for a new topic; say so explicitly, as an operator would.
    reset_offsets(setup, 0)
    _, url = setup.start_relay()
    wait_until(lambda: metric(url, "poimen_inbox_admitted_total")
               + metric(url, "poimen_inbox_replayed_total")
               + metric_sum(url, "poimen_inbox_dead_lettered_total") >= 2, timeout=30,
               what="both messages of the re-created topic answered")
    got = runs(pg, setup.tenant)
    assert sorted(r["input"]["n"] for r in got) == ["new", "old", "same", "same"], got
    assert metric(url, "poimen_inbox_admitted_total") == 2
    assert metric(url, "poimen_inbox_replayed_total") == 0
    assert topic_size(setup.bootstrap, setup.dlq) == 0
    assert len({r["dispatch_key"] for r in got}) == 4


# -- SIGTERM while a dead-letter write waits for its acknowledgement ----------------------------


def test_sigterm_during_a_dead_letter_write_exits_in_time_with_the_message_dead_lettered_once(
        setup, pg):
    setup.declare()
    # The DLQ producer holds each write for 4 s before sending (librdkafka's
    # linger.ms, a KAFKA_* setting): a dead-letter write is certainly in flight
    # when the signal arrives, waiting for an acknowledgement someone must poll for.
    relay, url = setup.start_relay(KAFKA_LINGER_MS="4000")
    bad = produce(setup.bootstrap, setup.topic, b"not json, dead-lettered at shutdown")
    wait_until(lambda: metric(url, "poimen_inbox_dlq_writes_in_flight") == 1, timeout=20,
               what="a dead-letter write in flight")
    signalled = time.monotonic()
    relay.signal_group(signal.SIGTERM)
    try:
        relay.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the relay did not exit within 30 s of SIGTERM:\n{relay.log()[-3000:]}")
    took = time.monotonic() - signalled
    assert took < 25, f"shutdown took {took:.1f}s, over POIMEN_SHUTDOWN_GRACE"
    assert relay.proc.returncode == 0, relay.log()[-3000:]
    # The write finished before the commit: in the DLQ once, and committed.
    assert [len(v) for v in dead_letters(setup.bootstrap, setup.dlq, expect=2).values()] == [1]
    assert setup.committed() == [bad + 1]

    # A successor resumes after it: the dead letter is not written a second time.
    setup.start_relay()
    after = produce(setup.bootstrap, setup.topic, request(dispatch_key="after-shutdown"))
    wait_runs(pg, setup.tenant, 1)
    setup.wait_committed([after + 1], timeout=10, what="the successor's commit")
    found = dead_letters(setup.bootstrap, setup.dlq, expect=2)
    assert list(found) == [bad] and len(found[bad]) == 1


# -- a tenant that does not exist yet (topics declared first) -----------------------------------


def test_messages_for_a_tenant_not_yet_created_wait_and_become_runs(setup, pg, make_tenant):
    name = f"late{uuid.uuid4().hex[:8]}"
    # Topics can be declared for a tenant the database does not know (no app, no DB).
    declared = subprocess.run(
        [sys.executable, "-m", "bridge.topics", "declare", "--tenant", name, "--partitions", "1"],
        env=setup.env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert declared.returncode == 0, declared.stderr
    topic = f"{setup.prefix}.{name}.dispatch"  # docs/operations/inbox.md
    assert f"{topic}\tcreated" in declared.stdout
    produce(setup.bootstrap, topic, request(dispatch_key="early"))

    relay, url = setup.start_relay()
    wait_until(lambda: metric(url, "poimen_inbox_retries_total", reason="tenant_not_found") >= 2,
               timeout=30, what="retries while the tenant does not exist")
    assert f"tenant '{name}' does not exist (yet)" in relay.log()
    assert committed(setup.bootstrap, setup.group, topic) == [-1001]
    assert topic_size(setup.bootstrap, f"{setup.prefix}.{name}.dispatch.dlq") == 0

    make_tenant(name)
    [run] = wait_runs(pg, name, 1, timeout=30)
    assert run["dispatch_key"] == "early"
    wait_until(lambda: committed(setup.bootstrap, setup.group, topic) == [1], timeout=10,
               what="the offset committed once the tenant exists")
    assert metric(url, "poimen_inbox_dead_lettered_total", reason="http_404") == 0
