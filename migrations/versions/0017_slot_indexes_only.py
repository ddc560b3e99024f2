"""slot indexes that only the slot statements can use, and that only they need:
the counts name a run's group, tenant and status as expressions (app/state/sql/README.md,
"Status tests that choose the index") that these indexes are built on and no other index is

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-02 05:40:00.000000

"""
from alembic import op

from app.state.claims import FUNCTIONS

revision = '0017'
down_revision = '0016'
branch_labels = None
depends_on = None

# The slot statements' group, tenant and status expressions (app/state/sql/claims.sql and
# runs.sql), written out here: a migration is history, and the planner matches an index's
# expressions to a statement's as written.
_GROUP = ("(CAST(tenant_id AS text) || '|' || workflow_name || '|' "
          "|| coalesce(concurrency_key, ''))")
_TENANT = "(CAST(tenant_id AS text))"
_STATUS = "('' || status)"
_UNFINISHED = f"{_STATUS} IN ('queued', 'running', 'waiting')"


def upgrade():
    # These replace (tenant_id, ..., status, ...) keyed indexes, which the counts' plain
    # `status = 'queued'` can leave for ix_runs_queued_last_sent (every queued run) when
    # the statistics say few runs are queued: under a backlog, each claim of a limited
    # run would read the whole backlog (auto_explain, bench/execution.py).
    op.execute("CREATE INDEX ix_runs_slot_group ON runs "
               f"({_GROUP}, {_STATUS}, created_at, id) "
               f"WHERE concurrency_limit IS NOT NULL AND {_UNFINISHED}")
    op.execute("DROP INDEX ix_runs_concurrency_group_status")
    op.execute("CREATE INDEX ix_runs_tenant_slots ON runs "
               f"({_TENANT}, {_STATUS}, created_at, id) WHERE {_UNFINISHED}")
    op.execute("DROP INDEX ix_runs_tenant_unfinished_status")
    for function in FUNCTIONS:
        op.execute(function.create)


def downgrade():
    # The functions keep the new statements: they stay correct, only their plans differ.
    op.execute("CREATE INDEX ix_runs_tenant_unfinished_status ON runs "
               "(tenant_id, status, created_at, id) "
               "WHERE status IN ('queued', 'running', 'waiting')")
    op.execute("DROP INDEX ix_runs_tenant_slots")
    op.execute("CREATE INDEX ix_runs_concurrency_group_status ON runs "
               "(tenant_id, workflow_name, coalesce(concurrency_key, ''), status, created_at, id) "
               "WHERE concurrency_limit IS NOT NULL AND status IN ('queued', 'running', 'waiting')")
    op.execute("DROP INDEX ix_runs_slot_group")
