"""Benchmark: the outbox relay against its two halves, Kafka alone and SQL alone, in one run.

An outbox of 100,000 events (25,000 runs x 4 events) is pre-filled in a
throwaway, migrated database. Three measurements over the same rows:

1. relay: ``python -m bridge.outbox`` is started as a standby (the benchmark
   holds the relay lock); the clock runs from releasing the lock until every
   row is marked published;
2. raw producer: the same keys, values and headers, loaded in memory first, sent
   by a confluent-kafka producer with the relay's settings (idempotent,
   ``acks=all``), in batches of the relay's size, waiting for each batch's
   delivery before the next;
3. SQL loop: the rows are set unpublished again and a loop selects them with the
   relay's own query and marks them, batch after batch, with no Kafka.

Reported: events/s, CPU ms per event (the relay process, and its Postgres
backends), and relay / each baseline. Targets: >= 20,000 events/s and >= 0.5 of
the slower baseline. Run alone on the machine (``make bench`` or, with the
services' environment exported, ``python bench/outbox.py [--events N]``); the
result is appended to bench/RESULTS.md under "Outbox relay".
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import psycopg
from confluent_kafka import Producer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import (  # noqa: E402
    append_result,
    cpu_seconds_with_children,
    machine_line,
    settle,
)
from bridge.outbox import (  # noqa: E402
    MARK_PUBLISHED,  # noqa: E402
    OUTBOX_LOCK_KEY,
    OUTBOX_LOCK_NAMESPACE,
    READ_SQL,
    SPECVERSION,
)
from bridge.topics import declare_topics, events_topic  # noqa: E402
from poimen_dev.scratch import scratch_database  # noqa: E402
from tests.processes import Process  # noqa: E402

RESULTS = ROOT / "bench" / "RESULTS.md"
SECTION = "## Outbox relay (bench/outbox.py)"
PARTITIONS = 4
BATCH = 1000
EVENTS_PER_RUN = 4
TENANT = "bench"


def backends_cpu(conn: psycopg.Connection, application_like: str) -> float:
    """CPU seconds of the Postgres backends serving ``application_like`` (same machine)."""
    pids = [r[0] for r in conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name LIKE %s", [application_like])]
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += cpu_seconds_with_children(pid)
    return total


def fill(conn: psycopg.Connection, events: int) -> None:
    """Create the tenant, its runs and ``events`` outbox rows shaped like the app's."""
    runs = events // EVENTS_PER_RUN
    tenant_id = conn.execute("INSERT INTO tenants (name) VALUES (%s) RETURNING id",
                             [TENANT]).fetchone()[0]
    conn.execute(
        """
        INSERT INTO runs (id, tenant_id, workflow_ref, workflow_name, workflow_version, input,
                          goal_id, dispatch_key, status, attempt, failures, cancel_requested,
                          origin)
        SELECT gen_random_uuid(), %(t)s, 'echo@1', 'echo', '1',
               jsonb_build_object('n', n), 'goal-' || (n %% 100), 'key-' || n, 'succeeded',
               1, 0, false, 'http'
          FROM generate_series(1, %(runs)s) AS n
        """, {"t": tenant_id, "runs": runs})
    # Events in id order per run, runs interleaved, as concurrent traffic writes them.
    conn.execute(
        """
        INSERT INTO outbox (tenant_id, run_id, event_type, payload)
        SELECT %(t)s, r.id, e.type,
               jsonb_build_object('run_id', r.id::text, 'type', e.type, 'attempt', 1)
                 || CASE WHEN e.step = 1 THEN jsonb_build_object(
                        'workflow_ref', 'echo@1', 'goal_id', r.goal_id,
                        'dispatch_key', r.dispatch_key, 'origin', 'http')
                    ELSE '{}'::jsonb END
          FROM (VALUES (1, 'run.admitted'), (2, 'run.started'), (3, 'run.step'),
                       (4, 'run.succeeded')) AS e(step, type)
         CROSS JOIN runs r
         ORDER BY e.step, r.id
        """, {"t": tenant_id})
    conn.execute("VACUUM ANALYZE outbox")
    conn.execute("VACUUM ANALYZE runs")


def unpublished(conn: psycopg.Connection) -> int:
    return conn.execute("SELECT count(*) FROM outbox WHERE published_at IS NULL").fetchone()[0]


