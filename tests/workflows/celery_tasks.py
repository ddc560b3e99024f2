"""Plain Celery tasks, and workflows with Celery routing, for tests/workers/test_celery_*.py.

Loaded where the tests ask for it (``POIMEN_WORKFLOW_MODULES=tests.workflows,
tests.workflows.celery_tasks``). The tasks are what a team already has:
``@shared_task(bind=True)`` code that knows nothing of Poimen.
"""

import os
import time

from celery import shared_task

from tests.workflows import record_effect
from workers.celery_native import task_workflow, workflow_from_task
from workers.registry import workflow


class NotYet(RuntimeError):
    pass


@shared_task(bind=True, name="tests.celery_tasks.retry_twice", max_retries=3)
def retry_twice(self, **input):
    """Ask Celery to retry twice, then succeed; each attempt leaves a side effect."""
    record_effect(self.request.id, f"try:{self.request.retries}")
    if self.request.retries < 2:
        raise self.retry(exc=NotYet("not yet"), countdown=float(input.get("countdown", 0.2)))
    return {"request_id": self.request.id, "retries": self.request.retries,
            "parent_id": self.request.parent_id, "root_id": self.request.root_id}


# The string form, by the task's registered name.
workflow_from_task("tests.celery_tasks.retry_twice", version="1")


@task_workflow(version="1", name="celery-give-up")
@shared_task(bind=True, name="tests.celery_tasks.give_up", max_retries=1)
def give_up(self, **input):
    """Retry until Celery's max_retries is used up: then the task's exception fails the run."""
    record_effect(self.request.id, f"try:{self.request.retries}")
    raise self.retry(exc=NotYet("never"), countdown=0.1)


# A queue of this test session's own (the session's queue name is in POIMEN_QUEUE,
# set before this module is imported), so concurrent sessions never share it.
SLOW_QUEUE = f"{os.environ.get('POIMEN_QUEUE', 'poimen')}.slow"


@workflow("routed-slow", version="1", queue=SLOW_QUEUE, priority=3, time_limit=120,
          soft_time_limit=100)
def routed_slow(ctx, input):
    """Say which worker process ran it."""
    record_effect(ctx.run_id, "start")
    return {"pid": os.getpid(), "ppid": os.getppid()}


# A queue of its own without a priority: the sender writes its runs as wire messages.
SIDE_QUEUE = f"{os.environ.get('POIMEN_QUEUE', 'poimen')}.side"


@workflow("routed-side", version="1", queue=SIDE_QUEUE)
def routed_side(ctx, input):
    return {}


@workflow("over-time", version="1", time_limit=3)
def over_time(ctx, input):
    """Sleep past the hard time limit, without checkpoints."""
    record_effect(ctx.run_id, "start")
    time.sleep(float(input.get("seconds", 60)))
    record_effect(ctx.run_id, "finish")
    return {"slept": True}


@workflow("soft-time", version="1", soft_time_limit=2, time_limit=60)
def soft_time(ctx, input):
    """Sleep until the soft time limit interrupts it, and stop cleanly."""
    from celery.exceptions import SoftTimeLimitExceeded

    try:
        time.sleep(float(input.get("seconds", 60)))
    except SoftTimeLimitExceeded:
        return {"stopped_by": "soft_time_limit"}
    return {"stopped_by": None}
