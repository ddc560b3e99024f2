"""Benchmark: runs/s end to end (HTTP admission -> ``succeeded``) versus plain Celery.

    python bench/execution.py [--runs 5000] [--plain-tasks 15000] [--repeat 1] [--prefetch 1 4]

For each prefetch multiplier, in one invocation and on the same services:

* **Poimen** — a ``celery -A workers worker --concurrency 2`` (prefork), as the
  Procfile starts it, and gunicorn as the Procfile starts it. ``--runs`` runs of
  the built-in ``noop`` workflow are admitted with ``POST /v1/runs`` from
  ``--clients`` keep-alive HTTP connections *while the worker runs*; the clock
  goes from the first POST to the moment ``SELECT count(*) FROM runs WHERE
  status = 'succeeded'`` (polled every 50 ms) reaches ``--runs``. Each run is
  admission (INSERT + outbox event, then the Celery send after commit), claim
  (UPDATE + event), a read, and the fenced finish (UPDATE + event).
* **Poimen, key limit** — the same, with runs of ``noop-keyed``
  (``bench/workflows.py``: a ``concurrency_limit`` on 16 keys that never binds),
  so every claim and finish takes the group's advisory lock and counts its
  slots in the claim statement (docs/internals/execution.md). Reported beside
  the unlimited case as its cost per run (target: within 10%). ``--no-keyed``
  skips it.
* **plain Celery** — ``bench/plain_celery_app.py``: the same Celery settings
  (``celeryconfig.celery_settings``: acks_late, prefetch, task events ...), the
  same broker, a queue of its own, a worker at ``--concurrency 2``; the task's
  body is one ``INCR`` of a Redis counter, the completion marker. The tasks are
  sent with ``apply_async`` from one thread while the worker runs; the clock
  goes from the first send to the moment the counter (polled every 50 ms)
  reaches ``--plain-tasks``.

Both cases are preceded by a warm-up (``--warmup`` runs/tasks, then the tables
or counter are reset), so neither pays for imports or first connections.
``--plain-tasks`` defaults to three times ``--runs`` so that each case lasts
about as long (>= 10 s here); the rates, not the counts, are compared.

Prefetch: with ``acks_late`` a pool process acknowledges a message only after
the task returns, so the multiplier only decides how many unacknowledged
messages each process may hold (reserve) ahead of the one it runs: it can save
broker round trips between tasks, never run more at once.

The benchmark owns everything it creates — a ``poimen_bench_<id>`` database
(migrated with ``flask db upgrade``), the queues ``poimen-bench-<id>`` and
``poimen-bench-<id>-plain``, a counter key, the child processes — and removes
them on the way out, error or not. Needs ``DATABASE_URL`` and ``REDIS_URL``
(``make bench`` sets them).

Commits per run: the transactions committed in the case's database during a Poimen case
(``pg_stat_database.xact_commit``, read-only ones included), less this script's own polls,
per run. Each end of the count waits ``STATS_FLUSH_S`` (11 s) first: a backend reports its
counts within 10 s of going idle.

The CPU columns are CPU-seconds per 1,000 runs, read from ``/proc`` before and
after each case: the worker (main + pool processes), gunicorn, every
``postgres`` process on the machine (the server is shared with whatever else
is running), ``redis-server``, this script (the client), and the whole machine.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.client
import json
import os
import statistics
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
import redis as redis_lib  # noqa: E402

from bench._common import (  # noqa: E402
    CASE_TENANT,
    RUNS_HISTORY,
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
    delete_redis_keys,
    format_batch_sizes,
    libpq_url,
    load_average,
    log_directory,
    machine_summary,
    percentile,
    require_env,
    reset_runs,
    runs_by_status,
    settle,
    stop_on_sigterm,
    tenant_id,
    wait_for_count,
    wait_ready,
)
from tests.processes import (  # noqa: E402
    BIN,
    Process,
    free_port,
    start_web,
    start_worker,
)

TARGET_RATIO = 0.6  # admit -> succeeded, of plain Celery's rate
TARGET_LATENCY_P50_MS = 20.0  # admit -> running at low load
# Finished runs in ``runs`` before each case, as a production table holds (``reset_runs``).
TARGET_KEYED_COST = 0.10  # a key limit's cost per run, of the unlimited case's


# -- results ------------------------------------------------------------------

@dataclass
class CaseResult:
    name: str
    prefetch: int
    count: int
    seconds: float
    send_seconds: float
    cpu: dict[str, float] = field(default_factory=dict)
    load_before: str = ""
    load_after: str = ""
    commits: int | None = None  # transactions committed in the case's database (Poimen)
    # A batch worker's runs per store-batcher statement in the case, by kind (mean), and
    # its statements by runs carried (``batch_histogram``), from its metrics.
    batch_sizes: dict[str, float] = field(default_factory=dict)
    batch_histogram: dict[str, str] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.count / self.seconds

    def cpu_per_1000(self, key: str) -> float:
        return self.cpu.get(key, 0.0) * 1000 / self.count

    @property
    def commits_per_run(self) -> str:
        return "-" if self.commits is None else f"{self.commits / self.count:.2f}"


# -- Poimen -------------------------------------------------------------------

def _bodies(keyed: bool) -> list[str]:
    """The request bodies to cycle through: ``noop``, or ``noop-keyed`` over its keys."""
    if not keyed:
        return [json.dumps({"workflow_ref": "noop", "input": {}})]
    from bench.workflows import KEYS

    return [json.dumps({"workflow_ref": "noop-keyed", "input": {"key": f"k{k}"}})
            for k in range(KEYS)]


def _admit(url: str, token: str, count: int, errors: list[str],
           rate: float | None = None, keyed: bool = False) -> None:
    """POST ``count`` noop runs over one keep-alive connection, ``rate`` per second if given."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    bodies = _bodies(keyed)
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    start = time.monotonic()
    try:
        for i in range(count):
            if rate and (pause := start + i / rate - time.monotonic()) > 0:
                time.sleep(pause)
            conn.request("POST", "/v1/runs", body=bodies[i % len(bodies)], headers=headers)
            resp = conn.getresponse()
            resp.read()
            if resp.status != 201:
                errors.append(f"{resp.status}")
    except Exception as err:  # noqa: BLE001 - reported by the caller
        errors.append(repr(err))
    finally:
        conn.close()


