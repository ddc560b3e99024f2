"""The runs console: server-rendered pages under ``/console`` for people.

One tenant at a time, signed in with a tenant token. The token itself never
leaves the server after sign-in: the session cookie (signed with
``POIMEN_CONSOLE_SECRET``, ``HttpOnly``, ``SameSite=Strict``, path
``/console``) keeps only its SHA-256, and every request checks it through
``app.auth.principal_for``, the API's own token check. Reads, cancel and
re-drive call the same functions as the API (``app/run_service.py``,
``app/admission.py``). Rules and settings: ``docs/guide/console.md``.
"""

from __future__ import annotations

from flask import Flask, Request
from flask.sessions import SecureCookieSessionInterface

# Below this many characters a signing secret is a password, not a key.
MIN_SECRET_LEN = 32
PREFIX = "/console"


class ConsoleSessionInterface(SecureCookieSessionInterface):
    """Flask's signed-cookie session, opened only for ``/console`` requests.

    The API stays stateless (a bearer token per request, no cookie read), and
    the cookie is ``Secure`` whenever the browser reached us over HTTPS,
    directly or through a proxy that says so (Heroku's router sets
    ``X-Forwarded-Proto``).
    """

    def open_session(self, app: Flask, request: Request):
        if not request.path.startswith(PREFIX):
            return None  # Flask substitutes its null session
        return super().open_session(app, request)

    def get_cookie_secure(self, app: Flask) -> bool:
        from flask import request

        forwarded = request.headers.get("X-Forwarded-Proto", "").split(",")[0].strip()
        return request.is_secure or forwarded == "https"


def init_console(app: Flask) -> None:
    """Register the console on ``app``; its secret is the config's ``POIMEN_CONSOLE_SECRET``."""
    from . import views

    secret = app.config.get("POIMEN_CONSOLE_SECRET") or ""
    app.config["POIMEN_CONSOLE_ENABLED"] = len(secret) >= MIN_SECRET_LEN
    if app.config["POIMEN_CONSOLE_ENABLED"]:
        app.config["SECRET_KEY"] = secret
    app.config.update(
        SESSION_COOKIE_NAME="poimen_console",
        SESSION_COOKIE_PATH=PREFIX,
        SESSION_COOKIE_HTTPONLY=True,
        SESSION_COOKIE_SAMESITE="Strict",
    )
    app.session_interface = ConsoleSessionInterface()
    app.config["POIMEN_CONSOLE_KAFKA"] = _kafka_settings()
    app.register_blueprint(views.bp)


def _kafka_settings() -> dict | None:
    """The inbox page's Kafka client settings, topic prefix and group; None without Kafka."""
    from poimenconfig import REPLAY_GROUP, consumer_group, kafka_client_settings, topic_prefix

    try:
        settings = kafka_client_settings()
    except SystemExit:  # no KAFKA_BOOTSTRAP_SERVERS nor KAFKA_URL: the page says so
        return None
    return {"settings": settings, "prefix": topic_prefix(), "group": consumer_group(REPLAY_GROUP)}
