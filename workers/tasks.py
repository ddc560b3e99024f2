"""Celery tasks, declared with explicit, stable names."""

from __future__ import annotations

import logging

from celery import shared_task

log = logging.getLogger(__name__)


@shared_task(name="runs.execute")
def execute(run_id: str) -> None:
    """Execute run ``run_id`` (placeholder until claims land)."""
    log.info("received run %s", run_id)


@shared_task(name="runs.repair")
def repair() -> None:
    """Re-send queued runs whose message may be lost (placeholder)."""
