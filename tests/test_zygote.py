"""The tests' zygote (``tests/zygote.py``): a worker it forks is started as ``Popen`` would
start it, and an environment its preload would have read otherwise is not served."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.process_guard import watching
from tests.processes import (
    CELERY_PROGRAM,
    ROOT,
    Process,
    Zygote,
    ZygoteChild,
    start_worker,
    wait_until,
    zygote_for,
)
from tests.zygote import serves


def test_a_server_serves_only_the_values_its_preload_read():
    recorded = {"CELERY_TRACE_APP": None, "PSYCOPG_IMPL": "c", "PYTHONPATH": "/a"}
    env = {"PSYCOPG_IMPL": "c", "PYTHONPATH": "/a", "DATABASE_URL": "anything"}
    assert serves(recorded, env)
    assert not serves(recorded, {**env, "CELERY_TRACE_APP": "1"})
    assert not serves(recorded, {**env, "PSYCOPG_IMPL": "python"})
    assert not serves(recorded, {k: v for k, v in env.items() if k != "PYTHONPATH"})
    # A preload that read the whole environment serves nothing.
    assert not serves({"*": None}, env)


@pytest.mark.processes
def test_a_worker_from_the_zygote_runs_as_popen_would_start_it(fast_env, tmp_path, processes):
    # LOG_FORMAT is read by the project, after the fork: the server started without it.
    worker = start_worker({**fast_env, "LOG_FORMAT": "json"}, tmp_path, "z")
    processes.append(worker)
    assert isinstance(worker.proc, ZygoteChild)
    # Its own session and group from the moment the start returns, as with Popen: a
    # killpg right away reaches it.
    assert os.getsid(worker.pid) == os.getpgid(worker.pid) == worker.pid
    wait_until(lambda: "ready" in worker.log(), timeout=30, what="the worker ready")
    proc = Path(f"/proc/{worker.pid}")
    assert os.readlink(proc / "cwd") == str(ROOT)
    assert os.readlink(proc / "fd/0") == os.devnull
    assert os.readlink(proc / "fd/1") == os.readlink(proc / "fd/2") == str(worker.log_path)
    # The request's environment: every line the worker logged is JSON.
    lines = [line for line in worker.log().splitlines() if line.strip()]
    assert lines and all(json.loads(line) for line in lines), lines[:5]
    worker.stop()
    assert worker.proc.returncode == 0, worker.log()[-3000:]


@pytest.mark.processes
def test_a_failing_start_ends_with_the_status_and_output_popen_gives(fast_env, tmp_path,
                                                                    monkeypatch):
    argv = [*CELERY_PROGRAM, "worker", "--no-such-option"]
    forked = Process("forked", argv, fast_env, tmp_path).start()
    assert isinstance(forked.proc, ZygoteChild)
    monkeypatch.setenv("POIMEN_TEST_ZYGOTE", "0")
    execed = Process("execed", argv, fast_env, tmp_path).start()
    assert isinstance(execed.proc, subprocess.Popen)
    assert forked.proc.wait(30) == execed.proc.wait(30) == 2
    assert "No such option '--no-such-option'" in forked.log()
    assert forked.log() == execed.log()


@pytest.mark.processes
def test_an_environment_the_preload_read_otherwise_is_started_by_popen(fast_env, tmp_path,
                                                                       processes):
    server = zygote_for(CELERY_PROGRAM, fast_env, ROOT)
    assert isinstance(server, Zygote)
    # A variable Celery's terminal colours read at import, unset where the server started.
    assert server.recorded.get("ITERM_PROFILE") is None
    other = {**fast_env, "ITERM_PROFILE": "other"}
    assert zygote_for(CELERY_PROGRAM, other, ROOT) is None
    worker = start_worker(other, tmp_path, "popen")
    processes.append(worker)
    assert isinstance(worker.proc, subprocess.Popen)
    # Another PYTHON* environment: another server.
    assert zygote_for(CELERY_PROGRAM, {**fast_env, "PYTHONHASHSEED": "7"}, ROOT) \
        not in (None, server)


@pytest.mark.processes
def test_a_start_through_the_zygote_is_seen_by_the_process_guard(fast_env, tmp_path,
                                                                  processes):
    zygote_for(CELERY_PROGRAM, fast_env, ROOT)  # the server, started before the watch
    with watching(True) as started:
        processes.append(start_worker(fast_env, tmp_path, "seen"))
    assert isinstance(processes[-1].proc, ZygoteChild)
    assert [s for s in started if "tests.celery_launch" in s], started


@pytest.mark.processes
def test_outside_the_tests_every_process_starts_by_popen():
    # The benchmarks start their processes through tests.processes, as a dyno starts them.
    out = subprocess.run([sys.executable, "-c", "import tests.processes as p; "
                          "print(p.ZYGOTE_ENABLED)"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"
