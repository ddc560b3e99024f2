"""Heroku-grade shutdown.

Heroku sends SIGTERM to every process of a dyno and SIGKILL 30 s later. Here
the worker is the Procfile's own ``worker`` command, started in a process
group of its own, and the SIGTERM goes to the whole group (``os.killpg``):
the Celery main process and its pool processes at once. A second worker and
beat stand for the dyno that replaces it (they would restart a killed run).

* A 5 s run in flight finishes where it is: ``attempt == 1``, one start, one
  finish, and the worker exits well within 30 s.
* A 45 s run outlives the grace (``POIMEN_SHUTDOWN_GRACE``, 25 s): the pool
  process gives it up at the deadline, the worker still exits within 30 s,
  and the run is resumed exactly once elsewhere (``attempt == 2``, two
  starts, one finish).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from poimen_dev.platform import procfile_commands
from tests.processes import (
    ROOT,
    Process,
    start_beat,
    start_procfile_process,
    start_worker,
    wait_until,
)

pytestmark = pytest.mark.slow

HEROKU_KILL_AFTER = 30.0  # seconds between Heroku's SIGTERM and its SIGKILL
GRACE = 25  # POIMEN_SHUTDOWN_GRACE's default
# Past the grace even after the replacement worker's start-up (up to 15 s here).
RUN_PAST_GRACE = 45


@pytest.fixture
def side_effects(pg):
    """The table the ``effect`` workflow writes a row per start and finish into."""
    pg.execute("CREATE TABLE IF NOT EXISTS side_effects (id bigserial PRIMARY KEY, "
               "run_id uuid NOT NULL, kind text NOT NULL, pid int NOT NULL, "
               "at timestamptz NOT NULL DEFAULT now())")
    pg.execute("TRUNCATE side_effects")

    def rows(run_id, kind: str) -> list[int]:
        return [r[0] for r in pg.execute(
            "SELECT pid FROM side_effects WHERE run_id = %s AND kind = %s ORDER BY id",
            [run_id, kind])]

    return rows


def _run(pg, run_id):
    return pg.execute("SELECT status, attempt FROM runs WHERE id = %s", [run_id]).fetchone()


def _sigterm_group_and_time_exit(worker: Process) -> float:
    """Heroku's SIGTERM to the whole process group; seconds until the worker exited."""
    t0 = time.monotonic()
    os.killpg(worker.pid, signal.SIGTERM)
    try:
        worker.proc.wait(HEROKU_KILL_AFTER + 10)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the worker was still running {HEROKU_KILL_AFTER + 10:.0f}s after "
                    f"SIGTERM:\n{worker.log()[-3000:]}")
    return time.monotonic() - t0


def _dyno(env, log_dir, processes, run_id, side_effects) -> Process:
    """The Procfile's worker, executing ``run_id``; plus the dyno that replaces it."""
    worker = start_procfile_process("worker", env, log_dir)
    processes.append(worker)
    wait_until(lambda: len(side_effects(run_id, "start")) == 1, timeout=90,
               what="the run to start on the first worker")
    replacement = start_worker(env, log_dir, "replacement")
    processes += [replacement, start_beat(env, log_dir)]
    wait_until(lambda: "ready" in replacement.log(), timeout=90, what="the replacement worker")
    return worker


# alone: the 5 s run must still be in flight when the replacement worker is ready; beside
# other tests' processes the replacement's start-up can outlast it.
@pytest.mark.alone
def test_sigterm_to_the_group_lets_a_5s_run_finish_where_it_is(
        admit, side_effects, test_env, pg, tmp_path, processes):
    env = {**test_env, "POIMEN_REPAIR_INTERVAL": "2", "POIMEN_REPAIR_MIN_AGE": "30"}
    run_id = admit("effect", {"seconds": 5})
    worker = _dyno(env, tmp_path, processes, run_id, side_effects)

    exited_after = _sigterm_group_and_time_exit(worker)
    status, attempt = wait_until(lambda: _run(pg, run_id)[0] == "succeeded" and _run(pg, run_id),
                                 timeout=90, what="the run to succeed")
    print(f"\n5 s run: worker exited {exited_after:.1f}s after SIGTERM (status "
          f"{worker.proc.returncode}); run {status}, attempt {attempt}")
    assert attempt == 1, worker.log()[-3000:]
    [started_on] = side_effects(run_id, "start")
    assert side_effects(run_id, "finish") == [started_on]
    assert exited_after < HEROKU_KILL_AFTER
    assert worker.proc.returncode == 0
    assert "SIGTERM: finishing the run in flight" in worker.log()


