"""one function per end: poimen_finish (a run's end, whatever its entry and whether it
holds a slot) replaces the three poimen_finish_slot functions and the three unlimited
finish statements; what an end sets off (a parent's join counted, a slot handed on) is
poimen_ended, which the functions that end runs or take them out of running call
(poimen_cancel, poimen_cancel_queued, poimen_end_abandoned, poimen_time_limit,
poimen_release, poimen_retry, poimen_wait); a run's slot locks are poimen_lock_slots
(app/state/sql/README.md, "Store functions")

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-05 11:00:00.000000

"""
from alembic import op

from app.state.claims import FUNCTIONS

revision = '0024'
down_revision = '0023'
branch_labels = None
depends_on = None

# The functions poimen_finish replaces (0014-0022 installed them).
_REPLACED = ("poimen_finish_slot", "poimen_finish_slot_inserted", "poimen_finish_slot_closed")


def upgrade():
    for function in FUNCTIONS:
        op.execute(function.create)
    for name in _REPLACED:
        op.execute(f"DROP FUNCTION IF EXISTS {name}")


def downgrade():
    # The store of revision 0023 calls the poimen_finish_slot functions its own
    # app/state/sql/claims.sql holds: a downgrade runs that revision's FUNCTIONS again.
    pass
