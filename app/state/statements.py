"""The store's SQL, read from the named statements in ``app/state/sql/*.sql``.

Each file holds the statements of one module (``runs.sql`` for ``runs.py``, ...), each
introduced by a ``-- name: <name>`` line and the ``-- `` lines right after it (what the
statement decides), and ended by ``;``. What Postgres receives is the text between,
as written: no statement is assembled in Python. A module binds each of its statements
to the constant of the same name in capitals (``ADMIT = statement("admit")``).

A database function a migration installs is a block too, holding its whole
``CREATE OR REPLACE FUNCTION``: ``function(name)`` reads it (its body as installed, the
call the store executes).

Lines before a file's first ``-- name:``, and ``--`` lines after a statement's ``;``,
are comments for the reader. The files are parsed once, at import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import TextClause, text

DIRECTORY = Path(__file__).with_name("sql")
_NAME = re.compile(r"^-- name: (\w+)\s*$")
# A bind parameter of a statement (``:name``; not a ``::type`` cast).
PARAMETER = re.compile(r"(?<![:\w]):(\w+)")


@dataclass(frozen=True)
class Named:
    """One named statement: where it is written, what it decides, its SQL."""

    name: str
    path: Path
    line: int  # of its ``-- name:`` line, 1-based
    doc: str
    sql: str


def parse(path: Path) -> list[Named]:
    """The named statements of ``path``, in file order."""
    found: list[Named] = []
    lines = path.read_text().split("\n")
    starts = [i for i, line in enumerate(lines) if _NAME.match(line)]
    for k, start in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else len(lines)
        block = lines[start + 1:end]
        doc = []
        while block and (block[0] == "--" or block[0].startswith("-- ")):
            doc.append(block.pop(0)[3:])
        # What follows the statement's ``;``: blank lines and comments for the reader.
        while block and (not block[-1].strip() or block[-1].startswith("--")):
            block.pop()
        named = _NAME.match(lines[start])
        assert named is not None  # ``starts`` are the lines it matches
        name = named[1]
        where = f"{path.name}:{start + 1} ({name})"
        if not block or not block[-1].endswith(";"):
            raise ValueError(f"{where}: a statement ends with ';'")
        sql = "\n".join(block)[:-1]
        if not sql.strip():
            raise ValueError(f"{where}: no statement")
        found.append(Named(name, path, start + 1, "\n".join(doc), sql))
    return found


def load(directory: Path = DIRECTORY) -> dict[str, Named]:
    """Every named statement under ``directory``, by name (a name is unique across files)."""
    named: dict[str, Named] = {}
    for path in sorted(directory.glob("*.sql")):
        for one in parse(path):
            if one.name in named:
                raise ValueError(f"{path.name}:{one.line}: {one.name} is also named in "
                                 f"{named[one.name].path.name}:{named[one.name].line}")
            named[one.name] = one
    return named


STATEMENTS = load()


def sql(name: str) -> str:
    """The SQL of statement ``name``, as Postgres receives it."""
    return STATEMENTS[name].sql


def statement(name: str) -> TextClause:
    """Statement ``name`` for ``Session.execute`` (its ``:name`` parameters bound)."""
    return text(sql(name))


@dataclass(frozen=True)
class Function:
    """A database function a migration installs from its named block.

    ``create``: the ``CREATE OR REPLACE FUNCTION`` (what the migration runs); ``body``:
    its source as Postgres keeps it (``pg_proc.prosrc``); ``arguments``: its argument
    names in order; ``call``: ``SELECT * FROM name(:a, :b, ...)``, the statement the
    store executes, whose parameters are the arguments without their ``p_`` prefix.
    """

    name: str
    create: str
    body: str
    arguments: tuple[str, ...]
    call: TextClause

    @property
    def query(self) -> TextClause:
        """A slot function's ``RETURN QUERY`` as a statement of its own (its arguments
        ``p_x`` and variables ``v_x`` as parameters ``:x``): what runs after the locks, for
        reading its plan."""
        start = self.body.index("RETURN QUERY ") + len("RETURN QUERY ")
        query = self.body[start:self.body.rindex(";\nEND")]
        return text(re.sub(r"\b[pv]_(\w+)\b", r":\1", query))


_CREATE = re.compile(r"^CREATE OR REPLACE FUNCTION (\w+)\((.*?)\) RETURNS .*? AS \$body\$",
                     re.DOTALL)


def function(name: str) -> Function:
    """The function block ``name`` (the function's own name)."""
    create = sql(name)
    match = _CREATE.match(create)
    if match is None or match[1] != name or not create.endswith("$body$"):
        raise ValueError(f"{name}: not a CREATE OR REPLACE FUNCTION {name}(...) "
                         "... AS $body$...$body$ block")
    body = create[match.end():-len("$body$")]
    arguments = tuple(arg.split()[0] for arg in match[2].split(",") if arg.strip())
    parameters = ", ".join(":" + a.removeprefix("p_") for a in arguments)
    return Function(name, create, body, arguments,
                    text(f"SELECT * FROM {name}({parameters})"))
