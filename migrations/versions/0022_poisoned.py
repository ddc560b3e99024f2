"""runs.status 'poisoned': a run whose executions killed max_takeovers + 1 workers ends
poisoned (rather than failed worker_lost); the slot functions again, since a finish's join
release and slot release count 'poisoned' among the ended statuses (app/state/sql/README.md,
"An end counts for the parent's join")

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-05 05:00:00.000000

"""
from alembic import op

from app.state.claims import FUNCTIONS

revision = '0022'
down_revision = '0021'
branch_labels = None
depends_on = None

_BEFORE = "('queued', 'running', 'waiting', 'succeeded', 'failed', 'cancelled')"
_AFTER = "('queued', 'running', 'waiting', 'succeeded', 'failed', 'cancelled', 'poisoned')"


def upgrade():
    op.execute("ALTER TABLE runs DROP CONSTRAINT ck_runs_status")
    op.execute(f"ALTER TABLE runs ADD CONSTRAINT ck_runs_status CHECK (status IN {_AFTER})")
    for function in FUNCTIONS:
        op.execute(function.create)


def downgrade():
    # A poisoned run was a failed one (worker_lost) before this revision. The slot
    # functions keep 'poisoned' among the ended statuses: no row has it any more.
    op.execute("UPDATE runs SET status = 'failed' WHERE status = 'poisoned'")
    op.execute("ALTER TABLE runs DROP CONSTRAINT ck_runs_status")
    op.execute(f"ALTER TABLE runs ADD CONSTRAINT ck_runs_status CHECK (status IN {_BEFORE})")