def admit_concurrently(url: str, token: str, count: int, clients: int,
                       keyed: bool = False) -> float:
    """Admit ``count`` runs from ``clients`` threads; return when the last one answered."""
    errors: list[str] = []
    shares = [count // clients + (i < count % clients) for i in range(clients)]
    threads = [threading.Thread(target=_admit, args=(url, token, n, errors),
                                kwargs={"keyed": keyed}, daemon=True)
               for n in shares]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} admissions failed, e.g. {errors[:3]}")
    return time.monotonic()


def succeeded(db_url: str) -> int:
    """The case's succeeded runs (not ``reset_runs``' history), read through the tenant's
    index on one open connection: this poll runs 20 times a second, and its Postgres
    CPU is charged to the case."""
    return _succeeded_poll(db_url)()


@functools.cache
def _succeeded_poll(db_url: str) -> CountPoll:
    return CountPoll(db_url, "SELECT count(*) FROM runs WHERE status = 'succeeded' "
                             "AND tenant_id = %s", [case_tenant_id(db_url)])


@functools.cache
def case_tenant_id(db_url: str) -> int:
    """The id of the case's tenant in ``db_url``, read once (the polls run 20 times a
    second, and ``reset_runs`` never touches ``tenants``)."""
    return tenant_id(db_url, CASE_TENANT)


