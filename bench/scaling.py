"""Benchmark: how throughput and Postgres CPU scale with worker and inbox processes.

    python bench/scaling.py [--runs 5000] [--messages 10000] [--workers 1 2 4]
                            [--inboxes 1 2] [--mode prefork|batch [--threads 16]]
                            [--no-record]

In one invocation, on the same services, one gunicorn as the Procfile starts it
(2 workers x 4 threads) and a migrated ``poimen_bench_<id>`` database:

* **Workers.** For 1, 2 and 4 worker processes: ``--runs`` runs of ``noop`` are
  admitted first, with ``POST /v1/runs/batch`` (1000 items a call), so that the
  admission side cannot limit the measure. Each worker is a ``celery -A workers
  worker --concurrency 1`` of its own, the Procfile's ``worker`` line at
  ``WORKER_CONCURRENCY=1``: adding capacity is adding dynos, each with its own
  main process, broker connection and boots, and one pool process each keeps
  "N workers" = N processes executing runs (``--concurrency N`` in one process
  would measure a wider pool behind one consumer instead, the other knob).
  ``--mode batch`` makes each worker a batching one (``POIMEN_WORKER_MODE=batch``,
  docs/internals/batching.md): one process of ``--threads`` threads whose claims and
  finishes go to Postgres many per statement.
  The web process sends the runs' messages to a *holding* queue; once every
  worker is up and ``ready``, the holding queue is renamed onto the workers'
  queue (one atomic Redis ``RENAME``). The clock runs from that release until
  ``SELECT count(*) FROM runs WHERE status = 'succeeded'`` (polled every 50 ms, on
  one open connection) reaches ``--runs``: the workers' start-up (imports, boot
  registration) is not charged to the runs, in time or CPU. Also printed: the steady rate, first
  claim to last finish by Postgres' clock. **Commits per run**: the transactions
  committed in the bench database from the release to the end
  (``pg_stat_database.xact_commit``, read-only ones included), less the script's own
  polls; each end of the count waits ``STATS_FLUSH_S`` for the backends to report. A
  batch worker's runs per claim and per finish statement come from its metrics.
* **Inbox.** For 1 and 2 ``python -m bridge.inbox`` processes in one consumer
  group (each with its own ``METRICS_PORT``): ``--messages`` dispatch messages
  of ``noop`` are produced first to ``poimen.<tenant>.dispatch`` under a private
  topic prefix, over ``--partitions`` (4) partitions, each case on a topic of
  its own; the clock runs from starting the inboxes until ``count(*) FROM
  runs`` reaches ``--messages`` (no worker runs: Kafka -> admitted). It includes
  the inboxes' start-up and the group's joins; the steady rate, first to last
  admission by Postgres' clock, is printed beside it.

CPU, from ``/proc`` before and after each measured interval: every
``postgres`` process on the machine (the server serves the bench database;
anything else it serves is counted too, which is why the machine must be quiet),
the workers (main + pool processes), gunicorn (arbiter + workers) and the
inboxes. Reported per run (per admitted message): **Postgres CPU per run** is
the figure the capacity plan (docs/scaling.md) multiplies by runs/s.

Load: the 1-, 5- and 15-minute load averages are printed before and after
each case. Benchmarks run alone: before each case the script waits up to
``--quiet-wait`` seconds for the 1-minute load average to fall to
``--max-load`` (1.5); if it does not, it warns loudly and the case is marked
INVALID in the output and in RESULTS.md.

``--no-record`` (or ``BENCH_NO_RECORD=1``) leaves bench/RESULTS.md alone: smoke
runs with tiny counts must not be recorded. Otherwise the result is appended
under "Scaling (bench/scaling.py)" with the date, the machine (nproc, arch,
kernel, Python, Postgres) and the load averages.

The benchmark owns what it creates (the database, the queues and every Redis
key naming its id, the topics' prefix, child processes) and removes the
database and the keys on the way out, error or not.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
import redis as redis_lib  # noqa: E402
import requests  # noqa: E402

from bench._common import (  # noqa: E402
    STATS_FLUSH_S,
    CountPoll,
    append_result,
    batch_counts,
    batch_histogram,
    batch_sizes,
    bench_database,
    committed,
    cpu_delta,
    cpu_snapshot,
    credentials,
    delete_redis_keys,
    ensure_quiet,
    format_batch_sizes,
    libpq_url,
    load_average,
    log_directory,
    machine_summary,
    produce,
    reset_runs,
    runs_by_status,
    stop_on_sigterm,
    wait_for_count,
    wait_ready,
)

RESULTS = ROOT / "bench" / "RESULTS.md"
SECTION = "## Scaling (bench/scaling.py)"
TENANT = "scale"
BATCH = 1000  # POIMEN_BATCH_MAX's default: items per POST /v1/runs/batch


@dataclass
class Case:
    kind: str  # "workers" or "inbox"
    processes: int
    count: int
    seconds: float
    steady_seconds: float
    cpu: dict[str, float] = field(default_factory=dict)
    load_before: str = ""
    load_after: str = ""
    valid: bool = True
    commits: int | None = None  # transactions committed in the bench database (workers)
    # Batch workers: the mean runs per store-batcher statement, by kind, and the
    # statements by runs carried (``batch_histogram``).
    batch_sizes: dict[str, float] = field(default_factory=dict)
    batch_histogram: dict[str, str] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.count / self.seconds

    @property
    def steady_rate(self) -> float:
        return self.count / self.steady_seconds if self.steady_seconds > 0 else float("nan")

    def ms_per(self, key: str) -> float:
        return self.cpu.get(key, 0.0) * 1000 / self.count

    @property
    def commits_per_run(self) -> str:
        return "-" if self.commits is None else f"{self.commits / self.count:.2f}"



# -- database reads -------------------------------------------------------------------------

def count_poll(db: str, status: str | None = None) -> CountPoll:
    """The case's poll of ``count(*) FROM runs`` (of ``status``), on one open connection:
    a connection per poll would charge 20 backend starts a second to Postgres' CPU."""
    if status is None:
        return CountPoll(db, "SELECT count(*) FROM runs")
    return CountPoll(db, "SELECT count(*) FROM runs WHERE status = %s", [status])


