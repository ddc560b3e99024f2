"""the batching worker's finish ends a batch set-wise when no run of it sets anything off
(no slot to hand on, no join to count), and any other batch run by run as before:
poimen_finish_batch; the store's functions again

Revision ID: 0030
Revises: 0029
Create Date: 2026-12-06 07:00:00.000000

"""
from alembic import op

from app.state.claims import FUNCTIONS

revision = '0030'
down_revision = '0029'
branch_labels = None
depends_on = None


def upgrade():
    for function in FUNCTIONS:
        op.execute(function.create)


def downgrade():
    # The function stays, as after every revision's downgrade: an older batching worker
    # calls poimen_finish_batch with the same arguments and gets the same ends.
    pass
