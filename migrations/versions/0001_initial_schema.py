"""initial schema: tenants, tokens, runs, worker boots, outbox

Revision ID: 0001
Revises: 
Create Date: 2026-11-29 08:42:39.213291

"""
from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

# revision identifiers, used by Alembic.
revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade():
    # Advisory-lock keys of worker boots: unique per boot, never reused.
    op.execute("CREATE SEQUENCE worker_boot_lock_key AS integer")
    op.create_table('tenants',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=63), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('name')
    )
    op.create_table('worker_boots',
    sa.Column('boot_id', sa.UUID(), nullable=False),
    sa.Column('lock_key', sa.Integer(), server_default=sa.text("nextval('worker_boot_lock_key')"), nullable=False),
    sa.Column('hostname', sa.String(length=255), nullable=False),
    sa.Column('pid', sa.Integer(), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.PrimaryKeyConstraint('boot_id'),
    sa.UniqueConstraint('lock_key')
    )
    op.create_table('api_tokens',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('tenant_id', sa.Integer(), nullable=True),
    sa.Column('is_service', sa.Boolean(), nullable=False),
    sa.Column('label', sa.String(length=100), nullable=True),
    sa.Column('token_hash', sa.String(length=64), nullable=False),
    sa.Column('prefix', sa.String(length=16), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('token_hash')
    )
    op.create_table('outbox',
    sa.Column('id', sa.BigInteger(), nullable=False),
    sa.Column('tenant_id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.UUID(), nullable=False),
    sa.Column('event_type', sa.String(length=64), nullable=False),
    sa.Column('payload', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('published_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('outbox', schema=None) as batch_op:
        batch_op.create_index('ix_outbox_unpublished', ['id'], unique=False, postgresql_where=sa.text('published_at IS NULL'))

    op.create_table('runs',
    sa.Column('id', sa.UUID(), nullable=False),
    sa.Column('tenant_id', sa.Integer(), nullable=False),
    sa.Column('workflow_ref', sa.String(length=200), nullable=False),
    sa.Column('workflow_name', sa.String(length=200), nullable=False),
    sa.Column('workflow_version', sa.String(length=64), nullable=False),
    sa.Column('input', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.Column('goal_id', sa.String(length=255), nullable=True),
    sa.Column('dispatch_key', sa.String(length=255), nullable=True),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('failures', sa.Integer(), server_default='0', nullable=False),
    sa.Column('claimed_by', sa.UUID(), nullable=True),
    sa.Column('cancel_requested', sa.Boolean(), nullable=False),
    sa.Column('result', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    sa.Column('error', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    sa.Column('origin', sa.String(length=16), nullable=False),
    sa.Column('origin_detail', sa.String(length=255), nullable=True),
    sa.Column('parent_run_id', sa.UUID(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('not_before', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint(
        "status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')",
        name="ck_runs_status",
    ),
    sa.ForeignKeyConstraint(['claimed_by'], ['worker_boots.boot_id'], ),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.create_index('ix_runs_status_updated', ['status', 'updated_at'], unique=False)
        batch_op.create_index('ix_runs_tenant_created', ['tenant_id', 'created_at', 'id'], unique=False)
        batch_op.create_index('ix_runs_tenant_goal', ['tenant_id', 'goal_id'], unique=False)
        # Exactly-once admission: the partial unique index decides concurrent
        # admissions of one (tenant, dispatch_key); runs without a key are free.
        batch_op.create_index('uq_runs_tenant_dispatch_key', ['tenant_id', 'dispatch_key'], unique=True, postgresql_where=sa.text('dispatch_key IS NOT NULL'))



def downgrade():
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_index('uq_runs_tenant_dispatch_key', postgresql_where=sa.text('dispatch_key IS NOT NULL'))
        batch_op.drop_index('ix_runs_tenant_goal')
        batch_op.drop_index('ix_runs_tenant_created')
        batch_op.drop_index('ix_runs_status_updated')

    op.drop_table('runs')
    with op.batch_alter_table('outbox', schema=None) as batch_op:
        batch_op.drop_index('ix_outbox_unpublished', postgresql_where=sa.text('published_at IS NULL'))

    op.drop_table('outbox')
    op.drop_table('api_tokens')
    op.drop_table('worker_boots')
    op.drop_table('tenants')
    op.execute("DROP SEQUENCE worker_boot_lock_key")
