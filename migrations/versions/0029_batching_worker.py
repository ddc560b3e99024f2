"""the batching worker's finish of many runs in one call: poimen_finish_batch (the claim
of many runs is a statement, claim_queued_batch, with no function); the store's
functions again

Revision ID: 0029
Revises: 0028
Create Date: 2026-12-06 00:00:00.000000

"""
from alembic import op

from app.state.claims import FUNCTIONS

revision = '0029'
down_revision = '0028'
branch_labels = None
depends_on = None


def upgrade():
    for function in FUNCTIONS:
        op.execute(function.create)


def downgrade():
    # A batching worker of this revision calls it: an older one never does.
    op.execute("DROP FUNCTION IF EXISTS poimen_finish_batch(text[], text[], text[], "
               "integer[], uuid[], uuid[], text[], text[], text[], bigint[], integer[], "
               "text[], text[], text[], text[], text[], text[], boolean[], text[])")
