"""Schedules: one run per tick, however many beat processes run.

A workflow declares ``schedule`` (seconds, a ``timedelta``, or a
``celery.schedules.crontab``) and the tenant its runs belong to. Every beat
process looks once a second for each schedule's latest tick
(``workers/ticks.py``) and admits it through the one admission, with the
dispatch key ``schedule:<workflow>:<tick, UTC ISO 8601>``. The key comes from
the *schedule's* tick, never from the beat's clock: two beats (a deploy
overlap, a second dyno) compute the same tick and the same key, and the
partial unique index admits it once. A beat that was down admits, when it
comes back, the most recent tick it missed (``catch_up="last"``, the default)
or nothing older than a moment (``catch_up="none"``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from . import registry
from .ticks import describe, due_tick, tick_key

if TYPE_CHECKING:
    from flask import Flask

log = logging.getLogger(__name__)


def schedule_input(wf: registry.Workflow, tick: datetime) -> dict[str, Any]:
    raw = wf.schedule_input
    value = raw(tick) if callable(raw) else raw
    return dict(value or {})


@dataclass
class Ticker:
    """Admits each schedule's due tick; what a beat process runs once a second."""

    admit: Callable[[registry.Workflow, datetime], bool]
    clock: Callable[[], datetime] = lambda: datetime.now(UTC)

    def __post_init__(self) -> None:
        self.admitted: dict[str, datetime] = {}  # per workflow: the last tick admitted here

    def tick(self) -> int:
        """Admit every schedule's due tick not admitted by this process yet; return how many
        admissions were made (a tick another beat admitted first counts: it was a replay)."""
        now = self.clock()
        made = 0
        for wf in registry.scheduled():
            tick = due_tick(wf.schedule, wf.catch_up, now)
            if tick is None or self.admitted.get(wf.name) == tick:
                continue
            try:
                if self.admit(wf, tick):
                    self.admitted[wf.name] = tick
                    made += 1
            except Exception:  # noqa: BLE001 - one schedule's failure must not stop the others
                log.exception("schedule %s: could not admit tick %s; trying again", wf.name,
                              tick.isoformat())
        return made


def admit_tick(wf: registry.Workflow, tick: datetime) -> bool:
    """Admit ``wf``'s run for ``tick`` through the one admission; True once it exists."""
    from app.admission import AdmissionConflict, admit_run
    from app.extensions import db
    from app.models import AdmissionOrigin
    from app.state.executor import on_session
    from app.tenant_service import UnknownTenant, find_tenant

    assert wf.schedule_tenant is not None  # the registry refuses a schedule without one
    try:
        tenant_id = find_tenant(wf.schedule_tenant).id
    except UnknownTenant:
        db.session.rollback()
        log.warning("schedule %s: tenant %r does not exist; tick %s not admitted", wf.name,
                    wf.schedule_tenant, tick.isoformat())
        return False
    key = tick_key(wf.name, tick)
    try:
        admission = admit_run(on_session(db.session), tenant_id=tenant_id, workflow_ref=wf.name,
                              input=schedule_input(wf, tick), dispatch_key=key,
                              origin=AdmissionOrigin.SCHEDULE, origin_detail=key[:255])
        db.session.commit()
    except AdmissionConflict:
        # Another process admitted this tick with another input (a schedule_input that
        # is not a function of the tick alone): the tick has its run.
        db.session.rollback()
        log.warning("schedule %s: tick %s was admitted with another input", wf.name,
                    tick.isoformat())
        return True
    except Exception:
        db.session.rollback()
        raise
    finally:
        db.session.remove()
    if admission.created:
        log.info("schedule %s: admitted run %s for tick %s", wf.name, admission.run.id,
                 tick.isoformat())
    return True


def start(flask_app: Flask, interval: float = 1.0) -> threading.Thread | None:
    """Start the beat's schedule thread (None when no workflow declares a schedule)."""
    if not registry.scheduled():
        return None
    ticker = Ticker(admit=admit_tick)

    def run() -> None:
        log.info("schedules: %s", ", ".join(f"{wf.name} ({describe(wf.schedule)}, tenant "
                                               f"{wf.schedule_tenant})"
                                               for wf in registry.scheduled()))
        while True:
            with flask_app.app_context():
                ticker.tick()
            time.sleep(interval)

    thread = threading.Thread(target=run, name="poimen-schedules", daemon=True)
    thread.start()
    return thread
