"""The tables. The schema itself is owned by the Alembic migrations."""

from __future__ import annotations

import enum
import uuid
from datetime import datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB, UUID
from sqlalchemy.orm import Mapped, mapped_column

from .extensions import db


class RunStatus(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    # Holds no worker: a join step waits for its children (the last child's finish
    # re-queues the run), or a run waits for a concurrency slot (WaitReason).
    WAITING = "waiting"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    # Its executions kept killing their workers: ended after max_takeovers takeovers.
    POISONED = "poisoned"
    # No worker started it by its expires_at (admission's expires_at/expires_in_seconds).
    EXPIRED = "expired"


class WaitReason(enum.StrEnum):
    """What a ``waiting`` run waits for (``runs.wait_reason``, migration 0012)."""

    JOIN = "join"  # its join step's children
    CONCURRENCY = "concurrency"  # a slot of its (tenant, workflow, concurrency_key)
    TENANT_CAP = "tenant_cap"  # a slot of its tenant (tenants.max_running)
    # A ``queued`` run's reserved start under its rate limits, at ``not_before``.
    RATE_LIMIT = "rate_limit"


TERMINAL_STATUSES = frozenset({RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED,
                               RunStatus.POISONED, RunStatus.EXPIRED})


class Tenant(db.Model):
    __tablename__ = "tenants"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(63), unique=True, nullable=False)
    # At most this many of the tenant's runs are running at once (None: no cap).
    max_running: Mapped[int | None] = mapped_column(Integer)
    # At most this many of the tenant's runs start per period (migration 0028): the limit
    # as set ("50/s") and the seconds between two starts it allows (None: no limit).
    rate_limit: Mapped[str | None] = mapped_column(String(32))
    rate_interval: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.now()
    )


class ApiToken(db.Model):
    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # A tenant token acts for its tenant only. A service token (is_service) may act
    # for any tenant named in X-Poimen-Tenant; its tenant_id, if set, is the default.
    tenant_id: Mapped[int | None] = mapped_column(ForeignKey("tenants.id"), nullable=True)
    is_service: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)
    label: Mapped[str | None] = mapped_column(String(100))
    # Only the SHA-256 of the token is stored; the token is shown once at creation.
    token_hash: Mapped[str] = mapped_column(String(64), unique=True, nullable=False)
    prefix: Mapped[str] = mapped_column(String(16), nullable=False)
    # None: everything the token's kind allows; "admit": only POST /v1/runs (the inbox's).
    scope: Mapped[str | None] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.now()
    )
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Run(db.Model):
    __tablename__ = "runs"

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), nullable=False)
    workflow_ref: Mapped[str] = mapped_column(String(200), nullable=False)
    workflow_name: Mapped[str] = mapped_column(String(200), nullable=False)
    workflow_version: Mapped[str] = mapped_column(String(64), nullable=False)
    input: Mapped[dict] = mapped_column(JSONB, nullable=False)
    goal_id: Mapped[str | None] = mapped_column(String(255))
    dispatch_key: Mapped[str | None] = mapped_column(String(255))
    # The key this run held until a newer run took it (key_reuse): see migration 0011.
    released_key: Mapped[str | None] = mapped_column(String(255))
    status: Mapped[str] = mapped_column(String(16), nullable=False, default=RunStatus.QUEUED.value)
    # Executions started (claims and takeovers). A worker lost mid-run counts here...
    attempt: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    # ... but only workflow exceptions count against the workflow's max_attempts.
    failures: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0", default=0)
    # ... and takeovers count the lost workers, compared with the workflow's max_takeovers.
    takeovers: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0", default=0)
    claimed_by: Mapped[uuid.UUID | None] = mapped_column(
        UUID(as_uuid=True), ForeignKey("worker_boots.boot_id")
    )
    cancel_requested: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)
    result: Mapped[dict | list | str | int | float | bool | None] = mapped_column(JSONB)
    error: Mapped[dict | None] = mapped_column(JSONB)
    origin: Mapped[str] = mapped_column(String(16), nullable=False)
    origin_detail: Mapped[str | None] = mapped_column(String(255))
    parent_run_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    # The root of a child's run tree (its parent's root, or its parent; migration 0021):
    # Celery's root_id on the run's messages. None for a top-level run (its own root).
    root_run_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    # The hash of the resolved workflow definition pinned at admission (migration 0006).
    definition_hash: Mapped[str | None] = mapped_column(String(64))
    # The W3C Trace Context the run was admitted with (migration 0010; app/tracecontext.py).
    traceparent: Mapped[str | None] = mapped_column(String(55))
    tracestate: Mapped[str | None] = mapped_column(String(512))
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.now()
    )
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.now()
    )
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    not_before: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # When the run was last sent to Celery (admission, then repair): repair's clock.
    last_sent_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.now())
    # Concurrency (migration 0012): the run's group is (tenant, workflow name, key);
    # at most concurrency_limit (pinned at admission; None: unlimited) run at once.
    concurrency_key: Mapped[str | None] = mapped_column(String(255))
    concurrency_limit: Mapped[int | None] = mapped_column(Integer)
    # Rate limit (migration 0028): the seconds between two first starts of the runs of
    # (tenant, workflow name, rate_key), pinned at admission (None: no limit).
    rate_key: Mapped[str | None] = mapped_column(String(255))
    rate_interval: Mapped[float | None] = mapped_column(Float)
    # What a 'waiting' run waits for (WaitReason); None otherwise.
    wait_reason: Mapped[str | None] = mapped_column(String(16))
    # Delayed runs and expiry (migration 0026): the not_before the run was admitted with
    # (a retry moves not_before, never this; a replay is compared with it), and the time by
    # which a worker must have started it, else it ends expired.
    admitted_not_before: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # The cancel requested reaches the run's descendants (migration 0027): a child admitted
    # under it from now on is admitted with its cancellation requested.
    cancel_cascade: Mapped[bool] = mapped_column(Boolean, nullable=False,
                                                 server_default=text("false"))

    __table_args__ = (
        CheckConstraint(
            "status IN ('queued', 'running', 'waiting', 'succeeded', 'failed', 'cancelled', "
            "'poisoned', 'expired')",
            name="ck_runs_status",
        ),
        # Exactly-once admission is decided here: the index, not application code.
        Index(
            "uq_runs_tenant_dispatch_key",
            "tenant_id",
            "dispatch_key",
            unique=True,
            postgresql_where=text("dispatch_key IS NOT NULL"),
        ),
        Index("ix_runs_tenant_created", "tenant_id", "created_at", "id"),
        Index("ix_runs_status_updated", "status", "updated_at"),
        Index("ix_runs_tenant_goal", "tenant_id", "goal_id"),
        Index("ix_runs_tenant_released_key", "tenant_id", "released_key",
              postgresql_where=text("released_key IS NOT NULL")),
    )


