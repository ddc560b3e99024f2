"""Console sign-in and CSRF: what the signed session cookie holds and how it is checked.

The cookie holds three things: the SHA-256 of the tenant token (never the
token: a copied cookie is no API credential), when the sign-in happened, and a
per-session CSRF token that every POST form carries in a hidden field.
"""

from __future__ import annotations

import hmac
import secrets
import time
from functools import wraps
from urllib.parse import urlencode

from flask import current_app, g, redirect, request, session, url_for

from ..auth import Principal, hash_token, principal_for
from ..errors import ApiError

# A signed-in session ends this long after sign-in, whatever the browser keeps.
SESSION_SECONDS = 12 * 3600
CSRF_FIELD = "csrf_token"


class ConsoleError(Exception):
    """A console request refused with ``status``: an HTML page (JSON if asked for)."""

    def __init__(self, status: int, code: str, message: str, details: dict | None = None):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.details = details or {}


def csrf_token() -> str:
    """Return this session's CSRF token, creating it (and the session) if needed."""
    token = session.get("csrf")
    if not token:
        token = session["csrf"] = secrets.token_urlsafe(32)
    return token


def check_csrf() -> None:
    """Refuse a POST whose form does not carry this session's CSRF token (403)."""
    sent = request.form.get(CSRF_FIELD, "")
    expected = session.get("csrf", "")
    if not expected or not hmac.compare_digest(sent.encode(), expected.encode()):
        raise ConsoleError(403, "csrf_failed",
                           "this form is stale or did not come from the console; "
                           "reload the page and try again")


def tenant_principal(token_hash: str) -> Principal:
    """Return the tenant principal of ``token_hash`` through the API's token check.

    Raises ``ApiError`` (401) for an unknown or revoked token, and
    ``ConsoleError`` (403) for a token the console does not accept: a service
    token (it acts for any tenant; the console shows one) or a scoped token
    that may not read runs.
    """
    try:
        principal = principal_for(token_hash)
    except ApiError as err:
        if err.status == 401:
            raise
        principal = None  # a service token without a default tenant (tenant_required)
    if principal is None or principal.is_service:
        raise ConsoleError(403, "service_token", "sign in with a tenant token, not a service token")
    if not principal.allows("read"):
        raise ConsoleError(403, "forbidden",
                           f"this token's scope ({principal.scope}) does not allow reading runs")
    return principal


def sign_in(token: str) -> Principal:
    """Check ``token`` and start a fresh session for it (a new CSRF token too)."""
    token_hash = hash_token(token.strip())
    principal = tenant_principal(token_hash)
    session.clear()  # no state from before sign-in survives it (session fixation)
    session["token_hash"] = token_hash
    session["at"] = int(time.time())
    csrf_token()
    return principal


def signed_in(view):
    """Require a signed-in session: put its principal on ``g.principal``, else go to sign-in."""

    @wraps(view)
    def wrapper(*args, **kwargs):
        if not current_app.config["POIMEN_CONSOLE_ENABLED"]:
            raise ConsoleError(503, "console_disabled",
                               "the console needs POIMEN_CONSOLE_SECRET (32 characters or more)")
        token_hash = session.get("token_hash")
        fresh = time.time() - session.get("at", 0) < SESSION_SECONDS
        if token_hash and fresh:
            try:
                g.principal = tenant_principal(token_hash)
                return view(*args, **kwargs)
            except ApiError as err:
                if err.status != 401:
                    raise
                # Revoked since sign-in: the session ends with it.
        session.pop("token_hash", None)
        return redirect(url_for("console.sign_in") + "?" + urlencode({"next": _here()}))

    return wrapper


def _here() -> str:
    if request.method == "GET":
        return request.full_path.rstrip("?")
    return request.path.rsplit("/", 1)[0]  # a form's action: back to the page it was on


def safe_next(target: str | None) -> str:
    """Where to go after sign-in: a console path only, never another site."""
    if target and target.startswith("/console/") and not target.startswith("//") \
            and "\\" not in target:
        return target
    return url_for("console.runs")
