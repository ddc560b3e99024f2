"""The tests' launcher of ``celery -A workers worker|beat`` (``tests/celery_launch.py``)
offers the very options the ``celery`` program does, defaults included, so the tests start
what the Procfile starts."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.processes import BIN, CELERY_PROGRAM, ROOT


def _help(argv: list[str]) -> str:
    proc = subprocess.run([*argv, "--help"], cwd=ROOT, env=dict(os.environ),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.processes  # fresh interpreters: what each program offers
@pytest.mark.parametrize("command", ["worker", "beat"])
def test_the_launcher_offers_what_the_celery_program_offers(command):
    through_celery = _help([str(BIN / "celery"), "-A", "workers", command])
    launched = _help([*CELERY_PROGRAM, command])
    assert f"Usage: celery {command} [OPTIONS]" in launched
    assert launched == through_celery


@pytest.mark.processes
def test_the_launcher_refuses_what_it_does_not_start():
    proc = subprocess.run([*CELERY_PROGRAM, "flower"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0 and "usage: python -m tests.celery_launch" in proc.stderr