def poimen_case(env: dict[str, str], log_dir: Path, db_url: str, web_url: str, web_pgrp: int,
                token: str, runs: int, warmup: int, prefetch: int, clients: int,
                timeout: float, hold_for_profile: bool, keyed: bool = False,
                concurrency: int = 2) -> CaseResult:
    name = "poimen-keyed" if keyed else "poimen"
    metrics_port = free_port()
    worker_env = {**env, "CELERY_PREFETCH_MULTIPLIER": str(prefetch),
                  "METRICS_PORT": str(metrics_port)}
    worker = start_worker(worker_env, log_dir, f"{name}-p{prefetch}", concurrency=concurrency)
    try:
        wait_ready(worker)
        if warmup:
            admit_concurrently(web_url, token, warmup, clients, keyed)
            wait_for_count(lambda: succeeded(db_url), warmup, timeout, "poimen warm-up")
        reset_runs(db_url, history=RUNS_HISTORY)
        if hold_for_profile:
            print(f"PROFILE worker_pgrp={worker.pid} web_pgrp={web_pgrp}: attach a profiler "
                  f"(e.g. py-spy record --pid <pool pid>); starting in 10 s", flush=True)
            time.sleep(10)

        settle(db_url)  # the previous case's load must not be charged to this one
        time.sleep(STATS_FLUSH_S)  # the warm-up's commits reported before the count starts
        commits0, polls0 = committed(db_url), _succeeded_poll(db_url).calls
        worker_metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        batches0 = batch_counts(worker_metrics)
        load_before = load_average()
        pgroups = {"worker": worker.pid, "web": web_pgrp}
        cpu0 = cpu_snapshot(pgroups)
        start = time.monotonic()
        sent: list[float] = []
        sender = threading.Thread(
            target=lambda: sent.append(admit_concurrently(web_url, token, runs, clients,
                                                          keyed)),
            daemon=True)
        sender.start()
        try:
            done = wait_for_count(lambda: succeeded(db_url), runs, timeout, name)
        except RuntimeError as err:
            raise RuntimeError(f"{err}; runs by status: {runs_by_status(db_url)}") from None
        sender.join()
        cpu1 = cpu_snapshot(pgroups)
        load_after = load_average()
        batches1 = batch_counts(worker_metrics)
        time.sleep(STATS_FLUSH_S)  # every process's commits of the case reported
        # Less this script's own: the polls, and the first read of the count.
        commits = (committed(db_url) - commits0 - 1
                   - (_succeeded_poll(db_url).calls - polls0))
        return CaseResult(name, prefetch, runs, done - start, sent[0] - start,
                          cpu_delta(cpu0, cpu1), load_before, load_after, commits,
                          batch_sizes(batches1, batches0), batch_histogram(batches1, batches0))
    finally:
        worker.stop()


def latency_case(env: dict[str, str], log_dir: Path, db_url: str, web_url: str, token: str,
                 rate: float, runs: int, timeout: float, concurrency: int = 2
                 ) -> dict[str, float]:
    """Admit ``runs`` runs at ``rate`` per second, one at a time, with a prefetch-1 worker
    running; return admit -> running percentiles in ms.

    Both ends are Postgres' clock: ``created_at`` is the admission statement's
    ``now()``, ``started_at`` the claim's. What lies between is the commit, the
    web process's sender, the broker, the worker's prefetch and the claim.
    """
    worker = start_worker({**env, "CELERY_PREFETCH_MULTIPLIER": "1"}, log_dir, "latency",
                          concurrency=concurrency)
    try:
        wait_ready(worker)
        admit_concurrently(web_url, token, 20, 1)
        wait_for_count(lambda: succeeded(db_url), 20, timeout, "latency warm-up")
        reset_runs(db_url, history=RUNS_HISTORY)
        settle(db_url)  # the previous case's load must not be charged to this one
        load_before = load_average()
        errors: list[str] = []
        _admit(web_url, token, runs, errors, rate=rate)
        if errors:
            raise RuntimeError(f"latency case: {len(errors)} admissions failed, e.g. {errors[:3]}")
        wait_for_count(lambda: succeeded(db_url), runs, timeout, "latency case")
        with psycopg.connect(db_url) as db:
            waits = [float(row[0]) for row in db.execute(
                "SELECT extract(epoch FROM started_at - created_at) * 1000 FROM runs "
                "WHERE tenant_id = %s", [case_tenant_id(db_url)])]
        return {"runs": len(waits), "rate": rate, "p50": percentile(waits, 50),
                "p90": percentile(waits, 90), "p99": percentile(waits, 99), "max": max(waits),
                "load_before": load_before, "load_after": load_average()}
    finally:
        worker.stop()


