"""Chaos fixtures: a private PostgreSQL that tests may stop, restart and cut.

The shared embedded Postgres (``poimen-dev``) serves every test session on
this machine, so no chaos test may touch it. ``private_postgres`` starts a
PostgreSQL 16 of its own from pgserver's bundled binaries, in a temporary
directory, listening on ``127.0.0.1:<free port>`` (TCP, like a hosted
database; the port stays the same across restarts, so clients reconnect to
the same URL). As root it runs as the ``pgserver`` system user, exactly as
pgserver runs the shared one (PostgreSQL refuses to run as root).

It is module-scoped: each chaos module gets a fresh server with one database,
migrated with ``flask --app app db upgrade`` (the release phase), and the
server is stopped and deleted after the module, whatever state a test left
it in.

Fixtures:

* ``private_postgres`` -> :class:`PrivatePostgres`: ``url`` (libpq URL of the
  migrated database), ``admin_url``, ``restart()``, ``stop()``, ``start()``,
  ``terminate(pid)``, ``backends(application_name)``, ``connect()``,
  ``is_up()``.
* ``chaos_env``: the environment for child processes (gunicorn, Celery
  workers, beat): ``DATABASE_URL`` pointing at the private database, the
  shared ``REDIS_URL`` with a Celery queue of its own (``POIMEN_QUEUE``),
  ``POIMEN_WORKFLOW_MODULES=tests.workflows``, ``PYTHONPATH`` = the repo.
* ``chaos_app``: an in-process Flask app built from ``chaos_env`` (for
  admitting runs and calling repair directly).
* ``chaos_tenant``: a tenant and token in the private database.
* ``chaos_pg``: an autocommit psycopg connection to the private database
  (reconnect yourself after a restart: ``private_postgres.connect()``).
* ``chaos_tables``: TRUNCATE every table (call it between tests that commit).

The server's log is ``<root>/postgres.log`` (printed on a failed start).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

import psycopg
import pytest
import redis as redis_lib

from tests.conftest import TABLES, TenantCreds
from tests.processes import ROOT, free_port, wait_until

SYSTEM_USER = "pgserver"  # the account pgserver runs PostgreSQL under when we are root
DB_NAME = "poimen_chaos"


def _bin(name: str) -> str:
    return str(_pgserver()[0] / name)


def _pgserver():
    """pgserver's bundled binaries and helpers (its import warns about XDG dirs: noise)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from pgserver._commands import POSTGRES_BIN_PATH
        from pgserver.utils import (
            ensure_folder_permissions,
            ensure_prefix_permissions,
            ensure_user_exists,
        )
    return POSTGRES_BIN_PATH, ensure_user_exists, ensure_prefix_permissions, \
        ensure_folder_permissions


