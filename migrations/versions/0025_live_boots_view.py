"""the one definition of a live boot as a view, poimen_live_boots (app/state/sql/boots.sql,
live_boots), read by mark_dead_boots, prune_dead_boots, marker_state and app/liveness.py
instead of each joining pg_locks itself; the runs waiting for their tenant's cap that it
lets go as a view, poimen_cap_wakes (runs.sql, cap_wakes), read by wake_waiting and
wake_tenant; poimen_event_ended, the event and poimen_ended call that poimen_release,
poimen_retry, poimen_wait, poimen_cancel, poimen_cancel_queued, poimen_end_abandoned and
poimen_time_limit end with; and the store's functions and the relay's again, so the
bodies changed since 0024 land on existing databases

Revision ID: 0025
Revises: 0024
Create Date: 2026-12-05 14:00:00.000000

"""
from alembic import op

from app.state.boots import LIVE_BOOTS
from app.state.claims import FUNCTIONS
from app.state.runs import CAP_WAKES
from app.state.outbox import RELAY_FUNCTIONS

revision = '0025'
down_revision = '0024'
branch_labels = None
depends_on = None


def upgrade():
    op.execute(LIVE_BOOTS)
    op.execute(CAP_WAKES)
    # In FUNCTIONS' order: a function is installed before the ones that call it.
    for function in FUNCTIONS:
        op.execute(function.create)
    for statement in RELAY_FUNCTIONS:
        op.execute(statement)


def downgrade():
    # Revision 0024's statements join pg_locks themselves. A function this revision adds
    # stays installed (nothing of 0024 calls it); a downgrade runs that revision's
    # FUNCTIONS again.
    op.execute("DROP VIEW IF EXISTS poimen_cap_wakes")
    op.execute("DROP VIEW IF EXISTS poimen_live_boots")
