"""The store's single statements on psycopg, without the ORM session.

A statement that is whole on its own (a claim, a run's end: one round trip each)
runs in autocommit. Through a ``Session`` it still pays the session's machinery
around it: a transaction object, a connection checked out and characterised as
``AUTOCOMMIT`` and reset again, the result's metadata built column by column, the
commit hooks: more than twice the CPU of the statement run here, with the same pool
checkout (bench/RESULTS.md, "single statements on psycopg directly").

:func:`single_statements` gives the store's functions an ``Executor``
(``app/state/executor.py``): each statement is a transaction of its own on a pooled
connection, and ``commit()`` hands the runs the writes left to send (its ``pending``)
to ``after_commit``, as a session's commit does.
Errors are SQLAlchemy's, as through the session (``OperationalError`` for a lost
server, ``DataError`` for a value the column refuses), and a connection that lost its
server is dropped from the pool.

Where a session could not run autocommit (``extensions.autocommit_engine``) the
session is returned as an executor (``executor.on_session``), and the work runs in its
transaction.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import psycopg
from psycopg.rows import namedtuple_row
from sqlalchemy import exc
from sqlalchemy.dialects.postgresql import psycopg as psycopg_dialect
from sqlalchemy.engine import Dialect, Engine
from sqlalchemy.orm import Session, scoped_session
from sqlalchemy.sql.elements import TextClause
from sqlalchemy.sql.expression import Executable

from app.extensions import autocommit_engine

from .executor import Executor, PendingSends, Send, on_session

# A statement that returned rows (looked up once, not per statement).
_TUPLES_OK = psycopg.pq.ExecStatus.TUPLES_OK

# Hands the runs a committed write left to send to the sender (``enqueue.send_pending``).
AfterCommit = Callable[[Mapping[uuid.UUID, Send]], None]

# Who watches the statements run here, all in autocommit (tests: ``conftest.statements``,
# which watches the engine's too): called with the SQL before each runs.
OBSERVERS: list[Callable[[str], None]] = []


def single_statements(session: Session | scoped_session[Any], after_commit: AfterCommit
                      ) -> Executor:
    """An autocommit stand-in for ``session`` (a ``scoped_session``) running each
    statement on its own, or ``session`` (as an executor) where that cannot be chosen.

    Either way the caller ends with ``commit()`` (``rollback()`` for reads only):
    a no-op for the stand-in, whose statements committed as they ran.
    """
    engine = autocommit_engine(session)
    return on_session(session) if engine is None else SingleStatements(engine, after_commit)


class Result:
    """The rows of one statement, read as a SQLAlchemy ``Result`` is by the store."""

    __slots__ = ("_rows", "rowcount")

    def __init__(self, rows: list[Any], rowcount: int):
        self._rows = rows
        self.rowcount = rowcount

    def one_or_none(self) -> Any:
        if len(self._rows) > 1:
            raise exc.MultipleResultsFound("Multiple rows were found when one or none "
                                           "was required")
        return self._rows[0] if self._rows else None

    def one(self) -> Any:
        if len(self._rows) != 1:
            raise (exc.NoResultFound("No row was found when one was required")
                   if not self._rows else
                   exc.MultipleResultsFound("Multiple rows were found when exactly one "
                                            "was required"))
        return self._rows[0]

    def scalar(self) -> Any:
        return self._rows[0][0] if self._rows else None

    def scalar_one(self) -> Any:
        return self.one()[0]

    def all(self) -> list[Any]:
        return self._rows


class SingleStatements:
    """Each ``execute`` a transaction of its own on a connection of ``engine``'s pool."""

    def __init__(self, engine: Engine, after_commit: AfterCommit):
        self.engine = engine
        self.pending = PendingSends()
        self._after_commit = after_commit

    def execute(self, statement: Executable,
                params: Mapping[str, Any] | None = None) -> Result:
        assert isinstance(statement, TextClause), "the store's statements are text"
        sql = _compiled(statement, self.engine.dialect)
        for observe in OBSERVERS:
            observe(sql)
        try:
            # The pool's checkout, its liveness check too; a failed connect is psycopg's
            # error here (a session's checkout wraps it): wrapped below the same way.
            fairy = self.engine.raw_connection()
        except psycopg.Error as err:
            raise exc.DBAPIError.instance(sql, params, err, psycopg.Error,
                                          connection_invalidated=True) from err
        conn = cast(psycopg.Connection[Any], fairy.driver_connection)
        try:
            conn.autocommit = True
            try:
                result = _run(conn, sql, params)
            finally:
                if not conn.closed:
                    conn.autocommit = False  # as the pool hands it to a session
        except psycopg.Error as err:
            lost = self.engine.dialect.is_disconnect(cast(Any, err), cast(Any, conn), None) \
                or conn.closed
            if lost:
                fairy.invalidate(err)
            raise exc.DBAPIError.instance(sql, params, err, psycopg.Error,
                                          connection_invalidated=lost) from err
        finally:
            fairy.close()
        return result

    def commit(self) -> None:
        """Every statement committed as it ran: send the runs they left to send, as a
        session's ``after_commit`` does."""
        pending = self.pending.take()
        if pending:
            self._after_commit(pending)

    def rollback(self) -> None:
        """What ran was whole on its own; the runs it left to send are forgotten, as a
        session's ``after_rollback`` forgets them (beat re-sends queued runs)."""
        self.pending.clear()


