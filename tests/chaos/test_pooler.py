"""Verify 4 of the fault issue: liveness locks refuse a transaction-mode pooler.

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
