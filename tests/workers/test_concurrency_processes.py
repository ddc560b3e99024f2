"""Concurrency keys and tenant caps with real worker processes."""

from __future__ import annotations

from collections import defaultdict

import pytest

from app.state.executor import on_session
from tests.conftest import FAST_TIMINGS
from tests.processes import start_beat, start_worker, wait_until

from .test_execution import wait_status


@pytest.fixture
def log_dir(tmp_path):
    return tmp_path


def intervals(pg, run_ids) -> dict:
    """run id -> (start, finish) from the side-effect table (the database's clock)."""
    spans: dict = defaultdict(dict)
    for run_id, kind, at in pg.execute(
            "SELECT run_id, kind, at FROM side_effects WHERE run_id = ANY(%s)", [list(run_ids)]):
        assert kind not in spans[run_id], f"run {run_id} recorded {kind} twice"
        spans[run_id][kind] = at
    return {run_id: (s["start"], s["finish"]) for run_id, s in spans.items()}


def overlap(a, b) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def most_at_once(spans) -> int:
    """The most intervals open at one instant (an end before a start at the same time)."""
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans],
                   key=lambda edge: (edge[0], edge[1]))
    most = current = 0
    for _, step in edges:
        current += step
        most = max(most, current)
    return most


def started_events(pg, run_ids) -> int:
    return pg.execute("SELECT count(*) FROM outbox WHERE run_id = ANY(%s) "
                      "AND event_type IN ('run.started', 'run.resumed')",
                      [list(run_ids)]).fetchone()[0]


@pytest.mark.processes
def test_runs_of_one_key_never_overlap_and_other_keys_do(admit, side_effects, fast_env, pg,
                                                         log_dir, processes):
    """2 workers x concurrency 4; 40 runs on 3 keys with limit 1. No beat: every wake-up
    comes from the statement that ends the slot's holder."""
    keys = ("a", "b", "c")
    runs = {admit("keyed", {"customer": keys[i % 3], "seconds": 0.3}): keys[i % 3]
            for i in range(40)}
    processes.append(start_worker(fast_env, log_dir, "w1", concurrency=4))
    processes.append(start_worker(fast_env, log_dir, "w2", concurrency=4))
    for run_id in runs:
        wait_status(pg, run_id, {"succeeded"}, timeout=180)

    spans = intervals(pg, runs)
    assert len(spans) == 40
    by_key = defaultdict(list)
    for run_id, key in runs.items():
        by_key[key].append(spans[run_id])
    for key, key_spans in by_key.items():
        key_spans.sort()
        for earlier, later in zip(key_spans, key_spans[1:], strict=False):
            assert earlier[1] <= later[0], f"two runs of key {key} overlapped"
    assert any(overlap(a, b) for a in by_key["a"] for b in by_key["b"] + by_key["c"]), \
        "runs of different keys never ran at once"
    # None was executed and then put back: one start per run, no release.
    assert started_events(pg, runs) == 40
    assert pg.execute("SELECT count(*) FROM outbox WHERE event_type = 'run.released'"
                      ).fetchone()[0] == 0


@pytest.mark.processes
def test_kill_9_of_a_slots_holder_lets_the_next_run_of_its_key_start_within_the_bound(
        admit, side_effects, fast_env, pg, log_dir, processes):
    """The holder's worker dies: its boot's lock goes, and with it the slot once the boot is
    gone. Beat's next repair sees the lock free; the one after the boot is gone (T_c + kill
    + margin later: the server cannot tell a kill from a cut lock whose process still runs
    the body) re-queues the run waiting for it."""
    from lease import dead_after
    from poimenconfig import lease_settings

    bound = 2 * float(FAST_TIMINGS["POIMEN_REPAIR_INTERVAL"]) + dead_after(
        lease_settings(FAST_TIMINGS))
    holder = admit("keyed", {"customer": "k", "seconds": 120})
    victim = start_worker(fast_env, log_dir, "victim")
    processes.append(victim)
    wait_until(lambda: side_effects(holder, "start") == 1, timeout=60, what="the holder to start")

    processes.append(start_worker(fast_env, log_dir, "rescuer", concurrency=2))
    processes.append(start_beat(fast_env, log_dir))
    # Longer than the takeover delay: the holder's run is taken over while it runs.
    nxt = admit("keyed", {"customer": "k", "seconds": 4})
    wait_until(lambda: pg.execute("SELECT status, wait_reason FROM runs WHERE id = %s",
                                  [nxt]).fetchone() == ("waiting", "concurrency"),
               timeout=60, what="the next run to wait for the slot")

    killed_at = pg.execute("SELECT clock_timestamp()").fetchone()[0]
    victim.kill()
    wait_until(lambda: side_effects(nxt, "start") == 1, timeout=60,
               what="the next run of the key to start")
    started = pg.execute("SELECT at FROM side_effects WHERE run_id = %s AND kind = 'start'",
                         [nxt]).fetchone()[0]
    # The bound, plus room for a loaded machine (2 shared cores): still far below the
    # holder's 120 s, which is how long the key would have waited without the rule.
    waited = (started - killed_at).total_seconds()
    assert waited < bound + 5, f"the next run started {waited:.1f}s after the kill"

    # The holder's run, taken over by the rescuer, respects the limit: it waits for the
    # slot (the next run has it) and resumes after it, never beside it.
    wait_status(pg, nxt, {"succeeded"})
    wait_until(lambda: side_effects(holder, "start") == 2, timeout=60,
               what="the holder's run to resume after the next run")
    second_start = pg.execute("SELECT max(at) FROM side_effects WHERE run_id = %s "
                              "AND kind = 'start'", [holder]).fetchone()[0]
    assert second_start >= intervals(pg, [nxt])[nxt][1]
    events = [r[0] for r in pg.execute(
        "SELECT event_type FROM outbox WHERE run_id = %s ORDER BY id", [holder])]
    assert events[:4] == ["run.admitted", "run.started", "run.waiting", "run.woken"], events


