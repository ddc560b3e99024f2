"""the status in a limited group's index and a capped tenant's, so a claim's slot count
reads the slot holders and the older runs that want one, not every queued run of a
deep backlog; the slot functions again (their claim counts one status at a time)

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-02 02:20:00.000000

"""
from alembic import op

from app.state.claims import FUNCTIONS

revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None

_UNFINISHED = "status IN ('queued', 'running', 'waiting')"


def upgrade():
    # The claim's count (a sum over the holders, the older queued and the older waiting
    # runs), FIFO order within a status, and the wake-up of a group's oldest waiting run.
    op.execute("CREATE INDEX ix_runs_concurrency_group_status ON runs "
               "(tenant_id, workflow_name, coalesce(concurrency_key, ''), status, created_at, id) "
               f"WHERE concurrency_limit IS NOT NULL AND {_UNFINISHED}")
    op.execute("DROP INDEX ix_runs_concurrency_group")
    # The same for a capped tenant (all its unfinished runs).
    op.execute("CREATE INDEX ix_runs_tenant_unfinished_status ON runs "
               f"(tenant_id, status, created_at, id) WHERE {_UNFINISHED}")
    op.execute("DROP INDEX ix_runs_tenant_unfinished")
    for function in FUNCTIONS:
        op.execute(function.create)


def downgrade():
    op.execute("CREATE INDEX ix_runs_tenant_unfinished ON runs (tenant_id, created_at, id) "
               f"WHERE {_UNFINISHED}")
    op.execute("DROP INDEX ix_runs_tenant_unfinished_status")
    op.execute("CREATE INDEX ix_runs_concurrency_group ON runs "
               "(tenant_id, workflow_name, coalesce(concurrency_key, ''), created_at, id) "
               f"WHERE concurrency_limit IS NOT NULL AND {_UNFINISHED}")
    op.execute("DROP INDEX ix_runs_concurrency_group_status")
