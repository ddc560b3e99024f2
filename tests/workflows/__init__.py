"""Workflows used by the tests (loaded via POIMEN_WORKFLOW_MODULES=tests.workflows)."""

from workers.registry import workflow


@workflow("versioned", version="2")
def versioned_2(ctx, input):
    return {"version": "2"}


@workflow("versioned", version="10")
def versioned_10(ctx, input):
    return {"version": "10"}


# Side effects go to a table of their own, each in its own committed
# transaction, so a count shows exactly how many times code ran, crash or not.
def record_effect(run_id, kind: str) -> None:
    """Record one side effect; wait out a database restart (the record must not be lost)."""
    import os
    import time

    from sqlalchemy import text
    from sqlalchemy.exc import OperationalError

    from app.extensions import db

    deadline = time.monotonic() + 60
    while True:
        try:
            with db.engine.begin() as conn:
                conn.execute(
                    text("INSERT INTO side_effects (run_id, kind, pid) VALUES (:r, :k, :p)"),
                    {"r": run_id, "k": kind, "p": os.getpid()})
            return
        except OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@workflow("effect", version="1")
def effect(ctx, input):
    """Record 'start', sleep ``seconds`` (checking for cancellation), record 'finish'."""
    import time

    record_effect(ctx.run_id, "start")
    deadline = time.monotonic() + float(input.get("seconds", 0))
    while time.monotonic() < deadline:
        if ctx.cancelled:
            record_effect(ctx.run_id, "cancelled")
            return {"cancelled": True}
        time.sleep(0.05)
    record_effect(ctx.run_id, "finish")
    return {"attempt": ctx.attempt}


class Flaky(RuntimeError):
    pass


@workflow("flaky", version="1", max_attempts=3, backoff_seconds=0.2)
def flaky(ctx, input):
    """Fail until the run has failed ``input['failures']`` times, then succeed."""
    record_effect(ctx.run_id, "try")
    from sqlalchemy import text

    from app.extensions import db

    with db.engine.connect() as conn:
        failures = conn.execute(text("SELECT failures FROM runs WHERE id = :r"),
                                {"r": ctx.run_id}).scalar()
    if failures < int(input.get("failures", 1)):
        raise Flaky(f"failure number {failures + 1}")
    return {"failures_before_success": failures}


