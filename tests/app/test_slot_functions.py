"""A limited group's claim and end are store statements installed as database functions.

Each function (its block in ``app/state/sql/claims.sql``) takes the run's slot locks, then
runs the store's statement on a snapshot taken after them: one round trip. The rule's
witnesses are in ``tests/workers/test_concurrency.py``; here, that what is installed is
what the store says.
"""

from __future__ import annotations

from app.state.claims import SLOT_FUNCTIONS


def test_the_installed_bodies_are_the_stores_statements(pg):
    for function in SLOT_FUNCTIONS:
        row = pg.execute("SELECT prosrc, provolatile FROM pg_proc WHERE proname = %s",
                         [function.name]).fetchone()
        assert row is not None, f"{function.name} is not installed"
        assert row[0] == function.body, (
            f"{function.name} in the database differs from the store: a change to its "
            "statement needs a migration that runs SLOT_FUNCTIONS again")
        assert row[1] == "v"  # VOLATILE: a fresh snapshot for the statement after the locks


def test_each_function_locks_before_its_statement():
    for function in SLOT_FUNCTIONS:
        lock, query = function.body.index("pg_advisory_xact_lock"), function.body.index(
            "RETURN QUERY")
        assert function.body.index("PERFORM") < lock < query, function.name