def span(db: str, start: str, end: str) -> float:
    """Seconds from the first ``start`` to the last ``end`` over all runs (Postgres' clock)."""
    with psycopg.connect(db) as conn:
        value = conn.execute(
            f"SELECT extract(epoch FROM max({end}) - min({start})) FROM runs").fetchone()[0]
    return float(value or 0.0)


# -- the cases ------------------------------------------------------------------------------

def admit_batches(api: str, token: str, n: int, tag: str) -> None:
    """Admit ``n`` noop runs through ``POST /v1/runs/batch``, ``BATCH`` items a call."""
    session = requests.Session()
    session.headers.update({"Authorization": f"Bearer {token}",
                            "User-Agent": "poimen-bench/scaling"})
    for first in range(0, n, BATCH):
        items = [{"workflow_ref": "noop", "input": {}, "dispatch_key": f"{tag}-{i}"}
                 for i in range(first, min(n, first + BATCH))]
        resp = session.post(f"{api}/v1/runs/batch", json={"runs": items}, timeout=120)
        resp.raise_for_status()
        refused = [r for r in resp.json()["results"] if r["status"] != 201]
        if refused:
            raise RuntimeError(f"{len(refused)} batch items refused, e.g. {refused[0]}")


def declare_queue(env: dict[str, str], name: str) -> None:
    """Declare ``name`` as the workers declare theirs, so the web's sends to it are routed
    (kombu's Redis transport drops a message for an exchange without a binding)."""
    from kombu import Connection, Exchange, Queue

    with Connection(env["REDIS_URL"]) as conn:
        Queue(name, Exchange(name, type="direct"), routing_key=name)(conn.default_channel).declare()


