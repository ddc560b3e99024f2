"""The hard-time-limit write is fenced by the run's holder.

A worker's main process fails a run past its hard time limit before it kills the
pool process. It names that process by its own node id (``workers.boots.NODE``,
inherited by its pool processes and stored with their boots) and the pool
process's pid: two containers may share a hostname and reuse pids, and the
write must never fail another worker's run.
"""

from __future__ import annotations

import json
import socket
import uuid

from app.state.runs import TIME_LIMIT

ERROR = json.dumps({"code": "time_limit"})


def hold(pg, run_id, node: uuid.UUID, pid: int) -> uuid.UUID:
    """Give ``run_id`` to a boot of ``node`` with ``pid`` on this very hostname."""
    boot = uuid.uuid4()
    pg.execute("INSERT INTO worker_boots (boot_id, hostname, pid, node) VALUES (%s, %s, %s, %s)",
               [boot, socket.gethostname()[:255], pid, node])
    pg.execute("UPDATE runs SET status = 'running', claimed_by = %s, attempt = 1 WHERE id = %s",
               [boot, run_id])
    return boot


def fail_for(app, run_id, node: uuid.UUID, pid: int):
    from app.extensions import db

    with app.app_context():
        row = db.session.execute(TIME_LIMIT.call, {"run": run_id, "pid": pid, "node": node,
                                                      "error": ERROR}).one_or_none()
        db.session.commit()
        return row


def test_the_same_hostname_and_pid_in_another_worker_is_not_the_holder(app, admit, pg):
    run_id = admit()
    other_container = uuid.uuid4()
    hold(pg, run_id, node=other_container, pid=4242)
    assert fail_for(app, run_id, node=uuid.uuid4(), pid=4242) is None
    assert pg.execute("SELECT status FROM runs WHERE id = %s", [run_id]).fetchone()[0] \
        == "running"


def test_the_holders_own_worker_fails_its_run(app, admit, pg):
    run_id = admit()
    node = uuid.uuid4()
    hold(pg, run_id, node=node, pid=4242)
    assert fail_for(app, run_id, node=node, pid=4242) is not None
    status, error = pg.execute("SELECT status, error FROM runs WHERE id = %s",
                               [run_id]).fetchone()
    assert status == "failed" and error["code"] == "time_limit"


def test_a_boot_records_the_node_of_its_worker(dsn, pg):
    from workers.boots import NODE, Boot

    boot = Boot.register(dsn)
    try:
        assert pg.execute("SELECT node FROM worker_boots WHERE boot_id = %s",
                          [boot.boot_id]).fetchone()[0] == NODE
    finally:
        boot.close()