def measure_relay(env: dict[str, str], db: str, logs: Path, events: int) -> dict[str, float]:
    """Start the relay as a standby (this process holds the relay lock), then let it go.

    The clock starts when the lock is released, so the relay's start-up
    (imports, connections) is not counted as shipping time.
    """
    relay = Process("outbox", [sys.executable, "-m", "bridge.outbox"],
                    {**env, "METRICS_PORT": "0", "POIMEN_OUTBOX_BATCH_SIZE": str(BATCH),
                     "POIMEN_OUTBOX_STANDBY_INTERVAL": "0.02"}, logs)
    with psycopg.connect(db, autocommit=True) as conn, \
            psycopg.connect(db, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s, %s)", [OUTBOX_LOCK_NAMESPACE, OUTBOX_LOCK_KEY])
        relay.start()
        try:
            deadline = time.monotonic() + 60
            while "standby: another relay holds" not in relay.log():
                if not relay.alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"the relay did not start:\n{relay.log()[-3000:]}")
                time.sleep(0.05)
            relay_cpu0 = cpu_seconds_with_children(relay.pid)
            holder.execute("SELECT pg_advisory_unlock(%s, %s)",
                           [OUTBOX_LOCK_NAMESPACE, OUTBOX_LOCK_KEY])
            started = time.monotonic()
            while (left := unpublished(conn)) > 0:
                if not relay.alive():
                    raise RuntimeError(f"the relay exited:\n{relay.log()[-3000:]}")
                if time.monotonic() - started > 600:
                    raise RuntimeError(f"{left} events unpublished after 600 s; logs in {logs}")
                time.sleep(0.02)
            elapsed = time.monotonic() - started
            relay_cpu = cpu_seconds_with_children(relay.pid) - relay_cpu0
            pg_cpu = backends_cpu(conn, "poimen-outbox/%")
        finally:
            relay.stop()
    return {"seconds": elapsed, "rate": events / elapsed, "cpu_ms": relay_cpu / events * 1000,
            "pg_cpu_ms": pg_cpu / events * 1000}


def load_messages(db: str, prefix: str, events: int) -> list[tuple[str, bytes, bytes, list]]:
    """The relay's messages for every row, read with its own query (untimed)."""
    out = []
    with psycopg.connect(db, autocommit=True) as conn:
        rows = conn.execute(READ_SQL, [events]).fetchall()
    for row_id, tenant, key, event_type, run_id, occurred_at, value, *_trace in rows:
        headers = [("ce_id", str(row_id)), ("ce_type", event_type),
                   ("ce_source", f"/poimen/{tenant}/runs/{run_id}"),
                   ("ce_specversion", SPECVERSION), ("ce_time", occurred_at),
                   ("content-type", "application/json")]
        out.append((events_topic(prefix, tenant), value.encode(), key.encode(), headers))
    return out


def measure_producer(kafka: dict[str, str], messages: list) -> dict[str, float]:
    producer = Producer({"message.timeout.ms": 0, "linger.ms": 5, **kafka,
                         "enable.idempotence": True, "acks": "all"})
    failures: list = []

    def delivered(err, _msg) -> None:
        if err is not None:
            failures.append(err)

    cpu, started = time.process_time(), time.monotonic()
    for i in range(0, len(messages), BATCH):
        for topic, value, key, headers in messages[i:i + BATCH]:
            while True:
                try:
                    producer.produce(topic, value, key, headers=headers, on_delivery=delivered)
                    break
                except BufferError:
                    producer.poll(0.01)
        if producer.flush(60):
            raise RuntimeError("the broker did not acknowledge a batch within 60 s")
    elapsed, cpu = time.monotonic() - started, time.process_time() - cpu
    if failures:
        raise RuntimeError(f"{len(failures)} messages failed, e.g. {failures[0]}")
    n = len(messages)
    return {"seconds": elapsed, "rate": n / elapsed, "cpu_ms": cpu / n * 1000}