def wait_queued(redis: redis_lib.Redis, queue: str, n: int, timeout: float = 120.0) -> None:
    """Wait until the web's sender has put all ``n`` messages on ``queue``."""
    deadline = time.monotonic() + timeout
    while (seen := redis.llen(queue)) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {seen}/{n} messages reached {queue} after {timeout:.0f}s")
        time.sleep(0.05)


def workers_case(env: dict[str, str], logs: Path, db: str, api: str, web_pid: int,
                 token: str, redis: redis_lib.Redis, k: int, n: int, args) -> Case:
    from tests.processes import free_port, start_worker

    hold, queue = env["BENCH_HOLD_QUEUE"], env["POIMEN_QUEUE"]
    reset_runs(db)
    redis.delete(hold, queue)
    admit_batches(api, token, n, f"w{k}")
    wait_queued(redis, hold, n)
    workers, ports = [], [free_port() for _ in range(k)]
    poll = count_poll(db, "succeeded")
    try:
        for i in range(k):
            # One dyno each: prefork at WORKER_CONCURRENCY=1, or a batch worker's threads.
            workers.append(start_worker(
                {**env, "METRICS_PORT": str(ports[i])}, logs, f"scale-w{k}-{i}",
                concurrency=args.threads if args.mode == "batch" else 1))
        for w in workers:
            wait_ready(w)
        valid = ensure_quiet(args.max_load, args.quiet_wait, database_url=db)
        time.sleep(STATS_FLUSH_S)  # the admission's commits reported before the count
        commits0, polls0 = committed(db), poll.calls
        urls = [f"http://127.0.0.1:{p}/metrics" for p in ports]
        batches0 = batch_counts(*urls)
        load_before = load_average()
        print(f"workers x{k}: load average before {load_before}", flush=True)
        groups = {"worker": [w.pid for w in workers], "web": web_pid}
        cpu0 = cpu_snapshot(groups)
        started = time.monotonic()
        redis.rename(hold, queue)  # the release: every message at once, workers warm
        try:
            done = wait_for_count(poll, n, args.timeout, f"workers x{k}")
        except RuntimeError as err:
            raise RuntimeError(f"{err}; runs by status: {runs_by_status(db)}") from None
        cpu = cpu_delta(cpu0, cpu_snapshot(groups))
        load_after = load_average()
        batches1 = batch_counts(*urls)
        time.sleep(STATS_FLUSH_S)  # every process's commits of the case reported
        # Less this script's own: the polls, and the first read of the count.
        commits = committed(db) - commits0 - 1 - (poll.calls - polls0)
        case = Case("workers", k, n, done - started, span(db, "started_at", "finished_at"),
                    cpu, load_before, load_after, valid, commits,
                    batch_sizes(batches1, batches0), batch_histogram(batches1, batches0))
        print(f"workers x{k}: load average after {case.load_after}", flush=True)
        return case
    finally:
        poll.close()
        for w in workers:
            w.stop()


def inbox_case(env: dict[str, str], logs: Path, db: str, api: str, web_pid: int,
               service_token: str, k: int, m: int, args) -> Case:
    from bridge.topics import declare_topics, dispatch_topic
    from tests.processes import start_inbox

    reset_runs(db)
    # A topic prefix and a group of the case's own: the previous case's offsets and
    # messages stay out of it.
    prefix = f"{env['BENCH_TOPIC_PREFIX']}i{k}"
    bootstrap = env["KAFKA_BOOTSTRAP_SERVERS"]
    declare_topics(bootstrap, prefix, [TENANT], args.partitions)
    produce(bootstrap, dispatch_topic(prefix, TENANT), 0, m, args.partitions, "scale",
            key_prefix=f"i{k}")
    relay_env = {**env, "POIMEN_API_URL": api, "POIMEN_API_TOKEN": service_token,
                 "POIMEN_TOPIC_PREFIX": prefix,
                 "POIMEN_INBOX_GROUP": f"{env['BENCH_TOPIC_PREFIX']}-i{k}"}
    inboxes = []
    try:
        valid = ensure_quiet(args.max_load, args.quiet_wait, database_url=db)
        load_before = load_average()
        print(f"inbox x{k}: load average before {load_before}", flush=True)
        cpu0 = cpu_snapshot({"web": web_pid})
        started = time.monotonic()
        for i in range(k):  # start_inbox gives each its own free METRICS_PORT
            inboxes.append(start_inbox(relay_env, logs, name=f"scale-i{k}-{i}")[0])
        with contextlib.closing(count_poll(db)) as poll:
            done = wait_for_count(poll, m, args.timeout, f"inbox x{k}")
        cpu = cpu_delta(cpu0, cpu_snapshot({"web": web_pid,
                                             "inbox": [p.pid for p in inboxes]}))
        case = Case("inbox", k, m, done - started, span(db, "created_at", "created_at"),
                    cpu, load_before, load_average(), valid)
        print(f"inbox x{k}: load average after {case.load_after}", flush=True)
        return case
    finally:
        for p in inboxes:
            p.stop()


