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
the view's own (``api.admit_one``: the same validation, statement, replay and
refusal rules), on the same engine, and the run reaches the same sender after
its commit. The answer is the view's, byte for byte: the body, ``Location``,
``Idempotent-Replayed``, ``X-Request-ID``; the same metrics series
(``poimen_http_requests_total`` and the latency histogram under the route
``/v1/runs``); the access log's ``request_id``/``tenant``/``run_id`` fields.

Everything else goes to Flask, which answers as it always has: another path or
method, a token not in the cache (Flask looks it up and caches it), another
content type, a body without a length or over the limit (its 413). Once the
body has been read, Flask gets it back as ``wsgi.input``. An error raised
while the fast path works (a 422 refusal, a 409 conflict, a database outage)
is answered by Flask's own error handlers, inside a request context made for
it: the statement is never run twice.

Off (every request through Flask) when ``POIMEN_ADMISSION_FAST_PATH=0``, when
the app's session is not the app's own (a test's rolled-back transaction), and
when OpenTelemetry or Sentry is configured (``create_app`` does not install it),
so that their Flask instrumentation sees every request.
"""

from __future__ import annotations

import functools
import io
import time

from flask import Flask, g
from werkzeug.datastructures import EnvironHeaders

import logconfig

from . import logs, metrics
from .admission import dumps
from .api import admit_one, answer_headers, parse_json, serialize_run
from .auth import ADMIT, TENANT_HEADER, cached_principal
from .enqueue import send_pending
from .extensions import db
from .state.direct import SingleStatements

PATH = "/v1/runs"
_TENANT_KEY = "HTTP_" + TENANT_HEADER.upper().replace("-", "_")
_STATUS = {201: "201 CREATED", 200: "200 OK"}


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
        self.requests = {status: metrics.HTTP_REQUESTS.labels("POST", PATH, str(status))
                         for status in _STATUS}
        self.seconds = metrics.HTTP_SECONDS.labels("POST", PATH)

    def __call__(self, environ: dict, start_response):
        if (environ.get("PATH_INFO") != PATH or environ.get("REQUEST_METHOD") != "POST"
                or db.session is not self.session):
            return self.flask_wsgi(environ, start_response)
        started = time.perf_counter()
        principal = self._principal(environ)
        body = None if principal is None else self._body(environ)
        if body is None:
            return self.flask_wsgi(environ, start_response)
        rid = logs.request_id_from(environ.get("HTTP_X_REQUEST_ID", ""))
        try:
            with logconfig.log_context(request_id=rid, tenant=principal.tenant_name):
                admission = admit_one(principal, parse_json(body), EnvironHeaders(environ),
                                      started, SingleStatements(self.engine, self.send))
        except Exception as err:  # noqa: BLE001 - answered by Flask's handlers, as the view's
            return self._flask_answer(environ, start_response, err, principal, rid, started)
        run = admission.run
        payload = (dumps(serialize_run(run, principal.tenant_name), ascii=True) + "\n").encode()
        status = 201 if admission.created else 200
        headers = [("Content-Type", "application/json"), ("Content-Length", str(len(payload))),
                   *answer_headers(admission, environ.get("SCRIPT_NAME", "").rstrip("/")),
                   ("X-Request-ID", rid)]
        # What gunicorn's access line names (logs.ACCESS_FIELDS), as the Flask path leaves it.
        environ["poimen.request_id"] = rid
        environ["poimen.tenant"] = principal.tenant_name
        environ["poimen.run_id"] = str(run.id)
        self.requests[status].inc()
        self.seconds.observe(time.perf_counter() - started)
        start_response(_STATUS[status], headers)
        return [payload]

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


def install(app: Flask) -> None:
    """Put :class:`FastAdmission` in front of ``app``'s Flask dispatch."""
    if not isinstance(app.wsgi_app, FastAdmission):
        app.wsgi_app = FastAdmission(app, app.wsgi_app)


def installed(app: Flask) -> bool:
    return isinstance(app.wsgi_app, FastAdmission)