@pytest.mark.processes
def test_a_capped_tenants_flood_does_not_hold_another_tenants_run(app, admit, make_tenant,
                                                                  tenant, side_effects,
                                                                  fast_env, pg, log_dir,
                                                                  processes):
    """A tenant capped at 2 with 20 queued runs, and 1 run of another tenant admitted
    after them: the other tenant's run starts at once, not after the flood."""
    from app.admission import admit_run
    from app.extensions import db
    from app.tenant_service import set_max_running

    with app.app_context():
        set_max_running(tenant.name, 2)
    flood = [admit("blind", {"seconds": 1.5}) for _ in range(20)]
    other = make_tenant()
    with app.app_context():
        theirs = admit_run(on_session(db.session), tenant_id=other.id, workflow_ref="blind",
                           input={"seconds": 0.1}).run.id
        db.session.commit()
    processes.append(start_worker(fast_env, log_dir, "w1", concurrency=4))
    wait_status(pg, theirs, {"succeeded"}, timeout=60)
    for run_id in flood:
        wait_status(pg, run_id, {"succeeded"}, timeout=180)

    spans = intervals(pg, [*flood, theirs])
    first_flood_finish = min(spans[r][1] for r in flood)
    # At once: before the first of the flood's runs (1.5 s each) has even finished.
    assert spans[theirs][0] < first_flood_finish
    assert most_at_once([spans[r] for r in flood]) == 2, \
        "the capped tenant's runs ran more (or fewer) at once than its cap"
    assert started_events(pg, flood) == 20



