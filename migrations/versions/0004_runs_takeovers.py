"""runs.takeovers: how many dead workers a run has outlived (max_takeovers)

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29 15:00:00.000000

"""
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade():
    # A constant default: stored in the catalogue, no table rewrite.
    op.execute("ALTER TABLE runs ADD COLUMN takeovers integer NOT NULL DEFAULT 0")


def downgrade():
    op.execute("ALTER TABLE runs DROP COLUMN takeovers")
