"""The one logging setup (``logconfig.py``) wired into Flask and Celery.

* ``init_app``: the web process logs in ``LOG_FORMAT`` at ``LOG_LEVEL``, and a
  record logged while serving a request carries the request's ``request_id``
  (the caller's ``X-Request-ID``, else a new one; echoed on the answer),
  ``tenant`` (its token's), ``run_id`` (the URL's, or the run just admitted)
  and ``dispatch_key``, and ``trace_id`` when a valid W3C ``traceparent`` came with
  it; gunicorn's access line carries its ``request_id``,
  ``tenant`` and ``run_id`` (``app/gunicorn_conf.py``).
* ``init_celery``: the worker, beat and Flower log the same way. Celery's own
  logging setup is replaced through its ``setup_logging`` signal (Celery then
  leaves the loggers alone); ``--loglevel`` is used only when ``LOG_LEVEL`` is
  unset. While a task runs its records carry ``task_id``, and for
  ``runs.execute`` the ``run_id``, the ``trace_id`` of the run's ``traceparent``
  (a header of its message) and, once claimed, the ``tenant``.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import uuid
from collections.abc import Mapping
from typing import Any

from flask import Flask, g, has_request_context, request

import logconfig

from . import tracecontext
from .task_names import EXECUTE_RUN

log = logging.getLogger(__name__)


# -- web ---------------------------------------------------------------------------------------


# The fields of a request that gunicorn's access line carries, under these WSGI environ
# keys (``poimen.tenant``): ids only, never a run's input or a token.
ACCESS_FIELDS = ("request_id", "tenant", "run_id")
ACCESS_PREFIX = "poimen."

# A caller's X-Request-ID is kept when it is short and plain (it goes into every
# log line of the request and back in the answer); anything else is replaced.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def request_id() -> str:
    """The current request's id: the caller's ``X-Request-ID``, or one made for it."""
    rid = g.get("request_id")
    if rid is None:
        rid = g.request_id = request_id_from(request.headers.get("X-Request-ID", ""))
    return rid


def request_id_from(given: str) -> str:
    """The id of a request that sent ``X-Request-ID: given`` (kept if plain, else a new one)."""
    return given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex


def _request_context() -> Mapping[str, Any]:
    if not has_request_context():
        return {}
    fields: dict[str, Any] = {"request_id": request_id()}
    if "_poimen_trace_id" not in g:
        trace = tracecontext.from_headers(request.headers)
        g._poimen_trace_id = trace.trace_id if trace is not None else None
    if g._poimen_trace_id:
        fields["trace_id"] = g._poimen_trace_id
    principal = g.get("principal")
    if principal is not None:
        fields["tenant"] = getattr(principal, "tenant_name", None)
    if request.view_args and request.view_args.get("run_id"):
        fields["run_id"] = request.view_args["run_id"]
    fields.update(g.get("_poimen_log_fields", {}))
    return fields


def note(**fields: Any) -> None:
    """Add ``fields`` to the records of the current request (or of this context)."""
    if has_request_context():
        g._poimen_log_fields = {**g.get("_poimen_log_fields", {}),
                                **{k: v for k, v in fields.items() if v is not None}}
    else:
        logconfig.bind(**fields)


def init_app(app: Flask) -> None:
    """Log the web process's records in ``LOG_FORMAT``; requests add their fields."""
    # force=False: under gunicorn (and the flask CLI) the root logger is ours to
    # set up; inside a program that configured logging already (pytest), not.
    logconfig.configure(force=False)
    logconfig.add_context_source(_request_context)

    @app.after_request
    def _echo_request_id(response):
        # Echoed (or made) on every answer, errors included, so a caller and the
        # logs name the same request; gunicorn's access line carries it too.
        response.headers["X-Request-ID"] = request_id()
        # gunicorn writes its access line after the request context is gone: the
        # fields it names go in the WSGI environ (read by app/gunicorn_conf.py).
        fields = _request_context()
        request.environ.update({f"{ACCESS_PREFIX}{name}": str(fields[name])
                                for name in ACCESS_FIELDS if fields.get(name)})
        return response


