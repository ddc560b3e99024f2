"""The outbox relay's writes are the store's statements, installed as database functions.

The relay (``bridge/outbox.py``) imports nothing of ``app/``; it calls
``poimen_outbox_mark_published`` and ``poimen_outbox_prune``, whose bodies are
``app/state/outbox.py``'s ``MARK_PUBLISHED`` and ``PRUNE_PUBLISHED`` as migrated.
"""

from __future__ import annotations

import json

from app.state import outbox as store
from bridge import outbox as relay

NINE_DAYS, TEN_DAYS = 9 * 86400.0, 10 * 86400.0


def _body(pg, name: str) -> str:
    return pg.execute("SELECT prosrc FROM pg_proc WHERE proname = %s", [name]).fetchone()[0]


def test_the_installed_bodies_are_the_stores_statements(pg):
    for name, body in store.RELAY_FUNCTION_BODIES.items():
        assert _body(pg, name) == body, (
            f"{name} in the database differs from app/state/outbox.py: a change to the "
            "statement needs a migration that runs RELAY_FUNCTIONS again")


def test_the_relay_names_only_the_functions():
    assert relay.MARK_PUBLISHED.startswith("SELECT poimen_outbox_mark_published(")
    assert relay.PRUNE_PUBLISHED.startswith("SELECT poimen_outbox_prune(")


def _event(pg, tenant_id: int, published_ago: float | None) -> int:
    return pg.execute(
        "INSERT INTO outbox (tenant_id, run_id, event_type, payload, published_at) "
        "VALUES (%s, gen_random_uuid(), 'test.relay', %s, now() - make_interval(secs => %s)) RETURNING id",
        [tenant_id, json.dumps({}), published_ago]).fetchone()[0]


def test_mark_and_prune_through_the_relays_statements(pg):
    tenant_id = pg.execute(
        "INSERT INTO tenants (name) VALUES ('relay-fn-' || gen_random_uuid()) RETURNING id"
    ).fetchone()[0]
    fresh = [_event(pg, tenant_id, None) for _ in range(3)]
    old = [_event(pg, tenant_id, TEN_DAYS) for _ in range(5)]

    pg.execute(relay.MARK_PUBLISHED, [fresh[:2]])
    marked = dict(pg.execute("SELECT id, published_at IS NOT NULL FROM outbox WHERE id = ANY(%s)",
                             [fresh]).fetchall())
    assert marked == {fresh[0]: True, fresh[1]: True, fresh[2]: False}

    # Older than nine days (no other test's events are), two at a time: the just-marked
    # and the unpublished stay.
    assert pg.execute(relay.PRUNE_PUBLISHED, [NINE_DAYS, 2]).fetchone()[0] == 2
    assert pg.execute(relay.PRUNE_PUBLISHED, [int(NINE_DAYS), 10]).fetchone()[0] == 3
    assert pg.execute(relay.PRUNE_PUBLISHED, [NINE_DAYS, 10]).fetchone()[0] == 0
    left = {row[0] for row in pg.execute("SELECT id FROM outbox WHERE tenant_id = %s",
                                         [tenant_id]).fetchall()}
    assert left == set(fresh) and not left & set(old)
