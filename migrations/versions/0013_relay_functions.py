"""the outbox relay's two writes as database functions, whose bodies are the run-state
store's statements (app/state/sql/outbox.sql: poimen_outbox_mark_published and
poimen_outbox_prune): the relay calls them and imports nothing of app/

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-01 22:30:00.000000

"""
from alembic import op

from app.state.outbox import RELAY_FUNCTIONS

revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None


def upgrade():
    # CREATE OR REPLACE: a later change to a body is a new migration that runs these again
    # (tests/app/test_relay_functions.py fails while an installed body differs from the file's).
    for statement in RELAY_FUNCTIONS:
        op.execute(statement)


def downgrade():
    op.execute("DROP FUNCTION IF EXISTS poimen_outbox_prune(double precision, integer)")
    op.execute("DROP FUNCTION IF EXISTS poimen_outbox_mark_published(bigint[])")
