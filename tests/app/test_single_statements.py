"""``app/state/direct.py``: the store's single statements on psycopg, without the session.

Deterministic witnesses of what the stand-in must keep of a session: sends only
after commit (forgotten on rollback), SQLAlchemy's errors, a connection the server
cut dropped from the pool, and the session (its executor) wherever it has a transaction.
"""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import exc, text

from app.state.compose import send_after_commit

SELECT_ONE = text("SELECT :x AS x, pg_backend_pid() AS pid")
BAD_JSON = text("SELECT CAST(:doc AS jsonb) AS doc")


@pytest.fixture
def store(app):
    from app.extensions import db
    from app.state.direct import SingleStatements, single_statements

    sent: list[dict] = []
    with app.app_context():
        stand_in = single_statements(db.session, sent.append)
        assert isinstance(stand_in, SingleStatements)
        yield stand_in, sent
        db.session.remove()


def test_rows_read_as_the_store_reads_a_result(store):
    stand_in, _ = store
    row = stand_in.execute(SELECT_ONE, {"x": 7}).one()
    assert row.x == 7 and row[0] == 7
    assert stand_in.execute(SELECT_ONE, {"x": 1}).scalar() == 1
    assert stand_in.execute(text("SELECT 1 WHERE false")).one_or_none() is None
    with pytest.raises(exc.MultipleResultsFound):
        stand_in.execute(text("SELECT generate_series(1, 2)")).one_or_none()


def test_sends_go_at_commit_and_are_forgotten_at_rollback(store):
    stand_in, sent = store
    run_id = uuid.uuid4()
    stand_in.execute(SELECT_ONE, {"x": 1})
    send_after_commit(stand_in, run_id, "noop@1")  # registered after the statement, as the store does
    assert sent == []
    stand_in.commit()
    assert sent == [{run_id: ("noop@1", None, None, 0, None, None)}]
    send_after_commit(stand_in, uuid.uuid4(), "noop@1")
    stand_in.rollback()
    stand_in.commit()
    assert len(sent) == 1 and len(stand_in.pending) == 0


def test_a_value_postgres_refuses_is_sqlalchemys_data_error(store):
    stand_in, _ = store
    with pytest.raises(exc.DataError):
        stand_in.execute(BAD_JSON, {"doc": '"\\u0000"'})
    assert stand_in.execute(SELECT_ONE, {"x": 2}).one().x == 2  # the connection is fine


def test_a_connection_cut_server_side_is_dropped_and_the_next_statement_runs(store, pg):
    stand_in, _ = store
    pid = stand_in.execute(SELECT_ONE, {"x": 1}).one().pid
    assert pg.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,)).fetchone()[0]
    # The checkout's check sees what the server said on the socket: a new connection.
    row = stand_in.execute(SELECT_ONE, {"x": 3}).one()
    assert row.x == 3 and row.pid != pid


def test_a_session_with_a_transaction_open_is_used_as_it_is(app):
    from app.extensions import db
    from app.state.direct import single_statements
    from app.state.executor import SessionExecutor

    with app.app_context():
        db.session.execute(text("SELECT 1"))  # a transaction is open now
        store = single_statements(db.session, lambda pending: None)
        assert isinstance(store, SessionExecutor) and store.session is db.session()
        db.session.rollback()
        db.session.remove()


def test_a_connection_lost_mid_statement_is_an_invalidated_operational_error(store):
    stand_in, _ = store
    with pytest.raises(exc.OperationalError) as err:
        stand_in.execute(text("SELECT pg_terminate_backend(pg_backend_pid())"))
    assert err.value.connection_invalidated  # what workers/dberrors.retryable waits out
    # Whichever pooled connection comes next (the pool may hold others), it works.
    for x in range(5):
        assert stand_in.execute(SELECT_ONE, {"x": x}).one().x == x
