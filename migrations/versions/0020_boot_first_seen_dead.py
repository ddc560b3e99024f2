"""worker_boots.first_seen_dead_at and dead_after_seconds: a boot whose lock goes early
(a restart, a failover, pg_terminate_backend) is gone only once the server first saw its
lock free T_c + kill + margin ago; the slot functions again, since from this revision
their slot count asks that of each holder (app.liveness.held_by_sql, written out in
app/state/sql/claims.sql)

Revision ID: 0020
Revises: 0018
Create Date: 2026-12-05 01:20:00.000000

"""
import sqlalchemy as sa
from alembic import op

from app.state.claims import FUNCTIONS

revision = '0020'
down_revision = '0018'
branch_labels = None
depends_on = None

# A boot registered by code older than this column (a rolling deploy) gets the default
# lease's bound: POIMEN_LEASE_CLIENT_SECONDS (10) + kill (1) + margin (2).
_DEFAULT_DEAD_AFTER = "13"


def upgrade():
    with op.batch_alter_table('worker_boots') as batch_op:
        batch_op.add_column(sa.Column('first_seen_dead_at', sa.DateTime(timezone=True),
                                      nullable=True))
        batch_op.add_column(sa.Column('dead_after_seconds', sa.Float(), nullable=False,
                                      server_default=_DEFAULT_DEAD_AFTER))
    for function in FUNCTIONS:
        op.execute(function.create)


def downgrade():
    # 0018's slot functions count a boot's slot free the moment its lock goes: reinstall
    # them with the code of that revision (these bodies read the columns dropped here).
    op.drop_column('worker_boots', 'dead_after_seconds')
    op.drop_column('worker_boots', 'first_seen_dead_at')
