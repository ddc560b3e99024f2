"""api_tokens.scope: what a token may do (NULL: everything its kind allows; 'admit': POST /v1/runs only)

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-29 15:10:00.000000

"""
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade():
    op.execute("ALTER TABLE api_tokens ADD COLUMN scope varchar(32)")


def downgrade():
    op.execute("ALTER TABLE api_tokens DROP COLUMN scope")
