"""The store's database functions are its statements, installed as written.

Each function (its block in ``app/state/sql/*.sql``) runs its statements in order, each on
a fresh snapshot: a limited group's claim and a run's end take the run's slot locks
(``poimen_lock_slots``) before the statement that decides, one round trip. The rule's
witnesses are in ``tests/workers/test_concurrency.py``; here, that what is installed is
what the store says.
"""

from __future__ import annotations

from app.state.claims import FUNCTIONS


def test_the_installed_bodies_are_the_stores_statements(pg):
    for function in FUNCTIONS:
        row = pg.execute("SELECT prosrc, provolatile FROM pg_proc WHERE proname = %s",
                         [function.name]).fetchone()
        assert row is not None, f"{function.name} is not installed"
        assert row[0] == function.body, (
            f"{function.name} in the database differs from the store: a change to its "
            "statement needs a migration that runs FUNCTIONS again")
        assert row[1] == "v"  # VOLATILE: a fresh snapshot for each statement after the locks


def test_the_installed_settings_are_the_stores(pg):
    """A function planned once per connection (``plan_cache_mode``) is installed so."""
    for function in FUNCTIONS:
        config = pg.execute("SELECT proconfig FROM pg_proc WHERE proname = %s",
                            [function.name]).fetchone()[0]
        generic = "\nSET plan_cache_mode = force_generic_plan AS $body$" in function.create
        assert config == (["plan_cache_mode=force_generic_plan"] if generic else None), (
            function.name, config)


def test_each_function_locks_before_its_statement():
    by_name = {function.name: function for function in FUNCTIONS}
    locks = by_name["poimen_lock_slots"].body
    assert "pg_advisory_xact_lock" in locks
    # The tenant's lock first, then the group's, everywhere.
    assert locks.index("1347373396") < locks.index("1347373379")
    for name, statement in (("poimen_claim_slot", "RETURN QUERY"),
                            ("poimen_finish", "UPDATE runs")):
        body = by_name[name].body
        assert body.index("poimen_lock_slots(p_run)") < body.index(statement), name