def test_a_45s_run_past_the_grace_is_resumed_exactly_once_elsewhere(
        admit, side_effects, test_env, pg, tmp_path, processes):
    env = {**test_env, "POIMEN_REPAIR_INTERVAL": "2", "POIMEN_REPAIR_MIN_AGE": "30"}
    run_id = admit("effect", {"seconds": RUN_PAST_GRACE})
    worker = _dyno(env, tmp_path, processes, run_id, side_effects)
    ran = pg.execute("SELECT extract(epoch FROM now() - at) FROM side_effects WHERE run_id = %s "
                     "AND kind = 'start'", [run_id]).fetchone()[0]
    assert RUN_PAST_GRACE - float(ran) > GRACE + 5, (
        f"the replacement took {ran:.0f}s to start: the run would end within the grace")

    exited_after = _sigterm_group_and_time_exit(worker)
    status, attempt = wait_until(lambda: _run(pg, run_id)[0] in {"succeeded", "failed"}
                                 and _run(pg, run_id), timeout=180, what="the run to end")
    starts, finishes = side_effects(run_id, "start"), side_effects(run_id, "finish")
    print(f"\n{RUN_PAST_GRACE} s run: worker exited {exited_after:.1f}s after SIGTERM; run {status}, "
          f"attempt {attempt}, starts {len(starts)}, finishes {len(finishes)}")
    assert exited_after < HEROKU_KILL_AFTER
    assert "exits after the 25s shutdown grace" in worker.log()
    assert (status, attempt) == ("succeeded", 2)
    assert len(starts) == 2 and starts[0] != starts[1]  # given up on one process ...
    assert finishes == [starts[1]]  # ... finished once, by the other
    time.sleep(3)  # let any stray duplicate delivery arrive: it must execute nothing
    assert len(side_effects(run_id, "start")) == 2


def _pool_process(body: str) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``body`` in a process that uses workers.shutdown as a pool process does."""
    code = "import os, signal, sys, time\nfrom workers import shutdown\n" \
        "shutdown.init_pool_process(grace=1.5)\n" + textwrap.dedent(body)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    return proc, time.monotonic() - t0


def test_a_pool_process_keeps_its_task_through_sigterm_until_the_deadline():
    """The rule itself, without Celery: noted during a task, then given up at the grace."""
    proc, took = _pool_process("""
        shutdown.task_starting()
        os.kill(os.getpid(), signal.SIGTERM)   # the dyno's SIGTERM: noted, not fatal
        time.sleep(0.2)
        print("running", shutdown.shutting_down(), round(shutdown.seconds_left()), flush=True)
        time.sleep(30)                         # a run that will not finish in time
        print("still here", flush=True)
    """)
    assert proc.stdout.splitlines() == ["running True 1"], proc.stderr
    assert proc.returncode == 75, proc.stderr  # EXIT_ABANDONED, at the deadline
    assert took < 10


def test_an_idle_pool_process_or_a_second_sigterm_ends_it_at_once():
    idle, _ = _pool_process("""
        shutdown.task_starting()
        shutdown.task_finished()
        os.kill(os.getpid(), signal.SIGTERM)   # nothing in flight to protect
        time.sleep(30)
    """)
    twice, took = _pool_process("""
        shutdown.task_starting()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)   # billiard's terminate, or an impatient operator
        time.sleep(30)
    """)
    assert idle.returncode == -signal.SIGTERM, idle.stderr
    assert twice.returncode == -signal.SIGTERM, twice.stderr
    assert took < 10


def test_herokus_sigterm_and_the_main_processs_notice_count_once():
    """A pool process leads its own group (workers/proctree.py): the main process passes a
    SIGTERM on as a notice, and on Heroku the dyno-wide SIGTERM arrives too, in either
    order. The two are one shutdown (the grace runs to its end); a second notice (the
    worker's group got SIGTERM again) is a second SIGTERM."""
    once = []
    for first, then in (("SIGTERM", "NOTICE"), ("NOTICE", "SIGTERM")):
        proc, took = _pool_process(f"""
            from workers.proctree import NOTICE
            SIGTERM = signal.SIGTERM
            shutdown.task_starting()
            os.kill(os.getpid(), {first})
            time.sleep(0.2)
            os.kill(os.getpid(), {then})
            time.sleep(0.2)
            print("running", shutdown.shutting_down(), flush=True)
            time.sleep(30)
        """)
        once.append((proc.stdout.splitlines(), proc.returncode, proc.stderr))
    assert [(out, code) for out, code, _ in once] == [(["running True"], 75)] * 2, once
    twice, took = _pool_process("""
        from workers.proctree import NOTICE
        shutdown.task_starting()
        os.kill(os.getpid(), NOTICE)
        time.sleep(0.2)
        os.kill(os.getpid(), NOTICE)
        time.sleep(30)
    """)
    assert twice.returncode == -signal.SIGTERM, twice.stderr
    assert took < 10


def test_gunicorn_grace_is_below_herokus_kill():
    web = procfile_commands()["web"]
    assert "--graceful-timeout ${POIMEN_SHUTDOWN_GRACE:-25}" in web
    from poimenconfig import DEFAULT_SHUTDOWN_GRACE, shutdown_grace

    assert DEFAULT_SHUTDOWN_GRACE == shutdown_grace({}) < HEROKU_KILL_AFTER
