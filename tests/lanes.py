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

The unit and db lanes run at the same time (the unit lane's output follows the db
lane's). The system lane's parallel pass starts the longest modules first
(``tests/durations.py``, from ``tests/durations.json``); ``--store-durations``
writes that file from the pass's report.

Each pass prints its test count and seconds; any pass's non-zero pytest status fails
the run (5, no tests collected, included), after every lane has run. The defaults
are chosen for two cores: ``POIMEN_TEST_WORKERS`` (3) is the db lane's worker count,
``POIMEN_SYSTEM_WORKERS`` (5) the system lane's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

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
    beside_next: bool = False  # runs at the same time as the pass after it
    longest_first: bool = False  # modules in tests/durations.json's order


def passes(lanes: list[str]) -> list[Pass]:
    db_workers = int(os.environ.get("POIMEN_TEST_WORKERS", "3"))
    # The system lane's tests mostly wait (takeover bounds, shutdown graces): one more.
    system_workers = int(os.environ.get("POIMEN_SYSTEM_WORKERS", "5"))
    table = {
        "unit": [Pass("unit", "unit", env=NO_SERVICES, beside_next="db" in lanes)],
        # worksteal: the model test's families take tens of seconds each, the rest
        # milliseconds; an idle worker takes over another's queue.
        "db": [Pass("db", "db", db_workers, "worksteal")],
        "system": [Pass("system", "system and not alone", system_workers, "loadfile",
                        longest_first=True),
                   Pass("system alone", "system and alone")],
    }
    return [p for lane in lanes for p in table[lane]]


SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)\b")


def count(line: str) -> int:
    return sum(int(n) for n, _ in SUMMARY.findall(line))


def run(step: Pass, extra: list[str], report: Path,
        out=None) -> tuple[int, int, float, str]:
    """Run one pass, streaming its output to ``out`` (stdout); (status, tests, seconds,
    summary line). Its JUnit report is written to ``report``."""
    out = out or sys.stdout
    argv = [sys.executable, "-m", "pytest", "-m", step.marks, f"--junitxml={report}", *extra]
    env = {**os.environ, **(step.env or {})}
    if step.workers:
        argv += ["-n", str(step.workers), "--dist", step.dist]
    if step.longest_first:
        argv += ["--no-loadscope-reorder"]
        env["POIMEN_LONGEST_FIRST"] = "1"
    out.write(f"\n=== lane {step.lane}: {' '.join(argv[1:])}\n")
    out.flush()
    started = time.monotonic()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True, bufsize=1)
    summary = ""
    assert proc.stdout is not None
    for line in proc.stdout:
        out.write(line)
        if SUMMARY.search(line) and re.search(r" in [\d.]+s", line):
            summary = line.strip(" =\n")
    status = proc.wait()
    out.flush()
    return status, count(summary), time.monotonic() - started, summary


def run_all(steps: list[Pass], extra: list[str], reports: Path) -> list[tuple]:
    """Every pass in order; a ``beside_next`` pass at the same time as the next one, its
    output held and printed after the next one's."""
    results: list[tuple] = []
    i = 0
    while i < len(steps):
        step = steps[i]
        report = reports / f"{step.lane.replace(' ', '-')}.xml"
        if step.beside_next and i + 1 < len(steps):
            held = tempfile.TemporaryFile("w+")
            beside: list[tuple] = []

            def run_beside(step=step, report=report, held=held, beside=beside) -> None:
                beside.append(run(step, extra, report, held))

            thread = threading.Thread(target=run_beside)
            thread.start()
            nxt = steps[i + 1]
            after = run(nxt, extra, reports / f"{nxt.lane.replace(' ', '-')}.xml")
            thread.join()
            held.seek(0)
            sys.stdout.write(held.read())
            sys.stdout.flush()
            results += [(step, *beside[0]), (nxt, *after)]
            i += 2
        else:
            results.append((step, *run(step, extra, report)))
            i += 1
    return results


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    extra = args[args.index("--") + 1:] if "--" in args else []
    lanes = (args[:args.index("--")] if "--" in args else args)
    store = "--store-durations" in lanes
    lanes = [lane for lane in lanes if lane != "--store-durations"] or list(LANES)
    unknown = set(lanes) - set(LANES)
    if unknown:
        print(f"unknown lanes: {', '.join(sorted(unknown))} (lanes: {', '.join(LANES)})",
              file=sys.stderr)
        return 2
    started = time.monotonic()
    reports = Path(tempfile.mkdtemp(prefix="poimen-lanes-"))
    results = run_all(passes(lanes), extra, reports)
    if store:
        from tests import durations
        durations.store([reports / f"{p.lane.replace(' ', '-')}.xml"
                         for p in passes(lanes) if p.longest_first])
        print(f"\n=== durations stored in {durations.FILE}", flush=True)
    print("\n=== lanes", flush=True)
    for step, status, tests, seconds, summary in results:
        verdict = "ok" if status == 0 else f"FAILED (pytest exit {status})"
        print(f"  {step.lane:<13} {tests:5d} tests {seconds:7.1f}s  {verdict}  {summary}")
    print(f"  {'total':<13} {sum(r[2] for r in results):5d} tests "
          f"{time.monotonic() - started:7.1f}s", flush=True)
    return 1 if any(r[1] != 0 for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
