"""a limited group's claim and end as database functions that take the group's locks and
then decide on a fresh snapshot (app/state/sql/claims.sql: poimen_claim_slot and the
poimen_finish_slot functions; app/state/sql/README.md, "Slot functions"): one round trip each

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-02 02:30:00.000000

"""
from alembic import op

from app.state.claims import FUNCTIONS

revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None


def upgrade():
    # CREATE OR REPLACE: a later change to a statement is a new migration that runs these
    # again (tests/app/test_slot_functions.py fails while an installed body differs).
    for function in FUNCTIONS:
        op.execute(function.create)


def downgrade():
    for function in FUNCTIONS:
        op.execute(f"DROP FUNCTION IF EXISTS {function.name}")
