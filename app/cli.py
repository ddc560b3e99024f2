"""Operator commands: ``flask --app app tenants|tokens|runs ...``."""

from __future__ import annotations

import re
import uuid

import click
from flask import Flask, current_app
from sqlalchemy import func, select, update

from .auth import hash_token, new_token
from .extensions import db
from .models import ApiToken, Run, Tenant

TENANT_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


def _tenant(name: str) -> Tenant:
    tenant = db.session.execute(select(Tenant).where(Tenant.name == name)).scalar_one_or_none()
    if tenant is None:
        raise click.ClickException(f"no tenant named {name!r}")
    return tenant


def create_tenant(name: str, exist_ok: bool = False) -> Tenant:
    """Create tenant ``name`` (a lowercase, topic-safe name)."""
    if not TENANT_NAME.match(name):
        raise click.ClickException(
            "tenant names are 1-63 chars of a-z, 0-9, '_' or '-' (they appear in topic names)"
        )
    existing = db.session.execute(select(Tenant).where(Tenant.name == name)).scalar_one_or_none()
    if existing is not None:
        if exist_ok:
            return existing
        raise click.ClickException(f"tenant {name!r} already exists")
    tenant = Tenant(name=name)
    db.session.add(tenant)
    db.session.commit()
    return tenant


def create_token(tenant: Tenant | None, service: bool, label: str | None = None,
                 token: str | None = None) -> str:
    """Create a token and return it; only its hash is stored."""
    token = token or new_token()
    db.session.add(ApiToken(tenant_id=tenant.id if tenant else None, is_service=service,
                            label=label, token_hash=hash_token(token), prefix=token[:12]))
    db.session.commit()
    return token


def register_cli(app: Flask) -> None:
    @app.cli.group()
    def tenants():
        """Create and list tenants."""

    @tenants.command("create")
    @click.argument("name")
    @click.option("--exist-ok", is_flag=True, help="Succeed if the tenant already exists.")
    def tenants_create(name: str, exist_ok: bool):
        """Create tenant NAME."""
        tenant = create_tenant(name, exist_ok=exist_ok)
        click.echo(f"tenant {tenant.name} (id {tenant.id})")

    @tenants.command("list")
    def tenants_list():
        """List tenants."""
        for tenant in db.session.scalars(select(Tenant).order_by(Tenant.name)):
            click.echo(f"{tenant.id}\t{tenant.name}")

    @app.cli.group()
    def tokens():
        """Create and revoke API tokens."""

    @tokens.command("create")
    @click.option("--tenant", "tenant_name", help="The tenant the token acts for.")
    @click.option("--service", is_flag=True,
                  help="A service token: may act for any tenant named in X-Poimen-Tenant.")
    @click.option("--label", help="A note saying who holds the token.")
    def tokens_create(tenant_name: str | None, service: bool, label: str | None):
        """Create a token and print it (shown this once)."""
        if not tenant_name and not service:
            raise click.UsageError("give --tenant NAME, or --service")
        tenant = _tenant(tenant_name) if tenant_name else None
        click.echo(create_token(tenant, service, label))

    @tokens.command("revoke")
    @click.argument("token_or_prefix")
    def tokens_revoke(token_or_prefix: str):
        """Revoke a token, given the token itself or its 12-character prefix."""
        revoked = db.session.execute(
            update(ApiToken)
            .where((ApiToken.token_hash == hash_token(token_or_prefix))
                   | (ApiToken.prefix == token_or_prefix[:12]))
            .where(ApiToken.revoked_at.is_(None))
            .values(revoked_at=func.now())
            .returning(ApiToken.id)
        ).scalars().all()
        db.session.commit()
        if not revoked:
            raise click.ClickException("no active token matches")
        click.echo(f"revoked {len(revoked)} token(s)")

    @app.cli.group()
    def runs():
        """Inspect and re-drive runs."""

    @runs.command("show")
    @click.argument("run_id")
    def runs_show(run_id: str):
        """Print one run as JSON."""
        import json

        from .api import serialize_run

        run = db.session.get(Run, uuid.UUID(run_id))
        if run is None:
            raise click.ClickException(f"no run {run_id}")
        tenant = db.session.get(Tenant, run.tenant_id)
        click.echo(json.dumps(serialize_run(run, tenant.name), indent=2))

    @runs.command("redrive")
    @click.option("--older-than", default=0.0, help="Only runs queued at least this many seconds.")
    def runs_redrive(older_than: float):
        """Re-send queued runs, and runs held by dead workers (claims absorb duplicates).

        The same repair as beat's, for every stranded run at once.
        """
        from workers.repair import repair_stranded_runs

        sent, found = repair_stranded_runs(db.session, current_app.extensions["celery"],
                                           min_age=older_than, limit=None)
        click.echo(f"re-sent {sent} of {found} run(s) (queued, or held by dead workers)")

    @app.cli.group()
    def topics():
        """Declare tenants' Kafka topics (dispatch, dispatch.dlq, events)."""

    @topics.command("declare")
    @click.option("--tenant", "tenant_names", multiple=True,
                  help="Tenant name; repeat for several (default: every tenant).")
    @click.option("--partitions", default=4, show_default=True)
    def topics_declare(tenant_names: tuple[str, ...], partitions: int):
        """Create each tenant's topics; topics that exist are left as they are."""
        from bridge.kafka import client_settings
        from bridge.topics import declare_topics, tenant_topics, topic_prefix

        names = list(tenant_names) or list(
            db.session.scalars(select(Tenant.name).order_by(Tenant.name)))
        for name in names:
            _tenant(name)
        settings = client_settings()
        prefix = topic_prefix()
        created = declare_topics(settings["bootstrap.servers"], prefix, names, partitions,
                                 settings)
        for name in names:
            for topic in tenant_topics(prefix, name):
                click.echo(f"{topic}\t{'created' if topic in created else 'exists'}")
