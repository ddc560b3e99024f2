"""A cascading cancel on real processes: a parent with 20 children in every state.

A worker and beat run; the parent runs, and its children are running, queued in Redis,
delayed, and waiting for a concurrency slot when the cancel is answered. None of them
starts after the answer: those not started are cancelled, the running ones stop at their
next checkpoint.
"""

from __future__ import annotations

import time

import pytest

from tests.processes import start_beat, start_worker, wait_until

pytestmark = pytest.mark.slow


def test_a_cancel_of_a_parent_with_20_children_in_every_state_lets_none_start_after_it(
        admit, client, tenant, side_effects, fast_env, pg, tmp_path, processes):
    processes.append(start_worker(fast_env, tmp_path, "c", concurrency=4))
    processes.append(start_beat(fast_env, tmp_path))
    parent = admit("effect", {"seconds": 60})
    wait_until(lambda: side_effects(parent, "start") == 1, timeout=60, what="the parent")

    def count(status: str) -> int:
        return pg.execute("SELECT count(*) FROM runs WHERE parent_run_id = %s AND status = %s",
                          [parent, status]).fetchone()[0]

    # One keyed run holds the slot (no checkpoint: it sleeps), four wait for it.
    keyed = [admit("keyed", {"customer": "c", "seconds": 8}, parent_run_id=parent)
             for _ in range(5)]
    wait_until(lambda: count("waiting") == 4, timeout=60, what="four runs behind the slot")
    # Two of these run (every pool process then busy), three wait in Redis.
    running = [admit("effect", {"seconds": 60}, parent_run_id=parent) for _ in range(5)]
    delayed = [admit("effect", {}, parent_run_id=parent, delay_seconds=30) for _ in range(5)]
    queued = [admit("effect", {}, parent_run_id=parent) for _ in range(5)]
    children = keyed + running + delayed + queued
    wait_until(lambda: count("running") == 3, timeout=60, what="every pool process busy")
    time.sleep(0.5)

    before = dict(pg.execute(
        "SELECT CASE WHEN not_before > now() THEN 'delayed' ELSE status END, count(*) "
        "FROM runs WHERE parent_run_id = %s GROUP BY 1", [parent]).fetchall())
    assert before == {"running": 3, "waiting": 4, "queued": 8, "delayed": 5}, before
    answer = client.post(f"/v1/runs/{parent}/cancel", headers=tenant.headers)
    answered = pg.execute("SELECT clock_timestamp()").fetchone()[0]
    # The parent checks for its cancel every 50 ms: by the answer, which follows the
    # whole cascade, it may have stopped already.
    assert (answer.status_code, answer.json["status"]) in ((202, "running"), (200, "cancelled"))
    # By the answer every child was cancelled or asked to stop (the running ones check every
    # 50 ms and may have stopped already), or it had started before the answer: a worker a
    # stopped run freed may take a sibling the cascade had not reached yet.
    states = pg.execute(
        "SELECT status, cancel_requested, started_at < %s, count(*) FROM runs "
        "WHERE parent_run_id = %s GROUP BY 1, 2, 3", [answered, parent]).fetchall()
    assert all(flagged or started_before for _, flagged, started_before, _ in states), states
    assert sum(n for status, _, _, n in states if status == "cancelled") >= 12, states
    # The header counts the children the cascade reached: each cancelled or flagged by the
    # answer. The parent, asked to stop first, frees its pool process at its next
    # checkpoint: a queued sibling it takes and runs to its end before the cascade comes
    # to it (it started before the answer, as asserted above) is not reached.
    escaped = sum(n for status, flagged, _, n in states if not flagged and status != "cancelled")
    assert escaped <= 2, states
    assert int(answer.headers["Poimen-Cancelled-Descendants"]) == 20 - escaped, states

    # Past the delays, with the pool processes freed by the checkpoints.
    wait_until(lambda: pg.execute(
        "SELECT count(*) FROM runs WHERE id = ANY(%s) AND status NOT IN ('running', 'queued', "
        "'waiting')", [[parent, *children]]).fetchone()[0] == 21, timeout=90, interval=0.5,
        what="the parent and every child to end")
    time.sleep(5)  # any message still in Redis delivered (and refused) meanwhile
    late = pg.execute("SELECT count(*) FROM side_effects WHERE kind = 'start' AND at > %s",
                      [answered]).fetchone()[0]
    assert late == 0, "a run started after the cancel's answer"
    late_claims = pg.execute("SELECT count(*) FROM runs WHERE id = ANY(%s) AND started_at > %s",
                             [children, answered]).fetchone()[0]
    assert late_claims == 0
    ends = dict(pg.execute("SELECT status, count(*) FROM runs WHERE id = ANY(%s) "
                           "GROUP BY status", [children]).fetchall())
    # Every child ended cancelled but the keyed slot holder, which has no checkpoint
    # (it sleeps) and ends as its body does, and any sibling that escaped the cascade.
    assert ends.get("cancelled", 0) >= 19 - escaped, ends
    assert pg.execute("SELECT status FROM runs WHERE id = %s", [parent]).fetchone()[0] \
        == "cancelled"
