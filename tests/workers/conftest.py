"""Fixtures for worker tests: boots, runs and a side-effect table."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
import uuid

import psycopg
import pytest

from tests.conftest import libpq_url


@pytest.fixture
def dsn(database_url) -> str:
    return libpq_url(database_url)


@pytest.fixture
def boot_factory(dsn):
    """Register live boots in this process, each on its own lock connection."""
    from workers.boots import Boot

    boots = []

    def make() -> Boot:
        boot = Boot.register(dsn)
        boots.append(boot)
        return boot

    yield make
    for boot in boots:
        boot.close()


@pytest.fixture
def fresh_boot():
    """execute_run in this process registers a boot; end it so each test starts clean."""
    from workers.boots import end_current_boot

    end_current_boot()
    yield
    end_current_boot()


def wait_backend_gone(pg, pid: int) -> None:
    """Return once the backend ``pid`` has exited: the server releases its locks then."""
    import time

    deadline = time.monotonic() + 10
    while pg.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s",
                     [pid]).fetchone()[0]:
        assert time.monotonic() < deadline, "the backend did not go away"
        time.sleep(0.02)


def close_for_good(pg, boot) -> None:
    """End ``boot``'s lock connection and return once its backend has exited, a moment
    after the client closed."""
    boot.close()
    wait_backend_gone(pg, boot.backend_pid)


def long_gone(conn, *boot_ids) -> None:
    """Stamp ``boot_ids`` (their locks free) first seen dead an hour ago: past every bound,
    so their runs and slots are free (``app/liveness.py``), as if beat's repair had seen
    them go long before. ``conn``: a psycopg connection in autocommit."""
    conn.execute("UPDATE worker_boots SET first_seen_dead_at = now() - interval '1 hour' "
                 "WHERE boot_id = ANY(%s)", [list(boot_ids)])


def lock_free(conn, boot_id, timeout: float = 10.0) -> None:
    """Return once ``boot_id``'s lock is free (its process was killed: its backend ends)."""
    from app.liveness import LIVE_BOOTS_SQL

    deadline = time.monotonic() + timeout
    while conn.execute(f"SELECT %s IN ({LIVE_BOOTS_SQL})", [boot_id]).fetchone()[0]:
        assert time.monotonic() < deadline, f"boot {boot_id}'s lock still held"
        time.sleep(0.02)


def dead_boots_long_gone(conn) -> None:
    """``long_gone`` for every boot whose lock is free now."""
    from app.liveness import LIVE_BOOTS_SQL

    conn.execute("UPDATE worker_boots SET first_seen_dead_at = now() - interval '1 hour' "
                 f"WHERE boot_id NOT IN ({LIVE_BOOTS_SQL})")


@pytest.fixture
def dead_boot(dsn):
    """A boot registered by a separate process that was then killed with SIGKILL, long ago
    (``long_gone``); ``gone=False``: a moment ago, its lock free but never seen so yet."""

    def make(gone: bool = True) -> uuid.UUID:
        code = textwrap.dedent(f"""
            import os, signal, sys
            from workers.boots import Boot
            boot = Boot.register({dsn!r})
            print(boot.boot_id, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        """)
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == -9, proc.stderr
        boot_id = uuid.UUID(proc.stdout.strip())
        with psycopg.connect(dsn, autocommit=True) as conn:
            # The process is gone; its backend lets the lock go once it sees the socket
            # close, a moment later on a loaded machine: the boot is dead from then on.
            lock_free(conn, boot_id)
            if gone:
                long_gone(conn, boot_id)
        return boot_id

    return make


@pytest.fixture
def queue(app, redis_client, queue_name):
    """The Celery queue of the test session, emptied; ``queue()`` lists the run ids waiting
    in it, oldest first."""
    from app.enqueue import sender

    # What the fixtures before it committed is published by the sender thread: let it
    # finish first, so none of it lands after the queue was emptied.
    assert sender(app.extensions["celery"]).wait_idle(30)
    redis_client.delete(queue_name)

    def messages() -> list[str]:
        # Committed runs are published by this process's sender thread: let it finish.
        assert sender(app.extensions["celery"]).wait_idle(30)
        return [json.loads(raw)["headers"]["id"]
                for raw in redis_client.lrange(queue_name, 0, -1)][::-1]  # oldest first

    yield messages
    redis_client.delete(queue_name)
