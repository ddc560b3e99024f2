"""The settings table is complete and current, and the code takes its defaults from it.

Every environment variable the code reads must be in ``settings_table.py`` (from which
``app/settings_reference.py`` generates ``docs/operations/configuration.md``), and every
entry must be read. The settings readers (``poimenconfig.py``, ``celeryconfig.py``,
``logconfig.py``) read only through the table's accessors (``get_str(env, "NAME")`` and
the like), so a default or a parsing is written once; no read anywhere passes a default
of its own; the Procfile's ``${NAME:-default}`` states the table's default. The product
reads the environment in one module, ``poimenconfig.py`` (``tests/test_wiring.py`` fails on a read anywhere
else in ``app/``, ``workers/``, ``bridge/`` or ``lease.py``), plus the framework
entry points ``celeryconfig.py``, ``app/gunicorn_conf.py`` and ``logconfig.py``; the dev
tooling (``poimen_dev/``) reads its own. Reads are found there with ``ast``:
``os.environ[...]``, ``os.environ.get/pop/setdefault(...)``, ``os.getenv(...)``,
``"X" in os.environ``, and the same on ``env`` (the ``Mapping`` parameter each
reader takes, ``os.environ`` by default), and a call of a table accessor
(``settings_table.ACCESSORS``) naming the variable. A read by a variable (``env.get(variable)``) is
resolved through the module's constants: the upper-case names its module-level
strings, tuples, sets and dicts (keys and values) spell. ``${NAME...}`` in the
Procfile and the container entrypoint are reads too.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import settings_table
from app import settings_reference
from tests.processes import ROOT

READERS = ("poimenconfig.py", "celeryconfig.py", "logconfig.py", "app/gunicorn_conf.py")
# The readers that read every variable through the table (gunicorn's configuration file
# only checks whether PROMETHEUS_MULTIPROC_DIR and LOG_LEVEL are set, and sets the former).
TABLE_READERS = ("poimenconfig.py", "celeryconfig.py", "logconfig.py")
SOURCES = ("poimen_dev",)
SHELL_FILES = ("Procfile", "bin/docker-entrypoint")
ENV_NAME = re.compile(r"^[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*$")
ACCESSORS = {"get", "pop", "setdefault"}


def python_files() -> list[Path]:
    files = [ROOT / name for name in READERS]
    return files + [p for pkg in SOURCES for p in sorted((ROOT / pkg).rglob("*.py"))]


class EnvReads(ast.NodeVisitor):
    """Collect the environment variable names one module reads."""

    def __init__(self, tree: ast.Module):
        # `environ` is os.environ only if imported from os (a WSGI app's `environ` is not).
        self.environ_is_os = any(
            isinstance(n, ast.ImportFrom) and n.module == "os"
            and any(a.name == "environ" for a in n.names) for n in ast.walk(tree))
        self.literal: dict[str, int] = {}
        self.by_variable: list[int] = []
        # Reads of the environment itself (not through a table accessor), and those of
        # them that pass a default of their own: "line: code" of each.
        self.direct: list[int] = []
        self.own_default: list[int] = []
        self.visit(tree)

    def is_env(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Attribute):
            return node.attr == "environ"
        if isinstance(node, ast.Name):
            return node.id == "env" or (node.id == "environ" and self.environ_is_os)
        return False

    def read(self, name: ast.AST | None, lineno: int) -> None:
        if isinstance(name, ast.Constant) and isinstance(name.value, str):
            self.literal.setdefault(name.value, lineno)
        elif name is not None:
            self.by_variable.append(lineno)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if node.args and (
                (isinstance(func, ast.Attribute) and func.attr in ACCESSORS and self.is_env(func.value))
                or (isinstance(func, ast.Attribute) and func.attr == "getenv")
                or (isinstance(func, ast.Name) and func.id == "getenv")):
            self.read(node.args[0], node.lineno)
            self.direct.append(node.lineno)
            if len(node.args) > 1 or node.keywords:
                self.own_default.append(node.lineno)
        called = (func.attr if isinstance(func, ast.Attribute)
                  else func.id if isinstance(func, ast.Name) else None)
        if called in settings_table.ACCESSORS and len(node.args) == 2 and self.is_env(node.args[0]):
            self.read(node.args[1], node.lineno)
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if self.is_env(node.value) and isinstance(node.ctx, ast.Load):
            self.read(node.slice, node.lineno)
            self.direct.append(node.lineno)
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        if any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) and any(
                self.is_env(c) for c in node.comparators):
            self.read(node.left, node.lineno)
            self.direct.append(node.lineno)
        self.generic_visit(node)


def module_constant_names(tree: ast.Module) -> set[str]:
    """Upper-case names spelled by the module-level constants of ``tree``."""
    found = set()
    for stmt in tree.body:
        value = stmt.value if isinstance(stmt, (ast.Assign, ast.AnnAssign)) else None
        if value is None:
            continue
        for node in ast.walk(value):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and ENV_NAME.match(
                    node.value):
                found.add(node.value)
    return found


def variables_read() -> dict[str, str]:
    """``{variable: "path:line"}`` for every variable the code reads."""
    reads: dict[str, str] = {}
    for path in python_files():
        tree = ast.parse(path.read_text(), str(path))
        module = EnvReads(tree)
        where = str(path.relative_to(ROOT))
        for name, line in module.literal.items():
            reads.setdefault(name, f"{where}:{line}")
        if module.by_variable:
            for name in module_constant_names(tree):
                reads.setdefault(name, f"{where}:{module.by_variable[0]} (by variable)")
    for name in SHELL_FILES:
        path = ROOT / name
        if path.exists():
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if line.lstrip().startswith("#"):
                    continue
                for match in re.finditer(r"\$\{?([A-Z][A-Z0-9_]*)", line):
                    reads.setdefault(match.group(1), f"{name}:{number}")
    return reads


def documented(name: str, names: set[str]) -> bool:
    # KAFKA_<ANY> is a librdkafka setting (bridge/kafka.py), documented as one row.
    return name in names or (name.startswith("KAFKA_") and "KAFKA_*" in names)


def test_every_variable_the_code_reads_is_in_the_reference():
    reads = variables_read()
    # The scan itself must see reads of each kind, or it proves nothing.
    assert reads["DATABASE_URL"].startswith("poimenconfig.py")
    assert reads["POIMEN_LEASE_SERVER_SECONDS"].startswith("poimenconfig.py")
    assert reads["POIMEN_SHUTDOWN_GRACE"].startswith("poimenconfig.py")
    assert "POIMEN_INBOX_CONCURRENCY" in reads      # poimenconfig.py reads INBOX_VARIABLES by variable
    assert "POIMEN_VISIBILITY_TIMEOUT" in reads     # celeryconfig.py
    assert "WEB_CONCURRENCY" in reads               # Procfile
    assert "PATH_INFO" not in reads                 # a WSGI environ, not the process's
    assert reads["POIMEN_ACK_PENDING_MAX"].startswith("celeryconfig.py")  # by an accessor
    names = settings_reference.names()
    missing = sorted(f"{name} ({where})" for name, where in reads.items()
                     if not documented(name, names))
    assert not missing, ("read by the code but not in settings_table.py: "
                         + ", ".join(missing))


# Documented, but read only by the test suite (tests/), which this scan does not cover.
READ_BY_TESTS_ONLY = {"POIMEN_TEST_AMQP_URL", "POIMEN_CONSOLE_SCREENSHOT"}


def test_every_variable_in_the_reference_is_still_read():
    reads = variables_read()
    stale = sorted(name for name in settings_reference.names() - READ_BY_TESTS_ONLY
                   if name != "KAFKA_*" and name not in reads)
    assert not stale, f"in settings_table.py but read nowhere: {stale}"


def test_the_reference_lists_each_variable_once_with_its_processes():
    seen = [s.name for s in settings_reference.SETTINGS]
    assert len(seen) == len(set(seen)), sorted({n for n in seen if seen.count(n) > 1})
    known = set(settings_reference.PROCESS_NOTES)
    for setting in settings_reference.SETTINGS:
        assert setting.processes and set(setting.processes) <= known, setting
        assert setting.doc.strip(), setting


@pytest.mark.processes
def test_docs_configuration_md_is_generated_from_the_reference():
    proc = subprocess.run([sys.executable, "-m", "app.settings_reference", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr + " (run `make docs` and commit docs/operations/configuration.md)"


def test_the_settings_readers_read_only_through_the_table():
    """A default, a type and a parse are the table's: the readers never read ``env``
    themselves, and no read anywhere passes a default of its own."""
    for name in READERS:
        path = ROOT / name
        module = EnvReads(ast.parse(path.read_text(), str(path)))
        lines = path.read_text().splitlines()
        assert not module.own_default, [f"{name}:{n}: {lines[n - 1].strip()}"
                                        for n in module.own_default]
        if name in TABLE_READERS:
            assert not module.direct, [f"{name}:{n}: {lines[n - 1].strip()}"
                                       for n in module.direct]


def test_the_scan_sees_a_read_that_bypasses_the_table():
    code = ('def f(env):\n    return get_int(env, "POIMEN_A"), int(env.get("POIMEN_B", "5")),'
            ' env["POIMEN_C"], settings_table.raw(env, "POIMEN_D")\n')
    module = EnvReads(ast.parse(code))
    assert set(module.literal) == {"POIMEN_A", "POIMEN_B", "POIMEN_C", "POIMEN_D"}
    assert module.own_default == [2] and module.direct == [2, 2]


def test_the_procfile_states_the_tables_defaults():
    text = (ROOT / "Procfile").read_text()
    found = re.findall(r"\$\{([A-Z][A-Z0-9_]*):-([^}]*)\}", text)
    assert found, "the scan finds the Procfile's defaults"
    for name, default in found:
        entry = settings_table.setting(name)
        assert default in entry.default_text, (name, default, entry.default_text)


def test_every_default_is_of_its_type_and_reads_back():
    for entry in settings_table.SETTINGS:
        if entry.default is not None:
            assert type(entry.default) is entry.kind, entry
            assert entry.parse(entry.default_text if entry.shown is None
                               else str(entry.default)) == entry.default, entry


def test_the_readers_give_the_tables_defaults():
    """Every reader run on an empty environment (each accessor call checks the kind it
    reads against the table's) gives the table's default wherever it names the variable."""
    import celeryconfig
    import logconfig
    import poimenconfig as config

    table = settings_table.BY_NAME
    flask = config.load_config({})
    for key, value in flask.items():
        if key in table and isinstance(value, (int, float)) and not isinstance(value, bool):
            assert value == table[key].default, key
    engine = flask["SQLALCHEMY_ENGINE_OPTIONS"]
    assert engine["pool_size"] == table["POIMEN_DB_POOL_SIZE"].default
    for url in ("redis://127.0.0.1:6379/0", "amqp://guest@127.0.0.1//"):
        celeryconfig.celery_settings(url, {})
    redis = celeryconfig.celery_settings("redis://x", {})["broker_transport_options"]
    assert redis["visibility_timeout"] == table["POIMEN_VISIBILITY_TIMEOUT"].default
    assert logconfig.level({}) == 20 and not logconfig.json_enabled({})
    env = {"POIMEN_API_URL": "http://api", "POIMEN_API_TOKEN": "t", "DATABASE_URL": "postgres://x",
           "KAFKA_BOOTSTRAP_SERVERS": "k:9092"}
    inbox, outbox = config.inbox_settings(env), config.outbox_settings(env)
    for field, variable in config.INBOX_VARIABLES.items():
        default = table[variable].default
        if default is not None:
            assert getattr(inbox, field) == default, variable
    assert inbox.metrics_port == settings_table.INBOX_METRICS_PORT
    assert outbox.metrics_port == settings_table.OUTBOX_METRICS_PORT
    assert outbox.retention == 7 * 86400 and table["POIMEN_OUTBOX_RETENTION"].default == "7d"
    assert outbox.lease == config.lease_settings({})
    assert config.lease_settings({}).server_seconds == table["POIMEN_LEASE_SERVER_SECONDS"].default
    assert config.max_takeovers_setting({}) == table["POIMEN_MAX_TAKEOVERS"].default
    assert config.topic_replication({}) == table["POIMEN_TOPIC_REPLICATION"].default
    config.telemetry_settings({})


def test_a_read_of_another_kind_than_the_tables_fails():
    with pytest.raises(TypeError, match="POIMEN_BATCH_MAX is a int setting, read as float"):
        settings_table.get_float({}, "POIMEN_BATCH_MAX")
    with pytest.raises(KeyError):
        settings_table.get_str({}, "POIMEN_NO_SUCH_SETTING")