def set_cap_with_the_cli(env, name: str, *args: str) -> str:
    """``flask --app app tenants set NAME ARGS``, as an operator runs it."""
    import subprocess
    import sys

    from tests.processes import ROOT

    proc = subprocess.run([sys.executable, "-m", "flask", "--app", "app", "tenants", "set", name,
                           *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def woken_at(pg, run_ids):
    """When the cap change's transaction woke ``run_ids`` (their ``run.woken`` events)."""
    return pg.execute("SELECT min(created_at) FROM outbox WHERE run_id = ANY(%s) "
                      "AND event_type = 'run.woken'", [list(run_ids)]).fetchone()[0]


def waiting_for_the_cap(pg, run_ids) -> int:
    return pg.execute("SELECT count(*) FROM runs WHERE id = ANY(%s) AND status = 'waiting' "
                      "AND wait_reason = 'tenant_cap'", [list(run_ids)]).fetchone()[0]


@pytest.mark.processes
def test_lifting_a_tenant_cap_starts_its_waiting_runs_at_once(app, admit, tenant, side_effects,
                                                              fast_env, pg, log_dir, processes):
    """Cap 1, three runs: one runs (25 s), two wait for the cap. The operator lifts the
    cap with the CLI: both start beside the first at once (25 s: the CLI's start-up under
    a loaded suite took long enough that an 8 s first run had ended before the lift). No beat: the wake-up is the
    cap change's own (in its transaction), not a repair tick's (10 s by default); without
    it the two would wait for good, since an end wakes nothing under no cap."""
    from app.tenant_service import set_max_running

    with app.app_context():
        set_max_running(tenant.name, 1)
    first = admit("blind", {"seconds": 25})
    waiters = [admit("blind", {"seconds": 0.5}) for _ in range(2)]
    processes.append(start_worker(fast_env, log_dir, "w1", concurrency=3))
    wait_until(lambda: side_effects(first, "start") == 1, timeout=60, what="the first to start")
    wait_until(lambda: waiting_for_the_cap(pg, waiters) == 2, timeout=60,
               what="the other two to wait for the tenant's cap")

    lifted_at = pg.execute("SELECT clock_timestamp()").fetchone()[0]
    out = set_cap_with_the_cli(fast_env, tenant.name, "--no-max-running")
    assert "max running none" in out
    for run_id in waiters:
        wait_status(pg, run_id, {"succeeded"}, timeout=20)
    wait_status(pg, first, {"succeeded"}, timeout=60)

    spans = intervals(pg, [first, *waiters])
    started = max(spans[r][0] for r in waiters)
    # At once: both woken by the cap change's own transaction and started while the first
    # run (25 s) still ran, with no beat and no end to wake them. Measured against the
    # first run rather than in seconds, so a loaded machine cannot fail it.
    woken = woken_at(pg, waiters)
    assert woken is not None and woken >= lifted_at, "the cap change woke none"
    print(f"\nlift: the waiting runs started {(started - woken).total_seconds():.1f}s after "
          "the cap change's transaction")
    assert most_at_once(spans.values()) == 3
    assert started_events(pg, [first, *waiters]) == 3
    assert "(2 waiting run(s) re-queued)" in out  # the command says what it woke


@pytest.mark.processes
def test_raising_a_tenant_cap_starts_as_many_waiting_runs_as_it_freed(app, admit, tenant,
                                                                      side_effects, fast_env,
                                                                      pg, log_dir, processes):
    """Cap 1, seven slow runs: one runs, six wait. The cap goes to 5: four more start at
    once (5 running), the last two wait for an end. No beat: the cap change wakes as many
    as it freed, where ends and repair alone wake one at a time (one run per tenant per
    repair tick: 3 running after 15 s with the default interval)."""
    from app.tenant_service import set_max_running

    with app.app_context():
        set_max_running(tenant.name, 1)
    # The first runs 25 s: the cap is raised while it runs, however long the CLI takes to
    # start on a loaded machine (with 10 s it ended first on the clean clone of 26c502e).
    runs = [admit("blind", {"seconds": 25 if i == 0 else 10}) for i in range(7)]
    processes.append(start_worker(fast_env, log_dir, "w1", concurrency=7))
    wait_until(lambda: side_effects(runs[0], "start") == 1, timeout=60,
               what="the first to start")
    wait_until(lambda: waiting_for_the_cap(pg, runs) == 6, timeout=60,
               what="six runs to wait for the tenant's cap")

    raised_at = pg.execute("SELECT clock_timestamp()").fetchone()[0]
    set_cap_with_the_cli(fast_env, tenant.name, "--max-running", "5")
    wait_until(lambda: side_effects(kind="start") >= 5, timeout=20, what="5 runs running")
    fifth = pg.execute("SELECT at FROM side_effects WHERE kind = 'start' ORDER BY at "
                       "OFFSET 4 LIMIT 1").fetchone()[0]
    # At once: the four were woken by the cap change's transaction and the fifth started
    # before any run ended (an end wakes one run at a time). Measured against the runs'
    # ends rather than in seconds, so a loaded machine cannot fail it.
    woken = woken_at(pg, runs)
    assert woken is not None and woken >= raised_at, "the cap change woke none"
    first_end = pg.execute("SELECT min(at) FROM side_effects WHERE kind = 'finish' "
                           "AND run_id = ANY(%s)", [runs]).fetchone()[0]
    assert first_end is None or fifth < first_end, "the fifth run waited for an end"
    print(f"\nraise: the fifth run started {(fifth - woken).total_seconds():.1f}s after the "
          "cap change's transaction")
    # FIFO: the four oldest waiters went first; the two newest waited for an end. The
    # starts are read with the ends in one statement: on a loaded machine the first run may
    # have ended by now and handed its slot to the sixth, which the change did not wake.
    before_an_end = {row[0] for row in pg.execute(
        "SELECT s.run_id FROM side_effects s WHERE s.kind = 'start' AND s.run_id = ANY(%s) "
        "AND NOT EXISTS (SELECT 1 FROM side_effects e WHERE e.kind = 'finish' "
        "AND e.run_id = ANY(%s) AND e.at <= s.at)", [runs, runs])}
    assert before_an_end == set(runs[:5])

    for run_id in runs:
        wait_status(pg, run_id, {"succeeded"}, timeout=60)
    assert most_at_once(intervals(pg, runs).values()) == 5
    assert started_events(pg, runs) == 7
