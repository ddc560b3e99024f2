"""worker_boots.node: the Celery worker (main process) a boot's pool process belongs to

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01 12:00:00.000000

"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import UUID

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade():
    # A worker's main process fails a run past its hard time limit before it kills
    # the pool process. (hostname, pid) does not name that process: containers may
    # share a hostname and reuse pids. The main process's own random id, inherited
    # by its pool processes and stored with each boot, does. Nullable: boots of
    # workers started before this migration have none (and are never matched).
    op.add_column('worker_boots', sa.Column('node', UUID(as_uuid=True), nullable=True))


def downgrade():
    op.drop_column('worker_boots', 'node')
