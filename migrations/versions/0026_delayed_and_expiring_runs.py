"""delayed runs and expiry: runs.admitted_not_before (the not_before a run was admitted
with, which a replay is compared with; a retry moves not_before, never this) and
runs.expires_at; the terminal status 'expired'; ix_runs_delayed, the delayed admissions
beat's release_due sends when due, and ix_runs_expiring, the runs never started that
expire_due ends; the store's functions again (poimen_expire; the claims refuse an
expired run; poimen_retry marks its delayed message sent at not_before; 'expired' among
the ended statuses of a join's count)

Revision ID: 0026
Revises: 0025
Create Date: 2026-12-05 18:00:00.000000

"""
from alembic import op

from app.state.claims import FUNCTIONS

revision = '0026'
down_revision = '0025'
branch_labels = None
depends_on = None

_BEFORE = "('queued', 'running', 'waiting', 'succeeded', 'failed', 'cancelled', 'poisoned')"
_AFTER = ("('queued', 'running', 'waiting', 'succeeded', 'failed', 'cancelled', 'poisoned', "
          "'expired')")


def upgrade():
    # IF NOT EXISTS: a downgrade keeps the columns (below).
    op.execute("ALTER TABLE runs ADD COLUMN IF NOT EXISTS admitted_not_before timestamptz, "
               "ADD COLUMN IF NOT EXISTS expires_at timestamptz")
    op.execute("ALTER TABLE runs DROP CONSTRAINT ck_runs_status")
    op.execute(f"ALTER TABLE runs ADD CONSTRAINT ck_runs_status CHECK (status IN {_AFTER})")
    # A retry's delayed message counts as sent at its not_before (poimen_retry from now
    # on): the retries queued now are marked so, or release_due would send them again.
    op.execute("UPDATE runs SET last_sent_at = not_before "
               "WHERE status = 'queued' AND last_sent_at < not_before")
    # The predicates release_due and expire_due repeat (app/state/sql/runs.sql).
    op.execute("CREATE INDEX IF NOT EXISTS ix_runs_delayed ON runs (not_before) "
               "WHERE status = 'queued' AND last_sent_at < not_before")
    op.execute("CREATE INDEX IF NOT EXISTS ix_runs_expiring ON runs (expires_at) "
               "WHERE expires_at IS NOT NULL AND started_at IS NULL "
               "AND status IN ('queued', 'waiting')")
    for function in FUNCTIONS:
        op.execute(function.create)


def downgrade():
    # An expired run never ran: before this revision it would have been cancelled. The
    # columns, the indexes and the functions stay: the functions installed are this
    # revision's (a migration cannot install an older checkout's), and they read the
    # columns; the older code reads and writes neither, and ignores both.
    op.execute("UPDATE runs SET status = 'cancelled' WHERE status = 'expired'")
    op.execute("ALTER TABLE runs DROP CONSTRAINT ck_runs_status")
    op.execute(f"ALTER TABLE runs ADD CONSTRAINT ck_runs_status CHECK (status IN {_BEFORE})")
