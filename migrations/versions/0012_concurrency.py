"""concurrency keys and tenant caps: runs.concurrency_key/concurrency_limit/wait_reason,
tenants.max_running

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01 16:00:00.000000

"""
from alembic import op

revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


def upgrade():
    # A run of a workflow that declares concurrency_limit carries the limit it was
    # admitted with (NULL: unlimited) and its key (NULL: one group per tenant and
    # workflow). The claim counts the group's running runs (docs/internals/execution.md).
    op.execute("ALTER TABLE runs ADD COLUMN concurrency_key varchar(255)")
    op.execute("ALTER TABLE runs ADD COLUMN concurrency_limit integer")
    # What a 'waiting' run waits for: 'join' (its children), 'concurrency' (a slot
    # of its key), 'tenant_cap' (a slot of its tenant). NULL for every other status.
    op.execute("ALTER TABLE runs ADD COLUMN wait_reason varchar(16)")
    op.execute("UPDATE runs SET wait_reason = 'join' WHERE status = 'waiting'")
    op.execute("ALTER TABLE runs ADD CONSTRAINT ck_runs_wait_reason CHECK "
               "(wait_reason IS NULL OR wait_reason IN ('join', 'concurrency', 'tenant_cap'))")
    op.execute("ALTER TABLE runs ADD CONSTRAINT ck_runs_concurrency_limit CHECK "
               "(concurrency_limit IS NULL OR concurrency_limit > 0)")
    # The claim's count and FIFO order of a group, and the wake-up of its oldest
    # waiting run: only the unfinished runs of limited workflows.
    op.execute("CREATE INDEX ix_runs_concurrency_group ON runs "
               "(tenant_id, workflow_name, coalesce(concurrency_key, ''), created_at, id) "
               "WHERE concurrency_limit IS NOT NULL "
               "AND status IN ('queued', 'running', 'waiting')")
    # The same for a capped tenant (all its unfinished runs).
    op.execute("CREATE INDEX ix_runs_tenant_unfinished ON runs (tenant_id, created_at, id) "
               "WHERE status IN ('queued', 'running', 'waiting')")
    # A tenant's cap on its running runs (NULL: none): flask tenants set --max-running.
    op.execute("ALTER TABLE tenants ADD COLUMN max_running integer")
    op.execute("ALTER TABLE tenants ADD CONSTRAINT ck_tenants_max_running CHECK "
               "(max_running IS NULL OR max_running > 0)")


def downgrade():
    op.execute("ALTER TABLE tenants DROP CONSTRAINT ck_tenants_max_running")
    op.execute("ALTER TABLE tenants DROP COLUMN max_running")
    op.execute("DROP INDEX ix_runs_tenant_unfinished")
    op.execute("DROP INDEX ix_runs_concurrency_group")
    op.execute("ALTER TABLE runs DROP CONSTRAINT ck_runs_concurrency_limit")
    op.execute("ALTER TABLE runs DROP CONSTRAINT ck_runs_wait_reason")
    op.execute("ALTER TABLE runs DROP COLUMN wait_reason")
    op.execute("ALTER TABLE runs DROP COLUMN concurrency_limit")
    op.execute("ALTER TABLE runs DROP COLUMN concurrency_key")
