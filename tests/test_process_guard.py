"""The ``processes`` mark is complete: ``make check`` stays fast only while it is.

The guard (``tests/process_guard.py``) is run here on a small test module in a
pytest session of its own (pytester, in this interpreter): an unmarked test that
starts a process fails naming the command; a marked one, or one using a process
fixture, passes and is what ``-m "not processes"`` leaves out. Each test is in the
lane (``unit``, ``db``, ``system``) its fixtures and marks say.
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


def test_on_a_service(base_env):
    assert base_env
"""

CONFTEST = """
import pytest


@pytest.fixture
def processes():
    yield []


@pytest.fixture
def base_env():
    return {"DATABASE_URL": "postgresql://"}
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
    result.assert_outcomes(passed=4, failed=2, errors=1)
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
    result.assert_outcomes(passed=2, failed=2, errors=1, deselected=2)


def test_each_test_is_in_the_lane_its_fixtures_say(pytester):
    lanes = {}
    for lane in ("unit", "db", "system"):
        result = run(pytester, "-m", lane, "--collect-only", "-q")
        lanes[lane] = sorted(line.split("::")[1] for line in result.outlines if "::" in line)
    assert lanes == {
        "unit": ["test_in_process", "test_unmarked_fixture_that_starts_one",
                 "test_unmarked_subprocess", "test_unmarked_system"],
        "db": ["test_on_a_service"],
        "system": ["test_marked", "test_through_a_process_fixture"],
    }


def test_every_process_fixture_the_guard_names_exists():
    """A renamed fixture would silently drop its tests' mark (and slow the lane)."""
    source = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("*.py"))
    for name in PROCESS_FIXTURES | INFRASTRUCTURE:
        assert re.search(rf"@pytest\.fixture[^\n]*\n(?:@[^\n]*\n)*def {name}\(", source), name


def test_make_check_is_the_lane_over_the_services_and_make_test_the_whole_suite():
    from tests.lanes import LANES, passes

    makefile = (ROOT / "Makefile").read_text()
    check = re.search(r"^check:([^\n]*)\n((?:\t[^\n]*\n)+)", makefile, re.M)
    test = re.search(r"^test:([^\n]*)\n((?:\t[^\n]*\n)+)", makefile, re.M)
    assert check and "services" in check.group(1).split()
    assert "-m tests.lanes unit db --" in check.group(2), "make check: the unit and db lanes"
    assert test and "services" in test.group(1).split()
    assert "-m tests.lanes --" in test.group(2), "make test runs every lane"
    assert not re.search(r"pytest[^\n]*\s-m\s", test.group(2)), "make test selects no marks"
    # The passes select every lane whole: system's three passes split it by `apart` and
    # `alone`. Unit and db start at once, the `apart` tests after unit; the parallel pass
    # after unit and db; the `alone` tests after every other pass.
    assert [(p.marks, p.after) for p in passes(list(LANES))] == [
        ("unit", ()), ("db", ()), ("system and apart", ("unit",)),
        ("system and not alone and not apart", ("unit", "db")),
        ("system and alone", ("unit", "db", "system apart", "system"))]
    assert all("system" not in p.marks for p in passes(["unit", "db"]))
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_the_system_pass_starts_the_longest_modules_first():
    from tests.durations import order
    from tests.lanes import passes

    assert order(["a.py", "b.py", "new.py", "c.py"], {"a.py": 5, "b.py": 50, "c.py": 5}) == [
        "new.py", "b.py", "a.py", "c.py"]  # unknown first, then longest, ties as given
    (parallel,) = [p for p in passes(["system"]) if p.longest_first]
    assert parallel.marks == "system and not alone and not apart" and parallel.dist == "loadfile"
    unit, db = passes(["unit", "db"])
    assert unit.after == db.after == ()


def test_a_junit_report_gives_each_modules_seconds(tmp_path):
    from tests.durations import of_junit

    report = tmp_path / "r.xml"
    report.write_text(
        '<testsuites><testsuite>'
        '<testcase classname="tests.test_lease" name="a" time="1.5"/>'
        '<testcase classname="tests.test_lease" name="b" time="2.0"/>'
        '<testcase classname="tests.app.test_runs.TestX" name="c" time="4"/>'
        '</testsuite></testsuites>')
    assert of_junit(report) == {"tests/test_lease.py": 3.5, "tests/app/test_runs.py": 4.0}


def test_a_pass_starts_once_the_selected_passes_it_waits_for_have_ended(monkeypatch, tmp_path):
    import threading
    import time

    from tests import lanes

    log: list[tuple[str, str]] = []
    guard = threading.Lock()

    def run(step, extra, report, out=None):
        with guard:
            log.append(("start", step.lane))
        time.sleep({"slow": 0.3, "quick": 0.05}.get(step.lane, 0.01))
        with guard:
            log.append(("end", step.lane))
        return 0, 1, 0.0, "1 passed in 0.01s"

    monkeypatch.setattr(lanes, "run", run)
    steps = [lanes.Pass("quick", "a"), lanes.Pass("slow", "b"),
             lanes.Pass("next", "c", after=("quick", "unselected")),
             lanes.Pass("last", "d", after=("slow", "next"))]
    results = lanes.run_all(steps, [], tmp_path)
    assert [r[0].lane for r in results] == ["quick", "slow", "next", "last"]
    assert log.index(("start", "next")) > log.index(("end", "quick"))
    assert log.index(("start", "next")) < log.index(("end", "slow")), "next waited for slow"
    assert log.index(("start", "last")) > log.index(("end", "slow"))
    assert log.index(("start", "last")) > log.index(("end", "next"))


def test_a_pass_runs_with_bytecode_caches_whatever_the_shell_says(monkeypatch, tmp_path):
    import io

    from tests import lanes

    seen = {}

    class Popen:
        def __init__(self, argv, env, **kwargs):
            seen.update(env)
            self.stdout = io.StringIO("1 passed in 0.01s\n")

        def wait(self):
            return 0

    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setattr(lanes.subprocess, "Popen", Popen)
    status, tests, _, _ = lanes.run(lanes.Pass("unit", "unit"), [], tmp_path / "r.xml",
                                    io.StringIO())
    assert (status, tests) == (0, 1)
    assert "PYTHONDONTWRITEBYTECODE" not in seen
