"""A limited run's slot counts read only the slot indexes, whatever the statistics say.

The counts (a claim's ``verdict``) and the wake-ups (``slot_woken``, ``wake_waiting``)
name a run's group, tenant and status as expressions (``app/state/sql/README.md``, "Status
tests that choose the index") that only ``ix_runs_slot_group`` and ``ix_runs_tenant_slots``
are built on (migration 0017). Written with a plain ``status = 'queued'``, the planner was free to
read ``ix_runs_queued_last_sent`` (every queued run of every tenant) and filter it, and
it did whenever the statistics said few runs were queued, as they do after a quiet
spell: under a burst, each claim then read the whole backlog (seen with auto_explain in
bench/execution.py). Here the statistics are made to say so, a backlog is added behind
their back, and the generic plan of each statement that counts or wakes slots (the plan
a database function caches) must still read ``runs`` only through the primary key and
the slot indexes.

And the other way round: no lookup of one run by id may have an index to read but the
primary key. ``(status || '')`` (a lookup's status) and ``('' || status)`` (the slot
indexes' status) are different expressions for that reason: with one expression, the slot
indexes' predicates held for every lookup by id, and a generic plan made when those
partial indexes looked empty found each run by scanning a whole slot index, dead
entries and all (seen with pgbench, 3-5 ms a claim and growing).
"""

from __future__ import annotations

import re

import pytest

from app.state import claims, runs
from app.state.statements import PARAMETER as _PARAMETER

SLOT_INDEXES = {"ix_runs_slot_group", "ix_runs_tenant_slots"}
ALLOWED = SLOT_INDEXES | {"runs_pkey"}

# Every claims statement of a limited run: they count slots (a claim; a takeover's and an
# adoption's ``poimen_slot_verdict``) or wake the next run waiting for one
# (``poimen_ended``, which an end, a release, a retry, a join's wait call); and a tenant's
# cap change, which wakes the runs waiting for its slots.
STATEMENTS = {
    "CLAIM_SLOT": claims.CLAIM_SLOT,
    "SLOT_VERDICT": claims.SLOT_VERDICT.query,
    "ENDED": runs.ENDED.query,
    "WAKE_TENANT": runs.WAKE_TENANT,
}

# The statements about one run: they find it by primary key only.
UNLIMITED = {name: getattr(claims, name) for name in ("CLAIM_QUEUED", "ADOPT")}

_RUNS_ROW = ("INSERT INTO runs (id, tenant_id, workflow_ref, workflow_name, workflow_version, "
             "input, status, attempt, failures, cancel_requested, origin, concurrency_key, "
             "concurrency_limit, started_at, finished_at, created_at, updated_at) "
             "SELECT gen_random_uuid(), %s, 'noop-keyed@1', 'noop-keyed', '1', '{}'::jsonb, "
             "%s, 1, 0, false, 'http', 'k' || (g %% 16), 100, now(), {finished}, "
             "now() - make_interval(secs => g), now() FROM generate_series(1, %s) g")


def _runs_reads(plan: str) -> set[str]:
    """How a plan reads ``runs``: the indexes it uses on it, and 'seq' for a full scan."""
    reads = set(re.findall(r"using (\w+) on runs\b", plan))
    reads |= {name for name in re.findall(r"Bitmap Index Scan on (\w+)", plan)
              if name.startswith(("ix_runs", "runs_", "uq_runs"))}
    if re.search(r"Seq Scan on runs\b", plan):
        reads.add("seq")
    return reads


