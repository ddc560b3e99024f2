"""runs.root_run_id: the root of a fan-out child's run tree (its parent's root, or its
parent), set at admission, so a run's Celery messages carry Celery's root_id (Flower's
task tree) without a walk up the tree; NULL for a top-level run (its own root)

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-05 04:50:00.000000

"""
import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = '0021'
down_revision = '0020'
branch_labels = None
depends_on = None


def upgrade():
    # Nullable and without a default: adding it rewrites no row. A child admitted before
    # it has none; its messages name its parent as the root.
    op.add_column('runs', sa.Column('root_run_id', postgresql.UUID(as_uuid=True),
                                    nullable=True))


def downgrade():
    op.drop_column('runs', 'root_run_id')
