"""worker_boot_lock_key cycles: boot lock keys are reused once their boots are pruned

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-29 15:30:00.000000

"""
from alembic import op

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade():
    # An integer sequence runs out after 2^31 boots (a busy --max-tasks-per-child
    # deployment gets there); cycling reuses keys, and registration skips a key
    # whose boot still exists.
    op.execute("ALTER SEQUENCE worker_boot_lock_key MINVALUE 1 MAXVALUE 2147483647 CYCLE")


def downgrade():
    op.execute("ALTER SEQUENCE worker_boot_lock_key NO CYCLE")