class WorkerBoot(db.Model):
    """One worker process lifetime. Alive exactly while it holds its advisory lock."""

    __tablename__ = "worker_boots"

    boot_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    # The advisory lock key: pg_advisory_lock(LOCK_NAMESPACE, lock_key).
    lock_key: Mapped[int] = mapped_column(
        Integer, unique=True, nullable=False, server_default=text("nextval('worker_boot_lock_key')")
    )
    hostname: Mapped[str] = mapped_column(String(255), nullable=False)
    pid: Mapped[int] = mapped_column(Integer, nullable=False)
    # The worker main process whose pool process this boot is (migration 0009).
    node: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    started_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.now()
    )
    # When a statement first found its lock free (server clock; migration 0020), and how
    # long after that its runs and slots stay held: its T_c + kill + margin
    # (app/liveness.py, lease.dead_after).
    first_seen_dead_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    dead_after_seconds: Mapped[float] = mapped_column(Float, nullable=False,
                                                      server_default=text("13"))


class OutboxEvent(db.Model):
    """A run event, written in the transaction of the change it reports."""

    __tablename__ = "outbox"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), nullable=False)
    run_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), nullable=False)
    event_type: Mapped[str] = mapped_column(String(64), nullable=False)
    payload: Mapped[dict] = mapped_column(JSONB, nullable=False)
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=func.now()
    )
    published_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # xid8 of the writing transaction (migration 0002); the relay reads below the horizon.
    txid: Mapped[str] = mapped_column(String, server_default=text("pg_current_xact_id()"))

    __table_args__ = (
        Index("ix_outbox_unpublished", "id", postgresql_where=text("published_at IS NULL")),
    )


class StepEntry(db.Model):
    """One entry of a run into a step: the ledger's row (``app/state/ledger.py`` writes it)."""

    __tablename__ = "step_entries"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    run_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), ForeignKey("runs.id"),
                                              nullable=False)
    entry_no: Mapped[int] = mapped_column(Integer, nullable=False)
    step_id: Mapped[str] = mapped_column(String(100), nullable=False)
    status: Mapped[str] = mapped_column(String(16), nullable=False)
    actions: Mapped[list] = mapped_column(JSONB, nullable=False)
    outputs: Mapped[dict] = mapped_column(JSONB, nullable=False)
    error: Mapped[dict | None] = mapped_column(JSONB)
    next_step: Mapped[str | None] = mapped_column(String(100))
    children_total: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    children_done: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class StepMarker(db.Model):
    """The claim of a marker-bearing action: (entry, declared position)."""

    __tablename__ = "step_markers"

    entry_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("step_entries.id"),
                                          primary_key=True)
    position: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), nullable=False)
    # No foreign key (migration 0008): a dead boot's row may be pruned; the id stays.
    claimed_by: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), nullable=False)
    status: Mapped[str] = mapped_column(String(16), nullable=False)
    claims: Mapped[int] = mapped_column(Integer, nullable=False, default=1)
    result: Mapped[dict | list | str | int | float | bool | None] = mapped_column(JSONB)
    error: Mapped[dict | None] = mapped_column(JSONB)
    claimed_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class StepChild(db.Model):
    """A child run and the entry (and position) whose fan-out admitted it."""

    __tablename__ = "step_children"

    child_run_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), ForeignKey("runs.id"),
                                                    primary_key=True)
    entry_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("step_entries.id"),
                                          nullable=False)
    position: Mapped[int] = mapped_column(Integer, nullable=False)
    ordinal: Mapped[int] = mapped_column(Integer, nullable=False)
    item_key: Mapped[str] = mapped_column(String, nullable=False)


class AdmissionOrigin(enum.StrEnum):
    HTTP = "http"
    FANOUT = "fanout"
    INTERNAL = "internal"
    SCHEDULE = "schedule"


__all__ = [
    "AdmissionOrigin",
    "ApiToken",
    "OutboxEvent",
    "Run",
    "RunStatus",
    "StepChild",
    "StepEntry",
    "StepMarker",
    "TERMINAL_STATUSES",
    "Tenant",
    "WaitReason",
    "WorkerBoot",
]
