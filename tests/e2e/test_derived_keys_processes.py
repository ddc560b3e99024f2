"""Derived keys and key reuse over real processes.

* A scheduled workflow with ``key_reuse="after_end"``: a restarted beat re-admits the
  latest tick (``catch_up="last"``); that tick's run has ended, and the tick must still
  have exactly one run.
* A keyless Kafka message of such a workflow, redelivered after its run ended (the
  consumer group reset to the start): still one run.
* Callers racing to re-admit a failed run's key over real HTTP (gunicorn): never a 5xx,
  one new run per round.
"""

from __future__ import annotations

import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import pytest
import requests
from confluent_kafka import Consumer, Producer, TopicPartition

from bridge.topics import declare_topics
from tests.processes import free_port, metric, start_beat, start_inbox, start_web, wait_until

pytestmark = pytest.mark.slow

PERIOD = 20
PREFIX = "schedule:reusable-schedule:"
MODULES = "tests.workflows,tests.workflows.reuse"


@pytest.fixture(scope="module")
def reuse_api(test_env, tmp_path_factory):
    """gunicorn, as the Procfile's ``web``, with the key-reuse workflows registered."""
    proc, url = start_web({**test_env, "POIMEN_WORKFLOW_MODULES": MODULES},
                          tmp_path_factory.mktemp("reuse-web"))
    yield url
    proc.teardown()


def end_runs(pg, tenant_id: int, like: str) -> int:
    """End every unended run of ``tenant_id`` whose key matches ``like`` (as a worker would)."""
    return pg.execute("UPDATE runs SET status = 'succeeded', finished_at = now() - "
                      "interval '1 second' WHERE tenant_id = %s AND dispatch_key LIKE %s "
                      "AND status NOT IN ('succeeded', 'failed', 'cancelled')",
                      [tenant_id, like]).rowcount


def runs_per_key(pg, tenant_id: int, like: str) -> dict[str, int]:
    """How many runs each key ever named: its holder and every run it was released from."""
    rows = pg.execute("SELECT coalesce(dispatch_key, released_key), count(*) FROM runs "
                      "WHERE tenant_id = %s AND coalesce(dispatch_key, released_key) LIKE %s "
                      "GROUP BY 1", [tenant_id, like]).fetchall()
    return dict(rows)


def test_a_restarted_beat_finds_the_ended_run_of_its_latest_tick(test_env, tenant, pg, tmp_path,
                                                                 processes):
    env = {**test_env, "POIMEN_WORKFLOW_MODULES": MODULES,
           "POIMEN_TEST_REUSABLE_SCHEDULE_TENANT": tenant.name,
           "POIMEN_TEST_SCHEDULE_SECONDS": str(PERIOD)}
    beat = start_beat({**env, "METRICS_PORT": str(free_port())}, tmp_path, name="beat-1")
    processes.append(beat)
    wait_until(lambda: runs_per_key(pg, tenant.id, PREFIX + "%"), timeout=40,
               what="the first scheduled run")
    # Wait for a fresh tick, so the restart below falls inside the same one.
    first = set(runs_per_key(pg, tenant.id, PREFIX + "%"))
    wait_until(lambda: set(runs_per_key(pg, tenant.id, PREFIX + "%")) - first,
               timeout=PERIOD + 15, what="the next tick's run")
    fresh = datetime.now(UTC)
    assert end_runs(pg, tenant.id, PREFIX + "%") >= 1
    beat.stop()
    # A second beat (a deploy's overlap, a restart) computes the same latest tick.
    again = start_beat({**env, "METRICS_PORT": str(free_port())}, tmp_path, name="beat-2")
    processes.append(again)
    wait_until(lambda: "schedules:" in again.log(), timeout=30, what="beat-2's schedules")
    time.sleep(3)  # several of its once-a-second looks
    again.stop()
    assert (datetime.now(UTC) - fresh).total_seconds() < PERIOD - 1, \
        "the restart took a tick: the re-admission was not tried"
    counts = runs_per_key(pg, tenant.id, PREFIX + "%")
    assert counts and all(n == 1 for n in counts.values()), counts


