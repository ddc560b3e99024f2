"""the step-entry ledger: step_entries, step_markers, step_children; runs.definition_hash; waiting

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-29 16:00:00.000000

"""
from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade():
    # A run whose join step waits for its children holds no worker: 'waiting'.
    op.execute("ALTER TABLE runs DROP CONSTRAINT ck_runs_status")
    op.execute("ALTER TABLE runs ADD CONSTRAINT ck_runs_status CHECK (status IN "
               "('queued', 'running', 'waiting', 'succeeded', 'failed', 'cancelled'))")
    # The hash of the resolved definition the run was admitted with (NULL for runs
    # admitted before the ledger): a worker resolving another refuses the run.
    op.execute("ALTER TABLE runs ADD COLUMN definition_hash varchar(64)")
    # GET /v1/runs?parent_run_id=... and the console's children list.
    op.execute("CREATE INDEX ix_runs_parent ON runs (parent_run_id, created_at) "
               "WHERE parent_run_id IS NOT NULL")

    op.execute("""
        CREATE TABLE step_entries (
            id bigserial PRIMARY KEY,
            run_id uuid NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
            entry_no integer NOT NULL,
            step_id varchar(100) NOT NULL,
            status varchar(16) NOT NULL,
            actions jsonb NOT NULL DEFAULT '[]'::jsonb,
            outputs jsonb NOT NULL DEFAULT '{}'::jsonb,
            error jsonb,
            next_step varchar(100),
            children_total integer NOT NULL DEFAULT 0,
            children_done integer NOT NULL DEFAULT 0,
            started_at timestamptz NOT NULL DEFAULT now(),
            finished_at timestamptz,
            CONSTRAINT ck_step_entries_status CHECK (status IN
                ('running', 'waiting', 'completed', 'failed', 'abandoned')),
            CONSTRAINT uq_step_entries_run_entry UNIQUE (run_id, entry_no)
        )
    """)
    # At most one unfinished entry per run: resuming re-uses it, never appends a second.
    op.execute("CREATE UNIQUE INDEX uq_step_entries_unfinished ON step_entries (run_id) "
               "WHERE status IN ('running', 'waiting')")

    # One row per marker-bearing (entry, declared position): the primary key makes
    # the claim one INSERT ... ON CONFLICT DO NOTHING.
    op.execute("""
        CREATE TABLE step_markers (
            entry_id bigint NOT NULL REFERENCES step_entries (id) ON DELETE CASCADE,
            position integer NOT NULL,
            run_id uuid NOT NULL,
            claimed_by uuid NOT NULL REFERENCES worker_boots (boot_id),
            status varchar(16) NOT NULL,
            claims integer NOT NULL DEFAULT 1,
            result jsonb,
            error jsonb,
            claimed_at timestamptz NOT NULL DEFAULT now(),
            finished_at timestamptz,
            PRIMARY KEY (entry_id, position),
            CONSTRAINT ck_step_markers_status CHECK (status IN ('claimed', 'completed', 'failed'))
        )
    """)
    op.execute("CREATE INDEX ix_step_markers_run ON step_markers (run_id)")

    # Which entry spawned a child: the child's finish counts it against that
    # entry's join in the same statement.
    op.execute("""
        CREATE TABLE step_children (
            child_run_id uuid PRIMARY KEY REFERENCES runs (id) ON DELETE CASCADE,
            entry_id bigint NOT NULL REFERENCES step_entries (id) ON DELETE CASCADE,
            position integer NOT NULL,
            ordinal integer NOT NULL,
            item_key text NOT NULL
        )
    """)
    op.execute("CREATE INDEX ix_step_children_entry ON step_children (entry_id, position, ordinal)")


def downgrade():
    op.execute("DROP TABLE step_children")
    op.execute("DROP TABLE step_markers")
    op.execute("DROP TABLE step_entries")
    op.execute("DROP INDEX ix_runs_parent")
    op.execute("ALTER TABLE runs DROP COLUMN definition_hash")
    op.execute("UPDATE runs SET status = 'queued' WHERE status = 'waiting'")
    op.execute("ALTER TABLE runs DROP CONSTRAINT ck_runs_status")
    op.execute("ALTER TABLE runs ADD CONSTRAINT ck_runs_status CHECK (status IN "
               "('queued', 'running', 'succeeded', 'failed', 'cancelled'))")
