"""cascading cancel: runs.cancel_cascade (a run's cancel reaches its descendants: a child
admitted under it afterwards is admitted with its cancellation requested); poimen_cancel
takes p_cascade (default false, so a previous release's two-argument call still resolves
to it, once the two-argument function is dropped); poimen_expire returns the run and the
parents it woke, no more; the store's functions again

Revision ID: 0027
Revises: 0026
Create Date: 2026-12-05 18:30:00.000000

"""
from alembic import op

from app.state.claims import FUNCTIONS

revision = '0027'
down_revision = '0026'
branch_labels = None
depends_on = None


def upgrade():
    # No rewrite: a constant default is stored in the catalog (PostgreSQL 11+).
    op.execute("ALTER TABLE runs ADD COLUMN IF NOT EXISTS cancel_cascade boolean "
               "NOT NULL DEFAULT false")
    # Two functions named poimen_cancel would make a two-argument call ambiguous.
    op.execute("DROP FUNCTION IF EXISTS poimen_cancel(uuid, integer)")
    # poimen_expire returns only what its callers read (the run, the parents it woke):
    # a function's result type changes only by dropping it (nothing calls it in between).
    op.execute("DROP FUNCTION IF EXISTS poimen_expire(uuid)")
    for function in FUNCTIONS:
        op.execute(function.create)


def downgrade():
    # The column and the function stay: the installed function (this revision's) reads and
    # writes it, and the older code's two-argument call resolves to it.
    pass
