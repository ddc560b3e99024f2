"""The relay's read, as Postgres plans it: it walks the unpublished index in id order.

A published event's entry stays in the partial index ``ix_outbox_unpublished`` until
the next vacuum. Statistics that say few rows are unpublished (the usual case) make a
bitmap scan look cheapest, and a bitmap scan reads every such dead entry and its heap
page again on every read: in a burst of 5,000 runs, 27,000 entries and 5-7 ms a read.
A plain index scan stops at the batch's LIMIT and marks the dead entries it passes,
which later scans skip (bridge/outbox.py, ``READ_PLAN``; docs/internals/outbox.md).
"""

from __future__ import annotations

import json

import psycopg

from bridge.outbox import read_batch
from poimenconfig import libpq_url


def _plan_nodes(plan: dict) -> list[dict]:
    nodes = [plan]
    for child in plan.get("Plans", []):
        nodes += _plan_nodes(child)
    return nodes


def test_the_read_walks_the_unpublished_index_in_order_when_statistics_favour_a_bitmap(
        database_url):
    # In one transaction, rolled back: no relay of another test sees these rows.
    with psycopg.connect(libpq_url(database_url)) as conn:
        tenant_id = conn.execute("INSERT INTO tenants (name) VALUES ('outbox-read-plan') "
                                 "RETURNING id").fetchone()[0]
        # 5,000 events, 60 unpublished, ids in no relation to where the rows lie (as
        # published rows' new versions scatter them): what makes a bitmap scan look
        # cheapest to the planner.
        conn.execute(
            "INSERT INTO outbox (id, tenant_id, run_id, event_type, payload, published_at) "
            "SELECT 9000000000 + (n * 7919) %% 5000, %s, gen_random_uuid(), 'run.test', '{}', "
            "       CASE WHEN n %% 83 = 0 THEN NULL ELSE now() END "
            "  FROM generate_series(1, 5000) AS n", [tenant_id])
        conn.execute("ANALYZE outbox")
        try:
            (plan,), = read_batch(conn, 100, prefix="EXPLAIN (FORMAT JSON) ")
            nodes = _plan_nodes((json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"])
            scans = [(n["Node Type"], n.get("Index Name")) for n in nodes
                     if n.get("Relation Name") == "outbox"
                     or n.get("Index Name") == "ix_outbox_unpublished"]
            assert scans == [("Index Scan", "ix_outbox_unpublished")], scans
        finally:
            conn.rollback()