class OwnConnection:
    """Each ``execute`` a transaction of its own on one psycopg connection in autocommit
    (the batching worker's store batcher keeps one: ``workers/batching.py``). Errors are
    SQLAlchemy's, as ``SingleStatements``'; the runs its statements leave to send are the
    caller's (``pending``)."""

    def __init__(self, conn: psycopg.Connection[Any]):
        conn.autocommit = True
        self.conn = conn
        self.pending = PendingSends()

    def execute(self, statement: Executable,
                params: Mapping[str, Any] | None = None) -> Result:
        assert isinstance(statement, TextClause), "the store's statements are text"
        sql = _compiled(statement, _PSYCOPG_DIALECT)
        for observe in OBSERVERS:
            observe(sql)
        try:
            return _run(self.conn, sql, params)
        except psycopg.Error as err:
            raise exc.DBAPIError.instance(sql, params, err, psycopg.Error,
                                          connection_invalidated=self.conn.closed) from err

    def together(self, calls: Sequence[tuple[Executable, Mapping[str, Any]]]
                 ) -> list[Result]:
        """Each statement of ``calls`` in one transaction with one commit, all sent in one
        round trip: a pipeline, whose statements up to its sync are one implicit
        transaction, committed at the sync or, on an error Postgres answers, rolled back
        whole. Their results, in order. Errors are SQLAlchemy's, as ``execute``'s.

        One exception: a value psycopg refuses to send (an error without a SQLSTATE)
        raises with the statements before it already queued, and psycopg's pipeline still
        syncs them on its way out, so they commit. Treat such an error as an unknown
        outcome (``workers/batching.py`` does)."""
        compiled = []
        for statement, params in calls:
            assert isinstance(statement, TextClause), "the store's statements are text"
            sql = _compiled(statement, _PSYCOPG_DIALECT)
            for observe in OBSERVERS:
                observe(sql)
            compiled.append((sql, params))
        cursors: list[psycopg.Cursor[Any]] = []
        try:
            try:
                with self.conn.pipeline():
                    for sql, params in compiled:
                        cur = self.conn.cursor(row_factory=namedtuple_row)
                        cursors.append(cur)
                        cur.execute(sql, params)
                return [_result(cur) for cur in cursors]
            finally:
                for cur in cursors:
                    cur.close()
        except psycopg.Error as err:
            raise exc.DBAPIError.instance(compiled[0][0], compiled[0][1], err, psycopg.Error,
                                          connection_invalidated=self.conn.closed) from err

    def commit(self) -> None:
        """Every statement committed as it ran."""

    def rollback(self) -> None:
        self.pending.clear()


_PSYCOPG_DIALECT = psycopg_dialect.dialect()  # type: ignore[no-untyped-call]


def _run(conn: psycopg.Connection[Any], sql: str, params: Mapping[str, Any] | None
         ) -> Result:
    """``sql`` on ``conn`` (in autocommit): its rows and rowcount."""
    with conn.cursor(row_factory=namedtuple_row) as cur:
        cur.execute(sql, params or {})
        return _result(cur)


def _result(cur: psycopg.Cursor[Any]) -> Result:
    """The rows and rowcount of the statement ``cur`` ran."""
    # Not ``cur.description``: it builds a Column object for every column of every
    # statement (a tenth of an admission's CPU for a run's 32).
    result = cur.pgresult
    rows = cur.fetchall() if result is not None and result.status == _TUPLES_OK else []
    return Result(rows, cur.rowcount)


_COMPILED: dict[tuple[int, int], tuple[TextClause, str]] = {}


def _compiled(statement: TextClause, dialect: Dialect) -> str:
    """``statement`` in the driver's parameter style (``%(name)s``), compiled once."""
    key = (id(statement), id(dialect))
    hit = _COMPILED.get(key)
    if hit is None or hit[0] is not statement:
        hit = (statement, statement.compile(dialect=dialect).string)
        _COMPILED[key] = hit
    return hit[1]
