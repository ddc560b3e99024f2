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
  (server-wide counts, timing bounds measured under load). The ``apart`` tests run on
  a Postgres and a Redis of their own in a network namespace (the partition tests):
  beside the db lane and the parallel pass's start, on servers no other test uses.

Each pass starts once the passes it waits for have ended (``Pass.after``): the unit
and db lanes at once; the system lane's ``apart`` tests (on servers of their own: the
partition tests) when the unit lane has ended; the system lane's parallel pass when the
unit and db lanes have ended (the ``apart`` tests, mostly waiting on partitions, run on
beside its first modules); its ``alone`` tests when every other pass has ended. The
db, parallel and ``alone`` passes stream their output; the others' is printed whole
when they end. The parallel pass starts the longest modules first
(``tests/durations.py``, from ``tests/durations.json``); ``--store-durations`` writes
that file from the pass's report.

Each pass prints its test count and seconds; any pass's non-zero pytest status fails
the run (5, no tests collected, included), after every lane has run. The defaults
are chosen for two cores: ``POIMEN_TEST_WORKERS`` (3) is the db lane's worker count,
``POIMEN_SYSTEM_WORKERS`` the system lane's (unset: 5 on a fast machine, 3 on a slow one,
by a timed probe: ``default_system_workers``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
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
    after: tuple[str, ...] = ()  # the passes (by lane label) it waits for, where selected
    longest_first: bool = False  # modules in tests/durations.json's order
    stream: bool = False  # its output as it comes (else whole, when it ends)


# A fixed piece of Python work, and how long it may take on a machine fast enough for the
# system lane's 5 workers (3 million loop steps: 0.06 s on the faster 2-core machine this
# suite was tuned on, 0.5-0.75 s on one 2.5 times slower per direct finish).
_PROBE_STEPS = 3_000_000
_FAST_PROBE_SECONDS = 0.25


def default_system_workers() -> int:
    """The system lane's workers when ``POIMEN_SYSTEM_WORKERS`` is unset: 5 on a fast
    machine, 3 on a slow one. The lane's tests start processes (web, workers, relays) that
    load both cores, and some bound a process's answer in seconds (a cap change beside an
    8 s run, a pooled web's answer, a kill -9 recovery): at 5 workers on a machine 2.5
    times slower, the load average stood near 9 and six of them failed for it; at 3 they
    passed. The probe is the best of three timings of a fixed loop, printed with the
    choice."""
    best = min(_probe() for _ in range(3))
    workers = 5 if best <= _FAST_PROBE_SECONDS else 3
    print(f"system lane: {workers} workers (a {_PROBE_STEPS:,}-step loop took {best:.2f}s; "
          f"5 at or under {_FAST_PROBE_SECONDS}s; POIMEN_SYSTEM_WORKERS overrides)", flush=True)
    return workers


def _probe() -> float:
    started = time.perf_counter()
    total = 0
    for step in range(_PROBE_STEPS):
        total += step
    return time.perf_counter() - started


def passes(lanes: list[str]) -> list[Pass]:
    db_workers = int(os.environ.get("POIMEN_TEST_WORKERS", "3"))
    system_workers = int(os.environ.get("POIMEN_SYSTEM_WORKERS") or default_system_workers())
    table = {
        "unit": [Pass("unit", "unit", env=NO_SERVICES)],
        # worksteal: the model test's families take tens of seconds each, the rest
        # milliseconds; an idle worker takes over another's queue.
        "db": [Pass("db", "db", db_workers, "worksteal", stream=True)],
        # `apart`: system tests on servers of their own (the partition tests), once the
        # unit lane has ended (its servers' start-up then takes no CPU from the db lane,
        # the first on the way to the parallel pass), beside the db lane and the parallel
        # pass's start, both waits mostly; then the `alone` tests. On a fast machine two
        # at a time: one after another they would outlast the db lane and that start.
        "system": [Pass("system apart", "system and apart", 2 if system_workers >= 5 else 0,
                        "worksteal", after=("unit",)),
                   Pass("system", "system and not alone and not apart", system_workers,
                        "loadfile", after=("unit", "db"), longest_first=True, stream=True),
                   Pass("system alone", "system and alone",
                        after=("unit", "db", "system apart", "system"), stream=True)],
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
    # Bytecode caches on, whatever the shell says: every pass collects the whole suite in
    # each of its xdist workers (pytest rewrites every test module's asserts, cached in
    # __pycache__), and the system lane starts hundreds of Pythons (web, workers, relays,
    # CLIs) that import the project. With PYTHONDONTWRITEBYTECODE set, as some machines
    # do, a collection took 10.7 s of CPU instead of 4.6, and each start compiled the
    # project again. (The mutation gate keeps it set: it edits sources under test.)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
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
    """Every pass, each once the selected passes it waits for have ended; results in
    ``steps``' order. A streaming pass's lines and an ended pass's whole output are
    written under one lock, so no line is cut."""
    lock = threading.Lock()
    ended = {step.lane: threading.Event() for step in steps}
    results: dict[str, tuple] = {}

    class Locked:
        def write(self, text: str) -> None:
            with lock:
                sys.stdout.write(text)

        def flush(self) -> None:
            with lock:
                sys.stdout.flush()

    def one(step: Pass) -> None:
        try:
            for lane in step.after:
                if lane in ended:
                    ended[lane].wait()
            if step.stream:
                results[step.lane] = run(step, extra, _report(reports, step), Locked())
                return
            with tempfile.TemporaryFile("w+") as out:
                results[step.lane] = run(step, extra, _report(reports, step), out)
                out.seek(0)
                with lock:
                    sys.stdout.write(out.read())
                    sys.stdout.flush()
        finally:
            ended[step.lane].set()

    with ThreadPoolExecutor(max_workers=len(steps)) as pool:
        for future in [pool.submit(one, step) for step in steps]:
            future.result()
    return [(step, *results[step.lane]) for step in steps]


def _report(reports: Path, step: Pass) -> Path:
    return reports / f"{step.lane.replace(' ', '-')}.xml"


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
        durations.store([_report(reports, p) for p in passes(lanes) if p.longest_first])
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
