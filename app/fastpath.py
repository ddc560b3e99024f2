"""``POST /v1/runs`` answered in front of Flask when the request is plain.

An admission is one statement in Postgres, yet through Flask each one also paid
for a request context and an app context (pushed and popped), URL matching,
``before``/``after_request`` hooks, a werkzeug ``Response`` and its header
processing, and the session teardown of a session it never used: about a third
of the web process's CPU per admission. :class:`FastAdmission` is a WSGI
middleware on ``app.wsgi_app`` (inside Flask's ``__call__``, so gunicorn and the
test client both go through it). It answers ``POST /v1/runs`` itself when the
request is plain and hands everything else to Flask untouched.

Plain means: ``Content-Type: application/json`` with a ``Content-Length`` within
``MAX_CONTENT_LENGTH``, and a bearer token this process has already looked up
and cached (``auth.PrincipalCache``) whose scope allows ``admit``. The work is
the view's own (``admission_handler.admit_request``: the same validation, statement,
replay and refusal rules, and the same answer), on the same engine, and the run reaches
the same sender after its commit. The answer is the view's, byte for byte, a refusal's
too: the body, ``Location``, ``Idempotent-Replayed``, ``X-Request-ID``; the same metrics series
(``poimen_http_requests_total`` and the latency histogram under the route
``/v1/runs``); the log records' ``request_id``, ``tenant``, ``trace_id`` (of a
valid ``traceparent``) and ``dispatch_key``, and the access log's
``request_id``/``tenant``/``run_id`` fields.

Everything else goes to Flask, which answers as it always has: another path or
method, a token not in the cache (Flask looks it up and caches it), another
content type, a body without a length or over the limit (its 413). Once the
body has been read, Flask gets it back as ``wsgi.input``. A refusal (a 400, a 422,
a 409 conflict) is the handler's answer, written here as any other. An error raised
while the fast path works (a database outage) is answered by Flask's own error
handlers, inside a request context made for it. Either way the statement is never
run twice.

Only the app's own Flask, never someone else's: the fast path skips Flask's
hooks and signals, so it serves a request only while nothing but Poimen hooks
it. It does not run foreign hooks itself (a ``before_request`` may expect
``request``, an instrumentation its own ``wsgi_app`` wrapper and span around
the view): a request anything else would see goes through Flask whole. At
install it records the app's own hooks -- ``before_request``,
``after_request``, ``teardown_request``, ``url_value_preprocessors`` (the app's
and the ``/v1/runs`` blueprint's), ``teardown_appcontext``, the receivers of
Flask's request and app-context signals, ``app.wsgi_app`` (itself),
``Flask.__call__`` and the view -- and each ``POST /v1/runs`` compares their
identities and counts (a fixed handful, no import, no walk) with that record.
Any difference hands the request to Flask: a hook or a receiver added after
``create_app`` (a workflow module's allow-list, an extension's CORS, Sentry's
``request_started``), a middleware wrapped around ``app.wsgi_app`` (Sentry's,
OpenTelemetry's ``instrument_app``), ``Flask.__call__`` patched (Sentry's Flask
integration). Anything foreign already there at install (a hook or receiver
whose module is not Poimen's or Flask-SQLAlchemy's, an app instrumented by
OpenTelemetry -- ``opentelemetry-instrument`` instruments Flask itself before
the app exists) keeps every request on Flask for good.

Off (every request through Flask, not installed) when
``POIMEN_ADMISSION_FAST_PATH=0``, when OpenTelemetry or Sentry is configured by
its variables (``SENTRY_DSN``; an OTLP endpoint of any signal,
``OTEL_TRACES_EXPORTER`` or ``OTEL_METRICS_EXPORTER``: ``create_app`` does not
install it), and, per request, when the app's session is not the app's own (a
test's rolled-back transaction).
"""

from __future__ import annotations

import functools
import io
import logging
import time
import weakref

from flask import Flask, g, signals
from flask.helpers import _split_blueprint_path
from werkzeug.datastructures import EnvironHeaders
from werkzeug.http import HTTP_STATUS_CODES

import logconfig

from . import logs, metrics, tracecontext
from .admission_handler import JSON, admit_request
from .auth import ADMIT, TENANT_HEADER, cached_principal
from .enqueue import send_pending
from .extensions import db
from .state.direct import SingleStatements

log = logging.getLogger(__name__)

PATH = "/v1/runs"
_TENANT_KEY = "HTTP_" + TENANT_HEADER.upper().replace("-", "_")

