"""The run-state store (``app/state/``) is the one writer of run state, readable as SQL.

No database and no process: these belong to the fast lane.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = [p for top in ("app", "workers", "bridge") for p in (ROOT / top).rglob("*.py")] + [
    ROOT / name for name in ("celeryconfig.py", "lease.py", "logconfig.py",
                             "poimenconfig.py")]
STATE_TABLES = ("runs", "step_entries", "step_markers", "step_children", "outbox", "worker_boots")
WRITE = re.compile(r"\b(INSERT\s+INTO|UPDATE|DELETE\s+FROM)\s+(" + "|".join(STATE_TABLES) + r")\b")
ORM_WRITE = re.compile(r"\b(update|delete|insert)\((Run|StepEntry|StepMarker|StepChild|OutboxEvent|"
                       r"WorkerBoot)\b|session\.(add|delete|merge)\((Run|OutboxEvent)\b")


def test_rendered_sql_is_the_statements_postgres_receives():
    from app.state import rendered

    assert rendered.PATH.read_text() == rendered.render(), (
        "app/state/rendered.sql drifted from the code: run `python -m app.state.rendered` "
        "and review the diff")


def test_every_statement_is_named_in_the_rendered_file():
    from app.state import rendered

    names = [where for where, _ in rendered.statements()]
    for transition in ("ADMIT", "ADMIT_MANY", "HOLDERS", "CLAIM_QUEUED", "TAKE_OVER", "ADOPT", "RELEASE", "RETRY", "FINISH",
                       "WAIT", "CANCEL", "DEAD_BOOT_RUNS", "ENTER", "CLAIM_MARKER",
                       "COMPLETE_MARKER", "CLOSE_ENTRY", "REGISTER_BOOT", "INSERT_EVENT",
                       "CLAIM_SLOT", "TAKE_OVER_SLOT", "LOCK_SLOTS", "WAKE_WAITING"):
        assert any(name.endswith(f": {transition}") for name in names), transition


def _strings(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.append((node.lineno, node.value))
        elif isinstance(node, ast.JoinedStr):
            out.append((node.lineno, "".join(
                v.value if isinstance(v, ast.Constant) else " x " for v in node.values)))
    return out


def test_no_module_outside_the_store_writes_run_state():
    state = ROOT / "app" / "state"
    offenders = []
    for path in PRODUCT:
        if state in path.parents:
            continue
        for lineno, value in _strings(path):
            if WRITE.search(value):
                offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {WRITE.search(value)[0]}")
        source = path.read_text()
        for match in ORM_WRITE.finditer(source):
            offenders.append(f"{path.relative_to(ROOT)}: {match[0]}")
    assert not offenders, "run state written outside app/state/:\n" + "\n".join(offenders)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, name: str, known: set[str], *, top_level_only: bool = False
             ) -> set[str]:
    """The product modules ``name`` imports: anywhere in it (a function's import is still a
    dependency), or only at import time; never under ``if TYPE_CHECKING``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    typing_only = {id(inner) for node in ast.walk(tree)
                   if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for inner in ast.walk(node)}
    inside = {id(inner) for node in ast.walk(tree)
              if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
              for inner in ast.walk(node)} if top_level_only else set()
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only or id(node) in inside:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    resolved = set()
    for module in found:
        while module and module not in known:
            module = module.rpartition(".")[0]
        if module and module != name:
            resolved.add(module)
    return resolved


def test_no_import_cycle_among_app_workers_bridge():
    """Not even through an import inside a function: two modules that need each other are
    one module, or a third one is missing."""
    paths = {_module_name(p): p for p in PRODUCT if p.suffix == ".py"}
    known = set(paths)
    graph = {name: _imports(path, name, known) for name, path in paths.items()}
    # Importing a.b imports a first: a package's own modules do not count as a cycle with it.
    cycles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if node.startswith(dep + ".") or dep.startswith(node + "."):
                continue
            if state.get(dep) == 1:
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                walk(dep)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_store_is_a_leaf():
    """app/state imports only the models, liveness and events (and itself)."""
    allowed = {"app.models", "app.liveness", "app.events", "app.extensions", "app"}
    paths = {_module_name(p): p for p in PRODUCT}
    known = set(paths)
    for name, path in paths.items():
        if not name.startswith("app.state"):
            continue
        for dep in _imports(path, name, known, top_level_only=True):
            assert dep.startswith("app.state") or dep in allowed, f"{name} imports {dep}"
