"""Benchmark: waiting on the server (``GET /v1/runs/<id>?wait=30``) beside admissions.

Standalone, like ``bench/admission.py`` (whose gunicorn and wrk helpers it uses): its own
database, tenant and Celery queue; gunicorn as the Procfile starts it (its default shape:
``WEB_CONCURRENCY`` 2 x ``WEB_THREADS`` 128). No worker runs: the waited runs are ended
by the benchmark itself, one statement each, so an answer's lag is measured from the
commit that ended its run.

Cases:

  alone    wrk admissions (unique keys, 16 connections) with nobody waiting: the baseline
  waiting  the same, while ``WAITERS`` requests wait on as many queued runs (each its own
           connection, ``?wait=30``)
  lag      then each waited run is ended in turn; its answer's lag after the end's
           commit, p50 and p99 (target p99 <= 100 ms)

The three alternate, ``ROUNDS`` times, and the medians of the two admission rates are
compared: ``admissions while waiting / alone`` (target: >= 0.9).

A wrong result fails the run (exit 1): a waiter answered before its run ended, a
non-terminal answer after it, an answer marked ``Poimen-Wait: full`` (the default shape
holds ``WAITERS`` waiters), or admissions that were not each one run. A missed target is
printed, never fatal (noise). Run it with ``make bench`` or ``.venv/bin/python
bench/wait.py [--record bench/RESULTS.md]``.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg  # noqa: E402
import redis  # noqa: E402
import requests  # noqa: E402

from bench._common import (  # noqa: E402
    append_result,
    bench_database,
    ensure_quiet,
    load_average,
    log_directory,
    machine_summary,
    percentile,
    release,
    require_env,
    require_wrk,
    stop_on_sigterm,
    web_environment,
)
from bench.admission import (  # noqa: E402
    CONNECTIONS,
    admission_lua,
    check_unique_case,
    create_tenant_and_token,
    describe,
    measured_wrk,
    run_wrk,
    start_gunicorn,
)

WAITERS = 100
ROUNDS = 3
WAIT_SECONDS = 30
WORKERS, THREADS = 2, 128  # the Procfile's defaults
TARGET_RATIO = 0.9
TARGET_LAG_P99_MS = 100.0


class Waiter(threading.Thread):
    """One ``GET ?wait=`` on its own connection; records when and what it answered."""

    def __init__(self, url: str, token: str, run_id: str):
        super().__init__(daemon=True)
        self.url, self.run_id = url, run_id
        self.headers = {"Authorization": f"Bearer {token}"}
        self.answered_at: float | None = None
        self.status: str | None = None
        self.full = False

    def run(self) -> None:
        answer = requests.get(f"{self.url}/v1/runs/{self.run_id}?wait={WAIT_SECONDS}",
                              headers=self.headers, timeout=WAIT_SECONDS + 15)
        self.answered_at = time.monotonic()
        self.status = answer.json().get("status")
        self.full = answer.headers.get("Poimen-Wait") == "full"


def end_and_measure(db_url: str, waiters: list[Waiter], problems: list[str]) -> list[float]:
    """End each waited run in turn (one committed statement); return each answer's lag
    after its end's commit, in ms, and note a wrong answer in ``problems``."""
    lags = []
    with psycopg.connect(db_url, autocommit=True) as conn:
        for waiter in waiters:
            conn.execute("UPDATE runs SET status = 'succeeded', finished_at = now() "
                         "WHERE id = %s", [waiter.run_id])
            ended = time.monotonic()
            waiter.join(10)
            if waiter.answered_at is None or waiter.status != "succeeded":
                problems.append(f"run {waiter.run_id}: answered {waiter.status!r} after its end")
                continue
            if waiter.full:
                problems.append(f"run {waiter.run_id}: answered 'full'")
            lags.append(max(0.0, waiter.answered_at - ended) * 1000)
    return lags


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=6.0, help="seconds per wrk case")
    parser.add_argument("--wrk-threads", type=int, default=2)
    parser.add_argument("--record", type=Path, help="append the results to this markdown file")
    args = parser.parse_args(argv)

    wrk = require_wrk()
    env = require_env()
    stop_on_sigterm()
    quiet = ensure_quiet()
    run_id = secrets.token_hex(4)
    queue = f"poimen-bench-{run_id}"
    started = datetime.now(UTC)
    load_before = load_average()
    print(f"wait benchmark {run_id}: {WAITERS} waiters, {args.duration:g} s per wrk case, "
          f"gunicorn {WORKERS} x {THREADS}, load average {load_before}")
    redis_client = redis.Redis.from_url(env["REDIS_URL"])
    problems: list[str] = []
    web = None
    try:
        with bench_database(env["DATABASE_URL"], env) as db_url, \
                log_directory("poimen-bench-wait-") as log_dir:
            web_env = web_environment(env, db_url, queue)
            machine = machine_summary(db_url)
            _, token = create_tenant_and_token(db_url, f"bench-{run_id}")
            web = start_gunicorn(web_env, log_dir, WORKERS, THREADS, access_log=True)
            admit = f"{web.url}/v1/runs"
            headers = {"Authorization": f"Bearer {token}"}
            run_wrk(wrk, admit, admission_lua(token, f"warm-{run_id}"), duration=2,
                    connections=CONNECTIONS, threads=args.wrk_threads)

            # Alone and waiting alternate, ROUNDS times each, so a drift of the machine
            # (the first case's warm-up, another process's burst) weighs on both alike;
            # the medians are compared.
            alones, waitings, lags = [], [], []
            for round_no in range(ROUNDS):
                tag = f"{run_id}-{round_no}"
                def admissions(case: str, tag: str = tag) -> float:
                    result = measured_wrk(wrk, web, db_url, "/v1/runs",
                                          admission_lua(token, f"{case}-{tag}"),
                                          duration=args.duration, wrk_threads=args.wrk_threads)
                    print(describe(case, result))
                    problems.extend(check_unique_case(db_url, f"{case}-{tag}", result))
                    return result.rate

                alones.append(admissions("alone"))

                waited = [requests.post(admit, json={"workflow_ref": "noop", "input": {}},
                                        headers=headers, timeout=10).json()["id"]
                          for _ in range(WAITERS)]
                waiters = [Waiter(web.url, token, rid) for rid in waited]
                for waiter in waiters:
                    waiter.start()
                time.sleep(1.0)  # every request in and waiting
                early = [w for w in waiters if w.answered_at is not None]
                if early:
                    problems.append(f"{len(early)} waiters answered before their run ended "
                                    f"({sum(w.full for w in early)} marked full)")
                waitings.append(admissions("waiting"))
                if any(w.answered_at is not None for w in waiters):
                    problems.append("a waiter answered before its run ended (wrk case)")
                lags += end_and_measure(db_url, waiters, problems)
            alone_rate, waiting_rate = statistics.median(alones), statistics.median(waitings)
            lag50, lag99 = percentile(lags, 50), percentile(lags, 99)
            ratio = waiting_rate / alone_rate if alone_rate else 0.0
            print(f"  lag      p50 {lag50:6.1f} ms  p99 {lag99:6.1f} ms  max {max(lags):6.1f} ms "
                  f"after the end's commit ({len(lags)} answers)")
            print(f"admissions while {WAITERS} wait / alone (medians of {ROUNDS}): "
                  f"{waiting_rate:.0f} / {alone_rate:.0f} = {ratio:.2f} "
                  f"(target >= {TARGET_RATIO}: {'met' if ratio >= TARGET_RATIO else 'MISSED'}); "
                  f"lag p99 {lag99:.1f} ms (target <= {TARGET_LAG_P99_MS:g}: "
                  f"{'met' if lag99 <= TARGET_LAG_P99_MS else 'MISSED'})")
            web.process.stop()
            web = None
    finally:
        release(web, redis_client, queue)
    load_after = load_average()
    print(f"load average before {load_before}, after {load_after}"
          + ("" if quiet else " (NOT QUIET before: figures invalid)"))
    if problems:
        print("WRONG RESULT: " + "; ".join(problems))
    if args.record:
        append_result(args.record, "## Waiting on the server (bench/wait.py)", [
            f"### {started:%Y-%m-%d %H:%M} UTC", "",
            f"- machine: {machine}; load before {load_before}, after {load_after}"
            + ("" if quiet else " (not quiet: invalid)"),
            f"- gunicorn {WORKERS} x {THREADS}, wrk -t{args.wrk_threads} -c{CONNECTIONS}, "
            f"{args.duration:g} s per case, {WAITERS} waiters on ?wait={WAIT_SECONDS}",
            f"- admissions alone {', '.join(f'{r:.0f}' for r in alones)}/s, while waiting "
            f"{', '.join(f'{r:.0f}' for r in waitings)}/s (alternating): ratio of the medians "
            f"{ratio:.2f} (target >= {TARGET_RATIO})",
            f"- answer lag after the end's commit: p50 {lag50:.1f} ms, p99 {lag99:.1f} ms "
            f"(target <= {TARGET_LAG_P99_MS:g})",
            f"- correctness: {'OK' if not problems else 'FAILED: ' + '; '.join(problems)}",
        ])
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
