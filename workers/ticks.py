"""Schedule ticks: when a workflow's schedule fires, computed the same in every process.

A number of seconds ``S`` (or a ``timedelta``) ticks at the multiples of ``S``
since the Unix epoch (UTC), so every process agrees without talking; a
``celery.schedules.crontab`` ticks at the minutes it names, in UTC. Pure: no
database, no Celery app (``workers/schedules.py`` admits the ticks).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from typing import Any

KEY_PREFIX = "schedule:"
# How late a tick may be seen and still count as due under catch_up="none".
NONE_TOLERANCE = timedelta(seconds=3)
_CRON_SEARCH_DAYS = 366 * 8  # a 29 February on a given weekday recurs within 28 years: enough


def _crontab_class() -> Any:
    from celery.schedules import crontab

    return crontab


def interval_of(schedule: Any) -> float | None:
    """A fixed schedule's period in seconds (None for a crontab)."""
    if isinstance(schedule, timedelta):
        return schedule.total_seconds()
    if isinstance(schedule, (int, float)) and not isinstance(schedule, bool):
        return float(schedule)
    return None


def check_schedule(schedule: Any) -> str | None:
    """Why ``schedule`` is not a schedule Poimen runs, or None."""
    period = interval_of(schedule)
    if period is not None:
        if not period >= 1 or not math.isfinite(period):
            return f"schedule must be at least 1 second, not {schedule!r}"
        return None
    if isinstance(schedule, _crontab_class()):
        return None
    return f"schedule must be seconds, a timedelta or a celery crontab, not {schedule!r}"


def describe(schedule: Any) -> str:
    period = interval_of(schedule)
    if period is not None:
        return f"every {period:g}s"
    fields = (schedule._orig_minute, schedule._orig_hour, schedule._orig_day_of_month,
              schedule._orig_month_of_year, schedule._orig_day_of_week)
    return "crontab " + " ".join(str(f) for f in fields)


def last_tick(schedule: Any, now: datetime) -> datetime:
    """The schedule's latest tick at or before ``now`` (aware, UTC)."""
    now = now.astimezone(UTC)
    period = interval_of(schedule)
    if period is not None:
        return datetime.fromtimestamp(math.floor(now.timestamp() / period) * period, UTC)
    for day, hours in _cron_days(schedule, now, backwards=True):
        for hour in hours:
            latest = now.minute if (day, hour) == (now.date(), now.hour) else 59
            minutes = [m for m in schedule.minute if m <= latest]
            if minutes:
                return datetime(day.year, day.month, day.day, hour, max(minutes), tzinfo=UTC)
    raise ValueError(f"{describe(schedule)} has no tick in the last {_CRON_SEARCH_DAYS} days")


def next_tick(schedule: Any, now: datetime) -> datetime:
    """The schedule's first tick after ``now`` (aware, UTC)."""
    now = now.astimezone(UTC)
    period = interval_of(schedule)
    if period is not None:
        return datetime.fromtimestamp((math.floor(now.timestamp() / period) + 1) * period, UTC)
    for day, hours in _cron_days(schedule, now, backwards=False):
        for hour in hours:
            earliest = now.minute + 1 if (day, hour) == (now.date(), now.hour) else 0
            minutes = [m for m in schedule.minute if m >= earliest]
            if minutes:
                return datetime(day.year, day.month, day.day, hour, min(minutes), tzinfo=UTC)
    raise ValueError(f"{describe(schedule)} has no tick in the next {_CRON_SEARCH_DAYS} days")


def _cron_days(cron: Any, now: datetime, *, backwards: bool) -> Iterator[tuple[date, list[int]]]:
    """Days the crontab runs on, from ``now``'s day on, with their hours (nearest first)."""
    step = -1 if backwards else 1
    for offset in range(_CRON_SEARCH_DAYS):
        day = now.date() + timedelta(days=step * offset)
        # celery's day_of_week counts from Sunday = 0; Python's weekday() from Monday = 0.
        if day.month not in cron.month_of_year or day.day not in cron.day_of_month \
                or (day.weekday() + 1) % 7 not in cron.day_of_week:
            continue
        if backwards:
            hours = sorted((h for h in cron.hour if day < now.date() or h <= now.hour),
                           reverse=True)
        else:
            hours = sorted(h for h in cron.hour if day > now.date() or h >= now.hour)
        yield day, hours


def tick_key(workflow_name: str, tick: datetime) -> str:
    """The dispatch key of ``workflow_name``'s run for ``tick``: the same in every beat."""
    return f"{KEY_PREFIX}{workflow_name}:{tick.astimezone(UTC).strftime('%Y-%m-%dT%H:%M:%SZ')}"


def due_tick(schedule: Any, catch_up: str, now: datetime) -> datetime | None:
    """The tick to admit now, or None (``catch_up="none"`` and the latest tick is old)."""
    tick = last_tick(schedule, now)
    if catch_up == "none" and now - tick > NONE_TOLERANCE:
        return None
    return tick
