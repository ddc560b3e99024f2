"""Workflows with key reuse policies and schedules (issue: key reuse, exactly-once schedules).

Imported by the tests that use them. The scheduled ones are registered only when
``POIMEN_TEST_SCHEDULE_TENANT`` names a tenant (the beats of tests/workers/
test_schedules.py set it), so no other test's beat admits anything.
"""

import os

from workers.registry import workflow


@workflow("reuse-never")
def reuse_never(ctx, input):
    return input


@workflow("reuse-after-failure", key_reuse="after_failure")
def reuse_after_failure(ctx, input):
    return input


@workflow("reuse-after-end", key_reuse="after_end")
def reuse_after_end(ctx, input):
    return input


@workflow("reuse-after-end-ttl", key_reuse="after_end", key_ttl=60)
def reuse_after_end_ttl(ctx, input):
    return input


if os.environ.get("POIMEN_TEST_SCHEDULE_TENANT"):
    @workflow("every-few-seconds", schedule=float(os.environ.get("POIMEN_TEST_SCHEDULE_SECONDS", "5")),
              schedule_tenant=os.environ["POIMEN_TEST_SCHEDULE_TENANT"],
              schedule_input=lambda tick: {"tick": tick.isoformat()})
    def every_few_seconds(ctx, input):
        return input


if os.environ.get("POIMEN_TEST_REUSABLE_SCHEDULE_TENANT"):
    # A schedule whose workflow lets a caller take an ended run's key: its ticks' keys are
    # Poimen's, so a beat re-admitting a tick must still find that tick's one run.
    @workflow("reusable-schedule", key_reuse="after_end",
              schedule=float(os.environ.get("POIMEN_TEST_SCHEDULE_SECONDS", "20")),
              schedule_tenant=os.environ["POIMEN_TEST_REUSABLE_SCHEDULE_TENANT"])
    def reusable_schedule(ctx, input):
        return input
