"""step_markers.claimed_by without a foreign key to worker_boots

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-29 17:00:00.000000

"""
from alembic import op

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade():
    # Markers are the ledger's permanent record; boots are pruned once dead
    # (0007, beat's repair). A marker needs its holder's row only to ask whether
    # it is live, and a pruned boot is dead by definition (it is not in the
    # live-boots join), so its unfinished markers are taken over by a
    # compare-and-set on the id the marker still holds. Without the key, a
    # marker keeps no dead boot's row alive, and a claim checks no reference.
    op.execute("ALTER TABLE step_markers DROP CONSTRAINT step_markers_claimed_by_fkey")


def downgrade():
    op.execute("ALTER TABLE step_markers ADD CONSTRAINT step_markers_claimed_by_fkey "
               "FOREIGN KEY (claimed_by) REFERENCES worker_boots (boot_id) NOT VALID")
