"""W3C Trace Context end to end, over real processes: gunicorn, a Celery
worker, the outbox relay and the Kafka inbox, on real Postgres, Redis and Kafka.

A ``traceparent`` sent with ``POST /v1/runs`` (or as a Kafka header of a dispatch
message) is on every event of the run, and of its fan-out children, as the CloudEvents
distributed-tracing extension, read here with the CloudEvents SDK's Kafka binding; the
worker reads it off the run's Celery message (its log lines carry the trace id).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from confluent_kafka import Consumer, Producer, TopicPartition

from bridge.topics import declare_topics
from poimen_dev.platform import procfile_commands
from tests import kafka_topics
from tests.processes import (
    BIN,
    Process,
    free_port,
    start_inbox,
    start_web,
    start_worker,
    wait_until,
)

try:  # the CloudEvents SDK: 2.x keeps the 1.x API under cloudevents.v1
    from cloudevents.v1.kafka import KafkaMessage, from_binary
except ImportError:  # pragma: no cover - the SDK 1.x
    from cloudevents.kafka import KafkaMessage, from_binary

pytestmark = pytest.mark.slow

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"
STATE = "congo=t61rcWkgMzE"


@dataclass
class Platform:
    api: str
    tenant: str
    token: str
    prefix: str
    bootstrap: str
    worker: Process

    def post(self, body: dict, **headers: str) -> requests.Response:
        return requests.post(f"{self.api}/v1/runs", json=body, timeout=10,
                             headers={"Authorization": f"Bearer {self.token}", **headers})

    def get(self, path: str) -> dict:
        answer = requests.get(f"{self.api}{path}", timeout=10,
                              headers={"Authorization": f"Bearer {self.token}"})
        assert answer.ok, answer.text
        return answer.json()

    def finished(self, run_id: str, timeout: float = 90) -> dict:
        def done():
            run = self.get(f"/v1/runs/{run_id}")
            return run if run["status"] in ("succeeded", "failed", "cancelled") else None

        return wait_until(done, timeout=timeout, what=f"run {run_id} to finish")

    def events(self, run_ids: set[str], ends: set[str], timeout: float = 60) -> dict:
        """Every event of ``run_ids`` on the tenant's events topic (docs/guide/events.md),
        parsed with the CloudEvents SDK; read until each of ``ends`` has its last event."""
        topic = f"{self.prefix}.{self.tenant}.events"
        consumer = Consumer({"bootstrap.servers": self.bootstrap,
                             "group.id": f"trace-{uuid.uuid4()}", "enable.auto.commit": False,
                             "auto.offset.reset": "earliest"})
        try:
            partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
            consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
            found: dict[str, list] = {}

            def complete() -> bool:
                while (msg := consumer.poll(0.2)) is not None:
                    if msg.error():
                        continue
                    event = from_binary(KafkaMessage(
                        headers=dict(msg.headers() or []), key=msg.key(), value=msg.value()),
                        data_unmarshaller=json.loads)
                    run_id = msg.key().decode().split(":", 1)[1]
                    if run_id in run_ids:
                        found.setdefault(run_id, []).append(event)
                return all(any(e["type"] in ("run.succeeded", "run.failed")
                               for e in found.get(r, [])) for r in ends)

            wait_until(complete, timeout=timeout, what="the runs' events on Kafka")
            return found
        finally:
            consumer.close()


@pytest.fixture
def platform(test_env, make_tenant, tmp_path, request):
    # Per test: the tables (tenants and tokens included) are emptied between tests.
    log_dir: Path = tmp_path
    creds, service = make_tenant(), make_tenant(service=True).token
    name, token = creds.name, creds.token
    prefix = f"tr{uuid.uuid4().hex[:6]}"
    env = {**test_env, "POIMEN_TOPIC_PREFIX": prefix, "POIMEN_OUTBOX_POLL_INTERVAL": "0.05",
           "POIMEN_OUTBOX_TOPIC_PARTITIONS": "1", "LOG_FORMAT": "json"}
    bootstrap = test_env["KAFKA_BOOTSTRAP_SERVERS"]
    declare_topics(bootstrap, prefix, [name], 1)
    procs: list[Process] = []
    try:
        web, api = start_web(env, log_dir, workers=1, threads=4)
        procs.append(web)
        worker = start_worker(env, log_dir, concurrency=2)
        procs.append(worker)
        procs.append(Process("outbox", ["/bin/sh", "-c", f"exec {procfile_commands()['outbox']}"],
                             {**env, "METRICS_PORT": str(free_port()),
                              "PATH": f"{BIN}:{env.get('PATH', '')}"}, log_dir).start())
        inbox, _ = start_inbox({**env, "POIMEN_API_URL": api, "POIMEN_API_TOKEN": service,
                                "POIMEN_INBOX_GROUP": f"inbox-{prefix}"}, log_dir)
        procs.append(inbox)
        wait_until(lambda: "ready" in worker.log(), timeout=60, what="the Celery worker")
        yield Platform(api, name, token, prefix, bootstrap, worker)
    finally:
        for proc in procs:
            proc.stop()
            print(f"--- {proc.name} ---\n{proc.log()[-4000:]}")  # shown if the test fails
        kafka_topics.delete_under(bootstrap, prefix)


def test_an_http_traceparent_is_on_every_event_of_the_run_and_of_its_children(platform):
    created = platform.post({"workflow_ref": "doc-review",
                             "input": {"participants": ["ana", "bo"]}},
                            traceparent=PARENT, tracestate=STATE)
    assert created.status_code == 201, created.text
    parent = created.json()["id"]
    assert platform.finished(parent)["status"] == "succeeded"
    children = platform.get(f"/v1/runs?parent_run_id={parent}")["runs"]
    assert len(children) == 2
    # A fan-out child inherits its parent's trace context.
    assert {c["traceparent"] for c in children} == {PARENT}
    runs = {parent} | {c["id"] for c in children}

    events = platform.events(runs, ends=runs)
    assert set(events) == runs
    for run_id, run_events in events.items():
        types = [e["type"] for e in run_events]
        assert types[0] == "run.admitted" and types[-1] == "run.succeeded", types
        for event in run_events:
            attributes = event.get_attributes()
            assert attributes["traceparent"] == PARENT, (run_id, attributes)
            assert attributes["tracestate"] == STATE
            assert event.data["run_id"] == run_id  # the data is the event, unchanged
            assert "traceparent" not in event.data

    # The worker read it off the run's Celery message: its lines for the run carry the id.
    lines = [json.loads(line) for line in platform.worker.log().splitlines()
             if line.startswith("{")]
    mine = [r for r in lines if r.get("run_id") == parent]
    assert mine and all(r.get("trace_id") == TRACE_ID for r in mine), mine[-3:]


def test_a_run_without_a_valid_traceparent_has_no_tracing_attributes(platform):
    plain = platform.post({"workflow_ref": "echo", "input": {}}).json()["id"]
    invalid = platform.post({"workflow_ref": "echo", "input": {}},
                            traceparent=PARENT.upper(), tracestate=STATE).json()["id"]
    events = platform.events({plain, invalid}, ends={plain, invalid})
    for run_events in events.values():
        for event in run_events:
            assert "traceparent" not in event.get_attributes()
            assert "tracestate" not in event.get_attributes()


def test_a_kafka_dispatch_messages_traceparent_header_is_kept_on_the_run(platform):
    producer = Producer({"bootstrap.servers": platform.bootstrap})
    topic = f"{platform.prefix}.{platform.tenant}.dispatch"
    traced, untraced = f"kafka-{uuid.uuid4().hex[:8]}", f"kafka-{uuid.uuid4().hex[:8]}"
    producer.produce(topic, json.dumps({"workflow_ref": "echo", "input": {},
                                        "dispatch_key": traced}).encode(),
                     headers=[("traceparent", PARENT.encode()), ("tracestate", STATE.encode())])
    # Invalid (uppercase hex): the run is admitted all the same, without it.
    producer.produce(topic, json.dumps({"workflow_ref": "echo", "input": {},
                                        "dispatch_key": untraced}).encode(),
                     headers=[("traceparent", PARENT.upper().encode())])
    assert producer.flush(30) == 0

    def admitted():
        runs = {key: platform.get(f"/v1/runs?dispatch_key={key}")["runs"]
                for key in (traced, untraced)}
        return runs if all(runs.values()) else None

    runs = wait_until(admitted, timeout=60, what="the inbox to admit both messages")
    traced_run, untraced_run = runs[traced][0], runs[untraced][0]
    assert traced_run["origin"] == "http"  # through the API, as every inbox message
    assert (traced_run["traceparent"], untraced_run["traceparent"]) == (PARENT, None)

    events = platform.events({traced_run["id"], untraced_run["id"]},
                             ends={traced_run["id"], untraced_run["id"]})
    assert events[traced_run["id"]] and all(
        e["traceparent"] == PARENT and e["tracestate"] == STATE for e in events[traced_run["id"]])
    assert all("traceparent" not in e.get_attributes() for e in events[untraced_run["id"]])
