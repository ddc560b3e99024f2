"""Wiring: the deployment file, task names, settings and package boundaries."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from poimen_dev.platform import procfile_commands
from tests.processes import ROOT

DESIGN_PROCESSES = {"release", "web", "worker", "beat", "flower"}


def test_procfile_declares_the_design_processes():
    commands = procfile_commands()
    assert DESIGN_PROCESSES <= set(commands)
    assert commands["release"] == "flask --app app db upgrade"
    assert '"app:create_app()"' in commands["web"] and "${PORT" in commands["web"]
    assert commands["worker"].startswith("celery -A workers worker")
    assert commands["beat"].startswith("celery -A workers beat")
    assert commands["flower"].startswith("celery -A workers flower") and "${PORT" in commands[
        "flower"]
    for name in ("inbox", "outbox"):
        if name in commands:
            assert commands[name] == f"python -m bridge.{name}"
            assert ((ROOT / "bridge" / f"{name}.py").exists()
                    or (ROOT / "bridge" / name / "__main__.py").exists())


def test_every_task_the_platform_sends_is_registered_by_the_worker(app):
    from app import task_names
    from workers import tasks

    names = {tasks.execute.name, tasks.repair.name}
    # The wire names are a contract with queued messages: pinned here, not read from code.
    assert names == task_names.ALL == {"runs.execute", "runs.repair"}
    celery_app = app.extensions["celery"]
    assert {entry["task"] for entry in celery_app.conf.beat_schedule.values()} <= names


def _imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports (absolute names), at any depth of the file."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


# app/ may use the workflow registry (to validate and pin workflow_ref) and
# nothing else of workers/: dependencies point from workers/ to app/.
APP_MAY_IMPORT_FROM_WORKERS = {"workers", "workers.registry"}


def test_app_imports_nothing_from_workers_but_the_registry():
    for path in sorted((ROOT / "app").rglob("*.py")):
        bad = sorted(m for m in _imported_modules(path)
                     if m.split(".")[0] == "workers" and m not in APP_MAY_IMPORT_FROM_WORKERS)
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


@pytest.mark.processes  # a fresh interpreter: what importing loads
def test_importing_app_loads_no_worker_module():
    modules = [p.stem for p in (ROOT / "app").glob("*.py") if p.stem != "__init__"]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module('app.' + m)\n"
        f"allowed = {sorted(APP_MAY_IMPORT_FROM_WORKERS)!r}\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'workers' and m not in allowed)\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_only_the_store_writes_the_outbox():
    """(Every table of run state: tests/test_state_store.py.)"""
    writers = sorted(str(p.relative_to(ROOT)) for pkg in ("app", "workers", "bridge")
                     for p in (ROOT / pkg).rglob("*") if p.suffix in (".py", ".sql")
                     and "INSERT INTO outbox" in p.read_text())
    assert writers and all(w.startswith("app/state/sql/") for w in writers), writers


def test_celery_settings_are_at_least_once():
    from celeryconfig import celery_settings

    settings = celery_settings("redis://x", env={})
    assert settings["task_acks_late"] and settings["task_reject_on_worker_lost"]
    assert settings["accept_content"] == ["json"]
    assert settings["task_serializer"] == "json"


def test_heroku_postgres_urls_are_accepted():
    from poimenconfig import broker_url, database_url

    assert database_url("postgres://u:p@h:5432/d") == "postgresql+psycopg://u:p@h:5432/d"
    assert database_url("postgresql://u@h/d") == "postgresql+psycopg://u@h/d"
    assert broker_url({"REDIS_URL": "redis://a", "CELERY_BROKER_URL": "redis://b"}) == "redis://b"
    assert broker_url({"REDIS_URL": "redis://a"}) == "redis://a"


@pytest.mark.processes  # a fresh interpreter: what importing loads
def test_importing_the_packages_reads_no_settings():
    """Config is read by the factory, never at import: imports work with an empty env."""
    code = ("import app, app.api, app.admission, app.run_service, app.tenant_service, workers, app.state.claims, "
            "workers.tasks, bridge")
    proc = subprocess.run([sys.executable, "-c", code], env={"PATH": "/usr/bin:/bin"},
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


# Alembic is the release phase's: a web, worker or beat process creates the app without
# it, and ``flask db`` loads Flask-Migrate's commands when it runs. The Kafka client and the
# HTTP client are the dead-letter replay's, loaded when a replay runs.
@pytest.mark.processes  # fresh interpreters: what creating the app loads, the CLI itself
def test_the_app_loads_alembic_only_for_flask_db_and_no_kafka_client():
    import os

    code = ("import sys\n"
            "from app import create_app\n"
            "create_app()\n"
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('alembic', 'flask_migrate', 'confluent_kafka', 'poimen_client'))\n"
            "assert not loaded, loaded\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    flask = str(Path(sys.executable).parent / "flask")
    listed = subprocess.run([flask, "--app", "app:create_app", "db", "--help"], cwd=ROOT,
                            env=dict(os.environ), capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    for command in ("upgrade", "downgrade", "current", "heads", "stamp"):
        assert f"  {command} " in listed.stdout, listed.stdout
    current = subprocess.run([flask, "--app", "app:create_app", "db", "heads"], cwd=ROOT,
                             env=dict(os.environ), capture_output=True, text=True, timeout=60)
    assert current.returncode == 0 and "(head)" in current.stdout, current.stderr


# bridge/ is a client of the API, never an in-process caller, and outside the app's
# lifecycle: it imports nothing of app/ or workers/. Its settings come from the top-level
# poimenconfig.py (standard library only), which loads no web or task framework.
@pytest.mark.processes  # a fresh interpreter: what importing loads
def test_bridge_imports_nothing_from_app_or_workers():
    modules = [p.stem for p in (ROOT / "bridge").glob("*.py") if p.stem != "__init__"]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module('bridge.' + m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('app', 'workers'))\n"
        "assert not bad, bad\n"
        "heavy = sorted(m for m in ('flask', 'celery', 'sqlalchemy') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for path in sorted((ROOT / "bridge").rglob("*.py")):
        bad = sorted(m for m in _imported_modules(path) if m.split(".")[0] in ("app", "workers"))
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


# -- one home for settings ---------------------------------------------------------------------

# The one module that reads the environment, and the framework entry points that
# Celery, gunicorn and the relays' logging load before any factory runs.
SETTINGS_READER = "poimenconfig.py"
ENTRY_POINTS = {"celeryconfig.py", "app/gunicorn_conf.py", "logconfig.py"}


def environment_reads(path: Path) -> list[str]:
    """``line: code`` of every read of the process environment in ``path``.

    A read is any use of ``os.environ`` (or ``environ`` imported from os) other
    than assigning one of its items, which configures a library
    (``PROMETHEUS_MULTIPROC_DIR``), and any call of ``os.getenv``/``getenv``. A
    WSGI app's ``environ`` parameter is not the process's.
    """
    tree = ast.parse(path.read_text(), str(path))
    from_os = {alias.asname or alias.name for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and node.module == "os"
               for alias in node.names}
    os_names = {alias.asname or alias.name for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names if alias.name == "os"}
    writes = {id(node.value) for node in ast.walk(tree)
              if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store)}
    lines = path.read_text().splitlines()
    found = []
    for node in ast.walk(tree):
        is_os_attr = (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                      and node.value.id in os_names)
        if ((is_os_attr and node.attr in ("environ", "environb") and id(node) not in writes)
                or (is_os_attr and node.attr == "getenv")
                or (isinstance(node, ast.Name) and node.id in from_os & {"environ", "getenv"}
                    and id(node) not in writes and not isinstance(node.ctx, ast.Store))):
            found.append((node.lineno, lines[node.lineno - 1].strip()))
    return [f"{line}: {code}" for line, code in sorted(set(found))]


def test_only_app_config_reads_the_environment():
    modules = [p for pkg in ("app", "workers", "bridge") for p in sorted((ROOT / pkg).rglob("*.py"))]
    modules.append(ROOT / "lease.py")
    readers = {}
    for path in modules:
        where = str(path.relative_to(ROOT))
        if where != SETTINGS_READER and where not in ENTRY_POINTS and environment_reads(path):
            readers[where] = environment_reads(path)
    assert not readers, ("read the environment outside poimenconfig.py (take the value from "
                         f"app.config instead): {readers}")
    # The scan sees what it must: the reader reads, and so do the entry points.
    assert environment_reads(ROOT / SETTINGS_READER)
    for name in ENTRY_POINTS:
        assert environment_reads(ROOT / name), name


def test_the_environment_scan_tells_reads_from_writes(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import os\nfrom os import environ, getenv\n"
        "os.environ['A'] = 'x'\n"               # line 3, a write: allowed
        "a = os.environ.get('B')\n"             # lines 4 to 9: reads
        "b = os.environ['C']\n"
        "c = 'D' in os.environ\n"
        "d = os.getenv('E')\n"
        "e = environ.get('F')\n"
        "f = getenv('G')\n")
    assert [int(r.split(":")[0]) for r in environment_reads(sample)] == [4, 5, 6, 7, 8, 9]
    wsgi = tmp_path / "wsgi.py"
    wsgi.write_text("def app(environ, start_response):\n    return environ.get('PATH_INFO')\n")
    assert environment_reads(wsgi) == []


def test_openapi_document_describes_every_route(app):
    from app.openapi import openapi_document

    doc = openapi_document()
    routes = {rule.rule.replace("<run_id>", "{run_id}") for rule in app.url_map.iter_rules()
              if rule.rule.startswith("/v1/")}
    assert routes == set(doc["paths"])
    assert doc["openapi"].startswith("3.")
