"""runs.released_key: a dispatch key a newer run of the same key took over (key reuse)

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01 16:00:00.000000

"""
import sqlalchemy as sa
from alembic import op

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade():
    # A workflow whose key_reuse policy lets a new admission take an ended run's key
    # moves the key off the old run (dispatch_key = NULL: out of the partial unique
    # index, which keeps deciding who holds a key) into released_key, where
    # GET /v1/runs?dispatch_key= still finds it.
    op.add_column('runs', sa.Column('released_key', sa.String(length=255), nullable=True))
    op.create_index('ix_runs_tenant_released_key', 'runs', ['tenant_id', 'released_key'],
                    postgresql_where=sa.text('released_key IS NOT NULL'))


def downgrade():
    op.drop_index('ix_runs_tenant_released_key', table_name='runs',
                  postgresql_where=sa.text('released_key IS NOT NULL'))
    op.drop_column('runs', 'released_key')
