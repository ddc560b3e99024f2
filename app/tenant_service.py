"""Tenants and their API tokens: the domain writes behind the operator CLI.

These raise ``TenantError`` subclasses; the CLI translates them into messages.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from sqlalchemy import func, select, update

from .auth import SCOPES, hash_token, new_token
from .extensions import db
from .models import ApiToken, Tenant
from .state.executor import on_session
from .state.runs import change_tenant_cap

# Tenant names appear in topic names: lowercase, digits, '_' and '-'.
TENANT_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


class TenantError(ValueError):
    """A tenant or token operation that cannot be done as asked."""


class InvalidTenantName(TenantError):
    pass


class TenantExists(TenantError):
    pass


class UnknownTenant(TenantError):
    pass


class NoActiveToken(TenantError):
    pass


class InvalidScope(TenantError):
    pass


def find_tenant(name: str) -> Tenant:
    """Return tenant ``name`` or raise ``UnknownTenant``."""
    tenant = db.session.execute(select(Tenant).where(Tenant.name == name)).scalar_one_or_none()
    if tenant is None:
        raise UnknownTenant(f"no tenant named {name!r}")
    return tenant


class InvalidCap(TenantError):
    pass


@dataclass(frozen=True)
class CapChange:
    tenant: Tenant
    woken: list[uuid.UUID]  # the runs the change re-queued (waiting for the tenant's slots)


def set_max_running(name: str, max_running: int | None) -> CapChange:
    """Cap tenant ``name``'s running runs at ``max_running`` (None: no cap); commit.

    Claims decide the cap (docs/internals/execution.md#concurrency-limits-and-tenant-caps).
    Runs already running keep running. A cap raised or lifted frees slots, and the
    same transaction re-queues as many runs waiting for them as it freed (every one
    when lifted), oldest first; they are sent once it commits.
    """
    if max_running is not None and (isinstance(max_running, bool) or max_running < 1):
        raise InvalidCap("--max-running must be a positive integer")
    tenant = find_tenant(name)
    woken = change_tenant_cap(on_session(db.session), tenant.id, max_running)
    db.session.commit()
    db.session.refresh(tenant)
    return CapChange(tenant, [row.id for row in woken])


class InvalidRateLimit(TenantError):
    pass


def set_rate_limit(name: str, rate_limit: str | None) -> Tenant:
    """Limit tenant ``name``'s starts to ``rate_limit`` ("50/s"; None: no limit); commit.

    Claims decide it (docs/internals/rate-limits.md), across every worker. A
    change applies to starts not reserved yet: a run whose start the old limit reserved
    keeps that time.
    """
    from workers import registry

    try:
        interval = None if rate_limit is None else registry.rate_interval(rate_limit)
    except ValueError as err:
        raise InvalidRateLimit(f"--rate-limit: {err}") from None
    tenant = find_tenant(name)
    tenant.rate_limit = None if rate_limit is None else rate_limit.replace(" ", "")
    tenant.rate_interval = interval
    db.session.commit()
    return tenant


def list_tenants() -> list[Tenant]:
    return list(db.session.scalars(select(Tenant).order_by(Tenant.name)))


def create_tenant(name: str, exist_ok: bool = False) -> Tenant:
    """Create and commit tenant ``name`` (a lowercase, topic-safe name)."""
    if not TENANT_NAME.match(name):
        raise InvalidTenantName(
            "tenant names are 1-63 chars of a-z, 0-9, '_' or '-' (they appear in topic names)"
        )
    existing = db.session.execute(select(Tenant).where(Tenant.name == name)).scalar_one_or_none()
    if existing is not None:
        if exist_ok:
            return existing
        raise TenantExists(f"tenant {name!r} already exists")
    tenant = Tenant(name=name)
    db.session.add(tenant)
    db.session.commit()
    return tenant


def create_token(tenant: Tenant | None, service: bool, label: str | None = None,
                 token: str | None = None, scope: str | None = None) -> str:
    """Create and commit a token; return it. Only its SHA-256 is stored.

    ``scope`` None lets the token do everything its kind allows; ``"admit"``
    only ``POST /v1/runs`` (the Kafka inbox's token).
    """
    if scope is not None and scope not in SCOPES:
        raise InvalidScope(f"unknown scope {scope!r} (known: {', '.join(SCOPES)})")
    token = token or new_token()
    db.session.add(ApiToken(tenant_id=tenant.id if tenant else None, is_service=service,
                            label=label, token_hash=hash_token(token), prefix=token[:12],
                            scope=scope))
    db.session.commit()
    return token


def revoke_token(token_or_prefix: str) -> int:
    """Revoke the token given by itself or by its 12-character prefix; return how many."""
    revoked = db.session.execute(
        update(ApiToken)
        .where((ApiToken.token_hash == hash_token(token_or_prefix))
               | (ApiToken.prefix == token_or_prefix[:12]))
        .where(ApiToken.revoked_at.is_(None))
        .values(revoked_at=func.now())
        .returning(ApiToken.id)
    ).scalars().all()
    db.session.commit()
    if not revoked:
        raise NoActiveToken("no active token matches")
    return len(revoked)


def token_registered(token: str) -> bool:
    """Return whether ``token`` is known (revoked or not)."""
    return db.session.execute(
        select(ApiToken.id).where(ApiToken.token_hash == hash_token(token))
    ).scalar_one_or_none() is not None


def token_scope(token: str) -> str | None:
    """Return the scope of the known ``token`` (None: unscoped)."""
    return db.session.execute(
        select(ApiToken.scope).where(ApiToken.token_hash == hash_token(token))
    ).scalar_one_or_none()
