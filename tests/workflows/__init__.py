"""Workflows used by the tests (loaded via POIMEN_WORKFLOW_MODULES=tests.workflows)."""

from workers.registry import workflow


@workflow("versioned", version="2")
def versioned_2(ctx, input):
    return {"version": "2"}


@workflow("versioned", version="10")
def versioned_10(ctx, input):
    return {"version": "10"}