@workflow("invalid-input", version="1", max_attempts=1)
def invalid_input(ctx, input):
    """Fail with a validation error that quotes its input at length: ``input['bytes']``
    bytes of message (an API's 413 body, a schema error dumping the document)."""
    quote = str(input.get("quote", "x"))
    raise ValueError("invalid input: " + quote * (int(input["bytes"]) // len(quote)))


@workflow("unstorable", version="1")
def unstorable(ctx, input):
    """Return a result Postgres jsonb refuses (a NUL character)."""
    return {"text": "nul \u0000 here"}


@workflow("blind", version="1")
def blind(ctx, input):
    """Record 'start', sleep ``seconds`` without any checkpoint, record 'finish'."""
    import time

    record_effect(ctx.run_id, "start")
    time.sleep(float(input.get("seconds", 0)))
    record_effect(ctx.run_id, "finish")
    return {"attempt": ctx.attempt}


# Priorities on the default queue (tests/rabbitmq: RabbitMQ delivers higher first once the
# queue has x-max-priority; on Redis, kombu serves 0 first).
@workflow("urgent", version="1", priority=9)
def urgent(ctx, input):
    return {"priority": 9}


@workflow("routine", version="1", priority=1)
def routine(ctx, input):
    return {"priority": 1}


@workflow("crash", version="1")
def crash(ctx, input):
    """Kill the worker process that runs it (an OOM kill, a segfault)."""
    import os

    record_effect(ctx.run_id, "start")
    os._exit(int(input.get("code", 1)))


@workflow("poison", version="1", max_takeovers=2)
def poison(ctx, input):
    """SIGKILL the pool process that runs it, every time: a poisoned run (a segfault in a
    native library, an allocation the OOM killer answers). Two takeovers, then poisoned."""
    import os
    import signal

    record_effect(ctx.run_id, "start")
    os.kill(os.getpid(), signal.SIGKILL)


@workflow("forker", version="1")
def forker(ctx, input):
    """Fork (without exec) a grandchild, then work. ``detach``: the grandchild leaves the
    pool process's process group (``setsid``), so it outlives this process."""
    import os
    import time

    grandchild = os.fork()
    if grandchild == 0:  # the grandchild: sleeps on, holding whatever it inherited
        if input.get("detach"):
            os.setsid()
        time.sleep(float(input.get("grandchild_seconds", 60)))
        os._exit(0)
    while input.get("detach") and os.getpgid(grandchild) == os.getpgid(0):
        time.sleep(0.01)  # until it has left this process's group
    record_effect(ctx.run_id, "start")
    time.sleep(float(input.get("seconds", 0)))
    record_effect(ctx.run_id, "finish")
    return {"attempt": ctx.attempt, "grandchild": grandchild}


# A child that writes "<unix time> <its pid>" to $1 every 0.2 s until it is killed. It
# ignores SIGTERM, as a child finishing its own work on SIGTERM (ffmpeg) outlives it.
SHELL_LOOP = 'trap "" TERM; while :; do echo "$(date +%s.%N) $$" >> "$1"; sleep 0.2; done'


@workflow("spawner", version="1")
def spawner(ctx, input):
    """Start :data:`SHELL_LOOP` writing to ``path`` as a child, then block ``seconds``;
    stop the loop and return. Two executions at once show as two pids writing."""
    import subprocess
    import time

    loop = subprocess.Popen(["sh", "-c", SHELL_LOOP, "loop", input["path"]])
    record_effect(ctx.run_id, "start")
    try:
        time.sleep(float(input.get("seconds", 300)))
    finally:
        loop.kill()
        loop.wait()
    record_effect(ctx.run_id, "finish")
    return {"attempt": ctx.attempt}


@workflow("tick", version="1")
def tick(ctx, input):
    """Append ``<unix time> <pid> <attempt>`` to the file ``path`` every ``every`` seconds for
    ``seconds``, or until the unix time ``until`` (at least once): a side effect outside the
    database, so a process cut off from Postgres still shows that it runs, and two
    executions at once show as interleaved pids. With ``until``, every execution of the run
    ends at the same time: a takeover's execution runs only the rest of the run's span."""
    import os
    import time

    if "until" in input:
        end = time.monotonic() + float(input["until"]) - time.time()
    else:
        end = time.monotonic() + float(input.get("seconds", 10))
    with open(input["path"], "a") as out:
        while True:
            out.write(f"{time.time():.3f} {os.getpid()} {ctx.attempt}\n")
            out.flush()
            if time.monotonic() >= end:
                break
            time.sleep(float(input.get("every", 0.25)))
    return {"attempt": ctx.attempt}


@workflow("keyed", version="1", concurrency_limit=1,
          concurrency_key=lambda input: input.get("customer"))
def keyed(ctx, input):
    """Record 'start', sleep ``seconds``, record 'finish': at most one run per customer at once
    (``concurrency_key`` derived from the input; no customer: one group for the workflow)."""
    import time

    record_effect(ctx.run_id, "start")
    time.sleep(float(input.get("seconds", 0)))
    record_effect(ctx.run_id, "finish")
    return {"attempt": ctx.attempt}


@workflow("rated", version="1", rate_limit="10/s", rate_key=lambda input: input.get("customer"))
def rated(ctx, input):
    """At most 10 first starts a second per customer, across every worker (``rate_key``
    derived from the input). With ``path``: appends ``<unix time> <run id>`` when it starts,
    the bodies' own record of their starts; sleeps ``seconds``."""
    import time

    if "path" in input:
        with open(input["path"], "a") as out:
            out.write(f"{time.time():.6f} {ctx.run_id}\n")
    time.sleep(float(input.get("seconds", 0)))
    return {"attempt": ctx.attempt}


@workflow("rated-slow", version="1", rate_limit="40/m",
          rate_key=lambda input: input.get("customer"))
def rated_slow(ctx, input):
    """40 first starts a minute per customer: 1.5 s apart, so the rule tests' claims a moment
    apart stay a moment apart on a loaded machine."""
    return {"attempt": ctx.attempt}


@workflow("rated-keyed", version="1", rate_limit="10/s", concurrency_limit=1)
def rated_keyed(ctx, input):
    """A rate limit and a concurrency limit of one together (each run first takes its slot,
    then its start)."""
    return {"attempt": ctx.attempt}


@workflow("stamped", version="1", concurrency_limit=1,
          concurrency_key=lambda input: input.get("customer"))
def stamped(ctx, input):
    """Append ``<unix time> <pid> <attempt> <run id>`` to the file ``path`` every 50 ms for
    ``seconds``: at most one run per customer at once, and a body that still runs after its
    worker lost its lock shows in the file (tests/workers/test_early_lock_loss.py)."""
    import os
    import time

    end = time.monotonic() + float(input.get("seconds", 5))
    with open(input["path"], "a") as out:
        while time.monotonic() < end:
            out.write(f"{time.time():.3f} {os.getpid()} {ctx.attempt} {ctx.run_id}\n")
            out.flush()
            time.sleep(0.05)
    return {"attempt": ctx.attempt}


@workflow("pair", version="1", concurrency_limit=2)
def pair(ctx, input):
    """At most two runs at once per concurrency_key given at admission."""
    return {"key": input.get("key")}
