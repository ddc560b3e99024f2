"""the slot functions again: a limited claim finds its run by primary key only
(its status tested as ``(r.status || '') = 'queued'``, app/state/sql/README.md, "Status
tests that choose the index"), never through a partial index on status

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-02 03:05:00.000000

"""
from alembic import op

from app.state.claims import FUNCTIONS

revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None


def upgrade():
    for function in FUNCTIONS:
        op.execute(function.create)


def downgrade():
    pass  # the bodies before it differ only in how the planner may find the run
