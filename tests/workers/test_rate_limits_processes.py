"""Rate limits on real processes: three workers of four pool processes each, and beat.

The limit is decided in the claim (``poimen_rate_start``): a run that may not start yet gets
its start reserved and holds no worker; the worker that reserved a start less than 2 s
away sends the run for then, beat's timer a later one, when due. The bodies record their own
starts, and those are what the limit is checked against.
"""

from __future__ import annotations

import time

import pytest

from tests.processes import start_beat, start_worker, wait_until

# A bound on the bodies' own timestamps: measured with the machine to itself (tests/lanes.py).
pytestmark = [pytest.mark.slow, pytest.mark.alone]

RUNS = 180
PER_SECOND = 10  # the "rated" workflow's rate_limit, "10/s"


def test_a_rate_limit_holds_across_workers_from_the_bodies_own_starts(
        admit, side_effects, fast_env, pg, tmp_path, processes):
    """180 runs of a "10/s" workflow on 3 workers x 4: in any 1-second window at most 10
    starts (+1 at its edges), about 18 s in all, each run once; a run of another workflow
    admitted meanwhile starts at once (no worker is held by a run waiting for its start)."""
    env = dict(fast_env)
    env.pop("POIMEN_RELEASE_INTERVAL", None)  # beat's default tick, 1 s
    workers = [start_worker(env, tmp_path, f"r{i}", concurrency=4) for i in range(3)]
    processes.extend(workers)
    processes.append(start_beat(env, tmp_path))
    time.sleep(3)  # the processes up before the first run comes
    starts_file = tmp_path / "starts"
    run_ids = [admit("rated", {"customer": "c1", "path": str(starts_file)})
               for _ in range(RUNS)]

    wait_until(lambda: starts_file.exists() and len(starts_file.read_text().splitlines()) >= 50,
               timeout=60, what="the first 50 starts")
    other = admit("effect", {"seconds": 0})
    admitted = time.monotonic()
    wait_until(lambda: side_effects(other, "start") == 1, timeout=10,
               what="a run of another workflow to start")
    other_wait = time.monotonic() - admitted
    reserved = pg.execute("SELECT count(*) FROM runs WHERE id = ANY(%s) AND status = 'queued' "
                          "AND wait_reason = 'rate_limit'", [run_ids]).fetchone()[0]

    wait_until(lambda: pg.execute("SELECT count(*) FROM runs WHERE id = ANY(%s) AND status = "
                                  "'succeeded'", [run_ids]).fetchone()[0] == RUNS,
               timeout=120, interval=0.5, what="every rated run to succeed")

    lines = [line.split() for line in starts_file.read_text().splitlines()]
    assert sorted(run for _, run in lines) == sorted(str(r) for r in run_ids)  # each once
    starts = sorted(float(at) for at, _ in lines)
    busiest = max(sum(1 for t in starts[i:] if t <= start + 1.0)
                  for i, start in enumerate(starts))
    span = starts[-1] - starts[0]
    print(f"busiest 1 s window {busiest} starts; {RUNS} starts over {span:.2f} s; another "
          f"workflow's run started after {other_wait:.2f} s beside {reserved} reserved runs")
    assert busiest <= PER_SECOND + 1, busiest
    assert (RUNS - 1) / PER_SECOND - 0.05 <= span <= (RUNS - 1) / PER_SECOND + 5, span
    assert reserved > 100  # measured while most runs waited for their starts
    assert other_wait < 2.0, other_wait
