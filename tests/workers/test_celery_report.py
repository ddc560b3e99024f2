"""What ``runs.execute`` tells Celery, for each way a delivery ends (docs/guide/celery.md's table).

In this process, through ``execute_run`` (what the task calls) and
``celery_native.report`` (what the task returns or raises), against the real
database; tests/workers/test_celery_native.py watches the same through real
workers, Flower and an event receiver.
"""

from __future__ import annotations

import pytest
from celery.exceptions import Ignore, Retry

from tests.workers.test_claims import hold_as


@pytest.fixture
def deliver(app, fresh_boot):
    """Deliver a run once, in this process; return what the task would return, or raise."""
    from workers import tasks
    from workers.celery_native import report
    from workers.execution import execute_run

    def run(run_id):
        with app.app_context():
            return report(tasks.execute, execute_run(str(run_id)))

    return run


def test_a_succeeded_run_returns_and_its_duplicate_is_ignored(admit, deliver, pg):
    run_id = admit("echo", {"x": 1})
    assert deliver(run_id) == "succeeded"
    with pytest.raises(Ignore):
        deliver(run_id)


def test_a_failed_run_raises_run_failed_naming_only_the_error_type(admit, deliver):
    from workers.celery_native import RunFailed

    run_id = admit("fail", {"message": "private words"})
    with pytest.raises(RunFailed) as failed:
        deliver(run_id)
    assert str(failed.value) == f"run {run_id} failed: workers.examples.ExampleFailure"
    with pytest.raises(Ignore):
        deliver(run_id)


def test_a_retry_is_retry_with_the_runs_delay(admit, deliver, side_effects):
    run_id = admit("flaky", {"failures": 1})
    with pytest.raises(Retry) as retry:
        deliver(run_id)
    assert retry.value.when == pytest.approx(0.2)
    with pytest.raises(Ignore):  # not due yet: the delayed message will come
        deliver(run_id)


def test_a_run_pinned_to_a_version_this_worker_lacks_is_retry(admit, deliver, pg):
    run_id = admit("echo")
    pg.execute("UPDATE runs SET workflow_version = '999' WHERE id = %s", [run_id])
    with pytest.raises(Retry):
        deliver(run_id)


def test_a_takeover_that_ends_the_run_poisoned_is_failure(admit, deliver, dead_boot, pg):
    from workers.celery_native import RunFailed

    run_id = admit("echo")
    hold_as(pg, run_id, dead_boot(), takeovers=5)  # the default max_takeovers
    with pytest.raises(RunFailed, match="poisoned"):
        deliver(run_id)


def test_a_takeover_of_a_cancelled_run_is_ignored_after_announcing_revoked(admit, deliver,
                                                                           dead_boot, pg):
    run_id = admit("echo")
    hold_as(pg, run_id, dead_boot(), cancel_requested=True)
    with pytest.raises(Ignore):
        deliver(run_id)
    assert pg.execute("SELECT status FROM runs WHERE id = %s", [run_id]).fetchone()[0] \
        == "cancelled"


def test_a_join_waiting_for_its_children_is_retry_not_success(admit, deliver, pg):
    run_id = admit("doc-review", {"participants": ["ana"]})
    with pytest.raises(Retry):
        deliver(run_id)
    assert pg.execute("SELECT status FROM runs WHERE id = %s", [run_id]).fetchone()[0] \
        == "waiting"
