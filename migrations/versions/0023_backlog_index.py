"""ix_runs_backlog: the backlog gauges (app/backlog.py) read only the queued and waiting
runs, every column they group and age by in the index, so a scrape is an index-only scan
of the backlog, never of the whole runs table

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-05 05:00:00.000000

"""
from alembic import op

revision = '0023'
down_revision = '0022'
branch_labels = None
depends_on = None


def upgrade():
    # Plain `status`, as app.backlog.BACKLOG writes it (the slot indexes of 0017 are on
    # the expression '' || status, which only the slot statements use).
    op.execute("CREATE INDEX ix_runs_backlog ON runs "
               "(tenant_id, workflow_name, workflow_version, status, wait_reason, "
               "not_before, created_at) WHERE status IN ('queued', 'waiting')")


def downgrade():
    op.execute("DROP INDEX ix_runs_backlog")
