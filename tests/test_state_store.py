"""The run-state store (``app/state/``) is the one writer of run state, its SQL in named
statements (``app/state/sql/*.sql``).

No database and no process: these belong to the fast lane.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = [p for top in ("app", "workers", "bridge") for p in (ROOT / top).rglob("*.py")] + [
    ROOT / name for name in ("celeryconfig.py", "lease.py", "logconfig.py",
                             "poimenconfig.py")]
STATE_TABLES = ("runs", "step_entries", "step_markers", "step_children", "outbox", "worker_boots",
                "rate_slots")
WRITE = re.compile(r"\b(INSERT\s+INTO|UPDATE|DELETE\s+FROM)\s+(" + "|".join(STATE_TABLES) + r")\b")
ORM_WRITE = re.compile(r"\b(update|delete|insert)\((Run|StepEntry|StepMarker|StepChild|OutboxEvent|"
                       r"WorkerBoot)\b|session\.(add|delete|merge)\((Run|OutboxEvent)\b")


MODULES = ("runs", "claims", "ledger", "boots", "outbox")


def _bound() -> dict[str, str]:
    """Statement name -> the module constant that binds it (``app.state.<file>.<NAME>``)."""
    import importlib

    from app.state import statements

    bound = {}
    for module_name in MODULES:
        module = importlib.import_module(f"app.state.{module_name}")
        for attr, value in vars(module).items():
            if not attr.isupper():
                continue
            for one in value if isinstance(value, tuple) else (value,):
                sql = getattr(one, "text", getattr(one, "create", one))
                for named in statements.STATEMENTS.values():
                    if named.path.stem == module_name and sql == named.sql:
                        bound.setdefault(named.name, f"{module_name}.{attr}")
    return bound


def test_every_statement_is_named_in_its_modules_file():
    """A transition's whole SQL is the block of its name in ``app/state/sql/<module>.sql``,
    bound to the module's constant of the same name in capitals."""
    from app.state import statements

    bound = _bound()
    for name, named in statements.STATEMENTS.items():
        assert named.path.stem in MODULES, f"{named.path.name}: no module app/state/{named.path.stem}.py"
        assert name in bound, f"{named.path.name}:{named.line}: {name} is bound to no constant"
        module, attr = bound[name].split(".")
        assert module == named.path.stem and attr == name.upper() \
            or named.sql.startswith("CREATE OR REPLACE FUNCTION"), (name, bound[name])
        assert named.doc, f"{named.path.name}:{named.line}: {name} says not what it decides"
    for transition in ("admit", "admit_many", "holders", "claim_queued", "poimen_take_over", "adopt",
                       "poimen_release", "poimen_retry", "poimen_finish", "poimen_wait",
                       "poimen_cancel", "poimen_ended", "dead_boot_runs", "enter", "claim_marker", "complete_marker",
                       "close_entry", "register_boot", "insert_event", "poimen_claim_slot",
                       "poimen_slot_verdict", "poimen_lock_slots", "wake_waiting",
                       "poimen_outbox_mark_published", "poimen_outbox_prune"):
        assert transition in statements.STATEMENTS, transition


def test_the_loader_reads_a_statement_as_written_and_refuses_a_malformed_file(tmp_path):
    from app.state import statements

    (tmp_path / "a.sql").write_text(
        "-- header, for the reader\n\n-- name: one\n-- decides one thing\n--\n-- and why\n"
        "SELECT 1\n  FROM t;\n\n-- -- a section ----\n\n-- name: two\n-- two\nSELECT 2;\n")
    loaded = statements.load(tmp_path)
    assert list(loaded) == ["one", "two"]
    assert loaded["one"].sql == "SELECT 1\n  FROM t"
    assert loaded["one"].doc == "decides one thing\n\nand why"
    assert loaded["two"].line == 12
    (tmp_path / "b.sql").write_text("-- name: one\n-- again\nSELECT 3;\n")
    with pytest.raises(ValueError, match="also named in a.sql:3"):
        statements.load(tmp_path)
    (tmp_path / "b.sql").write_text("-- name: three\n-- unended\nSELECT 3\n")
    with pytest.raises(ValueError, match="ends with ';'"):
        statements.load(tmp_path)


