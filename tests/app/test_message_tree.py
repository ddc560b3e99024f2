"""A run's ``runs.execute`` message tells Celery (and so Flower) what Celery's own messages
tell: ``retries`` (the executions the run started before this one), ``parent_id`` (the run
that fanned it out) and ``root_id`` (its run tree's root; itself at the top), read here from
the real Redis list the workers consume.

Every send is covered: admission (the sender's wire), a replay of a queued run, beat's
repair, and a send from inside a task a worker runs (a retry, repair run as a task), which
must not name that task as the parent as ``send_task`` would.
"""

from __future__ import annotations

import json
import uuid

import pytest


def _take(redis_client, queue: str, run_id) -> dict:
    """The headers of ``run_id``'s message in ``queue``, removed from it (the last one)."""
    found = None
    for raw in redis_client.lrange(queue, 0, -1):
        message = json.loads(raw)
        if message["headers"]["id"] == str(run_id):
            found = (raw, message["headers"])
    assert found is not None, f"no message of {run_id} in {queue}"
    redis_client.lrem(queue, 0, found[0])
    return found[1]


def _tree(headers: dict) -> tuple:
    return headers["retries"], headers["parent_id"], headers["root_id"]


def test_admitted_runs_carry_their_run_tree(admit, pg, redis_client, queue_name, sent):
    top = admit("echo", {"n": 1})
    child = admit("echo", {"n": 2}, parent_run_id=top)
    grandchild = admit("echo", {"n": 3}, parent_run_id=child)
    sent()
    # A top-level run: as Celery writes a task sent outside any task.
    assert _tree(_take(redis_client, queue_name, top)) == (0, None, str(top))
    assert _tree(_take(redis_client, queue_name, child)) == (0, str(top), str(top))
    assert _tree(_take(redis_client, queue_name, grandchild)) == (0, str(child), str(top))
    # The root is set at admission: none for a top-level run.
    roots = dict(pg.execute("SELECT id, root_run_id FROM runs WHERE id = ANY(%s)",
                            [[top, child, grandchild]]).fetchall())
    assert roots == {top: None, child: top, grandchild: top}


def test_a_replay_and_a_repair_carry_the_runs_attempt_and_tree(app, admit, pg, redis_client,
                                                              queue_name, sent):
    from app.extensions import db
    from app.run_service import redrive_stranded_runs

    top = admit("echo", {"n": 1})
    child = admit("echo", {"n": 2}, parent_run_id=top, dispatch_key=f"c-{uuid.uuid4()}")
    sent()
    redis_client.delete(queue_name)
    # As after two executions that failed and were retried: queued for its third.
    pg.execute("UPDATE runs SET attempt = 2, failures = 2 WHERE id = %s", [child])
    key = pg.execute("SELECT dispatch_key FROM runs WHERE id = %s", [child]).fetchone()[0]
    assert admit("echo", {"n": 2}, parent_run_id=top, dispatch_key=key) == child  # a replay
    sent()
    assert _tree(_take(redis_client, queue_name, child)) == (2, str(top), str(top))

    pg.execute("UPDATE runs SET last_sent_at = now() - interval '1 hour' WHERE id = %s",
               [child])
    with app.app_context():
        redrive_stranded_runs(db.session, app.extensions["celery"], min_age=60)
    assert _tree(_take(redis_client, queue_name, child)) == (2, str(top), str(top))


def _delivery() -> None:
    pass


@pytest.fixture
def inside_a_task(app):
    """This thread as a worker's pool thread running a delivery (of a run, or of a task
    such as a repair): Celery's own task stack and request, as its tracer sets them up
    (``called_directly`` False). A task of this app stands for the worker's (the web app
    does not load ``workers.tasks``)."""
    from celery._state import _task_stack

    celery_app = app.extensions["celery"]
    name = "tests.message_tree.delivery"
    task = celery_app.tasks.get(name) or celery_app.task(name=name)(_delivery)
    pushed = []

    def enter(run_id, parent_id=None, root_id=None, retries=0):
        _task_stack.push(task)
        task.push_request(id=str(run_id), parent_id=parent_id, root_id=root_id or str(run_id),
                          retries=retries, called_directly=False, delivery_info={})
        pushed.append(task)

    yield enter
    for task in pushed:
        task.pop_request()
        _task_stack.pop()


def test_a_send_from_inside_a_task_names_the_runs_tree_not_the_task(
        app, admit, redis_client, queue_name, sent, inside_a_task):
    from app.enqueue import Tree, send_run
    from workers.execution import delivered_tree

    celery_app = app.extensions["celery"]
    top, parent = admit("echo", {"n": 1}), uuid.uuid4()
    sent()
    redis_client.delete(queue_name)
    # Beat's repair, run as a task: a top-level run's message has no parent.
    inside_a_task(uuid.uuid4())
    with app.app_context():
        assert send_run(celery_app, top, "echo@1", tree=Tree(1))
    assert _tree(_take(redis_client, queue_name, top)) == (1, None, str(top))

    # A fan-out child's retry, sent by the worker that executes it: the tree its delivery
    # carried, the retries of its next execution.
    child = uuid.uuid4()
    inside_a_task(child, parent_id=str(parent), root_id=str(parent), retries=0)
    tree = delivered_tree(child, 1)
    assert tree == Tree(1, str(parent), str(parent))
    with app.app_context():
        assert send_run(celery_app, child, "echo@1", tree=tree)
    assert _tree(_take(redis_client, queue_name, child)) == (1, str(parent), str(parent))
    # A top-level run's retry from its own worker names no parent (not itself).
    inside_a_task(top, retries=1)
    tree = delivered_tree(top, 2)
    with app.app_context():
        assert send_run(celery_app, top, "echo@1", tree=tree)
    assert _tree(_take(redis_client, queue_name, top)) == (2, None, str(top))