# -- plain Celery -------------------------------------------------------------

def plain_case(env: dict[str, str], log_dir: Path, redis: redis_lib.Redis, counter_key: str,
               tasks: int, warmup: int, prefetch: int, timeout: float,
               pool: str = "prefork", concurrency: int = 2) -> CaseResult:
    from bench import plain_celery_app

    worker_env = {**env, "CELERY_PREFETCH_MULTIPLIER": str(prefetch)}
    sender_app = plain_celery_app.create(worker_env)
    task = sender_app.tasks[plain_celery_app.TASK_NAME]
    worker = Process(
        f"plain-p{prefetch}",
        [str(BIN / "celery"), "-A", "bench.plain_celery_app", "worker", "--loglevel", "INFO",
         "--pool", pool, "--concurrency", str(concurrency),
         "--hostname", f"plain-p{prefetch}-{uuid.uuid4().hex[:6]}@%h",
         "--without-mingle", "--without-gossip"],
        worker_env, log_dir,
    ).start()

    def count() -> int:
        return int(redis.get(counter_key) or 0)

    def send(n: int) -> float:
        for _ in range(n):
            task.apply_async()
        return time.monotonic()

    try:
        wait_ready(worker)
        redis.delete(counter_key)
        if warmup:
            send(warmup)
            wait_for_count(count, warmup, timeout, "plain warm-up")
        redis.delete(counter_key)

        settle(env["DATABASE_URL"])  # the previous case's load must not be charged to this one
        load_before = load_average()
        pgroups = {"worker": worker.pid}
        cpu0 = cpu_snapshot(pgroups)
        start = time.monotonic()
        sent: list[float] = []
        sender = threading.Thread(target=lambda: sent.append(send(tasks)), daemon=True)
        sender.start()
        done = wait_for_count(count, tasks, timeout, "plain celery")
        sender.join()
        cpu1 = cpu_snapshot(pgroups)
        return CaseResult("plain", prefetch, tasks, done - start, sent[0] - start,
                          cpu_delta(cpu0, cpu1), load_before, load_average())
    finally:
        worker.stop()
        sender_app.close()


# -- setup and report ---------------------------------------------------------

def create_tenant_and_token(db_url: str) -> str:
    os.environ["DATABASE_URL"] = db_url
    from app import create_app
    from app.tenant_service import create_tenant, create_token

    flask_app = create_app()
    with flask_app.app_context():
        tenant = create_tenant(CASE_TENANT)
        return create_token(tenant, service=False, label="bench/execution.py")


