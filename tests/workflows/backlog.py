"""Workflows that leave runs in each backlog state, for tests/console/test_console_backlog.py.

Loaded where the test asks for it (``POIMEN_WORKFLOW_MODULES=...,tests.workflows.backlog``).
"""

import os
import time

from workers.registry import workflow

# A queue of this test session's own that no worker consumes: its runs stay queued.
UNCONSUMED_QUEUE = f"{os.environ.get('POIMEN_QUEUE', 'poimen')}.backlog"


@workflow("backlog-hold", version="1", concurrency_limit=1,
          concurrency_key=lambda input: input.get("customer"))
def backlog_hold(ctx, input):
    """Hold a pool process and the customer's one slot for ``seconds``."""
    time.sleep(float(input.get("seconds", 0)))
    return {}


class NotNow(RuntimeError):
    pass


@workflow("backlog-retry", version="1", max_attempts=3, backoff_seconds=600,
          backoff_max_seconds=600)
def backlog_retry(ctx, input):
    """Fail: the run is retried, not before ten minutes from now (delayed)."""
    raise NotNow("not now")


@workflow("backlog-side", version="1", queue=UNCONSUMED_QUEUE)
def backlog_side(ctx, input):
    return {}
