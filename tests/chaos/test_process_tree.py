"""The fence ends a body's whole process tree, not the pool process alone.

The ``spawner`` workflow starts a shell loop as a child (it writes
``<unix time> <its pid>`` to a file every 0.2 s and ignores SIGTERM, as a child
finishing its own work would) and then blocks. Whatever stops the pool
process must stop the loop too, within the lease's kill bound
(``lease.KILL_SECONDS``): a loop that writes on is a body still running, and a
rescuer starting the run again makes two. Real Celery workers, real Postgres
and Redis; the kernel fence through a proxy that stops forwarding.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from lease import KILL_SECONDS
from tests.conftest import libpq_url
from tests.processes import start_procfile_process, start_worker, wait_until
from tests.proxy import StallingProxy

pytestmark = pytest.mark.slow


def writes(path: Path) -> list[tuple[float, int]]:
    """The loop's lines so far: (unix time, writer's pid)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2:
            rows.append((float(parts[0]), int(parts[1])))
    return rows


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def pool_process(pg, run_id) -> int:
    return pg.execute("SELECT pid FROM side_effects WHERE run_id = %s AND kind = 'start' "
                      "ORDER BY id LIMIT 1", [run_id]).fetchone()[0]


def wait_for_death(pid: int, timeout: float, what: str) -> float:
    """Wait until ``pid`` is gone; return when it was seen gone (unix time)."""
    wait_until(lambda: not alive(pid), timeout=timeout, interval=0.02, what=what)
    return time.time()


def end_loops(path: Path) -> None:
    """After the test, whatever happened: no loop may outlive it (they ignore SIGTERM)."""
    for pid in {pid for _, pid in writes(path)}:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def assert_gone_with(path: Path, loop: int, died_at: float, how: str) -> None:
    """The loop wrote nothing later than the kill bound after its pool process died."""
    time.sleep(2)  # 10 of its periods: a loop still running shows
    last = max(t for t, pid in writes(path) if pid == loop)
    assert not alive(loop), f"the body's shell loop {loop} outlived {how}"
    assert last <= died_at + KILL_SECONDS, \
        f"the loop wrote {last - died_at:.2f}s after {how}"


def test_kill_9_of_the_pool_process_ends_the_bodys_children_one_writer_at_a_time(
        admit, side_effects, fast_env, pg, tmp_path, processes):
    """kill -9 of the pool process running the body: its loop goes with it, and after the
    takeover (another pool process resumes the run) at most one loop writes at any time."""
    path = tmp_path / "writes"
    run_id = admit("spawner", {"path": str(path), "seconds": 300})
    worker = start_worker(fast_env, tmp_path, "pool", concurrency=2)
    processes.append(worker)
    try:
        wait_until(lambda: len(writes(path)) >= 3, timeout=60, what="the body's loop to write")
        [first] = {pid for _, pid in writes(path)}
        victim = pool_process(pg, run_id)
        os.kill(victim, signal.SIGKILL)
        died_at = wait_for_death(victim, 5, "the pool process to die")

        wait_until(lambda: any(pid != first for _, pid in writes(path)), timeout=90,
                   what="the run to be taken over and its body to start a loop")
        assert_gone_with(path, first, died_at, "kill -9 of its pool process")
        rows = writes(path)
        assert {pid for _, pid in rows} - {first} and len({pid for _, pid in rows}) == 2
        second_start = min(t for t, pid in rows if pid != first)
        assert max(t for t, pid in rows if pid == first) < second_start, \
            "two loops wrote at once: the old body overlapped the takeover"
        assert pg.execute("SELECT takeovers FROM runs WHERE id = %s", [run_id]).fetchone()[0] \
            == 1
    finally:
        end_loops(path)


def test_the_kernel_fence_ends_the_bodys_children(admit, side_effects, fast_env, pg,
                                                  database_url, tmp_path, processes):
    """The worker's path to Postgres stops forwarding with its sockets open: the kernel
    timer SIGKILLs the pool process T_c after its last confirmed probe, and the body's loop
    goes with it."""
    proxy = StallingProxy.to_postgres(libpq_url(database_url))
    path = tmp_path / "writes"
    try:
        env = {**fast_env, "DATABASE_URL": proxy.url(libpq_url(database_url)),
               "POIMEN_LEASE_CLIENT_SECONDS": "3", "POIMEN_BOOT_PROBE_INTERVAL": "0.5"}
        env.pop("POIMEN_LOCK_DATABASE_URL", None)  # the lock's path goes through the proxy
        run_id = admit("spawner", {"path": str(path), "seconds": 300})
        processes.append(start_worker(env, tmp_path, "victim"))
        wait_until(lambda: len(writes(path)) >= 3, timeout=60, what="the body's loop to write")
        [loop] = {pid for _, pid in writes(path)}
        victim = pool_process(pg, run_id)
        proxy.stall()
        stalled = time.time()
        died_at = wait_for_death(victim, 3 + KILL_SECONDS + 10,
                                 "the kernel fence to kill the pool process")
        print(f"\nkernel fence: pool process killed {died_at - stalled:.1f}s after the stall")
        assert died_at - stalled <= 3 + KILL_SECONDS + 1  # T_c, the kill, our polling
        assert_gone_with(path, loop, died_at, "the kernel fence")
    finally:
        end_loops(path)
        proxy.close()


def test_sigterm_past_the_grace_ends_the_bodys_children(admit, side_effects, fast_env, pg,
                                                        tmp_path, processes):
    """SIGTERM to the Procfile worker's whole group (as Heroku, as Ctrl-C's runner): the
    body outlives the grace (POIMEN_SHUTDOWN_GRACE, 5 s here), its pool process gives it up
    and exits, the worker exits, and the loop (deaf to SIGTERM) goes with the pool process."""
    path = tmp_path / "writes"
    run_id = admit("spawner", {"path": str(path), "seconds": 300})
    worker = start_procfile_process("worker", fast_env, tmp_path)
    processes.append(worker)
    try:
        wait_until(lambda: len(writes(path)) >= 3, timeout=90, what="the body's loop to write")
        [loop] = {pid for _, pid in writes(path)}
        victim = pool_process(pg, run_id)
        t0 = time.time()
        os.killpg(worker.pid, signal.SIGTERM)
        died_at = wait_for_death(victim, 5 + 15, "the pool process to give up the run")
        worker.proc.wait(15)
        print(f"\nSIGTERM: pool process exited {died_at - t0:.1f}s after SIGTERM, the worker "
              f"with status {worker.proc.returncode}")
        assert died_at - t0 >= 5 - 0.5, "the run was not given the grace"
        assert "exits after the 5s shutdown grace" in worker.log(), worker.log()[-3000:]
        assert_gone_with(path, loop, died_at, "the SIGTERM grace")
    finally:
        end_loops(path)