# Flask's per-request hooks, by blueprint (``None``: the app's): run around the view.
HOOKS = ("before_request_funcs", "after_request_funcs", "teardown_request_funcs",
         "url_value_preprocessors")
# The signals Flask sends while it serves a request.
SIGNALS = (signals.request_started, signals.request_finished, signals.got_request_exception,
           signals.request_tearing_down, signals.appcontext_pushed, signals.appcontext_popped,
           signals.appcontext_tearing_down)
# Whose hooks are the app's own: Poimen's package, and Flask-SQLAlchemy's session teardown.
OWN_PACKAGES = frozenset({__name__.partition(".")[0], "flask_sqlalchemy"})
# Flask's own ``__call__`` (Sentry's Flask integration replaces it with its middleware).
FLASK_CALL = ("flask.app", "Flask.__call__")


class FastAdmission:
    """WSGI middleware answering plain ``POST /v1/runs`` requests without Flask."""

    def __init__(self, app: Flask, flask_wsgi):
        self.app = app
        self.flask_wsgi = flask_wsgi
        # db.session as the app made it: a test that swaps in a session of its own
        # (one outer transaction) gets every request through Flask, on that session.
        self.session = db.session
        with app.app_context():
            self.engine = db.engine
        self.send = functools.partial(send_pending, celery_app=app.extensions["celery"])
        self.max_body = app.config.get("MAX_CONTENT_LENGTH")
        self.requests: dict[int, tuple] = {}  # status: (its status line, its counter)
        self.seconds = metrics.HTTP_SECONDS.labels("POST", PATH)
        self.endpoint = app.url_map.bind("").match(PATH, "POST")[0]
        blueprint = self.endpoint.rpartition(".")[0]
        # Flask runs the hooks of the app and of each blueprint the endpoint is under.
        self.scopes = (None, *(_split_blueprint_path(blueprint) if blueprint else ()))
        self.own: tuple | None = None  # what ``record`` saw; None serves nothing

    def record(self) -> None:
        """Record the app's own hooks as they are now (``self`` on ``app.wsgi_app``), or
        None (nothing ever equals it) when something foreign hooks the app already."""
        found = foreign(self.app, self.scopes)
        if found:
            log.info("admission fast path off: the app's requests are hooked by %s",
                     "; ".join(found))
        self.own = None if found else self._hooked()

    def _hooked(self) -> tuple:
        """What hooks the app's requests now: identities and counts, a fixed handful."""
        app = self.app
        return (app.wsgi_app, type(app).__call__, app.view_functions.get(self.endpoint),
                len(app.teardown_appcontext_funcs),
                # HOOKS, spelled out: this runs on every POST /v1/runs.
                [len(hooks.get(scope, ())) for hooks in (
                    app.before_request_funcs, app.after_request_funcs,
                    app.teardown_request_funcs, app.url_value_preprocessors)
                 for scope in self.scopes],
                [len(signal.receivers) for signal in SIGNALS])

    def serves(self) -> bool:
        """True while only the app's own hooks are on its requests (checked per request)."""
        return self._hooked() == self.own

    def __call__(self, environ: dict, start_response):
        if (environ.get("PATH_INFO") != PATH or environ.get("REQUEST_METHOD") != "POST"
                or db.session is not self.session or self._hooked() != self.own):
            return self.flask_wsgi(environ, start_response)
        started = time.perf_counter()
        principal = self._principal(environ)
        body = None if principal is None else self._body(environ)
        if body is None:
            return self.flask_wsgi(environ, start_response)
        rid = logs.request_id_from(environ.get("HTTP_X_REQUEST_ID", ""))
        given = EnvironHeaders(environ)
        trace = tracecontext.from_headers(given) if "HTTP_TRACEPARENT" in environ else None
        # The fields the view's records carry (logs._request_context); ``logs.note`` adds
        # the dispatch key to this context, which ends with the block.
        with logconfig.log_context(request_id=rid, tenant=principal.tenant_name,
                                   trace_id=trace.trace_id if trace is not None else None):
            try:
                answer = admit_request(principal, body, given, started,
                                       SingleStatements(self.engine, self.send),
                                       script_root=environ.get("SCRIPT_NAME", "").rstrip("/"),
                                       note=logs.note)
            except Exception as err:  # noqa: BLE001 - answered by Flask's handlers, as the view's
                return self._flask_answer(environ, start_response, err, principal, rid,
                                          started)
        headers = [("Content-Type", JSON), ("Content-Length", str(len(answer.body))),
                   *answer.headers, ("X-Request-ID", rid)]
        # What gunicorn's access line names (logs.ACCESS_FIELDS), as the Flask path leaves it.
        environ["poimen.request_id"] = rid
        environ["poimen.tenant"] = principal.tenant_name
        if answer.run_id is not None:
            environ["poimen.run_id"] = answer.run_id
        line, counter = self._status(answer.status)
        counter.inc()
        self.seconds.observe(time.perf_counter() - started)
        start_response(line, headers)
        return [answer.body]

    def _status(self, status: int):
        """The status line of ``status`` and its ``poimen_http_requests_total`` series."""
        found = self.requests.get(status)
        if found is None:
            found = self.requests[status] = (
                f"{status} {HTTP_STATUS_CODES.get(status, 'UNKNOWN').upper()}",
                metrics.HTTP_REQUESTS.labels("POST", PATH, str(status)))
        return found

    def _principal(self, environ: dict):
        """The cached principal of the request's bearer token if it may admit, else None."""
        principal = cached_principal(environ.get("HTTP_AUTHORIZATION", ""),
                                     environ.get(_TENANT_KEY))
        return principal if principal is not None and principal.allows(ADMIT) else None

    def _body(self, environ: dict) -> bytes | None:
        """The JSON body of a plain request (given back to ``wsgi.input``), else None."""
        mimetype = environ.get("CONTENT_TYPE", "").partition(";")[0].strip().lower()
        length = environ.get("CONTENT_LENGTH", "")
        if mimetype != "application/json" or not length.isdigit():
            return None
        size = int(length)
        if self.max_body is not None and size > self.max_body:
            return None
        body = environ["wsgi.input"].read(size) if size else b""
        # Flask reads it again if it answers (an error, or a body cut short).
        environ["wsgi.input"] = io.BytesIO(body)
        return body if len(body) == size else None

    def _flask_answer(self, environ: dict, start_response, err: Exception, principal,
                      rid: str, started: float):
        """Flask's answer to ``err`` (raised by the view's work), its hooks included."""
        app = self.app
        with app.request_context(environ):
            g.request_id = rid
            g.principal = principal
            g.poimen_started = started
            try:
                # Called while ``err`` is being handled: with no handler, Flask re-raises it.
                response = app.handle_user_exception(err)
            except Exception as unhandled:  # noqa: BLE001 - Flask's 500
                response = app.handle_exception(unhandled)
            response = app.finalize_request(response)
            return response(environ, start_response)