def measure_sql(db: str, events: int) -> dict[str, float]:
    with psycopg.connect(db, autocommit=True) as setup:
        setup.execute("UPDATE outbox SET published_at = NULL")
        setup.execute("VACUUM ANALYZE outbox")
        with psycopg.connect(db, autocommit=True, application_name="poimen-bench-sql",
                             prepare_threshold=None) as conn:
            cpu, started = time.process_time(), time.monotonic()
            done = 0
            while rows := conn.execute(READ_SQL, [BATCH]).fetchall():
                conn.execute(MARK_PUBLISHED, [[r[0] for r in rows]])
                done += len(rows)
            elapsed, cpu = time.monotonic() - started, time.process_time() - cpu
            pg_cpu = backends_cpu(setup, "poimen-bench-sql")
    if done != events:
        raise RuntimeError(f"the SQL loop marked {done} rows, not {events}")
    return {"seconds": elapsed, "rate": events / elapsed, "cpu_ms": cpu / events * 1000,
            "pg_cpu_ms": pg_cpu / events * 1000}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--no-record", action="store_true", help="do not touch RESULTS.md")
    args = parser.parse_args()
    events = args.events - args.events % EVENTS_PER_RUN
    env = dict(os.environ)
    missing = [v for v in ("DATABASE_URL", "KAFKA_BOOTSTRAP_SERVERS") if not env.get(v)]
    if missing:
        sys.exit(f"{', '.join(missing)} unset: run `make bench`, or export `poimen-dev env`")
    tag = uuid.uuid4().hex[:8]
    relay_prefix, raw_prefix = f"benchob{tag}", f"benchraw{tag}"
    kafka = {"bootstrap.servers": env["KAFKA_BOOTSTRAP_SERVERS"]}
    with contextlib.ExitStack() as cleanup:
        db = cleanup.enter_context(
            scratch_database(env["DATABASE_URL"], "poimen_bench_outbox", env))
        env.update(DATABASE_URL=db, POIMEN_TOPIC_PREFIX=relay_prefix)
        logs = Path(tempfile.mkdtemp(prefix="poimen-bench-outbox-"))
        for prefix in (relay_prefix, raw_prefix):
            declare_topics(kafka["bootstrap.servers"], prefix, [TENANT], PARTITIONS)
        with psycopg.connect(db, autocommit=True) as conn:
            fill(conn, events)
        print(f"outbox pre-filled: {events} events of {events // EVENTS_PER_RUN} runs; "
              f"topics {PARTITIONS} partitions; batch {BATCH}")
        # Each measurement starts on a quiet machine, just after a checkpoint: in `make
        # bench` the previous script's load and writes would otherwise land in it.
        settle(db)
        load_before = os.getloadavg()
        machine = machine_line()  # on the quiet machine, before the cases

        relay = measure_relay(env, db, logs, events)
        print(f"relay:        {relay['rate']:8.0f} events/s ({relay['seconds']:.1f} s); "
              f"CPU {relay['cpu_ms']:.3f} ms/event relay, {relay['pg_cpu_ms']:.3f} Postgres")

        with psycopg.connect(db, autocommit=True) as conn:
            conn.execute("UPDATE outbox SET published_at = NULL")
        messages = load_messages(db, raw_prefix, events)
        settle(db)
        producer = measure_producer(kafka, messages)
        del messages
        print(f"raw producer: {producer['rate']:8.0f} events/s ({producer['seconds']:.1f} s); "
              f"CPU {producer['cpu_ms']:.3f} ms/event")

        settle(db)
        sql = measure_sql(db, events)
        print(f"SQL loop:     {sql['rate']:8.0f} events/s ({sql['seconds']:.1f} s); "
              f"CPU {sql['cpu_ms']:.3f} ms/event client, {sql['pg_cpu_ms']:.3f} Postgres")
        load_after = os.getloadavg()

        vs_producer, vs_sql = relay["rate"] / producer["rate"], relay["rate"] / sql["rate"]
        slower = min(producer["rate"], sql["rate"])
        print(f"relay / raw producer {vs_producer:.2f}, relay / SQL loop {vs_sql:.2f}; "
              f"relay / slower baseline {relay['rate'] / slower:.2f} (target >= 0.5), "
              f"{relay['rate']:.0f} events/s (target >= 20000)")
        if not args.no_record:
            append_result(RESULTS, SECTION, [
                f"### {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
                "",
                f"- machine: {machine}; embedded Postgres and noida-db broker; "
                f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}",
                f"- {events} events ({events // EVENTS_PER_RUN} runs x {EVENTS_PER_RUN}), "
                f"{PARTITIONS} partitions, batch {BATCH}",
                f"- relay (`python -m bridge.outbox`, clock from lock release to last mark): "
                f"**{relay['rate']:.0f} events/s**; CPU {relay['cpu_ms']:.3f} ms/event "
                f"(relay), {relay['pg_cpu_ms']:.3f} ms/event (its Postgres backends)",
                f"- raw confluent-kafka producer, same messages and settings, batch by batch: "
                f"**{producer['rate']:.0f} events/s**; CPU {producer['cpu_ms']:.3f} ms/event",
                f"- SQL loop, the relay's select and mark without Kafka: "
                f"**{sql['rate']:.0f} events/s**; CPU {sql['cpu_ms']:.3f} ms/event (client), "
                f"{sql['pg_cpu_ms']:.3f} ms/event (Postgres)",
                f"- relay / raw producer **{vs_producer:.2f}**, relay / SQL loop "
                f"**{vs_sql:.2f}** (targets: >= 20,000 events/s, >= 0.5 of the slower)",
            ])
    return 0


if __name__ == "__main__":
    sys.exit(main())