# -- Celery ------------------------------------------------------------------------------------

_task_tokens: dict[str, Any] = {}


def _setup_logging(loglevel=None, **_: Any) -> None:
    # Connected receivers make Celery skip its own setup (no hijacked root logger,
    # no second handler); LOG_LEVEL wins over --loglevel.
    logconfig.configure(capture_stdout=True, default_level=loglevel or "INFO")


def _quiet_banner(sender=None, instance=None, **_: Any) -> None:
    # The worker's banner is printed straight to the real stdout, many lines of
    # plain text: in JSON mode its facts are logged instead (one record).
    if instance is not None and logconfig.json_enabled():
        instance.quiet = True
        log.info("celery worker %s starting: concurrency %s, queue %s", sender,
                 getattr(instance, "concurrency", "?"), instance.app.conf.task_default_queue)


def _task_started(task_id=None, task=None, args=None, **_: Any) -> None:
    fields: dict[str, Any] = {"task_id": task_id}
    if task is not None and task.name == EXECUTE_RUN and args:
        fields["run_id"] = args[0]
        # The run's trace context travels as headers of its message (app/enqueue.py).
        request = getattr(task, "request", None)
        trace = tracecontext.from_headers(
            {name: getattr(request, name, None) for name in tracecontext.HEADERS})
        if trace is not None:
            fields["trace_id"] = trace.trace_id
    _task_tokens[task_id] = logconfig.bind(**fields)


def _task_done(task_id=None, **_: Any) -> None:
    token = _task_tokens.pop(task_id, None)
    if token is not None:
        try:
            logconfig.unbind(token)
        except ValueError:  # bound in another context (a thread pool): nothing to undo here
            pass


def _say_as_json(msg: str, f: Any = None) -> None:
    # Celery's signal handlers ("worker: Warm shutdown (MainProcess)") write with a
    # raw os.write, around logging and sys.stdout; in JSON mode they write a record.
    # Also a raw write: a signal handler must not re-enter a buffered stream.
    if not logging.getLogger("celery.worker").isEnabledFor(logging.INFO):
        return
    record = logging.LogRecord("celery.worker", logging.INFO, __file__, 0, "%s", (msg,), None)
    try:
        os.write(2, (logconfig.JsonFormatter().format(record) + "\n").encode())
    except OSError:
        pass


def init_celery() -> None:
    """Log this Celery process (worker, beat, Flower) through ``logconfig``; call at start-up."""
    from celery import signals

    # Now, not only in setup_logging: beat prints its banner before setting up logging.
    logconfig.configure(capture_stdout=True)
    if logconfig.json_enabled():
        import celery.apps.worker

        celery.apps.worker.safe_say = _say_as_json
    signals.setup_logging.connect(_setup_logging, weak=False)
    signals.celeryd_init.connect(_quiet_banner, weak=False)
    signals.task_prerun.connect(_task_started, weak=False)
    signals.task_postrun.connect(_task_done, weak=False)


def tenant_name(tenant_id: int) -> str | None:
    """The name of tenant ``tenant_id`` (cached; None if there is none)."""
    return _tenant_name(tenant_id)


@functools.lru_cache(maxsize=1024)
def _tenant_name(tenant_id: int) -> str | None:
    from sqlalchemy import text

    from .extensions import db

    with db.engine.connect() as conn:
        return conn.execute(text("SELECT name FROM tenants WHERE id = :id"),
                            {"id": tenant_id}).scalar()


def note_tenant(tenant_id: int) -> None:
    """Add the tenant (by name, as the web logs it) to the current task's records."""
    try:
        name = _tenant_name(tenant_id)
    except Exception:  # noqa: BLE001 - a log field must not fail a run
        name = None
    logconfig.bind(tenant=name or tenant_id)
