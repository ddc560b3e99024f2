"""runs.last_sent_at: when a run was last sent to Celery, so repair pages through a backlog

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29 15:30:00.000000

"""
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade():
    # now() is stable, not volatile: Postgres evaluates it once and keeps it in
    # the catalogue, so no row is rewritten (existing runs count as sent now).
    # New runs get the admitting transaction's time; admission needs no change.
    op.execute("ALTER TABLE runs ADD COLUMN last_sent_at timestamptz NOT NULL DEFAULT now()")
    # Repair takes queued runs oldest send first, a page at a time.
    op.execute("CREATE INDEX ix_runs_queued_last_sent ON runs (last_sent_at) "
               "WHERE status = 'queued'")


def downgrade():
    op.execute("DROP INDEX ix_runs_queued_last_sent")
    op.execute("ALTER TABLE runs DROP COLUMN last_sent_at")
