"""Liveness locks refuse a transaction-mode pooler.

A real PgBouncer (Debian's ``pgbouncer``; installed when missing and we are
root) in ``pool_mode = transaction`` in front of the private Postgres. A
session advisory lock taken through it sits on a pooled server connection, so
a worker whose lock URL points there must refuse to start, naming
``POIMEN_LOCK_DATABASE_URL``; the direct URL is accepted.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.processes import Process, free_port, start_worker, wait_until


def _pgbouncer_binary() -> str:
    found = shutil.which("pgbouncer") or (
        "/usr/sbin/pgbouncer" if Path("/usr/sbin/pgbouncer").exists() else None)
    if found:
        return found
    if os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-q", "pgbouncer"], check=True,
                       capture_output=True, timeout=600)
        return "/usr/sbin/pgbouncer"
    pytest.fail("pgbouncer is not installed and cannot be installed (not root)")


@pytest.fixture(scope="module")
def pgbouncer(private_postgres):
    """PgBouncer in transaction mode in front of the private database; yields its URL."""
    binary = _pgbouncer_binary()
    root = Path(tempfile.mkdtemp(prefix="poimen-pgbouncer-"))
    port = free_port()
    (root / "userlist.txt").write_text('"postgres" ""\n')
    (root / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"poimen_chaos = host=127.0.0.1 port={private_postgres.port} dbname=poimen_chaos "
        "user=postgres\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = trust\nauth_file = {root}/userlist.txt\n"
        "pool_mode = transaction\ndefault_pool_size = 4\n"
        f"pidfile = {root}/pgbouncer.pid\n"
    )
    argv = [binary, str(root / "pgbouncer.ini")]
    if os.geteuid() == 0:  # pgbouncer refuses to run as root
        shutil.chown(root, user="pgserver")
        for path in root.iterdir():
            shutil.chown(path, user="pgserver")
        argv = [binary, "-u", "pgserver", str(root / "pgbouncer.ini")]
    proc = Process("pgbouncer", argv, dict(os.environ), root).start()
    url = f"postgresql://postgres@127.0.0.1:{port}/poimen_chaos"
    import psycopg

    def answering() -> bool:
        try:
            with psycopg.connect(url, connect_timeout=2) as conn:
                conn.execute("SELECT 1")
            return True
        except psycopg.OperationalError:
            return False

    wait_until(answering, timeout=30, what="pgbouncer")
    yield url
    proc.stop()
    shutil.rmtree(root, ignore_errors=True)


def test_a_lock_url_through_a_transaction_pooler_is_refused(pgbouncer):
    from workers.boots import PooledLockConnection, check_lock_database

    with pytest.raises(PooledLockConnection, match="POIMEN_LOCK_DATABASE_URL"):
        check_lock_database(pgbouncer)


def test_the_direct_url_is_accepted(private_postgres):
    from workers.boots import check_lock_database

    check_lock_database(private_postgres.url)


def test_the_session_check_tells_the_pooler_from_the_direct_url(pgbouncer, private_postgres):
    """What web's POIMEN_DB_PREPARE_THRESHOLD=auto decides on (app/extensions.py)."""
    from app.extensions import keeps_own_session

    assert keeps_own_session(private_postgres.url)
    assert not keeps_own_session(pgbouncer)


def test_web_prepares_statements_only_where_database_url_is_direct(
        pgbouncer, private_postgres, chaos_env, tmp_path):
    """auto: a web whose DATABASE_URL is direct (and the lock database) prepares statements;
    behind the pooler, even with no POIMEN_LOCK_DATABASE_URL to say so, it prepares none."""
    from tests.processes import start_web

    env = {name: value for name, value in chaos_env.items()
           if name not in ("POIMEN_DB_PREPARE_THRESHOLD", "POIMEN_LOCK_DATABASE_URL")}
    for name, database, expected in (("direct", private_postgres.url, "prepared statements on"),
                                     ("pooled", pgbouncer, "prepared statements off")):
        web, _ = start_web({**env, "DATABASE_URL": database, "METRICS_PORT": str(free_port())},
                           tmp_path, workers=1, threads=2, name=f"web-{name}")
        try:
            wait_until(lambda: expected in web.log(), timeout=30, what=expected)  # noqa: B023
            assert "prepared statements on" not in web.log() or expected.endswith(" on")
        finally:
            web.stop()


def test_a_worker_behind_the_pooler_refuses_to_start_naming_the_setting(
        pgbouncer, chaos_env, tmp_path):
    env = {**chaos_env, "POIMEN_LOCK_DATABASE_URL": pgbouncer}
    worker = start_worker(env, tmp_path, "pooled")
    try:
        try:
            wait_until(lambda: not worker.alive(), timeout=60,
                       what="the worker to refuse to start")
        except AssertionError:
            raise AssertionError(worker.log()[-3000:]) from None
        assert worker.proc.returncode != 0
        assert "POIMEN_LOCK_DATABASE_URL" in worker.log()
    finally:
        worker.stop()


def test_web_and_workers_behind_the_pooler_admit_and_run_every_run_without_an_error(
        pgbouncer, private_postgres, chaos_env, chaos_tenant, chaos_redis, processes, tmp_path):
    """Heroku's connection pooling: web's and the workers' DATABASE_URL through PgBouncer in
    transaction mode, the lock URL direct. 2,000 POSTs over 16 threads, a third of them
    replaying an earlier key: every answer 2xx, every run executed and succeeded (with
    psycopg's prepared statements on, they run on the wrong server connection: hundreds of
    500 and 503 answers)."""
    import collections
    import time
    from concurrent.futures import ThreadPoolExecutor

    import requests

    from tests.processes import start_beat, start_web

    env = {**chaos_env, "DATABASE_URL": pgbouncer,
           "POIMEN_LOCK_DATABASE_URL": private_postgres.url}
    env.pop("POIMEN_DB_PREPARE_THRESHOLD", None)
    web, url = start_web({**env, "METRICS_PORT": str(free_port())}, tmp_path, workers=2,
                         threads=8)
    processes.append(web)
    for n in range(2):
        processes.append(start_worker({**env, "METRICS_PORT": str(free_port())}, tmp_path,
                                      f"pooled-{n}", concurrency=2))
    processes.append(start_beat({**env, "METRICS_PORT": str(free_port())}, tmp_path))

    total = 2000
    # Request i uses key i, except every third, which replays the key (and body) of i - 1.
    keys = [f"pool-{i - 1 if i % 3 == 2 else i}" for i in range(total)]
    session = requests.Session()
    session.headers.update(chaos_tenant.headers)

    def post(key: str) -> int:
        return session.post(f"{url}/v1/runs", json={
            "workflow_ref": "echo", "input": {"key": key}, "dispatch_key": key},
            timeout=30).status_code

    with ThreadPoolExecutor(16) as pool:
        statuses = collections.Counter(pool.map(post, keys))
    unique = len(set(keys))
    print(f"\npooled admissions: {dict(statuses)}")
    assert set(statuses) <= {200, 201}, statuses
    assert statuses[201] == unique and statuses[200] == total - unique

    def all_done() -> bool:
        with private_postgres.connect() as conn:
            return dict(conn.execute("SELECT status, count(*) FROM runs GROUP BY 1").fetchall())

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        counts = all_done()
        if counts == {"succeeded": unique}:
            break
        time.sleep(1)
    assert all_done() == {"succeeded": unique}
    for proc in processes[1:3]:
        # auto: a worker with a separate lock URL prepares nothing on the pooled one
        assert "prepared statements off" in proc.log()
        assert 'prepared statement "' not in proc.log()  # "_pg3_N" does not exist / exists
