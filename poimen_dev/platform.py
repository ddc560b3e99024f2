"""``make run``: migrate, ensure the ``dev`` tenant and tokens, start the Procfile."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from . import _log, state_dir

DEV_TENANT = "dev"
WEB_PORT = "8000"


PROCFILE = Path(__file__).resolve().parent.parent / "Procfile"


def procfile_commands(path: Path = PROCFILE) -> dict[str, str]:
    """Return the Procfile's ``name -> command``, in order."""
    commands = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#") and ":" in line:
            name, _, command = line.partition(":")
            commands[name.strip()] = command.strip()
    return commands


def _ensure_token(path: Path, tenant: str | None, service: bool, label: str,
                  scope: str | None = None) -> str:
    """Return the dev token stored at ``path``, registering it if the database lacks it."""
    from app.auth import new_token
    from app.tenant_service import (
        NoActiveToken,
        create_tenant,
        create_token,
        revoke_token,
        token_registered,
        token_scope,
    )

    token = path.read_text().strip() if path.exists() else new_token()
    if token_registered(token) and token_scope(token) != scope:
        # Made before tokens had scopes (an inbox token that could read every run):
        # replace it rather than keep a broader token than the process needs.
        try:
            revoke_token(token)
        except NoActiveToken:
            pass  # revoked already
        token = new_token()
    if not token_registered(token):
        owner = create_tenant(tenant, exist_ok=True) if tenant else None
        create_token(owner, service, label, token=token, scope=scope)
    path.write_text(token + "\n")
    path.chmod(0o600)
    return token


def _ensure_secret(path: Path) -> str:
    """Return the secret kept at ``path``, making one the first time (the console's key)."""
    import secrets

    secret = path.read_text().strip() if path.exists() else ""
    if len(secret) < 32:
        secret = secrets.token_urlsafe(48)
        path.write_text(secret + "\n")
    path.chmod(0o600)
    return secret


def bootstrap(env: Mapping[str, str]) -> tuple[str, str]:
    """Migrate; make sure the dev tenant, its token, the inbox's token and its topics exist."""
    _log("migrating the database (flask db upgrade) ...")
    subprocess.run([sys.executable, "-m", "flask", "--app", "app", "db", "upgrade"],
                   env=dict(env), check=True)
    os.environ.update(env)
    from app import create_app
    from app.auth import ADMIN, ADMIT

    with create_app().app_context():
        d = state_dir()
        # The developer is the operator here: the console's operator actions (replaying
        # dead letters) need the admin scope.
        tenant_token = _ensure_token(d / "dev-token", DEV_TENANT, False, "make run",
                                     scope=ADMIN)
        # The inbox only admits runs: its token can do nothing else.
        service_token = _ensure_token(d / "service-token", None, True, "make run inbox",
                                      scope=ADMIT)
    from bridge.topics import declare_topics
    from poimenconfig import (
        DEFAULT_TOPIC_PARTITIONS,
        kafka_client_settings,
        topic_prefix,
        topic_replication,
    )

    settings = kafka_client_settings(env)
    declare_topics(settings["bootstrap.servers"], topic_prefix(env), [DEV_TENANT],
                   DEFAULT_TOPIC_PARTITIONS, settings, topic_replication(env))
    return tenant_token, service_token


def run_platform(env: Mapping[str, str], processes: list[str]) -> int:
    """Bootstrap, print how to use it, and run the processes under honcho until Ctrl-C."""
    env = dict(env)
    env.setdefault("PORT", WEB_PORT)
    env.setdefault("POIMEN_API_URL", f"http://127.0.0.1:{env['PORT']}")
    tenant_token, service_token = bootstrap(env)
    env.setdefault("POIMEN_API_TOKEN", service_token)
    # The console's session key: kept, so a restart of `make run` keeps people signed in.
    env.setdefault("POIMEN_CONSOLE_SECRET", _ensure_secret(state_dir() / "console-secret"))
    names = processes or [p for p in procfile_commands() if p != "release"]
    # honcho gives each process PORT = base + 100 * position: web first gets PORT.
    names.sort(key=lambda n: (n != "web", n != "flower"))
    port = int(env["PORT"])
    print(
        "\n"
        f"Poimen is starting: {', '.join(names)}\n"
        f"  API     http://127.0.0.1:{port}  (OpenAPI: /v1/openapi.json)\n"
        + (f"  Console http://127.0.0.1:{port}/console  (sign in with the token below)\n"
           if "web" in names else "")
        + (f"  Flower  http://127.0.0.1:{port + 100}\n" if "flower" in names else "")
        + f"  tenant  {DEV_TENANT}\n"
        f"  token   {tenant_token}\n\n"
        f"  export POIMEN_TOKEN={tenant_token}\n"
        f"  curl -s -X POST http://127.0.0.1:{port}/v1/runs \\\n"
        f"    -H \"Authorization: Bearer $POIMEN_TOKEN\" -H 'Content-Type: application/json' \\\n"
        "    -d '{\"workflow_ref\": \"echo\", \"input\": {\"hello\": \"world\"}, "
        "\"dispatch_key\": \"demo-1\"}'\n",
        flush=True,
    )
    cmd = [sys.executable, "-m", "honcho", "start", "-p", str(port), *names]
    proc = subprocess.Popen(cmd, env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        return proc.wait()