class PrivatePostgres:
    """A PostgreSQL 16 server of our own: ``initdb``'d in ``root``, on ``port``."""

    def __init__(self, root: Path, port: int | None = None):
        self.root = Path(root)
        self.pgdata = self.root / "data"
        self.socket_dir = self.root / "socket"
        self.logfile = self.root / "postgres.log"
        self.port = port or free_port()
        self.host = "127.0.0.1"
        self.user = None
        if os.geteuid() == 0:
            # Mirror pgserver (postgres_server.py): as root, run as a system user,
            # and make sure that user can read and traverse the binaries.
            bin_path, ensure_user_exists, ensure_prefix_permissions, ensure_folder_permissions = \
                _pgserver()
            ensure_user_exists(SYSTEM_USER)
            ensure_prefix_permissions(bin_path)
            readable = 0o044
            ensure_folder_permissions(bin_path, readable | 0o011)
            ensure_folder_permissions(bin_path.parent / "lib", readable)
            self.user = SYSTEM_USER

    # -- URLs -------------------------------------------------------------------------------

    def url_for(self, database: str) -> str:
        return f"postgresql://postgres@{self.host}:{self.port}/{database}"

    @property
    def admin_url(self) -> str:
        return self.url_for("postgres")

    @property
    def url(self) -> str:
        """The migrated database's libpq URL (what ``DATABASE_URL`` is set to)."""
        return self.url_for(DB_NAME)

    # -- lifecycle ---------------------------------------------------------------------------

    def _run(self, argv: list[str], timeout: float = 120) -> None:
        proc = subprocess.run(argv, user=self.user, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL, cwd=self.root)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stdout}"
                               f"{proc.stderr}\n--- server log ---\n{self.server_log()[-4000:]}")

    def init(self) -> None:
        """``initdb`` the data directory (trust auth, like pgserver's)."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.socket_dir.mkdir(exist_ok=True)
        if self.user:
            entry = pwd.getpwnam(self.user)
            for path in (self.root, self.socket_dir):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        self._run([_bin("initdb"), "-D", str(self.pgdata), "--auth=trust", "--auth-local=trust",
                   "--encoding=utf8", "-U", "postgres", "--no-sync"])

    def _options(self) -> str:
        # Small and fast: this server holds throwaway data. fsync off only risks
        # data on an OS crash; a killed or restarted server recovers from WAL.
        return (f"-h {self.host} -p {self.port} -k {self.socket_dir} -c fsync=off "
                "-c synchronous_commit=off -c full_page_writes=off -c shared_buffers=32MB "
                "-c max_connections=200")

    def start(self, timeout: float = 60) -> None:
        """Start the server and wait until it accepts connections."""
        self._run([_bin("pg_ctl"), "-D", str(self.pgdata), "-l", str(self.logfile), "-w",
                   "-t", str(int(timeout)), "-o", self._options(), "start"], timeout=timeout + 30)
        wait_until(self.is_up, timeout=timeout, what=f"private postgres on {self.port}")

    def stop(self, mode: str = "fast", timeout: float = 60) -> None:
        """Stop the server (``fast``: disconnect clients, clean shutdown; ``immediate``: crash)."""
        self._run([_bin("pg_ctl"), "-D", str(self.pgdata), "-m", mode, "-w", "-t",
                   str(int(timeout)), "stop"], timeout=timeout + 30)

    def restart(self, mode: str = "fast", down_for: float = 0.0) -> None:
        """Stop and start again on the same port; ``down_for`` seconds in between.

        Every client connection is cut, so every session advisory lock goes.
        """
        self.stop(mode)
        if down_for:
            time.sleep(down_for)  # an outage of a chosen length, not a wait for a condition
        self.start()

    def running(self) -> bool:
        return (self.pgdata / "postmaster.pid").exists()

    def is_up(self) -> bool:
        try:
            with psycopg.connect(self.admin_url, connect_timeout=2) as conn:
                conn.execute("SELECT 1")
            return True
        except psycopg.OperationalError:
            return False

    def destroy(self) -> None:
        with contextlib.suppress(Exception):
            if self.running():
                self.stop(mode="immediate")
        shutil.rmtree(self.root, ignore_errors=True)

    def server_log(self) -> str:
        try:
            return self.logfile.read_text(errors="replace")
        except OSError:
            return ""

    # -- databases and backends ---------------------------------------------------------------

    def connect(self, database: str = DB_NAME, **kwargs) -> psycopg.Connection:
        """A new autocommit connection (to the migrated database by default)."""
        kwargs.setdefault("autocommit", True)
        kwargs.setdefault("connect_timeout", 5)
        return psycopg.connect(self.url_for(database), **kwargs)

    def create_database(self, env: Mapping[str, str], name: str = DB_NAME) -> str:
        """Create ``name`` and migrate it like the release phase; return its URL."""
        with self.connect("postgres") as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        url = self.url_for(name)
        migrate = subprocess.run(
            [sys.executable, "-m", "flask", "--app", "app", "db", "upgrade"],
            env={**env, "DATABASE_URL": url}, cwd=ROOT, capture_output=True, text=True,
            timeout=300,
        )
        if migrate.returncode != 0:
            raise RuntimeError(f"migration failed:\n{migrate.stdout}{migrate.stderr}")
        return url

    def terminate(self, pid: int) -> bool:
        """``pg_terminate_backend(pid)``: cut one client connection server-side."""
        with self.connect("postgres") as conn:
            return bool(conn.execute("SELECT pg_terminate_backend(%s)", [pid]).fetchone()[0])

    def backends(self, application_name: str | None = None) -> list[int]:
        """Pids of client backends in the migrated database (optionally one application's)."""
        sql = ("SELECT pid FROM pg_stat_activity WHERE datname = %s AND backend_type = "
               "'client backend' AND pid <> pg_backend_pid()")
        params: list = [DB_NAME]
        if application_name is not None:
            sql += " AND application_name = %s"
            params.append(application_name)
        with self.connect("postgres") as conn:
            return [row[0] for row in conn.execute(sql, params)]


@contextlib.contextmanager
def private_server() -> Iterator[PrivatePostgres]:
    """Start a private server with a migrated database; delete it afterwards."""
    root = Path(tempfile.mkdtemp(prefix="poimen-chaos-pg-"))
    server = PrivatePostgres(root)
    try:
        server.init()
        server.start()
        yield server
    finally:
        server.destroy()


@pytest.fixture(scope="module")
def private_postgres(base_env) -> Iterator[PrivatePostgres]:
    with private_server() as server:
        server.create_database({**base_env, "PYTHONPATH": str(ROOT)})
        yield server
        if not server.running():  # a test left it down: say so, the next module gets its own
            print(f"\nprivate postgres was left stopped (log: {server.logfile})")


@pytest.fixture(scope="module")
def chaos_env(base_env, private_postgres) -> dict[str, str]:
    """Environment for child processes: the private database, the shared Redis, our queue."""
    env = {
        **base_env,
        "DATABASE_URL": private_postgres.url,
        "POIMEN_QUEUE": f"poimen-chaos-{private_postgres.port}-{os.getpid()}",
        "POIMEN_WORKFLOW_MODULES": "tests.workflows",
        "PYTHONPATH": str(ROOT),
    }
    yield env
    client = redis_lib.Redis.from_url(env["REDIS_URL"])
    client.delete(env["POIMEN_QUEUE"])
    client.close()


@contextlib.contextmanager
def environment(env: Mapping[str, str]) -> Iterator[None]:
    """Run the block with ``os.environ`` replaced by ``env`` (create_app reads it)."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="module")
def chaos_app(chaos_env):
    """The Flask app (and its Celery app) pointed at the private database and queue."""
    from app import create_app

    with environment(chaos_env):
        flask_app = create_app()
    flask_app.config["TESTING"] = True
    yield flask_app
    with flask_app.app_context():
        from app.extensions import db

        db.engine.dispose()


@pytest.fixture
def chaos_pg(private_postgres) -> Iterator[psycopg.Connection]:
    with private_postgres.connect() as conn:
        yield conn


@pytest.fixture
def chaos_tables(private_postgres):
    """Empty every table of the private database (for tests that commit)."""

    def clean() -> None:
        with private_postgres.connect() as conn:
            conn.execute(f"TRUNCATE {', '.join(TABLES)} RESTART IDENTITY CASCADE")

    clean()
    return clean


@pytest.fixture
def chaos_tenant(chaos_app, chaos_tables) -> TenantCreds:
    from app.extensions import db
    from app.tenant_service import create_tenant, create_token

    with chaos_app.app_context():
        db.engine.dispose()  # an earlier test may have restarted the server under the pool
        tenant = create_tenant("chaos", exist_ok=True)
        token = create_token(tenant, False)
        return TenantCreds(tenant.id, tenant.name, token)


@pytest.fixture
def chaos_redis(chaos_env):
    client = redis_lib.Redis.from_url(chaos_env["REDIS_URL"])
    client.delete(chaos_env["POIMEN_QUEUE"])
    yield client
    client.delete(chaos_env["POIMEN_QUEUE"])
    client.close()
