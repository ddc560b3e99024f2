"""The store's statements, read from app/state/sql/, are the ones the composed Python sent.

A one-off witness of the move from composed SQL to named statements: the reference
(``tests/state_reference.json``) was written by the composing code before the move.
No database and no process.
"""

from __future__ import annotations

import importlib
import json
import re
import textwrap
from pathlib import Path

REFERENCE = json.loads((Path(__file__).with_name("state_reference.json")).read_text())


def _normalised(sql: str) -> str:
    """What ``app/state/rendered.py`` made of a statement: dedented, trailing spaces and
    repeated blank lines dropped."""
    lines = [line.rstrip() for line in textwrap.dedent(sql.strip("\n")).splitlines()]
    out: list[str] = []
    for line in lines:
        if line or (out and out[-1]):
            out.append(line)
    return "\n".join(out).strip()


# The statements a slot function runs after its locks: read from the function's body
# (``Function.query``), whose first line lost its indentation to the composing code's
# strip(); Postgres receives the body, compared whole below.
IN_FUNCTIONS = {"CLAIM_SLOT", "FINISH", "FINISH_INSERTED", "FINISH_CLOSED"}


def test_every_statement_is_the_one_postgres_received():
    for name, ref in REFERENCE["statements"].items():
        module = importlib.import_module("app.state." + Path(ref["module"]).stem)
        value = getattr(module, name)
        sql = getattr(value, "text", value)
        if name in IN_FUNCTIONS:
            assert sql.split() == ref["sql"].split(), name
        else:
            assert _normalised(sql) == ref["sql"], name


def _words(sql: str) -> str:
    return re.sub(r"\s*([(),])\s*", r"\1", " ".join(sql.split()))


def test_every_function_is_the_one_migrations_installed():
    from app.state.claims import SLOT_FUNCTIONS
    from app.state.outbox import RELAY_FUNCTION_BODIES, RELAY_FUNCTIONS

    assert [f.name for f in SLOT_FUNCTIONS] == list(REFERENCE["functions"])
    for function in SLOT_FUNCTIONS:
        ref = REFERENCE["functions"][function.name]
        assert function.body == ref["body"], function.name
        # The CREATE's own words may be laid out on lines; its body is kept byte for byte.
        assert _words(function.create) == _words(ref["create"]), function.name
        assert function.call.text == ref["call"], function.name
    assert list(RELAY_FUNCTIONS) == REFERENCE["relay"]["functions"]
    assert RELAY_FUNCTION_BODIES == REFERENCE["relay"]["bodies"]
