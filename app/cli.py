"""Operator commands: ``flask --app app tenants|tokens|runs|topics ...``.

Commands only parse options, call the domain functions (``tenants``, ``runs``)
and translate their errors into messages; they hold no SQL of their own.
"""

from __future__ import annotations

import functools
import uuid
from typing import Any

import click
from flask import Flask, current_app

from poimenconfig import DEFAULT_TOPIC_PARTITIONS

from . import run_service, tenant_service
from .auth import SCOPES
from .extensions import db


def _domain_errors(command):
    """Show a domain error as a one-line CLI error (exit status 1)."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except tenant_service.TenantError as err:
            raise click.ClickException(str(err)) from err

    return wrapper


class _Migrations(click.Group):
    """``flask db``: Flask-Migrate's command group, loaded when ``flask db`` runs.

    Flask-Migrate imports Alembic, about 0.1 s of CPU that no web, worker or beat process
    needs; only the release phase (``flask db upgrade``) and an operator's ``flask db``
    do. When ``flask db ...`` is parsed, this binds the extension to the CLI's app (the
    checkout's or the wheel's scripts, ``migrations_directory``) and hands the arguments
    to Flask-Migrate's own group, which then parses, helps and runs as it always does.
    """

    def make_context(self, info_name: str | None, args: list[str],
                     parent: click.Context | None = None, **extra: Any) -> click.Context:
        from flask.cli import ScriptInfo
        from flask_migrate import Migrate
        from flask_migrate.cli import db as group

        from . import migrations_directory

        assert parent is not None  # a subcommand of ``flask``
        app = parent.ensure_object(ScriptInfo).load_app()
        if "migrate" not in app.extensions:
            Migrate(app, db, directory=str(migrations_directory()))
        return group.make_context(info_name, args, parent=parent, **extra)


def register_cli(app: Flask) -> None:
    app.cli.add_command(_Migrations("db", help="Perform database migrations."))

    @app.cli.group()
    def tenants():
        """Create, list and limit tenants."""

    @tenants.command("create")
    @click.argument("name")
    @click.option("--exist-ok", is_flag=True, help="Succeed if the tenant already exists.")
    @_domain_errors
    def tenants_create(name: str, exist_ok: bool):
        """Create tenant NAME."""
        tenant = tenant_service.create_tenant(name, exist_ok=exist_ok)
        click.echo(f"tenant {tenant.name} (id {tenant.id})")

    @tenants.command("list")
    def tenants_list():
        """List tenants."""
        for tenant in tenant_service.list_tenants():
            cap = "" if tenant.max_running is None else f"\tmax-running {tenant.max_running}"
            rate = "" if tenant.rate_limit is None else f"\trate-limit {tenant.rate_limit}"
            click.echo(f"{tenant.id}\t{tenant.name}{cap}{rate}")

    @tenants.command("set")
    @click.argument("name")
    @click.option("--max-running", type=int, default=None,
                  help="At most this many of the tenant's runs run at once.")
    @click.option("--no-max-running", is_flag=True, help="Remove the tenant's cap.")
    @click.option("--rate-limit", default=None, metavar="N/UNIT",
                  help="At most N of the tenant's runs start per s, m or h (e.g. 50/s), "
                       "across every worker.")
    @click.option("--no-rate-limit", is_flag=True, help="Remove the tenant's rate limit.")
    @_domain_errors
    def tenants_set(name: str, max_running: int | None, no_max_running: bool,
                    rate_limit: str | None, no_rate_limit: bool):
        """Set tenant NAME's limits: --max-running N caps its running runs, --rate-limit
        N/UNIT its starts."""
        cap_given = max_running is not None or no_max_running
        rate_given = rate_limit is not None or no_rate_limit
        if (max_running is not None and no_max_running) or (rate_limit and no_rate_limit) \
                or not (cap_given or rate_given):
            raise click.UsageError("give --max-running N or --no-max-running, and/or "
                                   "--rate-limit N/UNIT or --no-rate-limit")
        from .enqueue import sender

        if rate_given:
            tenant = tenant_service.set_rate_limit(name, None if no_rate_limit else rate_limit)
            click.echo(f"tenant {tenant.name}: rate limit {tenant.rate_limit or 'none'}")
        if not cap_given:
            return
        change = tenant_service.set_max_running(name, None if no_max_running else max_running)
        tenant = change.tenant
        cap = "none" if tenant.max_running is None else tenant.max_running
        woken = f" ({len(change.woken)} waiting run(s) re-queued)" if change.woken else ""
        click.echo(f"tenant {tenant.name}: max running {cap}{woken}")
        # The runs it re-queued go out before the command exits: a send left to exit
        # time finds the interpreter shutting down (beat's repair would re-send them).
        if change.woken and not sender(current_app.extensions["celery"]).wait_idle(10):
            click.echo("the broker did not take every re-queued run; beat's repair re-sends "
                       "them", err=True)

    @app.cli.group()
    def schedules():
        """The workflows beat admits on a schedule."""

    @schedules.command("list")
    def schedules_list():
        """List each schedule: its workflow, tenant, next tick (UTC) and last run."""
        from datetime import UTC, datetime

        from workers import registry

        now = datetime.now(UTC)
        scheduled = registry.scheduled()
        if not scheduled:
            click.echo("no workflow declares a schedule")
        for wf in scheduled:
            last = run_service.last_run_keyed(db.session, wf.schedule_tenant,
                                              wf.schedule_key_prefix)
            last_text = (f"{last.dispatch_key} -> {last.id} ({last.status})" if last is not None
                         else "none yet")
            nxt = wf.next_tick(now).strftime("%Y-%m-%dT%H:%M:%SZ")
            click.echo(f"{wf.name}\t{wf.schedule_description()}\ttenant {wf.schedule_tenant}"
                       f"\tcatch_up {wf.catch_up}\tnext {nxt}\tlast {last_text}")

    @app.cli.group()
    def tokens():
        """Create and revoke API tokens."""

    @tokens.command("create")
    @click.option("--tenant", "tenant_name", help="The tenant the token acts for.")
    @click.option("--service", is_flag=True,
                  help="A service token: may act for any tenant named in X-Poimen-Tenant.")
    @click.option("--label", help="A note saying who holds the token.")
    @click.option("--scope", type=click.Choice(SCOPES),
                  help="Limit or widen the token: 'admit' may only POST /v1/runs (the inbox's "
                       "token); 'admin' may also do the operator's actions (replaying dead "
                       "letters from the console).")
    @_domain_errors
    def tokens_create(tenant_name: str | None, service: bool, label: str | None,
                      scope: str | None):
        """Create a token and print it (shown this once)."""
        if not tenant_name and not service:
            raise click.UsageError("give --tenant NAME, or --service")
        tenant = tenant_service.find_tenant(tenant_name) if tenant_name else None
        click.echo(tenant_service.create_token(tenant, service, label, scope=scope))

    @tokens.command("revoke")
    @click.argument("token_or_prefix")
    @_domain_errors
    def tokens_revoke(token_or_prefix: str):
        """Revoke a token, given the token itself or its 12-character prefix."""
        count = tenant_service.revoke_token(token_or_prefix)
        click.echo(f"revoked {count} token(s)")

    @app.cli.group()
    def runs():
        """Inspect and re-drive runs."""

    @runs.command("show")
    @click.argument("run_id")
    def runs_show(run_id: str):
        """Print one run as JSON."""
        from .admission import dumps
        from .admission_handler import serialize_run

        try:
            found = run_service.find_run(db.session, uuid.UUID(run_id))
        except ValueError:
            found = None
        if found is None:
            raise click.ClickException(f"no run {run_id}")
        run, tenant_name = found
        click.echo(dumps(serialize_run(run, tenant_name), indent=2))

    @runs.command("redrive")
    @click.option("--older-than", default=0.0, help="Only runs queued at least this many seconds.")
    def runs_redrive(older_than: float):
        """Re-send queued runs, and runs held by dead workers (claims absorb duplicates).

        The same repair as beat's, for every stranded run at once: a dead worker's run
        is delivered once the worker is gone (its lock first seen free T_c + kill +
        margin ago), and POIMEN_TAKEOVER_DELAY after it is sent at the earliest.
        """
        sent, found = run_service.redrive_stranded_runs(
            db.session, current_app.extensions["celery"], min_age=older_than, limit=None,
            takeover_delay=current_app.config["POIMEN_TAKEOVER_DELAY"])
        click.echo(f"re-sent {sent} of {found} run(s) (queued, or held by dead workers)")

    @app.cli.group()
    def topics():
        """Declare tenants' Kafka topics (dispatch, dispatch.dlq, events)."""

    @topics.command("declare")
    @click.option("--tenant", "tenant_names", multiple=True,
                  help="Tenant name; repeat for several (default: every tenant).")
    @click.option("--partitions", default=DEFAULT_TOPIC_PARTITIONS, show_default=True)
    @_domain_errors
    def topics_declare(tenant_names: tuple[str, ...], partitions: int):
        """Create each tenant's topics; topics that exist are left as they are."""
        from bridge.topics import declare_topics, tenant_topics
        from poimenconfig import kafka_client_settings, topic_prefix, topic_replication

        names = list(tenant_names) or [t.name for t in tenant_service.list_tenants()]
        for name in names:
            tenant_service.find_tenant(name)
        settings = kafka_client_settings()
        prefix = topic_prefix()
        created = declare_topics(settings["bootstrap.servers"], prefix, names, partitions,
                                 settings, replication_factor=topic_replication())
        for name in names:
            for topic in tenant_topics(prefix, name):
                click.echo(f"{topic}\t{'created' if topic in created else 'exists'}")

    @topics.command("replay-dlq")
    @click.option("--tenant", "tenant_name", required=True, help="The tenant whose DLQ to replay.")
    @click.option("--reason", help="Only dead letters with this reason (poimen.dlq.reason).")
    @click.option("--since", help="Again, those dead-lettered since: ISO 8601 time, or an age "
                                  "(30m, 2h, 7d); replayed ones and copies included.")
    @click.option("--from-start", is_flag=True,
                  help="Again, the whole topic: replayed ones and copies included.")
    @click.option("--dry-run", is_flag=True, help="List what would be replayed; publish nothing.")
    @_domain_errors
    def topics_replay_dlq(tenant_name: str, reason: str | None, since: str | None,
                          from_start: bool, dry_run: bool):
        """Re-publish a tenant's dead letters to its dispatch topic (safe to run twice).

        Each dead letter is replayed once: a replay starts where the last one
        ended (the poimen-dlq-replay group's offsets, committed once the broker
        acknowledged the copies) and skips what an earlier replay published
        that was dead-lettered again (the copy, and the letter it names), so N
        letters that keep failing stay at most 2N. --from-start or --since read
        again on
        purpose, each message still published once per replay. A message keeps
        its dispatch key (a keyless one gets the key derived from its origin), so
        publishing it again yields the same run, never a second.
        """
        from confluent_kafka import KafkaException

        from bridge.dlq import parse_since, replay_dead_letters
        from poimenconfig import REPLAY_GROUP, consumer_group, kafka_client_settings, topic_prefix

        tenant_service.find_tenant(tenant_name)
        if since and from_start:
            raise click.UsageError("give --since or --from-start, not both")
        try:
            when = parse_since(since) if since else None
        except ValueError as err:
            raise click.BadParameter(str(err), param_hint="--since") from None
        try:
            report = replay_dead_letters(
                kafka_client_settings(), topic_prefix(), tenant_name,
                group=consumer_group(REPLAY_GROUP), reason=reason, since=when,
                from_start=from_start, dry_run=dry_run, show=click.echo)
        except (RuntimeError, TimeoutError, KafkaException) as err:
            raise click.ClickException(str(err)) from err
        click.echo(report.summary(dry_run))
