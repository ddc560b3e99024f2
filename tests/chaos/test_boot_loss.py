"""Chaos on the shared Postgres: a worker's lock cut server-side, workers that keep dying,
a cancelled run whose worker is killed. Real Celery workers, real Postgres and Redis."""

from __future__ import annotations

from pathlib import Path

from app.state.executor import on_session
from lease import KILL_SECONDS
from tests.processes import start_beat, start_worker, wait_until

FAST_PROBE = {"POIMEN_BOOT_PROBE_INTERVAL": "0.3"}


def run_row(pg, run_id):
    return pg.execute("SELECT status, attempt, takeovers, error, claimed_by FROM runs "
                      "WHERE id = %s", [run_id]).fetchone()


def events_of(pg, run_id) -> list[str]:
    return [r[0] for r in pg.execute(
        "SELECT event_type FROM outbox WHERE run_id = %s ORDER BY id", [run_id])]


def lock_backend_of(pg, run_id) -> int | None:
    """The backend pid holding the liveness lock of the boot that holds ``run_id``."""
    from app.liveness import LOCK_NAMESPACE

    row = pg.execute(
        "SELECT l.pid FROM runs r JOIN worker_boots b ON b.boot_id = r.claimed_by "
        "JOIN pg_locks l ON l.locktype = 'advisory' AND l.classid = CAST(%s AS oid) "
        "AND l.objid = CAST(b.lock_key AS oid) AND l.objsubid = 2 AND l.granted "
        "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
        "WHERE r.id = %s", [LOCK_NAMESPACE, run_id]).fetchone()
    return row[0] if row else None


def test_a_lock_cut_mid_run_is_adopted_and_the_run_runs_once(admit, side_effects, test_env, pg,
                                                             tmp_path, processes):
    """pg_terminate_backend of the running boot's lock connection: the process notices,
    moves its claim to a new boot, finishes; one start, one finish, attempt 1."""
    env = {**test_env, **FAST_PROBE}
    run_id = admit("blind", {"seconds": 3})
    processes.append(start_worker(env, tmp_path, "victim"))
    wait_until(lambda: side_effects(run_id, "start") == 1, timeout=60, what="the run to start")
    backend = lock_backend_of(pg, run_id)
    assert backend is not None
    pg.execute("SELECT pg_terminate_backend(%s)", [backend])

    wait_until(lambda: run_row(pg, run_id)[0] == "succeeded", timeout=60,
               what="the run to succeed")
    assert side_effects(run_id, "start") == 1
    assert side_effects(run_id, "finish") == 1
    assert run_row(pg, run_id)[1] == 1  # attempt: never restarted
    assert events_of(pg, run_id) == ["run.admitted", "run.started", "run.adopted",
                                     "run.succeeded"]


def test_a_lock_cut_with_a_rescuer_racing_still_finishes_once(admit, side_effects, test_env, pg,
                                                              tmp_path, processes):
    """Same cut, but beat re-sends every second and a second worker is waiting: whoever wins
    the compare-and-set runs it; the run is finished by exactly one process."""
    env = {**test_env, **FAST_PROBE, "POIMEN_REPAIR_INTERVAL": "1",
           "POIMEN_REPAIR_MIN_AGE": "30"}
    run_id = admit("blind", {"seconds": 3})
    processes.append(start_worker(env, tmp_path, "victim"))
    wait_until(lambda: side_effects(run_id, "start") == 1, timeout=60, what="the run to start")
    processes.append(start_worker(env, tmp_path, "rescuer"))
    processes.append(start_beat(env, tmp_path))
    pg.execute("SELECT pg_terminate_backend(%s)", [lock_backend_of(pg, run_id)])

    wait_until(lambda: run_row(pg, run_id)[0] == "succeeded", timeout=90,
               what="the run to succeed")
    assert side_effects(run_id, "finish") == 1
    events = events_of(pg, run_id)
    assert events.count("run.succeeded") == 1
    # Either the process kept it (adopted, one start) or a rescuer took it over and the
    # cut-off process stopped (two starts, never two finishes).
    if "run.adopted" in events:
        assert side_effects(run_id, "start") == 1
    else:
        assert "run.resumed" in events and side_effects(run_id, "start") == 2


