"""Throwaway databases for tests and benchmarks, migrated like the release phase does."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def scratch_database(server_url: str, prefix: str, env: Mapping[str, str],
                     migrate: bool = True) -> Iterator[str]:
    """Create ``<prefix>_<id>`` on ``server_url``'s server, migrate it, drop it after.

    Yields the database's libpq URL. Migrated with ``flask db upgrade`` (the
    real migrations, so the partial unique index really exists), with ``env``
    plus ``DATABASE_URL`` pointing at the new database; ``migrate=False`` leaves
    it empty, for a caller that runs the release step itself.
    """
    import psycopg
    from sqlalchemy.engine import make_url

    from poimenconfig import libpq_url

    server = make_url(libpq_url(server_url))
    admin = server.render_as_string(hide_password=False)
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        url = server.set(database=name).render_as_string(hide_password=False)
        if migrate:
            upgrade = subprocess.run(
                [sys.executable, "-m", "flask", "--app", "app", "db", "upgrade"],
                env={**env, "DATABASE_URL": url}, cwd=ROOT, capture_output=True, text=True,
            )
            if upgrade.returncode != 0:
                raise RuntimeError(f"migration failed:\n{upgrade.stdout}{upgrade.stderr}")
        yield url
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
