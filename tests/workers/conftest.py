"""Fixtures for worker tests: boots, runs and a side-effect table."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid

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


@pytest.fixture
def dead_boot(dsn):
    """A boot registered by a separate process that was then killed with SIGKILL."""

    def make() -> uuid.UUID:
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
        return uuid.UUID(proc.stdout.strip())

    return make
