"""Schedules on real beat processes: one run per tick however many beats run.

``tests/workflows/reuse.py`` registers ``every-few-seconds`` (a 5 s schedule) in
processes whose environment names its tenant. The tick rule itself is tested as a
table in ``test_ticks.py``.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta

from tests.processes import free_port, start_beat, wait_until

PERIOD = 5
PREFIX = "schedule:every-few-seconds:"


def ticks(pg, tenant_id) -> list[datetime]:
    rows = pg.execute("SELECT dispatch_key, origin, input FROM runs WHERE tenant_id = %s "
                      "AND dispatch_key LIKE %s ORDER BY dispatch_key",
                      [tenant_id, PREFIX + "%"]).fetchall()
    for key, origin, payload in rows:
        assert origin == "schedule"
        assert payload["tick"].startswith(key[len(PREFIX):-1])  # schedule_input(tick)
    return [datetime.fromisoformat(key[len(PREFIX):].replace("Z", "+00:00"))
            for key, _, _ in rows]


def consecutive(found: list[datetime]) -> bool:
    return all(b - a == timedelta(seconds=PERIOD) for a, b in zip(found, found[1:], strict=False))


def test_two_beats_admit_one_run_per_tick_and_a_restarted_beat_catches_up_once(
        test_env, tenant, pg, tmp_path, processes):
    env = {**test_env, "POIMEN_WORKFLOW_MODULES": "tests.workflows,tests.workflows.reuse",
           "POIMEN_TEST_SCHEDULE_TENANT": tenant.name,
           "POIMEN_TEST_SCHEDULE_SECONDS": str(PERIOD)}
    beats = [start_beat({**env, "METRICS_PORT": str(free_port())}, tmp_path, name=f"beat-{n}")
             for n in (1, 2)]
    processes.extend(beats)
    wait_until(lambda: ticks(pg, tenant.id), timeout=30, what="the first scheduled run")
    time.sleep(30)
    for beat in beats:
        beat.stop()
    overlap = ticks(pg, tenant.id)
    # One run per tick (the index refuses a second), and none missed while both ran.
    assert len(overlap) >= 30 // PERIOD and consecutive(overlap), overlap
    for beat in beats:
        log = beat.log()
        assert "admitted run" in log or "schedules:" in log, log[-2000:]

    time.sleep(20)  # four ticks pass with no beat
    stopped_at = overlap[-1]
    again = start_beat({**env, "METRICS_PORT": str(free_port())}, tmp_path, name="beat-again")
    processes.append(again)
    wait_until(lambda: len(ticks(pg, tenant.id)) > len(overlap), timeout=30,
               what="the restarted beat's catch-up")
    caught_up = time.time()
    again.stop()
    new = [t for t in ticks(pg, tenant.id) if t > stopped_at]
    # catch_up="last": the missed ticks get one run, the latest one's; nothing between.
    assert new[0] - stopped_at >= timedelta(seconds=20 - PERIOD), (stopped_at, new)
    assert new[0].timestamp() > caught_up - 2 * PERIOD - 2, (new, caught_up)
    assert consecutive(new), new
