"""Every mutant of the catalogue still applies: its ``find`` occurs as often as it says.

The gate (``python -m tests.mutations``) reports a stale mutant only when it runs; this
finds one in the fast lane, the moment a rule's code (often a statement in
``app/state/sql/``) moves without its mutant. No database and no process.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.mutations.__main__ import ROOT, apply
from tests.mutations.mutants import MUTANTS


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_the_mutant_applies(mutant, tmp_path):
    for rel, *_ in mutant.edits():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    assert apply(mutant, tmp_path) is None
    changed = [rel for rel, *_ in mutant.edits()
               if (tmp_path / rel).read_text() != (ROOT / rel).read_text()]
    assert changed, f"{mutant.name} changes nothing"


def test_names_are_unique():
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names))
    assert all(Path(ROOT / m.path).is_file() for m in MUTANTS)
