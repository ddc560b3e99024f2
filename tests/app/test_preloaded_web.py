"""web's workers are forked from an app the gunicorn master loaded once (``preload_app``,
``app/gunicorn_conf.py``), and none of them uses a connection of the process it was
forked from (``post_fork``: ``drop_inherited_connections``)."""

from __future__ import annotations

import os
import subprocess

import pytest
from sqlalchemy import text

from tests.processes import BIN, ROOT

pytestmark = pytest.mark.processes  # a fork, and a child gunicorn


def backend_pid(app) -> int:
    from app.extensions import db

    with app.app_context(), db.engine.connect() as conn:
        return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())


def test_a_forked_worker_opens_its_own_connection(app):
    from app.extensions import drop_inherited_connections

    parent = backend_pid(app)  # now pooled in this process, as a master's would be
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child's verdict goes through the pipe
        try:
            drop_inherited_connections(app)
            os.write(write, str(backend_pid(app)).encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    answer = os.read(read, 64)
    os.close(read)
    assert answer, "the child answered nothing"
    assert int(answer) != parent, "the child used its parent's pooled connection"


def test_gunicorn_preloads_the_app_and_resets_each_forked_worker(test_env):
    out = subprocess.run([str(BIN / "gunicorn"), "-c", "python:app.gunicorn_conf",
                          "--print-config", "app:create_app()"], cwd=ROOT, env=test_env,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    settings = {name.strip(): value.strip() for name, value in
                (line.split(" = ", 1) for line in out.splitlines() if " = " in line)}
    assert settings["preload_app"] == "True"
    assert settings["post_fork"] == "<post_fork()>"