def _whole_index_scans(plan: str) -> list[str]:
    """Index scans of ``runs`` that read a whole index: no ``Index Cond``, or one that
    does not bound the leading column. Every index a statement here may read leads with
    the column it is meant for: ``id`` (the primary key), or a slot index's scope
    (``CAST(tenant_id AS text)`` or the group built on it)."""
    lines = plan.splitlines()
    whole = []
    for i, line in enumerate(lines):
        scan = re.search(r"Index (?:Only )?Scan(?: Backward)? using (\w+) on runs\b", line)
        if not scan:
            continue
        condition = lines[i + 1].strip() if i + 1 < len(lines) else ""
        leading = "id = " if scan.group(1) == "runs_pkey" else "tenant_id)::text"
        if not re.match(r"Index Cond: \(+" + re.escape(leading), condition):
            whole.append(f"{line.strip()} / {condition}")
    return whole


def _generic_plan(pg, sql: str) -> str:
    """The generic plan of ``sql`` (``:name`` parameters), as a function caches it."""
    names = list(dict.fromkeys(_PARAMETER.findall(sql)))
    positional = _PARAMETER.sub(lambda m: f"${names.index(m.group(1)) + 1}", sql)
    pg.execute("DEALLOCATE ALL")
    pg.execute(f"PREPARE slot_statement AS {positional}")
    nulls = ", ".join("NULL" for _ in names)
    rows = pg.execute(f"EXPLAIN EXECUTE slot_statement{f'({nulls})' if names else ''}")
    return "\n".join(row[0] for row in rows)


@pytest.fixture
def quiet_statistics_then_a_backlog(pg):
    """Statistics taken when every run had finished (a quiet spell, as in production
    between bursts), then a backlog they do not know of: inside one transaction that
    the test rolls back, statistics included."""
    with pg.transaction(force_rollback=True):
        pg.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        tenant = pg.execute("INSERT INTO tenants (name, max_running) VALUES ('plans', 50) "
                            "RETURNING id").fetchone()[0]
        pg.execute(_RUNS_ROW.replace("{finished}", "now()"), [tenant, "succeeded", 5000])
        pg.execute("ANALYZE runs")
        pg.execute(_RUNS_ROW.replace("{finished}", "NULL"), [tenant, "queued", 2000])
        yield pg


@pytest.mark.parametrize("name", sorted(STATEMENTS))
def test_a_slot_statement_reads_runs_only_by_key_and_through_the_slot_indexes(
        quiet_statistics_then_a_backlog, name):
    plan = _generic_plan(quiet_statistics_then_a_backlog, STATEMENTS[name].text)
    reads = _runs_reads(plan)
    assert not _whole_index_scans(plan), plan
    assert reads <= ALLOWED, f"{name} reads runs through {sorted(reads - ALLOWED)}:\n{plan}"
    assert reads & SLOT_INDEXES, f"{name} counts or wakes slots without a slot index:\n{plan}"


def test_a_claims_counts_use_both_slot_indexes(quiet_statistics_then_a_backlog):
    plan = _generic_plan(quiet_statistics_then_a_backlog, claims.CLAIM_SLOT.text)
    assert SLOT_INDEXES <= _runs_reads(plan), plan


@pytest.mark.parametrize("name", sorted(UNLIMITED))
def test_a_statement_about_one_run_reads_runs_by_primary_key_only(
        quiet_statistics_then_a_backlog, name):
    plan = _generic_plan(quiet_statistics_then_a_backlog, UNLIMITED[name].text)
    assert _runs_reads(plan) == {"runs_pkey"}, f"{name}:\n{plan}"


@pytest.mark.parametrize("name", sorted(STATEMENTS | UNLIMITED))
def test_a_lookup_by_id_has_no_index_but_the_primary_key(quiet_statistics_then_a_backlog, name):
    """Without the primary key (dropped in the test's transaction), a lookup by id can
    only scan the table: an index it could read instead would be scanned whole, and the
    planner prefers that whenever the index looks small."""
    pg = quiet_statistics_then_a_backlog
    pg.execute("ALTER TABLE runs DROP CONSTRAINT runs_pkey CASCADE")
    plan = _generic_plan(pg, {**STATEMENTS, **UNLIMITED}[name].text)
    assert not _whole_index_scans(plan), plan
