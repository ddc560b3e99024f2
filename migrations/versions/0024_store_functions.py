"""one function per transition, and one for each part transitions share: poimen_finish (a
run's end, whatever its entry, limited or not) replaces the three poimen_finish_slot
functions and the three unlimited finish statements; poimen_take_over a takeover, limited
or not, deciding a held run's slot with poimen_slot_verdict; poimen_ended what runs' ends
set off (a parent's join counted, a slot handed on), called by the functions that end
runs or take them out of running (poimen_finish, poimen_take_over, poimen_release,
poimen_retry, poimen_wait, poimen_cancel, poimen_cancel_queued, poimen_end_abandoned,
poimen_time_limit); poimen_lock_slots a run's slot locks. They run on generic plans
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

# The functions poimen_finish replaces (0014-0022 installed them) stay installed: during a
# deploy the previous release's workers run beside the new schema (the release step
# migrates before they stop) and finish their limited runs with them. Nothing of this
# release calls them.


def upgrade():
    for function in FUNCTIONS:
        op.execute(function.create)


def downgrade():
    # The store of revision 0023 calls the poimen_finish_slot functions its own
    # app/state/sql/claims.sql holds, still installed: a downgrade runs that revision's
    # FUNCTIONS again.
    pass
