"""The ``processes`` mark is complete: ``make check`` stays fast only while it is.

The guard (``tests/process_guard.py``) is run here on a small test module in a
pytest session of its own (pytester, in this interpreter): an unmarked test that
starts a process fails naming the command; a marked one, or one using a process
fixture, passes and is what ``-m "not processes"`` leaves out.
"""

from __future__ import annotations

import re

from tests.process_guard import INFRASTRUCTURE, PROCESS_FIXTURES
from tests.processes import ROOT

MODULE = """
import os
import subprocess

import pytest


def test_unmarked_subprocess():
    subprocess.run(["true"], check=True)


def test_unmarked_system():
    assert os.system("true") == 0


@pytest.fixture
def starts_one():
    subprocess.run(["true"], check=True)


def test_unmarked_fixture_that_starts_one(starts_one):
    pass


@pytest.mark.processes
def test_marked():
    subprocess.run(["true"], check=True)


def test_through_a_process_fixture(processes):
    subprocess.run(["true"], check=True)


def test_in_process():
    assert sum(range(4)) == 6
"""

CONFTEST = """
import pytest


@pytest.fixture
def processes():
    yield []
"""

INI = """
[pytest]
addopts = --strict-markers -p no:cacheprovider
markers =
    slow: several processes
    processes: starts processes
"""


def run(pytester, *args: str):
    pytester.makeini(INI)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_module=MODULE)
    return pytester.runpytest_inprocess("-p", "tests.process_guard", *args)


def test_an_unmarked_test_that_starts_a_process_fails_naming_the_command(pytester):
    result = run(pytester)
    result.assert_outcomes(passed=3, failed=2, errors=1)
    result.stdout.fnmatch_lines([
        "*test_unmarked_subprocess started a process in its call without the `processes` "
        "mark (subprocess.Popen true)*",
        "*test_unmarked_system started a process in its call without the `processes` "
        "mark (os.system b'true')*",
    ], consecutive=False)
    result.stdout.fnmatch_lines(["*test_unmarked_fixture_that_starts_one started a process in "
                                 "its setup*"])


def test_the_lane_leaves_out_exactly_the_marked_tests(pytester):
    result = run(pytester, "-m", "not processes")
    result.assert_outcomes(passed=1, failed=2, errors=1, deselected=2)


def test_every_process_fixture_the_guard_names_exists():
    """A renamed fixture would silently drop its tests' mark (and slow the lane)."""
    source = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("*.py"))
    for name in PROCESS_FIXTURES | INFRASTRUCTURE:
        assert re.search(rf"@pytest\.fixture[^\n]*\n(?:@[^\n]*\n)*def {name}\(", source), name


def test_make_check_is_the_lane_over_the_services_and_make_test_the_whole_suite():
    makefile = (ROOT / "Makefile").read_text()
    check = re.search(r"^check:([^\n]*)\n((?:\t[^\n]*\n)+)", makefile, re.M)
    test = re.search(r"^test:([^\n]*)\n((?:\t[^\n]*\n)+)", makefile, re.M)
    assert check and "services" in check.group(1).split()
    assert '-m "not processes"' in check.group(2) and "pytest" in check.group(2)
    assert test and "services" in test.group(1).split()
    assert not re.search(r"pytest[^\n]*\s-m\s", test.group(2)), "make test selects no marks"
    assert "make test" in (ROOT / ".ci" / "run").read_text()
