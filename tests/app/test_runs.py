"""Unfenced run transitions (``app/run_service.py``): deterministic, two real sessions."""

from __future__ import annotations

import threading

from app.state.executor import on_session
from tests.conftest import connect, wait_until_waiting_on_a_lock


def test_cancel_racing_a_release_still_cancels(app, admit, pg, database_url):
    """A run goes running -> queued (a retry or a release) while cancel waits on its row.

    Two statements (cancel if queued; else flag if running) both miss it: the
    first saw it running, the second re-checks the new version, queued. The
    one-statement cancel re-checks the new version and cancels it outright.
    """
    from app.extensions import db
    from app.state.runs import cancel_run

    run_id = admit("echo", {})
    pg.execute("UPDATE runs SET status = 'running' WHERE id = %s", [run_id])
    tenant_id = pg.execute("SELECT tenant_id FROM runs WHERE id = %s", [run_id]).fetchone()[0]

    releaser = connect(database_url)
    releaser.execute("UPDATE runs SET status = 'queued' WHERE id = %s", [run_id])  # not committed

    outcome = {}

    def cancel():
        with app.app_context():
            db.session.execute(db.text("SET application_name = 'test-canceller'"))
            outcome["row"] = cancel_run(on_session(db.session), tenant_id, run_id)
            db.session.commit()

    canceller = threading.Thread(target=cancel)
    canceller.start()
    wait_until_waiting_on_a_lock(pg, "test-canceller")
    releaser.commit()
    releaser.close()
    canceller.join(10)
    assert not canceller.is_alive()

    status, requested = pg.execute("SELECT status, cancel_requested FROM runs WHERE id = %s",
                                   [run_id]).fetchone()
    assert (status, requested) == ("cancelled", True)
    assert outcome["row"] is not None
    events = [r[0] for r in pg.execute(
        "SELECT event_type FROM outbox WHERE run_id = %s ORDER BY id", [run_id])]
    assert events == ["run.admitted", "run.cancelled"]


def test_cancel_of_a_finished_run_changes_nothing(app, admit, pg):
    from app.extensions import db
    from app.state.runs import cancel_run

    run_id = admit("echo", {})
    pg.execute("UPDATE runs SET status = 'succeeded' WHERE id = %s", [run_id])
    tenant_id = pg.execute("SELECT tenant_id FROM runs WHERE id = %s", [run_id]).fetchone()[0]
    with app.app_context():
        assert cancel_run(on_session(db.session), tenant_id, run_id) is None
        db.session.commit()
    assert pg.execute("SELECT status, cancel_requested FROM runs WHERE id = %s",
                      [run_id]).fetchone() == ("succeeded", False)