# -- report ---------------------------------------------------------------------------------

def report(cases: list[Case]) -> list[str]:
    lines = [
        "| case | processes | count | seconds | /s | steady /s | Postgres CPU ms per run "
        "| worker CPU ms per run | web CPU ms per run | inbox CPU ms per run | machine CPU ms "
        "per run | commits per run | runs per claim / finish statement "
        "| load before -> after | valid |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for c in cases:
        def col(key: str, c: Case = c) -> str:
            return f"{c.ms_per(key):.2f}" if key in c.cpu else "-"
        lines.append(
            f"| {c.kind} | {c.processes} | {c.count} | {c.seconds:.2f} | {c.rate:.0f} | "
            f"{c.steady_rate:.0f} | {col('postgres')} | {col('worker')} | {col('web')} | "
            f"{col('inbox')} | {col('machine')} | {c.commits_per_run} | "
            f"{format_batch_sizes(c.batch_sizes)} | {c.load_before} -> {c.load_after} | "
            f"{'yes' if c.valid else '**INVALID** (load above the limit)'} |")
    for kind, unit in (("workers", "runs/s"), ("inbox", "messages/s")):
        mine = [c for c in cases if c.kind == kind]
        if len(mine) > 1:
            base = mine[0]
            lines.append(f"- {kind}: " + ", ".join(
                f"x{c.processes} {c.rate:.0f} {unit} ({c.rate / base.rate:.2f}x of "
                f"x{base.processes})" for c in mine))
    for c in cases:
        for kind, histogram in c.batch_histogram.items():
            lines.append(f"- {c.kind} x{c.processes}, {kind} statements by runs carried: "
                         f"{histogram}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5000, help="runs per workers case")
    parser.add_argument("--messages", type=int, default=10_000,
                        help="dispatch messages per inbox case")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4],
                        help="worker process counts (each --concurrency 1)")
    parser.add_argument("--inboxes", type=int, nargs="+", default=[1, 2],
                        help="inbox process counts (one consumer group)")
    parser.add_argument("--mode", choices=("prefork", "batch"), default="prefork",
                        help="the workers' POIMEN_WORKER_MODE: prefork at --concurrency 1, "
                             "or batch (one threads-pool process of --threads each)")
    parser.add_argument("--threads", type=int, default=16,
                        help="batch mode: each worker's threads")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=600.0, help="per case, seconds")
    parser.add_argument("--max-load", type=float, default=1.5,
                        help="1-minute load average above which a case is invalid")
    parser.add_argument("--quiet-wait", type=float, default=300.0,
                        help="seconds to wait for the load to fall before a case")
    parser.add_argument("--no-record", action="store_true",
                        default=os.environ.get("BENCH_NO_RECORD") == "1",
                        help="do not append to bench/RESULTS.md (also BENCH_NO_RECORD=1)")
    args = parser.parse_args()

    stop_on_sigterm()
    env = dict(os.environ)
    missing = [v for v in ("DATABASE_URL", "REDIS_URL", "KAFKA_BOOTSTRAP_SERVERS")
               if not env.get(v)]
    if missing:
        sys.exit(f"{', '.join(missing)} unset: run `make bench`, or export `poimen-dev env`")
    bench_id = uuid.uuid4().hex[:8]
    queue = f"poimen-bench-scale-{bench_id}"
    env.update({
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        "POIMEN_QUEUE": queue,
        "BENCH_HOLD_QUEUE": f"{queue}-hold",
        "BENCH_TOPIC_PREFIX": f"benchscale{bench_id}",
        "POIMEN_REPAIR_MIN_AGE": "3600",  # beat is not running; repair stays out of it
        "POIMEN_WORKER_MODE": args.mode,
    })
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    redis = redis_lib.Redis.from_url(env["REDIS_URL"])
    machine = machine_summary(env["DATABASE_URL"])
    print(f"machine: {machine}", flush=True)
    workers_are = (f"batch, {args.threads} threads each" if args.mode == "batch"
                   else "prefork, --concurrency 1 each")
    print(f"workers: {workers_are}", flush=True)
    print(f"runs {args.runs} x workers {args.workers}; messages {args.messages} x inboxes "
          f"{args.inboxes}, {args.partitions} partitions; queue {queue}", flush=True)
    cases: list[Case] = []
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: print(f"deleted {delete_redis_keys(redis, bench_id)} redis keys",
                                     flush=True))
        logs = stack.enter_context(log_directory("poimen-bench-scaling-"))
        db = libpq_url(stack.enter_context(bench_database(env["DATABASE_URL"], env)))
        env["DATABASE_URL"] = db
        token, service_token = credentials(env, TENANT, "bench/scaling.py")
        from tests.processes import start_web

        # The web sends every admitted run to the holding queue (see the docstring).
        declare_queue(env, env["BENCH_HOLD_QUEUE"])
        web, api = start_web({**env, "POIMEN_QUEUE": env["BENCH_HOLD_QUEUE"]}, logs,
                             workers=2, threads=4, name="scale-web")
        stack.callback(web.stop)
        worker_env = dict(env)
        for k in args.workers:
            case = workers_case(worker_env, logs, db, api, web.pid, token, redis, k,
                                args.runs, args)
            cases.append(case)
            print(f"workers x{k}: {case.count} runs in {case.seconds:.2f}s = "
                  f"{case.rate:.0f} runs/s (steady {case.steady_rate:.0f}); Postgres "
                  f"{case.ms_per('postgres'):.2f} ms/run, worker {case.ms_per('worker'):.2f} "
                  f"ms/run, {case.commits_per_run} commits/run"
                  f"{'' if case.valid else ' INVALID'}", flush=True)
        for k in args.inboxes:
            case = inbox_case(env, logs, db, api, web.pid, service_token, k, args.messages,
                              args)
            cases.append(case)
            print(f"inbox x{k}: {case.count} messages in {case.seconds:.2f}s = "
                  f"{case.rate:.0f} messages/s (steady {case.steady_rate:.0f}); Postgres "
                  f"{case.ms_per('postgres'):.2f} ms/message, web {case.ms_per('web'):.2f} "
                  f"ms/message{'' if case.valid else ' INVALID'}", flush=True)
    lines = report(cases)
    print()
    print("\n".join(lines))
    if args.no_record:
        print("(not recorded: --no-record)")
        return 0
    append_result(RESULTS, SECTION, [
        f"### {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
        f"- machine: {machine['cores']} cores (nproc), {machine['machine']}, Linux "
        f"{machine['kernel']}, Python {machine['python']}, Postgres {machine['postgres']}; "
        f"load average at the start {machine['load']}",
        f"- `python bench/scaling.py --runs {args.runs} --messages {args.messages} --workers "
        f"{' '.join(map(str, args.workers))} --inboxes {' '.join(map(str, args.inboxes))} "
        f"--partitions {args.partitions} --mode {args.mode}"
        f"{f' --threads {args.threads}' if args.mode == 'batch' else ''}`; gunicorn 2x4; "
        f"each worker {workers_are}; "
        f"CPU in ms per run (per admitted message), every `postgres` process counted",
        "", *lines])
    print(f"appended to {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
