"""runs.traceparent, runs.tracestate: the W3C Trace Context a run was admitted with

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01 16:00:00.000000

"""
import sqlalchemy as sa
from alembic import op

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade():
    # Nullable, no default: a run admitted without a trace context (and every run
    # admitted before this migration) has none. Adding nullable columns without a
    # default rewrites nothing, so this is instant on a large runs table.
    # traceparent is 55 characters (version 00, the only one stored); tracestate
    # is kept up to the 512 characters W3C asks vendors to propagate.
    op.add_column('runs', sa.Column('traceparent', sa.String(55), nullable=True))
    op.add_column('runs', sa.Column('tracestate', sa.String(512), nullable=True))


def downgrade():
    op.drop_column('runs', 'tracestate')
    op.drop_column('runs', 'traceparent')