def test_a_run_that_kills_its_worker_ends_poisoned_after_the_settings_max_takeovers(
        admit, side_effects, test_env, pg, tmp_path, processes):
    # The setting, not the workflow (``crash`` sets no max_takeovers; ``poison`` in
    # tests/workers/test_poison_processes.py does): the first execution, one takeover, then
    # poisoned.
    env = {**test_env, **FAST_PROBE, "POIMEN_REPAIR_INTERVAL": "1", "POIMEN_REPAIR_MIN_AGE": "30",
           "POIMEN_MAX_TAKEOVERS": "1"}
    run_id = admit("crash", {})
    processes.append(start_worker(env, tmp_path))
    processes.append(start_beat(env, tmp_path))
    wait_until(lambda: run_row(pg, run_id)[0] == "poisoned", timeout=180,
               what="the run to end poisoned")
    status, attempt, takeovers, error, _ = run_row(pg, run_id)
    assert error["code"] == "poisoned"
    assert (attempt, takeovers) == (2, 1)  # the first execution and one takeover
    assert side_effects(run_id, "start") == 2
    assert error["message"].startswith("the run killed 2 workers (max_takeovers 1)")
    events = events_of(pg, run_id)
    assert events[-1] == "run.poisoned" and events.count("run.resumed") == 1
    assert events.count("run.poisoned") == 1 and "run.failed" not in events


def test_a_cancelled_run_whose_worker_dies_ends_cancelled(app, admit, side_effects, test_env,
                                                          pg, tmp_path, processes):
    """Cancel while running (the workflow has no checkpoint), then kill -9 the worker:
    the takeover ends the run cancelled instead of executing it again."""
    from app.extensions import db
    from app.state.runs import cancel_run

    env = {**test_env, **FAST_PROBE, "POIMEN_REPAIR_INTERVAL": "1", "POIMEN_REPAIR_MIN_AGE": "30"}
    run_id = admit("blind", {"seconds": 30})
    victim = start_worker(env, tmp_path, "victim")
    processes.append(victim)
    wait_until(lambda: side_effects(run_id, "start") == 1, timeout=60, what="the run to start")
    tenant_id = pg.execute("SELECT tenant_id FROM runs WHERE id = %s", [run_id]).fetchone()[0]
    with app.app_context():
        assert cancel_run(on_session(db.session), tenant_id, run_id) is not None
        db.session.commit()
    victim.kill()

    processes.append(start_worker(env, tmp_path, "rescuer"))
    processes.append(start_beat(env, tmp_path))
    wait_until(lambda: run_row(pg, run_id)[0] == "cancelled", timeout=60,
               what="the run to end cancelled")
    assert side_effects(run_id, "start") == 1  # never executed again
    assert events_of(pg, run_id)[-1] == "run.cancelled"


def test_killing_only_the_pool_child_hands_its_run_to_another_child(admit, side_effects,
                                                                    test_env, pg, tmp_path,
                                                                    processes):
    """Boots are per pool process: kill -9 the child running a run (the worker's main
    process lives on) and the run is resumed by a child, not left to a live-looking boot."""
    import os
    import signal

    env = {**test_env, **FAST_PROBE}
    run_id = admit("blind", {"seconds": 2})
    worker = start_worker(env, tmp_path, "pool", concurrency=2)
    processes.append(worker)
    wait_until(lambda: side_effects(run_id, "start") == 1, timeout=60, what="the run to start")
    child = pg.execute("SELECT pid FROM side_effects WHERE run_id = %s AND kind = 'start'",
                       [run_id]).fetchone()[0]
    assert child != worker.pid
    os.kill(child, signal.SIGKILL)

    wait_until(lambda: run_row(pg, run_id)[0] == "succeeded", timeout=90,
               what="the run to be resumed and succeed")
    assert worker.alive()
    assert run_row(pg, run_id)[1:3] == (2, 1)  # attempt 2, one takeover
    assert side_effects(run_id, "finish") == 1
    finisher = pg.execute("SELECT pid FROM side_effects WHERE run_id = %s AND kind = 'finish'",
                          [run_id]).fetchone()[0]
    assert finisher != child


