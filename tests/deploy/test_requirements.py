"""What Heroku's Python buildpack builds from.

The buildpack reads ``.python-version`` and runs ``pip install -r
requirements.txt`` in a checkout. The slow test does the same in a fresh venv
over a copy of the tracked files, then uses the result the way the Procfile
does, from the checkout's root, against the session's real Postgres and Redis.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import venv

import pytest

from tests.processes import ROOT

PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==([^\s;#]+)")


def python_version() -> tuple[int, ...]:
    return tuple(int(part) for part in (ROOT / ".python-version").read_text().strip().split("."))


def test_the_tests_run_on_the_python_version_heroku_builds_with():
    wanted = python_version()
    assert sys.version_info[:len(wanted)] == wanted, (
        f".python-version says {wanted}, the tests run on {sys.version_info[:3]}")


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins() -> dict[str, str]:
    found = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        match = PIN.match(line.strip())
        if match:
            found[_normal(match.group(1))] = match.group(2)
    return found


@pytest.mark.slow
def test_a_fresh_venv_installs_a_working_project_from_requirements_txt(test_env, tmp_path):
    # A copy of the working tree's files, as a checkout has them (the build writes
    # build/ and *.egg-info, which must not land in the shared working tree).
    tracked = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True,
                             check=True).stdout.decode().split("\0")
    checkout = tmp_path / "checkout"
    for name in filter(None, tracked):
        source = ROOT / name
        if source.is_file():
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, checkout / name)
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    bin_dir = env_dir / "bin"
    env = {k: v for k, v in test_env.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"

    def run(*argv: str, timeout: float = 120) -> str:
        proc = subprocess.run(argv, cwd=checkout, env=env, capture_output=True, text=True,
                              timeout=timeout)
        assert proc.returncode == 0, f"{' '.join(argv)}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        return proc.stdout

    run(str(bin_dir / "pip"), "install", "--quiet", "-r", "requirements.txt", timeout=900)
    run(str(bin_dir / "pip"), "check")
    # Every installed distribution is pinned, at the pinned version: nothing floats.
    installed = {}
    for line in run(str(bin_dir / "pip"), "freeze", "--exclude", "poimen",
                    "--exclude", "poimen-client").splitlines():
        match = PIN.match(line)
        if match:
            installed[_normal(match.group(1))] = match.group(2)
    assert installed == pins(), {
        "unpinned or different": {k: v for k, v in installed.items() if pins().get(k) != v},
        "pinned, not installed": sorted(set(pins()) - set(installed))}

    # The installed project works as the Procfile's processes use it.
    python = str(bin_dir / "python")
    run(python, "-c", "import app, workers, bridge.inbox, bridge.outbox, bridge.dlq, "
                      "celeryconfig; from app import create_app; create_app()")
    assert "(head)" in run(str(bin_dir / "flask"), "--app", "app", "db", "current")
    assert "broker_url" in run(str(bin_dir / "celery"), "-A", "workers", "report")
    assert "replay-dlq" in run(str(bin_dir / "flask"), "--app", "app", "topics", "--help")
    run(str(bin_dir / "gunicorn"), "-c", "python:app.gunicorn_conf", "--check-config",
        "app:create_app()")
