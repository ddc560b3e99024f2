"""Bearer-token auth. A token acts for one tenant; a service token for any named one."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from functools import wraps

from flask import g, request
from sqlalchemy import select

from .errors import ApiError
from .extensions import db
from .models import ApiToken, Tenant

TOKEN_PREFIX = "pmn_"
TENANT_HEADER = "X-Poimen-Tenant"


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


def _authenticate() -> Principal:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(
            401,
            "unauthorized",
            "missing bearer token",
            headers={"WWW-Authenticate": 'Bearer realm="poimen"'},
        )
    row = db.session.execute(
        select(ApiToken.id, ApiToken.tenant_id, ApiToken.is_service, Tenant.name)
        .outerjoin(Tenant, Tenant.id == ApiToken.tenant_id)
        .where(ApiToken.token_hash == hash_token(token.strip()), ApiToken.revoked_at.is_(None))
    ).one_or_none()
    if row is None:
        raise ApiError(
            401,
            "unauthorized",
            "invalid or revoked token",
            headers={"WWW-Authenticate": 'Bearer realm="poimen", error="invalid_token"'},
        )
    acting_for = request.headers.get(TENANT_HEADER)
    if not row.is_service:
        if acting_for and acting_for != row.name:
            raise ApiError(403, "forbidden", f"this token may not act for tenant {acting_for!r}")
        return Principal(row.id, row.tenant_id, row.name, False)
    if not acting_for:
        if row.tenant_id is None:
            raise ApiError(
                400, "tenant_required", f"a service token must name a tenant in {TENANT_HEADER}"
            )
        return Principal(row.id, row.tenant_id, row.name, True)
    tenant_id = db.session.execute(
        select(Tenant.id).where(Tenant.name == acting_for)
    ).scalar_one_or_none()
    if tenant_id is None:
        raise ApiError(404, "tenant_not_found", f"no tenant named {acting_for!r}",
                       {"tenant": acting_for})
    return Principal(row.id, tenant_id, acting_for, True)


def require_token(view):
    """Authenticate the request and put the ``Principal`` on ``g.principal``."""

    @wraps(view)
    def wrapper(*args, **kwargs):
        g.principal = _authenticate()
        return view(*args, **kwargs)

    return wrapper
