"""Code and its comments are present tense: no issue numbers in comments or docstrings.

A comment says what the code does and why; which issue asked for it is history, and
history is in git (figures are in ``bench/RESULTS.md``). This reads every ``.py`` and
``.sql`` file of the tree (the virtualenv, the services' data and other dot-directories
left out) and fails on an issue number in a Python comment or docstring or an SQL
``--`` comment. The mutation catalogue (``tests/mutations/mutants.py``) is left out:
its rules name the issues their mutants came with.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The word "issue" (or "issues", any case of its first letter) before a number, with or
# without "#"; or "#" and a number in parentheses, as a pull request is cited.
ISSUE = re.compile(r"\b[Ii]ssues? #?\d+\b|\(#\d+\)")

SKIPPED_DIRS = {"__pycache__", "node_modules", "build", "dist"}
SKIPPED_FILES = {Path("tests/mutations/mutants.py")}


def sources() -> list[Path]:
    """Every ``.py`` and ``.sql`` file of the tree, outside dot-directories and builds."""
    found = []
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT)
        if path.suffix not in (".py", ".sql") or not path.is_file() or rel in SKIPPED_FILES:
            continue
        parents = rel.parts[:-1]
        if any(p.startswith(".") or p in SKIPPED_DIRS or p.endswith(".egg-info") for p in parents):
            continue
        found.append(path)
    return found


def python_prose(text: str) -> list[tuple[int, str]]:
    """``(line, text)`` of each comment and docstring of a Python source."""
    prose = [(tok.start[0], tok.string)
             for tok in tokenize.generate_tokens(io.StringIO(text).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                prose.append((body[0].lineno, body[0].value.value))
    return prose


def sql_prose(text: str) -> list[tuple[int, str]]:
    """``(line, text)`` of each ``--`` comment of an SQL file."""
    return [(n, line[line.index("--"):]) for n, line in enumerate(text.splitlines(), 1)
            if "--" in line]


def issue_numbers(path: Path) -> list[str]:
    text = path.read_text()
    prose = python_prose(text) if path.suffix == ".py" else sql_prose(text)
    return [f"{path.relative_to(ROOT)}:{line}: {match.group(0)!r}"
            for line, chunk in prose for match in ISSUE.finditer(chunk)]


def test_the_pattern_finds_issue_numbers_and_nothing_else():
    found = python_prose('"""Repair per queue (issue 23, item 3)."""\n'
                         'x = 1  # see (#12)\n'
                         'def f():\n    """Issues 22 and 23."""\n'
                         'y = "issue 5"  # a value, not prose\n'
                         '# an issue with 3 parts; the 2 issues; #5 in a list; issue-tracker\n')
    assert sorted(m.group(0) for _, chunk in found for m in ISSUE.finditer(chunk)) \
        == ["(#12)", "Issues 22", "issue 23"]
    assert [m.group(0) for _, chunk in sql_prose("SELECT 1; -- (issue 26)\n-- the issue\n")
            for m in ISSUE.finditer(chunk)] == ["issue 26"]


def test_no_issue_number_in_a_comment_or_docstring():
    checked = sources()
    assert len(checked) > 100 and any(p.suffix == ".sql" for p in checked)  # the walk finds the tree
    found = [hit for path in checked for hit in issue_numbers(path)]
    assert not found, ("say what the code does and why, not which issue asked for it "
                       "(history is in git):\n" + "\n".join(found))
