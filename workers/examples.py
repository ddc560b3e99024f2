"""Built-in example workflows: useful for smoke tests, demos and benchmarks."""

from __future__ import annotations

import time

from .registry import workflow


@workflow("echo", version="1")
def echo(ctx, input: dict) -> dict:
    """Return the input unchanged."""
    return input


@workflow("noop", version="1")
def noop(ctx, input: dict) -> None:
    """Do nothing (the benchmark workflow)."""
    return None


@workflow("sleep", version="1")
def sleep(ctx, input: dict) -> dict:
    """Sleep ``input["seconds"]`` in small slices, stopping early when cancelled."""
    seconds = float(input.get("seconds", 1))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if ctx.cancelled:
            return {"slept": seconds - (deadline - time.monotonic()), "cancelled": True}
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
    return {"slept": seconds}


class ExampleFailure(RuntimeError):
    pass


@workflow("fail", version="1", max_attempts=1)
def fail(ctx, input: dict) -> None:
    """Raise, to show how a failed run looks."""
    raise ExampleFailure(input.get("message", "this workflow always fails"))
