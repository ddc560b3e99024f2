"""outbox.txid: the writing transaction's id, so the relay reads below the snapshot horizon

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 09:00:00.000000

"""
from alembic import op

# revision identifiers, used by Alembic.
revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade():
    # Two steps so that no existing row is rewritten: a constant default is
    # stored in the catalogue only (rows already there get txid 0: committed,
    # below any horizon), and the volatile default applies to new rows only.
    op.execute("ALTER TABLE outbox ADD COLUMN txid xid8 NOT NULL DEFAULT '0'")
    op.execute("ALTER TABLE outbox ALTER COLUMN txid SET DEFAULT pg_current_xact_id()")
    # Retention deletes published rows oldest first; unpublished rows are found
    # through ix_outbox_unpublished (id WHERE published_at IS NULL).
    op.execute("CREATE INDEX ix_outbox_published_at ON outbox (published_at) "
               "WHERE published_at IS NOT NULL")


def downgrade():
    op.execute("DROP INDEX ix_outbox_published_at")
    op.execute("ALTER TABLE outbox DROP COLUMN txid")
