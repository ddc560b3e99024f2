"""Extension singletons, bound to an app with ``init_app`` in the factory."""

from __future__ import annotations

import logging
import select
import time

from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import event, exc
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase


class Base(DeclarativeBase):
    pass


# Rows stay loaded after commit: responses are built from them without a re-select.
db = SQLAlchemy(model_class=Base, session_options={"expire_on_commit": False})

_IDLE_SINCE = "poimen_idle_since"


def keeps_own_session(dsn: str) -> bool:
    """Whether a connection to ``dsn`` keeps its own Postgres session (no transaction pooler).

    The sign a transaction pooler (PgBouncer, Heroku's connection pooling) cannot hide:
    a second connection holding a transaction open pins a server connection, which
    must not be the first one's, and the first one's next statement must still run
    on its own backend, with its session setting kept.
    """
    import psycopg

    with psycopg.connect(dsn, autocommit=True, connect_timeout=10,
                         application_name="poimen-session-check") as first:
        pid = first.execute("SELECT pg_backend_pid(), "
                            "set_config('poimen.session_check', 'kept', false)").fetchone()[0]
        with psycopg.connect(dsn, connect_timeout=10,
                             application_name="poimen-session-check") as pinned:
            other = pinned.execute("SELECT pg_backend_pid()").fetchone()[0]
            again, kept = first.execute(
                "SELECT pg_backend_pid(), current_setting('poimen.session_check', true)"
            ).fetchone()
    return other != pid and again == pid and kept == "kept"


def prepare_if_direct(app, *, session_checked: bool = False) -> bool:
    """Under ``POIMEN_DB_PREPARE_THRESHOLD=auto``, prepare statements where it is safe.

    Safe only where ``DATABASE_URL`` reaches Postgres directly: it is the lock database
    too (``POIMEN_LOCK_DATABASE_URL`` unset or the same; a separate one says
    ``DATABASE_URL`` may be a pooler's), and a connection to it keeps its own session
    (``session_checked``: the caller saw that already, as a worker's lock check does;
    else ``keeps_own_session``). Returns whether statements are prepared now.
    """
    from poimenconfig import AUTO_PREPARE_THRESHOLD, libpq_url

    if not app.config.get("POIMEN_DB_PREPARE_AUTO"):
        return False
    log = logging.getLogger("poimen.db")
    dsn = libpq_url(app.config["SQLALCHEMY_DATABASE_URI"])
    lock = app.config.get("POIMEN_LOCK_DATABASE_URL")
    if lock and libpq_url(lock) != dsn:
        log.info("prepared statements off: DATABASE_URL is not the lock database "
                 "(it may go through a pooler); POIMEN_DB_PREPARE_THRESHOLD=5 turns them on")
        return False
    if not session_checked:
        try:
            direct = keeps_own_session(dsn)
        except Exception as err:  # noqa: BLE001 - unknown is not direct
            log.warning("prepared statements off: DATABASE_URL could not be checked (%s)",
                        type(err).__name__)
            return False
        if not direct:
            log.warning("prepared statements off: DATABASE_URL does not keep its own session "
                        "(a transaction pooler?)")
            return False
    with app.app_context():
        prepare_statements(db.engine, AUTO_PREPARE_THRESHOLD)
    log.info("prepared statements on: DATABASE_URL keeps a session (no transaction pooler)")
    return True


def prepare_statements(engine: Engine, threshold: int) -> None:
    """Give every connection ``engine`` opens from now on psycopg's ``prepare_threshold``.

    Only for an engine whose URL is known to reach Postgres directly (never through
    a transaction pooler): see ``poimenconfig.prepare_auto``.
    """
    @event.listens_for(engine, "connect")
    def _prepare(dbapi_connection, _record) -> None:
        dbapi_connection.prepare_threshold = threshold

    # Connections already pooled were opened without it: open new ones.
    engine.dispose()


def autocommit_engine(session) -> Engine | None:
    """The engine ``session`` (a ``scoped_session``) may run autocommit work on, or None
    when it cannot: it has a transaction open already (a token lookup that missed the
    cache), or is bound to a connection rather than the engine (a test's outer
    transaction); the work then runs in that transaction, as correct and slower."""
    current = session()  # db.session is a scoped_session: this request's (or task's) Session
    bind = current.get_bind()
    if current.in_transaction() or not isinstance(bind, Engine):
        return None
    return bind


def autocommit_next(session) -> bool:
    """Run the next transaction of ``session`` (a ``scoped_session``) in autocommit.

    Returns False when that cannot be chosen.

    For work that is a single statement (or statements each whole on its own):
    one round trip instead of BEGIN, statement, COMMIT. When it cannot be chosen
    (``autocommit_engine``) the work runs in the session's transaction.
    """
    if autocommit_engine(session) is None:
        return False
    session().connection(execution_options={"isolation_level": "AUTOCOMMIT"})
    return True


def ping_idle_connections(engine: Engine, idle_seconds: float) -> None:
    """Ping a pooled connection at checkout only when it may be dead.

    SQLAlchemy's ``pool_pre_ping`` pings at every checkout: one round trip per
    transaction, a fifth of an admission's. Here a connection is pinged when

    * the server has said something since it was checked in: its socket is
      readable. An idle connection in the pool receives nothing, unless its
      backend was terminated (a restart, a failover, ``pg_terminate_backend``
      send an error and close), so this costs a ``poll()``, no round trip;
    * or it sat idle ``idle_seconds`` or more: a connection dropped without a
      word (a NAT timeout, a vanished host) shows nothing on its socket.

    A dead one is replaced before the request uses it, and with it every older
    connection of the pool (``InvalidatePoolError``, what ``pool_pre_ping`` raises).
    """

    @event.listens_for(engine, "checkin")
    def _checked_in(dbapi_connection, record) -> None:
        if record is not None:
            record.info[_IDLE_SINCE] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checked_out(dbapi_connection, record, proxy) -> None:
        since = record.info.get(_IDLE_SINCE)
        if since is None:
            return  # new
        if time.monotonic() - since < idle_seconds and not _server_spoke(dbapi_connection):
            return  # in use a moment ago, and nothing arrived since
        try:
            engine.dialect.do_ping(dbapi_connection)
        except Exception as err:
            raise exc.InvalidatePoolError("pooled connection failed its ping") from err


def _server_spoke(dbapi_connection) -> bool:
    """Whether anything (an error, end of file) is waiting on an idle connection's socket."""
    try:
        poller = select.poll()
        poller.register(dbapi_connection.fileno(), select.POLLIN)
        return bool(poller.poll(0))
    except Exception:  # noqa: BLE001 - a closed connection has no socket: it needs the ping
        return True
