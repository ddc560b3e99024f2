"""A workflow version only some workers have (a rolling deploy): loaded by the 'new' ones."""

import os

from workers.registry import workflow


@workflow("rollout", version="2")
def rollout_2(ctx, input):
    return {"pid": os.getpid(), "attempt": ctx.attempt}
