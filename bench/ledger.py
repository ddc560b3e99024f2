"""Benchmark: what the step-entry ledger costs, end to end and per action.

    python bench/ledger.py [--parents 300] [--participants 3] [--actions 10] [--samples 200]

Two parts, in one invocation, on the same services (a throwaway
``poimen_bench_<id>`` database migrated with ``flask db upgrade``, a Celery
queue ``poimen-bench-<id>``):

1. **End to end.** A ``celery -A workers worker --concurrency 2`` (prefork, as
   the Procfile starts it) executes ``--parents`` ``doc-review`` runs with
   ``--participants`` participants and no rejection: ``draft``, ``review``
   (a marker-bearing action, a plain one, a fan-out of one child per
   participant, a join) and ``approve``, plus the children. Then, with the
   same worker, as many plain single-step ``noop`` runs as the doc-review case
   executed runs in all (parents + children). Runs are admitted in this
   process through ``admit_run`` (batches of 100 per commit, sent after
   commit) while the worker runs; each clock goes from the first admission
   to the moment every run of its case has succeeded (polled every 50 ms).
   Reported: parent runs/s, child runs/s, all runs/s against plain runs/s,
   and worker CPU ms per run.

2. **Ledger overhead per action**, in this process, no worker: ``execute_run``
   (exactly the worker task's body) of single-step workflows of ``k`` no-op
   actions, counting the SQL statements this process sends (SQLAlchemy's
   ``before_cursor_execute``; commits counted apart) and its CPU time
   (``time.process_time``), ``--samples`` runs per workflow:

   * ``plain(k)``: ``k`` plain actions, for k = 1 and 1 + ``--actions``;
   * ``marked(k)``: one plain action and ``k`` marker-bearing ones.

   The per-action cost is the slope between the two ``k``: for a marker-
   bearing action, its claim and its completion (and their commits); for a
   plain one, nothing but the call. The fixed cost of a step with markers
   (its entry is written when entered) is reported apart. Target: a
   marker-bearing action costs <= 2 statements and <= 1 ms of worker CPU.

Needs ``DATABASE_URL`` and ``REDIS_URL`` (``make bench`` sets them). Removes
everything it creates on the way out. Run it on a quiet machine: the end-to-
end rates move with everyone else's load; statements per action do not, and
CPU per action much less.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
import redis as redis_lib  # noqa: E402

from bench._common import (  # noqa: E402
    bench_database,
    libpq_url,
    load_average,
    log_directory,
    machine_summary,
    require_env,
    settle,
    stop_on_sigterm,
)
from bench.execution import (  # noqa: E402
    cpu_delta,
    cpu_snapshot,
    delete_redis_keys,
    wait_for_count,
    wait_ready,
)
from tests.processes import start_worker  # noqa: E402

BATCH = 100


# -- part 1: end to end ---------------------------------------------------------------------

@dataclass
class EndToEnd:
    name: str
    runs: int  # every run of the case (parents and children)
    parents: int
    seconds: float
    worker_cpu_s: float
    load_before: str
    load_after: str

    @property
    def rate(self) -> float:
        return self.runs / self.seconds


def count_succeeded(db_url: str, workflow: str | None = None) -> int:
    sql = "SELECT count(*) FROM runs WHERE status = 'succeeded'"
    params: list = []
    if workflow:
        sql += " AND workflow_name = %s"
        params.append(workflow)
    with psycopg.connect(db_url) as conn:
        return conn.execute(sql, params).fetchone()[0]


def admit_many(flask_app, tenant_id: int, ref: str, input: dict, count: int) -> None:
    from app.admission import admit_run
    from app.extensions import db
    from app.state.executor import on_session

    with flask_app.app_context():
        for start in range(0, count, BATCH):
            for _ in range(min(BATCH, count - start)):
                admit_run(on_session(db.session), tenant_id=tenant_id, workflow_ref=ref,
                          input=input)
            db.session.commit()  # sent to the worker after this commit


def reset(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("TRUNCATE runs, outbox CASCADE")
        conn.execute("VACUUM ANALYZE runs")


def end_to_end(flask_app, tenant_id: int, db_url: str, worker_pgrp: int, name: str, ref: str,
               input: dict, parents: int, runs: int, timeout: float) -> EndToEnd:
    reset(db_url)
    settle(db_url)  # a quiet machine, just after a checkpoint (as every bench case)
    load_before = load_average()
    cpu0 = cpu_snapshot({"worker": worker_pgrp})
    start = time.monotonic()
    sender = threading.Thread(target=admit_many, args=(flask_app, tenant_id, ref, input,
                                                       parents), daemon=True)
    sender.start()
    done = wait_for_count(lambda: count_succeeded(db_url), runs, timeout, name)
    sender.join()
    cpu = cpu_delta(cpu0, cpu_snapshot({"worker": worker_pgrp}))
    return EndToEnd(name, runs, parents, done - start, cpu["worker"], load_before,
                    load_average())


# -- part 2: statements and CPU per action -------------------------------------------------

@dataclass
class Cost:
    name: str
    samples: int
    statements: float  # per run
    commits: float
    cpu_ms: float  # median per run


def _noop(ctx, input):
    return None


def register_probes(actions: int) -> dict[str, str]:
    from workers.registry import Step, Workflow, action, register

    def plain(k: int) -> list:
        return [action(_noop, position=i, name=f"p{i}") for i in range(k)]

    def marked(k: int) -> list:
        return [action(_noop, position=0, name="p0"),
                *(action(_noop, position=i + 1, marker=True, name=f"m{i}") for i in range(k))]

    shapes = {"plain(1)": plain(1), f"plain({1 + actions})": plain(1 + actions),
              "marked(1)": marked(1), f"marked({1 + actions})": marked(1 + actions)}
    refs = {}
    for n, (label, acts) in enumerate(shapes.items()):
        wf = register(Workflow(f"bench-ledger-{n}", "1", steps=[Step("main", actions=acts)]))
        refs[label] = wf.ref
    return refs


def measure(flask_app, tenant_id: int, label: str, ref: str, samples: int) -> Cost:
    from sqlalchemy import event, text

    from app.admission import admit_run
    from app.extensions import db
    from app.state.executor import on_session
    from workers.execution import execute_run

    with flask_app.app_context():
        run_ids = []
        for _ in range(samples):
            run_ids.append(admit_run(on_session(db.session), tenant_id=tenant_id,
                                     workflow_ref=ref, input={}).run.id)
        db.session.commit()
        execute_run(str(run_ids[0]))  # warm: the boot, the pool, the statement caches
        counts: Counter = Counter()

        def on_statement(*_args, **_kwargs):
            counts["statements"] += 1

        def on_commit(*_args, **_kwargs):
            counts["commits"] += 1

        event.listen(db.engine, "before_cursor_execute", on_statement)
        event.listen(db.engine, "commit", on_commit)
        cpu = []
        try:
            for run_id in run_ids[1:]:
                started = time.process_time()
                outcome = execute_run(str(run_id)).outcome.value
                cpu.append((time.process_time() - started) * 1000)
                if outcome != "claimed":
                    raise RuntimeError(f"{label}: run {run_id} was {outcome}")
        finally:
            event.remove(db.engine, "before_cursor_execute", on_statement)
            event.remove(db.engine, "commit", on_commit)
        measured = len(run_ids) - 1
        statuses = dict(db.session.execute(text(
            "SELECT status, count(*) FROM runs WHERE workflow_name = :name GROUP BY 1"),
            {"name": ref.split("@")[0]}).all())
        db.session.rollback()
        if statuses != {"succeeded": samples}:
            raise RuntimeError(f"{label}: runs by status {statuses}")
        return Cost(label, measured, counts["statements"] / measured,
                    counts["commits"] / measured, statistics.median(cpu))


# -- setup and report ------------------------------------------------------------------------

def create_app_for(db_url: str, env: dict[str, str]):
    os.environ.update({k: v for k, v in env.items() if k.startswith(("POIMEN_", "REDIS",
                                                                         "CELERY"))})
    os.environ["DATABASE_URL"] = db_url
    from app import create_app
    from app.tenant_service import create_tenant

    flask_app = create_app()
    with flask_app.app_context():
        tenant = create_tenant("bench")
        return flask_app, tenant.id


def report(e2e: list[EndToEnd], costs: dict[str, Cost], actions: int, participants: int) -> str:
    lines = []
    if e2e:
        lines += ["## End to end", "",
                  "| case | runs (parents) | seconds | runs/s | parents/s | children/s | "
                  "worker CPU ms/run | load before -> after |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in e2e:
            fanout = r.name == "doc-review"
            parents_rate = f"{r.parents / r.seconds:.1f}" if fanout else "-"
            children_rate = f"{(r.runs - r.parents) / r.seconds:.1f}" if fanout else "-"
            lines.append(f"| {r.name} | {r.runs} ({r.parents}) | {r.seconds:.2f} | "
                         f"{r.rate:.1f} | {parents_rate} | {children_rate} | "
                         f"{r.worker_cpu_s * 1000 / r.runs:.2f} | {r.load_before} -> "
                         f"{r.load_after} |")
        by = {r.name: r for r in e2e}
        if "doc-review" in by and "noop" in by:
            lines += ["", f"doc-review ({participants} participants) executes runs at "
                          f"{by['doc-review'].rate / by['noop'].rate:.2f} x the plain rate "
                          "(a parent runs three steps and is claimed twice: before and after "
                          "its join).", ""]
    if not costs:
        return "\n".join(lines)
    lines += ["## Per action (this process, no worker)", "",
              "| workflow | runs | statements/run | commits/run | CPU ms/run (median) |",
              "|---|---|---|---|---|"]
    for c in costs.values():
        lines.append(f"| {c.name} | {c.samples} | {c.statements:.2f} | {c.commits:.2f} | "
                     f"{c.cpu_ms:.3f} |")
    k = 1 + actions
    plain1, plaink = costs["plain(1)"], costs[f"plain({k})"]
    marked1, markedk = costs["marked(1)"], costs[f"marked({k})"]

    def slope(a: Cost, b: Cost, field: str) -> float:
        return (getattr(b, field) - getattr(a, field)) / actions

    marker_stmts = slope(marked1, markedk, "statements")
    marker_cpu = slope(marked1, markedk, "cpu_ms")
    lines += [
        "",
        f"- plain action: {slope(plain1, plaink, 'statements'):+.2f} statements, "
        f"{slope(plain1, plaink, 'cpu_ms'):.3f} ms CPU each",
        f"- marker-bearing action: {marker_stmts:.2f} statements "
        f"(+{slope(marked1, markedk, 'commits'):.2f} commits), {marker_cpu:.3f} ms CPU each "
        f"(target <= 2 statements: {'met' if marker_stmts <= 2.0 + 1e-9 else 'NOT met'}; "
        f"<= 1 ms: {'met' if marker_cpu <= 1.0 else 'NOT met'})",
        f"- a step with markers, once per entry (the entry written when entered): "
        f"{marked1.statements - plain1.statements - marker_stmts:+.2f} statements, "
        f"{marked1.cpu_ms - plain1.cpu_ms - marker_cpu:+.3f} ms CPU",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parents", type=int, default=300, help="doc-review runs")
    parser.add_argument("--participants", type=int, default=3)
    parser.add_argument("--actions", type=int, default=10,
                        help="extra actions in the per-action workflows (the slope's run)")
    parser.add_argument("--samples", type=int, default=200,
                        help="runs per workflow in the per-action part")
    parser.add_argument("--timeout", type=float, default=600.0, help="per case, seconds")
    parser.add_argument("--only", choices=("e2e", "actions"), help="run one part only")
    args = parser.parse_args()

    stop_on_sigterm()
    env = require_env()
    bench_id = uuid.uuid4().hex[:8]
    env.update({
        "PYTHONPATH": str(ROOT),
        "POIMEN_QUEUE": f"poimen-bench-{bench_id}",
        "POIMEN_REPAIR_MIN_AGE": "3600",  # no beat here; keep repair out of the picture
    })
    redis = redis_lib.Redis.from_url(env["REDIS_URL"])
    print(f"machine: {machine_summary(env['DATABASE_URL'])}", flush=True)
    participants = [f"p{i}" for i in range(args.participants)]
    e2e: list[EndToEnd] = []
    costs: dict[str, Cost] = {}

    with contextlib.ExitStack() as stack:
        stack.callback(lambda: print(f"deleted {delete_redis_keys(redis, bench_id)} redis keys",
                                     flush=True))
        log_dir = stack.enter_context(log_directory("poimen-bench-ledger-"))
        db_url = libpq_url(stack.enter_context(bench_database(env["DATABASE_URL"], env)))
        env["DATABASE_URL"] = db_url
        flask_app, tenant_id = create_app_for(db_url, env)

        if args.only != "actions":
            worker = start_worker(env, log_dir, "ledger-bench", concurrency=2)
            stack.callback(worker.stop)
            wait_ready(worker)
            admit_many(flask_app, tenant_id, "noop", {}, 50)  # warm-up
            wait_for_count(lambda: count_succeeded(db_url), 50, args.timeout, "warm-up")
            total = args.parents * (1 + len(participants))
            r = end_to_end(flask_app, tenant_id, db_url, worker.pid, "doc-review",
                           "doc-review", {"participants": participants}, args.parents, total,
                           args.timeout)
            e2e.append(r)
            print(f"doc-review: {r.parents} parents + {r.runs - r.parents} children in "
                  f"{r.seconds:.2f}s", flush=True)
            r = end_to_end(flask_app, tenant_id, db_url, worker.pid, "noop", "noop", {},
                           total, total, args.timeout)
            e2e.append(r)
            print(f"noop: {r.runs} runs in {r.seconds:.2f}s", flush=True)
            worker.stop()

        if args.only != "e2e":
            reset(db_url)
            for label, ref in register_probes(args.actions).items():
                costs[label] = measure(flask_app, tenant_id, label, ref, args.samples + 1)
                c = costs[label]
                print(f"{label}: {c.statements:.2f} statements, {c.commits:.2f} commits, "
                      f"{c.cpu_ms:.3f} ms CPU per run", flush=True)
            from workers.boots import end_current_boot

            end_current_boot()

    print()
    print(report(e2e, costs, args.actions, args.participants))
    return 0


if __name__ == "__main__":
    sys.exit(main())
