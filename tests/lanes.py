"""``python -m tests.lanes [LANE ...] [-- PYTEST_ARG ...]``: run the test lanes.

Every test is in one lane, assigned at collection (``tests/process_guard.py``):

* ``unit``: reaches no service fixture. Runs in one process (the whole lane takes
  less than a parallel worker's start-up), with the services' variables pointing at a
  closed port, so a unit test that reaches a service fails instead of passing slowly.
* ``db``: in-process tests on the real Postgres, Redis and Kafka, in parallel
  (pytest-xdist): each worker is a pytest session with its scratch database and the
  Celery queue named after it (``tests/conftest.py``).
* ``system``: the ``processes`` mark: gunicorn, Celery, relays, chaos, the browser. A
  parallel pass (whole modules per worker, so a module-scoped server starts once),
  then the ``alone`` tests one at a time: they need the machine to themselves
  (iptables, timing bounds measured under load).

Each pass prints its test count and seconds; any pass's non-zero pytest status fails
the run (5, no tests collected, included), after every lane has run. The defaults
are chosen for two cores: ``POIMEN_TEST_WORKERS`` (3) is the db lane's worker count,
``POIMEN_SYSTEM_WORKERS`` (4) the system lane's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass

LANES = ("unit", "db", "system")

# The unit lane's services: a closed port (9, discard), so reaching one fails.
NO_SERVICES = {"DATABASE_URL": "postgresql://unit@127.0.0.1:9/unit",
               "REDIS_URL": "redis://127.0.0.1:9/0",
               "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:9"}


@dataclass(frozen=True)
class Pass:
    lane: str
    marks: str
    workers: int = 0  # 0: in this pytest process, no xdist
    dist: str = "load"
    env: dict[str, str] | None = None


def passes(lanes: list[str]) -> list[Pass]:
    db_workers = int(os.environ.get("POIMEN_TEST_WORKERS", "3"))
    # The system lane's tests mostly wait (takeover bounds, shutdown graces): one more.
    system_workers = int(os.environ.get("POIMEN_SYSTEM_WORKERS", "4"))
    table = {
        "unit": [Pass("unit", "unit", env=NO_SERVICES)],
        # worksteal: the model test's families take tens of seconds each, the rest
        # milliseconds; an idle worker takes over another's queue.
        "db": [Pass("db", "db", db_workers, "worksteal")],
        "system": [Pass("system", "system and not alone", system_workers, "loadfile"),
                   Pass("system alone", "system and alone")],
    }
    return [p for lane in lanes for p in table[lane]]


SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)\b")


def count(line: str) -> int:
    return sum(int(n) for n, _ in SUMMARY.findall(line))


def run(step: Pass, extra: list[str]) -> tuple[int, int, float, str]:
    """Run one pass, streaming its output; (status, tests, seconds, summary line)."""
    argv = [sys.executable, "-m", "pytest", "-m", step.marks, *extra]
    if step.workers:
        argv += ["-n", str(step.workers), "--dist", step.dist]
    print(f"\n=== lane {step.lane}: {' '.join(argv[1:])}", flush=True)
    started = time.monotonic()
    proc = subprocess.Popen(argv, env={**os.environ, **(step.env or {})},
                            stdout=subprocess.PIPE, text=True, bufsize=1)
    summary = ""
    for line in proc.stdout:
        sys.stdout.write(line)
        if SUMMARY.search(line) and re.search(r" in [\d.]+s", line):
            summary = line.strip(" =\n")
    status = proc.wait()
    return status, count(summary), time.monotonic() - started, summary


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    extra = args[args.index("--") + 1:] if "--" in args else []
    lanes = (args[:args.index("--")] if "--" in args else args) or list(LANES)
    unknown = set(lanes) - set(LANES)
    if unknown:
        print(f"unknown lanes: {', '.join(sorted(unknown))} (lanes: {', '.join(LANES)})",
              file=sys.stderr)
        return 2
    results = [(step, *run(step, extra)) for step in passes(lanes)]
    print("\n=== lanes", flush=True)
    for step, status, tests, seconds, summary in results:
        verdict = "ok" if status == 0 else f"FAILED (pytest exit {status})"
        print(f"  {step.lane:<13} {tests:5d} tests {seconds:7.1f}s  {verdict}  {summary}")
    total = sum(r[3] for r in results)
    print(f"  {'total':<13} {sum(r[2] for r in results):5d} tests {total:7.1f}s", flush=True)
    return 1 if any(r[1] != 0 for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
