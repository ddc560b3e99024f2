"""``POST /v1/runs`` served both ways: through Flask's view, and by the fast path in front
of Flask (``app/fastpath.py``). Both call one handler (``app/admission_handler.py``); the
admission test modules import ``client`` and ``db_session`` from here, so each of their
claims is checked on both.

- ``flask``: the fast path is off (``app.wsgi_app`` is Flask's own, as
  ``POIMEN_ADMISSION_FAST_PATH=0``); ``db_session`` is the usual rolled-back transaction.
- ``fast``: the fast path answers, and the client checks that it did: a JSON
  ``POST /v1/runs`` answered 200, 201, 400, 409 or 422 that reached Flask's dispatch fails
  the test. The fast path runs its statement on the app's engine, so a rolled-back session
  would hide the test's rows from it (and it steps aside for one): here ``db_session`` is
  a session that commits after each statement, on tables emptied before the test. The
  client looks each request's token up first, as Flask would have on its first use, so
  every plain admission finds it cached.
"""

from __future__ import annotations

import pytest
from flask.testing import FlaskClient

from app import fastpath

PATHS = ("flask", "fast")
ADMISSION_ANSWERS = {200, 201, 400, 409, 422}


@pytest.fixture(params=PATHS)
def admission_path(request) -> str:
    return request.param


class FastPathClient(FlaskClient):
    """A test client whose plain admissions must be answered by the fast path."""

    def run_wsgi_app(self, environ, buffered=False):
        from app.auth import TENANT_HEADER, _bearer, hash_token, principal_for
        from app.errors import ApiError

        app = self.application
        token = _bearer(environ.get("HTTP_AUTHORIZATION", ""))
        if token is not None:
            tenant_key = "HTTP_" + TENANT_HEADER.upper().replace("-", "_")
            with app.app_context():
                try:
                    principal_for(hash_token(token), environ.get(tenant_key))
                except ApiError:
                    pass  # not a token: Flask answers it (401)
        middleware = app.wsgi_app
        reached = len(middleware.flask_calls)
        answer = super().run_wsgi_app(environ, buffered)
        status = int(answer[1].split(" ", 1)[0])
        admission = (environ.get("PATH_INFO") == fastpath.PATH
                     and environ.get("REQUEST_METHOD") == "POST"
                     and environ.get("CONTENT_TYPE", "").startswith("application/json"))
        if admission and status in ADMISSION_ANSWERS:
            assert len(middleware.flask_calls) == reached, (
                f"POST /v1/runs ({status}) reached Flask: the fast path did not answer it")
        return answer


@pytest.fixture
def client(app, admission_path, monkeypatch):
    assert fastpath.installed(app), "the fast path is on by default"
    middleware = app.wsgi_app
    if admission_path == "flask":
        monkeypatch.setattr(app, "wsgi_app", middleware.flask_wsgi)
        return app.test_client()
    calls: list[str] = []
    original = middleware.flask_wsgi

    def counted(environ, start_response):
        calls.append(environ.get("PATH_INFO"))
        return original(environ, start_response)

    monkeypatch.setattr(middleware, "flask_wsgi", counted)
    monkeypatch.setattr(middleware, "flask_calls", calls, raising=False)
    return FastPathClient(app, app.response_class, use_cookies=True)


class Committing:
    """A session whose every ``execute`` commits (its rows read first), so what a test
    writes is there for the fast path's own connections."""

    def __init__(self, session):
        self._session = session

    def execute(self, *args, **kwargs):
        result = self._session.execute(*args, **kwargs)
        frozen = result.freeze() if result.returns_rows else None
        self._session.commit()
        return frozen() if frozen is not None else result

    def __getattr__(self, name):
        return getattr(self._session, name)


@pytest.fixture
def db_session(request, app, admission_path):
    """The usual rolled-back ``db_session`` on the Flask path; on the fast path, the app's
    own session committing each statement, on emptied tables."""
    if admission_path == "flask":
        yield request.getfixturevalue("rolled_back_session")
        return
    from app.extensions import db
    from tests.conftest import TABLES, connect

    with connect(request.getfixturevalue("database_url"), autocommit=True) as conn:
        conn.execute(f"TRUNCATE {', '.join(TABLES)} RESTART IDENTITY CASCADE")
    with app.app_context():
        yield Committing(db.session)
        db.session.remove()
