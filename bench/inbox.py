"""Benchmark: the Kafka inbox against direct HTTP admission, on the same API, in one run.

10,000 dispatch messages are pre-published across 4 partitions; the clock runs
from starting ``python -m bridge.inbox`` until all 10,000 runs are admitted.
The baseline is the same number of ``POST /v1/runs`` from 16 threads with
keep-alive sessions. Target: relay throughput >= 0.9 of direct admission.
The relay posts each partition's messages in batches (``POST /v1/runs/batch``, up to
``POIMEN_INBOX_BATCH_MAX``); the run prints how many calls it made and their mean size,
and fails if it made none (the batch path was not exercised).

Both go to one gunicorn (``app:create_app()``) on a throwaway, migrated
database and a throwaway Celery queue, so nothing of a developer's is touched.
Run with ``make bench`` or, with the services' environment exported,
``python bench/inbox.py [--messages N]``. The result is appended to
bench/RESULTS.md under "Kafka inbox".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import psycopg
import requests
from confluent_kafka import Producer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import (  # noqa: E402
    append_result,
    cpu_seconds_with_children,
    machine_line,
    settle,
)
from bridge.topics import declare_topics, dispatch_topic  # noqa: E402
from poimen_dev.scratch import scratch_database  # noqa: E402
from tests.processes import metrics, start_inbox, start_web  # noqa: E402

RESULTS = ROOT / "bench" / "RESULTS.md"
SECTION = "## Kafka inbox (bench/inbox.py)"
PARTITIONS = 4
THREADS = 16


def credentials(env: dict[str, str]) -> tuple[str, str]:
    """Create the tenants ``direct`` and ``inbox``; return (direct's token, a service token)."""
    code = (
        "from app import create_app\n"
        "from app.tenant_service import create_tenant, create_token\n"
        "with create_app().app_context():\n"
        "    d = create_tenant('direct'); create_tenant('inbox')\n"
        "    print(create_token(d, False)); print(create_token(None, True))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.split()
    return out[-2], out[-1]


def count_runs(url: str, tenant: str) -> int:
    with psycopg.connect(url) as c:
        return c.execute("SELECT count(*) FROM runs r JOIN tenants t ON t.id = r.tenant_id "
                         "WHERE t.name = %s", (tenant,)).fetchone()[0]


def admission_span(url: str, tenant: str) -> float:
    """Seconds from the tenant's first admitted run to its last (Postgres' clock)."""
    with psycopg.connect(url) as c:
        return float(c.execute(
            "SELECT extract(epoch FROM max(r.created_at) - min(r.created_at)) FROM runs r "
            "JOIN tenants t ON t.id = r.tenant_id WHERE t.name = %s", (tenant,)).fetchone()[0])


def direct(api: str, token: str, n: int) -> float:
    """POST ``n`` runs from 16 threads; return the seconds taken."""
    counter = iter(range(n))
    lock = threading.Lock()
    failures: list[str] = []

    def worker() -> None:
        session = requests.Session()
        session.headers.update({"Authorization": f"Bearer {token}",
                                "User-Agent": "poimen-bench/direct"})
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            r = session.post(f"{api}/v1/runs", json={
                "workflow_ref": "noop", "input": {"i": i}, "dispatch_key": f"direct-{i}"})
            if r.status_code != 201:
                failures.append(f"{r.status_code} {r.text[:200]}")

    threads = [threading.Thread(target=worker) for _ in range(THREADS)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started
    if failures:
        raise RuntimeError(f"{len(failures)} direct admissions failed, e.g. {failures[0]}")
    return elapsed


def publish(bootstrap: str, topic: str, n: int) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "acks": "all"})
    for i in range(n):
        value = json.dumps({"workflow_ref": "noop", "input": {"i": i},
                            "dispatch_key": f"inbox-{i}"}).encode()
        while True:
            try:
                # Round-robin over the partitions, as keyed traffic spreads evenly.
                producer.produce(topic, value, key=f"inbox:inbox-{i}".encode(),
                                 partition=i % PARTITIONS)
                break
            except BufferError:
                producer.poll(0.1)
    if producer.flush(60):
        raise RuntimeError("the broker did not acknowledge every dispatch message")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--no-record", action="store_true", help="do not touch RESULTS.md")
    args = parser.parse_args()
    n = args.messages
    env = dict(os.environ)
    missing = [v for v in ("DATABASE_URL", "REDIS_URL", "KAFKA_BOOTSTRAP_SERVERS")
               if not env.get(v)]
    if missing:
        sys.exit(f"{', '.join(missing)} unset: run `make bench`, or export `poimen-dev env`")
    tag = uuid.uuid4().hex[:8]
    queue = f"poimen-bench-inbox-{tag}"
    cleanup = contextlib.ExitStack()
    db = cleanup.enter_context(scratch_database(env["DATABASE_URL"], "poimen_bench_inbox", env))
    env.update(DATABASE_URL=db, POIMEN_QUEUE=queue)
    logs = Path(tempfile.mkdtemp(prefix="poimen-bench-inbox-"))
    web = relay = None
    try:
        direct_token, service_token = credentials(env)
        settle(db)  # a quiet machine, just after a checkpoint (as every bench case)
        load_before = os.getloadavg()
        machine = machine_line()  # on the quiet machine, before the cases
        web, api = start_web(env, logs, workers=2, threads=8)
        prefix = f"bench{tag}"
        topic = dispatch_topic(prefix, "inbox")
        declare_topics(env["KAFKA_BOOTSTRAP_SERVERS"], prefix, ["inbox"], PARTITIONS)
        publish(env["KAFKA_BOOTSTRAP_SERVERS"], topic, n)
        print(f"published {n} dispatch messages to {topic} ({PARTITIONS} partitions)")

        client_cpu = time.process_time()
        direct_s = direct(api, direct_token, n)
        client_cpu = time.process_time() - client_cpu
        assert count_runs(db, "direct") == n
        print(f"direct HTTP, {THREADS} threads: {n} runs in {direct_s:.1f}s "
              f"= {n / direct_s:.0f} runs/s; client CPU {client_cpu / n * 1000:.2f} "
              "ms/request")

        relay_env = {**env, "POIMEN_API_URL": api, "POIMEN_API_TOKEN": service_token,
                     "POIMEN_TOPIC_PREFIX": prefix, "POIMEN_INBOX_GROUP": f"bench-{tag}"}
        settle(db)
        started = time.monotonic()
        relay, relay_metrics = start_inbox(relay_env, logs, name="inbox")
        while (done := count_runs(db, "inbox")) < n:
            if time.monotonic() - started > 600:
                raise RuntimeError(f"only {done} of {n} runs after 600 s; logs in {logs}")
            time.sleep(0.1)
        inbox_s = time.monotonic() - started
        relay_cpu = cpu_seconds_with_children(relay.pid)
        scraped = metrics(relay_metrics)
        calls = scraped.get(("poimen_inbox_batch_size_count", ()), 0)
        batched = scraped.get(("poimen_inbox_batch_size_sum", ()), 0)
        if not calls:
            raise RuntimeError("the relay made no POST /v1/runs/batch call")
        print(f"relay batches: {calls:.0f} calls of POST /v1/runs/batch, "
              f"{batched / calls:.1f} messages each on average")
        print(f"inbox relay, {PARTITIONS} partitions: {n} runs in {inbox_s:.1f}s "
              f"= {n / inbox_s:.0f} runs/s")
        ratio = direct_s / inbox_s
        # Steady state: first admission to last, by Postgres' clock, for both: the relay's
        # clock above also holds its start-up (imports, the consumer group's join).
        direct_span, inbox_span = admission_span(db, "direct"), admission_span(db, "inbox")
        steady = direct_span / inbox_span
        print(f"ratio relay/direct: {ratio:.2f} from relay start; steady (first to last "
              f"admission: direct {direct_span:.1f}s, relay {inbox_span:.1f}s) {steady:.2f} "
              f"(target >= 0.9); relay CPU {relay_cpu:.1f}s = "
              f"{relay_cpu / n * 1000:.2f} ms/message")
        load_after = os.getloadavg()
        if not args.no_record:
            append_result(RESULTS, SECTION, [
                f"### {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
                "",
                f"- machine: {machine}; embedded Postgres/Redis/noida-db broker; "
                f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} "
                "(other sessions' tests and benchmarks may share the machine)",
                "- API: gunicorn, 2 workers x 8 threads; workflow `noop`; no Celery workers "
                "running (admission only)",
                f"- direct HTTP, {THREADS} threads, keep-alive: {n} runs in {direct_s:.1f} s = "
                f"**{n / direct_s:.0f} runs/s** "
                f"(client CPU {client_cpu / n * 1000:.2f} ms/request)",
                f"- inbox relay, {PARTITIONS} partitions pre-published, clock from relay start: "
                f"{n} runs in {inbox_s:.1f} s = **{n / inbox_s:.0f} runs/s** "
                f"(relay CPU {relay_cpu / n * 1000:.2f} ms/message); {calls:.0f} calls of "
                f"POST /v1/runs/batch, {batched / calls:.1f} messages each on average",
                f"- first to last admission (Postgres' clock): direct {direct_span:.1f} s, "
                f"relay {inbox_span:.1f} s (the relay's clock above includes its start-up "
                f"and the consumer group's join: {inbox_s - inbox_span:.1f} s)",
                f"- ratio relay/direct: **{ratio:.2f}** from relay start, **{steady:.2f}** "
                "steady state (target >= 0.9)",
            ])
        return 0
    finally:
        for proc in (relay, web):
            if proc is not None:
                proc.stop()
        cleanup.close()
        try:
            import redis

            redis.Redis.from_url(env["REDIS_URL"]).delete(queue)
        except Exception as err:  # noqa: BLE001 - cleanup is best effort
            print(f"could not delete queue {queue}: {err}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
