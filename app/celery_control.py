"""Celery's remote control, with ``revoke`` of a run id recorded in Postgres when it is issued.

Celery keeps revoked ids only in each worker's memory (``--statedb`` aside): a
run revoked while its message waits in the queue ran and succeeded after the
next full worker restart, which every Heroku deploy is, and the API never
showed the revoke. Every revoke this app sends (``celery -A workers control
revoke``, ``app.control.revoke``, Flower's buttons) goes through
``broadcast``; this subclass records each run id's cancel first, through the
API's cancel path (``app/state/runs.py: cancel_run``), so it survives restarts and
shows in ``GET /v1/runs/<id>`` at once. The broadcast follows as before: the
workers that receive it stop the run now (``--terminate``) instead of at its
next checkpoint.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable

from celery.app.control import Control

log = logging.getLogger(__name__)


class RunControl(Control):
    def broadcast(self, command, arguments=None, *args, **kwargs):
        if command == "revoke" and arguments:
            record_revokes(self.app.flask_app, arguments.get("task_id"))
        return super().broadcast(command, arguments, *args, **kwargs)


def record_revokes(flask_app, task_ids: str | Iterable[str] | None) -> list[uuid.UUID]:
    """Cancel every run among ``task_ids`` (a run's task id is its run id); return them.

    Ids that are no run (another task's, malformed) are left to Celery alone.
    """
    from app.extensions import db
    from app.run_service import tenant_of
    from app.state.executor import on_session
    from app.state.runs import cancel_run

    if task_ids is None:
        return []
    ids = [task_ids] if isinstance(task_ids, str) else list(task_ids)
    cancelled = []
    with flask_app.app_context():
        try:
            for raw in ids:
                try:
                    run_id = uuid.UUID(str(raw))
                except ValueError:
                    continue
                tenant_id = tenant_of(db.session, run_id)
                if tenant_id is None:
                    continue
                cancel_run(on_session(db.session), tenant_id, run_id)
                cancelled.append(run_id)
            db.session.commit()
        except Exception:
            db.session.rollback()
            log.exception("revoke: the cancel of %s could not be recorded; nothing was sent "
                          "(run the command again)", ids)
            raise
        finally:
            db.session.remove()
    if cancelled:
        log.info("revoke: cancel recorded for run(s) %s", ", ".join(map(str, cancelled)))
    return cancelled
