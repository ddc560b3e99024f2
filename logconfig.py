"""Logging for every process (web, worker, beat, inbox, outbox), from the environment only.

``LOG_FORMAT=json`` writes one JSON object per line to stderr: ``time``,
``level``, ``logger``, ``message``, ``process``, plus ``tenant``, ``run_id``,
``task_id`` and ``dispatch_key`` where the code that logs knows them (see
``log_context``), and ``traceback`` for a record with an exception. Log drains
(Heroku's, Vector, Loki) parse per line, so nothing spans lines. Anything
else (or unset) keeps the plain one-line text format. ``LOG_LEVEL`` (INFO)
is the level of every process.

A traceback keeps its frames and exception types, never the exceptions'
messages: a message quotes data (a workflow's error quotes its input,
SQLAlchemy's quotes the statement's parameters), and run inputs, results and
SQL parameters must never reach a log line.

This module is stdlib only and lives at the top level, like
``celeryconfig.py``, because ``bridge/`` may import nothing from ``app/`` and
the relays log the same way as the rest. The Flask and Celery wiring is in
``app/logs.py``, gunicorn's in ``app/gunicorn_conf.py``.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

import settings_table

# The fields a record carries when known, in the order a reader scans them.
CONTEXT_FIELDS = ("tenant", "run_id", "task_id", "dispatch_key")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_STANDARD_ATTRS = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message", "asctime", "taskName"}

_context: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar(
    "poimen_log_context", default=None)
# Extra sources of context, e.g. the Flask request's tenant (``app/logs.py``).
_sources: list[Callable[[], Mapping[str, Any]]] = []
_HANDLER_MARK = "_poimen_handler"


def json_enabled(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return settings_table.get_str(env, "LOG_FORMAT").strip().lower() == "json"


def level(env: Mapping[str, str] | None = None, default: str | int | None = None) -> int:
    """``LOG_LEVEL`` as a number (a name like ``debug`` or a number), else ``default`` (else
    the table's)."""
    env = os.environ if env is None else env
    if default is None:
        default = settings_table.default_str("LOG_LEVEL")
    value = (settings_table.raw(env, "LOG_LEVEL") or "").strip() or default
    if isinstance(value, int) or value.isdigit():
        return int(value)
    number = logging.getLevelName(value.upper())
    if not isinstance(number, int):
        raise SystemExit(f"LOG_LEVEL={value!r} is not a logging level (DEBUG, INFO, WARNING, ...)")
    return number


# -- context ---------------------------------------------------------------------------------


@contextlib.contextmanager
def log_context(**fields: Any) -> Iterator[None]:
    """Add ``fields`` (None values ignored) to every record logged inside the block."""
    token = bind(**fields)
    try:
        yield
    finally:
        _context.reset(token)


def bind(**fields: Any) -> contextvars.Token:
    """Add ``fields`` to this context's records until ``unbind(token)``."""
    merged = {**(_context.get() or {}), **{k: str(v) for k, v in fields.items() if v is not None}}
    return _context.set(merged)


def unbind(token: contextvars.Token) -> None:
    _context.reset(token)


def run_with(function: Callable[..., Any], *args: Any, **fields: Any) -> Any:
    """Call ``function(*args)`` with ``fields`` added to its records (a pool thread's job)."""
    with log_context(**fields):
        return function(*args)


def add_context_source(source: Callable[[], Mapping[str, Any]]) -> None:
    """Also take context fields from ``source()`` (called per record; must not raise)."""
    if source not in _sources:
        _sources.append(source)


def current_context() -> dict[str, str]:
    fields: dict[str, str] = {}
    for source in _sources:
        try:
            fields.update({k: str(v) for k, v in source().items() if v is not None})
        except Exception:  # noqa: BLE001 - a log line must never fail over its context
            pass
    fields.update(_context.get() or {})
    return fields


# -- tracebacks without messages -------------------------------------------------------------


_CAUSE = "The above exception was the direct cause of the following exception:"
_CONTEXT = "During handling of the above exception, another exception occurred:"


def quiet_traceback(err: BaseException | None, limit: int = 10) -> str:
    """``err`` and its causes as frames and exception types, without their messages.

    Laid out like Python's own traceback: the first cause first, ``err`` last.
    """
    parts: list[str] = []
    while err is not None and len(parts) < limit:
        code = getattr(getattr(err, "orig", None), "sqlstate", None) or getattr(
            err, "sqlstate", None)
        text = ("Traceback (most recent call last):\n"
                + "".join(traceback.format_tb(err.__traceback__))
                + f"{type(err).__module__}.{type(err).__qualname__}"
                + (f" (SQLSTATE {code})" if code else ""))
        if err.__cause__ is not None:
            link, err = _CAUSE, err.__cause__
        elif err.__context__ is not None and not err.__suppress_context__:
            link, err = _CONTEXT, err.__context__
        else:
            link, err = "", None
        parts.append(text)
        if link:
            parts.append(link)
    if parts and parts[-1] in (_CAUSE, _CONTEXT):
        parts.pop()  # the chain was cut at ``limit``
    return "\n\n".join(reversed(parts))


def _exception(exc_info: Any) -> BaseException | None:
    if isinstance(exc_info, BaseException):
        return exc_info
    if isinstance(exc_info, tuple) and len(exc_info) == 3:
        return exc_info[1]
    return None


# -- formatters ------------------------------------------------------------------------------


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "process": record.processName if record.processName != "MainProcess"
            else os.path.basename(sys.argv[0] or "python"),
            "pid": record.process,
        }
        entry.update(current_context())
        # Fields passed with ``extra=`` (e.g. ``run_id``) win over the context's.
        for key, value in record.__dict__.items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                if key == "data" and isinstance(value, dict) and "traceback" in value:
                    # Celery's task records repeat their traceback, messages included.
                    value = {k: v for k, v in value.items() if k != "traceback"}
                entry[key] = value
        err = _exception(record.exc_info)
        if err is not None:
            entry["exc_type"] = f"{type(err).__module__}.{type(err).__qualname__}"
            entry["traceback"] = quiet_traceback(err)
        if record.stack_info:
            entry["stack"] = record.stack_info
        return json.dumps(entry, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """The plain format, with tracebacks that keep types and frames but not messages."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)
        self._second: tuple[int, str] = (-1, "")  # the last second formatted, and its text

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        # logging's own text, with the seconds part made once a second: ``strftime`` per
        # record was a tenth of a busy worker's logging (a line or two per run).
        if datefmt is not None:
            return super().formatTime(record, datefmt)
        second, text = self._second
        if second != int(record.created):
            second = int(record.created)
            text = time.strftime(self.default_time_format, self.converter(record.created))
            self._second = (second, text)
        return self.default_msec_format % (text, record.msecs)

    def formatException(self, ei) -> str:  # noqa: N802 - logging's name
        return quiet_traceback(_exception(ei))

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        stack = getattr(record, "traceback", None)
        return f"{text}\n{stack}" if stack else text


def formatter() -> logging.Formatter:
    return JsonFormatter() if json_enabled() else TextFormatter()


# -- configuring a process -------------------------------------------------------------------


class _LinesToLog:
    """A text stream that logs each complete line: ``print`` in a JSON process stays JSON."""

    def __init__(self, logger: logging.Logger, original) -> None:
        self._logger = logger
        self._original = original
        self._buffer = ""
        self._lock = threading.Lock()
        self._local = threading.local()

    def write(self, text: str) -> int:
        if getattr(self._local, "busy", False):  # logging about our own write: no loop
            return self._original.write(text)
        with self._lock:
            self._buffer += text
            lines = self._buffer.split("\n")
            self._buffer = lines.pop()
        self._local.busy = True
        try:
            for line in lines:
                if line.strip():
                    self._logger.info("%s", line.rstrip())
        finally:
            self._local.busy = False
        return len(text)

    def flush(self) -> None:
        self._original.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._original.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self._original, "encoding", "utf-8")


def configure(*, force: bool = True, capture_stdout: bool = False,
              default_level: str | int = "INFO") -> None:
    """Log every record of this process to stderr in ``LOG_FORMAT`` at ``LOG_LEVEL``.

    ``force=False`` leaves a root logger that someone else (pytest, an
    embedding program) already configured alone. ``capture_stdout`` turns
    stray ``print`` output into records, in JSON mode only.
    """
    root = logging.getLogger()
    ours = [h for h in root.handlers if getattr(h, _HANDLER_MARK, False)]
    foreign = [h for h in root.handlers if not getattr(h, _HANDLER_MARK, False)]
    if foreign and not force and not ours:
        return
    for handler in ours:
        root.removeHandler(handler)
    if force:
        for handler in foreign:
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.__stderr__)
    handler.setFormatter(formatter())
    setattr(handler, _HANDLER_MARK, True)
    root.addHandler(handler)
    root.setLevel(level(default=default_level))
    # A logger that does not propagate and has no handler of its own (billiard's
    # "multiprocessing": "Process ... exited with ...") ends in logging's last
    # resort, a bare "%(message)s" on stderr: give it this format too.
    last_resort = logging.StreamHandler(sys.__stderr__)
    last_resort.setLevel(logging.WARNING)
    last_resort.setFormatter(formatter())
    logging.lastResort = last_resort
    logging.captureWarnings(True)
    if json_enabled():
        _install_hooks()
        if capture_stdout and not isinstance(sys.stdout, _LinesToLog):
            sys.stdout = _LinesToLog(logging.getLogger("stdout"), sys.stdout)


def _install_hooks() -> None:
    """Uncaught exceptions become records too, not a plain traceback on stderr."""
    def excepthook(kind: type[BaseException], err: BaseException,
                   tb: TracebackType | None) -> None:
        if issubclass(kind, KeyboardInterrupt):
            sys.__excepthook__(kind, err, tb)
            return
        logging.getLogger("uncaught").critical("uncaught %s", kind.__qualname__,
                                               exc_info=(kind, err, tb))

    def thread_excepthook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        logging.getLogger("uncaught").critical(
            "uncaught %s in thread %s", args.exc_type.__qualname__,
            args.thread.name if args.thread else "?",
            exc_info=(args.exc_type, args.exc_value, args.exc_traceback))

    sys.excepthook = excepthook
    threading.excepthook = thread_excepthook


def style(handler: logging.Handler) -> None:
    """Give another library's handler (gunicorn's) this process's format."""
    handler.setFormatter(formatter())
