"""Operator commands: ``flask --app app tenants|tokens|runs ...``."""

from __future__ import annotations

import json

import pytest


@pytest.fixture
def cli(app):
    return app.test_cli_runner()


def test_tenants_and_tokens_lifecycle(cli, client, pg):
    out = cli.invoke(args=["tenants", "create", "acme"])
    assert out.exit_code == 0, out.output
    assert cli.invoke(args=["tenants", "create", "acme"]).exit_code != 0  # exists
    assert cli.invoke(args=["tenants", "create", "acme", "--exist-ok"]).exit_code == 0
    assert cli.invoke(args=["tenants", "create", "Bad.Name"]).exit_code != 0  # not topic-safe

    token = cli.invoke(args=["tokens", "create", "--tenant", "acme"]).output.strip()
    assert token.startswith("pmn_")
    stored = pg.execute("SELECT token_hash FROM api_tokens").fetchone()[0]
    assert token not in stored  # only the hash is kept
    headers = {"Authorization": f"Bearer {token}"}
    assert client.get("/v1/runs", headers=headers).status_code == 200

    revoked = cli.invoke(args=["tokens", "revoke", token[:12]])
    assert revoked.exit_code == 0 and "revoked 1" in revoked.output
    assert cli.invoke(args=["tokens", "revoke", token[:12]]).exit_code != 0  # nothing left


def test_service_token_needs_no_tenant(cli):
    out = cli.invoke(args=["tokens", "create", "--service", "--label", "inbox"])
    assert out.exit_code == 0 and out.output.startswith("pmn_")
    assert cli.invoke(args=["tokens", "create"]).exit_code != 0  # neither --tenant nor --service


def test_runs_show_and_redrive(cli, client, tenant, redis_client, queue_name, sent):
    run_id = client.post("/v1/runs", json={"workflow_ref": "echo", "input": {"a": 1}},
                         headers=tenant.headers).json["id"]
    sent()
    shown = cli.invoke(args=["runs", "show", run_id])
    assert shown.exit_code == 0
    assert json.loads(shown.output)["input"] == {"a": 1}

    redis_client.delete(queue_name)  # the message is lost
    out = cli.invoke(args=["runs", "redrive"])
    assert out.exit_code == 0 and "re-sent 1 of 1" in out.output
    assert redis_client.llen(queue_name) == 1
    assert "re-sent 0 of 0" in cli.invoke(args=["runs", "redrive", "--older-than", "3600"]).output


def test_schedules_list_shows_each_schedule_its_next_tick_and_last_run(cli, tenant, admit):
    from workers import registry
    from workers.registry import Step, Workflow, action

    name = "cli-scheduled"
    registry.register(Workflow(
        name, "1", [Step("main", actions=[action(lambda ctx, input: input, position=0)])],
        schedule=3600, schedule_tenant=tenant.name))
    try:
        before = cli.invoke(args=["schedules", "list"])
        assert before.exit_code == 0, before.output
        line = next(row for row in before.output.splitlines() if row.startswith(name))
        assert "every 3600s" in line and f"tenant {tenant.name}" in line
        assert "catch_up last" in line and "next " in line and "last none yet" in line

        run_id = admit(name, {}, dispatch_key=f"schedule:{name}:2026-12-01T10:00:00Z")
        after = cli.invoke(args=["schedules", "list"]).output
        line = next(row for row in after.splitlines() if row.startswith(name))
        assert f"schedule:{name}:2026-12-01T10:00:00Z -> {run_id} (queued)" in line
    finally:
        registry._registry.pop(name, None)
