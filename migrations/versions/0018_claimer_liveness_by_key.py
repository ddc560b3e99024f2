"""the slot functions again: a limited claim asks its boot's liveness of the lock
manager for the one key (app.liveness.claimer_live_sql) instead of reading pg_locks

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-04 09:55:00.000000

"""
from alembic import op

from app.state.claims import FUNCTIONS

revision = '0018'
down_revision = '0017'
branch_labels = None
depends_on = None


def upgrade():
    for function in FUNCTIONS:
        op.execute(function.create)


def downgrade():
    pass  # the bodies before it answer the same question through pg_locks
