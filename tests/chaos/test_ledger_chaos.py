"""Chaos for the step-entry ledger: doc-review runs under random kill -9 of real workers.

Two ``celery worker`` processes (two pool processes each) and beat execute
``CHAOS_RUNS`` doc-review runs (1-3 participants, zero or one rejected round,
so one or two fan-outs and joins each) while a killer SIGKILLs, about every
second, either one pool process (Celery replaces it; its message comes back),
or a whole worker (restarted; beat's repair re-sends what it held), until the
runs are done or a minute has passed. Then: zero markers completed twice, zero
duplicate children, every run terminal. About 30-60 s on a 2-core machine.
Shared Postgres: nothing here restarts it. POIMEN_LEDGER_CHAOS_RUNS scales it.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter
from pathlib import Path

import tests.workflows.ledger  # noqa: F401 - the worker env loads the same modules
from tests.processes import Process, start_beat, start_worker, wait_until

CHAOS_RUNS = int(os.environ.get("POIMEN_LEDGER_CHAOS_RUNS", "200"))
KILL_EVERY = (0.3, 1.5)  # seconds between kills, uniformly
KILLING_FOR = 60.0  # seconds of kills at most; then the system settles
# How long the runs may take to finish once the kills stop. The kills leave the queue full
# of stale deliveries (each answered "nothing to do"), which the survivors work through
# before the last re-queued parent: on a slow machine that took longer than 90 s, with
# every run still making progress (the last parent re-queued by its join 7.5 s before).
SETTLE_TIMEOUT = 180.0


def pool_pids(worker: Process) -> list[int]:
    try:
        text = Path(f"/proc/{worker.pid}/task/{worker.pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def test_doc_review_runs_survive_random_kill_9_of_workers(admit, pg, test_env, tmp_path,
                                                          processes, redis_client, queue_name):
    from tests.workflows.ledger import MODULES

    rng = random.Random(20261129)
    env = {**test_env, "POIMEN_WORKFLOW_MODULES": MODULES, "POIMEN_REPAIR_INTERVAL": "1",
           "POIMEN_REPAIR_MIN_AGE": "3", "POIMEN_BOOT_PROBE_INTERVAL": "0.5"}
    redis_client.delete(queue_name)
    names = ["ana", "bo", "cy"]
    parents = {}
    for _ in range(CHAOS_RUNS):
        participants = names[:rng.randint(1, 3)]
        rounds = rng.randint(0, 1)
        run_id = admit("doc-review", {"participants": participants, "reject_rounds": rounds})
        parents[run_id] = (participants, rounds)

    workers = [start_worker(env, tmp_path, f"w{i}", concurrency=2) for i in range(2)]
    processes.extend(workers)
    processes.append(start_beat(env, tmp_path))
    started = time.monotonic()

    kills = Counter()
    generation = 0
    while time.monotonic() - started < KILLING_FOR:
        time.sleep(rng.uniform(*KILL_EVERY))  # the chaos schedule, not a wait for a condition
        if _all_terminal(pg):
            break
        index = rng.randrange(len(workers))
        victim = workers[index]
        pools = pool_pids(victim)
        if pools and rng.random() < 0.7:
            os.kill(rng.choice(pools), signal.SIGKILL)  # Celery replaces the pool process
            kills["pool process"] += 1
        else:
            victim.kill()  # the whole worker, main process and pool
            generation += 1
            workers[index] = start_worker(env, tmp_path, f"w{index}g{generation}", concurrency=2)
            processes.append(workers[index])
            kills["whole worker"] += 1

    try:
        wait_until(lambda: _all_terminal(pg), timeout=SETTLE_TIMEOUT, interval=0.5,
                   what="every run to finish")
    except AssertionError:
        _explain_stuck(pg, processes)
        raise
    elapsed = time.monotonic() - started
    statuses = dict(pg.execute("SELECT status, count(*) FROM runs GROUP BY 1").fetchall())
    takeovers = pg.execute("SELECT count(*) FROM step_markers WHERE claims > 1").fetchone()[0]
    resumed = pg.execute("SELECT count(*) FROM outbox WHERE event_type = 'run.resumed'"
                         ).fetchone()[0]
    print(f"\n{CHAOS_RUNS} doc-review runs in {elapsed:.0f}s; kills {dict(kills)}; "
          f"runs {statuses}; {resumed} takeovers of runs, {takeovers} of markers")
    assert sum(kills.values()) >= 5

    # Every run terminal: parents and children alike.
    assert set(statuses) <= {"succeeded", "poisoned"}  # only max_takeovers ends one otherwise

    # Zero markers completed twice: one action.completed event per marker, and
    # every completed marker has one.
    completions = Counter(pg.execute(
        "SELECT run_id, payload->>'entry', payload->>'position' FROM outbox "
        "WHERE event_type = 'action.completed'").fetchall())
    assert [k for k, n in completions.items() if n > 1] == []
    completed_markers = pg.execute(
        "SELECT count(*) FROM step_markers WHERE status = 'completed'").fetchone()[0]
    assert sum(completions.values()) == completed_markers

    # Zero duplicate children: each review entry admitted one child per participant,
    # under the keys its (run, step, entry, position, participant) derive.
    for parent, (participants, rounds) in parents.items():
        status, result = pg.execute("SELECT status, result FROM runs WHERE id = %s",
                                    [parent]).fetchone()
        if status != "succeeded":
            continue
        assert len(result["rounds"]) == rounds + 1
        per_entry = pg.execute(
            "SELECT e.entry_no, array_agg(r.dispatch_key ORDER BY r.dispatch_key) "
            "FROM step_entries e JOIN step_children c ON c.entry_id = e.id "
            "JOIN runs r ON r.id = c.child_run_id WHERE e.run_id = %s GROUP BY 1 ORDER BY 1",
            [parent]).fetchall()
        assert [n for n, _ in per_entry] == [2 * (i + 1) for i in range(rounds + 1)]
        for entry_no, keys in per_entry:
            assert keys == sorted(f"{parent}/review/{entry_no}/2/{p}" for p in participants)
    assert pg.execute(
        "SELECT count(*) FROM runs r WHERE parent_run_id IS NOT NULL AND NOT EXISTS "
        "(SELECT 1 FROM step_children c WHERE c.child_run_id = r.id)").fetchone()[0] == 0


def _explain_stuck(pg, processes) -> None:
    from app.liveness import LIVE_BOOTS_SQL

    rows = pg.execute(
        f"SELECT r.id, r.status, r.parent_run_id IS NOT NULL, r.claimed_by, "
        f"r.claimed_by IN ({LIVE_BOOTS_SQL}), now() - r.last_sent_at, now() - r.updated_at, "
        "(SELECT string_agg(e.entry_no || ':' || e.step_id || ':' || e.status || ':' || "
        "e.children_done || '/' || e.children_total, ' ' ORDER BY e.entry_no) "
        " FROM step_entries e WHERE e.run_id = r.id) "
        "FROM runs r WHERE r.status NOT IN ('succeeded', 'failed', 'cancelled') LIMIT 20"
    ).fetchall()
    print("\nstuck runs (id, status, child, holder, holder live, since sent, since update, "
          "entries):")
    for row in rows:
        print("  ", row)
        print("     events:", [r[0] for r in pg.execute(
            "SELECT event_type FROM outbox WHERE run_id = %s ORDER BY id", [row[0]])])
    for proc in processes[-3:]:
        print(f"--- {proc.name} (last lines)\n" + proc.log()[-3000:])


def _all_terminal(pg) -> bool:
    return pg.execute("SELECT count(*) FROM runs WHERE status NOT IN "
                      "('succeeded', 'failed', 'cancelled')").fetchone()[0] == 0
