"""Schedule ticks (workers/ticks.py) and the beat's ticker (workers/schedules.py), as tables.

The rule: a tick's dispatch key comes from the schedule's tick, never from a beat's
clock, so any number of beats compute the same key for one tick.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from celery.schedules import crontab

from workers import registry
from workers.registry import InvalidDefinition, Step, Workflow, action
from workers.schedules import Ticker
from workers.ticks import check_schedule, due_tick, last_tick, next_tick, tick_key


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


@pytest.mark.parametrize("schedule, now, last, nxt", [
    (5, "2026-12-01T10:00:02.900", "2026-12-01T10:00:00", "2026-12-01T10:00:05"),
    (5, "2026-12-01T10:00:05", "2026-12-01T10:00:05", "2026-12-01T10:00:10"),
    (timedelta(hours=1), "2026-12-01T10:59:59", "2026-12-01T10:00:00", "2026-12-01T11:00:00"),
    (crontab(minute="*/15"), "2026-12-01T10:07:30", "2026-12-01T10:00:00",
     "2026-12-01T10:15:00"),
    (crontab(minute=0, hour=9), "2026-12-01T08:30:00", "2026-11-30T09:00:00",
     "2026-12-01T09:00:00"),
    # 2026-12-01 is a Tuesday: Monday 09:00 was yesterday, the next one in six days.
    (crontab(minute=0, hour=9, day_of_week="mon"), "2026-12-01T10:00:00",
     "2026-11-30T09:00:00", "2026-12-07T09:00:00"),
    (crontab(minute=30, hour=0, day_of_month=1, month_of_year=1), "2026-12-01T10:00:00",
     "2026-01-01T00:30:00", "2027-01-01T00:30:00"),
])
def test_last_and_next_tick(schedule, now, last, nxt):
    assert last_tick(schedule, at(now)) == at(last)
    assert next_tick(schedule, at(now)) == at(nxt)


def test_two_beats_a_moment_apart_compute_one_key_for_one_tick():
    """The deterministic witness: clocks 0.4 s apart on either side of a second."""
    a, b = at("2026-12-01T10:00:02.900"), at("2026-12-01T10:00:03.300")
    assert tick_key("report", due_tick(5, "last", a)) == \
        tick_key("report", due_tick(5, "last", b)) == "schedule:report:2026-12-01T10:00:00Z"


def test_catch_up_last_admits_the_latest_missed_tick_and_none_skips_it():
    back = at("2026-12-01T10:00:21")  # down since 10:00:00; ticks 5, 10, 15, 20 missed
    assert due_tick(5, "last", back) == at("2026-12-01T10:00:20")
    assert due_tick(5, "none", back) == at("2026-12-01T10:00:20")  # 1 s late: still due
    assert due_tick(60, "none", at("2026-12-01T10:00:21")) is None  # 21 s late: skipped


@pytest.mark.parametrize("schedule", [0, 0.5, -5, "5", None, float("inf")])
def test_a_schedule_must_be_seconds_or_a_crontab(schedule):
    assert check_schedule(schedule) is not None


def _scheduled(name: str, **kwargs) -> Workflow:
    return registry.register(Workflow(
        name, "1", [Step("main", actions=[action(lambda ctx, input: input, position=0)])],
        **kwargs))


def test_a_schedule_needs_its_tenant():
    with pytest.raises(InvalidDefinition, match="schedule_tenant"):
        Workflow("sched-no-tenant", "1",
                 [Step("main", actions=[action(lambda ctx, input: None, position=0)])],
                 schedule=5)


def test_the_ticker_admits_each_tick_once_per_process_and_again_after_a_failure():
    wf = _scheduled("ticker-test", schedule=5, schedule_tenant="t")
    now = [at("2026-12-01T10:00:01")]
    admitted, fail = [], [True]

    def admit(workflow, tick):
        if workflow is not wf:
            return True  # another test's scheduled workflow
        if fail[0]:
            fail[0] = False
            raise RuntimeError("database away")
        admitted.append(tick_key(workflow.name, tick))
        return True

    ticker = Ticker(admit=admit, clock=lambda: now[0])
    ticker.tick()  # fails: tried again on the next tick
    for second in ("01.5", "02", "04.9", "05.1", "09"):
        now[0] = at(f"2026-12-01T10:00:{second}")
        ticker.tick()
    assert admitted == ["schedule:ticker-test:2026-12-01T10:00:00Z",
                        "schedule:ticker-test:2026-12-01T10:00:05Z"]