def test_a_forked_grandchild_does_not_keep_a_dead_workers_boot_alive(admit, side_effects,
                                                                     test_env, pg, tmp_path,
                                                                     processes):
    """The workflow forks a grandchild that detaches (``setsid``: it leaves the pool
    process's group, so it outlives it) and sleeps on; kill -9 the worker process: its lock
    must go with it (the grandchild holds no copy of the lock socket), so the run is
    taken over."""
    import os
    import signal

    from tests.chaos.test_process_tree import alive

    # The lease's server bound would end the orphaned lock session after T_s anyway:
    # set it far beyond the wait, so only the lock going with the process can pass.
    env = {**test_env, **FAST_PROBE, "POIMEN_REPAIR_INTERVAL": "1", "POIMEN_REPAIR_MIN_AGE": "30",
           "POIMEN_LEASE_SERVER_SECONDS": "600"}
    run_id = admit("forker", {"seconds": 2, "grandchild_seconds": 300, "detach": True})
    victim = start_worker(env, tmp_path, "victim")
    processes.append(victim)
    grandchildren: list[int] = []
    try:
        wait_until(lambda: side_effects(run_id, "start") == 1, timeout=60,
                   what="the run to start")
        child = pool_process_of(pg, run_id)
        grandchildren += forked_children(child)
        os.kill(child, signal.SIGKILL)  # the pool process; its detached grandchild lives on
        processes.append(start_worker(env, tmp_path, "rescuer"))
        processes.append(start_beat(env, tmp_path))
        # Well before the grandchild ends (300 s): only the lock going with the worker
        # process lets the run be taken over this soon.
        wait_until(lambda: run_row(pg, run_id)[0] == "succeeded", timeout=45,
                   what="the run to be taken over despite the grandchild")
        assert run_row(pg, run_id)[1] == 2
        assert [pid for pid in grandchildren if alive(pid)] == grandchildren  # it did live on
    finally:
        victim.signal_group(signal.SIGKILL)
        # The takeover's own detached grandchild too: it holds a copy of the rescuer's
        # broker socket, and a dead worker's blocking pop left open on it would take the
        # next test's message from the session's queue.
        result = pg.execute("SELECT result FROM runs WHERE id = %s", [run_id]).fetchone()
        if result and result[0] and result[0].get("grandchild"):
            grandchildren.append(int(result[0]["grandchild"]))
        for pid in grandchildren:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_forked_grandchild_dies_with_its_pool_process(admit, side_effects, test_env, pg,
                                                        tmp_path, processes):
    """The same grandchild, not detached: it is in the pool process's process group, which
    the guardian ends when the pool process dies (workers/proctree.py), within the lease's
    kill bound, so it never runs beside a takeover. It runs our Python (no exec): it must
    not keep the guardian's pipe open, or the guardian would wait for it."""
    import os
    import signal

    from tests.chaos.test_process_tree import alive

    env = {**test_env, **FAST_PROBE}
    run_id = admit("forker", {"seconds": 2, "grandchild_seconds": 300})
    processes.append(start_worker(env, tmp_path, "victim"))
    grandchildren: list[int] = []
    try:
        wait_until(lambda: side_effects(run_id, "start") == 1, timeout=60,
                   what="the run to start")
        child = pool_process_of(pg, run_id)
        grandchildren += forked_children(child)
        assert len(grandchildren) == 1
        os.kill(child, signal.SIGKILL)  # the pool process
        wait_until(lambda: not alive(grandchildren[0]), timeout=KILL_SECONDS, interval=0.02,
                   what="the grandchild to die with the pool process")
    finally:
        for pid in grandchildren:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def pool_process_of(pg, run_id) -> int:
    return pg.execute("SELECT pid FROM side_effects WHERE run_id = %s AND kind = 'start'",
                      [run_id]).fetchone()[0]


def forked_children(pid: int) -> list[int]:
    """The children of pool process ``pid`` but its guardian."""
    return [child for child in children_of(pid)
            if b"poimen-guardian" not in Path(f"/proc/{child}/cmdline").read_bytes()]


def children_of(pid: int) -> list[int]:
    """The children of ``pid`` (Linux: /proc/<pid>/task/<tid>/children)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found
