"""The configuration reference is complete and current.

Every environment variable the code reads must be in ``app/settings_reference.py``
(which generates ``docs/operations/configuration.md``). The product reads the environment in
one module, ``poimenconfig.py`` (``tests/test_wiring.py`` fails on a read anywhere
else in ``app/``, ``workers/``, ``bridge/`` or ``lease.py``), plus the framework
entry points ``celeryconfig.py``, ``app/gunicorn_conf.py`` and ``logconfig.py``; the dev
tooling (``poimen_dev/``) reads its own. Reads are found there with ``ast``:
``os.environ[...]``, ``os.environ.get/pop/setdefault(...)``, ``os.getenv(...)``,
``"X" in os.environ``, and the same on ``env`` (the ``Mapping`` parameter each
reader takes, ``os.environ`` by default). A read by a variable (``env.get(variable)``) is
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

from app import settings_reference
from tests.processes import ROOT

READERS = ("poimenconfig.py", "celeryconfig.py", "logconfig.py", "app/gunicorn_conf.py")
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
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if self.is_env(node.value):
            self.read(node.slice, node.lineno)
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        if any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) and any(
                self.is_env(c) for c in node.comparators):
            self.read(node.left, node.lineno)
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
    names = settings_reference.names()
    missing = sorted(f"{name} ({where})" for name, where in reads.items()
                     if not documented(name, names))
    assert not missing, ("read by the code but not in app/settings_reference.py: "
                         + ", ".join(missing))


# Documented, but read only by the test suite (tests/), which this scan does not cover.
READ_BY_TESTS_ONLY = {"POIMEN_TEST_AMQP_URL", "POIMEN_CONSOLE_SCREENSHOT"}


def test_every_variable_in_the_reference_is_still_read():
    reads = variables_read()
    stale = sorted(name for name in settings_reference.names() - READ_BY_TESTS_ONLY
                   if name != "KAFKA_*" and name not in reads)
    assert not stale, f"documented in app/settings_reference.py but read nowhere: {stale}"


def test_the_reference_lists_each_variable_once_with_its_processes():
    seen = [s.name for s in settings_reference.SETTINGS]
    assert len(seen) == len(set(seen)), sorted({n for n in seen if seen.count(n) > 1})
    known = set(settings_reference.PROCESS_NOTES)
    for setting in settings_reference.SETTINGS:
        assert setting.processes and set(setting.processes) <= known, setting
        assert setting.meaning.strip(), setting


@pytest.mark.processes
def test_docs_configuration_md_is_generated_from_the_reference():
    proc = subprocess.run([sys.executable, "-m", "app.settings_reference", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr + " (run `make docs` and commit docs/operations/configuration.md)"


def test_the_reference_states_the_defaults_poimenconfig_uses():
    import poimenconfig as config

    constants = {
        "POIMEN_SHUTDOWN_GRACE": config.DEFAULT_SHUTDOWN_GRACE,
        "POIMEN_BOOT_PROBE_INTERVAL": config.DEFAULT_PROBE_INTERVAL,
        "POIMEN_LEASE_CLIENT_SECONDS": config.DEFAULT_CLIENT_SECONDS,
        "POIMEN_LEASE_SERVER_SECONDS": config.DEFAULT_SERVER_SECONDS,
        "POIMEN_TAKEOVER_DELAY": config.DEFAULT_TAKEOVER_DELAY,
        "POIMEN_RECORD_RETRY_SECONDS": config.DEFAULT_RECORD_RETRY_SECONDS,
        "POIMEN_OUTBOX_TOPIC_PARTITIONS": config.DEFAULT_TOPIC_PARTITIONS,
    }
    documented = {s.name: s.default for s in settings_reference.SETTINGS}
    for name, value in constants.items():
        assert documented[name] == f"{value:g}", name
    assert documented["POIMEN_TOPIC_PREFIX"] == config.DEFAULT_TOPIC_PREFIX
    assert documented["POIMEN_QUEUE"] == config.DEFAULT_QUEUE
    assert documented["POIMEN_OUTBOX_RETENTION"] == f"{config.DEFAULT_OUTBOX_RETENTION / 86400:g}d"