def report(results: list[CaseResult]) -> str:
    lines = [
        "| case | prefetch | count | seconds | /s | send phase s | commits per run | runs per "
        "claim / finish statement | worker | web | postgres | redis | client | machine |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        cpu = " | ".join(
            f"{r.cpu_per_1000(k):.2f}" if k in r.cpu else "-"
            for k in ("worker", "web", "postgres", "redis", "client", "machine"))
        sizes = format_batch_sizes(r.batch_sizes)
        lines.append(f"| {r.name} | {r.prefetch} | {r.count} | {r.seconds:.2f} | "
                     f"{r.rate:.0f} | {r.send_seconds:.2f} | {r.commits_per_run} | {sizes} | "
                     f"{cpu} |")
    lines.append("")
    lines.append("Commits per run: transactions committed in the case's database "
                 "(pg_stat_database.xact_commit, read-only ones included, this script's own "
                 "left out) per run: admission, claim, finish, and the worker's own checks. "
                 "CPU columns: CPU-seconds per 1,000 "
                 "runs/tasks. Load (1/5/15 min) before -> after each case:")
    for r in results:
        lines.append(f"- {r.name} prefetch {r.prefetch}: {r.load_before} -> {r.load_after}")
    for r in results:
        for kind, histogram in r.batch_histogram.items():
            lines.append(f"- {r.name} prefetch {r.prefetch}, {kind} statements by runs "
                         f"carried: {histogram}")
    lines.append("")
    for prefetch in sorted({r.prefetch for r in results}):
        rates = {name: sorted(r.rate for r in results if r.prefetch == prefetch and r.name == name)
                 for name in ("poimen", "plain")}
        if not (rates["poimen"] and rates["plain"]):
            continue
        for label, pick in (("best", max), ("median", statistics.median)):
            poimen, plain = pick(rates["poimen"]), pick(rates["plain"])
            ratio = poimen / plain
            verdict = "met" if ratio >= TARGET_RATIO else "NOT met"
            lines.append(f"prefetch {prefetch} ({label} of {len(rates['poimen'])}): Poimen "
                         f"{poimen:.0f} runs/s, plain Celery {plain:.0f} tasks/s, ratio "
                         f"{ratio:.2f} (target >= {TARGET_RATIO}: {verdict})")
    for prefetch in sorted({r.prefetch for r in results}):
        rates = {name: [r.rate for r in results if r.prefetch == prefetch and r.name == name]
                 for name in ("poimen", "poimen-keyed")}
        if not (rates["poimen"] and rates["poimen-keyed"]):
            continue
        unlimited, keyed = statistics.median(rates["poimen"]), statistics.median(
            rates["poimen-keyed"])
        cost = (1 / keyed - 1 / unlimited) / (1 / unlimited)
        verdict = "met" if cost <= TARGET_KEYED_COST else "NOT met"
        lines.append(f"prefetch {prefetch} (median): key limit {keyed:.0f} runs/s, unlimited "
                     f"{unlimited:.0f} runs/s: {1000 / keyed:.2f} vs {1000 / unlimited:.2f} ms "
                     f"per run, cost {cost:+.0%} (target <= {TARGET_KEYED_COST:.0%}: "
                     f"{verdict})")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5000, help="Poimen runs per case")
    parser.add_argument("--plain-tasks", type=int, default=None,
                        help="plain Celery tasks per case (default: 3 x --runs)")
    parser.add_argument("--prefetch", type=int, nargs="+", default=[1, 4],
                        help="CELERY_PREFETCH_MULTIPLIER values to try")
    parser.add_argument("--repeat", type=int, default=1,
                        help="measure every case this many times, interleaved (the report "
                             "gives each measurement and the best and median of each case)")
    parser.add_argument("--clients", type=int, default=4, help="concurrent HTTP connections")
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--timeout", type=float, default=300.0, help="per case, seconds")
    parser.add_argument("--only", choices=("poimen", "plain"), help="run one side only")
    parser.add_argument("--no-keyed", action="store_true",
                        help="skip the key-limit case (runs of noop-keyed)")
    parser.add_argument("--hold-for-profile", action="store_true",
                        help="pause 10 s before each Poimen case to attach a profiler")
    parser.add_argument("--latency-rate", type=float, default=10.0,
                        help="runs/s of the low-load latency case (0 skips it)")
    parser.add_argument("--latency-runs", type=int, default=300)
    parser.add_argument("--mode", choices=("prefork", "batch"), default="prefork",
                        help="the worker's POIMEN_WORKER_MODE; plain Celery runs the same pool "
                             "(prefork, or threads for batch)")
    parser.add_argument("--threads", type=int, default=16,
                        help="batch mode: the worker's threads (and plain Celery's)")
    parser.add_argument("--record", type=Path, help="append the report to this markdown file")
    args = parser.parse_args()
    concurrency = args.threads if args.mode == "batch" else 2
    pool = "threads" if args.mode == "batch" else "prefork"
    plain_tasks = args.plain_tasks or 3 * args.runs

    stop_on_sigterm()
    env = require_env()
    bench_id = uuid.uuid4().hex[:8]
    queue = f"poimen-bench-{bench_id}"
    counter_key = f"poimen-bench-{bench_id}-plain-done"
    env.update({
        "PYTHONPATH": str(ROOT),
        "POIMEN_QUEUE": queue,
        "BENCH_PLAIN_QUEUE": f"{queue}-plain",
        "BENCH_COUNTER_KEY": counter_key,
        # beat is not running; keep repair out of the picture all the same.
        "POIMEN_REPAIR_MIN_AGE": "3600",
        "POIMEN_WORKER_MODE": args.mode,
        # noop-keyed, the key-limit case's workflow (web and worker load it).
        "POIMEN_WORKFLOW_MODULES": ",".join(
            filter(None, [env.get("POIMEN_WORKFLOW_MODULES"), "bench.workflows"])),
    })
    redis = redis_lib.Redis.from_url(env["REDIS_URL"])
    results: list[CaseResult] = []
    latency: dict[str, float] | None = None
    machine = machine_summary(env["DATABASE_URL"])
    print(f"machine: {machine}", flush=True)
    print(f"mode {args.mode} ({pool} pool, {concurrency}), runs {args.runs}, plain tasks "
          f"{plain_tasks}, prefetch {args.prefetch}, clients {args.clients}, queue {queue}",
          flush=True)

    with contextlib.ExitStack() as stack:
        stack.callback(lambda: print(f"deleted {delete_redis_keys(redis, bench_id)} redis keys",
                                     flush=True))
        log_dir = stack.enter_context(log_directory("poimen-bench-execution-"))
        db_url = stack.enter_context(bench_database(env["DATABASE_URL"], env))
        db_url = libpq_url(db_url)
        env["DATABASE_URL"] = db_url
        token = create_tenant_and_token(db_url)
        web = None
        if args.only != "plain":
            web, web_url = start_web(env, log_dir, workers=2, threads=4)
            stack.callback(web.stop)
        for round_, prefetch in [(i, p) for i in range(args.repeat) for p in args.prefetch]:
            if args.only != "plain":
                # The two Poimen cases swap places every round: the second of a pair
                # starts on a machine the first has just warmed (or loaded).
                keyed_cases = [False] if args.no_keyed else [False, True]
                for keyed in keyed_cases[::-1] if round_ % 2 else keyed_cases:
                    r = poimen_case(env, log_dir, db_url, web_url, web.pid, token, args.runs,
                                    args.warmup, prefetch, args.clients, args.timeout,
                                    args.hold_for_profile, keyed=keyed,
                                    concurrency=concurrency)
                    results.append(r)
                    print(f"{r.name} prefetch {prefetch}: {r.count} runs in {r.seconds:.2f}s = "
                          f"{r.rate:.0f} runs/s (admission took {r.send_seconds:.2f}s)",
                          flush=True)
            if args.only != "poimen":
                r = plain_case(env, log_dir, redis, counter_key, plain_tasks, args.warmup,
                               prefetch, args.timeout, pool, concurrency)
                results.append(r)
                print(f"plain prefetch {prefetch}: {r.count} tasks in {r.seconds:.2f}s = "
                      f"{r.rate:.0f} tasks/s (sending took {r.send_seconds:.2f}s)", flush=True)
        if args.latency_rate > 0 and args.only != "plain":
            latency = latency_case(env, log_dir, db_url, web_url, token,
                                   args.latency_rate, args.latency_runs, args.timeout,
                                   concurrency)
            print(f"admit -> running at {latency['rate']:g}/s: p50 {latency['p50']:.1f} ms, "
                  f"p99 {latency['p99']:.1f} ms", flush=True)
    text = report(results)
    if latency:
        verdict = "met" if latency["p50"] <= TARGET_LATENCY_P50_MS else "NOT met"
        text += (f"\n\nadmit -> running at {latency['rate']:g} runs/s ({latency['runs']} runs, "
                 f"one client, prefetch 1): p50 {latency['p50']:.1f} ms, p90 "
                 f"{latency['p90']:.1f} ms, p99 {latency['p99']:.1f} ms, max "
                 f"{latency['max']:.1f} ms (target p50 <= {TARGET_LATENCY_P50_MS:g} ms: "
                 f"{verdict}); load {latency['load_before']} -> {latency['load_after']}")
    print()
    print(text)
    if args.record:
        append_result(args.record, "## Execution (bench/execution.py)", [
            f"### {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
            "- machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()),
            f"- `python bench/execution.py --runs {args.runs} --mode {args.mode} --repeat "
            f"{args.repeat}` (plain tasks "
            f"{plain_tasks}; {pool} pool, concurrency {concurrency} for both), clients "
            f"{args.clients}", "", text])
        print(f"appended to {args.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
