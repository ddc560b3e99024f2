"""gunicorn settings of ``web``: metrics summed over its workers, and its log format.

The Procfile runs ``gunicorn -c python:app.gunicorn_conf ...``: a module of the
package, so a checkout and an installed wheel load the same settings. Command-line
flags (bind, workers, threads, timeouts) win over anything here.

* Metrics: each gunicorn worker is its own process with its own counters; a
  scrape of ``/metrics`` reaches one of them. prometheus_client's multiprocess
  mode makes every worker write its values to files under
  ``PROMETHEUS_MULTIPROC_DIR`` and ``/metrics`` sum them. Unset, a private
  directory is made here (before any worker imports prometheus_client) and
  removed on exit; set, it is emptied of an earlier run's files at start. A
  worker that exits is marked dead (``child_exit``) so its live gauges go.
* Telemetry: OpenTelemetry and Sentry, when configured (``app/telemetry.py``),
  start in each worker once it has loaded the app (``post_worker_init``).
* Prepared statements (``POIMEN_DB_PREPARE_THRESHOLD=auto``): each worker turns
  them on once it has checked that ``DATABASE_URL`` is direct (``post_worker_init``).
* Logs: gunicorn's own error and access logs use ``LOG_FORMAT`` (``json``: one
  object per line) and ``LOG_LEVEL``, like every other process (``logconfig.py``).
  An access line names the request's ``request_id``, ``tenant`` and ``run_id``
  (in the text, and as fields of the JSON record).
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Mapping

from gunicorn.glogging import Logger

# Names here that match gunicorn settings are read as settings: keep imports private.
import logconfig as _logs

_OWN_DIR = "POIMEN_GUNICORN_METRICS_DIR"  # the directory this file made (kept across reloads)

if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    os.environ[_OWN_DIR] = tempfile.mkdtemp(prefix="poimen-metrics-web-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = os.environ[_OWN_DIR]

_logs.configure()

# The app's config reads it (poimenconfig.py): a gunicorn worker's pool holds
# WEB_DB_CONNECTIONS, however many threads it has (a thread waiting on a run, ?wait=,
# holds none).
os.environ["POIMEN_WEB_PROCESS"] = "1"


def on_starting(server) -> None:
    # An operator-provided directory may hold a previous run's files, whose
    # counters would be added to this run's.
    directory = os.environ["PROMETHEUS_MULTIPROC_DIR"]
    os.makedirs(directory, exist_ok=True)
    if directory != os.environ.get(_OWN_DIR):
        for path in glob.glob(os.path.join(directory, "*.db")):
            os.remove(path)


def post_worker_init(worker) -> None:
    # Each gunicorn worker is a process of its own: OpenTelemetry's export thread and
    # Sentry's start in it, once the app is loaded (off unless configured).
    from app.extensions import prepare_if_direct
    from app.telemetry import init_web

    init_web(worker.wsgi)
    # POIMEN_DB_PREPARE_THRESHOLD=auto: prepared statements where DATABASE_URL is direct.
    prepare_if_direct(worker.wsgi)


def child_exit(server, worker) -> None:
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)


def on_exit(server) -> None:
    own = os.environ.get(_OWN_DIR)
    if own and own == os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        shutil.rmtree(own, ignore_errors=True)


class PoimenLogger(Logger):
    """gunicorn's logs in this process's ``LOG_FORMAT``, at ``LOG_LEVEL`` when set."""

    def setup(self, cfg) -> None:
        super().setup(cfg)
        if os.environ.get("LOG_LEVEL"):
            # The access log's records are INFO: LOG_LEVEL=WARNING silences them too.
            self.error_log.setLevel(_logs.level())
            self.access_log.setLevel(_logs.level())
        for log in (self.error_log, self.access_log):
            for handler in log.handlers:
                _logs.style(handler)

    def access(self, resp, req, environ, request_time) -> None:
        if not self.access_log_enabled:
            return
        # Under LOG_FORMAT=json the request's ids are the record's own fields, as on
        # the app's records of that request (app/logs.py left them in the environ).
        fields = {name: environ.get(f"poimen.{name}") for name in _ACCESS_FIELDS}
        with _logs.log_context(**fields):
            try:
                self.access_log.info(self.cfg.access_log_format,
                                     LazyAtoms(self, resp, req, environ, request_time))
            except Exception:  # noqa: BLE001 - as gunicorn's own access()
                self.error(traceback.format_exc())


_MISSING = object()


def _status(a):
    status = a._resp.status
    return status.split(None, 1)[0] if isinstance(status, str) else status


def _sent(a):
    return getattr(a._resp, "sent", None)


class LazyAtoms(Mapping):
    """gunicorn's access-log atoms, each made when the format asks for it.

    gunicorn's ``Logger.access`` builds every atom of every request, all request and
    response headers and the whole WSGI environ included, then copies them into its
    ``SafeAtoms``: a third of an access line's CPU for the eight the format uses.
    The values and rules are ``SafeAtoms``' (``"`` escaped, ``-`` for an atom or a
    ``{name}i/o/e`` that is not there, those names case-insensitive);
    ``tests/deploy/test_access_log.py`` compares the two atom by atom.
    """

    __slots__ = ("_logger", "_resp", "_req", "_environ", "_time")

    # gunicorn.glogging.Logger.atoms, letter by letter.
    LETTERS = {
        "h": lambda a: a._environ.get("REMOTE_ADDR", "-"),
        "l": lambda a: "-",
        "u": lambda a: a._logger._get_user(a._environ) or "-",
        "t": lambda a: time.strftime("[%d/%b/%Y:%H:%M:%S %z]"),
        "r": lambda a: " ".join((a._environ["REQUEST_METHOD"], a._environ["RAW_URI"],
                                 a._environ["SERVER_PROTOCOL"])),
        "s": _status,
        "m": lambda a: a._environ.get("REQUEST_METHOD"),
        "U": lambda a: a._environ.get("PATH_INFO"),
        "q": lambda a: a._environ.get("QUERY_STRING"),
        "H": lambda a: a._environ.get("SERVER_PROTOCOL"),
        "b": lambda a: _sent(a) is not None and str(_sent(a)) or "-",
        "B": _sent,
        "f": lambda a: a._environ.get("HTTP_REFERER", "-"),
        "a": lambda a: a._environ.get("HTTP_USER_AGENT", "-"),
        "T": lambda a: a._time.seconds,
        "D": lambda a: a._time.seconds * 1000000 + a._time.microseconds,
        "M": lambda a: a._time.seconds * 1000 + int(a._time.microseconds / 1000),
        "L": lambda a: f"{a._time.seconds:d}.{a._time.microseconds:06d}",
        "p": lambda a: f"<{os.getpid()}>",
    }

    def __init__(self, logger, resp, req, environ, request_time):
        self._logger, self._resp, self._req = logger, resp, req
        self._environ, self._time = environ, request_time

    def __getitem__(self, key: str):
        value = self._value(key)
        if value is _MISSING:
            return "-"
        return value.replace('"', '\\"') if isinstance(value, str) else value

    def __iter__(self):
        return iter(self.LETTERS)

    def __len__(self) -> int:  # a record takes a non-empty mapping as its arguments
        return len(self.LETTERS)

    def _value(self, key: str):
        if key.startswith("{"):
            key = key.lower()
            name, kind = key[1:-2], key[-2:]
            if kind == "}e":
                pairs = self._environ.items()
            elif kind == "}i":
                pairs = getattr(self._req, "headers", self._req)
                pairs = pairs.items() if hasattr(pairs, "items") else pairs
            elif kind == "}o":
                pairs = self._resp.headers
                pairs = pairs.items() if hasattr(pairs, "items") else pairs
            else:
                return _MISSING
            found = _MISSING
            for k, v in pairs:  # the last of a repeated name, as gunicorn's dict keeps it
                if k.lower() == name:
                    found = v
            return found
        atom = self.LETTERS.get(key)
        return _MISSING if atom is None else atom(self)


_ACCESS_FIELDS = ("request_id", "tenant", "run_id")  # app/logs.py ACCESS_FIELDS

logger_class = PoimenLogger
# gunicorn's default access line, plus the request's id (the X-Request-ID the app
# echoes), tenant and run id (when the request names or admits one; "-" otherwise),
# so an access line and the app's records of one request can be joined.
access_log_format = ('%(h)s %(l)s %(u)s %(t)s "%(r)s" %(s)s %(b)s "%(f)s" "%(a)s" '
                     'request_id=%({x-request-id}o)s tenant=%({poimen.tenant}e)s '
                     'run_id=%({poimen.run_id}e)s')
