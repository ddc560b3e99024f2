"""DLQ replay over real processes.

A real broker, gunicorn serving the API, ``python -m bridge.inbox`` and the
operator's command ``flask --app app topics replay-dlq`` as subprocesses. Three
messages are dead-lettered for reasons an operator can fix: one names a workflow
no process has registered yet (the API's 422), two trip a bug in the relay
(``POIMEN_INBOX_TEST_RAISE_ON``: dead-lettered as ``internal_error`` after three
tries), one of those without a ``dispatch_key``. The fix is deployed (a web
process that registers the workflow, a relay without the bug), the DLQ is
replayed: one run each. Replayed again: no new run. Heroku's ``KAFKA_PREFIX`` is
set throughout, so the prefixed topic and group names are exercised too.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import uuid

import pytest
from confluent_kafka import Producer

from bridge.topics import dead_letter_topic, declare_topics, dispatch_topic
from poimenconfig import topic_prefix
from tests.processes import ROOT, metric, start_inbox, start_web, wait_until

pytestmark = pytest.mark.slow

BUG = "trips-the-relay-bug"


def tenant_runs(pg, tenant: str) -> list[tuple[str, str]]:
    return [tuple(r) for r in pg.execute(
        "SELECT r.dispatch_key, r.workflow_ref FROM runs r JOIN tenants t ON t.id = r.tenant_id "
        "WHERE t.name = %s ORDER BY r.dispatch_key", (tenant,)).fetchall()]


def replay(env: dict, tenant: str, *extra: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "flask", "--app", "app", "topics", "replay-dlq",
         "--tenant", tenant, *extra],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_dead_letters_replayed_become_one_run_each_and_a_second_replay_adds_none(
        test_env, make_tenant, pg, tmp_path):
    service, tenant = make_tenant(service=True), make_tenant()
    tag = uuid.uuid4().hex[:8]
    late_flow = f"late-{tag}"
    bootstrap = test_env["KAFKA_BOOTSTRAP_SERVERS"]
    env = {**test_env, "KAFKA_PREFIX": f"hk{tag}.", "POIMEN_TOPIC_PREFIX": "dlq",
           "POIMEN_INBOX_GROUP": "inbox-dlq", "POIMEN_API_TOKEN": service.token,
           "POIMEN_INBOX_BACKOFF_INITIAL": "0.2", "POIMEN_INBOX_BACKOFF_MAX": "1",
           "POIMEN_INBOX_METADATA_REFRESH_MS": "1000"}
    prefix = topic_prefix(env)
    assert prefix == f"hk{tag}.dlq"
    declare_topics(bootstrap, prefix, [tenant.name], 1)
    started = []
    try:
        # The broken deploy: a web process that does not know late_flow, a relay with a bug.
        web, api = start_web(env, tmp_path, workers=1, threads=4, name="web-before")
        started.append(web)
        relay, relay_metrics = start_inbox({**env, "POIMEN_API_URL": api,
                                            "POIMEN_INBOX_TEST_RAISE_ON": BUG}, tmp_path,
                                           name="inbox-before")
        started.append(relay)
        producer = Producer({"bootstrap.servers": bootstrap})
        for value in ({"workflow_ref": late_flow, "input": {"n": 1}, "dispatch_key": "late-1"},
                      {"workflow_ref": "echo", "input": {"why": BUG}, "dispatch_key": "bug-1"},
                      {"workflow_ref": "echo", "input": {"why": BUG}}):  # keyless
            producer.produce(dispatch_topic(prefix, tenant.name), json.dumps(value).encode())
        assert producer.flush(30) == 0
        wait_until(lambda: sum(metric(relay_metrics, "poimen_inbox_dead_lettered_total",
                                      reason=r) for r in ("http_422", "internal_error")) == 3,
                   timeout=90, what="three messages dead-lettered")
        assert metric(relay_metrics, "poimen_inbox_dead_lettered_total", reason="http_422") == 1
        assert tenant_runs(pg, tenant.name) == []
        relay.stop()
        web.stop()
        # The relay consumed as the prefixed group, and committed past the dead letters.
        from tests.bridge.test_inbox_relay import committed
        assert committed(bootstrap, f"hk{tag}.inbox-dlq", dispatch_topic(prefix, tenant.name)) == [3]

        # A dry run lists the three and publishes nothing.
        listing = replay(env, tenant.name, "--dry-run")
        assert listing.count("-> replay") == 3, listing
        assert "would replay 3 of 3" in listing, listing
        assert "reason=http_422" in listing and listing.count("reason=internal_error") == 2

        # The fix: the workflow is registered (a module the new web process loads),
        # and the relay runs without the bug.
        (tmp_path / f"late_flows_{tag}.py").write_text(textwrap.dedent(f"""
            from workers.registry import workflow

            @workflow({late_flow!r})
            def late(ctx, input):
                return input
        """))
        fixed = {**env, "PYTHONPATH": f"{ROOT}:{tmp_path}",
                 "POIMEN_WORKFLOW_MODULES": f"tests.workflows,late_flows_{tag}"}
        web, api = start_web(fixed, tmp_path, workers=1, threads=4, name="web-after")
        started.append(web)
        relay, relay_metrics = start_inbox({**fixed, "POIMEN_API_URL": api}, tmp_path,
                                           name="inbox-after")
        started.append(relay)

        # --reason selects: only the 422 first.
        out = replay(env, tenant.name, "--reason", "http_422")
        assert "replayed 1 of 1" in out, out
        wait_until(lambda: len(tenant_runs(pg, tenant.name)) == 1, timeout=60,
                   what="the unknown-workflow message admitted after the fix")
        out = replay(env, tenant.name, "--since", "1h")
        assert "replayed 3 of 3" in out, out
        wait_until(lambda: metric(relay_metrics, "poimen_inbox_admitted_total")
                   + metric(relay_metrics, "poimen_inbox_replayed_total") == 4, timeout=60,
                   what="the four replayed messages answered by the API")
        rows = tenant_runs(pg, tenant.name)
        [derived] = [key for key, _ in rows if key.startswith("kafka:")]
        assert derived.startswith(f"kafka:{dispatch_topic(prefix, tenant.name)}:0:2:"), derived
        assert rows == sorted([("bug-1", "echo"), (derived, "echo"), ("late-1", late_flow)]), rows

        # A plain replay starts where the last one ended: nothing is left to replay.
        out = replay(env, tenant.name)
        assert "replayed 0 of 0" in out, out
        # Replayed again on purpose: every message is admission's replay, no new run.
        out = replay(env, tenant.name, "--from-start")
        assert "replayed 3 of 3" in out, out
        wait_until(lambda: metric(relay_metrics, "poimen_inbox_replayed_total") == 4, timeout=60,
                   what="the second replay answered as replays")
        assert metric(relay_metrics, "poimen_inbox_admitted_total") == 3
        assert tenant_runs(pg, tenant.name) == rows
        assert metric(relay_metrics, "poimen_inbox_dead_lettered_total", reason="http_422") == 0
        # Nothing was dead-lettered again: the DLQ still holds the three originals.
        from tests.bridge.test_inbox_relay import topic_end
        assert topic_end(bootstrap, dead_letter_topic(prefix, tenant.name)) == [3]
    finally:
        for proc in reversed(started):
            proc.stop()
            print(f"--- {proc.name} ---\n{proc.log()[-4000:]}")


def test_replaying_letters_that_keep_failing_three_times_leaves_at_most_twice_as_many(
        test_env, make_tenant, pg, tmp_path):
    """A dead letter is replayed once: a replay that read the whole DLQ from the start,
    with its copies that fail again dead-lettered again, would grow it N -> 2N -> 4N -> 8N.
    Re-reading is on purpose (--from-start), still once per message."""
    from tests.bridge.test_inbox_relay import read_topic, topic_size

    service, tenant = make_tenant(service=True), make_tenant()
    tag = uuid.uuid4().hex[:8]
    bootstrap = test_env["KAFKA_BOOTSTRAP_SERVERS"]
    env = {**test_env, "POIMEN_TOPIC_PREFIX": f"dlq3{tag}", "POIMEN_INBOX_GROUP": f"inbox-{tag}",
           "POIMEN_API_TOKEN": service.token, "POIMEN_INBOX_BACKOFF_INITIAL": "0.2",
           "POIMEN_INBOX_BACKOFF_MAX": "1", "POIMEN_INBOX_METADATA_REFRESH_MS": "1000"}
    prefix = topic_prefix(env)
    source, dlq = dispatch_topic(prefix, tenant.name), dead_letter_topic(prefix, tenant.name)
    declare_topics(bootstrap, prefix, [tenant.name], 1)
    started = []
    try:
        # No process ever registers this workflow: every copy fails again (the API's 422).
        web, api = start_web(env, tmp_path, workers=1, threads=4, name="web")
        started.append(web)
        relay, relay_metrics = start_inbox({**env, "POIMEN_API_URL": api}, tmp_path)
        started.append(relay)
        reports: list = []
        producer = Producer({"bootstrap.servers": bootstrap})
        for n, key in enumerate(("never-1", "never-2", None)):  # the third keyless
            value = {"workflow_ref": f"never-{tag}", "input": {"n": n},
                     **({"dispatch_key": key} if key else {})}
            producer.produce(source, json.dumps(value).encode(), partition=0,
                             on_delivery=lambda err, msg: reports.append(
                                 (msg.offset(), msg.timestamp()[1])))
        assert producer.flush(30) == 0

        def dead_lettered(count: int) -> None:
            wait_until(lambda: metric(relay_metrics, "poimen_inbox_dead_lettered_total",
                                      reason="http_422") == count, timeout=90,
                       what=f"{count} messages dead-lettered")

        dead_lettered(3)
        assert topic_size(bootstrap, dlq) == 3
        out = replay(env, tenant.name)
        assert "replayed 3 of 3" in out, out
        dead_lettered(6)  # the three copies failed again
        for attempt in (2, 3):
            out = replay(env, tenant.name)
            assert "replayed 0 of" in out, f"replay {attempt}: {out}"
        # Every copy the inbox could be given was answered: nothing more is coming.
        from tests.bridge.test_inbox_relay import committed, topic_end
        wait_until(lambda: committed(bootstrap, f"inbox-{tag}", source)
                   == topic_end(bootstrap, source), timeout=30, what="the inbox caught up")
        assert topic_end(bootstrap, source) == [6]  # three messages, three copies
        assert topic_size(bootstrap, dlq) == 6  # 2N, not 8N
        assert metric(relay_metrics, "poimen_inbox_dead_lettered_total", reason="http_422") == 6

        # The copies carry the key of the message they copy: the keyless one's is derived
        # from its origin's place and time, not from the copy's.
        (offset, timestamp) = reports[2]
        keys = sorted(json.loads(m.value()).get("dispatch_key", "-")
                      for m in read_topic(bootstrap, dlq, expect=6)[3:])
        assert keys == sorted(["never-1", "never-2", f"kafka:{source}:0:{offset}:{timestamp}"])

        # Again on purpose: --from-start reads originals and copies, and publishes each
        # message once (a copy and its original are one request).
        out = replay(env, tenant.name, "--from-start")
        assert "replayed 3 of 6" in out and "3 published_once_already" in out, out
        dead_lettered(9)
        assert tenant_runs(pg, tenant.name) == []
    finally:
        for proc in reversed(started):
            proc.stop()
            print(f"--- {proc.name} ---\n{proc.log()[-4000:]}")


def test_a_filtered_replay_of_a_letter_that_keeps_failing_publishes_it_once(
        test_env, make_tenant, tmp_path):
    """A letter a --reason filter leaves out stops the commit in its partition, so the
    letters after it are read again by the next replay: one that was replayed and failed
    again is known by its dead-lettered copy, and is not published a second time."""
    from tests.bridge.test_inbox_relay import topic_size

    service, tenant = make_tenant(service=True), make_tenant()
    tag = uuid.uuid4().hex[:8]
    bootstrap = test_env["KAFKA_BOOTSTRAP_SERVERS"]
    env = {**test_env, "POIMEN_TOPIC_PREFIX": f"dlqf{tag}", "POIMEN_INBOX_GROUP": f"inbox-{tag}",
           "POIMEN_API_TOKEN": service.token, "POIMEN_INBOX_BACKOFF_INITIAL": "0.2",
           "POIMEN_INBOX_BACKOFF_MAX": "1", "POIMEN_INBOX_METADATA_REFRESH_MS": "1000"}
    prefix = topic_prefix(env)
    dlq = dead_letter_topic(prefix, tenant.name)
    declare_topics(bootstrap, prefix, [tenant.name], 1)
    started = []
    try:
        web, api = start_web(env, tmp_path, workers=1, threads=4, name="web")
        started.append(web)
        # The relay's bug is never fixed: the replayed message fails again, every time.
        relay, relay_metrics = start_inbox({**env, "POIMEN_API_URL": api,
                                            "POIMEN_INBOX_TEST_RAISE_ON": BUG}, tmp_path)
        started.append(relay)
        producer = Producer({"bootstrap.servers": bootstrap})
        for value in ({"workflow_ref": f"never-{tag}", "dispatch_key": "left-out"},  # http_422
                      {"workflow_ref": "echo", "input": {"why": BUG}, "dispatch_key": "bug"}):
            producer.produce(dispatch_topic(prefix, tenant.name), json.dumps(value).encode(),
                             partition=0)
        assert producer.flush(30) == 0

        def dead_lettered(count: int) -> None:
            wait_until(lambda: topic_size(bootstrap, dlq) == count
                       and sum(metric(relay_metrics, "poimen_inbox_dead_lettered_total",
                                      reason=r) for r in ("http_422", "internal_error"))
                       == count, timeout=90, what=f"{count} dead letters")

        dead_lettered(2)
        out = replay(env, tenant.name, "--reason", "internal_error")
        assert "replayed 1 of 1" in out, out
        dead_lettered(3)  # its copy failed again
        for attempt in (2, 3):
            out = replay(env, tenant.name, "--reason", "internal_error")
            assert "replayed 0 of 2" in out and "1 replayed_and_dead_lettered_again" in out \
                and "1 copy_of_a_replayed_letter" in out, f"replay {attempt}: {out}"
        assert topic_size(bootstrap, dlq) == 3
    finally:
        for proc in reversed(started):
            proc.stop()
            print(f"--- {proc.name} ---\n{proc.log()[-4000:]}")


# -- the rules replay applies to each dead letter (no broker needed) ---------------------------


def test_since_takes_an_iso_time_or_an_age():
    from datetime import UTC, datetime, timedelta

    from bridge.dlq import parse_since

    now = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
    assert parse_since("2026-11-29T10:00:00Z", now) == datetime(2026, 11, 29, 10, tzinfo=UTC)
    assert parse_since("2026-11-29T10:00:00", now) == datetime(2026, 11, 29, 10, tzinfo=UTC)
    assert parse_since("90m", now) == now - timedelta(minutes=90)
    assert parse_since("7d", now) == now - timedelta(days=7)
    with pytest.raises(ValueError, match="--since"):
        parse_since("yesterday", now)


def test_what_replay_publishes_for_each_kind_of_dead_letter():
    from bridge.dlq import DeadLetter, replay_request

    def letter(value: bytes | None, **dlq: str) -> DeadLetter:
        origin = {"origin.topic": "poimen.t.dispatch", "origin.partition": "3",
                  "origin.offset": "41", "origin.timestamp": "1796432478134"}
        return DeadLetter(None, value, [], {"reason": "http_422", **origin, **dlq})

    keyed = b'{"workflow_ref": "echo", "dispatch_key": "k1"}'
    assert replay_request(letter(keyed)) == (keyed, "")
    # A keyless message gets the key its first delivery was admitted under.
    body, why = replay_request(letter(b'{"workflow_ref": "echo", "input": {}}'))
    assert why == ""
    assert json.loads(body)["dispatch_key"] == "kafka:poimen.t.dispatch:3:41:1796432478134"
    # A letter of a relay from before poimen.dlq.origin.timestamp: the key of the place
    # alone, the one that relay admitted it under (and its replays pinned).
    old = letter(b'{"workflow_ref": "echo"}')
    del old.dlq["origin.timestamp"]
    assert json.loads(replay_request(old)[0])["dispatch_key"] == "kafka:poimen.t.dispatch:3:41"
    assert replay_request(letter(b'{"workflow_ref": "echo", "dispatch_key": null}'))[0] is not None
    # Never replayed: a cut value, a value that is no run request, a keyless one of unknown origin.
    assert replay_request(letter(keyed, truncated="value")) == (None, "truncated")
    assert replay_request(letter(b"not json")) == (None, "never_a_run:invalid_json")
    assert replay_request(letter(None)) == (None, "never_a_run:no_value")
    orphan = DeadLetter(None, b'{"workflow_ref": "echo"}', [], {"reason": "x"})
    assert replay_request(orphan) == (None, "keyless_without_origin")


def test_a_plain_replay_starts_at_the_commit_within_the_topics_bounds():
    from bridge.dlq import DeadLetterTopic

    dlq = object.__new__(DeadLetterTopic)  # the bounds and commits only, no broker
    dlq.low, dlq.high = {0: 0, 1: 5, 2: 0, 3: 0}, {0: 10, 1: 9, 2: 3, 3: 4}
    dlq.committed = {0: 7, 1: 2, 2: 8}
    # 0: the commit; 1: below the start (retention deleted letters): the start;
    # 2: past the end, a re-created topic's letters are all new: the start; 3: none yet.
    assert dlq.resume_offsets() == {0: 7, 1: 5, 2: 0, 3: 0}