def _receiver(ref):
    """A signal's receiver: blinker keeps most of them as weak references."""
    return ref() if isinstance(ref, weakref.ref) else ref


def _own(function) -> bool:
    module = getattr(function, "__module__", None) or ""
    return module.partition(".")[0] in OWN_PACKAGES


def foreign(app: Flask, scopes=(None,)) -> list[str]:
    """What hooks ``app``'s requests besides Poimen (and Flask-SQLAlchemy), by name."""
    found = []
    if getattr(app, "_is_instrumented_by_opentelemetry", False):
        found.append("OpenTelemetry's Flask instrumentation")
    call = type(app).__call__
    if (getattr(call, "__module__", None), getattr(call, "__qualname__", None)) != FLASK_CALL:
        found.append(f"{type(app).__name__}.__call__ replaced")
    for hooks in HOOKS:
        for scope in scopes:
            found += [f"{hooks}[{scope}]: {f!r}" for f in getattr(app, hooks).get(scope, ())
                      if not _own(f)]
    found += [f"teardown_appcontext_funcs: {f!r}" for f in app.teardown_appcontext_funcs
              if not _own(f)]
    for signal in SIGNALS:
        found += [f"{signal.name}: {r!r}" for r in map(_receiver, signal.receivers.values())
                  if r is not None and not _own(r)]
    return found


def install(app: Flask) -> None:
    """Put :class:`FastAdmission` in front of ``app``'s Flask dispatch."""
    if not isinstance(app.wsgi_app, FastAdmission):
        app.wsgi_app = middleware = FastAdmission(app, app.wsgi_app)
        middleware.record()


def installed(app: Flask) -> bool:
    return isinstance(app.wsgi_app, FastAdmission)


def serving(app: Flask) -> bool:
    """True if ``app``'s next plain ``POST /v1/runs`` would be answered in front of Flask."""
    middleware = app.wsgi_app
    return isinstance(middleware, FastAdmission) and middleware.serves()