def test_a_redelivered_keyless_message_of_a_reusable_workflow_is_one_run(
        test_env, make_tenant, reuse_api, pg, tmp_path, processes):
    service, tenant = make_tenant(service=True), make_tenant()
    tag = uuid.uuid4().hex[:8]
    prefix, group = f"dk{tag}", f"inbox-dk-{tag}"
    bootstrap = test_env["KAFKA_BOOTSTRAP_SERVERS"]
    topic = f"{prefix}.{tenant.name}.dispatch"
    env = {**test_env, "POIMEN_API_URL": reuse_api, "POIMEN_API_TOKEN": service.token,
           "POIMEN_TOPIC_PREFIX": prefix, "POIMEN_INBOX_GROUP": group,
           "POIMEN_INBOX_METADATA_REFRESH_MS": "1000"}
    declare_topics(bootstrap, prefix, [tenant.name], 1)
    producer = Producer({"bootstrap.servers": bootstrap})
    producer.produce(topic, json.dumps({"workflow_ref": "reuse-after-end",
                                        "input": {"n": 1}}).encode())
    assert producer.flush(10) == 0

    relay, url = start_inbox(env, tmp_path, name="inbox-1")
    processes.append(relay)
    wait_until(lambda: runs_per_key(pg, tenant.id, "kafka:%"), timeout=30, what="the run")
    relay.stop()
    assert end_runs(pg, tenant.id, "kafka:%") == 1
    # The group goes back to the start (an offset reset, a lost commit): the same message
    # comes again, under the same derived key.
    reset = Consumer({"bootstrap.servers": bootstrap, "group.id": group,
                      "session.timeout.ms": 6000})
    reset.commit(offsets=[TopicPartition(topic, 0, 0)], asynchronous=False)
    reset.close()
    relay, url = start_inbox(env, tmp_path, name="inbox-2")
    processes.append(relay)
    wait_until(lambda: metric(url, "poimen_inbox_replayed_total") >= 1
               or metric(url, "poimen_inbox_admitted_total") >= 1, timeout=30,
               what="the redelivered message handled")
    relay.stop()
    counts = runs_per_key(pg, tenant.id, "kafka:%")
    assert list(counts.values()) == [1], counts


ROUNDS, RACERS = 30, 12


def test_racing_readmissions_over_http_never_answer_5xx(reuse_api, tenant, pg):
    """Item 8 from outside: each round fails the key's run, then 8 callers re-admit it at
    once through gunicorn (the single-request path, autocommit statements)."""
    url = f"{reuse_api}/v1/runs"
    key = f"race-{uuid.uuid4().hex[:8]}"

    def post(n: int) -> tuple[int, str | None]:
        response = requests.post(url, json={"workflow_ref": "reuse-after-failure",
                                            "input": {}, "dispatch_key": key},
                                 headers=tenant.headers, timeout=30)
        return response.status_code, response.json().get("id")

    first = post(0)
    assert first[0] == 201
    with ThreadPoolExecutor(RACERS) as pool:
        for round_no in range(ROUNDS):
            pg.execute("UPDATE runs SET status = 'failed', finished_at = now() - interval "
                       "'1 second' WHERE tenant_id = %s AND dispatch_key = %s",
                       [tenant.id, key])
            answers = list(pool.map(post, range(RACERS)))
            codes = sorted(code for code, _ in answers)
            assert all(code in (200, 201) for code in codes), (round_no, answers)
            assert codes.count(201) == 1, (round_no, codes)
            assert len({run_id for _, run_id in answers}) == 1, (round_no, answers)
    total = pg.execute("SELECT count(*) FROM runs WHERE tenant_id = %s AND "
                       "coalesce(dispatch_key, released_key) = %s", [tenant.id, key]).fetchone()[0]
    assert total == ROUNDS + 1
