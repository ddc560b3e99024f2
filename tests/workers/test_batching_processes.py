"""The batching worker (``POIMEN_WORKER_MODE=batch``) as real processes under faults.

A batch worker (Celery's threads pool, eight threads) and beat execute 150 runs while the
worker is SIGKILLed three times mid-batch and started again, then a second one joins:
every run ends once, none is lost, and no run is executed by two bodies at once. A batch
worker refuses to start while a workflow sets a time limit; ``revoke --terminate`` cancels
a run at its next checkpoint; SIGTERM lets runs finish within the grace and leaves the
rest to repair. The Postgres restart under a batch worker is
``tests/chaos/test_postgres_restart.py`` (both modes); the rules themselves,
deterministically, are ``test_batching.py``.
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.processes import start_beat, start_worker, wait_until

pytestmark = pytest.mark.processes

RUNS = 150
KILLS = 3


@pytest.fixture
def log_dir(tmp_path):
    path = tmp_path / "logs"
    path.mkdir()
    return path


def batch_env(fast_env, **more):
    return {**fast_env, "POIMEN_WORKER_MODE": "batch", **more}


def test_kill_9_of_a_batch_worker_mid_batch_loses_and_repeats_no_run(
        admit, side_effects, fast_env, pg, log_dir, processes):
    env = batch_env(fast_env)
    run_ids = [admit("blind", {"seconds": 0.5}) for _ in range(RUNS)]
    # The victim consumes alone while it is killed, so each of its lives takes runs (a
    # second worker beside it could have reserved the whole queue first).
    victim = start_worker(env, log_dir, "victim", concurrency=8)
    processes.extend([victim, start_beat(env, log_dir)])
    killed_pids: set[int] = set()
    for kill in range(KILLS):
        # Mid-batch: bodies of the victim's runs are executing (started, not finished).
        pid = victim.pid
        wait_until(lambda pid=pid: pg.execute(
            "SELECT count(*) FROM side_effects s WHERE s.kind = 'start' AND s.pid = %s "
            "AND NOT EXISTS (SELECT 1 FROM side_effects f WHERE f.run_id = s.run_id "
            "AND f.kind = 'finish')", [pid]).fetchone()[0] >= 2,
            timeout=60, interval=0.02, what="the victim to execute runs")
        killed_pids.add(pid)
        victim.kill()
        victim = start_worker(env, log_dir, f"victim{kill + 1}", concurrency=8)
        processes.append(victim)
    other = start_worker(env, log_dir, "other", concurrency=8)
    processes.append(other)

    def settled() -> bool:
        return pg.execute("SELECT count(*) FROM runs WHERE status <> 'succeeded'"
                          ).fetchone()[0] == 0

    wait_until(settled, timeout=180, interval=0.5, what="every run to succeed")
    ended = dict(pg.execute("SELECT run_id, count(*) FROM outbox WHERE event_type = "
                            "'run.succeeded' GROUP BY run_id").fetchall())
    assert sorted(ended) == sorted(run_ids) and set(ended.values()) == {1}
    # No two executions of one run at once: every body that started and did not run last
    # belongs to a worker that was killed; each run finished once past its takeovers.
    resumed = 0
    for run_id in run_ids:
        starts = [r[0] for r in pg.execute(
            "SELECT pid FROM side_effects WHERE run_id = %s AND kind = 'start' ORDER BY id",
            [run_id])]
        assert starts, run_id
        assert set(starts[:-1]) <= killed_pids, (run_id, starts)
        resumed += len(starts) > 1
    assert resumed >= 1, "no run was executing when its worker was killed: proved nothing"
    logs = victim.log() + other.log()
    assert "batch mode" in logs
    # The survivor's batches were all answered: no claim of unknown outcome, no boot ended.
    assert "claim outcome unknown" not in other.log()


def test_a_batch_worker_refuses_a_workflow_with_a_time_limit(fast_env, log_dir, processes):
    env = batch_env(fast_env,
                    POIMEN_WORKFLOW_MODULES="tests.workflows,tests.workflows.celery_tasks")
    worker = start_worker(env, log_dir, "refused", concurrency=2)
    processes.append(worker)
    wait_until(lambda: not worker.alive(), timeout=60, what="the worker to refuse to start")
    log = worker.log()
    assert "refuses to start" in log and "over-time@1" in log and "POIMEN_WORKER_MODE" in log


def run_events(pg, run_id) -> list[str]:
    return [r[0] for r in pg.execute(
        "SELECT event_type FROM outbox WHERE run_id = %s ORDER BY id", [run_id])]


def run_status(pg, run_id) -> str:
    return pg.execute("SELECT status FROM runs WHERE id = %s", [run_id]).fetchone()[0]


def test_terminate_in_a_batch_worker_cancels_the_run_at_its_next_checkpoint(
        admit, fast_env, pg, log_dir, processes):
    """A thread cannot be killed alone: ``revoke --terminate`` cancels the run, which stops
    at its next checkpoint; the worker lives on, and a later run is not hurt."""
    from tests.workers.test_celery_native import celery_cli

    env = batch_env(fast_env)
    worker = start_worker(env, log_dir, "termb", concurrency=4)
    processes.append(worker)
    run_id = admit("sleep", {"seconds": 60})  # checks ctx.cancelled every 0.1 s
    wait_until(lambda: run_status(pg, run_id) == "running", timeout=60, what="the run to start")
    out = celery_cli(env, "control", "--timeout", "10", "terminate", "SIGTERM", str(run_id))
    assert "termb@" in out.stdout, out.stdout
    wait_until(lambda: run_status(pg, run_id) == "cancelled", timeout=30,
               what="the run to be cancelled")
    assert "cancels the run; it stops at its next checkpoint" in worker.log()
    events = run_events(pg, run_id)
    assert events.count("run.started") == 1 and events[-1] == "run.cancelled", events
    after = admit("echo", {})
    wait_until(lambda: run_status(pg, after) == "succeeded", timeout=60, what="a later run")
    assert worker.alive()


def test_sigterm_to_a_batch_worker_lets_short_runs_finish_and_leaves_the_rest_after_the_grace(
        admit, side_effects, fast_env, pg, log_dir, processes):
    """Celery's warm shutdown waits for the threads' runs; ``POIMEN_SHUTDOWN_GRACE`` bounds
    the wait: a run that ends within it succeeds there, one that does not is left to repair
    when the process exits, and another worker takes it over and ends it once."""
    env = batch_env(fast_env, POIMEN_SHUTDOWN_GRACE="3")
    worker = start_worker(env, log_dir, "graceb", concurrency=4)
    processes.append(worker)
    short, long = admit("blind", {"seconds": 1.5}), admit("blind", {"seconds": 10})
    wait_until(lambda: side_effects(short, "start") == 1 and side_effects(long, "start") == 1,
               timeout=60, what="both runs to start")
    sent = time.monotonic()
    worker.signal_group(signal.SIGTERM)
    wait_until(lambda: not worker.alive(), timeout=20, what="the worker to exit")
    exited = time.monotonic() - sent
    assert exited < 3 + 5, f"exited {exited:.1f}s after SIGTERM (grace 3 s)"
    assert worker.proc.returncode == 75, worker.log()[-2000:]  # EXIT_ABANDONED
    assert run_status(pg, short) == "succeeded"
    assert run_status(pg, long) == "running"  # its body died with the process
    processes.extend([start_worker(env, log_dir, "rescuer", concurrency=2),
                      start_beat(env, log_dir)])
    wait_until(lambda: run_status(pg, long) == "succeeded", timeout=90,
               what="the long run to be taken over and succeed")
    assert run_events(pg, long).count("run.succeeded") == 1
    assert side_effects(long, "start") == 2 and side_effects(long, "finish") == 1
