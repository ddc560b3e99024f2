"""rate limits decided in the claim: runs.rate_key and runs.rate_interval (a workflow's
limit, pinned at admission), tenants.rate_limit and tenants.rate_interval (a tenant's),
rate_slots (each scope's last start and the end of its line of reserved starts), the wait
reason 'rate_limit' (a queued run's reserved start); poimen_rate_start, and
poimen_claim_slot returning the reservation (a function's result type changes only by
dropping it); poimen_cancel and poimen_cancel_queued clear an ended run's wait reason; the
store's functions again

Revision ID: 0028
Revises: 0027
Create Date: 2026-12-05 21:00:00.000000

"""
from alembic import op

from app.state.claims import FUNCTIONS

revision = '0028'
down_revision = '0027'
branch_labels = None
depends_on = None


def upgrade():
    # IF NOT EXISTS: a downgrade keeps the columns and the table (below).
    op.execute("ALTER TABLE runs ADD COLUMN IF NOT EXISTS rate_key varchar(255), "
               "ADD COLUMN IF NOT EXISTS rate_interval float8")
    op.execute("ALTER TABLE tenants ADD COLUMN IF NOT EXISTS rate_limit varchar(32), "
               "ADD COLUMN IF NOT EXISTS rate_interval float8")
    # Each scope's latest start taken and the end of its line of reserved starts.
    op.execute("CREATE TABLE IF NOT EXISTS rate_slots (scope text PRIMARY KEY, "
               "last_start timestamptz NOT NULL, next_start timestamptz NOT NULL)")
    op.execute("ALTER TABLE runs DROP CONSTRAINT ck_runs_wait_reason")
    op.execute("ALTER TABLE runs ADD CONSTRAINT ck_runs_wait_reason CHECK (wait_reason IS NULL "
               "OR wait_reason IN ('join', 'concurrency', 'tenant_cap', 'rate_limit'))")
    op.execute("DROP FUNCTION IF EXISTS poimen_claim_slot(uuid, uuid)")
    for function in FUNCTIONS:
        op.execute(function.create)


def downgrade():
    # The columns, the table and the functions stay: the installed functions (this
    # revision's) read them. A reserved run stays queued for its not_before, as a delayed
    # one: only its wait reason goes, which the older constraint does not know.
    op.execute("UPDATE runs SET wait_reason = NULL WHERE wait_reason = 'rate_limit'")
    op.execute("ALTER TABLE runs DROP CONSTRAINT ck_runs_wait_reason")
    op.execute("ALTER TABLE runs ADD CONSTRAINT ck_runs_wait_reason CHECK (wait_reason IS NULL "
               "OR wait_reason IN ('join', 'concurrency', 'tenant_cap'))")
