"""The per-process token cache (app/auth.py): what it costs and what it never does.

docs/internals/admission.md: a revoked token keeps working for at most
``POIMEN_TOKEN_CACHE_SECONDS`` in a process that saw it just before; 0 disables the
cache; a failed authentication is never cached, so a token that starts working
(created, or its tenant created) works on the very next request.
"""

from __future__ import annotations

import time
import uuid

from tests.processes import wait_until

CACHE_SECONDS = 1.0


def _runs(client, headers):
    return client.get("/v1/runs", headers=headers)


def _revoke(app, token):
    from app.tenant_service import revoke_token

    with app.app_context():
        assert revoke_token(token) == 1


def test_a_revoked_token_stops_working_once_its_cache_entry_expires(app, client, make_tenant,
                                                                   monkeypatch):
    monkeypatch.setitem(app.config, "POIMEN_TOKEN_CACHE_SECONDS", CACHE_SECONDS)
    creds = make_tenant()
    assert _runs(client, creds.headers).status_code == 200  # now cached
    _revoke(app, creds.token)
    revoked_at = time.monotonic()

    # The documented price: inside the cache period the revoked token still reads.
    assert _runs(client, creds.headers).status_code == 200
    # ... and no longer than that: the entry expires and the lookup finds the revocation.
    wait_until(lambda: _runs(client, creds.headers).status_code == 401,
               timeout=CACHE_SECONDS + 5, interval=0.05, what="the revoked token to be refused")
    refused_after = time.monotonic() - revoked_at
    assert refused_after >= CACHE_SECONDS - 0.1, (
        f"refused after {refused_after:.2f}s: the cache was not used at all")
    refused = _runs(client, creds.headers)
    assert refused.status_code == 401
    assert refused.json["error"]["code"] == "unauthorized"


def test_a_cache_period_of_zero_refuses_a_revoked_token_at_once(app, client, make_tenant,
                                                               monkeypatch):
    monkeypatch.setitem(app.config, "POIMEN_TOKEN_CACHE_SECONDS", 0)
    creds = make_tenant()
    assert _runs(client, creds.headers).status_code == 200
    _revoke(app, creds.token)
    assert _runs(client, creds.headers).status_code == 401


def test_an_unknown_token_is_not_cached_as_a_failure(app, client, make_tenant, monkeypatch):
    """A 401 is not remembered: the same token works the moment it exists."""
    from app.tenant_service import create_token, find_tenant

    monkeypatch.setitem(app.config, "POIMEN_TOKEN_CACHE_SECONDS", 60)
    owner = make_tenant()
    token = f"pmn_not-yet-{uuid.uuid4().hex}"
    headers = {"Authorization": f"Bearer {token}"}
    assert _runs(client, headers).status_code == 401
    assert _runs(client, headers).status_code == 401

    with app.app_context():
        create_token(find_tenant(owner.name), service=False, token=token)
    assert _runs(client, headers).status_code == 200


def test_a_refused_tenant_name_is_not_cached_either(app, client, make_tenant, monkeypatch):
    """A service token naming a tenant that does not exist yet works once it does."""
    from app.tenant_service import create_tenant

    monkeypatch.setitem(app.config, "POIMEN_TOKEN_CACHE_SECONDS", 60)
    service = make_tenant(service=True)
    later = f"later-{uuid.uuid4().hex[:8]}"
    headers = {"Authorization": f"Bearer {service.token}", "X-Poimen-Tenant": later}
    first = _runs(client, headers)
    assert first.status_code in (403, 404), first.json
    with app.app_context():
        create_tenant(later)
    assert _runs(client, headers).status_code == 200
