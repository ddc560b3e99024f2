"""``poimen-dev``: embedded services start once, are found again, and stop exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psycopg
import pytest
import redis

from tests.processes import ROOT

pytestmark = pytest.mark.processes


def poimen_dev(*args: str, state_dir) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATABASE_URL", "REDIS_URL", "KAFKA_BOOTSTRAP_SERVERS")}
    env["POIMEN_DEV_DIR"] = str(state_dir)
    return subprocess.run([sys.executable, "-m", "poimen_dev", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=180, check=True)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(") ")[1][0] != "Z"


def test_up_is_idempotent_and_down_stops_exactly_what_up_started(tmp_path):
    state_dir = tmp_path / "dev"
    first = poimen_dev("up", state_dir=state_dir).stdout
    urls = dict(line.split("=", 1) for line in first.split())
    assert set(urls) == {"DATABASE_URL", "REDIS_URL", "KAFKA_BOOTSTRAP_SERVERS"}
    state = json.loads((state_dir / "state.json").read_text())
    try:
        with psycopg.connect(urls["DATABASE_URL"]) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
        assert redis.Redis.from_url(urls["REDIS_URL"]).ping()

        again = poimen_dev("up", state_dir=state_dir).stdout
        assert again == first  # found running: same URLs, nothing new started
        assert json.loads((state_dir / "state.json").read_text()) == state
        env_lines = poimen_dev("env", state_dir=state_dir).stdout
        assert f"export REDIS_URL={urls['REDIS_URL']}" in env_lines
        assert "up" in poimen_dev("status", state_dir=state_dir).stdout
    finally:
        poimen_dev("down", state_dir=state_dir)

    for service in ("redis", "kafka"):
        assert not alive(state[service]["pid"]), service
    assert not (state_dir / "pg" / "postmaster.pid").exists()
    # The broker binary, not just the wrapper, is gone.
    leftovers = subprocess.run(["pgrep", "-f", str(state_dir)], capture_output=True, text=True)
    assert leftovers.stdout.strip() == ""
    status = poimen_dev("status", state_dir=state_dir).stdout
    assert "up" not in status
