"""Shared plumbing for the benchmarks: a throwaway database, wrk, machine facts.

Every benchmark owns what it creates (a ``poimen_bench_<id>`` database, a
Celery queue, child processes) and removes it on the way out, error or not,
so running ``make bench`` on a developer's machine leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from poimen_dev.scratch import scratch_database
from poimenconfig import libpq_url  # noqa: F401 - the benchmarks' URL conversion

ROOT = Path(__file__).resolve().parent.parent
REQUIRED_ENV = ("DATABASE_URL", "REDIS_URL")


def require_env() -> dict[str, str]:
    """Return ``os.environ`` as a dict, or exit with a hint when the services are unset."""
    missing = [name for name in REQUIRED_ENV if not os.environ.get(name)]
    if missing:
        sys.exit(f"{', '.join(missing)} unset: run the benchmarks with `make bench`, or "
                 "`set -a; eval \"$(.venv/bin/poimen-dev env)\"; set +a` first")
    return dict(os.environ)


def require_wrk() -> str:
    """Return the path of ``wrk``, or exit saying how to install it."""
    path = shutil.which("wrk")
    if path is None:
        sys.exit("wrk is not installed: `apt-get install -y wrk` (Debian's package), "
                 "or run `make bench` as root, which installs it")
    return path


def stop_on_sigterm() -> None:
    """Turn SIGTERM into ``SystemExit`` so ``finally`` blocks clean up on a plain kill. A
    second SIGTERM while they run is ignored: raised inside a ``finally``, it would cut the
    clean-up short and leave the benchmark's processes running."""

    def stop(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


@contextlib.contextmanager
def bench_database(server_url: str, env: Mapping[str, str]) -> Iterator[str]:
    """A migrated ``poimen_bench_<id>`` on ``server_url``'s server, dropped after (libpq URL)."""
    with scratch_database(server_url, "poimen_bench", env) as url:
        yield url


def web_environment(env: Mapping[str, str], db_url: str, queue: str) -> dict[str, str]:
    """``env`` for a benchmark's gunicorn: its database and Celery queue, and a metrics
    directory of its own (gunicorn_conf makes one when none is set)."""
    web_env = {**env, "DATABASE_URL": db_url, "POIMEN_QUEUE": queue}
    web_env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    return web_env


def release(web: Any, redis_client: Any, queue: str) -> None:
    """A benchmark's end, error or not: its gunicorn (``web``, None if stopped) stopped, its
    Celery queue's Redis keys deleted."""
    if web is not None:
        web.process.stop()
    for key in redis_client.scan_iter(match=f"*{queue}*"):
        redis_client.delete(key)
    redis_client.close()


@contextlib.contextmanager
def log_directory(prefix: str) -> Iterator[Path]:
    """A temporary directory for child logs; kept (and named) only if the run fails."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    except BaseException:
        print(f"child process logs kept in {path}", file=sys.stderr)
        raise
    shutil.rmtree(path, ignore_errors=True)


# -- wrk ---------------------------------------------------------------------

_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3, "h": 3600e3}
_COUNT_LINE = re.compile(r"^BENCH_COUNTS (.*)$", re.M)


@dataclass
class WrkResult:
    """What one wrk run reported (latencies in milliseconds)."""

    requests: int
    duration_s: float
    rate: float
    p50_ms: float
    p75_ms: float
    p90_ms: float
    p99_ms: float
    non_2xx: int
    socket_errors: dict[str, int]
    counts: dict[str, int] = field(default_factory=dict)
    output: str = ""
    # CPU milliseconds per completed request, by process group (see CpuMeter).
    cpu_ms: dict[str, float] = field(default_factory=dict)

    @property
    def errors(self) -> int:
        return self.non_2xx + sum(self.socket_errors.values())


def _ms(value: str, unit: str) -> float:
    return float(value) * _UNITS[unit]


def parse_wrk(output: str) -> WrkResult:
    """Parse ``wrk --latency`` output (plus this module's ``BENCH_COUNTS`` line)."""
    pct = {
        int(p): _ms(v, u)
        for p, v, u in re.findall(r"^\s+(\d+)%\s+([\d.]+)(us|ms|s|m|h)\s*$", output, re.M)
    }
    done = re.search(r"^\s*(\d+) requests in ([\d.]+)(us|ms|s|m|h)", output, re.M)
    rate = re.search(r"^Requests/sec:\s+([\d.]+)", output, re.M)
    if not (pct and done and rate):
        raise RuntimeError(f"could not parse wrk output:\n{output}")
    sock = re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output)
    socket_errors = dict(zip(("connect", "read", "write", "timeout"),
                             map(int, sock.groups()), strict=True)) if sock else {}
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", output)
    counts = {}
    if line := _COUNT_LINE.search(output):
        counts = {k: int(v) for k, v in (item.split("=") for item in line.group(1).split())}
    return WrkResult(
        requests=int(done.group(1)),
        duration_s=_ms(done.group(2), done.group(3)) / 1e3,
        rate=float(rate.group(1)),
        p50_ms=pct[50], p75_ms=pct[75], p90_ms=pct[90], p99_ms=pct[99],
        non_2xx=int(non_2xx.group(1)) if non_2xx else 0,
        socket_errors=socket_errors,
        counts=counts,
        output=output,
    )


# Per-thread counters summed in done(): wrk gives each thread its own Lua state,
# and setup() keeps a handle on every thread so done() can read them back.
WRK_COUNTERS_LUA = """
local threads = {}
issued, created, replayed, other = 0, 0, 0, 0

function setup(thread)
  thread:set("tid", #threads + 1)
  table.insert(threads, thread)
end

function response(status, headers, body)
  if status == 201 then created = created + 1
  elseif status == 200 then replayed = replayed + 1
  else other = other + 1 end
end

function done(summary, latency, requests)
  local sums = {issued = 0, created = 0, replayed = 0, other = 0}
  for _, t in ipairs(threads) do
    for name, _ in pairs(sums) do sums[name] = sums[name] + t:get(name) end
  end
  io.write(string.format("BENCH_COUNTS issued=%d created=%d replayed=%d other=%d\\n",
    sums.issued, sums.created, sums.replayed, sums.other))
end
"""


def run_wrk(wrk: str, url: str, lua: str, *, duration: float, connections: int,
            threads: int, timeout_s: float = 5.0) -> WrkResult:
    """Run ``wrk --latency`` with the Lua script ``lua`` and return the parsed result."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", prefix="poimen-bench-") as script:
        script.write(lua)
        script.flush()
        proc = subprocess.run(
            [wrk, f"-t{threads}", f"-c{connections}", f"-d{duration:g}s",
             f"--timeout={timeout_s:g}s", "--latency", "-s", script.name, url],
            capture_output=True, text=True, timeout=duration + 60,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"wrk failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return parse_wrk(proc.stdout)


# -- the machine ---------------------------------------------------------------

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    """The direct children of ``pid`` (e.g. gunicorn's workers under its arbiter)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds consumed so far by ``pids`` (gone ones count 0)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / _CLOCK_TICKS


def cpu_seconds_with_children(pid: int) -> float:
    """User + system CPU seconds used so far by process ``pid`` and its reaped children."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def append_result(results: Path, section: str, lines: list[str]) -> None:
    """Append one run to ``section`` of ``results`` (RESULTS.md), leaving others' alone."""
    text = results.read_text() if results.exists() else "# Benchmark results\n"
    entry = "\n".join(lines) + "\n"
    start = text.find(section)
    if start < 0:
        text = text.rstrip("\n") + f"\n\n{section}\n\n{entry}"
    else:
        end = text.find("\n## ", start + len(section))
        end = len(text) if end < 0 else end + 1
        text = text[:end].rstrip("\n") + f"\n\n{entry}" + ("\n" + text[end:] if end < len(text)
                                                           else "")
    results.write_text(text)


class CpuMeter:
    """CPU seconds spent by named groups of processes between ``start()`` and ``stop()``.

    Throughput on a shared machine moves with everyone else's load; CPU per
    request does much less, so it says what a request costs, not what it got.
    Processes born during the interval count in full; ones that died are lost.
    """

    def __init__(self, groups: Mapping[str, Callable[[], list[int]]]):
        self.groups = dict(groups)
        self.before: dict[str, dict[int, float]] = {}

    def start(self) -> None:
        self.before = {name: {pid: cpu_seconds([pid]) for pid in pids()}
                       for name, pids in self.groups.items()}

    def stop(self) -> dict[str, float]:
        return {
            name: sum(cpu_seconds([pid]) - self.before[name].get(pid, 0.0) for pid in pids())
            for name, pids in self.groups.items()
        }


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


# The CPU probe's loop: about 0.2 s of one core on the machines of bench/RESULTS.md.
PROBE_ADDITIONS = 2_000_000


def cpu_probe_ms(additions: int = PROBE_ADDITIONS) -> float:
    """Milliseconds one core takes for a fixed pure-Python loop (the best of three).

    Two boots of the same 2-core machine type ran the same tree 2-3 times apart in
    CPU per run, and on one boot this figure moved 1.9 times within an idle minute
    (bench/RESULTS.md, 2026-12-07): a report carries it to say how fast the machine was
    when the report started. Lower is faster."""
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        total = 0
        for i in range(additions):
            total += i
        best = min(best, time.perf_counter() - started)
    return round(best * 1000, 1)


def machine_line() -> str:
    """Cores, arch, Python and the CPU probe, for the scripts that print a line of them."""
    return (f"{len(os.sched_getaffinity(0))} cores, {platform.machine()}, "
            f"Python {platform.python_version()}, CPU probe {cpu_probe_ms()} ms")


def machine_summary(database_url: str) -> dict[str, str]:
    """The facts a result is meaningless without: cores, arch, Python, Postgres, load, and
    how fast this boot of the machine runs Python (``cpu_probe_ms``)."""
    with psycopg.connect(libpq_url(database_url)) as conn:
        pg = conn.execute("SHOW server_version").fetchone()[0]
    return {
        "cores": str(len(os.sched_getaffinity(0))),  # what `nproc` says
        "machine": platform.machine(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "postgres": pg,
        "cpu probe ms": str(cpu_probe_ms()),
        "load": load_average(),
    }


def quiet_database(database_url: str) -> bool:
    """``VACUUM ANALYZE`` then ``CHECKPOINT``, so a case does not pay for the previous
    case's writes: autovacuum wakes up for a table that grew by thousands of rows (the raw
    insert case adds ~60,000) and, landing in the next case, cost it a third of its
    rate; a checkpoint those writes brought on lands there too, with its page flushes.
    False where the role may not (``CHECKPOINT`` needs ``pg_checkpoint``)."""
    try:
        with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE")
            conn.execute("CHECKPOINT")
        return True
    except psycopg.errors.InsufficientPrivilege:
        return False


def _quieten(database_url: str | None, limit: float, wait: float) -> float:
    """``quiet_database`` ``database_url`` (if given), then wait up to ``wait`` seconds for
    the one-minute load average to fall to ``limit``. Returns the seconds waited."""
    if database_url:
        quiet_database(database_url)
    started = time.monotonic()
    while os.getloadavg()[0] > limit and time.monotonic() - started < wait:
        time.sleep(5)
    return time.monotonic() - started


def settle(database_url: str | None = None, limit: float = 1.5, cap: float = 300.0) -> None:
    """Wait until the one-minute load average is under ``limit`` (the previous phase's
    load must not be charged to the next one), for at most ``cap`` seconds. With
    ``database_url``, first ``quiet_database`` it: every case then starts just after a
    checkpoint, alone or in ``make bench`` (where the previous script's writes and its
    ``DROP DATABASE`` otherwise leave a checkpoint to land inside the next case)."""
    waited = _quieten(database_url, limit, cap)
    print(f"  load average {os.getloadavg()[0]:.2f} after {waited:.0f}s of quiet", flush=True)


def ensure_quiet(limit: float = 1.5, wait: float = 300.0,
                 database_url: str | None = None) -> bool:
    """The project's rule, benchmarks run alone: wait up to ``wait`` seconds for the
    one-minute load average to fall to ``limit``; if it does not, say so loudly and return
    False (the caller marks its figure invalid). True when the machine is quiet. With
    ``database_url``, first ``quiet_database`` it (as ``settle``)."""
    _quieten(database_url, limit, wait)
    load = os.getloadavg()[0]
    if load > limit:
        print(f"  WARNING: load average {load:.2f} > {limit} after {wait:.0f}s of waiting: "
              "the machine is not quiet, this figure is INVALID", file=sys.stderr, flush=True)
        return False
    return True


def percentile(values: list[float], p: float) -> float:
    """The ``p``-th percentile (nearest rank) of ``values``; NaN when there are none."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))]


# -- CPU accounting by process group, postgres and the machine (from /proc) ------

def _proc_stats() -> dict[int, tuple[str, int, float]]:
    """pid -> (command name, process group, CPU seconds) for every process."""
    stats = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                raw = f.read()
        except OSError:
            continue
        name = raw[raw.index("(") + 1:raw.rindex(")")]
        fields = raw[raw.rindex(")") + 2:].split()
        # fields[0] is field 3 (state): pgrp is field 5, utime/stime fields 14/15.
        stats[int(entry)] = (name, int(fields[2]),
                             (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS)
    return stats


def _machine_cpu() -> float:
    with open("/proc/stat") as f:
        parts = f.readline().split()[1:]
    busy = sum(int(x) for i, x in enumerate(parts[:8]) if i not in (3, 4))  # not idle/iowait
    return busy / _CLOCK_TICKS


@dataclass
class CpuSnapshot:
    processes: dict[int, tuple[tuple[str, ...], float]]  # pid: (its labels, CPU seconds)
    machine: float


def cpu_snapshot(pgroups: Mapping[str, int | Sequence[int]]) -> CpuSnapshot:
    """CPU seconds so far of each process in a named process group (a group id, or
    several: the processes started with ``start_new_session`` lead their own), of every
    ``postgres`` and ``redis-server`` process on the machine, of this process, and of
    the machine."""
    processes = {}
    for pid, (name, pgrp, cpu) in _proc_stats().items():
        labels = [label for label, group in pgroups.items()
                  if pgrp == group or (not isinstance(group, int) and pgrp in group)]
        if name.startswith("postgres"):
            labels.append("postgres")
        elif name.startswith("redis-server"):
            labels.append("redis")
        if pid == os.getpid():
            labels.append("client")
        if labels:
            processes[pid] = (tuple(labels), cpu)
    return CpuSnapshot(processes, _machine_cpu())


def cpu_delta(before: CpuSnapshot, after: CpuSnapshot) -> dict[str, float]:
    """CPU seconds between two snapshots by label, summed per process: a process that
    started in between counts whole, one that ended in between is not counted (its
    last CPU time is gone with it; summing groups instead gave negative figures when a
    Postgres backend or an autovacuum worker ended during a case)."""
    delta: dict[str, float] = {}
    for snapshot in (before, after):
        for labels, _ in snapshot.processes.values():
            for label in labels:
                delta.setdefault(label, 0.0)
    for pid, (labels, cpu) in after.processes.items():
        earlier = before.processes.get(pid)
        spent = cpu - earlier[1] if earlier and earlier[0] == labels else cpu
        for label in labels:
            delta[label] += max(spent, 0.0)
    delta["machine"] = after.machine - before.machine
    return delta


def runs_by_status(db_url: str) -> dict[str, int]:
    with psycopg.connect(db_url) as conn:
        return dict(conn.execute("SELECT status, count(*) FROM runs GROUP BY 1").fetchall())




POLL_S = 0.05


class CountPoll:
    """``SELECT count(*) ...`` on one connection kept open for a case's polls.

    A connection per poll is a Postgres backend started 20 times a second, its CPU
    charged to the system under test: the case then measures the poll. Callable;
    ``close()`` when the case is over."""

    def __init__(self, db_url: str, sql: str, params: Sequence[object] = ()):
        self._conn = psycopg.connect(db_url, autocommit=True)
        self._sql, self._params = sql, list(params)
        self.calls = 0  # each one a transaction of its own (``committed`` counts them)

    def __call__(self) -> int:
        self.calls += 1
        return self._conn.execute(self._sql, self._params, prepare=True).fetchone()[0]

    def close(self) -> None:
        self._conn.close()


# A backend reports its transaction counts to the statistics when a transaction ends at
# least a second after its last report, when it exits, or once it has been idle 10 s
# (PostgreSQL 15 and later): waiting this long makes every count of a finished phase seen.
STATS_FLUSH_S = 11.0


def committed(db_url: str) -> int:
    """Transactions committed in ``db_url``'s database so far, as its statistics say
    (``pg_stat_database.xact_commit``; read-only transactions count too). The read is one
    transaction itself."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        return conn.execute("SELECT xact_commit FROM pg_stat_database "
                            "WHERE datname = current_database()").fetchone()[0]


# A batch worker's store-batcher statements so far, by kind (``claim``, ``finish``):
# ``count`` (statements), ``sum`` (runs) and each bucket's cumulative count by its
# bound (``1.0``, ``2.0``, ... ``+Inf``), summed over workers.
BatchCounts = dict[str, dict[str, float]]


def batch_counts(*urls: str) -> BatchCounts:
    """The ``poimen_worker_batch_size`` histogram of the batch workers whose metrics
    ``urls`` serve, summed (``BatchCounts``); empty kinds for prefork workers."""
    from tests.processes import metrics

    counts: BatchCounts = {"claim": {}, "finish": {}}
    for url in urls:
        try:
            scraped = metrics(url)
        except Exception:  # noqa: BLE001 - a figure to report, not a result
            continue
        for (name, labels), value in scraped.items():
            fields = dict(labels)
            kind = fields.get("kind")
            if kind not in counts or not name.startswith("poimen_worker_batch_size_"):
                continue
            key = name.removeprefix("poimen_worker_batch_size_")
            if key == "bucket":
                key = fields["le"]
            elif key not in ("count", "sum"):
                continue
            counts[kind][key] = counts[kind].get(key, 0.0) + value
    return counts


def batch_sizes(after: BatchCounts, before: BatchCounts | None = None) -> dict[str, float]:
    """The mean runs per store-batcher statement, by kind, between two ``batch_counts``
    (``before`` None: since the workers started); a kind without statements is left out."""
    out = {}
    for kind, now in after.items():
        then = (before or {}).get(kind, {})
        statements = now.get("count", 0.0) - then.get("count", 0.0)
        if statements > 0:
            out[kind] = (now.get("sum", 0.0) - then.get("sum", 0.0)) / statements
    return out


def format_batch_sizes(sizes: Mapping[str, float]) -> str:
    """``batch_sizes`` as a report shows it: ``"claim / finish"`` means, ``-`` if none."""
    if not sizes:
        return "-"
    return f"{sizes.get('claim', 0):.1f} / {sizes.get('finish', 0):.1f}"


def batch_histogram(after: BatchCounts, before: BatchCounts | None = None) -> dict[str, str]:
    """The store-batcher statements between two ``batch_counts`` by how many runs each
    carried, by kind: ``"1: 812, 2: 301, 3-4: 96, 5-8: 4"`` (empty ranges left out)."""
    out = {}
    for kind, now in after.items():
        then = (before or {}).get(kind, {})
        bounds = sorted((float(key), key) for key in now if key not in ("count", "sum"))
        parts, below, low = [], 0.0, 1
        for bound, key in bounds:
            cumulative = now[key] - then.get(key, 0.0)
            if cumulative > below:
                high = "" if bound == float("inf") else str(int(bound))
                label = (f"{low}+" if not high else
                         str(low) if str(low) == high else f"{low}-{high}")
                parts.append(f"{label}: {int(cumulative - below)}")
            below = cumulative
            if bound != float("inf"):
                low = int(bound) + 1
        if parts:
            out[kind] = ", ".join(parts)
    return out


def wait_for_count(count_fn, target: int, timeout: float, what: str) -> float:
    """Poll ``count_fn`` every ``POLL_S`` until it reaches ``target``; return that moment."""
    deadline = time.monotonic() + timeout
    while True:
        seen = count_fn()
        if seen >= target:
            return time.monotonic()
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: only {seen}/{target} done after {timeout:.0f}s")
        time.sleep(POLL_S)




def wait_ready(proc, timeout: float = 60.0) -> None:
    """Wait for a Celery worker's ``ready.`` line (fail at once if it exits)."""
    from tests.processes import wait_until

    def ready():
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited:\n{proc.log()[-3000:]}")
        return " ready." in proc.log()

    wait_until(ready, timeout=timeout, interval=0.1, what=f"{proc.name} ready")




def delete_redis_keys(redis, marker: str) -> int:
    """Delete every key naming this run's id (queues, bindings, the counter)."""
    keys = list(redis.scan_iter(match=f"*{marker}*", count=1000))
    return redis.delete(*keys) if keys else 0


# -- tenants, Kafka ------------------------------------------------------------------

def credentials(env: Mapping[str, str], tenant: str, label: str) -> tuple[str, str]:
    """Create ``tenant`` in ``env``'s database (a child process: the app's settings come
    from that environment); return (a token of the tenant, an admit-only service token)."""
    code = (
        "from app import create_app\n"
        "from app.tenant_service import create_tenant, create_token\n"
        "with create_app().app_context():\n"
        f"    t = create_tenant({tenant!r})\n"
        f"    print(create_token(t, False, label={label!r}))\n"
        f"    print(create_token(None, True, label={label!r}, scope='admit'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=dict(env), cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.split()
    return out[-2], out[-1]


def produce(bootstrap: str, topic: str, first: int, n: int, partitions: int, phase: str,
            rate: float = 0.0, key_prefix: str = "e2e") -> float:
    """Produce dispatch messages ``first..first+n-1`` of ``noop`` (paced at ``rate``/s if
    set), round robin over ``partitions``; return the monotonic time of the first produce."""
    import json

    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 2, "acks": "all"})
    started = time.monotonic()
    for k in range(n):
        if rate:
            delay = started + k / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        i = first + k
        value = json.dumps({"workflow_ref": "noop", "dispatch_key": f"{key_prefix}-{i}",
                            "input": {"i": i, "phase": phase, "t": time.time()}}).encode()
        while True:
            try:
                producer.produce(topic, value, key=f"{key_prefix}-{i}".encode(),
                                 partition=i % partitions)
                break
            except BufferError:
                producer.poll(0.05)
        producer.poll(0)
    if producer.flush(120):
        raise RuntimeError("the broker did not acknowledge every dispatch message")
    return started


HISTORY_TENANT = "bench-history"
# How many finished runs of ``HISTORY_TENANT`` a case's ``runs`` holds (``reset_runs``).
RUNS_HISTORY = 20_000
# The tenant of a case's runs, besides ``reset_runs``' history. Read its runs with
# ``tenant_id = %s`` and its id as a parameter: the planner then sees the value and
# uses the tenant's index (with ``= ANY(SELECT ...)`` or ``= (SELECT ...)`` it planned
# for any tenant, i.e. for the history's, and scanned all of ``runs`` on every poll:
# auto_explain, 3-6 ms each, 20 polls a second).
CASE_TENANT = "bench"


def tenant_id(db_url: str, name: str) -> int:
    """The id of tenant ``name`` in ``db_url``'s database."""
    with psycopg.connect(db_url) as conn:
        return conn.execute("SELECT id FROM tenants WHERE name = %s", [name]).fetchone()[0]


def reset_runs(db_url: str, history: int = 0) -> None:
    """Empty ``runs`` and ``outbox`` (and what cascades) between cases; then, with
    ``history``, give ``runs`` that many finished runs of another tenant
    (``HISTORY_TENANT``), each with its step entry, and analyze them.

    A production ``runs`` table holds the history of finished runs, analyzed by
    autovacuum, with a few queued and running ones. An emptied one is not that:
    ``VACUUM ANALYZE`` records it as known to be empty (every plan made in the next
    case reads ``runs`` by sequential scan), and ``TRUNCATE`` alone leaves its size
    unknown (a generic plan may then find a run by id through a partial index, which
    reads every queued run). Autovacuum corrects either within a minute or two; a
    case lasts 20 s, so without a history the case measures only that minute.
    """
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("TRUNCATE runs, outbox CASCADE")
        if history:
            tenant = conn.execute(
                "INSERT INTO tenants (name) VALUES (%s) ON CONFLICT (name) DO UPDATE "
                "SET name = EXCLUDED.name RETURNING id", [HISTORY_TENANT]).fetchone()[0]
            conn.execute(
                "INSERT INTO runs (id, tenant_id, workflow_ref, workflow_name, workflow_version, "
                "input, status, attempt, failures, cancel_requested, origin, "
                "started_at, finished_at, created_at, updated_at) "
                "SELECT gen_random_uuid(), %s, 'noop@1', 'noop', '1', '{}'::jsonb, 'succeeded', "
                "1, 0, false, 'http', now(), now(), now() - make_interval(secs => g), now() "
                "FROM generate_series(1, %s) g", [tenant, history])
            conn.execute(
                "INSERT INTO step_entries (run_id, entry_no, step_id, status, actions, "
                "finished_at) SELECT id, 0, 'run', 'completed', '[]'::jsonb, now() FROM runs "
                "WHERE tenant_id = %s", [tenant])
            conn.execute("ANALYZE runs")
            conn.execute("ANALYZE step_entries")
            conn.execute("ANALYZE outbox")
