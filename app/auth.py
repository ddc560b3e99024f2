"""Bearer-token auth. A token acts for one tenant; a service token for any named one.

A token's scope narrows what it may do: none (NULL) is everything its kind
allows but the operator's actions; ``admit`` is ``POST /v1/runs`` only, which is
all the Kafka inbox needs, so a leaked inbox token can create runs but not read,
list or cancel them; ``admin`` is everything, the operator's actions included
(replaying the inbox's dead letters from the console).
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from dataclasses import dataclass
from functools import wraps

from flask import current_app, g, request
from sqlalchemy import select

from .errors import ApiError
from .extensions import db
from .models import ApiToken, Tenant

TOKEN_PREFIX = "pmn_"
TENANT_HEADER = "X-Poimen-Tenant"

# The scopes a token may be given: ``admit`` names the one action it allows,
# ``admin`` allows every action, the operator's included.
ADMIT = "admit"
ADMIN = "admin"
SCOPES = (ADMIT, ADMIN)
# Actions for operators only: an unscoped token (a tenant's callers) may not do them.
# Replaying dead letters re-publishes every message of the tenant's DLQ at once.
REPLAY_DLQ = "replay_dlq"
ADMIN_ACTIONS = frozenset({REPLAY_DLQ})


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class Principal:
    token_id: int
    tenant_id: int
    tenant_name: str
    is_service: bool
    scope: str | None = None

    def allows(self, action: str) -> bool:
        """Whether this token may do ``action`` (``admit``, ``read``, ``cancel``,
        ``replay_dlq``)."""
        if self.scope == ADMIN:
            return True
        if action in ADMIN_ACTIONS:
            return False
        return self.scope is None or self.scope == action


class PrincipalCache:
    """Recently authenticated principals, per process, for ``ttl`` seconds.

    An admission is a handful of milliseconds of CPU and the token lookup was a
    fifth of it. The price: a revoked token keeps working for at most ``ttl``
    seconds in a process that saw it just before (``POIMEN_TOKEN_CACHE_SECONDS``,
    0 disables). Failures are never cached.
    """

    def __init__(self, max_entries: int = 10_000):
        self._entries: dict[tuple[str, str | None], tuple[float, Principal]] = {}
        self._lock = threading.Lock()
        self.max_entries = max_entries

    def get(self, key: tuple[str, str | None]) -> Principal | None:
        entry = self._entries.get(key)
        if entry is None or entry[0] < time.monotonic():
            return None
        return entry[1]

    def put(self, key: tuple[str, str | None], principal: Principal, ttl: float) -> None:
        if ttl <= 0:
            return
        with self._lock:
            if len(self._entries) >= self.max_entries:
                self._entries.clear()
            self._entries[key] = (time.monotonic() + ttl, principal)


_principals = PrincipalCache()


def _bearer(header: str) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None."""
    scheme, _, token = header.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def cached_principal(authorization: str, acting_for: str | None) -> Principal | None:
    """The principal this process has cached for the request's ``Authorization`` header
    (and ``X-Poimen-Tenant``), or None: no bearer token, or not looked up recently."""
    token = _bearer(authorization)
    return None if token is None else _principals.get((hash_token(token), acting_for))


def _authenticate() -> Principal:
    token = _bearer(request.headers.get("Authorization", ""))
    if token is None:
        raise ApiError(
            401,
            "unauthorized",
            "missing bearer token",
            headers={"WWW-Authenticate": 'Bearer realm="poimen"'},
        )
    return principal_for(hash_token(token), request.headers.get(TENANT_HEADER))


def principal_for(token_hash: str, acting_for: str | None = None) -> Principal:
    """Return the principal of the token whose SHA-256 is ``token_hash``, or raise a 401.

    The one token check: the API's bearer tokens and the console's session
    (which keeps only the hash) both come through here, cache included.
    """
    key = (token_hash, acting_for)
    principal = _principals.get(key)
    if principal is None:
        principal = _lookup(*key)
        _principals.put(key, principal, current_app.config["POIMEN_TOKEN_CACHE_SECONDS"])
    return principal


def _lookup(token_hash: str, acting_for: str | None) -> Principal:
    row = db.session.execute(
        select(ApiToken.id, ApiToken.tenant_id, ApiToken.is_service, ApiToken.scope,
               Tenant.name)
        .outerjoin(Tenant, Tenant.id == ApiToken.tenant_id)
        .where(ApiToken.token_hash == token_hash, ApiToken.revoked_at.is_(None))
    ).one_or_none()
    if row is None:
        raise ApiError(
            401,
            "unauthorized",
            "invalid or revoked token",
            headers={"WWW-Authenticate": 'Bearer realm="poimen", error="invalid_token"'},
        )
    if not row.is_service:
        if acting_for and acting_for != row.name:
            raise ApiError(403, "forbidden", f"this token may not act for tenant {acting_for!r}")
        return Principal(row.id, row.tenant_id, row.name, False, row.scope)
    if not acting_for:
        if row.tenant_id is None:
            raise ApiError(
                400, "tenant_required", f"a service token must name a tenant in {TENANT_HEADER}"
            )
        return Principal(row.id, row.tenant_id, row.name, True, row.scope)
    tenant_id = db.session.execute(
        select(Tenant.id).where(Tenant.name == acting_for)
    ).scalar_one_or_none()
    if tenant_id is None:
        raise ApiError(404, "tenant_not_found", f"no tenant named {acting_for!r}",
                       {"tenant": acting_for})
    return Principal(row.id, tenant_id, acting_for, True, row.scope)


def require_token(action: str):
    """Authenticate the request, refuse a token whose scope does not allow ``action``
    (403 ``forbidden``), and put the ``Principal`` on ``g.principal``."""

    def decorate(view):
        @wraps(view)
        def wrapper(*args, **kwargs):
            principal = _authenticate()
            if not principal.allows(action):
                raise ApiError(403, "forbidden",
                               f"this token's scope ({principal.scope}) does not allow {action}",
                               {"scope": principal.scope, "action": action})
            g.principal = principal
            return view(*args, **kwargs)

        return wrapper

    return decorate