def test_every_parameter_is_bound():
    """Each ``:name`` of a statement is a bind parameter of it (none hides in a literal or a
    cast), and a psycopg statement (``%s``) has no ``:name``."""
    from app.state import statements

    for name, named in statements.STATEMENTS.items():
        found = set(statements.PARAMETER.findall(named.sql))
        bound = set(statements.statement(name).compile().params)
        if "%s" in named.sql:
            assert not found, name
        else:
            assert found == bound, (name, found ^ bound)


def test_no_sql_is_assembled_in_the_stores_python():
    """The store's modules bind statements by name; none writes SQL of its own."""
    state = ROOT / "app" / "state"
    offenders = []
    for path in state.glob("*.py"):
        if path.name == "statements.py":  # builds a function's call from its block
            continue
        for lineno, value in _strings(path):
            if WRITE.search(value) or re.search(r"\bSELECT\b[\s\S]*\bFROM\b", value):
                offenders.append(f"{path.relative_to(ROOT)}:{lineno}")
    assert not offenders, "SQL outside app/state/sql/:\n" + "\n".join(offenders)


def test_the_statements_use_the_one_definition_of_a_live_boot():
    """A boot's liveness is ``app/liveness.py``'s. The live boots are one view; each other
    place a statement tests a boot's lock or its bound is the definition, word for word."""
    from app import liveness
    from app.state import statements

    def words(sql: str) -> str:
        return " ".join(sql.split())

    text = words("\n".join(n.sql for n in statements.STATEMENTS.values()))
    # The live boots: one view, the only reader of pg_locks, which app/liveness.py names.
    view = statements.sql("live_boots")
    assert view.startswith(f"CREATE OR REPLACE VIEW {liveness.LIVE_BOOTS_VIEW} AS")
    assert f"CAST({liveness.LOCK_NAMESPACE} AS oid)" in view
    assert text.count("pg_locks") == view.count("pg_locks") == 1
    assert liveness.LIVE_BOOTS_VIEW in liveness.LIVE_BOOTS_SQL
    checks = {
        "WHERE b.boot_id = :boot AND NOT pg_try_advisory_xact_lock_shared": words(
            liveness.claimer_live_sql(":boot")),
        "WHERE b.boot_id = p_boot AND NOT pg_try_advisory_xact_lock_shared": words(
            liveness.claimer_live_sql("p_boot")),
        "WHERE b.boot_id = :claimer AND NOT pg_try_advisory_xact_lock_shared": words(
            liveness.claimer_live_sql(":claimer")),
        "g.boot_id = p_dead AND g.first_seen_dead_at <=": words(liveness.gone_sql("p_dead")),
        "g.boot_id = runs.claimed_by AND g.first_seen_dead_at <=": words(
            liveness.gone_sql("runs.claimed_by")),
        "g.boot_id = r.claimed_by AND g.first_seen_dead_at <=": words(
            liveness.held_by_sql("r.claimed_by")),
        "extract(epoch FROM g.": words(liveness.gone_in_sql("g")),
        "extract(epoch FROM b.": words(liveness.gone_in_sql("b")),
    }
    for marker, definition in checks.items():
        assert text.count(marker) > 0, marker
        assert text.count(marker) == text.count(definition), (marker, definition)
    namespace = re.findall(r"pg_try_advisory_xact_lock_shared\((\d+)", text)
    assert namespace and set(namespace) == {str(liveness.LOCK_NAMESPACE)}


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


def test_a_result_is_built_as_its_init_would_make_it_and_stays_frozen():
    import dataclasses
    from types import SimpleNamespace

    from app.state.executor import build
    from app.state.runs import AdmittedRun

    names = [f.name for f in dataclasses.fields(AdmittedRun)]
    row = SimpleNamespace(**{name: f"v-{name}" for name in names}, extra="not read")
    built = build(AdmittedRun, row)
    made = AdmittedRun(*(f"v-{name}" for name in names))
    assert built == made and repr(built) == repr(made) and hash(built) == hash(made)
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.status = "changed"  # type: ignore[misc]

    @dataclasses.dataclass(frozen=True)
    class Checked:
        value: int

        def __post_init__(self) -> None:
            assert self.value > 0

    with pytest.raises(TypeError, match="__post_init__"):
        build(Checked, SimpleNamespace(value=1))
